"""JDBC URLs, driver jars and partitioned-read options, derived from SQLAlchemy URLs (no Spark needed)."""

from __future__ import annotations

import pytest
from sqlalchemy.engine import make_url

from qtp.errors import ConfigurationError
from qtp.reconcile._sources import (
    Bounds,
    ProbedTable,
    TableSpec,
    find_jdbc_jars,
    hash_predicates,
    jdbc_properties,
    jdbc_url,
    quote_table,
    read_options,
)


@pytest.mark.parametrize(
    "url, expected",
    [
        ("postgresql://u:pw@db1:6543/app", "jdbc:postgresql://db1:6543/app"),
        ("postgresql+psycopg2://postgres@127.0.0.1/app", "jdbc:postgresql://127.0.0.1:5432/app"),
        ("mysql+pymysql://root@127.0.0.1:3307/app",
         "jdbc:mysql://127.0.0.1:3307/app?sessionVariables=net_write_timeout=3600"),
        ("mariadb+pymysql://root@h/app", "jdbc:mysql://h:3306/app?sessionVariables=net_write_timeout=3600"),
    ],
)
def test_jdbc_url_is_derived_from_the_sqlalchemy_url(url, expected):
    assert jdbc_url(make_url(url)) == expected


def test_credentials_and_driver_go_into_the_properties():
    props = jdbc_properties(make_url("postgresql://alice:s3cret@h/app"), fetchsize=500)
    assert props == {"driver": "org.postgresql.Driver", "fetchsize": "500", "user": "alice", "password": "s3cret"}
    assert jdbc_properties(make_url("mysql+pymysql://root@h/app"), 7)["driver"] == "org.mariadb.jdbc.Driver"


def test_an_unsupported_database_is_refused_by_name():
    with pytest.raises(ConfigurationError, match="unsupported database in sqlite"):
        jdbc_url(make_url("sqlite:///x.db"))


def test_a_missing_driver_jar_names_the_debian_package(tmp_path, monkeypatch):
    monkeypatch.delenv("QTP_JDBC_JARS_DIR", raising=False)
    with pytest.raises(ConfigurationError, match="libmariadb-java"):
        find_jdbc_jars({"mysql"}, dirs=(str(tmp_path),))
    (tmp_path / "postgresql-42.0.0.jar").write_bytes(b"")
    assert find_jdbc_jars({"postgresql"}, dirs=(str(tmp_path),)) == [str(tmp_path / "postgresql-42.0.0.jar")]


def test_the_installed_jars_are_found():
    jars = find_jdbc_jars({"postgresql", "mysql"})
    assert len(jars) == 2 and all(jar.endswith(".jar") for jar in jars)


def test_tables_are_quoted_per_backend():
    assert quote_table("public.msgs", "postgresql") == '"public"."msgs"'
    assert quote_table("app.m`x", "mysql") == "`app`.`m``x`"


def _probed(url, bounds, integer=True):
    return ProbedTable(TableSpec(url, "msgs", "id", ("a",)), "postgresql" if url.startswith("postgres") else "mysql",
                       url, bounds, integer)


def test_integer_keys_are_read_in_ranges_between_min_and_max():
    options = read_options(_probed("postgresql://p@h/app", Bounds(10, 1009)), partitions=4, fetchsize=1000)
    assert {k: options[k] for k in ("partitionColumn", "lowerBound", "upperBound", "numPartitions", "fetchsize")} == {
        "partitionColumn": "id", "lowerBound": "10", "upperBound": "1010", "numPartitions": "4", "fetchsize": "1000",
    }
    assert "partitionColumn" not in read_options(_probed("postgresql://p@h/app", None), 4, 1000)


def test_other_keys_are_split_by_a_database_hash():
    pg = hash_predicates(_probed("postgresql://p@h/app", None, integer=False), 3)
    assert pg[:3] == [f'((hashtext("id"::text) & 2147483647) % 3) = {i}' for i in range(3)]
    assert pg[3] == '"id" IS NULL'
    assert hash_predicates(_probed("mysql+pymysql://r@h/app", None, integer=False), 2)[1] == "(crc32(`id`) % 2) = 1"
