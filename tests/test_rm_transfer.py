"""The transfer path between two nodes in this process: in-order requests, batches, measured timeouts, and
the per-channel metrics that show them."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import NamedTuple

import pytest
import requests
import sqlalchemy

import qtp
from qtp.embedded import free_port
from qtp.errors import ConfigurationError
from qtp.testing.nodes import counter, wait_until
from qtp.wsrm.runtime import Limits, Node, NodeSettings
from qtp.wsrm.runtime._sequences import RoundTrip as _RoundTrip
from qtp.wsrm.runtime._settings import ChannelSettings, node_settings

ACTION = "urn:qtp:test/item"


def _items_table(url: str) -> None:
    """``items(n)`` in ``url``'s database, without a unique key: a second apply of a message leaves a second row."""
    engine = sqlalchemy.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sqlalchemy.text("CREATE TABLE items (n INTEGER NOT NULL)"))
    engine.dispose()


def _record_item(tx, payload: bytes) -> int:
    """The number in ``payload`` (``<i>n</i>``), inserted into ``items`` by the handler's transaction ``tx``."""
    number = int(payload.decode()[3:-4])
    tx.connection("app").execute(sqlalchemy.text("INSERT INTO items (n) VALUES (:n)"), {"n": number})
    return number


def _items(url: str) -> list[int]:
    """The numbers committed into ``items``, sorted, repeats kept."""
    engine = sqlalchemy.create_engine(url)
    with engine.connect() as conn:
        numbers = sorted(n for (n,) in conn.execute(sqlalchemy.text("SELECT n FROM items")))
    engine.dispose()
    return numbers


def _wait_applied_once(url: str, count: int, what: str) -> None:
    """Wait until ``items`` holds ``count`` rows, then check they are 0..count-1, each once: judged from the
    store, not from what the handlers saw (a rolled-back apply would be seen and not committed)."""
    wait_until(lambda: len(_items(url)) >= count, 60, what)
    assert _items(url) == list(range(count))


def _receiver(url: str, logs: Path, arrivals: list[int], applied: list[int]) -> Node:
    """A node on ``url``'s database that records the message numbers of its requests as they arrive (before
    anything is stored) and of its applies (in memory and, committed, in ``items``)."""
    _items_table(url)
    tm = qtp.TransactionManager(f"r-{uuid.uuid4().hex[:6]}", logs, recovery_interval=None)
    tm.add_resource("app", url)
    node = Node(tm, NodeSettings(endpoint=f"http://127.0.0.1:{free_port()}/rm", store="app"))
    lock = threading.Lock()
    handle, handle_batch = node.receiver.handle, node.receiver.handle_batch

    def spy(env, caller=None, room=None):
        if env.sequence is not None:
            with lock:
                arrivals.append(env.sequence.number)
        return handle(env, caller, room)

    def spy_batch(envs, caller=None):
        with lock:
            arrivals.extend(env.sequence.number for env in envs)
        return handle_batch(envs, caller)

    node.receiver.handle, node.receiver.handle_batch = spy, spy_batch

    @node.handler(ACTION)
    def record(tx, message):
        number = _record_item(tx, message.payload)
        with lock:
            applied.append(number)
        return message.payload  # the reply, when the sender offered a sequence for replies

    return node.start()


class Pair(NamedTuple):
    sender: Node
    receiver: Node
    arrivals: list[int]
    applied: list[int]
    sender_url: str
    receiver_url: str


@pytest.fixture
def pair(pg_db, tmp_path):
    """Factory: pair(batch) -> Pair, both nodes closed at the end. With ``replies``, the receiver answers each
    message and the sender's reply handler inserts the reply's number into the sender's ``items``."""
    made: list[Node] = []

    def make(batch: bool, lanes: int = 1, replies: bool = False) -> Pair:
        arrivals: list[int] = []
        applied: list[int] = []
        receiver_url, sender_url = pg_db("receiver"), pg_db("sender")
        receiver = _receiver(receiver_url, tmp_path / "receiver", arrivals, applied)
        _items_table(sender_url)
        tm = qtp.TransactionManager(f"s-{uuid.uuid4().hex[:6]}", tmp_path / "logs", recovery_interval=None)
        tm.add_resource("app", sender_url)
        channel = ChannelSettings("out", peer=receiver.endpoint, store="app", batch=batch, lanes=lanes,
                                  reply=replies)
        sender = Node(tm, NodeSettings(endpoint=f"http://127.0.0.1:{free_port()}/rm", store="app",
                                       channels={"out": channel}))
        if replies:
            @sender.reply_handler("out")
            def reply(tx, message) -> None:
                _record_item(tx, message.payload)
        sender.start()
        made.extend([sender, receiver])
        return Pair(sender, receiver, arrivals, applied, sender_url, receiver_url)

    yield make
    qtp.install(None)
    for node in made:
        node.close()


