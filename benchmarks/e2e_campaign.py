"""End-to-end crash campaign: two qtp nodes, SIGKILLs of nodes and databases, a lossy network, Spark's verdict.

A client node (application table ``orders``) sends N orders, each in a transaction that inserts the order's
row; every 13th is rolled back on purpose (then recorded with status ``aborted``). A server node applies
each order by inserting into ``applied`` and answers; the client records each reply in ``replies``. Two
lossy proxies sit between the nodes, one per direction. While orders flow, a driver kills, at random
instants and with SIGKILL: the client node, the server node, the PostgreSQL server, the MariaDB server, or
arms a failpoint in a node (it restarts the node with ``QTP_FAILPOINTS=<point>=crash@<n>``, so the node
kills itself at a chosen instant inside the runtime or the commit path). Everything is restarted. At the
end the loss is turned off, the run waits (bounded) until nothing moves any more, and ``qtp reconcile``
(the Spark job) compares ``orders`` with ``applied`` and with ``replies``.

The client sends at a pace (``--rate``, orders/s) that spreads the stream over the kills: by default
``messages / (kills * KILL_SPACING_S)``, about one kill per ``KILL_SPACING_S`` of stream, the time a kill and
its restart take. Unpaced (``--rate 0``) the stream of 10,000 orders ended after 45-100 of 200 kills once the
transfer path had become fast, and the rest hit nodes with nothing in flight. Each kill records how many
orders the server had applied before it; ``kills_in_stream`` in the result counts the kills that came before
the last committed order was applied and replied to.

    python benchmarks/e2e_campaign.py --mode xa --messages 10000 --kills 200 --loss 0.1 --seed 1

Replicas (``--replicas N``, N > 1): each node runs as N processes sharing its identity through a ``[lease]``
(``--ttl`` seconds), one owner and N - 1 standbys, each with its own log folder and port, as on hosts of
their own; each side's lossy proxy fronts all the replicas of that side and fails over to the one that
answers (qtp.testing.lossy_proxy). The victims are then each replica ("server-a", "server-b", ...,
"client-a", ...), the two database servers, and a failpoint in a random replica; a killed replica is started
again at once and comes back as a standby (or the owner, whichever it gets). With ``--pause``, two more
victims: "pause-server" and "pause-client" SIGSTOP the owner of that node for the lease's ttl and 1-3 s more,
then SIGCONT it: it must find its lease taken and exit with status 75 (it is then started again as a
standby), and, checked on the server's ``applied`` table, must not have written after the takeover (see
``_pause``). Any replica that exits (a failpoint, a lost lease) is started again. A pause takes longer
than a kill: the default pace leaves the stream that much more time per pause.

    python benchmarks/e2e_campaign.py --messages 2000 --kills 40 --replicas 2 --pause --ttl 5

Replicas that share the work (``--slots N`` with ``--replicas M``, M >= 2): the server's replicas split its
work into N slots (``[lease] slots``), each holds some and serves, and the server's proxy sends each request
to the next replica in turn (round-robin; one that refuses or is silent is skipped for a second); the client's
replicas stay owner and standbys. The clients start once each server replica holds a slot (the first one
took them all; the others get theirs as it hands them back, after twice the ttl). The victims are the same; "pause-server" then pauses a random live server
replica, whose slots the others take over; it must not exit but give those slots back and go on, and must
not have written after the takeover (see ``_pause_sharing``). The summary adds how many requests the
server's proxy had answered by each server replica (``server_replica_requests``).

    python benchmarks/e2e_campaign.py --messages 1000 --kills 20 --replicas 2 --slots 2 --ttl 3

Every kill's outcome goes to ``<out>/kills.json``, the reconciliation reports to ``<out>/``; the verdict
(``exactly-once`` or ``violated``; with ``--pause`` also violated when a paused process wrote after the
takeover) is printed last and the exit code is 0 only for exactly-once.
"""

from __future__ import annotations

import argparse
import json
import random
import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qtp.coordinator._lease import LEASE_TABLE
from qtp.embedded import EmbeddedMariaDB, EmbeddedPostgres, free_port
from qtp.testing.lossy_proxy import LossyProxy
from qtp.testing.nodes import (LOST_LEASE_STATUS, NodeProcess, Pair, Replicas, applied_id_mark, balanced, client_schema,
                               clock_mark, written_after,
                               listening_ports, node_id, owner_of, reconcile_reports, rows, server_schema)

