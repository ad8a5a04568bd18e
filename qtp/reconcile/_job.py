"""The reconciliation job: probe both sides, read them over JDBC, classify, collect the bounded summary.

One pass over the data answers everything in the report: the classified keys are reduced to one row per
(class, multiplicity) carrying the counts, the per-column mismatch counts and at most ``sample_size`` samples
(see ``_classify``), and only that reduction reaches the driver. Writing the per-key anomalies to Parquet or
to a table is a second pass, run only when asked for.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import sqlalchemy as sa
from pyspark import SparkContext
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from qtp.errors import ConfigurationError, QtpError, ReconcileError
from qtp.reconcile import _classify as C
from qtp.reconcile import _digest as D
from qtp.reconcile import _jvm
from qtp.reconcile._sources import (
    ProbedTable,
    TableSpec,
    backend_of,
    find_jdbc_jars,
    hash_predicates,
    jdbc_properties,
    jdbc_url,
    parse_url,
    probe,
    quote_table,
    read_options,
)

Log = Callable[[str], None]


@dataclass
class ReconcileResult:
    """What one run found. ``counts`` has every class of ``CLASSES``; the rest details the anomalies."""

    counts: dict[str, int]
    duplicate_histogram: dict[int, int]
    mismatched_columns: dict[str, int]
    in_doubt_applied: int
    samples: dict[str, list[dict]]
    metadata: dict = field(default_factory=dict)

    @property
    def exactly_once(self) -> bool:
        return all(self.counts[name] == 0 for name in C.VIOLATIONS)

    @property
    def verdict(self) -> str:
        return "exactly-once" if self.exactly_once else "violated"

    @property
    def exit_code(self) -> int:
        return 0 if self.exactly_once else 1

    def to_dict(self) -> dict:
        return {
            "verdict": self.verdict,
            "counts": dict(self.counts),
            "duplicate_histogram": {str(k): v for k, v in sorted(self.duplicate_histogram.items())},
            "mismatched_columns": dict(self.mismatched_columns),
            "in_doubt_applied": self.in_doubt_applied,
            "samples": self.samples,
            "metadata": self.metadata,
        }


# ------------------------------------------------------------------------------------------------ Spark


def launched_by_spark_submit() -> bool:
    """True when this Python process was started by ``spark-submit`` (which then owns master and jars)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def spark_session(master: str | None = None, conf: Mapping[str, str] | None = None,
                  backends: set[str] = frozenset({"postgresql", "mysql"}), light: bool = False) -> SparkSession:
    """A SparkSession with the JDBC driver jars on its class path (``local[*]`` unless told otherwise).

    When this call starts the driver JVM, it maps the class archive of ``_jvm`` (or records one). ``light``
    (digest mode: a few thousand rows to classify, beside two databases busy digesting) also limits the
    driver's JIT to its quick C1 compiler: the start and the first jobs then take about half the CPU, while a
    job over millions of rows runs about 1.5x slower (benchmarks/RESULTS.md, issue 12)."""
    jars = find_jdbc_jars(set(backends))
    settings = {
        "spark.sql.shuffle.partitions": "16",
        "spark.ui.showConsoleProgress": "true",
        "spark.sql.session.timeZone": "UTC",
        **dict(conf or {}),
    }
    settings["spark.jars"] = ",".join(filter(None, [settings.get("spark.jars", ""), *jars]))
    started = NOT_STARTED_BY_QTP
    if not launched_by_spark_submit() and SparkContext._active_spark_context is None:  # we start the JVM
        java_options, archive = _jvm.options(jars)
        started = {"class_archive": archive, "compiler": "C1 only" if light else "tiered"}
        settings["spark.driver.extraJavaOptions"] = " ".join(filter(None, [
            settings.get("spark.driver.extraJavaOptions", ""), java_options, LIGHT_JIT if light else ""]))
    if master is not None and not master.startswith("local"):
        # Executors run no Python for this job (no UDFs); should one start, it needs this interpreter's path.
        settings.setdefault("spark.pyspark.python", sys.executable)
    builder = SparkSession.builder.appName("qtp-reconcile")
    if master is not None or not launched_by_spark_submit():
        builder = builder.master(master or "local[*]")
    for key, value in settings.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    DRIVER_JVM.setdefault(spark.sparkContext.applicationId, started)
    if not spark.sparkContext.master.startswith("local"):
        spark.sparkContext.addPyFile(qtp_zip())
    return spark


