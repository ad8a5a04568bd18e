"""Shared by the test_reconcile_* modules: one SparkSession for the whole test session (local[2])."""

from __future__ import annotations

import pytest

from qtp.reconcile import spark_session

SPARK_CONF = {
    "spark.sql.shuffle.partitions": "4",
    "spark.default.parallelism": "2",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.driver.memory": "1g",
}


@pytest.fixture(scope="session")
def spark():
    session = spark_session("local[2]", SPARK_CONF)
    yield session
    session.stop()
