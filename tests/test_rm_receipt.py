"""Apply on receipt (``[limits] apply_on_receipt``, xa mode): a message that is next in its sequence, with
nothing of its sequence waiting for the invoker, is applied in the global transaction that stores it. Judged
from the databases: a trigger on ``qtp_rm_incoming`` counts the rows the node wrote there (a message applied
on receipt never is one), and ``items`` holds what the handlers committed."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import pytest
import sqlalchemy

import qtp
from qtp.embedded import free_port
from qtp.errors import ConfigurationError
from qtp.testing.nodes import post_as, request, wait_until
from qtp.wsrm.codec import decode
from qtp.wsrm.protocol import CreateSequence, CreateSequenceResponse, Sequence
from qtp.wsrm.runtime import Limits, Node, NodeSettings
from qtp.wsrm.runtime._settings import ChannelSettings, limits as parse_limits

from test_rm_transfer import _items

ACTION = "urn:qtp:test/a"


def _execute(url: str, *statements: str) -> None:
    engine = sqlalchemy.create_engine(url)
    with engine.begin() as conn:
        for statement in statements:
            conn.execute(sqlalchemy.text(statement))
    engine.dispose()


def _scalar(url: str, query: str) -> Any:
    engine = sqlalchemy.create_engine(url)
    with engine.connect() as conn:
        value = conn.execute(sqlalchemy.text(query)).scalar_one()
    engine.dispose()
    return value


def _count_stored_rows(url: str) -> None:
    """Every row inserted into ``qtp_rm_incoming`` (committed) adds one to ``stored_rows``."""
    _execute(url,
             "CREATE TABLE stored_rows (number INTEGER NOT NULL)",
             "CREATE FUNCTION count_stored() RETURNS trigger AS $$ BEGIN "
             "INSERT INTO stored_rows VALUES (NEW.number); RETURN NEW; END $$ LANGUAGE plpgsql",
             "CREATE TRIGGER count_stored AFTER INSERT ON qtp_rm_incoming FOR EACH ROW EXECUTE FUNCTION count_stored()")


def _stored_rows(url: str) -> int:
    return int(_scalar(url, "SELECT count(*) FROM stored_rows"))


def _receiver(url: str, logs: Path, handler: Callable[[Any, Any], None], limits: Limits | None = None,
              on_receipt: bool = True, queued_too: str | None = None) -> Node:
    """A started node whose ``handler`` takes ACTION (and, with ``queued_too``, that action, registered with
    on_receipt=False)."""
    _execute(url, "CREATE TABLE items (n INTEGER NOT NULL)")
    tm = qtp.TransactionManager(f"r-{uuid.uuid4().hex[:6]}", logs, recovery_interval=None)
    tm.add_resource("app", url)
    node = Node(tm, NodeSettings(endpoint=f"http://127.0.0.1:{free_port()}/rm", store="app",
                                 limits=limits or Limits()))
    node.handler(ACTION, on_receipt=on_receipt)(handler)
    if queued_too is not None:
        node.handler(queued_too, on_receipt=False)(handler)
    node.start()
    _count_stored_rows(url)
    return node


def _insert(tx: Any, message: Any) -> int:
    number = int(message.payload.decode()[3:-4])
    tx.connection("app").execute(sqlalchemy.text("INSERT INTO items (n) VALUES (:n)"), {"n": number})
    return number


def _record(tx: Any, message: Any) -> None:
    _insert(tx, message)


def _send(receiver: Node, url: str, logs: Path, count: int, pause: float = 0.0) -> Node:
    """A sender node on ``url`` that commits ``count`` messages to ``receiver``, one after the other."""
    tm = qtp.TransactionManager(f"s-{uuid.uuid4().hex[:6]}", logs, recovery_interval=None)
    tm.add_resource("app", url)
    sender = Node(tm, NodeSettings(store="app", channels={"out": ChannelSettings("out", peer=receiver.endpoint,
                                                                                  store="app")})).start()
    qtp.install(sender.manager)
    for i in range(count):
        with qtp.transaction() as tx:
            tx.send("out", f"<i>{i}</i>".encode(), action=ACTION)
        if pause:
            time.sleep(pause)
    return sender


@pytest.fixture
def nodes():
    made: list[Node] = []
    yield made
    qtp.install(None)
    for node in made:
        node.close()


def test_a_message_next_in_its_sequence_never_becomes_a_stored_row(pg_db, tmp_path, nodes):
    url = pg_db("receiver")
    threads: set[str] = set()

    def handler(tx, message):
        threads.add(threading.current_thread().name)
        _insert(tx, message)

    nodes.append(_receiver(url, tmp_path / "r", handler))
    nodes.append(_send(nodes[0], pg_db("sender"), tmp_path / "s", 100))
    wait_until(lambda: len(_items(url)) >= 100, 60, "100 applied")
    assert _items(url) == list(range(100))
    assert _stored_rows(url) == 0  # each was applied in the commit that stored it: no row to insert and delete
    assert not any(name.startswith("qtp-invoker") for name in threads)


def test_turned_off_every_message_is_stored_first_and_applied_by_the_invoker(pg_db, tmp_path, nodes):
    url = pg_db("receiver")
    nodes.append(_receiver(url, tmp_path / "r", _record, Limits(apply_on_receipt=False)))
    nodes.append(_send(nodes[0], pg_db("sender"), tmp_path / "s", 50))
    wait_until(lambda: len(_items(url)) >= 50, 60, "50 applied")
    assert _items(url) == list(range(50))
    assert _stored_rows(url) == 50


def test_a_handler_registered_not_on_receipt_gets_stored_messages(pg_db, tmp_path, nodes):
    url = pg_db("receiver")
    nodes.append(_receiver(url, tmp_path / "r", _record, on_receipt=False))
    nodes.append(_send(nodes[0], pg_db("sender"), tmp_path / "s", 30))
    wait_until(lambda: len(_items(url)) >= 30, 60, "30 applied")
    assert _items(url) == list(range(30))
    assert _stored_rows(url) == 30


def test_a_handler_that_fails_on_receipt_rolls_back_and_its_message_is_stored_and_applied_once(pg_db, tmp_path,
                                                                                               nodes):
    """The failed receipt transaction leaves nothing (its INSERT into items rolled back with it); the message
    is stored, acknowledged and applied by the invoker, with its attempts counted from there."""
    url = pg_db("receiver")
    failures: list[int] = []

    def handler(tx, message):
        number = _insert(tx, message)
        if number == 7 and not failures:
            failures.append(number)
            raise ValueError("7 fails once")

    nodes.append(_receiver(url, tmp_path / "r", handler, Limits(retry_backoff=0.05, retry_backoff_max=0.1)))
    nodes.append(_send(nodes[0], pg_db("sender"), tmp_path / "s", 20, pause=0.01))
    wait_until(lambda: len(_items(url)) >= 20, 60, "20 applied")
    assert failures == [7]
    assert _items(url) == list(range(20))  # 7 once: its first INSERT went with the rolled-back receipt
    assert _stored_rows(url) >= 1  # 7 at least went the invoker's way


def test_a_handler_slower_than_the_budget_is_left_to_the_invoker_for_a_while(pg_db, tmp_path, nodes):
    """The acknowledgement of a message applied on receipt waits for its handler: one that took longer than
    0.1 s (per message) has its next messages stored and acknowledged first."""
    url = pg_db("receiver")

    def handler(tx, message):
        if _insert(tx, message) == 0:
            time.sleep(0.3)

    nodes.append(_receiver(url, tmp_path / "r", handler))
    nodes.append(_send(nodes[0], pg_db("sender"), tmp_path / "s", 1))
    wait_until(lambda: len(_items(url)) >= 1, 60, "the slow one applied")
    assert _stored_rows(url) == 0  # it was applied on receipt, slowly
    sender = nodes[1]
    qtp.install(sender.manager)
    for i in range(1, 11):
        with qtp.transaction() as tx:
            tx.send("out", f"<i>{i}</i>".encode(), action=ACTION)
    wait_until(lambda: len(_items(url)) >= 11, 60, "11 applied")
    assert _items(url) == list(range(11))
    assert _stored_rows(url) == 10


def test_apply_on_receipt_is_a_boolean_setting():
    assert parse_limits({"apply_on_receipt": False}).apply_on_receipt is False
    assert Limits().apply_on_receipt is True
    with pytest.raises(ConfigurationError, match="apply_on_receipt must be true or false"):
        parse_limits({"apply_on_receipt": 1})


def test_a_message_that_arrives_before_the_one_it_follows_waits_and_order_is_kept(pg_db, tmp_path, nodes):
    """2 comes first and is stored (1 is missing); 1 is then applied on receipt and 2 right after it by the
    invoker; 3, once 2 is applied, on receipt again."""
    url = pg_db("receiver")
    order: list[int] = []

    def handler(tx, message):
        order.append(_insert(tx, message))

    node = _receiver(url, tmp_path / "r", handler)
    nodes.append(node)
    anonymous = "http://www.w3.org/2005/08/addressing/anonymous"

    def post(envelope) -> Any:
        answer = post_as(node.endpoint, envelope, None, "")
        assert answer.status_code in (200, 202), answer.text
        return decode(answer.content) if answer.content else None

    created = post(request(CreateSequence(anonymous), to=node.endpoint)).body
    assert isinstance(created, CreateSequenceResponse)

    def message(n: int) -> None:
        post(request(sequence=Sequence(created.identifier, n), payload=f"<i>{n}</i>".encode(), action=ACTION,
                     to=node.endpoint))

    message(2)
    assert _stored_rows(url) == 1 and order == []
    message(1)
    wait_until(lambda: len(_items(url)) >= 2, 30, "1 and 2 applied")
    message(3)
    wait_until(lambda: len(_items(url)) >= 3, 30, "3 applied")
    assert order == [1, 2, 3] and _items(url) == [1, 2, 3]
    assert _stored_rows(url) == 1  # only 2, which came before 1


def test_an_action_registered_not_on_receipt_stays_off_it_in_a_request_that_mixes_actions(pg_db, tmp_path, nodes):
    """One function handles two actions, one of them registered with on_receipt=False: in a batch that mixes
    them, only the other action's messages may run in the receiving commit (found by an outside tester: the
    head of a request was checked by its first message's action only)."""
    url = pg_db("receiver")
    threads: dict[str, set[str]] = {"a": set(), "b": set()}

    def handler(tx, message):
        threads[message.action[-1]].add(threading.current_thread().name)
        _insert(tx, message)

    node = _receiver(url, tmp_path / "r", handler, queued_too="urn:qtp:test/b")  # one function, two actions
    nodes.append(node)
    tm = qtp.TransactionManager(f"s-{uuid.uuid4().hex[:6]}", tmp_path / "s", recovery_interval=None)
    tm.add_resource("app", pg_db("sender"))
    sender = Node(tm, NodeSettings(store="app", channels={"out": ChannelSettings("out", peer=node.endpoint,
                                                                                  store="app")})).start()
    nodes.append(sender)
    qtp.install(sender.manager)

    def send(start: int) -> None:
        for i in range(start, 240, 6):
            with qtp.transaction() as tx:
                tx.send("out", f"<i>{i}</i>".encode(), action="urn:qtp:test/b" if i % 16 == 9 else ACTION)

    workers = [threading.Thread(target=send, args=(k,)) for k in range(6)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    wait_until(lambda: len(_items(url)) >= 240, 60, "240 applied")
    assert _items(url) == list(range(240))
    assert threads["b"] and all(name.startswith("qtp-invoker") for name in threads["b"]), threads["b"]
    assert any(not name.startswith("qtp-invoker") for name in threads["a"])  # and the others on receipt
