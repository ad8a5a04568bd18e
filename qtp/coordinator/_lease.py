"""One live owner per node identity: a lease in one of the node's databases, a fence in each of them.

Several processes may run one node (replicas on two hosts, a standby beside the owner). They share the
node's databases and nothing else: each has its own decision-log folder. ``[lease]`` in qtp.toml makes
each of them take the node's lease before its transaction manager recovers anything; the one that holds it
is the *owner* and works, the others wait as *standbys* (or refuse to start) and take over when the owner's
lease expires.

Three tables, created where missing (the same DDL on PostgreSQL and MariaDB):

``qtp_node_lease`` (in the lease database)
    node_id, holder (the owning process), epoch (one more at every takeover), acquired_at.
``qtp_node_member`` (in the lease database)
    node_id, member, role (owner / standby / left), epoch, seen_at, expires_at: every process of the node,
    its heartbeat, and the owner's lease expiry.
``qtp_node_fence`` (in every SQL database of the node)
    node_id, epoch: the epoch allowed to write there.

Times are the lease database's clock (seconds since 1970), never a process's: processes on hosts with
skewed clocks agree on when a lease expires.

**Taking over.** A standby locks the lease row (``FOR UPDATE``), reads the holder's ``expires_at``, and if
it has passed (or the holder left), sets itself as holder with the next epoch. Then, in every database of the
node, it raises the fence row to the new epoch. Only then does it go on: recovery of the node's in-doubt
transactions (with ``[lease]`` every commit decision is a row in a database, see below), then the stores,
the workers, the endpoint.

**Fencing.** Every commit that writes the node's state carries the check: just before a one-phase COMMIT
(a single branch, or the last resource's commit that carries a two-phase decision) and before every commit
of a messaging store's own transactions, ``SELECT epoch FROM qtp_node_fence ... FOR SHARE`` in that
transaction, on that connection. The share lock lasts until the COMMIT, and raising the fence needs the row
exclusively, so a commit either finishes before a takeover raises the fence there, or sees the new epoch
and rolls back (``FencedError``). A prepared branch is not fenced: it decides nothing, and a commit decision
is the last resource's commit, which is. A process paused (SIGSTOP) or cut off past its lease can therefore
resume but not write: its next commit fails, its next renewal finds another holder, and it stops
(``on_lost``; ``qtp serve`` exits with status 75 so that its supervisor starts it again, as a standby).

It also refuses locally first: the owner counts its lease from the instant it *sent* its last successful
renewal, and once ``ttl`` less a tenth has passed on its own monotonic clock it refuses every commit itself
until a renewal succeeds: a process that is merely slow stops writing before anyone may take over.

**Liveness.** Sessions of the node's engines end a transaction left idle too long (PostgreSQL
``idle_in_transaction_session_timeout``, MariaDB ``idle_transaction_timeout``): the messaging stores' after
``ttl``, the application's after its transaction timeout (or ``ttl`` if longer), so that a paused owner's open
transactions, and their row locks, do not hold up the new owner for longer than that.

**Decisions.** A standby cannot read another host's file log, so with ``[lease]`` a commit decision goes
only where it can: the Logging Last Resource row in one of the node's SQL databases (``llr = true``, every
resource a SQL database). A transaction that would need the file log (MariaDB with the binary log as its
only last resource) is refused rather than decided where no standby looks.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import sqlalchemy
from sqlalchemy import event

from qtp._failures import Failures, driver_first_line
from qtp.config import LeaseSettings
from qtp.errors import ConfigurationError, FencedError, LeaseHeldError

log = logging.getLogger("qtp.lease")

LEASE_TABLE = "qtp_node_lease"
MEMBER_TABLE = "qtp_node_member"
FENCE_TABLE = "qtp_node_fence"
REPLICA_TABLE = "qtp_node_replica"  # replicas that share the work in slots (qtp.wsrm.runtime._shared)
DDL = (
    f"CREATE TABLE IF NOT EXISTS {LEASE_TABLE} (node_id varchar(31) NOT NULL PRIMARY KEY, "
    "holder varchar(120) NOT NULL, epoch bigint NOT NULL, acquired_at double precision NOT NULL)",
    f"CREATE TABLE IF NOT EXISTS {MEMBER_TABLE} (node_id varchar(31) NOT NULL, member varchar(120) NOT NULL, "
    "role varchar(16) NOT NULL, epoch bigint NOT NULL, seen_at double precision NOT NULL, "
    "expires_at double precision NOT NULL, PRIMARY KEY (node_id, member))",
)
FENCE_DDL = f"CREATE TABLE IF NOT EXISTS {FENCE_TABLE} (node_id varchar(31) NOT NULL PRIMARY KEY, epoch bigint NOT NULL)"

_NOW = {"postgresql": "CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS double precision)",
        "mysql": "CAST(UNIX_TIMESTAMP(SYSDATE(6)) AS DOUBLE)"}
_SHARE = {"postgresql": "FOR SHARE", "mysql": "LOCK IN SHARE MODE"}
_FENCE_SQL = {family: f"SELECT epoch FROM {FENCE_TABLE} WHERE node_id = %s {share}" for family, share in _SHARE.items()}
FORGET_MEMBERS_S = 3600.0  # rows of processes gone this long are deleted by the owner


@dataclass
class LeaseView:
    """What ``qtp status`` shows: the holder, its epoch, and every process seen (role, age of its heartbeat)."""

    node_id: str
    holder: str | None
    epoch: int
    acquired_s_ago: float | None
    expires_in_s: float | None
    members: list[dict]


def _family(url: Any) -> str:
    return "postgresql" if url.get_backend_name() == "postgresql" else "mysql"


class _Database:
    """One database of the node, as the lease uses it: a small engine of its own (never the branch pools)."""

    def __init__(self, resource: Any, lock_wait_s: float):
        self.name = resource.name
        self.family = _family(resource.url)
        self.now = _NOW[self.family]
        wait_ms = max(1, int(lock_wait_s * 1000))
        self.engine = sqlalchemy.create_engine(resource.url, pool_size=2, max_overflow=4, pool_pre_ping=True)

        @event.listens_for(self.engine, "connect")
        def _limit_lock_waits(raw: Any, _record: Any) -> None:  # a standby must not queue behind a paused owner
            with raw.cursor() as cur:
                if self.family == "postgresql":
                    cur.execute(f"SET lock_timeout = {wait_ms}")
                else:
                    cur.execute(f"SET SESSION innodb_lock_wait_timeout = {max(1, round(lock_wait_s))}")
            raw.commit()

    def create(self, lease_tables: bool) -> None:
        with self.engine.begin() as conn:
            for ddl in (DDL if lease_tables else ()) + (FENCE_DDL,):
                conn.exec_driver_sql(ddl)

    def raise_fence(self, node_id: str, epoch: int) -> None:
        """Let ``epoch`` write here, and no earlier one: waits for the commits fenced with an older epoch."""
        with self.engine.begin() as conn:
            changed = conn.exec_driver_sql(f"UPDATE {FENCE_TABLE} SET epoch = %s WHERE node_id = %s AND epoch <= %s",
                                           (epoch, node_id, epoch)).rowcount
            if not changed:
                found = conn.exec_driver_sql(f"SELECT epoch FROM {FENCE_TABLE} WHERE node_id = %s",
                                             (node_id,)).first()
                if found is not None:  # a later epoch holds it: this process is not the owner any more
                    raise FencedError(f"database {self.name!r} is fenced at epoch {found[0]} > {epoch}")
                conn.exec_driver_sql(f"INSERT INTO {FENCE_TABLE} (node_id, epoch) VALUES (%s, %s)", (node_id, epoch))

    def close(self) -> None:
        self.engine.dispose()


class Lease:
    """The lease of node ``node_id`` for this process: ``acquire()`` (blocks as a standby), ``fence(raw,
    family)`` before each fenced commit, ``verify()``, ``release()``. ``on_lost`` is called (once, from the
    renewal thread) when another process has taken the node over."""

    def __init__(self, node_id: str, settings: LeaseSettings, lease_resource: Any, resources: list[Any],
                 on_lost: Callable[[str], None], member: str | None = None):
        self.node_id = node_id
        self.settings = settings
        self.member = member or process_member()
        self.on_lost = on_lost
        lock_wait = min(2.0, settings.ttl / 2)
        self.home = _Database(lease_resource, lock_wait)
        self.databases = [self.home] + [_Database(r, lock_wait) for r in resources
                                        if r.identity != lease_resource.identity]
        self.epoch = 0
        self.owner = False
        self.lost = threading.Event()
        self.lost_reason = ""
        self.renewed_at: float | None = None  # monotonic instant the last successful renewal was sent
        self._valid_until = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._created = False
        self._seen = False  # this process has a row in the member table

    def __repr__(self) -> str:
        role = "owner" if self.owner else "lost" if self.lost.is_set() else "standby"
        return f"<Lease {self.node_id} {self.member} {role} epoch={self.epoch}>"

    # ------------------------------------------------------------------ taking it

    def acquire(self) -> int:
        """Hold the lease (waiting as a standby while another live process does, or raising LeaseHeldError
        with ``standby = "refuse"``), then fence every database at the new epoch; returns the epoch."""
        if not self._created:
            for db in self.databases:
                db.create(lease_tables=db is self.home)
            self._created = True
        try:
            return self._acquire()
        except BaseException:  # stopped while waiting (SIGTERM, Ctrl-C), or refused: not a standby any more
            self.release()
            raise

    def _acquire(self) -> int:
        poll = max(0.05, min(1.0, self.settings.ttl / 10))
        said = None
        while True:
            try:
                taken, holder, expires_in = self._try_take()
            except sqlalchemy.exc.SQLAlchemyError as exc:  # the database is down or a lock wait timed out
                log.warning("node %s: lease not taken yet (%s); trying again", self.node_id, driver_first_line(exc))
                time.sleep(poll)
                continue
            if taken:
                break
            if self.settings.standby == "refuse":
                raise LeaseHeldError(f"node {self.node_id!r} is owned by {holder} (its lease expires in "
                                     f"{expires_in:.1f} s unless renewed)")
            if said != holder:
                log.warning("node %s: this process (%s) is a standby for node %s: owner %s, its lease expires in "
                            "%.1f s unless renewed", self.node_id, self.member, self.node_id, holder, expires_in)
                said = holder
            time.sleep(poll)
        self._start_renewing()
        for db in self.databases:
            while True:
                try:
                    db.raise_fence(self.node_id, self.epoch)
                    break
                except FencedError:
                    self._lose(f"a later owner fenced database {db.name!r} while this process took over")
                    raise
                except sqlalchemy.exc.SQLAlchemyError as exc:
                    log.warning("node %s: fence of database %s not raised yet (%s); trying again", self.node_id,
                                db.name, driver_first_line(exc))
                    time.sleep(poll)
        self.owner = True
        log.warning("node %s: this process (%s) took over node %s at epoch %d", self.node_id, self.member,
                    self.node_id, self.epoch)
        return self.epoch

    def _check_not_shared(self) -> None:
        """ConfigurationError while replicas of this node share its work in slots: a process of the whole node
        would work slot 0's tables beside the replica holding it."""
        db = self.home
        try:
            with db.engine.begin() as conn:
                row = conn.exec_driver_sql(f"SELECT member, slots FROM {REPLICA_TABLE} WHERE node_id = %s AND "
                                           f"expires_at > {db.now}", (self.node_id,)).first()
        except sqlalchemy.exc.ProgrammingError:  # no such table: no replica ever shared this database's nodes
            return
        if row is not None:
            raise ConfigurationError(f"node {self.node_id!r}: its replicas share the work in {row[1]} slots "
                                     f"([lease] slots; {row[0]} is live), and this process has no slots: give it "
                                     "the same [lease] slots, or stop them first")

    def _try_take(self) -> tuple[bool, str | None, float]:
        self._check_not_shared()
        db, n = self.home, self.node_id
        sent = time.monotonic()
        with db.engine.begin() as conn:
            now = conn.exec_driver_sql(f"SELECT {db.now}").scalar()
            row = conn.exec_driver_sql(f"SELECT holder, epoch FROM {LEASE_TABLE} WHERE node_id = %s FOR UPDATE",
                                       (n,)).first()
            if row is None:
                conn.exec_driver_sql(f"INSERT INTO {LEASE_TABLE} (node_id, holder, epoch, acquired_at) "
                                     "VALUES (%s, %s, 1, %s)", (n, self.member, now))
                self.epoch = 1
            else:
                holder, epoch = row
                found = conn.exec_driver_sql(f"SELECT expires_at, role FROM {MEMBER_TABLE} WHERE node_id = %s AND "
                                             "member = %s", (n, holder)).first()
                expires_at = now if found is None or found[1] == "left" else found[0]
                if expires_at > now and holder != self.member:
                    if self.settings.standby == "wait":  # seen by `qtp status` as a standby
                        self._heartbeat(conn, "standby", epoch, now)
                    return False, holder, expires_at - now
                conn.exec_driver_sql(f"UPDATE {LEASE_TABLE} SET holder = %s, epoch = %s, acquired_at = %s "
                                     "WHERE node_id = %s", (self.member, epoch + 1, now, n))
                self.epoch = epoch + 1
            self._heartbeat(conn, "owner", self.epoch, now)
        self._renewed(sent)
        return True, None, 0.0

    def _heartbeat(self, conn: Any, role: str, epoch: int, now: float) -> None:
        values = (role, epoch, now, now + self.settings.ttl, self.node_id, self.member)
        if not conn.exec_driver_sql(f"UPDATE {MEMBER_TABLE} SET role = %s, epoch = %s, seen_at = %s, expires_at = %s "
                                    "WHERE node_id = %s AND member = %s", values).rowcount:
            conn.exec_driver_sql(f"INSERT INTO {MEMBER_TABLE} (role, epoch, seen_at, expires_at, node_id, member) "
                                 "VALUES (%s, %s, %s, %s, %s, %s)", values)
        self._seen = True

    def _renewed(self, sent: float) -> None:
        self.renewed_at = sent
        self._valid_until = sent + self.settings.ttl * 0.9

    # ------------------------------------------------------------------ keeping it

    def _start_renewing(self) -> None:
        self._thread = threading.Thread(target=self._renew_loop, name="qtp-lease", daemon=True)
        self._thread.start()

    def _renew_loop(self) -> None:
        every = self.settings.renew_every
        forget_at = 0.0
        failures = Failures(log, f"node {self.node_id}: lease renewal")
        ran_out = False  # said, in this run of failures
        while not self._stop.wait(every if self.valid() else min(every, 0.25)):
            try:
                holder = self._renew()
            except sqlalchemy.exc.SQLAlchemyError as exc:
                left = self._valid_until - time.monotonic()
                if left <= 0 and not ran_out:  # said once, as it happens, whatever was said before
                    ran_out = True
                    log.warning("node %s: the lease ran out while renewal fails: writes refused until it "
                                "succeeds", self.node_id)
                failures.failed(exc, detail=f"{left:.1f} s of lease left" if left > 0
                                else "writes refused until it succeeds")
                continue
            failures.worked()
            ran_out = False
            if holder != (self.member, self.epoch):
                self._lose(f"{holder[0]} holds it at epoch {holder[1]}" if holder else "its row is gone")
                return
            if time.monotonic() > forget_at:
                forget_at = time.monotonic() + 60.0
                self._forget_gone()

    def _renew(self) -> tuple[str, int] | None:
        db, sent = self.home, time.monotonic()
        with db.engine.begin() as conn:
            now = conn.exec_driver_sql(f"SELECT {db.now}").scalar()
            row = conn.exec_driver_sql(f"SELECT holder, epoch FROM {LEASE_TABLE} WHERE node_id = %s",
                                       (self.node_id,)).first()
            holder = None if row is None else (row[0], int(row[1]))
            if holder == (self.member, self.epoch):
                self._heartbeat(conn, "owner", self.epoch, now)
        if holder == (self.member, self.epoch):
            self._renewed(sent)
        return holder

    def _forget_gone(self) -> None:
        try:
            with self.home.engine.begin() as conn:
                conn.exec_driver_sql(f"DELETE FROM {MEMBER_TABLE} WHERE node_id = %s AND expires_at < "
                                     f"{self.home.now} - %s", (self.node_id, FORGET_MEMBERS_S))
        except sqlalchemy.exc.SQLAlchemyError as exc:  # housekeeping: next time
            log.debug("old member rows not deleted: %s", exc)

    def valid(self) -> bool:
        """Held, and renewed recently enough by this process's own clock to write."""
        return self.owner and not self.lost.is_set() and time.monotonic() < self._valid_until

    def _lose(self, why: str) -> None:
        if self.lost.is_set():
            return
        self.owner = False  # from here every fence refuses
        self.lost_reason = why
        log.critical("node %s: this process (%s) lost the lease of node %s (epoch %d): %s; it writes nothing more",
                     self.node_id, self.member, self.node_id, self.epoch, why)
        try:
            self.on_lost(why)
        finally:
            self.lost.set()

    # ------------------------------------------------------------------ fencing

    def fence(self, raw: Any, family: str) -> None:
        """In the writing transaction on DBAPI connection ``raw`` (of a ``family`` database), just before its
        COMMIT: FencedError unless this process's epoch is still the one allowed to write there."""
        if not self.valid():
            why = self.lost_reason or "its last renewal is too old"
            raise FencedError(f"node {self.node_id!r}: this process does not hold the lease now ({why}): "
                              "the commit is refused")
        with raw.cursor() as cur:
            cur.execute(_FENCE_SQL[family], (self.node_id,))
            row = cur.fetchone()
        if row is None or int(row[0]) != self.epoch:
            raise FencedError(f"node {self.node_id!r}: another process took the node over (epoch "
                              f"{row[0] if row else 'none'} is allowed to write, this process has {self.epoch}): "
                              "the commit is refused")

    def verify(self) -> None:
        """FencedError unless the lease is held now, as the lease database says (for recovery: a pass acts on
        what it scanned only if no takeover can have happened before the scan ended)."""
        if not self.valid():
            raise FencedError(f"node {self.node_id!r}: this process does not hold the lease now")
        holder = self._renew()
        if holder != (self.member, self.epoch):
            raise FencedError(f"node {self.node_id!r}: the lease is held by {holder[0] if holder else 'nobody'}")

    # ------------------------------------------------------------------ giving it up

    def release(self) -> None:
        """Stop renewing and mark this process gone: a standby takes over at once from an owner that closes
        cleanly, and `qtp status` lists a standby that stopped as gone."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if self._seen:
            try:
                with self.home.engine.begin() as conn:
                    now = conn.exec_driver_sql(f"SELECT {self.home.now}").scalar()
                    self._heartbeat(conn, "left", self.epoch, now)
                if self.owner:
                    log.info("node %s: this process released the lease (epoch %d)", self.node_id, self.epoch)
            except sqlalchemy.exc.SQLAlchemyError as exc:
                log.warning("node %s: lease not released (%s): a standby takes over when it expires", self.node_id,
                            driver_first_line(exc))
        self.owner = False
        for db in self.databases:
            db.close()


def process_member() -> str:
    """This process's name in the lease tables: host, pid and a random part (pids are reused)."""
    return f"{socket.gethostname()[:60]}:{os.getpid()}:{secrets.token_hex(3)}"


