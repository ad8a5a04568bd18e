"""The Receiver built alone: on the memory store, with a fake clock, a recording invoker and inline work; no node,
no socket, no database. What the end-to-end tests cover only as a whole: sequences created (with and without an
Offer), messages stored before they are acknowledged, duplicates, group commit, batches, the reload after a store
transaction whose outcome is unknown, the refusals made before anything is stored, ownership, Close/Terminate,
inactivity and forgetting."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import pytest

from fakes_runtime import FakeClock, FakeTransport, inline
from qtp.wsrm.codec import Addressing, Envelope, SoapFault, SoapVersion, WsaVersion, anonymous
from qtp.wsrm.protocol import (
    AckRequested,
    CloseSequence,
    CloseSequenceResponse,
    CreateSequence,
    CreateSequenceResponse,
    DestinationState,
    FaultCode,
    Offer,
    RMVersion,
    Sequence,
    SequenceAcknowledgement,
    SequenceFault,
    TerminateSequence,
    TerminateSequenceResponse,
)
from qtp.wsrm.protocol import _ranges as ranges
from qtp.wsrm.runtime._answers import NOTHING, Answer
from qtp.wsrm.runtime._mailbox import Mailbox
from qtp.wsrm.runtime._metrics import Metrics
from qtp.wsrm.runtime._offers import Offers, offer_route
from qtp.wsrm.runtime._ownership import Ownership
from qtp.wsrm.runtime._ports import Wake
from qtp.wsrm.runtime._receiver import Receiver
from qtp.wsrm.runtime._security import Peer, Security
from qtp.wsrm.runtime._sequences import Destinations, Sources
from qtp.wsrm.runtime._settings import Limits
from qtp.wsrm.store import Incoming, MemoryStore

ACTION = "urn:test:do"
ENDPOINT = "http://127.0.0.1:8001/rm"
CLIENT = "http://127.0.0.1:8002/rm"  # an anonymous peer may name loopback addresses of a loopback node
ALICE = Peer("alice", endpoint="http://alice.example/rm")
BOB = Peer("bob", endpoint="http://bob.example/rm")
W05 = WsaVersion.WSA200508
ANON = anonymous(W05)


class StoreWithFaults(MemoryStore):
    """The memory store, with a record of what each local transaction stored, and two faults on demand: a
    transaction that raises after its commit landed (its outcome unknown to the caller: ``fail_after_commit``),
    and one that waits, before its commit, until the test releases it (``hold``)."""

    def __init__(self) -> None:
        super().__init__("wrecv")
        self.stored_per_commit: list[list[int]] = []
        self._outcomes: list[bool] = []
        self.hold: threading.Event | None = None
        self.holding = threading.Event()

    @contextmanager
    def local(self) -> Iterator[Any]:
        with super().local() as s:
            yield s
            if self.hold is not None:
                hold, self.hold = self.hold, None
                self.holding.set()
                assert hold.wait(10), "the test never released the held commit"
        if self._outcomes and self._outcomes.pop(0):
            raise ConnectionError("the connection dropped after COMMIT was sent")

    def fail_after_commit(self, *pattern: bool) -> None:
        """What the next commits do: True lands, then raises; False lands."""
        self._outcomes = list(pattern or (True,))

    def store_incoming_many(self, s: Any, messages: list[Incoming]) -> None:
        self.stored_per_commit.append([m.number for m in messages])
        super().store_incoming_many(s, messages)

    def numbers(self, identifier: str) -> list[int]:
        with super().local() as s:
            return [m.number for m in self.incoming(s, identifier)]

    def record(self, identifier: str) -> Any:
        with super().local() as s:
            return next((r for _, r in self.destinations(s) if r.identifier == identifier), None)


class RecordingInvoker:
    """What the receiver tells the invoker (``Deliveries``), recorded; nothing is applied until ``apply``."""

    def __init__(self) -> None:
        self.told: dict[str, list[int]] = {}
        self.applied: dict[str, set[int]] = {}
        self.completions: list[tuple[str, Any]] = []

    def ensure(self, identifier: str) -> None:
        self.told.setdefault(identifier, [])

    def stored(self, identifier: str, number: int, message: Incoming | None = None) -> None:
        self.told.setdefault(identifier, []).append(number)

    def receipt(self, info: Any, record: Any, before: Any, messages: list[Incoming]) -> None:
        return None  # never applies on receipt: the receiver stores them itself

    def completed(self, identifier: str, received: Any) -> None:
        self.completions.append((identifier, received))

    def apply(self, identifier: str) -> None:
        self.applied[identifier] = set(self.told.get(identifier, ()))

    def _waiting(self, identifier: str) -> int:
        return len(set(self.told.get(identifier, ())) - self.applied.get(identifier, set()))

    def pending(self, identifier: str) -> bool:
        return self._waiting(identifier) > 0

    def backlog(self) -> int:
        return sum(self._waiting(i) for i in self.told)

    def backlog_of(self, identifiers: set[str]) -> int:
        return sum(self._waiting(i) for i in identifiers)


@dataclass
class SenderEvents:
    """What the receiver tells the sender."""

    acks: list[SequenceAcknowledgement] = field(default_factory=list)
    bodies: list[Any] = field(default_factory=list)

    def on_acks(self, acks: tuple[SequenceAcknowledgement, ...]) -> None:
        self.acks.extend(acks)

    def on_body(self, body: Any, key: str | None = None) -> None:
        self.bodies.append(body)


@dataclass
class Rig:
    receiver: Receiver
    store: StoreWithFaults
    invoker: RecordingInvoker
    outbound: SenderEvents
    sources: Sources
    clock: FakeClock
    transport: FakeTransport
    wake: Wake

    def create(self, caller: str | None = None, offer: Offer | None = None, message_id: str = "urn:uuid:cs-1") -> str:
        answer = self.receiver.handle(create_sequence(message_id, offer), caller)
        body = answer.envelope.body if answer.envelope is not None else None
        assert isinstance(body, CreateSequenceResponse), answer
        return body.identifier


def build(limits: Limits | None = None, store: StoreWithFaults | None = None) -> Rig:
    limits, clock = limits or Limits(), FakeClock()
    store = store or StoreWithFaults()
    security = Security(peers={p.name: p for p in (ALICE, BOB)}, allow_anonymous=True)
    metrics = Metrics("wrecv", lambda: 0, lambda: 0)
    sources, destinations, wake = Sources(), Destinations(), Wake()
    offers = Offers(store, sources, destinations, limits, security.peer_for_url, wake, clock)
    ownership = Ownership(destinations, sources, {}, security, metrics)
    invoker, outbound, transport = RecordingInvoker(), SenderEvents(), FakeTransport(lambda url, envelopes: NOTHING)
    receiver = Receiver(limits, security, "127.0.0.1", ENDPOINT, store, destinations, offers, outbound, invoker,
                        Mailbox(limits, metrics, sources, destinations, None, clock), ownership, metrics,
                        transport, inline, clock)
    return Rig(receiver, store, invoker, outbound, sources, clock, transport, wake)


def envelope(body: Any = None, message_id: str | None = None, **parts: Any) -> Envelope:
    return Envelope(soap=SoapVersion.SOAP12, rm=RMVersion.WSRM11, wsa=W05, body=body,
                    addressing=Addressing(action=parts.pop("action", None), to=ENDPOINT, message_id=message_id,
                                          reply_to=ANON), **parts)


def create_sequence(message_id: str, offer: Offer | None = None) -> Envelope:
    return envelope(CreateSequence(acks_to=ANON, offer=offer), message_id)


def message(identifier: str, number: int, action: str = ACTION) -> Envelope:
    return envelope(None, f"urn:uuid:m-{number}", action=action, sequence=Sequence(identifier, number),
                    payload=f"<o xmlns='urn:test'>{number}</o>".encode())


def acked(answer: Answer, identifier: str) -> tuple[tuple[int, int], ...]:
    """The ranges ``answer`` acknowledges for ``identifier`` (() when it acknowledges nothing of it)."""
    assert answer.envelope is not None and answer.status == 200, answer
    return next((a.ranges for a in answer.envelope.acks if a.identifier == identifier), ())


def fault_of(answer: Answer) -> Any:
    assert answer.envelope is not None and answer.status >= 400, answer
    return answer.envelope.body


# ---------------------------------------------------------------------------------------------- CreateSequence


def test_create_sequence_saves_the_destination_and_a_retransmitted_one_gets_the_same_sequence() -> None:
    rig = build()
    identifier = rig.create(message_id="urn:uuid:cs-1")
    assert rig.store.record(identifier).state is DestinationState.ACTIVE
    assert rig.create(message_id="urn:uuid:cs-1") == identifier
    assert rig.create(message_id="urn:uuid:cs-2") != identifier
    with rig.store.local() as s:
        assert len(rig.store.destinations(s)) == 2


def test_create_sequence_without_an_offer_creates_no_reply_sequence() -> None:
    rig = build()
    answer = rig.receiver.handle(create_sequence("urn:uuid:cs-1"))
    assert answer.envelope is not None and answer.envelope.body.accept_acks_to is None
    assert rig.store.record(answer.envelope.body.identifier).accepted_offer is None
    assert rig.sources.all() == []


def test_create_sequence_with_an_offer_creates_the_reply_sequence_in_the_same_commit() -> None:
    rig = build()
    answer = rig.receiver.handle(create_sequence("urn:uuid:cs-1", Offer("urn:uuid:offer-1", endpoint=CLIENT)))
    body = answer.envelope.body  # type: ignore[union-attr]
    assert body.accept_acks_to == ENDPOINT
    assert rig.store.record(body.identifier).accepted_offer == "urn:uuid:offer-1"
    with rig.store.local() as s:
        saved = rig.store.sources(s)
    assert [(info.route, info.peer, record.identifier) for info, record in saved] == \
        [(offer_route("urn:uuid:offer-1"), CLIENT, "urn:uuid:offer-1")]
    reply_sequence = rig.sources.by_identifier("urn:uuid:offer-1")
    assert reply_sequence is not None and reply_sequence.offered
    assert rig.wake.calls >= 1  # the sender is told it has a route to serve


def test_an_offer_of_an_identifier_in_use_is_refused() -> None:
    rig = build()
    rig.create(offer=Offer("urn:uuid:offer-1", endpoint=CLIENT))
    answer = rig.receiver.handle(create_sequence("urn:uuid:cs-2", Offer("urn:uuid:offer-1", endpoint=CLIENT)))
    assert fault_of(answer).code is FaultCode.CREATE_SEQUENCE_REFUSED


# ---------------------------------------------------------------------------------------------- messages


def test_a_message_is_stored_then_acknowledged_and_the_invoker_told() -> None:
    rig = build()
    identifier = rig.create()
    answer = rig.receiver.handle(message(identifier, 1))
    assert acked(answer, identifier) == ((1, 1),)
    with rig.store.local() as s:
        stored = rig.store.incoming(s, identifier)
    assert [(m.number, m.message_id, m.action, m.payload) for m in stored] == \
        [(1, "urn:uuid:m-1", ACTION, b"<o xmlns='urn:test'>1</o>")]
    assert rig.store.record(identifier).received == ((1, 1),)
    assert rig.invoker.told[identifier] == [1]


def test_a_message_whose_store_failed_is_not_acknowledged() -> None:
    rig = build()
    identifier = rig.create()
    rig.store.fail_after_commit()
    with pytest.raises(ConnectionError):
        rig.receiver.handle(message(identifier, 1))
    assert rig.invoker.told[identifier] == []  # nothing is applied from an answer the caller never got


def test_a_duplicate_is_acknowledged_again_without_being_stored_again() -> None:
    rig = build()
    identifier = rig.create()
    rig.receiver.handle(message(identifier, 1))
    rig.invoker.apply(identifier)
    with rig.store.local() as s:
        rig.store.consume(s, identifier, 1)  # applied: a second store would bring it back
    answer = rig.receiver.handle(message(identifier, 1))
    assert acked(answer, identifier) == ((1, 1),)
    assert rig.store.stored_per_commit == [[1]]
    assert rig.store.numbers(identifier) == []
    assert rig.invoker.told[identifier] == [1]


def test_requests_waiting_for_a_sequence_are_stored_in_one_commit() -> None:
    """Group commit: while message 1's commit runs (held), messages 2 and 3 of the same sequence queue; whoever
    takes the lock next stores both in ONE transaction, and each request gets its own acknowledgement."""
    rig = build()
    identifier = rig.create()
    seq = rig.receiver.destinations.get(identifier)
    assert seq is not None
    release = rig.store.hold = threading.Event()
    answers: dict[int, Answer] = {}

    def send(number: int) -> None:
        answers[number] = rig.receiver.handle(message(identifier, number))

    first = threading.Thread(target=send, args=(1,))
    first.start()
    assert rig.store.holding.wait(10)
    queued = _Queue(seq)
    others = [threading.Thread(target=send, args=(n,)) for n in (2, 3)]
    for thread in others:
        thread.start()
    assert queued.wait_for(2)
    release.set()
    for thread in [first, *others]:
        thread.join(10)
    assert sorted(map(sorted, rig.store.stored_per_commit)) == [[1], [2, 3]]
    assert rig.store.numbers(identifier) == [1, 2, 3]
    assert acked(answers[1], identifier) == ((1, 1),)
    for number in (2, 3):  # each answer acknowledges its own message and every one before it
        assert ranges.contains(acked(answers[number], identifier), number)
        assert ranges.contains(acked(answers[number], identifier), 1)


def test_when_a_group_commit_fails_no_request_of_the_group_is_acknowledged() -> None:
    """The commit of the group (messages 2 and 3, queued behind message 1) lands and then raises: both requests
    fail, neither is acknowledged; the invoker is told of each once (by the reload), and a retransmission is
    recognised as stored."""
    rig = build()
    identifier = rig.create()
    seq = rig.receiver.destinations.get(identifier)
    release = rig.store.hold = threading.Event()
    rig.store.fail_after_commit(False, True)
    outcomes: dict[int, Any] = {}

    def send(number: int) -> None:
        try:
            outcomes[number] = rig.receiver.handle(message(identifier, number))
        except Exception as exc:
            outcomes[number] = exc

    first = threading.Thread(target=send, args=(1,))
    first.start()
    assert rig.store.holding.wait(10)
    queued = _Queue(seq)
    others = [threading.Thread(target=send, args=(n,)) for n in (2, 3)]
    for thread in others:
        thread.start()
    assert queued.wait_for(2)
    release.set()
    for thread in [first, *others]:
        thread.join(10)
    assert acked(outcomes[1], identifier) == ((1, 1),)
    assert isinstance(outcomes[2], Exception) and isinstance(outcomes[3], Exception)
    assert sorted(rig.invoker.told[identifier]) == [1, 2, 3]  # the request that waited behind it reloaded
    assert acked(rig.receiver.handle(message(identifier, 3)), identifier) == ((1, 3),)
    assert sorted(rig.invoker.told[identifier]) == [1, 2, 3]
    assert sorted(map(sorted, rig.store.stored_per_commit)) == [[1], [2, 3]]


class _Queue(list):  # type: ignore[type-arg]
    """Stands in for a sequence's ``arrivals`` and says when ``n`` requests have queued in it."""

    def __init__(self, seq: Any):
        super().__init__()
        self._changed = threading.Condition()
        with seq.io:
            self.extend(seq.arrivals)
            seq.arrivals = self

    def append(self, item: Any) -> None:
        with self._changed:
            super().append(item)
            self._changed.notify_all()

    def wait_for(self, n: int) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: len(self) >= n, timeout=10)


