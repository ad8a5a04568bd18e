"""Digest mode: each database summarises ranges of keys in its own SQL, and only ranges that differ are read.

For every range of keys (a bucket), each side computes, in one ``GROUP BY bucket`` query, the number of rows,
the number of digested rows and the SHA-256 of the concatenation of the digested rows' canonical encodings in
key order (integers by value, text by code point). The encoding of a row parses back into its fields, so two
ranges have the same digest when, and only when, they hold the same sequence of encoded rows (up to a SHA-256
collision). Equal multisets of rows give the same sequence when the keys are unique on both sides; a key the
server holds twice makes its range's row count differ from the client's (whose key is unique), so such a range
is read whatever order the copies come in. One hash per range, not one per row: hashing each row costs the
databases more than building its encoding (benchmarks/RESULTS.md, issue 12).

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

from qtp.errors import ReconcileError
from qtp.reconcile._sources import ProbedTable, connect, quote_table

ROWS_PER_RANGE = 1024  # integer keys: the width of a range, for dense keys
MAX_RANGES = 65536
HASH_BITS = 12  # text keys: ranges are the first 12 bits of the key's MD5 (4096 ranges)
NULL_RANGE = -1
MAX_SCALE = 38  # MariaDB's largest DECIMAL scale: a pair printed at a larger one is trimmed instead
SPLIT = 2  # digest queries per side (integer keys), run at once
SAMPLE_RANGES = 64  # auto mode: ranges digested first, to tell the usual case from a dense one
DENSE = 0.5  # auto mode: above this fraction of differing sampled ranges, read everything


@dataclass(frozen=True)
class Plan:
    """How the keys are cut into ranges; ``reason`` says why digest mode cannot run (None when it can)."""

    reason: str | None
    kinds: tuple[tuple[str, str], ...] = ()  # (client kind, server kind) of the key, then of every column
    lower: int = 0  # integer keys: first key of range 0
    width: int = 0  # integer keys: keys per range; 0 for text keys (hashed)
    # per column (key first): the scale both sides print a decimal pair at; None: trailing zeros trimmed
    scales: tuple[int | None, ...] = ()


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
    kinds, scales = [], []
    for c_col, s_col in columns:
        ck, sk = kind(client.types[c_col]), kind(server.types[s_col])
        if ck is None or sk is None or (ck != sk and frozenset({ck, sk}) not in _PAIRS_OK):
            return Plan(f"column {c_col!r} ({client.types[c_col]}) and {s_col!r} ({server.types[s_col]}) have no "
                        "common canonical encoding (floating point, or different kinds)")
        kinds.append((ck, sk))
        declared = (_scale(client.types[c_col]), _scale(server.types[s_col]))
        common = None if None in declared else max(declared)
        scales.append(common if "decimal" in (ck, sk) and common is not None and common <= MAX_SCALE else None)
    if kinds[0][0] != kinds[0][1] or kinds[0][0] not in ("integer", "text"):
        return Plan("digest ranges need integer or text keys of the same kind on both sides")
    if kinds[0][0] == "text":
        return Plan(None, tuple(kinds), scales=tuple(scales))
    bounds = [b for b in (client.key_bounds, server.key_bounds) if b is not None]
    lower = min((b.lower for b in bounds), default=0)
    upper = max((b.upper for b in bounds), default=0)
    span = upper - lower + 1
    width = max(width or ROWS_PER_RANGE, -(-span // MAX_RANGES))
    return Plan(None, tuple(kinds), lower, width, tuple(scales))


# ------------------------------------------------------------------------------------------------ SQL


def _q(name: str, backend: str) -> str:
    return quote_table(name, backend)


def _scale(sa_type: sa.types.TypeEngine) -> int | None:
    """The declared scale of a decimal column (0 for an integer), None when not declared."""
    if kind(sa_type) == "integer":
        return 0
    return getattr(sa_type, "scale", None)


def _decimal_text(col: str, backend: str, own: int | None, common: int | None) -> str:
    """A decimal (or an integer paired with one) printed at scale ``common``, or trimmed when it is None."""
    if common is not None:
        if own == common:  # a column prints its declared scale
            return f"{col}::text" if backend == "postgresql" else f"CAST({col} AS CHAR)"
        if backend == "postgresql":
            return f"round({col}::numeric, {common})::text"
        return f"CAST(CAST({col} AS DECIMAL(65, {common})) AS CHAR)"
    if backend == "postgresql":
        return f"trim_scale({col}::numeric)::text"
    # a DECIMAL with a scale always prints its point, one without never does
    return f"TRIM(TRAILING '.' FROM TRIM(TRAILING '0' FROM CAST({col} AS CHAR)))" if own else f"CAST({col} AS CHAR)"


def _text(col: str, kind_: str, backend: str) -> str:
    """SQL for the canonical text of a non-NULL value of ``col`` (NULL stays NULL), decimals aside."""
    if backend == "postgresql":
        return {
            "integer": f"{col}::text",
            "boolean": f"CASE WHEN {col} THEN '1' ELSE '0' END",
            "text": f"{col}::text",
            "date": f"to_char({col}, 'YYYY-MM-DD')",
            "timestamp": f"to_char({col}, 'YYYY-MM-DD HH24:MI:SS.US')",
            "timestamptz": f"to_char({col} AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.US')",
        }[kind_]
    return {
        "integer": f"CAST({col} AS CHAR)",
        "boolean": f"CASE WHEN {col} THEN '1' ELSE '0' END",
        "text": f"CONVERT({col} USING utf8mb4)",
        "date": f"DATE_FORMAT({col}, '%Y-%m-%d')",
        "timestamp": f"DATE_FORMAT({col}, '%Y-%m-%d %H:%i:%s.%f')",
        "timestamptz": f"DATE_FORMAT({col}, '%Y-%m-%d %H:%i:%s.%f')",  # the session runs in UTC
    }[kind_]


def _concat(backend: str, parts: Sequence[str]) -> str:
    return " || ".join(parts) if backend == "postgresql" else f"CONCAT({', '.join(parts)})"


def _field(col: str, kinds: tuple[str, str], side: int, probed: ProbedTable, common: int | None) -> list[str]:
    """Text: ``<length>:<text>``; any other kind (no ``;`` in its text): ``<text>;``; NULL: ``#``. The
    parts to concatenate: a NOT NULL column's go straight into the row's one concatenation (no NULL test, no
    concatenation of its own: MariaDB spent 13 % more on nested ``CONCAT``)."""
    backend, kind_ = probed.backend, kinds[side]
    sql = _q(col, backend)
    if "decimal" in kinds:
        text = _decimal_text(sql, backend, _scale(probed.types[col]), common)
    elif kind_ == "integer" and backend == "mysql":
        text = sql  # CONCAT prints an integer as CAST(... AS CHAR) does
    else:
        text = _text(sql, kind_, backend)
    length = "char_length" if backend == "postgresql" else "CHAR_LENGTH"
    parts = [f"{length}({sql})", "':'", text] if kind_ == "text" else [text, "';'"]
    return parts if col in probed.not_null else [f"COALESCE({_concat(backend, parts)}, '#')"]


def _status(probed: ProbedTable) -> str | None:
    """SQL for one side's status, lower case and trimmed (None when every row is committed)."""
    column = probed.spec.status_column
    if column is None:
        return None
    cast = f"{_q(column, probed.backend)}::text" if probed.backend == "postgresql" else \
        f"CAST({_q(column, probed.backend)} AS CHAR)"
    return f"lower(trim({cast}))"


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


