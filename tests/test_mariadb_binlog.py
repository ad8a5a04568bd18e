"""MariaDB with the binary log on: an acknowledged one-phase XA COMMIT can come back *prepared* after the
server crashes (MDEV-31949 / MDEV-33168; qtp's own crash tests hit it), and presumed abort would then roll
an acknowledged commit back. qtp therefore never commits a branch on such a server without a logged
decision, and never makes it the last resource of a Logging Last Resource commit. A server of its own,
with the binary log on, shows both."""

from __future__ import annotations

import pytest
import sqlalchemy
from sqlalchemy import text

import qtp
from qtp.embedded import EmbeddedMariaDB

from test_coordinator import BALANCE, balances, make_accounts, sent, transfer



@pytest.fixture(scope="module")
def binlog_server(tmp_path_factory):
    server = EmbeddedMariaDB(tmp_path_factory.mktemp("mariadb-binlog"), binlog=True)
    server.start()
    yield server
    server.destroy()


@pytest.fixture
def tm(tmp_path):
    manager = qtp.TransactionManager("binlog-node", tmp_path / "logs", recovery_interval=None)
    yield manager
    manager.close()


def test_the_server_really_has_its_binary_log_on(binlog_server):
    engine = sqlalchemy.create_engine(binlog_server.create_database("probe"))
    with engine.connect() as conn:
        assert conn.execute(text("SELECT @@log_bin")).scalar() == 1
    engine.dispose()


def test_a_single_branch_is_prepared_and_its_decision_logged(tm, binlog_server):
    engine = make_accounts(binlog_server.create_database("single"))
    tm.add_resource("m", engine.url)
    with tm.transaction() as tx:
        tx.connection("m").execute(text("UPDATE accounts SET balance = balance - 5 WHERE id = 1"))
    assert tx.outcome is qtp.Outcome.COMMITTED and balances(engine)[1] == BALANCE - 5
    counts = sent(tm, "m")
    assert counts["prepare"] == 1 and counts["commit"] == 1 and "commit_one_phase" not in counts
    assert tm.log.forced_records == 1
    assert tm.resource("m").one_phase_safe is False


def test_it_is_never_the_last_resource(tm, binlog_server, pg_db):
    maria = make_accounts(binlog_server.create_database("pair"))
    pg = make_accounts(pg_db("pg"))
    tm.add_resource("a", maria.url, last_resource=True)  # preferred, but unsafe once qtp knows the server
    tm.add_resource("b", pg.url)
    with tm.transaction() as tx:
        transfer(tx, 10)
    assert balances(maria)[1] == BALANCE - 10 and balances(pg)[1] == BALANCE + 10
    assert sent(tm, "a")["prepare"] == 1 and "write_decision" not in sent(tm, "a")
    assert sent(tm, "b")["write_decision"] == 1 and sent(tm, "b")["commit_one_phase"] == 1