LIGHT_JIT = "-XX:TieredStopAtLevel=1"
# applicationId -> how qtp started the driver JVM (class archive, compiler), for the report
DRIVER_JVM: dict[str, dict[str, str]] = {}
NOT_STARTED_BY_QTP = {"class_archive": "not started by qtp", "compiler": "not started by qtp"}


def qtp_zip() -> str:
    """A zip of the qtp package (Python files only) for the executors' ``sys.path``, made once per process."""
    global _QTP_ZIP
    if _QTP_ZIP is None:
        package = Path(__file__).resolve().parents[1]
        target = Path(tempfile.mkdtemp(prefix="qtp-reconcile-")) / "qtp.zip"
        with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as archive:
            for source in sorted(package.rglob("*.py")):
                archive.write(source, source.relative_to(package.parent))
        _QTP_ZIP = str(target)
    return _QTP_ZIP


_QTP_ZIP: str | None = None


@contextmanager
def spark_errors(what: str) -> Iterator[None]:
    """Translate Spark and Py4J failures into ReconcileError naming the step."""
    try:
        yield
    except QtpError:
        raise
    except Exception as exc:
        module = type(exc).__module__
        if not (module.startswith("pyspark") or module.startswith("py4j")):
            raise
        first = _root_cause(exc)
        if "ClassNotFoundException" in str(exc) or "No suitable driver" in str(exc):
            raise ConfigurationError(
                f"{what}: the JDBC driver is not on Spark's class path ({first.strip()}); pass the session "
                "from qtp.reconcile.spark_session(), or --jars with the driver jar to spark-submit"
            ) from exc
        raise ReconcileError(f"{what} failed: {first.strip()}", retryable=_transient(first)) from exc


# Root causes that another run can get past: a database or executor that went away, a timeout.
_TRANSIENT = ("Connection refused", "Communications link failure", "connection attempt failed",
              "Connection reset", "timed out", "TimeoutException", "SocketTimeoutException",
              "terminating connection", "Could not connect", "ExecutorLostFailure", "SparkOutOfMemoryError")


def _transient(cause: str) -> bool:
    """Whether a Spark failure's root cause is transient (see ``_TRANSIENT``); a bad table, column or query
    fails the same way every time."""
    return any(marker.lower() in cause.lower() for marker in _TRANSIENT)


def _root_cause(exc: BaseException) -> str:
    """The innermost Java cause of a Py4J error (its own first line says only which call failed)."""
    java = getattr(exc, "java_exception", None)
    if java is not None:
        while java.getCause() is not None:
            java = java.getCause()
        return str(java.toString())
    return next((line for line in str(exc).splitlines() if line.strip()), type(exc).__name__)


# ------------------------------------------------------------------------------------------------ types

_FAMILIES = (
    ("integer", (T.ByteType, T.ShortType, T.IntegerType, T.LongType)),
    ("number", (T.FloatType, T.DoubleType, T.DecimalType)),
    ("string", (T.StringType, T.VarcharType, T.CharType)),
    ("time", (T.DateType, T.TimestampType, T.TimestampNTZType)),
    ("boolean", (T.BooleanType,)),
    ("binary", (T.BinaryType,)),
)


def type_family(data_type: T.DataType) -> str:
    if isinstance(data_type, T.DecimalType) and data_type.scale == 0:
        return "integer"
    for name, kinds in _FAMILIES:
        if isinstance(data_type, kinds):
            return name
    return data_type.simpleString()


def _comparable(client: T.DataType, server: T.DataType) -> bool:
    families = {type_family(client), type_family(server)}
    return len(families) == 1 or families == {"integer", "number"}


def key_type(client: T.DataType, server: T.DataType, client_name: str, server_name: str) -> T.DataType:
    """The common type both keys are cast to; keys of different families are a ConfigurationError."""
    fam_c, fam_s = type_family(client), type_family(server)
    if fam_c != fam_s:
        raise ConfigurationError(
            f"key types differ: client key {client_name!r} is {client.simpleString()} ({fam_c}), server key "
            f"{server_name!r} is {server.simpleString()} ({fam_s}); the keys must hold the same kind of value "
            "(both integers or both strings)"
        )
    if fam_c == "integer":
        decimal = any(isinstance(t, T.DecimalType) for t in (client, server))
        return T.DecimalType(38, 0) if decimal else T.LongType()
    return client if client == server else (T.StringType() if fam_c == "string" else client)


