"""Events (inputs) and actions (outputs) of the WS-RM state machines, h11 style.

The runtime turns what happens to it (a decoded envelope, the application's send call, a timer, a committed
delivery) into one event, feeds it to the machine of that sequence, saves the machine's new state in the
same transaction, and then carries out the actions it got back: send an envelope, store a payload, set a
timer, hand a message to the application. The machine never does any of these itself.

``now`` is always an argument: the clock is an input, in seconds on whatever monotonic or wall scale the
runtime chooses, as long as it uses one scale per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

from qtp.wsrm.protocol._messages import (
    AckRanges,
    CreateSequenceResponse,
    FaultCode,
    SequenceAcknowledgement,
    SequenceFault,
)

# ---------------------------------------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class TimerFired:
    """The runtime's timer went off (or it simply polls); retransmissions and timeouts are decided here."""

    now: float


@dataclass(frozen=True, slots=True)
class FaultReceived:
    """A WS-RM fault about this sequence arrived from the peer."""

    code: FaultCode
    now: float


@dataclass(frozen=True, slots=True)
class CreateRequested:
    """RM Source: start the sequence; ``offer_identifier`` offers a sequence for the replies."""

    now: float
    offer_identifier: str | None = None


@dataclass(frozen=True, slots=True)
class CreateSequenceResponded:
    response: CreateSequenceResponse
    now: float


@dataclass(frozen=True, slots=True)
class SendRequested:
    """RM Source: the application handed over ``count`` messages; the machine numbers them (one event for a
    batch, so that numbering n messages costs one transition, not n)."""

    now: float
    count: int = 1


@dataclass(frozen=True, slots=True)
class AckReceived:
    ack: SequenceAcknowledgement
    now: float


@dataclass(frozen=True, slots=True)
class CompleteRequested:
    """RM Source: no more messages; finish once everything is acknowledged (LastMessage / Close, Terminate)."""

    now: float


@dataclass(frozen=True, slots=True)
class CloseRequested:
    """RM Source, WS-RM 1.1: close now, even with messages unacknowledged (they may be lost)."""

    now: float


@dataclass(frozen=True, slots=True)
class CloseResponded:
    now: float


@dataclass(frozen=True, slots=True)
class TerminateResponded:
    now: float


@dataclass(frozen=True, slots=True)
class CreateSequenceReceived:
    """RM Destination: a CreateSequence for this sequence (also its retransmissions, which get the same reply).

    ``accepted_offer`` is the offered identifier when the runtime accepts the Offer, else None.
    """

    now: float
    expires: float | None = None
    accepted_offer: str | None = None


@dataclass(frozen=True, slots=True)
class MessageReceived:
    number: int
    now: float
    last_message: bool = False  # WS-RM 1.0 LastMessage marker


@dataclass(frozen=True, slots=True)
class AckRequestedReceived:
    now: float


@dataclass(frozen=True, slots=True)
class CloseReceived:
    now: float
    last_msg_number: int | None = None


@dataclass(frozen=True, slots=True)
class TerminateReceived:
    now: float
    last_msg_number: int | None = None


@dataclass(frozen=True, slots=True)
class MessageStored:
    """Invoker: the destination accepted message ``number`` and the runtime stored its payload."""

    number: int


@dataclass(frozen=True, slots=True)
class DeliveryCommitted:
    """Invoker: the application's transaction that consumed ``number`` committed."""

    number: int


@dataclass(frozen=True, slots=True)
class DeliveryAborted:
    """Invoker: the application's transaction for ``number`` rolled back; it will be delivered again."""

    number: int


@dataclass(frozen=True, slots=True)
class SequenceCompleted:
    """Invoker: the destination sequence ended; ``received`` is its final set of message numbers."""

    received: AckRanges


# --------------------------------------------------------------------------------------------- actions


@dataclass(frozen=True, slots=True)
class SetTimer:
    """Call back with ``TimerFired`` at ``at`` (None: no timer needed any more)."""

    at: float | None


