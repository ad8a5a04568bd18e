"""The recipient's side of coupled messaging: originals stored as coupling rows, the handlers that process
them (shared, compensatable, queued), the sender's decisions, and the coupling worker.

Every row moves only by the table ``_states.RECIPIENT``, through a compare-and-set (``_log.move``) made
under the row's lock in the same transaction as the effect it guards. The rules that keep a shared
recipient's work exactly once (issue 27: a worker acting on an old read rolled back a subordinate that was
already prepared and voted, and the Commit that followed was reported as done):

1. The worker claims a row in memory, *then* reads it: it always acts on the row as it is, and only one
   thread of the node acts on one row at a time.
2. Subordinate work is rolled back by the recipient only while it is unvoted: under the row's lock, with the
   row still ``preparing`` (or ``ordered``) *and still naming that subordinate*. The vote is the move
   ``preparing -> prepared`` made under the same lock and guard, so the two exclude each other.
3. Voted work is ended only after the sender's decision is recorded in the row (``committing`` /
   ``rolling-back``, written with the dequeue of the Commit or Abort); from then on the only action on that
   subordinate is the recorded one. A subordinate the database no longer knows while the row says
   ``committing`` was therefore committed by an earlier attempt of the same step.
4. Only a business refusal (the handler raised something that is not transient, see
   ``qtp.errors.transient``) counts toward ``max_attempts``: an outage of a database or of the network
   delays an exchange and never ends it.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from qtp.coordinator.failpoints import failpoint
from qtp.coupled import _log as log_
from qtp.coupled import _states as states
from qtp.coupled._site import Site
from qtp.coupled._wire import COUPLINGS, Control, decode
from qtp.errors import ConfigurationError, CoupledWireError, MessageRefusedError, MessagingError, transient
from qtp.xa import Xid

log = logging.getLogger("qtp.coupled")

SUB_MARK = "~c"
ASK_EVERY = 5.0  # seconds before the first Status question about one overdue coupling is repeated
ASK_MAX = 300.0  # ... doubling up to this
HANDLER_GRACE = 10.0  # seconds after start in which a missing handler is awaited, not refused


class _NoHandlerYet(MessagingError):
    """The application has not registered the handler yet (just after start): try again, uncounted."""

    retryable = True


@dataclass(frozen=True)
class CoupledMessage:
    """What a coupled handler (and a compensator) receives."""

    id: str                    # the coupling id: one original to one recipient
    action: str
    payload: bytes             # the original's payload; for a compensator, the compensation
    coordinator: str           # the sender's node
    transaction: str           # the sender's transaction
    coupling: str
    original: bytes | None = None  # for a compensator: the original's payload


class _Bounded:
    """A handler's view of its transaction: every connection it takes waits at most ``seconds`` for a lock
    (``[limits] coupled_lock_timeout``), so that locks held by another peer's prepared work cannot stall the
    coupling worker's threads; the attempt then fails as a transient conflict and is tried again later."""

    def __init__(self, tx: Any, seconds: float):
        self._tx = tx
        self._seconds = seconds
        self._bounded: set[str] = set()

    def connection(self, name: str) -> Any:
        conn = self._tx.connection(name)
        if name not in self._bounded:
            self._bounded.add(name)
            dialect = conn.dialect.name
            if dialect == "postgresql":
                conn.exec_driver_sql(f"SET LOCAL lock_timeout = '{int(self._seconds * 1000)}ms'")
            elif dialect in ("mysql", "mariadb"):
                conn.exec_driver_sql(f"SET SESSION innodb_lock_wait_timeout = {max(1, math.ceil(self._seconds))}")
        return conn

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tx, name)


def control_of(message: Any) -> Control:
    """The control message a WS-RM message carries; a malformed one is refused for good (a dead letter)."""
    try:
        return decode(message.action, message.payload)
    except CoupledWireError as exc:
        raise MessageRefusedError(f"malformed coupled message {message.message_id}: {exc}") from None


