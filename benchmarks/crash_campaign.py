"""The long crash campaign: N kills across PG+PG, PG+MariaDB and MariaDB+MariaDB.

Half the kills are SIGKILLs from outside at random moments, the other half crashes at a failpoint chosen
at random (every point of the commit path, and recovery itself dying after an action). After every kill
the node is recovered (through the code of ``qtp recover`` or at the next start, at random) and checked:
money conserved, no transfer half-applied, no acknowledged transfer lost, the crashed transfer decided as
its failpoint forces, nothing prepared, every row updatable at once. See qtp/testing/crash_campaign.py.

    .venv/bin/python benchmarks/crash_campaign.py --kills 2000 [--budget-s 1500] [--llr]

Writes benchmarks/crash_campaign.json and the chart benchmarks/crash_campaign_outcomes.png (with ``--llr``,
Logging Last Resource commits and its failpoints: crash_campaign_llr.json, crash_campaign_llr_outcomes.png).
Servers: its own PostgreSQL and MariaDB under .qtp/campaign (started when needed).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from qtp.testing import crash_campaign as _campaign  # noqa: E402

ORDER = ["sigkill", *dict.fromkeys(_campaign.FAILPOINT_SCENARIOS + _campaign.LLR_FAILPOINT_SCENARIOS)]
OUTCOMES = [("committed", "#2e7d32"), ("rolled back", "#1565c0"), ("no transfer in progress", "#9e9e9e")]


def chart(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per = summary["per_scenario"]
    names = [n for n in ORDER if n in per]
    fig, ax = plt.subplots(figsize=(10, 4.8))
    bottom = [0] * len(names)
    for outcome, colour in OUTCOMES:
        values = [per[n].get(outcome, 0) for n in names]
        ax.bar(names, values, bottom=bottom, color=colour, label=f"crashed transfer {outcome}"
               if outcome != "no transfer in progress" else outcome)
        bottom = [b + v for b, v in zip(bottom, values)]
    for i, n in enumerate(names):
        ax.text(i, bottom[i], f"{per[n]['kills']} kills\n{per[n]['violations']} viol.", ha="center",
                va="bottom", fontsize=7)
    ax.set_ylabel("kills")
    ax.set_ylim(0, max(bottom) * 1.22)
    mode = "Logging Last Resource" if summary.get("llr") else "file decision log"
    ax.set_title(f"qtp crash campaign ({mode}): {summary['kills']} kills over PG+PG, PG+MariaDB, MariaDB+MariaDB; "
                 f"{summary['violations']} violations, "
                 f"{sum(len(v) for v in summary['prepared_left'].values())} prepared left", fontsize=9)
    ax.legend(fontsize=8, loc="upper right")
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=2000)
    parser.add_argument("--budget-s", type=float, default=None, help="stop starting kills after this many seconds")
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--root", type=Path, default=Path(".qtp/campaign"), help="where the servers live")
    parser.add_argument("--llr", action="store_true", help="commit with Logging Last Resource")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--png", type=Path)
    args = parser.parse_args(argv)
    suffix = "_llr" if args.llr else ""
    args.out = args.out or HERE / f"crash_campaign{suffix}.json"
    args.png = args.png or HERE / f"crash_campaign{suffix}_outcomes.png"
    work = Path(tempfile.mkdtemp(prefix="qtp-campaign-"))
    try:
        code = _campaign.main([
            "--kills", str(args.kills), "--scenarios", "all", "--workdir", str(work),
            "--pg-root", str(args.root / "pg"), "--maria-root", str(args.root / "mariadb"),
            "--seed", str(args.seed), "--tag", f"lc{os.getpid() % 100000}", "--json", str(args.out),
            *(["--budget-s", str(args.budget_s)] if args.budget_s else []), *(["--llr"] if args.llr else []),
        ])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = json.loads(args.out.read_text())
    chart(summary, args.png)
    print(f"{summary['kills']} kills in {summary['seconds']} s, {summary['violations']} violations; chart {args.png}")
    return code


if __name__ == "__main__":
    sys.exit(main())
