"""``qtp status``: a node's in-doubt branches, decision log, and messaging (sequences, backlog, dead letters).

It exits 0 when there is nothing to warn about, 1 otherwise (2 on an error, 3 is never used). The two
halves come from their own layers: ``qtp.recovery`` (transactions), ``qtp.wsrm.runtime`` (messaging) and ``qtp.coupled`` (coupled transactions).
"""

from __future__ import annotations

import argparse
from typing import Any

from qtp._render import age, run, table
from qtp.config import slot_configs
from qtp.coupled._status import coupled_status, coupled_warnings, render_coupled
from qtp.recovery._node import NodeStatus, node_status
from qtp.wsrm.runtime._status import messaging_status, messaging_warnings, render_messaging


def register(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("status", help="in-doubt branches per resource, the decision log, and messaging")
    s.add_argument("--config", default="qtp.toml", help="the node's qtp.toml (default ./qtp.toml)")
    s.add_argument("--json", action="store_true", help="print one JSON document for scripts")
    s.set_defaults(func=run_status)


def run_status(args: argparse.Namespace) -> int:
    def compute(config: Any) -> NodeStatus:
        status = node_status(config, warn_age_s=config.warn_prepared_age)
        status.messaging = messaging_status(config)  # type: ignore[attr-defined]
        status.warnings += messaging_warnings(status.messaging)  # type: ignore[attr-defined]
        if status.messaging["sequences"] or config.messaging["channels"]:  # type: ignore[attr-defined]
            status.coupled = coupled_status(config)  # type: ignore[attr-defined]
            status.warnings += coupled_warnings(status.coupled)  # type: ignore[attr-defined]
        return status

    def render(status: NodeStatus) -> str:
        coupled = getattr(status, "coupled", None)
        return (render_status(status) + "\n" + render_messaging(status.messaging)  # type: ignore[attr-defined]
                + ("\n" + render_coupled(coupled) if coupled else ""))

    def each(config: Any) -> list[NodeStatus]:  # a node whose replicas share the work: each of its slots
        return [compute(slot) for slot in slot_configs(config)]

    return run(args, each,
               lambda statuses: [s.__dict__ for s in statuses] if len(statuses) > 1 else statuses[0].__dict__,
               lambda statuses: "\n\n".join(render(s) for s in statuses),
               lambda statuses: not any(s.warnings for s in statuses))


def render_status(status: NodeStatus) -> str:
    live = f"held by live manager pid {status.log_locked_by}" if status.log_locked_by else "no live manager"
    lines = [f"node {status.node_id}   log {status.log_dir} ({live})"]
    if status.log_present:
        ckpt = status.last_checkpoint or "none"
        if status.last_checkpoint_age_s is not None:
            ckpt += f", {age(status.last_checkpoint_age_s)} ago"
        lines.append(f"  log: {status.log_size} bytes in {status.log_segments} segment(s), {status.log_records} "
                     f"record(s), {status.open_decisions} open decision(s), last checkpoint {ckpt}")
        if status.torn_tail:
            lines.append(f"  log: torn tail (cut by a crash, ignored): {status.torn_tail}")
    else:
        lines.append("  log: missing (no segment file)")
    lines.append(f"  last-resource decision rows (Logging Last Resource): {status.last_resource_decisions}")
    if status.lease is not None:
        lines.append(render_lease(status.lease))
    for name, entry in status.resources.items():
        if entry["unreachable"]:
            lines.append(f"  resource {name}: UNREACHABLE: {entry['unreachable']}")
            continue
        branches = entry["in_doubt"]
        lines.append(f"  resource {name} ({entry['family']}): {len(branches)} in-doubt branch(es)")
        if branches:
            rows = table(["xid", "age", "logged decision"],
                          [[b["xid"], age(b["age_s"]), b["decision"]] for b in branches])
            lines += ["    " + line for line in rows.splitlines()]
    for warning in status.warnings:
        lines.append(f"WARNING: {warning}")
    return "\n".join(lines)


GONE_SHOWN = 5  # processes of the node that left or died, shown by `qtp status` (newest first)


def render_lease(lease: dict) -> str:
    """The owner, its epoch and lease, and every process of the node seen ([lease]: replicas)."""
    expires = lease["expires_in_s"]
    state = "expired" if expires is None or expires <= 0 else f"expires in {expires:.1f} s unless renewed"
    lines = [f"  lease: owner {lease['holder']}, epoch {lease['epoch']}, held for {age(lease['acquired_s_ago'])}, "
             f"{state}"]
    live = [m for m in lease["members"] if m["role"] != "left" and m["expires_in_s"] > 0]
    gone = [m for m in lease["members"] if m not in live]  # newest first: the last few are worth a look
    rows = [[m["member"], m["role"], m["epoch"], age(m["seen_s_ago"]) + " ago"] for m in live]
    rows += [[m["member"], "left" if m["role"] == "left" else f"{m['role']} (gone)", m["epoch"],
              age(m["seen_s_ago"]) + " ago"] for m in gone[:GONE_SHOWN]]
    lines += ["    " + line for line in table(["process", "role", "epoch", "last seen"], rows).splitlines()]
    if len(gone) > GONE_SHOWN:
        lines.append(f"    ... and {len(gone) - GONE_SHOWN} more processes gone (kept for an hour)")
    return "\n".join(lines)
