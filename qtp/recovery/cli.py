"""``qtp recover`` and ``qtp status``: the operator's view of a node's in-doubt branches.

Exit codes of ``qtp recover``: 0 nothing of this node is left in doubt; 1 something is left in doubt or
suspect (the summary says why: unreachable resource, heuristic hazard, missing log, quarantine); 2 an error
stopped it (corrupt log, bad configuration); 3 refused: a live manager holds the node's log.
``qtp status`` exits 0 when there is nothing to warn about, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable

from qtp.config import load_config
from qtp.errors import QtpError
from qtp.recovery._core import RecoveryReport
from qtp.recovery._node import LiveManagerError, NodeStatus, node_status, recover_node

EXIT_OK, EXIT_IN_DOUBT, EXIT_ERROR, EXIT_REFUSED = 0, 1, 2, 3


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("recover", help="resolve this node's in-doubt branches from its decision log")
    p.add_argument("--config", default="qtp.toml", help="the node's qtp.toml (default ./qtp.toml)")
    p.add_argument("--dry-run", action="store_true", help="show what would be done, change nothing")
    p.add_argument("--json", action="store_true", help="print one JSON document for scripts")
    p.set_defaults(func=run_recover)
    s = sub.add_parser("status", help="in-doubt branches per resource, and the decision log's state")
    s.add_argument("--config", default="qtp.toml", help="the node's qtp.toml (default ./qtp.toml)")
    s.add_argument("--json", action="store_true", help="print one JSON document for scripts")
    s.set_defaults(func=run_status)


# ---------------------------------------------------------------------------------------------- recover


def run_recover(args: argparse.Namespace) -> int:
    return _run(args, lambda config: recover_node(config, dry_run=args.dry_run),
                lambda report: report.to_dict(), render_report, lambda report: report.ok)


def _run(args: argparse.Namespace, compute: Callable, as_dict: Callable, render: Callable, ok: Callable) -> int:
    """Load the configuration, compute, print as text or JSON, and turn the outcome into an exit code."""
    try:
        result = compute(load_config(args.config))
    except LiveManagerError as exc:
        return _fail(args, "refused", str(exc), EXIT_REFUSED)
    except QtpError as exc:
        return _fail(args, "error", str(exc), EXIT_ERROR)
    print(json.dumps(as_dict(result), indent=2, default=str) if args.json else render(result))
    return EXIT_OK if ok(result) else EXIT_IN_DOUBT


def _fail(args: argparse.Namespace, kind: str, message: str, code: int) -> int:
    if args.json:
        print(json.dumps({"ok": False, kind: message}))
    else:
        print(f"qtp {args.command}: {kind}: {message}", file=sys.stderr)
    return code


def render_report(report: RecoveryReport) -> str:
    lines = []
    if report.rows:
        lines.append(_table(["xid", "resource", "age", "logged decision", "action", "result"],
                            [[r.xid, r.resource, _age(r.age_s), r.decision, r.action,
                              r.result if r.problem is None else f"{r.problem}: {r.result}"]
                             for r in report.rows]))
    else:
        lines.append(f"node {report.node_id}: no in-doubt branches and no open decisions")
    lines.append("")
    lines.append(("DRY RUN: " if report.dry_run else "") + report.summary())
    reasons = report.reasons()
    if reasons:
        lines.append("NOT RESOLVED:")
        lines += [f"  - {reason}" for reason in reasons]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- status


def run_status(args: argparse.Namespace) -> int:
    from qtp.wsrm.runtime.cli import messaging_status, render_messaging

    def compute(config: Any) -> NodeStatus:
        status = node_status(config, warn_age_s=config.warn_prepared_age)
        status.messaging = messaging_status(config)  # type: ignore[attr-defined]
        return status

    def render(status: NodeStatus) -> str:
        return render_status(status) + "\n" + render_messaging(status.messaging)  # type: ignore[attr-defined]

    return _run(args, compute, lambda status: status.__dict__, render, lambda status: not status.warnings)


def render_status(status: NodeStatus) -> str:
    live = f"held by live manager pid {status.log_locked_by}" if status.log_locked_by else "no live manager"
    lines = [f"node {status.node_id}   log {status.log_dir} ({live})"]
    if status.log_present:
        ckpt = status.last_checkpoint or "none"
        if status.last_checkpoint_age_s is not None:
            ckpt += f", {_age(status.last_checkpoint_age_s)} ago"
        lines.append(f"  log: {status.log_size} bytes in {status.log_segments} segment(s), {status.log_records} "
                     f"record(s), {status.open_decisions} open decision(s), last checkpoint {ckpt}")
        if status.torn_tail:
            lines.append(f"  log: torn tail (cut by a crash, ignored): {status.torn_tail}")
    else:
        lines.append("  log: missing (no segment file)")
    lines.append(f"  last-resource decision rows (Logging Last Resource): {status.last_resource_decisions}")
    for name, entry in status.resources.items():
        if entry["unreachable"]:
            lines.append(f"  resource {name}: UNREACHABLE: {entry['unreachable']}")
            continue
        branches = entry["in_doubt"]
        lines.append(f"  resource {name} ({entry['family']}): {len(branches)} in-doubt branch(es)")
        if branches:
            table = _table(["xid", "age", "logged decision"],
                           [[b["xid"], _age(b["age_s"]), b["decision"]] for b in branches])
            lines += ["    " + line for line in table.splitlines()]
    for warning in status.warnings:
        lines.append(f"WARNING: {warning}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- helpers


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def _table(header: list[str], rows: list[list[Any]]) -> str:
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    out = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)
