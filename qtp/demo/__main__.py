"""``make demo``: a client node on PostgreSQL sends orders to a server node on MariaDB over WS-RM/HTTP.

This process is the client node: each order is one transaction that inserts the order's row *and* sends
the order (``tx.send``), and some orders are deliberately rolled back (out of stock), so neither their row
nor their message may ever appear. The server node is a separate ``qtp serve`` process
(``qtp.demo.shop``); it applies each order in a transaction with its dequeue and answers with a reply that
comes back reliably and is applied here in a transaction that marks the order confirmed. Midway the demo
kills the server node with SIGKILL and starts it again. At the end it prints what was sent, applied and
replied, and checks that every committed order was applied exactly once and answered exactly once.

    python -m qtp.demo [--orders 2000] [--threads 4]
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import requests
import sqlalchemy as sa
from sqlalchemy import text

import qtp
from qtp.embedded import DEFAULT_ROOT, EmbeddedMariaDB, EmbeddedPostgres, free_port


class OutOfStock(Exception):
    """The application's own reason to roll an order back."""


def _fresh_table(url: str, drop: list[str], ddl: str) -> None:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with engine.begin() as conn:
        for table in drop:
            conn.execute(text(f"DROP TABLE IF EXISTS {table}"))
        conn.execute(text(ddl))
    engine.dispose()


def _count(url: str, query: str) -> int:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with engine.connect() as conn:
        value = conn.execute(text(query)).scalar()
    engine.dispose()
    return int(value or 0)


_STORE_TABLES = ["qtp_rm_outgoing", "qtp_rm_source", "qtp_rm_destination", "qtp_rm_incoming", "qtp_rm_invoker",
                 "qtp_rm_dead_letter"]


def _configs(folder: Path, pg_url: str, maria_url: str) -> tuple[Path, Path]:
    """The two nodes' files. They authenticate each other with a secret made for this run (HMAC-signed
    requests and answers, see docs/security.md) and take no anonymous request."""
    client_port, server_port = free_port(), free_port()
    secret = secrets.token_urlsafe(32)
    common = f'log_dir = "{folder / "logs"}"\nstore = "app"\nallow_anonymous = false\n'
    client = folder / "client.toml"
    client.write_text(f'''[node]
id = "shop-client"
endpoint = "http://127.0.0.1:{client_port}/rm"
{common}
[resources.app]
url = "{pg_url}"

[channels.orders]
peer = "http://127.0.0.1:{server_port}/rm"
reply = true

[limits]
retransmit_interval = 0.5
retransmit_interval_max = 2

[peers.shop-server]
endpoint = "http://127.0.0.1:{server_port}/rm"
secret = "{secret}"
''')
    server = folder / "server.toml"
    server.write_text(f'''[node]
id = "shop-server"
endpoint = "http://127.0.0.1:{server_port}/rm"
{common}
[resources.app]
url = "{maria_url}"

[peers.shop-client]
endpoint = "http://127.0.0.1:{client_port}/rm"
secret = "{secret}"
''')
    return client, server


class ServerNode:
    """The server node as a ``qtp serve`` process."""

    def __init__(self, config: Path, log: Path):
        self.config, self.log = config, log
        self.url = next(line.split('"')[1] for line in config.read_text().splitlines() if line.startswith("endpoint"))
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = dict(os.environ, QTP_DEMO_CONFIG=str(self.config))
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "qtp", "serve", "--app", "qtp.demo.shop:node"],
                                         env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        health = self.url.replace("/rm", "/health")
        for _ in range(600):
            if self.proc.poll() is not None:
                raise SystemExit(f"the server node exited; see {self.log}")
            try:
                if requests.get(health, timeout=1).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.1)
        raise SystemExit(f"the server node did not start; see {self.log}")

    def kill(self) -> None:
        if self.proc is not None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)


