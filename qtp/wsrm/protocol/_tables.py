"""The transition tables of the three WS-RM machines, as data, in one place.

``TABLE[version][state][event name]`` is the set of states the machine may be in after handling that event.
The handler of an event decides which of them applies (an acknowledgement may or may not complete a
draining sequence); the table decides whether the event is legal at all, and the machine checks the
handler's answer against it. An event missing from the table is a ``ProtocolError`` and moves the machine
to ``FAILED``, which allows nothing. The state diagrams in ``docs/wsrm`` are drawn from these tables.

Self-loops on ``TERMINATED`` and late states are deliberate: on a network that duplicates and delays,
a stale CreateSequenceResponse, acknowledgement or response can arrive at any later time and must be
harmless, not a protocol error.

RM Source (after RMSSequence in the Mercury dissertation, extended to both WS-RM versions)::

    NEW -> CREATING -> ACTIVE -> DRAINING -> (1.1) CLOSING -> TERMINATING -> TERMINATED
                                         -> (1.0) TERMINATED (TerminateSequence has no response)

RM Destination (after RMDSequence)::

    NEW -> ACTIVE -> (1.1) CLOSED -> TERMINATED      (or TERMINATED by inactivity or expiry)

Invoker buffer (after InvokerBuffer)::

    ACTIVE -> DRAINING (final set of numbers known) -> COMPLETE (all of them delivered)
"""

from __future__ import annotations

from enum import Enum

from qtp.wsrm.protocol._messages import RMVersion


class SourceState(str, Enum):
    NEW = "NEW"
    CREATING = "CREATING"
    ACTIVE = "ACTIVE"
    DRAINING = "DRAINING"
    CLOSING = "CLOSING"
    CLOSED = "CLOSED"
    TERMINATING = "TERMINATING"
    TERMINATED = "TERMINATED"
    FAILED = "FAILED"


class DestinationState(str, Enum):
    NEW = "NEW"
    ACTIVE = "ACTIVE"
    CLOSED = "CLOSED"
    TERMINATED = "TERMINATED"
    FAILED = "FAILED"


class InvokerState(str, Enum):
    ACTIVE = "ACTIVE"
    DRAINING = "DRAINING"
    COMPLETE = "COMPLETE"
    FAILED = "FAILED"


Table = dict[Enum, dict[str, frozenset[Enum]]]

S = SourceState
D = DestinationState
I = InvokerState  # noqa: E741


def _t(*states: Enum) -> frozenset[Enum]:
    return frozenset(states)


_LATE_SOURCE = ("AckReceived", "CreateSequenceResponded", "CloseResponded", "TerminateResponded",
                "FaultReceived", "TimerFired")

SOURCE_11: Table = {
    S.NEW: {"CreateRequested": _t(S.CREATING)},
    S.CREATING: {
        "CreateSequenceResponded": _t(S.ACTIVE, S.DRAINING, S.CLOSING),
        "SendRequested": _t(S.CREATING),
        "CompleteRequested": _t(S.CREATING),
        "TimerFired": _t(S.CREATING),
        "FaultReceived": _t(S.FAILED),
    },
    S.ACTIVE: {
        "SendRequested": _t(S.ACTIVE),
        "AckReceived": _t(S.ACTIVE, S.TERMINATING, S.FAILED),
        "CompleteRequested": _t(S.DRAINING, S.CLOSING),
        "CloseRequested": _t(S.CLOSING),
        "TimerFired": _t(S.ACTIVE, S.TERMINATED),
        "FaultReceived": _t(S.CLOSED, S.FAILED),
        "CreateSequenceResponded": _t(S.ACTIVE),
    },
    S.DRAINING: {
        "AckReceived": _t(S.DRAINING, S.CLOSING, S.TERMINATING, S.FAILED),
        "CloseRequested": _t(S.CLOSING),
        "TimerFired": _t(S.DRAINING, S.TERMINATED),
        "FaultReceived": _t(S.CLOSED, S.FAILED),
        "CreateSequenceResponded": _t(S.DRAINING),
    },
    S.CLOSING: {
        "CloseResponded": _t(S.CLOSED, S.TERMINATING),
        "AckReceived": _t(S.CLOSING, S.FAILED),
        "TimerFired": _t(S.CLOSING, S.TERMINATED),
        "FaultReceived": _t(S.CLOSING, S.FAILED),
        "CreateSequenceResponded": _t(S.CLOSING),
    },
    S.CLOSED: {
        "AckReceived": _t(S.CLOSED, S.TERMINATING, S.FAILED),
        "CloseResponded": _t(S.CLOSED),
        "TimerFired": _t(S.CLOSED, S.TERMINATED),
        "FaultReceived": _t(S.CLOSED, S.FAILED),
        "CreateSequenceResponded": _t(S.CLOSED),
    },
    S.TERMINATING: {
        "TerminateResponded": _t(S.TERMINATED),
        "AckReceived": _t(S.TERMINATING),
        "CloseResponded": _t(S.TERMINATING),
        "TimerFired": _t(S.TERMINATING, S.TERMINATED),
        "FaultReceived": _t(S.TERMINATING, S.TERMINATED),
        "CreateSequenceResponded": _t(S.TERMINATING),
    },
    S.TERMINATED: {name: _t(S.TERMINATED) for name in _LATE_SOURCE},
    S.FAILED: {},
}

