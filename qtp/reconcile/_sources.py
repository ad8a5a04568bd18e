"""Where the two tables come from: SQLAlchemy URLs -> JDBC reads that Spark can run in parallel.

Before Spark reads a single row, each side is checked with a plain SQLAlchemy connection: the server answers,
the table and every named column exist. The same connection fetches MIN/MAX of the key, which become the
bounds of Spark's partitioned read (``partitionColumn``, ``lowerBound``, ``upperBound``, ``numPartitions``):
each partition is one range query on the key, so the database serves it from the key's index. A key that is
not an integer is split by a hash of the key instead (one predicate per partition).

``fetchsize`` bounds what a JDBC driver holds at once: the PostgreSQL driver then reads through a cursor
(Spark turns autocommit off for it), and MariaDB Connector/J streams the result set ``fetchsize`` rows at a
time instead of buffering it whole. Nothing here collects rows to the driver.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import URL, make_url

from qtp._failures import first_line
from qtp.errors import ConfigurationError

JAR_DIRS = ("/usr/share/java",)
_JAR_PATTERNS = {
    "postgresql": ("postgresql.jar", "postgresql-[0-9]*.jar"),
    "mysql": ("mariadb-java-client.jar", "mariadb-java-client-[0-9]*.jar"),
}
_DEBIAN_PACKAGE = {"postgresql": "libpostgresql-jdbc-java", "mysql": "libmariadb-java"}
_DRIVER_CLASS = {"postgresql": "org.postgresql.Driver", "mysql": "org.mariadb.jdbc.Driver"}
# jdbc:mysql: so that Spark picks its MySQL dialect (backquoted identifiers); MariaDB Connector/J 2.x takes it.
_JDBC_SCHEME = {"postgresql": "postgresql", "mysql": "mysql"}


@dataclass(frozen=True)
class TableSpec:
    """One side of the reconciliation: a table reached through a SQLAlchemy URL.

    ``columns`` are the payload columns compared with the other side, in the same order as the other side's
    (the i-th client column is compared with the i-th server column). ``status_column`` (client only) holds
    ``committed``, ``aborted`` or ``in_doubt``; without it every row counts as committed.
    """

    url: str
    table: str
    key: str
    columns: tuple[str, ...] = ()
    status_column: str | None = None
    compensated: tuple[str, str] | None = None  # server only: (column, value) marking a compensated row

    def __post_init__(self) -> None:
        object.__setattr__(self, "columns", tuple(self.columns))


@dataclass(frozen=True)
class Bounds:
    lower: int
    upper: int


@dataclass
class ProbedTable:
    """What the pre-flight check learned about one side."""

    spec: TableSpec
    backend: str  # "postgresql" or "mysql"
    display_url: str  # the URL with any password masked
    key_bounds: Bounds | None  # None when the key is not an integer or the table is empty
    key_is_integer: bool
    key_is_unique: bool = True  # a primary key or unique index on the key column alone
    types: dict[str, sa.types.TypeEngine] = field(default_factory=dict)  # reflected type of every column
    not_null: frozenset[str] = frozenset()  # the columns declared NOT NULL


def backend_of(url: URL) -> str:
    """``postgresql`` or ``mysql`` (MariaDB included) for a SQLAlchemy URL; anything else is refused."""
    name = url.get_backend_name()
    if name in ("postgresql", "postgres"):
        return "postgresql"
    if name in ("mysql", "mariadb"):
        return "mysql"
    raise ConfigurationError(
        f"unsupported database in {url.render_as_string(hide_password=True)}: reconciliation reads "
        "PostgreSQL (postgresql://...) and MySQL/MariaDB (mysql+pymysql://...) tables"
    )


def parse_url(text: str, side: str) -> URL:
    try:
        return make_url(text)
    except Exception as exc:  # sqlalchemy raises ArgumentError, but be sure to name the side
        raise ConfigurationError(f"{side} URL {text!r} is not a database URL ({exc}); "
                                 "use postgresql://user@host:port/db or mysql+pymysql://user@host:port/db") from exc


def jdbc_url(url: URL) -> str:
    """The JDBC URL Spark uses for the SQLAlchemy URL ``url`` (credentials go into properties, not here)."""
    backend = backend_of(url)
    host = url.host or "localhost"
    port = url.port or (5432 if backend == "postgresql" else 3306)
    jdbc = f"jdbc:{_JDBC_SCHEME[backend]}://{host}:{port}/{url.database or ''}"
    if backend == "mysql":
        # A streamed result set must be read within net_write_timeout (60 s by default) of the server's last
        # write; a Spark task that spills or waits for a core may pause longer than that.
        jdbc += "?sessionVariables=net_write_timeout=3600"
    return jdbc


def jdbc_properties(url: URL, fetchsize: int) -> dict[str, str]:
    backend = backend_of(url)
    props = {"driver": _DRIVER_CLASS[backend], "fetchsize": str(fetchsize)}
    if url.username:
        props["user"] = url.username
    if url.password:
        props["password"] = str(url.password)
    return props


def find_jdbc_jars(backends: set[str], dirs: tuple[str, ...] = JAR_DIRS) -> list[str]:
    """The driver jar for each backend, from Debian's packages; a missing one is a ConfigurationError."""
    extra = os.environ.get("QTP_JDBC_JARS_DIR")
    search = ((extra,) if extra else ()) + tuple(dirs)
    jars = []
    for backend in sorted(backends):
        found = [hit for d in search for pattern in _JAR_PATTERNS[backend] for hit in sorted(glob.glob(f"{d}/{pattern}"))]
        if not found:
            raise ConfigurationError(
                f"no {backend} JDBC driver jar in {', '.join(search)}: install Debian's "
                f"{_DEBIAN_PACKAGE[backend]} (run `make deps` or `apt-get install {_DEBIAN_PACKAGE[backend]}`), "
                "or set QTP_JDBC_JARS_DIR to a folder holding the jar"
            )
        jars.append(str(Path(found[0]).resolve()))
    return jars


