"""Coupled-transaction crash campaign: a sender and its recipients, SIGKILLs of every node and of both
database servers, a lossy network, and Spark's verdict.

``--fanout pair`` (the default): node ``a`` (PostgreSQL) opens accounts acc-1..acc-N, each in a transaction
that inserts the account and sends it as one conditional message to ``b`` (MariaDB, coupling shared) and
``c`` (PostgreSQL, compensatable), "processed by every recipient within W s".

``--fanout mixed`` (issue 27, item 8): ``a`` (PostgreSQL) sends each account as one conditional message to
four recipients: ``s`` (MariaDB, shared), ``c1`` (PostgreSQL, compensatable), ``c2`` (MariaDB,
compensatable) and ``s2`` (PostgreSQL, shared), "processed by at least 3 of them, ``s`` among them, within W
s" (``--at-least``), with one compensation. Each recipient's handler refuses some accounts by a rule the
judge knows (``s``: K % 11 == 0, ``c1``: K % 13 == 0, ``c2``: K % 17 == 0, ``s2``: none), and the
recipients run with ``max_attempts = 1`` (only a business refusal counts as an attempt; an outage only
delays). ``--recipients`` picks a subset (at least one of each coupling).

In both, every 7th transaction is aborted by the application after the send. A lossy proxy sits in front of
each node (every node reaches the others through it). While accounts are opened a driver SIGKILLs, at
random instants, the sender, a recipient, the PostgreSQL server or the MariaDB server (each of them once
first, then at random), and restarts it. At the end the loss is turned off and the run waits until the
sender tried every account, its application threads are done, and every coupled message is settled on both
sides. Then, from the databases alone:

- pair: ``qtp.testing.coupled_nodes.judge`` (shared: the account at ``b`` exists if and only if it exists at
  ``a``; compensatable: committed at ``a`` means open at ``c``, aborted means absent or closed); mixed:
  ``coupled_nodes.judge_mixed`` (committed => open at every shared recipient, open or refused at every
  compensatable one, the condition held; rolled back => absent at the shared ones, absent or closed at the
  compensatable ones; every sphere-log and recipient row final and in agreement; a refusal only where the
  rule refuses; no prepared transaction left on either server);
- ``qtp reconcile`` (Spark) compares ``a``'s outcomes with each recipient's accounts, with
  ``--server-compensated status=closed``: a violation is a lost, duplicated, unexpected, applied-but-aborted
  or committed-but-compensated account. Pair: view ``coupled_outcomes`` (committed when the account exists
  at ``a``); mixed: one view per recipient, ``coupled_expected_<role>`` (committed when the account exists
  at ``a`` and the recipient's rule does not refuse it).

``--repeat N`` runs the campaign N times on the same database servers (seed, seed+1, ...), each in its own
databases and ``--out`` subfolder, for races that show rarely (``--budget-s`` stops starting new ones).

    python benchmarks/coupled_campaign.py --transactions 1000 --kills 40 --loss 0.1 --seed 1
    python benchmarks/coupled_campaign.py --fanout mixed --transactions 1000 --kills 40 --loss 0.1 --seed 1
    python benchmarks/coupled_campaign.py --fanout mixed --transactions 40 --kills 0 --loss 0 --threads 4 \\
        --max-attempts 2 --repeat 100 --no-spark
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's qtp, not an installed one

import sqlalchemy as sa  # noqa: E402

from qtp.embedded import EmbeddedMariaDB, EmbeddedPostgres, free_port  # noqa: E402
from qtp.testing.coupled_nodes import (MixedRecipient, accounts_schema, expected_view, judge,  # noqa: E402
                                       judge_mixed, node_ids, settled, write_configs)
from qtp.testing.lossy_proxy import LossyProxy  # noqa: E402
from qtp.testing.nodes import NodeProcess, reconcile_reports, rows  # noqa: E402

APP = "qtp.testing.coupled_app:node"
# role -> (database server, coupling, refusal rule: K % rule == 0 is refused; 0 never)
PAIR = {"b": ("mariadb", "shared", 0), "c": ("postgresql", "compensatable", 0)}
MIXED = {"s": ("mariadb", "shared", 11), "c1": ("postgresql", "compensatable", 13),
         "c2": ("mariadb", "compensatable", 17), "s2": ("postgresql", "shared", 0)}
MIXED_BY = ["s"]  # the recipient the mixed condition names (by=)
DONE = b"coupled_app: all sent"


def _count(url: str, query: str) -> int:
    try:
        return int(rows(url, query)[0][0] or 0)
    except Exception:  # the database is being killed: no reading this time
        return -1


_NOISE = [(re.compile(p), r) for p, r in [
    (r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ \d+ ", ""), (r"^([a-z-]+?)[-_]\d+ ", r"\1 "),
    (r"urn:uuid:[0-9a-f-]+", "urn:uuid:U"), (r"[0-9a-f]{32}", "X"), (r"\b[a-z][a-z0-9]*-[0-9a-f]{6}\b", "NODE"),
    (r"acc-\d+", "acc-N"), (r"_\d+_\d{10}\b", "_DB"), (r"(?<![A-Za-z])\d+(\.\d+)?", "N"),
]]
_STAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ ")


def _normal(line: str) -> str:
    for pattern, replacement in _NOISE:
        line = pattern.sub(replacement, line)
    return line.strip()[:220]


def log_summary(out: Path) -> dict:
    """Per node log: the distinct ERROR / CRITICAL lines and the distinct exceptions that end a traceback
    (the last of a chain), with ids and numbers blanked out, and how often each occurs."""
    summary = {}
    for log in sorted(out.glob("*.log")):
        errors: dict[str, int] = {}
        tracebacks: dict[str, int] = {}
        pending, frames = None, False
        for line in log.read_text(errors="replace").splitlines() + ["0000-00-00 00:00:00,0 end"]:
            if _STAMP.match(line) or line.startswith(("coupled_app:", "qtp serve")):
                if pending:
                    tracebacks[pending] = tracebacks.get(pending, 0) + 1
                pending, frames = None, False
                if re.search(r" (ERROR|CRITICAL) ", line):
                    key = _normal(line)
                    errors[key] = errors.get(key, 0) + 1
            elif line.startswith("Traceback (most recent call last)"):
                pending, frames = None, True  # a chained exception replaces its cause
            elif frames and line and not line.startswith((" ", "\t")):
                pending, frames = _normal(line), False  # the exception's first line; the rest is its message
        summary[log.stem] = {"errors": dict(sorted(errors.items(), key=lambda e: -e[1])),
                             "tracebacks": dict(sorted(tracebacks.items(), key=lambda e: -e[1]))}
    return summary


def _drop(url: str) -> None:
    """Drop a run's database (after a repetition that passed), from the server's admin database."""
    parsed = sa.engine.make_url(url)
    admin = parsed.set(database="postgres" if parsed.get_backend_name() == "postgresql" else "qtp")
    engine = sa.create_engine(admin, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT")
    quote = '"' if parsed.get_backend_name() == "postgresql" else "`"
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {quote}{parsed.database}{quote}")
    finally:
        engine.dispose()


def run_once(args: argparse.Namespace, servers: dict, out: Path, seed: int) -> dict:
    began = time.monotonic()
    tag = f"{seed}_{int(time.time())}"
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    mixed = args.fanout == "mixed"
    if mixed:
        chosen = args.recipients.split(",") if args.recipients else list(MIXED)
        unknown = sorted(set(chosen) - set(MIXED))
        if unknown or not set(MIXED_BY) <= set(chosen):
            raise SystemExit(f"--recipients: {', '.join(MIXED)}, with {', '.join(MIXED_BY)}; not {unknown}")
        layout = {role: MIXED[role] for role in chosen}
    else:
        layout = PAIR
    at_least = args.at_least or len(layout) - 1
    max_attempts = args.max_attempts or (1 if mixed else 1000)
    victims = ("sender", *layout, "postgresql", "mariadb")
    print(f"coupled campaign ({args.fanout}): {args.transactions} transactions, {args.kills} kills, loss "
          f"{args.loss}, seed {seed}, within {args.within} s, max_attempts {max_attempts}, {args.threads} "
          f"sender thread(s)" + (f", processed(at_least={at_least}, by={MIXED_BY})" if mixed else ""), flush=True)
    urls = {"a": servers["postgresql"].create_database(f"ca_{tag}")}
    for role, (server, _, _) in layout.items():
        urls[role] = servers[server].create_database(f"c{role}_{tag}")
    for url in urls.values():
        accounts_schema(url)
    ids = node_ids(list(urls))
    recipients = [MixedRecipient(role, urls[role], ids[role], coupling, refuse)
                  for role, (_, coupling, refuse) in layout.items()]
    if mixed:
        engine = sa.create_engine(urls["a"], poolclass=sa.pool.NullPool)
        with engine.begin() as conn:
            for r in recipients:
                conn.exec_driver_sql(expected_view(r))
        engine.dispose()
    ports = {role: free_port() for role in urls}
    via = {role: free_port() for role in urls}
    configs = write_configs(out, urls, ids, limits=f"max_attempts = {max_attempts}", ports=ports, via=via)
    loss = dict(drop_request=args.loss / 2, drop_response=args.loss / 2, duplicate_request=args.loss / 2,
                delay=0.2, delay_ms=(0, 30))
    proxies = [LossyProxy(f"http://127.0.0.1:{ports[role]}", port=via[role], seed=seed + i, **loss).start()
               for i, role in enumerate(urls)]
    sender_env = {"QTP_COUPLED_SEND": str(args.transactions), "QTP_COUPLED_TO": ",".join(r.node_id for r in recipients),
                  "QTP_COUPLED_WITHIN": str(args.within), "QTP_COUPLED_ABORT_EVERY": "7",
                  "QTP_COUPLED_THREADS": str(args.threads)}
    if mixed:
        sender_env.update({"QTP_COUPLED_AT_LEAST": str(at_least), "QTP_COUPLED_BY": ",".join(ids[b] for b in MIXED_BY)})
    nodes = {r.role: NodeProcess(configs[r.role], out / f"{r.role}.log",
                                 {"QTP_COUPLED_COUPLING": r.coupling, "QTP_COUPLED_REFUSE": str(r.refuse)}, app=APP)
             for r in recipients}
    nodes["sender"] = NodeProcess(configs["a"], out / "a.log", sender_env, app=APP)
    since = {"sender": 0}  # where the sender's log began at its last start: "all sent" must come after it

    def start(role: str) -> None:
        if role == "sender":
            since["sender"] = nodes[role].log.stat().st_size if nodes[role].log.exists() else 0
        nodes[role].start()

    def sender_done() -> bool:
        with open(nodes["sender"].log, "rb") as log:
            log.seek(since["sender"])
            return DONE in log.read()

    kills: list[dict] = []
    drained = False
    try:
        with ThreadPoolExecutor(len(nodes)) as pool:  # at once: each waits for its node's health check
            list(pool.map(start, nodes))
        for i in range(args.kills):
            target = (i + 1) * args.transactions / (args.kills + 1)
            waited = time.monotonic()
            while _count(urls["a"], "SELECT COALESCE(MAX(k), 0) FROM attempts") < target \
                    and time.monotonic() - waited < 20:
                time.sleep(0.1)
            time.sleep(rng.uniform(0.0, 0.5))
            victim = victims[i] if i < len(victims) else rng.choice(victims)
            started = time.monotonic()
            if victim in nodes:
                nodes[victim].kill()
                start(victim)
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
                if sender_done() and settled(urls["a"], [r.url for r in recipients], args.transactions):
                    drained = True
                    break
            except Exception:  # a database still restarting
                pass
            for role, node in nodes.items():
                if not node.alive():
                    start(role)
            time.sleep(0.5 if args.kills == 0 else 1.0)
        print(f"  settled: {drained} after {time.monotonic() - began:.0f} s", flush=True)
    finally:
        with ThreadPoolExecutor(len(nodes)) as pool:
            list(pool.map(lambda node: node.stop(), nodes.values()))
        for proxy in proxies:
            proxy.stop()
    if mixed:
        try:
            judged = judge_mixed(urls["a"], ids["a"], recipients, at_least, MIXED_BY)
            judged["verdict"] = "atomic"
        except AssertionError as exc:
            judged = {"verdict": "violated", "problems": str(exc)[:20000]}
        client = {r.role: f"coupled_expected_{r.role}" for r in recipients}
    else:
        try:
            judged = judge(urls["a"], [(r.url, r.coupling) for r in recipients])
            judged["verdict"] = "atomic"
        except AssertionError as exc:
            judged = {"verdict": "violated", "problems": str(exc)[:2000]}
        client = {r.role: "coupled_outcomes" for r in recipients}
    spark = {}
    if args.spark:
        chosen = args.spark_only.split(",") if args.spark_only else list(client)
        roles = [role for role in client if role in chosen]
        reports = reconcile_reports([(out / f"reconcile-{role}.json", urls["a"], client[role], urls[role], "accounts",
                                      "--server-compensated", "status=closed") for role in roles])
        spark = dict(zip(roles, reports))  # one Spark driver for every recipient
    logs = log_summary(out)
    result = {"fanout": args.fanout, "transactions": args.transactions, "kills": len(kills), "loss": args.loss,
              "seed": seed, "within_s": args.within, "max_attempts": max_attempts, "threads": args.threads,
              "recipients": {r.role: {"coupling": r.coupling, "refuses": r.refuse,
                                      "server": layout[r.role][0]} for r in recipients},
              "victims": {v: sum(1 for k in kills if k["victim"] == v) for v in victims},
              "settled": drained, "judge": judged,
              "spark": {role: {"verdict": r["verdict"], "counts": r["counts"]} for role, r in spark.items()},
              "elapsed_s": round(time.monotonic() - began, 1), "urls": urls, "logs": logs}
    ok = drained and judged["verdict"] == "atomic" and all(r["verdict"] == "exactly-once" for r in spark.values())
    result["verdict"] = "atomic" if ok else "violated"
    (out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("victims", "settled", "judge", "spark", "elapsed_s")}))
    print("log lines at ERROR/CRITICAL: " + ", ".join(f"{node} {sum(v['errors'].values())}" for node, v in logs.items())
          + "; tracebacks: " + ", ".join(f"{node} {sum(v['tracebacks'].values())}" for node, v in logs.items()))
    print(f"results in {out}")
    print(result["verdict"], flush=True)
    return result


def run(args: argparse.Namespace) -> int:
    began = time.monotonic()
    out = Path(args.out or f".qtp/coupled-campaign/{args.seed}_{int(time.time())}")
    pg, maria = EmbeddedPostgres(Path(args.root) / "pg"), EmbeddedMariaDB(Path(args.root) / "mariadb")
    pg.start()
    maria.start()
    servers = {"postgresql": pg, "mariadb": maria}
    try:
        if args.repeat <= 1:
            return 0 if run_once(args, servers, out, args.seed)["verdict"] == "atomic" else 1
        summary: list[dict] = []
        for i in range(args.repeat):
            if args.budget_s and time.monotonic() - began > args.budget_s:
                print(f"budget of {args.budget_s:g} s spent: {i} of {args.repeat} repetitions run", flush=True)
                break
            result = run_once(args, servers, out / f"rep-{i + 1:03d}", args.seed + i)
            summary.append({"rep": i + 1, "seed": args.seed + i, "verdict": result["verdict"],
                            "settled": result["settled"], "elapsed_s": result["elapsed_s"],
                            "committed": result["judge"].get("committed"),
                            "rolled_back": result["judge"].get("rolled_back"),
                            "problems": result["judge"].get("problems")})
            if result["verdict"] == "atomic" and not args.keep_databases:
                for url in result["urls"].values():
                    _drop(url)
            violated = [s for s in summary if s["verdict"] != "atomic"]
            (out / "summary.json").write_text(json.dumps({"repetitions": len(summary), "violated": len(violated),
                                                          "elapsed_s": round(time.monotonic() - began, 1),
                                                          "runs": summary}, indent=1))
            print(f"repetition {i + 1}/{args.repeat}: {result['verdict']} ({result['elapsed_s']} s); "
                  f"{len(violated)} violated so far", flush=True)
        violated = [s for s in summary if s["verdict"] != "atomic"]
        print(json.dumps({"repetitions": len(summary), "violated": len(violated),
                          "violated_reps": [s["rep"] for s in violated],
                          "elapsed_s": round(time.monotonic() - began, 1)}))
        return 0 if not violated else 1
    finally:
        if args.stop_databases:
            pg.stop()
            maria.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fanout", choices=("pair", "mixed"), default="pair",
                        help="pair: a shared and a compensatable recipient; mixed: four recipients (see above)")
    parser.add_argument("--recipients", default=None, help="mixed: the recipients, e.g. s,c1,c2 (default all four)")
    parser.add_argument("--transactions", type=int, default=1000)
    parser.add_argument("--kills", type=int, default=40)
    parser.add_argument("--loss", type=float, default=0.1, help="share of requests and responses disturbed")
    parser.add_argument("--within", type=float, default=5.0, help="the condition's deadline, seconds")
    parser.add_argument("--at-least", type=int, default=None,
                        help="mixed: recipients that must process (default all but one)")
    parser.add_argument("--threads", type=int, default=1, help="application threads at the sender")
    parser.add_argument("--max-attempts", type=int, default=None,
                        help="[limits] max_attempts of every node (default: pair 1000, mixed 1)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--drain-s", type=float, default=600.0, help="bound on the final wait")
    parser.add_argument("--no-spark", dest="spark", action="store_false", help="the judge only, no qtp reconcile")
    parser.add_argument("--spark-only", default=None, help="run qtp reconcile for these recipients only (e.g. s,c1)")
    parser.add_argument("--repeat", type=int, default=1, help="run the campaign this many times")
    parser.add_argument("--budget-s", type=float, default=0.0, help="--repeat: start no repetition after this long")
    parser.add_argument("--keep-databases", action="store_true",
                        help="--repeat: keep the databases of repetitions that passed (default: dropped)")
    parser.add_argument("--root", default=".qtp/coupled-campaign-db", help="folder of the campaign's database servers")
    parser.add_argument("--stop-databases", action="store_true", help="stop the database servers at the end")
    parser.add_argument("--out", default=None, help="results folder (default .qtp/coupled-campaign/<seed>_<time>)")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