def test_a_batch_stores_each_sequence_in_one_commit_and_acknowledges_all() -> None:
    rig = build()
    first, second = rig.create(message_id="urn:uuid:cs-1"), rig.create(message_id="urn:uuid:cs-2")
    batch = [message(first, 1), message(second, 1), message(first, 2), message(first, 3), message(second, 2)]
    answer = rig.receiver.handle_batch(batch)
    assert acked(answer, first) == ((1, 3),) and acked(answer, second) == ((1, 2),)
    assert sorted(rig.store.stored_per_commit) == [[1, 2], [1, 2, 3]]


def test_a_batch_with_a_message_of_another_peer_stores_nothing() -> None:
    rig = build()
    mine, theirs = rig.create("alice", message_id="urn:uuid:cs-1"), rig.create("bob", message_id="urn:uuid:cs-2")
    answer = rig.receiver.handle_batch([message(mine, 1), message(theirs, 1)], "alice")
    assert answer.status == 403
    assert rig.store.stored_per_commit == []


def test_ack_requested_is_answered_with_what_was_stored() -> None:
    rig = build()
    identifier = rig.create()
    rig.receiver.handle(message(identifier, 2))
    answer = rig.receiver.handle(envelope(None, "urn:uuid:a-1", ack_requests=(AckRequested(identifier),)))
    assert acked(answer, identifier) == ((2, 2),)


