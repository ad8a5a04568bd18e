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
from qtp.wsrm.codec import (
    MAKE_CONNECTION_ACTION,
    MISSING_SELECTION,
    Addressing,
    CheckedPayload,
    Envelope,
    MakeConnection,
    SoapFault,
    SoapVersion,
    WsaVersion,
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

    def poll(self, caller: str | None = ALICE, identifier: str | None = None) -> Answer:
        body = MakeConnection(mc_anonymous(CLIENT), identifier)
        return self.mailbox.answer(poll_of(body), body, caller)

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


def polling() -> Polling:
    server = box()
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
        return server.mailbox.answer(env, env.body, ALICE)

    def handle(env: Envelope, source: Source) -> Answer:
        handled.append((env, source))
        assert env.sequence is not None
        return answer(env, acks=(SequenceAcknowledgement(env.sequence.identifier,
                                                         ranges=((1, env.sequence.number),)),))

    transport = FakeTransport(serve, clock)
    channels = {"rr": ChannelSettings("rr", peer=SERVER, mode="memory", reply=True)}
    poller = Poller(mc_anonymous(CLIENT), channels, limits, transport,  # type: ignore[arg-type]
                    Metrics("client", lambda: 0, lambda: 0), Security(), handle)
    return Polling(poller, transport, server, handled, polls, posted)


def test_the_poller_hands_each_fetched_message_to_the_receiver_as_its_peers_and_says_whether_more_wait():
    p = polling()
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
