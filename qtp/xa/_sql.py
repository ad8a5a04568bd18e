"""What the PostgreSQL and MySQL resources share: URLs, engines, the branch connection, error translation.

A SQL branch is one pooled DBAPI connection wrapped in a SQLAlchemy ``Connection`` (``BranchConnection``)
that the application uses with ordinary SQLAlchemy. The adapter underneath drives the two-phase protocol
on the same DBAPI connection; the wrapper refuses work once the branch has been handed to the manager.
Statements are watched (``before_cursor_execute``) so that a branch that ran nothing, or only reads,
can vote read-only without asking the database.
"""

from __future__ import annotations

import logging
import re
import threading
from datetime import datetime
from collections import Counter
from dataclasses import dataclass
from typing import Any

import sqlalchemy
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.engine.url import URL

from qtp.errors import (
    ConflictError,
    ConfigurationError,
    ConnectionClosedError,
    QtpError,
    ResourceError,
    ResourceUnavailableError,
    TransactionStateError,
)
from qtp.xa._resource import Resource, Vote
from qtp.xa._xid import Xid, validate_name

log = logging.getLogger("qtp.xa")

_DRIVERS = {"postgresql": "psycopg2", "mysql": "pymysql", "mariadb": "pymysql"}
_READ_ONLY = re.compile(r"^\s*(select|show|explain|values|savepoint|release|rollback\s+to)\b", re.I)


def normalize_url(url: str | URL) -> URL:
    """qtp's drivers are psycopg2 and pymysql: ``postgresql://`` means psycopg2 even where SQLAlchemy 2.1
    would pick psycopg 3, and ``mysql://`` / ``mariadb://`` mean pymysql."""
    try:
        parsed = make_url(url)
    except sqlalchemy.exc.ArgumentError as exc:
        raise ConfigurationError(f"not a database URL: {url!r} ({exc})") from exc
    backend = parsed.get_backend_name()
    if backend == "postgres":
        backend = "postgresql"
    if backend not in _DRIVERS:
        raise ConfigurationError(
            f"unsupported database in {parsed.render_as_string(hide_password=True)}: qtp supports "
            "postgresql:// (psycopg2) and mysql:// or mariadb:// (pymysql)"
        )
    driver = parsed.get_driver_name() if "+" in parsed.drivername else _DRIVERS[backend]
    if driver != _DRIVERS[backend]:
        raise ConfigurationError(
            f"driver {driver!r} in {parsed.render_as_string(hide_password=True)} is not supported: qtp "
            f"drives {backend} through {_DRIVERS[backend]} (use {backend}+{_DRIVERS[backend]}://)"
        )
    return parsed.set(drivername=f"{backend}+{driver}")


def identity_of(url: URL) -> tuple:
    """Two URLs with the same identity reach the same database (and share one branch)."""
    family = "postgresql" if url.get_backend_name() == "postgresql" else "mysql"
    host = url.host or "localhost"
    if host in ("127.0.0.1", "::1"):
        host = "localhost"
    return (family, host, url.port, url.database, url.username, tuple(sorted(url.query.items())))


def _reads_only(statement: Any) -> bool:
    """True for a statement that cannot write: a SELECT (Core or text), SHOW, EXPLAIN, a savepoint."""
    if isinstance(statement, str):
        return bool(_READ_ONLY.match(statement))
    if getattr(statement, "is_select", False):
        return True
    text_ = getattr(statement, "text", None)
    return isinstance(text_, str) and bool(_READ_ONLY.match(text_))


