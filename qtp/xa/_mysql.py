"""MySQL / MariaDB resource: ``XA START / END / PREPARE / COMMIT / ROLLBACK / RECOVER`` through pymysql,
which has no TPC API. All MySQL-specific SQL of qtp lives here.

MariaDB before 10.5 rolls back a prepared XA branch when its client disconnects, which breaks 2PC; qtp
refuses such servers. ``XA RECOVER`` is decoded with ``FORMAT='SQL'`` on MariaDB and ``CONVERT XID`` on
MySQL, so binary xids survive the round trip.
"""

from __future__ import annotations

import re
import threading
from datetime import datetime
from typing import Any

import pymysql
import pymysql.connections
import sqlalchemy

from qtp.errors import ConfigurationError, PrepareRefusedError, QtpError, ResourceUnavailableError
from qtp.xa._sql import SqlResource
from qtp.xa._xid import Xid

_DISCONNECT_CODES = {2003, 2006, 2013, 2055, 1927, 4031}
_XAER_NOTA = 1397  # unknown xid: already resolved
_DEADLOCK = 1213  # ER_LOCK_DEADLOCK: the server rolled the transaction back
_XA_RB_CODES = {1402, 1613, 1614}  # XA_RBROLLBACK, XA_RBTIMEOUT, XA_RBDEADLOCK: the server rolled it back
_MIN_MARIADB = (10, 5)


class _Connection(pymysql.connections.Connection):
    """pymysql's connection, with one change: in its default TLS mode (PREFERRED: TLS when the server offers
    it, no certificate check) pymysql builds a new ``ssl.create_default_context()`` for every connection,
    which loads the system's CA bundle: about 30 ms of CPU each on the development machine, the largest
    single cost of a MariaDB recipient of coupled messages (profiled: 41 % of its CPU went to new
    connections). That context is the same every time (no CA, CERT_NONE, no hostname check), so it is built
    once per process and shared; an SSLContext may serve many connections. Explicit TLS settings (``ssl``,
    ``ssl_ca``...) are untouched: they still get their own context, as pymysql builds it."""

    def _create_ssl_ctx(self, sslp: Any) -> Any:
        global _PREFERRED_TLS
        if isinstance(sslp, dict) and not sslp:
            with _PREFERRED_LOCK:
                if _PREFERRED_TLS is None:
                    _PREFERRED_TLS = super()._create_ssl_ctx({})
            return _PREFERRED_TLS
        return super()._create_ssl_ctx(sslp)


_PREFERRED_TLS: Any = None
_PREFERRED_LOCK = threading.Lock()


def share_tls_context(engine: Any) -> Any:
    """Make ``engine`` (pymysql) open its connections as ``_Connection``; other engines are left alone.
    Uses SQLAlchemy's ``do_connect`` event, which may hand back the DBAPI connection to use."""
    if engine.dialect.driver == "pymysql" and not getattr(engine, "_qtp_shared_tls", False):
        @sqlalchemy.event.listens_for(engine, "do_connect")
        def connect(dialect: Any, record: Any, cargs: Any, cparams: Any) -> Any:
            return _Connection(*cargs, **cparams)
        engine._qtp_shared_tls = True
    return engine


def _code(exc: BaseException) -> int | None:
    """The server or client error number of a pymysql error (None for anything else)."""
    return exc.args[0] if isinstance(exc, pymysql.err.MySQLError) and exc.args else None


def _execute(raw: Any, sql: str) -> list[tuple]:
    with raw.cursor() as cur:
        cur.execute(sql)
        return list(cur.fetchall())


