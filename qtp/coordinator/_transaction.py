"""One global transaction and its commit path (presumed-abort two-phase commit).

The commit path reads like the protocol:

1. no branch: nothing to do. One branch: commit it in one phase (a local commit; no vote, no log).
2. phase 1: ask every branch for its vote, all at once. A "no" (an exception) rolls every branch back.
   Read-only branches leave here: they take no part in phase 2 and are not logged.
3. one branch left prepared: commit it (no other branch can disagree, so no decision needs logging).
   Several: append the COMMIT decision to the log and force it (group commit). From the append on the
   decision is never contradicted: the record reaches the disk with the next flush even if this thread is
   interrupted while it waits, so nothing may be rolled back any more.
4. phase 2: commit every prepared branch, all at once. A failure is never turned into a rollback: the
   caller is told "committed with branches pending", the failure is logged at CRITICAL and retried in the
   background, and what retries cannot finish is left to recovery.
5. an unforced END record lets the log forget the transaction.

Logging Last Resource (the manager's ``llr``, on by default). When two or more branches wrote and one of
them is a SQL database, that one (the *last resource*: the one configured ``last_resource``, else the SQL
branch that ran most statements, the first enlisted on a tie) is not prepared. Instead, while the others
are asked to vote, the decision row (gtrid, node id, the other branches) is inserted into that branch's own
``qtp_llr_decision`` table; once every other branch voted yes, the last branch is committed in one phase.
That local COMMIT *is* the decision: the row exists if and only if it committed. No log write is forced
and one prepare is saved. Phase 2 then commits the prepared branches, and the row is deleted later in a
batch (the END record, in effect). Recovery looks an in-doubt transaction up in the file log and in the
decision tables of every SQL resource of the node.

Every state change goes through one table, ``TRANSITIONS[(state, event)]``; a pair that is not in it is a
TransactionStateError. Nothing else assigns the state.

What an error or an interrupt (any BaseException: KeyboardInterrupt, SystemExit, a failpoint) means, by
where it strikes; each rule is carried out by ``_settle_after`` or the step named:

=====================================  ==================================================================
before the decision (flush, votes)     roll every branch back; RollbackError (an interrupt is re-raised)
LLR: the last COMMIT, database says    certain abort: the prepared branches are rolled back; RollbackError
no (or the decision row failed)
LLR: the last COMMIT, connection       unknown: the prepared branches are left to recovery, which finds the
lost or interrupted                    decision row or presumes abort; OutcomeUnknownError
one-phase COMMIT: database says no     certain abort: RollbackError (``_commit_one_phase``)
one-phase COMMIT: connection lost,     the COMMIT may have landed: outcome unknown, the branch's
or anything else (an interrupt)        connection dropped, OutcomeUnknownError (an interrupt re-raised)
decision: the log write fails          unknown until recovery reads the log: every branch left prepared,
                                       OutcomeUnknownError; the failed log refuses new transactions
decision: interrupted after append     flush the record, then committed: phase 2 to the background retry;
                                       if the log cannot write it, unknown (as when the write fails)
decision: interrupted before append    roll back (no record can exist)
phase 2 fails or is interrupted        committed with branches pending: background retry, then recovery
                                       (an interrupt is re-raised once the branches are handed over)
rollback interrupted                   connections dropped: active branches die with them, prepared ones
                                       are rolled back by recovery (presumed abort); the interrupt re-raised
=====================================  ==================================================================
"""

from __future__ import annotations

import enum
import os
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from sqlalchemy.orm import Session