ABORT_EVERY = 13
KILL_SPACING_S = 1.2  # seconds of order stream per kill, when --rate is not given
FAILPOINTS = {
    # where the node kills itself; which ones a run can reach depends on where the stores are
    "colocated": ["after_store_before_ack", "after_apply_before_ack"],
    "other": ["after_store_before_ack", "after_apply_before_ack", "before_prepare", "after_prepare_0",
              "after_decision_forced", "after_commit_0", "before_end_record"],
}
VICTIMS = ("client", "server", "postgresql", "mariadb", "failpoint")
PAUSES = ("pause-server", "pause-client")  # --pause: SIGSTOP of that node's owner past its lease, then SIGCONT


@dataclass
class Campaign:
    args: argparse.Namespace
    out: Path
    rng: random.Random
    replicas: Replicas | None = None
    kills: list[dict] = field(default_factory=list)
    revived: list[dict] = field(default_factory=list)  # replicas started again after they exited by themselves
    balanced_s: float | None = None  # --slots: how long the server's replicas took to share its slots at the start

    def names(self) -> list[str]:
        """The node processes: the client's replicas, then the server's ("client", "server" for one each)."""
        return [*self.replicas.names("client"), *self.replicas.names("server")]

    @property
    def victims(self) -> tuple[str, ...]:
        return (*self.names(), *VICTIMS[2:], *(PAUSES if self.args.pause else ()))


def _databases(root: Path) -> tuple[EmbeddedPostgres, EmbeddedMariaDB]:
    pg, maria = EmbeddedPostgres(root / "pg"), EmbeddedMariaDB(root / "mariadb")
    pg.start()
    maria.start()
    return pg, maria


def _pair(args: argparse.Namespace, pg: EmbeddedPostgres, maria: EmbeddedMariaDB, tag: str) -> Pair:
    client_db, server_db = (pg, maria) if args.pair == "pg-maria" else (maria, pg)
    client_app = client_db.create_database(f"c_{tag}")
    server_app = server_db.create_database(f"s_{tag}")
    client_schema(client_app)
    server_schema(server_app)
    stores = {}
    if args.store == "other":
        stores = {"client_store": server_db.create_database(f"cs_{tag}"),
                  "server_store": client_db.create_database(f"ss_{tag}")}
    return Pair(client_app, server_app, reply=args.reply, mode=args.mode, wsrm=args.wsrm, soap=args.soap,
                proxy_port=free_port(), back_proxy_port=None if args.no_listen else free_port(),
                limits="max_attempts = 1000", secret=secrets.token_urlsafe(32) if args.auth else None,
                client_listens=not args.no_listen, acks_to=args.acks_to,
                client_extra=f"lanes = {args.lanes}\n" if args.lanes > 1 else "", **stores)


def _count(url: str, query: str) -> int:
    try:
        return int(rows(url, query)[0][0] or 0)
    except Exception:  # the database is being killed: no reading this time
        return -1


def _kill(c: Campaign, victim: str, nodes: dict[str, NodeProcess], servers: dict) -> dict:
    began = time.monotonic()
    record: dict = {"i": len(c.kills) + 1, "victim": victim, "at_s": round(time.monotonic() - c.args.began, 3)}
    if victim in nodes:
        if c.args.replicas > 1:
            record["role"] = nodes[victim].role()
        if nodes[victim].slots > 1:
            record["slots_held"] = nodes[victim].slots_held()
        nodes[victim].kill()
        nodes[victim].start_replica()
    elif victim in ("postgresql", "mariadb"):
        servers[victim].kill()
        servers[victim].start()
    elif victim in PAUSES:
        record.update(_pause(c, victim.removeprefix("pause-"), nodes))
    else:
        which = c.rng.choice(c.names())
        point = c.rng.choice(FAILPOINTS[c.args.store])
        hit = c.rng.randint(1, 20)
        record.update(node=which, failpoint=f"{point}=crash@{hit}")
        node = nodes[which]
        node.kill()
        node.env["QTP_FAILPOINTS"] = record["failpoint"]
        try:
            node.start_replica()
        except RuntimeError:  # the failpoint fired while the node was starting (delivering its backlog)
            record["fired"] = True
            node.env.pop("QTP_FAILPOINTS")
            node.start_replica()
        node.env.pop("QTP_FAILPOINTS", None)
    record["restart_s"] = round(time.monotonic() - began, 3)
    return record