def test_with_an_addressable_acks_to_the_acknowledgement_is_posted_there_not_answered() -> None:
    rig = build()
    answer = rig.receiver.handle(envelope(CreateSequence(acks_to=CLIENT), "urn:uuid:cs-1"))
    identifier = answer.envelope.body.identifier  # type: ignore[union-attr]
    stored = rig.receiver.handle(message(identifier, 1))
    assert stored.envelope is None or not stored.envelope.acks
    [request] = rig.transport.requests
    acks = [(a.identifier, a.ranges) for env in request.envelopes for a in env.acks]
    assert request.url == CLIENT and acks == [(identifier, ((1, 1),))]


# ---------------------------------------------------------------------------------------------- stale reload


def test_after_a_commit_of_unknown_outcome_the_next_request_reloads_and_the_invoker_learns_what_landed() -> None:
    rig = build()
    identifier = rig.create()
    rig.store.fail_after_commit()
    with pytest.raises(ConnectionError):
        rig.receiver.handle(message(identifier, 1))  # its commit landed; the caller saw an error
    answer = rig.receiver.handle(message(identifier, 2))
    assert acked(answer, identifier) == ((1, 2),)  # the reload found 1 stored
    assert sorted(rig.invoker.told[identifier]) == [1, 2]
    assert rig.store.record(identifier).received == ((1, 2),)
    retransmitted = rig.receiver.handle(message(identifier, 1))
    assert acked(retransmitted, identifier) == ((1, 2),)
    assert rig.store.stored_per_commit == [[1], [2]]  # the retransmission is a duplicate, not stored again