def _order_key(probed: ProbedTable, p: Plan) -> str:
    """SQL for the key as both servers order it alike: integers as numbers, text by code point (no padding)."""
    key = _q(probed.spec.key, probed.backend)
    if p.width:
        return key
    if probed.backend == "postgresql":
        return f'{key}::text COLLATE "C"'
    return f"CONVERT({key} USING utf8mb4) COLLATE utf8mb4_nopad_bin"


def digest_sql(probed: ProbedTable, p: Plan, columns: Sequence[str], side: int, where: str | None = None) -> str:
    """One query: per range, the rows, the digested rows and the SHA-256 of their encodings in key order.

    Flat (no derived table), and each row's encoding written once: both servers substitute a derived table's
    expressions into the outer query and would build the encoding once per aggregate that uses it."""
    backend = probed.backend
    names = [probed.spec.key, *columns]
    fields = [part for col, kinds, common in zip(names, p.kinds, p.scales)
              for part in _field(col, kinds, side, probed, common)]
    status = _status(probed) if side == 0 else None
    if status is None:
        encoded, digested = _concat(backend, [*fields, "'c'"]), "COUNT(*)"
    else:
        committed, other = _concat(backend, [*fields, "'c'"]), _concat(backend, [*fields, "'x'"])
        encoded = f"CASE {status} WHEN 'aborted' THEN NULL WHEN 'committed' THEN {committed} ELSE {other} END"
        digested = f"SUM(CASE WHEN {status} = 'aborted' THEN 0 ELSE 1 END)"
    if backend == "postgresql":
        digest = f"encode(sha256(convert_to(string_agg({encoded}, '' ORDER BY {_order_key(probed, p)}), 'UTF8')), 'hex')"
    else:
        digest = f"SHA2(GROUP_CONCAT({encoded} ORDER BY {_order_key(probed, p)} SEPARATOR ''), 256)"
    table = _q(probed.spec.table, backend)
    return (f"SELECT {range_of(probed, p)} AS r, COUNT(*) AS n, {digested} AS dn, {digest} AS h "
            f"FROM {table}{f' WHERE {where}' if where else ''} GROUP BY 1")