def _pause(c: Campaign, role: str, nodes: dict[str, NodeProcess]) -> dict:
    """SIGSTOP the owner of node ``role`` for the lease's ttl and 1-3 s more, then SIGCONT it. If a standby
    took the node over meanwhile (the lease's epoch rose), the paused process must exit with status 75 and,
    must have written no row after the takeover: for the server in ``applied``, for the client in ``orders``
    and ``replies`` (``nodes.written_after``: the same argument with the client database's clock, which stamps
    each row at its INSERT, in place of ids).

    The server's check, from outside: ``applied.pid`` says which process inserted a row, and ``applied.id`` comes
    from a sequence (PostgreSQL) or an AUTO_INCREMENT counter (MariaDB) that hands out ids in increasing
    order at INSERT time, whether or not the transaction commits. ``mark`` is the highest id handed out,
    read while the process has been stopped for longer than the lease (so every statement it sent before
    the SIGSTOP has long finished) and after the takeover. A committed row of the paused pid with an id above
    ``mark`` was therefore inserted after the SIGCONT, by a process that had lost its lease: a write after
    the loss. The check is sound (no false alarm) but not complete: a transaction that inserted its row
    before the SIGSTOP and committed it after the SIGCONT has an id below ``mark`` and is not counted (the
    fence is what refuses that COMMIT; test_lease.py shows it), nor is anything the process wrote in the
    messaging stores' tables. A row below ``mark`` committed after the
    takeover is legitimate when the new owner's recovery committed the paused process's prepared branch.
    Reading MAX(id) before the SIGSTOP instead would be wrong both ways: commits in flight at the SIGSTOP
    and branches recovered by the new owner would look like writes after the loss. Ids are never handed
    out twice by PostgreSQL; MariaDB may hand out again, after a crash of its own, ids that no committed
    row holds, which can only hide a late row, never invent one."""
    if role == "server" and c.args.slots > 1:
        return _pause_sharing(c, nodes)
    owner = owner_of([nodes[name] for name in c.replicas.names(role)], timeout=3 * c.args.ttl + 30)
    if owner is None:
        return {"paused": None}
    pair = c.replicas.pair
    store = (pair.server_store or pair.server_app) if role == "server" else (pair.client_store or pair.client_app)
    epoch = f"SELECT epoch FROM {LEASE_TABLE} WHERE node_id = '{node_id(role, c.out)}'"
    held = c.args.ttl + c.rng.uniform(1.0, 3.0)
    record: dict = {"paused": next(name for name, node in nodes.items() if node is owner), "pid": owner.proc.pid,
                    "paused_s": round(held, 3), "epoch_before": _count(store, epoch)}
    owner.pause()
    time.sleep(held)
    record["epoch_after"] = _count(store, epoch)
    mark = _mark(pair.server_app if role == "server" else pair.client_app, role)
    owner.resume()
    taken_over = record["epoch_after"] > record["epoch_before"] >= 0
    status = owner.wait_exit(c.args.ttl + 30 if taken_over else 1.0)
    record.update(taken_over=taken_over, exit=status, exited_75=status == LOST_LEASE_STATUS,
                  as_expected=status == LOST_LEASE_STATUS if taken_over else status is None)
    if taken_over and mark is not None:
        record["wrote_after_loss"] = _wrote_after(pair, role, owner.proc.pid, mark)
    if status is None and taken_over:  # it did not notice: the record says so; the campaign goes on
        owner.kill()
    if not owner.alive():
        owner.start_replica()
    return record


