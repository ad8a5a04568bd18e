"""What ``qtp status`` shows of a node's messaging, read from its stores: sequences in both directions,
invoker backlog, dead letters. Opened on their own, so it works while the node runs and while it is down."""

from __future__ import annotations

import time
from typing import Any

import sqlalchemy

from qtp._render import age, table
from qtp.config import Config
from qtp.wsrm.codec import mc_id
from qtp.wsrm.runtime._settings import node_settings
from qtp.wsrm.store import SqlStore, Store
from qtp.xa._sql import normalize_url


def stores(config: Config) -> list[tuple[str, Store, sqlalchemy.Engine]]:
    """The node's SQL stores, opened read-write on their own (the node itself may be running)."""
    settings = node_settings(config.messaging, set(config.resources))
    names = [settings.store] if settings.mode != "memory" else []
    names += [c.store for c in settings.channels.values() if c.mode != "memory"]
    opened: dict[str, tuple[str, Store, sqlalchemy.Engine]] = {}
    for name in names:
        if name is None:
            continue
        url = config.resources[name]
        if url in opened:
            continue
        engine = sqlalchemy.create_engine(normalize_url(url), poolclass=sqlalchemy.pool.NullPool)
        store = SqlStore(name, engine)
        store.create()
        opened[url] = (name, store, engine)
    return list(opened.values())


def messaging_status(config: Config) -> dict[str, Any]:
    """Sequences (both directions), invoker backlog and dead letters, read from the node's stores."""
    if not config.messaging["channels"] and not config.messaging["node"].get("endpoint"):
        return {"sequences": [], "dead_letters": 0, "dead_letters_per_peer": {}, "invoker_backlog": 0}
    now = time.time()
    sequences, dead, backlog = [], 0, 0
    per_peer: dict[str, int] = {}  # peer name ("-": anonymous sequences) -> dead letters
    for name, store, engine in stores(config):
        try:
            with store.local() as s:
                summary = store.summary(s)
                for info, record in store.sources(s):
                    count, oldest = summary.outgoing.get((info.route, record.key), (0, None))
                    sequences.append({
                        "direction": "out", "store": name, "route": info.route, "peer": info.peer,
                        "identifier": record.identifier, "state": record.state.value,
                        "last_number": record.next_number - 1, "unacknowledged": count,
                        "oldest_unacknowledged_age_s": None if oldest is None else round(now - oldest, 3)})
                for route, key in summary.outgoing:
                    if key is None:
                        count, oldest = summary.outgoing[route, key]
                        sequences.append({"direction": "out", "store": name, "route": route, "peer": None,
                                          "identifier": None, "state": "QUEUED", "last_number": 0,
                                          "unacknowledged": count,
                                          "oldest_unacknowledged_age_s": round(now - oldest, 3)})
                for info, record in store.destinations(s):
                    waiting = summary.incoming.get(record.identifier, 0)
                    sequences.append({
                        "direction": "in", "store": name, "route": info.channel or "-", "peer": info.reply_to,
                        "identifier": record.identifier, "state": record.state.value,
                        "last_number": record.received[-1][1] if record.received else 0,
                        "invoker_backlog": waiting})
                dead += summary.dead_letters
                if summary.dead_letters:
                    for peer, count in store.dead_letters_per_peer(s).items():
                        per_peer[peer or "-"] = per_peer.get(peer or "-", 0) + count
                backlog += sum(summary.incoming.values())
        finally:
            engine.dispose()
    limits = node_settings(config.messaging, set(config.resources)).limits
    return {"sequences": sequences, "dead_letters": dead, "dead_letters_per_peer": dict(sorted(per_peer.items())),
            "invoker_backlog": backlog,
            "max_dead_letters": limits.max_dead_letters, "polling_clients": polling_clients(sequences)}


def polling_clients(sequences: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Clients that cannot listen and fetch their messages with WS-MakeConnection: the outbound sequences
    whose peer is a WS-MC anonymous URI, with how many messages wait for each client."""
    clients: dict[str, dict[str, Any]] = {}
    for q in sequences:
        client = mc_id(q["peer"]) if q["direction"] == "out" else None
        if client is not None:
            entry = clients.setdefault(client, {"client": client, "sequences": 0, "waiting": 0,
                                                "oldest_waiting_age_s": None})
            entry["sequences"] += 1
            entry["waiting"] += q["unacknowledged"]
            ages = [a for a in (entry["oldest_waiting_age_s"], q["oldest_unacknowledged_age_s"]) if a is not None]
            entry["oldest_waiting_age_s"] = max(ages) if ages and entry["waiting"] else None
    return sorted(clients.values(), key=lambda c: c["client"])


def messaging_warnings(status: dict[str, Any]) -> list[str]:
    """What an operator must act on: dead letters (each waits for a decision), and the peers at their cap."""
    dead, cap = status["dead_letters"], status.get("max_dead_letters")
    if not dead:
        return []
    per_peer = status.get("dead_letters_per_peer") or {}
    warning = (f"{dead} dead letter(s) wait for an operator (qtp dead-letters list, then retry or drop "
               "them)")
    if per_peer:
        warning += ": " + ", ".join(f"{n} from {peer}" for peer, n in per_peer.items())
    full = [peer for peer, n in per_peer.items() if cap is not None and n >= cap]
    if full:
        warning += (f"; {', '.join(full)} reached the cap of {cap} per peer ([limits] max_dead_letters): a "
                    "message of theirs whose handler keeps failing now stays queued and holds up its sequence")
    return [warning]


def render_messaging(status: dict[str, Any]) -> str:
    rows = [[q["direction"], q["route"], q["peer"] or "-", q["identifier"] or "-", q["state"], q["last_number"],
             q.get("unacknowledged", "-"), age(q.get("oldest_unacknowledged_age_s"), unknown="-"),
             q.get("invoker_backlog", "-")]
            for q in status["sequences"]]
    lines = [f"  messaging: {len(rows)} sequence(s), invoker backlog {status['invoker_backlog']}, "
             f"dead letters {status['dead_letters']}"]
    if rows:
        lines_of = table(["dir", "route", "peer", "sequence", "state", "last #", "unacked", "oldest", "backlog"],
                       rows)
        lines += ["    " + line for line in lines_of.splitlines()]
    clients = status.get("polling_clients") or []
    if clients:
        lines.append(f"  clients that poll (WS-MakeConnection): {len(clients)}")
        polled = table(["client", "sequences", "waiting", "oldest"],
                       [[c["client"], c["sequences"], c["waiting"], age(c["oldest_waiting_age_s"], unknown="-")]
                        for c in clients])
        lines += ["    " + line for line in polled.splitlines()]
    return "\n".join(lines)
