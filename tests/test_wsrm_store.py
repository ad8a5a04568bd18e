"""The store contract, run on the in-memory store, PostgreSQL and MariaDB alike."""

from __future__ import annotations

import threading
import time

from dataclasses import replace

import pytest
import sqlalchemy

import qtp
from qtp.errors import DuplicateApplyError
from qtp.wsrm.protocol import DestinationRecord, InvokerRecord, RMVersion, SourceRecord, SourceState
from qtp.wsrm.store import DestinationInfo, Incoming, MemoryStore, Outgoing, SourceInfo, SqlStore


@pytest.fixture(params=["memory", "postgresql", "mariadb"])
def store(request):
    if request.param == "memory":
        yield MemoryStore()
        return
    url = request.getfixturevalue("pg_db" if request.param == "postgresql" else "maria_db")("store")
    engine = sqlalchemy.create_engine(url)
    s = SqlStore("store", engine)
    s.create()
    s.create()  # idempotent
    yield s
    engine.dispose()


def _out(route: str, i: int, payload: bytes | None = b"<a/>") -> Outgoing:
    return Outgoing(route=route, message_id=f"urn:uuid:{route}-{i}", action="urn:a", payload=payload,
                    enqueued_at=1000.0 + i)


def _in(identifier: str, number: int) -> Incoming:
    return Incoming(identifier=identifier, number=number, message_id=f"urn:uuid:m{number}", action="urn:a",
                    payload=f"<p n='{number}'/>".encode(), received_at=5.0, enqueued_at=4.5, relates_to=None)


def test_outgoing_numbering_and_acknowledgement(store):
    with store.local() as s:
        for i in range(5):
            store.enqueue(s, _out("orders", i))
        store.enqueue(s, _out("other", 9))
    with store.local() as s:
        first = store.unnumbered(s, "orders", 3)
        assert [m.message_id for m in first] == [f"urn:uuid:orders-{i}" for i in range(3)]
        store.assign(s, "k1", [(m.seq, n) for n, m in enumerate(first, start=1)])
    with store.local() as s:
        rest = store.unnumbered(s, "orders", 10)
        assert [m.message_id for m in rest] == ["urn:uuid:orders-3", "urn:uuid:orders-4"]
        numbered = store.numbered(s, "k1")
        assert [(m.number, m.payload, m.key) for m in numbered] == [(1, b"<a/>", "k1"), (2, b"<a/>", "k1"),
                                                                     (3, b"<a/>", "k1")]
        assert [m.number for m in store.numbered(s, "k1", [2])] == [2]
        assert store.backlog(s, "orders") == 5 and store.backlog(s) == 6
    with store.local() as s:
        assert store.acknowledged(s, "k1", ((1, 2),)) == 2
        assert store.acknowledged(s, "k1", ((1, 2),)) == 0
    with store.local() as s:
        assert [m.number for m in store.numbered(s, "k1")] == [3]
        assert store.backlog(s, "orders") == 3


def test_released_messages_wait_again_before_those_enqueued_after_them(store):
    """A sequence that ended with messages unacknowledged gives them back: unnumbered again, and ahead of the
    messages enqueued after them, so the next sequence sends them in their original order."""
    with store.local() as s:
        for i in range(3):
            store.enqueue(s, _out("orders", i))
    with store.local() as s:
        store.assign(s, "k1", [(m.seq, n) for n, m in enumerate(store.unnumbered(s, "orders", 3), start=1)])
        store.enqueue(s, _out("orders", 3))
    with store.local() as s:
        assert store.acknowledged(s, "k1", ((1, 1),)) == 1
        assert store.release(s, "k1", ((2, 3),)) == 2
        assert store.release(s, "k1", ((2, 3),)) == 0
    with store.local() as s:
        waiting = store.unnumbered(s, "orders", 10)
        assert [m.message_id for m in waiting] == [f"urn:uuid:orders-{i}" for i in (1, 2, 3)]
        assert [(m.key, m.number) for m in waiting] == [(None, None)] * 3
        assert store.numbered(s, "k1") == []
        store.drop_source(s, "k1")
        assert store.backlog(s, "orders") == 3


def test_a_failed_local_transaction_leaves_nothing(store):
    with pytest.raises(RuntimeError):
        with store.local() as s:
            store.enqueue(s, _out("orders", 1))
            store.store_incoming(s, _in("urn:x", 1))
            raise RuntimeError("boom")
    with store.local() as s:
        assert store.backlog(s) == 0 and store.incoming(s) == []


