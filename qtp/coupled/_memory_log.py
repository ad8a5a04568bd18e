"""The in-memory twin of ``_log``: the same functions over ``MemoryTables`` instead of a SQL connection.

It is a real implementation of the coupling log's contract (``tests/test_coupled_log.py`` runs one suite
against it and against PostgreSQL and MariaDB), for models and tests that drive the sender's and the
recipient's logic without a database. Row locks are not modelled: one ``MemoryTables`` is one
serialisable store, and each call is atomic under its lock.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any, Iterable

from qtp.coupled import _states as states
from qtp.coupled import _tables as tables

_OUT_COLUMNS = [c.name for c in tables.outbound.columns]
_IN_COLUMNS = [c.name for c in tables.inbound.columns]


class MemoryTables:
    def __init__(self) -> None:
        self.out: dict[str, dict[str, Any]] = {}
        self.inn: dict[str, dict[str, Any]] = {}
        self.lock = threading.RLock()


def _row(values: dict[str, Any]) -> SimpleNamespace:
    return SimpleNamespace(**values)


def _new(columns: list[str], **values: Any) -> dict[str, Any]:
    unknown = set(values) - set(columns)
    if unknown:
        raise KeyError(f"no such column(s): {sorted(unknown)}")
    return {c: values.get(c) for c in columns}


# ================================================================== the sender's sphere log

def record_sent(conn: MemoryTables, **row: Any) -> None:
    now = time.time()
    with conn.lock:
        if row["id"] in conn.out:
            raise KeyError(f"duplicate coupling id {row['id']}")
        conn.out[row["id"]] = _new(_OUT_COLUMNS, **row, state=states.ACTIVE, recipient="sent", created_at=now,
                                   updated_at=now)


def decide(conn: MemoryTables, ids: list[str], event: str) -> int:
    target = states.next_state(states.SENDER, states.ACTIVE, event)
    with conn.lock:
        moved = [conn.out[i] for i in ids if i in conn.out and conn.out[i]["state"] == states.ACTIVE]
        for row in moved:
            row.update(state=target, updated_at=time.time())
        return len(moved)


def lock_active(conn: MemoryTables, gtrid: str, deadline_before: float | None = None,
                skip_locked: bool = False) -> list[Any]:
    with conn.lock:
        return [_row(r) for _, r in sorted(conn.out.items()) if r["state"] == states.ACTIVE and r["gtrid"] == gtrid
                and (deadline_before is None or r["deadline"] < deadline_before)]


def active_gtrids(conn: MemoryTables, deadline_before: float | None) -> set[str]:
    with conn.lock:
        return {r["gtrid"] for r in conn.out.values() if r["state"] == states.ACTIVE
                and (deadline_before is None or r["deadline"] < deadline_before)}


def sent_row(conn: MemoryTables, coupling_id: str, lock: bool = True) -> Any:
    with conn.lock:
        row = conn.out.get(coupling_id)
        return None if row is None else _row(row)


def report(conn: MemoryTables, coupling_id: str, state: str, coupling: str, reason: str | None) -> None:
    with conn.lock:
        if coupling_id in conn.out:
            conn.out[coupling_id].update(recipient=state, coupling=coupling, reason=reason, updated_at=time.time())


def reports(conn: MemoryTables, ids: list[str]) -> list[Any]:
    with conn.lock:
        return [_row(conn.out[i]) for i in ids if i in conn.out]


def sent_rows(conn: MemoryTables, ids: Iterable[str] | None = None, gtrid: str | None = None) -> list[Any]:
    wanted = None if ids is None else set(ids)
    with conn.lock:
        found = [r for r in conn.out.values() if (wanted is None or r["id"] in wanted)
                 and (gtrid is None or r["gtrid"] == gtrid)]
        return [_row(r) for r in sorted(found, key=lambda r: (r["created_at"], r["id"]))]


def open_compensations(conn: MemoryTables, limit: int | None = None) -> list[Any]:
    with conn.lock:
        found = sorted((r for r in conn.out.values() if r["state"] == states.ABORTED
                        and r["recipient"] not in states.SETTLED), key=lambda r: r["updated_at"])
        return [_row(r) for r in found[:limit]]


def prune_sent(conn: MemoryTables, before: float) -> int:
    with conn.lock:
        gone = [i for i, r in conn.out.items() if r["state"] != states.ACTIVE and r["recipient"] in states.SETTLED
                and r["updated_at"] < before]
        for i in gone:
            del conn.out[i]
        return len(gone)


# ================================================================== the recipient's coupling rows

def received(conn: MemoryTables, coupling_id: str, lock: bool = False) -> Any:
    with conn.lock:
        row = conn.inn.get(coupling_id)
        return None if row is None else _row(row)


def record_received(conn: MemoryTables, state: str, **row: Any) -> None:
    now = time.time()
    with conn.lock:
        if row["id"] in conn.inn:
            raise KeyError(f"duplicate coupling id {row['id']}")
        conn.inn[row["id"]] = _new(_IN_COLUMNS, **{"attempts": 0, "next_at": 0.0, "received_at": now,
                                                   "updated_at": now, **row, "state": state})


def move(conn: MemoryTables, coupling_id: str, state: str | None, event: str, sub: Any = ...,
         **values: Any) -> str | None:
    target = states.next_state(states.RECIPIENT, state, event)
    _new(_IN_COLUMNS, **values)  # the same columns as the table
    with conn.lock:
        row = conn.inn.get(coupling_id)
        if row is None or row["state"] != state or (sub is not ... and row["sub_gtrid"] != sub):
            return None
        row.update(values, state=target, updated_at=time.time())
        return target


def note_attempt(conn: MemoryTables, coupling_id: str, state: str, attempts: int, next_at: float, error: str) -> bool:
    with conn.lock:
        row = conn.inn.get(coupling_id)
        if row is None or row["state"] != state:
            return False
        row.update(attempts=attempts, next_at=next_at, error=error, updated_at=time.time())
        return True


def work(conn: MemoryTables, now: float, limit: int) -> list[str]:
    with conn.lock:
        found = [r for r in conn.inn.values() if r["next_at"] <= now and (
            r["state"] in states.WORK and (r["state"] != states.RECEIVED or r["deadline"] > now))]
        return [r["id"] for r in sorted(found, key=lambda r: r["received_at"])[:limit]]


def waiting_past_deadline(conn: MemoryTables, now: float) -> list[Any]:
    with conn.lock:
        return [_row(r) for r in conn.inn.values()
                if r["state"] in (states.PREPARED, states.RECEIVED, states.PROCESSED) and r["deadline"] < now]


def held(conn: MemoryTables, owner: str | None) -> int:
    with conn.lock:
        return sum(1 for r in conn.inn.values() if r["owner"] == owner
                   and r["state"] in (states.PREPARING, states.PREPARED))


def prune_received(conn: MemoryTables, before: float) -> int:
    with conn.lock:
        gone = [i for i, r in conn.inn.items() if r["updated_at"] < before
                and r["state"] in ("committed", "cancelled", "rolled-back", "compensated")]
        for i in gone:
            del conn.inn[i]
        return len(gone)
