"""One global transaction and its commit path (presumed-abort two-phase commit).

The commit path reads like the protocol:

1. no branch: nothing to do. One branch: commit it in one phase (a local commit; no vote, no log).
2. phase 1: ask every branch for its vote, all at once. A "no" (an exception) rolls every branch back.
   Read-only branches leave here: they take no part in phase 2 and are not logged.
3. one branch left prepared: commit it (no other branch can disagree, so no decision needs logging).
   Several: force the COMMIT decision to the log (group commit) - from here on the transaction *is*
   committed, whatever happens next.
4. phase 2: commit every prepared branch, all at once. A failure is never turned into a rollback: the
   caller is told "committed with branches pending", the failure is logged at CRITICAL and retried in the
   background, and what retries cannot finish is left to recovery.
5. an unforced END record lets the log forget the transaction.

Transitions of a transaction are data (``TRANSITIONS``); anything else is a TransactionStateError.
"""

from __future__ import annotations

import enum
import os
import logging
import time
from typing import TYPE_CHECKING, Any, Callable

from sqlalchemy.orm import Session

from qtp.coordinator.failpoints import failpoint
from qtp.errors import (
    ConfigurationError,
    LogError,
    OutcomeUnknownError,
    ResourceUnavailableError,
    RollbackError,
    TransactionStateError,
    TransactionTimeoutError,
)
from qtp.xa import Resource, Vote, Xid

if TYPE_CHECKING:
    from qtp.coordinator._manager import TransactionManager

log = logging.getLogger("qtp.coordinator")


class State(enum.Enum):
    ACTIVE = "active"
    PREPARING = "preparing"
    COMMITTING = "committing"
    ROLLING_BACK = "rolling back"
    COMMITTED = "committed"
    COMMITTED_PENDING = "committed with branches pending"
    ROLLED_BACK = "rolled back"
    IN_DOUBT = "in doubt"


class Outcome(enum.Enum):
    COMMITTED = "committed"
    COMMITTED_PENDING = "committed with branches pending"
    ROLLED_BACK = "rolled back"
    UNKNOWN = "unknown until recovery"


TRANSITIONS: dict[State, set[State]] = {
    State.ACTIVE: {State.PREPARING, State.ROLLING_BACK},
    State.PREPARING: {State.COMMITTING, State.ROLLING_BACK, State.COMMITTED, State.IN_DOUBT},
    State.COMMITTING: {State.COMMITTED, State.COMMITTED_PENDING},
    State.ROLLING_BACK: {State.ROLLED_BACK},
    State.COMMITTED: set(),
    State.COMMITTED_PENDING: set(),
    State.ROLLED_BACK: set(),
    State.IN_DOUBT: set(),
}


