"""The transaction manager: resources by name, the decision log, the current transaction (a context variable:
one per thread, and one per asyncio task).

Recovery is not the coordinator's business: the manager is handed a recovery *scheduler* (anything with
``start()``, ``run_once(dry_run=)`` and ``stop()``), made by ``recovery_factory(manager)``. ``qtp.recovery``
registers its ``RecoveryService`` as the default factory when it is imported (``import qtp`` does that), so
the dependency runs one way: recovery knows the coordinator, the coordinator does not know recovery.

Messaging attaches itself the same way: ``qtp.wsrm.runtime`` registers, on import, an *attachment* for
the ``messaging`` part of a configuration (``register_attachment``); ``from_config`` hands that part to it,
and the node it builds sets ``manager.node``, which ``Transaction.send`` uses. The coordinator never
imports ``qtp.wsrm``.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import os
import threading
import time
import concurrent.futures
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol

import tenacity
from sqlalchemy.engine import Engine

from qtp.config import LeaseSettings
from qtp.coordinator._lease import Lease, lease_home, limit_idle
from qtp.coordinator._log import DecisionLog, log_present, read_lost_mark, write_lost_mark
from qtp.coordinator._transaction import Branch, State, Transaction, run_each
from qtp.errors import (
    ConfigurationError,
    FencedError,
    LogError,
    NestedTransactionError,
    NoTransactionError,
    QtpError,
    TransactionTimeoutError,
)
from qtp.xa import Resource, resource_for
from qtp.xa._xid import MAX_NODE_ID, validate_name

log = logging.getLogger("qtp.coordinator")

DEFAULT_LOG_DIR = "recovery_logs"
DEFAULT_TIMEOUT_S = 60.0
DEFAULT_RECOVERY_INTERVAL_S = 60.0
FORGET_BATCH = 256  # LLR decision rows deleted in one statement
FORGET_INTERVAL_S = 1.0


# What builds the rest of a node from its configuration: name -> fn(manager, config), registered by the
# layers above the coordinator when they are imported (``qtp.wsrm.runtime`` registers "messaging").
_ATTACHMENTS: dict[str, Callable[["TransactionManager", Any], None]] = {}


def register_attachment(name: str, attach: Callable[["TransactionManager", Any], None]) -> None:
    """``attach(manager, config)`` is called by ``TransactionManager.from_config`` after recovery started."""
    _ATTACHMENTS[name] = attach


class TransactionManager:
    """Runs global transactions over named resources with a durable decision log.

    ``log_dir`` is the root of decision logs; this node's log lives in ``<log_dir>/<node_id>/`` and is
    locked while the manager is open. ``llr``: commit the decision in the last SQL branch's own local
    transaction instead of forcing the file log (Logging Last Resource, see ``qtp.coordinator._transaction``).
    """

    def __init__(self, node_id: str, log_dir: str | Path = DEFAULT_LOG_DIR, timeout: float = DEFAULT_TIMEOUT_S,
                 phase_two_retry_s: float = 30.0, max_workers: int = 32,
                 recovery_interval: float | None = DEFAULT_RECOVERY_INTERVAL_S, llr: bool = True,
                 recovery_factory: Callable[["TransactionManager"], RecoveryScheduler] | None = None,
                 lease: LeaseSettings | None = None):
        self.node_id = validate_name("node id", node_id, MAX_NODE_ID)
        self.gtrid_prefix = f"{node_id}/".encode()  # a transaction's gtrid: this + 32 random hex digits
        if not math.isfinite(timeout) or timeout <= 0:
            raise ConfigurationError(f"transaction timeout must be positive, got {timeout!r}")
        self.log_dir = Path(log_dir) / node_id
        self.timeout = float(timeout)
        self.phase_two_retry_s = phase_two_retry_s
        # With a lease every decision is a row in a database (qtp.coordinator._lease): a new, empty log
        # folder (a replica's first start on its host) loses nothing, and must not quarantine the branches
        # another replica left in doubt.
        if lease is None and read_lost_mark(self.log_dir) is None and not log_present(self.log_dir):
            # Durable before the log creates its first segment: see read_lost_mark.
            write_lost_mark(self.log_dir, {"created_at": time.time(), "vetted": []})
        self.log = DecisionLog(self.log_dir)
        self.recovery_interval = recovery_interval
        self._recovery: RecoveryScheduler | None = None  # made and started by start_recovery()
        self._recovery_factory = recovery_factory
        self._resources: dict[str, Resource] = {}
        self._current: contextvars.ContextVar[Transaction | None] = contextvars.ContextVar(
            f"qtp_current_{node_id}", default=None)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="qtp-branch")
        self._retry_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="qtp-phase2-retry")
        self._retry_futures: set[concurrent.futures.Future] = set()
        self._closed = False
        self._in_flight: dict[str, Transaction] = {}  # begun, not finished (recovery leaves them alone)
        self._reaper: threading.Thread | None = None
        self._parallel_limit = os.cpu_count() or 1
        self._in_flight_lock = threading.Lock()
        self.node: Any = None  # the qtp.Node (messaging) attached to this manager, if any
        self.llr = llr
        self._preferred_last: set[int] = set()  # id() of resources configured as the last resource
        self._forgetting: dict[int, tuple[Resource, list[str]]] = {}  # LLR rows to delete, per resource
        self._forget_lock = threading.Lock()
        self._forgetter: threading.Thread | None = None
        self._forget_wakeup = threading.Event()
        self.lease_settings = lease
        self.lease: Lease | None = None  # taken by start_recovery(), before anything is recovered
        self.lease_member: str | None = None  # the name the lease gives this process (None: its own)
        self._lease_lock = threading.Lock()

    @classmethod
    def from_config(cls, path: str | Path) -> "TransactionManager":
        """Build a manager from ``qtp.toml``: ``[node] id, log_dir`` and ``[resources.NAME] url``."""
        from qtp.config import load_config

        config = load_config(path)
        if config.lease is not None and config.lease.slots > 1:
            raise ConfigurationError(f"{path}: [lease] slots = {config.lease.slots}: the node's replicas share its "
                                     "work in slots, each with a transaction manager of its own; build the node with "
                                     "qtp.Node.from_config (or run `qtp serve`), not TransactionManager.from_config")
        manager = cls(config.node_id, config.log_dir, timeout=config.timeout,
                      recovery_interval=config.recovery_interval, llr=config.llr, lease=config.lease)
        for name, url in config.resources.items():
            manager.add_resource(name, url, last_resource=name in config.last_resources)
        manager.start_recovery()
        if (config.messaging["channels"] or config.messaging["node"].get("endpoint")) \
                and "messaging" not in _ATTACHMENTS:
            manager.close()
            raise ConfigurationError(f"{path} has channels or an endpoint, but messaging is not loaded: "
                                     "`import qtp` (or qtp.wsrm.runtime) before TransactionManager.from_config")
        for attach in _ATTACHMENTS.values():
            attach(manager, config)
        return manager

    def __repr__(self) -> str:
        return f"<TransactionManager {self.node_id} resources={sorted(self._resources)}>"

    # ------------------------------------------------------------------ resources

    def add_resource(self, name: str, target: str | Engine | Resource, last_resource: bool = False,
                     **engine_kw: Any) -> Resource:
        """Register a resource under ``name``: a URL, a SQLAlchemy engine, or a Resource.

        A name whose database is already registered under another name becomes an alias of it: both
        names then share one branch in every transaction. ``last_resource``: prefer this SQL database as
        the last resource of Logging Last Resource commits.
        """
        validate_name("resource name", name)
        if name in self._resources:
            raise ConfigurationError(f"resource {name!r} is already registered on node {self.node_id!r}")
        resource = resource_for(name, target, self.node_id, **engine_kw)
        for existing in self._resources.values():
            if existing.identity == resource.identity and existing is not resource:
                if not isinstance(target, Resource):
                    resource.close()
                resource = existing
                break
        if last_resource:
            if not resource.last_resource_capable:
                raise ConfigurationError(f"resource {name!r} cannot be the last resource: only a SQL database "
                                         "can hold the commit decision in its own transaction")
            self._preferred_last.add(id(resource))
        self._resources[name] = resource
        return resource

    def resource(self, name: str) -> Resource:
        try:
            return self._resources[name]
        except KeyError:
            known = ", ".join(sorted(self._resources)) or "none"
            raise ConfigurationError(
                f"unknown resource {name!r} on node {self.node_id!r} (registered: {known}); add it with "
                f"manager.add_resource({name!r}, url) or a [resources.{name}] table in qtp.toml"
            ) from None

    @property
    def resources(self) -> dict[str, Resource]:
        return dict(self._resources)

    def distinct_resources(self) -> list[Resource]:
        """One Resource per database (aliases folded)."""
        seen: dict[int, Resource] = {}
        for resource in self._resources.values():
            seen.setdefault(id(resource), resource)
        return list(seen.values())

    # ------------------------------------------------------------------ transactions

    def begin(self, timeout: float | None = None, gtrid: bytes | None = None) -> Transaction:
        """Start a transaction on this thread (prefer ``with manager.transaction()``). ``gtrid``: another global
        id than a fresh one of this node (a subordinate of another node's transaction, see
        ``Transaction.prepare_subordinate``)."""
        if self._closed:
            raise ConfigurationError(f"transaction manager {self.node_id!r} is closed")
        if self.log.failed:
            raise LogError(
                f"node {self.node_id!r} refuses new transactions: its decision log {self.log_dir} failed to write "
                f"({self.log.failure}); what reached the disk is unknown. Fix the disk, restart the node (its "
                "start-up recovery reads the log and ends every in-doubt branch), or run `qtp recover`")
        if self._recovery is None:
            self.start_recovery()
        if self.lease is not None and self.lease.lost.is_set():
            raise FencedError(f"node {self.node_id!r}: this process lost the node's lease "
                              f"({self.lease.lost_reason}): it starts no transaction")
        current = self._current.get()
        if current is not None and current.outcome is None:
            raise NestedTransactionError(
                f"this thread already runs transaction {current.xid}; qtp transactions do not nest: do the work "
                "inside the existing `with qtp.transaction()` block"
            )
        tx = Transaction(self, timeout if timeout is not None else self.timeout, gtrid)
        with self._in_flight_lock:
            self._in_flight[tx.xid] = tx
            if self._reaper is None:
                self._reaper = threading.Thread(target=self._reap, name="qtp-timeout", daemon=True)
                self._reaper.start()
        self._current.set(tx)
        return tx

    def finished(self, tx: Transaction) -> None:
        """Called by a transaction when it reaches an outcome."""
        with self._in_flight_lock:
            self._in_flight.pop(tx.xid, None)

    def in_flight(self) -> set[str]:
        """Global ids of the transactions this manager is running now (recovery must not touch them)."""
        with self._in_flight_lock:
            return set(self._in_flight)

    def _reap(self) -> None:
        """Interrupt transactions that run past their timeout before prepare.

        The reaper does not roll back on another thread's connection: it cancels the statement the
        transaction is running (one waiting on a lock, say), and the owner's thread then rolls back and
        gets TransactionTimeoutError; an idle transaction gets it at its next call or at commit.
        """
        period = max(0.05, min(1.0, self.timeout / 4))
        while not self._closed:
            time.sleep(period)
            now = time.monotonic()
            with self._in_flight_lock:
                late = [tx for tx in self._in_flight.values() if tx.state is State.ACTIVE and now > tx.deadline]
            for tx in late:
                tx.interrupt()

    def current(self) -> Transaction | None:
        """The transaction running in this thread (or asyncio task), if any."""
        tx = self._current.get()
        return tx if tx is not None and tx.outcome is None else None

    @contextlib.contextmanager
    def transaction(self, timeout: float | None = None) -> Iterator[Transaction]:
        """Commit on normal exit, roll back on an exception (which is re-raised).

        If the block ended the transaction itself (``tx.commit()``) and then raised, the application's
        exception goes on up unchanged: the transaction keeps the outcome it has.
        """
        tx = self.begin(timeout)
        try:
            yield tx
        except BaseException as exc:
            if tx.outcome is None:
                tx.rollback()
            if tx.interrupted and not isinstance(exc, TransactionTimeoutError):
                raise TransactionTimeoutError(
                    f"transaction {tx.xid} ran past its timeout of {tx.timeout:g} s: its statement was cancelled "
                    "and every branch rolled back; shorten the transaction or raise the timeout"
                ) from exc
            raise
        else:
            if tx.state is State.ACTIVE:
                tx.commit()
        finally:
            self._current.set(None)

    # ------------------------------------------------------------------ parallel branches

    def fan_out(self, fn: Callable[[int, Any], Any], items: list[Any]) -> list[Any]:
        """Apply ``fn(index, item)`` to every item at once: one round trip per phase, not one per branch.

        The first item runs on the calling thread, the others on pool threads. When more transactions are in
        flight than there are CPUs, the items run one after another on the calling thread instead (measured in
        benchmarks/RESULTS.md). Results are values or the exceptions raised."""
        if len(items) <= 1 or len(self._in_flight) > self._parallel_limit:
            # Saturated: other transactions' round trips already overlap ours, and handing branches to
            # pool threads would only spend the CPU everyone is queueing for.
            return run_each(fn, items)
        try:
            futures = [self._pool.submit(run_each, lambda i, it, k=k: fn(k, it), [item])
                       for k, item in enumerate(items[1:], start=1)]
        except RuntimeError:  # the pool is shut down (close() raced this transaction): do it here
            return run_each(fn, items)
        first = run_each(fn, items[:1])
        return first + [f.result()[0] for f in futures]

    # ------------------------------------------------------------------ recovery

    def start_recovery(self) -> Any:
        """Resolve what an earlier run of this node left in doubt, then keep doing so every
        ``recovery_interval`` seconds in the background. Runs by itself at the first ``begin()`` (and in
        ``from_config``); call it after ``add_resource`` to recover before any traffic. Returns the start-up
        pass's RecoveryReport, or None when recovery had already started."""
        factory = self._recovery_factory or _default_recovery_factory
        if factory is None:
            raise ConfigurationError("no recovery for this manager: import qtp.recovery (import qtp does), or pass "
                                     "TransactionManager(recovery_factory=...)")
        if self.lease_settings is not None:
            with self._lease_lock:
                if self.lease is None:
                    self._take_lease(self.lease_settings)  # blocks while another process owns the node
        with self._in_flight_lock:
            if self._recovery is not None:
                return None
            self._recovery = factory(self)
        return self._recovery.start()

    # ------------------------------------------------------------------ the node's lease (replicas)

    def _take_lease(self, settings: LeaseSettings) -> None:
        """Own the node before recovering anything: another live process's prepared branches are not
        crash leftovers. Then fence every one-phase commit of every resource (qtp.coordinator._lease)."""
        if not self.llr:
            raise ConfigurationError(f"node {self.node_id!r}: [lease] needs llr = true: a standby must find every "
                                     "commit decision in a database, and the file log is on another host")
        resources = self.distinct_resources()
        memory = [r.name for r in resources if getattr(r, "url", None) is None]
        if memory or not resources:
            raise ConfigurationError(f"node {self.node_id!r}: [lease] needs every resource to be a SQL database "
                                     f"(not {', '.join(memory) or 'none at all'}): a standby takes over only what "
                                     "is in the databases")
        for resource in resources:
            resource.probe()  # MariaDB: is its binary log on? (then it cannot be the last resource)
        if not any(r.last_resource_capable for r in resources):
            raise ConfigurationError(f"node {self.node_id!r}: [lease] needs a database that can hold commit decisions "
                                     "(PostgreSQL, or MariaDB without the binary log): with none, every two-phase "
                                     "commit would need the file log, which a standby on another host cannot read")
        home = self.resource(lease_home(self.node_id, settings, [r.name for r in resources]))
        lease = Lease(self.node_id, settings, home, resources, self._lease_lost, self.lease_member)
        for resource in resources:
            resource.fence = self.fence
            # an application's transaction may stay idle as long as its timeout allows; a paused owner's
            # transactions are ended by the database then (qtp.coordinator._lease, "Liveness")
            limit_idle(resource.engine, max(settings.ttl, self.timeout))
        lease.acquire()
        self.lease = lease  # (a lease not taken leaves every fence refusing)

    def fence(self, raw: Any, family: str) -> None:
        """Before a fenced commit on DBAPI connection ``raw``: FencedError unless this process owns the node."""
        lease = self.lease
        if lease is None:
            raise FencedError(f"node {self.node_id!r} has a [lease] and this process has not taken it yet: "
                              "nothing commits before start_recovery() took it")
        lease.fence(raw, family)

    def limit_idle(self, engine: Any) -> None:
        """A store engine of this node: its sessions end transactions idle longer than the lease."""
        if self.lease_settings is not None:
            limit_idle(engine, self.lease_settings.ttl)

    def _lease_lost(self, why: str) -> None:
        """Another process owns the node now: the workers stop (their commits are refused already)."""
        if self.node is not None:
            threading.Thread(target=self.node.stop, name="qtp-lease-lost", daemon=True).start()

    def recover(self, dry_run: bool = False) -> Any:
        """One recovery pass now (in-flight transactions are left alone); returns its RecoveryReport."""
        if self._recovery is None:
            self.start_recovery()
        return self._recovery.run_once(dry_run=dry_run)

    # ------------------------------------------------------------------ Logging Last Resource

    def last_resource_of(self, branches: list[Branch]) -> Branch | None:
        """The branch whose one-phase COMMIT will carry the decision, or None for the file log: the one
        configured ``last_resource``, else the SQL branch that ran most statements (the first enlisted on a
        tie: the busiest branch is the one most worth sparing a prepare)."""
        if not self.llr:
            return None
        capable = [b for b in branches if b.resource.last_resource_capable]
        if not capable:
            return None
        preferred = [b for b in capable if id(b.resource) in self._preferred_last]
        if preferred:
            return preferred[0]
        return max(capable, key=lambda b: b.resource.work_done(b.xid))  # max keeps the first of equals

    def forget_decision(self, resource: Resource, gtrid: str) -> None:
        """Queue the deletion of a decision row whose transaction is complete; rows go in batches."""
        with self._forget_lock:
            entry = self._forgetting.setdefault(id(resource), (resource, []))
            entry[1].append(gtrid)
            if self._forgetter is None:
                self._forgetter = threading.Thread(target=self._forget_loop, name="qtp-llr-forget", daemon=True)
                self._forgetter.start()
            if len(entry[1]) >= FORGET_BATCH:
                self._forget_wakeup.set()

    def _forget_loop(self) -> None:
        while not self._closed:
            self._forget_wakeup.wait(FORGET_INTERVAL_S)
            self._forget_wakeup.clear()
            self.forget_now()

    def forget_now(self) -> None:
        """Delete the queued decision rows now. A row left behind (database down, crash) is harmless:
        recovery deletes it once it finds nothing of its transaction in doubt."""
        with self._forget_lock:
            batches, self._forgetting = list(self._forgetting.values()), {}
        for resource, gtrids in batches:
            try:
                resource.forget_decisions(gtrids)
            except Exception as exc:  # housekeeping: retried with the next batch
                log.warning("could not delete %d decision row(s) from %s yet: %s", len(gtrids), resource.name, exc)
                with self._forget_lock:
                    self._forgetting.setdefault(id(resource), (resource, []))[1].extend(gtrids)

    # ------------------------------------------------------------------ phase-2 retries

    def retry_phase_two(self, gtrid: str, branches: list[Branch], end: Callable[[], None],
                        durable_first: bool = True) -> None:
        """Keep committing ``branches`` of a decided transaction in the background. The transaction stays
        in flight (recovery leaves it alone) until the retries end; what they cannot finish, recovery does.

        With ``durable_first`` (a decision in the file log) the decision is made durable first (a committer
        cut after appending it has flushed it already; this is the safety net). If the log cannot be written,
        no branch is committed: each is left prepared for the recovery that reads the log after a restart.
        ``end`` forgets the decision once every branch committed."""
        with self._in_flight_lock:
            future = self._retry_pool.submit(self._retry, gtrid, branches, end, durable_first)
            self._retry_futures.add(future)
        future.add_done_callback(self._retry_futures.discard)

    def _retry(self, gtrid: str, branches: list[Branch], end: Callable[[], None], durable_first: bool) -> None:
        try:
            if durable_first:
                self.log.flush()
                if self.log.failed:
                    raise LogError(f"decision log failed: {self.log.failure}")
        except BaseException as exc:
            for branch in branches:
                branch.resource.detach(branch.xid)
            log.critical("transaction %s: its commit decision may not be durable (%s); its branches stay prepared "
                         "for recovery after a restart", gtrid, exc)
            with self._in_flight_lock:
                self._in_flight.pop(gtrid, None)
            return
        left = []
        for branch in branches:  # each branch on its own: one unreachable database delays no other
            resource, xid = branch.resource, branch.xid
            try:
                for attempt in tenacity.Retrying(
                    stop=tenacity.stop_after_delay(self.phase_two_retry_s),
                    wait=tenacity.wait_exponential(multiplier=0.05, max=2.0),
                    retry=tenacity.retry_if_exception_type(QtpError), reraise=True,
                ):
                    with attempt:
                        resource.commit(xid)
            except Exception as exc:  # the retrier must survive anything; recovery finishes the work
                left.append(xid.branch)
                log.critical("transaction %s: phase-2 retries of branch %s gave up (%s); run `qtp recover` or "
                             "let the periodic recovery finish it", gtrid, xid.branch, exc)
        if not left:
            end()
            log.warning("transaction %s: pending branches committed by the background retry", gtrid)
        with self._in_flight_lock:
            self._in_flight.pop(gtrid, None)

    def wait_retries(self) -> None:
        """Block until the background phase-2 retries queued so far have finished (for tests, shutdown)."""
        with self._in_flight_lock:
            pending = list(self._retry_futures)
        concurrent.futures.wait(pending)

    def close(self, drain_s: float = 30.0) -> None:
        """Refuse new transactions, let running ones finish (at most ``drain_s``), stop background work,
        flush and unlock the log, release pooled connections."""
        if self._closed:
            return
        if self.node is not None:
            self.node.stop()  # the messaging workers first: they use this manager
        self._closed = True
        if self._recovery is not None:
            self._recovery.stop()
        deadline = time.monotonic() + drain_s
        while self.in_flight() and time.monotonic() < deadline:
            time.sleep(0.01)
        if self.in_flight():
            log.warning("closing node %s with transactions still running: %s", self.node_id,
                        sorted(self.in_flight()))
        self.wait_retries()
        self._retry_pool.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        self._forget_wakeup.set()
        if self._forgetter is not None:
            self._forgetter.join()
        self.forget_now()
        if self.lease is not None:
            self.lease.release()
        self.log.close()
        for resource in self.distinct_resources():
            resource.close()

    def __enter__(self) -> "TransactionManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ---------------------------------------------------------------------- recovery, handed in


