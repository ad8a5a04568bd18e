"""The sender: drives the node's RM Source machines over HTTP.

Theory. Messages are enqueued unnumbered, inside application transactions (``Node.send``). The sender
alone numbers them: it takes the oldest unnumbered messages of a route, feeds one ``SendRequested`` per
message to the route's current sequence, and saves the machine's record together with the numbers in one
short local transaction of the store. Only then does it transmit. So a number is durable before any peer
can see it, a crash never gives one number to two messages, and no lock is held across an application's
two-phase commit.

Every event for a sequence (an acknowledgement, a response, a timer) is applied to a *copy* of its machine;
the copy's record is saved in a local transaction, and the live machine is replaced only after that
commit. A crash anywhere therefore leaves the store at the last committed record, from which the machine
is rebuilt on restart; whatever it had sent but not had acknowledged is retransmitted by its timer, and the
destination recognises the duplicates.

Transmission. Each sequence has one *pump*: the numbers the machine asks to transmit wait in it, and it
sends them in number order, one request at a time, so a destination that discards a message arriving after
a gap (gSOAP at its defaults) sees none. When the destination agreed to qtp's batching extension at
CreateSequence (``SourceRecord.peer_batch``), one request carries up to that many messages; otherwise one.
Messages committed while a request of their sequence is in flight stay unnumbered (``Outbound.deferred``):
numbered at once they would only wait in the pump, and at one sending thread that cost a numbering
transaction per message; the end of the request wakes the sender, which numbers them all in one.
Messages just numbered are kept in memory for their first transmission and retransmissions (dropped once
acknowledged); after a restart they are read back from the store. The retransmission timeout comes from
the measured round-trip time of first transmissions (RFC 6298, Karn's rule).

Routes: a channel's name (sequences created by this node, ``CreateSequence`` with an ``Offer`` when the
channel is request-reply) or ``offer:<identifier>`` for a sequence a peer offered us for our replies
(born ACTIVE when we accepted the offer; it cannot be re-created, so when it ends its unsent replies wait).

Offered routes are bounded, for a peer that offers and then never listens, polls nor acknowledges. While
one waits on its peer (replies unacknowledged, or closing) it carries an expiry (``expires_at``)
``offer_inactivity_timeout`` ahead, pushed forward whenever the peer acknowledges, answers, or polls
something of it; at the expiry the machine ends the sequence and its unacknowledged replies go back to the
route, where ``qtp status`` shows them (QUEUED) and nothing sends them: an operator sees them, nothing
deletes them. An offered sequence on which no reply was ever numbered ends at once with its inbound
sequence (there is nothing to close). The receiver counts a peer's offered sequences and their
unacknowledged replies against its quotas (``offers_of``, ``replies_waiting``).

Held replies cost an idle node nothing. For a WS-MC peer the mailbox is the retransmitter (it gives a held
message again until acknowledged), so the timers do not build and hold again what it holds, and back off
without the usual cap; an event that changes nothing the store keeps (a retransmission's due times) is not
written; and routes are asked for new messages when a commit enqueued some (``wake``), not every tick.
"""

from __future__ import annotations

import logging
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Callable, Mapping

from sqlalchemy.exc import SQLAlchemyError

from qtp._failures import first_line
from qtp.coordinator.failpoints import failpoint
from qtp.errors import QtpError
from qtp.wsrm.codec import (
    BATCH_CONTENT_TYPE,
    Addressing,
    CheckedPayload,
    Envelope,
    InvalidMessage,
    SoapFault,
    SoapVersion,
    WsaVersion,
    anonymous,
    default_action,
    encode_batch,
    mc_id,
)
from qtp.wsrm.codec._names import WSA_FAULT_ACTION, action
from qtp.wsrm.protocol import (
    AckReceived,
    AckRequested,
    CloseResponded,
    CloseSequence,
    CloseSequenceResponse,
    CompleteRequested,
    CreateRequested,
    CreateSequence,
    CreateSequenceResponded,
    CreateSequenceResponse,
    FaultReceived,
    MessageNumbered,
    MessagesAcknowledged,
    MessagesLost,
    Offer,
    OfferAccepted,
    ProtocolError,
    RMVersion,
    SendAckRequested,
    SendCloseSequence,
    SendCreateSequence,
    SendFault,
    SendRequested,
    SendTerminateSequence,
    Sequence,
    SequenceAcknowledgement,
    SequenceEnded,
    SequenceFault,
    SourceRecord,
    SourceSequence,
    SourceState,
    TerminateResponded,
    TerminateSequence,
    TerminateSequenceResponse,
    TimerFired,
    Transmit,
)
from qtp.wsrm.protocol import _ranges as ranges
from qtp.wsrm.runtime._answers import read_answer
from qtp.wsrm.runtime._ids import create_message_id, new_identifier, slot_of
from qtp.wsrm.runtime._mailbox import Mailbox
from qtp.wsrm.runtime._offers import Offers
from qtp.wsrm.runtime._ownership import Ownership, Source
from qtp.wsrm.runtime._ports import SYSTEM_CLOCK, Clock, Run, Wake
from qtp.wsrm.runtime._refusals import outages
from qtp.wsrm.runtime._security import Security
from qtp.wsrm.runtime._sequences import Outbound, Sources
from qtp.wsrm.runtime._settings import PAYLOAD_ROOM, ChannelSettings, Limits, channel_name
from qtp.wsrm.runtime._stores import Stores
from qtp.wsrm.runtime._transport import Transport, TransportError, wire
from qtp.wsrm.store import Outgoing, SourceInfo, Store

