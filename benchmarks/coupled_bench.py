"""Coupled transactions against a plain queued send and against the same outcome built by hand as a saga.

One sender node (this process, PostgreSQL) opens accounts at a recipient node (a `qtp serve` process,
MariaDB), each account in one transaction of the sender that also inserts the account in its own database:

- ``plain``: ``tx.send`` of an ordinary message (queued: the sender never learns what became of it);
- ``saga``: the hand-built saga: the sender inserts its account "pending" and sends the request; the
  recipient opens its account and sends "opened" back; the sender's handler marks its account "open" (the
  compensation path of a saga, on a failure, is not exercised: nothing fails here);
- ``compensatable``/``shared``: ``coupled.send`` with "processed by the recipient within 30 s" (the recipient's
  handler coupled that way).

For each variant, ``--threads`` application threads open ``--count`` accounts; reported: the commit latency
the application sees (p50, p95: time in the ``with`` block), and the throughput until every account is final
at both ends (plain: applied at the recipient; saga: marked open at the sender; coupled: the recipient's
row committed), each variant against ``plain`` of the same run.

    python benchmarks/coupled_bench.py --count 400 --threads 1 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import sqlalchemy as sa
from lxml import etree

import qtp
from qtp.coupled import Coupled, processed
from qtp.embedded import EmbeddedMariaDB, EmbeddedPostgres
from qtp.testing.coupled_nodes import accounts_schema, node_ids, write_configs
from qtp.testing.nodes import NodeProcess, rows

OPEN = "urn:bank:open"
VARIANTS = ("plain", "saga", "compensatable", "shared")


def _final(variant: str, sender_url: str, recipient_url: str, prefix: str) -> int:
    if variant == "saga":
        return rows(sender_url, f"SELECT COUNT(*) FROM accounts WHERE status = 'open' AND id LIKE '{prefix}%'")[0][0]
    if variant in ("plain",):
        return rows(recipient_url, f"SELECT COUNT(*) FROM accounts WHERE id LIKE '{prefix}%'")[0][0]
    return rows(recipient_url, "SELECT COUNT(*) FROM qtp_coupled_in WHERE state = 'committed' AND "
                               f"payload LIKE '%{prefix}%'")[0][0]


def run_variant(variant: str, threads: int, count: int, node, coupled, recipient_id: str, sender_id: str,
                urls: dict[str, str], round_no: int) -> dict:
    prefix = f"{variant[:2]}{threads}r{round_no}x"
    latencies: list[float] = []
    lock = threading.Lock()
    numbers = iter(range(count))
    base = {"plain": 1, "saga": 2, "compensatable": 3, "shared": 4}[variant] * 10_000_000 + \
        threads * 100_000 + round_no * 10_000

    def work() -> None:
        while True:
            with lock:
                i = next(numbers, None)
            if i is None:
                return
            account = f"{prefix}-{base + i}"
            status = "pending" if variant == "saga" else "open"
            began = time.perf_counter()
            with node.manager.transaction() as tx:
                tx.connection("app").execute(sa.text("INSERT INTO accounts (id, k, status) VALUES (:i, :k, :s)"),
                                             {"i": account, "k": base + i, "s": status})
                body = f"<open id='{account}'/>"
                if variant == "plain":
                    tx.send(recipient_id, body, action=OPEN + "-plain")
                elif variant == "saga":
                    tx.send(recipient_id, f"<open id='{account}' reply='{sender_id}'/>", action=OPEN + "-saga")
                else:
                    coupled.send(tx, recipient_id, body, action=f"{OPEN}-{variant}", condition=processed(within=30))
            with lock:
                latencies.append(time.perf_counter() - began)

    began = time.perf_counter()
    workers = [threading.Thread(target=work) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    committed_s = time.perf_counter() - began
    while _final(variant, urls["a"], urls["b"], prefix) < count:
        if time.perf_counter() - began > 600:
            raise SystemExit(f"{variant}: not final after 600 s")
        time.sleep(0.02)
    final_s = time.perf_counter() - began
    latencies.sort()
    return {"variant": variant, "threads": threads, "count": count,
            "commit_p50_ms": round(1000 * statistics.median(latencies), 1),
            "commit_p95_ms": round(1000 * latencies[int(0.95 * (len(latencies) - 1))], 1),
            "all_committed_s": round(committed_s, 2), "all_final_s": round(final_s, 2),
            "final_per_s": round(count / final_s, 1)}


def _is_final(variant: str, urls: dict[str, str], account: str) -> bool:
    if variant == "saga":
        return bool(rows(urls["a"], f"SELECT COUNT(*) FROM accounts WHERE id = '{account}' AND status = 'open'")[0][0])
    if variant == "plain":
        return bool(rows(urls["b"], f"SELECT COUNT(*) FROM accounts WHERE id = '{account}'")[0][0])
    return bool(rows(urls["b"], "SELECT COUNT(*) FROM qtp_coupled_in WHERE state = 'committed' AND "
                                f"payload LIKE '%{account}%'")[0][0])


def final_latency(variant: str, count: int, node, coupled, recipient_id: str, sender_id: str, urls: dict[str, str],
                  round_no: int) -> dict:
    """One transaction at a time: from the start of the transaction until the account is final at both
    ends (polled every 2 ms, the same way for every variant)."""
    took = []
    base = 90_000_000 + {"plain": 1, "saga": 2, "compensatable": 3, "shared": 4}[variant] * 100_000 + round_no * 1000
    for i in range(count):
        account = f"seq{variant[:2]}-{base + i}"
        began = time.perf_counter()
        with node.manager.transaction() as tx:
            tx.connection("app").execute(sa.text("INSERT INTO accounts (id, k, status) VALUES (:i, :k, :s)"),
                                         {"i": account, "k": base + i, "s": "pending" if variant == "saga" else "open"})
            if variant == "plain":
                tx.send(recipient_id, f"<open id='{account}'/>", action=OPEN + "-plain")
            elif variant == "saga":
                tx.send(recipient_id, f"<open id='{account}' reply='{sender_id}'/>", action=OPEN + "-saga")
            else:
                coupled.send(tx, recipient_id, f"<open id='{account}'/>", action=f"{OPEN}-{variant}",
                             condition=processed(within=30))
        while not _is_final(variant, urls, account):
            if time.perf_counter() - began > 60:
                raise SystemExit(f"{variant}: {account} not final after 60 s")
            time.sleep(0.002)
        took.append(time.perf_counter() - began)
    took.sort()
    return {"variant": variant, "threads": "sequential", "count": count,
            "final_p50_ms": round(1000 * statistics.median(took), 1),
            "final_p95_ms": round(1000 * took[int(0.95 * (len(took) - 1))], 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=400)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--rounds", type=int, default=2, help="each variant this many times, interleaved")
    parser.add_argument("--sequential", type=int, default=100,
                        help="transactions per variant in the one-at-a-time latency measurement")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--lanes", type=int, default=1, help="lanes of the channels between the two nodes")
    parser.add_argument("--out", default="benchmarks/results/coupled_bench.json")
    args = parser.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="qtp-coupled-bench-"))
    pg, maria = EmbeddedPostgres(folder / "pg"), EmbeddedMariaDB(folder / "mariadb")
    pg.start()
    maria.start()
    results: list[dict] = []
    try:
        urls = {"a": pg.create_database("bench_a"), "b": maria.create_database("bench_b")}
        for url in urls.values():
            accounts_schema(url)
        ids = node_ids(list(urls))
        configs = write_configs(folder, urls, ids, lanes=args.lanes)
        recipient = NodeProcess(configs["b"], folder / "b.log", app="qtp.testing.coupled_app:node").start()
        node = qtp.Node.from_config(configs["a"])
        coupled = Coupled(node)

        @node.handler(OPEN + "-saga-done")
        def opened(tx, message):
            account = etree.fromstring(message.payload).get("id")
            tx.connection("app").execute(sa.text("UPDATE accounts SET status = 'open' WHERE id = :i"),
                                         {"i": account})
        node.start()
        try:
            for round_no in range(args.rounds):
                for threads in args.threads:
                    for variant in args.variants:
                        result = run_variant(variant, threads, args.count, node, coupled, ids["b"], ids["a"],
                                             urls, round_no)
                        results.append(result)
                        print(json.dumps(result), flush=True)
                for variant in args.variants:
                    result = final_latency(variant, args.sequential, node, coupled, ids["b"], ids["a"], urls,
                                           round_no)
                    results.append(result)
                    print(json.dumps(result), flush=True)
        finally:
            node.close()
            recipient.stop()
    finally:
        pg.stop()
        maria.stop()
    summary: dict[str, dict] = {}
    for threads in args.threads:
        by = {v: [r for r in results if r["variant"] == v and r["threads"] == threads] for v in VARIANTS}
        plain = statistics.median(r["final_per_s"] for r in by["plain"]) if by["plain"] else None
        for v in VARIANTS:
            seq = [r for r in results if r["variant"] == v and r["threads"] == "sequential"]
            if seq:
                summary[f"{v}@sequential"] = {"final_p50_ms": statistics.median(r["final_p50_ms"] for r in seq),
                                              "final_p95_ms": statistics.median(r["final_p95_ms"] for r in seq)}
        for variant, found in by.items():
            if not found:
                continue
            rate = statistics.median(r["final_per_s"] for r in found)
            summary[f"{variant}@{threads}"] = {
                "final_per_s": rate, "vs_plain": round(rate / plain, 2) if plain else None,
                "commit_p50_ms": statistics.median(r["commit_p50_ms"] for r in found),
                "commit_p95_ms": statistics.median(r["commit_p95_ms"] for r in found)}
    print(json.dumps(summary, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"runs": results, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