from qtp.coordinator.failpoints import failpoint
from qtp.errors import (
    ConfigurationError,
    LogError,
    OutcomeUnknownError,
    ResourceError,
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
    DECIDING = "deciding"
    COMMITTING = "committing"
    ROLLING_BACK = "rolling back"
    COMMITTED = "committed"
    COMMITTED_PENDING = "committed with branches pending"
    ROLLED_BACK = "rolled back"
    IN_DOUBT = "in doubt"


class Event(enum.Enum):
    COMMIT = "commit requested"  # the application ended the block (or called tx.commit())
    ROLLBACK = "rollback"  # asked for, a vote was no, or the path was cut before the decision
    ROLLED_BACK = "every branch told to roll back"
    COMMITTED = "every branch committed"  # one-phase, sole prepared, nothing to do, or phase 2 done
    DECIDE = "decision appended to the log"
    DECIDED = "decision durable"
    PENDING = "branches left to the background retry"
    UNKNOWN = "outcome unknown"


class Outcome(enum.Enum):
    COMMITTED = "committed"
    COMMITTED_PENDING = "committed with branches pending"
    ROLLED_BACK = "rolled back"
    UNKNOWN = "unknown until recovery"


S, E = State, Event
TRANSITIONS: dict[tuple[State, Event], State] = {
    (S.ACTIVE, E.COMMIT): S.PREPARING,
    (S.ACTIVE, E.ROLLBACK): S.ROLLING_BACK,
    (S.PREPARING, E.ROLLBACK): S.ROLLING_BACK,
    (S.PREPARING, E.COMMITTED): S.COMMITTED,
    (S.PREPARING, E.UNKNOWN): S.IN_DOUBT,
    (S.PREPARING, E.DECIDE): S.DECIDING,
    (S.DECIDING, E.DECIDED): S.COMMITTING,
    (S.DECIDING, E.UNKNOWN): S.IN_DOUBT,
    (S.DECIDING, E.PENDING): S.COMMITTED_PENDING,
    (S.DECIDING, E.ROLLBACK): S.ROLLING_BACK,
    (S.COMMITTING, E.COMMITTED): S.COMMITTED,
    (S.COMMITTING, E.PENDING): S.COMMITTED_PENDING,
    (S.ROLLING_BACK, E.ROLLED_BACK): S.ROLLED_BACK,
}
del S, E

_OUTCOMES = {State.COMMITTED: Outcome.COMMITTED, State.COMMITTED_PENDING: Outcome.COMMITTED_PENDING,
             State.ROLLED_BACK: Outcome.ROLLED_BACK, State.IN_DOUBT: Outcome.UNKNOWN}
FINAL = frozenset(_OUTCOMES)  # the states with an outcome


@dataclass(frozen=True)
class Branch:
    """One database's part of a global transaction."""

    resource: Resource
    xid: Xid

    @property
    def name(self) -> str:
        return self.xid.branch


class Transaction:
    """A global transaction. Use it through ``with qtp.transaction() as tx`` (or ``manager.transaction()``)."""

    def __init__(self, manager: "TransactionManager", timeout: float, gtrid: bytes | None = None):
        self.manager = manager
        self.gtrid = gtrid or manager.gtrid_prefix + os.urandom(16).hex().encode()
        self.deadline = time.monotonic() + timeout
        self.timeout = timeout
        self.state = State.ACTIVE  # changed only by _fire
        self.pending: list[str] = []  # branches whose phase-2 commit is still owed
        self.interrupted = False  # the timeout reaper cancelled this transaction's statements
        self._branches: dict[int, Branch] = {}  # id(resource) -> branch
        self._sessions: dict[str, tuple[Session, dict[str, Any]]] = {}  # name -> (session, its options)
        self._on_commit: list[Callable[[], None]] = []
        self._before_commit: list[Callable[["Transaction"], None]] = []
        self._on_rollback: list[Callable[[], None]] = []
        self._handed_over = False  # the background phase-2 retry finishes it (and ends it in the manager)
        self._last: Branch | None = None  # the last resource, once its COMMIT made the decision (LLR)
        self._last_commit_sent: Branch | None = None  # the last resource, once its COMMIT may be on its way

    def __repr__(self) -> str:
        return f"<Transaction {self.gtrid.decode()} {self.state.value}>"

    @property
    def xid(self) -> str:
        """The global transaction id (``<node id>/<hex>``); each branch's xid adds its resource name."""
        return self.gtrid.decode()

    @property
    def outcome(self) -> Outcome | None:
        """None while the transaction runs; then committed, committed with branches pending, rolled back, or
        unknown until recovery."""
        return _OUTCOMES.get(self.state)

    def _fire(self, event: Event) -> None:
        """The one place the state changes: ``TRANSITIONS[(state, event)]`` or TransactionStateError."""
        new = TRANSITIONS.get((self.state, event))
        if new is None:
            raise TransactionStateError(
                f"transaction {self.xid} is {self.state.value}: it cannot take the event {event.value!r}")
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

    def enlist(self, name: str) -> Branch:
        """Make resource ``name`` a branch of this transaction (once per database) and return the branch."""
        self._check_active(f"enlist {name!r}")
        resource = self.manager.resource(name)
        branch = self._branches.get(id(resource))
        if branch is None:
            xid = Xid.of(self.gtrid, resource.name)
            resource.begin(xid)
            branch = self._branches[id(resource)] = Branch(resource, xid)
        return branch

    @property
    def branches(self) -> list[Branch]:
        return list(self._branches.values())

    def connection(self, name: str) -> Any:
        """The branch's connection: a SQLAlchemy ``Connection`` for SQL resources."""
        branch = self.enlist(name)
        return branch.resource.connection(branch.xid)

    def session(self, name: str, **session_kw: Any) -> Session:
        """An ORM ``Session`` bound to the branch of ``name``; committed into the branch before the vote.

        The session works in a savepoint of the branch: ``session.commit()`` makes its work part of the global
        transaction, ``session.rollback()`` undoes only the session's work since then. One session per name:
        a later call returns it, and refuses options that differ from those it was opened with.
        """
        self._check_active(f"open a session on {name!r}")
        opened = self._sessions.get(name)
        if opened is not None:
            session, options = opened
            if session_kw and session_kw != options:
                raise ConfigurationError(
                    f"tx.session({name!r}) is already open in transaction {self.xid} with options {options!r}; "
                    f"it cannot be reopened with {session_kw!r}: pass the options on the first call only")
            return session
        conn = self.connection(name)
        if not hasattr(conn, "execute"):
            raise ConfigurationError(f"resource {name!r} is not a SQL database; use tx.connection({name!r})")
        options = dict(session_kw)
        session = Session(bind=conn, join_transaction_mode="create_savepoint",
                          **{"expire_on_commit": False, **session_kw})
        self._sessions[name] = (session, options)
        return session

    def on_commit(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` on the committing thread once the transaction is committed (also with branches
        pending); never after a rollback or an unknown outcome. Its errors are logged, not raised."""
        self._check_active("register an on-commit callback")
        self._on_commit.append(callback)

    def before_commit(self, callback: Callable[["Transaction"], None]) -> None:
        """Call ``callback(tx)`` when the application commits, before the sessions are flushed and the
        branches asked to vote, while the transaction is still active: it may do more work in it (enlist,
        write), wait for something, or raise to roll the transaction back (RollbackError says why). This is
        *Phase 0* of the coupled transactions (``qtp.coupled``): their conditions are checked here."""
        self._check_active("register a before-commit callback")
        self._before_commit.append(callback)

    def on_rollback(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once the transaction is rolled back (for whatever reason); never after a
        commit or when the outcome is unknown. Its errors are logged, not raised."""
        self._check_active("register an on-rollback callback")
        self._on_rollback.append(callback)

    def send(self, channel: str, payload: bytes, action: str, message_id: str | None = None,
             key: str | None = None) -> str:
        """Enqueue a message on ``channel``, atomically with this transaction; returns its MessageID.

        The message exists if and only if this transaction commits; the node's sender then delivers it
        reliably (WS-ReliableMessaging). Needs a node with channels (``[channels.NAME]`` in qtp.toml).
        A message with a ``key`` is applied after every message with that key whose transaction committed
        before this call (so one thread's messages keep commit order; two transactions that both send
        before either commits may go either way); on a channel with ``lanes > 1``, different keys may
        overtake each other; messages without a key share lane 0.
        """
        node = getattr(self.manager, "node", None)
        if node is None:
            raise ConfigurationError(
                f"tx.send({channel!r}, ...): node {self.manager.node_id!r} has no channels; add a "
                f"[channels.{channel}] table (peer, store) to its qtp.toml, or build a qtp.Node"
            )
        return node.enqueue(self, channel, payload, action=action, message_id=message_id, key=key)

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
        for branch in self.branches:
            try:
                branch.resource.cancel(branch.xid)
            except Exception as exc:  # best effort: the owner still rolls back at its next call
                log.warning("could not cancel the running statement of %s: %s", branch.xid, exc)

    # ------------------------------------------------------------------ ending

    def commit(self) -> None:
        """Commit atomically across every branch, or roll every branch back and raise RollbackError."""
        self._check_active("commit")
        try:
            try:
                self._run_before_commit()
                for session, _ in self._sessions.values():
                    session.commit()  # flushes and releases the session's savepoint; the branch stays open
            except BaseException as exc:
                self._roll_back_all(Event.ROLLBACK)
                if not isinstance(exc, Exception):
                    raise
                if isinstance(exc, RollbackError):
                    raise
                raise RollbackError(f"transaction {self.xid} rolled back: flushing a session failed: {exc}") \
                    from exc
            self._fire(Event.COMMIT)
            self._close_sessions()
            try:
                self._two_phase_commit()
            except BaseException as exc:  # anything unforeseen (a failpoint, an interrupt): settle, then re-raise
                self._settle_after(exc)
                raise
        finally:
            self._done()
        if self._on_commit:
            self._run_on_commit()

    def _run_before_commit(self) -> None:
        while self._before_commit:  # a callback may register another
            callback = self._before_commit.pop(0)
            try:
                callback(self)
            except RollbackError:
                raise
            except Exception as exc:
                raise RollbackError(f"transaction {self.xid} rolled back: a before-commit step failed: {exc}") \
                    from exc

    def _done(self) -> None:
        """Tell the manager once the transaction has an outcome (when handed to the retry, the retry does)."""
        if self.state in FINAL and not self._handed_over:
            self.manager.finished(self)
        if self.state is State.ROLLED_BACK and self._on_rollback:
            callbacks, self._on_rollback = self._on_rollback, []
            for callback in callbacks:
                try:
                    callback()
                except Exception:  # the transaction is rolled back; its callbacks cannot change that
                    log.exception("on-rollback callback of transaction %s failed", self.xid)

    def prepare_subordinate(self) -> list[str]:
        """End the transaction as a *subordinate* of another node's transaction: ask every branch to vote and
        leave the ones that voted yes prepared, for the superior's decision (``qtp.coupled``'s shared
        coupling). Returns the names of the prepared branches (empty: nothing was written, nothing waits).

        No decision is logged here and no branch is committed; the state ends "in doubt". A "no" rolls every
        branch back and raises RollbackError. The caller records the prepared branches durably before it
        votes, and later commits or rolls them back by xid (``Resource.commit``/``rollback``, idempotent).
        The transaction's gtrid must not carry this node's own prefix, or the node's recovery would presume
        abort for the branches while the superior may have committed them.
        """
        self._check_active("prepare")
        if self.gtrid.startswith(self.manager.gtrid_prefix):
            raise TransactionStateError(f"transaction {self.xid} has this node's own gtrid: its recovery would "
                                        "roll the prepared branches back; begin it with a subordinate gtrid")
        try:
            self._run_before_commit()
            for session, _ in self._sessions.values():
                session.commit()
            self._fire(Event.COMMIT)
            self._close_sessions()
            branches = self._drop_idle(self.branches)
            prepared = self._phase_one(branches)
            for branch in prepared:
                branch.resource.detach(branch.xid)
            self._fire(Event.UNKNOWN)
            return [b.name for b in prepared]
        except BaseException as exc:
            if self.state in (State.ACTIVE, State.PREPARING):
                self._roll_back_all(Event.ROLLBACK)
            if isinstance(exc, Exception) and not isinstance(exc, RollbackError):
                raise RollbackError(f"transaction {self.xid} rolled back: preparing it failed: {exc}") from exc
            raise
        finally:
            self._done()

    def _two_phase_commit(self) -> None:
        branches = self._drop_idle(self.branches)
        if not branches or (len(branches) == 1 and branches[0].resource.one_phase_safe):
            self._commit_one_phase(branches)
            return
        last = self.manager.last_resource_of(branches)
        if last is not None:
            self._commit_last_resource(self._phase_one(branches, last), last)
            return
        prepared = self._phase_one(branches)
        if len(prepared) <= 1:
            self._commit_sole_prepared(prepared)
            return
        self._decide(prepared)
        self._phase_two(prepared)

    def _settle_after(self, exc: BaseException) -> None:
        """The commit path was cut by an error the step itself did not settle (see the module's table)."""
        if self.state is State.PREPARING:
            self._roll_back_all(Event.ROLLBACK)
        elif self.state is State.DECIDING:
            if self._last_commit_sent is not None:  # LLR: the last COMMIT may have landed
                others = [b for b in self.branches if b is not self._last_commit_sent]
                self._leave_to_recovery(others, self._last_commit_sent, exc, "its COMMIT was cut")
            elif self.manager.log.holds(self.xid):  # the record may reach the disk: never roll back now
                self._settle_appended(exc)
            else:
                self._roll_back_all(Event.ROLLBACK)
        elif self.state is State.COMMITTING:
            self._hand_to_retry(self.branches, Event.PENDING, exc)
        elif self.state is State.ROLLING_BACK:
            for branch in self.branches:
                branch.resource.detach(branch.xid)
            self._fire(Event.ROLLED_BACK)

    def _settle_appended(self, cause: BaseException) -> None:
        """The COMMIT record is appended but was not known durable when the path was cut. Flush it before
        saying "committed": left to the retry's flush, a crash in between would lose a decision already
        reported. A log that cannot write it leaves the outcome to recovery after a restart."""
        decisions = self.manager.log
        try:
            decisions.flush()
        except BaseException as exc:  # cut again: what reached the disk is the log's to say
            cause = exc
        if not decisions.failed and self.xid in decisions.open:
            self._hand_to_retry(self.branches, Event.PENDING, cause)
            return
        self._give_up_knowing(cause, "its commit decision was appended to the log but could not be made durable",
                              leave=self.branches)

    def _hand_to_retry(self, branches: list[Branch], event: Event, cause: BaseException) -> None:
        self.pending = [b.name for b in branches]
        log.critical("transaction %s is decided (commit) but its commit path was cut (%r); the background retry "
                     "makes the decision durable and commits %s", self.xid, cause, ", ".join(self.pending))
        self._fire(event)
        self._handed_over = True
        self.manager.retry_phase_two(self.xid, branches, end=self._end, durable_first=self._last is None)

    def _drop_idle(self, branches: list[Branch]) -> list[Branch]:
        """End the branches that did no work (read-only, no round trip); return the others."""
        busy = []
        for branch in branches:
            if branch.resource.may_have_written(branch.xid):
                busy.append(branch)
            else:
                try:
                    branch.resource.prepare(branch.xid)
                except BaseException as exc:
                    self._abort(exc, f"ending idle branch {branch.name} failed")
        return busy

    def _commit_one_phase(self, branches: list[Branch]) -> None:
        if branches:
            branch = branches[0]
            try:
                branch.resource.commit(branch.xid, one_phase=True)
                failpoint("after_one_phase_commit")
            except ResourceUnavailableError as exc:  # the COMMIT may have landed before the connection broke
                self._give_up_knowing(exc, f"the connection to {branch.name} broke during its one-phase commit, "
                                           "so the database alone knows whether it committed", leave=branches)
            except ResourceError as exc:  # the database answered: it did not commit
                self._abort(exc, "the one-phase commit failed")
            except BaseException as exc:  # cut while the COMMIT may have been on its way or done: unknown
                self._give_up_knowing(exc, f"the one-phase commit of {branch.name} was interrupted, so the "
                                           "database alone knows whether it committed", leave=branches)
        self._fire(Event.COMMITTED)

    def _phase_one(self, branches: list[Branch], last: Branch | None = None) -> list[Branch]:
        """Ask every branch for its vote, all at once; return the prepared ones. With a ``last`` resource
        (LLR), that branch is not asked: its decision row is written instead, alongside the others' prepares
        (rolled back with the branch if need be), and it is not among those returned."""
        failpoint("before_prepare")
        others = [b for b in branches if b is not last]

        def vote(index: int, branch: Branch) -> Vote | None:
            if branch is last:
                last.resource.write_decision(last.xid, self.xid, [b.name for b in others])
                return None
            result = branch.resource.prepare(branch.xid)
            failpoint(f"after_prepare_{index}")
            return result

        asked = others if last is None else [*others, last]
        self.manager.log.voting(+1)
        try:
            results = self.manager.fan_out(vote, asked)
        finally:
            self.manager.log.voting(-1)
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            self._abort(failure, "a branch voted no")
        return [b for b, result in zip(asked, results) if result is Vote.YES]

    def _commit_last_resource(self, prepared: list[Branch], last: Branch) -> None:
        """Logging Last Resource (see the module docstring): the last branch's one-phase COMMIT, carrying
        the decision row, is the decision; ``prepared`` are the other branches that voted yes."""
        self._fire(Event.DECIDE)
        failpoint("llr_before_last_commit")
        self._last_commit_sent = last  # from here an interrupt cannot know whether the COMMIT landed
        try:
            last.resource.commit(last.xid, one_phase=True)
        except ResourceUnavailableError as exc:
            self._leave_to_recovery(prepared, last, exc, "the connection broke during its COMMIT")
        except ResourceError as exc:  # the database answered: the last branch did not commit
            self._abort(exc, f"the last resource {last.name} refused to commit")
        except BaseException as exc:
            self._leave_to_recovery(prepared, last, exc, "its COMMIT was interrupted")
        self._fire(Event.DECIDED)
        self._last = last
        failpoint("llr_after_last_commit")
        self._phase_two(prepared)

    def _leave_to_recovery(self, prepared: list[Branch], last: Branch, cause: BaseException, what: str) -> None:
        self._give_up_knowing(cause, f"the last resource {last.name} holds the decision and {what}, so only "
                                     "its decision table can tell whether the transaction committed",
                              leave=[*prepared, last])

    def _end(self) -> None:
        """Every branch committed: the decision can be forgotten (END record, or the LLR row in a batch)."""
        if self._last is not None:
            self.manager.forget_decision(self._last.resource, self.xid)
        else:
            self.manager.log.log_end(self.xid)

    def _commit_sole_prepared(self, prepared: list[Branch]) -> None:
        """Every other branch was read-only: the one prepared branch decides alone, nothing is logged.

        If its commit fails the transaction is still decided "commit" (nobody can disagree): the decision is
        logged then, and the commit finished like any pending phase 2 (a lost reply is thus harmless). A
        resource whose commits are not safe without a logged decision (MariaDB with the binary log) gets the
        decision logged first, like any two-phase commit.
        """
        if all(b.resource.one_phase_safe for b in prepared):
            try:
                for branch in prepared:
                    branch.resource.commit(branch.xid)
            except BaseException:
                pass  # still decided "commit": logged below, and finished like any pending phase 2
            else:
                self._fire(Event.COMMITTED)
                return
        self._decide(prepared)
        self._phase_two(prepared)

    def _decide(self, prepared: list[Branch]) -> None:
        if self.manager.lease_settings is not None:  # a standby on another host could not read this decision
            self._abort(ConfigurationError("the node runs with a [lease], so a commit decision must be a row in "
                                           "one of its SQL databases, and no branch can carry it (MariaDB with "
                                           "the binary log cannot be the last resource)"),
                        "its decision would go to the file log")
        self._fire(Event.DECIDE)  # an interrupt from here on asks the log whether the record was appended
        try:
            self.manager.log.log_commit(self.xid, [b.name for b in prepared])
        except LogError as exc:
            # The record may or may not be on disk: rolling back could contradict it. Leave every branch
            # prepared; recovery after a restart reads the log and ends them all the same way.
            self._give_up_knowing(exc, "the commit decision could not be logged", leave=prepared)
        self._fire(Event.DECIDED)
        failpoint("after_decision_forced")

    def _give_up_knowing(self, cause: BaseException, why: str, leave: list[Branch]) -> None:
        """The outcome is unknown: let go of ``leave`` (their connections dropped: an active branch dies with
        it, a prepared one waits for recovery) and raise OutcomeUnknownError, or re-raise an interrupt."""
        for branch in leave:
            branch.resource.detach(branch.xid)
        self._fire(Event.UNKNOWN)
        log.critical("transaction %s: outcome unknown: %s (%r); recovery will resolve it", self.xid, why, cause)
        if not isinstance(cause, Exception):
            raise cause  # an interrupt stays an interrupt; tx.outcome says UNKNOWN
        raise OutcomeUnknownError(
            f"transaction {self.xid}: outcome unknown: {why}: {cause}; every branch is left to recovery "
            "(`qtp recover`), which ends them all the same way; check the outcome before retrying"
        ) from cause

    def _phase_two(self, prepared: list[Branch]) -> None:
        def commit(index: int, branch: Branch) -> None:
            branch.resource.commit(branch.xid)
            failpoint(f"after_commit_{index}")

        results = self.manager.fan_out(commit, prepared)
        failed = [(b, r) for b, r in zip(prepared, results) if isinstance(r, BaseException)]
        if failed:
            for branch, exc in failed:
                log.critical("transaction %s is committed but branch %s could not commit yet (%s); retrying in "
                             "the background, and recovery will finish it if retries cannot", self.xid,
                             branch.name, exc)
            self._hand_to_retry([b for b, _ in failed], Event.PENDING, failed[0][1])
            _reraise_interrupt(r for _, r in failed)
            return
        failpoint("before_end_record")
        self._end()
        self._fire(Event.COMMITTED)

    def rollback(self) -> None:
        """Roll every branch back. Branches that cannot be reached stay prepared or active in the database;
        the database drops active ones with the connection, and recovery rolls back prepared ones."""
        if self.state is State.ROLLED_BACK:
            return
        try:
            self._close_sessions()
            self._roll_back_all(Event.ROLLBACK)
        except BaseException:
            if self.state is State.ROLLING_BACK:
                self._settle_after(None)  # type: ignore[arg-type]
            raise
        finally:
            self._done()

    def _roll_back_all(self, event: Event) -> None:
        self._fire(event)

        def rollback(index: int, branch: Branch) -> None:
            branch.resource.rollback(branch.xid)

        branches = self.branches
        results = self.manager.fan_out(rollback, branches)
        for branch, result in zip(branches, results):
            if isinstance(result, BaseException):  # drop the connection: an active branch dies with it
                branch.resource.detach(branch.xid)
                log.warning("rollback of %s failed (%s); recovery will roll it back if it was prepared", branch.xid,
                            result)
        self._fire(Event.ROLLED_BACK)
        _reraise_interrupt(results)

    def _abort(self, cause: BaseException, why: str) -> None:
        self._roll_back_all(Event.ROLLBACK)
        if not isinstance(cause, Exception):
            raise cause  # an interrupt stays an interrupt; tx.outcome says ROLLED_BACK
        raise RollbackError(f"transaction {self.xid} rolled back: {why}: {cause}") from cause

    def _close_sessions(self) -> None:
        for session, _ in self._sessions.values():
            session.close()
        self._sessions.clear()


def _reraise_interrupt(results: Any) -> None:
    """An interrupt (KeyboardInterrupt, SystemExit) caught while branches were handled together goes on up
    once the transaction has its outcome: it is never swallowed."""
    interrupt = next((r for r in results if isinstance(r, BaseException) and not isinstance(r, Exception)), None)
    if interrupt is not None:
        raise interrupt


def run_each(fn: Callable[[int, Any], Any], items: list[Any]) -> list[Any]:
    """Apply ``fn(index, item)`` to each item in turn, collecting results or exceptions (no threads)."""
    results: list[Any] = []
    for index, item in enumerate(items):
        try:
            results.append(fn(index, item))
        except BaseException as exc:  # collected and handled by the caller
            results.append(exc)
    return results