# MariaDB cuts a GROUP_CONCAT at this many bytes (with warning 1260): set far above any range's encodings,
# and a cut is an error, never a digest of part of a range.
GROUP_CONCAT_MAX = 2**32 - 1
GROUP_CONCAT_CUT = 1260


def _session(conn: sa.Connection, backend: str) -> None:
    """UTC for zoned timestamps; in PostgreSQL, a hash aggregate (it expects a group per row) and no JIT."""
    if backend == "postgresql":
        for setting in ("SET TIME ZONE 'UTC'", "SET jit = off", "SET work_mem = '256MB'"):
            conn.exec_driver_sql(setting)
    else:
        conn.exec_driver_sql("SET time_zone = '+00:00'")
        conn.exec_driver_sql(f"SET SESSION group_concat_max_len = {GROUP_CONCAT_MAX}")


def fetch(probed: ProbedTable, p: Plan, columns: Sequence[str], side: int,
          ranges: Sequence[int] | None = None, where: str | None = None) -> dict[int, tuple]:
    """Run one side's digest query (of every range, of ``ranges``, or of the rows matching ``where``):
    {range: (rows, digested rows, SHA-256 hex or None)}; NULL keys -> -1."""
    engine = connect(probed.spec)
    try:
        with engine.connect() as conn:
            _session(conn, probed.backend)
            where = predicates(probed, p, ranges, 1)[0] if ranges else where
            sql = digest_sql(probed, p, columns, side, where)
            if probed.backend == "mysql":
                sql = sql.replace("%", "%%")  # PyMySQL formats the statement with %
            rows = conn.exec_driver_sql(sql).all()
            if probed.backend == "mysql" and any(w[1] == GROUP_CONCAT_CUT
                                                  for w in conn.exec_driver_sql("SHOW WARNINGS").all()):
                raise ReconcileError(f"digest of {probed.spec.table}: a range's rows exceed MariaDB's "
                                     f"group_concat_max_len ({GROUP_CONCAT_MAX} bytes); use a smaller range width")
    finally:
        engine.dispose()
    return {NULL_RANGE if r[0] is None else int(r[0]): (int(r[1]), int(r[2]), r[3]) for r in rows}


def compare(client: dict[int, tuple], server: dict[int, tuple]) -> Digests:
    """Ranges whose digested rows and digests agree are ok; the rest (and the NULL-key range) are read."""
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
    """Both sides' digest queries (of every range, or of ``ranges`` only), run at once, compared. Every range
    is digested by one of ``SPLIT`` queries per side (integer keys), so that each database can use more than
    one core: neither server spreads an ordered aggregate over parallel workers."""
    def wheres(probed: ProbedTable) -> list[str | None]:
        return [None] if ranges or not p.width else chunks(probed, p, SPLIT)

    with ThreadPoolExecutor(2 * SPLIT) as pool:
        sides = [[pool.submit(fetch, probed, p, [pair[side] for pair in pairs], side, ranges, where)
                  for where in wheres(probed)]
                 for side, probed in ((0, client), (1, server))]
        c, s = ({r: v for future in futures for r, v in future.result().items()} for futures in sides)
        return compare(c, s)


def chunks(probed: ProbedTable, p: Plan, count: int) -> list[str]:
    """WHERE clauses that cut an integer key into ``count`` runs of whole ranges (NULL keys in the first)."""
    key = _q(probed.spec.key, probed.backend)
    upper = probed.key_bounds.upper if probed.key_bounds else p.lower
    last = max(0, (upper - p.lower) // p.width) + 1
    edges = sorted({p.lower + p.width * (last * i // count) for i in range(1, count)})  # count >= 2: not empty
    clauses = [f"({key} < {edges[0]} OR {key} IS NULL)"]
    clauses += [f"{key} >= {a} AND {key} < {b}" for a, b in zip(edges, edges[1:])]
    return clauses + [f"{key} >= {edges[-1]}"]


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
