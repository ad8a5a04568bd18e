"""The Invoker built alone: on the memory store, with a fake clock and fake transactions (commit runs the
``on_commit`` callbacks, so the memory mode's dequeue is replayed after the handler's transaction), driven by
``step()``: no worker thread, no database, no sleep. In order, batches, retries with backoff, dead letters and
their per-peer cap, transient failures, replies on the offered sequence, the end of a sequence, and a message
that no handler takes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fakes_runtime import FakeClock, FakeTransactions
from qtp.errors import ResourceUnavailableError
from qtp.wsrm.protocol import DestinationRecord, DestinationState, RMVersion
from qtp.wsrm.runtime._invoker import Invoker, _Batch
from qtp.wsrm.runtime._metrics import Metrics
from qtp.wsrm.runtime._node import HandlerTable
from qtp.wsrm.runtime._offers import offer_route
from qtp.wsrm.runtime._ports import Wake
from qtp.wsrm.runtime._sequences import Destinations, Inbound
from qtp.wsrm.runtime._settings import Limits
from qtp.wsrm.runtime._stores import Enlisted
from qtp.wsrm.store import DestinationInfo, Incoming, MemoryStore

ACTION = "urn:test:do"
SEQ = "urn:uuid:seq-1"


OFFERED = "urn:uuid:offered-by-us"


class Refused(Exception):
    """What a handler raises to refuse a message (not transient: counts as an attempt)."""


@dataclass
class Rig:
    invoker: Invoker
    store: MemoryStore
    destinations: Destinations
    handlers: HandlerTable
    transactions: FakeTransactions
    clock: FakeClock
    wake: Wake
    finished: list[str] = field(default_factory=list)
    applied: list[tuple[str, int]] = field(default_factory=list)

    def sequence(self, identifier: str = SEQ, owner: str | None = None, offer: str | None = None) -> None:
        """An inbound sequence ``identifier`` of peer ``owner``, which offered ``offer`` for replies."""
        record = DestinationRecord(identifier, RMVersion.WSRM11, state=DestinationState.ACTIVE, accepted_offer=offer)
        self.destinations.add(Inbound(DestinationInfo(owner=owner), record))
        self.invoker.ensure(identifier)

    def arrive(self, *numbers: int, identifier: str = SEQ, action: str = ACTION) -> None:
        """Messages stored by the receiver, and the invoker told (as the receiver does, after the commit)."""
        for number in numbers:
            with self.store.local() as s:
                self.store.store_incoming(s, Incoming(identifier, number, f"urn:uuid:{identifier[-5:]}-m{number}",
                                                      action, f"<o xmlns='urn:test'>{number}</o>".encode(),
                                                      received_at=self.clock.time()))
            self.invoker.stored(identifier, number)

    def record(self, tx: Any, message: Incoming) -> None:
        self.applied.append((message.identifier, message.number))

    def drain(self) -> int:
        """Step until nothing is due now; how many steps delivered something."""
        steps = 0
        while self.invoker.step():
            steps += 1
            assert steps < 1000
        return steps

    def waiting(self, identifier: str = SEQ) -> list[Incoming]:
        with self.store.local() as s:
            return self.store.incoming(s, identifier)

    def dead_letters(self) -> list[tuple[str | None, str, int]]:
        with self.store.local() as s:
            return [(d.peer, d.message.identifier, d.message.number) for d in self.store.dead_letters(s)]


def build(limits: Limits | None = None) -> Rig:
    limits, clock, store = limits or Limits(), FakeClock(), MemoryStore("winv")
    destinations, handlers, transactions, wake = Destinations(), HandlerTable(), FakeTransactions(), Wake()
    finished: list[str] = []
    invoker = Invoker(limits, store, destinations, handlers, transactions.transaction,
                      lambda tx: Enlisted(store, tx, None, atomic=False), finished.append,
                      Metrics("winv", lambda: 0, lambda: 0), wake, clock)
    rig = Rig(invoker, store, destinations, handlers, transactions, clock, wake, finished)
    handlers.requests[ACTION] = rig.record
    return rig


def failing(rig: Rig, error: BaseException, times: int) -> None:
    """The handler fails ``times`` times with ``error``, then applies."""
    left = [times]

    def handler(tx: Any, message: Incoming) -> None:
        if left[0] > 0:
            left[0] -= 1
            raise error
        rig.record(tx, message)
    rig.handlers.requests[ACTION] = handler


def test_messages_are_applied_in_number_order_whatever_order_they_were_stored_in() -> None:
    rig = build(Limits(invoker_batch=1))
    rig.sequence()
    rig.arrive(3, 2)
    assert rig.drain() == 0  # 1 is missing: nothing may be applied yet
    rig.arrive(1)
    rig.drain()
    assert rig.applied == [(SEQ, 1), (SEQ, 2), (SEQ, 3)]
    assert rig.waiting() == []
    with rig.store.local() as s:
        assert [r.delivered for r in rig.store.invokers(s)] == [((1, 3),)]


def batch_handler(rig: Rig, fails_beyond: int | None = None) -> list[list[int]]:
    """Registers a batch handler that refuses batches of more than ``fails_beyond`` messages; the numbers
    of each call."""
    calls: list[list[int]] = []

    def batch(tx: Any, messages: list[Incoming]) -> None:
        calls.append([m.number for m in messages])
        if fails_beyond is not None and len(messages) > fails_beyond:
            raise Refused("one row of the batch breaks a constraint")
    rig.handlers.requests[ACTION] = _Batch(batch)
    return calls


def test_a_batch_handler_gets_consecutive_messages_in_one_transaction() -> None:
    rig = build()
    rig.sequence()
    calls = batch_handler(rig)
    rig.arrive(1, 2, 3)
    rig.drain()
    assert calls == [[1, 2, 3]]
    assert rig.transactions.committed == 1
    assert rig.waiting() == []


def test_a_failed_batch_is_applied_again_one_message_per_transaction() -> None:
    """Not batched again from its second message on (that was quadratic: a batch of 128 failing for good
    tried 127 shrinking batches)."""
    rig = build()
    rig.sequence()
    calls = batch_handler(rig, fails_beyond=1)
    rig.arrive(1, 2, 3)
    rig.drain()
    assert calls == [[1, 2, 3], [1], [2], [3]]
    assert rig.waiting() == [] and rig.dead_letters() == []


def test_a_failing_handler_is_retried_after_a_doubling_backoff_then_becomes_a_dead_letter() -> None:
    rig = build(Limits(max_attempts=3, retry_backoff=1.0, invoker_batch=1))
    rig.sequence(owner="alice")
    failing(rig, Refused("no such customer"), times=99)
    rig.arrive(1, 2)
    for attempts, backoff in ((1, 1.0), (2, 2.0)):
        assert rig.drain() == 1
        assert [m.attempts for m in rig.waiting()][:1] == [attempts]
        rig.clock.advance(backoff - 0.01)
        assert rig.drain() == 0  # not before its backoff
        rig.clock.advance(0.01)
    rig.drain()
    assert rig.dead_letters()[:1] == [("alice", SEQ, 1)]
    with rig.store.local() as s:
        assert "no such customer" in rig.store.dead_letters(s)[0].error
    assert 1 not in [m.number for m in rig.waiting()]  # the sequence moved on: 2 is tried next


def test_dead_letters_are_capped_per_peer_and_one_peer_at_its_cap_does_not_hold_another() -> None:
    rig = build(Limits(max_attempts=1, max_dead_letters=1, invoker_batch=1))
    rig.sequence("urn:uuid:alice", owner="alice")
    rig.sequence("urn:uuid:bob", owner="bob")
    failing(rig, Refused("refused"), times=99)
    rig.arrive(1, 2, identifier="urn:uuid:alice")
    rig.drain()
    assert rig.dead_letters() == [("alice", "urn:uuid:alice", 1)]
    assert [(m.number, m.attempts) for m in rig.waiting("urn:uuid:alice")] == [(2, 1)]  # kept: alice is at its cap
    rig.arrive(1, identifier="urn:uuid:bob")
    rig.drain()
    assert sorted(rig.dead_letters()) == [("alice", "urn:uuid:alice", 1), ("bob", "urn:uuid:bob", 1)]


def test_a_transient_failure_delays_the_message_without_counting_an_attempt() -> None:
    rig = build(Limits(max_attempts=2, retry_backoff=1.0))
    rig.sequence()
    failing(rig, ResourceUnavailableError("the database is restarting"), times=4)
    rig.arrive(1)
    for outage in range(1, 5):
        assert rig.drain() == 1
        assert [m.attempts for m in rig.waiting()] == [0]
        rig.clock.advance(Limits(retry_backoff=1.0).backoff(outage))
    rig.drain()
    assert rig.applied == [(SEQ, 1)] and rig.dead_letters() == []


def test_a_reply_is_enqueued_on_the_sequence_the_peer_offered_when_the_transaction_commits() -> None:
    rig = build()
    rig.sequence(offer="urn:uuid:offer-1")
    rig.handlers.requests[ACTION] = lambda tx, message: b"<r xmlns='urn:test'>ok</r>"
    rig.arrive(1)
    woken = rig.wake.calls
    rig.drain()
    with rig.store.local() as s:
        replies = rig.store.unnumbered(s, offer_route("urn:uuid:offer-1"), 10)
    assert [(r.action, r.relates_to, r.payload) for r in replies] == \
        [(ACTION + "Response", "urn:uuid:seq-1-m1", b"<r xmlns='urn:test'>ok</r>")]
    assert rig.wake.calls > woken  # the sender is told there is a reply to send


def test_a_handler_that_raises_leaves_the_message_stored_and_enqueues_no_reply() -> None:
    rig = build(Limits(max_attempts=5))
    rig.sequence(offer="urn:uuid:offer-1")

    def handler(tx: Any, message: Incoming) -> bytes:
        raise Refused("not now")
    rig.handlers.requests[ACTION] = handler
    rig.arrive(1)
    rig.drain()
    assert [m.number for m in rig.waiting()] == [1] and rig.transactions.rolled_back == 1
    with rig.store.local() as s:
        assert rig.store.unnumbered(s, offer_route("urn:uuid:offer-1"), 10) == []


def test_finished_is_called_once_a_completed_sequence_is_fully_applied() -> None:
    rig = build(Limits(invoker_batch=1))
    rig.sequence()
    rig.arrive(1, 2)
    rig.invoker.completed(SEQ, ((1, 2),))
    assert rig.invoker.step()
    assert rig.finished == [] and rig.invoker.pending(SEQ)
    assert rig.invoker.step()
    assert rig.finished == [SEQ] and not rig.invoker.pending(SEQ)


def test_a_message_no_handler_takes_becomes_a_dead_letter_at_once() -> None:
    rig = build(Limits(max_attempts=5))
    rig.sequence(owner="alice")
    rig.arrive(1, action="urn:test:gone")
    rig.arrive(2)
    rig.drain()
    assert rig.dead_letters() == [("alice", SEQ, 1)]
    with rig.store.local() as s:
        assert "no handler is registered for action 'urn:test:gone'" in rig.store.dead_letters(s)[0].error
    assert rig.applied == [(SEQ, 2)]  # the sequence goes on


def test_a_reply_with_no_reply_handler_waits_for_one_and_is_never_a_dead_letter() -> None:
    """The outside attack (F2): a reply on a channel without a reply handler became a dead letter, and `qtp
    dead-letters retry` sent it back as a request (no channel any more), so no reply handler could ever take
    it. A reply now waits, stored, until a node with the channel's reply handler applies it."""
    rig = build(Limits(max_attempts=2))
    rig.destinations.add(Inbound(DestinationInfo(channel="orders"), DestinationRecord(
        OFFERED, RMVersion.WSRM11, state=DestinationState.ACTIVE)))
    rig.invoker.ensure(OFFERED)
    rig.arrive(1, identifier=OFFERED, action=ACTION + "Response")
    for _ in range(5):
        rig.drain()
        rig.clock.advance(rig.invoker.limits.retry_backoff_max + 1)
    assert rig.dead_letters() == [] and [m.number for m in rig.waiting(OFFERED)] == [1]
    rig.handlers.replies["orders"] = rig.record
    rig.clock.advance(rig.invoker.limits.retry_backoff_max + 1)
    rig.drain()
    assert rig.applied == [(OFFERED, 1)] and rig.waiting(OFFERED) == []