class Transaction:
    """A global transaction. Use it through ``with qtp.transaction() as tx`` (or ``manager.transaction()``)."""

    def __init__(self, manager: "TransactionManager", timeout: float):
        self.manager = manager
        self.gtrid = manager.gtrid_prefix + os.urandom(16).hex().encode()
        self.deadline = time.monotonic() + timeout
        self.timeout = timeout
        self.state = State.ACTIVE
        self.pending: list[str] = []  # branches whose phase-2 commit is still owed
        self.interrupted = False  # the timeout reaper cancelled this transaction's statements
        self._branches: dict[int, tuple[Resource, Xid]] = {}  # id(resource) -> branch
        self._sessions: dict[str, Session] = {}
        self._on_commit: list[Callable[[], None]] = []

    def __repr__(self) -> str:
        return f"<Transaction {self.gtrid.decode()} {self.state.value}>"

    @property
    def xid(self) -> str:
        """The global transaction id (``<node id>/<hex>``); each branch's xid adds its resource name."""
        return self.gtrid.decode()

    @property
    def outcome(self) -> Outcome | None:
        """None while the transaction runs; then committed, committed with branches pending, or rolled back."""
        return {State.COMMITTED: Outcome.COMMITTED, State.COMMITTED_PENDING: Outcome.COMMITTED_PENDING,
                State.ROLLED_BACK: Outcome.ROLLED_BACK, State.IN_DOUBT: Outcome.UNKNOWN}.get(self.state)

    @property
    def state(self) -> State:
        return self._state

    @state.setter
    def state(self, new: State) -> None:
        self._state = new
        if not TRANSITIONS[new] and new is not State.COMMITTED_PENDING:  # pending: the retrier finishes it
            self.manager.finished(self)

    def _move(self, new: State) -> None:
        if new not in TRANSITIONS[self.state]:
            raise TransactionStateError(f"transaction {self.xid} cannot go from {self.state.value} to {new.value}")
        self.state = new

    # ------------------------------------------------------------------ enlisting

    def _check_active(self, action: str) -> None:
        if self.state is not State.ACTIVE:
            raise TransactionStateError(
                f"cannot {action}: transaction {self.xid} is {self.state.value}; enlist resources inside the "
                "`with qtp.transaction()` block, before it ends"
            )
        if time.monotonic() > self.deadline:
            self.rollback()
            raise TransactionTimeoutError(
                f"transaction {self.xid} ran past its timeout of {self.timeout:g} s and was rolled back; "
                "shorten the transaction or raise the timeout (TransactionManager(timeout=...))"
            )

    def enlist(self, name: str) -> tuple[Resource, Xid]:
        """Make resource ``name`` a branch of this transaction (once per database) and return the branch."""
        self._check_active(f"enlist {name!r}")
        resource = self.manager.resource(name)
        branch = self._branches.get(id(resource))
        if branch is None:
            xid = Xid.of(self.gtrid, resource.name)
            resource.begin(xid)
            branch = self._branches[id(resource)] = (resource, xid)
        return branch

    def connection(self, name: str) -> Any:
        """The branch's connection: a SQLAlchemy ``Connection`` for SQL resources."""
        resource, xid = self.enlist(name)
        return resource.connection(xid)

    def session(self, name: str, **session_kw: Any) -> Session:
        """An ORM ``Session`` bound to the branch of ``name``; committed into the branch before the vote.

        The session works in a savepoint of the branch: ``session.commit()`` makes its work part of the global
        transaction, ``session.rollback()`` undoes only the session's work since then.
        """
        self._check_active(f"open a session on {name!r}")
        session = self._sessions.get(name)
        if session is None:
            conn = self.connection(name)
            if not hasattr(conn, "execute"):
                raise ConfigurationError(f"resource {name!r} is not a SQL database; use tx.connection({name!r})")
            session_kw.setdefault("expire_on_commit", False)
            session = Session(bind=conn, join_transaction_mode="create_savepoint", **session_kw)
            self._sessions[name] = session
        return session

    def on_commit(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` on the committing thread once the transaction is committed (also with branches
        pending); never after a rollback or an unknown outcome. Its errors are logged, not raised."""
        self._check_active("register an on-commit callback")
        self._on_commit.append(callback)

    def send(self, channel: str, payload: bytes, action: str, message_id: str | None = None) -> str:
        """Enqueue a message on ``channel``, atomically with this transaction; returns its MessageID.

        The message exists if and only if this transaction commits; the node's sender then delivers it
        reliably (WS-ReliableMessaging). Needs a node with channels (``[channels.NAME]`` in qtp.toml).
        """
        node = getattr(self.manager, "node", None)
        if node is None:
            raise ConfigurationError(
                f"tx.send({channel!r}, ...): node {self.manager.node_id!r} has no channels; add a "
                f"[channels.{channel}] table (peer, store) to its qtp.toml, or build a qtp.Node"
            )
        return node.send(self, channel, payload, action=action, message_id=message_id)

    def _run_on_commit(self) -> None:
        for callback in self._on_commit:
            try:
                callback()
            except Exception:  # the transaction is committed; its callbacks cannot change that
                log.exception("on-commit callback of transaction %s failed", self.xid)
        self._on_commit.clear()

    def interrupt(self) -> None:
        """Called by the timeout reaper (another thread): cancel whatever the branches are running."""
        self.interrupted = True
        for resource, xid in list(self._branches.values()):
            try:
                resource.cancel(xid)
            except Exception as exc:  # best effort: the owner still rolls back at its next call
                log.warning("could not cancel the running statement of %s: %s", xid, exc)

    # ------------------------------------------------------------------ ending

    def commit(self) -> None:
        """Commit atomically across every branch, or roll every branch back and raise RollbackError."""
        self._check_active("commit")
        try:
            for session in self._sessions.values():
                session.commit()  # flushes and releases the session's savepoint; the branch stays open
        except BaseException as exc:
            self.rollback()
            raise RollbackError(f"transaction {self.xid} rolled back: flushing a session failed: {exc}") from exc
        self._move(State.PREPARING)
        self._close_sessions()
        try:
            self._two_phase_commit()
        except (RollbackError, OutcomeUnknownError):
            raise
        except BaseException as exc:  # anything unforeseen (a failpoint, an interrupt): settle, then re-raise
            self._settle_after(exc)
            raise
        if self._on_commit:
            self._run_on_commit()

    def _two_phase_commit(self) -> None:
        branches = self._drop_idle(list(self._branches.values()))
        if len(branches) <= 1:
            self._commit_one_phase(branches)
            return
        prepared = self._phase_one(branches)
        if len(prepared) <= 1:
            self._commit_sole_prepared(prepared)
            return
        self._decide(prepared)
        self._phase_two(prepared)

    def _settle_after(self, exc: BaseException) -> None:
        """The commit path was cut by an unexpected error. Before the decision: roll everything back.
        After it: the transaction is committed; the background retry (then recovery) commits what is left."""
        if self.state is State.PREPARING:
            self._move(State.ROLLING_BACK)
            self._rollback_all(list(self._branches.values()))
            self.state = State.ROLLED_BACK
        elif self.state is State.COMMITTING:
            branches = list(self._branches.values())
            self.pending = [xid.branch for _, xid in branches]
            log.critical("transaction %s is committed but its phase 2 was interrupted (%r); committing the "
                         "branches in the background", self.xid, exc)
            self.state = State.COMMITTED_PENDING
            self.manager.retry_phase_two(self.xid, branches)

    def _drop_idle(self, branches: list[tuple[Resource, Xid]]) -> list[tuple[Resource, Xid]]:
        """End the branches that did no work (read-only, no round trip); return the others."""
        busy = []
        for resource, xid in branches:
            if resource.may_have_written(xid):
                busy.append((resource, xid))
            else:
                try:
                    resource.prepare(xid)
                except BaseException as exc:
                    self._abort(exc, f"ending idle branch {xid.branch} failed")
        return busy

    def _commit_one_phase(self, branches: list[tuple[Resource, Xid]]) -> None:
        if branches:
            resource, xid = branches[0]
            try:
                resource.commit(xid, one_phase=True)
            except ResourceUnavailableError as exc:  # the COMMIT may have landed before the connection broke
                resource.detach(xid)
                self._give_up_knowing(exc, f"the connection to {xid.branch} broke during its one-phase commit, "
                                           "so the database alone knows whether it committed")
            except BaseException as exc:
                self._abort(exc, "the one-phase commit failed")
        self.state = State.COMMITTED

    def _phase_one(self, branches: list[tuple[Resource, Xid]]) -> list[tuple[Resource, Xid]]:
        failpoint("before_prepare")

        def prepare(index: int, branch: tuple[Resource, Xid]) -> Vote:
            vote = branch[0].prepare(branch[1])
            failpoint(f"after_prepare_{index}")
            return vote

        self.manager.log.voting(+1)
        try:
            results = self.manager.fan_out(prepare, branches)
        finally:
            self.manager.log.voting(-1)
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            self._abort(failure, "a branch voted no")
        return [b for b, vote in zip(branches, results) if vote is Vote.YES]

    def _commit_sole_prepared(self, prepared: list[tuple[Resource, Xid]]) -> None:
        """Every other branch was read-only: the one prepared branch decides alone, nothing is logged.

        If its commit fails the transaction is still decided "commit" (nobody can disagree): the decision is
        logged then, and the commit finished like any pending phase 2 (a lost reply is thus harmless).
        """
        try:
            for resource, xid in prepared:
                resource.commit(xid)
        except BaseException:
            self._decide(prepared)
            self._phase_two(prepared)
            return
        self.state = State.COMMITTED

    def _decide(self, prepared: list[tuple[Resource, Xid]]) -> None:
        try:
            self.manager.log.log_commit(self.xid, [xid.branch for _, xid in prepared])
        except LogError as exc:
            # The record may or may not be on disk: rolling back could contradict it. Leave every branch
            # prepared; recovery after a restart reads the log and ends them all the same way.
            for resource, xid in prepared:
                resource.detach(xid)
            self._give_up_knowing(exc, "the commit decision could not be logged")
        self._move(State.COMMITTING)
        failpoint("after_decision_forced")

    def _give_up_knowing(self, cause: BaseException, why: str) -> None:
        self._move(State.IN_DOUBT)
        log.critical("transaction %s: outcome unknown: %s (%s); recovery will resolve it", self.xid, why, cause)
        raise OutcomeUnknownError(
            f"transaction {self.xid}: outcome unknown: {why}: {cause}; every branch is left to recovery "
            "(`qtp recover`), which ends them all the same way; check the outcome before retrying"
        ) from cause

    def _phase_two(self, prepared: list[tuple[Resource, Xid]]) -> None:
        def commit(index: int, branch: tuple[Resource, Xid]) -> None:
            branch[0].commit(branch[1])
            failpoint(f"after_commit_{index}")

        results = self.manager.fan_out(commit, prepared)
        failed = [(b, r) for b, r in zip(prepared, results) if isinstance(r, BaseException)]
        if failed:
            self.pending = [xid.branch for (_, xid), _ in failed]
            for (resource, xid), exc in failed:
                log.critical("transaction %s is committed but branch %s could not commit yet (%s); retrying in "
                             "the background, and recovery will finish it if retries cannot", self.xid,
                             xid.branch, exc)
            self.state = State.COMMITTED_PENDING
            self.manager.retry_phase_two(self.xid, [b for b, _ in failed])
            return
        failpoint("before_end_record")
        self.manager.log.log_end(self.xid)
        self.state = State.COMMITTED

    def rollback(self) -> None:
        """Roll every branch back. Branches that cannot be reached stay prepared or active in the database;
        the database drops active ones with the connection, and recovery rolls back prepared ones."""
        if self.state in (State.ROLLED_BACK, State.ROLLING_BACK):
            return
        self._move(State.ROLLING_BACK)
        self._close_sessions()
        self._rollback_all(list(self._branches.values()))
        self.state = State.ROLLED_BACK

    def _rollback_all(self, branches: list[tuple[Resource, Xid]]) -> None:
        def rollback(index: int, branch: tuple[Resource, Xid]) -> None:
            branch[0].rollback(branch[1])

        for (_, xid), result in zip(branches, self.manager.fan_out(rollback, branches)):
            if isinstance(result, BaseException):
                log.warning("rollback of %s failed (%s); recovery will roll it back if it was prepared", xid, result)

    def _abort(self, cause: BaseException, why: str) -> None:
        self._move(State.ROLLING_BACK)
        self._rollback_all(list(self._branches.values()))
        self.state = State.ROLLED_BACK
        raise RollbackError(f"transaction {self.xid} rolled back: {why}: {cause}") from cause

    def _close_sessions(self) -> None:
        for session in self._sessions.values():
            session.close()
        self._sessions.clear()


def run_each(fn: Callable[[int, Any], Any], items: list[Any]) -> list[Any]:
    """Apply ``fn(index, item)`` to each item in turn, collecting results or exceptions (no threads)."""
    results: list[Any] = []
    for index, item in enumerate(items):
        try:
            results.append(fn(index, item))
        except BaseException as exc:  # collected and handled by the caller
            results.append(exc)
    return results