SOURCE_10: Table = {
    S.NEW: {"CreateRequested": _t(S.CREATING)},
    S.CREATING: {
        "CreateSequenceResponded": _t(S.ACTIVE, S.DRAINING),
        "SendRequested": _t(S.CREATING),
        "CompleteRequested": _t(S.CREATING),
        "TimerFired": _t(S.CREATING),
        "FaultReceived": _t(S.FAILED),
    },
    S.ACTIVE: {
        "SendRequested": _t(S.ACTIVE),
        "AckReceived": _t(S.ACTIVE, S.FAILED),
        "CompleteRequested": _t(S.DRAINING),
        "TimerFired": _t(S.ACTIVE, S.TERMINATED),
        "FaultReceived": _t(S.FAILED),
        "CreateSequenceResponded": _t(S.ACTIVE),
    },
    S.DRAINING: {
        "AckReceived": _t(S.DRAINING, S.TERMINATED, S.FAILED),
        "TimerFired": _t(S.DRAINING, S.TERMINATED),
        "FaultReceived": _t(S.FAILED),
        "CreateSequenceResponded": _t(S.DRAINING),
    },
    S.TERMINATED: {name: _t(S.TERMINATED) for name in ("AckReceived", "CreateSequenceResponded",
                                                         "FaultReceived", "TimerFired")},
    S.FAILED: {},
}

_LATE_DESTINATION = ("CreateSequenceReceived", "MessageReceived", "AckRequestedReceived", "CloseReceived",
                     "TerminateReceived", "FaultReceived", "TimerFired")

DESTINATION_11: Table = {
    D.NEW: {"CreateSequenceReceived": _t(D.ACTIVE)},
    D.ACTIVE: {
        "CreateSequenceReceived": _t(D.ACTIVE),
        "MessageReceived": _t(D.ACTIVE),
        "AckRequestedReceived": _t(D.ACTIVE),
        "CloseReceived": _t(D.CLOSED),
        "TerminateReceived": _t(D.TERMINATED),
        "TimerFired": _t(D.ACTIVE, D.TERMINATED),
        "FaultReceived": _t(D.FAILED),
    },
    D.CLOSED: {
        "CreateSequenceReceived": _t(D.CLOSED),
        "MessageReceived": _t(D.CLOSED),
        "AckRequestedReceived": _t(D.CLOSED),
        "CloseReceived": _t(D.CLOSED),
        "TerminateReceived": _t(D.TERMINATED),
        "TimerFired": _t(D.CLOSED, D.TERMINATED),
        "FaultReceived": _t(D.FAILED),
    },
    D.TERMINATED: {name: _t(D.TERMINATED) for name in _LATE_DESTINATION},
    D.FAILED: {},
}

DESTINATION_10: Table = {
    D.NEW: {"CreateSequenceReceived": _t(D.ACTIVE)},
    D.ACTIVE: {
        "CreateSequenceReceived": _t(D.ACTIVE),
        "MessageReceived": _t(D.ACTIVE),
        "AckRequestedReceived": _t(D.ACTIVE),
        "TerminateReceived": _t(D.TERMINATED),
        "TimerFired": _t(D.ACTIVE, D.TERMINATED),
        "FaultReceived": _t(D.FAILED),
    },
    D.TERMINATED: {name: _t(D.TERMINATED) for name in _LATE_DESTINATION if name != "CloseReceived"},
    D.FAILED: {},
}

INVOKER: Table = {
    I.ACTIVE: {
        "MessageStored": _t(I.ACTIVE),
        "DeliveryCommitted": _t(I.ACTIVE),
        "DeliveryAborted": _t(I.ACTIVE),
        "SequenceCompleted": _t(I.DRAINING, I.COMPLETE),
    },
    I.DRAINING: {
        "MessageStored": _t(I.DRAINING),
        "DeliveryCommitted": _t(I.DRAINING, I.COMPLETE),
        "DeliveryAborted": _t(I.DRAINING),
        "SequenceCompleted": _t(I.DRAINING),
    },
    I.COMPLETE: {"MessageStored": _t(I.COMPLETE), "SequenceCompleted": _t(I.COMPLETE)},
    I.FAILED: {},
}

SOURCE_TABLES: dict[RMVersion, Table] = {RMVersion.WSRM10: SOURCE_10, RMVersion.WSRM11: SOURCE_11}
DESTINATION_TABLES: dict[RMVersion, Table] = {RMVersion.WSRM10: DESTINATION_10, RMVersion.WSRM11: DESTINATION_11}

ALL_TABLES: dict[str, Table] = {
    "source-1.0": SOURCE_10,
    "source-1.1": SOURCE_11,
    "destination-1.0": DESTINATION_10,
    "destination-1.1": DESTINATION_11,
    "invoker": INVOKER,
}
