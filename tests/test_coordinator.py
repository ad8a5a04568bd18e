"""The transaction manager over real PostgreSQL and MariaDB: every branch combination, the optimisations
(each checked by counting what reached the database), sessions, and the error paths."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import sqlalchemy
from sqlalchemy import Integer, String, text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

import qtp
from qtp.coordinator import Outcome, read_log
from qtp.embedded import EmbeddedPostgres
from qtp.errors import (
    ConfigurationError,
    ConnectionClosedError,
    NestedTransactionError,
    NoTransactionError,
    PrepareRefusedError,
    RollbackError,
    TransactionStateError,
    TransactionTimeoutError,
)
from qtp.xa import MemoryResource

from embedded_support import discard

BALANCE = 1000


def make_accounts(url: str) -> sqlalchemy.Engine:
    engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE accounts (id int PRIMARY KEY, balance int NOT NULL)"))
        conn.execute(text("INSERT INTO accounts VALUES (1, :b), (2, :b)"), {"b": BALANCE})
    return engine


def balances(engine: sqlalchemy.Engine) -> dict[int, int]:
    with engine.connect() as conn:
        return dict(conn.execute(text("SELECT id, balance FROM accounts ORDER BY id")).all())


def prepared_left(engine: sqlalchemy.Engine) -> int:
    """Prepared transactions left in this database (MariaDB lists the whole server's: count this node's)."""
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            return conn.execute(text("SELECT count(*) FROM pg_prepared_xacts "
                                     "WHERE database = current_database()")).scalar()
        return sum(b"test-node/" in bytes(row[3]) for row in conn.execute(text("XA RECOVER")).all())


@pytest.fixture
def tm(tmp_path):
    # the file-log path; Logging Last Resource has its own tests (test_llr.py)
    manager = qtp.TransactionManager(node_id="test-node", log_dir=tmp_path / "logs", llr=False)
    qtp.install(manager)
    yield manager
    qtp.install(None)
    manager.close()


@pytest.fixture(params=["pg+pg", "pg+mariadb", "mariadb+mariadb"])
def pair(request, pg_db, maria_db):
    left, right = request.param.split("+")
    make = {"pg": pg_db, "mariadb": maria_db}
    return make_accounts(make[left]("a")), make_accounts(make[right]("b"))


def sent(manager, name: str) -> dict[str, int]:
    """What reached the database for resource ``name``, leaving out recovery's scans."""
    return {k: v for k, v in manager.resource(name).counters().items() if not k.startswith("recover")}


def two_branches(tm, pg_db, second=None, last_resource: bool = False):
    """Accounts in database ``a`` (PostgreSQL) and ``b`` (``second``, PostgreSQL by default), registered on
    ``tm``; ``last_resource``: prefer ``b`` as the Logging Last Resource."""
    return enlist(tm, make_accounts(pg_db("a")), make_accounts((second or pg_db)("b")), last_resource)


def enlist(tm, a, b, last_resource: bool = False):
    """Register the account databases ``a`` and ``b`` on ``tm`` as resources "a" and "b"; returns them."""
    tm.add_resource("a", a.url)
    tm.add_resource("b", b.url, last_resource=last_resource)
    return a, b


def transfer(tx, amount: int) -> None:
    tx.connection("a").execute(text("UPDATE accounts SET balance = balance - :x WHERE id = 1"), {"x": amount})
    tx.connection("b").execute(text("UPDATE accounts SET balance = balance + :x WHERE id = 1"), {"x": amount})


def test_transfer_commits_on_both_databases(tm, pair):
    a, b = enlist(tm, *pair)
    with qtp.transaction() as tx:
        transfer(tx, 10)
    assert tx.outcome is Outcome.COMMITTED
    assert balances(a)[1] == BALANCE - 10 and balances(b)[1] == BALANCE + 10
    counts_a, counts_b = sent(tm, "a"), sent(tm, "b")
    assert counts_a["prepare"] == counts_b["prepare"] == 1
    assert counts_a["commit"] == counts_b["commit"] == 1
    assert tm.log.forced_records == 1
    tm.log.flush()
    assert read_log(tm.log_dir).open == {}  # the END record followed
    assert prepared_left(a) == prepared_left(b) == 0


