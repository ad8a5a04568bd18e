"""The RM Source against a peer that forgets: two nodes in this process, a lossy proxy between them.

The receiving node keeps its sequences in memory (``mode = "memory"``), so closing it and starting a fresh one
on the same port is a peer that restarted without its state, as gSOAP's RM Destination does after a crash. It
answers the old sequence with UnknownSequence; the sender must end that sequence and send what was not
acknowledged again, in a new sequence and in the order the messages were enqueued.
"""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import qtp
from qtp.embedded import free_port
from qtp.testing.lossy_proxy import LossyProxy
from qtp.testing.nodes import wait_until
from qtp.wsrm.runtime import Limits, Node, NodeSettings
from qtp.wsrm.runtime._settings import ChannelSettings
from qtp.wsrm.store import SqlStore

ACTION = "urn:qtp:test/item"


def _receiver(port: int, logs: Path, seen: list[tuple[str, int, str]]) -> Node:
    """A node that keeps no messaging state: each message's (sequence, number, text) is appended to ``seen``."""
    tm = qtp.TransactionManager(f"r-{uuid.uuid4().hex[:6]}", logs, recovery_interval=None)
    settings = NodeSettings(endpoint=f"http://127.0.0.1:{port}/rm", mode="memory",
                            limits=Limits(retransmit_interval=0.2))
    node = Node(tm, settings)
    lock = threading.Lock()

    @node.handler(ACTION)
    def record(tx, message):
        with lock:
            seen.append((message.identifier, message.number, message.payload.decode()))

    return node.start()


def test_messages_of_a_sequence_the_peer_forgot_are_sent_again_in_their_order(pg_db, tmp_path):
    port = free_port()
    before: list[tuple[str, int, str]] = []
    receiver = _receiver(port, tmp_path / "receiver", before)
    url = pg_db("sender")
    tm = qtp.TransactionManager(f"s-{uuid.uuid4().hex[:6]}", tmp_path / "logs", recovery_interval=None)
    tm.add_resource("app", url)
    with LossyProxy(f"http://127.0.0.1:{port}/rm") as proxy:
        channel = ChannelSettings("out", peer=proxy.url, store="app")
        sender = Node(tm, NodeSettings(store="app", channels={"out": channel},
                                       limits=Limits(max_unacknowledged=3, retransmit_interval=0.2,
                                                     retransmit_interval_max=0.5))).start()
        store = sender.stores.for_route("out")
        assert isinstance(store, SqlStore)
        qtp.install(tm)

        def send(i: int) -> None:
            with qtp.transaction() as tx:
                tx.send("out", f"<i>{i}</i>".encode(), action=ACTION)

        def waiting() -> tuple[int, int]:
            """(messages numbered, messages not numbered) at the sender."""
            with store.local() as s:
                unnumbered = len(store.unnumbered(s, "out", 100))
                return store.backlog(s, "out") - unnumbered, unnumbered

        after: list[tuple[str, int, str]] = []
        try:
            send(0)
            wait_until(lambda: waiting() == (0, 0), 30, "message 0 acknowledged")
            proxy.set_faults(drop_response=1.0)  # the receiver applies 1..3; their acknowledgements are lost
            for i in (1, 2, 3):
                send(i)
            wait_until(lambda: len({text for _, _, text in before}) == 4, 30, "messages 1..3 received")
            for i in (4, 5):  # the window of 3 is full: these wait unnumbered behind 1..3
                send(i)
            assert waiting() == (3, 2)
            receiver.close()
            receiver = _receiver(port, tmp_path / "receiver", after)  # the same address, nothing remembered
            proxy.set_faults(drop_response=0.0)
            wait_until(lambda: waiting() == (0, 0), 30, "everything acknowledged by the restarted receiver")
        finally:
            qtp.install(None)
            sender.close()
            receiver.close()
    assert len({identifier for identifier, _, _ in before}) == 1
    assert len({identifier for identifier, _, _ in after}) == 1
    assert before[0][0] != after[0][0]
    assert [(number, text) for _, number, text in sorted(after)] == \
        [(n, f"<i>{i}</i>") for n, i in enumerate((1, 2, 3, 4, 5), start=1)]
