"""Where a node keeps its WS-RM state: one contract (``Store``), a SQL and an in-memory implementation.

See ``qtp.wsrm.store._contract`` for the rules every store keeps and how sessions join transactions.
"""

from qtp.wsrm.store._contract import (
    Buffered,
    DeadLetter,
    DestinationInfo,
    Incoming,
    Outgoing,
    SourceInfo,
    Store,
    Summary,
)
from qtp.wsrm.store._memory import MemoryStore
from qtp.wsrm.store._sql import SqlStore

__all__ = ["Buffered", "DeadLetter", "DestinationInfo", "Incoming", "MemoryStore", "Outgoing", "SourceInfo",
           "SqlStore", "Store", "Summary"]