def _check_names(control: Control) -> None:
    """A coupling id names its sender: ``<coordinator>/<...>:<n>``, and an original's transaction is the id's
    own. With the reply channel, which must lead to the authenticated peer that sent it, this keeps a peer
    from taking another sender's coupling id (one it saw on the wire, with its token) before the original
    arrives: MessageRefusedError, a dead letter at once."""
    coordinator = control.coordinator or ""
    names = bool(coordinator) and control.id.startswith(coordinator + "/")
    if control.kind == "Message":
        names = names and control.id.startswith(f"{control.transaction}:")
    if not names:
        raise MessageRefusedError(f"coupled {control.kind} {control.id!r} does not name its sender "
                                  f"{coordinator!r} (ids are <sender node>/<transaction>:<n>)")


class Recipient:
    def __init__(self, site: Site, workers: int):
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
            raise ConfigurationError(f"workers must be a positive number of threads, got {workers!r}")
        self.site = site
        self.manager = site.manager
        self.handlers: dict[str, tuple[Callable[..., Any], str]] = {}
        self.compensators: dict[str, Callable[..., Any]] = {}
        self.wake = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="qtp-coupled-worker")
        self._lock = threading.Lock()
        self._cap_lock = threading.Lock()
        self._claimed: set[str] = set()           # rows a worker thread acts on now (rule 1)
        self._later: dict[str, tuple[float, int]] = {}  # id -> (not before, transient failures in a row)
        self._asked: dict[str, tuple[float, float]] = {}
        self.started = time.monotonic()  # Coupled.start() sets it again  # id -> (ask again at, interval)

    # ------------------------------------------------------------------ registration

    def handler(self, action: str, coupling: str) -> Callable[[Callable[..., Any]], Any]:
        if coupling not in COUPLINGS:
            raise ConfigurationError(f"coupling is one of {', '.join(COUPLINGS)}, not {coupling!r}")

        def register(fn: Callable[..., Any]) -> Callable[..., Any]:
            if action in self.handlers:
                raise ConfigurationError(f"a coupled handler for {action!r} is already registered")
            self.handlers[action] = (fn, coupling)
            return fn
        return register

    def compensator(self, action: str) -> Callable[[Callable[..., Any]], Any]:
        def register(fn: Callable[..., Any]) -> Callable[..., Any]:
            self.compensators[action] = fn
            return fn
        return register

    def _fn(self, action: str) -> Callable[..., Any] | None:
        registered = self.handlers.get(action)
        return registered[0] if registered else self.site.node.handlers.get(action)

    # ------------------------------------------------------------------ in the invoker's transaction

    def on_message(self, tx: Any, message: Any) -> None:
        """An original arrived: store it (or refuse it) and, for a census, say "delivered"."""
        control = control_of(message)
        owner = self.site.owner(message)
        conn = self.site.conn(tx)
        _check_names(control)
        self.site.reply_channel(control.coordinator, owner)  # refused now if it could never be answered
        if log_.received(conn, control.id, lock=True) is not None:
            return  # a copy, or a decision that came first and left a tombstone: never processed again
        registered = self.handlers.get(control.action or "")
        coupling = registered[1] if registered else "queued"
        refusal = None
        if registered is None and control.action not in self.site.node.handlers:
            self._not_yet(control.action)
            refusal = f"no handler for action {control.action}"
        elif control.require is not None and control.require != coupling:
            refusal = f"the sender requires a {control.require} coupling; the handler here is {coupling}"
        now = time.time()
        state = states.next_state(states.RECIPIENT, None, "arrive")
        if refusal is not None:
            state = states.next_state(states.RECIPIENT, state, "refuse")
        log_.record_received(conn, state, id=control.id, coordinator=control.coordinator or "", owner=owner,
                             token=control.token, gtrid=control.transaction or "", action=control.action or "",
                             coupling=coupling, payload=control.body or b"", error=refusal,
                             deadline=min(control.deadline or now, now + self.site.limits.max_coupled_deadline))
        if refusal is not None:
            self._notify(tx, control.coordinator, owner, control.id, control.token, "failed", coupling, refusal)
        elif control.census:
            self._notify(tx, control.coordinator, owner, control.id, control.token, "delivered", coupling)
        tx.on_commit(self.wake.set)

    def _not_yet(self, action: str | None) -> None:
        """Just after start the application may still be registering its handlers (``Coupled(node)`` then
        ``@coupled.handler``), while stored originals are already being delivered: for ``HANDLER_GRACE``
        seconds a missing handler is an outage (tried again, uncounted), not a refusal. Its coupling is
        read when the original is stored, so it must not be guessed."""
        if time.monotonic() - self.started < HANDLER_GRACE:
            raise _NoHandlerYet(f"no handler for action {action} yet, {HANDLER_GRACE:g} s after start: waiting "
                                "for the application to register it")

    def on_decision(self, tx: Any, message: Any) -> None:
        """Commit or Abort from the sender: recorded in the row; the worker acts on it."""
        control = control_of(message)
        event = "commit" if control.kind == "Commit" else "abort"
        owner = self.site.owner(message)
        conn = self.site.conn(tx)
        row = log_.received(conn, control.id, lock=True)
        if row is None:  # never stored here (refused, or a dead letter): answered, so the sender's log closes
            _check_names(control)
            self.site.reply_channel(control.coordinator, owner)
            state = states.next_state(states.RECIPIENT, None, event)
            now = time.time()
            log_.record_received(conn, state, id=control.id, coordinator=control.coordinator or "", owner=owner,
                                 token=control.token, gtrid="", action="", coupling="queued", payload=b"",
                                 deadline=now, error="the original never arrived here")
            log.warning("coupled %s for %s, which never arrived here: answered %s", control.kind, control.id, state)
            self._notify(tx, control.coordinator, owner, control.id, control.token, states.REPORT[state], "queued",
                         "the original never arrived here")
            return
        if not self._same_sender(row, owner, control.token):
            return
        if not states.allowed(states.RECIPIENT, row.state, event):
            log.warning("coupled %s for %s in state %s: not allowed, ignored (the sender contradicts itself)",
                        control.kind, row.id, row.state)
            return
        target = states.next_state(states.RECIPIENT, row.state, event)
        if target != row.state:
            # the handler's refusals so far still count once the original is ordered; a compensator or the
            # resolution of a subordinate starts with none
            values: dict[str, Any] = {"next_at": 0.0} if target == states.ORDERED else {
                "attempts": 0, "next_at": 0.0, "error": None}
            if target == states.COMPENSATING:
                values["compensation"] = control.body if control.body is not None else row.compensation
            log_.move(conn, row.id, row.state, event, **values)
            tx.on_commit(self.wake.set)
        if target in states.FINAL:  # a final state is reported, again if the decision came again
            self._notify(tx, row.coordinator, row.owner, row.id, row.token, states.REPORT[target], row.coupling,
                         row.error if target == "failed" else None)

    def _same_sender(self, row: Any, owner: str | None, token: str) -> bool:
        """A decision is taken only from the sender of the original: its identity and its token."""
        if row.owner != owner or (row.token is not None and row.token != token):
            log.warning("a coupled decision about %s from %s that is not its sender's (%s)%s: refused", row.id,
                        owner or "(anonymous)", row.owner or "(anonymous)",
                        "" if row.owner != owner else ": wrong token")
            return False
        return True

    def _notify(self, tx: Any, coordinator: str | None, owner: str | None, coupling_id: str, token: str | None,
                state: str, coupling: str, reason: str | None = None) -> None:
        channel = self.site.reply_channel(coordinator, owner)
        self.site.send(tx, channel, Control("Notify", coupling_id, state=state, coupling=coupling, reason=reason,
                                            token=token or ""))

    # ------------------------------------------------------------------ the worker

    def work_once(self) -> bool:
        """Hand the rows that have work to the pool (each to one thread at a time); True if any was new."""
        now = time.time()
        with self.site.store.local() as conn:
            ids = log_.work(conn, now, limit=64)
        fresh = 0
        for coupling_id in ids:
            with self._lock:
                if coupling_id in self._claimed or self._later.get(coupling_id, (0.0, 0))[0] > now:
                    continue
                self._claimed.add(coupling_id)
            fresh += 1
            self._pool.submit(self._step, coupling_id)
        return fresh > 0

    def stop(self) -> None:
        self._pool.shutdown(wait=True)

    def _step(self, coupling_id: str) -> None:
        """One step for one claimed row, on a fresh read of it."""
        row = None
        try:
            if self.site.stopping.is_set():
                return
            with self.site.store.local() as conn:
                row = log_.received(conn, coupling_id)
            if row is None or row.next_at > time.time():
                return
            if row.state == states.RECEIVED and row.deadline > time.time():
                if row.coupling == "shared":
                    self._prepare(row)
                else:
                    self._process(row)
            elif row.state == states.PREPARING:   # claimed, so no attempt of this node is in flight: unvoted
                self._undo(row, row.sub_gtrid, None, None)
            elif row.state == states.ORDERED:
                if row.sub_gtrid and not self._clear_unvoted(row):
                    return
                self._process(row)
            elif row.state in (states.COMMITTING, states.ROLLING_BACK):
                self._finish(row)
            elif row.state == states.COMPENSATING:
                self._compensate(row)
            with self._lock:
                self._later.pop(coupling_id, None)
        except Exception as exc:
            self._postpone(coupling_id, exc)
        finally:
            with self._lock:
                self._claimed.discard(coupling_id)
            self.wake.set()

    def _postpone(self, coupling_id: str, exc: BaseException) -> None:
        """A step that failed for a cause outside the handler (a database down): try again after a backoff,
        in memory (the database may not take a write now)."""
        with self._lock:
            count = self._later.get(coupling_id, (0.0, 0))[1] + 1
            delay = self.site.limits.backoff(count)
            self._later[coupling_id] = (time.time() + delay, count)
        log.warning("coupled %s: step failed (%s: %s); again in %.1f s", coupling_id, type(exc).__name__, exc, delay)

    def _message(self, row: Any, compensation: bool = False) -> CoupledMessage:
        payload = row.compensation if compensation and row.compensation is not None else row.payload
        return CoupledMessage(row.id, row.action, payload, row.coordinator, row.gtrid, row.coupling,
                              row.payload if compensation else None)

    def _bounded(self, tx: Any) -> _Bounded:
        return _Bounded(tx, self.site.limits.coupled_lock_timeout)

    def _sub_gtrid(self) -> str:
        return f"{self.site.node_id}{SUB_MARK}/{os.urandom(15).hex()}"

    def _prepare(self, row: Any) -> None:
        """Shared: the handler's work prepared as a subordinate of the sender's transaction, then the vote."""
        sub = self._sub_gtrid()
        cap = self.site.limits.max_prepared_per_peer
        with self._cap_lock, self.site.store.local() as conn:  # counted and taken at once: the cap holds
            full = log_.held(conn, row.owner) >= cap
            # recorded first: whatever happens next, the subordinate can be found
            if not full and log_.move(conn, row.id, states.RECEIVED, "attempt", sub_gtrid=sub, branches=None) is None:
                return
        if full:
            self._refuse(row, states.RECEIVED, f"this recipient holds {cap} subordinate transactions for peer "
                         f"{row.owner or '(anonymous)'} already ([limits] max_prepared_per_peer)")
            return
        fn = self._fn(row.action)
        branches: list[str] | None = None
        try:
            tx = self.manager.begin(gtrid=sub.encode())
            try:
                if fn is None:
                    self._not_yet(row.action)
                    raise MessageRefusedError(f"no handler for action {row.action!r}")
                fn(self._bounded(tx), self._message(row))
                branches = tx.prepare_subordinate()
                failpoint("coupled_after_prepare")  # prepared, not voted
            except BaseException:
                if tx.outcome is None:
                    tx.rollback()
                raise
        except Exception as exc:
            self._undo(row, sub, branches, exc)
            return
        try:
            with self.manager.transaction() as vote:
                conn = self.site.conn(vote)
                current = log_.received(conn, row.id, lock=True)
                voted = current is not None and current.state == states.PREPARING and current.sub_gtrid == sub
                if voted:
                    log_.move(conn, row.id, states.PREPARING, "vote", sub=sub, branches=",".join(branches),
                              attempts=0, error=None)
                    self._notify(vote, row.coordinator, row.owner, row.id, row.token, "prepared", "shared")
                else:
                    vote.rollback()
        except Exception:
            self._undo(row, sub, branches, None)  # unvoted unless the vote committed: the guard tells
            raise
        if not voted:  # the decision came first (ordered / rolling-back): this work was never voted
            self._resolve(sub, branches, commit=False)

    def _undo(self, row: Any, sub: str | None, branches: list[str] | None, exc: BaseException | None) -> None:
        """Roll back unvoted subordinate work ``sub`` (rule 2), and count ``exc`` if it was a refusal."""
        now = time.time()
        refusal, attempts, next_at = self._judge(row, exc, now)
        with self.manager.transaction() as tx:
            conn = self.site.conn(tx)
            current = log_.received(conn, row.id, lock=True)
            if current is None or current.state != states.PREPARING or current.sub_gtrid != sub:
                tx.rollback()
                return
            self._resolve(sub, branches, commit=False)
            error = None if exc is None else _describe(exc)
            if refusal:
                log_.move(conn, row.id, states.PREPARING, "refuse", sub=sub, sub_gtrid=None, attempts=attempts,
                          error=error)
                self._notify(tx, row.coordinator, row.owner, row.id, row.token, "failed", row.coupling,
                             f"failed {attempts} time(s); kept at the recipient")
            else:
                log_.move(conn, row.id, states.PREPARING, "undo", sub=sub, sub_gtrid=None, attempts=attempts,
                          next_at=next_at, error=error)
        if exc is not None:
            self._log_failure(row, exc, attempts, refusal, next_at - now)

    def _clear_unvoted(self, row: Any) -> bool:
        """``ordered`` with a subordinate left by an attempt that lost the race to the Commit: roll it back."""
        with self.site.store.local() as conn:
            current = log_.received(conn, row.id, lock=True)
            if current is None or current.state != states.ORDERED or current.sub_gtrid != row.sub_gtrid:
                return False
            self._resolve(row.sub_gtrid, None, commit=False)
            log_.move(conn, row.id, states.ORDERED, "commit", sub=row.sub_gtrid, sub_gtrid=None)
        return True

    def _process(self, row: Any) -> None:
        """Compensatable or queued (``received``), or anything the sender committed first (``ordered``): the
        handler commits on its own, with the row's move and the report."""
        fn = self._fn(row.action)
        try:
            with self.manager.transaction() as tx:
                conn = self.site.conn(tx)
                current = log_.received(conn, row.id, lock=True)
                if current is None or current.state != row.state or current.sub_gtrid is not None:
                    tx.rollback()
                    return
                target = log_.move(conn, row.id, row.state, "process", error=None)
                if fn is None:
                    self._not_yet(row.action)
                    raise MessageRefusedError(f"no handler for action {row.action!r}")
                fn(self._bounded(tx), self._message(row))
                self._notify(tx, row.coordinator, row.owner, row.id, row.token, states.REPORT[target], row.coupling)
        except Exception as exc:
            self._failed(row, exc)

    def _finish(self, row: Any) -> None:
        """``committing`` / ``rolling-back``: end the subordinate as recorded (rule 3), then report."""
        commit = row.state == states.COMMITTING
        branches = [b for b in (row.branches or "").split(",") if b] or None
        self._resolve(row.sub_gtrid, branches, commit=commit)
        with self.manager.transaction() as tx:
            conn = self.site.conn(tx)
            target = log_.move(conn, row.id, row.state, "resolved")
            if target is None:
                tx.rollback()
                return
            self._notify(tx, row.coordinator, row.owner, row.id, row.token, states.REPORT[target], row.coupling)

    def _compensate(self, row: Any) -> None:
        fn = self.compensators.get(row.action)
        try:
            with self.manager.transaction() as tx:
                conn = self.site.conn(tx)
                target = log_.move(conn, row.id, states.COMPENSATING, "compensate", error=None)
                if target is None:
                    tx.rollback()
                    return
                if fn is None:
                    self._not_yet(row.action)
                    raise MessageRefusedError(f"no compensator for action {row.action!r} (coupling {row.coupling}): "
                                              "its effect stays")
                fn(self._bounded(tx), self._message(row, compensation=True))
                self._notify(tx, row.coordinator, row.owner, row.id, row.token, "compensated", row.coupling)
        except Exception as exc:
            self._failed(row, exc)

    def _resolve(self, sub: str | None, branches: list[str] | None, commit: bool) -> None:
        """Commit or roll back subordinate ``sub`` on ``branches`` (None: every resource), by xid (idempotent)."""
        if not sub:
            return
        for name in branches if branches is not None else list(self.manager.resources):
            resource = self.manager.resource(name)
            xid = Xid.of(sub.encode(), name)
            if commit:
                resource.commit(xid)
            else:
                resource.rollback(xid)

    # ------------------------------------------------------------------ failures

    def _judge(self, row: Any, exc: BaseException | None, now: float) -> tuple[bool, int, float]:
        """(refused for good, attempts, next attempt at) after ``exc``; only refusals count (rule 4)."""
        if exc is None or transient(exc):
            count = self._later.get(row.id, (0.0, 0))[1] + (exc is not None)
            return False, row.attempts, now + (self.site.limits.backoff(count) if exc is not None else 0.0)
        attempts = row.attempts + 1
        final = attempts >= self.site.limits.max_attempts or isinstance(exc, MessageRefusedError)
        return final, attempts, now + self.site.limits.backoff(attempts)

    def _failed(self, row: Any, exc: BaseException) -> None:
        """The handler or compensator of ``row`` failed in its own transaction (rolled back)."""
        now = time.time()
        if transient(exc):
            raise exc  # the step is postponed in memory; nothing is counted
        refusal, attempts, next_at = self._judge(row, exc, now)
        if not refusal:
            with self.site.store.local() as conn:
                log_.note_attempt(conn, row.id, row.state, attempts, next_at, _describe(exc))
        elif not self._refuse(row, row.state, _describe(exc), attempts):
            return  # the row moved meanwhile (a decision came first): nothing was refused
        self._log_failure(row, exc, attempts, refusal, next_at - now)

    def _refuse(self, row: Any, state: str, error: str, attempts: int | None = None) -> bool:
        """Refuse the original (or compensation) for good, if the row is still in ``state``; whether it was."""
        with self.manager.transaction() as tx:
            conn = self.site.conn(tx)
            target = log_.move(conn, row.id, state, "refuse", error=error,
                               attempts=row.attempts if attempts is None else attempts)
            if target is None:
                tx.rollback()
                return False
            reason = error if attempts is None else f"failed {attempts} time(s); kept at the recipient"
            self._notify(tx, row.coordinator, row.owner, row.id, row.token, states.REPORT[target], row.coupling,
                         reason)
        return True

    def _log_failure(self, row: Any, exc: BaseException, attempts: int, final: bool, delay: float) -> None:
        if final:
            log.error("coupled %s (%s) is refused after %d attempt(s): %s", row.id, row.action, attempts,
                      _describe(exc))
        elif transient(exc):
            log.warning("coupled %s (%s): transient failure, not counted; again in %.1f s: %s", row.id, row.action,
                        delay, _describe(exc))
        else:
            log.warning("coupled %s (%s): attempt %d of %d failed, next in %.1f s: %s", row.id, row.action, attempts,
                        self.site.limits.max_attempts, delay, _describe(exc))

    # ------------------------------------------------------------------ housekeeping

    def ask_overdue(self) -> None:
        """Originals whose decision is overdue (prepared, or undecided past the deadline): ask the sender for
        it (Status), after ``ASK_EVERY`` seconds, then doubling up to ``ASK_MAX`` while it does not answer (each
        question is a reliable message: a sender down for long must not find a pile of them); the answer is
        the Commit or Abort again."""
        now = time.time()
        with self.site.store.local() as conn:
            rows = log_.waiting_past_deadline(conn, now)
        waiting = {r.id for r in rows}
        for known in [k for k in self._asked if k not in waiting]:
            del self._asked[known]
        for row in rows:
            due, interval = self._asked.get(row.id, (0.0, ASK_EVERY / 2))
            if now < due:
                continue
            interval = min(interval * 2, ASK_MAX)
            self._asked[row.id] = (now + interval, interval)
            with self.manager.transaction() as tx:
                channel = self.site.reply_channel(row.coordinator, row.owner)
                self.site.send(tx, channel, Control("Status", row.id, token=row.token or ""))
            log.info("coupled %s is undecided past its deadline: asked %s for the decision", row.id, row.coordinator)

    def prune(self, before: float) -> int:
        with self.site.store.local() as conn:
            return log_.prune_received(conn, before)


def _describe(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()[:2000]
