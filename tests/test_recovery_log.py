"""Recovery and a damaged or missing decision log, after a real crash over PostgreSQL + MariaDB.

- a torn tail (the last write cut short) is ignored, and the decision before it is honoured;
- a damaged record in the middle makes ``qtp recover`` and the next manager refuse, naming file and
  offset, and touch nothing;
- a missing log directory with in-doubt branches is reported as such, and the branches are left in doubt
  by ``qtp recover`` and quarantined by the next manager, never rolled back blindly.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import struct

import pytest

from qtp.coordinator import read_log
from qtp.recovery import QUARANTINE_FILE
from qtp.testing.crash_workload import check_pair, drain, setup_database, write_config

from zygote import qtp_command, shared

_n = itertools.count()


class CrashedNode:
    """A PG+MariaDB node whose child died right after forcing the decision of its second transfer."""

    def __init__(self, pg_server, maria_server, tmp):
        tag = f"lg{next(_n)}"
        self.urls = [pg_server.create_database(f"{tag}_a"), maria_server.create_database(f"{tag}_b")]
        for url in self.urls:
            setup_database(url)
        self.node_id = f"{tag}-node"
        self.log_dir = tmp / "logs" / self.node_id
        self.config = write_config(tmp / f"{tag}.toml", self.node_id, tmp / "logs", *self.urls)
        code, lines = self.child("after_decision_forced=crash@2")
        assert code == -9, lines
        self.tid = [line[2:] for line in lines if line.startswith("T ")][-1]
        self.done = {line[2:] for line in lines if line.startswith("D ")}
        for url in self.urls:
            drain(url)
        assert len(self.prepared()) == 2

    def child(self, failpoints: str | None = None, transfers: int = 4) -> tuple[int, list[str]]:
        env = {k: v for k, v in os.environ.items() if k != "QTP_FAILPOINTS"}
        if failpoints:
            env["QTP_FAILPOINTS"] = failpoints
        proc = shared().run("qtp.testing.crash_child", "--config", str(self.config), "--transfers", str(transfers),
                            env=env)
        return proc.returncode, proc.stdout.splitlines() + proc.stderr.splitlines()

    def qtp(self, *args: str):
        return qtp_command(*args, "--config", self.config)

    def prepared(self) -> list[str]:
        return check_pair(*self.urls, self.node_id, update=False).prepared

    def assert_recovered(self) -> None:
        check = check_pair(*self.urls, self.node_id, self.done)
        assert check.violations == [] and check.prepared == []
        assert check.committed(self.tid), "the transfer whose decision was forced is committed"


@pytest.fixture
def crashed(pg_server, maria_server, tmp_path):
    return CrashedNode(pg_server, maria_server, tmp_path)


def test_a_torn_tail_is_ignored(crashed):
    segment = read_log(crashed.log_dir).segments[-1]
    with open(segment, "ab") as f:  # a record whose write the crash cut short
        f.write(struct.pack("<II", 200, 12345) + b"\x01{\"gtrid\":")
    status = json.loads(crashed.qtp("status", "--json").stdout)
    assert status["torn_tail"] and str(segment) in status["torn_tail"]

    proc = crashed.qtp("recover", "--json")

    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(proc.stdout)["committed"] == 2
    crashed.assert_recovered()
    assert read_log(crashed.log_dir).torn_tail is None, "the tail was cut off before appending"


def test_a_damaged_record_in_the_middle_stops_recovery_and_names_file_and_offset(crashed):
    segment = read_log(crashed.log_dir).segments[-1]
    data = bytearray(segment.read_bytes())
    first_length = struct.unpack_from("<I", data, 0)[0]
    offset = 8 + first_length  # the second record: the first transfer's COMMIT, followed by others
    data[offset + 8 + 5] ^= 0xFF
    segment.write_bytes(bytes(data))

    proc = crashed.qtp("recover")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"{segment} is damaged at offset {offset}" in proc.stderr and "checksum" in proc.stderr
    code, lines = crashed.child(transfers=0)  # the next manager refuses to start on it
    assert code != 0 and any(f"damaged at offset {offset}" in line for line in lines)
    assert len(crashed.prepared()) == 2, "nothing was guessed"

    data[offset + 8 + 5] ^= 0xFF  # the operator restores the file
    segment.write_bytes(bytes(data))
    assert crashed.qtp("recover").returncode == 0
    crashed.assert_recovered()


def test_a_missing_log_is_reported_and_its_branches_are_not_rolled_back(crashed, tmp_path):
    backup = tmp_path / "log-backup"
    shutil.move(crashed.log_dir, backup)

    proc = crashed.qtp("recover", "--json")
    assert proc.returncode == 1
    report = json.loads(proc.stdout)
    assert {row["problem"] for row in report["rows"]} == {"decision log missing"}
    assert any("decision log directory is missing" in reason for reason in report["reasons"])
    assert not crashed.log_dir.exists() and len(crashed.prepared()) == 2
    status = crashed.qtp("status")
    assert "log: missing" in status.stdout and "is missing: restore it" in status.stdout

    code, lines = crashed.child(transfers=0)  # a manager started on the missing log quarantines them
    assert code == 0, lines
    ready = json.loads(lines[0][len("READY "):])
    assert not ready["ok"] and any("quarantined" in reason for reason in ready["reasons"])
    assert len(crashed.prepared()) == 2
    assert len((crashed.log_dir / QUARANTINE_FILE).read_text().splitlines()) == 2
    assert crashed.qtp("recover").returncode == 1, "qtp recover leaves quarantined branches alone too"

    shutil.rmtree(crashed.log_dir)  # the operator restores the log from the backup
    shutil.move(backup, crashed.log_dir)
    proc = crashed.qtp("recover")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    crashed.assert_recovered()