class BranchConnection(Connection):
    """A SQLAlchemy Connection bound to one branch; unusable once the branch leaves the application."""

    _qtp_open: bool = False
    _qtp_xid: Xid | None = None
    _qtp_branch: "SqlBranch | None" = None
    _qtp_parked: bool = False  # its pooled connection went on to serve a later branch

    def _qtp_note(self, statement: Any) -> None:
        """Refuse work after the branch ended; otherwise count the statement, and whether it may write."""
        branch = self._qtp_branch
        if not self._qtp_open or branch is None:
            raise ConnectionClosedError(
                f"this connection belonged to transaction {self._qtp_xid} which has ended; take a new one "
                "with tx.connection(name) inside a `with qtp.transaction()` block"
            )
        branch.statements += 1
        if not _reads_only(statement):
            branch.writes += 1

    @property
    def connection(self) -> Any:
        """The pooled DBAPI connection. Work done on it bypasses SQLAlchemy, so from now on the branch is
        taken to have written (where the database cannot tell qtp otherwise)."""
        branch = self._qtp_branch
        if branch is not None:
            branch.raw_used = True
        if self._qtp_parked:
            raise ConnectionClosedError(
                f"this connection belonged to transaction {self._qtp_xid} which has ended; take a new one "
                "with tx.connection(name) inside a `with qtp.transaction()` block")
        return Connection.connection.fget(self)

    def execute(self, statement: Any, *args: Any, **kw: Any) -> Any:
        self._qtp_note(statement)
        return super().execute(statement, *args, **kw)

    def exec_driver_sql(self, statement: Any, *args: Any, **kw: Any) -> Any:
        self._qtp_note(statement)
        return super().exec_driver_sql(statement, *args, **kw)

    def scalar(self, statement: Any, *args: Any, **kw: Any) -> Any:
        self._qtp_note(statement)
        return super().scalar(statement, *args, **kw)

    def scalars(self, statement: Any, *args: Any, **kw: Any) -> Any:
        self._qtp_note(statement)
        return super().scalars(statement, *args, **kw)

    def commit(self) -> None:
        raise TransactionStateError(
            "do not commit a qtp branch connection yourself: leave the `with qtp.transaction()` block and "
            "the manager commits every branch atomically"
        )

    def rollback(self) -> None:
        raise TransactionStateError(
            "do not roll back a qtp branch connection yourself: raise an exception inside the "
            "`with qtp.transaction()` block (or call tx.rollback()) and every branch is rolled back"
        )


# The Logging Last Resource decision rows: one per transaction committed with this database as its last
# resource, inserted inside that branch (so it exists if and only if the branch committed), deleted in
# batches once every other branch has committed. The same DDL runs on PostgreSQL and MariaDB.
DECISION_TABLE = "qtp_llr_decision"
DECISION_TABLE_DDL = (
    f"CREATE TABLE IF NOT EXISTS {DECISION_TABLE} ("
    "gtrid varchar(64) NOT NULL PRIMARY KEY, "
    "node_id varchar(31) NOT NULL, "
    "branches varchar(2000) NOT NULL, "
    "decided_at timestamp NOT NULL DEFAULT CURRENT_TIMESTAMP)"
)


class _Translate:
    __slots__ = ("resource", "action", "xid")

    def __init__(self, resource: "SqlResource", action: str, xid: Xid | None):
        self.resource, self.action, self.xid = resource, action, xid

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: Any) -> bool:
        if exc is None or isinstance(exc, QtpError) or not isinstance(exc, Exception):
            return False
        raise self.resource._translate(exc, self.action, self.xid) from exc  # the driver boundary


@dataclass
class SqlBranch:
    xid: Xid
    conn: BranchConnection
    raw: Any  # the DBAPI connection
    statements: int = 0
    writes: int = 0
    raw_used: bool = False  # the application reached for the DBAPI connection
    prepared: bool = False
    thread: int = 0  # the thread that began it: its pooled connection is kept for that thread's next branch


