"""The transaction manager: two-phase commit with presumed abort over a group-committed decision log."""

from qtp.coordinator._log import DecisionLog, LogState, lock_holder, read_log
from qtp.coordinator._manager import (
    TransactionManager,
    current,
    install,
    installed,
    register_attachment,
    transaction,
)
from qtp.coordinator._transaction import TRANSITIONS, Branch, Event, Outcome, State, Transaction

__all__ = [
    "TRANSITIONS", "Branch", "DecisionLog", "Event", "LogState", "Outcome", "State", "Transaction",
    "TransactionManager", "current", "install", "installed", "lock_holder", "read_log", "register_attachment",
    "transaction",
]
