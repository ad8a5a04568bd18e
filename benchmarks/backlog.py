"""A backlog drained: memory of both nodes and the size of the store tables, at 10,000 and 100,000 messages.

For each N: the store tables are created, then the client node commits N
one-way 1 KB orders (16 threads) while the server is down, so the backlog builds in the client's
``qtp_rm_outgoing``; then the server starts and the run waits until every order is applied and nothing is
left unacknowledged or unapplied. The RSS of both ``qtp serve`` processes is sampled every 0.2 s while the
backlog drains (and VmHWM, the peak over the process's life, read at the end). Store tables are measured
before the run, at the peak, and after the drain: rows, and bytes on disk (PostgreSQL
``pg_total_relation_size``; MariaDB ``data_length + index_length`` after ``ANALYZE TABLE``). Neither server
gives disk space back by itself: PostgreSQL's autovacuum makes dead rows' space reusable without shrinking
the file (``VACUUM`` is run at the end and sizes are taken again), InnoDB keeps its pages.

    python benchmarks/backlog.py [--messages 10000,100000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import sqlalchemy as sa
from e2e_throughput import PAD, _fresh

from qtp.embedded import DEFAULT_ROOT, EmbeddedMariaDB, EmbeddedPostgres
from qtp.testing.nodes import NodeProcess, Pair, client_schema, rows, server_schema, wait_until
from qtp.wsrm.store import SqlStore

TABLES = ("qtp_rm_outgoing", "qtp_rm_source", "qtp_rm_destination", "qtp_rm_incoming", "qtp_rm_invoker",
          "qtp_rm_applied", "qtp_rm_dead_letter")


def _rss_mib(pid: int, field: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def _sizes(url: str) -> dict[str, tuple[int, int]]:
    """table -> (rows, bytes on disk)."""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    out = {}
    with engine.connect() as conn:
        for table in TABLES:
            count = conn.execute(sa.text(f"SELECT COUNT(*) FROM {table}")).scalar()
            if url.startswith("postgresql"):
                size = conn.execute(sa.text(f"SELECT pg_total_relation_size('{table}')")).scalar()
            else:
                conn.execute(sa.text(f"ANALYZE TABLE {table}")).fetchall()
                size = conn.execute(sa.text(
                    "SELECT data_length + index_length FROM information_schema.tables "
                    "WHERE table_schema = DATABASE() AND table_name = :t"), {"t": table}).scalar()
            out[table] = (int(count), int(size or 0))
    engine.dispose()
    return out


def _vacuum(url: str) -> None:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        for table in TABLES:
            conn.execute(sa.text(f"VACUUM {table}"))
    engine.dispose()


def run(pg, maria, folder: Path, messages: int) -> dict:
    tag = f"bl{messages}_{int(time.time())}"
    client_app, server_app = _fresh(pg, f"c{tag}"), _fresh(maria, f"s{tag}")
    client_schema(client_app)
    server_schema(server_app)
    run_dir = folder / tag
    run_dir.mkdir(parents=True, exist_ok=True)
    client_config, server_config = Pair(client_app, server_app).write(run_dir)
    for url in (client_app, server_app):  # the tables a node creates at its start, created now
        SqlStore("app", sa.create_engine(url, poolclass=sa.pool.NullPool)).create()
    server = NodeProcess(server_config, run_dir / "server.log")
    client = NodeProcess(client_config, run_dir / "client.log",
                         {"QTP_TEST_SEND": str(messages), "QTP_TEST_THREADS": "16", "QTP_TEST_PAD": str(PAD)})
    pre = {"client": _sizes(client_app), "server": _sizes(server_app)}
    began = time.monotonic()
    client.start()
    wait_until(lambda: rows(client_app, "SELECT COUNT(*) FROM orders")[0][0] >= messages, 1800, "every order")
    enqueued_s = time.monotonic() - began
    peak = {"client": _sizes(client_app), "server": _sizes(server_app)}
    server.start()
    drained_at, rss = time.monotonic(), {"client": 0.0, "server": 0.0}
    try:
        while True:
            for name, node in (("client", client), ("server", server)):
                rss[name] = max(rss[name], _rss_mib(node.proc.pid))
            done = rows(server_app, "SELECT COUNT(*) FROM applied")[0][0] >= messages and \
                rows(client_app, "SELECT COUNT(*) FROM qtp_rm_outgoing")[0][0] == 0 and \
                rows(server_app, "SELECT COUNT(*) FROM qtp_rm_incoming")[0][0] == 0
            if done or time.monotonic() - drained_at > 1800:
                break
            time.sleep(0.2)
        drain_s = time.monotonic() - drained_at
        hwm = {name: _rss_mib(node.proc.pid, "VmHWM") for name, node in (("client", client), ("server", server))}
        time.sleep(3.0)
        after = {"client": _sizes(client_app), "server": _sizes(server_app)}
    finally:
        client.stop()
        server.stop()
    _vacuum(client_app)
    return {"messages": messages, "enqueue_rate": round(messages / enqueued_s, 1),
            "drain_rate": round(messages / drain_s, 1),
            "applied": rows(server_app, "SELECT COUNT(*) FROM applied")[0][0],
            "peak_rss_mib_while_draining": {k: round(v, 1) for k, v in rss.items()},
            "vm_hwm_mib": {k: round(v, 1) for k, v in hwm.items()},
            "tables": {"pre": pre, "peak": peak, "after": after,
                       "client_after_vacuum": _sizes(client_app)}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", default="10000,100000")
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    pg, maria = EmbeddedPostgres(args.root / "pg"), EmbeddedMariaDB(args.root / "mariadb")
    pg.start()
    maria.start()
    results = [run(pg, maria, args.root / "backlog", int(n)) for n in args.messages.split(",")]
    for r in results:
        t = r["tables"]
        print(f"{r['messages']:>7} messages: enqueued {r['enqueue_rate']}/s, drained {r['drain_rate']}/s, "
              f"applied {r['applied']}; peak RSS while draining {r['peak_rss_mib_while_draining']} MiB, "
              f"VmHWM {r['vm_hwm_mib']} MiB")
        for side in ("client", "server"):
            for table in TABLES:
                (pr, pb), (kr, kb), (ar, ab) = (t[when][side][table] for when in ("pre", "peak", "after"))
                if kr or pb != ab:
                    print(f"    {side:6} {table:20} rows {pr} -> {kr} -> {ar}; bytes {pb} -> {kb} -> {ab}")
    if len(results) > 1:
        for side in ("client", "server"):
            ratio = results[-1]["peak_rss_mib_while_draining"][side] / results[0]["peak_rss_mib_while_draining"][side]
            print(f"peak RSS {side}: {ratio:.2f}x at {results[-1]['messages']} vs {results[0]['messages']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
