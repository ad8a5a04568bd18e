"""qtp: queued transaction processing.

::

    tm = qtp.TransactionManager(node_id="orders-1")
    tm.add_resource("app", "postgresql://app@db1/app")
    tm.add_resource("ledger", "mysql+pymysql://qtp@db2/ledger")
    qtp.install(tm)

    with qtp.transaction() as tx:
        tx.connection("app").execute(text("UPDATE accounts SET balance = balance - 10 WHERE id = 1"))
        tx.connection("ledger").execute(text("UPDATE accounts SET balance = balance + 10 WHERE id = 7"))
"""

from qtp import errors, recovery  # noqa: F401 - recovery registers itself with the coordinator
from qtp._version import __version__
from qtp.coordinator import Outcome, Transaction, TransactionManager, current, install, transaction
from qtp.errors import QtpError
from qtp.wsrm.runtime import Message, Node

__all__ = ["Message", "Node", "Outcome", "QtpError", "Transaction", "TransactionManager", "__version__", "current",
           "errors", "install", "transaction"]
