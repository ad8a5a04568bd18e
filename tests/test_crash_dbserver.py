"""Database crashes during phase 2: kill -9 the PostgreSQL postmaster, and separately mariadbd, after the
commit decision is durable and before that database's branch is committed; restart it; recover.

Each test runs its own throw-away server (so killing it disturbs no other test) next to the session's
server of the other kind. The PostgreSQL case is recovered with ``qtp recover`` after the application is
gone; the MariaDB case by the application's own manager, which keeps retrying phase 2 and finishes once
the server is back.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from qtp.coordinator import read_log
from qtp.testing.crash_workload import check_pair, drain, prepared_branches, engine, setup_database, write_config

from zygote import qtp_command


class Child:
    """The application: transfers with a pause after the decision of its second transfer."""

    def __init__(self, config, node_log):
        env = {**os.environ, "QTP_FAILPOINTS": "after_decision_forced=delay:2000@2"}
        self.proc = subprocess.Popen([sys.executable, "-m", "qtp.testing.crash_child", "--config", str(config),
                                      "--transfers", "3"], stdout=subprocess.PIPE, text=True, env=env)
        self.node_log = node_log
        self.lines: list[str] = []

    def wait_for_second_decision(self) -> None:
        """Records: checkpoint, COMMIT 1, then END 1 + COMMIT 2 in one forced write."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.node_log.exists() and read_log(self.node_log).records >= 4:
                return
            time.sleep(0.01)
        raise AssertionError("the second decision was never forced")

    def finish(self, timeout: float) -> int:
        out, _ = self.proc.communicate(timeout=timeout)
        self.lines = out.splitlines()
        return self.proc.returncode

    def tids(self, kind: str) -> list[str]:
        return [line[2:].split()[0] for line in self.lines if line.startswith(kind + " ")]


def _setup(tmp_path, url_a, url_b, node_id):
    for url in (url_a, url_b):
        setup_database(url)
    config = write_config(tmp_path / "node.toml", node_id, tmp_path / "logs", url_a, url_b)
    return config, tmp_path / "logs" / node_id


def test_postgres_killed_during_phase_two_then_qtp_recover(own_pg, maria_server, tmp_path):
    url_a, url_b = own_pg.create_database("phase2"), maria_server.create_database("dbcrash_pg_b")
    config, node_log = _setup(tmp_path, url_a, url_b, "dbcrash-pg")
    child = Child(config, node_log)
    child.wait_for_second_decision()
    own_pg.kill()  # the decision is durable; PostgreSQL's branch is prepared, not yet committed
    assert not own_pg.running()
    time.sleep(2.5)  # phase 2 runs: MariaDB's branch commits, PostgreSQL's cannot
    child.proc.kill()  # the application gives up too
    child.finish(timeout=30)
    started, done = child.tids("T"), child.tids("D")
    assert len(started) >= 2
    drain(url_b)

    own_pg.start()  # crash recovery of PostgreSQL keeps the prepared branch
    pg = engine(url_a)
    with pg.connect() as conn:
        assert len(prepared_branches(conn, url_a, None)) == 1
    pg.dispose()
    proc = qtp_command("recover", "--config", config)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "committed" in proc.stdout

    check = check_pair(url_a, url_b, "dbcrash-pg", set(done), set(started))
    assert check.violations == [] and check.prepared == []
    assert check.committed(started[1]), "the second transfer was decided before the crash"
    pg = engine(url_a)
    with pg.connect() as conn:
        assert prepared_branches(conn, url_a, None) == []  # the whole database, not only this node's
    pg.dispose()


def test_mariadb_killed_during_phase_two_then_the_live_manager_finishes(pg_server, own_maria, tmp_path):
    url_a, url_b = pg_server.create_database("dbcrash_maria_a"), own_maria.create_database("phase2")
    config, node_log = _setup(tmp_path, url_a, url_b, "dbcrash-maria")
    child = Child(config, node_log)
    child.wait_for_second_decision()
    own_maria.kill()
    time.sleep(2.5)  # phase 2 runs against a dead MariaDB: the transfer is "committed, branches pending"
    own_maria.start()  # InnoDB recovers the prepared XA branch; the manager's phase-2 retry commits it
    code = child.finish(timeout=120)
    assert code == 0, child.lines
    started, done = child.tids("T"), child.tids("D")
    assert started[1] in done, "commit returned (with a branch pending) for the decided transfer"

    check = check_pair(url_a, url_b, "dbcrash-maria", set(done), set(started))
    assert check.violations == [] and check.prepared == []
    assert check.committed(started[1])
    maria = engine(url_b)
    with maria.connect() as conn:
        assert prepared_branches(conn, url_b, None) == []  # XA RECOVER on the whole server
    maria.dispose()
    proc = qtp_command("recover", "--config", config)
    assert proc.returncode == 0 and "no in-doubt branches and no open decisions" in proc.stdout, proc.stdout