def quote_table(table: str, backend: str) -> str:
    """``schema.table`` quoted for the backend, for Spark's ``dbtable`` option."""
    quote = '"' if backend == "postgresql" else "`"
    return ".".join(f"{quote}{part.replace(quote, quote * 2)}{quote}" for part in table.split("."))


def probe(spec: TableSpec, side: str) -> ProbedTable:
    """Check that ``spec``'s server answers and its table and columns exist; read the key's bounds."""
    url = parse_url(spec.url, side)
    backend = backend_of(url)
    shown = url.render_as_string(hide_password=True)
    engine = sa.create_engine(_with_installed_driver(url), poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            table = _reflect(conn, spec, side, shown)
            key_col = table.c[spec.key]
            key_is_integer = _is_integer_type(key_col.type)
            key_is_unique = _is_unique(table, spec.key)
            types = {col.name: col.type for col in table.c}
            not_null = frozenset(col.name for col in table.c if not col.nullable)
            bounds = None
            if key_is_integer:
                lo, hi = conn.execute(sa.select(sa.func.min(key_col), sa.func.max(key_col))).one()
                bounds = None if lo is None else Bounds(int(lo), int(hi))
    except sa.exc.OperationalError as exc:
        raise ConfigurationError(
            f"cannot reach the {side} database {shown}: {first_line(exc.orig)}; check that the server runs "
            "and the host, port, user and database in the URL"
        ) from exc
    finally:
        engine.dispose()
    return ProbedTable(spec=spec, backend=backend, display_url=shown, key_bounds=bounds,
                       key_is_integer=key_is_integer, key_is_unique=key_is_unique, types=types,
                       not_null=not_null)


def connect(spec: TableSpec) -> sa.Engine:
    """A SQLAlchemy engine (no pool) for ``spec``'s database, with the drivers qtp installs."""
    return sa.create_engine(_with_installed_driver(make_url(spec.url)), poolclass=sa.pool.NullPool)


def _is_unique(table: sa.Table, column: str) -> bool:
    keys = [table.primary_key.columns.keys()]
    keys += [index.columns.keys() for index in table.indexes if index.unique]
    keys += [c.columns.keys() for c in table.constraints if isinstance(c, sa.UniqueConstraint)]
    return [column] in keys


def _with_installed_driver(url: URL) -> URL:
    """Bare ``postgresql://`` / ``mysql://`` URLs use the drivers qtp installs (psycopg2, PyMySQL)."""
    if "+" in url.drivername:
        return url
    return url.set(drivername="postgresql+psycopg2" if backend_of(url) == "postgresql" else "mysql+pymysql")


def _reflect(conn: sa.Connection, spec: TableSpec, side: str, shown: str) -> sa.Table:
    schema, _, name = spec.table.rpartition(".")
    inspector = sa.inspect(conn)
    if not inspector.has_table(name, schema=schema or None):
        known = inspector.get_table_names(schema=schema or None)
        raise ConfigurationError(
            f"{side} table {spec.table!r} does not exist in {shown}; tables there: "
            f"{', '.join(sorted(known)[:20]) or '(none)'}"
        )
    table = sa.Table(name, sa.MetaData(), schema=schema or None, autoload_with=conn)
    wanted = [spec.key, *spec.columns, *([spec.status_column] if spec.status_column else []),
              *([spec.compensated[0]] if spec.compensated else [])]
    missing = [col for col in wanted if col not in table.c]
    if missing:
        raise ConfigurationError(
            f"{side} table {spec.table!r} in {shown} has no column {', '.join(map(repr, missing))}; "
            f"its columns are {', '.join(table.c.keys())}"
        )
    return table


def _is_integer_type(sa_type: sa.types.TypeEngine) -> bool:
    try:
        return sa_type.python_type is int
    except NotImplementedError:
        return False


def read_options(probed: ProbedTable, partitions: int, fetchsize: int) -> dict[str, str]:
    """The ``spark.read.format("jdbc")`` options for one side (integer keys: ranged partitions)."""
    url = make_url(probed.spec.url)
    options = {
        "url": jdbc_url(url),
        "dbtable": quote_table(probed.spec.table, probed.backend),
        **jdbc_properties(url, fetchsize),
    }
    bounds = probed.key_bounds
    if bounds is not None and bounds.upper > bounds.lower and partitions > 1:
        options.update(
            partitionColumn=probed.spec.key,
            lowerBound=str(bounds.lower),
            upperBound=str(bounds.upper + 1),
            numPartitions=str(partitions),
        )
    return options


def hash_predicates(probed: ProbedTable, partitions: int) -> list[str]:
    """One WHERE clause per partition that splits a non-integer key by a hash the database computes."""
    key = quote_table(probed.spec.key, probed.backend)
    if probed.backend == "postgresql":
        bucket = f"((hashtext({key}::text) & 2147483647) % {partitions})"
    else:
        bucket = f"(crc32({key}) % {partitions})"
    return [f"{bucket} = {i}" for i in range(partitions)] + [f"{key} IS NULL"]
