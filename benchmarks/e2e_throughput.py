"""Exactly-once throughput and latency: qtp against a hand-written transactional outbox/inbox.

One-way messages of about 1 KB from a client application transaction (PostgreSQL) to a server application
transaction (MariaDB), both nodes on this machine, counted as applied per second at the server, with the
enqueue-to-apply latency (p50, p99) of every message:

- (a) qtp ``xa``, each node's queues in its own application database (one local commit per send and apply);
- (b) qtp ``xa``, each node's queues in the other database (two-phase commit at both ends);
- (c) the baseline: an ``outbox`` table written in the client's local transaction, one relay thread
  (``FOR UPDATE SKIP LOCKED``, batches of 100) that POSTs each message with ``requests`` and deletes it
  once answered, and at the server an ``inbox`` table keyed by message id in the same local transaction as
  the application row (duplicates ignored).

Variants run interleaved, ``--rounds`` times each, at 1 and 16 sending threads; throughput is measured in
the steady part of each run (from 10 % to 90 % of the messages applied). Results: a table on stdout and
``--json``.

    python benchmarks/e2e_throughput.py [--messages 2000] [--rounds 2] [--threads 1,16]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import requests
import sqlalchemy as sa
from sqlalchemy import text

from qtp.embedded import DEFAULT_ROOT, EmbeddedMariaDB, EmbeddedPostgres, free_port
from qtp.testing.nodes import NodeProcess, Pair, client_schema, counter, create, rows, server_schema

HERE = Path(__file__).resolve().parent
PAD = 1000 - len('<order xmlns="urn:test" k="12345"></order>')


def _fresh(server, name: str) -> str:
    url = server.create_database(name)
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with engine.begin() as conn:
        tables = sa.inspect(conn).get_table_names()
        for table in tables:
            conn.execute(text(f"DROP TABLE {table}"))
    engine.dispose()
    return url


def _measure(server_url: str, client_url: str, total: int, began: float, timeout: float,
             metrics: str | None = None) -> dict:
    """Poll the stages: orders committed at the client (the sending transactions), messages stored at the
    server (qtp: its received counter), messages applied. Each stage's rate is taken between 10 % and 90 %
    of the messages; latency is every message's enqueue-to-apply time."""
    stages = {"sent": lambda: rows(client_url, "SELECT COUNT(*) FROM orders")[0][0],
              "applied": lambda: rows(server_url, "SELECT COUNT(*) FROM applied")[0][0]}
    if metrics:
        stages["stored"] = lambda: counter(metrics, "qtp_messages_received_total") or 0.0
    marks: dict[tuple[str, float], float] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        counts = {name: read() for name, read in stages.items()}
        now = time.monotonic()
        for name, n in counts.items():
            for share in (0.1, 0.9):
                if (name, share) not in marks and n >= share * total:
                    marks[name, share] = now
        if counts["applied"] >= total:
            break
        time.sleep(0.05)
    latencies = sorted(v for (v,) in rows(server_url, "SELECT lat_ms FROM applied") if v is not None)
    result = {"applied": len(latencies), "elapsed_s": round(time.monotonic() - began, 2),
              "p50_ms": round(_pct(latencies, 0.5), 1), "p99_ms": round(_pct(latencies, 0.99), 1)}
    for name in stages:
        low, high = marks.get((name, 0.1)), marks.get((name, 0.9))
        rate = 0.8 * total / (high - low) if low is not None and high is not None and high > low else 0.0
        result["rate" if name == "applied" else f"{name}_rate"] = round(rate, 1)
    return result


def _pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def run_qtp(pg, maria, folder: Path, messages: int, threads: int, other: bool, tag: str) -> dict:
    client_app, server_app = _fresh(pg, f"tc_{tag}"), _fresh(maria, f"ts_{tag}")
    client_schema(client_app)
    server_schema(server_app)
    stores = {"client_store": _fresh(maria, f"tcs_{tag}"), "server_store": _fresh(pg, f"tss_{tag}")} if other else {}
    pair = Pair(client_app, server_app, reply=False, limits="max_unacknowledged = 512",
                **stores)
    run = folder / tag
    run.mkdir(parents=True, exist_ok=True)
    client_config, server_config = pair.write(run)
    server = NodeProcess(server_config, run / "server.log").start()
    client = NodeProcess(client_config, run / "client.log",
                         {"QTP_TEST_SEND": str(messages), "QTP_TEST_THREADS": str(threads), "QTP_TEST_PAD": str(PAD)})
    began = time.monotonic()
    client.start()
    try:
        metrics = f"http://127.0.0.1:{pair.server_port}/metrics"
        return _measure(server_app, client_app, messages, began, timeout=600, metrics=metrics)
    finally:
        client.stop()
        server.stop()


