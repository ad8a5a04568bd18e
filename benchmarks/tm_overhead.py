"""What qtp's transaction manager costs, against hand-written two-phase commit and plain local commits.

Each transaction is one INSERT in each of two PostgreSQL databases (variants a-c), or both INSERTs in one
database (d, e), or one INSERT in PostgreSQL and one in MariaDB (f). Transactions per second at 1 and 16
threads:

  (a) hand-written psycopg2 2PC, no log     (b) SQLAlchemy Session(twophase=True)
  (c) qtp (Logging Last Resource: the default) (c_log) qtp with the file decision log (llr=False)
  (d) a plain local commit of both INSERTs in one database
  (e) qtp with both resource names on one database (shared branch: one local commit)
  (f) qtp over PostgreSQL + MariaDB with LLR  (f_log) the same with the file decision log

Two more variants split qtp's cost into its parts (they are measurements, not modes anyone should run):

  (a_sqla) the hand-written 2PC of (a), but with the INSERTs through SQLAlchemy Core connections, as in (c)
  (c_nosync) (c_log) with the decision log's fdatasync replaced by nothing (NOT durable)

Variants run in many short rounds, in a shuffled order each round, so that the machine's noise and any drift
(table growth, checkpoints) hit all of them alike; the figure for each is the median over rounds. Ratios are
computed within this one run.

    .venv/bin/python benchmarks/tm_overhead.py [--seconds 1] [--rounds 8] [--threads 1,16]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import psycopg2
import sqlalchemy
from sqlalchemy import Column, Integer, MetaData, String, Table, insert, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import qtp  # noqa: E402
from qtp.embedded import EmbeddedMariaDB, EmbeddedPostgres  # noqa: E402

metadata = MetaData()
t_a = Table("bench_a", metadata, Column("id", Integer, primary_key=True, autoincrement=True), Column("v", String(40)))
t_b = Table("bench_b", metadata, Column("id", Integer, primary_key=True, autoincrement=True), Column("v", String(40)))


def pg_connect(url: str):
    u = make_url(url)
    return psycopg2.connect(host=u.host, port=u.port, user=u.username, dbname=u.database)


# ------------------------------------------------------------------------------------------- the variants


def variant_a(url_a: str, url_b: str):
    """Hand-written psycopg2 two-phase commit: the cheapest correct 2PC without a decision log."""
    conns = threading.local()

    def run() -> None:
        if not hasattr(conns, "a"):
            conns.a, conns.b = pg_connect(url_a), pg_connect(url_b)
        a, b = conns.a, conns.b
        gtrid = uuid.uuid4().hex
        xa, xb = a.xid(1, gtrid, "a"), b.xid(1, gtrid, "b")
        a.tpc_begin(xa)
        b.tpc_begin(xb)
        with a.cursor() as cur:
            cur.execute("INSERT INTO bench_a (v) VALUES (%s)", ("x",))
        with b.cursor() as cur:
            cur.execute("INSERT INTO bench_b (v) VALUES (%s)", ("x",))
        a.tpc_prepare()
        b.tpc_prepare()
        a.tpc_commit()
        b.tpc_commit()

    return run, None


def variant_a_sqla(url_a: str, url_b: str):
    """(a) with the statements through SQLAlchemy Core: what the SQL layer alone costs, with no manager."""
    eng_a = sqlalchemy.create_engine(url_a, pool_size=20, max_overflow=20)
    eng_b = sqlalchemy.create_engine(url_b, pool_size=20, max_overflow=20)

    def run() -> None:
        gtrid = uuid.uuid4().hex
        with eng_a.connect() as ca, eng_b.connect() as cb:
            ra, rb = ca.connection.dbapi_connection, cb.connection.dbapi_connection
            ra.tpc_begin(ra.xid(1, gtrid, "a"))
            rb.tpc_begin(rb.xid(1, gtrid, "b"))
            ca.execute(insert(t_a), {"v": "x"})
            cb.execute(insert(t_b), {"v": "x"})
            ra.tpc_prepare()
            rb.tpc_prepare()
            ra.tpc_commit()
            rb.tpc_commit()

    return run, lambda: (eng_a.dispose(), eng_b.dispose())


def variant_b(url_a: str, url_b: str):
    """SQLAlchemy's own two-phase Session over two engines."""
    eng_a = sqlalchemy.create_engine(url_a, pool_size=20, max_overflow=20)
    eng_b = sqlalchemy.create_engine(url_b, pool_size=20, max_overflow=20)

    def run() -> None:
        with Session(binds={t_a: eng_a, t_b: eng_b}, twophase=True) as session:
            session.execute(insert(t_a), {"v": "x"})
            session.execute(insert(t_b), {"v": "x"})
            session.commit()

    return run, lambda: (eng_a.dispose(), eng_b.dispose())