def test_exception_rolls_back_both_databases(tm, pair):
    a, b = enlist(tm, *pair)
    with pytest.raises(ZeroDivisionError):
        with qtp.transaction() as tx:
            transfer(tx, 10)
            1 / 0
    assert tx.outcome is Outcome.ROLLED_BACK
    assert balances(a)[1] == BALANCE and balances(b)[1] == BALANCE
    assert tm.log.forced_records == 0  # presumed abort: aborts are never logged
    assert prepared_left(a) == prepared_left(b) == 0


def test_no_vote_rolls_back_every_branch(tm, pair):
    """A branch that fails at prepare (here: a deferred constraint on PostgreSQL, a deadlock-free duplicate on
    MariaDB is checked at statement time, so a memory branch votes no instead) rolls back the others."""
    a, b = enlist(tm, *pair)
    mem = tm.add_resource("m", MemoryResource("m", tm.node_id))
    mem.inject("prepare", RuntimeError("disk full"))
    with pytest.raises(RollbackError, match="a branch voted no: disk full"):
        with qtp.transaction() as tx:
            transfer(tx, 10)
            tx.connection("m").put("k", 1)
    assert balances(a)[1] == BALANCE and balances(b)[1] == BALANCE
    assert prepared_left(a) == prepared_left(b) == 0
    assert mem.store.data == {} and mem.store.prepared == {}


def test_one_phase_commit_when_only_one_branch_wrote(tm, pg_db, maria_db):
    a, b = two_branches(tm, pg_db, maria_db)
    with qtp.transaction() as tx:
        tx.connection("b")  # enlisted, did nothing
        tx.connection("a").execute(text("UPDATE accounts SET balance = 1 WHERE id = 1"))
    assert balances(a)[1] == 1
    assert sent(tm, "a") == {"begin": 1, "commit_one_phase": 1}
    assert sent(tm, "b") == {"begin": 1, "read-only": 1}
    assert tm.log.fsyncs == 0


def test_read_only_branches_leave_phase_two_and_the_log(tm, pg_db):
    a, b, c = (make_accounts(pg_db(tag)) for tag in "abc")
    for name, engine in zip("abc", (a, b, c)):
        tm.add_resource(name, engine.url)
    with qtp.transaction() as tx:
        transfer(tx, 5)
        assert tx.connection("c").execute(text("SELECT sum(balance) FROM accounts")).scalar() == 2 * BALANCE
    counts_c = sent(tm, "c")
    assert counts_c == {"begin": 1, "read-only": 1}  # asked once, never prepared, never committed
    assert tm.log.forced_records == 1
    with open(sorted(tm.log_dir.glob("segment-*"))[0], "rb") as f:
        log_bytes = f.read()
    assert b'"branches":["a","b"]' in log_bytes and b'"c"' not in log_bytes


def test_two_names_on_one_database_share_a_branch(tm, pg_db):
    url = pg_db("shared")
    app = make_accounts(url)
    with app.begin() as conn:
        conn.execute(text("CREATE TABLE outbox (id serial PRIMARY KEY, body text)"))
    tm.add_resource("app", url)
    store = tm.add_resource("store", url.replace("127.0.0.1", "localhost"))
    assert store is tm.resource("app")
    with qtp.transaction() as tx:
        tx.connection("app").execute(text("UPDATE accounts SET balance = balance - 1 WHERE id = 1"))
        tx.connection("store").execute(text("INSERT INTO outbox (body) VALUES ('hello')"))
        assert tx.connection("app") is tx.connection("store")
    assert sent(tm, "app") == {"begin": 1, "commit_one_phase": 1}  # one local commit
    assert tm.log.fsyncs == 0
    with app.connect() as conn:
        assert conn.execute(text("SELECT body FROM outbox")).scalars().all() == ["hello"]


