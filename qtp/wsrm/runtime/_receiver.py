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
import time
import uuid
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from qtp.coordinator.failpoints import failpoint
from qtp.errors import MessagingError
from qtp.wsrm.codec import (
    Addressing,
    Envelope,
    WSMC_FAULT_ACTION,
    WSMC_NS,
    MakeConnection,
    SoapFault,
    WsaVersion,
    anonymous,
    default_action,
    mc_id,
)
from qtp.wsrm.codec._names import WSA_FAULT_ACTION
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
from qtp.wsrm.runtime._ownership import Source
from qtp.wsrm.runtime._refusals import refusals
from qtp.wsrm.runtime._security import is_loopback
from qtp.wsrm.store import DestinationInfo, Incoming, SourceInfo

if TYPE_CHECKING:
    from qtp.wsrm.runtime._node import Node
    from qtp.wsrm.runtime._settings import ChannelSettings

log = logging.getLogger("qtp.wsrm.receiver")

D = DestinationState
SWEEP_INTERVAL_S = 60.0  # how often applied MessageIDs past their retention are looked for
SWEEP_BATCH = 1000
_ENQUEUED_PREFIX = "urn:qtp:m:"


def new_message_id(now: float) -> str:
    """A MessageID that also tells a qtp peer when the message was enqueued (for the latency histogram)."""
    return f"{_ENQUEUED_PREFIX}{int(now * 1_000_000)}:{uuid.uuid4().hex}"


def enqueued_at(message_id: str) -> float | None:
    if not message_id.startswith(_ENQUEUED_PREFIX):
        return None
    stamp = message_id[len(_ENQUEUED_PREFIX):].split(":", 1)[0]
    return int(stamp) / 1_000_000 if stamp.isdigit() else None


@dataclass(frozen=True, slots=True)
class Answer:
    """What the endpoint sends back: an envelope (None: nothing, 202) and the HTTP status."""

    envelope: Envelope | None
    status: int = 200


