"""A small end-to-end crash campaign in `make test`: two node processes, 300 orders with replies, 15 SIGKILLs
covering both nodes, both database servers and the runtime's failpoints, 10 % of the HTTP traffic lost or
duplicated; the Spark reconciliation's verdict must be exactly-once for requests and replies."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from qtp.embedded import EmbeddedMariaDB, EmbeddedPostgres

# long tests (a quick run leaves them out: -m 'not slow')
pytestmark = pytest.mark.slow

CAMPAIGN = Path(__file__).resolve().parent.parent / "benchmarks" / "e2e_campaign.py"


def test_small_xa_campaign_is_exactly_once(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(CAMPAIGN), "--mode", "xa", "--messages", "300", "--kills", "15",
                           "--loss", "0.1", "--seed", "11", "--root", str(tmp_path / "db"), "--out", str(out),
                           "--drain-s", "300", "--stop-databases"], capture_output=True, text=True, timeout=1500)
    assert done.stdout.strip().splitlines()[-1] == "exactly-once", done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 0
    result = json.loads((out / "result.json").read_text())
    assert result["kills"] == 15 and all(result["victims"][v] >= 1 for v in
                                         ("client", "server", "postgresql", "mariadb", "failpoint"))
    requests_, replies = result["requests"], result["replies"]
    assert requests_["ok"] == 300 and replies["ok"] == 300, (requests_, replies)  # aborted ones: ok when absent
    assert all(requests_[c] == 0 for c in ("lost", "duplicated", "unexpected", "applied_but_aborted"))
    kills = json.loads((out / "kills.json").read_text())
    assert len(kills) == 15
    assert result["kills_in_stream"] >= 8, result  # paced: the kills hit work in flight, not a finished stream
    # the campaign's own servers are stopped, not left behind for the rest of the suite
    assert not EmbeddedPostgres(tmp_path / "db" / "pg").running()
    assert not EmbeddedMariaDB(tmp_path / "db" / "mariadb").running()


def test_small_xa_campaign_with_a_client_that_cannot_listen_is_exactly_once(tmp_path):
    """Issue 23: the client has no endpoint (the campaign checks it binds no port) and fetches its replies and
    its acknowledgements with WS-MakeConnection through the lossy proxy; kills of both nodes and both
    databases; authenticated."""
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(CAMPAIGN), "--mode", "xa", "--messages", "200", "--kills", "10",
                           "--loss", "0.1", "--seed", "23", "--no-listen", "--acks-to", "poll", "--auth", "--root", str(tmp_path / "db"),
                           "--out", str(out), "--drain-s", "300", "--stop-databases"],
                          capture_output=True, text=True, timeout=1500)
    assert "the client listens on no port" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "exactly-once", done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    assert result["requests"]["ok"] == 200 and result["replies"]["ok"] == 200, result
    assert all(result["requests"][c] == 0 and result["replies"][c] == 0 for c in ("lost", "duplicated", "unexpected"))
    assert "polls for replies as http://docs.oasis-open.org/ws-rx/wsmc/200702/anonymous?id=" in \
        (out / "client.log").read_text()
