"""Logging Last Resource on real databases: the decision is the last branch's own COMMIT.

Each failure case of the coordinator's table is reproduced: a no vote, the last COMMIT refused by the
database, the connection lost during that COMMIT (before and after it landed), phase 2 failing after the
decision; and recovery reading the decision tables (found, absent, unreadable).
"""

from __future__ import annotations

import pytest
import sqlalchemy
from sqlalchemy import text

import qtp
from qtp.coordinator import Outcome
from qtp.errors import ConfigurationError, OutcomeUnknownError, ResourceUnavailableError, RollbackError
from qtp.xa import MemoryResource
from qtp.xa._sql import DECISION_TABLE

from test_coordinator import (  # noqa: F401 - pair is a fixture
    BALANCE, balances, enlist, pair, prepared_left, sent, transfer, two_branches,
)


@pytest.fixture
def tm(tmp_path):
    manager = qtp.TransactionManager(node_id="llr-node", log_dir=tmp_path / "logs", recovery_interval=None)
    yield manager
    manager.close()


def decision_rows(engine: sqlalchemy.Engine) -> list[str]:
    with engine.connect() as conn:
        try:
            return [row[0] for row in conn.execute(text(f"SELECT gtrid FROM {DECISION_TABLE}"))]
        except sqlalchemy.exc.ProgrammingError:
            return []  # the table was never created: no decision was ever made here


def restart(tm, *engines, names=("a", "b")):
    """A fresh manager of the same node (the old one closed), with the same resources; runs its start-up pass."""
    tm.close()
    again = qtp.TransactionManager("llr-node", tm.log_dir.parent, recovery_interval=None)
    for name, engine in zip(names, engines):
        again.add_resource(name, engine.url)
    report = again.start_recovery()
    return again, report


def test_the_last_branch_commits_the_decision_and_the_log_is_not_forced(tm, pair):
    a, b = enlist(tm, *pair)
    with tm.transaction() as tx:
        transfer(tx, 10)
        tx.connection("b").execute(text("UPDATE accounts SET balance = balance WHERE id = 2"))  # b is busier
    assert tx.outcome is Outcome.COMMITTED
    assert balances(a)[1] == BALANCE - 10 and balances(b)[1] == BALANCE + 10
    counts_a, counts_b = sent(tm, "a"), sent(tm, "b")
    assert counts_b.get("prepare", 0) == 0 and counts_b["commit_one_phase"] == 1 and counts_b["write_decision"] == 1
    assert counts_a["prepare"] == 1 and counts_a["commit"] == 1 and "write_decision" not in counts_a
    assert tm.log.forced_records == 0 and tm.log.fsyncs == 0  # no file-log write at all
    assert decision_rows(b) == [tx.xid]  # until the batch deletes it
    tm.forget_now()
    assert decision_rows(b) == []
    assert prepared_left(a) == prepared_left(b) == 0


def test_which_branch_is_last(tm, pg_db, maria_db):
    """The configured preference wins; otherwise the branch that ran most statements; memory never."""
    a, b = two_branches(tm, pg_db, maria_db, last_resource=True)
    tm.add_resource("m", MemoryResource("m", "llr-node"))
    with tm.transaction() as tx:
        for _ in range(3):
            tx.connection("a").execute(text("UPDATE accounts SET balance = balance + 1 WHERE id = 1"))
        tx.connection("b").execute(text("UPDATE accounts SET balance = balance + 1 WHERE id = 1"))
        tx.connection("m").put("k", 1)
        branches = tx.branches
        assert tm.last_resource_of(branches).name == "b"
        tm._preferred_last.clear()
        assert tm.last_resource_of(branches).name == "a"  # three statements against one
        assert tm.last_resource_of([branches[2]]) is None
    with pytest.raises(ConfigurationError, match="only a SQL database"):
        tm.add_resource("m2", MemoryResource("m2", "llr-node"), last_resource=True)


