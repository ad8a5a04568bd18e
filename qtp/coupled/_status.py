"""What ``qtp status`` and ``qtp coupled`` show of a node's coupled messaging, read from its stores on their
own connections (so it works while the node runs and while it is down), and the operator's retry."""

from __future__ import annotations

import time
import uuid
from typing import Any

import sqlalchemy as sa

from qtp._render import age, table
from qtp.config import Config
from qtp.coupled import _log as log_
from qtp.coupled._wire import ACTION, Control, encode
from qtp.errors import ConfigurationError
from qtp.wsrm.runtime._settings import node_settings
from qtp.wsrm.runtime._status import stores
from qtp.wsrm.store import Outgoing



def _present(engine: sa.Engine) -> bool:
    return sa.inspect(engine).has_table("qtp_coupled_out")


def coupled_status(config: Config, limit: int = 50) -> dict[str, Any]:
    """Sender rows undecided, the compensation log's open entries, recipient rows waiting or prepared."""
    now = time.time()
    waiting, open_entries, prepared, failed, received = 0, [], [], [], 0
    for name, _, engine in stores(config):
        if not _present(engine):
            continue
        with engine.connect() as conn:
            waiting += log_.undecided_count(conn)
            open_entries += [{k: r._mapping[k] for k in ("id", "channel", "recipient", "coupling", "reason",
                                                         "updated_at")} | {"store": name}
                             for r in log_.open_compensations(conn, limit)]
            prepared += [dict(r._mapping) for r in log_.prepared_rows(conn, limit)]
            failed += [dict(r._mapping) for r in log_.recipient_failures(conn, limit)]
            received += log_.waiting_count(conn)
    for entry in open_entries:
        entry["age_s"] = round(now - entry.pop("updated_at"), 3)
    for entry in prepared:
        entry["past_deadline_s"] = round(max(0.0, now - entry.pop("deadline")), 3)
        entry["prepared_for_s"] = round(now - entry.pop("updated_at"), 3)
    return {"undecided": waiting, "open_compensations": open_entries, "prepared": prepared,
            "recipient_failures": failed, "received": received}


def coupled_warnings(status: dict[str, Any]) -> list[str]:
    warnings = []
    if status["open_compensations"]:
        warnings.append(f"{len(status['open_compensations'])} aborted coupled message(s) not yet undone by their "
                        "recipient (qtp coupled list; qtp coupled retry ID)")
    late = [p for p in status["prepared"] if p["past_deadline_s"] > 0]
    if late:
        warnings.append(f"{len(late)} shared coupled message(s) prepared past their deadline, holding locks until "
                        "their sender decides (is the sender's node up?)")
    return warnings


def render_coupled(status: dict[str, Any]) -> str:
    lines = [f"coupled: {status['undecided']} sent and undecided, {status['received']} received and waiting, "
             f"{len(status['prepared'])} prepared (shared), {len(status['open_compensations'])} open compensation(s)"]
    if status["open_compensations"]:
        lines += ["  " + line for line in table(
            ["id", "channel", "recipient reported", "age"],
            [[e["id"], e["channel"], e["recipient"], age(e["age_s"])] for e in status["open_compensations"]]
        ).splitlines()]
    if status["prepared"]:
        lines += ["  " + line for line in table(
            ["prepared id", "sender", "prepared for", "past deadline"],
            [[p["id"], p["coordinator"], age(p["prepared_for_s"]), age(p["past_deadline_s"])] for p in status["prepared"]]
        ).splitlines()]
    if status["recipient_failures"]:
        lines += ["  " + line for line in table(
            ["failed id", "sender", "state", "error"],
            [[f["id"], f["coordinator"], f["state"], (f["error"] or "")[:80]] for f in status["recipient_failures"]]
        ).splitlines()]
    return "\n".join(lines)


def entries(config: Config, everything: bool = False) -> list[dict[str, Any]]:
    """The sender's rows: the open compensation-log entries, or every row."""
    found = []
    for name, _, engine in stores(config):
        if not _present(engine):
            continue
        with engine.connect() as conn:
            found += [dict(r._mapping) | {"store": name} for r in log_.entries(conn, everything)]
    return found


def retry(config: Config, ids: list[str] | None) -> list[str]:
    """Send the Abort of these aborted rows again (None: every open entry); returns the ids sent. The running
    node's sender takes the new messages from its store; a stopped node sends them when it starts."""
    settings = node_settings(config.messaging, set(config.resources))
    sent: list[str] = []
    for _, store, engine in stores(config):
        if not _present(engine):
            continue
        with store.local() as conn:
            for row in log_.lock_aborted(conn, ids):
                channel = settings.channels.get(row.channel)
                if channel is None:
                    raise ConfigurationError(f"coupled message {row.id} went to channel {row.channel!r}, which "
                                             "this node's configuration no longer has")
                abort = Control("Abort", row.id, body=row.compensation, token=row.token or "",
                                coordinator=config.node_id)
                store.enqueue(conn, Outgoing(route=channel.route_for(row.id), message_id=f"urn:uuid:{uuid.uuid4()}",
                                             action=ACTION["Abort"], enqueued_at=time.time(), payload=encode(abort)))
                log_.touch(conn, row.id)
                sent.append(row.id)
    missing = sorted(set(ids or ()) - set(sent))
    if missing:
        raise ConfigurationError(f"not aborted coupled messages of this node (nothing sent for them): "
                                 f"{', '.join(missing)}")
    return sent