class MySQLResource(SqlResource):
    family = "mysql"

    def __init__(self, name: str, target: Any, node_id: str, **engine_kw: Any):
        # Autocommit outside XA: XA START opens the branch explicitly, and statements run for recovery
        # (XA COMMIT / ROLLBACK / RECOVER by xid) must not sit inside an implicit local transaction.
        engine_kw.setdefault("connect_args", {}).setdefault("autocommit", True)
        super().__init__(name, target, node_id, **engine_kw)
        share_tls_context(self.engine)
        self._flavour: str | None = None
        self._binlog = False

    @property
    def one_phase_safe(self) -> bool:  # type: ignore[override]
        """False on MariaDB with the binary log on (see ``Resource.one_phase_safe``); known from the first
        branch on (each branch's XA START first asks the server what it is)."""
        return not (self._flavour == "mariadb" and self._binlog)

    @property
    def last_resource_capable(self) -> bool:  # type: ignore[override]
        return self.one_phase_safe

    def _is_disconnect(self, exc: BaseException) -> bool:
        """pymysql's InterfaceError (the socket is closed) and the client/server codes of a lost connection
        (2003, 2006, 2013, 2055, 1927 connection killed, 4031 idle timeout); not every OperationalError,
        which also carries deadlocks and lock wait timeouts."""
        if isinstance(exc, pymysql.err.InterfaceError):
            return True
        return isinstance(exc, pymysql.err.OperationalError) and _code(exc) in _DISCONNECT_CODES

    def _is_missing_table(self, exc: BaseException) -> bool:
        return _code(exc) == 1146  # no such table

    def _is_conflict(self, exc: BaseException) -> bool:
        code = _code(exc)
        return code == _DEADLOCK or code in _XA_RB_CODES

    def _translate(self, exc: Exception, action: str, xid: Xid | None) -> QtpError:
        original = getattr(exc, "orig", None) or exc
        code = _code(original)
        if action == "prepare" and code is not None and not self._is_disconnect(original) \
                and not self._is_conflict(original):
            return PrepareRefusedError(
                f"resource {self.name!r} ({self.display_url}) refused XA PREPARE for {xid}: {original}"
            )
        return super()._translate(exc, action, xid)

    def _check_server(self, raw: Any) -> None:
        if self._flavour is not None:
            return
        version = _execute(raw, "SELECT VERSION()")[0][0]
        numbers = tuple(int(n) for n in re.findall(r"\d+", version)[:2])
        if "MariaDB" in version:
            if numbers < _MIN_MARIADB:
                raise ConfigurationError(
                    f"{self.display_url} runs MariaDB {version}; qtp needs 10.5 or newer (older versions roll "
                    "back a prepared XA transaction when its client disconnects)"
                )
            self._binlog = bool(int(_execute(raw, "SELECT @@log_bin")[0][0]))
            self._flavour = "mariadb"
        else:
            self._flavour = "mysql"

    def probe(self) -> None:
        """MariaDB or MySQL, binary log on or off: ``one_phase_safe`` and ``last_resource_capable`` known now."""
        with self.translate("ask the server what it is"), self.engine.connect() as conn:
            self._check_server(conn.connection.dbapi_connection)

    def cancel(self, xid: Xid) -> None:
        branch = self._branches.get(xid)
        if branch is None or branch.prepared:
            return
        with self.translate("cancel", xid), self.engine.connect() as conn:
            _execute(conn.connection.dbapi_connection, f"KILL QUERY {int(branch.raw.thread_id())}")

    # ------------------------------------------------------------------ the protocol steps

    def _xa_start(self, raw: Any, xid: Xid) -> None:
        self._check_server(raw)
        _execute(raw, f"XA START {xid.to_mysql()}")

    def _xa_prepare(self, raw: Any, xid: Xid) -> None:
        _execute(raw, f"XA END {xid.to_mysql()}")
        _execute(raw, f"XA PREPARE {xid.to_mysql()}")

    def _xa_commit(self, raw: Any, xid: Xid) -> None:
        _execute(raw, f"XA COMMIT {xid.to_mysql()}")

    def _xa_commit_one_phase(self, raw: Any, xid: Xid) -> None:
        _execute(raw, f"XA END {xid.to_mysql()}")
        _execute(raw, f"XA COMMIT {xid.to_mysql()} ONE PHASE")

    def _xa_end_read_only(self, raw: Any, xid: Xid) -> None:
        self._xa_rollback(raw, xid)

    def _xa_rollback(self, raw: Any, xid: Xid) -> None:
        for statement in (f"XA END {xid.to_mysql()}", f"XA ROLLBACK {xid.to_mysql()}"):
            try:
                _execute(raw, statement)
            except pymysql.err.OperationalError as exc:
                # XAER_RMFAIL (1399): END after END or after PREPARE; XAER_NOTA: gone already.
                if exc.args[0] not in (1399, _XAER_NOTA):
                    raise

    def _xa_resolve(self, raw: Any, xid: Xid, commit: bool) -> None:
        verb = "COMMIT" if commit else "ROLLBACK"
        try:
            _execute(raw, f"XA {verb} {xid.to_mysql()}")
        except pymysql.err.MySQLError as exc:
            if not (exc.args and exc.args[0] == _XAER_NOTA):
                raise
            # Unknown to this session: resolved already, or still attached to a live session (a connection
            # the server has not yet seen close). Only the first is success.
            if any(x == xid for x, _ in self._xa_recover(raw)):
                raise ResourceUnavailableError(
                    f"branch {xid} on {self.display_url} is still attached to another session; retry later"
                ) from exc

    def _xa_recover(self, raw: Any) -> list[tuple[Xid, datetime | None]]:
        self._check_server(raw)
        if self._flavour == "mariadb":
            rows = _execute(raw, "XA RECOVER FORMAT='SQL'")
            found = [Xid.from_mysql(_text(row[3])) for row in rows]
        else:
            rows = _execute(raw, "XA RECOVER CONVERT XID")
            found = [Xid.from_mysql_parts(row[0], row[1], row[2], bytes.fromhex(_text(row[3])[2:]))
                     for row in rows]
        return [(x, None) for x in found if x is not None]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, (bytes, bytearray)) else str(value)