def test_source_destination_and_invoker_records_round_trip(store):
    source = SourceRecord("k1", RMVersion.WSRM11, state=SourceState.ACTIVE, identifier="urn:s",
                          pending=((1, 1, 3.5),), acked=((1, 4),))
    destination = DestinationRecord("urn:d", RMVersion.WSRM10, received=((1, 3), (5, 5)))
    invoker = InvokerRecord("urn:d", True, delivered=((1, 2),))
    info = DestinationInfo(reply_to="http://peer/rm", channel=None, soap="1.1", wsa="2004/08")
    with store.local() as s:
        store.save_source(s, SourceInfo("orders", "http://peer/rm"), source)
        store.save_destination(s, info, destination)
        store.save_invoker(s, invoker)
    with store.local() as s:
        # pending is not kept: the numbered outgoing rows are the pending messages
        assert store.sources(s) == [(SourceInfo("orders", "http://peer/rm"), replace(source, pending=()))]
        assert store.destinations(s) == [(info, destination)]
        assert store.invokers(s) == [invoker]
        store.save_source(s, SourceInfo("orders", "http://peer/rm"), SourceRecord("k1", RMVersion.WSRM11))
    with store.local() as s:
        assert store.sources(s)[0][1].state is SourceState.NEW
        store.drop_source(s, "k1")
        store.drop_destination(s, "urn:d")
    with store.local() as s:
        assert store.sources(s) == [] and store.destinations(s) == [] and store.invokers(s) == []


def test_a_destination_with_thousands_of_gaps_round_trips_saved_by_difference(store):
    """Saved with the committed record as ``before`` at every step (as the receiver does), the record reads
    back whole: while gaps open, when they close and merge ranges, and after a save that knows no ``before``."""
    from qtp.wsrm.protocol import _ranges as ranges
    info = DestinationInfo(reply_to=None)
    record = DestinationRecord("urn:gappy", RMVersion.WSRM11)
    with store.local() as s:
        store.create_destination(s, info, record)
    steps = [2 * i for i in range(1, 1001)] + [3, 5, 1] + list(range(7, 40, 2)) + [2001, 4000]
    for i, number in enumerate(steps):
        before, record = record, replace(record, received=ranges.add(record.received, number))
        with store.local() as s:
            store.save_destination(s, info, record, before=before)
        if i % 250 == 0 or i >= len(steps) - 25:
            with store.local() as s:
                assert store.destinations(s) == [(info, record)], f"after {number}"
    assert len(record.received) > 900
    shrunk = replace(record, received=((1, 10),))
    with store.local() as s:
        store.save_destination(s, info, shrunk)  # no before: everything written again
    with store.local() as s:
        assert store.destinations(s) == [(info, shrunk)]
        store.save_destination(s, info, record, before=shrunk)
    with store.local() as s:
        assert store.destinations(s) == [(info, record)]
        store.drop_destination(s, "urn:gappy")
    with store.local() as s:
        assert store.destinations(s) == []


@pytest.mark.parametrize("database", ["postgresql", "mariadb"])
def test_one_more_gap_writes_a_row_not_the_whole_record(request, database):
    """Issue 21, attack 4d: with 2,000 gaps, accepting one more message sent the whole record (every range as
    JSON, about 30 KB) to the database per commit. Now it sends the record's fixed fields and one range row."""
    from qtp.wsrm.protocol import _ranges as ranges
    engine = sqlalchemy.create_engine(request.getfixturevalue("pg_db" if database == "postgresql" else "maria_db")("gaps"))
    store = SqlStore("gaps", engine)
    store.create()
    info = DestinationInfo(reply_to=None)
    record = DestinationRecord("urn:gaps", RMVersion.WSRM11, received=tuple((2 * i, 2 * i) for i in range(1, 2001)))
    with store.local() as s:
        store.save_destination(s, info, record)
    sent: list[int] = []

    def count(conn, cursor, statement, parameters, context, executemany):
        sent.append(len(statement) + len(repr(parameters)))

    sqlalchemy.event.listen(engine, "before_cursor_execute", count)
    try:
        for number in (4002, 4004, 3, 5):  # two new gaps, then two that close one and merge neighbours
            before, record = record, replace(record, received=ranges.add(record.received, number))
            with store.local() as s:
                store.save_destination(s, info, record, before=before)
    finally:
        sqlalchemy.event.remove(engine, "before_cursor_execute", count)
    with store.local() as s:
        assert store.destinations(s) == [(info, record)]
    assert max(sent) < 2000, sent
    assert sum(sent) < 4 * 4000, sent
    engine.dispose()


