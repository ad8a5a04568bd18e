"""Takeover time of a replicated node: how long orders stop being applied when the owner of the server dies.

The server node runs as two replicas (``qtp serve`` processes with the same config but for their own log
folder and port, as on two hosts) sharing its identity through a ``[lease]`` of ``--ttl`` seconds: one owns
the node and serves, the other waits as a standby. A failover proxy (qtp.testing.lossy_proxy, no loss) is
the node's address; a client node sends one-way orders through it at a steady ``--rate``. The client's
database is PostgreSQL, the server's MariaDB (``--server-db``), both embedded servers of the benchmark's own.

Each round, once orders flow: SIGKILL the owner's process group and wait until it has exited; ``mark`` is
then the highest ``applied.id`` handed out; the server's ``applied`` table is polled (every 10 ms, on one
connection) until it holds a row above ``mark`` written by another process (``applied.pid``). A sample is
the time from the SIGKILL to that row being seen: everything a peer waits for, that is the owner's lease
running out (up to ``ttl`` after its last renewal; renewals every ttl/5), the standby noticing (it polls
every ttl/10), raising the fence, recovering, starting the runtime and the endpoint, the proxy failing over
(a dead replica refuses at once), and the client's retry backoff (0.1-1 s) before its next attempt gets
through. ``took_over_s``, from the SIGKILL to the ``took over node`` line of the new owner's log, separates
the lease's share from the rest. The killed replica is then started again (it becomes the standby).

``--pause``: SIGSTOP instead of SIGKILL (a process that hangs; the kernel still accepts connections for it,
so the proxy waits ``--failover-s`` on each before it tries the standby); the sample runs from the SIGSTOP to
the first order applied by another process. The paused process is then resumed (SIGCONT); it must find its
lease taken and exit with status 75 (each sample records its exit status), and is started again.

At the end the client stops sending, its backlog drains, and the tables are checked for exactly-once
(qtp.testing.nodes.check_exactly_once). Printed: a line per round, then p50 / p90 / p99 / max of the
samples; ``--json PATH`` writes them with every sample.

    python benchmarks/takeover.py --takeovers 50 --rate 50 --ttl 5 [--pause] [--json takeover.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy import text

from qtp.embedded import EmbeddedMariaDB, EmbeddedPostgres, free_port
from qtp.testing.lossy_proxy import LossyProxy
from qtp.testing.nodes import (LOST_LEASE_STATUS, TOOK_OVER_LINE, NodeProcess, Pair, Replicas, applied_id_mark,
                               check_exactly_once, client_schema, owner_of, rows, server_schema, wait_until)

POLL_S = 0.01


class Applied:
    """The server's ``applied`` table, polled on one connection."""

    def __init__(self, url: str):
        self.url = url
        self.engine = sa.create_engine(url, pool_size=1, pool_pre_ping=True)

    def count(self, after: int = 0, not_by: int = 0) -> int:
        """Rows with an id above ``after`` and written by another process than ``not_by``."""
        with self.engine.connect() as conn:
            return conn.execute(text("SELECT COUNT(*) FROM applied WHERE id > :a AND pid <> :p"),
                                {"a": after, "p": not_by}).scalar()

    def wait_new(self, after: int, not_by: int, timeout: float) -> float | None:
        """The monotonic instant a row above ``after`` not by ``not_by`` was first seen; None after ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.count(after, not_by):
                return time.monotonic()
            time.sleep(POLL_S)
        return None


def _took_over_at(node: NodeProcess) -> float | None:
    """The wall-clock instant of the ``took over node`` line in ``node``'s log since its start."""
    for line in node.said().splitlines():
        if TOOK_OVER_LINE in line:
            stamp = line[:23].decode()  # e2e_app's log format: "%Y-%m-%d %H:%M:%S,mmm ..."
            return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return None


def _flowing(applied: Applied, rate: float, timeout: float) -> None:
    """Wait until orders are being applied again (a fifth of a second's worth after this call)."""
    start = applied_id_mark(applied.url)
    wait_until(lambda: applied.count(start) >= max(3, rate / 5), timeout, "orders applied steadily", poll=0.05)


def _round(i: int, args: argparse.Namespace, servers: dict[str, NodeProcess], applied: Applied) -> dict:
    owner = owner_of(list(servers.values()), timeout=3 * args.ttl + 60)
    if owner is None:
        raise SystemExit(f"round {i}: no replica owns the server node:\n" +
                         "\n".join(node.tail(10) for node in servers.values()))
    name = next(n for n, node in servers.items() if node is owner)
    standby = next(node for node in servers.values() if node is not owner)
    pid = owner.proc.pid
    began, wall = time.monotonic(), time.time()
    if args.pause:
        owner.pause()
    else:
        owner.kill()
    seen = applied.wait_new(applied_id_mark(applied.url), pid, timeout=3 * args.ttl + 60)
    took_over = _took_over_at(standby)
    sample = {"i": i, "victim": name, "pid": pid, "applied_s": None if seen is None else round(seen - began, 3),
              "took_over_s": None if took_over is None else round(took_over - wall, 3)}
    if args.pause:
        owner.resume()
        sample["exit"] = owner.wait_exit(args.ttl + 30)
        owner.kill()  # (nothing if it exited; one that did not notice its loss is not left running)
    owner.start_replica()
    sample["restarted_as"] = owner.role()
    return sample


