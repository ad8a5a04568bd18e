"""One contract suite, run against every resource: in-memory, PostgreSQL and MariaDB (real servers)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import sqlalchemy
from sqlalchemy import text

from qtp.errors import ConnectionClosedError
from qtp.xa import MemoryResource, MemoryDatabase, MySQLResource, PostgresResource, Resource, Vote, Xid

NODE = "node-a"


@dataclass
class Kit:
    """How the suite talks to one kind of resource."""

    make: Callable[[str], Resource]          # node id -> a new resource object on the same database
    write: Callable[[Any, str, int], None]   # (branch connection, key, value)
    read_only_work: Callable[[Any], None]    # a statement that reads without writing
    committed: Callable[[], dict[str, int]]  # what an outside observer sees
    prepare_foreign: Callable[[], Callable[[], None]]  # prepared branches not this node's; returns a clean-up
    sees_reads: bool = True                  # can the database tell that a branch that ran reads wrote nothing?


def _sql_kit(url: str, cls: type) -> Kit:
    engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool)
    with engine.begin() as conn:
        conn.execute(text("CREATE TABLE kv (k varchar(40) PRIMARY KEY, v int)"))
    family = "postgresql" if cls is PostgresResource else "mysql"

    def committed() -> dict[str, int]:
        with engine.connect() as conn:
            return dict(conn.execute(text("SELECT k, v FROM kv")).all())

    def prepare_foreign() -> Callable[[], None]:
        other = cls("kv", url, "node-b")  # another manager's branch
        xid = Xid.of(Xid.new_gtrid("node-b"), "kv")
        other.begin(xid)
        other.connection(xid).execute(text("INSERT INTO kv VALUES ('foreign', 1)"))
        other.prepare(xid)
        other.close()
        gid = f"hand-made-{uuid.uuid4().hex[:8]}"
        hand = [f"BEGIN; INSERT INTO kv VALUES ('hand', 1); PREPARE TRANSACTION '{gid}'"] \
            if family == "postgresql" else \
            [f"XA START '{gid}'", "INSERT INTO kv VALUES ('hand', 1)", f"XA END '{gid}'", f"XA PREPARE '{gid}'"]
        undo = f"ROLLBACK PREPARED '{gid}'" if family == "postgresql" else f"XA ROLLBACK '{gid}'"
        _run_raw(engine, hand)

        def clean_up() -> None:  # leave no prepared transaction behind in the shared test server
            cls("kv", url, "node-b").rollback(xid)
            _run_raw(engine, [undo])

        return clean_up

    return Kit(
        make=lambda node: cls("kv", url, node),
        write=lambda conn, k, v: conn.execute(text("INSERT INTO kv VALUES (:k, :v)"), {"k": k, "v": v}),
        read_only_work=lambda conn: conn.execute(text("SELECT count(*) FROM kv")).scalar(),
        committed=committed,
        prepare_foreign=prepare_foreign,
        # MariaDB prepares (and lists in XA RECOVER) a branch that only read; qtp cannot tell it wrote nothing.
        sees_reads=family == "postgresql",
    )


def _run_raw(engine: sqlalchemy.Engine, statements: list[str]) -> None:
    proxy = engine.raw_connection()
    raw = proxy.driver_connection
    if engine.dialect.name == "postgresql":
        raw.autocommit = True
    else:
        raw.autocommit(True)
    with raw.cursor() as cur:
        for sql in statements:
            cur.execute(sql)
    proxy.invalidate()


def _memory_kit() -> Kit:
    store = MemoryDatabase()

    def prepare_foreign() -> Callable[[], None]:
        other = MemoryResource("kv", "node-b", store)
        xid = Xid.of(Xid.new_gtrid("node-b"), "kv")
        other.begin(xid)
        other.connection(xid).put("foreign", 1)
        other.prepare(xid)
        return lambda: other.rollback(xid)

    return Kit(
        make=lambda node: MemoryResource("kv", node, store),
        write=lambda conn, k, v: conn.put(k, v),
        read_only_work=lambda conn: conn.get("nothing"),
        committed=lambda: dict(store.data),
        prepare_foreign=prepare_foreign,
    )


@pytest.fixture(params=["memory", "postgresql", "mariadb"])
def kit(request):
    if request.param == "memory":
        yield _memory_kit()
    elif request.param == "postgresql":
        yield _sql_kit(request.getfixturevalue("pg_db")(), PostgresResource)
    else:
        yield _sql_kit(request.getfixturevalue("maria_db")(), MySQLResource)


@pytest.fixture(autouse=True)
def _node():
    """A node id of its own per test: MariaDB's XA RECOVER lists the prepared branches of the whole server."""
    globals()["NODE"] = f"n-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def resource(kit):
    res = kit.make(NODE)
    yield res
    res.close()