# ---------------------------------------------------------------------------------------------- refusals


def test_a_message_no_handler_takes_is_stored_and_acknowledged_so_the_sequence_goes_on() -> None:
    """The outside attack (F1): refused before it was stored, a message with an unknown action left a gap that
    nothing fills (the sender retransmits it for ever), and every later message of the sequence, stored or not,
    waited behind it: one typo blocked the channel for good. It is stored and acknowledged; the invoker makes
    it a dead letter (with a fault for the client when it offered a sequence for replies), and the messages
    after it are applied."""
    rig = build()
    identifier = rig.create()
    answer = rig.receiver.handle(message(identifier, 1, action="urn:test:unknown"))
    assert acked(answer, identifier) == ((1, 1),)
    assert acked(rig.receiver.handle(message(identifier, 2)), identifier) == ((1, 2),)
    assert rig.store.numbers(identifier) == [1, 2] and sorted(rig.invoker.told[identifier]) == [1, 2]


def test_a_message_too_far_above_the_last_in_order_is_refused_before_it_is_stored() -> None:
    rig = build(Limits(max_gap=2))
    identifier = rig.create()
    assert isinstance(fault_of(rig.receiver.handle(message(identifier, 3))), SoapFault)
    assert acked(rig.receiver.handle(message(identifier, 2)), identifier) == ((2, 2),)
    assert rig.store.numbers(identifier) == [2]


