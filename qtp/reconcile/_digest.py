"""Digest mode: each database summarises ranges of keys in its own SQL, and only ranges that differ are read.

For every range of keys (a bucket), each side computes, in one ``GROUP BY bucket`` query, the number of rows
and an order-independent digest of its rows: the sum, per 60-bit slice, of the SHA-256 of each row's
canonical encoding. The sums are exact (PostgreSQL ``numeric``, MariaDB ``DECIMAL``), so the two servers agree
bit for bit when, and only when, they hold the same multiset of encoded rows (up to a SHA-256 collision).

The canonical encoding of a row is the concatenation of its fields: a text value as ``<length>:<text>``
(length in characters), any other value as ``<text>;`` (no such text holds a ``;``), NULL as ``#``, so that
NULL, ``''`` and ``'#'`` all differ and no two field lists run together. The fields are the key, the compared
columns in mapping order, and the status (last, one character): ``c`` when the client's status is
``committed`` (every server row is ``c``), ``x`` otherwise. The text of a value by kind:

    integer     decimal digits, e.g. ``-42``
    decimal     the value without trailing fractional zeros: ``1.50`` -> ``1.5``, ``2.00`` -> ``2``
    boolean     ``1`` / ``0`` (PostgreSQL ``boolean``; a MariaDB ``BOOL`` is an integer and is not paired)
    text        the characters as stored (trailing spaces kept), hashed as UTF-8
    date        ``YYYY-MM-DD``
    timestamp   ``YYYY-MM-DD HH:MM:SS.ffffff``; a zoned type (``timestamptz``, MariaDB ``TIMESTAMP``) in UTC

A client row whose status is ``aborted`` is left out of the digest (an aborted message absent from the server
is ok) but counted. A range is ``ok`` without reading a row when both digests and the number of digested
rows agree: then every client row there is committed or aborted, every committed one is on the server once
with equal values, and the server holds nothing else. The ``NULL``-key range is always read. Floating-point
columns, key or column kinds that the encoding does not pair, and client keys without a unique index (a key
sent twice must be classified per row) make digest mode unavailable: ``auto`` then runs the full mode and
``digest`` is refused with the reason.
"""

from __future__ import annotations

import datetime as dt
import decimal
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.dialects import mysql

from qtp.reconcile._sources import ProbedTable, connect, quote_table

ROWS_PER_RANGE = 1024  # integer keys: the width of a range, for dense keys
MAX_RANGES = 65536
HASH_BITS = 12  # text keys: ranges are the first 12 bits of the key's MD5 (4096 ranges)
SLICES = 2  # 60-bit slices of the SHA-256 summed per range: a 120-bit digest
NULL_RANGE = -1
SAMPLE_RANGES = 64  # auto mode: ranges digested first, to tell the usual case from a dense one
DENSE = 0.5  # auto mode: above this fraction of differing sampled ranges, read everything


@dataclass(frozen=True)
class Plan:
    """How the keys are cut into ranges; ``reason`` says why digest mode cannot run (None when it can)."""

    reason: str | None
    kinds: tuple[tuple[str, str], ...] = ()  # (client kind, server kind) of the key, then of every column
    lower: int = 0  # integer keys: first key of range 0
    width: int = 0  # integer keys: keys per range; 0 for text keys (hashed)


@dataclass
class Digests:
    """The comparison: which ranges must be read, and what the agreeing ranges hold."""

    differing: list[int]
    ok_keys: int  # client rows in agreeing ranges: each is an ok key
    ok_server_rows: int
    ranges: int


