"""PostgreSQL resource: psycopg2's TPC API (``PREPARE TRANSACTION`` / ``COMMIT PREPARED`` /
``ROLLBACK PREPARED``) and ``pg_prepared_xacts``. All PostgreSQL-specific SQL of qtp lives here."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import psycopg2
import psycopg2.errorcodes

from qtp.errors import PrepareRefusedError, QtpError, ResourceError
from qtp.xa._sql import SqlBranch, SqlResource
from qtp.xa._xid import FORMAT_ID, Xid

_UNDEFINED_OBJECT = psycopg2.errorcodes.UNDEFINED_OBJECT  # 42704: no such prepared transaction
_SESSION_ENDED = {"57P01", "57P02", "57P03"}  # admin shutdown, crash shutdown, cannot connect now


def _pg_xid(raw: Any, xid: Xid) -> Any:
    return raw.xid(xid.format_id, xid.gtrid.decode(), xid.bqual.decode())


class PostgresResource(SqlResource):
    family = "postgresql"

    def _is_disconnect(self, exc: BaseException) -> bool:
        """libpq's own errors (no SQLSTATE: the server closed the connection, could not connect), SQLSTATE
        class 08 (connection exception) and the server shutting the session down (57P01-57P03). Not every
        OperationalError: serialization failures (40001), deadlocks (40P01) and cancelled statements (57014)
        are OperationalErrors too, and the database answered them."""
        if isinstance(exc, psycopg2.InterfaceError):
            return True
        if not isinstance(exc, psycopg2.OperationalError):
            return False
        code = exc.pgcode
        return code is None or code.startswith("08") or code in _SESSION_ENDED

    def _is_missing_table(self, exc: BaseException) -> bool:
        return getattr(exc, "pgcode", None) == psycopg2.errorcodes.UNDEFINED_TABLE

    def _is_conflict(self, exc: BaseException) -> bool:
        return isinstance(exc, psycopg2.Error) and (exc.pgcode or "").startswith("40")

    def _translate(self, exc: Exception, action: str, xid: Xid | None) -> QtpError:
        original = getattr(exc, "orig", None) or exc
        refused = self._prepare_refusal(original)
        if action == "prepare" and refused:
            return PrepareRefusedError(f"resource {self.name!r} ({self.display_url}) cannot prepare {xid}: "
                                       f"{refused}")
        return super()._translate(exc, action, xid)

    @staticmethod
    def _prepare_refusal(exc: BaseException) -> str | None:
        text = str(exc)
        if "prepared transactions are disabled" in text:
            return ("max_prepared_transactions is 0 on this server; set max_prepared_transactions to at least "
                    "max_connections in postgresql.conf and restart it")
        if "temporary" in text and "PREPARE" in text:
            return ("the transaction used temporary tables, which PostgreSQL cannot prepare; use ordinary "
                    "tables (or a separate, non-qtp connection) for temporary data")
        return None

    def cancel(self, xid: Xid) -> None:
        branch = self._branches.get(xid)
        if branch is not None and not branch.prepared:
            with self.translate("cancel", xid):
                branch.raw.cancel()

    # ------------------------------------------------------------------ the protocol steps

    def _xa_start(self, raw: Any, xid: Xid) -> None:
        if raw.status != psycopg2.extensions.STATUS_READY:
            raw.rollback()
        raw.tpc_begin(_pg_xid(raw, xid))

    def _idle(self, branch: SqlBranch) -> bool:
        """libpq knows, without a round trip, whether BEGIN was ever sent: even work done on the raw DBAPI
        connection, which SQLAlchemy does not see, is caught."""
        idle = branch.raw.get_transaction_status() == psycopg2.extensions.TRANSACTION_STATUS_IDLE
        return branch.statements == 0 and idle

    def _wrote_nothing(self, branch: SqlBranch) -> bool:
        with self.translate("prepare (read-only check)", branch.xid), branch.raw.cursor() as cur:
            cur.execute("SELECT txid_current_if_assigned() IS NULL")
            return bool(cur.fetchone()[0])

    @staticmethod
    def _check_not_failed(raw: Any, xid: Xid) -> None:
        """A statement failed and the application carried on: PostgreSQL would answer PREPARE or COMMIT
        with a silent ROLLBACK. Refuse instead, so the transaction rolls back on every branch."""
        if raw.get_transaction_status() == psycopg2.extensions.TRANSACTION_STATUS_INERROR:
            raise ResourceError(
                f"branch {xid} is in a failed state: one of its statements raised an error and PostgreSQL "
                "has aborted the branch; the transaction cannot commit (let the error leave the "
                "`with qtp.transaction()` block, or use a savepoint around statements that may fail)"
            )

    def _xa_prepare(self, raw: Any, xid: Xid) -> None:
        self._check_not_failed(raw, xid)
        raw.tpc_prepare()

    def _xa_commit(self, raw: Any, xid: Xid) -> None:
        raw.tpc_commit()

    def _xa_commit_one_phase(self, raw: Any, xid: Xid) -> None:
        self._check_not_failed(raw, xid)
        raw.tpc_commit()

    def _xa_end_read_only(self, raw: Any, xid: Xid) -> None:
        raw.tpc_rollback()

    def _xa_rollback(self, raw: Any, xid: Xid) -> None:
        try:
            raw.tpc_rollback()
        except psycopg2.ProgrammingError:  # the branch failed before tpc state was set up
            raw.rollback()

    def _xa_resolve(self, raw: Any, xid: Xid, commit: bool) -> None:
        verb = "COMMIT PREPARED" if commit else "ROLLBACK PREPARED"
        raw.autocommit = True
        try:
            with raw.cursor() as cur:
                cur.execute(f"{verb} %s", (xid.to_pg_gid(),))
        except psycopg2.Error as exc:
            if exc.pgcode != _UNDEFINED_OBJECT:
                raise
        finally:
            raw.autocommit = False

    def _xa_recover(self, raw: Any) -> list[tuple[Xid, datetime | None]]:
        with raw.cursor() as cur:
            cur.execute(
                "SELECT gid, prepared FROM pg_prepared_xacts "
                "WHERE database = current_database() AND gid LIKE %s",
                (f"{FORMAT_ID}\\_%",),
            )
            rows = cur.fetchall()
        raw.rollback()
        found = [(Xid.from_pg_gid(gid), prepared) for gid, prepared in rows]
        return [(x, at) for x, at in found if x is not None]