def test_prepare_and_commit_reach_all_branches_at_once(tm):
    """Each branch's prepare (then commit) waits for the other on a barrier: done one after another, the
    barrier would break and the transaction roll back."""
    first = tm.add_resource("m1", MemoryResource("m1", tm.node_id))
    second = tm.add_resource("m2", MemoryResource("m2", tm.node_id))
    for step in ("prepare", "commit"):
        barrier = threading.Barrier(2, timeout=5)
        first.inject(step, barrier.wait)
        second.inject(step, barrier.wait)
    with qtp.transaction() as tx:
        tx.connection("m1").put("x", 1)
        tx.connection("m2").put("y", 2)
    assert tx.outcome is Outcome.COMMITTED
    assert first.store.data == {"x": 1} and second.store.data == {"y": 2}


def test_phase_two_failure_is_committed_with_branches_pending(tm, caplog):
    tm.phase_two_retry_s = 5
    first = tm.add_resource("m1", MemoryResource("m1", tm.node_id))
    second = tm.add_resource("m2", MemoryResource("m2", tm.node_id))
    from qtp.errors import ResourceUnavailableError

    second.inject("commit", ResourceUnavailableError("connection lost"))
    with caplog.at_level(logging.CRITICAL, logger="qtp.coordinator"):
        with qtp.transaction() as tx:
            tx.connection("m1").put("x", 1)
            tx.connection("m2").put("y", 2)
    assert tx.outcome is Outcome.COMMITTED_PENDING
    assert tx.pending == ["m2"]
    assert any("could not commit yet" in r.message for r in caplog.records if r.levelno == logging.CRITICAL)
    assert first.store.data == {"x": 1}
    tm.wait_retries()  # the background retry finishes the commit; it is never turned into a rollback
    assert second.store.data == {"y": 2} and second.store.prepared == {}
    tm.log.flush()
    assert read_log(tm.log_dir).open == {}


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    item: Mapped[str] = mapped_column(String(40))


def test_orm_session_is_bound_to_the_branch(tm, pg_db, maria_db):
    pg, maria = pg_db("orm"), maria_db("orm")
    for url in (pg, maria):
        Base.metadata.create_all(sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool))
    tm.add_resource("pg", pg)
    tm.add_resource("maria", maria)
    with qtp.transaction() as tx:
        tx.session("pg").add(Order(id=1, item="book"))
        tx.session("maria").add(Order(id=1, item="book"))
        tx.session("pg").commit()  # joins the global transaction: nothing is committed yet
    with pytest.raises(RuntimeError):
        with qtp.transaction() as tx:
            tx.session("pg").add(Order(id=2, item="pen"))
            raise RuntimeError("changed my mind")
    for url in (pg, maria):
        with sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool).connect() as conn:
            assert conn.execute(text("SELECT id, item FROM orders")).all() == [(1, "book")]


# ---------------------------------------------------------------------------------------------- errors


def test_unknown_resource_name_is_named(tm, pg_db):
    tm.add_resource("app", pg_db())
    with pytest.raises(ConfigurationError, match=r"unknown resource 'ap' .*registered: app"):
        with qtp.transaction() as tx:
            tx.connection("ap")


def test_enlisting_after_the_transaction_ended(tm, pg_db):
    tm.add_resource("app", pg_db())
    with qtp.transaction() as tx:
        tx.connection("app").execute(text("SELECT 1"))
    with pytest.raises(TransactionStateError, match="is committed"):
        tx.connection("app")


def test_connection_used_outside_its_transaction(tm, pg_db, maria_db):
    tm.add_resource("pg", pg_db())
    tm.add_resource("maria", maria_db())
    with qtp.transaction() as tx:
        kept = [tx.connection("pg"), tx.connection("maria")]
    for conn in kept:
        with pytest.raises(ConnectionClosedError, match="has ended"):
            conn.execute(text("SELECT 1"))


def test_committing_a_branch_connection_by_hand_is_refused(tm, pg_db):
    tm.add_resource("app", pg_db())
    with pytest.raises(TransactionStateError, match="do not commit"):
        with qtp.transaction() as tx:
            tx.connection("app").commit()