class RecoveryScheduler(Protocol):
    """What the manager needs of recovery: a start-up pass (then whatever schedule it keeps), a pass on
    demand, and a stop."""

    def start(self) -> Any: ...

    def run_once(self, dry_run: bool = False) -> Any: ...

    def stop(self) -> None: ...


_default_recovery_factory: Callable[[TransactionManager], RecoveryScheduler] | None = None


def set_default_recovery(factory: Callable[[TransactionManager], RecoveryScheduler]) -> None:
    """Called by ``qtp.recovery`` at import: how managers built without a ``recovery_factory`` recover."""
    global _default_recovery_factory
    _default_recovery_factory = factory


# ---------------------------------------------------------------------- the installed manager

_installed: TransactionManager | None = None


def install(manager: TransactionManager | None) -> None:
    """Make ``manager`` the one ``qtp.transaction()`` uses (``None`` uninstalls)."""
    global _installed
    _installed = manager


def installed() -> TransactionManager:
    if _installed is None:
        raise NoTransactionError("no transaction manager installed: call qtp.install(TransactionManager(...)) "
                                 "before `with qtp.transaction()`")
    return _installed


def transaction(timeout: float | None = None) -> contextlib.AbstractContextManager[Transaction]:
    """``with qtp.transaction() as tx:`` on the installed manager."""
    return installed().transaction(timeout)


def current() -> Transaction | None:
    """The transaction running in this thread (or asyncio task), if any; None when nothing is running or no
    manager is installed."""
    return _installed.current() if _installed is not None else None