def test_a_peer_whose_backlog_is_full_gets_503_before_storing_and_other_peers_go_on() -> None:
    rig = build(Limits(max_backlog_per_peer=2))
    mine = rig.create("alice", message_id="urn:uuid:cs-1")
    theirs = rig.create("bob", message_id="urn:uuid:cs-2")
    for number in (1, 2):
        rig.receiver.handle(message(mine, number), "alice")
    refused = rig.receiver.handle(message(mine, 3), "alice")
    assert refused.status == 503 and rig.store.numbers(mine) == [1, 2]
    assert acked(rig.receiver.handle(message(theirs, 1), "bob"), theirs) == ((1, 1),)
    rig.invoker.apply(mine)
    assert acked(rig.receiver.handle(message(mine, 3), "alice"), mine) == ((1, 3),)


def test_a_node_whose_invoker_backlog_is_full_gets_503_before_storing() -> None:
    rig = build(Limits(max_invoker_backlog=1))
    identifier = rig.create()
    rig.receiver.handle(message(identifier, 1))
    assert rig.receiver.handle(message(identifier, 2)).status == 503
    assert rig.store.numbers(identifier) == [1] and rig.store.record(identifier).received == ((1, 1),)


def test_a_peer_at_its_quota_of_sequences_is_refused_a_new_one_and_other_peers_are_not() -> None:
    rig = build(Limits(max_sequences_per_peer=1))
    rig.create("alice", message_id="urn:uuid:cs-1")
    refused = rig.receiver.handle(create_sequence("urn:uuid:cs-2"), "alice")
    assert fault_of(refused).code is FaultCode.CREATE_SEQUENCE_REFUSED
    rig.create("bob", message_id="urn:uuid:cs-3")


