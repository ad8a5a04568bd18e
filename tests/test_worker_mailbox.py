"""WS-MakeConnection alone: the Mailbox (what a node holds for peers that poll) and the Poller (the loop of
a node that cannot listen), with a fake clock and a fake transport; no sockets, no sleeps, no threads.

The mailbox is asked as the receiver asks it (``answer(envelope, MakeConnection, caller)``); the sequences
it consults are real ``Outbound`` / ``Inbound`` objects in their registries. The poller polls a mailbox
through a fake transport, and its received messages go to a recording handler.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace

from fakes_runtime import FakeClock, FakeTransport, answer

from qtp.errors import TransportError
from qtp.wsrm.codec import (
    MAKE_CONNECTION_ACTION,
    MISSING_SELECTION,
    Addressing,
    BatchRoom,
    CheckedPayload,
    Envelope,
    MakeConnection,
    SoapFault,
    SoapVersion,
    WsaVersion,
    accepted_batch,
    decode,
    framed_size,
    mc_anonymous,
    mc_id,
)
from qtp.wsrm.protocol import (
    DestinationRecord,
    RMVersion,
    Sequence,
    SequenceAcknowledgement,
    SourceRecord,
    SourceSequence,
    SourceState,
    TerminateSequenceResponse,
)
from qtp.wsrm.protocol import _ranges as ranges
from qtp.wsrm.runtime._answers import NOTHING, Answer
from qtp.wsrm.runtime._mailbox import Mailbox, Poller
from qtp.wsrm.runtime._metrics import Metrics
from qtp.wsrm.runtime._ownership import Source
from qtp.wsrm.runtime._security import Security
from qtp.wsrm.runtime._transport import wire
from qtp.wsrm.runtime._sequences import Destinations, Inbound, Outbound, Sources
from qtp.wsrm.runtime._settings import ChannelSettings, Limits
from qtp.wsrm.store import DestinationInfo, SourceInfo

SERVER = "http://server.test/rm"
CLIENT = f"urn:uuid:{uuid.uuid4()}"  # the polling client's WS-MC id
ALICE, BOB = "alice", "bob"


@dataclass
class Box:
    """A mailbox with one of our offered sequences for ALICE's client (``out``) and one inbound sequence of
    hers whose acknowledgements are held for that client (``inbound``)."""

    mailbox: Mailbox
    clock: FakeClock
    sources: Sources
    out: Outbound
    inbound: str
    limits: Limits

    def hold(self, *numbers: int, owner: str | None = ALICE) -> None:
        for number in numbers:
            self.mailbox.hold(owner, CLIENT, message(self.out.identifier or "", number), self.out.key)

    def hold_ack(self, *numbers: int) -> None:
        self.mailbox.hold(ALICE, CLIENT, acknowledgement(self.inbound, *numbers))

    def poll(self, caller: str | None = ALICE, identifier: str | None = None, room: BatchRoom | None = None) -> Answer:
        body = MakeConnection(mc_anonymous(CLIENT), identifier)
        return self.mailbox.answer(poll_of(body), body, caller, room)

    def acknowledged(self, *numbers: int) -> None:
        """The peer acknowledged ``numbers`` of ``out`` (the sender applied it)."""
        record = self.out.machine.record
        self.out.machine = SourceSequence(replace(record, pending=tuple(p for p in record.pending
                                                                          if p[0] not in numbers)))


def message(identifier: str, number: int) -> Envelope:
    return Envelope(soap=SoapVersion.SOAP12, rm=RMVersion.WSRM11, wsa=WsaVersion.WSA200508,
                    sequence=Sequence(identifier, number), payload=CheckedPayload(f"<r n='{number}'/>".encode()),
                    addressing=Addressing(action="urn:test:reply", to=mc_anonymous(CLIENT),
                                          message_id=f"urn:uuid:{uuid.uuid4()}", reply_to=SERVER))


def acknowledgement(identifier: str, *numbers: int) -> Envelope:
    ack = SequenceAcknowledgement(identifier, ranges=ranges.from_numbers(numbers))
    return Envelope(soap=SoapVersion.SOAP12, rm=RMVersion.WSRM11, wsa=WsaVersion.WSA200508, acks=(ack,),
                    addressing=Addressing(action="http://docs.oasis-open.org/ws-rx/wsrm/200702/SequenceAcknowledgement",
                                          to=mc_anonymous(CLIENT), message_id=f"urn:uuid:{uuid.uuid4()}"))


def poll_of(body: MakeConnection) -> Envelope:
    return Envelope(soap=SoapVersion.SOAP12, rm=RMVersion.WSRM11, wsa=WsaVersion.WSA200508, body=body,
                    addressing=Addressing(action=MAKE_CONNECTION_ACTION, to=SERVER,
                                          message_id=f"urn:uuid:{uuid.uuid4()}"))


def box(limits: Limits | None = None, pending: int = 3) -> Box:
    """A mailbox whose offered sequence has numbers 1..``pending`` unacknowledged."""
    limits, clock = limits or Limits(), FakeClock()
    sources, destinations = Sources(), Destinations()
    offered = f"urn:uuid:{uuid.uuid4()}"
    record = SourceRecord(key=uuid.uuid4().hex, version=RMVersion.WSRM11, state=SourceState.ACTIVE,
                          identifier=offered, next_number=pending + 1,
                          pending=tuple((n, 1, clock.time() + 1) for n in range(1, pending + 1)))
    out = sources.add(Outbound(SourceInfo(f"offer:{offered}", mc_anonymous(CLIENT), owner=ALICE), record, limits),
                      current=True)
    inbound = f"urn:uuid:{uuid.uuid4()}"
    destinations.add(Inbound(DestinationInfo(owner=ALICE), DestinationRecord(inbound, RMVersion.WSRM11)))
    metrics = Metrics("server", destinations.open_count, lambda: 0)
    return Box(Mailbox(limits, metrics, sources, destinations, None, clock), clock, sources, out, inbound, limits)


def numbers(answer_: Answer) -> tuple[int | None, bool | None]:
    """The message number an answer to a poll carries (None: no message), and its MessagePending."""
    env = answer_.envelope
    if env is None:
        return None, None
    return (env.sequence.number if env.sequence is not None else None), env.message_pending


# ---------------------------------------------------------------------- the mailbox

def test_held_messages_go_one_per_poll_lowest_number_first_with_more_pending_until_the_last():
    b = box()
    b.hold(3, 1, 2)
    assert [numbers(b.poll()) for _ in range(3)] == [(1, True), (2, True), (3, False)]
    assert b.poll() is NOTHING  # each was given out just now
    assert b.poll().status == 202


def test_held_acknowledgements_ride_along_with_the_first_message_then_go_alone():
    b = box()
    b.hold_ack(1, 2)
    b.hold(1)
    first = b.poll().envelope
    assert first is not None and first.sequence is not None and first.sequence.number == 1
    assert [a.identifier for a in first.acks] == [b.inbound]
    assert b.poll() is NOTHING  # the acknowledgement went with it, once
    b.hold_ack(1, 2, 3)
    alone = b.poll().envelope
    assert alone is not None and alone.sequence is None and alone.acks[0].ranges == ((1, 3),)


def test_a_message_given_out_is_given_again_after_the_retransmit_interval_until_acknowledged():
    b = box(Limits(retransmit_interval=2.0))
    b.hold(1)
    assert numbers(b.poll()) == (1, False)
    b.clock.advance(1.9)
    assert b.poll() is NOTHING
    b.clock.advance(0.2)
    assert numbers(b.poll()) == (1, False)  # the client lost it: given again
    b.acknowledged(1)
    b.clock.advance(2.1)
    assert b.poll() is NOTHING
    assert b.mailbox.waiting() == {}


def test_acknowledged_messages_are_dropped_before_they_are_given():
    b = box()
    b.hold(1, 2, 3)
    b.acknowledged(1, 2)
    assert b.mailbox.waiting() == {(ALICE, CLIENT): 1}
    assert numbers(b.poll()) == (3, False)
    assert b.mailbox.holds(ALICE, CLIENT, b.out.key) == {3}


def test_another_peers_poll_for_the_same_address_gets_nothing():
    b = box()
    b.hold(1)
    b.hold_ack(1)
    assert b.poll(caller=BOB) is NOTHING
    assert b.poll(caller=None) is NOTHING  # nor an anonymous one
    got = b.poll(caller=ALICE).envelope
    assert got is not None and got.sequence is not None and got.acks


def test_a_poll_for_one_sequence_gets_only_that_sequences_messages():
    b = box()
    b.hold(1)
    b.hold_ack(1)
    assert b.poll(identifier=f"urn:uuid:{uuid.uuid4()}") is NOTHING
    only_ack = b.poll(identifier=b.inbound).envelope
    assert only_ack is not None and only_ack.sequence is None and only_ack.acks
    assert numbers(b.poll(identifier=b.out.identifier)) == (1, False)


def test_the_offered_sequence_a_poll_takes_from_is_marked_polled():
    b = box()
    b.hold(1)
    assert not b.out.polled
    b.poll()
    assert b.out.polled  # the sender pushes its expiry forward: its peer is there


def test_a_poll_without_a_selection_is_a_fault():
    b = box()
    body = MakeConnection()
    got = b.mailbox.answer(poll_of(body), body, ALICE)
    assert isinstance(got.envelope.body, SoapFault) and got.envelope.body.subcode == MISSING_SELECTION


def batch_numbers(answer_: Answer) -> list[tuple[int, bool]]:
    """(message number, MessagePending) of each envelope of a batch answer, decoded from its bytes."""
    assert answer_.status == 200 and answer_.batch
    envelopes = [decode(part) for part in answer_.batch]
    assert envelopes[0].sequence == answer_.envelope.sequence
    return [(e.sequence.number, e.message_pending) for e in envelopes]


def test_a_poll_that_takes_a_batch_gets_every_held_message_in_order_with_the_acknowledgements_on_the_first():
    b = box(pending=5)
    b.hold(4, 2, 5, 1, 3)
    b.hold_ack(1, 2)
    got = b.poll(room=BatchRoom(256, 1 << 20))
    assert batch_numbers(got) == [(1, True), (2, True), (3, True), (4, True), (5, False)]
    first, *rest = [decode(part) for part in got.batch]
    assert [a.identifier for a in first.acks] == [b.inbound] and all(not e.acks for e in rest)
    assert all(e.addressing.to == mc_anonymous(CLIENT) for e in rest)
    assert b.poll(room=BatchRoom(256, 1 << 20)) is NOTHING  # each was given out just now
    b.clock.advance(b.limits.retransmit_interval)
    assert [n for n, _ in batch_numbers(b.poll(room=BatchRoom(256, 1 << 20)))] == [1, 2, 3, 4, 5]  # not acknowledged
    assert b.poll(room=BatchRoom(256, 1 << 20)) is NOTHING  # (the acknowledgement went once)


def test_a_batch_answer_stops_at_the_pollers_count_and_the_rest_goes_on_the_next_poll():
    b = box(pending=5)
    b.hold(1, 2, 3, 4, 5)
    assert batch_numbers(b.poll(room=BatchRoom(2, 1 << 20))) == [(1, True), (2, True)]
    assert batch_numbers(b.poll(room=BatchRoom(2, 1 << 20))) == [(3, True), (4, True)]
    assert numbers(b.poll(room=BatchRoom(2, 1 << 20))) == (5, False)  # one left: a standard envelope


def test_messages_that_do_not_fit_the_bytes_are_given_at_the_next_poll_not_after_the_retransmit_interval():
    b = box(pending=4)
    b.hold(1, 2, 3, 4)
    whole = b.poll(room=BatchRoom(256, 1 << 20))
    assert len(whole.batch) == 4
    b.clock.advance(b.limits.retransmit_interval)  # none acknowledged: all are given again
    two = BatchRoom(256, framed_size(list(whole.batch[:2])) + 50)
    assert batch_numbers(b.poll(room=two)) == [(1, True), (2, True)]  # 3 and 4 did not fit: more waits
    got = b.poll(room=two)  # at once: the clock has not moved
    assert [n for n, _ in batch_numbers(got)] == [3, 4] and framed_size(list(got.batch)) <= two.size


def test_one_message_for_a_batch_poller_is_a_standard_envelope():
    b = box()
    b.hold(1)
    single = b.poll(room=BatchRoom(256, 1 << 20))
    assert single.batch == () and numbers(single) == (1, False)


def test_acknowledgements_that_would_not_fit_with_the_first_message_wait_for_the_next_poll():
    """(An outside tester's F1: a reply that fit the poller's bytes went with the held acknowledgements on it,
    over them; the poller could not read the answer, and under a steady stream never got a reply.)"""
    b = box(pending=2)
    b.hold(1, 2)
    b.hold_ack(*range(1, 400, 2))  # 200 ranges: a long SequenceAcknowledgement
    alone = len(wire(message(b.out.identifier or "", 1)))  # a message's size as it is given (give or take)
    room = BatchRoom(256, alone + 200)  # the message fits, not with the acknowledgements on it
    got = b.poll(room=room)
    assert numbers(got) == (1, True) and got.envelope.acks == () and len(wire(got.envelope)) <= room.size
    second = b.poll(room=room)  # at once: message 2, then the acknowledgement alone
    assert numbers(second) == (2, True) and second.envelope.acks == ()
    lone = b.poll(room=room).envelope
    assert lone.sequence is None and lone.acks and lone.acks[0].identifier == b.inbound
    assert b.poll(room=room) is NOTHING


def test_a_message_that_fits_the_bytes_alone_is_given_alone_though_it_would_not_fit_framed():
    """(The re-check's N1: a lone message was measured as if framed in a batch, 20 bytes more, so a reply
    just under the client's limit was withheld and reported as larger than it.)"""
    b = box(pending=2)
    b.hold(1, 2)
    alone = len(wire(b.mailbox._given(b.mailbox._boxes[(ALICE, CLIENT)][("message", b.out.key, 1)].envelope,
                                      False)))
    got = b.poll(room=BatchRoom(256, alone))
    assert got.batch == () and numbers(got) == (1, True) and len(wire(got.envelope)) <= alone
    assert numbers(b.poll(room=BatchRoom(256, alone))) == (2, False)


def test_a_message_larger_than_a_batch_pollers_bytes_is_not_given_to_it_and_is_reported(caplog):
    """(F2: a reply larger than the client reads was given to every poll, refused unread each time, and the
    client's replies stopped without a word.) It is not given to that poller; the messages after it and the
    acknowledgements are; a warning says which message and what to raise. Another stack's poll, with no
    budget, still gets it."""
    b = box(pending=3)
    b.hold(2, 3)
    big = message(b.out.identifier or "", 1)
    big = replace(big, payload=CheckedPayload(b"<r>" + b"x" * 5000 + b"</r>"))
    b.mailbox.hold(ALICE, CLIENT, big, b.out.key)
    b.hold_ack(1)
    room = BatchRoom(256, 3000)
    got = b.poll(room=room)
    assert [n for n, _ in batch_numbers(got)] == [2, 3] and decode(got.batch[0]).acks
    assert batch_numbers(got)[-1] == (3, False)  # nothing more this poller can read waits
    assert "message 1 of sequence" in caplog.text and "max_response_bytes" in caplog.text
    assert b.poll(room=room) is NOTHING  # not given, and no busy polling for it
    assert b.mailbox.metrics.polls.labels(result="too_large")._value.get() == 2  # once per poll that found it
    assert numbers(b.poll()) == (1, False)  # a poll without a budget gets it


def test_another_peers_poll_that_takes_a_batch_gets_nothing():
    b = box()
    b.hold(1, 2)
    assert b.poll(caller=BOB, room=BatchRoom(256, 1 << 20)) is NOTHING
    assert len(b.poll(caller=ALICE, room=BatchRoom(256, 1 << 20)).batch) == 2


# ---------------------------------------------------------------------- the poller

@dataclass
class Polling:
    """A Poller of a node without an endpoint, polling the mailbox of ``server`` through a fake transport;
    what it fetches goes to ``handled``, answered with ``reply`` (None: the acknowledgement a receiver
    would give)."""

    poller: Poller
    transport: FakeTransport
    server: Box
    handled: list[tuple[Envelope, Source]]
    polls: list[Envelope]
    posted: list[Envelope]
    batches: list[int]  # the size of each batch handed to the receiver at once


def polling(server_batches: bool = True, limits: Limits | None = None, pending: int = 3) -> Polling:
    """``server_batches`` False: the server ignores the poll's Accept header (another stack's, or a qtp node
    before the extension), answering one message per poll."""
    server = box(limits, pending)
    clock, limits = server.clock, server.limits
    handled: list[tuple[Envelope, Source]] = []
    polls: list[Envelope] = []
    posted: list[Envelope] = []

    def serve(url: str, envelopes: list[Envelope]) -> Answer:
        env = envelopes[0]
        if not isinstance(env.body, MakeConnection):
            posted.append(env)
            return NOTHING
        polls.append(env)
        room = accepted_batch(transport.requests[-1].accept) if server_batches else None
        return server.mailbox.answer(env, env.body, ALICE, room)

    def handle(env: Envelope, source: Source) -> Answer:
        handled.append((env, source))
        assert env.sequence is not None
        return answer(env, acks=(SequenceAcknowledgement(env.sequence.identifier,
                                                         ranges=((1, env.sequence.number),)),))

    def handle_batch(envs: list[Envelope], source: Source) -> Answer:
        batches.append(len(envs))
        return [handle(env, source) for env in envs][-1]

    batches: list[int] = []
    transport = FakeTransport(serve, clock)
    channels = {"rr": ChannelSettings("rr", peer=SERVER, mode="memory", reply=True)}
    poller = Poller(mc_anonymous(CLIENT), channels, limits, transport,  # type: ignore[arg-type]
                    Metrics("client", lambda: 0, lambda: 0), Security(), handle, handle_batch)
    return Polling(poller, transport, server, handled, polls, posted, batches)


def test_the_poller_hands_each_fetched_message_to_the_receiver_as_its_peers_and_says_whether_more_wait():
    p = polling(server_batches=False)
    assert p.poller.peers() == [SERVER]
    p.server.hold(1, 2)
    assert p.poller.poll(SERVER) == (True, True)
    assert p.poller.poll(SERVER) == (True, False)
    assert p.poller.poll(SERVER) == (False, False)
    assert [env.sequence.number for env, _ in p.handled] == [1, 2]
    assert {source for _, source in p.handled} == {Source(None, SERVER)}
    assert mc_id(p.polls[0].body.address) == CLIENT


def test_the_acknowledgement_of_a_fetched_message_rides_on_the_next_poll_and_survives_a_lost_one():
    p = polling()
    p.server.hold(1)
    p.poller.poll(SERVER)
    assert p.poller.has_acks(SERVER)
    assert p.polls[-1].acks == ()
    p.transport.lose = lambda request: True
    assert p.poller.poll(SERVER) == (False, False)  # lost on the way: the acknowledgement is kept
    assert p.poller.has_acks(SERVER)
    p.transport.lose = lambda request: False
    p.poller.poll(SERVER)
    assert [(a.identifier, a.ranges) for a in p.polls[-1].acks] == [(p.server.out.identifier, ((1, 1),))]
    assert not p.poller.has_acks(SERVER)
    assert p.posted == []  # acknowledgements alone are not POSTed: they wait for the poll


def test_any_other_answer_to_a_fetched_message_is_posted_to_the_peer():
    p = polling()
    p.server.hold(1)

    def terminate(env: Envelope, source: Source) -> Answer:
        return answer(env, body=TerminateSequenceResponse(env.sequence.identifier))

    p.poller._handle = terminate
    p.poller.poll(SERVER)
    assert [type(env.body) for env in p.posted] == [TerminateSequenceResponse]
    assert not p.poller.has_acks(SERVER)


def test_the_poller_takes_what_the_server_holds_in_one_poll_and_hands_it_to_the_receiver_as_one_batch():
    p = polling(limits=Limits(max_batch=3), pending=5)
    p.server.hold(1, 2, 3, 4, 5)
    assert p.poller.poll(SERVER) == (True, True)  # 1-3, and more wait
    assert accepted_batch(p.transport.requests[0].accept) == BatchRoom(3, Limits().max_response_bytes)
    assert p.poller.poll(SERVER) == (True, False)  # 4-5, their acknowledgement riding on this poll
    assert p.batches == [3, 2]
    assert [env.sequence.number for env, _ in p.handled] == [1, 2, 3, 4, 5]
    assert {source for _, source in p.handled} == {Source(None, SERVER)}
    assert [(a.identifier, a.ranges) for a in p.polls[-1].acks] == [(p.server.out.identifier, ((1, 3),))]
    assert p.poller.has_acks(SERVER)
    assert p.poller.poll(SERVER) == (False, False)
    assert [(a.identifier, a.ranges) for a in p.polls[-1].acks] == [(p.server.out.identifier, ((1, 5),))]


def test_a_batch_answer_holding_anything_but_sequence_messages_is_ignored(caplog):
    p = polling()
    p.server.hold(1, 2)
    control = acknowledgement(p.server.inbound, 1)
    p.transport.handler = lambda url, envs: Answer(control, 200, (wire(control), wire(message("x", 1))))
    assert p.poller.poll(SERVER) == (False, False)
    assert p.handled == [] and "holds more than sequence messages" in caplog.text


def test_a_poll_answer_over_the_pollers_limit_is_reported_not_only_logged_at_debug(caplog):
    """(F2, the client's side: an answer over max_response_bytes was dropped with a debug line only.)"""
    p = polling()

    def too_large(request):
        raise TransportError("POST http://server.test/rm failed: RequestException: the answer is 5000000 bytes, "
                             "over [limits] max_response_bytes (4194304); not read")

    p.transport._deliver = too_large
    assert p.poller.poll(SERVER) == (False, False)
    assert "raise [limits] max_response_bytes" in caplog.text