def kind(sa_type: sa.types.TypeEngine) -> str | None:
    """The canonical kind of a reflected column type, or None when no exact encoding exists (floats)."""
    if isinstance(sa_type, sa.Boolean):
        return "boolean"
    if isinstance(sa_type, sa.Float) or isinstance(sa_type, (mysql.FLOAT, mysql.DOUBLE, mysql.REAL)):
        return None
    if isinstance(sa_type, sa.DateTime) or isinstance(sa_type, (mysql.TIMESTAMP, mysql.DATETIME)):
        zoned = isinstance(sa_type, mysql.TIMESTAMP) or bool(getattr(sa_type, "timezone", False))
        return "timestamptz" if zoned else "timestamp"
    try:
        python = sa_type.python_type
    except NotImplementedError:
        return None
    return {int: "integer", decimal.Decimal: "decimal", str: "text", dt.date: "date"}.get(python)


_PAIRS_OK = {frozenset({"integer", "decimal"})}


def plan(client: ProbedTable, server: ProbedTable, pairs: Sequence[tuple[str, str]], width: int = 0) -> Plan:
    """Decide whether digest mode can run on these two tables, and cut the keys into ranges."""
    if not client.key_is_unique:
        return Plan(f"client key {client.spec.key!r} has no unique index (a key sent twice is classified per row)")
    columns = [(client.spec.key, server.spec.key), *pairs]
    kinds = []
    for c_col, s_col in columns:
        ck, sk = kind(client.types[c_col]), kind(server.types[s_col])
        if ck is None or sk is None or (ck != sk and frozenset({ck, sk}) not in _PAIRS_OK):
            return Plan(f"column {c_col!r} ({client.types[c_col]}) and {s_col!r} ({server.types[s_col]}) have no "
                        "common canonical encoding (floating point, or different kinds)")
        kinds.append((ck, sk))
    if kinds[0][0] != kinds[0][1] or kinds[0][0] not in ("integer", "text"):
        return Plan("digest ranges need integer or text keys of the same kind on both sides")
    if kinds[0][0] == "text":
        return Plan(None, tuple(kinds))
    bounds = [b for b in (client.key_bounds, server.key_bounds) if b is not None]
    lower = min((b.lower for b in bounds), default=0)
    upper = max((b.upper for b in bounds), default=0)
    span = upper - lower + 1
    width = max(width or ROWS_PER_RANGE, -(-span // MAX_RANGES))
    return Plan(None, tuple(kinds), lower, width)


# ------------------------------------------------------------------------------------------------ SQL


def _q(name: str, backend: str) -> str:
    return quote_table(name, backend)


def _text(col: str, kind_: str, backend: str, scale: int | None) -> str:
    """SQL for the canonical text of a non-NULL value of ``col`` (NULL stays NULL)."""
    if backend == "postgresql":
        return {
            "integer": f"{col}::text",
            "decimal": f"trim_scale({col})::text",
            "boolean": f"CASE WHEN {col} THEN '1' ELSE '0' END",
            "text": f"{col}::text",
            "date": f"to_char({col}, 'YYYY-MM-DD')",
            "timestamp": f"to_char({col}, 'YYYY-MM-DD HH24:MI:SS.US')",
            "timestamptz": f"to_char({col} AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.US')",
        }[kind_]
    as_char = f"CAST({col} AS CHAR)"
    # a DECIMAL with a scale always prints its point, one without never does
    decimal_text = f"TRIM(TRAILING '.' FROM TRIM(TRAILING '0' FROM {as_char}))" if scale else as_char
    return {
        "integer": as_char,
        "decimal": decimal_text,
        "boolean": f"CASE WHEN {col} THEN '1' ELSE '0' END",
        "text": f"CONVERT({col} USING utf8mb4)",
        "date": f"DATE_FORMAT({col}, '%Y-%m-%d')",
        "timestamp": f"DATE_FORMAT({col}, '%Y-%m-%d %H:%i:%s.%f')",
        "timestamptz": f"DATE_FORMAT({col}, '%Y-%m-%d %H:%i:%s.%f')",  # the session runs in UTC
    }[kind_]


def _field(col: str, kind_: str, backend: str, scale: int | None = None) -> str:
    """Text: ``<length>:<text>``; any other kind (no ``;`` in its text): ``<text>;``; NULL: ``#``."""
    text = _text(col, kind_, backend, scale)
    if backend == "postgresql":
        encoded = f"char_length({col}) || ':' || {text}" if kind_ == "text" else f"{text} || ';'"
        return f"COALESCE({encoded}, '#')"
    encoded = f"CHAR_LENGTH({col}), ':', {text}" if kind_ == "text" else f"{text}, ';'"
    return f"COALESCE(CONCAT({encoded}), '#')"


def _status(probed: ProbedTable) -> tuple[str, str]:
    """(encoded status, SQL condition for a row that is digested) for one side."""
    column = probed.spec.status_column
    if column is None:
        return "'c'", "1 = 1"
    cast = f"{_q(column, probed.backend)}::text" if probed.backend == "postgresql" else \
        f"CAST({_q(column, probed.backend)} AS CHAR)"
    normal = f"lower(trim({cast}))"
    return f"CASE WHEN {normal} = 'committed' THEN 'c' ELSE 'x' END", f"COALESCE({normal}, '') <> 'aborted'"


def range_of(probed: ProbedTable, p: Plan) -> str:
    """SQL for the range number of a row's key (NULL for a NULL key)."""
    key = _q(probed.spec.key, probed.backend)
    if p.width:
        division = "/" if probed.backend == "postgresql" else "DIV"
        return f"(({key} - {p.lower}) {division} {p.width})"
    hexes = HASH_BITS // 4
    if probed.backend == "postgresql":
        return f"('x' || substr(md5({key}::text), 1, {hexes}))::bit({HASH_BITS})::int"
    return f"CAST(CONV(SUBSTR(MD5(CONVERT({key} USING utf8mb4)), 1, {hexes}), 16, 10) AS SIGNED)"


def digest_sql(probed: ProbedTable, p: Plan, columns: Sequence[str], side: int, where: str | None = None) -> str:
    """One query: range, rows, digested rows and the slice sums, per range."""
    backend = probed.backend
    names = [probed.spec.key, *columns]
    fields = [_field(_q(col, backend), kinds[side], backend, getattr(probed.types[col], "scale", None))
              for col, kinds in zip(names, p.kinds)]
    status, digested = _status(probed) if side == 0 else ("'c'", "1 = 1")
    if backend == "postgresql":
        row = " || ".join([*fields, status])
        hashed = f"encode(sha256(convert_to({row}, 'UTF8')), 'hex')"
        slices = [f"('x' || substr(h, {1 + 15 * i}, 15))::bit(60)::bigint" for i in range(SLICES)]
    else:
        row = "CONCAT(" + ", ".join([*fields, status]) + ")"
        hashed = f"SHA2({row}, 256)"
        slices = [f"CAST(CONV(SUBSTR(h, {1 + 15 * i}, 15), 16, 10) AS UNSIGNED)" for i in range(SLICES)]
    sums = ", ".join(f"SUM(CASE WHEN d THEN {s} END) AS s{i}" for i, s in enumerate(slices))
    inner = (f"SELECT {range_of(probed, p)} AS r, ({digested}) AS d, {hashed} AS h "
             f"FROM {_q(probed.spec.table, backend)}{f' WHERE {where}' if where else ''}")
    return (f"SELECT r, COUNT(*) AS n, SUM(CASE WHEN d THEN 1 ELSE 0 END) AS dn, {sums} "
            f"FROM ({inner}) t GROUP BY r")


def _session(conn: sa.Connection, backend: str) -> None:
    """UTC for zoned timestamps; in PostgreSQL, a hash aggregate (it expects a group per row) and no JIT."""
    if backend == "postgresql":
        for setting in ("SET TIME ZONE 'UTC'", "SET jit = off", "SET work_mem = '256MB'"):
            conn.exec_driver_sql(setting)
    else:
        conn.exec_driver_sql("SET time_zone = '+00:00'")


def fetch(probed: ProbedTable, p: Plan, columns: Sequence[str], side: int,
          ranges: Sequence[int] | None = None) -> dict[int, tuple]:
    """Run one side's digest query: {range: (rows, digested rows, sum 0, sum 1, ...)}; NULL keys -> -1."""
    engine = connect(probed.spec)
    try:
        with engine.connect() as conn:
            _session(conn, probed.backend)
            where = predicates(probed, p, ranges, 1)[0] if ranges else None
            sql = digest_sql(probed, p, columns, side, where)
            if probed.backend == "mysql":
                sql = sql.replace("%", "%%")  # PyMySQL formats the statement with %
            rows = conn.exec_driver_sql(sql).all()
    finally:
        engine.dispose()
    return {NULL_RANGE if r[0] is None else int(r[0]): tuple(int(v or 0) for v in r[1:]) for r in rows}


def compare(client: dict[int, tuple], server: dict[int, tuple]) -> Digests:
    """Ranges whose digested rows and sums agree are ok; the rest (and the NULL-key range) are read."""
    differing, ok_keys, ok_server = [], 0, 0
    for r in sorted(set(client) | set(server)):
        c, s = client.get(r), server.get(r)
        if r != NULL_RANGE and c is not None and s is not None and c[1:] == (s[0], *s[2:]):
            ok_keys += c[0]
            ok_server += s[0]
        elif r != NULL_RANGE and c is not None and s is None and c[1] == 0:
            ok_keys += c[0]  # only aborted messages, none applied
        else:
            differing.append(r)
    return Digests(differing, ok_keys, ok_server, len(set(client) | set(server)))


def digests(client: ProbedTable, server: ProbedTable, p: Plan, pairs: Sequence[tuple[str, str]],
            ranges: Sequence[int] | None = None) -> Digests:
    """Both sides' digest queries (of every range, or of ``ranges`` only), run at once, compared."""
    with ThreadPoolExecutor(2) as pool:
        c = pool.submit(fetch, client, p, [c for c, _ in pairs], 0, ranges)
        s = pool.submit(fetch, server, p, [s for _, s in pairs], 1, ranges)
        return compare(c.result(), s.result())


def sample(client: ProbedTable, server: ProbedTable, p: Plan, count: int = SAMPLE_RANGES) -> list[int]:
    """Up to ``count`` integer-key ranges spread evenly over the keys (each read through the key's index)."""
    bounds = [b.upper for b in (client.key_bounds, server.key_bounds) if b is not None]
    if not p.width or not bounds:
        return []
    last = (max(bounds) - p.lower) // p.width
    return sorted({last * i // max(1, count - 1) for i in range(count)})


def predicates(probed: ProbedTable, p: Plan, ranges: Sequence[int], partitions: int) -> list[str]:
    """WHERE clauses (at most ``partitions`` + 1) that together select exactly the rows of ``ranges``."""
    key = _q(probed.spec.key, probed.backend)
    wanted = [r for r in ranges if r != NULL_RANGE]
    size = -(-len(wanted) // partitions) if wanted else 1
    groups = [wanted[i:i + size] for i in range(0, len(wanted), size)]
    if p.width:
        spans = [_spans(sorted(group)) for group in groups if group]
        clauses = [" OR ".join(f"({key} >= {p.lower + a * p.width} AND {key} < {p.lower + b * p.width})"
                               for a, b in group) for group in spans]
    else:
        expr = range_of(probed, p)
        clauses = [f"{expr} IN ({', '.join(map(str, group))})" for group in groups if group]
    if NULL_RANGE in ranges:
        clauses.append(f"{key} IS NULL")
    return clauses


def _spans(ranges: list[int]) -> list[tuple[int, int]]:
    """Consecutive range numbers merged: [1, 2, 3, 7] -> [(1, 4), (7, 8)]."""
    spans: list[tuple[int, int]] = []
    for r in ranges:
        if spans and spans[-1][1] == r:
            spans[-1] = (spans[-1][0], r + 1)
        else:
            spans.append((r, r + 1))
    return spans