def test_memory_branches_only_use_the_file_log(tm):
    tm.add_resource("m1", MemoryResource("m1", "llr-node"))
    tm.add_resource("m2", MemoryResource("m2", "llr-node"))
    with tm.transaction() as tx:
        tx.connection("m1").put(1, 1)
        tx.connection("m2").put(1, 1)
    assert tx.outcome is Outcome.COMMITTED and tm.log.forced_records == 1


def test_a_no_vote_rolls_back_every_branch_the_last_included(tm, pg_db):
    a, b = two_branches(tm, pg_db, last_resource=True)
    with pytest.raises(RollbackError, match="voted no"):
        with tm.transaction() as tx:
            transfer(tx, 10)
            tx.connection("a").execute(text("CREATE TEMPORARY TABLE scratch (x int)"))  # cannot be prepared
    assert tx.outcome is Outcome.ROLLED_BACK
    assert balances(a)[1] == BALANCE and balances(b)[1] == BALANCE
    assert decision_rows(b) == [] and prepared_left(a) == 0


def test_the_last_commit_refused_rolls_back_the_prepared_branches(tm, pg_db):
    """A deferred constraint fails at the last branch's COMMIT: the database answered, nothing committed
    there, so the prepared branch is rolled back."""
    a, b = two_branches(tm, pg_db, last_resource=True)
    with b.begin() as conn:
        conn.execute(text("CREATE TABLE uniq (k int, CONSTRAINT u UNIQUE (k) DEFERRABLE INITIALLY DEFERRED)"))
        conn.execute(text("INSERT INTO uniq VALUES (1)"))
    with pytest.raises(RollbackError, match="refused to commit"):
        with tm.transaction() as tx:
            transfer(tx, 10)
            tx.connection("b").execute(text("INSERT INTO uniq VALUES (1)"))  # checked at COMMIT
    assert tx.outcome is Outcome.ROLLED_BACK
    assert balances(a)[1] == BALANCE and balances(b)[1] == BALANCE
    assert prepared_left(a) == 0 and decision_rows(b) == []


@pytest.mark.parametrize("landed", [False, True])
def test_a_connection_lost_during_the_last_commit_is_unknown_until_recovery(tm, pg_db, landed):
    """The connection to the last resource breaks during its COMMIT: qtp cannot know, and says so. Recovery
    then finds the decision row (the COMMIT landed: commit the prepared branch) or not (presumed abort)."""
    a, b = two_branches(tm, pg_db, last_resource=True)
    last = tm.resource("b")
    real = last._xa_commit_one_phase

    def commit_then_lose_reply(raw, xid):
        if landed:
            real(raw, xid)
            raise ResourceUnavailableError("injected: the reply to COMMIT was lost")
        pid = raw.get_backend_pid()
        with b.connect() as killer:
            killer.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})
        real(raw, xid)  # the server is gone: raises

    last._xa_commit_one_phase = commit_then_lose_reply
    with pytest.raises(OutcomeUnknownError, match="decision table"):
        with tm.transaction() as tx:
            transfer(tx, 10)
    assert tx.outcome is Outcome.UNKNOWN
    assert prepared_left(a) == 1  # held for recovery, never guessed
    again, report = restart(tm, a, b)
    try:
        assert report.ok, report.reasons()
        moved = 10 if landed else 0
        assert balances(a)[1] == BALANCE - moved and balances(b)[1] == BALANCE + moved
        assert (report.committed, report.rolled_back) == ((1, 0) if landed else (0, 1))
        assert prepared_left(a) == 0 and decision_rows(b) == []  # a found row is deleted once a committed
    finally:
        again.close()


def test_phase_two_failure_after_the_decision_is_committed_pending(tm, pg_db):
    a, b = two_branches(tm, pg_db, last_resource=True)
    prepared = tm.resource("a")
    real, calls = prepared._xa_commit, []

    def fail_once(raw, xid):
        calls.append(xid)
        if len(calls) == 1:
            raise ResourceUnavailableError("injected: database unreachable in phase 2")
        real(raw, xid)

    prepared._xa_commit = fail_once
    with tm.transaction() as tx:
        transfer(tx, 10)
    assert tx.outcome is Outcome.COMMITTED_PENDING and tx.pending == ["a"]
    tm.wait_retries()
    assert balances(a)[1] == BALANCE - 10 and balances(b)[1] == BALANCE + 10 and prepared_left(a) == 0
    tm.forget_now()
    assert decision_rows(b) == []


