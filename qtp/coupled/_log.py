"""Every SQL statement of coupled messaging: the sender's sphere log (``qtp_coupled_out``) and the recipient's
coupling rows (``qtp_coupled_in``). The tables are defined in ``_tables``; the states and the moves between
them in ``_states``.

Each function takes a SQLAlchemy connection: a store's local transaction, or a branch of a global one, as
the caller decides. A state change is a compare-and-set: ``UPDATE ... WHERE id = :id AND state = :expected``
whose row count says whether it happened; the new state comes from the transition table, so a move the
table does not know cannot be written.
"""

from __future__ import annotations

import time
from typing import Any, Iterable

import sqlalchemy as sa

from qtp.coupled import _states as states
from qtp.coupled import _tables as tables

OUT = tables.outbound
IN = tables.inbound
BUSY = sorted(states.WORK - {states.RECEIVED})  # worked on whatever the deadline


# ================================================================== the sender's sphere log

def record_sent(conn: Any, **row: Any) -> None:
    now = time.time()
    conn.execute(OUT.insert(), {**row, "state": states.ACTIVE, "recipient": "sent", "created_at": now,
                                "updated_at": now})


def decide(conn: Any, ids: list[str], event: str) -> int:
    """Move the active rows ``ids`` by ``event`` ("commit" or "abort"); how many moved."""
    target = states.next_state(states.SENDER, states.ACTIVE, event)
    return conn.execute(OUT.update().where(OUT.c.id.in_(ids), OUT.c.state == states.ACTIVE)
                        .values(state=target, updated_at=time.time())).rowcount


def lock_active(conn: Any, gtrid: str, deadline_before: float | None = None, skip_locked: bool = False) -> list[Any]:
    """The active rows of transaction ``gtrid`` (past ``deadline_before`` if given), locked; ``skip_locked``:
    those another transaction holds are left out."""
    where = [OUT.c.gtrid == gtrid] + ([] if deadline_before is None else [OUT.c.deadline < deadline_before])
    return conn.execute(sa.select(OUT.c.id, OUT.c.channel, OUT.c.compensation, OUT.c.token)
                        .where(OUT.c.state == states.ACTIVE, *where).order_by(OUT.c.id)
                        .with_for_update(skip_locked=skip_locked)).all()


def active_gtrids(conn: Any, deadline_before: float | None) -> set[str]:
    where = [] if deadline_before is None else [OUT.c.deadline < deadline_before]
    return {g for (g,) in conn.execute(sa.select(OUT.c.gtrid).distinct().where(OUT.c.state == states.ACTIVE,
                                                                                 *where))}


def sent_row(conn: Any, coupling_id: str, lock: bool = True) -> Any:
    query = sa.select(OUT).where(OUT.c.id == coupling_id)
    return conn.execute(query.with_for_update() if lock else query).first()


def report(conn: Any, coupling_id: str, state: str, coupling: str, reason: str | None) -> None:
    conn.execute(OUT.update().where(OUT.c.id == coupling_id).values(
        recipient=state, coupling=coupling, reason=reason, updated_at=time.time()))


def reports(conn: Any, ids: list[str]) -> list[Any]:
    return conn.execute(sa.select(OUT.c.id, OUT.c.recipient, OUT.c.coupling, OUT.c.reason)
                        .where(OUT.c.id.in_(ids))).all()


def sent_rows(conn: Any, ids: Iterable[str] | None = None, gtrid: str | None = None) -> list[Any]:
    query = sa.select(OUT)
    if ids is not None:
        query = query.where(OUT.c.id.in_(list(ids)))
    if gtrid is not None:
        query = query.where(OUT.c.gtrid == gtrid)
    return conn.execute(query.order_by(OUT.c.created_at, OUT.c.id)).all()


def open_compensations(conn: Any, limit: int | None = None) -> list[Any]:
    query = (sa.select(OUT).where(OUT.c.state == states.ABORTED, OUT.c.recipient.not_in(states.SETTLED))
             .order_by(OUT.c.updated_at))
    return conn.execute(query if limit is None else query.limit(limit)).all()


def prune_sent(conn: Any, before: float) -> int:
    """Forget decided rows whose recipient settled before ``before`` (the retention has passed)."""
    return conn.execute(OUT.delete().where(OUT.c.state != states.ACTIVE, OUT.c.recipient.in_(states.SETTLED),
                                           OUT.c.updated_at < before)).rowcount


# ================================================================== the recipient's coupling rows

def received(conn: Any, coupling_id: str, lock: bool = False) -> Any:
    query = sa.select(IN).where(IN.c.id == coupling_id)
    return conn.execute(query.with_for_update() if lock else query).first()


def record_received(conn: Any, state: str, **row: Any) -> None:
    now = time.time()
    conn.execute(IN.insert(), {"attempts": 0, "next_at": 0.0, "received_at": now, "updated_at": now,
                               **row, "state": state})