def _pause_sharing(c: Campaign, nodes: dict[str, NodeProcess]) -> dict:
    """``--slots``: SIGSTOP a random live server replica for the lease's ttl and 1-3 s more, then SIGCONT it.
    The other replicas take over the slots it held (their logs say ``took slot <k>``): those are
    ``slots_lost``. Unlike a whole node's owner, the paused replica must not exit: it finds those slots'
    leases lost, gives them back (its log says ``gives slot <k> back``) and goes on serving, taking its share
    again later (``as_expected``: alive, and every lost slot given back within ttl + 30 s).

    It must have written no row after the takeover: rows of its pid in ``applied`` with an id above ``mark``
    (read, as in ``_pause``, while it has been stopped for longer than the lease) and up to ``mark_after``,
    read once it has given every lost slot back. Its rows after it takes a slot again are legitimate, so the
    check counts only when it took none before ``mark_after`` was read, and when every slot it held was taken
    over (a slot nobody took meanwhile is still its own); else ``wrote_after_loss`` is -1 (not checked)."""
    replicas = [nodes[name] for name in c.replicas.names("server")]
    live = [node for node in replicas if node.role() == "sharing"]
    if not live:
        return {"paused": None}
    paused = c.rng.choice(live)
    others = [node for node in replicas if node is not paused]
    slots = paused.slots_held()
    took = lambda: [sum(k == j for node in others for j in node.slots_taken()) for k in slots]  # noqa: E731
    held = c.args.ttl + c.rng.uniform(1.0, 3.0)
    record: dict = {"paused": next(name for name, node in nodes.items() if node is paused), "pid": paused.proc.pid,
                    "paused_s": round(held, 3), "slots_held": slots}
    before, taken, gave = took(), len(paused.slots_taken()), len(paused.slots_given_back())
    paused.pause()
    time.sleep(held)
    lost = [k for k, n, m in zip(slots, before, took()) if m > n]
    mark = _mark(c.replicas.pair.server_app, "server")
    paused.resume()
    given_back = lambda: set(lost) <= set(paused.slots_given_back()[gave:])  # noqa: E731
    deadline = time.monotonic() + c.args.ttl + 30
    while lost and paused.alive() and not given_back() and time.monotonic() < deadline:
        time.sleep(0.05)
    mark_after = _mark(c.replicas.pair.server_app, "server")
    retook = len(paused.slots_taken()) > taken
    status = None if paused.alive() else paused.wait_exit(1.0)
    record.update(slots_lost=lost, taken_over=bool(lost), exit=status, exited_75=status == LOST_LEASE_STATUS,
                  gave_back=given_back(), as_expected=status is None and given_back())
    if lost and mark is not None and mark_after is not None:
        checkable = lost == slots and not retook
        record["wrote_after_loss"] = _wrote_after(c.replicas.pair, "server", paused.proc.pid, mark, mark_after) \
            if checkable else -1
    if not paused.alive():
        paused.start_replica()
    return record


def _mark(url: str, role: str) -> Any:
    """The server's highest ``applied.id`` handed out, or the client database's clock; None when the database
    is being killed (no check this time)."""
    try:
        return applied_id_mark(url) if role == "server" else clock_mark(url)
    except Exception:  # noqa: BLE001 - a database being killed: no reading
        return None


def _wrote_after(pair: Pair, role: str, pid: int, mark: Any, upto: int | None = None) -> int:
    """Rows process ``pid`` wrote after ``mark`` (for the server, up to id ``upto`` when given)."""
    try:
        if role == "server":
            below = "" if upto is None else f" AND id <= {upto}"
            return int(rows(pair.server_app,
                            f"SELECT COUNT(*) FROM applied WHERE pid = {pid} AND id > {mark}{below}")[0][0])
        return written_after(pair.client_app, pid, mark)
    except Exception:  # noqa: BLE001 - as _count: -1, not checked this time
        return -1


def _revive(nodes: dict[str, NodeProcess], c: Campaign) -> None:
    """A node that exited by itself (a failpoint killed it, it lost its lease) is started again (without the
    failpoint)."""
    for name, node in nodes.items():
        if not node.alive():
            if c.args.replicas > 1:
                c.revived.append({"replica": name, "exit": node.wait_exit(1.0),
                                  "at_s": round(time.monotonic() - c.args.began, 3)})
            node.start_replica()
            for record in reversed(c.kills):
                if record.get("node") == name and "fired" not in record:
                    record["fired"] = True
                    break


def _run_kills(c: Campaign, pair: Pair, nodes: dict[str, NodeProcess], servers: dict) -> None:
    args = c.args
    for i in range(args.kills):
        # spread the kills over the stream: kill i once the client has recorded its share of the orders
        # (or after a few seconds without progress), at a random instant shortly after
        target = (i + 1) * args.messages / (args.kills + 1)
        waited = time.monotonic()
        while _count(pair.client_app, "SELECT COUNT(*) FROM orders") < target and time.monotonic() - waited < 5:
            _revive(nodes, c)
            time.sleep(0.05)
        time.sleep(c.rng.uniform(0.0, 0.3))
        _revive(nodes, c)
        victims = c.victims
        victim = victims[len(c.kills) % len(victims)] if len(c.kills) < len(victims) else c.rng.choice(victims)
        record = _kill(c, victim, nodes, servers)
        record["applied_before"] = _count(pair.server_app, "SELECT COUNT(*) FROM applied")
        if args.reply:
            record["replies_before"] = _count(pair.client_app, "SELECT COUNT(*) FROM replies")
        c.kills.append(record)
        if len(c.kills) % 10 == 0 or len(c.kills) == args.kills:
            print(f"  kill {len(c.kills)}/{args.kills}: {victim}; applied {record['applied_before']}", flush=True)
        (c.out / "kills.json").write_text(json.dumps(c.kills, indent=1))


