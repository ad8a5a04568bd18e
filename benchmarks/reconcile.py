"""Benchmark of the Spark reconciliation (issue 5): cross-database Spark job vs one SQL query in PostgreSQL.

    .venv/bin/python benchmarks/reconcile.py --rows 5000000 --rows 1000000

For each size N (a multiple of 1000) it loads, once, a client table of N rows into PostgreSQL and the server
table (about N rows) into MariaDB, with every class injected by key (key mod 1000):

    1 lost            2 duplicated x2       3 duplicated x3     4 mismatched amount   5 mismatched note
    6 aborted+applied 7 aborted, absent(ok) 8 in doubt, applied 9 in doubt, absent    N+1..N+N/1000 unexpected

With ``--sparse`` (issue 12: the usual case after a campaign) the same nine classes are injected only at the
keys whose ``key mod (N/10)`` is 1..9 (ten blocks), plus 20 unexpected keys: 100 anomalies in all, in tables
``client_sparse_N`` / ``server_sparse_N``. ``--mode`` and ``--pushdown``/``--no-pushdown`` are passed to the job.

and a copy of the server table into the same PostgreSQL. It then runs ``python -m qtp.reconcile`` in a child
process, sampling the resident memory of the Python driver and of its JVM (the Spark driver, which in
local mode also runs the executors), and times the same classification as one SQL query in PostgreSQL.
The counts of both are checked against the injected ones. Not a test: it takes minutes and prints figures.
Servers live under ``--root`` (default .qtp/bench) so that they disturb nobody; they are left running so
that a second run reuses the data (``qtp db stop --root .qtp/bench`` stops them).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import psycopg2
import pymysql

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qtp.embedded import EmbeddedMariaDB, EmbeddedPostgres  # noqa: E402

DB = "bench"


SPARSE = False  # set by --sparse


def blocks(rows: int) -> int:
    """How many keys carry each injected class."""
    return 10 if SPARSE else rows // 1000


def unexpected(rows: int) -> int:
    return 20 if SPARSE else rows // 1000


def cls(k: str, rows: int) -> str:
    """SQL for the injected class (0: none) of key ``k``."""
    if SPARSE:
        return f"(CASE WHEN MOD({k},{rows // 10}) < 10 THEN MOD({k},{rows // 10}) ELSE 0 END)"
    return f"MOD({k},1000)"


def table(side: str, rows: int) -> str:
    return f"{side}_sparse_{rows}" if SPARSE else f"{side}_{rows}"


def expected_counts(rows: int) -> dict:
    m, u = blocks(rows), unexpected(rows)
    return {
        "counts": {"ok": rows - 8 * m, "lost": m, "duplicated": 2 * m, "unexpected": u, "mismatched": 2 * m,
                   "applied_but_aborted": m, "in_doubt": 2 * m},
        "duplicate_histogram": {"2": m, "3": m},
        "mismatched_columns": {"amount": m, "note": m},
        "in_doubt_applied": m,
        "server_rows": rows + u,
    }


# ------------------------------------------------------------------------------------------------ data

STATUS = "CASE {c} WHEN 6 THEN 'aborted' WHEN 7 THEN 'aborted' WHEN 8 THEN 'in_doubt' " \
         "WHEN 9 THEN 'in_doubt' ELSE 'committed' END"
AMOUNT = "MOD({k},100000) * 0.01"
SERVER_AMOUNT = "MOD({k},100000) * 0.01 + CASE WHEN {c} = 4 THEN 1 ELSE 0 END"


def _server_note(k: str, c: str, concat) -> str:
    return f"CASE WHEN {c} = 5 THEN {concat(repr('msg '), k, repr('!'))} ELSE {concat(repr('msg '), k)} END"


def _pg_concat(*parts: str) -> str:
    return " || ".join(f"({p})::text" for p in parts)


def _my_concat(*parts: str) -> str:
    return f"CONCAT({', '.join(parts)})"


def _server_selects(k: str, concat, source, lo: int, hi: int, rows: int) -> list[str]:
    """INSERT ... SELECT bodies for the server table's keys lo..hi: copy 1, copies 2 and 3, and (when hi is
    the last key) the unexpected keys after it."""
    c = cls(k, rows)
    cols = f"{k}, {{copy}}, {SERVER_AMOUNT.format(k=k, c=c)}, {_server_note(k, c, concat)}"
    keys = source(lo, hi)
    bodies = [
        f"SELECT {cols.format(copy=1)} FROM {keys} WHERE {c} NOT IN (1, 7, 9)",
        f"SELECT {cols.format(copy=2)} FROM {keys} WHERE {c} IN (2, 3)",
        f"SELECT {cols.format(copy=3)} FROM {keys} WHERE {c} = 3",
    ]
    if hi == rows:
        bodies.append(f"SELECT {k}, 1, 1.00, 'never sent' FROM {source(rows + 1, rows + unexpected(rows))}")
    return bodies


def load_postgres(conn, rows: int) -> None:
    client, server = table("client", rows), table("server", rows)
    with conn.cursor() as cur:
        cur.execute("SELECT to_regclass(%s) IS NOT NULL", (f"loaded_{client}",))
        if cur.fetchone()[0]:
            return
        t = time.monotonic()
        cur.execute(f"DROP TABLE IF EXISTS {client}, {server}")
        cur.execute(f"CREATE TABLE {client} (id bigint NOT NULL, amount numeric(12,2), note text, status text)")
        status = STATUS.format(c=cls("g", rows))
        cur.execute(f"INSERT INTO {client} SELECT g, {AMOUNT.format(k='g')}, 'msg ' || g, {status} "
                    f"FROM generate_series(1, {rows}) g")
        cur.execute(f"ALTER TABLE {client} ADD PRIMARY KEY (id)")
        cur.execute(f"CREATE TABLE {server} (msg_id bigint NOT NULL, copy_no int NOT NULL, amt numeric(12,2), "
                    "note text)")
        series = lambda lo, hi: f"generate_series({lo}, {hi}) g"  # noqa: E731
        for body in _server_selects("g", _pg_concat, series, 1, rows, rows):
            cur.execute(f"INSERT INTO {server} {body}")
        cur.execute(f"ALTER TABLE {server} ADD PRIMARY KEY (msg_id, copy_no)")
        cur.execute(f"VACUUM ANALYZE {client}")
        cur.execute(f"VACUUM ANALYZE {server}")
        cur.execute(f"CREATE TABLE loaded_{client} (n int)")
        print(f"  postgresql: loaded {client} and {server} in {time.monotonic() - t:.0f}s", flush=True)


def load_mariadb(conn, rows: int) -> None:
    server = table("server", rows)
    with conn.cursor() as cur:
        cur.execute(f"SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = '{DB}' "
                    f"AND table_name = '{server}_done'")
        if cur.fetchone()[0]:
            return
        t = time.monotonic()
        cur.execute("SET SESSION sql_log_bin = 0")
        cur.execute(f"DROP TABLE IF EXISTS {server}")
        cur.execute(f"CREATE TABLE {server} (msg_id bigint NOT NULL, copy_no int NOT NULL, amt decimal(12,2), "
                    "note varchar(64), PRIMARY KEY (msg_id, copy_no))")
        seq = lambda a, b: f"seq_{a}_to_{b}"  # noqa: E731
        chunk = 500_000
        for lo in range(1, rows + 1, chunk):  # in key order, so that the clustered index mostly appends
            for body in _server_selects("seq", _my_concat, seq, lo, min(rows, lo + chunk - 1), rows):
                cur.execute(f"INSERT INTO {server} {body}")
            conn.commit()
        cur.execute(f"ANALYZE TABLE {server}")
        cur.fetchall()
        cur.execute(f"CREATE TABLE {server}_done (n int)")
        print(f"  mariadb: loaded {server} in {time.monotonic() - t:.0f}s", flush=True)


# ------------------------------------------------------------------------------------------------ runs

SQL = """
WITH s AS (
    SELECT msg_id AS key, count(*) AS copies, min(amt) AS amt, min(note) AS note FROM {server} GROUP BY msg_id
), j AS (
    SELECT coalesce(c.id, s.key) AS key, c.id IS NOT NULL AS sent, c.status, coalesce(s.copies, 0) AS copies,
           c.id IS NOT NULL AND s.key IS NOT NULL AND c.amount IS DISTINCT FROM s.amt AS d_amount,
           c.id IS NOT NULL AND s.key IS NOT NULL AND c.note IS DISTINCT FROM s.note AS d_note
    FROM {client} c FULL OUTER JOIN s ON s.key = c.id
), k AS (
    SELECT CASE
        WHEN NOT sent THEN 'unexpected'
        WHEN status NOT IN ('committed', 'aborted') OR status IS NULL THEN 'in_doubt'
        WHEN status = 'aborted' AND copies >= 1 THEN 'applied_but_aborted'
        WHEN status = 'aborted' THEN 'ok'
        WHEN copies = 0 THEN 'lost'
        WHEN copies > 1 THEN 'duplicated'
        WHEN d_amount OR d_note THEN 'mismatched'
        ELSE 'ok' END AS class, copies, d_amount, d_note
    FROM j
)
SELECT class, copies, count(*), count(*) FILTER (WHERE d_amount), count(*) FILTER (WHERE d_note)
FROM k GROUP BY class, copies
"""


def run_sql(pg_conn, rows: int) -> dict:
    t = time.monotonic()
    with pg_conn.cursor() as cur:
        cur.execute(SQL.format(client=table("client", rows), server=table("server", rows)))
        groups = cur.fetchall()
    seconds = time.monotonic() - t
    counts = {}
    hist, per_col, in_doubt_applied = {}, {"amount": 0, "note": 0}, 0
    for cls, copies, keys, d_amount, d_note in groups:
        counts[cls] = counts.get(cls, 0) + keys
        if cls == "duplicated":
            hist[str(copies)] = keys
        if cls == "mismatched":
            per_col["amount"] += d_amount
            per_col["note"] += d_note
        if cls == "in_doubt" and copies > 0:
            in_doubt_applied += keys
    return {"seconds": seconds, "counts": counts, "duplicate_histogram": hist, "mismatched_columns": per_col,
            "in_doubt_applied": in_doubt_applied}


class MemorySampler(threading.Thread):
    """Peak RSS of a process (the Python driver) and of its java descendants (the Spark JVM)."""

    def __init__(self, pid: int, every: float = 0.1):
        super().__init__(daemon=True)
        self.proc = psutil.Process(pid)
        self.every = every
        self.peak_python = self.peak_jvm = 0
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                self.peak_python = max(self.peak_python, self.proc.memory_info().rss)
                jvm = sum(c.memory_info().rss for c in self.proc.children(recursive=True) if "java" in c.name())
                self.peak_jvm = max(self.peak_jvm, jvm)
            except psutil.Error:
                pass
            self.stopped.wait(self.every)


def run_spark(pg_url: str, maria_url: str, rows: int, args: argparse.Namespace, out: Path, mode: str) -> dict:
    report = out / f"reconcile-{rows}.json"
    cmd = [
        sys.executable, "-m", "qtp.reconcile", "--quiet",
        "--client-url", pg_url, "--client-table", table("client", rows),
        "--server-url", maria_url, "--server-table", table("server", rows), "--mode", mode,
        "--key", "id=msg_id", "--columns", "amount=amt,note", "--client-status-column", "status",
        "--json", str(report), "--html", str(out / f"reconcile-{rows}.html"),
        "--master", args.master, "--fetchsize", str(args.fetchsize),
        "--conf", f"spark.driver.memory={args.driver_memory}", "--conf", "spark.ui.showConsoleProgress=false",
    ]
    if args.partitions:
        cmd += ["--partitions", str(args.partitions)]
    if args.pushdown is not None:
        cmd.append("--pushdown" if args.pushdown else "--no-pushdown")
    t = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sampler = MemorySampler(proc.pid)
    sampler.start()
    stdout, stderr = proc.communicate()
    wall = time.monotonic() - t
    sampler.stopped.set()
    sampler.join()
    if proc.returncode not in (0, 1):
        raise SystemExit(f"the Spark job failed ({proc.returncode}):\n{stderr[-3000:]}")
    data = json.loads(report.read_text())
    return {"wall_seconds": wall, "job_seconds": data["metadata"]["seconds"], "exit_code": proc.returncode,
            "peak_python_rss": sampler.peak_python, "peak_jvm_rss": sampler.peak_jvm, "report": data}


def read_floor(pg_url: str, maria_url: str, rows: int, args: argparse.Namespace) -> dict:
    """Time a Spark that only starts and reads both tables over JDBC (the transfer every plan must pay)."""
    cmd = [sys.executable, __file__, "--child-floor", str(rows), "--pg-url", pg_url, "--maria-url", maria_url,
           "--master", args.master, "--driver-memory", args.driver_memory, "--fetchsize", str(args.fetchsize)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"the read-floor child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def child_floor(args: argparse.Namespace) -> int:
    from pyspark.sql import functions as F

    from qtp.reconcile import TableSpec, spark_session
    from qtp.reconcile._job import _read
    from qtp.reconcile._sources import probe

    rows = args.child_floor
    t0 = time.monotonic()
    spark = spark_session(args.master, {"spark.driver.memory": args.driver_memory,
                                        "spark.ui.showConsoleProgress": "false"})
    started = time.monotonic()
    client = probe(TableSpec(args.pg_url, table("client", rows), "id", ("amount", "note"), "status"), "client")
    server = probe(TableSpec(args.maria_url, table("server", rows), "msg_id", ("amt", "note")), "server")
    parts = 2 * spark.sparkContext.defaultParallelism
    both = _read(spark, client, parts, args.fetchsize).select(F.col("id").alias("k"), "note").unionByName(
        _read(spark, server, parts, args.fetchsize).select(F.col("msg_id").alias("k"), "note"))
    both.write.format("noop").mode("overwrite").save()
    done = time.monotonic()
    print(json.dumps({"session_s": round(started - t0, 2), "read_both_s": round(done - started, 2)}))
    spark.stop()
    return 0


def check(name: str, got: dict, want: dict) -> list[str]:
    return [f"{name}: {key} is {got.get(key)!r}, expected {want[key]!r}"
            for key in ("counts", "duplicate_histogram", "mismatched_columns", "in_doubt_applied")
            if got.get(key) != want[key]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, action="append", help="client rows, a multiple of 1000 (repeatable; "
                        "default 5000000 and 1000000)")
    parser.add_argument("--root", type=Path, default=ROOT / ".qtp" / "bench")
    parser.add_argument("--master", default="local[*]")
    parser.add_argument("--driver-memory", default="2g")
    parser.add_argument("--partitions", type=int)
    parser.add_argument("--fetchsize", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=1, help="Spark runs per size (SQL runs twice as many)")
    parser.add_argument("--sparse", action="store_true", help="100 anomalies in all instead of 9 per 1,000 keys")
    parser.add_argument("--mode", action="append", choices=("auto", "digest", "full"),
                        help="mode of the job (repeatable: each mode is run, interleaved, in the same run; "
                             "default auto); with full among them, each other mode's time is also given as a "
                             "ratio to full")
    parser.add_argument("--pushdown", action="store_true", default=None)
    parser.add_argument("--no-pushdown", dest="pushdown", action="store_false")
    parser.add_argument("--no-floor", action="store_true", help="skip the JDBC read-only measurement")
    parser.add_argument("--child-floor", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--pg-url", help=argparse.SUPPRESS)
    parser.add_argument("--maria-url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    global SPARSE
    SPARSE = args.sparse
    if args.child_floor:
        return child_floor(args)
    sizes = args.rows or [5_000_000, 1_000_000]
    if any(n % 1000 for n in sizes):
        parser.error("--rows must be multiples of 1000")

    pg = EmbeddedPostgres(args.root / "pg")
    maria = EmbeddedMariaDB(args.root / "mariadb")
    pg.start()
    maria.start()
    pg_url, maria_url = pg.create_database(DB), maria.create_database(DB)
    pg_conn = psycopg2.connect(host="127.0.0.1", port=pg.info.port, user="postgres", dbname=DB)
    pg_conn.autocommit = True
    my_conn = pymysql.connect(host="127.0.0.1", port=maria.info.port, user="root", database=DB)
    out = args.root / "reports"
    out.mkdir(parents=True, exist_ok=True)

    results, problems = [], []
    for rows in sizes:
        print(f"== {rows:,} client rows", flush=True)
        load_postgres(pg_conn, rows)
        load_mariadb(my_conn, rows)
        want = expected_counts(rows)
        sql_runs = [run_sql(pg_conn, rows) for _ in range(2 * args.repeat)]
        for run in sql_runs:
            problems += check(f"SQL {rows}", run, want)
        modes = args.mode or ["auto"]
        runs = {mode: [] for mode in modes}
        for _ in range(args.repeat):  # interleaved, so that a noisy minute hits every mode alike
            for mode in modes:
                runs[mode].append(run_spark(pg_url, maria_url, rows, args, out, mode))
        for mode, spark_runs in runs.items():
            for run in spark_runs:
                problems += check(f"Spark {mode} {rows}", run["report"], want)
                meta = run["report"]["metadata"]
                if (meta["client"]["rows"], meta["server"]["rows"]) != (rows, want["server_rows"]):
                    problems.append(f"Spark {mode} {rows}: rows {meta['client']['rows']}/{meta['server']['rows']}")
        floor = None if args.no_floor else read_floor(pg_url, maria_url, rows, args)
        best_sql = min(r["seconds"] for r in sql_runs)
        best_of = {mode: min(spark_runs, key=lambda r: r["wall_seconds"]) for mode, spark_runs in runs.items()}
        for mode, spark_runs in runs.items():
            best = best_of[mode]
            meta = best["report"]["metadata"]
            row = {
                "rows": rows, "server_rows": want["server_rows"], "mode_requested": mode,
                "spark_wall_s": round(best["wall_seconds"], 2), "spark_job_s": round(best["job_seconds"], 2),
                "rows_per_s": round((rows + want["server_rows"]) / best["wall_seconds"]),
                "peak_python_mib": round(max(r["peak_python_rss"] for r in spark_runs) / 2**20),
                "peak_jvm_mib": round(max(r["peak_jvm_rss"] for r in spark_runs) / 2**20),
                "sql_s": [round(r["seconds"], 2) for r in sql_runs], "sql_best_s": round(best_sql, 2),
                "ratio_wall": round(best["wall_seconds"] / best_sql, 2),
                "ratio_job": round(best["job_seconds"] / best_sql, 2),
                "ratio_to_full_wall": (round(best["wall_seconds"] / best_of["full"]["wall_seconds"], 2)
                                       if "full" in best_of else None),
                "spark_runs_wall_s": [round(r["wall_seconds"], 2) for r in spark_runs],
                "driver_memory": args.driver_memory, "read_floor": floor,
                "load_average_after": round(psutil.getloadavg()[0], 2),
                "mode": meta.get("mode"), "split": meta.get("seconds_split"),
                "driver_jvm": {k: meta["spark"].get(k) for k in ("class_archive", "compiler")},
                "args": {"sparse": args.sparse, "pushdown": args.pushdown},
                "counts": best["report"]["counts"], "verdict": best["report"]["verdict"],
                "exit_code": best["exit_code"],
            }
            results.append(row)
            print(json.dumps(row, indent=1), flush=True)

    name = f"results-{'sparse' if SPARSE else 'dense'}-{'-'.join(args.mode or ['auto'])}.json"
    (out / name).write_text(json.dumps({"results": results, "problems": problems}, indent=1))
    print(f"\n{'rows':>10} {'mode':>7} {'used':>7} {'spark wall s':>12} {'job s':>7} {'rows/s':>10} {'py MiB':>7} "
          f"{'jvm MiB':>8} {'SQL s':>7} {'/SQL':>6} {'/full':>6}")
    for r in results:
        print(f"{r['rows']:>10,} {r['mode_requested']:>7} {r['mode']['used']:>7} {r['spark_wall_s']:>12} "
              f"{r['spark_job_s']:>7} {r['rows_per_s']:>10,} {r['peak_python_mib']:>7} {r['peak_jvm_mib']:>8} "
              f"{r['sql_best_s']:>7} {r['ratio_wall']:>6} {r['ratio_to_full_wall'] or '-':>6}")
    print("counts exact" if not problems else "COUNT PROBLEMS:\n" + "\n".join(problems))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