def test_database_with_prepared_transactions_disabled(tm, tmp_path, pg_db):
    server = EmbeddedPostgres(tmp_path / "no-2pc", max_prepared_transactions=0)
    server.start()
    try:
        off, on = make_accounts(server.create_database("off")), make_accounts(pg_db("on"))
        tm.add_resource("a", off.url)
        tm.add_resource("b", on.url)
        with pytest.raises(RollbackError) as caught:
            with qtp.transaction() as tx:
                transfer(tx, 10)
        assert isinstance(caught.value.__cause__, PrepareRefusedError)
        assert "set max_prepared_transactions" in str(caught.value)
        assert balances(off)[1] == BALANCE and balances(on)[1] == BALANCE
        assert prepared_left(on) == 0
    finally:
        tm.close()
        discard(server)


def test_temporary_tables_cannot_be_prepared(tm, pg_db):
    a, b = two_branches(tm, pg_db)
    with pytest.raises(RollbackError, match="temporary tables") as caught:
        with qtp.transaction() as tx:
            transfer(tx, 10)
            tx.connection("a").execute(text("CREATE TEMPORARY TABLE scratch (x int)"))
    assert isinstance(caught.value.__cause__, PrepareRefusedError)
    assert balances(a)[1] == BALANCE and balances(b)[1] == BALANCE
    assert prepared_left(a) == prepared_left(b) == 0


def test_nested_transaction_is_refused(tm):
    tm.add_resource("m", "memory://nested")
    with qtp.transaction():
        with pytest.raises(NestedTransactionError, match="do not nest"):
            with qtp.transaction():
                pass


def test_transaction_without_an_installed_manager():
    qtp.install(None)
    with pytest.raises(NoTransactionError, match=r"qtp.install"):
        with qtp.transaction():
            pass


def test_transaction_past_its_timeout_is_rolled_back(tm, pg_db):
    a = make_accounts(pg_db())
    tm.add_resource("a", a.url)
    with pytest.raises(TransactionTimeoutError, match="timeout"):
        with qtp.transaction(timeout=30) as tx:
            tx.connection("a").execute(text("UPDATE accounts SET balance = 0 WHERE id = 1"))
            tx.deadline = time.monotonic() - 1  # as if 30 s had passed
            tx.connection("a")
    assert tx.outcome is Outcome.ROLLED_BACK
    assert balances(a)[1] == BALANCE


def test_commit_after_the_timeout_rolls_back(tm, pg_db):
    a = make_accounts(pg_db())
    tm.add_resource("a", a.url)
    with pytest.raises(TransactionTimeoutError):
        with qtp.transaction(timeout=30) as tx:
            tx.connection("a").execute(text("UPDATE accounts SET balance = 0 WHERE id = 1"))
            tx.deadline = time.monotonic() - 1
    assert balances(a)[1] == BALANCE


@pytest.mark.parametrize("url, message", [
    ("sqlite:///x.db", "unsupported database"),
    ("postgresql+psycopg://u@h/db", "use postgresql\\+psycopg2"),
    ("not a url", "not a database URL"),
])
def test_bad_urls_are_explained(tm, url, message):
    with pytest.raises(ConfigurationError, match=message):
        tm.add_resource("x", url)


def test_bare_postgresql_url_means_psycopg2(tm, pg_db):
    url = pg_db().replace("postgresql+psycopg2://", "postgresql://")
    resource = tm.add_resource("app", url)
    assert resource.engine.dialect.driver == "psycopg2"
    with qtp.transaction() as tx:
        assert tx.connection("app").execute(text("SELECT 1")).scalar() == 1


def test_engine_of_an_unsupported_database_is_refused(tm):
    with pytest.raises(ConfigurationError, match="unsupported database"):
        tm.add_resource("x", sqlalchemy.create_engine("sqlite://"))


def test_engine_is_used_as_given(tm, pg_db):
    engine = sqlalchemy.create_engine(pg_db(), pool_size=3)
    resource = tm.add_resource("app", engine)
    assert resource.engine is engine


