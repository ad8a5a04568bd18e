"""What the ``qtp`` commands share: aligned tables, short ages, and the load-compute-print-exit of a report.

Exit codes: 0 nothing to report, 1 something to look at (in doubt, warnings), 2 an error stopped the
command (bad configuration, corrupt log), 3 refused (e.g. a live manager holds the node's log).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Callable

from qtp.config import load_config
from qtp.errors import QtpError

EXIT_OK, EXIT_ATTENTION, EXIT_ERROR, EXIT_REFUSED = 0, 1, 2, 3


def table(header: list[str], rows: list[list[Any]]) -> str:
    """``rows`` under ``header``, columns left-aligned to their widest cell, a dashed rule under the header."""
    cells = [header] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    out = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)


def age(seconds: float | None, unknown: str = "?") -> str:
    """``seconds`` as 42s, 17m or 3.5h; ``unknown`` when there is no value."""
    if seconds is None:
        return unknown
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def run(args: argparse.Namespace, compute: Callable, as_dict: Callable, render: Callable, ok: Callable,
        refused: tuple[type[BaseException], ...] = ()) -> int:
    """Load ``args.config``, compute, print as text or JSON (``args.json``), and turn the outcome into an
    exit code; an exception of ``refused`` means 3."""
    try:
        result = compute(load_config(args.config))
    except refused as exc:
        return _fail(args, "refused", str(exc), EXIT_REFUSED)
    except QtpError as exc:
        return _fail(args, "error", str(exc), EXIT_ERROR)
    print(json.dumps(as_dict(result), indent=2, default=str) if args.json else render(result))
    return EXIT_OK if ok(result) else EXIT_ATTENTION


def _fail(args: argparse.Namespace, kind: str, message: str, code: int) -> int:
    if args.json:
        print(json.dumps({"ok": False, kind: message}))
    else:
        print(f"qtp {args.command}: {kind}: {message}", file=sys.stderr)
    return code
