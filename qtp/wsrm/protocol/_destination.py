"""The RM Destination sequence: accepting messages once, acknowledging, closing, terminating, timing out.

Theory. The destination's whole memory of a sequence is ``received``, the merged ranges of the message
numbers it accepted. A message whose number is already in it is a duplicate: it is acknowledged again (the
first acknowledgement may have been lost) and never accepted twice, which is what makes delivery exactly
once. Acknowledgements are built from ``received`` and nothing else, so they can never claim a number that
did not arrive. A Final acknowledgement is only sent once the sequence is closed or terminated, when
``received`` can no longer grow.

Faults: a message for a terminated sequence gets SequenceTerminated, one for a closed sequence
SequenceClosed (unless it is a duplicate, which is simply acknowledged again), a number above the
WS-RM 1.0 LastMessage gets LastMessageNumberExceeded, a number above the agreed maximum
MessageNumberRollover. UnknownSequence is for identifiers the runtime has no record of
(:func:`unknown_sequence`). A fault from the source (InvalidAcknowledgement, ...) fails the sequence.
The sequence ends by itself after ``inactivity_timeout`` seconds without hearing from the source, or when
its granted ``Expires`` runs out.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import ClassVar

from qtp.wsrm.protocol import _ranges as ranges
from qtp.wsrm.protocol._events import (
    AcceptMessage,
    AckRequestedReceived,
    Action,
    CloseReceived,
    CreateSequenceReceived,
    FaultReceived,
    MessageReceived,
    SendAcknowledgement,
    SendCloseSequenceResponse,
    SendCreateSequenceResponse,
    SendFault,
    SendTerminateSequenceResponse,
    SequenceEnded,
    TerminateReceived,
    TimerFired,
)
from qtp.wsrm.protocol._machine import Machine
from qtp.wsrm.protocol._messages import (
    MAX_MESSAGE_NUMBER,
    AckRanges,
    FaultCode,
    RMVersion,
    SequenceAcknowledgement,
    SequenceFault,
)
from qtp.wsrm.protocol._tables import DESTINATION_TABLES, DestinationState, Table

D = DestinationState


@dataclass(frozen=True, slots=True)
class DestinationRecord:
    """Everything an RM Destination sequence knows; saved whole after every event."""

    identifier: str
    version: RMVersion
    state: DestinationState = D.NEW
    received: AckRanges = ()
    last_number: int | None = None
    accepted_offer: str | None = None
    expires: float | None = None
    expires_at: float | None = None
    inactivity_timeout: float | None = 600.0
    last_activity: float = 0.0
    max_message_number: int = MAX_MESSAGE_NUMBER
    end_reason: str | None = None
    failure: str | None = None

    ENUMS: ClassVar[dict[str, type[Enum]]] = {"state": DestinationState, "version": RMVersion}


Step = tuple[DestinationRecord, list[Action]]


def unknown_sequence(identifier: str) -> SendFault:
    """The answer to any message naming a sequence the runtime has no record of."""
    return SendFault(SequenceFault(FaultCode.UNKNOWN_SEQUENCE, identifier, f"no sequence {identifier} here"))


def build_ack(r: DestinationRecord, final: bool) -> SequenceAcknowledgement | None:
    final = final and r.version is RMVersion.WSRM11
    if r.received:
        return SequenceAcknowledgement(r.identifier, ranges=r.received, final=final)
    if r.version is RMVersion.WSRM11:
        return SequenceAcknowledgement(r.identifier, none=True, final=final)
    return None


class DestinationSequence(Machine[DestinationRecord]):
    """RM Destination machine. ``DestinationSequence(DestinationRecord(identifier, version))`` starts in NEW."""

    name = "RM Destination"

    def table(self) -> Table:
        return DESTINATION_TABLES[self._record.version]

    def next_timer(self, record: DestinationRecord) -> float | None:
        if record.state in (D.NEW, D.TERMINATED, D.FAILED):
            return None
        times = [] if record.inactivity_timeout is None else [record.last_activity + record.inactivity_timeout]
        if record.expires_at is not None:
            times.append(record.expires_at)
        return min(times) if times else None

    def acknowledgement(self, final: bool = False) -> SequenceAcknowledgement | None:
        """The acknowledgement for what was received; None when WS-RM 1.0 has no way to say 'nothing yet'."""
        return build_ack(self._record, final)

    @staticmethod
    def _ack(r: DestinationRecord, final: bool = False) -> list[Action]:
        ack = build_ack(r, final)
        return [] if ack is None else [SendAcknowledgement(ack)]

    def _fault(self, code: FaultCode, reason: str) -> SendFault:
        return SendFault(SequenceFault(code, self._record.identifier, reason))

    def on_CreateSequenceReceived(self, e: CreateSequenceReceived) -> Step:
        r = self._record
        if r.state is D.NEW:
            r = dataclasses.replace(
                r, state=D.ACTIVE, last_activity=e.now, expires=e.expires, accepted_offer=e.accepted_offer,
                expires_at=None if e.expires is None else e.now + e.expires,
            )
        return r, [SendCreateSequenceResponse(r.identifier, r.expires, r.accepted_offer)]

    def on_MessageReceived(self, e: MessageReceived) -> Step:
        r = dataclasses.replace(self._record, last_activity=max(self._record.last_activity, e.now))
        n = e.number
        if r.state is D.TERMINATED:
            return r, [self._fault(FaultCode.SEQUENCE_TERMINATED, "the sequence is terminated")]
        if ranges.contains(r.received, n):
            return r, self._ack(r, final=r.state is D.CLOSED)
        if r.state is D.CLOSED:
            return r, [self._fault(FaultCode.SEQUENCE_CLOSED, "the sequence is closed")]
        if n > r.max_message_number:
            return r, [self._fault(FaultCode.MESSAGE_NUMBER_ROLLOVER, f"{n} is above {r.max_message_number}")]
        if r.last_number is not None and n > r.last_number:
            code = FaultCode.LAST_MESSAGE_NUMBER_EXCEEDED
            return r, [self._fault(code, f"{n} is above the last message number {r.last_number}")]
        if e.last_message:
            if ranges.highest(r.received) > n:
                code = FaultCode.LAST_MESSAGE_NUMBER_EXCEEDED
                return r, [self._fault(code, f"LastMessage {n} is below a number already received")]
            r = dataclasses.replace(r, last_number=n)
        r = dataclasses.replace(r, received=ranges.add(r.received, n))
        return r, [AcceptMessage(n), *self._ack(r)]

    def on_AckRequestedReceived(self, e: AckRequestedReceived) -> Step:
        r = self._record
        if r.state is not D.TERMINATED:
            r = dataclasses.replace(r, last_activity=max(r.last_activity, e.now))
        return r, self._ack(r, final=r.state is not D.ACTIVE)

    def on_CloseReceived(self, e: CloseReceived) -> Step:
        r = self._record
        if r.state is D.TERMINATED:
            return r, [self._fault(FaultCode.SEQUENCE_TERMINATED, "the sequence is terminated")]
        r = dataclasses.replace(r, state=D.CLOSED, last_activity=max(r.last_activity, e.now),
                                last_number=r.last_number if r.state is D.CLOSED else e.last_msg_number)
        return r, [*self._ack(r, final=True), SendCloseSequenceResponse(r.identifier)]

    def on_TerminateReceived(self, e: TerminateReceived) -> Step:
        r = self._record
        reply: list[Action] = []
        if r.version is RMVersion.WSRM11:
            reply = [SendTerminateSequenceResponse(r.identifier)]
        if r.state is D.TERMINATED:
            return r, reply
        r = dataclasses.replace(r, state=D.TERMINATED, end_reason="terminated",
                                last_number=r.last_number or e.last_msg_number)
        return r, [*reply, SequenceEnded("terminated")]

    def on_FaultReceived(self, e: FaultReceived) -> Step:
        r = self._record
        if r.state is D.TERMINATED:
            return r, []
        reason = f"peer sent {e.code.value}"
        r = dataclasses.replace(r, state=D.FAILED, end_reason=e.code.value, failure=reason)
        return r, [SequenceEnded(reason, e.code)]

    def on_TimerFired(self, e: TimerFired) -> Step:
        r = self._record
        if r.state is D.TERMINATED:
            return r, []
        if r.expires_at is not None and e.now >= r.expires_at:
            return dataclasses.replace(r, state=D.TERMINATED, end_reason="expired"), [SequenceEnded("expired")]
        timeout = r.inactivity_timeout
        if timeout is not None and e.now - r.last_activity >= timeout:
            r = dataclasses.replace(r, state=D.TERMINATED, end_reason="InactivityTimeout")
            return r, [SequenceEnded("InactivityTimeout")]
        return r, []
