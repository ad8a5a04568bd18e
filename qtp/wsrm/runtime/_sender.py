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
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable

from sqlalchemy.exc import SQLAlchemyError

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
from qtp.wsrm.runtime._ownership import Source
from qtp.wsrm.runtime._settings import channel_name
from qtp.wsrm.runtime._transport import TransportError, wire
from qtp.wsrm.store import Outgoing, SourceInfo, Store

if TYPE_CHECKING:
    from qtp.wsrm.runtime._node import Node

log = logging.getLogger("qtp.wsrm.sender")

S = SourceState
_SOAP = {v.value: v for v in SoapVersion}  # a dict look-up: Enum(value) is slow on the per-message path
_WSA = {v.value: v for v in WsaVersion}
_LIVE = (S.NEW, S.CREATING, S.ACTIVE)
_ENDED = (S.TERMINATED, S.FAILED)
_HEARD = (AckReceived, CloseResponded, TerminateResponded, FaultReceived)  # the peer is there
FILL_INTERVAL_S = 5.0  # with no wake-up call, routes are looked at for new messages this often (a safety net)


def create_message_id(key: str) -> str:
    """The MessageID of a sequence's CreateSequence, the same on every retransmission, so the destination
    can answer a repeated request with the sequence it already made."""
    return f"urn:uuid:{uuid.UUID(hex=key)}"