def _drain(c: Campaign, pair: Pair, nodes: dict[str, NodeProcess], proxies: list[LossyProxy]) -> dict:
    """No more loss; wait until the client has sent everything and nothing changes for a while."""
    for proxy in proxies:
        proxy.set_faults(drop_request=0, drop_response=0, duplicate_request=0)
    deadline = time.monotonic() + c.args.drain_s
    last, still_since = None, time.monotonic()
    while time.monotonic() < deadline:
        _revive(nodes, c)
        state = (_count(pair.client_app, "SELECT COUNT(*) FROM orders"),
                 _count(pair.server_app, "SELECT COUNT(*) FROM applied"),
                 _count(pair.client_app, "SELECT COUNT(*) FROM replies"))
        committed = _count(pair.client_app, "SELECT COUNT(*) FROM orders WHERE status = 'committed'")
        complete = state[0] == c.args.messages and state[1] >= committed and (not c.args.reply or state[2] >= committed)
        if state != last:
            last, still_since = state, time.monotonic()
            print(f"  draining: orders {state[0]}, applied {state[1]}, replies {state[2]}", flush=True)
        if complete and time.monotonic() - still_since > 3 or time.monotonic() - still_since > c.args.quiet_s:
            break
        time.sleep(1.0)
    return {"orders": last[0], "applied": last[1], "replies": last[2], "drained": time.monotonic() < deadline}


def run(args: argparse.Namespace) -> int:
    tag = f"{args.mode}_{args.seed}_{int(time.time())}"
    out = Path(args.out or f".qtp/campaign/{tag}")
    out.mkdir(parents=True, exist_ok=True)
    c = Campaign(args, out, random.Random(args.seed))
    args.began = time.monotonic()
    print(f"e2e campaign: mode {args.mode}, {args.messages} messages, {args.kills} kills, loss {args.loss}, "
          f"seed {args.seed}, {args.pair}, stores {args.store}, {'request-reply' if args.reply else 'one-way'}"
          f"{', client polls (no endpoint)' if args.no_listen else ''}, "
          f"{f'paced at {args.rate:.1f} orders/s' if args.rate > 0 else 'unpaced'}"
          f"{f', {args.replicas} replicas per node, lease ttl {args.ttl:g} s' if args.replicas > 1 else ''}"
          f"{f', the server in {args.slots} slots shared by its replicas (round-robin)' if args.slots > 1 else ''}"
          f"{', pauses' if args.pause else ''}", flush=True)
    pg, maria = _databases(Path(args.root))
    pair = _pair(args, pg, maria, tag)
    c.replicas = Replicas(pair, servers=args.replicas, clients=args.replicas, ttl=args.ttl, slots=args.slots)
    configs = c.replicas.write(out)
    loss = dict(drop_request=args.loss / 2, drop_response=args.loss / 2, duplicate_request=args.loss / 2,
                delay=0.2, delay_ms=(0, 30))
    if args.replicas > 1:
        loss["failover_s"] = args.failover_s
    proxies = [LossyProxy(c.replicas.urls("server"), port=pair.proxy_port, seed=args.seed,
                          balance=c.replicas.balance("server"), **loss).start()]
    if pair.back_proxy_port is not None:  # a client without an endpoint is never called: it polls
        proxies.append(LossyProxy(c.replicas.urls("client"), port=pair.back_proxy_port,
                                  seed=args.seed + 1, **loss).start())
    sending = {"QTP_TEST_SEND": str(args.messages), "QTP_TEST_ABORT_EVERY": str(ABORT_EVERY)}
    if args.lanes > 1:  # each order keyed by its number: the channel's lanes (sequences) all carry orders
        sending["QTP_TEST_KEYS"] = "1"
    if args.rate > 0:
        sending["QTP_TEST_RATE"] = str(args.rate)
    nodes = {name: NodeProcess(configs[name], out / f"{name}.log", sending if name.startswith("client") else None)
             for name in (*c.replicas.names("server"), *c.replicas.names("client"))}
    servers = {"postgresql": pg, "mariadb": maria}
    try:
        for node in nodes.values():  # the servers first: the first replica of each node is its owner
            if args.slots > 1 and node is nodes[c.replicas.names("client")[0]]:
                # the first server replica took every slot: the client starts once each replica has its share
                c.balanced_s = balanced([nodes[name] for name in c.replicas.names("server")], 3 * args.ttl + 30)
                print(f"  the server's replicas share its {args.slots} slots after {c.balanced_s:.1f} s", flush=True)
            node.start_replica()
        if args.no_listen:
            assert all(listening_ports(nodes[name].proc.pid) == [] for name in c.replicas.names("client")), \
                "the client without an endpoint bound a port"
            print("  the client listens on no port (checked in /proc)", flush=True)
        _run_kills(c, pair, nodes, servers)
        drained = _drain(c, pair, nodes, proxies)
    finally:
        for node in nodes.values():
            node.stop()
        for proxy in proxies:
            proxy.stop()
    if args.replicas > 1:
        drained["proxies"] = [proxy.stats() for proxy in proxies]
    try:
        jobs = [(c.out / "reconcile-requests.json", pair.client_app, "orders", pair.server_app, "applied")]
        if args.reply:
            jobs.append((c.out / "reconcile-replies.json", pair.client_app, "orders", pair.client_app, "replies"))
        reports = reconcile_reports(jobs)  # one Spark driver for both
        requests_report, replies_report = reports[0], reports[1] if args.reply else None
    finally:
        if args.stop_databases:
            pg.stop()
            maria.stop()
    return summarise(c, drained, requests_report, replies_report)