def _qtp_manager(urls: dict[str, str], llr: bool = True) -> qtp.TransactionManager:
    tm = qtp.TransactionManager(f"bench-{uuid.uuid4().hex[:8]}", tempfile.mkdtemp(prefix="qtp-bench-"),
                                recovery_interval=None, llr=llr)
    for name, url in urls.items():
        tm.add_resource(name, url)
    tm.start_recovery()  # the start-up pass, outside the measurement
    return tm


def variant_c(url_a: str, url_b: str, llr: bool = True):
    tm = _qtp_manager({"a": url_a, "b": url_b}, llr=llr)

    def run() -> None:
        with tm.transaction() as tx:
            tx.connection("a").execute(insert(t_a), {"v": "x"})
            tx.connection("b").execute(insert(t_b), {"v": "x"})

    return run, tm


def variant_c_log(url_a: str, url_b: str):
    return variant_c(url_a, url_b, llr=False)


def variant_c_nosync(url_a: str, url_b: str):
    run, tm = variant_c(url_a, url_b, llr=False)
    tm.log._sync = lambda fd: None  # decomposition only: without the fsync the decision is not durable
    return run, tm


MARIA_URL: str | None = None  # set by main(): the MariaDB database of the (f) variants


def variant_f(url_a: str, url_b: str, llr: bool = True):
    return variant_c(url_a, MARIA_URL, llr=llr)


def variant_f_log(url_a: str, url_b: str):
    return variant_f(url_a, url_b, llr=False)


def variant_d(url_a: str, url_b: str):
    """A plain local transaction through SQLAlchemy Core: both INSERTs, one COMMIT, in database a."""
    eng = sqlalchemy.create_engine(url_a, pool_size=20, max_overflow=20)

    def run() -> None:
        with eng.begin() as conn:
            conn.execute(insert(t_a), {"v": "x"})
            conn.execute(insert(t_b), {"v": "x"})

    return run, eng.dispose


def variant_d_raw(url_a: str, url_b: str):
    """The same local transaction with bare psycopg2 (shown for reference: no SQLAlchemy at all)."""
    conns = threading.local()

    def run() -> None:
        if not hasattr(conns, "a"):
            conns.a = pg_connect(url_a)
        with conns.a.cursor() as cur:
            cur.execute("INSERT INTO bench_a (v) VALUES (%s)", ("x",))
            cur.execute("INSERT INTO bench_b (v) VALUES (%s)", ("x",))
        conns.a.commit()

    return run, None


def variant_e(url_a: str, url_b: str):
    tm = _qtp_manager({"app": url_a, "store": url_a.replace("127.0.0.1", "localhost")})

    def run() -> None:
        with tm.transaction() as tx:
            tx.connection("app").execute(insert(t_a), {"v": "x"})
            tx.connection("store").execute(insert(t_b), {"v": "x"})

    return run, tm


VARIANTS = {"a": variant_a, "a_sqla": variant_a_sqla, "b": variant_b, "c": variant_c, "c_log": variant_c_log,
            "c_nosync": variant_c_nosync, "d": variant_d, "d_raw": variant_d_raw, "e": variant_e, "f": variant_f,
            "f_log": variant_f_log}
LABELS = {
    "a": "hand-written psycopg2 2PC, no log",
    "a_sqla": "(a) with INSERTs through SQLAlchemy Core",
    "b": "SQLAlchemy Session(twophase=True)",
    "c": "qtp, LLR (2 PostgreSQL)",
    "c_log": "qtp, file log (2 PostgreSQL)",
    "c_nosync": "(c_log) without the log fsync (NOT durable)",
    "d": "local commit, SQLAlchemy Core (1 database)",
    "d_raw": "local commit, bare psycopg2 (1 database)",
    "e": "qtp, shared branch (1 database)",
    "f": "qtp, LLR (PostgreSQL + MariaDB)",
    "f_log": "qtp, file log (PostgreSQL + MariaDB)",
}


# ------------------------------------------------------------------------------------------- measurement


def measure(run, threads: int, seconds: float) -> float:
    """Transactions per second of ``run`` on ``threads`` threads for ``seconds`` (after a short warm-up)."""
    stop = threading.Event()
    counts = [0] * threads
    errors: list[BaseException] = []
    start_gate = threading.Barrier(threads + 1)

    def worker(i: int) -> None:
        try:
            for _ in range(5):
                run()
            start_gate.wait()
            n = 0
            while not stop.is_set():
                run()
                n += 1
            counts[i] = n
        except BaseException as exc:  # reported after the run
            errors.append(exc)
            try:
                start_gate.abort()
            except threading.BrokenBarrierError:
                pass

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    try:
        start_gate.wait()
    except threading.BrokenBarrierError:
        pass
    began = time.perf_counter()
    time.sleep(seconds)
    stop.set()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - began
    if errors:
        raise errors[0]
    return sum(counts) / elapsed