def _send(sender: Node, count: int, keys: int = 0) -> None:
    """``count`` messages committed at once, from 8 threads; with ``keys``, message i has key i % keys."""
    qtp.install(sender.manager)

    def send(start: int) -> None:
        for i in range(start, count, 8):
            with qtp.transaction() as tx:
                tx.send("out", f"<i>{i}</i>".encode(), action=ACTION, key=f"k{i % keys}" if keys else None)

    threads = [threading.Thread(target=send, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _first_arrivals(arrivals: list[int]) -> list[int]:
    """The numbers in the order of their first arrival (a retransmission may follow a later first send)."""
    return list(dict.fromkeys(arrivals))


def _metric(node: Node, name: str) -> float | None:
    return counter(node.endpoint.replace("/rm", "/metrics"), name)


def _requests_and_messages(node: Node) -> tuple[float | None, float | None]:
    """(requests sent, application messages they carried), retransmissions included, from one scrape (two
    scrapes could straddle a retransmission)."""
    body = requests.get(node.endpoint.replace("/rm", "/metrics"), timeout=5).text
    found = {line.split("{", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
             if line.startswith("qtp_channel_request_messages_")}
    return found.get("qtp_channel_request_messages_count"), found.get("qtp_channel_request_messages_sum")


def test_a_peer_without_batching_gets_one_request_at_a_time_in_number_order(pair):
    """What a strict destination (gSOAP at its defaults discards a message that arrives after a gap) needs:
    the first transmissions of a sequence arrive in number order, one message per request."""
    p = pair(batch=False)
    _send(p.sender, 120)
    _wait_applied_once(p.receiver_url, 120, "120 messages applied")
    assert _first_arrivals(p.arrivals) == list(range(1, 121)), p.arrivals[:130]
    sender = p.sender
    requests_sent, messages = _requests_and_messages(sender)
    assert requests_sent == messages, (requests_sent, messages)  # one message per request, retransmissions too


def _batched(node: Node) -> None:
    """Some request of ``node`` carried more than one message: fewer requests than messages transmitted (both
    count retransmissions, whose number varies with load; a request without batching carries one message)."""
    requests_sent, messages = _requests_and_messages(node)
    assert requests_sent is not None and messages is not None and requests_sent < messages, (requests_sent, messages)


def test_between_qtp_nodes_messages_travel_in_batches_and_the_channel_shows_its_state(pair):
    sender, receiver, arrivals, _, _, receiver_url = pair(batch=True)
    _send(sender, 400)
    _wait_applied_once(receiver_url, 400, "400 messages applied")
    assert _first_arrivals(arrivals) == list(range(1, 401))  # batches too go in number order
    _batched(sender)
    assert (_metric(receiver, "qtp_store_messages_count") or 0) < 400  # group commit: fewer commits than messages
    assert (_metric(sender, "qtp_channel_round_trip_seconds") or 0) > 0  # measured
    wait_until(lambda: _metric(sender, "qtp_channel_backlog") in (None, 0.0), 10, "nothing left unacknowledged")


def test_replies_on_the_offered_sequence_travel_in_batches_too(pair):
    p = pair(batch=True, replies=True)
    _send(p.sender, 300)
    _wait_applied_once(p.sender_url, 300, "300 replies applied")
    _batched(p.receiver)


def test_lanes_keep_each_keys_order_and_spread_keys_over_sequences(pair):
    """Ten keys over four lanes: each key's messages are applied in commit order, and more than one
    sequence carries them (the keys are spread)."""
    sender, receiver, _, applied, _, _ = pair(batch=True, lanes=4)
    qtp.install(sender.manager)
    for i in range(300):
        with qtp.transaction() as tx:
            tx.send("out", f"<i>{i}</i>".encode(), action=ACTION, key=f"k{i % 10}")
    wait_until(lambda: len(applied) == 300, 60, "300 messages applied")
    for key in range(10):
        mine = [i for i in applied if i % 10 == key]
        assert mine == sorted(mine), (key, mine)
    assert receiver.receiver.open_sequences() >= 2


def test_the_channel_metrics_show_what_waits_for_an_unreachable_peer(pg_db, tmp_path):
    tm = qtp.TransactionManager(f"s-{uuid.uuid4().hex[:6]}", tmp_path / "logs", recovery_interval=None)
    tm.add_resource("app", pg_db("sender"))
    channel = ChannelSettings("out", peer=f"http://127.0.0.1:{free_port()}/rm", store="app")
    sender = Node(tm, NodeSettings(endpoint=f"http://127.0.0.1:{free_port()}/rm", store="app",
                                   channels={"out": channel}, limits=Limits(http_timeout=1))).start()
    try:
        _send(sender, 3)
        time.sleep(1.0)
        assert _metric(sender, "qtp_channel_backlog") == 3
        assert (_metric(sender, "qtp_channel_oldest_message_age_seconds") or 0) >= 0.9
    finally:
        qtp.install(None)
        sender.close()


def test_the_retransmission_timeout_follows_rfc_6298():
    rtt = _RoundTrip(initial=1.0, low=0.2, high=30.0)
    assert rtt.timeout == 1.0  # nothing measured yet
    rtt.sample(0.1)
    assert (rtt.srtt, rtt.rttvar, rtt.timeout) == (0.1, 0.05, 0.30000000000000004)
    rtt.sample(0.3)
    assert rtt.srtt == pytest.approx(0.125) and rtt.rttvar == pytest.approx(0.0875)
    assert rtt.timeout == pytest.approx(0.475)
    for _ in range(50):
        rtt.sample(0.001)
    assert rtt.timeout == 0.2  # never below the floor
    rtt.sample(100.0)
    assert rtt.timeout == 30.0  # nor above the ceiling


@pytest.mark.parametrize(("table", "message"), [
    ({"lanes": 0}, "lanes must be a whole number from 1 to 64"),
    ({"lanes": 65}, "lanes must be a whole number"),
    ({"lanes": True}, "lanes must be a whole number"),
    ({"batch": "yes"}, "reply and batch must be true or false"),
])
def test_channel_settings_refuse_bad_lanes_and_batch(table, message):
    channel = {"peer": "http://127.0.0.1:1/rm", **table}
    with pytest.raises(ConfigurationError, match=message):
        node_settings({"node": {"store": "app"}, "channels": {"out": channel}}, {"app"})


def test_a_channel_name_cannot_look_like_a_lane():
    with pytest.raises(ConfigurationError, match="cannot contain '#'"):
        node_settings({"node": {"store": "app"}, "channels": {"a#1": {"peer": "http://h/rm"}}}, {"app"})


def test_keys_choose_lanes_stably():
    channel = ChannelSettings("orders", peer="http://h/rm", lanes=4)
    assert channel.routes() == ["orders", "orders#1", "orders#2", "orders#3"]
    assert channel.route_for(None) == "orders"
    assert {channel.route_for(f"customer-{i}") for i in range(100)} == set(channel.routes())
    assert channel.route_for("customer-7") == channel.route_for("customer-7")


def test_a_batch_handler_gets_consecutive_messages_and_a_failing_batch_is_retried_one_by_one(pg_db, tmp_path):
    calls: list[list[int]] = []
    url = pg_db("receiver")
    _items_table(url)
    tm = qtp.TransactionManager(f"r-{uuid.uuid4().hex[:6]}", tmp_path / "receiver", recovery_interval=None)
    tm.add_resource("app", url)
    receiver = Node(tm, NodeSettings(endpoint=f"http://127.0.0.1:{free_port()}/rm", store="app",
                                     limits=Limits(max_attempts=2, retry_backoff=0.05, retry_backoff_max=0.1)))

    @receiver.batch_handler(ACTION)
    def apply(tx, messages):
        numbers = [_record_item(tx, m.payload) for m in messages]
        calls.append(numbers)
        if 13 in numbers:
            raise ValueError("13 is refused")
        return None

    receiver.start()
    sender = _sender_to(receiver, pg_db("sender"), tmp_path)
    try:
        _send(sender, 200)
        wait_until(lambda: len(_items(url)) >= 199 and _metric(receiver, "qtp_messages_dead_lettered_total") == 1,
                   60, "199 applied and one dead letter")
        assert max(len(call) for call in calls) > 1
        assert [13] in calls  # after its batch failed, 13 alone
        assert _items(url) == [n for n in range(200) if n != 13]  # each committed once, 13's batch-mates too
    finally:
        qtp.install(None)
        sender.close()
        receiver.close()


def _sender_to(receiver: Node, url: str, tmp_path: Path) -> Node:
    """A started node on ``url`` with one channel, ``out``, to ``receiver``."""
    tm = qtp.TransactionManager(f"s-{uuid.uuid4().hex[:6]}", tmp_path / "logs", recovery_interval=None)
    tm.add_resource("app", url)
    channel = ChannelSettings("out", peer=receiver.endpoint, store="app")
    return Node(tm, NodeSettings(store="app", channels={"out": channel})).start()


def test_at_the_dead_letter_cap_a_failing_message_stays_queued(pg_db, tmp_path):
    url = pg_db("receiver")
    tm = qtp.TransactionManager(f"r-{uuid.uuid4().hex[:6]}", tmp_path / "receiver", recovery_interval=None)
    tm.add_resource("app", url)
    receiver = Node(tm, NodeSettings(endpoint=f"http://127.0.0.1:{free_port()}/rm", store="app",
                                     limits=Limits(max_attempts=1, max_dead_letters=1, retry_backoff_max=0.5)))
    tried: list[int] = []

    @receiver.handler(ACTION)
    def refuse(tx, message):
        tried.append(int(message.payload.decode()[3:-4]))
        raise ValueError("refused")

    receiver.start()
    sender = _sender_to(receiver, pg_db("sender"), tmp_path)
    try:
        _send(sender, 2)
        wait_until(lambda: len(tried) >= 4, 30, "the second message tried again and again")
        store = receiver.inbound_store
        with store.local() as s:
            assert store.summary(s).dead_letters == 1  # the first one
            assert [m.number for m in store.incoming(s)] == [2]  # the second waits in its queue
    finally:
        qtp.install(None)
        sender.close()
        receiver.close()