class Receiver:
    def __init__(self, node: "Node"):
        self.node = node
        self.store = node.inbound_store
        self._machines: dict[str, DestinationSequence] = {}
        self._infos: dict[str, DestinationInfo] = {}
        self._created_by: dict[str, str] = {}  # CreateSequence MessageID -> identifier
        self._locks: dict[str, threading.Lock] = {}
        self._mutex = threading.Lock()
        self._creating = threading.Lock()  # one CreateSequence at a time, from its checks to its adoption
        self._unsure: set[str] = set()  # CreateSequence MessageIDs whose store transaction failed
        self._stale: set[str] = set()  # sequences whose last store transaction ended with an error
        self._arrivals: dict[str, list[_Arrival]] = {}  # requests waiting for their sequence's next commit
        self._next_sweep = 0.0

    def load(self) -> None:
        with self.store.local() as s:
            saved = self.store.destinations(s)
        for info, record in saved:
            self._adopt(info, record)

    def _adopt(self, info: DestinationInfo, record: DestinationRecord) -> None:
        with self._mutex:
            self._machines[record.identifier] = DestinationSequence(record)
            self._infos[record.identifier] = info
            self._locks.setdefault(record.identifier, threading.Lock())
            if info.create_message_id:
                self._created_by[info.create_message_id] = record.identifier

    def open_sequences(self) -> int:
        with self._mutex:
            return sum(1 for m in self._machines.values() if m.state in (D.ACTIVE, D.CLOSED))

    def info(self, identifier: str) -> DestinationInfo | None:
        return self._infos.get(identifier)

    def record(self, identifier: str) -> DestinationRecord | None:
        machine = self._machines.get(identifier)
        return None if machine is None else machine.record

    # ------------------------------------------------------------------ offered sequences (our replies)

    def expect_offered(self, identifier: str, channel: str, settings: "ChannelSettings") -> None:
        """Our RM Source is about to offer ``identifier``: be its destination before the peer can use it."""
        record = DestinationRecord(identifier, settings.wsrm, state=D.ACTIVE, last_activity=time.time(),
                                   inactivity_timeout=self.node.limits.inactivity_timeout)
        peer = self.node.settings.security.peer_for_url(settings.peer)
        info = DestinationInfo(channel=channel, soap=settings.soap.value, wsa=settings.wsa.value,
                               owner=None if peer is None else peer.name)
        with self.store.local() as s:
            self.store.save_destination(s, info, record)
        self._adopt(info, record)

    def offer_accepted(self, identifier: str) -> None:
        log.info("the peer accepted offered sequence %s for replies", identifier)

    # ------------------------------------------------------------------ requests

    def handle(self, env: Envelope, caller: "Source | str | None" = None) -> Answer:
        """One request from ``caller``: the authenticated peer's name (None: anonymous), or the ``Source`` of a
        message we fetched (the answer to our poll). Only what it may say of its own sequences is taken
        (``Ownership``); a request that says nothing else is refused."""
        now = time.time()
        source = Source.of(caller)
        about = self.node.ownership.sort(source, env)
        if about.acks:
            self.node.sender.on_acks(about.acks)
        if not about.sequence or not about.body or \
                about.refused and env.body is None and env.sequence is None and not about.ack_requests:
            return self._refuse(env)
        caller = source.peer
        body = env.body
        if isinstance(body, MakeConnection):  # a peer that cannot listen fetches what we hold for it
            return self.node.mailbox.answer(env, body, caller)
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
            return Answer(None, 202)
        if about.ack_requests:
            acks = [self._event(env, r.identifier, AckRequestedReceived(now)) for r in about.ack_requests]
            return acks[0]
        if isinstance(body, (CreateSequenceResponse, CloseSequenceResponse, TerminateSequenceResponse)):
            self.node.sender.on_body(body)
            return Answer(None, 202)
        if env.acks:
            return Answer(None, 202)
        return self.fault(env, SoapFault("Sender", None, "the message is neither WS-RM nor part of a sequence"), 400)

    # ------------------------------------------------------------------ who may do what

    def _foreign(self, identifier: str, caller: str | None) -> bool:
        """``identifier`` is one of our inbound sequences and ``caller`` is not the peer that owns it."""
        return not self.node.ownership.admits(Source(caller), identifier)

    def _refuse(self, env: Envelope) -> Answer:
        """The answer to a request that named another peer's sequence (logged and counted by ``Ownership``)."""
        return self.fault(env, SoapFault("Sender", None, "this sequence belongs to another peer"), 403)

    def _may_name(self, caller: str | None, address: str) -> bool:
        security = self.node.settings.security
        if mc_id(address) is not None:
            # Nothing is sent there: held for the caller's polls. Anonymous callers share one identity, so
            # one could fetch another's replies: only on a loopback node, or where anonymous_addresses says.
            return caller is not None or security.anonymous_may_name(address, None) or \
                is_loopback(self.node.settings.listen_host() or "")
        if caller is not None:
            peer = security.peers.get(caller)
            return peer is not None and peer.may_name(address)
        return security.anonymous_may_name(address, self.node.settings.listen_host())

    def _owned_open(self, caller: str | None) -> list[str]:
        with self._mutex:
            return [i for i, m in self._machines.items()
                    if m.state in (D.ACTIVE, D.CLOSED) and self._infos[i].owner == caller and self._infos[i].channel is None]

    def _owned(self, caller: str | None) -> int:
        """What counts against ``caller``'s max_sequences_per_peer: its open inbound sequences, and the reply
        sequences it offered that outlive the inbound sequence that accepted them (waiting for it to
        acknowledge or poll its replies). An open sequence and its offered one take one place."""
        inbound = self._owned_open(caller)
        with self._mutex:
            accepted = {self._machines[i].record.accepted_offer for i in inbound if i in self._machines}
        return len(inbound) + len(self.node.sender.offers_of(caller) - accepted)

    def _refused_create(self, env: Envelope, reason: str, caller: str | None) -> Answer:
        refusals.warn(log, "create", "refused a CreateSequence from %s: %s",
                      f"peer {caller}" if caller else "an anonymous peer", reason)
        self.node.metrics.refused.labels(reason="create").inc()
        return self.fault(env, SequenceFault(FaultCode.CREATE_SEQUENCE_REFUSED, None, reason))

    def _create(self, env: Envelope, body: CreateSequence, now: float, caller: str | None = None) -> Answer:
        """A CreateSequence, under ``_creating``: a copy the peer sent again while the first was being stored
        (a slow or restarting database) then finds the first's sequence made and is answered with it, instead
        of making a second sequence that accepts the same offer (two RM Sources for one offered sequence:
        the peer's acknowledgements went to the one that had sent nothing, which failed the sequence with
        InvalidAcknowledgement, and no reply reached the peer any more)."""
        with self._creating:
            return self._create_locked(env, body, now, caller)

    def _create_locked(self, env: Envelope, body: CreateSequence, now: float, caller: str | None) -> Answer:
        message_id = env.addressing.message_id
        if message_id in self._unsure:
            self._adopt_landed(message_id)
        known = self._created_by.get(message_id) if message_id else None
        if known is not None and not self._foreign(known, caller):  # a retransmitted CreateSequence
            return self._event(env, known, CreateSequenceReceived(now))
        limits = self.node.limits
        if self.open_sequences() >= limits.max_open_sequences:
            return self._refused_create(env, f"this node has {limits.max_open_sequences} sequences open already",
                                        caller)
        if self._owned(caller) >= limits.max_sequences_per_peer:
            return self._refused_create(env, f"this peer has {limits.max_sequences_per_peer} sequences open "
                                        "here already ([limits] max_sequences_per_peer)", caller)
        offer = body.offer
        if offer is not None and self.node.sender.replies_waiting(caller)[0] >= limits.max_replies_per_peer:
            return self._refused_create(env, f"{limits.max_replies_per_peer} replies wait for this peer's "
                                        "acknowledgement already ([limits] max_replies_per_peer)", caller)
        addresses = [("AcksTo", _address(body.acks_to)), ("ReplyTo", _address(env.addressing.reply_to)),
                     ("Offer Endpoint", _address(offer.endpoint) if offer is not None else None)]
        for what, address in addresses:
            if address is not None and not self._may_name(caller, address):
                return self._refused_create(env, f"{what} {address[:200]} is not an address of this peer", caller)
        if offer is not None and self._offer_in_use(offer.identifier):
            return self._refused_create(env, "the offered identifier is in use already", caller)
        identifier = f"urn:uuid:{uuid.uuid4()}"
        offer = body.offer
        reply_to = _address(env.addressing.reply_to)
        offer_peer = (offer.endpoint if offer is not None and offer.endpoint else None) or reply_to
        accepted = offer.identifier if offer is not None and offer_peer is not None else None
        record = DestinationRecord(identifier, env.rm or RMVersion.WSRM11,
                                   inactivity_timeout=self.node.limits.inactivity_timeout)
        machine = DestinationSequence(record)
        actions = machine.handle(CreateSequenceReceived(now, expires=None, accepted_offer=accepted))
        info = DestinationInfo(reply_to=offer_peer, soap=env.soap.value, wsa=(env.wsa or WsaVersion.WSA200508).value,
                               acks_to=_address(body.acks_to), create_message_id=message_id, owner=caller)
        offered = None
        if message_id:
            self._unsure.add(message_id)  # until the commit is known to have happened (or not)
        with self.store.local() as s:
            self.store.create_destination(s, info, machine.record)
            if accepted is not None:
                offered = self.node.sender.add_offer_route(s, self.store, accepted, offer_peer, machine.record.version,
                                                           info.soap, info.wsa, body.batch, owner=caller)
        self._unsure.discard(message_id)
        self._adopt(info, machine.record)
        if offered is not None:
            self.node.sender.adopt_offer(offered, SourceInfo(f"offer:{accepted}", offer_peer, info.soap, info.wsa,
                                                             owner=caller))
        self.node.invoker.ensure(identifier)
        return self._answer(env, identifier, actions)

    def _adopt_landed(self, message_id: str) -> None:
        """The store transaction of the CreateSequence ``message_id`` failed, perhaps after its COMMIT landed:
        adopt what it stored (the sequence and its offered RM Source), so that the copy the peer sends again
        is answered with that sequence. Otherwise it would make a second one accepting the same offer, and
        after a restart the two RM Sources of one offered sequence, loaded from the store, would fail it
        (the peer's acknowledgements reaching the one that sent nothing: InvalidAcknowledgement)."""
        with self.store.local() as s:
            landed = next(((info, record) for info, record in self.store.destinations(s)
                           if info.create_message_id == message_id), None)
            offer = landed[1].accepted_offer if landed is not None else None
            source = next(((info, record) for info, record in self.store.sources(s)
                           if offer is not None and info.route == f"offer:{offer}"), None)
        self._unsure.discard(message_id)
        if landed is None:
            return
        log.info("CreateSequence %s had been stored before its transaction failed: sequence %s adopted",
                 message_id, landed[1].identifier)
        self._adopt(*landed)
        if source is not None:
            self.node.sender.adopt_offer(source[1], source[0])
        self.node.invoker.ensure(landed[1].identifier)

    def _offer_in_use(self, identifier: str) -> bool:
        return identifier in self._locks or self.node.sender.knows(identifier)

    def handle_batch(self, envelopes: list[Envelope], caller: str | None = None) -> Answer:
        """A qtp batch: each sequence's messages stored in one local commit, one answer with every
        acknowledgement (or the first fault)."""
        now = time.time()
        groups: dict[str, list[Envelope]] = {}
        for env in envelopes:
            if env.sequence is None or env.body is not None and not isinstance(env.body, SoapFault):
                return self.fault(env, SoapFault("Sender", None, "a qtp batch carries sequence messages only"), 400)
            about = self.node.ownership.sort(Source.of(caller), env)
            if not about.sequence:
                return self._refuse(env)
            if about.acks:
                self.node.sender.on_acks(about.acks)
            groups.setdefault(env.sequence.identifier, []).append(env)
        answers = [self._messages(group, now, caller) for group in groups.values()]
        failed = next((a for a in answers if a.status >= 300), None)
        if failed is not None:
            return failed
        acks = tuple(ack for a in answers if a.envelope is not None for ack in a.envelope.acks)
        last = next((a for a in reversed(answers) if a.envelope is not None), None)
        if last is None or last.envelope is None:
            return Answer(None, 202)
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
        lock = self._locks.get(identifier)
        if lock is None:
            return self._answer(envs[0], identifier, [unknown_sequence(identifier)])
        refusal = self._admit(envs, caller)
        if refusal is not None:
            return refusal
        arrival = _Arrival(envs)
        with self._mutex:
            self._arrivals.setdefault(identifier, []).append(arrival)
        with lock:
            if arrival.answer is None and arrival.failure is None:
                with self._mutex:
                    group = self._arrivals.pop(identifier, [])
                try:
                    self._store_group(identifier, group, now)
                except BaseException as exc:
                    for other in group:
                        other.failure = exc
                    raise
        if arrival.answer is None:
            raise MessagingError(f"the messages of sequence {identifier} could not be stored now: "
                                 f"{arrival.failure}") from arrival.failure
        return arrival.answer

    def _admit(self, envs: list[Envelope], caller: str | None) -> Answer | None:
        """Refuse, before anything is stored, what no handler takes and what breaks the peer's quotas."""
        identifier = envs[0].sequence.identifier  # type: ignore[union-attr]
        info = self._infos.get(identifier)
        machine = self._machines.get(identifier)
        handlers = self.node.handlers  # none yet: the application is still registering them; messages wait
        if handlers and info is not None and info.channel is None and machine is not None and \
                machine.state is D.ACTIVE:  # (replies on an offered sequence go to the reply handler)
            for env in envs:
                action = env.addressing.action or ""
                if not isinstance(env.body, SoapFault) and action not in handlers and \
                        not (env.rm is RMVersion.WSRM10 and env.sequence.last_message and not env.payload):  # type: ignore[union-attr]
                    self.node.metrics.refused.labels(reason="unknown_action").inc()
                    refusals.warn(log, "unknown_action", "refused a message with action %r on %s: no handler "
                                  "takes it", action[:200], identifier)
                    return self.fault(env, SoapFault("Sender", "wsa:ActionNotSupported",
                                                     f"no handler for action {action[:200]}"))
        if machine is not None:
            limits = self.node.limits
            in_order = _in_order(machine.record.received)
            too_far = next((e for e in envs if e.sequence.number > in_order + limits.max_gap), None)  # type: ignore[union-attr]
            if too_far is not None:
                self.node.metrics.refused.labels(reason="gap").inc()
                return self.fault(too_far, SoapFault("Sender", None, f"message number {too_far.sequence.number} is "  # type: ignore[union-attr]
                                                     f"more than {limits.max_gap} above the last in order ({in_order})"))
            fresh = sum(1 for e in envs if not _ranges_contain(machine.record.received, e.sequence.number))  # type: ignore[union-attr]
            backlog = self.node.invoker.backlog_of(set(self._owned_all(caller))) if fresh else 0
            if fresh and backlog + fresh > limits.max_backlog_per_peer:
                self.node.metrics.refused.labels(reason="peer_backlog").inc()
                return self.fault(envs[0], SoapFault("Receiver", None, "this peer's backlog of unapplied messages "
                                                     "is full; retry later"), 503)
            if fresh and machine.record.accepted_offer is not None and info is not None and info.channel is None:
                return self._admit_replies(envs[0], caller, machine.record.accepted_offer, backlog + fresh)
        return None

    def _admit_replies(self, env: Envelope, caller: str | None, offer: str, coming: int) -> Answer | None:
        """Messages whose replies go to ``caller``'s offered sequence ``offer``: refused (503, before they are
        stored, so that the peer sends them again later) while the replies waiting for the peer's
        acknowledgement and the ``coming`` ones (its unapplied messages) would pass ``max_replies_per_peer``,
        or while that sequence's window is full (further replies would pile up in the store unnumbered)."""
        waiting, full = self.node.sender.replies_waiting(caller, offer)
        limit = self.node.limits.max_replies_per_peer
        if waiting + coming <= limit and not full:
            return None
        self.node.metrics.refused.labels(reason="peer_replies").inc()  # (not logged: a peer may retry at any rate)
        return self.fault(env, SoapFault("Receiver", None, "too many replies wait for this peer's "
                                         "acknowledgement; acknowledge (or poll for) them, then retry"), 503)

    def _owned_all(self, caller: str | None) -> list[str]:
        with self._mutex:
            return [i for i, info in self._infos.items() if info.owner == caller]

    def _store_group(self, identifier: str, group: list["_Arrival"], now: float) -> None:
        """Take ``group`` (arrivals of one sequence, under its lock) through the machine, store what it
        accepted in one commit, then give each arrival its answer. An exception answers none of them:
        ``_messages`` raises it to every caller, none of whose messages was acknowledged."""
        self._reload_if_stale(identifier)
        machine = self._machines.get(identifier)
        if machine is None or identifier not in self._infos:  # forgotten while the requests waited
            for arrival in group:
                arrival.answer = self._answer(arrival.envs[0], identifier, [unknown_sequence(identifier)])
            return
        record = machine.record
        accepted: list[Incoming] = []
        for arrival in group:
            record, taken = self._accept(identifier, record, arrival, now)
            accepted += taken
        if accepted:
            self._stale.add(identifier)  # until the commit is known to have happened
            with self.store.local() as s:
                self.store.store_incoming_many(s, accepted)
                self.store.save_destination(s, self._infos[identifier], record, before=machine.record)
            failpoint("after_store_before_ack")
            self.node.metrics.received.inc(len(accepted))
            self.node.metrics.stored_batch.observe(len(accepted))
        self._machines[identifier] = DestinationSequence(record)
        self._stale.discard(identifier)
        for message in accepted:  # also when stored already, by a commit whose outcome we did not learn
            self.node.invoker.stored(identifier, message.number, message)
        for arrival in group:
            if arrival.answer is None:
                arrival.answer = self._answer(arrival.envs[-1], identifier, arrival.actions or [])

    def _accept(self, identifier: str, record: DestinationRecord, arrival: "_Arrival",
                now: float) -> tuple[DestinationRecord, list[Incoming]]:
        """Feed one arrival's messages to the machine at ``record``: the record after them and what they
        accepted; or ``record`` unchanged and the arrival answered by a fault (backlog full: 503 before
        anything is stored; a protocol error)."""
        fresh = sum(1 for e in arrival.envs if not _ranges_contain(record.received, e.sequence.number))  # type: ignore[union-attr]
        if fresh and self._busy(fresh):
            fault = SoapFault("Receiver", None, "the node's backlog of unapplied messages is full; retry later")
            arrival.answer = self.fault(arrival.envs[0], fault, 503)
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

    def _reload_if_stale(self, identifier: str) -> None:
        """The last store transaction of this sequence failed, perhaps after its COMMIT landed: rebuild the
        machine from the store (the truth) before handling anything else, or a later save would drop a
        number that was stored and acknowledged nowhere else (and its retransmission would be applied twice)."""
        if identifier not in self._stale:
            return
        with self.store.local() as s:
            saved = {record.identifier: record for _, record in self.store.destinations(s)}
        before = self._machines.get(identifier)
        if identifier in saved:
            self._machines[identifier] = DestinationSequence(saved[identifier])
            # what that transaction stored after all: the invoker was never told (the caller saw an error),
            # and a retransmission is now a duplicate that would not tell it either
            landed = ranges.difference(saved[identifier].received, before.record.received if before else ())
            for low, high in landed:
                for number in range(low, high + 1):
                    self.node.invoker.stored(identifier, number)
        self._stale.discard(identifier)
        log.info("inbound sequence %s reloaded from the store after a failed transaction", identifier)

    def _busy(self, arriving: int = 1) -> bool:
        return self.node.invoker.backlog() + arriving > self.node.limits.max_invoker_backlog

    def _event(self, env: Envelope, identifier: str, event: Any) -> Answer:
        lock = self._locks.get(identifier)
        if lock is None:
            return self._answer(env, identifier, [unknown_sequence(identifier)])
        with lock:
            self._reload_if_stale(identifier)
            machine = self._machines.get(identifier)
            if machine is None:  # forgotten while this request waited for the lock
                return self._answer(env, identifier, [unknown_sequence(identifier)])
            probe = DestinationSequence(machine.record)
            try:
                actions = probe.handle(event)
            except ProtocolError as exc:
                return self._protocol_error(env, identifier, exc)
            if probe.record.state is not machine.record.state or probe.record.last_number != machine.record.last_number:
                self._stale.add(identifier)
                with self.store.local() as s:
                    self.store.save_destination(s, self._infos[identifier], probe.record, before=machine.record)
            self._machines[identifier] = probe
            self._stale.discard(identifier)
        for a in actions:
            if isinstance(a, SequenceEnded):
                self.node.invoker.completed(identifier, probe.record.received)
        return self._answer(env, identifier, actions)

    def _fault_received(self, env: Envelope, fault: SequenceFault, now: float) -> Answer:
        """A SequenceFault from the peer of the sequence it names (``handle`` checked that): for one of our
        inbound sequences, or else for our outbound ones."""
        if fault.identifier is not None and fault.identifier in self._locks:
            self._event(env, fault.identifier, FaultReceived(fault.code, now))
        elif fault.identifier is not None:
            self.node.sender.on_body(fault)
        else:
            log.info("a peer sent a SequenceFault that names no sequence: %s", fault.reason)
        return Answer(None, 202)

    def _protocol_error(self, env: Envelope, identifier: str, exc: ProtocolError) -> Answer:
        log.error("inbound sequence %s: %s", identifier, exc)
        return self.fault(env, SequenceFault(FaultCode.SEQUENCE_TERMINATED, identifier, str(exc)))

    def tick(self, now: float) -> None:
        """Inactivity and expiry of inbound sequences; ended ones are forgotten after ``ended_retention``;
        applied MessageIDs older than ``dedup_retention`` are forgotten, in batches."""
        if now >= self._next_sweep:
            self._next_sweep = now + SWEEP_INTERVAL_S
            self.sweep(now)
        retention = self.node.limits.ended_retention
        for identifier, machine in list(self._machines.items()):
            record = machine.record
            if record.state in (D.TERMINATED, D.FAILED):
                if now - record.last_activity > retention and not self.node.invoker.pending(identifier):
                    self._forget(identifier)
                continue
            at = machine.next_timer(record)
            if at is not None and at <= now:
                self._event(_NO_ENVELOPE, identifier, TimerFired(now))

    def sweep(self, now: float) -> int:
        """Forget the applied MessageIDs older than ``dedup_retention``, ``SWEEP_BATCH`` per statement."""
        forgotten, cutoff = 0, now - self.node.limits.dedup_retention
        while True:
            with self.store.local() as s:
                count = self.store.forget_applied(s, cutoff, SWEEP_BATCH)
            forgotten += count
            if count < SWEEP_BATCH:
                return forgotten

    def finished(self, identifier: str) -> None:
        """Every message of an ended sequence was applied: keep only its record, so that late messages still
        get SequenceTerminated (not UnknownSequence) until ``ended_retention`` has passed."""
        machine, info = self._machines.get(identifier), self._infos.get(identifier)
        with self.store.local() as s:
            self.store.drop_destination(s, identifier)
            if machine is not None and info is not None:
                self.store.save_destination(s, info, machine.record)
        if machine is not None and machine.record.accepted_offer is not None:
            self.node.sender.end_offer(machine.record.accepted_offer)

    def _forget(self, identifier: str) -> None:
        """Drop an ended sequence, under its lock: a request that holds the lock finishes first, one that
        waits for it then finds the sequence gone (UnknownSequence) instead of half of it (a 500)."""
        lock = self._locks.get(identifier)
        if lock is None:
            return
        with lock:
            self._forget_locked(identifier)

    def _forget_locked(self, identifier: str) -> None:
        with self.store.local() as s:
            self.store.drop_destination(s, identifier)
        with self._mutex:
            self._machines.pop(identifier, None)
            info = self._infos.pop(identifier, None)
            self._locks.pop(identifier, None)
            if info is not None and info.create_message_id:
                self._created_by.pop(info.create_message_id, None)

    # ------------------------------------------------------------------ answers

    def _answer(self, env: Envelope, identifier: str, actions: list[Any]) -> Answer:
        if env is _NO_ENVELOPE:
            return Answer(None, 202)
        acks: list[SequenceAcknowledgement] = []
        body: Any = None
        for a in actions:
            if isinstance(a, SendAcknowledgement):
                acks.append(a.ack)
            elif isinstance(a, SendFault):
                return self.fault(env, a.fault)
            elif isinstance(a, SendCreateSequenceResponse):
                accept = None
                if a.accepted_offer is not None:
                    accept = self.node.endpoint or anonymous(env.wsa or WsaVersion.WSA200508)
                behavior = IncompleteSequenceBehavior.NO_DISCARD if env.rm is RMVersion.WSRM11 else None
                batch = env.body.batch if isinstance(env.body, CreateSequence) else None
                body = CreateSequenceResponse(a.identifier, a.expires, incomplete_behavior=behavior,
                                              accept_acks_to=accept,
                                              batch=min(batch, self.node.limits.max_batch) if batch else None)
            elif isinstance(a, SendCloseSequenceResponse):
                body = CloseSequenceResponse(a.identifier)
            elif isinstance(a, SendTerminateSequenceResponse):
                body = TerminateSequenceResponse(a.identifier)
        info = self._infos.get(identifier)
        if acks and info is not None and info.acks_to and not _anonymous(info.acks_to) and body is None:
            self.node.send_acks_to(info, env, acks)  # addressable AcksTo: acknowledged there, not here
            acks = []
        if not acks and body is None:
            return Answer(None, 202)
        reply = Envelope(soap=env.soap, rm=env.rm, wsa=env.wsa, acks=tuple(acks), body=body,
                         addressing=self._reply_addressing(env, ""))
        act = default_action(reply)
        return Answer(replace(reply, addressing=replace(reply.addressing, action=act)), 200)

    def _reply_addressing(self, env: Envelope, act: str) -> Addressing:
        wsa = env.wsa or WsaVersion.WSA200508
        return Addressing(action=act, to=anonymous(wsa), message_id=f"urn:uuid:{uuid.uuid4()}",
                          relates_to=env.addressing.message_id)

    def fault(self, env: Envelope, fault: SequenceFault | SoapFault, status: int | None = None) -> Answer:
        reply = Envelope(soap=env.soap, rm=env.rm, wsa=env.wsa or WsaVersion.WSA200508, body=fault,
                         addressing=self._reply_addressing(env, ""))
        if isinstance(fault, SequenceFault) and env.rm is not None:
            act = default_action(reply)
        elif isinstance(fault, SoapFault) and (fault.subcode or "").startswith(f"{{{WSMC_NS}}}"):
            act = WSMC_FAULT_ACTION
        else:
            act = WSA_FAULT_ACTION[env.wsa or WsaVersion.WSA200508]
        reply = replace(reply, addressing=replace(reply.addressing, action=act))
        if status is None:
            sender = isinstance(fault, SequenceFault) or fault.code.endswith("Sender")
            status = 400 if sender and env.soap.value == "1.2" else 500
        return Answer(reply, status)


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


def _ranges_contain(received: tuple[tuple[int, int], ...], number: int) -> bool:
    return any(lower <= number <= upper for lower, upper in received)


class _NoEnvelope:
    """Stands for 'no request': timer events answer nobody."""


_NO_ENVELOPE: Any = _NoEnvelope()