def _in_stream(kills: list[dict], drained: dict) -> int:
    """Kills that came while work was in flight: before the server had applied (and, request-reply, the client
    had recorded the reply to) every committed order, as counted at the end of the drain."""
    return sum(1 for k in kills if 0 <= k.get("applied_before", -1) < drained["applied"]
               or 0 <= k.get("replies_before", -1) < (drained["replies"] or 0))


def summarise(c: Campaign, drained: dict, requests_report: dict, replies_report: dict | None) -> int:
    counts = requests_report["counts"]
    result = {"mode": c.args.mode, "messages": c.args.messages, "kills": len(c.kills), "loss": c.args.loss,
              "seed": c.args.seed, "pair": c.args.pair, "store": c.args.store, "reply": c.args.reply,
              "victims": {v: sum(1 for k in c.kills if k["victim"] == v) for v in c.victims},
              "rate": c.args.rate, "kills_in_stream": _in_stream(c.kills, drained),
              "drained": drained, "requests": counts, "requests_verdict": requests_report["verdict"],
              "replies": replies_report["counts"] if replies_report else None,
              "replies_verdict": replies_report["verdict"] if replies_report else None,
              "elapsed_s": round(time.monotonic() - c.args.began, 1)}
    if c.args.replicas > 1:
        result.update(replicas=c.args.replicas, ttl=c.args.ttl, revived=c.revived, **_lease_summary(c.kills))
        per_target = drained["proxies"][0]["per_target"]    # the server's proxy: requests each replica answered
        result.update(slots=c.args.slots, balanced_s=c.balanced_s, server_replica_requests={
            name: per_target.get(url, 0) for name, url in zip(c.replicas.names("server"), c.replicas.urls("server"))})
    verdict = "exactly-once" if result["requests_verdict"] == "exactly-once" and \
        result["replies_verdict"] in (None, "exactly-once") and not result.get("paused_wrote_after_loss") \
        else "violated"
    result["verdict"] = verdict
    (c.out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("victims", "kills_in_stream", "requests", "replies", "elapsed_s",
                                             "pauses", "paused_wrote_after_loss", "server_replica_requests")
                      if k in result}))
    print(f"results in {c.out}")
    print(verdict)
    return 0 if verdict == "exactly-once" else 1