# ------------------------------------------------------------------------------------------------ the job


COPIES = "qtp_copies"  # the row count of the server's pushed-down GROUP BY
# MariaDB materialises a GROUP BY in a derived table as a temporary table (on disk in tmpdir at millions of
# keys): not faster than Spark's grouping in benchmarks/reconcile.py, and twice a 5M-row run failed when the
# temporary file vanished. PostgreSQL streams the aggregate.
PUSHDOWN_DEFAULT = {"postgresql": True, "mysql": False}


def _grouped_table(probed: ProbedTable) -> str | None:
    """The server's ``GROUP BY key`` (row count and each column's MIN) as a subquery for Spark's ``dbtable``.

    None when a column has no MIN in its database (PostgreSQL ``boolean``): Spark then groups the rows.
    """
    spec, backend = probed.spec, probed.backend
    if any(isinstance(probed.types.get(col), sa.Boolean) for col in spec.columns):
        return None
    key = quote_table(spec.key, backend)
    mins = "".join(f", MIN({quote_table(col, backend)}) AS {quote_table(col, backend)}"
                   for col in dict.fromkeys(spec.columns) if col != spec.key)
    return (f"(SELECT {key}, COUNT(*) AS {COPIES}{mins} FROM {quote_table(spec.table, backend)} "
            f"GROUP BY {key}) qtp_grouped")


def _read(spark: SparkSession, probed: ProbedTable, partitions: int, fetchsize: int,
          grouped: str | None = None, where: list[str] | None = None) -> DataFrame:
    """One side over JDBC: the table (or ``grouped``, the server's GROUP BY), split by key range or hash,
    or only the rows matching one of the ``where`` clauses (one partition each)."""
    spec = probed.spec
    wanted = [spec.key, *spec.columns, *([spec.status_column] if spec.status_column else []),
              *([spec.compensated[0]] if spec.compensated else []), *([COPIES] if grouped else [])]
    url = parse_url(spec.url, "")
    table = grouped or quote_table(spec.table, probed.backend)
    if where is None and (probed.key_is_integer or partitions < 2):
        options = {**read_options(probed, partitions, fetchsize), "dbtable": table}
        frame = spark.read.format("jdbc").options(**options).load()
    else:
        frame = spark.read.jdbc(jdbc_url(url), table, predicates=where or hash_predicates(probed, partitions),
                                properties=jdbc_properties(url, fetchsize))
    return frame.select(*dict.fromkeys(wanted))


def _column_pairs(client: TableSpec, server: TableSpec) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    server_columns = server.columns or client.columns
    if len(server_columns) != len(client.columns):
        raise ConfigurationError(
            f"the column mapping pairs {len(client.columns)} client column(s) with {len(server_columns)} "
            "server column(s); give one server column per client column"
        )
    names = list(client.columns)
    return list(zip(names, client.columns)), list(zip(names, server_columns))


def _aligned(client_df: DataFrame, server_df: DataFrame, client: TableSpec, server: TableSpec,
             pairs: list[tuple[str, str]], server_pairs: list[tuple[str, str]]) -> tuple[DataFrame, DataFrame]:
    """Cast both keys to one type and each server payload column to its client column's type."""
    c_types = {f.name: f.dataType for f in client_df.schema.fields}
    s_types = {f.name: f.dataType for f in server_df.schema.fields}
    common = key_type(c_types[client.key], s_types[server.key], client.key, server.key)
    casts_s = {server.key: F.col(server.key).cast(common)}
    for (name, c_col), (_, s_col) in zip(pairs, server_pairs):
        ct, st = c_types[c_col], s_types[s_col]
        if not _comparable(ct, st):
            raise ConfigurationError(
                f"payload column {name!r}: client {c_col!r} is {ct.simpleString()} but server {s_col!r} is "
                f"{st.simpleString()}; map columns that hold the same kind of value"
            )
        if ct != st:
            casts_s[s_col] = F.col(s_col).cast(ct)
    return client_df.withColumn(client.key, F.col(client.key).cast(common)), server_df.withColumns(casts_s)