def test_a_node_at_its_open_sequences_is_refused_a_new_one_until_one_ends() -> None:
    rig = build(Limits(max_open_sequences=2))
    first = rig.create("alice", message_id="urn:uuid:cs-1")
    rig.create("bob", message_id="urn:uuid:cs-2")
    refused = rig.receiver.handle(create_sequence("urn:uuid:cs-3"))
    assert fault_of(refused).code is FaultCode.CREATE_SEQUENCE_REFUSED
    rig.receiver.handle(envelope(TerminateSequence(first), "urn:uuid:t-1"), "alice")
    rig.create(message_id="urn:uuid:cs-4")


# ---------------------------------------------------------------------------------------------- ownership


def test_another_peer_may_not_send_close_or_ask_for_acks_on_a_sequence() -> None:
    rig = build()
    identifier = rig.create("alice")
    assert rig.receiver.handle(message(identifier, 1), "bob").status == 403
    assert rig.receiver.handle(envelope(CloseSequence(identifier), "urn:uuid:c-1"), "bob").status == 403
    assert rig.receiver.handle(envelope(TerminateSequence(identifier), "urn:uuid:t-1"), "bob").status == 403
    assert rig.receiver.handle(envelope(None, "urn:uuid:a-1", ack_requests=(AckRequested(identifier),)),
                               "bob").status == 403
    assert rig.store.numbers(identifier) == []
    assert rig.store.record(identifier).state is DestinationState.ACTIVE


def test_a_create_sequence_that_reuses_another_peers_message_id_neither_gets_nor_hides_its_sequence() -> None:
    rig = build()
    mine = rig.create("alice", message_id="urn:uuid:cs-1")
    theirs = rig.create("bob", message_id="urn:uuid:cs-1")
    assert theirs != mine
    assert rig.create("alice", message_id="urn:uuid:cs-1") == mine  # alice's retransmission
    assert rig.create("bob", message_id="urn:uuid:cs-1") == theirs


