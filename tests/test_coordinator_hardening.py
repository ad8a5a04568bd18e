"""The holes a line-by-line review of the coordinator found (issue 13), each reproduced on real databases.

Every test here failed on the code before the fix (commit 1168f4a) and names the hole it covers:

a. a lost decision log known only in memory;     e. a failed log that still let transactions begin;
b. an interrupted decision rolled back although   f. rollback after tx.commit() hiding the block's error;
   its COMMIT record still reached the disk;      g. an interrupted one-phase COMMIT reported rolled back;
c. a group-commit leader cut by an exception     d. serialization failures taken for lost connections.
   that left every later committer blocked;
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import pkgutil
import threading

import psycopg2
import pymysql
import pytest
from sqlalchemy import text

import qtp
from qtp.coordinator import TRANSITIONS, Outcome, State, failpoints, read_log
from qtp.coordinator._log import LOST_MARK, read_lost_mark
from qtp.errors import (
    ConfigurationError,
    ConflictError,
    LogError,
    OutcomeUnknownError,
    ResourceError,
    ResourceUnavailableError,
    RollbackError,
)
from qtp.recovery import read_quarantine
from qtp.xa import Xid, resource_for

from test_coordinator import BALANCE, balances, make_accounts, prepared_left, transfer, two_branches


@pytest.fixture
def tm(tmp_path):
    manager = qtp.TransactionManager(node_id="test-node", log_dir=tmp_path / "logs", recovery_interval=None,
                                     llr=False)  # these holes are in the file-log path
    qtp.install(manager)
    yield manager
    qtp.install(None)
    failpoints.configure(None)
    manager.close()


# ---------------------------------------------------------------------- a. the lost log


def prepare_orphan(url: str, node: str = "test-node") -> Xid:
    """A branch of ``node`` prepared by a run whose decision log is gone (the transaction may have committed)."""
    resource = resource_for("a", url, node)
    xid = Xid.of(f"{node}/{'ab' * 16}".encode(), "a")
    try:
        resource.begin(xid)
        resource.connection(xid).execute(text("UPDATE accounts SET balance = 0 WHERE id = 2"))
        resource.prepare(xid)
        resource.detach(xid)
    finally:
        resource.close()
    return xid


def test_a_crash_between_the_lost_log_mark_and_vetting_still_quarantines(tmp_path, pg_db):
    """The manager found no log, wrote its mark and its first segment, and died before vetting: the next
    start sees a log, but must still not presume abort for a branch the lost log may have committed."""
    engine = make_accounts(pg_db())
    xid = prepare_orphan(str(engine.url))
    first = qtp.TransactionManager("test-node", tmp_path / "logs", recovery_interval=None)
    assert read_lost_mark(first.log_dir) is not None  # written before the first segment
    first.log.close()  # "crash": no recovery pass ran, nothing vetted
    restarted = qtp.TransactionManager("test-node", tmp_path / "logs", recovery_interval=None)
    restarted.add_resource("a", engine.url)
    try:
        report = restarted.start_recovery()
        assert prepared_left(engine) == 1, "the branch was presumed aborted on the word of the new log"
        assert str(xid) in read_quarantine(restarted.log_dir)
        assert report.rolled_back == 0 and not report.ok
        assert read_lost_mark(restarted.log_dir) is None  # every resource vetted: the mark is gone
    finally:
        restarted.close()
        resource_for("a", engine.url, "test-node").rollback(xid)


def test_a_resource_unreachable_at_start_is_vetted_before_anything_is_presumed(tmp_path, pg_server, pg_db):
    """Started on a lost log while the database was down, the node restarts once it is up: the branch is
    quarantined, not rolled back, although a log exists by then."""
    engine = make_accounts(pg_db())
    xid = prepare_orphan(str(engine.url))
    engine.dispose()
    pg_server.kill()
    try:
        down = qtp.TransactionManager("test-node", tmp_path / "logs", recovery_interval=None)
        down.add_resource("a", engine.url, connect_args={"connect_timeout": 2})
        report = down.start_recovery()
        assert "a" in report.unreachable
        down.close()
    finally:
        pg_server.start()
    assert read_lost_mark(tmp_path / "logs" / "test-node")["vetted"] == []
    up = qtp.TransactionManager("test-node", tmp_path / "logs", recovery_interval=None)
    up.add_resource("a", engine.url)
    try:
        up.start_recovery()
        assert prepared_left(engine) == 1
        assert str(xid) in read_quarantine(up.log_dir)
    finally:
        up.close()
        resource_for("a", engine.url, "test-node").rollback(xid)


def test_offline_recover_leaves_unvetted_resources_alone(tmp_path, pg_db):
    """`qtp recover` on a node whose lost-log mark still lists a resource as unvetted acts on nothing there."""
    from qtp.config import Config
    from qtp.recovery import recover_node

    engine = make_accounts(pg_db())
    xid = prepare_orphan(str(engine.url))
    manager = qtp.TransactionManager("test-node", tmp_path / "logs", recovery_interval=None)
    manager.close()  # never recovered: the mark stays
    assert (tmp_path / "logs" / "test-node" / LOST_MARK).exists()
    config = Config(node_id="test-node", log_dir=str(tmp_path / "logs"), resources={"a": str(engine.url)})
    try:
        report = recover_node(config)
        assert report.rolled_back == 0 and prepared_left(engine) == 1
        assert any("not yet vetted" in reason or "vetted" in reason for reason in report.reasons())
    finally:
        resource_for("a", engine.url, "test-node").rollback(xid)


# ---------------------------------------------------------------------- b. a decision made is made


def interrupted_transfer(tm, pg_db, point: str):
    """A transfer between two PostgreSQL databases, cut by Ctrl-C at failpoint ``point``."""
    a, b = two_branches(tm, pg_db)
    failpoints.configure(f"{point}=interrupt")
    with pytest.raises(KeyboardInterrupt):
        with qtp.transaction() as tx:
            transfer(tx, 10)
    failpoints.configure(None)
    return tx, a, b


@pytest.mark.parametrize("point, outcome", [
    # b: waiting for its COMMIT record to be flushed, the transaction is never rolled back (the next flush
    # writes the record whoever runs it): the record is flushed before the interrupt goes on up, and the
    # background retry commits every branch
    ("decision_appended", Outcome.COMMITTED_PENDING),
    # one step earlier no record can exist: every branch is rolled back
    ("after_prepare_1", Outcome.ROLLED_BACK),
    # in phase 2: committed (pending, finished in the background), and the interrupt is not swallowed
    ("after_commit_1", Outcome.COMMITTED_PENDING),
])
def test_b_an_interrupt_is_settled_by_where_it_strikes(tm, pg_db, point, outcome):
    tx, a, b = interrupted_transfer(tm, pg_db, point)
    assert tx.outcome is outcome
    tm.wait_retries()
    moved = 10 if outcome is Outcome.COMMITTED_PENDING else 0
    assert balances(a)[1] == BALANCE - moved and balances(b)[1] == BALANCE + moved
    assert prepared_left(a) == prepared_left(b) == 0
    tm.log.flush()
    assert read_log(tm.log_dir).open == {}  # decided, then ended (or never decided)
    assert tm.in_flight() == set()


# ---------------------------------------------------------------------- c. and e. a failed log write


@pytest.mark.parametrize("action", ["error", "interrupt"])
def test_c_a_flush_cut_by_any_exception_never_blocks_later_committers(tm, pg_db, action):
    """A leader cut inside its write (an error other than OSError, or an interrupt) used to leave the log
    "flushing" forever. Now the log fails (what reached the disk is unknown): the transaction's outcome is
    unknown, its branches stay prepared for recovery, and the next transaction is refused at once."""
    a, b = two_branches(tm, pg_db)
    failpoints.configure(f"log_write={action}")
    expected = OutcomeUnknownError if action == "error" else KeyboardInterrupt
    with pytest.raises(expected):
        with qtp.transaction() as tx:
            transfer(tx, 10)
    failpoints.configure(None)
    assert tx.outcome is Outcome.UNKNOWN
    tm.wait_retries()
    assert prepared_left(a) == prepared_left(b) == 1  # left to recovery, never guessed

    done = threading.Event()
    errors: list[BaseException] = []

    def later_committer() -> None:
        try:
            tm.log.log_commit("test-node/" + "cd" * 16, ["a", "b"])
        except BaseException as exc:
            errors.append(exc)
        done.set()

    threading.Thread(target=later_committer, daemon=True).start()
    assert done.wait(10), "a later committer blocked behind the failed flush"
    assert isinstance(errors[0], LogError)
    with pytest.raises(LogError, match="refuses new transactions.*restart"):
        tm.begin()
    tm.close()
    restarted = qtp.TransactionManager("test-node", tm.log_dir.parent, recovery_interval=None)
    restarted.add_resource("a", a.url)
    restarted.add_resource("b", b.url)
    try:
        restarted.start_recovery()
        assert prepared_left(a) == prepared_left(b) == 0
        assert (balances(a)[1], balances(b)[1]) in ((BALANCE, BALANCE), (BALANCE - 10, BALANCE + 10))
    finally:
        restarted.close()


def test_e_a_failed_log_refuses_new_transactions(tm, pg_db):
    """After one failed write (a full disk, say) every multi-branch transaction would prepare, then be left
    in doubt holding its locks: the manager refuses to begin instead, saying how to recover."""
    a, b = two_branches(tm, pg_db)

    def disk_full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    tm.log._sync = disk_full
    with pytest.raises(OutcomeUnknownError, match="could not be logged"):
        with qtp.transaction() as tx:
            transfer(tx, 10)
    with pytest.raises(LogError, match="No space left on device.*restart the node"):
        with qtp.transaction():
            pass
    tm.close()
    restarted = qtp.TransactionManager("test-node", tm.log_dir.parent, recovery_interval=None)
    restarted.add_resource("a", a.url)
    restarted.add_resource("b", b.url)
    try:
        restarted.start_recovery()  # the write landed in the file, its fsync failed: whatever the file says,
        moved = BALANCE - balances(a)[1]  # both branches end the same way
        assert moved in (0, 10) and balances(b)[1] == BALANCE + moved
        assert prepared_left(a) == prepared_left(b) == 0
    finally:
        restarted.close()


# ---------------------------------------------------------------------- d. conflicts are not disconnects


def test_d_a_serialization_failure_at_one_phase_commit_is_a_retryable_rollback(tm, pg_db):
    """PostgreSQL's SSI aborts the second of two write-skewed transactions at COMMIT (SQLSTATE 40001).
    psycopg2 raises TransactionRollbackError, an OperationalError: it used to be taken for a lost
    connection and reported as an unknown outcome. It is a certain, retryable rollback."""
    engine = make_accounts(pg_db())
    tm.add_resource("a", engine.url)
    other = qtp.TransactionManager("other-node", tm.log_dir.parent, recovery_interval=None)
    other.add_resource("a", engine.url)

    def serializable(tx):
        conn = tx.connection("a")
        conn.execute(text("SET TRANSACTION ISOLATION LEVEL SERIALIZABLE"))
        return conn

    try:
        first, second = other.begin(), tm.begin()
        c1, c2 = serializable(first), serializable(second)
        c1.execute(text("SELECT balance FROM accounts WHERE id = 2")).scalar()
        c2.execute(text("SELECT balance FROM accounts WHERE id = 1")).scalar()
        c1.execute(text("UPDATE accounts SET balance = balance + 1 WHERE id = 1"))
        c2.execute(text("UPDATE accounts SET balance = balance + 1 WHERE id = 2"))
        first.commit()
        with pytest.raises(RollbackError) as caught:
            second.commit()
    finally:
        other.close()
    assert isinstance(caught.value.__cause__, ConflictError), caught.value
    assert caught.value.retryable and second.outcome is Outcome.ROLLED_BACK
    assert balances(engine) == {1: BALANCE + 1, 2: BALANCE}


def translated(resource, exc: BaseException):
    return resource._translate(exc, "commit", None)


def test_d_driver_errors_are_classified_by_code_on_both_databases(pg_db, maria_db):
    """Real errors from real servers: a killed session is "unavailable" (outcome unknown); a cancelled
    statement is a plain failure; a deadlock is a conflict (a certain, retryable abort)."""
    pg = resource_for("a", pg_db(), "n")
    maria = resource_for("b", maria_db(), "n")
    try:
        raw = pg.engine.raw_connection()
        killer = pg.engine.raw_connection()
        pid = raw.cursor().connection.get_backend_pid()
        killer.cursor().execute("SELECT pg_terminate_backend(%s)", (pid,))
        killer.commit()
        with pytest.raises(psycopg2.OperationalError) as lost:
            raw.cursor().execute("SELECT 1")
        assert isinstance(translated(pg, lost.value), ResourceUnavailableError)

        raw = pg.engine.raw_connection()
        cur = raw.cursor()
        cur.execute("SET statement_timeout = 50")
        with pytest.raises(psycopg2.OperationalError) as cancelled:  # QueryCanceledError, 57014
            cur.execute("SELECT pg_sleep(5)")
        kind = translated(pg, cancelled.value)
        assert type(kind) is ResourceError and not kind.retryable
        raw.rollback()

        deadlock = mariadb_deadlock(maria)
        assert isinstance(translated(maria, deadlock), ConflictError) and translated(maria, deadlock).retryable

        raw = maria.engine.raw_connection()
        other = maria.engine.raw_connection()
        with other.cursor() as c:
            c.execute("KILL %s" % raw.thread_id())
        with pytest.raises(pymysql.err.OperationalError) as killed:
            raw.cursor().execute("SELECT 1")
        assert isinstance(translated(maria, killed.value), ResourceUnavailableError)
    finally:
        pg.close()
        maria.close()


def mariadb_deadlock(resource) -> BaseException:
    """Two sessions that lock two rows in opposite orders: MariaDB kills one with error 1213."""
    with resource.engine.begin() as conn:
        conn.execute(text("CREATE TABLE t (id int PRIMARY KEY, v int)"))
        conn.execute(text("INSERT INTO t VALUES (1, 0), (2, 0)"))
    one, two = resource.engine.raw_connection(), resource.engine.raw_connection()
    c1, c2 = one.cursor(), two.cursor()
    c1.execute("BEGIN")
    c2.execute("BEGIN")
    c1.execute("UPDATE t SET v = 1 WHERE id = 1")
    c2.execute("UPDATE t SET v = 1 WHERE id = 2")
    caught: list[BaseException] = []

    def blocked() -> None:
        try:
            c1.execute("UPDATE t SET v = 2 WHERE id = 2")
        except pymysql.err.MySQLError as exc:
            caught.append(exc)

    waiter = threading.Thread(target=blocked)
    waiter.start()
    try:
        c2.execute("UPDATE t SET v = 2 WHERE id = 1")
    except pymysql.err.MySQLError as exc:
        caught.append(exc)
    waiter.join(30)
    one.rollback()
    two.rollback()
    assert caught and caught[0].args[0] == 1213, caught
    return caught[0]


# ---------------------------------------------------------------------- f. and g.


def test_f_the_blocks_own_error_is_not_hidden_after_an_explicit_commit(tm, pg_db):
    a = make_accounts(pg_db())
    tm.add_resource("a", a.url)
    with pytest.raises(ValueError, match="after the commit"):
        with qtp.transaction() as tx:
            tx.connection("a").execute(text("UPDATE accounts SET balance = 1 WHERE id = 1"))
            tx.commit()
            raise ValueError("the application failed after the commit")
    assert tx.outcome is Outcome.COMMITTED and balances(a)[1] == 1


def test_g_an_interrupted_one_phase_commit_is_unknown_not_rolled_back(tm, pg_db):
    """The COMMIT landed, then the interrupt: reporting "rolled back" would be a lie the data contradicts."""
    a = make_accounts(pg_db())
    tm.add_resource("a", a.url)
    failpoints.configure("after_one_phase_commit=interrupt")
    with pytest.raises(KeyboardInterrupt):
        with qtp.transaction() as tx:
            tx.connection("a").execute(text("UPDATE accounts SET balance = 7 WHERE id = 1"))
    failpoints.configure(None)
    assert tx.outcome is Outcome.UNKNOWN
    assert balances(a)[1] == 7
    assert tm.in_flight() == set()


# ---------------------------------------------------------------------- the table, errors, context


def test_every_state_change_goes_through_the_table():
    """Every non-final state has a way out, final states have none, and the source assigns ``state`` in
    exactly one place besides the constructor (``_fire``)."""
    from qtp.coordinator import _transaction

    sources = {state for state, _ in TRANSITIONS}
    finals = {State.COMMITTED, State.COMMITTED_PENDING, State.ROLLED_BACK, State.IN_DOUBT}
    assert sources == set(State) - finals
    assert set(TRANSITIONS.values()) <= set(State)
    code = inspect.getsource(_transaction)
    assert code.count("self.state = ") == 2  # the constructor's ACTIVE and _fire


def test_every_public_exception_lives_in_qtp_errors():
    """One tree: any exception class a caller can meet is defined in qtp.errors (private control-flow
    exceptions, named with a leading underscore, never leave their module)."""
    import qtp as package

    outside = set()
    for info in pkgutil.walk_packages(package.__path__, "qtp."):
        if info.name.startswith("qtp.demo") or info.name in ("qtp.testing.e2e_app", "qtp.testing.coupled_app") \
                or info.name.endswith("__main__"):
            continue  # example applications (their own exceptions) and process entry points
        module = importlib.import_module(info.name)
        for name, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseException) and cls.__module__.startswith("qtp") \
                    and cls.__module__ != "qtp.errors" and not name.startswith("_"):
                outside.add(f"{cls.__module__}.{name}")
    assert outside == set()


def test_current_is_none_without_a_manager():
    qtp.install(None)
    assert qtp.current() is None


def test_a_session_is_not_reopened_with_other_options(tm, pg_db):
    a = make_accounts(pg_db())
    tm.add_resource("a", a.url)
    with qtp.transaction() as tx:
        session = tx.session("a", autoflush=False)
        assert tx.session("a") is session and tx.session("a", autoflush=False) is session
        with pytest.raises(ConfigurationError, match="already open.*autoflush"):
            tx.session("a", autoflush=True)


def test_asyncio_tasks_each_see_their_own_transaction(tm):
    """The current transaction is a context variable: two tasks on one thread each run their own
    transaction (with a thread-local, the second would be refused as nested)."""
    tm.add_resource("m", "memory://asyncio-tasks")

    async def worker(n: int, started: asyncio.Event, other: asyncio.Event):
        with tm.transaction() as tx:
            tx.connection("m").put(n, n)
            started.set()
            await other.wait()  # both transactions are open now, on the same thread
            assert tm.current() is tx
        return tx

    async def main():
        first, second = asyncio.Event(), asyncio.Event()
        return await asyncio.gather(worker(1, first, second), worker(2, second, first))

    txs = asyncio.run(main())
    assert txs[0] is not txs[1]
    assert all(tx.outcome is Outcome.COMMITTED for tx in txs)
    assert tm.current() is None
