"""``qtp recover``: resolve a node's in-doubt branches from its decision log (``qtp status`` is
``qtp.status_cli``).

Exit codes of ``qtp recover``: 0 nothing of this node is left in doubt; 1 something is left in doubt or
suspect (the summary says why: unreachable resource, heuristic hazard, missing log, quarantine); 2 an error
stopped it (corrupt log, bad configuration); 3 refused: a live manager holds the node's log.
"""

from __future__ import annotations

import argparse
from typing import Any

from qtp._render import age, run, table
from qtp.config import slot_configs
from qtp.recovery._core import RecoveryReport
from qtp.recovery._node import LiveManagerError, recover_node


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("recover", help="resolve this node's in-doubt branches from its decision log")
    p.add_argument("--config", default="qtp.toml", help="the node's qtp.toml (default ./qtp.toml)")
    p.add_argument("--dry-run", action="store_true", help="show what would be done, change nothing")
    p.add_argument("--json", action="store_true", help="print one JSON document for scripts")
    p.set_defaults(func=run_recover)


# ---------------------------------------------------------------------------------------------- recover


def run_recover(args: argparse.Namespace) -> int:
    def each(config: Any) -> list[RecoveryReport]:  # a node whose replicas share the work: each of its slots
        return [recover_node(slot, dry_run=args.dry_run) for slot in slot_configs(config)]

    return run(args, each,
               lambda reports: [r.to_dict() for r in reports] if len(reports) > 1 else reports[0].to_dict(),
               lambda reports: "\n\n".join(render_report(r) for r in reports),
               lambda reports: all(r.ok for r in reports), refused=(LiveManagerError,))


def render_report(report: RecoveryReport) -> str:
    lines = []
    if report.rows:
        lines.append(table(["xid", "resource", "age", "logged decision", "action", "result"],
                           [[r.xid, r.resource, age(r.age_s), r.decision, r.action,
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
