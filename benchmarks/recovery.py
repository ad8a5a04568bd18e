"""Recovery benchmark: resolve N in-doubt branches (default 10,000) across PostgreSQL and MariaDB.

Set-up (not timed): N/2 global transactions, each with one prepared branch on PostgreSQL and one on
MariaDB, exactly as a crashed manager leaves them; half of them have a COMMIT decision in the node's log,
the other half none (presumed abort). Timed: one ``qtp recover`` pass (``recover_node``, the code behind
the command): scan both in-doubt lists, commit 5,000 branches, roll back 5,000, write the END records and
checkpoint the log. Then every branch is checked to be gone and every decided row committed.

Uses its own PostgreSQL (max_prepared_transactions must exceed N/2) and MariaDB under ``.qtp/recovery-bench``.

    .venv/bin/python benchmarks/recovery.py [--branches 10000] [--workers 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psycopg2
import pymysql
from sqlalchemy.engine import make_url

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qtp.config import load_config  # noqa: E402
from qtp.coordinator import DecisionLog  # noqa: E402
from qtp.embedded import EmbeddedMariaDB, EmbeddedPostgres  # noqa: E402
from qtp.recovery import recover_node  # noqa: E402
from qtp.xa import Xid  # noqa: E402

NODE = "bench-recovery"
ROOT = Path(".qtp/recovery-bench")


def _pg(url: str):
    u = make_url(url)
    conn = psycopg2.connect(host=u.host, port=u.port, user=u.username, dbname=u.database)
    conn.autocommit = True
    return conn


def _my(url: str):
    u = make_url(url)
    return pymysql.connect(host=u.host, port=u.port, user=u.username, database=u.database, autocommit=True)


def _prepare_pg(url: str, xids: list[Xid]) -> None:
    conn = _pg(url)
    with conn.cursor() as cur:
        for xid in xids:
            cur.execute(f"BEGIN; INSERT INTO bench VALUES ('{xid.gtrid.decode()}'); "
                        f"PREPARE TRANSACTION '{xid.to_pg_gid()}'")
    conn.close()


def _prepare_my(url: str, xids: list[Xid]) -> None:
    for xid in xids:  # a MariaDB session holds its prepared branch until it disconnects
        conn = _my(url)
        with conn.cursor() as cur:
            cur.execute(f"XA START {xid.to_mysql()}")
            cur.execute(f"INSERT INTO bench VALUES ('{xid.gtrid.decode()}')")
            cur.execute(f"XA END {xid.to_mysql()}")
            cur.execute(f"XA PREPARE {xid.to_mysql()}")
        conn.close()


def clean(pg_url: str, my_url: str) -> None:
    """Roll back what an interrupted earlier run of this benchmark left prepared."""
    pg, my = _pg(pg_url), _my(my_url)
    with pg.cursor() as cur:
        cur.execute("SELECT gid FROM pg_prepared_xacts WHERE database = current_database()")
        for (gid,) in cur.fetchall():
            cur.execute(f"ROLLBACK PREPARED '{gid}'")
    with my.cursor() as cur:
        cur.execute("XA RECOVER FORMAT='SQL'")
        for row in cur.fetchall():
            xid = Xid.from_mysql(row[3].decode() if isinstance(row[3], bytes) else row[3])
            if xid is not None and xid.belongs_to(NODE):
                cur.execute(f"XA ROLLBACK {xid.to_mysql()}")
    pg.close()
    my.close()


def setup(pg_url: str, my_url: str, log_root: Path, transactions: int) -> list[bytes]:
    clean(pg_url, my_url)
    for conn in (_pg(pg_url), _my(my_url)):
        with conn.cursor() as cur:
            cur.execute("DROP TABLE IF EXISTS bench")
            cur.execute("CREATE TABLE bench (gtrid VARCHAR(64) PRIMARY KEY)")
        conn.close()
    gtrids = [Xid.new_gtrid(NODE) for _ in range(transactions)]
    chunks = [gtrids[i::8] for i in range(8)]
    with ThreadPoolExecutor(16) as pool:
        jobs = [pool.submit(_prepare_pg, pg_url, [Xid.of(g, "pg") for g in c]) for c in chunks]
        jobs += [pool.submit(_prepare_my, my_url, [Xid.of(g, "my") for g in c]) for c in chunks]
        for job in jobs:
            job.result()
    decided = gtrids[: transactions // 2]
    log = DecisionLog(log_root / NODE)
    with ThreadPoolExecutor(32) as pool:  # group commit writes them quickly
        list(pool.map(lambda g: log.log_commit(g.decode(), ["pg", "my"]), decided))
    log.close()
    return decided


def count(pg_url: str, my_url: str) -> tuple[int, int, int, int]:
    """(prepared on PG, prepared on MariaDB of this node, rows on PG, rows on MariaDB)."""
    pg, my = _pg(pg_url), _my(my_url)
    with pg.cursor() as cur:
        cur.execute("SELECT count(*) FROM pg_prepared_xacts WHERE database = current_database()")
        pg_prepared = cur.fetchone()[0]
        cur.execute("SELECT count(*) FROM bench")
        pg_rows = cur.fetchone()[0]
    with my.cursor() as cur:
        cur.execute("XA RECOVER")
        my_prepared = sum(1 for row in cur.fetchall() if row[3][: row[1]].startswith(NODE.encode()))
        cur.execute("SELECT count(*) FROM bench")
        my_rows = cur.fetchone()[0]
    pg.close()
    my.close()
    return pg_prepared, my_prepared, pg_rows, my_rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--branches", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=32)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    transactions = args.branches // 2
    pg = EmbeddedPostgres(ROOT / "pg", max_prepared_transactions=transactions + 200)
    pg.start()
    probe = _pg(pg.info.url())
    with probe.cursor() as cur:
        cur.execute("SHOW max_prepared_transactions")
        too_few = int(cur.fetchone()[0]) < transactions
    probe.close()
    if too_few:  # a server left running by a smaller run: restart it with enough slots
        pg.stop()
        pg.start()
    maria = EmbeddedMariaDB(ROOT / "mariadb")
    maria.start()
    pg_url, my_url = pg.create_database("recovery_bench"), maria.create_database("recovery_bench")
    work = Path(tempfile.mkdtemp(prefix="qtp-recovery-bench-"))
    try:
        config_path = work / "qtp.toml"
        config_path.write_text(f'[node]\nid = "{NODE}"\nlog_dir = "{work / "logs"}"\n\n'
                               f'[resources.pg]\nurl = "{pg_url}"\n\n[resources.my]\nurl = "{my_url}"\n')
        began = time.monotonic()
        setup(pg_url, my_url, work / "logs", transactions)
        print(f"set-up: {args.branches} prepared branches in {time.monotonic() - began:.1f} s "
              f"({count(pg_url, my_url)[:2]} on PostgreSQL, MariaDB)")

        began = time.monotonic()
        report = recover_node(load_config(config_path), workers=args.workers)
        seconds = time.monotonic() - began

        pg_prepared, my_prepared, pg_rows, my_rows = count(pg_url, my_url)
        result = {
            "branches": args.branches, "workers": args.workers, "seconds": round(seconds, 2),
            "branches_per_s": round(args.branches / seconds), "committed": report.committed,
            "rolled_back": report.rolled_back, "ended": len(report.ended), "ok": report.ok,
            "left_prepared": pg_prepared + my_prepared, "rows": [pg_rows, my_rows],
        }
        print(json.dumps(result))
        good = (report.ok and report.committed == report.rolled_back == transactions and pg_prepared == 0
                and my_prepared == 0 and pg_rows == my_rows == transactions // 2)
        print(f"{args.branches} in-doubt branches resolved in {seconds:.2f} s "
              f"({'target <= 10 s met' if seconds <= 10 else 'TARGET OF 10 s MISSED'}); "
              f"{'all checks passed' if good else 'CHECKS FAILED'}")
        if args.json:
            args.json.write_text(json.dumps(result, indent=2))
        return 0 if good else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