def move(conn: Any, coupling_id: str, state: str | None, event: str, sub: Any = ..., **values: Any) -> str | None:
    """Compare-and-set: the row ``coupling_id`` goes from ``state`` by ``event`` to the table's next state,
    only if it is still in ``state`` (and, when ``sub`` is given, still holds that subordinate gtrid).
    Returns the new state, or None when the row had moved on (the caller decides what that means)."""
    target = states.next_state(states.RECIPIENT, state, event)
    where = [IN.c.id == coupling_id, IN.c.state == state]
    if sub is not ...:
        where.append(IN.c.sub_gtrid.is_(None) if sub is None else IN.c.sub_gtrid == sub)
    moved = conn.execute(IN.update().where(*where).values(state=target, updated_at=time.time(), **values)).rowcount
    return target if moved else None


def note_attempt(conn: Any, coupling_id: str, state: str, attempts: int, next_at: float, error: str) -> bool:
    """A failed attempt that leaves the row where it is (counted or not: ``attempts``)."""
    return bool(conn.execute(IN.update().where(IN.c.id == coupling_id, IN.c.state == state).values(
        attempts=attempts, next_at=next_at, error=error, updated_at=time.time())).rowcount)


def work(conn: Any, now: float, limit: int) -> list[str]:
    """Ids of rows with something to do now (``preparing`` ones included: the worker skips those it holds,
    and undoes the others). An original still undecided past its deadline waits for the decision (the
    sender has made it or makes it now): processing it could only be undone again."""
    c = IN.c
    due = sa.or_(sa.and_(c.state == states.RECEIVED, c.deadline > now), c.state.in_(BUSY))
    return [r for (r,) in conn.execute(sa.select(c.id).where(c.next_at <= now, due)
                                       .order_by(c.received_at).limit(limit))]


def waiting_past_deadline(conn: Any, now: float) -> list[Any]:
    """Rows whose sender's decision is overdue: prepared, or received/processed past the deadline."""
    return conn.execute(sa.select(IN.c.id, IN.c.coordinator, IN.c.owner, IN.c.token).where(
        IN.c.state.in_([states.PREPARED, states.RECEIVED, states.PROCESSED]), IN.c.deadline < now)).all()


def held(conn: Any, owner: str | None) -> int:
    """Subordinate transactions held for one peer (prepared, or being prepared)."""
    peer = IN.c.owner.is_(None) if owner is None else IN.c.owner == owner
    return conn.execute(sa.select(sa.func.count()).where(
        peer, IN.c.state.in_([states.PREPARING, states.PREPARED]))).scalar() or 0


def prune_received(conn: Any, before: float) -> int:
    return conn.execute(IN.delete().where(IN.c.state.in_(["committed", "cancelled", "rolled-back", "compensated"]),
                                          IN.c.updated_at < before)).rowcount


# ================================================================== what operators see (qtp status, qtp coupled)

def undecided_count(conn: Any) -> int:
    return conn.execute(sa.select(sa.func.count()).where(OUT.c.state == states.ACTIVE)).scalar() or 0


def waiting_count(conn: Any) -> int:
    return conn.execute(sa.select(sa.func.count()).where(IN.c.state == states.RECEIVED)).scalar() or 0


def prepared_rows(conn: Any, limit: int) -> list[Any]:
    return conn.execute(sa.select(IN.c.id, IN.c.coordinator, IN.c.deadline, IN.c.updated_at)
                        .where(IN.c.state == states.PREPARED).order_by(IN.c.updated_at).limit(limit)).all()


def recipient_failures(conn: Any, limit: int) -> list[Any]:
    return conn.execute(sa.select(IN.c.id, IN.c.coordinator, IN.c.state, IN.c.error)
                        .where(IN.c.state.in_(["failed", "compensation-failed"]))
                        .order_by(IN.c.updated_at).limit(limit)).all()


def entries(conn: Any, everything: bool) -> list[Any]:
    query = sa.select(OUT.c.id, OUT.c.gtrid, OUT.c.channel, OUT.c.action, OUT.c.state, OUT.c.recipient,
                      OUT.c.coupling, OUT.c.reason, OUT.c.updated_at).order_by(OUT.c.created_at)
    if not everything:
        query = query.where(OUT.c.state == states.ABORTED, OUT.c.recipient.not_in(states.SETTLED))
    return conn.execute(query).all()


def lock_aborted(conn: Any, ids: list[str] | None) -> list[Any]:
    """Aborted rows to send the Abort of again (``ids``, or None: every open entry), locked."""
    query = sa.select(OUT.c.id, OUT.c.channel, OUT.c.compensation, OUT.c.token).where(OUT.c.state == states.ABORTED)
    query = query.where(OUT.c.id.in_(ids)) if ids else query.where(OUT.c.recipient.not_in(states.SETTLED))
    return conn.execute(query.with_for_update()).all()


def touch(conn: Any, coupling_id: str) -> None:
    conn.execute(OUT.update().where(OUT.c.id == coupling_id).values(updated_at=time.time()))