def run_outbox(pg, maria, folder: Path, messages: int, threads: int, tag: str) -> dict:
    client_url, server_url = _fresh(pg, f"oc_{tag}"), _fresh(maria, f"os_{tag}")
    create(client_url, "CREATE TABLE orders (k int PRIMARY KEY, status varchar(16) NOT NULL DEFAULT 'committed')")
    create(client_url, "CREATE TABLE outbox (id bigserial PRIMARY KEY, k int NOT NULL, msg_id varchar(64) NOT NULL, "
                       "payload bytea NOT NULL, enqueued_at double precision NOT NULL)")
    server_schema(server_url)
    create(server_url, "CREATE TABLE inbox (msg_id varchar(64) PRIMARY KEY)")
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(HERE / "_outbox_server.py"), server_url, str(port)],
                            start_new_session=True)
    _wait_port(port)
    engine = sa.create_engine(client_url, pool_size=threads + 2)
    stop = threading.Event()
    relay = threading.Thread(target=_relay, args=(engine, f"http://127.0.0.1:{port}/", stop), daemon=True)
    senders = [threading.Thread(target=_outbox_sender, args=(engine, lane, threads, messages), daemon=True)
               for lane in range(1, threads + 1)]
    began = time.monotonic()
    relay.start()
    for t in senders:
        t.start()
    try:
        return _measure(server_url, client_url, messages, began, timeout=600)
    finally:
        stop.set()
        relay.join(10)
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
        engine.dispose()


def _outbox_sender(engine: sa.Engine, lane: int, lanes: int, messages: int) -> None:
    pad = "x" * PAD
    for k in range(lane, messages + 1, lanes):
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO orders (k) VALUES (:k)"), {"k": k})
            conn.execute(text("INSERT INTO outbox (k, msg_id, payload, enqueued_at) VALUES (:k, :m, :p, :t)"),
                         {"k": k, "m": f"m-{k}", "p": f'<order xmlns="urn:test" k="{k}">{pad}</order>'.encode(),
                          "t": time.time()})


def _relay(engine: sa.Engine, url: str, stop: threading.Event) -> None:
    session = requests.Session()
    take = text("SELECT id, msg_id, payload, enqueued_at FROM outbox ORDER BY id LIMIT 100 FOR UPDATE SKIP LOCKED")
    while not stop.is_set():
        with engine.begin() as conn:
            batch = conn.execute(take).fetchall()
            done = []
            for id_, msg_id, payload, enqueued in batch:
                try:
                    r = session.post(url, data=bytes(payload), timeout=10,
                                     headers={"X-Message-Id": msg_id, "X-Enqueued": repr(enqueued)})
                except requests.RequestException:
                    break
                if r.status_code == 200:
                    done.append(id_)
            if done:
                conn.execute(text("DELETE FROM outbox WHERE id = ANY(:ids)"), {"ids": done})
        if not batch:
            time.sleep(0.005)


def _wait_port(port: int) -> None:
    for _ in range(200):
        try:
            requests.post(f"http://127.0.0.1:{port}/", data=b"", timeout=0.5)
        except requests.ConnectionError:
            time.sleep(0.05)
            continue
        except requests.RequestException:
            pass
        return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", default="1,16")
    parser.add_argument("--variants", default="a,b,c")
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    pg, maria = EmbeddedPostgres(args.root / "pg"), EmbeddedMariaDB(args.root / "mariadb")
    pg.start()
    maria.start()
    folder = args.root / "e2e-throughput"
    results: list[dict] = []
    for round_ in range(args.rounds):
        for threads in [int(t) for t in args.threads.split(",")]:
            for variant in args.variants.split(","):
                tag = f"{variant}{threads}r{round_}"
                if variant == "c":
                    r = run_outbox(pg, maria, folder, args.messages, threads, tag)
                else:
                    r = run_qtp(pg, maria, folder, args.messages, threads, variant == "b", tag)
                r.update(variant=variant, threads=threads, round=round_)
                results.append(r)
                print(json.dumps(r), flush=True)
    summary = summarise(results)
    if args.json:
        args.json.write_text(json.dumps({"runs": results, "summary": summary}, indent=1))
    return 0


def summarise(results: list[dict]) -> dict:
    summary: dict = {}
    for threads in sorted({r["threads"] for r in results}):
        row = {}
        for variant in ("a", "b", "c"):
            runs = [r for r in results if r["threads"] == threads and r["variant"] == variant]
            if runs:
                row[variant] = {"rate": statistics.median(r["rate"] for r in runs),
                                "sent_rate": statistics.median(r["sent_rate"] for r in runs),
                                "stored_rate": statistics.median(r.get("stored_rate", 0.0) for r in runs),
                                "p50_ms": statistics.median(r["p50_ms"] for r in runs),
                                "p99_ms": statistics.median(r["p99_ms"] for r in runs)}
        if "c" in row and row["c"]["rate"]:
            for variant in ("a", "b"):
                if variant in row:
                    row[variant]["ratio_to_c"] = round(row[variant]["rate"] / row["c"]["rate"], 2)
        summary[threads] = row
        print(f"{threads:2d} thread(s): " + "  ".join(
            f"({v}) {x['rate']:7.1f} msg/s (sent {x['sent_rate']:.0f}, stored {x['stored_rate']:.0f}) "
            f"p50 {x['p50_ms']:6.1f} ms p99 {x['p99_ms']:7.1f} ms"
            + (f" = {x['ratio_to_c']:.2f}x (c)" if "ratio_to_c" in x else "") for v, x in row.items()))
    return summary


if __name__ == "__main__":
    sys.exit(main())