@pytest.mark.parametrize("database", ["postgresql", "mariadb"])
def test_a_record_written_with_all_its_ranges_in_json_moves_them_to_rows_when_read(request, database, monkeypatch):
    """Stores written before ranges had rows keep working: the first read moves the ranges, so the next save
    by difference does not lose them."""
    from qtp.wsrm.protocol import _ranges as ranges
    from qtp.wsrm.store import _sql
    engine = sqlalchemy.create_engine(request.getfixturevalue("pg_db" if database == "postgresql" else "maria_db")("legacy"))
    store = SqlStore("legacy", engine)
    store.create()
    info = DestinationInfo(reply_to=None)
    record = DestinationRecord("urn:old", RMVersion.WSRM11, received=tuple((3 * i, 3 * i + 1) for i in range(1, 101)))
    with monkeypatch.context() as m:
        m.setattr(_sql, "_INLINE", 10**9)  # the old layout: every range in the JSON
        with store.local() as s:
            store.save_destination(s, info, record)
    with store.local() as s:
        assert store.destinations(s) == [(info, record)]
    before, record = record, replace(record, received=ranges.add(record.received, 1000))
    with store.local() as s:
        store.save_destination(s, info, record, before=before)
    with store.local() as s:
        assert store.destinations(s) == [(info, record)]
        assert s.execute(sqlalchemy.text("SELECT count(*) FROM qtp_rm_received")).scalar() == 101
    engine.dispose()


def test_incoming_is_stored_once_and_consumed_once(store):
    with store.local() as s:
        assert store.store_incoming(s, _in("urn:d", 2))
        assert store.store_incoming(s, _in("urn:d", 1))
        assert not store.store_incoming(s, _in("urn:d", 1))
        assert store.store_incoming(s, _in("urn:e", 1))
    with store.local() as s:
        assert [(m.identifier, m.number) for m in store.incoming(s)] == [("urn:d", 1), ("urn:d", 2), ("urn:e", 1)]
        assert store.incoming(s, "urn:d")[1].payload == b"<p n='2'/>"
        store.note_failure(s, "urn:d", 1, "handler said no", 99.0)
    with store.local() as s:
        failed = store.incoming(s, "urn:d")[0]
        assert (failed.attempts, failed.not_before, failed.last_error) == (1, 99.0, "handler said no")
        assert store.consume(s, "urn:d", 1)
        assert not store.consume(s, "urn:d", 1)
    with store.local() as s:
        assert [m.number for m in store.incoming(s, "urn:d")] == [2]


def test_dead_letters(store):
    with store.local() as s:
        store.store_incoming(s, _in("urn:d", 1))
        store.store_incoming(s, _in("urn:d", 2))
    with store.local() as s:
        store.dead_letter(s, store.incoming(s)[0], "ValueError: bad order", 10.0)
    with store.local() as s:
        letters = store.dead_letters(s)
        assert len(letters) == 1 and letters[0].error == "ValueError: bad order"
        assert letters[0].message.payload == b"<p n='1'/>" and letters[0].message.number == 1
        assert [m.number for m in store.incoming(s)] == [2]
        taken = store.take_dead_letter(s, letters[0].id)
        assert taken == letters[0]
        assert store.take_dead_letter(s, letters[0].id) is None
    with store.local() as s:
        assert store.dead_letters(s) == []


def test_dead_letters_remember_their_peer_and_are_counted_per_peer(store):
    with store.local() as s:
        for n in range(1, 5):
            store.store_incoming(s, _in("urn:d", n))
    with store.local() as s:
        first, second, third, fourth = store.incoming(s)
        store.dead_letter(s, first, "boom", 1.0, peer="mallory")
        store.dead_letter(s, second, "boom", 2.0, peer="mallory")
        store.dead_letter(s, third, "boom", 3.0, peer="client-a")
        store.dead_letter(s, fourth, "boom", 4.0)  # an anonymous sequence's
    with store.local() as s:
        assert [x.peer for x in store.dead_letters(s)] == ["mallory", "mallory", "client-a", None]
        assert store.dead_letters_per_peer(s) == {"mallory": 2, "client-a": 1, None: 1}
        assert store.take_dead_letter(s, store.dead_letters(s)[0].id).peer == "mallory"
        assert store.dead_letters_per_peer(s) == {"mallory": 1, "client-a": 1, None: 1}


@pytest.mark.parametrize("kind", ["postgresql", "mariadb"])
def test_enqueue_joins_the_global_transaction(kind, request, tmp_path):
    """Enqueued through a branch of a global transaction: there iff the transaction committed."""
    url = request.getfixturevalue("pg_db" if kind == "postgresql" else "maria_db")("app")
    tm = qtp.TransactionManager("store-node", tmp_path, recovery_interval=None)
    tm.add_resource("app", url)
    store = SqlStore("app", sqlalchemy.create_engine(url))
    store.create()
    with pytest.raises(ZeroDivisionError):
        with tm.transaction() as tx:
            store.enqueue(tx.connection("app"), _out("orders", 1))
            1 / 0
    with tm.transaction() as tx:
        store.enqueue(tx.connection("app"), _out("orders", 2))
    with store.local() as s:
        assert [m.message_id for m in store.unnumbered(s, "orders", 10)] == ["urn:uuid:orders-2"]
    tm.close()