def lease_home(node_id: str, settings: LeaseSettings, names: list[str]) -> str:
    """The name of the resource that holds the lease: ``[lease] resource``, or the node's only database."""
    if settings.resource is not None:
        return settings.resource
    if len(names) == 1:
        return names[0]
    raise ConfigurationError(f"node {node_id!r}: [lease] resource = \"NAME\" is needed: which of "
                             f"{', '.join(sorted(names))} holds the lease")


def limit_idle(engine: Any, limit: float) -> None:
    """Sessions of ``engine`` (one of a leased node's) end a transaction left idle longer than ``limit`` seconds:
    a paused owner's open transactions, and their row locks, do not outlive it by more than that."""
    family, seconds = _family(engine.url), max(1, round(limit))

    @event.listens_for(engine, "connect")
    def _idle_limit(raw: Any, _record: Any) -> None:
        with raw.cursor() as cur:
            if family == "postgresql":
                cur.execute(f"SET idle_in_transaction_session_timeout = {seconds * 1000}")
            else:
                cur.execute(f"SET SESSION idle_transaction_timeout = {seconds}")
        if family == "postgresql":
            raw.commit()


def read_lease(url: Any, node_id: str) -> LeaseView | None:
    """The lease of ``node_id`` in the database at ``url`` (None: no lease table or no row), for ``qtp status``."""
    family = _family(url)
    engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool)
    try:
        with engine.connect() as conn:
            now = conn.exec_driver_sql(f"SELECT {_NOW[family]}").scalar()
            try:
                row = conn.exec_driver_sql(f"SELECT holder, epoch, acquired_at FROM {LEASE_TABLE} WHERE node_id = %s",
                                           (node_id,)).first()
            except sqlalchemy.exc.ProgrammingError:
                return None
            members = conn.exec_driver_sql(f"SELECT member, role, epoch, seen_at, expires_at FROM {MEMBER_TABLE} "
                                           "WHERE node_id = %s ORDER BY seen_at DESC", (node_id,)).all()
    finally:
        engine.dispose()
    if row is None:
        return None
    holder, epoch, acquired_at = row
    mine = next((m for m in members if m[0] == holder), None)
    return LeaseView(node_id, holder, int(epoch), now - acquired_at,
                     None if mine is None or mine[1] == "left" else mine[4] - now,
                     [{"member": m, "role": role, "epoch": int(e), "seen_s_ago": round(now - seen, 3),
                       "expires_in_s": round(exp - now, 3)} for m, role, e, seen, exp in members])


