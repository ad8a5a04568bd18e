"""One contract for the coupling log, run against its three implementations: ``qtp.coupled._log`` on
PostgreSQL and on MariaDB, and its in-memory twin ``qtp.coupled._memory_log``. The sender and the recipient
rely on exactly these answers (a compare-and-set that says whether it moved the row, the rows with work,
the per-peer count behind ``max_prepared_per_peer``)."""

from __future__ import annotations

import time

import pytest
import sqlalchemy as sa

from qtp.coupled import _log as sql_log
from qtp.coupled import _memory_log as memory_log
from qtp.coupled import _states as states
from qtp.coupled import _tables as tables
from qtp.errors import ProtocolError


@pytest.fixture(params=["memory", "postgresql", "mariadb"])
def log(request):
    """(implementation, connection): the functions and what they take as ``conn``."""
    if request.param == "memory":
        yield memory_log, memory_log.MemoryTables()
        return
    url = request.getfixturevalue("pg_db" if request.param == "postgresql" else "maria_db")("log")
    engine = sa.create_engine(url)
    tables.create(engine)
    with engine.connect() as conn:
        yield sql_log, conn
        conn.rollback()
    engine.dispose()


def _sent(impl, conn, cid: str, gtrid: str, deadline: float) -> None:
    impl.record_sent(conn, id=cid, gtrid=gtrid, channel="b", action="urn:x", compensation=b"<undo/>",
                     token="0" * 32, deadline=deadline)


def test_the_sphere_log_decides_once_and_keeps_the_compensation_log(log):
    impl, conn = log
    now = time.time()
    _sent(impl, conn, "t1:1", "t1", now - 10)
    _sent(impl, conn, "t1:2", "t1", now + 10)
    _sent(impl, conn, "t2:1", "t2", now + 10)
    assert impl.active_gtrids(conn, None) == {"t1", "t2"}
    assert impl.active_gtrids(conn, now) == {"t1"}
    assert [r.id for r in impl.lock_active(conn, "t1", now)] == ["t1:1"]
    assert [r.id for r in impl.lock_active(conn, "t1")] == ["t1:1", "t1:2"]
    assert impl.decide(conn, ["t1:1", "t1:2"], "commit") == 2
    assert impl.decide(conn, ["t1:1"], "abort") == 0            # decided once: the second decision moves nothing
    with pytest.raises(ProtocolError):
        impl.decide(conn, ["t2:1"], "status")                   # not a move of an active row
    assert impl.decide(conn, ["t2:1"], "abort") == 1
    assert [(r.id, r.state) for r in impl.sent_rows(conn, gtrid="t1")] == [("t1:1", "committed"),
                                                                          ("t1:2", "committed")]
    assert [r.id for r in impl.open_compensations(conn)] == ["t2:1"]
    impl.report(conn, "t2:1", "compensated", "compensatable", None)
    assert [(r.recipient, r.coupling) for r in impl.reports(conn, ["t2:1", "nope"])] == [("compensated",
                                                                                         "compensatable")]
    assert impl.open_compensations(conn) == []
    assert impl.sent_row(conn, "t2:1").token == "0" * 32 and impl.sent_row(conn, "nope") is None
    assert impl.prune_sent(conn, time.time() + 1) == 1          # only the settled one: t1's recipient said nothing
    assert {r.id for r in impl.sent_rows(conn)} == {"t1:1", "t1:2"}


def _received(impl, conn, cid: str, owner: str | None, deadline: float, state: str = "received") -> None:
    impl.record_received(conn, state, id=cid, coordinator="a", owner=owner, token="1" * 32, gtrid="t",
                         action="urn:x", coupling="shared", payload=b"<x/>", deadline=deadline)


def test_coupling_rows_move_only_by_the_table_and_only_from_the_state_read(log):
    impl, conn = log
    now = time.time()
    _received(impl, conn, "r1", "peer", now + 60)
    assert impl.move(conn, "r1", states.RECEIVED, "attempt", sub_gtrid="s1") == states.PREPARING
    assert impl.move(conn, "r1", states.RECEIVED, "attempt", sub_gtrid="s2") is None   # a stale read moves nothing
    assert impl.move(conn, "r1", states.PREPARING, "vote", sub="s-other") is None      # not its subordinate
    with pytest.raises(ProtocolError):
        impl.move(conn, "r1", states.PREPARING, "compensate")                          # no such move
    assert impl.held(conn, "peer") == 1 and impl.held(conn, None) == 0
    assert impl.work(conn, now, 10) == ["r1"]  # a preparing row is found by the worker, deadline or not
    assert impl.received(conn, "r1").sub_gtrid == "s1"
    assert impl.move(conn, "r1", states.PREPARING, "vote", sub="s1", branches="app") == states.PREPARED
    row = impl.received(conn, "r1")
    assert (row.state, row.sub_gtrid, row.branches) == ("prepared", "s1", "app")
    assert impl.move(conn, "r1", states.PREPARED, "commit") == states.COMMITTING
    assert impl.move(conn, "r1", states.COMMITTING, "resolved") == "committed"
    assert impl.held(conn, "peer") == 0


def test_the_worker_finds_what_is_due_and_nothing_else(log):
    impl, conn = log
    now = time.time()
    _received(impl, conn, "due", None, now + 60)
    _received(impl, conn, "late", None, now - 1)                  # undecided past its deadline: waits
    _received(impl, conn, "later", None, now + 60)
    assert impl.note_attempt(conn, "later", states.RECEIVED, 1, now + 30, "refused once")
    assert not impl.note_attempt(conn, "later", states.PREPARED, 2, now, "wrong state")
    _received(impl, conn, "ordered", None, now - 1, state=states.ORDERED)
    _received(impl, conn, "done", None, now + 60, state="committed")
    assert set(impl.work(conn, now, 10)) == {"due", "ordered"}
    assert impl.received(conn, "later").attempts == 1
    assert {r.id for r in impl.waiting_past_deadline(conn, now)} == {"late"}
    assert impl.prune_received(conn, time.time() + 1) == 1 and impl.received(conn, "done") is None


@pytest.mark.parametrize("server", ["pg_db", "maria_db"])
def test_rows_of_the_version_before_the_states_table_are_read_in_its_states(request, server):
    engine = sa.create_engine(request.getfixturevalue(server)("legacy"))
    tables.create(engine)
    now = time.time()
    with engine.begin() as conn:
        for cid, state, decision, sub in [("unvoted", "received", None, "n~c/1"), ("ordered", "received", "commit", None),
                                          ("undo", "processed", "abort", None), ("waiting", "received", None, None)]:
            sql_log.record_received(conn, state, id=cid, coordinator="a", owner=None, gtrid="t", action="urn:x",
                                    coupling="shared", payload=b"<x/>", deadline=now + 60, decision=decision,
                                    sub_gtrid=sub)
    tables.create(engine)  # what Coupled(node) runs at every start
    with engine.connect() as conn:
        found = {cid: sql_log.received(conn, cid).state for cid in ("unvoted", "ordered", "undo", "waiting")}
    engine.dispose()
    assert found == {"unvoted": states.PREPARING, "ordered": states.ORDERED, "undo": states.COMPENSATING,
                     "waiting": states.RECEIVED}