@dataclass(frozen=True, slots=True)
class SendCreateSequence:
    offer_identifier: str | None
    expires: float | None


@dataclass(frozen=True, slots=True)
class MessageNumbered:
    """Store the application's payload under this number (``last_message``: WS-RM 1.0 empty LastMessage)."""

    number: int
    last_message: bool = False


@dataclass(frozen=True, slots=True)
class Transmit:
    """Send (or resend) stored message ``number`` of sequence ``identifier``."""

    identifier: str
    number: int
    last_message: bool
    ack_requested: bool
    attempt: int


@dataclass(frozen=True, slots=True)
class SendAckRequested:
    identifier: str
    max_message_number_used: int | None = None


@dataclass(frozen=True, slots=True)
class SendCloseSequence:
    identifier: str
    last_msg_number: int | None


@dataclass(frozen=True, slots=True)
class SendTerminateSequence:
    identifier: str
    last_msg_number: int | None


@dataclass(frozen=True, slots=True)
class MessagesAcknowledged:
    """These numbers are acknowledged for the first time: their payloads may be deleted."""

    ranges: AckRanges


@dataclass(frozen=True, slots=True)
class MessagesLost:
    """The sequence ended without these numbers being received (closed or terminated early)."""

    ranges: AckRanges


@dataclass(frozen=True, slots=True)
class OfferAccepted:
    """The peer accepted our Offer: create an RM Destination for ``identifier``."""

    identifier: str


@dataclass(frozen=True, slots=True)
class SendRefused:
    """The application's message was not numbered (MessageNumberRollover): start a new sequence for it."""

    code: FaultCode


@dataclass(frozen=True, slots=True)
class SequenceEnded:
    """The sequence reached a terminal state; ``reason`` says why, ``code`` names a fault if one caused it."""

    reason: str
    code: FaultCode | None = None


@dataclass(frozen=True, slots=True)
class SendFault:
    fault: SequenceFault


@dataclass(frozen=True, slots=True)
class SendCreateSequenceResponse:
    identifier: str
    expires: float | None
    accepted_offer: str | None


@dataclass(frozen=True, slots=True)
class AcceptMessage:
    """Store the payload of ``number`` and pass it to the invoker (first receipt only)."""

    number: int


@dataclass(frozen=True, slots=True)
class SendAcknowledgement:
    """Send, or piggy-back on the next outgoing message, this acknowledgement."""

    ack: SequenceAcknowledgement


@dataclass(frozen=True, slots=True)
class SendCloseSequenceResponse:
    identifier: str


@dataclass(frozen=True, slots=True)
class SendTerminateSequenceResponse:
    identifier: str


@dataclass(frozen=True, slots=True)
class Deliver:
    """Hand message ``number`` to the application, inside the transaction that reports DeliveryCommitted."""

    identifier: str
    number: int


@dataclass(frozen=True, slots=True)
class DeliveryFinished:
    """Every message of the sequence was delivered: the invoker's row may be deleted."""

    identifier: str


Event = (
    TimerFired
    | FaultReceived
    | CreateRequested
    | CreateSequenceResponded
    | SendRequested
    | AckReceived
    | CompleteRequested
    | CloseRequested
    | CloseResponded
    | TerminateResponded
    | CreateSequenceReceived
    | MessageReceived
    | AckRequestedReceived
    | CloseReceived
    | TerminateReceived
    | MessageStored
    | DeliveryCommitted
    | DeliveryAborted
    | SequenceCompleted
)
Action = (
    SetTimer
    | SendCreateSequence
    | MessageNumbered
    | Transmit
    | SendAckRequested
    | SendCloseSequence
    | SendTerminateSequence
    | MessagesAcknowledged
    | MessagesLost
    | OfferAccepted
    | SendRefused
    | SequenceEnded
    | SendFault
    | SendCreateSequenceResponse
    | AcceptMessage
    | SendAcknowledgement
    | SendCloseSequenceResponse
    | SendTerminateSequenceResponse
    | Deliver
    | DeliveryFinished
)
