"""qtp's one exception tree.

::

    QtpError                              every error qtp raises; .retryable says whether trying again can help
    ├── ConfigurationError                bad qtp.toml, unknown resource name, bad URL, missing binaries
    ├── TransactionError                  misuse or failure of a global transaction
    │   ├── NoTransactionError            qtp.transaction() used with no manager installed
    │   ├── NestedTransactionError        qtp.transaction() inside another one on the same thread
    │   ├── TransactionStateError         enlisting after prepare, using a finished transaction
    │   ├── TransactionTimeoutError       the transaction outlived its timeout before prepare
    │   ├── RollbackError                 the transaction was rolled back (a branch voted no or failed);
    │   │                                 retryable when its cause is
    │   └── OutcomeUnknownError           qtp cannot tell yet whether it committed; recovery will decide
    ├── ResourceError                     a database or driver failed; driver exceptions are wrapped here
    │   ├── ResourceUnavailableError      could not connect, connection lost (retryable)
    │   ├── ConflictError                 serialization failure or deadlock: the database rolled the branch
    │   │                                 back (retryable)
    │   ├── PrepareRefusedError           the database cannot prepare (max_prepared_transactions = 0, ...)
    │   ├── ConnectionClosedError         a connection used outside the transaction that owns it
    │   └── FencedError                   a commit refused: this process does not hold its node's lease now
    ├── LeaseHeldError                    another live process owns the node ([lease] standby = "refuse")
    ├── LogError                          the decision log (also: a failed log refuses new transactions)
    │   ├── LogLockedError                another live manager holds the log directory
    │   │   └── LiveManagerError          `qtp recover` asked to act beside the node's live manager
    │   └── LogCorruptError               a damaged record that is not a torn tail (names file and offset)
    ├── FailpointError                    a failpoint configured to fail fired (tests and crash campaigns)
    ├── ReconcileError                    the Spark reconciliation job failed; retryable per cause
    ├── WsrmFault                         a WS-ReliableMessaging fault; .code is its wire fault code
    │   └── InvalidMessage                input that is not a usable WS-RM/SOAP envelope (qtp.wsrm.codec)
    └── MessagingError                    the queue runtime (qtp.wsrm)
        ├── BacklogFullError              tx.send on a channel whose unacknowledged backlog is full (retryable)
        ├── DuplicateApplyError           a message id applied already: its second copy's apply is refused
        ├── MessageRefusedError           a handler refuses a message for good: a dead letter at once
        ├── TransportError                the peer could not be reached or did not answer (retryable)
        ├── ProtocolError                 an event a WS-RM state machine does not allow; the sequence failed
        ├── EncodingError                 an envelope the chosen WS-RM/SOAP version cannot express (a bug)
        └── CoupledWireError              a coupled-messaging control message that does not follow coupled.xsd

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
    """The transaction was rolled back instead of committed; ``__cause__`` holds the reason.

    ``retryable`` is the cause's: True after a lost connection or a conflict (serialization failure,
    deadlock), False after, say, a constraint violation or a prepare the database refuses.
    """

    @property
    def retryable(self) -> bool:  # type: ignore[override]
        return bool(getattr(self.__cause__, "retryable", False))


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


class ConflictError(ResourceError):
    """The database rolled the branch back to resolve a conflict with another transaction (SQLSTATE class
    40 on PostgreSQL: serialization failure, deadlock; MariaDB's deadlock and XA rollback-only codes).
    A certain abort: running the whole transaction again can succeed."""

    retryable = True


class PrepareRefusedError(ResourceError):
    """The database refuses to prepare this branch; the message says which setting or statement is at fault."""


class ConnectionClosedError(ResourceError):
    """A connection was used after its transaction ended (your code kept it too long)."""


class FencedError(ResourceError):
    """A commit refused because this process does not hold its node's lease now (``[lease]``): another
    process has taken the node over, or this one could not renew in time. Nothing of the transaction
    committed; a process that lost its lease stops (``qtp serve`` exits with status 75)."""


class LeaseHeldError(QtpError):
    """Another live process owns the node (``[lease] standby = "refuse"``, or ``qtp recover`` beside it)."""


class LogError(QtpError):
    """The decision log failed."""


class LogLockedError(LogError):
    """Another live transaction manager holds this log directory."""


class LiveManagerError(LogLockedError):
    """``qtp recover`` was asked to act on a node whose live manager holds the log."""


class LogCorruptError(LogError):
    """A record inside the log (not a torn tail) fails its checksum; qtp refuses to guess."""


class FailpointError(QtpError):
    """Raised by a failpoint whose action is ``error`` (``qtp.coordinator.failpoints``)."""


class ReconcileError(QtpError):
    """The Spark job failed while reading or classifying; the message names the step and the root cause.

    ``retryable`` is True when the cause is transient (a database or executor connection lost, a timeout)
    and False when running it again the same way fails the same way (a bad table, column or query).
    """

    def __init__(self, message: str, retryable: bool = False):
        super().__init__(message)
        self.retryable = retryable


class WsrmFault(QtpError):
    """A WS-ReliableMessaging fault. ``code`` is the wire subcode (e.g. ``UnknownSequence``)."""

    def __init__(self, code: str, reason: str, detail: str | None = None):
        super().__init__(f"{code}: {reason}")
        self.code = code
        self.reason = reason
        self.detail = detail


class InvalidMessage(WsrmFault):
    """Input that is not a usable WS-RM/SOAP envelope.

    ``code`` is the wire fault code to answer with: a WS-RM subcode where the spec names one
    (``InvalidAcknowledgement``, ``MessageNumberRollover``), else the SOAP code ``Sender`` (``Client`` in
    SOAP 1.1), or ``MustUnderstand`` / ``VersionMismatch``. Retrying the same bytes cannot help.
    """

    retryable = False


class MessagingError(QtpError):
    """The queue runtime could not do what was asked (``tx.send``, a handler's delivery, the endpoint)."""


class DuplicateApplyError(MessagingError):
    """Two copies of one message (one MessageID, sent again in another sequence) tried to commit their apply;
    the second is refused (the memory store's counterpart of the SQL store's primary key). Retrying finds
    the first applied and consumes the copy without applying it."""

    retryable = True


class MessageRefusedError(MessagingError):
    """A handler refuses a message for good: it is malformed or cannot be served here, and no later attempt
    could change that. The invoker makes it a dead letter at once instead of trying ``max_attempts`` times."""


class BacklogFullError(MessagingError):
    """``tx.send`` on a channel whose backlog is at ``[limits] max_backlog``: the peer is slow or down."""

    retryable = True


class TransportError(MessagingError):
    """The peer could not be reached or did not answer; the message stays queued and is retransmitted."""

    retryable = True


class AuthenticationError(MessagingError):
    """A request (or an answer) does not prove it comes from a known peer: a bad or stale signature, an
    unknown client certificate, or none where the node takes no anonymous requests."""


class StaleBoot(AuthenticationError):
    """A signed request names another start of the receiving node (or none: the sender did not know this
    one yet): the sender signs it again with the boot the 401 answer gives and sends it once more."""


class ProtocolError(MessagingError):
    """An event was not allowed in the state of a WS-RM state machine; the machine is now FAILED."""

    retryable = False

    def __init__(self, machine: str, state: str, event: str, why: str):
        super().__init__(f"{machine} in state {state}: {event} is not allowed ({why})")
        self.machine = machine
        self.state = state
        self.event = event


class EncodingError(MessagingError, ValueError):
    """qtp was asked to emit an envelope its version cannot express; a bug in the caller, never sent."""


class CoupledWireError(MessagingError):
    """A coupled-messaging control message (``qtp.coupled``) that does not follow ``coupled.xsd``."""


def transient(exc: BaseException) -> bool:
    """Whether ``exc`` says something outside the code was briefly unavailable (a database unreachable, a
    connection lost, a conflict), so that trying again later can succeed with nothing changed: such a failure
    delays work and never counts as a refusal. qtp's own errors say it with ``retryable``; an error of the
    driver that reached here untranslated is transient when SQLAlchemy calls it an operational or interface
    error or saw the connection invalidated."""
    if isinstance(exc, QtpError):
        return bool(exc.retryable)
    from sqlalchemy import exc as sa_exc

    return isinstance(exc, (sa_exc.OperationalError, sa_exc.InterfaceError)) or \
        bool(getattr(exc, "connection_invalidated", False))