def _stderr_log(message: str) -> None:
    print(f"[qtp reconcile {datetime.now().strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


MODES = ("auto", "digest", "full")


def reconcile(
    client: TableSpec,
    server: TableSpec,
    *,
    spark: SparkSession | None = None,
    master: str | None = None,
    spark_conf: Mapping[str, str] | None = None,
    partitions: int | None = None,
    fetchsize: int = 10_000,
    sample_size: int = 10,
    anomalies_parquet: str | None = None,
    anomalies_table: tuple[str, str] | None = None,
    mode: str = "auto",
    pushdown: bool | None = None,
    range_width: int | None = None,
    log: Log | None = _stderr_log,
) -> ReconcileResult:
    """Reconcile ``client`` against ``server`` and return the classes, samples and run metadata.

    ``server.columns`` may be empty when the server's payload columns have the client's names. ``spark``
    reuses a session (it must have the JDBC jars, as ``spark_session()`` arranges); otherwise one is made
    with ``master`` (default ``local[*]``) and ``spark_conf``. ``partitions`` is the number of JDBC reads
    per side (default: twice Spark's parallelism). ``anomalies_parquet`` (a path) and ``anomalies_table``
    (SQLAlchemy URL, table) receive the per-key anomalies, overwriting what is there.

    ``mode``: ``full`` reads every row; ``digest`` has both databases digest ranges of keys and reads only
    the ranges that differ (see ``_digest``); ``auto`` uses digest mode when the tables allow it. The counts
    are the same in every mode. ``pushdown`` has the server's database group its rows by key (default: only
    when the server is PostgreSQL; see ``PUSHDOWN_DEFAULT``).
    ``range_width`` sets the keys per digest range (integer keys; default ``_digest.ROWS_PER_RANGE``).
    """
    if mode not in MODES:
        raise ConfigurationError(f"unknown mode {mode!r}: use one of {', '.join(MODES)}")
    say = log or (lambda message: None)
    started = time.time()
    pairs, server_pairs = _column_pairs(client, server)
    names = [name for name, _ in pairs]
    server = TableSpec(server.url, server.table, server.key, tuple(col for _, col in server_pairs),
                       compensated=server.compensated)

    say(f"checking client {client.table} and server {server.table}")
    probed_c, probed_s = probe(client, "client"), probe(server, "server")
    if not probed_c.key_is_unique:
        say(f"warning: client key {client.key!r} has no primary key or unique index; a key the client holds "
            "twice is counted as two messages")
    column_pairs = [(c, s) for (_, c), (_, s) in zip(pairs, server_pairs)]
    plan = D.plan(probed_c, probed_s, column_pairs, range_width or 0)
    impossible = plan.reason or (  # the digests do not carry the compensation mark
        "the server table has a compensation mark (--server-compensated)" if server.compensated else None)
    if mode == "digest" and impossible:
        raise ConfigurationError(f"digest mode cannot run: {impossible}; use --mode full or auto")
    reason = impossible or (_dense(probed_c, probed_s, plan, column_pairs, say) if mode == "auto" else None)
    used = "full" if mode == "full" or reason else "digest"
    if mode == "auto" and reason:
        say(f"auto mode: full, because {reason}")

    if pushdown is None:
        pushdown = PUSHDOWN_DEFAULT[probed_s.backend] and not server.compensated
    if pushdown and server.compensated:
        raise ConfigurationError("--pushdown groups the server's rows in its database, which drops the "
                                 "compensation mark; leave it out with --server-compensated")
    grouped = _grouped_table(probed_s) if pushdown else None
    timing: dict[str, float] = {}

    def parts_of(session: SparkSession) -> int:
        return partitions or max(2, 2 * session.sparkContext.defaultParallelism)

    def classify_reads(session: SparkSession, where_c: list[str] | None, where_s: list[str] | None,
                       shuffle: int | None, final: bool = True) -> list:
        """Read both sides (all rows, or those matching ``where_*``), classify, collect the summary."""
        parts = parts_of(session)
        with _shuffle_partitions(session, shuffle):
            with spark_errors("reading the tables over JDBC"):
                client_df = _read(session, probed_c, parts, fetchsize, where=where_c)
                server_df = _read(session, probed_s, parts, fetchsize, grouped=grouped, where=where_s)
            client_df, server_df = _aligned(client_df, server_df, client, server, pairs, server_pairs)
            server_rows = (C.server_side_grouped(server_df, server.key, server_pairs, COPIES) if grouped
                           else C.server_side(server_df, server.key, server_pairs, server.compensated))
            classified = C.classify(C.client_side(client_df, client.key, pairs, client.status_column), server_rows,
                                    names)
            if final:
                if anomalies_parquet or anomalies_table:
                    with spark_errors("writing the anomalies"):
                        _write_anomalies(C.anomalies(classified, names), anomalies_parquet, anomalies_table, say)
                say("classifying every key read (one pass over both tables)")
            with spark_errors("classifying"):
                return C.summarize(classified, names, sample_size).collect()

    def start_and_warm() -> SparkSession:
        """The driver JVM started; in digest mode, while the databases digest, one range classified and thrown
        away, so that the real reads find the JDBC drivers loaded and the query code generated and compiled."""
        session = _timed(timing, "jvm_start_s", spark_session, master, spark_conf,
                         {probed_c.backend, probed_s.backend}, used == "digest")
        if used == "digest" and plan.width:
            first = [0]
            _timed(timing, "warm_up_s", classify_reads, session, D.predicates(probed_c, plan, first, 1),
                   D.predicates(probed_s, plan, first, 1), 1, False)
        return session

    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(start_and_warm) if spark is None else None
        found = None
        if used == "digest":
            say(f"digest mode: {'key ranges of ' + str(plan.width) if plan.width else 'hashed key ranges'}")
            found = _timed(timing, "digests_s", D.digests, probed_c, probed_s, plan, column_pairs)
            say(f"{len(found.differing)} of {found.ranges} ranges differ")
        spark = spark if future is None else future.result()
    parts = parts_of(spark)
    for side, probed in (("client", probed_c), ("server", probed_s)):
        say(f"{side}: {probed.display_url} table {probed.spec.table}, {_split(probed)}, {parts} partitions, "
            f"fetchsize {fetchsize}{', grouped by key in the database' if side == 'server' and grouped else ''}")

    where_c = where_s = None
    shuffle = None
    if found is not None:
        reads = _read_partitions(found, plan, parts)
        shuffle = None if reads == parts else reads
        where_c = D.predicates(probed_c, plan, found.differing, reads)
        where_s = D.predicates(probed_s, plan, found.differing, reads)
    read_started = time.time()
    groups = [] if where_c == [] else classify_reads(spark, where_c, where_s, shuffle)
    timing["reads_and_classification_s"] = round(time.time() - read_started, 3)
    result = _result(groups, names, sample_size)
    rows = result.metadata
    if found is not None:
        result.counts[C.OK] += found.ok_keys
        rows["client_rows"] += found.ok_keys
        rows["server_rows"] += found.ok_server_rows
    result.metadata = {
        "client": _side_meta(probed_c, rows["client_rows"]),
        "server": _side_meta(probed_s, rows["server_rows"]),
        "columns": [{"name": n, "client": c, "server": s} for (n, c), (_, s) in zip(pairs, server_pairs)],
        **_timing(started, time.time()),
        "mode": {"requested": mode, "used": used, "reason": reason, "pushdown": grouped is not None,
                 **({"ranges": found.ranges, "ranges_read": len(found.differing), "keys_ok_by_digest": found.ok_keys}
                    if found is not None else {})},
        "seconds_split": timing,
        "spark": {"master": spark.sparkContext.master, "version": spark.version, "partitions_per_side": parts,
                  "fetchsize": fetchsize,
                  **DRIVER_JVM.get(spark.sparkContext.applicationId, NOT_STARTED_BY_QTP)},
        "sample_size": sample_size,
    }
    say(f"done in {result.metadata['seconds']:.1f}s ({used} mode): {result.verdict}")
    return result


def _dense(client: ProbedTable, server: ProbedTable, plan: D.Plan, pairs: list[tuple[str, str]],
           say: Log) -> str | None:
    """Auto mode: digest a sample of ranges first; when most differ, reading everything is cheaper."""
    ranges = D.sample(client, server, plan)
    if not ranges:
        return None
    found = D.digests(client, server, plan, pairs, ranges)
    differing = len([r for r in found.differing if r != D.NULL_RANGE])
    say(f"auto mode: {differing} of {len(ranges)} sampled ranges differ")
    if differing > D.DENSE * len(ranges):
        return f"{differing} of {len(ranges)} sampled key ranges differ (anomalies are dense)"
    return None


ROWS_PER_READ = 250_000  # digest mode: rows per JDBC read partition (and per shuffle partition)


def _read_partitions(found: D.Digests, plan: D.Plan, parts: int) -> int:
    """Fewer JDBC reads (and shuffle partitions) when only a few ranges differ: each task costs more than
    the rows it would carry. Hashed text-key ranges hold an unknown number of rows: ``parts``."""
    if not plan.width:
        return parts
    return max(1, min(parts, -(-len(found.differing) * plan.width // ROWS_PER_READ)))


@contextmanager
def _shuffle_partitions(spark: SparkSession, count: int | None) -> Iterator[None]:
    """``spark.sql.shuffle.partitions`` set to ``count`` for the block (unchanged when None)."""
    if count is None:
        yield
        return
    before = spark.conf.get("spark.sql.shuffle.partitions")
    spark.conf.set("spark.sql.shuffle.partitions", str(count))
    try:
        yield
    finally:
        spark.conf.set("spark.sql.shuffle.partitions", before)


def _timed(timing: dict, name: str, fn: Callable, *args):
    """``fn(*args)``, its duration recorded in ``timing[name]``."""
    t = time.time()
    try:
        return fn(*args)
    finally:
        timing[name] = round(time.time() - t, 3)


def _split(probed: ProbedTable) -> str:
    """How a side's read is split, for the progress line."""
    if probed.key_bounds is not None:
        return f"key in [{probed.key_bounds.lower}, {probed.key_bounds.upper}]"
    return "key hashed" if not probed.key_is_integer else "empty table"


def _timing(started: float, finished: float) -> dict:
    def iso(t: float) -> str:
        return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds")

    return {"started_at": iso(started), "finished_at": iso(finished), "seconds": round(finished - started, 3)}


def _side_meta(probed: ProbedTable, rows: int) -> dict:
    spec = probed.spec
    return {"url": probed.display_url, "table": spec.table, "key": spec.key, "columns": list(spec.columns),
            "status_column": spec.status_column, "rows": rows}


def _write_anomalies(frame: DataFrame, parquet: str | None, table: tuple[str, str] | None, say: Log) -> None:
    if parquet:
        say(f"writing the per-key anomalies to {parquet}")
        frame.write.mode("overwrite").parquet(parquet)
    if table:
        url_text, name = table
        url = parse_url(url_text, "anomalies")
        say(f"writing the per-key anomalies to {url.render_as_string(hide_password=True)} table {name}")
        frame.write.mode("overwrite").jdbc(jdbc_url(url), quote_table(name, backend_of(url)),
                                           properties=jdbc_properties(url, 10_000))


def _result(groups: Sequence, names: Sequence[str], sample_size: int) -> ReconcileResult:
    """Fold the collected (class, copies) groups into counts, histogram, per-column counts and samples."""
    counts = dict.fromkeys(C.CLASSES, 0)
    histogram: dict[int, int] = {}
    per_column = dict.fromkeys(names, 0)
    samples: dict[str, list[dict]] = {name: [] for name in C.CLASSES if name != C.OK}
    in_doubt_applied = client_rows = server_rows = 0
    for row in groups:
        cls, copies, keys = row["class"], int(row["copies"]), int(row["keys"])
        counts[cls] += keys
        server_rows += keys * copies
        client_rows += 0 if cls == C.UNEXPECTED else keys
        if cls == C.DUPLICATED:
            histogram[copies] = histogram.get(copies, 0) + keys
        if cls == C.MISMATCHED:
            for i, name in enumerate(names):
                per_column[name] += int(row[f"differs_{i}"])
        if cls == C.IN_DOUBT and copies > 0:
            in_doubt_applied += keys
        if cls in samples:
            found = row["samples"] or ()  # no samples when the group's keys are NULL
            samples[cls].extend(sample.asDict(recursive=True) for sample in found if sample is not None)
    for cls, rows in samples.items():
        rows.sort(key=lambda sample: (sample["key"] is None, sample["key"]))
        del rows[sample_size:]
    result = ReconcileResult(counts, histogram, per_column, in_doubt_applied, samples)
    result.metadata = {"client_rows": client_rows, "server_rows": server_rows}
    return result
