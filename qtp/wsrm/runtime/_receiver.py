"""The receiver: the node's RM Destinations, fed by the endpoint with decoded envelopes.

Theory. A message is acknowledged only after it is stored: the receive path applies ``MessageReceived``
to a copy of the sequence's machine, stores the payload and the copy's record in one local transaction of
the inbound store, and only after that commit adopts the copy and answers with the acknowledgement. A crash
before the commit loses nothing the source was told it may forget; a crash after it leaves a stored
message whose acknowledgement was lost, and the source's retransmission is then recognised as a duplicate
(the number is in ``received``) and acknowledged again without storing anything.

Concurrent requests for one sequence are serialised by a per-sequence lock (the node is one process, so
it is the only writer of its destination records); different sequences proceed in parallel.

Group commit. Requests of one sequence that arrive while its lock is held (a commit is running) queue in
``_arrivals``; whoever takes the lock next stores *every* queued arrival in one local transaction and
answers each of them after that commit, so under concurrent load the cost per message falls instead of
the queue growing. A lone request never waits for company. A qtp peer's batch is one arrival.
"""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import replace
from typing import Any

from qtp.coordinator.failpoints import failpoint
from qtp.errors import MessagingError
from qtp.wsrm.codec import (
    Addressing,
    BatchRoom,
    Envelope,
    MakeConnection,
    SoapFault,
    WsaVersion,
    anonymous,
    default_action,
    mc_id,
)
from qtp.wsrm.codec._names import action as rm_action
from qtp.wsrm.protocol import (
    AcceptMessage,
    AckRequestedReceived,
    CloseReceived,
    CloseSequence,
    CloseSequenceResponse,
    CreateSequence,
    CreateSequenceReceived,
    CreateSequenceResponse,
    DestinationRecord,
    DestinationSequence,
    DestinationState,
    FaultCode,
    FaultReceived,
    IncompleteSequenceBehavior,
    MessageReceived,
    ProtocolError,
    RMVersion,
    SendAcknowledgement,
    SendCloseSequenceResponse,
    SendCreateSequenceResponse,
    SendFault,
    SendTerminateSequenceResponse,
    SequenceAcknowledgement,
    SequenceEnded,
    SequenceFault,
    TerminateReceived,
    TerminateSequence,
    TerminateSequenceResponse,
    TimerFired,
    unknown_sequence,
)
from qtp.wsrm.protocol import _ranges as ranges
from qtp.wsrm.runtime._answers import NOTHING, Answer, fault, reply_addressing
from qtp.wsrm.runtime._ids import enqueued_at, new_identifier
from qtp.wsrm.runtime._mailbox import Mailbox
from qtp.wsrm.runtime._offers import Offers
from qtp.wsrm.runtime._ownership import Ownership, Source
from qtp.wsrm.runtime._ports import SYSTEM_CLOCK, Clock, Deliveries, OutboundEvents, Run
from qtp.wsrm.runtime._refusals import refusals
from qtp.wsrm.runtime._security import Security, is_loopback
from qtp.wsrm.runtime._sequences import Destinations, Inbound, Outbound
from qtp.wsrm.runtime._settings import Limits
from qtp.wsrm.runtime._transport import Transport, TransportError, wire
from qtp.wsrm.store import DestinationInfo, Incoming, Store

log = logging.getLogger("qtp.wsrm.receiver")

D = DestinationState
_OPEN = (D.ACTIVE, D.CLOSED)
SWEEP_INTERVAL_S = 60.0  # how often applied MessageIDs past their retention are looked for
SWEEP_BATCH = 1000