def test_recovery_never_presumes_abort_while_a_decision_table_is_unreadable(tm, pg_db):
    """A prepared branch with no decision in the file log: its decision may be a row in a database that is
    down. Recovery leaves it in doubt and says why; once the database is back it decides."""
    a, b = two_branches(tm, pg_db, last_resource=True)
    last = tm.resource("b")
    last._xa_commit_one_phase = lambda raw, xid: (_ for _ in ()).throw(ResourceUnavailableError("injected"))
    with pytest.raises(OutcomeUnknownError):
        with tm.transaction() as tx:
            transfer(tx, 10)
    tm.close()
    again = qtp.TransactionManager("llr-node", tm.log_dir.parent, recovery_interval=None)
    again.add_resource("a", a.url)
    again.add_resource("b", "postgresql://postgres@127.0.0.1:1/nowhere", connect_args={"connect_timeout": 1})
    try:
        report = again.start_recovery()
        assert not report.ok and report.rolled_back == 0 and prepared_left(a) == 1
        assert any("decision table" in r.problem for r in report.problems if r.problem), report.reasons()
    finally:
        again.close()
    third, report = restart(again, a, b)
    try:
        assert report.ok and report.rolled_back == 1 and prepared_left(a) == 0  # no row: presumed abort
        assert balances(a)[1] == BALANCE and balances(b)[1] == BALANCE
    finally:
        third.close()


def test_llr_can_be_turned_off(tmp_path, pg_db):
    manager = qtp.TransactionManager("llr-off", tmp_path, recovery_interval=None, llr=False)
    try:
        a, b = two_branches(manager, pg_db)
        with manager.transaction() as tx:
            transfer(tx, 1)
        assert manager.log.forced_records == 1 and sent(manager, "b")["prepare"] == 1
        assert decision_rows(a) == decision_rows(b) == []
    finally:
        manager.close()


def test_configuration_names_the_last_resource(tmp_path, pg_db, maria_db):
    a, b = pg_db("a"), maria_db("b")
    config = tmp_path / "qtp.toml"
    config.write_text(f'[node]\nid = "cfg"\nlog_dir = "logs"\nllr = true\n\n[resources.a]\nurl = "{a}"\n\n'
                      f'[resources.b]\nurl = "{b}"\nlast_resource = true\n\n[recovery]\ninterval = 0\n')
    manager = qtp.TransactionManager.from_config(config)
    try:
        assert manager.llr and [id(manager.resource("b"))] == list(manager._preferred_last)
    finally:
        manager.close()
    config.write_text(f'[node]\nid = "cfg"\n\n[resources.a]\nurl = "{a}"\nlast_resource = "yes"\n')
    with pytest.raises(ConfigurationError, match="last_resource = true.false"):
        qtp.TransactionManager.from_config(config)


def test_an_interrupt_during_the_last_commit_is_unknown_and_recovery_finds_the_row(tm, pg_db):
    """Ctrl-C while the last COMMIT is on its way (here: it landed): never rolled back, never guessed."""
    a, b = two_branches(tm, pg_db, last_resource=True)
    last = tm.resource("b")
    real = last._xa_commit_one_phase

    def commit_then_interrupt(raw, xid):
        real(raw, xid)
        raise KeyboardInterrupt("injected after the COMMIT landed")

    last._xa_commit_one_phase = commit_then_interrupt
    with pytest.raises(KeyboardInterrupt):
        with tm.transaction() as tx:
            transfer(tx, 10)
    assert tx.outcome is Outcome.UNKNOWN and prepared_left(a) == 1
    again, report = restart(tm, a, b)
    try:
        assert report.ok and report.committed == 1
        assert balances(a)[1] == BALANCE - 10 and balances(b)[1] == BALANCE + 10
    finally:
        again.close()