log = logging.getLogger("qtp.wsrm.sender")

S = SourceState
_SOAP = {v.value: v for v in SoapVersion}  # a dict look-up: Enum(value) is slow on the per-message path
_WSA = {v.value: v for v in WsaVersion}
_LIVE = (S.NEW, S.CREATING, S.ACTIVE)
_ENDED = (S.TERMINATED, S.FAILED)
_HEARD = (AckReceived, CloseResponded, TerminateResponded, FaultReceived)  # the peer is there
ENVELOPE_BYTES = 1024  # what one message's envelope adds to its payload in a batch (headers; counted generously)
FILL_INTERVAL_S = 5.0  # with no wake-up call, routes are looked at for new messages this often (a safety net)


class Sender:
    """The node's RM Sources. ``tick()`` is called by the node's maintenance thread; ``wake()`` by whoever
    makes work for it. Its state is the ``Sources`` registry (one ``Outbound`` per sequence; the lock rules
    are in ``_sequences``) and the acknowledgements waiting for the next tick (``_acks_mutex``)."""

    def __init__(self, limits: Limits, channels: Mapping[str, ChannelSettings], stores: Stores, sources: Sources,
                 offers: Offers, transport: Transport, mailbox: Mailbox, ownership: Ownership, metrics: Any,
                 security: Security, endpoint: str | None, mc_address: str | None, wake: Wake,
                 clock: Clock = SYSTEM_CLOCK, run: Run | None = None):
        self.limits = limits
        self.channels = channels
        self.stores = stores
        self.sources = sources
        self.offers = offers
        self.transport = transport
        self.mailbox = mailbox
        self.ownership = ownership
        self.metrics = metrics
        self.security = security
        self.endpoint = endpoint  # where peers reach us (None: they cannot; replies fetched by polling)
        self.tag = ""  # a slot's tag in the Offers it makes (qtp.wsrm.runtime._shared)
        self.acks_endpoint = endpoint  # AcksTo = our endpoint: with a slot, naming it (?slot=k)
        self.mc_address = mc_address
        self.wake = wake
        self.clock = clock
        self._pool = None if run is not None else ThreadPoolExecutor(limits.sender_threads,
                                                                     thread_name_prefix="qtp-send")
        self._run = run or self._on_pool
        self._fill_lock = threading.Lock()
        self._acks_mutex = threading.Lock()
        self._acks: dict[str, SequenceAcknowledgement] = {}  # newest acknowledgement per identifier, unapplied
        self._filled = (-1, 0.0)  # the wake-up calls counted at the last look for new messages, and its time

    # ------------------------------------------------------------------ start-up

    def load(self) -> None:
        """Rebuild every RM Source from the stores (after the node's transaction recovery)."""
        for store in self.stores.distinct():
            with store.local() as s:
                saved = [(info, _with_pending(record, store.numbered(s, record.key)))
                         for info, record in store.sources(s)]
            for info, record in saved:
                channel = self.channels.get(channel_name(info.route))
                if channel is not None and channel.peer != info.peer:
                    info = replace(info, peer=channel.peer)  # the configuration moved the peer
                elif info.route.startswith("offer:"):
                    info = self._moved(info)
                if info.route.startswith("offer:") and record.expires_at is not None:
                    # its peer could not reach us while we were down
                    fresh = max(record.expires_at, self.clock.time() + self.limits.offer_inactivity_timeout)
                    record = replace(record, expires_at=fresh)
                self.sources.add(Outbound(info, record, self.limits), current=record.state in _LIVE)
        if len(self.sources):
            log.info("resumed %d outbound sequence(s)", len(self.sources))

    def _moved(self, info: SourceInfo) -> SourceInfo:
        """A sequence a peer offered for its replies goes where the peer's Offer (or its request) said when it
        was made. When the configuration has moved that peer since (``[peers.<name>] endpoint``: the peer now
        listens behind another address, e.g. a balancer in front of its replicas) and the peer may not name the
        old address any more, its replies go to its endpoint now: at the old one nobody may be listening, or
        nobody who takes our signature for it."""
        peer = self.security.peers.get(info.owner) if info.owner is not None else None
        if peer is None or peer.endpoint is None or mc_id(info.peer) is not None or peer.may_name(info.peer):
            return info
        log.warning("replies of sequence %s go to peer %s's endpoint %s now: the address its offer gave (%s) is "
                    "not one of the peer's any more", info.route[len("offer:"):], peer.name, peer.endpoint,
                    info.peer[:200])
        return replace(info, peer=peer.endpoint)

    # ------------------------------------------------------------------ the periodic work

    def tick(self, now: float) -> float | None:
        """Apply waiting acknowledgements, number and send new messages, fire due timers; return when the
        next timer is due."""
        acks = self._take_acks(now)
        with self._fill_lock:
            calls = self.wake.calls
            if calls != self._filled[0] or now - self._filled[1] >= FILL_INTERVAL_S:
                self._filled = (calls, now)  # (a call made while filling makes the next tick fill again)
                self._fill_all(now, acks)
            try:
                for seq, ack in acks.items():  # those no new message took along
                    self.event(seq, ack)
            except (QtpError, SQLAlchemyError) as exc:  # the store is down: the peer acknowledges again later
                log.warning("acknowledgements not applied now: %s", exc)
            if self.offers.ending():
                try:
                    self._end_offers(now)
                except (QtpError, SQLAlchemyError) as exc:
                    log.warning("offered sequences not ended now: %s", exc)
        due: list[float] = []
        for seq in self.sources.all():
            if seq.polled:
                self._keep_polled(seq, now)
            at = seq.machine.next_timer(seq.machine.record)
            if at is not None and at <= now:
                try:
                    self.event(seq, TimerFired(now))
                except (QtpError, SQLAlchemyError) as exc:  # the store is down: try again at the next tick
                    outages.warn(log, "a sequence's timer cannot be handled now",
                                 "sequence %s: timer not handled now: %s", seq.key, first_line(exc))
                    due.append(now + 1.0)
                    continue
                at = seq.machine.next_timer(seq.machine.record) if seq.key in self.sources else None
            if at is not None:
                due.append(at)
        return min(due) if due else None

    def _fill_all(self, now: float, acks: dict[Outbound, AckReceived]) -> None:
        """Number what waits on every route. Every commit that enqueues a message calls ``wake``, so a tick
        after none (a timer's) does not ask the store about each route (it did, five times a second per
        route: an idle node's busiest work, with hundreds of offered routes); ``FILL_INTERVAL_S`` is the
        safety net (a transaction committed by recovery, which calls nothing). A route's sequence takes its
        waiting acknowledgement (from ``acks``) along: numbers and acknowledgement in one store transaction."""
        routes = [route for channel in self.channels.values() for route in channel.routes()]
        for route in [*routes, *self.sources.offer_routes()]:
            try:
                self._fill(route, now, acks)
            except (QtpError, SQLAlchemyError) as exc:
                outages.warn(log, "a route cannot take new messages now", "route %s: cannot take new messages now: %s",
                             route, first_line(exc))

    def _fill(self, route: str, now: float, acks: dict[Outbound, AckReceived]) -> None:
        seq = self._sequence_for(route, now)
        if seq is None:
            return
        with seq.io:
            if seq.pump.running:  # numbered now, they would wait in the pump: number them together when it ends
                seq.deferred = True
                return
        record = seq.machine.record
        ack = acks.get(seq)
        unacknowledged = len(record.pending) if ack is None else \
            sum(1 for number, _, _ in record.pending if not ranges.contains(ack.ack.ranges, number))
        room = min(self.limits.max_unacknowledged - unacknowledged,
                   self.limits.sequence_max_messages - record.next_number + 1)
        if room <= 0:
            return
        store = self.stores.for_route(route)
        with store.local() as s:
            waiting = store.unnumbered(s, route, room)
        if waiting:
            acks.pop(seq, None)  # (taken along even when this transaction fails: the peer acknowledges again)
            self.event(seq, *((ack,) if ack else ()), SendRequested(now, len(waiting)), messages=waiting)

    def _sequence_for(self, route: str, now: float) -> Outbound | None:
        """The sequence that takes ``route``'s new messages, starting a new one when needed."""
        seq = self.sources.current(route)
        if seq is not None and seq.machine.state in _LIVE and \
                seq.machine.record.next_number <= self.limits.sequence_max_messages:
            return seq
        if route.startswith("offer:"):
            return None
        store = self.stores.for_route(route)
        with store.local() as s:
            if not store.unnumbered(s, route, 1):
                return None  # nothing to send: no sequence needed yet
        if seq is not None and seq.machine.state in _LIVE:
            self.event(seq, CompleteRequested(now))  # full: finish it, its messages drain
        return self._create(route, now)

    def _create(self, route: str, now: float) -> Outbound:
        channel = self.channels[channel_name(route)]
        offer = new_identifier(self.tag) if channel.reply else None
        record = SourceRecord(key=uuid.uuid4().hex, version=channel.wsrm,
                              retransmit_interval=self.limits.retransmit_interval,
                              max_interval=self.limits.retransmit_interval_max)
        info = SourceInfo(route, channel.peer, channel.soap.value, channel.wsa.value)
        if offer is not None:  # ready for the replies before the peer can know the identifier
            self.offers.expect(offer, route, channel)
        seq = self.sources.add(Outbound(info, record, self.limits), current=True)
        self.event(seq, CreateRequested(now, offer_identifier=offer))
        return seq

    # ------------------------------------------------------------------ events

    def event(self, seq: Outbound, *events: Any, messages: list[Outgoing] | None = None,
              expire: bool = False) -> None:
        """Apply ``events`` to ``seq``: save the outcome durably, then carry out the actions. ``expire``: the
        sequence's expiry is now (with a TimerFired: it ends, whatever is pending lost)."""
        info = seq.info
        with seq.changing(self._reload) as machine:
            if self.sources.get(seq.key) is not seq:
                return  # forgotten while this waited
            record = replace(machine.record, retransmit_interval=seq.rtt.timeout)
            if seq.offered:
                record = self._offer_expiry(seq, record, events)
            if expire:
                record = replace(record, expires_at=min(e.now for e in events))
            probe = SourceSequence(record)
            actions: list[Any] = []
            try:
                for event in events:
                    actions.extend(probe.handle(event))
            except ProtocolError as exc:
                log.error("outbound sequence %s: %s", machine.record.identifier or seq.key, exc)
            if seq.offered and probe.record.state is S.ACTIVE and not probe.record.pending:
                probe = SourceSequence(replace(probe.record, expires_at=None))  # waits on nobody
            ended = probe.record.state in _ENDED
            keep = messages or ended or _kept(probe.record) != _kept(machine.record) or \
                any(isinstance(a, (MessagesAcknowledged, MessagesLost)) for a in actions)
            # (not kept: only due times moved, a retransmission: the store has everything it keeps already)
            store = self.stores.for_route(info.route)
            seq.adopt(probe, (lambda: self._save(store, seq, probe.record, actions, messages)) if keep else None)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("sequence %s saved: next %d, acked %s, pending %d, events %s", seq.key,
                          probe.record.next_number, probe.record.acked, len(probe.record.pending),
                          sorted({type(e).__name__ for e in events}))
            if probe.record.identifier and self.sources.by_identifier(probe.record.identifier) is not seq:
                self.sources.identified(seq)  # (the response came, or a reload brought the identifier)
            if ended:
                self._forget(seq)
        self._carry_out(seq, actions, messages or [])

    def _offer_expiry(self, seq: Outbound, record: SourceRecord, events: tuple[Any, ...]) -> SourceRecord:
        """An offered sequence that waits on its peer (replies unacknowledged, or closing) expires when the
        peer is silent for ``offer_inactivity_timeout``: from the first such event, pushed forward whenever
        it acknowledges, answers or polls. One with nothing to wait for has no expiry (it ends with its
        inbound sequence, which has its own inactivity timeout)."""
        heard = seq.polled or any(isinstance(e, _HEARD) for e in events)
        seq.polled = False
        if heard or record.expires_at is None:
            return replace(record, expires_at=self.clock.time() + self.limits.offer_inactivity_timeout)
        return record

    def _save(self, store: Store, seq: Outbound, record: SourceRecord, actions: list[Any],
              messages: list[Outgoing] | None) -> None:
        """One local transaction: the numbers given to ``messages``, what ``actions`` acknowledged or lost, and
        ``record`` (or, ended with nothing pending, the sequence dropped)."""
        key = seq.key
        with store.local() as s:
            if messages:
                numbers = [a.number for a in actions if isinstance(a, MessageNumbered)]
                store.assign(s, key, [(m.seq, n) for m, n in zip(messages, numbers)])
            for a in actions:
                if isinstance(a, MessagesAcknowledged):
                    store.acknowledged(s, key, a.ranges)
                elif isinstance(a, MessagesLost):
                    self._requeue(store, s, seq, a.ranges)
            if record.state in _ENDED and not record.pending:
                store.drop_source(s, key)
            else:
                store.save_source(s, seq.info, record)

    def _reload(self, seq: Outbound) -> None:
        """A store transaction of ``seq`` failed with its outcome unknown (the connection broke during COMMIT,
        the database was killed): the store is the truth, so the machine is rebuilt from it before any other
        event. Otherwise a commit that did land would be contradicted by the next one (a number given twice)."""
        store = self.stores.for_route(seq.info.route)
        with store.local() as s:
            saved = {record.key: record for _, record in store.sources(s)}
            if seq.key in saved:
                seq.machine = SourceSequence(_with_pending(saved[seq.key], store.numbered(s, seq.key)))
        log.info("sequence %s reloaded from the store after a failed transaction", seq.key)

    def _requeue(self, store: Store, s: Any, seq: Outbound, lost: tuple[tuple[int, int], ...]) -> None:
        """The sequence ended without these being acknowledged: they go back to their route, to be sent
        again in a new sequence (at least once; the destination cannot recognise them across sequences)."""
        count = store.release(s, seq.key, lost)
        if count and seq.offered:
            log.warning("offered sequence %s ended with %d repl(ies) unacknowledged; they stay queued on route %s "
                        "(qtp status), undelivered: an offered sequence cannot be created again", seq.key, count,
                        seq.info.route)
        elif count:
            log.warning("sequence %s ended with %d message(s) unacknowledged; they are sent again in a new "
                        "sequence, before any message enqueued after them", seq.key, count)

    def _forget(self, seq: Outbound) -> None:
        self.sources.remove(seq)
        if mc_id(seq.info.peer) is not None:
            self.mailbox.forget(seq.key)
        self.wake()

    def _carry_out(self, seq: Outbound, actions: list[Any], messages: list[Outgoing]) -> None:
        numbers = [a.number for a in actions if isinstance(a, MessageNumbered)]
        if messages:
            with seq.io:
                for m, n in zip(messages, numbers):
                    seq.cache[n] = replace(m, key=seq.key, number=n)
        transmits = [a for a in actions if isinstance(a, Transmit)]
        if transmits:
            self._queue(seq, transmits)
        for a in actions:
            if isinstance(a, (MessagesAcknowledged, MessagesLost)):
                self._uncache(seq, a.ranges)
            if isinstance(a, (SendCreateSequence, SendCloseSequence, SendTerminateSequence, SendAckRequested,
                                SendFault)):
                self._run(self._control, seq, a)
            if isinstance(a, MessagesAcknowledged):
                self.metrics.acknowledged.inc(ranges.count(a.ranges))
            elif isinstance(a, OfferAccepted):
                self.offers.accepted(a.identifier)
            elif isinstance(a, SequenceEnded):
                log.info("outbound sequence %s ended: %s", seq.key, a.reason)

    def _on_pool(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self._pool.submit(self._guard, fn, *args)  # type: ignore[union-attr]
        except RuntimeError:  # the node is closing; the timers resend after restart
            pass

    @staticmethod
    def _guard(fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:  # a worker thread must survive; the timer retransmits whatever was not sent
            log.exception("sending failed")

    # ------------------------------------------------------------------ the wire

    def _envelope(self, seq: Outbound, **fields: Any) -> Envelope:
        info = seq.info
        return Envelope(soap=_SOAP[info.soap], rm=seq.machine.record.version, wsa=_WSA[info.wsa], **fields)

    def _addressing(self, info: SourceInfo, act: str, message_id: str | None = None,
                    relates_to: str | None = None, back_channel: bool = False) -> Addressing:
        """``back_channel``: the answer is read from the HTTP response, so ReplyTo says anonymous (a peer that
        honours a non-anonymous ReplyTo, such as gSOAP, would otherwise POST it to our endpoint instead)."""
        wsa = _WSA[info.wsa]
        reply_to = anonymous(wsa) if back_channel else self.endpoint or anonymous(wsa)
        return Addressing(action=act, to=info.peer, message_id=message_id or f"urn:uuid:{uuid.uuid4()}",
                          relates_to=relates_to, reply_to=reply_to)

    # ------------------------------------------------------------------ the pump

    def _queue(self, seq: Outbound, transmits: list[Transmit]) -> None:
        """Hand ``transmits`` to the sequence's pump, starting it when it is idle.

        A timer's retransmission (it asks for an acknowledgement) of a message whose first request left
        less than a timeout ago is dropped: the machine's timer runs from the numbering, and a message may
        wait in the pump behind others (one message per request to a peer without batching)."""
        client = mc_id(seq.info.peer)
        if client is not None:  # the mailbox gives what it holds again by itself, until it is acknowledged
            held = self.mailbox.holds(seq.info.owner, client, seq.key)
            transmits = [t for t in transmits if t.number not in held]
            if not transmits:
                return
        now = self.clock.monotonic()
        with seq.io:
            pump, timeout = seq.pump, seq.rtt.timeout
            for t in transmits:
                sent = pump.sent_at.get(t.number)
                if t.ack_requested and sent is not None and now - sent < timeout:
                    continue
                known = pump.waiting.get(t.number)
                pump.waiting[t.number] = t if known is None or t.ack_requested else known
            if pump.running:
                return
            pump.running = True
        self._run(self._pump, seq)

    def _pump(self, seq: Outbound) -> None:
        """Send what waits in the pump, lowest numbers first, one request at a time, until nothing waits."""
        pump = seq.pump
        try:
            while True:
                record = seq.machine.record
                with seq.io:
                    if not pump.waiting or self.sources.get(seq.key) is not seq:
                        self._stopped(seq)
                        return
                    size = record.peer_batch if self._batching(seq.info) else 1
                    batch = [pump.waiting.pop(n) for n in sorted(pump.waiting)[:size]]
                self._transmit(seq, record, batch)
        except BaseException:
            with seq.io:
                self._stopped(seq)
            raise

    def _stopped(self, seq: Outbound) -> None:
        """The pump of ``seq`` ends (``io`` held); messages committed meanwhile are numbered at the next tick."""
        seq.pump.running = False
        if seq.deferred:
            seq.deferred = False
            self.wake()

    def _batching(self, info: SourceInfo) -> bool:
        channel = self.channels.get(channel_name(info.route))
        return channel is None or channel.batch

    def _transmit(self, seq: Outbound, record: SourceRecord, batch: list[Transmit]) -> None:
        """One request with the messages of ``batch`` (in number order) that are still unacknowledged."""
        waiting = {number for number, _, _ in record.pending}
        batch = [t for t in batch if t.number in waiting]
        messages = self._messages(seq, [t.number for t in batch if not t.last_message])
        batch = self._fitting(seq, batch, messages)
        envelopes = [e for e in (self._message_envelope(seq, record, t, messages.get(t.number))
                                 for t in batch) if e is not None]
        if not envelopes:
            return
        began = self.clock.monotonic()
        with seq.io:
            resent = sum(1 for t in batch if t.number in seq.pump.sent_at)
            seq.pump.sent_at.update((t.number, began) for t in batch)
        self.metrics.transmitted(_channel(seq.info.route), len(envelopes), resent)
        answered = self._exchange(seq, envelopes)
        if answered and not resent:  # Karn: the answer to a request sent again is ambiguous
            rtt = self.clock.monotonic() - began
            with seq.io:
                seq.rtt.sample(rtt)

    def _fitting(self, seq: Outbound, batch: list[Transmit], messages: dict[int, Outgoing]) -> list[Transmit]:
        """The first messages of ``batch`` that fit in one request together: their payloads, and each one's
        envelope, within ``max_request_bytes`` less the room ``tx.send`` leaves each payload (a peer with the
        same limits takes the request). The rest go back to the pump, for the next request."""
        room, used, kept = self.limits.max_request_bytes - PAYLOAD_ROOM, 0, 0
        for t in batch:
            message = messages.get(t.number)
            size = ENVELOPE_BYTES + (len(message.payload) if message is not None and message.payload else 0)
            if kept and used + size > room:
                break
            used += size
            kept += 1
        if kept < len(batch):
            with seq.io:
                for t in batch[kept:]:
                    seq.pump.waiting.setdefault(t.number, t)
        return batch[:kept]

    def _messages(self, seq: Outbound, numbers: list[int]) -> dict[int, Outgoing]:
        """The stored messages of ``numbers``: from memory, else (after a restart) in one query."""
        with seq.io:
            found = {n: seq.cache[n] for n in numbers if n in seq.cache}
        missing = [n for n in numbers if n not in found]
        if missing:
            store = self.stores.for_route(seq.info.route)
            with store.local() as s:
                found.update((m.number, m) for m in store.numbered(s, seq.key, missing) if m.number is not None)
        return found

    def _uncache(self, seq: Outbound, done: tuple[tuple[int, int], ...]) -> None:
        """``done`` (acknowledged or lost) need neither their message nor their send time any more."""
        with seq.io:
            for table in (seq.cache, seq.pump.sent_at):
                for number in [n for n in table if ranges.contains(done, n)]:
                    del table[number]

    def _message_envelope(self, seq: Outbound, record: SourceRecord, t: Transmit,
                          message: Outgoing | None) -> Envelope | None:
        if message is None and not t.last_message:
            return None  # acknowledged meanwhile
        info, rm = seq.info, record.version
        acks = (self._ack_request(record, t.identifier),) if t.ack_requested else ()
        sequence = Sequence(t.identifier, t.number, last_message=t.last_message)
        if message is None:
            return self._envelope(seq, sequence=sequence, ack_requests=acks,
                                  addressing=self._addressing(info, action(rm, "LastMessage")))
        act = WSA_FAULT_ACTION[_WSA[info.wsa]] if message.fault is not None else message.action
        body = SoapFault("Receiver", None, message.fault) if message.fault is not None else None
        payload = None if body is not None or message.payload is None else CheckedPayload(message.payload)
        return self._envelope(seq, sequence=sequence, ack_requests=acks, body=body, payload=payload,
                              addressing=self._addressing(info, act, message.message_id, message.relates_to))

    def _control(self, seq: Outbound, a: Any) -> None:
        info = seq.info
        record = seq.machine.record
        rm = record.version
        message_id = None
        if isinstance(a, SendCreateSequence):
            body: Any = self._create_sequence(seq, a, rm)
            message_id = create_message_id(seq.key)
        elif isinstance(a, SendCloseSequence):
            body = CloseSequence(a.identifier, a.last_msg_number)
        elif isinstance(a, SendTerminateSequence):
            body = TerminateSequence(a.identifier, a.last_msg_number if rm is RMVersion.WSRM11 else None)
        elif isinstance(a, SendFault):
            body = a.fault
        else:
            envelope = self._envelope(seq, ack_requests=(self._ack_request(record, a.identifier),),
                                      addressing=self._addressing(info, action(rm, "AckRequested"),
                                                                  back_channel=True))
            self._exchange(seq, envelope)
            return
        # A CreateSequence with an Offer keeps ReplyTo = our endpoint: a WS-RM 1.0 Offer names no endpoint, so
        # the peer sends the replies there.
        back = not (isinstance(a, SendCreateSequence) and a.offer_identifier is not None)
        envelope = self._envelope(seq, body=body, addressing=self._addressing(info, "", message_id,
                                                                              back_channel=back))
        envelope = replace(envelope, addressing=replace(envelope.addressing, action=default_action(envelope)))
        self._exchange(seq, envelope)

    def _create_sequence(self, seq: Outbound, a: SendCreateSequence, rm: RMVersion) -> CreateSequence:
        offer = None
        if a.offer_identifier is not None:
            own = self.endpoint or self.mc_address  # no endpoint: replies fetched by polling
            offer = Offer(a.offer_identifier, endpoint=own if rm is RMVersion.WSRM11 else None)
        channel = self.channels.get(channel_name(seq.info.route))
        acks_to = anonymous(_WSA[seq.info.wsa])
        if channel is not None and channel.acks_to == "endpoint" and self.acks_endpoint:
            acks_to = self.acks_endpoint
        elif channel is not None and channel.acks_to == "poll" and self.mc_address:
            acks_to = self.mc_address  # fetched with MakeConnection
        batch = self.limits.max_batch if channel is None or channel.batch else None
        return CreateSequence(acks_to, a.expires, offer, batch)

    @staticmethod
    def _ack_request(record: SourceRecord, identifier: str) -> AckRequested:
        """WS-RM 1.0 tells the destination the highest number used, so it can see what it is missing."""
        if record.version is RMVersion.WSRM10 and record.next_number > 1:
            return AckRequested(identifier, max_message_number_used=record.next_number - 1)
        return AckRequested(identifier)

    def _exchange(self, seq: Outbound, envelopes: Envelope | list[Envelope]) -> bool:
        """POST one envelope, or several as a qtp batch; act on the answer. True when the peer answered."""
        info = seq.info
        client = mc_id(info.peer)
        if client is not None:  # a peer that cannot listen: held until it polls (WS-MakeConnection)
            for envelope in [envelopes] if isinstance(envelopes, Envelope) else envelopes:
                self.mailbox.hold(info.owner, client, envelope, seq.key)
            return False
        slot = slot_of(seq.identifier)  # a peer whose replicas share the work: its balancer routes on it
        try:
            if isinstance(envelopes, Envelope) or len(envelopes) == 1:
                envelope = envelopes if isinstance(envelopes, Envelope) else envelopes[0]
                reply = self.transport.post(info.peer, wire(envelope), envelope.soap, envelope.addressing.action,
                                            slot=slot)
            else:
                reply = self.transport.post_raw(info.peer, encode_batch([wire(e) for e in envelopes]),
                                                BATCH_CONTENT_TYPE, slot=slot)
        except TransportError as exc:
            log.debug("%s", exc)
            return False
        if not reply.body.strip():
            return reply.status < 300
        try:
            answer = read_answer(reply.body, info.peer, self.metrics)
        except InvalidMessage as exc:
            log.warning("unreadable answer (HTTP %d) from %s: %s", reply.status, info.peer, exc)
            return False
        self.on_answer(answer, seq.key, Source.answer(self.security, info.peer))
        return reply.status < 300

    def on_answer(self, answer: Envelope, key: str, source: Source) -> None:
        """The answer to our POST for sequence ``key``: what ``source`` (whoever we POSTed to) may say of its
        own sequences is taken; what it says of another peer's is not (``Ownership``)."""
        about = self.ownership.sort(source, answer, key)
        if about.acks:
            self.on_acks(about.acks)
        if about.body:
            self.on_body(answer.body, key)

    def on_body(self, body: Any, key: str | None = None) -> None:
        """A response or fault for our RM Sources, from the peer it is about (the caller checked that):
        ``key``, the sequence whose answer it is (None: it came in a request)."""
        now = self.clock.time()
        seq = None if key is None else self.sources.get(key)
        if isinstance(body, CreateSequenceResponse) and seq is not None:
            self.event(seq, CreateSequenceResponded(body, now))
        elif isinstance(body, CloseSequenceResponse):
            self._by_identifier(body.identifier, CloseResponded(now))
        elif isinstance(body, TerminateSequenceResponse):
            self._by_identifier(body.identifier, TerminateResponded(now))
        elif isinstance(body, SequenceFault):
            target = self.sources.by_identifier(body.identifier) if body.identifier else seq
            if target is not None:
                self.event(target, FaultReceived(body.code, now))
        elif isinstance(body, SoapFault):
            log.info("peer answered with a fault: %s", body.reason)

    def on_acks(self, acks: tuple[SequenceAcknowledgement, ...]) -> None:
        """Acknowledgements are set unions, so only the newest per sequence matters: they are kept here and
        applied by the next tick, one store transaction per sequence for however many arrived meanwhile
        (instead of one per HTTP response; the transaction that numbers the sequence's next messages, when
        there are some). Losing them in a crash only means retransmissions."""
        with self._acks_mutex:
            for ack in acks:
                known = self._acks.get(ack.identifier)
                if known is not None and not ack.final and not ack.nacks and not known.nacks and \
                        ranges.union(known.ranges, ack.ranges) == ack.ranges:
                    self._acks[ack.identifier] = ack  # covers what was waiting
                elif known is None:
                    self._acks[ack.identifier] = ack
                else:
                    self._acks[ack.identifier] = _merge(known, ack)
        self.wake()

    def _take_acks(self, now: float) -> dict[Outbound, AckReceived]:
        """The acknowledgements waiting since the last tick, as events of the sequences they name."""
        with self._acks_mutex:
            waiting, self._acks = self._acks, {}
        if waiting:
            failpoint("before_acks_applied")  # the peer stored and acknowledged; nothing deleted here yet
        taken: dict[Outbound, AckReceived] = {}
        for ack in waiting.values():
            seq = self.sources.by_identifier(ack.identifier)
            if seq is not None:
                taken[seq] = AckReceived(ack, now)
        return taken

    def _by_identifier(self, identifier: str, event: Any) -> None:
        seq = self.sources.by_identifier(identifier)
        if seq is not None:
            self.event(seq, event)

    # ------------------------------------------------------------------ offered sequences

    def _keep_polled(self, seq: Outbound, now: float) -> None:
        """Push forward the expiry of an offered sequence polled since its last event, once half of its
        ``offer_inactivity_timeout`` has passed (one write per half timeout, not one per poll)."""
        expires_at = seq.machine.record.expires_at
        if expires_at is None:  # (nothing waits on the peer)
            seq.polled = False
        elif expires_at - now < self.limits.offer_inactivity_timeout / 2:
            self.event(seq, TimerFired(now))

    def _end_offers(self, now: float) -> None:
        for route in self.offers.ending():
            seq = self.sources.current(route)
            if seq is None:
                self.offers.done(route)
                continue
            store = self.stores.for_route(route)
            with store.local() as s:
                if store.unnumbered(s, route, 1):
                    continue  # replies still to number: the next tick
            if seq.machine.record.next_number == 1 and seq.machine.state in _LIVE:
                log.info("offered sequence %s carried no reply: ended with its inbound sequence", seq.key)
                self.event(seq, TimerFired(now), expire=True)  # nothing to close or to tell the peer
            else:
                self.event(seq, CompleteRequested(now))
            self.offers.done(route)

    # ------------------------------------------------------------------ status and shutdown

    def channel_stats(self) -> dict[str, dict[str, float]]:
        """Per channel (offered reply sequences under ``offer``): in flight, round-trip time and timeout."""
        stats: dict[str, dict[str, float]] = {}
        for seq in self.sources.all():
            entry = stats.setdefault(_channel(seq.info.route), {"in_flight": 0.0})
            entry["in_flight"] += len(seq.machine.record.pending)
            if seq.rtt.srtt is not None and self.sources.current(seq.info.route) is seq:
                entry["round_trip_seconds"] = seq.rtt.srtt
                entry["retransmission_timeout_seconds"] = seq.rtt.timeout
        return stats

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on a sender thread (a best-effort send that nothing waits for)."""
        self._run(fn, *args)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


def _kept(record: SourceRecord) -> SourceRecord:
    """What the store keeps of ``record``: not its pending numbers' due times (rebuilt from the stored
    messages at start) nor its retransmission timeout (measured again)."""
    return replace(record, pending=(), retransmit_interval=0.0)


def _merge(a: SequenceAcknowledgement, b: SequenceAcknowledgement) -> SequenceAcknowledgement:
    """Two acknowledgements of one sequence as one: the union of their ranges (Nacks and None carry no
    ranges; a Final one stays final)."""
    merged = ranges.union(a.ranges, b.ranges)
    if not merged:
        return b
    return SequenceAcknowledgement(b.identifier, ranges=merged, final=a.final or b.final)


def _channel(route: str) -> str:
    """The channel a route belongs to, for metrics (every offered reply sequence counts as ``offer``)."""
    return "offer" if route.startswith("offer:") else channel_name(route)


def _with_pending(record: SourceRecord, stored: list[Outgoing]) -> SourceRecord:
    """``record`` with its pending numbers rebuilt from the messages still stored in its sequence (the store
    does not keep them in the record): due at once, so a restarted node sends them again first thing."""
    if record.state in _ENDED:
        return record
    numbers = {m.number for m in stored if m.number is not None}
    if record.version is RMVersion.WSRM10 and record.complete_requested and record.last_number:
        numbers.add(record.last_number)  # the empty LastMessage marker has no stored row
    numbers = {n for n in numbers if not ranges.contains(record.acked, n)}
    sent = 0 if record.state in (S.NEW, S.CREATING) else 1
    return replace(record, pending=tuple((n, sent, 0.0) for n in sorted(numbers)))
