"""The classification's DataFrame functions, on small DataFrames."""

from __future__ import annotations

import pytest
from pyspark.sql import Row
from pyspark.sql import types as T
from pyspark.testing import assertDataFrameEqual
from reconcile_support import spark  # noqa: F401  (session fixture)

from qtp.errors import ConfigurationError
from qtp.reconcile import _classify as C
from qtp.reconcile._job import ReconcileResult, _result, key_type

NAMES = ["amount", "note"]
CLIENT_SCHEMA = "id long, amount int, note string, st string"
SERVER_SCHEMA = "msg long, amt int, note string"
CLIENT_COLS = [("amount", "amount"), ("note", "note")]
SERVER_COLS = [("amount", "amt"), ("note", "note")]


def _classified(spark, client_rows, server_rows):
    client = C.client_side(spark.createDataFrame(client_rows, CLIENT_SCHEMA), "id", CLIENT_COLS, "st")
    server = C.server_side(spark.createDataFrame(server_rows, SERVER_SCHEMA), "msg", SERVER_COLS)
    return C.classify(client, server, NAMES)


# One key per situation; the comment is the expected class.
CLIENT = [
    (1, 10, "a", "committed"),   # ok
    (2, 20, "b", "committed"),   # lost
    (3, 30, "c", "committed"),   # duplicated (x2)
    (4, 40, "d", "committed"),   # duplicated (x3), with a differing copy
    (5, 50, "e", "committed"),   # mismatched on amount
    (6, 60, None, "committed"),  # mismatched on note (NULL vs value)
    (7, 70, None, "committed"),  # ok: NULL equals NULL
    (8, 80, "h", "aborted"),     # applied_but_aborted
    (9, 90, "i", "aborted"),     # ok: aborted and absent
    (10, 100, "j", "in_doubt"),  # in_doubt, applied
    (11, 110, "k", None),        # in_doubt (NULL status), absent
    (12, 120, "l", " Committed "),  # ok: status is trimmed and lower-cased
]
SERVER = [
    (1, 10, "a"),
    (3, 30, "c"), (3, 30, "c"),
    (4, 40, "d"), (4, 41, "d"), (4, 40, "d"),
    (5, 51, "e"),
    (6, 60, "f"),
    (7, 70, None),
    (8, 80, "h"),
    (10, 100, "j"),
    (12, 120, "l"),
    (99, 1, "z"),                # unexpected
]
EXPECTED = {
    1: "ok", 2: "lost", 3: "duplicated", 4: "duplicated", 5: "mismatched", 6: "mismatched", 7: "ok",
    8: "applied_but_aborted", 9: "ok", 10: "in_doubt", 11: "in_doubt", 12: "ok", 99: "unexpected",
}


def test_client_side_normalises_status_and_defaults_to_committed(spark):
    df = spark.createDataFrame([(1, 5, "x", " ABORTED"), (2, 6, "y", None)], CLIENT_SCHEMA)
    with_status = C.client_side(df, "id", CLIENT_COLS, "st").select("key", "status")
    assertDataFrameEqual(with_status, [Row(key=1, status="aborted"), Row(key=2, status="in_doubt")])
    without = C.client_side(df, "id", CLIENT_COLS, None).select("key", "status")
    assertDataFrameEqual(without, [Row(key=1, status="committed"), Row(key=2, status="committed")])


def test_server_side_counts_copies_and_keeps_the_smallest_payload(spark):
    df = spark.createDataFrame([(4, 41, "d"), (4, 40, "d"), (5, 7, "q")], SERVER_SCHEMA)
    out = C.server_side(df, "msg", SERVER_COLS)
    assert out.columns == ["key", "copies", "server", "compensated"]
    assert out.schema["server"].dataType.names == NAMES
    assertDataFrameEqual(
        out,
        [Row(key=4, copies=2, server=Row(amount=40, note="d"), compensated=False),
         Row(key=5, copies=1, server=Row(amount=7, note="q"), compensated=False)],
    )


def test_classify_gives_every_key_exactly_one_class(spark):
    out = _classified(spark, CLIENT, SERVER)
    assert out.columns == ["key", "class", "status", "copies", "client", "server", "differing"]
    assertDataFrameEqual(out.select("key", "class"), [Row(key=k, **{"class": v}) for k, v in EXPECTED.items()])


def test_classify_reports_copies_and_differing_columns(spark):
    out = _classified(spark, CLIENT, SERVER).select("key", "copies", "differing")
    got = {row.key: (row.copies, row.differing) for row in out.collect()}
    assert got[3] == (2, [])
    assert got[4] == (3, [])  # the smallest copy equals the client's
    assert got[5] == (1, ["amount"])
    assert got[6] == (1, ["note"])
    assert got[7] == (1, [])
    assert got[2] == (0, [])  # lost: nothing to compare
    assert got[99] == (1, [])  # unexpected: nothing to compare


