"""WS-RM protocol messages as version-neutral value objects.

These are what the state machines read and write and what the codec turns into XML and back. They know
nothing about SOAP or XML namespaces; the codec decides how each field is spelt in each WS-RM version and
refuses what a version cannot express (``CloseSequence`` in WS-RM 1.0, ``LastMessage`` in WS-RM 1.1, ...).

Construction is strict (the "strict when emitting" half of the robustness rule): a message number outside
1..2**63-1, an empty identifier or an inverted acknowledgement range raises ``ValueError`` at once, so a
malformed message can never reach the wire.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

MAX_MESSAGE_NUMBER = 9223372036854775807  # xs:unsignedLong capped by WS-RM 1.1's MessageNumberType

AckRanges = tuple[tuple[int, int], ...]


class RMVersion(str, Enum):
    """The two WS-RM versions in use: 1.0 (2005/02, submission) and 1.1 (OASIS 200702)."""

    WSRM10 = "1.0"
    WSRM11 = "1.1"


class FaultCode(str, Enum):
    """WS-RM fault subcodes, spelt as on the wire (the local name in the WS-RM namespace)."""

    CREATE_SEQUENCE_REFUSED = "CreateSequenceRefused"
    UNKNOWN_SEQUENCE = "UnknownSequence"
    SEQUENCE_TERMINATED = "SequenceTerminated"
    SEQUENCE_CLOSED = "SequenceClosed"
    INVALID_ACKNOWLEDGEMENT = "InvalidAcknowledgement"
    MESSAGE_NUMBER_ROLLOVER = "MessageNumberRollover"
    LAST_MESSAGE_NUMBER_EXCEEDED = "LastMessageNumberExceeded"
    WSRM_REQUIRED = "WSRMRequired"


_BOTH = frozenset(RMVersion)
FAULT_VERSIONS: dict[FaultCode, frozenset[RMVersion]] = {
    FaultCode.CREATE_SEQUENCE_REFUSED: _BOTH,
    FaultCode.UNKNOWN_SEQUENCE: _BOTH,
    FaultCode.SEQUENCE_TERMINATED: _BOTH,
    FaultCode.INVALID_ACKNOWLEDGEMENT: _BOTH,
    FaultCode.MESSAGE_NUMBER_ROLLOVER: _BOTH,
    FaultCode.SEQUENCE_CLOSED: frozenset({RMVersion.WSRM11}),
    FaultCode.WSRM_REQUIRED: frozenset({RMVersion.WSRM11}),
    FaultCode.LAST_MESSAGE_NUMBER_EXCEEDED: frozenset({RMVersion.WSRM10}),
}


class IncompleteSequenceBehavior(str, Enum):
    """WS-RM 1.1: what the destination does with a sequence that ends with gaps."""

    DISCARD_ENTIRE_SEQUENCE = "DiscardEntireSequence"
    DISCARD_FOLLOWING_FIRST_GAP = "DiscardFollowingFirstGap"
    NO_DISCARD = "NoDiscard"


def check_identifier(identifier: str) -> None:
    if not isinstance(identifier, str) or not identifier.strip() or identifier != identifier.strip():
        raise ValueError(f"sequence identifier must be a non-empty URI without surrounding blanks: {identifier!r}")


def check_number(number: int, what: str = "message number") -> None:
    if isinstance(number, bool) or not isinstance(number, int) or not 1 <= number <= MAX_MESSAGE_NUMBER:
        raise ValueError(f"{what} must be an integer in 1..{MAX_MESSAGE_NUMBER}: {number!r}")


def check_expires(expires: float | None) -> None:
    if expires is not None and (not isinstance(expires, (int, float)) or not 0 <= expires < 10**12):
        raise ValueError(f"Expires must be a non-negative number of seconds: {expires!r}")


MAX_BATCH = 10_000  # messages in one request, at most, whatever a peer offers


def check_batch(batch: int | None) -> None:
    if batch is not None and (not isinstance(batch, int) or not 1 <= batch <= MAX_BATCH):
        raise ValueError(f"a batch size is a whole number from 1 to {MAX_BATCH}: {batch!r}")


@dataclass(frozen=True, slots=True)
class Offer:
    """An offered sequence for the responses (WS-RM 1.1 requires its Endpoint)."""

    identifier: str
    endpoint: str | None = None
    expires: float | None = None
    incomplete_behavior: IncompleteSequenceBehavior | None = None

    def __post_init__(self) -> None:
        check_identifier(self.identifier)
        check_expires(self.expires)


@dataclass(frozen=True, slots=True)
class CreateSequence:
    acks_to: str
    expires: float | None = None
    offer: Offer | None = None
    batch: int | None = None  # qtp's extension: the sender can post up to this many messages in one request

    def __post_init__(self) -> None:
        check_identifier(self.acks_to)
        check_expires(self.expires)
        check_batch(self.batch)


@dataclass(frozen=True, slots=True)
class CreateSequenceResponse:
    identifier: str
    expires: float | None = None
    incomplete_behavior: IncompleteSequenceBehavior | None = None
    accept_acks_to: str | None = None  # present when the Offer was accepted
    batch: int | None = None  # qtp's extension: the destination takes up to this many messages per request

    def __post_init__(self) -> None:
        check_identifier(self.identifier)
        check_expires(self.expires)
        check_batch(self.batch)


@dataclass(frozen=True, slots=True)
class Sequence:
    """The Sequence header of an application message (mustUnderstand on the wire)."""

    identifier: str
    number: int
    last_message: bool = False  # WS-RM 1.0 only

    def __post_init__(self) -> None:
        check_identifier(self.identifier)
        check_number(self.number)


@dataclass(frozen=True, slots=True)
class AckRequested:
    identifier: str
    max_message_number_used: int | None = None  # WS-RM 1.0 only

    def __post_init__(self) -> None:
        check_identifier(self.identifier)
        if self.max_message_number_used is not None:
            check_number(self.max_message_number_used, "MaxMessageNumberUsed")


@dataclass(frozen=True, slots=True)
class SequenceAcknowledgement:
    """Ranges are sorted, disjoint and not adjacent; ``none`` and ``final`` are WS-RM 1.1 only."""

    identifier: str
    ranges: AckRanges = ()
    nacks: tuple[int, ...] = ()
    none: bool = False
    final: bool = False

    def __post_init__(self) -> None:
        check_identifier(self.identifier)
        floor = 1  # the lowest number the next range may start at
        for lower, upper in self.ranges:
            if type(lower) is not int or type(upper) is not int or not floor <= lower <= upper <= MAX_MESSAGE_NUMBER:
                raise ValueError(
                    f"acknowledgement ranges must be sorted, disjoint, merged and in 1..{MAX_MESSAGE_NUMBER}: "
                    f"{self.ranges[:5]}"
                )
            floor = upper + 2
        for number in self.nacks:
            check_number(number, "Nack")
        kinds = (bool(self.ranges), bool(self.nacks), self.none)
        if sum(kinds) != 1:
            raise ValueError("an acknowledgement has exactly one of: ranges, nacks, none")
        if self.final and self.nacks:
            raise ValueError("Final cannot accompany Nack")


@dataclass(frozen=True, slots=True)
class CloseSequence:
    identifier: str
    last_msg_number: int | None = None

    def __post_init__(self) -> None:
        check_identifier(self.identifier)
        if self.last_msg_number is not None:
            check_number(self.last_msg_number, "LastMsgNumber")


@dataclass(frozen=True, slots=True)
class CloseSequenceResponse:
    identifier: str

    def __post_init__(self) -> None:
        check_identifier(self.identifier)


@dataclass(frozen=True, slots=True)
class TerminateSequence:
    identifier: str
    last_msg_number: int | None = None  # WS-RM 1.1 only

    def __post_init__(self) -> None:
        check_identifier(self.identifier)
        if self.last_msg_number is not None:
            check_number(self.last_msg_number, "LastMsgNumber")


@dataclass(frozen=True, slots=True)
class TerminateSequenceResponse:
    identifier: str

    def __post_init__(self) -> None:
        check_identifier(self.identifier)


@dataclass(frozen=True, slots=True)
class SequenceFault:
    """A WS-RM fault: its code, the sequence it is about (if any) and a human reason."""

    code: FaultCode
    identifier: str | None = None
    reason: str = field(default="")

    def __post_init__(self) -> None:
        if not isinstance(self.code, FaultCode):
            raise ValueError(f"unknown WS-RM fault code {self.code!r}")
        if self.identifier is not None:
            check_identifier(self.identifier)


RMHeader = Sequence | AckRequested | SequenceAcknowledgement | SequenceFault
RMBody = (
    CreateSequence
    | CreateSequenceResponse
    | CloseSequence
    | CloseSequenceResponse
    | TerminateSequence
    | TerminateSequenceResponse
)