@pytest.mark.parametrize("flavour", ["pg", "mariadb"])
def test_timeout_interrupts_a_transaction_blocked_on_a_lock(tmp_path, pg_db, maria_db, flavour):
    """A transaction waiting on a lock past its timeout is cancelled by the reaper and rolled back."""
    url = (pg_db if flavour == "pg" else maria_db)()
    accounts = make_accounts(url)
    manager = qtp.TransactionManager("reaper", tmp_path / "logs", timeout=0.4, recovery_interval=None)
    manager.add_resource("a", url)
    holder = accounts.connect()
    holder.execute(text("UPDATE accounts SET balance = 0 WHERE id = 1"))  # holds the row lock, uncommitted
    began = time.monotonic()
    try:
        with pytest.raises(TransactionTimeoutError, match="cancelled"):
            with manager.transaction() as tx:
                tx.connection("a").execute(text("UPDATE accounts SET balance = balance + 1 WHERE id = 2"))
                tx.connection("a").execute(text("UPDATE accounts SET balance = balance + 1 WHERE id = 1"))
        waited = time.monotonic() - began
    finally:
        holder.rollback()
        holder.close()
        manager.close()
    assert tx.outcome is Outcome.ROLLED_BACK
    assert waited < 5  # not the database's own lock timeout (none in PostgreSQL, 10 s in our MariaDB)
    assert balances(accounts) == {1: BALANCE, 2: BALANCE}


@pytest.mark.parametrize("flavour", ["pg", "mariadb"])
def test_work_on_the_raw_dbapi_connection_is_not_mistaken_for_idle(tm, pg_db, maria_db, flavour):
    """Work done on the DBAPI connection is invisible to SQLAlchemy: PostgreSQL's libpq still knows the branch
    began; for MariaDB, reaching for the DBAPI connection marks the branch as written."""
    make = pg_db if flavour == "pg" else maria_db
    a, b = enlist(tm, make_accounts(make("a")), make_accounts(pg_db("b")))
    with qtp.transaction() as tx:
        raw = tx.connection("a").connection.dbapi_connection
        cur = raw.cursor()
        cur.execute("UPDATE accounts SET balance = balance - 3 WHERE id = 1")
        cur.close()
        tx.connection("b").execute(text("UPDATE accounts SET balance = balance + 3 WHERE id = 1"))
    assert sent(tm, "a")["prepare"] == 1 and sent(tm, "b")["prepare"] == 1
    assert balances(a)[1] == BALANCE - 3 and balances(b)[1] == BALANCE + 3


@pytest.mark.parametrize("point, outcome", [
    ("before_prepare", Outcome.ROLLED_BACK),
    ("after_prepare_1", Outcome.ROLLED_BACK),
    ("after_decision_forced", Outcome.COMMITTED_PENDING),
    ("before_end_record", Outcome.COMMITTED_PENDING),
])
def test_an_error_inside_the_commit_path_settles_the_transaction(tm, pg_db, maria_db, point, outcome):
    """Cut short by an unexpected error, the commit path leaves nothing open: before the decision every branch
    is rolled back, after it every branch ends committed (by the background retry), locks released."""
    from qtp.coordinator import failpoints

    a, b = two_branches(tm, pg_db, maria_db)
    failpoints.configure(f"{point}=error")
    try:
        with pytest.raises((failpoints.FailpointError, RollbackError)):
            with qtp.transaction() as tx:
                transfer(tx, 10)
    finally:
        failpoints.configure(None)
    assert tx.outcome is outcome
    tm.wait_retries()
    moved = 10 if outcome is Outcome.COMMITTED_PENDING else 0
    assert balances(a)[1] == BALANCE - moved and balances(b)[1] == BALANCE + moved
    assert prepared_left(a) == prepared_left(b) == 0
    assert tm.in_flight() == set()
    with qtp.transaction() as tx:  # nothing left locked
        transfer(tx, 1)


