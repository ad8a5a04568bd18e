"""Sans-I/O WS-ReliableMessaging: RM Source, RM Destination and invoker state machines.

Events go in through ``machine.handle(event)``, actions come out; ``machine.record`` is the whole state, a
plain value saved with ``to_row`` and loaded with ``from_row``. Nothing here reads a clock, opens a socket
or touches a database. The transition tables are in ``_tables``; diagrams of them in ``docs/wsrm``.
"""

from qtp.wsrm.protocol._destination import DestinationRecord, DestinationSequence, build_ack, unknown_sequence
from qtp.wsrm.protocol._errors import ProtocolError
from qtp.wsrm.protocol._events import *  # noqa: F401,F403  (the event and action classes)
from qtp.wsrm.protocol._events import Action, Event
from qtp.wsrm.protocol._invoker import InvokerBuffer, InvokerRecord
from qtp.wsrm.protocol._machine import Machine, from_row, to_row
from qtp.wsrm.protocol._messages import (
    FAULT_VERSIONS,
    MAX_BATCH,
    MAX_MESSAGE_NUMBER,
    AckRanges,
    AckRequested,
    CloseSequence,
    CloseSequenceResponse,
    CreateSequence,
    CreateSequenceResponse,
    FaultCode,
    IncompleteSequenceBehavior,
    Offer,
    RMBody,
    RMHeader,
    RMVersion,
    Sequence,
    SequenceAcknowledgement,
    SequenceFault,
    TerminateSequence,
    TerminateSequenceResponse,
)
from qtp.wsrm.protocol._source import SourceRecord, SourceSequence
from qtp.wsrm.protocol._tables import (
    ALL_TABLES,
    DESTINATION_TABLES,
    INVOKER,
    SOURCE_TABLES,
    DestinationState,
    InvokerState,
    SourceState,
)

__all__ = [
    "ALL_TABLES", "DESTINATION_TABLES", "FAULT_VERSIONS", "INVOKER", "MAX_BATCH", "MAX_MESSAGE_NUMBER", "SOURCE_TABLES",
    "AckRanges", "AckRequested", "Action", "CloseSequence", "CloseSequenceResponse", "CreateSequence",
    "CreateSequenceResponse", "DestinationRecord", "DestinationSequence", "DestinationState", "Event",
    "FaultCode", "IncompleteSequenceBehavior", "InvokerBuffer", "InvokerRecord", "InvokerState", "Machine",
    "Offer", "ProtocolError", "RMBody", "RMHeader", "RMVersion", "Sequence", "SequenceAcknowledgement",
    "SequenceFault", "SourceRecord", "SourceSequence", "SourceState", "TerminateSequence",
    "TerminateSequenceResponse", "build_ack", "from_row", "to_row", "unknown_sequence",
]
