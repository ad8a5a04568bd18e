"""Coupled-transaction crash campaign: a sender, a shared and a compensatable recipient, SIGKILLs of the three
nodes and of both database servers, a lossy network, and Spark's verdict.

Node ``a`` (PostgreSQL) opens accounts acc-1..acc-N, each in a transaction that inserts the account and sends
it as one conditional message to ``b`` (MariaDB, coupling shared) and ``c`` (PostgreSQL, compensatable),
"processed by every recipient within W s"; every 7th transaction is aborted by the application after the
send. A lossy proxy sits in front of each node (every node reaches the others through it). While accounts
are opened a driver SIGKILLs, at random instants: the sender, a recipient, the PostgreSQL server or the
MariaDB server, and restarts it. At the end the loss is turned off and the run waits until every coupled
message is settled on both sides. Then:

- ``qtp.testing.coupled_nodes.judge`` checks from the databases that every transaction is atomic by its
  coupling (shared: the account at ``b`` exists if and only if it exists at ``a``; compensatable: committed
  at ``a`` means open at ``c``, aborted means absent or closed);
- ``qtp reconcile`` (Spark) compares ``a``'s outcomes (view ``coupled_outcomes``: committed when the account
  exists) with ``b``'s and ``c``'s accounts, with ``--server-compensated status=closed``: a violation is a
  lost, duplicated, unexpected, applied-but-aborted or committed-but-compensated account.

    python benchmarks/coupled_campaign.py --transactions 1000 --kills 40 --loss 0.1 --seed 1
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from qtp.embedded import EmbeddedMariaDB, EmbeddedPostgres, free_port
from qtp.testing.coupled_nodes import accounts_schema, judge, node_ids, settled, write_configs
from qtp.testing.lossy_proxy import LossyProxy
from qtp.testing.nodes import NodeProcess, reconcile_report, rows

VICTIMS = ("sender", "b", "c", "postgresql", "mariadb")
APP = "qtp.testing.coupled_app:node"


def _count(url: str, query: str) -> int:
    try:
        return int(rows(url, query)[0][0] or 0)
    except Exception:  # the database is being killed: no reading this time
        return -1


def run(args: argparse.Namespace) -> int:
    began = time.monotonic()
    tag = f"{args.seed}_{int(time.time())}"
    out = Path(args.out or f".qtp/coupled-campaign/{tag}")
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    print(f"coupled campaign: {args.transactions} transactions, {args.kills} kills, loss {args.loss}, "
          f"seed {args.seed}, within {args.within} s", flush=True)
    pg, maria = EmbeddedPostgres(Path(args.root) / "pg"), EmbeddedMariaDB(Path(args.root) / "mariadb")
    pg.start()
    maria.start()
    servers = {"postgresql": pg, "mariadb": maria}
    urls = {"a": pg.create_database(f"ca_{tag}"), "b": maria.create_database(f"cb_{tag}"),
            "c": pg.create_database(f"cc_{tag}")}
    for url in urls.values():
        accounts_schema(url)
    ids = node_ids(list(urls))
    ports = {role: free_port() for role in urls}
    via = {role: free_port() for role in urls}
    configs = write_configs(out, urls, ids, limits="max_attempts = 1000", ports=ports, via=via)
    loss = dict(drop_request=args.loss / 2, drop_response=args.loss / 2, duplicate_request=args.loss / 2,
                delay=0.2, delay_ms=(0, 30))
    proxies = [LossyProxy(f"http://127.0.0.1:{ports[role]}", port=via[role], seed=args.seed + i, **loss).start()
               for i, role in enumerate(urls)]
    nodes = {
        "b": NodeProcess(configs["b"], out / "b.log", {"QTP_COUPLED_COUPLING": "shared"}, app=APP),
        "c": NodeProcess(configs["c"], out / "c.log", {"QTP_COUPLED_COUPLING": "compensatable"}, app=APP),
        "sender": NodeProcess(configs["a"], out / "a.log", {
            "QTP_COUPLED_SEND": str(args.transactions), "QTP_COUPLED_TO": f"{ids['b']},{ids['c']}",
            "QTP_COUPLED_WITHIN": str(args.within), "QTP_COUPLED_ABORT_EVERY": "7"}, app=APP),
    }
    kills: list[dict] = []
    recipients = [(urls["b"], "shared"), (urls["c"], "compensatable")]
    try:
        for node in nodes.values():
            node.start()
        for i in range(args.kills):
            target = (i + 1) * args.transactions / (args.kills + 1)
            waited = time.monotonic()
            while _count(urls["a"], "SELECT COALESCE(MAX(k), 0) FROM attempts") < target \
                    and time.monotonic() - waited < 20:
                time.sleep(0.1)
            time.sleep(rng.uniform(0.0, 0.5))
            victim = VICTIMS[i % len(VICTIMS)] if i < len(VICTIMS) else rng.choice(VICTIMS)
            started = time.monotonic()
            if victim in nodes:
                nodes[victim].kill()
                nodes[victim].start()
            else:
                servers[victim].kill()
                servers[victim].start()
            kills.append({"i": i + 1, "victim": victim, "at_s": round(started - began, 2),
                          "restart_s": round(time.monotonic() - started, 2),
                          "tried_before": _count(urls["a"], "SELECT COALESCE(MAX(k), 0) FROM attempts")})
            if (i + 1) % 10 == 0 or i + 1 == args.kills:
                print(f"  kill {i + 1}/{args.kills}: {victim}; tried {kills[-1]['tried_before']}", flush=True)
            (out / "kills.json").write_text(json.dumps(kills, indent=1))
        for proxy in proxies:
            proxy.set_faults(drop_request=0, drop_response=0, duplicate_request=0)
        deadline = time.monotonic() + args.drain_s
        while time.monotonic() < deadline:
            try:
                if settled(urls["a"], [u for u, _ in recipients], args.transactions):
                    break
            except Exception:  # a database still restarting
                pass
            for node in nodes.values():
                if not node.alive():
                    node.start()
            time.sleep(1.0)
        drained = time.monotonic() < deadline
        print(f"  settled: {drained} after {time.monotonic() - began:.0f} s", flush=True)
    finally:
        for node in nodes.values():
            node.stop()
        for proxy in proxies:
            proxy.stop()
    try:
        try:
            judged = judge(urls["a"], recipients)
            judged["verdict"] = "atomic"
        except AssertionError as exc:
            judged = {"verdict": "violated", "problems": str(exc)[:2000]}
        spark = {role: reconcile_report(out / f"reconcile-{role}.json", urls["a"], "coupled_outcomes", urls[role],
                                        "accounts", "--server-compensated", "status=closed") for role in ("b", "c")}
    finally:
        if args.stop_databases:
            pg.stop()
            maria.stop()
    result = {"transactions": args.transactions, "kills": len(kills), "loss": args.loss, "seed": args.seed,
              "within_s": args.within, "victims": {v: sum(1 for k in kills if k["victim"] == v) for v in VICTIMS},
              "settled": drained, "judge": judged,
              "spark": {role: {"verdict": r["verdict"], "counts": r["counts"]} for role, r in spark.items()},
              "elapsed_s": round(time.monotonic() - began, 1)}
    ok = drained and judged["verdict"] == "atomic" and all(r["verdict"] == "exactly-once" for r in spark.values())
    result["verdict"] = "atomic" if ok else "violated"
    (out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("victims", "judge", "spark", "elapsed_s")}))
    print(f"results in {out}")
    print(result["verdict"])
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transactions", type=int, default=1000)
    parser.add_argument("--kills", type=int, default=40)
    parser.add_argument("--loss", type=float, default=0.1, help="share of requests and responses disturbed")
    parser.add_argument("--within", type=float, default=5.0, help="the condition's deadline, seconds")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--drain-s", type=float, default=600.0, help="bound on the final wait")
    parser.add_argument("--root", default=".qtp/coupled-campaign-db", help="folder of the campaign's database servers")
    parser.add_argument("--stop-databases", action="store_true", help="stop the database servers at the end")
    parser.add_argument("--out", default=None, help="results folder (default .qtp/coupled-campaign/<seed>_<time>)")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
