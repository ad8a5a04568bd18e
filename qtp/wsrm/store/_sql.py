"""The SQL store: WS-RM state in tables of a PostgreSQL or MariaDB database, defined once with SQLAlchemy Core.

Sessions are SQLAlchemy ``Connection`` objects: the store's own engine for local transactions, or the
branch connection of a global transaction (``tx.connection(resource)``), so that in ``xa`` mode enqueue
and dequeue are statements of the application's transaction.

Why concurrent senders do not serialise: ``enqueue`` is a single INSERT into ``qtp_rm_outgoing`` whose
key comes from the database's identity column; it touches no shared row. Message numbers are given later
by the node's one sender thread, in its own short local transaction (``assign``), so no lock is ever held
across a two-phase commit on behalf of a sequence.

Tables are created by ``create()`` outside any XA transaction (MariaDB refuses DDL inside one).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from typing import Any, Callable, Iterator

import sqlalchemy as sa
from sqlalchemy.dialects import mysql, postgresql
from sqlalchemy.engine import Connection, Engine

from qtp.errors import ConfigurationError

from qtp.wsrm.protocol import _ranges as ranges
from qtp.wsrm.protocol import (
    AckRanges,
    DestinationRecord,
    InvokerRecord,
    SourceRecord,
    from_row,
    to_row,
)
from qtp.wsrm.store._contract import (
    DeadLetter,
    DestinationInfo,
    Incoming,
    Outgoing,
    SourceInfo,
    Store,
    Summary,
)

_BLOB = sa.LargeBinary().with_variant(mysql.LONGBLOB(), "mysql", "mariadb")
_TEXT = sa.Text().with_variant(mysql.LONGTEXT(), "mysql", "mariadb")
_ID = sa.String(255)

class Tables:
    """The store's tables for one slot of a node (``prefix``: ``qtp_rm_`` for a node without slots, and for
    slot 0, so that a node that takes up slots keeps its state there); the applied MessageIDs are one table for
    every slot (``qtp_rm_applied``): a message sent again in a new sequence is recognised whichever slot takes it."""

    def __init__(self, prefix: str = "qtp_rm_"):
        self.prefix = prefix
        self.metadata = metadata = sa.MetaData()
        self.outgoing = sa.Table(
            prefix + "outgoing", metadata,
            sa.Column("seq", sa.BigInteger().with_variant(sa.Integer, "sqlite"), sa.Identity(), primary_key=True),
            sa.Column("route", _ID, nullable=False),
            sa.Column("message_id", _ID, nullable=False),
            sa.Column("action", sa.String(1024), nullable=False),
            sa.Column("payload", _BLOB),
            sa.Column("relates_to", _ID),
            sa.Column("fault", _TEXT),
            sa.Column("enqueued_at", sa.Float(53), nullable=False),
            sa.Column("seq_key", sa.String(64)),
            sa.Column("number", sa.BigInteger),
            sa.Index(prefix + "outgoing_route", "route", "seq_key", "seq"),
            sa.Index(prefix + "outgoing_number", "seq_key", "number", unique=True),  # a number names one message
        )
        self.sources = sa.Table(
            prefix + "source", metadata,
            sa.Column("seq_key", sa.String(64), primary_key=True),
            sa.Column("info", _TEXT, nullable=False),
            sa.Column("record", _TEXT, nullable=False),
        )
        self.destinations = sa.Table(
            prefix + "destination", metadata,
            sa.Column("identifier", _ID, primary_key=True),
            sa.Column("info", _TEXT, nullable=False),
            sa.Column("record", _TEXT, nullable=False),
        )
        # a destination's received numbers once it has more than _INLINE ranges: a row per range
        self.received = sa.Table(
            prefix + "received", metadata,
            sa.Column("identifier", _ID, primary_key=True),
            sa.Column("lower", sa.BigInteger, primary_key=True, autoincrement=False),
            sa.Column("upper", sa.BigInteger, nullable=False),
        )
        self.incoming = sa.Table(
            prefix + "incoming", metadata,
            sa.Column("identifier", _ID, primary_key=True),
            sa.Column("number", sa.BigInteger, primary_key=True, autoincrement=False),
            sa.Column("message_id", _ID, nullable=False),
            sa.Column("action", sa.String(1024), nullable=False),
            sa.Column("payload", _BLOB),
            sa.Column("relates_to", _ID),
            sa.Column("fault", _TEXT),
            sa.Column("received_at", sa.Float(53), nullable=False),
            sa.Column("enqueued_at", sa.Float(53)),
            sa.Column("attempts", sa.Integer, nullable=False, default=0),
            sa.Column("not_before", sa.Float(53), nullable=False, default=0.0),
            sa.Column("last_error", _TEXT),
        )
        self.invokers = sa.Table(
            prefix + "invoker", metadata,
            sa.Column("identifier", _ID, primary_key=True),
            sa.Column("record", _TEXT, nullable=False),
        )
        self.dead_letters = sa.Table(
            prefix + "dead_letter", metadata,
            sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), sa.Identity(), primary_key=True),
            sa.Column("identifier", _ID, nullable=False),
            sa.Column("number", sa.BigInteger, nullable=False),
            sa.Column("message", _TEXT, nullable=False),
            sa.Column("payload", _BLOB),
            sa.Column("error", _TEXT, nullable=False),
            sa.Column("failed_at", sa.Float(53), nullable=False),
        )
        self.applied = sa.Table(
            "qtp_rm_applied", metadata,
            sa.Column("message_id", _ID, primary_key=True),
            sa.Column("applied_at", sa.Float(53), nullable=False),
            sa.Index("qtp_rm_applied_at", "applied_at"),
        )


_TABLES: dict[str, Tables] = {}


def tables(prefix: str = "qtp_rm_") -> Tables:
    """The (cached) table set of ``prefix``."""
    if prefix not in _TABLES:
        _TABLES[prefix] = Tables(prefix)
    return _TABLES[prefix]


_INLINE = 16  # up to this many received ranges travel in the record's JSON (no extra statement per commit)

_INCOMING_FIELDS = ("identifier", "number", "message_id", "action", "payload", "relates_to", "fault",
                    "received_at", "enqueued_at", "attempts", "not_before", "last_error")


def _dump(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _incoming(row: Any) -> Incoming:
    m = row._mapping
    return Incoming(**{f: m[f] for f in _INCOMING_FIELDS})


def _outgoing(row: Any) -> Outgoing:
    m = row._mapping
    return Outgoing(route=m["route"], message_id=m["message_id"], action=m["action"], payload=m["payload"],
                    enqueued_at=m["enqueued_at"], relates_to=m["relates_to"], fault=m["fault"], seq=m["seq"],
                    key=m["seq_key"], number=m["number"])


def _numbers_in(outgoing: sa.Table, ranges: AckRanges) -> sa.ColumnElement[bool]:
    return sa.or_(*(outgoing.c.number.between(lower, upper) for lower, upper in ranges))


class SqlStore(Store):
    """The store in one SQL database. ``resource`` is the name of the qtp resource it belongs to."""

    durable = True

    def __init__(self, resource: str, engine: Engine, fence: Callable[[Any, str], None] | None = None,
                 prefix: str = "qtp_rm_"):
        self.name = resource
        self.engine = engine
        self.t = tables(prefix)  # a slot of a node whose replicas share the work has tables of its own
        # a node run as replicas ([lease]): fence(dbapi_connection, family) before every commit
        self.fence = fence
        self._family = "postgresql" if engine.dialect.name == "postgresql" else "mysql"

    def __repr__(self) -> str:
        return f"<SqlStore {self.name} {self.engine.url.render_as_string(hide_password=True)}>"

    def create(self) -> None:
        """Create the tables if missing. Refuses an engine whose connections autocommit (a MySQL XA
        resource's engine is one): the store's local transactions would not be atomic on it."""
        if self.engine.dialect.name in ("mysql", "mariadb"):
            with self.engine.connect() as conn:
                if conn.exec_driver_sql("SELECT @@autocommit").scalar():
                    raise ConfigurationError(
                        f"store {self.name!r}: its engine autocommits, so its transactions would not be atomic; "
                        "give the store an engine of its own (sqlalchemy.create_engine(url))")
        self.t.metadata.create_all(self.engine)

    @contextlib.contextmanager
    def local(self) -> Iterator[Connection]:
        with self.engine.begin() as conn:
            yield conn
            if self.fence is not None:
                self.fence(conn.connection.dbapi_connection, self._family)

    # ------------------------------------------------------------------ RM Source side

    def enqueue(self, s: Connection, message: Outgoing) -> None:
        s.execute(self.t.outgoing.insert(), {
            "route": message.route, "message_id": message.message_id, "action": message.action,
            "payload": message.payload, "relates_to": message.relates_to, "fault": message.fault,
            "enqueued_at": message.enqueued_at,
        })

    def unnumbered(self, s: Connection, route: str, limit: int) -> list[Outgoing]:
        t = self.t
        query = (t.outgoing.select().where(t.outgoing.c.route == route, t.outgoing.c.seq_key.is_(None))
                 .order_by(t.outgoing.c.seq).limit(limit))
        return [_outgoing(row) for row in s.execute(query)]

    def assign(self, s: Connection, key: str, numbered: list[tuple[int, int]]) -> None:
        """One UPDATE for the whole batch (a CASE maps each row to its number)."""
        t = self.t
        if numbered:
            numbers = dict(numbered)
            s.execute(t.outgoing.update().where(t.outgoing.c.seq.in_(list(numbers)))
                      .values(seq_key=key, number=sa.case(numbers, value=t.outgoing.c.seq)))

    def numbered(self, s: Connection, key: str, numbers: list[int] | None = None) -> list[Outgoing]:
        t = self.t
        query = t.outgoing.select().where(t.outgoing.c.seq_key == key)
        if numbers is not None:
            query = query.where(t.outgoing.c.number.in_(numbers))
        return [_outgoing(row) for row in s.execute(query.order_by(t.outgoing.c.number))]

    def release(self, s: Connection, key: str, ranges: AckRanges) -> int:
        t = self.t
        if not ranges:
            return 0
        return s.execute(t.outgoing.update().where(t.outgoing.c.seq_key == key, _numbers_in(t.outgoing, ranges))
                         .values(seq_key=None, number=None)).rowcount

    def acknowledged(self, s: Connection, key: str, ranges: AckRanges) -> int:
        t = self.t
        if not ranges:
            return 0
        query = t.outgoing.delete().where(t.outgoing.c.seq_key == key, _numbers_in(t.outgoing, ranges))
        return s.execute(query).rowcount

    def backlog(self, s: Connection, route: str | None = None) -> int:
        t = self.t
        query = sa.select(sa.func.count()).select_from(t.outgoing)
        if route is not None:
            query = query.where(t.outgoing.c.route == route)
        return int(s.execute(query).scalar_one())

    def save_source(self, s: Connection, info: SourceInfo, record: SourceRecord) -> None:
        record = dataclasses.replace(record, pending=())  # rebuilt from the numbered rows (contract)
        self._upsert(s, self.t.sources, {"seq_key": record.key},
                     {"info": _dump(_fields(info)), "record": _dump(to_row(record))})

    def create_source(self, s: Connection, info: SourceInfo, record: SourceRecord) -> None:
        record = dataclasses.replace(record, pending=())
        s.execute(self.t.sources.insert().values(seq_key=record.key, info=_dump(_fields(info)),
                                                 record=_dump(to_row(record))))

    def sources(self, s: Connection) -> list[tuple[SourceInfo, SourceRecord]]:
        return _with_info(s, self.t.sources, SourceInfo, SourceRecord)

    def drop_source(self, s: Connection, key: str) -> None:
        t = self.t
        s.execute(t.outgoing.delete().where(t.outgoing.c.seq_key == key))
        s.execute(t.sources.delete().where(t.sources.c.seq_key == key))

    # ------------------------------------------------------------------ RM Destination side

    def save_destination(self, s: Connection, info: DestinationInfo, record: DestinationRecord,
                         before: DestinationRecord | None = None) -> None:
        """The record's fixed fields as one small JSON; its received numbers, once they are more than
        ``_INLINE`` ranges (a sequence with gaps), as rows of ``qtp_rm_received`` of which only those that
        differ from ``before`` (the committed record, when the caller knows it) are written: a message that
        opens or closes a gap costs a row or two, however many gaps the sequence has."""
        t = self.t
        inline, rows = _split(record.received)
        self._upsert(s, t.destinations, {"identifier": record.identifier},
                     {"info": _dump(_fields(info)), "record": _dump(to_row(dataclasses.replace(record, received=inline)))})
        key = t.received.c.identifier == record.identifier
        if before is None:
            s.execute(t.received.delete().where(key))
            old: set[tuple[int, int]] = set()
        else:
            old = set(_split(before.received)[1])
        new = set(rows)
        gone = [lower for lower, _ in old - new]
        if gone:
            s.execute(t.received.delete().where(key, t.received.c.lower.in_(gone)))
        added = new - old
        if added:
            s.execute(t.received.insert(), [{"identifier": record.identifier, "lower": lower, "upper": upper}
                                          for lower, upper in sorted(added)])

    def create_destination(self, s: Connection, info: DestinationInfo, record: DestinationRecord) -> None:
        """A plain INSERT: the upsert's UPDATE of a missing row takes a gap lock in InnoDB, and two
        CreateSequence committing at once then deadlocked (one got 503)."""
        assert len(record.received) <= _INLINE, "a new sequence has received nothing"
        s.execute(self.t.destinations.insert().values(identifier=record.identifier, info=_dump(_fields(info)),
                                               record=_dump(to_row(record))))

    def destinations(self, s: Connection) -> list[tuple[DestinationInfo, DestinationRecord]]:
        """Every record with its received ranges whole again. A record whose JSON holds more than
        ``_INLINE`` ranges (written before ranges had rows) has them moved to rows here, so that a later
        save that writes only the difference starts from what the rows hold."""
        t = self.t
        rows: dict[str, list[tuple[int, int]]] = {}
        r = t.received
        for identifier, lower, upper in s.execute(sa.select(r.c.identifier, r.c.lower, r.c.upper)
                                                  .order_by(r.c.identifier, r.c.lower)):
            rows.setdefault(identifier, []).append((lower, upper))
        result = []
        for info, record in _with_info(s, t.destinations, DestinationInfo, DestinationRecord):
            whole = ranges.union(record.received, rows.get(record.identifier, ()))
            record = dataclasses.replace(record, received=whole)
            if len(whole) > _INLINE and record.identifier not in rows:
                self.save_destination(s, info, record)
            result.append((info, record))
        return result

    def drop_destination(self, s: Connection, identifier: str) -> None:
        t = self.t
        for table in (t.incoming, t.invokers, t.received, t.destinations):
            s.execute(table.delete().where(table.c.identifier == identifier))

    def store_incoming(self, s: Connection, message: Incoming) -> bool:
        t = self.t
        exists = s.execute(sa.select(t.incoming.c.number).where(
            t.incoming.c.identifier == message.identifier, t.incoming.c.number == message.number)).first()
        if exists is not None:
            return False
        s.execute(t.incoming.insert(), {f: getattr(message, f) for f in _INCOMING_FIELDS})
        return True

    def store_incoming_many(self, s: Connection, messages: list[Incoming]) -> None:
        """One multi-row INSERT that skips rows already stored (the primary key is (identifier, number))."""
        t = self.t
        if not messages:
            return
        if s.dialect.name == "postgresql":
            statement: Any = postgresql.insert(t.incoming).on_conflict_do_nothing()
        elif s.dialect.name in ("mysql", "mariadb"):
            statement = mysql.insert(t.incoming)
            statement = statement.on_duplicate_key_update(identifier=statement.inserted.identifier)
        else:
            for message in messages:
                self.store_incoming(s, message)
            return
        s.execute(statement, [{f: getattr(m, f) for f in _INCOMING_FIELDS} for m in messages])

    def incoming(self, s: Connection, identifier: str | None = None, number: int | None = None,
                 start: int | None = None, limit: int | None = None) -> list[Incoming]:
        t = self.t
        query = t.incoming.select().order_by(t.incoming.c.identifier, t.incoming.c.number)
        if identifier is not None:
            query = query.where(t.incoming.c.identifier == identifier)
        if number is not None:
            query = query.where(t.incoming.c.number == number)
        if start is not None:
            query = query.where(t.incoming.c.number >= start)
        if limit is not None:
            query = query.limit(limit)
        return [_incoming(row) for row in s.execute(query)]

    def consume(self, s: Connection, identifier: str, number: int) -> bool:
        t = self.t
        result = s.execute(t.incoming.delete().where(t.incoming.c.identifier == identifier,
                                                   t.incoming.c.number == number))
        return result.rowcount == 1

    def applied_before(self, s: Connection, message_ids: list[str]) -> set[str]:
        t = self.t
        if not message_ids:
            return set()
        query = sa.select(t.applied.c.message_id).where(t.applied.c.message_id.in_(message_ids))
        return {row[0] for row in s.execute(query)}

    def remember_applied(self, s: Connection, message_ids: list[str], now: float) -> None:
        """A plain INSERT: a MessageID remembered already violates the primary key and fails the apply."""
        if message_ids:
            s.execute(self.t.applied.insert(), [{"message_id": m, "applied_at": now} for m in message_ids])

    def forget_applied(self, s: Connection, before: float, limit: int) -> int:
        t = self.t
        old = sa.select(t.applied.c.message_id).where(t.applied.c.applied_at < before).limit(limit)
        ids = [row[0] for row in s.execute(old)]
        if not ids:
            return 0
        return s.execute(t.applied.delete().where(t.applied.c.message_id.in_(ids))).rowcount

    def consume_many(self, s: Connection, identifier: str, numbers: list[int]) -> int:
        t = self.t
        if not numbers:
            return 0
        return s.execute(t.incoming.delete().where(t.incoming.c.identifier == identifier,
                                                 t.incoming.c.number.in_(numbers))).rowcount

    def note_failure(self, s: Connection, identifier: str, number: int, error: str, not_before: float) -> None:
        t = self.t
        s.execute(t.incoming.update().where(t.incoming.c.identifier == identifier, t.incoming.c.number == number)
                  .values(attempts=t.incoming.c.attempts + 1, not_before=not_before, last_error=error[:4000]))

    def save_invoker(self, s: Connection, record: InvokerRecord) -> None:
        self._upsert(s, self.t.invokers, {"identifier": record.identifier}, {"record": _dump(to_row(record))})

    def invokers(self, s: Connection) -> list[InvokerRecord]:
        t = self.t
        return [from_row(InvokerRecord, json.loads(row.record))
                for row in s.execute(t.invokers.select().order_by(t.invokers.c.identifier))]

    def summary(self, s: Connection) -> Summary:
        t = self.t
        o = t.outgoing
        out = s.execute(sa.select(o.c.route, o.c.seq_key, sa.func.count(), sa.func.min(o.c.enqueued_at))
                        .group_by(o.c.route, o.c.seq_key))
        inc = s.execute(sa.select(t.incoming.c.identifier, sa.func.count()).group_by(t.incoming.c.identifier))
        dead = s.execute(sa.select(sa.func.count()).select_from(t.dead_letters)).scalar_one()
        return Summary({(r, k): (int(n), float(t)) for r, k, n, t in out}, {i: int(n) for i, n in inc}, int(dead))

    # ------------------------------------------------------------------ dead letters

    def dead_letter(self, s: Connection, message: Incoming, error: str, now: float, peer: str | None = None) -> None:
        self.consume(s, message.identifier, message.number)
        described = {f: getattr(message, f) for f in _INCOMING_FIELDS if f != "payload"}
        described["peer"] = peer  # in the JSON description: tables made before the peer was kept still fit
        s.execute(self.t.dead_letters.insert(), {"identifier": message.identifier, "number": message.number,
                                          "message": _dump(described), "payload": message.payload,
                                          "error": error[:4000], "failed_at": now})

    def dead_letters(self, s: Connection) -> list[DeadLetter]:
        t = self.t
        return [self._letter(row) for row in s.execute(t.dead_letters.select().order_by(t.dead_letters.c.id))]

    def dead_letters_per_peer(self, s: Connection) -> dict[str | None, int]:
        counts: dict[str | None, int] = {}
        for (described,) in s.execute(sa.select(self.t.dead_letters.c.message)):
            peer = json.loads(described).get("peer")
            counts[peer] = counts.get(peer, 0) + 1
        return counts

    def take_dead_letter(self, s: Connection, letter_id: int) -> DeadLetter | None:
        t = self.t
        row = s.execute(t.dead_letters.select().where(t.dead_letters.c.id == letter_id)).first()
        if row is None:
            return None
        s.execute(t.dead_letters.delete().where(t.dead_letters.c.id == letter_id))
        return self._letter(row)

    @staticmethod
    def _letter(row: Any) -> DeadLetter:
        fields = json.loads(row.message)
        peer = fields.pop("peer", None)
        return DeadLetter(id=row.id, message=Incoming(payload=row.payload, **fields), error=row.error,
                          failed_at=row.failed_at, peer=peer)

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _upsert(s: Connection, table: sa.Table, key: dict[str, Any], values: dict[str, Any]) -> None:
        """Update the row of ``key``, inserting it when missing (the node's one process is the only writer)."""
        column, value = next(iter(key.items()))
        updated = s.execute(table.update().where(table.c[column] == value).values(**values)).rowcount
        if updated == 0:
            s.execute(table.insert().values(**key, **values))


def _with_info(s: Connection, table: sa.Table, info: type, record: type) -> list[Any]:
    """Every (info, machine record) pair saved in ``table``, by primary key."""
    return [(info(**json.loads(row.info)), from_row(record, json.loads(row.record)))
            for row in s.execute(table.select().order_by(*table.primary_key.columns))]


def _split(numbers: AckRanges) -> tuple[AckRanges, AckRanges]:
    """(the ranges kept in the record's JSON, the ranges kept as rows): all in one place or the other."""
    return (numbers, ()) if len(numbers) <= _INLINE else ((), numbers)


def _fields(value: Any) -> dict[str, Any]:
    return {name: getattr(value, name) for name in value.__slots__}