class Receiver:
    """The node's RM Destinations. Its state is the ``Destinations`` registry (one ``Inbound`` per sequence;
    the lock rules are in ``_sequences``)."""

    def __init__(self, limits: Limits, security: Security, listen_host: str | None, endpoint: str | None,
                 store: Store, destinations: Destinations, offers: Offers, outbound: OutboundEvents,
                 deliveries: Deliveries, mailbox: Mailbox, ownership: Ownership, metrics: Any,
                 transport: Transport, run: Run, clock: Clock = SYSTEM_CLOCK):
        self.limits = limits
        self.tag = ""  # a slot's tag in the identifiers it makes (qtp.wsrm.runtime._shared)
        self.security = security
        self.listen_host = listen_host or ""
        self.endpoint = endpoint
        self.store = store
        self.destinations = destinations
        self.offers = offers
        self.outbound = outbound
        self.deliveries = deliveries
        self.mailbox = mailbox
        self.ownership = ownership
        self.metrics = metrics
        self.transport = transport
        self._run = run
        self.clock = clock
        self._next_sweep = 0.0
        self._creating = threading.Lock()  # one CreateSequence at a time, from its checks to its adoption
        self._unsure: set[tuple[str | None, str]] = set()  # (peer, CreateSequence MessageID): its commit failed

    def load(self) -> None:
        with self.store.local() as s:
            saved = self.store.destinations(s)
        for info, record in saved:
            self.destinations.add(Inbound(info, record))

    def open_sequences(self) -> int:
        return self.destinations.open_count()

    # ------------------------------------------------------------------ requests

    def handle(self, env: Envelope, caller: "Source | str | None" = None, room: BatchRoom | None = None) -> Answer:
        """One request from ``caller``: the authenticated peer's name (None: anonymous), or the ``Source`` of a
        message we fetched (the answer to our poll). Only what it may say of its own sequences is taken
        (``Ownership``); a request that says nothing else is refused. ``room``: the batch a poll's sender
        takes in the answer (qtp's extension)."""
        now = self.clock.time()
        source = Source.of(caller)
        about = self.ownership.sort(source, env)
        if about.acks:
            self.outbound.on_acks(about.acks)
        if not about.sequence or not about.body or \
                about.refused and env.body is None and env.sequence is None and not about.ack_requests:
            return self._refuse(env)
        caller = source.peer
        body = env.body
        if isinstance(body, MakeConnection):  # a peer that cannot listen fetches what we hold for it
            return self.mailbox.answer(env, body, caller, room)
        if isinstance(body, CreateSequence):
            return self._create(env, body, now, caller)
        if env.sequence is not None:
            return self._message(env, now, caller)
        if isinstance(body, CloseSequence):
            return self._event(env, body.identifier, CloseReceived(now, body.last_msg_number))
        if isinstance(body, TerminateSequence):
            return self._event(env, body.identifier, TerminateReceived(now, body.last_msg_number))
        if isinstance(body, SequenceFault):
            return self._fault_received(env, body, now)
        if isinstance(body, SoapFault):
            log.info("a peer sent a fault: %s", body.reason)
            return NOTHING
        if about.ack_requests:
            acks = [self._event(env, r.identifier, AckRequestedReceived(now)) for r in about.ack_requests]
            return acks[0]
        if isinstance(body, (CreateSequenceResponse, CloseSequenceResponse, TerminateSequenceResponse)):
            self.outbound.on_body(body)
            return NOTHING
        if env.acks:
            return NOTHING
        return fault(env, SoapFault("Sender", None, "the message is neither WS-RM nor part of a sequence"), 400)

    # ------------------------------------------------------------------ who may do what

    def _refuse(self, env: Envelope) -> Answer:
        """The answer to a request that named another peer's sequence (logged and counted by ``Ownership``)."""
        return fault(env, SoapFault("Sender", None, "this sequence belongs to another peer"), 403)

    def _may_name(self, caller: str | None, address: str) -> bool:
        security = self.security
        if mc_id(address) is not None:
            # Nothing is sent there: held for the caller's polls. Anonymous callers share one identity, so
            # one could fetch another's replies: only on a loopback node, or where anonymous_addresses says.
            return caller is not None or security.anonymous_may_name(address, None) or \
                is_loopback(self.listen_host)
        if caller is not None:
            peer = security.peers.get(caller)
            return peer is not None and peer.may_name(address)
        return security.anonymous_may_name(address, self.listen_host or None)

    def _owned(self, caller: str | None) -> int:
        """What counts against ``caller``'s max_sequences_per_peer: its open inbound sequences, and the reply
        sequences it offered that outlive the inbound sequence that accepted them (waiting for it to
        acknowledge or poll its replies). An open sequence and its offered one take one place."""
        inbound = [seq for seq in self.destinations.owned(caller) if seq.machine.state in _OPEN]
        accepted = {seq.machine.record.accepted_offer for seq in inbound}
        return len(inbound) + len(self.offers.of(caller) - accepted)

    def _refused_create(self, env: Envelope, reason: str, caller: str | None) -> Answer:
        refusals.warn(log, "create", "refused a CreateSequence from %s: %s",
                      f"peer {caller}" if caller else "an anonymous peer", reason)
        self.metrics.refused.labels(reason="create").inc()
        return fault(env, SequenceFault(FaultCode.CREATE_SEQUENCE_REFUSED, None, reason))

    def _create(self, env: Envelope, body: CreateSequence, now: float, caller: str | None = None) -> Answer:
        """A CreateSequence, under ``_creating``: a copy the peer sent again while the first was being stored
        (a slow or restarting database, a network that duplicates) then finds the first's sequence made and is
        answered with it, instead of making a second sequence that accepts the same offer (two RM Sources for
        one offered sequence: the peer's acknowledgements went to the one that had sent nothing, which failed
        the sequence with InvalidAcknowledgement, and no reply reached the peer any more)."""
        with self._creating:
            return self._create_locked(env, body, now, caller)

    def _create_locked(self, env: Envelope, body: CreateSequence, now: float, caller: str | None) -> Answer:
        message_id = env.addressing.message_id
        if message_id and (caller, message_id) in self._unsure:
            self._adopt_landed(caller, message_id)
        known = self.destinations.created_by(caller, message_id) if message_id else None
        if known is not None:  # a retransmitted CreateSequence
            return self._event(env, known.identifier, CreateSequenceReceived(now))
        refusal = self._create_refusal(env, body, caller)
        if refusal is not None:
            return self._refused_create(env, refusal, caller)
        identifier = new_identifier(self.tag)
        offer = body.offer
        reply_to = _address(env.addressing.reply_to)
        offer_peer = (offer.endpoint if offer is not None and offer.endpoint else None) or reply_to
        accepted = offer.identifier if offer is not None and offer_peer is not None else None
        record = DestinationRecord(identifier, env.rm or RMVersion.WSRM11,
                                   inactivity_timeout=self.limits.inactivity_timeout)
        machine = DestinationSequence(record)
        actions = machine.handle(CreateSequenceReceived(now, expires=None, accepted_offer=accepted))
        info = DestinationInfo(reply_to=offer_peer, soap=env.soap.value, wsa=(env.wsa or WsaVersion.WSA200508).value,
                               acks_to=_address(body.acks_to), create_message_id=message_id, owner=caller)
        offered = None
        if message_id:
            self._unsure.add((caller, message_id))  # until the commit is known to have happened (or not)
        with self.store.local() as s:
            self.store.create_destination(s, info, machine.record)
            if accepted is not None and offer_peer is not None:
                offered = self.offers.accept(s, accepted, offer_peer, machine.record.version, info.soap, info.wsa,
                                             body.batch, owner=caller)
        self._unsure.discard((caller, message_id or ""))
        self.destinations.add(Inbound(info, machine.record))
        if offered is not None:
            self.offers.adopt(offered)
        self.deliveries.ensure(identifier)
        return self._answer(env, identifier, actions)

    def _adopt_landed(self, caller: str | None, message_id: str) -> None:
        """The store transaction of ``caller``'s CreateSequence ``message_id`` failed, perhaps after its COMMIT
        landed: adopt what it stored (the sequence and its offered RM Source), so that the copy the peer sends
        again is answered with that sequence. Otherwise it would make a second one accepting the same offer,
        and after a restart the two RM Sources of one offered sequence, loaded from the store, would fail it."""
        with self.store.local() as s:
            landed = next(((info, record) for info, record in self.store.destinations(s)
                           if info.create_message_id == message_id and info.owner == caller), None)
            offer = landed[1].accepted_offer if landed is not None else None
            source = next(((info, record) for info, record in self.store.sources(s)
                           if offer is not None and info.route == f"offer:{offer}"), None)
        self._unsure.discard((caller, message_id))
        if landed is None:
            return
        log.info("CreateSequence %s had been stored before its transaction failed: sequence %s adopted",
                 message_id, landed[1].identifier)
        self.destinations.add(Inbound(*landed))
        if source is not None:
            self.offers.adopt(Outbound(source[0], source[1], self.limits))
        self.deliveries.ensure(landed[1].identifier)

    def _create_refusal(self, env: Envelope, body: CreateSequence, caller: str | None) -> str | None:
        """Why a new sequence from ``caller`` is refused (None: it is not)."""
        limits = self.limits
        if self.open_sequences() >= limits.max_open_sequences:
            return f"this node has {limits.max_open_sequences} sequences open already"
        if self._owned(caller) >= limits.max_sequences_per_peer:
            return (f"this peer has {limits.max_sequences_per_peer} sequences open here already ([limits] "
                    "max_sequences_per_peer)")
        offer = body.offer
        if offer is not None and self.offers.replies_waiting(caller)[0] >= limits.max_replies_per_peer:
            return (f"{limits.max_replies_per_peer} replies wait for this peer's acknowledgement already "
                    "([limits] max_replies_per_peer)")
        addresses = [("AcksTo", _address(body.acks_to)), ("ReplyTo", _address(env.addressing.reply_to)),
                     ("Offer Endpoint", _address(offer.endpoint) if offer is not None else None)]
        for what, address in addresses:
            if address is not None and not self._may_name(caller, address):
                return f"{what} {address[:200]} is not an address of this peer"
        if offer is not None and self.offers.in_use(offer.identifier):
            return "the offered identifier is in use already"
        return None

    def handle_batch(self, envelopes: list[Envelope], caller: "Source | str | None" = None) -> Answer:
        """A qtp batch (a request's, or the answer to our poll: ``caller`` as for ``handle``): each sequence's
        messages stored in one local commit, one answer with every acknowledgement (or the first fault)."""
        now = self.clock.time()
        source = Source.of(caller)
        caller = source.peer
        groups: dict[str, list[Envelope]] = {}
        for env in envelopes:
            if env.sequence is None or env.body is not None and not isinstance(env.body, SoapFault):
                return fault(env, SoapFault("Sender", None, "a qtp batch carries sequence messages only"), 400)
            about = self.ownership.sort(source, env)
            if not about.sequence:
                return self._refuse(env)
            if about.acks:
                self.outbound.on_acks(about.acks)
            groups.setdefault(env.sequence.identifier, []).append(env)
        answers = [self._messages(group, now, caller) for group in groups.values()]
        failed = next((a for a in answers if a.status >= 300), None)
        if failed is not None:
            return failed
        acks = tuple(ack for a in answers if a.envelope is not None for ack in a.envelope.acks)
        last = next((a for a in reversed(answers) if a.envelope is not None), None)
        if last is None or last.envelope is None:
            return NOTHING
        return Answer(replace(last.envelope, acks=acks), 200)

    def _message(self, env: Envelope, now: float, caller: str | None = None) -> Answer:
        answer = self._messages([env], now, caller)
        if env.ack_requests and answer.envelope is None and answer.status < 300:
            assert env.sequence is not None
            return self._event(env, env.sequence.identifier, AckRequestedReceived(now))
        return answer

    def _messages(self, envs: list[Envelope], now: float, caller: str | None = None) -> Answer:
        """Messages of one sequence, in the order they came: stored (with whatever else queued for the
        sequence meanwhile) in one local transaction, then answered with the acknowledgement after it."""
        identifier = envs[0].sequence.identifier  # type: ignore[union-attr]
        seq = self.destinations.get(identifier)
        if seq is None:
            return self._answer(envs[0], identifier, [unknown_sequence(identifier)])
        refusal = self._admit(seq, envs, caller)
        if refusal is not None:
            return refusal
        arrival = _Arrival(envs)
        with seq.io:
            seq.arrivals.append(arrival)
        try:
            with seq.changing(self._reload):
                if arrival.answer is None and arrival.failure is None:
                    with seq.io:
                        group, seq.arrivals = seq.arrivals, []
                    try:
                        self._store_group(seq, group, now)
                    except BaseException as exc:
                        for other in group:
                            other.failure = exc
                        raise
        except BaseException:
            with seq.io:  # (the reload failed before anyone took it: it is not left for the next group)
                if arrival in seq.arrivals:
                    seq.arrivals.remove(arrival)
            raise
        if arrival.answer is None:
            raise MessagingError(f"the messages of sequence {identifier} could not be stored now: "
                                 f"{arrival.failure}") from arrival.failure
        return arrival.answer

    def _admit(self, seq: Inbound, envs: list[Envelope], caller: str | None) -> Answer | None:
        """Refuse, before anything is stored, what breaks the peer's quotas. (A message whose action no
        handler takes is not refused: refused, it would leave a gap nothing fills and hold every later message
        of its sequence; stored, the invoker makes it a dead letter, with a fault for the client.)"""
        record = seq.machine.record
        info = seq.info
        limits = self.limits
        in_order = _in_order(record.received)
        too_far = next((e for e in envs if e.sequence.number > in_order + limits.max_gap), None)  # type: ignore[union-attr]
        if too_far is not None:
            self.metrics.refused.labels(reason="gap").inc()
            return fault(too_far, SoapFault("Sender", None, f"message number {too_far.sequence.number} is "  # type: ignore[union-attr]
                                            f"more than {limits.max_gap} above the last in order ({in_order})"))
        fresh = sum(1 for e in envs if not ranges.contains(record.received, e.sequence.number))  # type: ignore[union-attr]
        if not fresh:
            return None
        owned = {s.identifier for s in self.destinations.all() if s.info.owner == caller}
        backlog = self.deliveries.backlog_of(owned)
        if backlog + fresh > limits.max_backlog_per_peer:
            self.metrics.refused.labels(reason="peer_backlog").inc()
            return fault(envs[0], SoapFault("Receiver", None, "this peer's backlog of unapplied messages "
                                            "is full; retry later"), 503)
        if record.accepted_offer is not None and info.channel is None:
            return self._admit_replies(envs[0], caller, record.accepted_offer, backlog + fresh)
        return None

    def _admit_replies(self, env: Envelope, caller: str | None, offer: str, coming: int) -> Answer | None:
        """Messages whose replies go to ``caller``'s offered sequence ``offer``: refused (503, before they are
        stored, so that the peer sends them again later) while the replies waiting for the peer's
        acknowledgement and the ``coming`` ones (its unapplied messages) would pass ``max_replies_per_peer``,
        or while that sequence's window is full (further replies would pile up in the store unnumbered)."""
        waiting, full = self.offers.replies_waiting(caller, offer)
        limit = self.limits.max_replies_per_peer
        if waiting + coming <= limit and not full:
            return None
        self.metrics.refused.labels(reason="peer_replies").inc()  # (not logged: a peer may retry at any rate)
        return fault(env, SoapFault("Receiver", None, "too many replies wait for this peer's "
                                    "acknowledgement; acknowledge (or poll for) them, then retry"), 503)

    def _store_group(self, seq: Inbound, group: list["_Arrival"], now: float) -> None:
        """Take ``group`` (arrivals of one sequence, under its lock) through the machine, store what it
        accepted in one commit, then give each arrival its answer. An exception answers none of them:
        ``_messages`` raises it to every caller, none of whose messages was acknowledged."""
        identifier = seq.identifier
        if self.destinations.get(identifier) is not seq:  # forgotten while the requests waited
            for arrival in group:
                arrival.answer = self._answer(arrival.envs[0], identifier, [unknown_sequence(identifier)])
            return
        before = seq.machine.record
        record = before
        accepted: list[Incoming] = []
        for arrival in group:
            record, taken = self._accept(identifier, record, arrival, now)
            accepted += taken

        applied: set[int] = set()

        def save() -> None:
            done = self.deliveries.receipt(seq.info, record, before, accepted)
            if done is not None:  # stored and (its head) applied in one global transaction
                applied.update(done)
                return
            with self.store.local() as s:
                self.store.store_incoming_many(s, accepted)
                self.store.save_destination(s, seq.info, record, before=before)
            failpoint("after_store_before_ack")

        seq.adopt(DestinationSequence(record), save if accepted else None)
        if accepted:
            self.metrics.received.inc(len(accepted))
            self.metrics.stored_batch.observe(len(accepted))
        for message in accepted:  # also when stored already, by a commit whose outcome we did not learn
            if message.number not in applied:
                self.deliveries.stored(identifier, message.number, message)
        for arrival in group:
            if arrival.answer is None:
                arrival.answer = self._answer(arrival.envs[-1], identifier, arrival.actions or [])

    def _accept(self, identifier: str, record: DestinationRecord, arrival: "_Arrival",
                now: float) -> tuple[DestinationRecord, list[Incoming]]:
        """Feed one arrival's messages to the machine at ``record``: the record after them and what they
        accepted; or ``record`` unchanged and the arrival answered by a fault (backlog full: 503 before
        anything is stored; a protocol error)."""
        fresh = sum(1 for e in arrival.envs if not ranges.contains(record.received, e.sequence.number))  # type: ignore[union-attr]
        if fresh and self._busy(fresh):
            busy = SoapFault("Receiver", None, "the node's backlog of unapplied messages is full; retry later")
            arrival.answer = fault(arrival.envs[0], busy, 503)
            return record, []
        probe = DestinationSequence(record)
        actions: list[Any] = []
        ack: list[Any] = []  # only the last acknowledgement counts: it covers the earlier ones
        accepted: list[Incoming] = []
        for env in arrival.envs:
            seq = env.sequence
            assert seq is not None
            try:
                step = probe.handle(MessageReceived(seq.number, now, seq.last_message))
            except ProtocolError as exc:
                arrival.answer = self._protocol_error(env, identifier, exc)
                return record, []
            if any(isinstance(a, AcceptMessage) for a in step):
                accepted.append(_incoming(env, now))
            for a in step:
                if isinstance(a, SendAcknowledgement):
                    ack = [a]
                else:
                    actions.append(a)
        arrival.actions = actions + ack
        return probe.record, accepted

    def _reload(self, seq: Inbound) -> None:
        """The last store transaction of this sequence failed, perhaps after its COMMIT landed: rebuild the
        machine from the store (the truth) before handling anything else, or a later save would drop a
        number that was stored and acknowledged nowhere else (and its retransmission would be applied twice)."""
        with self.store.local() as s:
            saved = {record.identifier: record for _, record in self.store.destinations(s)}
        before = seq.machine.record
        if seq.identifier in saved:
            seq.machine = DestinationSequence(saved[seq.identifier])
            # what that transaction stored after all: the invoker was never told (the caller saw an error),
            # and a retransmission is now a duplicate that would not tell it either
            for low, high in ranges.difference(saved[seq.identifier].received, before.received):
                for number in range(low, high + 1):
                    self.deliveries.stored(seq.identifier, number)
        log.info("inbound sequence %s reloaded from the store after a failed transaction", seq.identifier)

    def _busy(self, arriving: int = 1) -> bool:
        return self.deliveries.backlog() + arriving > self.limits.max_invoker_backlog

    def _event(self, env: Envelope, identifier: str, event: Any) -> Answer:
        seq = self.destinations.get(identifier)
        if seq is None:
            return self._answer(env, identifier, [unknown_sequence(identifier)])
        with seq.changing(self._reload) as machine:
            if self.destinations.get(identifier) is not seq:  # forgotten while this request waited for the lock
                return self._answer(env, identifier, [unknown_sequence(identifier)])
            probe = DestinationSequence(machine.record)
            try:
                actions = probe.handle(event)
            except ProtocolError as exc:
                return self._protocol_error(env, identifier, exc)
            changed = probe.record.state is not machine.record.state or \
                probe.record.last_number != machine.record.last_number
            seq.adopt(probe, (lambda: self._save(seq, probe.record, machine.record)) if changed else None)
        for a in actions:
            if isinstance(a, SequenceEnded):
                self.deliveries.completed(identifier, probe.record.received)
        return self._answer(env, identifier, actions)

    def _save(self, seq: Inbound, record: DestinationRecord, before: DestinationRecord) -> None:
        with self.store.local() as s:
            self.store.save_destination(s, seq.info, record, before=before)

    def _fault_received(self, env: Envelope, body: SequenceFault, now: float) -> Answer:
        """A SequenceFault from the peer of the sequence it names (``handle`` checked that): for one of our
        inbound sequences, or else for our outbound ones."""
        if body.identifier is not None and body.identifier in self.destinations:
            self._event(env, body.identifier, FaultReceived(body.code, now))
        elif body.identifier is not None:
            self.outbound.on_body(body)
        else:
            log.info("a peer sent a SequenceFault that names no sequence: %s", body.reason)
        return NOTHING

    def _protocol_error(self, env: Envelope, identifier: str, exc: ProtocolError) -> Answer:
        log.error("inbound sequence %s: %s", identifier, exc)
        return fault(env, SequenceFault(FaultCode.SEQUENCE_TERMINATED, identifier, str(exc)))

    def tick(self, now: float) -> None:
        """Inactivity and expiry of inbound sequences; ended ones are forgotten after ``ended_retention``;
        applied MessageIDs older than ``dedup_retention`` are forgotten, in batches."""
        if now >= self._next_sweep:
            self._next_sweep = now + SWEEP_INTERVAL_S
            self.sweep(now)
        retention = self.limits.ended_retention
        for seq in self.destinations.all():
            record = seq.machine.record
            if record.state in (D.TERMINATED, D.FAILED):
                if now - record.last_activity > retention and not self.deliveries.pending(seq.identifier):
                    self._forget(seq)
                continue
            at = seq.machine.next_timer(record)
            if at is not None and at <= now:
                self._event(_NO_ENVELOPE, seq.identifier, TimerFired(now))

    def sweep(self, now: float) -> int:
        """Forget the applied MessageIDs older than ``dedup_retention``, ``SWEEP_BATCH`` per statement."""
        forgotten, cutoff = 0, now - self.limits.dedup_retention
        while True:
            with self.store.local() as s:
                count = self.store.forget_applied(s, cutoff, SWEEP_BATCH)
            forgotten += count
            if count < SWEEP_BATCH:
                return forgotten

    def _forget(self, seq: Inbound) -> None:
        """Drop an ended sequence, under its lock: a request that holds the lock finishes first, one that
        waits for it then finds the sequence gone (UnknownSequence) instead of half of it (a 500)."""
        with seq.lock:
            with self.store.local() as s:
                self.store.drop_destination(s, seq.identifier)
            self.destinations.remove(seq)

    # ------------------------------------------------------------------ answers

    def _answer(self, env: Envelope, identifier: str, actions: list[Any]) -> Answer:
        if env is _NO_ENVELOPE:
            return NOTHING
        acks: list[SequenceAcknowledgement] = []
        body: Any = None
        for a in actions:
            if isinstance(a, SendAcknowledgement):
                acks.append(a.ack)
            elif isinstance(a, SendFault):
                return fault(env, a.fault)
            elif isinstance(a, SendCreateSequenceResponse):
                body = self._create_response(env, a)
            elif isinstance(a, SendCloseSequenceResponse):
                body = CloseSequenceResponse(a.identifier)
            elif isinstance(a, SendTerminateSequenceResponse):
                body = TerminateSequenceResponse(a.identifier)
        info = self.destinations.info(identifier)
        if acks and info is not None and info.acks_to and not _anonymous(info.acks_to) and body is None:
            self._send_acks_to(info, env, acks)  # addressable AcksTo: acknowledged there, not here
            acks = []
        if not acks and body is None:
            return NOTHING
        reply = Envelope(soap=env.soap, rm=env.rm, wsa=env.wsa, acks=tuple(acks), body=body,
                         addressing=reply_addressing(env, ""))
        act = default_action(reply)
        return Answer(replace(reply, addressing=replace(reply.addressing, action=act)), 200)

    def _create_response(self, env: Envelope, a: SendCreateSequenceResponse) -> CreateSequenceResponse:
        accept = None
        if a.accepted_offer is not None:
            accept = self.endpoint or anonymous(env.wsa or WsaVersion.WSA200508)
        behavior = IncompleteSequenceBehavior.NO_DISCARD if env.rm is RMVersion.WSRM11 else None
        batch = env.body.batch if isinstance(env.body, CreateSequence) else None
        return CreateSequenceResponse(a.identifier, a.expires, incomplete_behavior=behavior, accept_acks_to=accept,
                                      batch=min(batch, self.limits.max_batch) if batch else None)

    def _send_acks_to(self, info: DestinationInfo, request: Envelope, acks: list[SequenceAcknowledgement]) -> None:
        """Acknowledgements for a sequence whose AcksTo is addressable: POST them there (or, for a WS-MC
        address, hold them for the peer's poll)."""
        assert info.acks_to is not None
        wsa = request.wsa or WsaVersion.WSA200508
        rm = request.rm or RMVersion.WSRM11
        envelope = Envelope(soap=request.soap, rm=rm, wsa=wsa, acks=tuple(acks), addressing=Addressing(
            action=rm_action(rm, "SequenceAcknowledgement"), to=info.acks_to, message_id=f"urn:uuid:{uuid.uuid4()}",
            reply_to=anonymous(wsa)))
        client = mc_id(info.acks_to)
        if client is not None:  # a peer that cannot listen: it fetches them with MakeConnection
            self.mailbox.hold(info.owner, client, envelope)
            return
        self._run(self._post_acks, info.acks_to, envelope)

    def _post_acks(self, address: str, envelope: Envelope) -> None:
        try:
            self.transport.post(address, wire(envelope), envelope.soap, envelope.addressing.action)
        except TransportError as exc:
            log.debug("acknowledgement to %s not delivered (the source will ask again): %s", address, exc)