class Sender:
    """The node's RM Sources. ``tick()`` is called by the node's maintenance thread; ``wake()`` by senders."""

    def __init__(self, node: "Node"):
        self.node = node
        self.limits = node.limits
        self._machines: dict[str, SourceSequence] = {}
        self._infos: dict[str, SourceInfo] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._current: dict[str, str] = {}  # route -> the sequence taking its new messages
        self._offer_routes: dict[str, SourceInfo] = {}
        self._mutex = threading.Lock()
        self._pool = ThreadPoolExecutor(self.limits.sender_threads, thread_name_prefix="qtp-send")
        self._fill_lock = threading.Lock()
        self._stale: set[str] = set()  # sequences whose last store transaction ended with an error
        self._acks: dict[str, SequenceAcknowledgement] = {}  # newest acknowledgement per identifier, unapplied
        self._pumps: dict[str, _Pump] = {}
        self._cache: dict[str, dict[int, Outgoing]] = {}  # numbered, unacknowledged messages per sequence
        self._rtt: dict[str, _RoundTrip] = {}
        self._ending: set[str] = set()  # offered routes to end once their replies are numbered
        self._polled: set[str] = set()  # offered sequences a poll took something of since their last event
        self.wake = _Wake()
        self._filled = (-1, 0.0)  # the wake-up calls counted at the last look for new messages, and its time

    # ------------------------------------------------------------------ start-up

    def load(self) -> None:
        """Rebuild every RM Source from the stores (after the node's transaction recovery)."""
        for store in self.node.distinct_stores():
            with store.local() as s:
                saved = [(info, _with_pending(record, store.numbered(s, record.key)))
                         for info, record in store.sources(s)]
            for info, record in saved:
                channel = self.node.channels.get(channel_name(info.route))
                if channel is not None and channel.peer != info.peer:
                    info = replace(info, peer=channel.peer)  # the configuration moved the peer
                self._adopt(info, record)
                if record.state in _LIVE:
                    self._current[info.route] = record.key
                if info.route.startswith("offer:"):
                    self._offer_routes[info.route] = info
                    if record.expires_at is not None:  # its peer could not reach us while we were down
                        fresh = max(record.expires_at, time.time() + self.limits.offer_inactivity_timeout)
                        self._machines[record.key] = SourceSequence(replace(record, expires_at=fresh))
        if self._machines:
            log.info("resumed %d outbound sequence(s)", len(self._machines))

    def _adopt(self, info: SourceInfo, record: SourceRecord) -> None:
        with self._mutex:
            self._machines[record.key] = SourceSequence(record)
            self._infos[record.key] = info
            self._locks.setdefault(record.key, threading.Lock())

    def add_offer_route(self, s: Any, store: Store, identifier: str, peer: str, rm: RMVersion,
                        soap: str, wsa: str, batch: int | None = None, owner: str | None = None) -> SourceRecord:
        """We accepted a peer's Offer: an RM Source for our replies, saved in session ``s`` of ``store``;
        the caller calls ``adopt_offer`` after that session committed. ``batch``: the qtp peer takes
        batches of up to that many messages (its CreateSequence said so)."""
        route = f"offer:{identifier}"
        # A WS-MC peer's mailbox gives what it holds again by itself: the timers need only hold it again after
        # a restart (and control messages, given once), so they back off without the usual cap.
        backoff = self.limits.offer_inactivity_timeout if mc_id(peer) else self.limits.retransmit_interval_max
        record = SourceRecord(key=uuid.uuid4().hex, version=rm, state=S.ACTIVE, identifier=identifier,
                              retransmit_interval=self.limits.retransmit_interval, max_interval=backoff,
                              peer_batch=min(batch, self.limits.max_batch) if batch else 1)
        store.create_source(s, SourceInfo(route, peer, soap, wsa, owner=owner), record)
        return record

    def adopt_offer(self, record: SourceRecord, info: SourceInfo) -> None:
        self._adopt(info, record)
        self._offer_routes[info.route] = info
        self._current[info.route] = record.key
        self.wake.set()

    # ------------------------------------------------------------------ the periodic work

    def tick(self, now: float) -> float | None:
        """Apply waiting acknowledgements, number and send new messages, fire due timers; return when the
        next timer is due."""
        try:
            self._apply_acks(now)
        except (QtpError, SQLAlchemyError) as exc:  # the store is down: the peer acknowledges again later
            log.warning("acknowledgements not applied now: %s", exc)
        with self._fill_lock:
            calls = self.wake.calls
            if calls != self._filled[0] or now - self._filled[1] >= FILL_INTERVAL_S:
                self._filled = (calls, now)  # (a call made while filling makes the next tick fill again)
                self._fill_all(now)
            if self._ending:
                try:
                    self._end_offers(now)
                except (QtpError, SQLAlchemyError) as exc:
                    log.warning("offered sequences not ended now: %s", exc)
        if self._polled:
            self._keep_polled(now)
        due: list[float] = []
        for key in list(self._machines):
            machine = self._machines.get(key)
            if machine is None:
                continue
            at = machine.next_timer(machine.record)
            if at is not None and at <= now:
                try:
                    self.event(key, TimerFired(now))
                except (QtpError, SQLAlchemyError) as exc:  # the store is down: try again at the next tick
                    log.warning("sequence %s: timer not handled now: %s", key, exc)
                    due.append(now + 1.0)
                    continue
                machine = self._machines.get(key)
                at = machine.next_timer(machine.record) if machine is not None else None
            if at is not None:
                due.append(at)
        return min(due) if due else None

    def _fill_all(self, now: float) -> None:
        """Number what waits on every route. Every commit that enqueues a message calls ``wake``, so a tick
        after none (a timer's) does not ask the store about each route (it did, five times a second per
        route: an idle node's busiest work, with hundreds of offered routes); ``FILL_INTERVAL_S`` is the
        safety net (a transaction committed by recovery, which calls nothing)."""
        for route in [*self.node.routes(), *self._offer_routes]:
            try:
                self._fill(route, now)
            except (QtpError, SQLAlchemyError) as exc:
                log.warning("route %s: cannot take new messages now: %s", route, exc)

    def _fill(self, route: str, now: float) -> None:
        key = self._sequence_for(route, now)
        if key is None:
            return
        machine = self._machines[key]
        record = machine.record
        room = min(self.limits.max_unacknowledged - len(record.pending),
                   self.limits.sequence_max_messages - record.next_number + 1)
        if room <= 0:
            return
        store = self.node.store_for_route(route)
        with store.local() as s:
            waiting = store.unnumbered(s, route, room)
        if waiting:
            self.event(key, SendRequested(now, len(waiting)), messages=waiting)

    def _sequence_for(self, route: str, now: float) -> str | None:
        """The sequence that takes ``route``'s new messages, starting a new one when needed."""
        key = self._current.get(route)
        machine = self._machines.get(key) if key else None
        if machine is not None and machine.state in _LIVE and \
                machine.record.next_number <= self.limits.sequence_max_messages:
            return key
        if route.startswith("offer:"):
            return None
        store = self.node.store_for_route(route)
        with store.local() as s:
            if not store.unnumbered(s, route, 1):
                return None  # nothing to send: no sequence needed yet
        if machine is not None and machine.state in _LIVE:
            self.event(key, CompleteRequested(now))  # full: finish it, its messages drain
        return self._create(route, now)

    def _create(self, route: str, now: float) -> str:
        channel = self.node.channels[channel_name(route)]
        key = uuid.uuid4().hex
        offer = f"urn:uuid:{uuid.uuid4()}" if channel.reply else None
        record = SourceRecord(key=key, version=channel.wsrm, retransmit_interval=self.limits.retransmit_interval,
                              max_interval=self.limits.retransmit_interval_max)
        info = SourceInfo(route, channel.peer, channel.soap.value, channel.wsa.value)
        if offer is not None:  # ready for the replies before the peer can know the identifier
            self.node.receiver.expect_offered(offer, route, channel)
        self._adopt(info, record)
        self._current[route] = key
        self.event(key, CreateRequested(now, offer_identifier=offer))
        return key

    # ------------------------------------------------------------------ events

    def event(self, key: str, *events: Any, messages: list[Outgoing] | None = None, expire: bool = False) -> None:
        """Apply ``events`` to sequence ``key``: save the outcome durably, then carry out the actions.
        ``expire``: the sequence's expiry is now (with a TimerFired: it ends, whatever is pending lost)."""
        lock = self._locks.get(key)
        if lock is None:
            return
        with lock:
            if key in self._stale:
                self._reload(key)
            machine = self._machines.get(key)
            if machine is None:
                return
            info = self._infos[key]
            offered = info.route.startswith("offer:")
            record = replace(machine.record, retransmit_interval=self._timeout(key))
            if offered:
                record = self._offer_expiry(key, record, events)
            if expire:
                record = replace(record, expires_at=min(e.now for e in events))
            probe = SourceSequence(record)
            actions: list[Any] = []
            try:
                for event in events:
                    actions.extend(probe.handle(event))
            except ProtocolError as exc:
                log.error("outbound sequence %s: %s", machine.record.identifier or key, exc)
            if offered and probe.record.state is S.ACTIVE and not probe.record.pending:
                probe = SourceSequence(replace(probe.record, expires_at=None))  # waits on nobody
            store = self.node.store_for_route(info.route)
            ended = probe.record.state in _ENDED
            if messages or ended or _kept(probe.record) != _kept(machine.record) or \
                    any(isinstance(a, (MessagesAcknowledged, MessagesLost)) for a in actions):
                self._save(store, key, info, probe.record, actions, messages)
            # (else only due times moved, a retransmission: the store has everything it keeps already)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("sequence %s saved: next %d, acked %s, pending %d, events %s", key,
                          probe.record.next_number, probe.record.acked, len(probe.record.pending),
                          sorted({type(e).__name__ for e in events}))
            self._machines[key] = probe
            self._stale.discard(key)
            if ended:
                self._forget(key, info)
        self._carry_out(key, info, actions, messages or [])

    def _offer_expiry(self, key: str, record: SourceRecord, events: tuple[Any, ...]) -> SourceRecord:
        """An offered sequence that waits on its peer (replies unacknowledged, or closing) expires when the
        peer is silent for ``offer_inactivity_timeout``: from the first such event, pushed forward whenever
        it acknowledges, answers or polls. One with nothing to wait for has no expiry (it ends with its
        inbound sequence, which has its own inactivity timeout)."""
        heard = key in self._polled or any(isinstance(e, _HEARD) for e in events)
        self._polled.discard(key)
        if heard or record.expires_at is None:
            return replace(record, expires_at=time.time() + self.limits.offer_inactivity_timeout)
        return record

    def _save(self, store: Store, key: str, info: SourceInfo, record: SourceRecord, actions: list[Any],
              messages: list[Outgoing] | None) -> None:
        """One local transaction: the numbers given to ``messages``, what ``actions`` acknowledged or lost, and
        ``record`` (or, ended with nothing pending, the sequence dropped)."""
        self._stale.add(key)  # until the commit is known to have happened: its outcome may be unknown
        with store.local() as s:
            if messages:
                numbers = [a.number for a in actions if isinstance(a, MessageNumbered)]
                store.assign(s, key, [(m.seq, n) for m, n in zip(messages, numbers)])
            for a in actions:
                if isinstance(a, MessagesAcknowledged):
                    store.acknowledged(s, key, a.ranges)
                elif isinstance(a, MessagesLost):
                    self._requeue(store, s, key, a.ranges)
            if record.state in _ENDED and not record.pending:
                store.drop_source(s, key)
            else:
                store.save_source(s, info, record)

    def _reload(self, key: str) -> None:
        """A store transaction of ``key`` failed with its outcome unknown (the connection broke during COMMIT,
        the database was killed): the store is the truth, so the machine is rebuilt from it before any other
        event. Otherwise a commit that did land would be contradicted by the next one (a number given twice)."""
        info = self._infos[key]
        store = self.node.store_for_route(info.route)
        with store.local() as s:
            saved = {record.key: record for _, record in store.sources(s)}
            if key in saved:
                self._machines[key] = SourceSequence(_with_pending(saved[key], store.numbered(s, key)))
        self._stale.discard(key)
        log.info("sequence %s reloaded from the store after a failed transaction", key)

    def _requeue(self, store: Store, s: Any, key: str, lost: tuple[tuple[int, int], ...]) -> None:
        """The sequence ended without these being acknowledged: they go back to their route, to be sent
        again in a new sequence (at least once; the destination cannot recognise them across sequences)."""
        count = store.release(s, key, lost)
        route = self._infos[key].route
        if count and route.startswith("offer:"):
            log.warning("offered sequence %s ended with %d repl(ies) unacknowledged; they stay queued on route %s "
                        "(qtp status), undelivered: an offered sequence cannot be created again", key, count, route)
        elif count:
            log.warning("sequence %s ended with %d message(s) unacknowledged; they are sent again in a new "
                        "sequence, before any message enqueued after them", key, count)

    def _forget(self, key: str, info: SourceInfo) -> None:
        with self._mutex:
            self._machines.pop(key, None)
            self._infos.pop(key, None)
            self._locks.pop(key, None)
            self._pumps.pop(key, None)
            self._cache.pop(key, None)
            self._rtt.pop(key, None)
        if self._current.get(info.route) == key:
            del self._current[info.route]
        if info.route.startswith("offer:"):  # an offered sequence cannot be created again
            self._offer_routes.pop(info.route, None)
            self._polled.discard(key)
        if mc_id(info.peer) is not None:
            self.node.mailbox.forget(key)
        self.wake.set()

    def _carry_out(self, key: str, info: SourceInfo, actions: list[Any], messages: list[Outgoing]) -> None:
        numbers = [a.number for a in actions if isinstance(a, MessageNumbered)]
        if messages:
            with self._mutex:
                cache = self._cache.setdefault(key, {})
                for m, n in zip(messages, numbers):
                    cache[n] = replace(m, key=key, number=n)
        metrics = self.node.metrics
        transmits = [a for a in actions if isinstance(a, Transmit)]
        if transmits:
            self._queue(key, info, transmits)
        for a in actions:
            if isinstance(a, (MessagesAcknowledged, MessagesLost)):
                self._uncache(key, a.ranges)
            if isinstance(a, (SendCreateSequence, SendCloseSequence, SendTerminateSequence, SendAckRequested,
                                SendFault)):
                self._submit(self._control, key, info, a)
            if isinstance(a, MessagesAcknowledged):
                metrics.acknowledged.inc(ranges.count(a.ranges))
            elif isinstance(a, OfferAccepted):
                self.node.receiver.offer_accepted(a.identifier)
            elif isinstance(a, SequenceEnded):
                log.info("outbound sequence %s ended: %s", key, a.reason)

    def _submit(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self._pool.submit(self._guard, fn, *args)
        except RuntimeError:  # the node is closing; the timers resend after restart
            pass

    @staticmethod
    def _guard(fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:  # a worker thread must survive; the timer retransmits whatever was not sent
            log.exception("sending failed")

    # ------------------------------------------------------------------ the wire

    def _envelope(self, info: SourceInfo, **fields: Any) -> Envelope:
        machine = self._machines.get(fields.pop("key"))
        rm = machine.record.version if machine is not None else RMVersion.WSRM11
        wsa = _WSA[info.wsa]
        addressing = fields.pop("addressing")
        return Envelope(soap=_SOAP[info.soap], rm=rm, wsa=wsa, addressing=addressing, **fields)

    def _addressing(self, info: SourceInfo, act: str, message_id: str | None = None,
                    relates_to: str | None = None, back_channel: bool = False) -> Addressing:
        """``back_channel``: the answer is read from the HTTP response, so ReplyTo says anonymous (a peer that
        honours a non-anonymous ReplyTo, such as gSOAP, would otherwise POST it to our endpoint instead)."""
        wsa = _WSA[info.wsa]
        reply_to = anonymous(wsa) if back_channel else self.node.endpoint or anonymous(wsa)
        return Addressing(action=act, to=info.peer, message_id=message_id or f"urn:uuid:{uuid.uuid4()}",
                          relates_to=relates_to, reply_to=reply_to)

    # ------------------------------------------------------------------ the pump

    def _queue(self, key: str, info: SourceInfo, transmits: list[Transmit]) -> None:
        """Hand ``transmits`` to the sequence's pump, starting it when it is idle.

        A timer's retransmission (it asks for an acknowledgement) of a message whose first request left
        less than a timeout ago is dropped: the machine's timer runs from the numbering, and a message may
        wait in the pump behind others (one message per request to a peer without batching)."""
        client = mc_id(info.peer)
        if client is not None:  # the mailbox gives what it holds again by itself, until it is acknowledged
            held = self.node.mailbox.holds(info.owner, client, key)
            transmits = [t for t in transmits if t.number not in held]
            if not transmits:
                return
        now, timeout = time.monotonic(), self._timeout(key)
        with self._mutex:
            pump = self._pumps.setdefault(key, _Pump())
            for t in transmits:
                sent = pump.sent_at.get(t.number)
                if t.ack_requested and sent is not None and now - sent < timeout:
                    continue
                known = pump.waiting.get(t.number)
                pump.waiting[t.number] = t if known is None or t.ack_requested else known
            if pump.running:
                return
            pump.running = True
        self._submit(self._pump, key, info, pump)

    def _pump(self, key: str, info: SourceInfo, pump: "_Pump") -> None:
        """Send what waits in ``pump``, lowest numbers first, one request at a time, until nothing waits."""
        try:
            while True:
                machine = self._machines.get(key)
                with self._mutex:
                    if not pump.waiting or machine is None or self._pumps.get(key) is not pump:
                        pump.running = False
                        return
                    size = machine.record.peer_batch if self._batching(info) else 1
                    batch = [pump.waiting.pop(n) for n in sorted(pump.waiting)[:size]]
                self._transmit(key, info, machine.record, batch, pump)
        except BaseException:
            with self._mutex:
                pump.running = False
            raise

    def _batching(self, info: SourceInfo) -> bool:
        channel = self.node.channels.get(channel_name(info.route))
        return channel is None or channel.batch

    def _transmit(self, key: str, info: SourceInfo, record: SourceRecord, batch: list[Transmit],
                  pump: "_Pump") -> None:
        """One request with the messages of ``batch`` (in number order) that are still unacknowledged."""
        waiting = {number for number, _, _ in record.pending}
        batch = [t for t in batch if t.number in waiting]
        messages = self._messages(key, info, [t.number for t in batch if not t.last_message])
        envelopes = [e for e in (self._message_envelope(key, info, record, t, messages.get(t.number))
                                 for t in batch) if e is not None]
        if not envelopes:
            return
        began = time.monotonic()
        with self._mutex:
            resent = sum(1 for t in batch if t.number in pump.sent_at)
            pump.sent_at.update((t.number, began) for t in batch)
        self.node.metrics.transmitted(_channel(info.route), len(envelopes), resent)
        answered = self._exchange(key, info, envelopes)
        if answered and not resent:  # Karn: the answer to a request sent again is ambiguous
            self._round_trip(key).sample(time.monotonic() - began)

    def _messages(self, key: str, info: SourceInfo, numbers: list[int]) -> dict[int, Outgoing]:
        """The stored messages of ``numbers``: from memory, else (after a restart) in one query."""
        with self._mutex:
            cache = self._cache.get(key, {})
            found = {n: cache[n] for n in numbers if n in cache}
        missing = [n for n in numbers if n not in found]
        if missing:
            store = self.node.store_for_route(info.route)
            with store.local() as s:
                found.update((m.number, m) for m in store.numbered(s, key, missing) if m.number is not None)
        return found

    def _uncache(self, key: str, done: tuple[tuple[int, int], ...]) -> None:
        """``done`` (acknowledged or lost) need neither their message nor their send time any more."""
        with self._mutex:
            for table in (self._cache.get(key), getattr(self._pumps.get(key), "sent_at", None)):
                if table:
                    for number in [n for n in table if ranges.contains(done, n)]:
                        del table[number]

    def _message_envelope(self, key: str, info: SourceInfo, record: SourceRecord, t: Transmit,
                          message: Outgoing | None) -> Envelope | None:
        if message is None and not t.last_message:
            return None  # acknowledged meanwhile
        rm = record.version
        acks = (self._ack_request(record, t.identifier),) if t.ack_requested else ()
        sequence = Sequence(t.identifier, t.number, last_message=t.last_message)
        if message is None:
            return self._envelope(info, key=key, sequence=sequence, ack_requests=acks,
                                  addressing=self._addressing(info, action(rm, "LastMessage")))
        act = WSA_FAULT_ACTION[_WSA[info.wsa]] if message.fault is not None else message.action
        body = SoapFault("Receiver", None, message.fault) if message.fault is not None else None
        payload = None if body is not None or message.payload is None else CheckedPayload(message.payload)
        return self._envelope(info, key=key, sequence=sequence, ack_requests=acks, body=body, payload=payload,
                              addressing=self._addressing(info, act, message.message_id, message.relates_to))

    def _round_trip(self, key: str) -> "_RoundTrip":
        with self._mutex:
            rtt = self._rtt.get(key)
            if rtt is None:
                rtt = self._rtt[key] = _RoundTrip(self.limits.retransmit_interval, self.limits.retransmit_interval_min,
                                                  self.limits.retransmit_interval_max)
            return rtt

    def _timeout(self, key: str) -> float:
        """The retransmission timeout of sequence ``key`` now."""
        return self._round_trip(key).timeout

    def _control(self, key: str, info: SourceInfo, a: Any) -> None:
        machine = self._machines.get(key)
        rm = machine.record.version if machine is not None else RMVersion.WSRM11
        message_id = None
        if isinstance(a, SendCreateSequence):
            offer = None
            if a.offer_identifier is not None:
                own = self.node.endpoint or self.node.mc_address  # no endpoint: replies fetched by polling
                offer = Offer(a.offer_identifier, endpoint=own if rm is RMVersion.WSRM11 else None)
            channel = self.node.channels.get(channel_name(info.route))
            acks_to = anonymous(_WSA[info.wsa])
            if channel is not None and channel.acks_to == "endpoint" and self.node.endpoint:
                acks_to = self.node.endpoint
            elif channel is not None and channel.acks_to == "poll" and self.node.mc_address:
                acks_to = self.node.mc_address  # fetched with MakeConnection
            batch = self.limits.max_batch if channel is None or channel.batch else None
            body: Any = CreateSequence(acks_to, a.expires, offer, batch)
            message_id = create_message_id(key)
        elif isinstance(a, SendCloseSequence):
            body = CloseSequence(a.identifier, a.last_msg_number)
        elif isinstance(a, SendTerminateSequence):
            body = TerminateSequence(a.identifier, a.last_msg_number if rm is RMVersion.WSRM11 else None)
        elif isinstance(a, SendFault):
            body = a.fault
        else:
            request = self._ack_request(machine.record, a.identifier) if machine is not None else AckRequested(a.identifier)
            envelope = self._envelope(info, key=key, ack_requests=(request,),
                                      addressing=self._addressing(info, action(rm, "AckRequested"),
                                                                  back_channel=True))
            self._exchange(key, info, envelope)
            return
        # A CreateSequence with an Offer keeps ReplyTo = our endpoint: a WS-RM 1.0 Offer names no endpoint, so
        # the peer sends the replies there.
        back = not (isinstance(a, SendCreateSequence) and a.offer_identifier is not None)
        envelope = self._envelope(info, key=key, body=body, addressing=self._addressing(info, "", message_id,
                                                                                         back_channel=back))
        envelope = replace(envelope, addressing=replace(envelope.addressing, action=default_action(envelope)))
        self._exchange(key, info, envelope)

    @staticmethod
    def _ack_request(record: SourceRecord, identifier: str) -> AckRequested:
        """WS-RM 1.0 tells the destination the highest number used, so it can see what it is missing."""
        if record.version is RMVersion.WSRM10 and record.next_number > 1:
            return AckRequested(identifier, max_message_number_used=record.next_number - 1)
        return AckRequested(identifier)

    def _exchange(self, key: str, info: SourceInfo, envelopes: Envelope | list[Envelope]) -> bool:
        """POST one envelope, or several as a qtp batch; act on the answer. True when the peer answered."""
        client = mc_id(info.peer)
        if client is not None:  # a peer that cannot listen: held until it polls (WS-MakeConnection)
            for envelope in [envelopes] if isinstance(envelopes, Envelope) else envelopes:
                self.node.mailbox.hold(info.owner, client, envelope, key)
            return False
        transport = self.node.transport
        try:
            if isinstance(envelopes, Envelope) or len(envelopes) == 1:
                envelope = envelopes if isinstance(envelopes, Envelope) else envelopes[0]
                reply = transport.post(info.peer, wire(envelope), envelope.soap, envelope.addressing.action)
            else:
                reply = transport.post_raw(info.peer, encode_batch([wire(e) for e in envelopes]), BATCH_CONTENT_TYPE)
        except TransportError as exc:
            log.debug("%s", exc)
            return False
        if not reply.body.strip():
            return reply.status < 300
        try:
            answer = read_answer(reply.body, info.peer, self.node.metrics)
        except InvalidMessage as exc:
            log.warning("unreadable answer (HTTP %d) from %s: %s", reply.status, info.peer, exc)
            return False
        self.on_answer(answer, key, Source.answer(self.node.settings.security, info.peer))
        return reply.status < 300

    def on_answer(self, answer: Envelope, key: str, source: Source) -> None:
        """The answer to our POST for sequence ``key``: what ``source`` (whoever we POSTed to) may say of its
        own sequences is taken; what it says of another peer's is not (``Ownership``)."""
        about = self.node.ownership.sort(source, answer, key)
        if about.acks:
            self.on_acks(about.acks)
        if about.body:
            self.on_body(answer.body, key)

    def on_body(self, body: Any, key: str | None = None) -> None:
        """A response or fault for our RM Sources, from the peer it is about (the caller checked that):
        ``key``, the sequence whose answer it is (None: it came in a request)."""
        now = time.time()
        if isinstance(body, CreateSequenceResponse) and key is not None:
            self.event(key, CreateSequenceResponded(body, now))
        elif isinstance(body, CloseSequenceResponse):
            self._by_identifier(body.identifier, CloseResponded(now))
        elif isinstance(body, TerminateSequenceResponse):
            self._by_identifier(body.identifier, TerminateResponded(now))
        elif isinstance(body, SequenceFault):
            target = self.key_of(body.identifier) if body.identifier else key
            if target is not None:
                self.event(target, FaultReceived(body.code, now))
        elif isinstance(body, SoapFault):
            log.info("peer answered with a fault: %s", body.reason)

    def on_acks(self, acks: tuple[SequenceAcknowledgement, ...]) -> None:
        """Acknowledgements are set unions, so only the newest per sequence matters: they are kept here and
        applied by the next tick, one store transaction per sequence for however many arrived meanwhile
        (instead of one per HTTP response). Losing them in a crash only means retransmissions."""
        with self._mutex:
            for ack in acks:
                known = self._acks.get(ack.identifier)
                if known is not None and not ack.final and not ack.nacks and not known.nacks and \
                        ranges.union(known.ranges, ack.ranges) == ack.ranges:
                    self._acks[ack.identifier] = ack  # covers what was waiting
                elif known is None:
                    self._acks[ack.identifier] = ack
                else:
                    self._acks[ack.identifier] = _merge(known, ack)
        self.wake.set()

    def _apply_acks(self, now: float) -> None:
        with self._mutex:
            waiting, self._acks = self._acks, {}
        if waiting:
            failpoint("before_acks_applied")  # the peer stored and acknowledged; nothing deleted here yet
        for ack in waiting.values():
            self._by_identifier(ack.identifier, AckReceived(ack, now))

    def _by_identifier(self, identifier: str, event: Any) -> None:
        key = self.key_of(identifier)
        if key is not None:
            self.event(key, event)

    def has(self, key: str) -> bool:
        """Our RM Source sequence ``key`` is known (not yet forgotten)."""
        return key in self._machines

    def unacknowledged(self, key: str) -> set[int]:
        """The numbers of our sequence ``key`` sent and not yet acknowledged."""
        machine = self._machines.get(key)
        return set() if machine is None else {n for n, *_ in machine.record.pending}

    def knows(self, identifier: str) -> bool:
        """An outbound sequence (or an offered route) of ours has this identifier."""
        return f"offer:{identifier}" in self._offer_routes or self.key_of(identifier) is not None

    def info(self, key: str) -> SourceInfo | None:
        """Where our RM Source sequence ``key`` goes, and whose it is (None: forgotten)."""
        return self._infos.get(key)

    def identifier_of(self, key: str) -> str | None:
        machine = self._machines.get(key)
        return None if machine is None else machine.record.identifier

    def end_offer(self, identifier: str) -> None:
        """The inbound sequence that accepted offer ``identifier`` is over and applied: the offered sequence
        ends too once its replies are sent and acknowledged (else it would live, and be polled, for ever)."""
        route = f"offer:{identifier}"
        if route in self._offer_routes:
            with self._mutex:
                self._ending.add(route)
            self.wake.set()

    def polled(self, key: str) -> None:
        """A poll of the peer took a message of our sequence ``key``: if it is an offered one, it lives on."""
        info = self._infos.get(key)
        if info is not None and info.route.startswith("offer:"):
            self._polled.add(key)

    def _keep_polled(self, now: float) -> None:
        """Push forward the expiry of offered sequences polled since their last event, once half of their
        ``offer_inactivity_timeout`` has passed (one write per half timeout, not one per poll)."""
        for key in list(self._polled):
            machine = self._machines.get(key)
            if machine is None or machine.record.expires_at is None:  # (nothing waits on the peer)
                self._polled.discard(key)
            elif machine.record.expires_at - now < self.limits.offer_inactivity_timeout / 2:
                self.event(key, TimerFired(now))

    def offers_of(self, owner: str | None) -> set[str]:
        """The identifiers of the offered sequences of peer ``owner`` (None: anonymous) that have not ended."""
        with self._mutex:
            return {machine.record.identifier or "" for key, machine in self._machines.items()
                    if machine.state not in _ENDED and self._infos[key].owner == owner
                    and self._infos[key].route.startswith("offer:")}

    def replies_waiting(self, owner: str | None, offer: str | None = None) -> tuple[int, bool]:
        """Replies sent to peer ``owner`` on its offered sequences and not acknowledged; and whether the
        window (``max_unacknowledged``) of offered sequence ``offer`` is full, so that further replies would
        wait unnumbered in the store."""
        route = f"offer:{offer}"
        waiting, full = 0, False
        with self._mutex:
            for key, machine in self._machines.items():
                info = self._infos[key]
                if info.owner == owner and info.route.startswith("offer:"):
                    waiting += len(machine.record.pending)
                    if info.route == route:
                        full = len(machine.record.pending) >= self.limits.max_unacknowledged
        return waiting, full

    def _end_offers(self, now: float) -> None:
        with self._mutex:
            ending = list(self._ending)
        for route in ending:
            key = self._current.get(route)
            if key is None:
                with self._mutex:
                    self._ending.discard(route)
                continue
            store = self.node.store_for_route(route)
            with store.local() as s:
                if store.unnumbered(s, route, 1):
                    continue  # replies still to number: the next tick
            machine = self._machines.get(key)
            if machine is not None and machine.record.next_number == 1 and machine.state in _LIVE:
                log.info("offered sequence %s carried no reply: ended with its inbound sequence", key)
                self.event(key, TimerFired(now), expire=True)  # nothing to close or to tell the peer
            else:
                self.event(key, CompleteRequested(now))
            with self._mutex:
                self._ending.discard(route)

    def key_of(self, identifier: str) -> str | None:
        with self._mutex:
            for key, machine in self._machines.items():
                if machine.record.identifier == identifier:
                    return key
        return None

    # ------------------------------------------------------------------ status and shutdown

    def channel_stats(self) -> dict[str, dict[str, float]]:
        """Per channel (offered reply sequences under ``offer``): in flight, round-trip time and timeout."""
        stats: dict[str, dict[str, float]] = {}
        with self._mutex:
            for key, machine in self._machines.items():
                entry = stats.setdefault(_channel(self._infos[key].route), {"in_flight": 0.0})
                entry["in_flight"] += len(machine.record.pending)
                rtt = self._rtt.get(key)
                if rtt is not None and rtt.srtt is not None and self._current.get(self._infos[key].route) == key:
                    entry["round_trip_seconds"] = rtt.srtt
                    entry["retransmission_timeout_seconds"] = rtt.timeout
        return stats

    def snapshot(self) -> list[tuple[SourceInfo, SourceRecord]]:
        with self._mutex:
            return [(self._infos[k], m.record) for k, m in self._machines.items()]

    def submit(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on a sender thread (a best-effort send that nothing waits for)."""
        self._submit(fn)

    def close(self) -> None:
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


class _Wake(threading.Event):
    """The sender's wake-up call (a message was enqueued, an acknowledgement came), counting the calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def set(self) -> None:
        self.calls += 1
        super().set()


class _Pump:
    """The transmissions one sequence still has to make, by number, whether a thread is sending them, and
    when each unacknowledged number last left (monotonic clock)."""

    __slots__ = ("waiting", "running", "sent_at")

    def __init__(self) -> None:
        self.waiting: dict[int, Transmit] = {}
        self.running = False
        self.sent_at: dict[int, float] = {}


class _RoundTrip:
    """RFC 6298's estimator: smoothed round-trip time and its deviation give the retransmission timeout."""

    __slots__ = ("srtt", "rttvar", "timeout", "low", "high")

    def __init__(self, initial: float, low: float, high: float):
        self.srtt: float | None = None
        self.rttvar = 0.0
        self.timeout, self.low, self.high = initial, low, high

    def sample(self, rtt: float) -> None:
        if self.srtt is None:
            self.srtt, self.rttvar = rtt, rtt / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt)
            self.srtt = 0.875 * self.srtt + 0.125 * rtt
        self.timeout = min(self.high, max(self.low, self.srtt + max(0.01, 4 * self.rttvar)))


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
