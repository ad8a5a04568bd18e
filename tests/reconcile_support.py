"""Shared by the test_reconcile_* modules: one SparkSession for the whole test session (local[2])."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

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


def run_sql(url: str, *statements: str) -> None:
    """Run plain SQL statements in one transaction on the database at ``url``."""
    with sa.create_engine(url).begin() as conn:
        for statement in statements:
            conn.exec_driver_sql(statement)
