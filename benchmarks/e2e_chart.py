"""Chart of e2e crash campaigns: per mode, messages committed, applied once, lost, duplicated, applied but
aborted, replies lost and duplicated, beside the dissertation's three outcomes (seed 000, chapter 5).

    python benchmarks/e2e_chart.py RESULT.json [RESULT.json ...] --png benchmarks/e2e_campaign.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# What the dissertation observed with 20 messages, the nodes stopped and started by hand (chapter 5).
DISSERTATION = {
    "memory": "lost messages and sequence state; could not recover",
    "persistent": "some of 20 lost (fewer than 20 applied, fewer than 20 replies)",
    "xa": "none of 20 lost",
}
CLASSES = ("committed", "applied once", "lost", "duplicated", "applied but aborted", "replies lost",
           "replies duplicated")


def bars(result: dict) -> list[int]:
    r, p = result["requests"], result.get("replies") or {}
    aborted = result["messages"] // 13  # every 13th order is rolled back on purpose
    applied_once = r["ok"] - (aborted - r["applied_but_aborted"])  # ok also counts aborted orders left absent
    return [result["messages"] - aborted, applied_once, r["lost"], r["duplicated"], r["applied_but_aborted"],
            p.get("lost", 0), p.get("duplicated", 0)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--png", type=Path, default=Path("benchmarks/e2e_campaign.png"))
    args = parser.parse_args(argv)
    results = [json.loads(p.read_text()) for p in args.results]
    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 4.6), squeeze=False)
    for ax, result in zip(axes[0], results):
        values = bars(result)
        colours = ["#7a7a7a", "#2e7d32", "#c62828", "#ef6c00", "#6a1b9a", "#e57373", "#ffb74d"]
        ax.bar(range(len(CLASSES)), values, color=colours)
        ax.set_xticks(range(len(CLASSES)), CLASSES, rotation=40, ha="right", fontsize=8)
        for i, v in enumerate(values):
            ax.text(i, v, str(v), ha="center", va="bottom", fontsize=7)
        ax.set_title(f"{result['mode']}: {result['messages']:,} messages, {result['kills']} kills, "
                     f"verdict {result['verdict']}", fontsize=8)
        ax.set_xlabel("dissertation (20 msgs): " + DISSERTATION[result["mode"]], fontsize=7, wrap=True)
    fig.suptitle("qtp end-to-end crash campaigns (SIGKILL of nodes, databases, failpoints; lossy network), "
                 "reconciled by Spark", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    print(f"chart: {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
