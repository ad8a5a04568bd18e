"""What ``qtp status`` shows of a node's messaging, read from its stores: sequences in both directions,
invoker backlog, dead letters. Opened on their own, so it works while the node runs and while it is down.
For a node without an endpoint, also the polled peers it reported as maybe lacking WS-MakeConnection, from
``polled-peers.json`` in its log folder (written by its poller, ``_mailbox.PolledPeers``)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import sqlalchemy

from qtp._render import age, table
from qtp.config import Config
from qtp.wsrm.codec import mc_id
from qtp.wsrm.runtime._settings import node_settings
from qtp.wsrm.store import SqlStore, Store
from qtp.xa._sql import normalize_url

POLLED_PEERS_FILE = "polled-peers.json"  # in the node's log folder (<log_dir>/<node id>/), by _mailbox.PolledPeers


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
        store = SqlStore(name, engine, prefix="qtp_rm_" if not config.slot else f"qtp_rm_s{config.slot}_")
        store.create()
        opened[url] = (name, store, engine)
    return list(opened.values())


def messaging_status(config: Config) -> dict[str, Any]:
    """Sequences (both directions), invoker backlog and dead letters, read from the node's stores."""
    if not config.messaging["channels"] and not config.messaging["node"].get("endpoint"):
        return {"sequences": [], "dead_letters": 0, "dead_letters_per_peer": {}, "invoker_backlog": 0,
                "polled_peers": []}
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
                        "owner": info.owner, "identifier": record.identifier, "state": record.state.value,
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
            "max_dead_letters": limits.max_dead_letters, "polling_clients": polling_clients(sequences),
            "polled_peers": polled_peers(config.log_dir / config.node_id, now)}


def polled_peers(folder: Path, now: float) -> list[dict[str, Any]]:
    """The peers a node without an endpoint polls, as its poller last wrote them (only once one looked like
    it lacks WS-MakeConnection); ``written_age_s``: how long ago that was written."""
    try:
        written = json.loads((folder / POLLED_PEERS_FILE).read_text())
    except (OSError, ValueError):
        return []
    age = round(max(0.0, now - float(written.get("updated_at", now))), 3)
    return [dict(p, written_age_s=age) for p in written.get("peers", []) if isinstance(p, dict) and "peer" in p]


def polling_clients(sequences: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Clients that cannot listen and fetch their messages with WS-MakeConnection: the outbound sequences
    whose peer is a WS-MC anonymous URI, with how many messages wait for each client, per peer that created
    them (``owner``; None: anonymous). Only that peer's polls get them: another peer naming the same WS-MC
    address has a row of its own."""
    clients: dict[tuple[str, str], dict[str, Any]] = {}
    for q in sequences:
        client = mc_id(q["peer"]) if q["direction"] == "out" else None
        if client is not None:
            owner = q.get("owner")
            entry = clients.setdefault((owner or "", client), {"client": client, "peer": owner, "sequences": 0,
                                                               "waiting": 0, "oldest_waiting_age_s": None})
            entry["sequences"] += 1
            entry["waiting"] += q["unacknowledged"]
            ages = [a for a in (entry["oldest_waiting_age_s"], q["oldest_unacknowledged_age_s"]) if a is not None]
            entry["oldest_waiting_age_s"] = max(ages) if ages and entry["waiting"] else None
    return sorted(clients.values(), key=lambda c: (c["client"], c["peer"] or ""))


def messaging_warnings(status: dict[str, Any]) -> list[str]:
    """What an operator must act on: dead letters (each waits for a decision), and the peers at their cap."""
    warnings = [f"polled peer {p['peer']} answered {p['empty_in_a_row']} polls in a row with an empty HTTP "
                f"{p['last_status']} and never a message: it may not support WS-MakeConnection, so what this node "
                "fetches from it (replies, acknowledgements) never comes (docs/interop.md, WS-MakeConnection)"
                for p in status.get("polled_peers") or [] if p.get("suspect")]
    return warnings + _dead_letter_warnings(status)


def _dead_letter_warnings(status: dict[str, Any]) -> list[str]:
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
        polled = table(["client", "peer", "sequences", "waiting", "oldest"],
                       [[c["client"], c.get("peer") or "-", c["sequences"], c["waiting"],
                         age(c["oldest_waiting_age_s"], unknown="-")] for c in clients])
        lines += ["    " + line for line in polled.splitlines()]
    peers = status.get("polled_peers") or []
    if peers:
        lines.append(f"  peers this node polls (WS-MakeConnection): {len(peers)}")
        seen = table(["peer", "messages", "empty in a row", "empty for", "last status", "no WS-MC?", "written"],
                     [[p["peer"], p["messages"], p["empty_in_a_row"], age(p.get("empty_for_s"), unknown="-"),
                       p.get("last_status") or "-", "yes" if p.get("suspect") else "no",
                       age(p.get("written_age_s"), unknown="-") + " ago"] for p in peers])
        lines += ["    " + line for line in seen.splitlines()]
    return "\n".join(lines)