def place_orders(first: int, last: int, stats: dict, lock: threading.Lock) -> None:
    for order in range(first, last):
        try:
            with qtp.transaction() as tx:
                tx.connection("app").execute(text("INSERT INTO orders (id, status) VALUES (:id, 'sent')"), {"id": order})
                tx.send("orders", f"<order xmlns='urn:shop'><id>{order}</id></order>".encode(), action="urn:shop:place")
                if order % 10 == 0:
                    raise OutOfStock(order)
            outcome = "committed"
        except OutOfStock:
            outcome = "rolled back (out of stock)"
        with lock:
            stats[outcome] = stats.get(outcome, 0) + 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qtp.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--orders", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT, help="folder of qtp's private servers")
    args = parser.parse_args(argv)

    print("starting qtp's private PostgreSQL and MariaDB ...", flush=True)
    pg, maria = EmbeddedPostgres(args.root / "pg"), EmbeddedMariaDB(args.root / "mariadb")
    pg.start()
    maria.start()
    pg_url, maria_url = pg.create_database("shop"), maria.create_database("shop")
    folder = args.root / "demo"
    folder.mkdir(parents=True, exist_ok=True)
    for config in (folder / "client.toml", folder / "server.toml"):
        if config.exists():  # an earlier run was cut short: settle its in-doubt branches before dropping tables
            subprocess.run([sys.executable, "-m", "qtp", "recover", "--config", str(config)], capture_output=True)
    _fresh_table(pg_url, ["orders", *_STORE_TABLES], "CREATE TABLE orders (id int PRIMARY KEY, status varchar(20))")
    _fresh_table(maria_url, ["applied_orders", *_STORE_TABLES],
                 "CREATE TABLE applied_orders (row_id int AUTO_INCREMENT PRIMARY KEY, order_id int NOT NULL, "
                 "sequence varchar(255), number bigint)")
    client_config, server_config = _configs(folder, pg_url, maria_url)
    server = ServerNode(server_config, folder / "server.log")
    server.start()
    print(f"server node (MariaDB) serving at {server.url}, pid {server.proc.pid}", flush=True)
    stranger = requests.post(server.url, data=b"<x/>", headers={"Content-Type": "application/soap+xml"}, timeout=10)
    print(f"  the nodes authenticate each other (HMAC, a secret made for this run); an unsigned request gets "
          f"HTTP {stranger.status_code}", flush=True)

    node = qtp.Node.from_config(client_config)   # the client node, recovered; handlers first, then start
    replies = {"n": 0}

    @node.reply_handler("orders")
    def confirmed(tx, reply):
        order = int(re.search(rb"<id>(\d+)</id>", reply.payload).group(1))
        tx.connection("app").execute(text("UPDATE orders SET status = 'confirmed' WHERE id = :id"), {"id": order})
        replies["n"] += 1

    node.start()                                 # the sender, and the endpoint the replies come back to
    qtp.install(node.manager)
    tm = node.manager

    stats: dict = {}
    lock = threading.Lock()
    per = args.orders // args.threads
    threads = [threading.Thread(target=place_orders, args=(1 + i * per, 1 + (i + 1) * per, stats, lock))
               for i in range(args.threads)]
    began = time.perf_counter()
    print(f"client node (PostgreSQL) placing {per * args.threads} orders on {args.threads} threads ...", flush=True)
    for t in threads:
        t.start()
    killed = False
    committed_goal = per * args.threads - per * args.threads // 10
    deadline, shown = time.monotonic() + 300, 0.0
    while time.monotonic() < deadline:
        applied = _count(maria_url, "SELECT COUNT(*) FROM applied_orders")
        confirmed_n = _count(pg_url, "SELECT COUNT(*) FROM orders WHERE status = 'confirmed'")
        if time.monotonic() - shown >= 1.0 or (not killed and applied >= committed_goal // 3):
            print(f"  applied at the server: {applied:4d}   confirmed at the client: {confirmed_n:4d}", flush=True)
            shown = time.monotonic()
        if not killed and applied >= committed_goal // 3:
            server.kill()
            print(f"  >>> server node killed with SIGKILL after {applied} orders applied; restarting it", flush=True)
            server.start()
            killed = True
        if killed and confirmed_n >= committed_goal and not any(t.is_alive() for t in threads):
            break
        time.sleep(0.02)  # watched closely: a qtp pair moves hundreds of orders a second
    elapsed = time.perf_counter() - began
    return report(pg_url, maria_url, stats, elapsed, tm, server)


def report(pg_url: str, maria_url: str, stats: dict, elapsed: float, tm: qtp.TransactionManager,
           server: ServerNode) -> int:
    committed = _count(pg_url, "SELECT COUNT(*) FROM orders")
    confirmed = _count(pg_url, "SELECT COUNT(*) FROM orders WHERE status = 'confirmed'")
    applied_rows = _count(maria_url, "SELECT COUNT(*) FROM applied_orders")
    applied_orders = _count(maria_url, "SELECT COUNT(DISTINCT order_id) FROM applied_orders")
    aborted_applied = _count(maria_url, "SELECT COUNT(*) FROM applied_orders WHERE order_id % 10 = 0")
    tm.close()
    server.stop()
    print()
    for outcome, n in sorted(stats.items()):
        print(f"orders {outcome:28s} {n:5d}")
    print(f"orders applied at the server       {applied_rows:5d} rows for {applied_orders} distinct orders")
    print(f"orders confirmed by a reply        {confirmed:5d}")
    print(f"rolled-back orders applied         {aborted_applied:5d}")
    print(f"time: {elapsed:.1f} s, with one SIGKILL of the server node")
    exact = applied_rows == applied_orders == committed == confirmed and aborted_applied == 0
    print("exactly once:", "every committed order was applied once and confirmed once" if exact else "VIOLATED")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