def _said(sample: dict) -> str:
    exited = f"; it exited with {sample['exit']}" if "exit" in sample else ""
    return (f"{'paused' if 'exit' in sample else 'killed'} {sample['victim']} (pid {sample['pid']}); took over "
            f"after {sample['took_over_s']} s, applied again after {sample['applied_s']} s{exited}; restarted as "
            f"{sample['restarted_as']}")


def _report(samples: list[dict]) -> dict:
    times = sorted(s["applied_s"] for s in samples if s["applied_s"] is not None)
    cuts = statistics.quantiles(times, n=100, method="inclusive") if len(times) > 1 else times * 99
    return {"samples": len(samples), "no_takeover": len(samples) - len(times),
            "p50_s": round(cuts[49], 3) if cuts else None, "p90_s": round(cuts[89], 3) if cuts else None,
            "p99_s": round(cuts[98], 3) if cuts else None, "max_s": times[-1] if times else None}


def _drain(client: NodeProcess, applied: Applied, client_app: str, timeout: float) -> None:
    """Stop the client's sending (a restart with nothing left to send), wait until its backlog is applied."""
    client.stop()
    last = rows(client_app, "SELECT COALESCE(MAX(k), 0) FROM orders")[0][0]
    client.env["QTP_TEST_SEND"] = str(last)
    client.start()
    committed = rows(client_app, "SELECT COUNT(*) FROM orders WHERE status = 'committed'")[0][0]
    wait_until(lambda: applied.count() >= committed, timeout, f"{committed} orders applied", poll=0.5)


def run(args: argparse.Namespace) -> int:
    tag = f"t{int(time.time())}"
    out = Path(args.out or f".qtp/takeover/{tag}")
    out.mkdir(parents=True, exist_ok=True)
    pg, maria = EmbeddedPostgres(Path(args.root) / "pg"), EmbeddedMariaDB(Path(args.root) / "mariadb")
    pg.start()
    maria.start()
    client_app = pg.create_database(f"c_{tag}")
    server_app = (maria if args.server_db == "mariadb" else pg).create_database(f"s_{tag}")
    client_schema(client_app)
    server_schema(server_app)
    pair = Pair(client_app, server_app, proxy_port=free_port())
    replicas = Replicas(pair, servers=2, clients=1, ttl=args.ttl)
    configs = replicas.write(out)
    servers = {name: NodeProcess(configs[name], out / f"{name}.log") for name in replicas.names("server")}
    client = NodeProcess(configs["client"], out / "client.log",
                         {"QTP_TEST_SEND": str(10**9), "QTP_TEST_RATE": str(args.rate), "QTP_TEST_ABORT_EVERY": "0"})
    applied = Applied(server_app)
    samples: list[dict] = []
    print(f"takeover: server as 2 replicas (lease ttl {args.ttl:g} s, server on {args.server_db}), client at "
          f"{args.rate:g} orders/s, {args.takeovers} {'pauses' if args.pause else 'kills'}; results in {out}",
          flush=True)
    try:
        with LossyProxy(replicas.urls("server"), port=pair.proxy_port, failover_s=args.failover_s) as proxy:
            for node in servers.values():
                node.start_replica()
            client.start()
            for i in range(1, args.takeovers + 1):
                _flowing(applied, args.rate, timeout=3 * args.ttl + 60)
                samples.append(_round(i, args, servers, applied))
                print(f"  {i}/{args.takeovers}: {_said(samples[-1])}", flush=True)
            _drain(client, applied, client_app, timeout=300)
            failovers = proxy.stats()
        checked = check_exactly_once(client_app, server_app, reply=False)
    finally:
        for node in (client, *servers.values()):
            node.stop()
        applied.engine.dispose()
        if args.stop_databases:
            pg.stop()
            maria.stop()
    report = {"ttl": args.ttl, "rate": args.rate, "pause": args.pause, "server_db": args.server_db,
              **_report(samples), "exactly_once": checked, "proxy": failovers, "each": samples}
    if args.pause:
        report["exited_75"] = sum(1 for s in samples if s["exit"] == LOST_LEASE_STATUS)
    print(json.dumps({k: v for k, v in report.items() if k != "each"}))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if report["no_takeover"] == 0 and report.get("exited_75", len(samples)) == len(samples) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--takeovers", type=int, default=50)
    parser.add_argument("--rate", type=float, default=50.0, help="orders/s the client sends")
    parser.add_argument("--ttl", type=float, default=5.0, help="the lease's ttl in seconds")
    parser.add_argument("--failover-s", type=float, default=1.0,
                        help="the proxy passes over a replica silent this long (a paused one)")
    parser.add_argument("--pause", action="store_true", help="SIGSTOP the owner instead of SIGKILL")
    parser.add_argument("--server-db", choices=["mariadb", "postgresql"], default="mariadb")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the report and every sample here")
    parser.add_argument("--root", default=".qtp/takeover-db", help="folder of the benchmark's own database servers")
    parser.add_argument("--stop-databases", action="store_true", help="stop them at the end")
    parser.add_argument("--out", default=None, help="configs and logs (default .qtp/takeover/<time>)")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
