"""The random campaign: a transferring process is SIGKILLed from outside at random moments, over and over.

Runs ``python -m qtp.testing.crash_campaign`` (which forks the children, kills them, recovers through the code of
``qtp recover`` or at the next start, and checks every property after every kill) against the session's
servers, then checks the databases again itself.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from qtp.config import load_config
from qtp.testing.crash_workload import check_pair

# long tests (a quick run leaves them out: -m 'not slow')
pytestmark = pytest.mark.slow

# Per database pair: 35 with the file log, 20 with Logging Last Resource. Every failpoint is crashed at, both
# routes, in tests/test_crash_matrix.py; these random moments add the kills no failpoint names (at 210 and
# 120 kills the outcomes were 60 committed / 131 rolled back and 42 / 66: the halves keep both well above 5).
KILLS = {"log": 105, "llr": 60}


@pytest.mark.parametrize("mode", ["log", "llr"])
def test_random_sigkill_campaign(pg_server, maria_server, tmp_path, mode):
    out = tmp_path / "campaign.json"
    kills = KILLS[mode]
    proc = subprocess.run(
        [sys.executable, "-m", "qtp.testing.crash_campaign", "--kills", str(kills), "--scenarios", "sigkill",
         "--workdir", str(tmp_path), "--pg-root", str(pg_server.root), "--maria-root", str(maria_server.root),
         "--seed", "3", "--tag", f"rk{mode}", "--json", str(out), *(["--llr"] if mode == "llr" else [])],
        capture_output=True, text=True, timeout=900,
    )
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["violations"] == 0, json.dumps(summary["violation_records"], indent=1)[:5000]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert summary["kills"] == kills
    assert summary["per_pair"] == {"pg+pg": kills // 3, "pg+maria": kills // 3, "maria+maria": kills // 3}
    assert summary["prepared_left"] == {"pg+pg": [], "pg+maria": [], "maria+maria": []}
    outcomes = summary["per_scenario"]["sigkill"]
    # the random moments fell on both sides of the commit decision, so both kinds of recovery were exercised
    assert outcomes.get("committed", 0) > 5 and outcomes.get("rolled back", 0) > 5, outcomes
    assert set(summary["routes"]) == {"cli", "auto"}
    assert all(n > 0 for n in summary["transfers_acknowledged"].values())

    for pair in ("pg_pg", "pg_maria", "maria_maria"):
        config = load_config(tmp_path / f"{pair}.toml")
        check = check_pair(config.resources["a"], config.resources["b"], config.node_id)
        assert check.violations == [] and check.prepared == []
        assert len(check.ledger_a) >= summary["transfers_acknowledged"][pair.replace("_", "+")]
