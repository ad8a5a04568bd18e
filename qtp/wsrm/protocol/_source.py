"""The RM Source sequence: numbering, retransmission with backoff, acknowledgements, completion.

Theory. Reliability comes from one rule: a message stays in ``pending`` until an acknowledgement names it,
and every pending message is retransmitted when its due time passes, the interval doubling per attempt
(capped at ``max_interval``). Losing any message of the protocol therefore only delays progress: a lost
CreateSequence, Close or Terminate is resent by the timer the same way (``control_due``). Duplicates are
harmless because the destination recognises (identifier, number) and acknowledgements are idempotent set
unions. An acknowledgement that names a number never sent proves the peer broken: the source answers with
InvalidAcknowledgement and fails, rather than deleting messages it was never shown to have delivered.

Fast retransmission: an acknowledgement that names a higher number shows a message below it missing (its
request was lost, or the destination dropped it). Such a message is sent again at once, the first time
only; after that its timer decides, so a run of acknowledgements showing the same gap sends it once. The
runtime sets ``retransmit_interval`` from the measured round-trip time before it feeds an event.

Completion: WS-RM 1.0 sends an empty message marked LastMessage, waits for every number to be
acknowledged, then sends TerminateSequence (which has no response, so the source is done). WS-RM 1.1 waits
for every acknowledgement, sends CloseSequence, then TerminateSequence, retrying each until answered. A
sequence that is closed early (CloseRequested, SequenceClosed, a Final acknowledgement) reports what the
destination did not get as MessagesLost.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import ClassVar

from qtp.wsrm.protocol import _ranges as ranges
from qtp.wsrm.protocol._events import (
    AckReceived,
    Action,
    CloseRequested,
    CloseResponded,
    CompleteRequested,
    CreateRequested,
    CreateSequenceResponded,
    FaultReceived,
    MessageNumbered,
    MessagesAcknowledged,
    MessagesLost,
    OfferAccepted,
    SendAckRequested,
    SendCloseSequence,
    SendCreateSequence,
    SendFault,
    SendRefused,
    SendRequested,
    SendTerminateSequence,
    SequenceEnded,
    TerminateResponded,
    TimerFired,
    Transmit,
)
from qtp.wsrm.protocol._machine import Machine, _Violation
from qtp.wsrm.protocol._messages import (
    MAX_MESSAGE_NUMBER,
    AckRanges,
    FaultCode,
    RMVersion,
    SequenceFault,
)
from qtp.wsrm.protocol._tables import SOURCE_TABLES, SourceState, Table

S = SourceState
Pending = tuple[tuple[int, int, float], ...]  # (number, transmissions so far, due time)
_CLOSING_FAULTS = frozenset({FaultCode.SEQUENCE_CLOSED, FaultCode.MESSAGE_NUMBER_ROLLOVER})


@dataclass(frozen=True, slots=True)
class SourceRecord:
    """Everything an RM Source sequence knows; saved whole after every event."""

    key: str
    version: RMVersion
    state: SourceState = S.NEW
    identifier: str | None = None
    offer_identifier: str | None = None
    next_number: int = 1
    last_number: int | None = None
    complete_requested: bool = False
    acked: AckRanges = ()
    final_ack: bool = False
    pending: Pending = ()
    control_attempts: int = 0
    control_due: float | None = None
    requested_expires: float | None = None
    expires_at: float | None = None
    retransmit_interval: float = 3.0
    exponential_backoff: bool = True
    max_interval: float = 60.0
    max_message_number: int = MAX_MESSAGE_NUMBER
    end_reason: str | None = None
    failure: str | None = None
    peer_batch: int = 1  # messages per request the destination agreed to (qtp's batching extension)

    ENUMS: ClassVar[dict[str, type[Enum]]] = {"state": SourceState, "version": RMVersion}

    def delay(self, attempts: int) -> float:
        """Time until the next transmission after ``attempts`` transmissions."""
        if not self.exponential_backoff:
            return self.retransmit_interval
        return min(self.retransmit_interval * 2 ** min(max(attempts - 1, 0), 32), self.max_interval)


Step = tuple[SourceRecord, list[Action]]


class SourceSequence(Machine[SourceRecord]):
    """RM Source machine. ``SourceSequence(SourceRecord(key, version))`` starts one in NEW."""

    name = "RM Source"

    def table(self) -> Table:
        return SOURCE_TABLES[self._record.version]

    def next_timer(self, record: SourceRecord) -> float | None:
        if record.state in (S.NEW, S.TERMINATED, S.FAILED):
            return None
        times = [due for _, sent, due in record.pending if sent] if record.state in (S.ACTIVE, S.DRAINING) else []
        if record.control_due is not None:
            times.append(record.control_due)
        if record.expires_at is not None:
            times.append(record.expires_at)
        return min(times) if times else None

    # ------------------------------------------------------------------------------ application side

    def on_CreateRequested(self, e: CreateRequested) -> Step:
        r = self._record
        r = dataclasses.replace(r, state=S.CREATING, offer_identifier=e.offer_identifier, control_attempts=1,
                                control_due=e.now + r.delay(1))
        return r, [SendCreateSequence(e.offer_identifier, r.requested_expires)]

    def on_SendRequested(self, e: SendRequested) -> Step:
        r = self._record
        if r.next_number + e.count - 1 > r.max_message_number:
            return r, [SendRefused(FaultCode.MESSAGE_NUMBER_ROLLOVER)]
        return self._number(r, e.now, last_message=False, count=e.count)

    def on_CompleteRequested(self, e: CompleteRequested) -> Step:
        r = dataclasses.replace(self._record, complete_requested=True)
        if r.version is RMVersion.WSRM10:
            if r.next_number > r.max_message_number:
                raise _Violation("no message number is left for the LastMessage marker")
            r, actions = self._number(r, e.now, last_message=True)
        else:
            r, actions = dataclasses.replace(r, last_number=r.next_number - 1), []
        if r.state is S.CREATING:
            return r, actions
        return self._advance(dataclasses.replace(r, state=S.DRAINING), e.now, actions)

    def on_CloseRequested(self, e: CloseRequested) -> Step:
        r = dataclasses.replace(self._record, complete_requested=True, last_number=self._record.next_number - 1)
        return self._close(r, e.now, [])

    def _number(self, r: SourceRecord, now: float, last_message: bool, count: int = 1) -> Step:
        numbers = range(r.next_number, r.next_number + count)
        r = dataclasses.replace(r, next_number=numbers.stop,
                                last_number=numbers[-1] if last_message else r.last_number)
        actions: list[Action] = [MessageNumbered(number, last_message) for number in numbers]
        if r.state is S.CREATING:
            return dataclasses.replace(r, pending=(*r.pending, *((n, 0, now) for n in numbers))), actions
        due = now + r.delay(1)
        r = dataclasses.replace(r, pending=(*r.pending, *((n, 1, due) for n in numbers)))
        actions.extend(self._transmit(r, number, ack_requested=False, attempt=1) for number in numbers)
        return r, actions

    def _transmit(self, r: SourceRecord, number: int, ack_requested: bool, attempt: int) -> Transmit:
        last = r.version is RMVersion.WSRM10 and number == r.last_number and r.complete_requested
        return Transmit(r.identifier or "", number, last, ack_requested, attempt)

    # ------------------------------------------------------------------------------------- peer side

    def on_CreateSequenceResponded(self, e: CreateSequenceResponded) -> Step:
        r = self._record
        if r.state is not S.CREATING:
            return r, []  # a duplicate or late response: the sequence already has its identifier
        response = e.response
        r = dataclasses.replace(
            r, state=S.DRAINING if r.complete_requested else S.ACTIVE, identifier=response.identifier,
            control_attempts=0, control_due=None,
            expires_at=None if response.expires is None else e.now + response.expires,
            peer_batch=response.batch or 1,
        )
        actions: list[Action] = []
        if response.accept_acks_to is not None and r.offer_identifier is not None:
            actions.append(OfferAccepted(r.offer_identifier))
        pending = tuple((number, 1, e.now + r.delay(1)) for number, _, _ in r.pending)
        r = dataclasses.replace(r, pending=pending)
        actions.extend(self._transmit(r, number, False, 1) for number, _, _ in pending)
        return self._advance(r, e.now, actions)

    def on_AckReceived(self, e: AckReceived) -> Step:
        r = self._record
        if r.state in (S.TERMINATING, S.TERMINATED):
            return r, []
        ack = e.ack
        sent = r.next_number - 1
        if ranges.highest(ack.ranges) > sent or any(n > sent for n in ack.nacks):
            return self._invalid_ack(r, sent)
        fresh = ranges.difference(ack.ranges, r.acked)
        acked = ranges.union(r.acked, ack.ranges)
        actions: list[Action] = [MessagesAcknowledged(fresh)] if fresh else []
        pending: list[tuple[int, int, float]] = []
        highest = ranges.highest(acked)
        for number, attempts, due in r.pending:
            if ranges.contains(acked, number):
                continue
            if attempts and (number in ack.nacks or (attempts == 1 and number < highest)):
                actions.append(self._transmit(r, number, False, attempts + 1))
                attempts, due = attempts + 1, e.now + r.delay(attempts + 1)
            pending.append((number, attempts, due))
        r = dataclasses.replace(r, acked=acked, pending=tuple(pending), final_ack=r.final_ack or ack.final)
        if ack.final and r.state in (S.ACTIVE, S.DRAINING, S.CLOSED):
            return self._terminate(*self._lose_pending(r, actions), e.now)
        if r.state is S.CLOSED and not r.pending:
            return self._terminate(r, actions, e.now)
        return self._advance(r, e.now, actions)

    def _invalid_ack(self, r: SourceRecord, sent: int) -> Step:
        reason = f"acknowledgement names a message number above {sent}, the highest sent"
        fault = SequenceFault(FaultCode.INVALID_ACKNOWLEDGEMENT, r.identifier, reason)
        r, actions = self._lose_pending(r, [SendFault(fault)])
        r = dataclasses.replace(r, state=S.FAILED, failure=reason, control_due=None, end_reason="InvalidAcknowledgement")
        return r, [*actions, SequenceEnded(reason, FaultCode.INVALID_ACKNOWLEDGEMENT)]

    def on_CloseResponded(self, e: CloseResponded) -> Step:
        r = self._record
        if r.state is not S.CLOSING:
            return r, []
        if not r.pending:
            return self._terminate(r, [], e.now)
        if r.final_ack:
            return self._terminate(*self._lose_pending(r, []), e.now)
        r = dataclasses.replace(r, state=S.CLOSED, control_attempts=1, control_due=e.now + r.delay(1))
        return r, [SendAckRequested(r.identifier or "")]

    def on_TerminateResponded(self, e: TerminateResponded) -> Step:
        r = self._record
        if r.state is S.TERMINATED:
            return r, []
        return self._end(r, "terminated"), [SequenceEnded("terminated")]

    def on_FaultReceived(self, e: FaultReceived) -> Step:
        r = self._record
        if r.state is S.TERMINATED:
            return r, []
        if r.state is S.TERMINATING:
            if e.code in (FaultCode.UNKNOWN_SEQUENCE, FaultCode.SEQUENCE_TERMINATED):
                return self._end(r, "terminated"), [SequenceEnded("terminated by the destination", e.code)]
            return r, []
        if e.code in _CLOSING_FAULTS and r.version is RMVersion.WSRM11 and r.state is not S.CREATING:
            if r.state in (S.CLOSING, S.CLOSED):
                return r, []
            r = dataclasses.replace(r, state=S.CLOSED, control_attempts=1, control_due=e.now + r.delay(1))
            return r, [SendAckRequested(r.identifier or "")]
        r, actions = self._lose_pending(r, [])
        r = dataclasses.replace(r, state=S.FAILED, control_due=None, end_reason=e.code.value,
                                failure=f"peer sent {e.code.value}")
        return r, [*actions, SequenceEnded(f"peer sent {e.code.value}", e.code)]

    def on_TimerFired(self, e: TimerFired) -> Step:
        r = self._record
        if r.state is S.TERMINATED:
            return r, []
        if r.expires_at is not None and e.now >= r.expires_at:
            r, actions = self._lose_pending(r, [])
            return self._end(r, "expired"), [*actions, SequenceEnded("expired")]
        if r.state in (S.ACTIVE, S.DRAINING):
            return self._retransmit(r, e.now)
        if r.control_due is None or e.now < r.control_due:
            return r, []
        attempts = r.control_attempts + 1
        r = dataclasses.replace(r, control_attempts=attempts, control_due=e.now + r.delay(attempts))
        return r, [self._control_message(r)]

    def _control_message(self, r: SourceRecord) -> Action:
        identifier = r.identifier or ""
        if r.state is S.CREATING:
            return SendCreateSequence(r.offer_identifier, r.requested_expires)
        if r.state is S.CLOSING:
            return SendCloseSequence(identifier, r.last_number or None)
        if r.state is S.CLOSED:
            return SendAckRequested(identifier)
        return SendTerminateSequence(identifier, self._terminate_last(r))

    def _retransmit(self, r: SourceRecord, now: float) -> Step:
        actions: list[Action] = []
        pending: list[tuple[int, int, float]] = []
        for number, attempts, due in r.pending:
            if due <= now:
                actions.append(self._transmit(r, number, True, attempts + 1))
                attempts, due = attempts + 1, now + r.delay(attempts + 1)
            pending.append((number, attempts, due))
        return dataclasses.replace(r, pending=tuple(pending)), actions

    # ------------------------------------------------------------------------------------ completion

    def _advance(self, r: SourceRecord, now: float, actions: list[Action]) -> Step:
        """Move a draining sequence on once every message is acknowledged."""
        if r.state is not S.DRAINING or r.pending:
            return r, actions
        if r.version is RMVersion.WSRM10:
            actions.append(SendTerminateSequence(r.identifier or "", None))
            return self._end(r, "completed"), [*actions, SequenceEnded("completed")]
        return self._close(r, now, actions)

    def _close(self, r: SourceRecord, now: float, actions: list[Action]) -> Step:
        r = dataclasses.replace(r, state=S.CLOSING, control_attempts=1, control_due=now + r.delay(1))
        return r, [*actions, SendCloseSequence(r.identifier or "", r.last_number or None)]

    def _terminate(self, r: SourceRecord, actions: list[Action], now: float) -> Step:
        r = dataclasses.replace(r, state=S.TERMINATING, control_attempts=1, control_due=now + r.delay(1))
        return r, [*actions, SendTerminateSequence(r.identifier or "", self._terminate_last(r))]

    @staticmethod
    def _terminate_last(r: SourceRecord) -> int | None:
        return (r.last_number or r.next_number - 1 or None) if r.version is RMVersion.WSRM11 else None

    @staticmethod
    def _lose_pending(r: SourceRecord, actions: list[Action]) -> Step:
        if not r.pending:
            return r, actions
        lost = ranges.from_numbers(number for number, _, _ in r.pending)
        return dataclasses.replace(r, pending=()), [*actions, MessagesLost(lost)]

    @staticmethod
    def _end(r: SourceRecord, reason: str) -> SourceRecord:
        return dataclasses.replace(r, state=S.TERMINATED, end_reason=reason, control_due=None, pending=())
