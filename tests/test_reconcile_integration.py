"""The whole job against real PostgreSQL and MariaDB tables: every class injected and found exactly."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa
from reconcile_support import run_sql, spark  # noqa: F401  (session fixture)

import qtp.reconcile
from qtp import cli
from qtp.embedded import free_port
from qtp.errors import ConfigurationError
from qtp.reconcile import TableSpec, reconcile
from qtp.reconcile._sources import find_jdbc_jars

# long tests (a quick run leaves them out: -m 'not slow')
pytestmark = pytest.mark.slow

KEYS = range(1, 301)
LOST = {3, 50, 77}
DUPLICATED = {10: 2, 11: 2, 12: 3}
UNEXPECTED = {1001, 1002}
MISMATCHED = {20: "amount", 21: "note", 22: "both"}
APPLIED_BUT_ABORTED = {30, 31}
ABORTED_ABSENT = {32}
IN_DOUBT_APPLIED, IN_DOUBT_ABSENT = {40}, {41}


def _status(key: int) -> str:
    if key in APPLIED_BUT_ABORTED | ABORTED_ABSENT:
        return "aborted"
    if key in IN_DOUBT_APPLIED | IN_DOUBT_ABSENT:
        return "in_doubt"
    return "committed"


def _server_rows():
    for key in KEYS:
        if key in LOST | ABORTED_ABSENT | IN_DOUBT_ABSENT:
            continue
        amount, note = key * 1.25, f"msg {key}"
        if MISMATCHED.get(key) in ("amount", "both"):
            amount += 1
        if MISMATCHED.get(key) in ("note", "both"):
            note += "!"
        for _ in range(DUPLICATED.get(key, 1)):
            yield {"msg_id": key, "amt": amount, "note": note}
    for key in sorted(UNEXPECTED):
        yield {"msg_id": key, "amt": 1, "note": "never sent"}


@pytest.fixture
def anomalous_tables(pg_db, maria_db):
    """Client outbox in PostgreSQL with a status column; server table in MariaDB with other column names."""
    client_url, server_url = pg_db("client"), maria_db("server")
    with sa.create_engine(client_url).begin() as conn:
        conn.exec_driver_sql(
            "CREATE TABLE outbox (id bigint PRIMARY KEY, amount numeric(12,2), note text, status text NOT NULL)")
        conn.execute(sa.text("INSERT INTO outbox VALUES (:id, :amount, :note, :status)"),
                     [{"id": k, "amount": k * 1.25, "note": f"msg {k}", "status": _status(k)} for k in KEYS])
    with sa.create_engine(server_url).begin() as conn:
        conn.exec_driver_sql(
            "CREATE TABLE applied (rid int AUTO_INCREMENT PRIMARY KEY, msg_id bigint NOT NULL, "
            "amt decimal(12,2), note varchar(100))")
        conn.execute(sa.text("INSERT INTO applied (msg_id, amt, note) VALUES (:msg_id, :amt, :note)"),
                     list(_server_rows()))
    return client_url, server_url


def _cli(*args: str) -> int:
    return cli.main(["reconcile", "--master", "local[2]", "--quiet", *args])


def test_every_injected_anomaly_is_found_exactly(anomalous_tables, spark, tmp_path, capsys):
    client_url, server_url = anomalous_tables
    report, page, parquet = tmp_path / "r.json", tmp_path / "r.html", tmp_path / "anomalies.parquet"
    code = _cli(
        "--client-url", client_url, "--client-table", "outbox", "--server-url", server_url,
        "--server-table", "applied", "--key", "id=msg_id", "--columns", "amount=amt,note",
        "--client-status-column", "status", "--json", str(report), "--html", str(page),
        "--anomalies-parquet", str(parquet), "--anomalies-table", "anomalies", "--samples", "2",
    )
    assert code == 1
    data = json.loads(report.read_text())
    assert data["verdict"] == "violated"
    assert data["counts"] == {
        "ok": 287, "lost": 3, "duplicated": 3, "unexpected": 2, "mismatched": 3, "applied_but_aborted": 2,
        "in_doubt": 2, "compensated": 0, "committed_but_compensated": 0,
    }
    assert data["duplicate_histogram"] == {"2": 2, "3": 1}
    assert data["mismatched_columns"] == {"amount": 2, "note": 2}
    assert data["in_doubt_applied"] == 1
    assert [s["key"] for s in data["samples"]["lost"]] == [3, 50]
    assert [s["key"] for s in data["samples"]["unexpected"]] == [1001, 1002]
    assert data["samples"]["mismatched"][0]["client"]["amount"] == "25.00"
    assert data["samples"]["mismatched"][0]["server"]["amount"] == "26.00"
    assert data["metadata"]["client"]["rows"] == 300
    assert data["metadata"]["server"]["rows"] == len(list(_server_rows()))

    out = capsys.readouterr().out
    assert "lost" in out and "verdict: violated" in out
    html = page.read_text()
    assert "violated" in html and "data:image/png;base64," in html and "applied_but_aborted" in html
    assert (tmp_path / "r.png").read_bytes().startswith(b"\x89PNG")

    anomalies = 300 + len(UNEXPECTED) - 287
    assert spark.read.parquet(str(parquet)).count() == anomalies
    with sa.create_engine(client_url).connect() as conn:
        by_class = dict(conn.exec_driver_sql('SELECT "class", count(*) FROM anomalies GROUP BY 1').all())
    assert by_class == {"lost": 3, "duplicated": 3, "unexpected": 2, "mismatched": 3,
                        "applied_but_aborted": 2, "in_doubt": 2}


def test_a_clean_delivery_is_exactly_once_with_string_keys_from_mariadb_to_postgresql(pg_db, maria_db, spark):
    client_url, server_url = maria_db("client"), pg_db("server")
    rows = [{"k": f"m-{i:04d}", "v": i, "note": None if i % 7 == 0 else f"n{i}"} for i in range(200)]
    with sa.create_engine(client_url).begin() as conn:
        conn.exec_driver_sql("CREATE TABLE sent (k varchar(20) PRIMARY KEY, v int, note varchar(20))")
        conn.execute(sa.text("INSERT INTO sent VALUES (:k, :v, :note)"), rows)
    with sa.create_engine(server_url).begin() as conn:
        conn.exec_driver_sql("CREATE TABLE got (msg text PRIMARY KEY, v bigint, note text)")
        conn.execute(sa.text("INSERT INTO got VALUES (:k, :v, :note)"), rows)
    result = reconcile(TableSpec(client_url, "sent", "k", ("v", "note")), TableSpec(server_url, "got", "msg"),
                       spark=spark, partitions=3, log=None)
    assert result.counts == {"ok": 200, "lost": 0, "duplicated": 0, "unexpected": 0, "mismatched": 0,
                             "applied_but_aborted": 0, "in_doubt": 0, "compensated": 0,
                             "committed_but_compensated": 0}
    assert (result.verdict, result.exit_code) == ("exactly-once", 0)
    assert _cli("--client-url", client_url, "--client-table", "sent", "--server-url", server_url,
                "--server-table", "got", "--key", "k=msg", "--columns", "v,note") == 0


def test_a_single_lost_message_among_string_keys_is_found(pg_db, maria_db, spark):
    client_url, server_url = maria_db("client"), pg_db("server")
    with sa.create_engine(client_url).begin() as conn:
        conn.exec_driver_sql("CREATE TABLE sent (k varchar(20) PRIMARY KEY, v int)")
        conn.execute(sa.text("INSERT INTO sent VALUES (:k, :v)"), [{"k": f"m{i}", "v": i} for i in range(50)])
    with sa.create_engine(server_url).begin() as conn:
        conn.exec_driver_sql("CREATE TABLE got (k text, v int)")
        conn.execute(sa.text("INSERT INTO got VALUES (:k, :v)"), [{"k": f"m{i}", "v": i} for i in range(1, 50)])
    result = reconcile(TableSpec(client_url, "sent", "k", ("v",)), TableSpec(server_url, "got", "k"),
                       spark=spark, partitions=3, log=None)
    assert (result.counts["lost"], result.counts["ok"], result.verdict) == (1, 49, "violated")
    assert result.samples["lost"][0]["key"] == "m0"


# ------------------------------------------------------------------------------------------------ bad input


@pytest.fixture
def small_tables(pg_db, maria_db):
    client_url, server_url = pg_db("client"), maria_db("server")
    run_sql(client_url, "CREATE TABLE outbox (id bigint PRIMARY KEY, amount int)",
            "INSERT INTO outbox VALUES (1, 10), (2, 20)")
    run_sql(server_url, "CREATE TABLE applied (msg_id bigint, amount int, code varchar(10))",
            "INSERT INTO applied VALUES (1, 10, 'a'), (2, 20, 'b')")
    return client_url, server_url


BAD_INPUT = {
    "unknown table": (
        ("outbox", "id", ("amount",)), ("nope", "msg_id", ()),
        r"server table 'nope' does not exist in mysql.*tables there: applied",
    ),
    "unknown column": (
        ("outbox", "id", ("amt",)), ("applied", "msg_id", ("amount",)),
        r"client table 'outbox' .* has no column 'amt'; its columns are id, amount",
    ),
    "key types differ": (
        ("outbox", "id", ("amount",)), ("applied", "code", ()),
        r"key types differ: client key 'id' is bigint .* server key 'code' is string",
    ),
    "payload kinds differ": (
        ("outbox", "id", ("amount",)), ("applied", "msg_id", ("code",)),
        r"payload column 'amount': client 'amount' is int but server 'code' is string",
    ),
}


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_is_a_configuration_error_naming_cause_and_fix(small_tables, spark, case):
    client_url, server_url = small_tables
    (c_table, c_key, c_cols), (s_table, s_key, s_cols), message = BAD_INPUT[case]
    with pytest.raises(ConfigurationError, match=message):
        reconcile(TableSpec(client_url, c_table, c_key, c_cols), TableSpec(server_url, s_table, s_key, s_cols),
                  spark=spark, log=None)


@pytest.mark.parametrize("scheme", ["postgresql", "mysql+pymysql"])
def test_an_unreachable_database_is_a_clear_error(small_tables, spark, scheme):
    client_url, _ = small_tables
    dead = f"{scheme}://root@127.0.0.1:{free_port()}/nowhere"
    with pytest.raises(ConfigurationError, match=rf"cannot reach the server database {re.escape(scheme)}://root@127.0.0.1:\d+/nowhere: .*refused"):
        reconcile(TableSpec(client_url, "outbox", "id"), TableSpec(dead, "applied", "msg_id"), spark=spark, log=None)


def test_the_command_line_exits_2_with_one_line_on_bad_input(small_tables, spark, capsys):
    client_url, server_url = small_tables
    code = _cli("--client-url", client_url, "--client-table", "outbox", "--server-url", server_url,
                "--server-table", "applied", "--key", "id=msg_id", "--columns", "amount,missing")
    assert code == 2
    err = capsys.readouterr().err
    assert "qtp reconcile: error:" in err and "has no column 'missing'" in err


def test_spark_submit_runs_the_module(small_tables, tmp_path):
    client_url, server_url = small_tables
    venv_bin = Path(sys.executable).parent
    report = tmp_path / "r.json"
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    proc = subprocess.run(
        [str(venv_bin / "spark-submit"), "--master", "local[1]", "--conf", "spark.ui.enabled=false",
         "--jars", ",".join(find_jdbc_jars({"postgresql", "mysql"})),
         str(Path(qtp.reconcile.__file__).parent / "__main__.py"), "--quiet",
         "--client-url", client_url, "--client-table", "outbox", "--server-url", server_url,
         "--server-table", "applied", "--key", "id=msg_id", "--columns", "amount", "--json", str(report)],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(report.read_text())["counts"]["ok"] == 2
    assert "verdict: exactly-once" in proc.stdout


def test_progress_is_reported_and_a_client_key_without_unique_index_is_warned_about(small_tables, spark):
    client_url, server_url = small_tables
    seen: list[str] = []
    result = reconcile(TableSpec(server_url, "applied", "msg_id", ("amount",)), TableSpec(client_url, "outbox", "id"),
                       spark=spark, log=seen.append)
    assert result.counts["ok"] == 2
    assert any("client key 'msg_id' has no primary key or unique index" in line for line in seen)
    assert any(line.startswith("client: mysql+pymysql://") and "key in [1, 2]" in line for line in seen)
    assert seen[-1].startswith("done in") and seen[-1].endswith("exactly-once")
    seen.clear()
    reconcile(TableSpec(client_url, "outbox", "id", ("amount",)), TableSpec(server_url, "applied", "msg_id"),
              spark=spark, log=seen.append)
    assert not any("unique index" in line for line in seen)
