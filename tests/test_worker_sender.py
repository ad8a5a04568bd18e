"""The Sender alone: the memory store, a fake transport to a fake peer, a fake clock, work run inline.

Each test drives ``Sender.tick(now)`` with the fake clock and looks at the store and at what reached the
peer: numbering durable before transmission, batches, acknowledgements applied in one save per sequence,
retransmission and its timeout, the reload after a commit whose outcome is unknown, offers, the wake-up
rule, and the rollover to a new sequence.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass

import pytest

from fakes_runtime import FakeClock, FakePeer, FakeTransport, OneStore, RecordingStore, inline, receiver_handler
from qtp.wsrm.codec import Envelope, MakeConnection, SoapVersion, WsaVersion, mc_anonymous
from qtp.wsrm.protocol import (
    CloseSequence,
    CreateSequence,
    DestinationRecord,
    RMVersion,
    Sequence,
    SequenceAcknowledgement,
    SourceState,
    TerminateSequence,
)
from qtp.wsrm.runtime._answers import Answer
from qtp.wsrm.runtime._mailbox import Mailbox
from qtp.wsrm.runtime._metrics import Metrics
from qtp.wsrm.runtime._offers import Offers, offer_route
from qtp.wsrm.runtime._ownership import Ownership
from qtp.wsrm.runtime._ports import Wake
from qtp.wsrm.runtime._receiver import Receiver
from qtp.wsrm.runtime._security import Peer, Security
from qtp.wsrm.runtime._sender import FILL_INTERVAL_S, Sender
from qtp.wsrm.runtime._sequences import Destinations, Inbound, Outbound, Sources
from qtp.wsrm.runtime._settings import ChannelSettings, Limits
from qtp.wsrm.store import DestinationInfo, MemoryStore, Outgoing

PEER = "http://peer.test/rm"
ME = "http://me.test/rm"
ACTION = "urn:test:item"


@dataclass
class Rig:
    """One Sender and everything around it."""

    sender: Sender
    store: RecordingStore
    clock: FakeClock
    transport: FakeTransport
    peer: FakePeer
    sources: Sources
    destinations: Destinations
    offers: Offers
    wake: Wake

    def enqueue(self, count: int, route: str = "out", wake: bool = True, relates_to: str | None = None) -> list[str]:
        """``count`` messages committed on ``route`` (and the wake-up call a committing ``tx.send`` makes)."""
        ids = [f"urn:uuid:{uuid.uuid4()}" for _ in range(count)]
        with self.store.local() as s:
            for message_id in ids:
                self.store.enqueue(s, Outgoing(route, message_id, ACTION, f"<i>{message_id}</i>".encode(),
                                               self.clock.time(), relates_to=relates_to))
        if wake:
            self.wake()
        return ids

    def tick(self, advance: float = 0.0) -> float | None:
        return self.sender.tick(self.clock.advance(advance))

    def numbered(self, key: str) -> dict[int, str]:
        """Number -> MessageID of the messages the store holds numbered in sequence ``key``."""
        return {m.number: m.message_id for m in self.store.read("numbered", key) if m.number is not None}

    def only(self, route: str = "out") -> Outbound:
        seq = self.sources.current(route)
        assert seq is not None, f"no sequence takes route {route}"
        return seq

    def sent_at(self, seq: Outbound, number: int) -> float:
        """When (``time()``) message ``number`` of ``seq`` last left."""
        return self.clock.time() - (self.clock.monotonic() - seq.pump.sent_at[number])

    def sent(self, identifier: str, number: int) -> int:
        """How many times message ``number`` of ``identifier`` was posted."""
        return self.transport.messages().count((identifier, number))


def build(limits: Limits | None = None, peer: FakePeer | None = None, reply: bool = False, batch: bool = True,
          lanes: int = 1, latency: float = 0.0, store: RecordingStore | None = None, run=inline,
          security: Security | None = None) -> Rig:
    """``store``: the store of a node that ran before (a restart); ``run``: how work leaves the tick (at
    once, on the caller's thread, by default)."""
    limits = limits or Limits()
    clock, store, peer = FakeClock(), store or RecordingStore(), peer or FakePeer()
    channels = {"out": ChannelSettings("out", peer=PEER, mode="memory", reply=reply, batch=batch, lanes=lanes)}
    sources, destinations, wake, security = Sources(), Destinations(), Wake(), security or Security()
    metrics = Metrics("n1", destinations.open_count, lambda: 0)
    offers = Offers(store, sources, destinations, limits, security.peer_for_url, wake, clock)
    transport = FakeTransport(peer, clock, latency)
    sender = Sender(limits, channels, OneStore(store), sources, offers, transport,  # type: ignore[arg-type]
                    Mailbox(limits, metrics, sources, destinations, None, clock),
                    Ownership(destinations, sources, channels, security, metrics), metrics, security, ME, None,
                    wake, clock, run=run)
    return Rig(sender, store, clock, transport, peer, sources, destinations, offers, wake)


# ---------------------------------------------------------------------- numbering and batches

def test_a_number_is_in_the_store_before_the_peer_sees_it():
    rig = build()
    durable: list[bool] = []
    peer = rig.peer

    def check(url: str, envelopes: list[Envelope]) -> Answer:
        for env in envelopes:
            if env.sequence is not None:
                seq = rig.sources.by_identifier(env.sequence.identifier)
                durable.append(seq is not None and env.sequence.number in rig.numbered(seq.key))
        return peer(url, envelopes)

    rig.transport.handler = check
    ids = rig.enqueue(5)
    rig.tick()
    seq = rig.only()
    assert rig.peer.received[seq.identifier] == [1, 2, 3, 4, 5]
    assert durable == [True] * 5
    assert rig.numbered(seq.key) == dict(enumerate(ids, start=1))  # enqueue order; acks not applied yet
    saved = {record.key: record for _, record in rig.store.read("sources")}
    assert saved[seq.key].next_number == 6


def test_a_batching_peer_gets_fewer_requests_than_messages():
    rig = build(peer=FakePeer(batch=4))
    rig.enqueue(10)
    rig.tick()
    seq = rig.only()
    carrying = [r for r in rig.transport.requests if r.messages]
    assert rig.transport.carrying(CreateSequence)[0].body.batch == Limits().max_batch
    assert seq.machine.record.peer_batch == 4
    assert rig.peer.received[seq.identifier] == list(range(1, 11))
    assert len(carrying) < 10
    assert all(len(r.messages) <= 4 for r in carrying)


def test_a_peer_slot_named_by_its_sequence_identifier_is_put_in_every_request_of_that_sequence():
    """A peer whose replicas share the work names the slot in the identifiers it makes; the sender says it in
    the URL (``?qtp-slot=k``), where the peer's balancer routes on it (a replica not holding the slot would
    have to forward the request). The CreateSequence, before any identifier, names none; nor do the
    requests of a sequence whose identifier names no slot."""
    tagged = build(peer=FakePeer(batch=4, tag="orders:s3"))
    tagged.enqueue(10)
    tagged.tick()
    seq = tagged.only()
    assert tagged.peer.received[seq.identifier] == list(range(1, 11))
    first, *rest = tagged.transport.requests
    assert isinstance(first.envelopes[0].body, CreateSequence) and first.slot is None
    assert rest and [r.slot for r in rest] == [3] * len(rest)
    plain = build(peer=FakePeer(batch=4))
    plain.enqueue(10)
    plain.tick()
    assert len(plain.transport.requests) > 1 and {r.slot for r in plain.transport.requests} == {None}


def test_a_batch_is_cut_where_its_payloads_would_pass_the_request_size_limit():
    """Outside finding: batches were cut by count only, so payloads that each fit ([limits] max_request_bytes,
    checked by tx.send) went out together over the limit, were answered 413, and were sent so again for ever."""
    limit = 64 * 1024
    rig = build(limits=Limits(max_request_bytes=limit), peer=FakePeer(batch=50))
    sizes: list[int] = []
    post_raw = rig.transport.post_raw
    rig.transport.post_raw = lambda url, data, content_type, slot=None: (sizes.append(len(data)),
                                                                         post_raw(url, data, content_type, slot))[1]
    with rig.store.local() as s:
        for k in range(7):
            rig.store.enqueue(s, Outgoing("out", f"urn:uuid:m{k}", ACTION, b"<i>" + b"x" * 25_000 + b"</i>",
                                          rig.clock.time()))
    rig.wake()
    for _ in range(5):
        rig.tick(1.0)
    seq = rig.only()
    assert rig.peer.received[seq.identifier] == list(range(1, 8))
    assert len(sizes) >= 3 and max(sizes) <= limit, sizes  # two payloads a request at most, never over the limit


def test_a_peer_without_batches_gets_one_message_per_request_in_number_order():
    rig = build(peer=FakePeer(batch=None))
    rig.enqueue(4)
    rig.tick()
    carrying = [r for r in rig.transport.requests if r.messages]
    assert [len(r.messages) for r in carrying] == [1, 1, 1, 1]
    assert [r.messages[0][1] for r in carrying] == [1, 2, 3, 4]


def test_no_more_than_the_window_is_numbered_until_acknowledgements_make_room():
    rig = build(limits=Limits(max_unacknowledged=3), peer=FakePeer(acknowledge=False))
    ids = rig.enqueue(5)
    rig.tick()
    seq = rig.only()
    assert rig.numbered(seq.key) == dict(enumerate(ids[:3], start=1))
    rig.sender.on_acks((SequenceAcknowledgement(seq.identifier, ranges=((1, 2),)),))
    rig.tick()
    assert rig.numbered(seq.key) == {3: ids[2], 4: ids[3], 5: ids[4]}
    assert rig.peer.received[seq.identifier] == [1, 2, 3, 4, 5]


# ---------------------------------------------------------------------- acknowledgements

def test_acknowledgements_wait_for_the_next_tick_and_cost_one_save_per_sequence():
    rig = build(peer=FakePeer(acknowledge=False), lanes=2)
    rig.enqueue(6, route="out")
    rig.enqueue(6, route="out#1")
    rig.tick()
    sequences = [rig.only("out"), rig.only("out#1")]
    for number in (1, 3, 2, 6, 4, 5):  # as many answers would bring them, one by one
        rig.sender.on_acks(tuple(SequenceAcknowledgement(seq.identifier, ranges=((number, number),))
                                 for seq in sequences))
    assert all(len(rig.numbered(seq.key)) == 6 for seq in sequences)  # nothing applied before the tick
    saves, deletes = rig.store.calls["save_source"], rig.store.calls["acknowledged"]
    rig.tick()
    assert rig.store.calls["save_source"] - saves == 2
    assert rig.store.calls["acknowledged"] - deletes == 2
    for seq in sequences:
        assert rig.numbered(seq.key) == {}
        assert seq.machine.record.acked == ((1, 6),)
        assert seq.machine.record.pending == ()


def test_an_acknowledgement_and_the_next_numbers_of_its_sequence_cost_one_save():
    """At one sending thread each tick has an acknowledgement of what went before and a message committed
    since: both go in one store transaction (they took two), and the room the acknowledgement makes in the
    window is counted before numbering."""
    rig = build(limits=Limits(max_unacknowledged=3), peer=FakePeer(acknowledge=False))
    ids = rig.enqueue(3)
    rig.tick()
    seq = rig.only()
    assert rig.numbered(seq.key) == dict(enumerate(ids, start=1))  # the window is full
    more = rig.enqueue(2)
    rig.sender.on_acks((SequenceAcknowledgement(seq.identifier, ranges=((1, 2),)),))
    saves, deletes, assigns = (rig.store.calls[name] for name in ("save_source", "acknowledged", "assign"))
    rig.tick()
    assert rig.store.calls["save_source"] - saves == 1
    assert rig.store.calls["acknowledged"] - deletes == 1 and rig.store.calls["assign"] - assigns == 1
    assert rig.numbered(seq.key) == {3: ids[2], 4: more[0], 5: more[1]}
    assert seq.machine.record.acked == ((1, 2),)
    assert rig.peer.received[seq.identifier] == [1, 2, 3, 4, 5]


def test_messages_committed_while_a_request_is_in_flight_are_numbered_together_when_it_ends():
    """Numbered at once, they would only wait in the pump behind the request in flight: at one sending thread
    that cost a numbering transaction per message. They wait unnumbered; the end of the request wakes the
    sender, and one transaction numbers them all for the next request."""
    in_flight, release = threading.Event(), threading.Event()
    pumps: list[threading.Thread] = []

    def run(fn, *args) -> None:
        pumps.append(threading.Thread(target=fn, args=args))
        pumps[-1].start()

    rig = build(run=run)
    peer = rig.peer

    def slow(url: str, envelopes: list[Envelope]) -> Answer:
        if any(env.sequence is not None for env in envelopes):
            in_flight.set()
            assert release.wait(10)
        return peer(url, envelopes)

    rig.transport.handler = slow
    first = rig.enqueue(1)
    rig.tick()
    assert in_flight.wait(10)
    seq = rig.only()
    assigns, wakes = rig.store.calls["assign"], rig.wake.calls
    more = rig.enqueue(3)
    rig.tick()
    assert rig.store.calls["assign"] == assigns and rig.numbered(seq.key) == {1: first[0]}  # waiting, unnumbered
    release.set()
    for pump in pumps:
        pump.join(10)
    assert rig.wake.calls > wakes  # the end of the request asks for a tick
    rig.tick()
    for pump in pumps:
        pump.join(10)
    assert rig.store.calls["assign"] == assigns + 1
    assert {n: m for n, m in rig.numbered(seq.key).items() if n > 1} == {2: more[0], 3: more[1], 4: more[2]}
    assert rig.peer.received[seq.identifier] == [1, 2, 3, 4]


# ---------------------------------------------------------------------- retransmission

def test_nothing_is_resent_before_the_timeout_and_each_message_is_after_it():
    rig = build(peer=FakePeer(acknowledge=False))
    rig.transport.lose = lambda request: bool(request.messages)  # the messages never arrive
    rig.enqueue(2)
    rig.tick()
    seq = rig.only()
    timeout = Limits().retransmit_interval
    assert seq.rtt.timeout == timeout  # nothing answered: nothing measured
    rig.tick(timeout - 0.1)
    assert [rig.sent(seq.identifier, n) for n in (1, 2)] == [1, 1]
    rig.tick(0.2)
    assert [rig.sent(seq.identifier, n) for n in (1, 2)] == [2, 2]
    resent = [r for r in rig.transport.requests if r.messages][-1]
    assert resent.envelopes[-1].ack_requests  # a retransmission asks for an acknowledgement
    rig.tick(2 * timeout - 0.2)  # the interval doubled
    assert rig.sent(seq.identifier, 1) == 2
    rig.tick(0.3)
    assert rig.sent(seq.identifier, 1) == 3


def test_a_message_that_waited_behind_others_is_not_resent_right_after_its_first_request():
    """The timer runs from the numbering; a message whose first request left late (behind others, one per
    request) is not sent again until a timeout after that request."""
    rig = build(peer=FakePeer(batch=None, acknowledge=False), latency=0.4)
    rig.enqueue(3)
    rig.tick()  # numbered at once (due a timeout later), posted one after the other, 0.4 s each
    seq = rig.only()
    assert rig.clock.time() - rig.sent_at(seq, 3) < seq.rtt.timeout  # the third left late
    rig.tick()  # all three are due by the machine's timer
    assert rig.sent(seq.identifier, 1) == 2
    assert rig.sent(seq.identifier, 3) == 1
    rig.tick(2 * seq.rtt.timeout)  # its next due time (the interval doubled)
    assert rig.sent(seq.identifier, 3) == 2


def test_round_trip_samples_shrink_the_retransmission_timeout():
    limits = Limits()
    rig = build(latency=0.05, limits=limits)
    rig.enqueue(1)
    rig.tick()
    seq = rig.only()
    assert seq.rtt.srtt == pytest.approx(0.05)
    assert seq.rtt.timeout < limits.retransmit_interval / 2
    rig.transport.lose = lambda request: (seq.identifier, 2) in request.messages and \
        rig.sent(seq.identifier, 2) == 1  # its first transmission
    rig.enqueue(1)
    rig.tick()
    assert rig.sent(seq.identifier, 2) == 1
    rig.tick(limits.retransmit_interval / 3)  # past the measured timeout, before the initial one
    assert rig.sent(seq.identifier, 2) == 2
    assert rig.peer.received[seq.identifier] == [1, 2]


def test_karn_the_answer_to_a_resent_request_is_not_a_round_trip_sample():
    rig = build(latency=0.05)
    rig.transport.lose = lambda request: bool(request.messages) and \
        sum(1 for r in rig.transport.requests if r.messages) == 1  # the first message request only
    rig.enqueue(1)
    rig.tick()
    seq = rig.only()
    rig.tick(Limits().retransmit_interval + 0.1)
    assert rig.peer.received[seq.identifier] == [1]  # the retransmission arrived and was answered
    assert seq.rtt.srtt is None
    assert seq.rtt.timeout == Limits().retransmit_interval
    rig.enqueue(1)
    rig.tick()  # a first transmission, answered: a sample
    assert seq.rtt.srtt == pytest.approx(0.05)


# ---------------------------------------------------------------------- a commit whose outcome is unknown

def test_after_a_commit_with_an_unknown_outcome_the_store_is_read_again_and_no_number_is_given_twice():
    rig = build()
    rig.enqueue(1)
    rig.tick()
    seq = rig.only()
    rig.store.fail_commit_after("assign")  # the numbering commits, then the connection "breaks"
    first = rig.enqueue(3)
    rig.tick()
    assert list(rig.numbered(seq.key).values()) == first  # it did land
    assert seq.stale and seq.machine.record.next_number == 5 - 3  # the live machine does not know
    assert rig.sent(seq.identifier, 2) == 0  # nothing transmitted for a change not known durable
    second = rig.enqueue(2)
    rig.tick()
    assert not seq.stale
    numbered = rig.numbered(seq.key)
    assert numbered == dict(zip(range(2, 7), first + second))
    assert sorted(set(rig.peer.received[seq.identifier])) == [1, 2, 3, 4, 5, 6]


# ---------------------------------------------------------------------- a restart

def test_after_a_restart_what_was_numbered_and_not_acknowledged_is_read_back_from_the_store_and_sent_again():
    before = build()
    before.transport.lose = lambda request: bool(request.messages)  # the node dies before any arrives
    ids = before.enqueue(3)
    before.tick()
    identifier = before.only().identifier
    after = build(store=before.store, peer=before.peer)  # a new process: nothing in memory
    after.sender.load()
    seq = after.only()
    assert seq.identifier == identifier and seq.cache == {}
    after.tick()
    assert after.transport.carrying(CreateSequence) == []
    sent = [e for r in after.transport.requests for e in r.envelopes if e.sequence is not None]
    assert [(e.sequence.number, e.addressing.message_id) for e in sent] == list(enumerate(ids, start=1))
    after.tick()
    assert after.store.read("backlog") == 0


def test_after_a_restart_the_replies_to_a_peer_the_configuration_moved_go_to_its_endpoint_now():
    """Outside finding: a request-reply client moved behind a balancer (its [node] endpoint, and the server's
    [peers.<name>] endpoint, changed) never got the replies of its older sequences: they went on to the address
    its Offer had given, where nothing took them (and the server would not sign for an address that is not the
    peer's). After the server's restart with the new file they go to the peer's endpoint; a peer that may still
    name the old address (allow_addresses) keeps it."""
    old, new = "http://127.0.0.1:21020/rm", "http://127.0.0.1:21040/rm"
    soap, wsa = SoapVersion.SOAP12.value, WsaVersion.WSA200508.value

    def replies_sent_to(security: Security) -> set[str]:
        before = build()
        identifier = f"urn:uuid:{uuid.uuid4()}"
        with before.store.local() as s:
            before.offers.accept(s, identifier, old, RMVersion.WSRM11, soap, wsa, owner="cli")
        before.enqueue(2, route=offer_route(identifier), wake=False)
        after = build(store=before.store, security=security)  # the server started again with the new file
        after.sender.load()
        after.tick()
        assert sorted(n for r in after.transport.requests for _, n in r.messages) == [1, 2]
        return {r.url for r in after.transport.requests}

    assert replies_sent_to(Security(peers={"cli": Peer("cli", endpoint=new)})) == {new}
    assert replies_sent_to(Security(peers={"cli": Peer("cli", endpoint=new, allow_addresses=(old,))})) == {old}
    assert replies_sent_to(Security()) == {old}  # a peer not configured: the address its offer gave


# ---------------------------------------------------------------------- offers

def test_a_request_reply_channel_offers_a_sequence_that_is_our_destination_before_the_create_leaves():
    rig = build(reply=True)
    seen: list[tuple[bool, bool]] = []
    peer = rig.peer

    def check(url: str, envelopes: list[Envelope]) -> Answer:
        body = envelopes[0].body
        if isinstance(body, CreateSequence) and body.offer is not None:
            saved = {record.identifier for _, record in rig.store.read("destinations")}
            seen.append((body.offer.identifier in rig.destinations, body.offer.identifier in saved))
        return peer(url, envelopes)

    rig.transport.handler = check
    rig.enqueue(1)
    rig.tick()
    create = rig.transport.carrying(CreateSequence)[0].body
    assert seen == [(True, True)]
    assert create.offer.endpoint == ME  # WS-RM 1.1: where the replies go
    assert create.offer.identifier != rig.only().identifier
    info = rig.destinations.info(create.offer.identifier)
    assert info is not None and info.channel == "out"  # replies on it go to the channel's reply handler


def accept_offer(rig: Rig, identifier: str, peer: str = PEER) -> Outbound:
    """A peer's CreateSequence offered ``identifier`` and the receiver accepted it."""
    with rig.store.local() as s:
        seq = rig.offers.accept(s, identifier, peer, RMVersion.WSRM11, "1.2", "2005/08")
    rig.offers.adopt(seq)
    return seq


def test_replies_on_a_sequence_a_peer_offered_are_numbered_on_its_route_without_a_create():
    rig = build()
    offered = f"urn:uuid:{uuid.uuid4()}"
    calls = rig.wake.calls
    seq = accept_offer(rig, offered)
    assert rig.wake.calls > calls  # adopting it wakes the sender
    replies = rig.enqueue(2, route=offer_route(offered), wake=False, relates_to="urn:uuid:request")
    rig.tick()
    assert rig.transport.carrying(CreateSequence) == []
    assert rig.peer.received[offered] == [1, 2]
    assert rig.numbered(seq.key) == {1: replies[0], 2: replies[1]}
    sent = [e for r in rig.transport.requests for e in r.envelopes if e.sequence is not None]
    assert {e.addressing.relates_to for e in sent} == {"urn:uuid:request"}


def test_an_offered_sequence_whose_peer_stays_silent_expires_and_its_replies_stay_queued():
    limits = Limits(offer_inactivity_timeout=60.0)
    rig = build(limits=limits)
    rig.transport.lose = lambda request: True  # the peer is gone
    offered = f"urn:uuid:{uuid.uuid4()}"
    seq = accept_offer(rig, offered)
    route = offer_route(offered)
    replies = rig.enqueue(2, route=route)
    rig.tick()
    assert rig.numbered(seq.key) == {1: replies[0], 2: replies[1]}
    rig.tick(limits.offer_inactivity_timeout - 1)
    assert rig.sources.get(seq.key) is seq
    rig.tick(2)
    assert rig.sources.get(seq.key) is None and seq.machine.state is SourceState.TERMINATED
    assert [m.message_id for m in rig.store.read("unnumbered", route, 10)] == replies  # QUEUED, kept
    posted = len(rig.transport.requests)
    rig.tick(FILL_INTERVAL_S + 1)
    rig.tick(limits.retransmit_interval_max)
    assert len(rig.transport.requests) == posted  # nothing sends them any more


def test_replies_for_a_peer_that_polls_are_held_and_its_polls_keep_the_offered_sequence_alive():
    limits = Limits(offer_inactivity_timeout=60.0)
    rig = build(limits=limits)
    client = f"urn:uuid:{uuid.uuid4()}"
    offered = f"urn:uuid:{uuid.uuid4()}"
    seq = accept_offer(rig, offered, peer=mc_anonymous(client))
    rig.enqueue(1, route=offer_route(offered))
    rig.tick()
    assert rig.transport.requests == []  # nowhere to POST: held for the peer's poll
    mailbox = rig.sender.mailbox
    assert mailbox.holds(None, client, seq.key) == {1}

    def poll() -> Envelope | None:
        return mailbox.answer(Envelope(soap=SoapVersion.SOAP12, rm=RMVersion.WSRM11, wsa=WsaVersion.WSA200508),
                              MakeConnection(mc_anonymous(client)), None).envelope

    for _ in range(6):  # two inactivity timeouts, polled every third of one, never acknowledged
        got = poll()
        assert got is not None and got.sequence == Sequence(offered, 1)
        rig.tick(limits.offer_inactivity_timeout / 3)
        assert rig.sources.get(seq.key) is seq
    silent_since = rig.clock.time() - limits.offer_inactivity_timeout / 3
    while rig.sources.get(seq.key) is seq and rig.clock.time() - silent_since < 3 * limits.offer_inactivity_timeout:
        rig.tick(1.0)
    silent = rig.clock.time() - silent_since
    # (the expiry moves at most once per half timeout: a poll counts from the next event)
    assert limits.offer_inactivity_timeout <= silent <= 2 * limits.offer_inactivity_timeout
    assert rig.sources.get(seq.key) is None
    assert mailbox.holds(None, client, seq.key) == set()


def inbound_that_accepted(rig: Rig, offered: str) -> str:
    """An inbound sequence of ours whose CreateSequence offered ``offered`` (its identifier)."""
    identifier = f"urn:uuid:{uuid.uuid4()}"
    record = DestinationRecord(identifier, RMVersion.WSRM11, accepted_offer=offered)
    rig.destinations.add(Inbound(DestinationInfo(reply_to=PEER), record))
    return identifier


def test_an_offered_sequence_that_carried_no_reply_ends_at_once_with_its_inbound_sequence():
    rig = build()
    offered = f"urn:uuid:{uuid.uuid4()}"
    seq = accept_offer(rig, offered)
    inbound = inbound_that_accepted(rig, offered)
    rig.tick()
    assert rig.sources.get(seq.key) is seq
    rig.offers.inbound_finished(inbound)
    rig.tick()
    assert rig.sources.get(seq.key) is None
    assert rig.transport.requests == []  # nothing to close or to tell the peer
    assert seq.key not in {record.key for _, record in rig.store.read("sources")}


def test_an_offered_sequence_with_replies_is_closed_once_they_are_acknowledged_after_its_inbound_sequence_ends():
    rig = build()
    offered = f"urn:uuid:{uuid.uuid4()}"
    seq = accept_offer(rig, offered)
    inbound = inbound_that_accepted(rig, offered)
    rig.enqueue(2, route=offer_route(offered))
    rig.tick()
    rig.offers.inbound_finished(inbound)
    rig.tick()  # the acknowledgements of both replies, then the end: Close, Terminate
    assert rig.peer.received[offered] == [1, 2]
    assert rig.peer.closed == [offered] and rig.peer.terminated == [offered]
    assert rig.sources.get(seq.key) is None and rig.offers.ending() == []
    assert rig.store.read("backlog") == 0


# ---------------------------------------------------------------------- the wake-up call and the safety fill

def test_routes_are_read_only_when_woken_or_after_the_fill_interval():
    rig = build()
    rig.enqueue(1)
    rig.tick()
    rig.tick(0.1)  # the acknowledgement woke it: one more look
    seq = rig.only()
    reads = rig.store.calls["unnumbered"]
    rig.tick(1.0)
    rig.tick(1.0)
    assert rig.store.calls["unnumbered"] == reads
    late = rig.enqueue(1, wake=False)  # committed by recovery: nobody calls wake()
    rig.tick(1.0)
    assert rig.store.calls["unnumbered"] == reads and rig.peer.received[seq.identifier] == [1]
    rig.tick(FILL_INTERVAL_S)
    assert rig.peer.received[seq.identifier] == [1, 2]
    assert rig.numbered(seq.key) == {2: late[0]}


# ---------------------------------------------------------------------- rollover

def test_a_full_sequence_is_closed_and_the_next_messages_go_in_a_new_one():
    rig = build(limits=Limits(sequence_max_messages=3))
    ids = rig.enqueue(5)
    rig.tick()
    first = rig.only()
    assert rig.peer.received == {first.identifier: [1, 2, 3]}
    rig.tick(0.1)  # the acknowledgements woke it: the full sequence ends, a new one takes the rest
    second = rig.only()
    assert second is not first
    assert rig.peer.received[second.identifier] == [1, 2]
    assert rig.peer.closed == [first.identifier] and rig.peer.terminated == [first.identifier]
    assert first.machine.state is SourceState.TERMINATED and rig.sources.get(first.key) is None
    assert rig.numbered(second.key) == {1: ids[3], 2: ids[4]}
    assert len(rig.transport.carrying(CreateSequence)) == 2
    assert rig.transport.carrying(CloseSequence)[0].body.last_msg_number == 3
    assert rig.transport.carrying(TerminateSequence)


# ---------------------------------------------------------------------- against a real receiver, over a lossy line

class Stored:
    """What a receiver tells its invoker (``Deliveries``): here only recorded."""

    def __init__(self) -> None:
        self.numbers: list[tuple[str, int]] = []

    def ensure(self, identifier: str) -> None:
        return None

    def stored(self, identifier: str, number: int, message: object = None) -> None:
        self.numbers.append((identifier, number))

    def receipt(self, info: object, record: object, before: object, messages: object) -> None:
        return None

    def completed(self, identifier: str, received: object) -> None:
        return None

    def pending(self, identifier: str) -> bool:
        return False

    def backlog(self) -> int:
        return 0

    def backlog_of(self, identifiers: set[str]) -> int:
        return 0



class NoSources:
    def on_acks(self, acks: object) -> None:
        return None

    def on_body(self, body: object, key: str | None = None) -> None:
        return None


def receiver(clock: FakeClock, store: MemoryStore, stored: Stored) -> Receiver:
    """A real Receiver on ``store``, with no sequences of its own."""
    limits, security = Limits(), Security()
    sources, destinations, wake = Sources(), Destinations(), Wake()
    metrics = Metrics("peer", destinations.open_count, lambda: 0)
    offers = Offers(store, sources, destinations, limits, security.peer_for_url, wake, clock)
    return Receiver(limits, security, "127.0.0.1", PEER, store, destinations, offers, NoSources(), stored,
                    Mailbox(limits, metrics, sources, destinations, None, clock),
                    Ownership(destinations, sources, {}, security, metrics), metrics,
                    FakeTransport(FakePeer()), inline, clock)  # type: ignore[arg-type]


def test_over_a_line_that_loses_requests_and_answers_each_message_is_stored_once_in_order():
    rig = build(limits=Limits(max_batch=4))
    store, stored = MemoryStore("peer"), Stored()
    rig.transport.handler = receiver_handler(receiver(rig.clock, store, stored))
    rig.transport.lose = lambda request: len(rig.transport.requests) % 3 == 1
    rig.transport.lose_answer = lambda request: len(rig.transport.requests) % 5 == 2  # stored, not acknowledged
    ids: list[str] = []
    for _ in range(3):
        ids += rig.enqueue(10)
        rig.tick(0.3)
    for _ in range(200):
        if not rig.store.read("backlog"):
            break
        rig.tick(0.5)
    assert rig.store.read("backlog") == 0  # every message acknowledged
    assert len(stored.numbers) == len(set(stored.numbers)) == len(ids)  # each stored once
    with store.local() as s:
        received = [(m.identifier, m.number, m.message_id) for m in store.incoming(s)]
    assert [message_id for _, _, message_id in received] == ids  # in the order they were enqueued
    assert rig.transport.carrying(CreateSequence)
    assert len(rig.transport.messages()) > len(ids)  # (the loss was real: some were sent again)