@pytest.mark.parametrize("kind", ["postgresql", "mariadb"])
def test_concurrent_senders_do_not_wait_for_each_other(kind, request, tmp_path):
    """Two transactions enqueue on one route; the first stays open (holding whatever it locked) while the
    second enqueues and commits. If enqueue took a shared lock the second would block until the timeout."""
    url = request.getfixturevalue("pg_db" if kind == "postgresql" else "maria_db")("app")
    tm = qtp.TransactionManager("store-node", tmp_path, recovery_interval=None)
    tm.add_resource("app", url)
    store = SqlStore("app", sqlalchemy.create_engine(url))
    store.create()
    holding, release, done = threading.Event(), threading.Event(), []

    def first() -> None:
        with tm.transaction() as tx:
            store.enqueue(tx.connection("app"), _out("orders", 1))
            holding.set()
            release.wait(30)
        done.append("first")

    thread = threading.Thread(target=first)
    thread.start()
    assert holding.wait(30)
    started = time.monotonic()
    with tm.transaction(timeout=5) as tx:
        store.enqueue(tx.connection("app"), _out("orders", 2))
    waited = time.monotonic() - started
    release.set()
    thread.join(30)
    assert done == ["first"] and waited < 4
    with store.local() as s:
        assert store.backlog(s, "orders") == 2
    tm.close()


def test_summary_counts_for_operators(store):
    with store.local() as s:
        for i in range(3):
            store.enqueue(s, _out("orders", i))
        store.store_incoming(s, _in("urn:d", 1))
        store.store_incoming(s, _in("urn:d", 2))
    with store.local() as s:
        first = store.unnumbered(s, "orders", 1)
        store.assign(s, "k1", [(first[0].seq, 1)])
        store.dead_letter(s, store.incoming(s, "urn:d", 1)[0], "boom", 1.0)
    with store.local() as s:
        summary = store.summary(s)
    assert summary.outgoing == {("orders", "k1"): (1, 1000.0), ("orders", None): (2, 1001.0)}
    assert summary.incoming == {"urn:d": 1} and summary.dead_letters == 1


def test_a_store_refuses_an_autocommit_engine(maria_db):
    """A MySQL XA resource's engine autocommits: a store on it would commit statement by statement."""
    engine = sqlalchemy.create_engine(maria_db("auto"), connect_args={"autocommit": True})
    with pytest.raises(qtp.errors.ConfigurationError, match="autocommits"):
        SqlStore("auto", engine).create()
    engine.dispose()


def test_incoming_from_a_number_with_a_limit(store):
    with store.local() as s:
        for number in (5, 1, 3, 2, 4):
            store.store_incoming(s, _in("urn:d", number))
    with store.local() as s:
        assert [m.number for m in store.incoming(s, "urn:d", start=2, limit=3)] == [2, 3, 4]
        assert [m.number for m in store.incoming(s, "urn:d", start=5)] == [5]


def test_applied_message_ids_are_remembered_once_and_forgotten_after_their_retention(store):
    """A copy of a message sent again in a new sequence is recognised by its MessageID after the original
    was applied and its stored row consumed; remembering an id twice fails (the apply of a second copy
    cannot commit); the retention sweep forgets only ids older than its cutoff."""
    with store.local() as s:
        assert store.store_incoming(s, _in("urn:old", 1))
    with store.local() as s:
        original = store.incoming(s)[0]
        assert store.consume_many(s, "urn:old", [1]) == 1
        store.remember_applied(s, [original.message_id], 100.0)
    with store.local() as s:
        assert store.incoming(s) == []  # the row is gone: the id alone remembers it
        assert store.applied_before(s, [original.message_id, "urn:uuid:other"]) == {original.message_id}
    with pytest.raises((DuplicateApplyError, sqlalchemy.exc.IntegrityError)):
        with store.local() as s:
            store.remember_applied(s, [original.message_id], 101.0)
    with store.local() as s:
        store.remember_applied(s, ["urn:uuid:later"], 200.0)
        assert store.consume_many(s, "urn:old", [1]) == 0  # consumed already: a second delivery finds nothing
    with store.local() as s:
        assert store.forget_applied(s, before=150.0, limit=10) == 1
    with store.local() as s:
        assert store.applied_before(s, [original.message_id, "urn:uuid:later"]) == {"urn:uuid:later"}
