"""qtp's one exception tree.

::

    QtpError                              every error qtp raises; .retryable says whether trying again can help
    ├── ConfigurationError                bad qtp.toml, unknown resource name, bad URL, missing binaries
    ├── TransactionError                  misuse or failure of a global transaction
    │   ├── NoTransactionError            qtp.transaction() used with no manager installed
    │   ├── NestedTransactionError        qtp.transaction() inside another one on the same thread
    │   ├── TransactionStateError         enlisting after prepare, using a finished transaction
    │   ├── TransactionTimeoutError       the transaction outlived its timeout before prepare
    │   ├── RollbackError                 the transaction was rolled back (a branch voted no or failed)
    │   └── OutcomeUnknownError           qtp cannot tell yet whether it committed; recovery will decide
    ├── ResourceError                     a database or driver failed; driver exceptions are wrapped here
    │   ├── ResourceUnavailableError      could not connect, connection lost (retryable)
    │   ├── PrepareRefusedError           the database cannot prepare (max_prepared_transactions = 0, ...)
    │   └── ConnectionClosedError         a connection used outside the transaction that owns it
    ├── LogError                          the decision log
    │   ├── LogLockedError                another live manager holds the log directory
    │   └── LogCorruptError               a damaged record that is not a torn tail (names file and offset)
    ├── RecoveryError                     in-doubt resolution could not finish
    │   └── HeuristicError                a branch was resolved by hand against the logged decision
    ├── WsrmFault                         a WS-ReliableMessaging fault; .code is its wire fault code
    └── MessagingError                    the queue runtime (qtp.wsrm.runtime)
        └── BacklogFullError              tx.send on a channel whose unacknowledged backlog is full (retryable)

Lower-layer exceptions are translated where qtp meets the driver, with ``raise ... from exc``.
"""

from __future__ import annotations


class QtpError(Exception):
    """Base of every qtp error. ``retryable`` is True when the same call may succeed later."""

    retryable: bool = False


class ConfigurationError(QtpError):
    """Configuration is wrong: the message names the setting and how to fix it."""


class TransactionError(QtpError):
    """A global transaction was misused or could not complete."""


class NoTransactionError(TransactionError):
    """``qtp.transaction()`` was used before ``qtp.install(manager)``."""


class NestedTransactionError(TransactionError):
    """A transaction was begun on a thread that already has one."""


class TransactionStateError(TransactionError):
    """An operation is not allowed in the transaction's current state."""


class TransactionTimeoutError(TransactionError):
    """The transaction ran past its timeout before it was prepared, and was rolled back."""


class RollbackError(TransactionError):
    """The transaction was rolled back instead of committed; ``__cause__`` holds the reason."""

    retryable = True


class OutcomeUnknownError(TransactionError):
    """The outcome cannot be known now (the decision log failed, or the reply to a one-phase commit was lost).

    Every branch is left as the database has it; recovery decides from the durable log (presumed abort when
    the commit decision did not reach the disk), so all branches end the same way. Do not retry blindly.
    """


class ResourceError(QtpError):
    """A resource (database) failed; ``__cause__`` holds the driver's exception."""


class ResourceUnavailableError(ResourceError):
    """The database could not be reached or the connection broke."""

    retryable = True


class PrepareRefusedError(ResourceError):
    """The database refuses to prepare this branch; the message says which setting or statement is at fault."""


class ConnectionClosedError(ResourceError):
    """A connection was used after its transaction ended (your code kept it too long)."""


class LogError(QtpError):
    """The decision log failed."""


class LogLockedError(LogError):
    """Another live transaction manager holds this log directory."""


class LogCorruptError(LogError):
    """A record inside the log (not a torn tail) fails its checksum; qtp refuses to guess."""


class RecoveryError(QtpError):
    """Recovery could not resolve every in-doubt branch."""


class HeuristicError(RecoveryError):
    """A branch was committed or rolled back by hand against the logged decision."""


class WsrmFault(QtpError):
    """A WS-ReliableMessaging fault. ``code`` is the wire subcode (e.g. ``UnknownSequence``)."""

    def __init__(self, code: str, reason: str, detail: str | None = None):
        super().__init__(f"{code}: {reason}")
        self.code = code
        self.reason = reason
        self.detail = detail


class MessagingError(QtpError):
    """The queue runtime could not do what was asked (``tx.send``, a handler's delivery, the endpoint)."""


class BacklogFullError(MessagingError):
    """``tx.send`` on a channel whose backlog is at ``[limits] max_backlog``: the peer is slow or down."""

    retryable = True