def test_summarize_is_one_row_per_class_and_multiplicity_with_bounded_samples(spark):
    extra_lost = [(100 + i, i, "x", "committed") for i in range(7)]
    summary = C.summarize(_classified(spark, CLIENT + extra_lost, SERVER), NAMES, sample_size=3)
    rows = {(r["class"], r["copies"]): r for r in summary.collect()}
    assert {k: r["keys"] for k, r in rows.items()} == {
        ("ok", 1): 3, ("ok", 0): 1, ("lost", 0): 8, ("duplicated", 2): 1, ("duplicated", 3): 1,
        ("mismatched", 1): 2, ("applied_but_aborted", 1): 1, ("in_doubt", 1): 1, ("in_doubt", 0): 1,
        ("unexpected", 1): 1,
    }
    assert (rows[("mismatched", 1)]["differs_0"], rows[("mismatched", 1)]["differs_1"]) == (1, 1)
    assert [s["key"] for s in rows[("lost", 0)]["samples"]] == [2, 100, 101]
    assert rows[("lost", 0)]["samples"][0]["client"].asDict() == {"amount": 20, "note": "b"}


def test_anomalies_leaves_out_ok_keys_and_flattens_both_sides(spark):
    out = C.anomalies(_classified(spark, CLIENT, SERVER), NAMES)
    assert out.columns == ["key", "class", "status", "copies", "client_amount", "client_note",
                           "server_amount", "server_note", "differing"]
    assert sorted(r.key for r in out.collect()) == sorted(k for k, v in EXPECTED.items() if v != "ok")
    row5 = out.filter("key = 5").first()
    assert (row5.client_amount, row5.server_amount, row5.differing) == (50, 51, "amount")


def test_result_folds_groups_into_counts_histogram_and_rows(spark):
    summary = C.summarize(_classified(spark, CLIENT, SERVER), NAMES, sample_size=2).collect()
    result = _result(summary, NAMES, 2)
    assert result.counts == {"ok": 4, "lost": 1, "duplicated": 2, "unexpected": 1, "mismatched": 2,
                             "applied_but_aborted": 1, "in_doubt": 2, "compensated": 0,
                             "committed_but_compensated": 0}
    assert result.duplicate_histogram == {2: 1, 3: 1}
    assert result.mismatched_columns == {"amount": 1, "note": 1}
    assert result.in_doubt_applied == 1
    assert result.metadata == {"client_rows": len(CLIENT), "server_rows": len(SERVER)}
    assert [s["key"] for s in result.samples["duplicated"]] == [3, 4]
    assert result.verdict == "violated" and result.exit_code == 1


@pytest.mark.parametrize("violation", C.VIOLATIONS)
def test_verdict_is_violated_by_each_violation_alone(violation):
    counts = dict.fromkeys(C.CLASSES, 0) | {"ok": 10, "in_doubt": 3}
    clean = ReconcileResult(dict(counts), {}, {}, 0, {})
    assert (clean.verdict, clean.exit_code) == ("exactly-once", 0)
    broken = ReconcileResult(counts | {violation: 1}, {}, {}, 0, {})
    assert (broken.verdict, broken.exit_code) == ("violated", 1)
    assert broken.to_dict()["counts"][violation] == 1


def test_key_types_of_one_family_meet_and_others_are_refused():
    assert key_type(T.IntegerType(), T.LongType(), "id", "msg") == T.LongType()
    assert key_type(T.LongType(), T.DecimalType(20, 0), "id", "msg") == T.DecimalType(38, 0)
    assert key_type(T.StringType(), T.StringType(), "id", "msg") == T.StringType()
    with pytest.raises(ConfigurationError, match="key types differ.*'id' is bigint.*'msg' is string"):
        key_type(T.LongType(), T.StringType(), "id", "msg")


def test_a_compensation_mark_on_the_server_makes_compensated_and_committed_but_compensated(spark):
    """Coupled messaging: an aborted sender's recipient row that its compensator marked is 'compensated' (not
    a violation); the same mark under a committed client row is a violation; unmarked rows classify as
    before (an aborted client row still applied and not marked is applied_but_aborted)."""
    client = C.client_side(spark.createDataFrame(
        [(1, "aborted"), (2, "committed"), (3, "aborted"), (4, "committed"), (5, "aborted")], "k long, st string"),
        "k", [], "st")
    server = C.server_side(spark.createDataFrame(
        [(1, "closed"), (2, "closed"), (3, "open"), (4, "open")], "k long, status string"), "k", [],
        compensated=("status", "closed"))
    got = {r["key"]: r["class"] for r in C.classify(client, server, []).collect()}
    assert got == {1: "compensated", 2: "committed_but_compensated", 3: "applied_but_aborted", 4: "ok", 5: "ok"}
    assert "committed_but_compensated" in C.VIOLATIONS and "compensated" not in C.VIOLATIONS
    unmarked = C.server_side(spark.createDataFrame([(1, "closed")], "k long, status string"), "k", [])
    assert {r["key"]: r["class"] for r in C.classify(client, unmarked, []).collect()}[1] == "applied_but_aborted"
