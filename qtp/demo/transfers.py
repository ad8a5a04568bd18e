"""``make demo``: money moves between an accounts table in PostgreSQL and one in MariaDB, atomically.

Several threads each run transfers under ``with qtp.transaction()``: debit an account in one database,
credit an account in the other. A transfer that would overdraw raises inside the block and is rolled back
on both sides. The total balance across both databases is the invariant: it must be the same before and
after, whatever ran in between.

    python -m qtp.demo.transfers [--threads 8] [--transfers 2000] [--accounts 100]
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from pathlib import Path

import sqlalchemy
from sqlalchemy import text

import qtp
from qtp.embedded import DEFAULT_ROOT, EmbeddedMariaDB, EmbeddedPostgres
from qtp.errors import RollbackError

INITIAL = 1_000


class Overdraft(Exception):
    """The application's own error: the debit would make a balance negative."""


def setup(url: str, accounts: int) -> sqlalchemy.Engine:
    engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool)
    with engine.begin() as conn:
        conn.execute(text("DROP TABLE IF EXISTS accounts"))
        conn.execute(text("CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL)"))
        conn.execute(text("INSERT INTO accounts (id, balance) VALUES (:id, :b)"),
                     [{"id": i, "b": INITIAL} for i in range(accounts)])
    return engine


def total(engine: sqlalchemy.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text("SELECT COALESCE(SUM(balance), 0) FROM accounts")).scalar())


_UPDATE = text("UPDATE accounts SET balance = balance + :delta WHERE id = :id")
_BALANCE = text("SELECT balance FROM accounts WHERE id = :id")


def transfer(source: str, src_id: int, dst_id: int, amount: int) -> None:
    """Move ``amount`` from account ``src_id`` in ``source`` to account ``dst_id`` in the other database.

    Rows are always locked in PostgreSQL first: neither database can see a deadlock that spans both, so a
    fixed order is what keeps two opposite transfers from waiting on each other forever.
    """
    pg_id, maria_id = (src_id, dst_id) if source == "pg" else (dst_id, src_id)
    pg_delta = -amount if source == "pg" else amount
    with qtp.transaction() as tx:
        tx.connection("pg").execute(_UPDATE, {"delta": pg_delta, "id": pg_id})
        tx.connection("maria").execute(_UPDATE, {"delta": -pg_delta, "id": maria_id})
        left = tx.connection(source).execute(_BALANCE, {"id": src_id}).scalar()
        if left < 0:
            raise Overdraft(f"account {src_id} in {source} would go to {left}")


def worker(plan: list[tuple], stats: dict, lock: threading.Lock) -> None:
    for source, src_id, dst_id, amount in plan:
        try:
            transfer(source, src_id, dst_id, amount)
            outcome = "committed"
        except Overdraft:
            outcome = "overdraft (rolled back)"
        except RollbackError:
            outcome = "rolled back by the manager"
        with lock:
            stats[outcome] = stats.get(outcome, 0) + 1
            stats["done"] += 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qtp.demo.transfers", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--transfers", type=int, default=2000)
    parser.add_argument("--accounts", type=int, default=100)
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT, help="folder of qtp's private servers")
    args = parser.parse_args(argv)

    print("starting qtp's private PostgreSQL and MariaDB ...", flush=True)
    pg = EmbeddedPostgres(args.root / "pg")
    pg.start()
    maria = EmbeddedMariaDB(args.root / "mariadb")
    maria.start()
    pg_url, maria_url = pg.create_database("qtp_demo"), maria.create_database("qtp_demo")
    engines = {"pg": setup(pg_url, args.accounts), "maria": setup(maria_url, args.accounts)}
    before = {name: total(engine) for name, engine in engines.items()}

    tm = qtp.TransactionManager(node_id="demo", log_dir=Path("recovery_logs"))
    tm.add_resource("pg", pg_url)
    tm.add_resource("maria", maria_url)
    qtp.install(tm)
    recovered = tm.start_recovery()
    if recovered is not None and recovered.rows:
        print(f"recovery at start-up: {recovered.committed} branch(es) committed, {recovered.rolled_back} rolled "
              "back, left in doubt by an earlier run")

    rng = random.Random(42)
    plans: list[list[tuple]] = [[] for _ in range(args.threads)]
    for i in range(args.transfers):
        source = "pg" if rng.random() < 0.5 else "maria"
        plans[i % args.threads].append((source, rng.randrange(args.accounts), rng.randrange(args.accounts),
                                        rng.randint(1, 400)))

    print(f"before: PostgreSQL {before['pg']:,} + MariaDB {before['maria']:,} = {sum(before.values()):,}")
    print(f"running {args.transfers:,} transfers on {args.threads} threads ...", flush=True)
    stats: dict = {"done": 0}
    lock = threading.Lock()
    threads = [threading.Thread(target=worker, args=(plan, stats, lock)) for plan in plans]
    began = time.perf_counter()
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        time.sleep(1.0)
        print(f"  {stats['done']:,}/{args.transfers:,} transfers", flush=True)
    elapsed = time.perf_counter() - began
    forced, fsyncs = tm.log.forced_records, tm.log.fsyncs
    tm.close()

    after = {name: total(engine) for name, engine in engines.items()}
    print()
    print(f"after:  PostgreSQL {after['pg']:,} + MariaDB {after['maria']:,} = {sum(after.values()):,}")
    for outcome in sorted(k for k in stats if k != "done"):
        print(f"  {outcome:28s} {stats[outcome]:6,}")
    print(f"throughput: {stats['done'] / elapsed:,.0f} transfers/s ({elapsed:.1f} s)")
    share = forced / fsyncs if fsyncs else 0.0
    print(f"decision log: {forced:,} commit decisions in {fsyncs:,} fsyncs ({share:.2f} decisions per fsync)")
    held = sum(before.values()) == sum(after.values())
    print("invariant:", "holds (total balance unchanged)" if held else "VIOLATED")
    return 0 if held else 1


if __name__ == "__main__":
    sys.exit(main())