def machine() -> str:
    model = subprocess.run(["sh", "-c", "lscpu | sed -n 's/^Model name: *//p'"], capture_output=True,
                           text=True).stdout.strip()
    cores = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    return f"{model or platform.processor()}, {cores} cores, Python {platform.python_version()}, " \
           f"PostgreSQL {psycopg2.__libpq_version__ // 10000} client"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=1.0, help="measuring time per variant per round")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", default="1,16")
    parser.add_argument("--root", default=".qtp/pg", help="the private PostgreSQL server's folder")
    parser.add_argument("--maria-root", default=".qtp/mariadb", help="the private MariaDB server's folder")
    parser.add_argument("--variants", help="comma list of variants to run (default: all)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args()
    chosen = {k: VARIANTS[k] for k in (args.variants.split(",") if args.variants else VARIANTS)}

    global MARIA_URL
    maria = EmbeddedMariaDB(args.maria_root)
    maria.start()
    MARIA_URL = maria.create_database("bench_tm_maria")
    engine = sqlalchemy.create_engine(MARIA_URL)
    metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE bench_b"))
    engine.dispose()

    server = EmbeddedPostgres(args.root)
    server.start()
    urls = []
    for name in ("bench_tm_a", "bench_tm_b"):
        url = server.create_database(name)
        engine = sqlalchemy.create_engine(url)
        metadata.create_all(engine)
        with engine.begin() as conn:
            conn.execute(text("TRUNCATE bench_a, bench_b"))
        engine.dispose()
        urls.append(url)

    thread_counts = [int(t) for t in args.threads.split(",")]
    results: dict[str, dict[int, list[float]]] = {v: {t: [] for t in thread_counts} for v in chosen}
    fsync_share: dict[int, list[float]] = {t: [] for t in thread_counts}
    shuffle = random.Random(7)
    for round_no in range(1, args.rounds + 1):
        for threads in thread_counts:
            order = list(chosen)
            shuffle.shuffle(order)
            for key in order:
                run, resource = chosen[key](*urls)
                before = (resource.log.forced_records, resource.log.fsyncs) if key == "c_log" else None
                rate = measure(run, threads, args.seconds)
                results[key][threads].append(rate)
                if before is not None:
                    forced = resource.log.forced_records - before[0]
                    syncs = resource.log.fsyncs - before[1]
                    fsync_share[threads].append(forced / syncs if syncs else 0.0)
                if isinstance(resource, qtp.TransactionManager):
                    resource.close()
                elif callable(resource):
                    resource()
                print(f"round {round_no} threads {threads:2d} ({key}) {LABELS[key]:45s} {rate:8.0f} tx/s",
                      flush=True)

    med = {k: {t: statistics.median(v) for t, v in per.items()} for k, per in results.items()}
    dpf = {t: statistics.median(v) for t, v in fsync_share.items() if v}
    print()
    print(f"machine: {machine()}")
    header = "variant".ljust(50) + "".join(f"{t:>4} thr tx/s" for t in thread_counts)
    print(header)
    for key in chosen:
        print(f"({key}) {LABELS[key]}".ljust(50) + "".join(f"{med[key][t]:>13.0f}" for t in thread_counts))
    print()
    targets = []

    def ratio(top: str, bottom: str, t: int, target: float | None) -> None:
        if top in med and bottom in med:
            targets.append((f"({top})/({bottom}) at {t} thread(s)", med[top][t] / med[bottom][t], target))

    for t in thread_counts:  # issue 11's targets, and issue 2's for the file-log path
        ratio("c", "a", t, 1.2 if t == 1 else 1.0 if t >= 16 else None)
        ratio("c", "b", t, 1.3 if t == 1 else None)
        ratio("f", "f_log", t, 1.3 if t == 1 else None)
        ratio("c_log", "a", t, None)
        ratio("e", "d", t, 0.9)
        if dpf.get(t):
            targets.append((f"decisions per log fsync at {t} thread(s), (c_log)", dpf[t], 4.0 if t >= 16 else None))
    for name, value, target in targets:
        verdict = "" if target is None else ("met" if value >= target else "NOT met") + f" (target >= {target})"
        print(f"{name:42s} {value:6.2f}  {verdict}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "median_tx_per_s": med,
                                               "decisions_per_fsync": dpf, "rounds": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