def new_xid() -> Xid:
    return Xid.of(Xid.new_gtrid(NODE), "kv")


def test_one_phase_commit_makes_work_visible(kit, resource):
    xid = new_xid()
    resource.begin(xid)
    kit.write(resource.connection(xid), "a", 1)
    assert kit.committed() == {}
    resource.commit(xid, one_phase=True)
    assert kit.committed() == {"a": 1}
    assert resource.recover() == []


def test_prepared_branch_is_in_doubt_until_committed(kit, resource):
    xid = new_xid()
    resource.begin(xid)
    kit.write(resource.connection(xid), "a", 1)
    assert resource.prepare(xid) is Vote.YES
    assert kit.committed() == {}
    assert resource.recover() == [xid]
    resource.commit(xid)
    assert kit.committed() == {"a": 1}
    assert resource.recover() == []
    resource.commit(xid)  # idempotent
    assert kit.committed() == {"a": 1}


def test_prepared_branch_rolls_back_idempotently(kit, resource):
    xid = new_xid()
    resource.begin(xid)
    kit.write(resource.connection(xid), "a", 1)
    resource.prepare(xid)
    resource.rollback(xid)
    resource.rollback(xid)
    assert kit.committed() == {}
    assert resource.recover() == []


def test_active_branch_rolls_back(kit, resource):
    xid = new_xid()
    resource.begin(xid)
    kit.write(resource.connection(xid), "a", 1)
    resource.rollback(xid)
    assert kit.committed() == {}
    assert resource.recover() == []


def test_branch_that_ran_nothing_votes_read_only(kit, resource):
    xid = new_xid()
    resource.begin(xid)
    assert resource.prepare(xid) is Vote.READ_ONLY
    assert resource.recover() == []


def test_branch_that_only_read_votes_read_only_where_the_database_can_tell(kit, resource):
    xid = new_xid()
    resource.begin(xid)
    kit.read_only_work(resource.connection(xid))
    if kit.sees_reads:
        assert resource.prepare(xid) is Vote.READ_ONLY
        assert resource.recover() == []
    else:  # the safe answer: prepare it like any other branch
        assert resource.prepare(xid) is Vote.YES
        assert resource.recover() == [xid]
        resource.rollback(xid)


def test_prepared_branch_outlives_its_resource_object(kit):
    """What recovery relies on: a fresh process (new pool, new connections) finds and commits the branch."""
    first = kit.make(NODE)
    xid = new_xid()
    first.begin(xid)
    kit.write(first.connection(xid), "a", 7)
    first.prepare(xid)
    first.close()
    second = kit.make(NODE)
    assert second.recover() == [xid]
    second.commit(xid)
    assert kit.committed() == {"a": 7}
    second.close()


def test_recover_lists_only_this_nodes_qtp_branches(kit, resource):
    clean_up = kit.prepare_foreign()
    try:
        xid = new_xid()
        resource.begin(xid)
        kit.write(resource.connection(xid), "mine", 1)
        resource.prepare(xid)
        assert resource.recover() == [xid]
        resource.rollback(xid)
    finally:
        clean_up()


def test_connection_refuses_work_after_prepare(kit, resource):
    xid = new_xid()
    resource.begin(xid)
    conn = resource.connection(xid)
    kit.write(conn, "a", 1)
    resource.prepare(xid)
    with pytest.raises(ConnectionClosedError, match="has ended"):
        kit.write(conn, "b", 2)
    resource.rollback(xid)


def test_detach_leaves_a_prepared_branch_for_recovery_and_drops_an_active_one(kit, resource):
    prepared, active = new_xid(), new_xid()
    resource.begin(prepared)
    kit.write(resource.connection(prepared), "p", 1)
    resource.prepare(prepared)
    resource.begin(active)
    kit.write(resource.connection(active), "a", 2)
    resource.detach(prepared)
    resource.detach(active)
    assert resource.recover() == [prepared]
    assert kit.committed() == {}
    resource.commit(prepared)  # by xid, as recovery does
    assert kit.committed() == {"p": 1}