def _lease_summary(kills: list[dict]) -> dict:
    """The pauses: how many, how many were taken over, how many of those exited 75 as they must, and the rows
    the paused processes wrote after their takeover (must be 0: the campaign's verdict checks it)."""
    pauses = [k for k in kills if k.get("paused")]
    taken = [k for k in pauses if k["taken_over"]]
    return {"pauses": len(pauses), "pauses_taken_over": len(taken),
            "paused_exited_75": sum(1 for k in taken if k["exited_75"]),
            "pauses_not_as_expected": sum(1 for k in pauses if not k["as_expected"]),
            "paused_wrote_after_loss": sum(max(0, k.get("wrote_after_loss", 0)) for k in pauses),
            "paused_unchecked": sum(1 for k in taken if k.get("wrote_after_loss", -1) < 0)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["memory", "persistent", "xa"], default="xa")
    parser.add_argument("--messages", type=int, default=1000)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--loss", type=float, default=0.1, help="share of requests and responses disturbed")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--pair", choices=["pg-maria", "maria-pg"], default="pg-maria",
                        help="client database - server database")
    parser.add_argument("--store", choices=["colocated", "other"], default="colocated",
                        help="queues in each node's application database, or in the other database (2PC)")
    parser.add_argument("--one-way", dest="reply", action="store_false", help="no replies")
    parser.add_argument("--no-listen", action="store_true",
                        help="the client has no endpoint and binds no port: it polls for replies (WS-MakeConnection)")
    parser.add_argument("--acks-to", default="anonymous", choices=["anonymous", "endpoint", "poll"],
                        help="the client channel's acks_to (poll: with --no-listen, acknowledgements fetched too)")
    parser.add_argument("--auth", action="store_true",
                        help="the nodes authenticate each other (signed requests, anonymous refused)")
    parser.add_argument("--wsrm", default="1.1")
    parser.add_argument("--soap", default="1.2")
    parser.add_argument("--rate", type=float, default=None,
                        help="orders/s the client sends (0: unpaced; default: messages / (kills * 1.2 s), "
                             "with --pause more seconds per kill for the share of pauses)")
    parser.add_argument("--drain-s", type=float, default=600.0, help="bound on the final wait")
    parser.add_argument("--quiet-s", type=float, default=30.0, help="nothing moved this long: stop waiting")
    parser.add_argument("--root", default=".qtp/campaign-db", help="folder of the campaign's own database servers")
    parser.add_argument("--stop-databases", action="store_true",
                        help="stop the campaign's database servers at the end (default: left running to inspect)")
    parser.add_argument("--out", default=None, help="results folder (default .qtp/campaign/<mode>_<seed>_<time>)")
    parser.add_argument("--replicas", type=int, default=1,
                        help="processes per node sharing its [lease] (1: one process per node, no lease)")
    parser.add_argument("--ttl", type=float, default=5.0, help="with --replicas: the lease's ttl in seconds")
    parser.add_argument("--failover-s", type=float, default=2.0,
                        help="with --replicas: a replica silent this long is passed over by the proxy")
    parser.add_argument("--lanes", type=int, default=1,
                        help="the client channel's lanes (sequences), each order keyed by its number: with --slots, "
                             "what spreads the orders over the server's slots")
    parser.add_argument("--slots", type=int, default=1,
                        help="with --replicas: the server's replicas share its work in this many slots "
                             "(round-robin proxy); 1: owner and standbys")
    parser.add_argument("--pause", action="store_true",
                        help="with --replicas: some kills SIGSTOP a node's owner past its lease, then SIGCONT it")
    args = parser.parse_args(argv)
    if args.replicas < 1 or args.pause and args.replicas < 2:
        parser.error("--replicas is 1 or more, and --pause needs --replicas 2 or more (a standby to take over)")
    if args.slots < 1 or args.slots > 1 and args.replicas < 2:
        parser.error("--slots is 1 or more, and --slots N > 1 needs --replicas 2 or more (replicas to share the work)")
    if args.slots > 1 and args.mode != "xa":
        parser.error("--slots N > 1 needs --mode xa (qtp refuses [lease] slots with other modes)")
    if args.lanes < 1:
        parser.error("--lanes is 1 or more")
    if args.rate is None:  # a pause lasts the ttl and 1-3 s more before its restart: a share of the kills do
        pauses = len(PAUSES) / (2 * args.replicas + len(VICTIMS) - 2 + len(PAUSES)) if args.pause else 0.0
        args.rate = args.messages / (max(args.kills, 1) * (KILL_SPACING_S + pauses * (args.ttl + 2.0)))
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
