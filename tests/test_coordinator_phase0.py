"""The coordinator's hooks for coupled transactions: before_commit (Phase 0), on_rollback, and a transaction
ended as a prepared subordinate of another node's transaction (real PostgreSQL and MariaDB)."""

from __future__ import annotations

import pytest
from sqlalchemy import text

import qtp
from qtp.coordinator import Outcome
from qtp.errors import RollbackError, TransactionStateError
from qtp.xa import Xid
from test_coordinator import BALANCE, balances, enlist, make_accounts, prepared_left, transfer, tm  # noqa: F401


def held(engine) -> int:
    """Prepared branches left: this database's (PostgreSQL), or subordinates of test-node (MariaDB's list is
    the whole server's)."""
    if engine.dialect.name == "postgresql":
        return prepared_left(engine)
    with engine.connect() as conn:
        return sum(b"test-node~c/" in bytes(row[3]) for row in conn.execute(text("XA RECOVER")).all())


def test_before_commit_runs_in_the_transaction_and_can_refuse_it(tm, pg_db, maria_db):
    a, b = enlist(tm, make_accounts(pg_db("a")), make_accounts(maria_db("b")))
    seen = []
    with qtp.transaction() as tx:
        transfer(tx, 5)
        tx.before_commit(lambda t: t.connection("b").execute(text("UPDATE accounts SET balance = balance + 1 "
                                                                  "WHERE id = 1")))
        tx.on_rollback(lambda: seen.append("rolled back"))
    assert tx.outcome is Outcome.COMMITTED and seen == []
    assert balances(a)[1] == BALANCE - 5 and balances(b)[1] == BALANCE + 6

    def refuse(t):
        raise ValueError("the condition is not met")

    with pytest.raises(RollbackError, match="condition is not met"):
        with qtp.transaction() as tx:
            transfer(tx, 7)
            tx.before_commit(refuse)
            tx.on_rollback(lambda: seen.append("rolled back"))
    assert tx.outcome is Outcome.ROLLED_BACK and seen == ["rolled back"]
    assert balances(a)[1] == BALANCE - 5 and balances(b)[1] == BALANCE + 6
    assert prepared_left(a) == prepared_left(b) == 0
    with pytest.raises(RuntimeError):  # the application's own exception: on_rollback runs too
        with qtp.transaction() as tx:
            tx.on_rollback(lambda: seen.append("again"))
            raise RuntimeError("app")
    assert seen == ["rolled back", "again"]


def test_a_subordinate_stays_prepared_past_the_nodes_own_recovery_until_resolved_by_xid(tm, pg_db, maria_db):
    a, b = enlist(tm, make_accounts(pg_db("a")), make_accounts(maria_db("b")))
    gtrid = b"test-node~c/" + b"1" * 30
    tx = tm.begin(gtrid=gtrid)
    transfer(tx, 3)
    prepared = tx.prepare_subordinate()
    assert sorted(prepared) == ["a", "b"] and tx.outcome is Outcome.UNKNOWN
    assert held(a) == held(b) == 1
    tm.recover()  # the node's recovery presumes abort for its own in-doubt branches: these are not its own
    assert held(a) == held(b) == 1
    assert balances(a)[1] == BALANCE
    for name in prepared:
        tm.resource(name).commit(Xid.of(gtrid, name))
        tm.resource(name).commit(Xid.of(gtrid, name))  # idempotent: a retried decision is harmless
    assert held(a) == held(b) == 0
    assert balances(a)[1] == BALANCE - 3 and balances(b)[1] == BALANCE + 3


def test_a_subordinate_that_votes_no_rolls_back_and_one_with_the_nodes_gtrid_is_refused(tm, pg_db, maria_db):
    a, b = enlist(tm, make_accounts(pg_db("a")), make_accounts(maria_db("b")))
    tx = tm.begin(gtrid=b"test-node~c/" + b"2" * 30)
    transfer(tx, 3)
    tx.before_commit(lambda t: (_ for _ in ()).throw(ValueError("the handler's last check failed")))
    with pytest.raises(RollbackError, match="last check failed"):
        tx.prepare_subordinate()
    assert tx.outcome is Outcome.ROLLED_BACK and held(a) == held(b) == 0
    own = tm.begin()
    transfer(own, 1)
    with pytest.raises(TransactionStateError, match="subordinate gtrid"):
        own.prepare_subordinate()
    own.rollback()
    assert balances(a)[1] == BALANCE and balances(b)[1] == BALANCE
