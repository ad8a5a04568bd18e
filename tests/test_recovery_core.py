"""Recovery's decisions, on the in-memory resource (a real transactional store) and on the real databases.

Commit what the log decided, roll back the rest, write END records, leave alone what is in flight, another
node's or hand-made; report instead of guessing when the log cannot say (missing log, unknown resource,
branch the decision does not list, unreachable database); refuse to act beside a live manager.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time

import psycopg2
import pymysql
import pytest
from sqlalchemy.engine import make_url

from qtp.config import load_config
from qtp.coordinator import DecisionLog, TransactionManager, failpoints, read_log
from qtp.embedded import free_port
from qtp.recovery import QUARANTINE_FILE, read_quarantine, recover_node
from qtp.recovery._core import HEURISTIC, LOG_MISSING, NOT_CONFIGURED, QUARANTINED
from qtp.testing.crash_workload import check_pair, drain, setup_database, write_config
from qtp.xa import MemoryResource, MemoryDatabase, Xid

from zygote import qtp_command, shared

_ids = itertools.count()


class MemoryNode:
    """A node over two fresh in-memory stores, with its qtp.toml."""

    def __init__(self, tmp_path, extra: str = ""):
        n = next(_ids)
        self.node_id = f"mem{n}"
        self.stores = {name: MemoryDatabase.named(f"rc{n}{name}") for name in ("x", "y")}
        self.log_root = tmp_path / "logs"
        self.log_dir = self.log_root / self.node_id
        self.config_path = tmp_path / f"{self.node_id}.toml"
        self.config_path.write_text(
            f'[node]\nid = "{self.node_id}"\nlog_dir = "{self.log_root}"\n\n'
            f'[resources.x]\nurl = "memory://rc{n}x"\n\n[resources.y]\nurl = "memory://rc{n}y"\n{extra}'
        )

    def prepare(self, gtrid: bytes, branch: str, key: str, value: int, node_id: str | None = None) -> Xid:
        """Leave a prepared branch in store ``branch``, as a crashed manager would."""
        resource = MemoryResource(branch, node_id or self.node_id, self.stores[branch])
        xid = Xid.of(gtrid, branch)
        resource.begin(xid)
        resource.connection(xid).put(key, value)
        resource.prepare(xid)
        return xid

    def decide(self, gtrid: bytes, branches: list[str]) -> None:
        log = DecisionLog(self.log_dir)
        log.log_commit(gtrid.decode(), branches)
        log.close()

    def config(self):
        return load_config(self.config_path)

    def prepared(self, branch: str) -> list[Xid]:
        return list(self.stores[branch].prepared)

    def crashed_state(self, undecided_in: str) -> bytes:
        """A decided transaction prepared on x and y (key "a") and an undecided one prepared on
        ``undecided_in`` (key "b"), as a crash after the decision leaves them; returns the decided gtrid."""
        decided, undecided = Xid.new_gtrid(self.node_id), Xid.new_gtrid(self.node_id)
        self.prepare(decided, "x", "a", 1)
        self.prepare(decided, "y", "a", 1)
        self.prepare(undecided, undecided_in, "b", 2)
        self.decide(decided, ["x", "y"])
        return decided


def test_logged_commits_are_committed_the_rest_rolled_back_and_the_log_forgets(tmp_path):
    node = MemoryNode(tmp_path)
    decided = node.crashed_state(undecided_in="x")

    report = recover_node(node.config())

    assert report.ok and (report.committed, report.rolled_back) == (2, 1)
    assert report.ended == [decided.decode()]
    assert node.stores["x"].data == {"a": 1} and node.stores["y"].data == {"a": 1}
    assert node.prepared("x") == node.prepared("y") == []
    assert read_log(node.log_dir).open == {}
    assert read_log(node.log_dir).last_checkpoint == 2, "the pass checkpointed the log"
    again = recover_node(node.config())  # idempotent: nothing left to do
    assert again.ok and again.rows == [] and again.ended == []


def test_other_nodes_and_foreign_xids_are_never_touched(tmp_path):
    node = MemoryNode(tmp_path)
    theirs = node.prepare(Xid.new_gtrid("someone-else"), "x", "k", 1, node_id="someone-else")
    handmade = Xid(4242, f"{node.node_id}/by-hand".encode(), b"x")
    store = node.stores["x"]
    store.prepared[handmade] = {"h": 1}
    node.decide(Xid.new_gtrid(node.node_id), ["x"])  # an old decision whose branch is gone

    report = recover_node(node.config())

    assert report.ok and report.committed == report.rolled_back == 0
    assert set(store.prepared) == {theirs, handmade}
    assert [r.action for r in report.rows] == ["end record"]
    assert "not verifiable" in report.rows[0].result


def test_missing_log_leaves_in_doubt_branches_alone_and_says_so(tmp_path):
    node = MemoryNode(tmp_path)
    gtrid = Xid.new_gtrid(node.node_id)
    node.prepare(gtrid, "x", "k", 1)

    report = recover_node(node.config())
    assert not report.ok
    assert [r.problem for r in report.rows] == [LOG_MISSING]
    assert any("decision log directory is missing" in reason for reason in report.reasons())
    assert len(node.prepared("x")) == 1
    assert not node.log_dir.exists(), "recovery must not create the log it found missing"

    # A manager started on the missing log quarantines the branch instead of presuming it aborted ...
    manager = TransactionManager.from_config(node.config_path)
    manager.close()
    assert len(node.prepared("x")) == 1
    assert list(read_quarantine(node.log_dir)) == [str(Xid.of(gtrid, "x"))]
    # ... and so does every later pass, until an operator resolves it and removes the file.
    later = recover_node(node.config())
    assert [r.problem for r in later.rows] == [QUARANTINED] and len(node.prepared("x")) == 1
    (node.log_dir / QUARANTINE_FILE).unlink()
    assert recover_node(node.config()).rolled_back == 1


def test_a_branch_the_decision_does_not_list_is_reported_not_resolved(tmp_path):
    node = MemoryNode(tmp_path)
    gtrid = Xid.new_gtrid(node.node_id)
    node.prepare(gtrid, "x", "k", 1)
    node.prepare(gtrid, "y", "k", 1)
    node.decide(gtrid, ["x"])

    report = recover_node(node.config())

    assert not report.ok
    problems = {r.resource: r.problem for r in report.rows}
    assert problems == {"x": None, "y": HEURISTIC}
    assert len(node.prepared("y")) == 1 and report.ended == []
    assert read_log(node.log_dir).open == {gtrid.decode(): ["x"]}, "no END while a branch is unresolved"


def test_decision_naming_an_unconfigured_resource_keeps_the_decision(tmp_path):
    node = MemoryNode(tmp_path)
    gtrid = Xid.new_gtrid(node.node_id)
    node.prepare(gtrid, "x", "k", 1)
    node.decide(gtrid, ["x", "gone"])

    report = recover_node(node.config())

    assert report.committed == 1 and not report.ok
    assert [r.problem for r in report.rows if r.problem] == [NOT_CONFIGURED]
    assert read_log(node.log_dir).open == {gtrid.decode(): ["x", "gone"]}


def test_unreachable_resource_fails_the_pass_and_names_it(tmp_path):
    node = MemoryNode(tmp_path, extra=f'\n[resources.z]\nurl = "postgresql://postgres@127.0.0.1:{free_port()}/x"\n')
    gtrid = Xid.new_gtrid(node.node_id)
    node.prepare(gtrid, "x", "k", 1)
    node.decide(gtrid, ["x", "z"])

    proc = qtp_command("recover", "--config", node.config_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "resource 'z' is unreachable" in proc.stdout and "start it or fix its URL" in proc.stdout
    assert read_log(node.log_dir).open, "the decision is kept until z can be checked"


def test_start_up_recovery_resolves_what_the_last_run_left(tmp_path):
    node = MemoryNode(tmp_path)
    node.crashed_state(undecided_in="y")

    manager = TransactionManager(node.node_id, node.log_root, recovery_interval=None)
    manager.add_resource("x", "memory://" + _store_name(node, "x"))
    manager.add_resource("y", "memory://" + _store_name(node, "y"))
    with manager.transaction() as tx:  # the first transaction starts recovery before it begins
        tx.connection("x").put("c", 3)
    manager.close()

    assert node.stores["x"].data == {"a": 1, "c": 3} and node.stores["y"].data == {"a": 1}
    assert node.prepared("x") == node.prepared("y") == [] and read_log(node.log_dir).open == {}


def _store_name(node: MemoryNode, branch: str) -> str:
    return next(k for k, v in MemoryDatabase._named.items() if v is node.stores[branch])


def test_recovery_inside_the_manager_never_touches_a_transaction_in_flight(tmp_path):
    node = MemoryNode(tmp_path)
    manager = TransactionManager(node.node_id, node.log_root, recovery_interval=None)
    manager.add_resource("x", "memory://" + _store_name(node, "x"))
    manager.add_resource("y", "memory://" + _store_name(node, "y"))
    manager.start_recovery()
    failpoints.configure("after_prepare_1=delay:600")
    try:
        def work():
            with manager.transaction() as tx:
                tx.connection("x").put("k", 1)
                tx.connection("y").put("k", 1)

        worker = threading.Thread(target=work)
        worker.start()
        deadline = time.monotonic() + 5
        while len(node.prepared("y")) == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert node.prepared("y"), "the transaction reached its vote"
        report = manager.recover()  # prepared, not yet decided: presumed abort would be wrong here
        worker.join()
    finally:
        failpoints.configure(None)
        manager.close()
    assert {r.action for r in report.rows} == {"skip (in flight)"} and report.rolled_back == 0
    assert node.stores["x"].data == {"k": 1} and node.stores["y"].data == {"k": 1}


def test_the_background_pass_acts_on_a_branch_seen_in_doubt_twice(tmp_path):
    node = MemoryNode(tmp_path)
    manager = TransactionManager(node.node_id, node.log_root, recovery_interval=0.2)
    manager.add_resource("x", "memory://" + _store_name(node, "x"))
    try:
        manager.start_recovery()
        orphan = node.prepare(Xid.new_gtrid(node.node_id), "x", "k", 1)  # as if its transaction just died
        reports = []
        deadline = time.monotonic() + 10
        while node.prepared("x") and time.monotonic() < deadline:
            time.sleep(0.05)
            if manager._recovery.last_report not in reports:
                reports.append(manager._recovery.last_report)
    finally:
        manager.close()
    assert node.prepared("x") == []
    actions = [row.action for report in reports for row in report.rows if row.xid == str(orphan)]
    assert actions[0] == "wait (second pass)" and actions[-1] == "rollback"


# ---------------------------------------------------------------------------------------------- real databases


def _write_config(path, node_id, log_root, urls, extra=""):
    body = "".join(f'[resources.{name}]\nurl = "{url}"\n\n' for name, url in urls.items())
    path.write_text(f'[node]\nid = "{node_id}"\nlog_dir = "{log_root}"\n\n{body}{extra}')
    return path


def test_hand_made_and_other_nodes_prepared_transactions_survive_recovery(pg_db, maria_db, tmp_path):
    pg_url, maria_url = pg_db("hm"), maria_db("hm")
    pg, my = make_url(pg_url), make_url(maria_url)
    pgc = psycopg2.connect(host=pg.host, port=pg.port, user=pg.username, dbname=pg.database)
    pgc.autocommit = True
    with pgc.cursor() as cur:
        cur.execute("CREATE TABLE t (x int)")
    other = Xid.of(Xid.new_gtrid("other-node"), "pg")
    for gid in ("handmade-1", other.to_pg_gid()):
        with pgc.cursor() as cur:
            cur.execute(f"BEGIN; INSERT INTO t VALUES (1); PREPARE TRANSACTION '{gid}'")
    myc = pymysql.connect(host=my.host, port=my.port, user=my.username, database=my.database, autocommit=True)
    other_my = Xid.of(Xid.new_gtrid("other-node"), "my")
    with myc.cursor() as cur:
        cur.execute("CREATE TABLE t (x int)")
    for xid in ("'handmade-2'", other_my.to_mysql()):
        with myc.cursor() as cur:
            cur.execute(f"XA START {xid}")
            cur.execute("INSERT INTO t VALUES (1)")
            cur.execute(f"XA END {xid}")
            cur.execute(f"XA PREPARE {xid}")
        myc.close()
        myc = pymysql.connect(host=my.host, port=my.port, user=my.username, database=my.database, autocommit=True)
    config = _write_config(tmp_path / "hm.toml", "hm-node", tmp_path / "logs", {"pg": pg_url, "my": maria_url})
    try:
        report = recover_node(load_config(config))
        assert report.ok and report.rows == []
        with pgc.cursor() as cur:
            cur.execute("SELECT gid FROM pg_prepared_xacts WHERE database = current_database()")
            assert {r[0] for r in cur.fetchall()} == {"handmade-1", other.to_pg_gid()}
        with myc.cursor() as cur:
            cur.execute("XA RECOVER")
            gtrids = {row[3][:row[1]] for row in cur.fetchall()}
        assert {b"handmade-2", other_my.gtrid} <= gtrids
    finally:
        with pgc.cursor() as cur:
            for gid in ("handmade-1", other.to_pg_gid()):
                cur.execute(f"ROLLBACK PREPARED '{gid}'")
        with myc.cursor() as cur:
            for xid in ("'handmade-2'", other_my.to_mysql()):
                cur.execute(f"XA ROLLBACK {xid}")
        pgc.close()
        myc.close()


def test_qtp_recover_refuses_beside_a_live_manager(pg_db, tmp_path):
    config = _write_config(tmp_path / "live.toml", "live-node", tmp_path / "logs", {"app": pg_db("live")})
    manager = TransactionManager.from_config(config)
    try:
        proc = qtp_command("recover", "--config", config)
        assert proc.returncode == 3, proc.stdout + proc.stderr
        assert f"pid {os.getpid()}" in proc.stderr and "qtp status" in proc.stderr
        as_json = qtp_command("recover", "--config", config, "--json")
        assert as_json.returncode == 3
        assert json.loads(as_json.stdout)["refused"].startswith("node 'live-node' is running")
        status = qtp_command("status", "--config", config, "--json")
        assert json.loads(status.stdout)["log_locked_by"] == str(os.getpid())
    finally:
        manager.close()
    proc = qtp_command("recover", "--config", config)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_status_shows_in_doubt_branches_with_their_age_and_warns_about_old_ones(pg_db, maria_db, tmp_path):
    urls = [pg_db("st"), maria_db("st")]
    for url in urls:
        setup_database(url)
    config = write_config(tmp_path / "st.toml", "st-node", tmp_path / "logs", *urls)
    config.write_text(config.read_text().replace("interval = 0", "interval = 0\nwarn_prepared_age = 0"))
    crash = shared().run("qtp.testing.crash_child", "--config", str(config),
                         env={**os.environ, "QTP_FAILPOINTS": "after_decision_forced=crash"})
    assert crash.returncode == -9
    for url in urls:
        drain(url)

    proc = qtp_command("status", "--config", config)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 open decision(s)" in proc.stdout and "VACUUM" in proc.stdout
    assert proc.stdout.count("): 1 in-doubt branch(es)") == 2
    data = json.loads(qtp_command("status", "--config", config, "--json").stdout)
    aged = data["resources"]["a"]["in_doubt"][0]
    assert aged["decision"] == "commit" and aged["age_s"] is not None and aged["age_s"] >= 0
    assert data["resources"]["b"]["in_doubt"][0]["age_s"] is None  # MariaDB does not record it
    assert data["log_present"] and data["open_decisions"] == 1 and data["log_locked_by"] is None

    dry = qtp_command("recover", "--config", config, "--dry-run", "--json")
    assert [row["result"] for row in json.loads(dry.stdout)["rows"]] == ["would commit", "would commit"]
    assert len(check_pair(*urls, "st-node", update=False).prepared) == 2, "a dry run changes nothing"
    report = recover_node(load_config(config))
    assert report.ok and report.committed == 2
    assert qtp_command("status", "--config", config).returncode == 0
    assert check_pair(*urls, "st-node").violations == []


@pytest.mark.parametrize("bad", ["interval = -1", "every = 5", 'interval = "often"'])
def test_recovery_settings_are_checked(tmp_path, bad):
    path = tmp_path / "q.toml"
    path.write_text(f'[node]\nid = "n"\n\n[recovery]\n{bad}\n')
    with pytest.raises(Exception, match=r"\[recovery\]"):
        load_config(path)


def test_a_branch_still_attached_to_a_dying_session_is_not_taken_for_resolved(maria_db, tmp_path):
    """MariaDB lists a prepared branch whose session is still connected (a client that died a moment ago)
    but answers "unknown xid" to XA COMMIT from elsewhere. Taking that for "already committed" would END the
    decision, and the branch, detached later, would then be rolled back: recovery must wait instead."""
    node = MemoryNode(tmp_path, extra="")
    url = maria_db("attached")
    node.config_path.write_text(node.config_path.read_text() + f'\n[resources.m]\nurl = "{url}"\n')
    u = make_url(url)
    session = pymysql.connect(host=u.host, port=u.port, user=u.username, database=u.database, autocommit=True)
    gtrid = Xid.new_gtrid(node.node_id)
    with session.cursor() as cur:
        cur.execute("CREATE TABLE t (x int)")
        xid = Xid.of(gtrid, "m").to_mysql()
        for statement in (f"XA START {xid}", "INSERT INTO t VALUES (1)", f"XA END {xid}", f"XA PREPARE {xid}"):
            cur.execute(statement)
    node.prepare(gtrid, "x", "k", 1)
    node.decide(gtrid, ["x", "m"])

    report = recover_node(node.config())

    assert not report.ok
    assert {r.resource: r.problem for r in report.rows} == {"x": None, "m": "resource unreachable"}
    assert read_log(node.log_dir).open == {gtrid.decode(): ["x", "m"]}, "no END while m is unresolved"
    session.close()  # the server notices the client is gone
    deadline = time.monotonic() + 10
    while not (report := recover_node(node.config())).ok and time.monotonic() < deadline:
        time.sleep(0.1)
    assert report.ok and report.ended == [gtrid.decode()]
    check = pymysql.connect(host=u.host, port=u.port, user=u.username, database=u.database)
    with check.cursor() as cur:
        cur.execute("SELECT count(*) FROM t")
        assert cur.fetchone()[0] == 1, "the decided branch committed"
    check.close()