class _Arrival:
    """One request's messages of a sequence, waiting to be stored by whoever commits next."""

    __slots__ = ("envs", "actions", "answer", "failure")

    def __init__(self, envs: list[Envelope]):
        self.envs = envs
        self.actions: list[Any] | None = None
        self.answer: Answer | None = None
        self.failure: BaseException | None = None


def _incoming(env: Envelope, now: float) -> Incoming:
    seq = env.sequence
    assert seq is not None
    message_id = env.addressing.message_id or f"urn:uuid:{uuid.uuid4()}"
    return Incoming(identifier=seq.identifier, number=seq.number, message_id=message_id,
                    action=env.addressing.action or "", payload=env.payload, received_at=now,
                    enqueued_at=enqueued_at(message_id), relates_to=env.addressing.relates_to,
                    fault=env.body.reason if isinstance(env.body, SoapFault) else None)


def _anonymous(address: str) -> bool:
    return address.endswith("/anonymous") or address.endswith("/role/anonymous")


def _address(address: str | None) -> str | None:
    return None if address is None or _anonymous(address) or address.endswith("/none") else address


def _in_order(received: tuple[tuple[int, int], ...]) -> int:
    """The highest number below which every number was received (0: not even 1)."""
    return next((upper for lower, upper in received if lower == 1), 0)


class _NoEnvelope:
    """Stands for 'no request': timer events answer nobody."""


_NO_ENVELOPE: Any = _NoEnvelope()