def test_another_peer_may_not_acknowledge_the_replies_a_peer_offered_for() -> None:
    rig = build()
    rig.create("alice", offer=Offer("urn:uuid:offer-1", endpoint=ALICE.endpoint))
    ack = SequenceAcknowledgement("urn:uuid:offer-1", ((1, 1),))
    assert rig.receiver.handle(envelope(None, "urn:uuid:a-1", acks=(ack,)), "bob").status == 403
    assert rig.outbound.acks == []
    assert rig.receiver.handle(envelope(None, "urn:uuid:a-2", acks=(ack,)), "alice").status == 202
    assert rig.outbound.acks == [ack]


# ---------------------------------------------------------------------------------------------- the end


def test_close_then_terminate_end_the_sequence_and_tell_the_invoker_what_it_received() -> None:
    rig = build()
    identifier = rig.create()
    rig.receiver.handle(message(identifier, 1))
    closed = rig.receiver.handle(envelope(CloseSequence(identifier), "urn:uuid:c-1"))
    assert isinstance(closed.envelope.body, CloseSequenceResponse)  # type: ignore[union-attr]
    assert rig.store.record(identifier).state is DestinationState.CLOSED
    late = fault_of(rig.receiver.handle(message(identifier, 2)))
    assert isinstance(late, SequenceFault) and late.code is FaultCode.SEQUENCE_CLOSED
    assert rig.store.numbers(identifier) == [1]
    ended = rig.receiver.handle(envelope(TerminateSequence(identifier), "urn:uuid:t-1"))
    assert isinstance(ended.envelope.body, TerminateSequenceResponse)  # type: ignore[union-attr]
    assert rig.store.record(identifier).state is DestinationState.TERMINATED
    assert rig.invoker.completions == [(identifier, ((1, 1),))]


def test_a_silent_sequence_ends_after_its_inactivity_timeout() -> None:
    rig = build(Limits(inactivity_timeout=30.0))
    identifier = rig.create()
    rig.receiver.handle(message(identifier, 1))
    rig.clock.advance(29.0)
    rig.receiver.tick(rig.clock.time())
    assert rig.store.record(identifier).state is DestinationState.ACTIVE and rig.invoker.completions == []
    rig.clock.advance(2.0)
    rig.receiver.tick(rig.clock.time())
    assert rig.store.record(identifier).state is DestinationState.TERMINATED
    assert rig.store.record(identifier).end_reason == "InactivityTimeout"
    assert rig.invoker.completions == [(identifier, ((1, 1),))]


def test_an_ended_sequence_is_forgotten_after_ended_retention_once_its_messages_are_applied() -> None:
    rig = build(Limits(ended_retention=100.0))
    identifier = rig.create()
    rig.receiver.handle(message(identifier, 1))
    rig.receiver.handle(envelope(TerminateSequence(identifier), "urn:uuid:t-1"))
    rig.clock.advance(101.0)
    rig.receiver.tick(rig.clock.time())
    assert rig.store.record(identifier) is not None  # message 1 is not applied yet
    rig.invoker.apply(identifier)
    rig.receiver.tick(rig.clock.time())
    assert rig.store.record(identifier) is None and identifier not in rig.receiver.destinations
    late = fault_of(rig.receiver.handle(message(identifier, 2)))
    assert late.code is FaultCode.UNKNOWN_SEQUENCE


def test_an_ended_sequence_is_remembered_within_ended_retention() -> None:
    rig = build(Limits(ended_retention=100.0))
    identifier = rig.create()
    rig.receiver.handle(envelope(TerminateSequence(identifier), "urn:uuid:t-1"))
    rig.clock.advance(99.0)
    rig.receiver.tick(rig.clock.time())
    late = fault_of(rig.receiver.handle(message(identifier, 1)))
    assert late.code is FaultCode.SEQUENCE_TERMINATED
    assert ranges.count(rig.store.record(identifier).received) == 0
