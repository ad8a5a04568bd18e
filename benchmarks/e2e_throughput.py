"""Exactly-once throughput and latency: qtp against hand-written transactional outbox/inbox baselines.

One-way messages of about 1 KB from a client application transaction (PostgreSQL) to a server application
transaction (MariaDB), both nodes on this machine, counted as applied per second at the server, with the
enqueue-to-apply latency (p50, p99) of every message and the CPU milliseconds per message of each of the
four processes (client, server, PostgreSQL with its backends, MariaDB):

- (a) qtp ``xa``, each node's queues in its own application database (one local commit per send and apply);
- (b) qtp ``xa``, each node's queues in the other database (two-phase commit at both ends);
- (A) as (a), with the nodes authenticating each other (every request and response HMAC-signed, anonymous
  requests refused: docs/security.md), what signing costs;
- (r) as (a), request-reply: the server's handler answers each order, the client applies each reply in a
  transaction (replies/s reported beside);
- (p) as (r), with a client that has no endpoint: it listens on no port and fetches its replies (and the
  acknowledgements of its orders) by polling the server with WS-MakeConnection;
- (d) the drain of a polling client: as (p), but the client polls only every ``DRAIN_POLL_S`` seconds
  (and takes its acknowledgements on the responses), with a window (``max_unacknowledged``) larger than
  the run (the server takes no more requests from a peer whose reply window is full), so that every reply
  waits at the server when its
  polls come: the replies/s reported are the rate at which a backlog is fetched and applied (the orders
  must all be applied within the first interval; the 10 %-90 % window of the replies then lies in the drain);
- (L) as (a), each node run with a ``[lease]`` (docs/operations.md: one owner among replicas; here one
  process each), what the fence before every commit costs;
- (R) as (L), each node with a second replica waiting as its standby (its own log folder and port, as on
  another host): what a standby costs the owner (their CPU is reported as ``server_standby``, ``client_standby``);
- (S1) as (L), the server's ``[lease]`` with ``slots = 2`` and the server one process (it holds both slots),
  behind the same balancer as (S2) (one target): what splitting the work into slots costs;
- (S2) as (S1), the server as two processes sharing the work (``slots = 2``, each its own log folder and port,
  as on hosts of their own) behind a round-robin balancer, the client started once each server process holds
  a slot (``balanced_s`` after the first took both): what replicas that share the work give. The balancer
  (``--balancer``) is HAProxy (one thread, connections to the replicas kept, routing by slot: a request whose
  URL names its slot, ``?qtp-slot=k``, goes to the replica holding it: ``qtp.testing.balancer``; its
  CPU reported as ``balancer``, this process's polls as ``measure``), or the test harness's ``LossyProxy``
  without faults (in this process, a connection per request; its CPU and the polls reported as ``proxy``);
  the second server process's CPU as ``server_b``;
- (S2r) as (S2), HAProxy round-robin without routing by slot: half the requests reach the replica that does
  not hold their slot, which forwards them (what routing by slot saves);
- (s) **the strong baseline**, what a user would hand-write: an ``outbox`` row written in the client's
  local transaction; one relay thread takes up to 500 rows (``FOR UPDATE SKIP LOCKED``, in id order),
  sends them in one POST (JSON), and deletes them on a 200 in the same transaction; the server inserts the
  new ones into its ``inbox`` (keyed by message id: exactly-once) and its ``applied`` table with
  ``executemany`` in one local commit. No recovery story beyond that.
- (c) the serial baseline: the same outbox, but one message per POST and one commit per message at the
  server (what issue 9 measured).

Every target is a ratio to (s) measured in the same round; (S1) and (S2) are also given as ratios to (L), and
(S2) to (S1), both by the window rate and by the end-to-end rate (every message, from the first order
committed to the last applied).
Variants run interleaved, ``--rounds`` times each, at each ``--threads`` count; throughput is measured in
the steady part of each run (from 10 % to 90 % of the messages applied). ``--rate R`` paces the senders at
R messages/s in all (the latency at a given load); ``--batch-handler`` makes the qtp server apply with a
batch handler (one ``executemany`` per transaction, as the strong baseline does); ``--lanes N`` gives the
qtp client's channel N lanes (N sequences; a server with slots works each sequence in one slot, so (S1) and
(S2) spread over their slots only with lanes). The measurement reads the databases every 50 ms (on one kept
connection each) and the servers' ``/metrics`` every ``METRICS_EVERY_S`` (the stored stage, so its rate is
the coarsest). The client CPU of (s) and (c) is this process's (its app and relay threads, plus the polling of
the measurement; the outbox server, its child, counted apart). Results: a table on stdout and ``--json``.

    python benchmarks/e2e_throughput.py [--messages 2000] [--rounds 2] [--threads 1,16] [--variants a,b,r,s,c]
    python benchmarks/e2e_throughput.py --rounds 1 --variants L,S1,S2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
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

from _cpu import CpuMeter, thread_cpu, thread_names

from qtp.embedded import DEFAULT_ROOT, EmbeddedMariaDB, EmbeddedPostgres, free_port
from qtp.testing.balancer import Haproxy
from qtp.testing.lossy_proxy import LossyProxy
from qtp.testing.nodes import (NodeProcess, Pair, Replicas, balanced, client_schema, counter, create, rows,
                               server_schema)

HERE = Path(__file__).resolve().parent
DRAIN_POLL_S = 60.0
PAD = 1000 - len('<order xmlns="urn:test" k="12345"></order>')
LABELS = {"a": "qtp xa, queues co-located", "A": "qtp xa, co-located, authenticated peers", "b": "qtp xa, queues in the other db",
          "r": "qtp xa, co-located, request-reply", "p": "qtp xa, request-reply, client polls",
          "d": "qtp xa, request-reply, polled backlog (drain)",
          "L": "qtp xa, co-located, [lease] (fenced commits)", "R": "qtp xa, co-located, [lease], a standby each",
          "S1": "qtp xa, [lease], slots = 2, one server", "S2": "qtp xa, [lease], slots = 2, two servers",
          "S2r": "as S2, balancer not routing by slot",
          "s": "strong outbox baseline", "c": "serial outbox baseline"}
SLOTS = 2  # (S1), (S2)
METRICS_EVERY_S = 0.5  # the servers' /metrics (the stored stage) is read this often; the databases every 50 ms
QTP_VARIANTS = ("a", "A", "L", "R", "S1", "S2", "S2r", "b", "r", "p", "d")
SHARED = ("S1", "S2", "S2r")  # the server's [lease] with slots = SLOTS
STRONG_BATCH = 500


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
             metrics: list[str] | None = None, cpu: CpuMeter | None = None, replies: bool = False) -> dict:
    """Poll the stages: orders committed at the client (the sending transactions), messages stored at the
    server (qtp: its received counter, summed over the server's processes at ``metrics``), messages applied.
    Each stage's rate is taken between 10 % and 90 % of the messages; latency is every message's
    enqueue-to-apply time."""
    # one kept connection per database for the polls (a new one per poll made the databases start 40
    # sessions a second, PostgreSQL a backend process each: load on the machine measured)
    engines = {url: sa.create_engine(url, pool_size=1, max_overflow=0) for url in (client_url, server_url)}
    try:
        return _poll(engines, server_url, client_url, total, began, timeout, metrics, cpu, replies)
    finally:
        for engine in engines.values():
            engine.dispose()


def _poll(engines: dict, server_url: str, client_url: str, total: int, began: float, timeout: float,
          metrics: list[str] | None, cpu: CpuMeter | None, replies: bool) -> dict:
    def count(url: str, table: str) -> int:
        with engines[url].connect() as conn:
            return conn.execute(text(f"SELECT COUNT(*) FROM {table}")).scalar_one()

    stages = {"sent": lambda: count(client_url, "orders"), "applied": lambda: count(server_url, "applied")}
    if metrics:  # scraped every METRICS_EVERY_S seconds: as often as the databases (every poll), /metrics would
        # load the servers more than any monitoring does (twice as much with two processes, as in (S2))
        scraped = {"at": -METRICS_EVERY_S, "n": 0.0}

        def stored() -> float:
            if time.monotonic() - scraped["at"] >= METRICS_EVERY_S:
                scraped["at"], scraped["n"] = time.monotonic(), _summed(metrics, "qtp_messages_received_total") or 0.0
            return scraped["n"]
        stages["stored"] = stored
    if replies:
        stages["replied"] = lambda: count(client_url, "replies")
    marks: dict[tuple[str, float], float] = {}
    commits = _commits(client_url)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        counts = {name: read() for name, read in stages.items()}
        now = time.monotonic()
        for name, n in counts.items():
            for share in (0.1, 0.9):
                if (name, share) not in marks and n >= share * total:
                    marks[name, share] = now
        if ("sent", 0.0) not in marks and counts["sent"]:
            marks["sent", 0.0] = now
        if counts["applied"] >= total and ("applied", 1.0) not in marks:
            marks["applied", 1.0] = now
        if counts["applied"] >= total and counts.get("replied", total) >= total:
            break
        time.sleep(0.05)
    latencies = sorted(v for (v,) in rows(server_url, "SELECT lat_ms FROM applied") if v is not None)
    result = {"applied": len(latencies), "elapsed_s": round(time.monotonic() - began, 2),
              "p50_ms": round(_pct(latencies, 0.5), 1), "p99_ms": round(_pct(latencies, 0.99), 1)}
    for name in stages:
        low, high = marks.get((name, 0.1)), marks.get((name, 0.9))
        rate = 0.8 * total / (high - low) if low is not None and high is not None and high > low else 0.0
        result["rate" if name == "applied" else f"{name}_rate"] = round(rate, 1)
    # every message, from the first order committed to the last one applied: what the workload takes end to
    # end. The window rate above is the apply rate once under way; when the senders are the limit it also
    # rewards a server that falls behind at first and catches up later (its window is shorter).
    first, last = marks.get(("sent", 0.0)), marks.get(("applied", 1.0))
    result["completion_rate"] = round(total / (last - first), 1) if first is not None and last and last > first \
        else 0.0
    if cpu is not None:
        result["cpu_ms_per_msg"] = cpu.per_message(len(latencies))
    if metrics:
        result["applied_on_receipt"] = _summed(metrics, "qtp_messages_applied_on_receipt_total")
        stores = _summed(metrics, "qtp_store_messages_count")
        result["messages_per_receiving_commit"] = round(total / stores, 2) if stores else None
    time.sleep(1.5)  # PostgreSQL publishes a backend's counters within a second of it going idle
    result["client_commits_per_msg"] = round((_commits(client_url) - commits) / total, 2)
    return result


def _summed(urls: list[str], name: str) -> float | None:
    """Metric ``name`` summed over the nodes' ``/metrics`` ``urls``; None when none of them has it."""
    values = [value for value in (counter(url, name) for url in urls) if value is not None]
    return sum(values) if values else None


def _commits(url: str) -> int:
    """Transactions committed in the client's PostgreSQL database so far (every process's, the measurement's
    polls included: about one per 50 ms)."""
    return rows(url, "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()")[0][0]


def _pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def _databases_cpu(pg, maria) -> dict[str, int | None]:
    return {"postgresql": pg.postmaster_pid(), "mariadb": maria.info.pid if maria.info else None}


def run_qtp(pg, maria, folder: Path, messages: int, threads: int, other: bool, tag: str,
            rate: float | None = None, batch_handler: bool = False, reply: bool = False,
            secret: str | None = None, profile: Path | None = None, polls: bool = False, drain: bool = False,
            lease: bool = False, standby: bool = False, slots: int = 1, sharing: int = 1, lanes: int = 1,
            balancer: str = "haproxy", per_thread: bool = False, route: bool = True) -> dict:
    """One run of a qtp variant; ``slots`` > 1: the server's ``[lease] slots``, run as ``sharing`` processes
    behind a round-robin LossyProxy without faults (one process too), the client with a ``[lease]``; ``lanes``
    > 1: the client's channel has that many lanes (sequences), each order keyed by its number."""
    client_app, server_app = _fresh(pg, f"tc_{tag}"), _fresh(maria, f"ts_{tag}")
    client_schema(client_app)
    server_schema(server_app)
    stores = {"client_store": _fresh(maria, f"tcs_{tag}"), "server_store": _fresh(pg, f"tss_{tag}")} if other else {}
    pair = Pair(client_app, server_app, reply=reply, secret=secret, client_listens=not (polls or drain),
                acks_to="poll" if polls else "anonymous", **stores, proxy_port=free_port() if slots > 1 else None,
                client_extra=f"lanes = {lanes}\n" if lanes > 1 else "",
                limits=f"poll_interval_min = {DRAIN_POLL_S}\npoll_interval_max = {DRAIN_POLL_S}\n"
                       f"max_unacknowledged = {messages + 1}" if drain else "")
    run = folder / tag
    run.mkdir(parents=True, exist_ok=True)
    proxy = None
    if slots > 1:  # the server's configs with [lease] slots (Replicas), the client's with a [lease] appended
        replicas = Replicas(pair, servers=sharing, clients=1, ttl=10, slots=slots)
        configs = replicas.write(run)
        client_config, server_configs = configs["client"], [configs[name] for name in replicas.names("server")]
        client_config.write_text(client_config.read_text() + "\n[lease]\nttl = 10\n")
        # (S1) too reaches its one process through the balancer: the two variants differ in the processes only
        if balancer == "haproxy":
            proxy = Haproxy(replicas.urls("server"), pair.proxy_port, run / "haproxy",
                            slots=slots if route else 0).start()
        else:
            proxy = LossyProxy(replicas.urls("server"), port=pair.proxy_port, balance="round-robin").start()
    else:
        client_config, server_config = pair.write(run)
        server_configs = [server_config]
        if lease or standby:
            for config in (client_config, server_config):
                config.write_text(config.read_text() + "\n[lease]\nttl = 10\n")
    servers = [NodeProcess(config, run / f"{config.stem}.log",
                           {"QTP_TEST_BATCH_HANDLER": "1"} if batch_handler else {}).start()
               for config in server_configs]
    server = servers[0]
    # the client starts once the server's processes hold every slot, each its share (with two, the first took
    # both and hands one back after holding it for twice the ttl)
    balanced_s = balanced(servers, timeout=3 * 10 + 30) if slots > 1 else None
    sending = {"QTP_TEST_SEND": str(messages), "QTP_TEST_THREADS": str(threads), "QTP_TEST_PAD": str(PAD)}
    if lanes > 1:
        sending["QTP_TEST_KEYS"] = "1"
    if rate:
        sending["QTP_TEST_RATE"] = str(rate)
    client = NodeProcess(client_config, run / "client.log", sending)
    standbys = [_standby(server_config, "server"), _standby(client_config, "client", sending)] if standby else []
    if standbys:  # each owner first, so that its standby waits; the client's starts as the client sends
        standbys[0].start_replica()
    began = time.monotonic()
    client.start()
    if standbys:
        standbys[1].start_replica()
        assert all(node.role() == "standby" for node in standbys), "a standby took its node"
    cpu = CpuMeter({"client": client.proc.pid, "server": server.proc.pid, **_databases_cpu(pg, maria),
                    **{f"{role}_standby": node.proc.pid for role, node in zip(("server", "client"), standbys)},
                    **{f"server_{chr(ord('a') + i)}": node.proc.pid for i, node in enumerate(servers) if i},
                    **({"proxy": os.getpid()} if isinstance(proxy, LossyProxy) else {}),
                    **({"balancer": proxy.pid, "measure": os.getpid()} if isinstance(proxy, Haproxy) else {})})
    spies = [_spy(profile / f"{tag}-{node.config.stem}.txt", node.proc.pid) for node in (client, *servers)
             ] if profile else []
    try:
        metrics = [f"http://127.0.0.1:{node.port}/metrics" for node in servers]
        threads_before = {node.config.stem: thread_cpu(node.proc.pid) for node in servers} if per_thread else {}
        result = _measure(server_app, client_app, messages, began, timeout=600 + (DRAIN_POLL_S if drain else 0),
                          metrics=metrics, cpu=cpu, replies=reply)
        if per_thread:  # each server process's CPU per message by thread (pool threads summed)
            result["thread_cpu_ms_per_msg"] = {
                node.config.stem: _by_thread(node.proc.pid, threads_before[node.config.stem], result["applied"])
                for node in servers}
        if proxy is not None:
            result["balanced_s"] = balanced_s
            if isinstance(proxy, Haproxy):
                answered = proxy.per_target()
            else:
                stats = proxy.stats()  # requests each server process answered (per_target: with several)
                answered = stats.get("per_target") or {replicas.urls("server")[0]: stats.get("forwarded", 0)}
            result["per_server"] = {name: answered.get(url, 0) for name, url in zip(replicas.names("server"),
                                                                                     replicas.urls("server"))}
        return result
    finally:
        for spy in spies:
            spy.send_signal(signal.SIGINT)
            spy.wait(30)
        client.stop()
        for node in (*servers, *standbys):
            node.stop()
        if proxy is not None:
            proxy.stop()


def _standby(config: Path, role: str, env: dict[str, str] | None = None) -> NodeProcess:
    """A second replica of the node of ``config``: its own log folder and port (as on another host)."""
    text = re.sub(r'(?m)^log_dir = "(.*)"$', lambda m: f'log_dir = "{m.group(1)}-standby"', config.read_text(), count=1)
    text = re.sub(r'(?m)^listen = ".*"$', f'listen = "127.0.0.1:{free_port()}"', text, count=1)
    path = config.with_name(f"{role}-standby.toml")
    path.write_text(text)
    return NodeProcess(path, config.with_name(f"{role}-standby.log"), env)


def _by_thread(pid: int, before: dict[int, float], messages: int) -> dict[str, float]:
    names = thread_names(pid, str(Path(sys.executable).parent / "py-spy"))
    used: dict[str, float] = {}
    for tid, seconds in thread_cpu(pid).items():
        name = names.get(tid, "(not Python)")
        used[name] = used.get(name, 0.0) + seconds - before.get(tid, 0.0)
    return {name: round(1000 * s / max(messages, 1), 3) for name, s in sorted(used.items(), key=lambda x: -x[1])}


def _spy(out: Path, pid: int) -> subprocess.Popen:
    """py-spy sampling ``pid``'s threads while they hold the interpreter lock (``--gil``: the Python work, not
    the waits for the lock) as collapsed stacks in ``out`` until SIGINT."""
    out.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(pid), "--rate", "200",
                             "--format", "raw", "--output", str(out), "--nonblocking", "--gil"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run_outbox(pg, maria, folder: Path, messages: int, threads: int, tag: str, strong: bool = False,
               rate: float | None = None) -> dict:
    """(s) with ``strong``, else (c): the hand-written outbox, relay and inbox."""
    client_url, server_url = _fresh(pg, f"oc_{tag}"), _fresh(maria, f"os_{tag}")
    client_schema(client_url)  # the same client table as qtp's variants write
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
    relay = threading.Thread(target=_strong_relay if strong else _relay,
                             args=(engine, f"http://127.0.0.1:{port}/", stop), daemon=True)
    senders = [threading.Thread(target=_outbox_sender, args=(engine, lane, threads, messages, rate), daemon=True)
               for lane in range(1, threads + 1)]
    cpu = CpuMeter({"client": os.getpid(), "server": proc.pid, **_databases_cpu(pg, maria)})
    began = time.monotonic()
    relay.start()
    for t in senders:
        t.start()
    try:
        return _measure(server_url, client_url, messages, began, timeout=600, cpu=cpu)
    finally:
        stop.set()
        relay.join(10)
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
        engine.dispose()


def _outbox_sender(engine: sa.Engine, lane: int, lanes: int, messages: int, rate: float | None) -> None:
    pad = "x" * PAD
    began = time.monotonic()
    for i, k in enumerate(range(lane, messages + 1, lanes)):
        if rate:  # this thread's share of the total rate
            time.sleep(max(0.0, began + i * lanes / rate - time.monotonic()))
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


def _strong_relay(engine: sa.Engine, url: str, stop: threading.Event) -> None:
    """Up to 500 outbox rows per POST, in id order, deleted in the same transaction once the server said 200."""
    session = requests.Session()
    take = text(f"SELECT id, msg_id, payload, enqueued_at FROM outbox ORDER BY id LIMIT {STRONG_BATCH} "
                "FOR UPDATE SKIP LOCKED")
    while not stop.is_set():
        with engine.begin() as conn:
            batch = conn.execute(take).fetchall()
            if batch:
                body = json.dumps([{"id": m, "payload": bytes(p).decode(), "enqueued": t} for _, m, p, t in batch])
                try:
                    ok = session.post(url + "batch", data=body, timeout=10).status_code == 200
                except requests.RequestException:
                    ok = False
                if ok:
                    conn.execute(text("DELETE FROM outbox WHERE id = ANY(:ids)"), {"ids": [r[0] for r in batch]})
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
    parser.add_argument("--variants", default="a,b,r,s,c",
                        help="a, A, L, R, S1, S2, S2r, b, r, p, d (qtp), s (strong), c (serial); see above")
    parser.add_argument("--rate", type=float, default=None, help="pace the senders at this many messages/s")
    parser.add_argument("--batch-handler", action="store_true", help="the qtp server applies with a batch handler")
    parser.add_argument("--lanes", type=int, default=1,
                        help="lanes of the qtp client's channel (orders keyed by number): with one, all the orders "
                             "travel in one sequence, which one slot of (S1)/(S2) works")
    parser.add_argument("--balancer", choices=("haproxy", "lossy"), default="haproxy",
                        help="what (S1) and (S2) reach the server through: HAProxy (round-robin, connections to "
                             "the replicas reused; Debian's package haproxy), or the test harness's LossyProxy "
                             "without faults (in this process, a connection per request)")
    parser.add_argument("--per-thread", action="store_true",
                        help="each qtp server process's CPU per message by thread (from /proc, names by py-spy dump)")
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--profile", type=Path, help="record the qtp nodes with py-spy (collapsed stacks) in this folder")
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
                if variant in ("c", "s"):
                    r = run_outbox(pg, maria, folder, args.messages, threads, tag, variant == "s", args.rate)
                else:
                    r = run_qtp(pg, maria, folder, args.messages, threads, variant == "b", tag, args.rate,
                                args.batch_handler, reply=variant in ("r", "p", "d"), polls=variant == "p",
                                drain=variant == "d",
                                secret=secrets.token_urlsafe(32) if variant == "A" else None,
                                lease=variant in ("L", *SHARED), standby=variant == "R",
                                slots=SLOTS if variant in SHARED else 1, sharing=1 if variant == "S1" else 2,
                                route=variant != "S2r",
                                lanes=args.lanes, profile=args.profile, balancer=args.balancer,
                                per_thread=args.per_thread)
                r.update(variant=variant, threads=threads, round=round_, rate_limit=args.rate, balancer=args.balancer,
                         batch_handler=args.batch_handler, lanes=args.lanes)
                results.append(r)
                print(json.dumps(r), flush=True)
    summary = summarise(results)
    if args.json:
        args.json.write_text(json.dumps({"runs": results, "summary": summary}, indent=1))
    return 0


def summarise(results: list[dict]) -> dict:
    """Medians per thread count and variant; each qtp variant's ratio to (s), and to (c), of the same rounds;
    (S1) and (S2) also to (L)."""
    summary: dict = {}
    for threads in sorted({r["threads"] for r in results}):
        row = {}
        for variant in LABELS:
            runs = [r for r in results if r["threads"] == threads and r["variant"] == variant]
            if runs:
                row[variant] = {name: statistics.median(r.get(name, 0.0) for r in runs)
                                for name in ("rate", "sent_rate", "stored_rate", "replied_rate", "completion_rate",
                                             "p50_ms", "p99_ms")}
                if all("client_commits_per_msg" in r for r in runs):
                    row[variant]["client_commits_per_msg"] = statistics.median(r["client_commits_per_msg"] for r in runs)
                row[variant]["cpu_ms_per_msg"] = {
                    proc: round(statistics.median(r["cpu_ms_per_msg"][proc] for r in runs), 3)
                    for proc in runs[0].get("cpu_ms_per_msg", {})}
        for base, variants in (("s", QTP_VARIANTS), ("c", QTP_VARIANTS), ("L", SHARED), ("S1", ("S2", "S2r"))):
            if base in row and row[base]["rate"]:
                for variant in variants:
                    if variant in row:
                        row[variant][f"ratio_to_{base}"] = round(row[variant]["rate"] / row[base]["rate"], 2)
                        if base in ("L", "S1") and row[base]["completion_rate"]:  # two processes against one
                            row[variant][f"completion_ratio_to_{base}"] = round(
                                row[variant]["completion_rate"] / row[base]["completion_rate"], 2)
        summary[threads] = row
        for variant, x in row.items():
            ratios = "".join(f" = {x[k]:.2f}x ({k.rsplit('_', 1)[1]})" for k in
                             ("ratio_to_s", "ratio_to_c", "ratio_to_L", "ratio_to_S1") if k in x)
            done = "".join(f" = {x[k]:.2f}x ({k.rsplit('_', 1)[1]})" for k in
                           ("completion_ratio_to_L", "completion_ratio_to_S1") if k in x)
            cpu = " ".join(f"{proc} {ms:.2f}" for proc, ms in x["cpu_ms_per_msg"].items())
            replied = f"; replies {x['replied_rate']:.0f}/s" if x.get("replied_rate") else ""
            commits = f"; client commits/msg {x['client_commits_per_msg']:.2f}" if "client_commits_per_msg" in x else ""
            print(f"{threads:2d} thread(s) ({variant}) {LABELS[variant]:40s} {x['rate']:7.1f} msg/s{ratios}{replied}{commits}; "
                  f"sent {x['sent_rate']:.0f}/s; end to end {x['completion_rate']:.0f}/s{done}; p50 {x['p50_ms']:.1f} ms p99 {x['p99_ms']:.1f} ms; CPU ms/msg: {cpu}")
    return summary


if __name__ == "__main__":
    sys.exit(main())