@pytest.mark.parametrize("branches", [1, 2])
def test_a_postgresql_branch_whose_statement_failed_cannot_commit(tm, pg_db, branches):
    """PostgreSQL answers PREPARE (or COMMIT) of an aborted transaction with a silent ROLLBACK; qtp must
    roll back every branch instead of reporting a commit."""
    a, b = two_branches(tm, pg_db)
    with pytest.raises(RollbackError, match="failed state"):
        with qtp.transaction() as tx:
            if branches == 2:
                tx.connection("b").execute(text("UPDATE accounts SET balance = 0 WHERE id = 1"))
            try:
                tx.connection("a").execute(text("INSERT INTO accounts VALUES (1, 0)"))  # duplicate key
            except sqlalchemy.exc.IntegrityError:
                pass  # the application swallows the error and carries on
    assert tx.outcome is Outcome.ROLLED_BACK
    assert balances(a)[1] == BALANCE and balances(b)[1] == BALANCE
    assert prepared_left(a) == prepared_left(b) == 0


def test_one_phase_commit_whose_connection_breaks_is_reported_unknown(tm, pg_db):
    """If the connection dies during a one-phase COMMIT, the database alone knows the outcome: qtp says so
    instead of claiming a rollback."""
    from qtp.errors import OutcomeUnknownError

    a = make_accounts(pg_db("a"))
    tm.add_resource("a", a.url)
    with pytest.raises(OutcomeUnknownError, match="outcome unknown"):
        with qtp.transaction() as tx:
            conn = tx.connection("a")
            conn.execute(text("UPDATE accounts SET balance = 0 WHERE id = 1"))
            pid = conn.execute(text("SELECT pg_backend_pid()")).scalar()
            with a.connect() as killer:
                killer.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})
    assert tx.outcome is Outcome.UNKNOWN
    assert tm.in_flight() == set()


def test_urls_that_differ_in_their_query_are_different_databases(tm, pg_db):
    url = pg_db()
    first = tm.add_resource("a", url)
    second = tm.add_resource("b", url + "?application_name=other")
    assert first is not second


def test_close_lets_running_transactions_finish_and_refuses_new_ones(tmp_path):
    manager = qtp.TransactionManager("closing", tmp_path / "logs", recovery_interval=None)
    first = manager.add_resource("m1", MemoryResource("m1", "closing"))
    second = manager.add_resource("m2", MemoryResource("m2", "closing"))
    entered, release = threading.Event(), threading.Event()
    first.inject("prepare", lambda: (entered.set(), release.wait(10)))
    done = {}

    def run():
        with manager.transaction() as tx:
            tx.connection("m1").put("x", 1)
            tx.connection("m2").put("y", 2)
        done["outcome"] = tx.outcome

    worker = threading.Thread(target=run)
    worker.start()
    assert entered.wait(10)  # the transaction is voting
    closer = threading.Thread(target=manager.close)
    closer.start()
    closer.join(0.2)
    assert closer.is_alive()  # close() waits for it
    with pytest.raises(ConfigurationError, match="is closed"):
        manager.begin()
    release.set()
    worker.join(10)
    closer.join(10)
    assert done["outcome"] is Outcome.COMMITTED
    assert first.store.data == {"x": 1} and second.store.data == {"y": 2}
    assert read_log(manager.log_dir).open == {}


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf")])
def test_timeout_must_be_a_positive_number(tmp_path, timeout):
    with pytest.raises(ConfigurationError, match="timeout"):
        qtp.TransactionManager("t", tmp_path, timeout=timeout)


def test_a_thread_keeps_its_connection_from_one_transaction_to_the_next(tm, pg_db, maria_db):
    """Each thread's branches reuse one pooled connection per database (no checkout, no check-in, no
    needless ROLLBACK), while a connection object kept from an ended transaction still refuses any use."""
    a, b = two_branches(tm, pg_db, maria_db)
    kept = []
    for amount in range(1, 6):
        with qtp.transaction() as tx:
            transfer(tx, amount)
            kept.append(tx.connection("a"))
    assert balances(a)[1] == BALANCE - 15 and balances(b)[1] == BALANCE + 15
    assert tm.resource("a").checkouts == 1 and tm.resource("b").checkouts == 1
    for old in kept:
        with pytest.raises(ConnectionClosedError):
            old.execute(text("SELECT 1"))
        with pytest.raises(ConnectionClosedError):
            old.connection