class SqlResource(Resource):
    """Common machinery; subclasses supply the database's two-phase statements (``_xa_*``)."""

    family: str = ""
    # fence(dbapi_connection, family) before a one-phase COMMIT: set by a manager whose node has a [lease]
    fence: Any = None

    def __init__(self, name: str, url_or_engine: str | URL | Engine, node_id: str, **engine_kw: Any):
        self.name = validate_name("resource name", name)
        self.node_id = node_id
        if isinstance(url_or_engine, Engine):
            self.url = normalize_url(url_or_engine.url)
            if url_or_engine.url.get_driver_name() != self.url.get_driver_name():
                raise ConfigurationError(
                    f"engine for resource {name!r} uses driver {url_or_engine.url.get_driver_name()!r}; "
                    f"qtp needs {self.url.get_driver_name()} (create it from {self.url.drivername}://...)"
                )
            self.engine = url_or_engine
        else:
            self.url = normalize_url(url_or_engine)
            options = {"pool_size": 32, "max_overflow": 64, "pool_reset_on_return": None}
            options.update(engine_kw)
            self.engine = sqlalchemy.create_engine(self.url, **options)
        self.identity = identity_of(self.url)
        self.display_url = self.url.render_as_string(hide_password=True)
        self._branches: dict[Xid, SqlBranch] = {}
        self._lock = threading.Lock()
        self._counters: Counter = Counter()
        self._decision_table_ready = False
        self._parked: dict[int, Any] = {}  # thread id -> a pooled connection kept for its next branch
        self._closed = False
        self.checkouts = 0  # pooled connections taken for branches (the others were kept from earlier ones)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} {self.display_url}>"

    def _count(self, what: str) -> None:
        self._counters[what] += 1

    # ------------------------------------------------------------------ errors

    def translate(self, action: str, xid: Xid | None = None) -> "_Translate":
        """``with self.translate(...)``: driver and SQLAlchemy errors become qtp errors naming the resource
        and the action (a class, not a generator: it sits on every branch's hot path)."""
        return _Translate(self, action, xid)

    def _translate(self, exc: Exception, action: str, xid: Xid | None) -> QtpError:
        """Three kinds, decided from the driver's error code, never from its class alone: the connection is
        lost (outcome of the statement unknown), the database rolled the work back over a conflict (a certain
        abort, retryable), or the database refused (a certain failure)."""
        original = getattr(exc, "orig", None) or exc
        where = f"{action} on resource {self.name!r} ({self.display_url})" + (f" for {xid}" if xid else "")
        if getattr(exc, "connection_invalidated", False) or self._is_disconnect(original):
            return ResourceUnavailableError(f"{where}: database unreachable: {original}")
        if self._is_conflict(original):
            return ConflictError(f"{where}: the database rolled the branch back over a conflict with another "
                                 f"transaction (run the transaction again): {original}")
        return ResourceError(f"{where} failed: {original}")

    def _is_disconnect(self, exc: BaseException) -> bool:
        """The connection is gone: whatever the statement was doing, its outcome is not known here."""
        raise NotImplementedError

    def _is_conflict(self, exc: BaseException) -> bool:
        """Serialization failure or deadlock: the database has rolled the transaction back."""
        raise NotImplementedError

    # ------------------------------------------------------------------ branch life

    def begin(self, xid: Xid) -> None:
        with self.translate("begin", xid):
            conn = self._take_connection()
            raw = conn.connection.dbapi_connection
            try:
                self._xa_start(raw, xid)
            except BaseException:
                conn.invalidate()
                conn.close()
                raise
        conn.begin()  # before the branch is attached: SQLAlchemy's own use of .connection is not the app's
        branch = SqlBranch(xid, conn, raw, thread=threading.get_ident())
        conn._qtp_open, conn._qtp_xid, conn._qtp_branch = True, xid, branch
        with self._lock:
            self._branches[xid] = branch
        self._count("begin")

    def connection(self, xid: Xid) -> BranchConnection:
        return self._branch(xid, "connection").conn

    def _branch(self, xid: Xid, action: str) -> SqlBranch:
        branch = self._branches.get(xid)
        if branch is None:
            raise TransactionStateError(f"{action}: resource {self.name!r} has no active branch {xid}")
        return branch

    # ------------------------------------------------------------------ Logging Last Resource

    last_resource_capable = True

    def work_done(self, xid: Xid) -> int:
        branch = self._branches.get(xid)
        return 0 if branch is None else branch.statements

    def write_decision(self, xid: Xid, gtrid: str, branches: list[str]) -> None:
        branch = self._branch(xid, "write the commit decision")
        if not self._decision_table_ready:
            self.create_decision_table()
        with self.translate("write the commit decision", xid), branch.raw.cursor() as cur:
            cur.execute(f"INSERT INTO {DECISION_TABLE} (gtrid, node_id, branches) VALUES (%s, %s, %s)",
                        (gtrid, self.node_id, ",".join(branches)))
        self._count("write_decision")

    def create_decision_table(self) -> None:
        """Create the decision table if it is missing (on a connection of its own: DDL cannot run in XA)."""
        with self.translate("create the decision table"), self.engine.connect() as conn:
            conn.exec_driver_sql(DECISION_TABLE_DDL)
            conn.commit()
        self._decision_table_ready = True

    def read_decisions(self, node_id: str) -> dict[str, list[str]]:
        with self.translate("read the commit decisions"), self.engine.connect() as conn:
            try:
                rows = conn.exec_driver_sql(f"SELECT gtrid, branches FROM {DECISION_TABLE} WHERE node_id = %s",
                                            (node_id,)).all()
            except sqlalchemy.exc.ProgrammingError as exc:
                if not self._is_missing_table(exc.orig):
                    raise
                rows = []  # this database never served as the last resource
            conn.rollback()
        return {gtrid: [b for b in branches.split(",") if b] for gtrid, branches in rows}

    def forget_decisions(self, gtrids: list[str]) -> None:
        if not gtrids:
            return
        with self.translate("forget commit decisions"), self.engine.connect() as conn:
            marks = ", ".join(["%s"] * len(gtrids))
            conn.exec_driver_sql(f"DELETE FROM {DECISION_TABLE} WHERE gtrid IN ({marks})", tuple(gtrids))
            conn.commit()
        self._count("forget_decisions")

    def _is_missing_table(self, exc: BaseException) -> bool:
        raise NotImplementedError

    def probe(self) -> None:
        """Learn what the server is, where that decides ``last_resource_capable`` (MySQL/MariaDB: the binary
        log), before the first branch; nothing to learn by default."""

    def may_have_written(self, xid: Xid) -> bool:
        return not self._idle(self._branch(xid, "may_have_written"))

    def _idle(self, branch: SqlBranch) -> bool:
        """Did the branch certainly run nothing? (Statements through SQLAlchemy are counted.)"""
        return branch.statements == 0 and not branch.raw_used

    def prepare(self, xid: Xid) -> Vote:
        branch = self._branch(xid, "prepare")
        branch.conn._qtp_open = False
        if self._idle(branch) or (branch.writes == 0 and not branch.raw_used and self._wrote_nothing(branch)):
            self._finish(branch, self._xa_end_read_only, "read-only")
            return Vote.READ_ONLY
        with self.translate("prepare", xid):
            self._xa_prepare(branch.raw, xid)
        branch.prepared = True
        self._count("prepare")
        return Vote.YES

    def _wrote_nothing(self, branch: SqlBranch) -> bool:
        """For a branch that ran only reads: ask the database whether it wrote (default: assume it did)."""
        return False

    def commit(self, xid: Xid, one_phase: bool = False) -> None:
        branch = self._branches.get(xid)
        if branch is None:
            if one_phase:
                raise TransactionStateError(f"one-phase commit: resource {self.name!r} has no branch {xid}")
            self._resolve(xid, commit=True)
            return
        branch.conn._qtp_open = False
        if one_phase and self._idle(branch):
            self._finish(branch, self._xa_end_read_only, "read-only")
            return
        if one_phase:
            if self.fence is not None:  # the node runs as replicas: see qtp.coordinator._lease
                with self.translate("check the node's lease", xid):
                    self.fence(branch.raw, self.family)
            self._finish(branch, self._xa_commit_one_phase, "commit_one_phase")
        else:
            self._finish(branch, self._xa_commit, "commit")

    def rollback(self, xid: Xid) -> None:
        branch = self._branches.get(xid)
        if branch is None:
            self._resolve(xid, commit=False)
            return
        branch.conn._qtp_open = False
        self._finish(branch, self._xa_rollback, "rollback")

    def _finish(self, branch: SqlBranch, step: Any, what: str) -> None:
        """Run the final protocol step on the branch's own connection, then give the connection back.

        If the connection broke, it is discarded; a prepared branch then stays in doubt in the
        database and the caller (phase-2 retry or recovery) resolves it by xid on a fresh connection.
        """
        with self._lock:
            self._branches.pop(branch.xid, None)
        branch.conn._qtp_branch = None
        try:
            with self.translate(what, branch.xid):
                step(branch.raw, branch.xid)
            self._count(what)
        except BaseException:
            branch.conn.invalidate()
            branch.conn.close()
            raise
        self._park(branch)

    # Connections kept per thread. A branch's pooled connection is not checked in when the branch ends: it
    # waits for the next branch begun by the same thread (a transaction manager's threads run one
    # transaction after another), which saves a pool checkout and check-in and a SQLAlchemy Connection
    # set-up per branch. The SQLAlchemy Connection of the ended branch is retired (it refuses any use), and
    # its transaction bookkeeping is dropped without a ROLLBACK: the protocol step already ended the
    # transaction on the DBAPI connection (pymysql would send a needless ROLLBACK round trip).

    def _take_connection(self) -> BranchConnection:
        with self._lock:
            pooled = self._parked.pop(threading.get_ident(), None)
        if pooled is not None and pooled.is_valid:
            return BranchConnection(self.engine, connection=pooled)
        self.checkouts += 1
        return BranchConnection(self.engine)

    def _park(self, branch: SqlBranch) -> None:
        conn = branch.conn
        pooled = conn._dbapi_connection  # SQLAlchemy's own attribute: the pooled connection
        conn._transaction = conn._nested_transaction = None
        conn._dbapi_connection = None
        conn._qtp_parked = True
        with self._lock:
            if branch.thread not in self._parked and not self._closed:
                self._parked[branch.thread] = pooled
                return
        pooled.close()  # back to the pool

    def _resolve(self, xid: Xid, commit: bool) -> None:
        """Commit or roll back a prepared branch by xid on a fresh connection (phase-2 retry, recovery)."""
        what = "commit" if commit else "rollback"
        with self.translate(f"{what} (by xid)", xid), self.engine.connect() as conn:
            try:
                self._xa_resolve(conn.connection.dbapi_connection, xid, commit)
            except BaseException:
                conn.invalidate()  # the pool does not reset connections: never hand a broken one back
                raise
        self._count(f"{what}_by_xid")

    def recover(self) -> list[Xid]:
        return [xid for xid, _ in self.in_doubt()]

    def in_doubt(self) -> list[tuple[Xid, datetime | None]]:
        """``recover()`` with the time each branch was prepared, where the database records it."""
        with self.translate("recover"), self.engine.connect() as conn:
            found = self._xa_recover(conn.connection.dbapi_connection)
        self._count("recover")
        # MariaDB lists the whole server's branches: keep this node's, and this resource's (bqual = name).
        return [(xid, at) for xid, at in found if xid.belongs_to(self.node_id) and xid.branch == self.name]

    def forget(self, xid: Xid) -> None:
        """PostgreSQL and MariaDB keep no heuristic-completion record: nothing to forget."""

    def close(self) -> None:
        """Close every connection, the branches' included: active branches are rolled back by the database;
        prepared branches stay prepared, detached from any session, for commit or rollback by xid."""
        for xid in list(self._branches):
            self.detach(xid)
        with self._lock:
            self._closed = True
            parked, self._parked = list(self._parked.values()), {}
        for pooled in parked:
            pooled.close()
        self.engine.dispose()

    def detach(self, xid: Xid) -> None:
        with self._lock:
            branch = self._branches.pop(xid, None)
        if branch is None:
            return
        branch.conn._qtp_open, branch.conn._qtp_branch = False, None
        try:
            branch.conn.invalidate()
            branch.conn.close()
        except Exception as exc:  # detaching must not fail: the connection is being thrown away anyway
            log.warning("closing the connection of %s failed: %s", xid, exc)

    # ------------------------------------------------------------------ database-specific steps

    def _xa_start(self, raw: Any, xid: Xid) -> None:
        raise NotImplementedError

    def _xa_prepare(self, raw: Any, xid: Xid) -> None:
        raise NotImplementedError

    def _xa_commit(self, raw: Any, xid: Xid) -> None:
        raise NotImplementedError

    def _xa_commit_one_phase(self, raw: Any, xid: Xid) -> None:
        raise NotImplementedError

    def _xa_end_read_only(self, raw: Any, xid: Xid) -> None:
        raise NotImplementedError

    def _xa_rollback(self, raw: Any, xid: Xid) -> None:
        raise NotImplementedError

    def _xa_resolve(self, raw: Any, xid: Xid, commit: bool) -> None:
        raise NotImplementedError

    def _xa_recover(self, raw: Any) -> list[tuple[Xid, datetime | None]]:
        raise NotImplementedError
