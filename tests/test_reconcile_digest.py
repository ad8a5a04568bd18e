"""Digest mode against real PostgreSQL and MariaDB: the canonical encoding agrees bit for bit on both servers
for equal values and differs for different ones, and every count equals the full mode's."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from reconcile_support import run_sql, spark  # noqa: F401  (session fixture)
from test_reconcile_integration import anomalous_tables  # noqa: F401  (fixture)

from qtp.errors import ConfigurationError, ReconcileError
from qtp.reconcile import TableSpec, reconcile
from qtp.reconcile import _digest as D
from qtp.reconcile._sources import probe

# key: (client value, server value) for columns d (decimal), t, t2 (text), ts (zoned), dt (naive), day
SAME = {
    1: ("1.5000", "1.5", "a", "x", "2024-03-01 12:00:00+02", "2024-03-01 10:00:00", "2024-01-01 00:00:00.123456",
        "2024-02-29"),
    2: ("0.0000", "0", "", "", "2024-03-01 00:00:00+00", "2024-03-01 00:00:00", "1999-12-31 23:59:59", "2000-01-01"),
    3: ("-12.3400", "-12.34", None, None, None, None, None, None),
    4: ("100.0000", "100", "ünïcødé ✓ 日本 🚀", "naïve", "2030-06-30 23:59:59.999999-07",
        "2030-07-01 06:59:59.999999", "2030-06-30 23:59:59.999999", "2030-06-30"),
}
# each differs from its server row in one way only the canonical encoding can tell
DIFFERENT = {
    101: ("t", "a", "a "),  # trailing space
    102: ("t", None, ""),  # NULL vs empty string
    103: ("d", "1.5100", "1.5"),  # a real decimal difference (not a trailing zero)
    104: ("t", "#", None),  # the NULL marker as text
    105: ("ts", "2024-03-01 12:00:00.000001+02", None),  # one microsecond later
    106: ("t2", "", "b"),  # with t below: ('ab', '') vs ('a', 'b') must not run together
}


def _rows():
    """(client rows, server rows) as dicts."""
    cols = ("d", "t", "t2", "ts", "dt", "day")
    client, server = [], []
    for key, (d, sd, t, t2, ts, sts, dt, day) in SAME.items():
        client.append({"id": key, "d": d, "t": t, "t2": t2, "ts": ts, "dt": dt, "day": day})
        server.append({"id": key, "d": sd, "t": t, "t2": t2, "ts": sts, "dt": dt, "day": day})
    for key, (col, c_value, s_value) in DIFFERENT.items():
        base_c = {"id": key, "d": "1.5", "t": "a", "t2": "x", "ts": None, "dt": None, "day": None}
        base_s = {**base_c, "ts": None}
        if col == "ts":
            base_c["ts"], base_s["ts"] = c_value, "2024-03-01 10:00:00"
        else:
            base_c[col], base_s[col] = c_value, s_value
        if key == 106:
            base_c["t"], base_s["t"] = "ab", "a"
        client.append(base_c)
        server.append(base_s)
    client.append({"id": None, **dict.fromkeys(cols)})  # a NULL key on both sides: lost + unexpected
    server.append({"id": None, **dict.fromkeys(cols)})
    return client, server


@pytest.fixture
def awkward_tables(pg_db, maria_db):
    client_url, server_url = pg_db("client"), maria_db("server")
    client_rows, server_rows = _rows()
    with sa.create_engine(client_url).begin() as conn:
        conn.exec_driver_sql("SET TIME ZONE 'America/New_York'")  # offsets in the literals decide the instant
        conn.exec_driver_sql("CREATE TABLE c (id bigint UNIQUE, d numeric(12,4), t text, t2 text, ts timestamptz, "
                             "dt timestamp, day date)")
        conn.execute(sa.text("INSERT INTO c VALUES (:id, :d, :t, :t2, :ts, :dt, :day)"), client_rows)
    with sa.create_engine(server_url).begin() as conn:
        conn.exec_driver_sql("SET time_zone = '+00:00'")
        conn.exec_driver_sql("CREATE TABLE s (id bigint, d decimal(12,2), t varchar(40) CHARACTER SET utf8mb4, "
                             "t2 varchar(40) CHARACTER SET utf8mb4, ts timestamp(6) NULL, dt datetime(6), day date)")
        conn.execute(sa.text("INSERT INTO s VALUES (:id, :d, :t, :t2, :ts, :dt, :day)"), server_rows)
    columns = ("d", "t", "t2", "ts", "dt", "day")
    return TableSpec(client_url, "c", "id", columns), TableSpec(server_url, "s", "id", columns)


def test_the_canonical_encoding_is_the_same_bytes_on_both_servers_for_equal_values_only(awkward_tables):
    client, server = awkward_tables
    probed_c, probed_s = probe(client, "client"), probe(server, "server")
    pairs = [(col, col) for col in client.columns]
    plan = D.plan(probed_c, probed_s, pairs, width=1)  # one key per range: a per-row comparison
    assert plan.reason is None, plan.reason
    assert [k for k, _ in plan.kinds] == ["integer", "decimal", "text", "text", "timestamptz", "timestamp", "date"]
    c_side = D.fetch(probed_c, plan, client.columns, 0)
    s_side = D.fetch(probed_s, plan, server.columns, 1)
    assert c_side[D.NULL_RANGE][0] == s_side[D.NULL_RANGE][0] == 1
    found = D.compare(c_side, s_side)
    differing_keys = {plan.lower + r for r in found.differing if r != D.NULL_RANGE}
    assert differing_keys == set(DIFFERENT)
    assert D.NULL_RANGE in found.differing  # NULL keys never match: always read
    assert found.ok_keys == len(SAME)


def test_digest_and_full_mode_count_the_awkward_values_the_same(awkward_tables, spark):
    client, server = awkward_tables
    full = reconcile(client, server, spark=spark, mode="full", log=None)
    digest = reconcile(client, server, spark=spark, mode="digest", range_width=1, log=None)
    assert full.counts == digest.counts == {
        "ok": len(SAME), "lost": 1, "duplicated": 0, "unexpected": 1, "mismatched": len(DIFFERENT),
        "applied_but_aborted": 0, "in_doubt": 0, "compensated": 0, "committed_but_compensated": 0,
    }
    assert full.mismatched_columns == digest.mismatched_columns == {"d": 1, "t": 4, "t2": 1, "ts": 1, "dt": 0,
                                                                     "day": 0}
    assert digest.metadata["mode"]["used"] == "digest" and full.metadata["mode"]["used"] == "full"
    assert digest.metadata["mode"]["keys_ok_by_digest"] == len(SAME)
    assert digest.metadata["client"]["rows"] == full.metadata["client"]["rows"] == len(SAME) + len(DIFFERENT) + 1


@pytest.mark.parametrize("width", [7, 1024])
def test_every_anomaly_class_counts_the_same_in_digest_and_full_mode(anomalous_tables, spark, width):  # noqa: F811
    client_url, server_url = anomalous_tables
    client = TableSpec(client_url, "outbox", "id", ("amount", "note"), "status")
    server = TableSpec(server_url, "applied", "msg_id", ("amt", "note"))
    full = reconcile(client, server, spark=spark, mode="full", pushdown=False, log=None)
    full_pushed = reconcile(client, server, spark=spark, mode="full", pushdown=True, log=None)
    digest = reconcile(client, server, spark=spark, mode="digest", range_width=width, pushdown=True, log=None)
    assert full.counts == full_pushed.counts == digest.counts
    assert full.counts["ok"] == 287 and full.counts["lost"] == 3
    for result in (full_pushed, digest):
        assert result.duplicate_histogram == full.duplicate_histogram == {2: 2, 3: 1}
        assert result.mismatched_columns == full.mismatched_columns
        assert result.in_doubt_applied == full.in_doubt_applied == 1
        assert result.metadata["client"]["rows"] == full.metadata["client"]["rows"]
        assert result.metadata["server"]["rows"] == full.metadata["server"]["rows"]
    assert full_pushed.metadata["mode"]["pushdown"] and not full.metadata["mode"]["pushdown"]
    mode = digest.metadata["mode"]
    if width < 1024:  # the anomalies sit in a few ranges: the rest are ok without being read
        assert 0 < mode["ranges_read"] < mode["ranges"] and mode["keys_ok_by_digest"] > 100


def test_a_clean_delivery_in_digest_mode_reads_no_range(pg_db, maria_db, spark):
    client_url, server_url = pg_db("client"), maria_db("server")
    rows = [{"k": i, "v": f"{i}.10", "s": "committed" if i % 5 else "aborted"} for i in range(1, 2001)]
    with sa.create_engine(client_url).begin() as conn:
        conn.exec_driver_sql("CREATE TABLE c (k int PRIMARY KEY, v numeric(10,2), s varchar(12))")
        conn.execute(sa.text("INSERT INTO c VALUES (:k, :v, :s)"), rows)
    with sa.create_engine(server_url).begin() as conn:
        conn.exec_driver_sql("CREATE TABLE s (k bigint, v decimal(10,1))")
        conn.execute(sa.text("INSERT INTO s VALUES (:k, :v)"), [r for r in rows if r["s"] == "committed"])
    client, server = TableSpec(client_url, "c", "k", ("v",), "s"), TableSpec(server_url, "s", "k")
    digest = reconcile(client, server, spark=spark, range_width=100, log=None)  # auto picks digest
    assert digest.metadata["mode"] == {"requested": "auto", "used": "digest", "reason": None, "pushdown": False,
                                       "ranges": 20, "ranges_read": 0, "keys_ok_by_digest": 2000}
    assert digest.counts == reconcile(client, server, spark=spark, mode="full", log=None).counts
    assert digest.counts["ok"] == 2000 and digest.exactly_once


def test_text_keys_are_digested_in_hashed_ranges(pg_db, maria_db, spark):
    client_url, server_url = maria_db("client"), pg_db("server")
    rows = [{"k": f"m-{i:04d}-é", "v": i} for i in range(500)]
    with sa.create_engine(client_url).begin() as conn:
        conn.exec_driver_sql("CREATE TABLE c (k varchar(20) CHARACTER SET utf8mb4 PRIMARY KEY, v int)")
        conn.execute(sa.text("INSERT INTO c VALUES (:k, :v)"), rows)
    with sa.create_engine(server_url).begin() as conn:
        conn.exec_driver_sql("CREATE TABLE s (k text, v bigint)")
        conn.execute(sa.text("INSERT INTO s VALUES (:k, :v)"), [{**r, "v": r["v"] + (r["v"] == 7)} for r in rows[1:]])
    client, server = TableSpec(client_url, "c", "k", ("v",)), TableSpec(server_url, "s", "k")
    digest = reconcile(client, server, spark=spark, mode="digest", log=None)
    full = reconcile(client, server, spark=spark, mode="full", log=None)
    assert digest.counts == full.counts
    assert (digest.counts["lost"], digest.counts["mismatched"], digest.counts["ok"]) == (1, 1, 498)
    assert digest.metadata["mode"]["ranges_read"] == 2  # the lost key's range and the mismatched key's


def test_auto_falls_back_to_full_and_digest_is_refused_with_the_reason(pg_db, maria_db, spark):
    client_url, server_url = pg_db("client"), maria_db("server")
    run_sql(client_url, "CREATE TABLE c (k int PRIMARY KEY, x double precision)",
            "INSERT INTO c VALUES (1, 0.5), (2, 1.5)")
    run_sql(server_url, "CREATE TABLE s (k int, x double)", "INSERT INTO s VALUES (1, 0.5), (2, 1.25)")
    client, server = TableSpec(client_url, "c", "k", ("x",)), TableSpec(server_url, "s", "k")
    seen: list[str] = []
    result = reconcile(client, server, spark=spark, log=seen.append)
    assert result.metadata["mode"]["used"] == "full" and "floating point" in result.metadata["mode"]["reason"]
    assert result.counts["mismatched"] == 1
    assert any(line.startswith("auto mode: full, because column 'x'") for line in seen)
    with pytest.raises(ConfigurationError, match=r"digest mode cannot run: column 'x' .*floating point.*--mode full"):
        reconcile(client, server, spark=spark, mode="digest", log=None)
    with pytest.raises(ConfigurationError, match=r"unknown mode 'fast': use one of auto, digest, full"):
        reconcile(client, server, spark=spark, mode="fast", log=None)


def test_auto_reads_everything_when_a_sample_of_ranges_shows_dense_anomalies(pg_db, maria_db, spark):
    client_url, server_url = pg_db("client"), maria_db("server")
    run_sql(client_url, "CREATE TABLE c (k bigint PRIMARY KEY, v int)",
            "INSERT INTO c SELECT g, g FROM generate_series(1, 400) g")
    run_sql(server_url, "CREATE TABLE s (k bigint, v int)",
            "INSERT INTO s SELECT seq, seq + (MOD(seq, 5) = 0) FROM seq_1_to_400")  # one in five differs
    client, server = TableSpec(client_url, "c", "k", ("v",)), TableSpec(server_url, "s", "k")
    seen: list[str] = []
    auto = reconcile(client, server, spark=spark, range_width=10, log=seen.append)
    assert auto.metadata["mode"]["used"] == "full"
    assert auto.metadata["mode"]["reason"] == "40 of 40 sampled key ranges differ (anomalies are dense)"
    assert "auto mode: 40 of 40 sampled ranges differ" in seen
    digest = reconcile(client, server, spark=spark, mode="digest", range_width=10, log=None)
    assert auto.counts == digest.counts and digest.counts["mismatched"] == 80 and digest.counts["ok"] == 320
    assert digest.metadata["mode"]["ranges_read"] == 40


def _probed(client_url: str, server_url: str, columns: tuple[str, ...]):
    """Tables ``c`` and ``s`` keyed by ``k``, probed."""
    return (probe(TableSpec(client_url, "c", "k", columns), "client"),
            probe(TableSpec(server_url, "s", "k", columns), "server"))


def test_text_keys_that_only_a_collation_calls_equal_are_ordered_alike_on_both_servers(pg_db, maria_db, spark,
                                                                                       monkeypatch):
    # MariaDB's default collation calls 'a', 'A', 'a ' and 'ä' equal; a range digest built in that order would
    # differ from PostgreSQL's on equal data. Rows go in in opposite orders, so that no order survives by luck.
    client_url, server_url = pg_db("client"), maria_db("server")
    keys = sorted(["a", "A", "a ", "ä", "b", "B", "é", "E", "e", "z", "Z ", "ß", "ss", "SS"])
    rows = [{"k": k, "v": i} for i, k in enumerate(keys)]
    with sa.create_engine(client_url).begin() as conn:
        conn.exec_driver_sql("CREATE TABLE c (k text PRIMARY KEY, v int)")
        conn.execute(sa.text("INSERT INTO c VALUES (:k, :v)"), rows)
    with sa.create_engine(server_url).begin() as conn:
        conn.exec_driver_sql("CREATE TABLE s (k varchar(8) CHARACTER SET utf8mb4 COLLATE utf8mb4_general_ci, v int)")
        conn.execute(sa.text("INSERT INTO s VALUES (:k, :v)"), rows[::-1])
    client, server = _probed(client_url, server_url, ("v",))
    plan = D.plan(client, server, [("v", "v")])
    monkeypatch.setattr(D, "range_of", lambda probed, p: "0")  # every key in one range: one ordered digest
    c_side, s_side = D.fetch(client, plan, ["v"], 0), D.fetch(server, plan, ["v"], 1)
    assert c_side[0][:2] == s_side[0][:2] == (len(keys), len(keys))
    assert c_side[0][2] == s_side[0][2]
    monkeypatch.undo()
    digest = reconcile(TableSpec(client_url, "c", "k", ("v",)), TableSpec(server_url, "s", "k"), spark=spark,
                       mode="digest", log=None)
    assert digest.metadata["mode"]["ranges_read"] == 0 and digest.counts["ok"] == len(keys)


def test_decimals_without_a_declared_scale_are_compared_without_trailing_zeros(pg_db, maria_db):
    client_url, server_url = pg_db("client"), maria_db("server")
    run_sql(client_url, "CREATE TABLE c (k int PRIMARY KEY, d numeric, n int)",
            "INSERT INTO c VALUES (1, 1.5, 7), (2, 2.000, 8), (3, 0.10, 9), (4, 5, 10)")
    run_sql(server_url, "CREATE TABLE s (k int, d decimal(12,3), n decimal(6,2))",
            "INSERT INTO s VALUES (1, 1.500, 7.00), (2, 2, 8), (3, 0.1, 9.00), (4, 5.001, 10)")
    client, server = _probed(client_url, server_url, ("d", "n"))
    plan = D.plan(client, server, [("d", "d"), ("n", "n")], width=1)
    assert plan.scales == (None, None, 2)  # d: PostgreSQL's numeric declares no scale; n: int 0, decimal 2
    found = D.compare(D.fetch(client, plan, ["d", "n"], 0), D.fetch(server, plan, ["d", "n"], 1))
    assert [plan.lower + r for r in found.differing] == [4]


def test_a_range_longer_than_mariadbs_group_concat_limit_is_an_error_not_a_partial_digest(pg_db, maria_db,
                                                                                          monkeypatch):
    server_url = maria_db("server")
    run_sql(server_url, "CREATE TABLE s (k int PRIMARY KEY, t varchar(40))",
            "INSERT INTO s SELECT seq, REPEAT('x', 30) FROM seq_1_to_50")
    client_url = pg_db("client")
    run_sql(client_url, "CREATE TABLE c (k int PRIMARY KEY, t text)",
            "INSERT INTO c SELECT g, repeat('x', 30) FROM generate_series(1, 50) g")
    client, server = _probed(client_url, server_url, ("t",))
    plan = D.plan(client, server, [("t", "t")], width=100)
    assert D.fetch(server, plan, ["t"], 1)[0][2] == D.fetch(client, plan, ["t"], 0)[0][2]
    monkeypatch.setattr(D, "GROUP_CONCAT_MAX", 1000)  # 50 rows of ~36 bytes do not fit
    with pytest.raises(ReconcileError, match="group_concat_max_len"):
        D.fetch(server, plan, ["t"], 1)


def test_split_digest_queries_cover_every_range_once(pg_db, maria_db):
    client_url, server_url = pg_db("client"), maria_db("server")
    run_sql(client_url, "CREATE TABLE c (k int UNIQUE, v int)",
            "INSERT INTO c SELECT g, g FROM generate_series(1, 1000) g", "INSERT INTO c VALUES (NULL, 0)")
    run_sql(server_url, "CREATE TABLE s (k int, v int)", "INSERT INTO s SELECT seq, seq FROM seq_1_to_1000")
    client, server = _probed(client_url, server_url, ("v",))
    plan = D.plan(client, server, [("v", "v")], width=7)
    whole = D.fetch(client, plan, ["v"], 0)
    for count in (2, 3, 5):
        parts = [D.fetch(client, plan, ["v"], 0, where=w) for w in D.chunks(client, plan, count)]
        assert len(parts) == count
        assert sorted(r for part in parts for r in part) == sorted(whole)  # no range twice, none missing
        assert {r: v for part in parts for r, v in part.items()} == whole
    found = D.digests(client, server, plan, [("v", "v")])
    assert found.differing == [D.NULL_RANGE] and found.ok_keys == 1000
