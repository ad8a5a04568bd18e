"""The failpoint matrix: every failpoint x {PG+PG, PG+MariaDB, MariaDB+MariaDB} x {qtp recover, next start},
once with the file decision log and once with Logging Last Resource (its own failpoints around the last
branch's COMMIT).

A child process (``python -m qtp.testing.crash_child``, failpoints from ``QTP_FAILPOINTS``; forked from the
session's zygote, an interpreter that imported qtp once) runs transfers and dies at the failpoint (``crash`` =
SIGKILL to itself). Recovery then runs through the real ``qtp recover`` command (a fork of the zygote too), or
automatically when the next manager starts. Afterwards: money is conserved, no transfer is half-applied,
every acknowledged transfer is there, the crashed transfer went the way its failpoint forces (rolled back
before the decision, committed after it), nothing of the node is prepared, and every row can be updated at
once.
"""

from __future__ import annotations

import itertools
import json
import os

import pytest

from qtp.testing.crash_campaign import EXPECTED, FAILPOINT_SCENARIOS, LLR_FAILPOINT_SCENARIOS, decision_point
from qtp.testing.crash_workload import check_pair, drain, setup_database, write_config

from zygote import shared


PAIRS = ("pg+pg", "pg+maria", "maria+maria")
MODES = ("log", "llr")
SCENARIOS = [("log", point) for point in FAILPOINT_SCENARIOS] + [("llr", point) for point in LLR_FAILPOINT_SCENARIOS]
_names = itertools.count()


class Node:
    """A pair of databases and the qtp.toml of the node that transfers between them."""

    def __init__(self, pair, mode, pg_server, maria_server, tmp):
        servers = {"pg": pg_server, "maria": maria_server}
        self.llr = mode == "llr"
        tag = f"mx{next(_names)}_{mode}_{pair.replace('+', '_')}"
        self.urls = [servers[kind].create_database(f"{tag}_{side}") for kind, side in zip(pair.split("+"), "ab")]
        for url in self.urls:
            setup_database(url)
        self.node_id = tag.replace("_", "-")
        self.config = write_config(tmp / f"{tag}.toml", self.node_id, tmp / "logs", *self.urls, llr=self.llr)
        self.done: set[str] = set()
        self.started: set[str] = set()

    def _env(self, failpoints: str | None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "QTP_FAILPOINTS"}
        return {**env, "QTP_FAILPOINTS": failpoints} if failpoints else env

    def child(self, failpoints: str | None, transfers: int) -> tuple[int, list[str]]:
        proc = shared().run("qtp.testing.crash_child", "--config", str(self.config), "--transfers", str(transfers),
                               env=self._env(failpoints))
        lines = proc.stdout.splitlines()
        self.started |= {line[2:] for line in lines if line.startswith("T ")}
        self.done |= {line[2:] for line in lines if line.startswith("D ")}
        return proc.returncode, lines

    def qtp(self, *args: str, failpoints: str | None = None):
        return shared().run("qtp", *args, "--config", str(self.config), env=self._env(failpoints))

    def drain(self):
        for url in self.urls:
            drain(url)

    def check(self, update: bool = True):
        return check_pair(*self.urls, self.node_id, self.done, self.started, update=update)


@pytest.fixture(scope="module")
def nodes(pg_server, maria_server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("matrix")
    return {(pair, mode): Node(pair, mode, pg_server, maria_server, tmp) for pair in PAIRS for mode in MODES}


def _crash(node: Node, failpoint: str) -> str | None:
    """Run transfers until the failpoint kills the child; return the transfer it was in the middle of."""
    point = decision_point(node.llr) if failpoint == "recovery_after_action" else failpoint
    code, lines = node.child(f"{point}=crash@2", transfers=6)
    assert code == -9, f"the child should have died at {point}: exit {code}, output {lines[-5:]}"
    started = [line[2:] for line in lines if line.startswith("T ")]
    assert len(started) == 2 and started[-1] not in node.done, lines
    node.drain()
    return started[-1]


@pytest.mark.parametrize("route", ["cli", "auto"])
@pytest.mark.parametrize("mode, failpoint", SCENARIOS)
@pytest.mark.parametrize("pair", PAIRS)
def test_crash_at_failpoint_then_recover(nodes, pair, mode, failpoint, route):
    node = nodes[pair, mode]
    tid = _crash(node, failpoint)
    before = node.check(update=False)
    if failpoint.startswith(("after_prepare", "llr_")) or failpoint in ("after_decision_forced",
                                                                      "recovery_after_action"):
        assert before.prepared, "a crash between a yes vote and phase 2 leaves branches in doubt"

    if failpoint == "recovery_after_action":  # recovery itself dies after its first action
        if route == "cli":
            died = node.qtp("recover", failpoints="recovery_after_action=crash")
            assert died.returncode == -9, died.stdout + died.stderr
        else:
            code, _ = node.child("recovery_after_action=crash", transfers=0)
            assert code == -9
        node.drain()
        # the two actions run in parallel: the first to finish kills the pass, the other may have finished too
        before = node.check(update=False)
        assert len(before.prepared) <= 1, "the first action of the dead pass took effect"

    if route == "cli":
        proc = node.qtp("recover", "--json")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        report = json.loads(proc.stdout)
    else:
        code, lines = node.child(None, transfers=0)
        assert code == 0, lines
        report = json.loads(lines[0][len("READY "):])
    assert report["ok"], report
    expected = EXPECTED[failpoint]
    if expected == "rolled back":
        assert report["committed"] == 0 and report["rolled_back"] == len(before.prepared)
    else:
        assert report["rolled_back"] == 0 and report["committed"] == len(before.prepared)
        if failpoint == decision_point(node.llr):
            assert len(before.prepared) == (1 if node.llr else 2)  # LLR: the last branch committed itself

    after = node.check()
    assert after.violations == []
    assert after.prepared == []
    assert after.update_s < 1.0
    assert ("committed" if after.committed(tid) else "rolled back") == expected
    assert tid not in after.ledger_a ^ after.ledger_b


def test_transfers_still_work_after_the_matrix(nodes):
    """The nodes, their logs and their databases are healthy after all those crashes."""
    for node in nodes.values():  # both modes: LLR decision rows are deleted like END records
        code, lines = node.child(None, transfers=3)
        assert code == 0 and sum(line.startswith("D ") for line in lines) == 3, lines
        status = node.qtp("status", "--json")
        assert status.returncode == 0, status.stdout + status.stderr
        data = json.loads(status.stdout)
        assert data["open_decisions"] == 0 and data["last_resource_decisions"] == 0
        assert node.check().violations == []
