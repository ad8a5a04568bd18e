"""One node, several processes: the lease, the fence, the standby (qtp.coordinator._lease), on real databases.

Two transaction managers with the same node id and separate log folders (two hosts' worth) share one set
of databases, as two replicas of a node do. The issue's problem is reproduced first: without a lease the
second one's start-up recovery rolls back the first one's live prepared branch, and the first then commits
its last resource: half a transaction. With ``[lease]`` the second waits (or refuses), and a first one that
lost its lease (paused past it) has its commit refused by the fence, in the database itself.
"""

from __future__ import annotations

import math
import threading
import time

import pytest
import sqlalchemy
from sqlalchemy import text

import qtp
from qtp.config import LeaseSettings, load_config
from qtp.coordinator import failpoints
from qtp.coordinator._lease import FENCE_TABLE, read_lease
from qtp.errors import ConfigurationError, FencedError, LeaseHeldError, RollbackError
from qtp.xa import MemoryResource

from test_coordinator import BALANCE, balances, make_accounts, prepared_left

NODE = "leased-node"


def manager(tmp_path, host: str, dbs, lease: LeaseSettings | None, **kw) -> qtp.TransactionManager:
    """A manager of node NODE with its own log folder (``host``), resources "a" and "b" on ``dbs``."""
    tm = qtp.TransactionManager(NODE, tmp_path / host / "logs", recovery_interval=None, lease=lease, **kw)
    tm.add_resource("a", dbs[0].url)
    tm.add_resource("b", dbs[1].url, last_resource=True)
    return tm


@pytest.fixture(params=["pg+pg", "pg+mariadb"])
def dbs(request, pg_db, maria_db):
    """Accounts in "a" (PostgreSQL, the lease's database) and "b" (the last resource, whose COMMIT is fenced)."""
    return make_accounts(pg_db("a")), make_accounts((maria_db if request.param.endswith("mariadb") else pg_db)("b"))


@pytest.fixture
def closing():
    made: list = []
    yield made.append
    for tm in made:
        tm.close(drain_s=0)


def transfer_in_thread(tm, amount: int, outcome: dict) -> threading.Thread:
    def run():
        try:
            with tm.transaction() as tx:
                tx.connection("a").execute(text("UPDATE accounts SET balance = balance - :x WHERE id = 1"),
                                           {"x": amount})
                tx.connection("b").execute(text("UPDATE accounts SET balance = balance + :x WHERE id = 1"),
                                           {"x": amount})
            outcome["result"] = "committed"
        except Exception as exc:  # noqa: BLE001 - the test looks at what it was
            outcome["result"] = exc
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def wait_prepared(engine, count: int = 1) -> None:
    deadline = time.monotonic() + 10
    while prepared_left(engine) < count:
        assert time.monotonic() < deadline, "the branch was never prepared"
        time.sleep(0.02)


@pytest.fixture
def paused_before_last_commit():
    """Every transaction waits 3 s between its prepares and its last resource's COMMIT (a process paused
    there, as by SIGSTOP)."""
    failpoints.configure("llr_before_last_commit=delay:3000")
    yield
    failpoints.configure(None)


def test_without_a_lease_a_second_process_rolls_back_the_first_ones_live_branch(
        tmp_path, dbs, closing, paused_before_last_commit):
    """The problem, as it is without [lease]: half a transaction commits. (The second host has run the node
    before: on a first start its empty log folder would quarantine what it finds instead.)"""
    a, b = dbs
    earlier = manager(tmp_path, "host-2", dbs, None)
    earlier.start_recovery()
    earlier.close()
    first = manager(tmp_path, "host-1", dbs, None)
    closing(first)
    first.start_recovery()
    outcome: dict = {}
    thread = transfer_in_thread(first, 10, outcome)
    wait_prepared(a)  # "a" is prepared; "b" (the last resource) commits after the pause
    second = manager(tmp_path, "host-2", dbs, None)
    closing(second)
    report = second.start_recovery()  # presumed abort: it takes the first one's live branch for a leftover
    assert report.rolled_back == 1
    thread.join()
    assert outcome["result"] == "committed"
    assert balances(a)[1] == BALANCE and balances(b)[1] == BALANCE + 10  # money made from nothing


def test_a_second_process_waits_as_a_standby_and_takes_over_when_the_owner_closes(tmp_path, dbs, closing):
    lease = LeaseSettings(resource="a", ttl=2.0)
    first = manager(tmp_path, "host-1", dbs, lease)
    closing(first)
    first.start_recovery()
    assert first.lease.owner and first.lease.epoch == 1
    refusing = manager(tmp_path, "host-3", dbs, LeaseSettings(resource="a", ttl=2.0, standby="refuse"))
    closing(refusing)
    with pytest.raises(LeaseHeldError, match="is owned by"):
        refusing.start_recovery()
    second = manager(tmp_path, "host-2", dbs, lease)
    closing(second)
    took: dict = {}
    waiter = threading.Thread(target=lambda: took.setdefault("report", second.start_recovery()))
    waiter.start()
    time.sleep(1.0)
    assert waiter.is_alive() and second.lease is None  # still waiting: the owner renews
    view = read_lease(first.resource("a").url, NODE)
    assert view.holder == first.lease.member and {m["role"] for m in view.members} >= {"owner", "standby"}
    closed = time.monotonic()
    first.close()  # a clean close marks the owner gone: no waiting for the lease to expire
    waiter.join(timeout=10)
    assert not waiter.is_alive() and second.lease.owner and second.lease.epoch == 2
    assert time.monotonic() - closed < 1.5
    with second.transaction() as tx:
        tx.connection("a").execute(text("UPDATE accounts SET balance = balance - 1 WHERE id = 1"))
    assert balances(dbs[0])[1] == BALANCE - 1


@pytest.mark.parametrize("trust", ["own clock", "database only"])
def test_an_owner_paused_past_its_lease_cannot_commit_after_the_takeover(
        tmp_path, dbs, closing, paused_before_last_commit, trust, monkeypatch):
    """The same race as the first test, with [lease]: the standby takes over only once the owner's lease
    expired, recovers its prepared branch (presumed abort), and the owner's late COMMIT is refused. "database
    only": the owner's own clock is made to believe it still holds the lease, and the database's limit on idle
    transactions (which ends the paused owner's sessions) is off, so that only the fence row refuses the
    commit."""
    a, b = dbs
    if trust == "database only":
        monkeypatch.setattr("qtp.coordinator._manager.limit_idle", lambda engine, ttl: None)
    lease = LeaseSettings(resource="a", ttl=1.0)
    first = manager(tmp_path, "host-1", dbs, lease)
    closing(first)
    first.start_recovery()
    outcome: dict = {}
    thread = transfer_in_thread(first, 10, outcome)
    wait_prepared(a)
    first.lease._stop.set()  # paused: it renews no more
    if trust == "database only":
        first.lease._valid_until = math.inf
    second = manager(tmp_path, "host-2", dbs, lease)
    closing(second)
    report = second.start_recovery()  # waits until the first one's lease expired
    assert second.lease.epoch == 2 and report.rolled_back == 1
    thread.join()
    assert isinstance(outcome["result"], RollbackError) and isinstance(outcome["result"].__cause__, FencedError)
    assert balances(a)[1] == BALANCE and balances(b)[1] == BALANCE  # nothing of it anywhere
    assert prepared_left(a) == 0


def test_a_store_transaction_of_a_fenced_process_is_rolled_back(tmp_path, dbs, closing):
    """What the messaging stores' own transactions do: the fence before their COMMIT."""
    lease = LeaseSettings(resource="a", ttl=1.0)
    first = manager(tmp_path, "host-1", dbs, lease)
    closing(first)
    first.start_recovery()
    engine = sqlalchemy.create_engine(dbs[0].url)
    family = "postgresql"

    def write(amount):
        with engine.begin() as conn:
            conn.execute(text("UPDATE accounts SET balance = balance + :x WHERE id = 2"), {"x": amount})
            first.fence(conn.connection.dbapi_connection, family)

    write(5)
    first.lease._stop.set()
    first.lease._valid_until = math.inf
    second = manager(tmp_path, "host-2", dbs, lease)
    closing(second)
    second.start_recovery()
    with pytest.raises(FencedError, match="another process took the node over"):
        write(7)
    assert balances(dbs[0])[2] == BALANCE + 5
    with engine.connect() as conn:
        assert conn.execute(text(f"SELECT epoch FROM {FENCE_TABLE}")).scalar() == 2
    engine.dispose()


def test_an_owner_notices_the_loss_and_refuses_new_transactions(tmp_path, dbs, closing):
    lease = LeaseSettings(resource="a", ttl=1.0, renew=0.2)
    lost: list = []
    first = manager(tmp_path, "host-1", dbs, lease)
    closing(first)
    first.start_recovery()
    first.lease.on_lost = lost.append
    with _paused(first):
        second = manager(tmp_path, "host-2", dbs, lease)
        closing(second)
        second.start_recovery()
    first.lease.lost.wait(5)
    assert lost and "holds it at epoch 2" in lost[0]
    with pytest.raises(FencedError, match="lost the node's lease"):
        first.begin()


class _paused:
    """The owner's renewals stop (as in a SIGSTOP) inside the block and start again after it."""

    def __init__(self, tm):
        self.lease = tm.lease

    def __enter__(self):
        self.lease._stop.set()
        self.lease._thread.join()

    def __exit__(self, *exc):
        self.lease._stop.clear()
        self.lease._start_renewing()


def test_configurations_that_cannot_be_taken_over_are_refused(tmp_path, dbs, closing):
    tm = manager(tmp_path, "host-1", dbs, LeaseSettings(resource="a", ttl=2.0), llr=False)
    closing(tm)
    with pytest.raises(ConfigurationError, match="llr = true"):
        tm.start_recovery()
    tm = qtp.TransactionManager("mem-node", tmp_path / "m", recovery_interval=None, lease=LeaseSettings(resource="a"))
    closing(tm)
    tm.add_resource("a", dbs[0].url)
    tm.add_resource("mem", MemoryResource("mem", "mem-node"))
    with pytest.raises(ConfigurationError, match="every resource to be a SQL database"):
        tm.start_recovery()
    config = tmp_path / "q.toml"
    for table, message in [("[lease]\nttl = 0.1\n", "ttl must be between"),
                           ("[lease]\nstandby = \"maybe\"\n", "standby must be"),
                           ("[lease]\nresource = \"nope\"\n", "is not one of"),
                           ("[lease]\nttl = 4\nrenew = 3\n", "renew must be"),
                           ("[lease]\n[coupled]\nx = 1\n", "not supported"),
                           ("[lease]\n[channels.c]\npeer = \"http://x/rm\"\nmode = \"memory\"\n",
                            "memory.*channels.c")]:
        config.write_text(f"[node]\nid = \"n\"\n[resources.app]\nurl = \"{dbs[0].url}\"\n{table}")
        with pytest.raises(ConfigurationError, match=message):
            load_config(config)
    config.write_text(f"[node]\nid = \"n\"\nstore = \"app\"\n[resources.app]\nurl = \"{dbs[0].url}\"\n[lease]\nttl = 3\n")
    assert load_config(config).lease == LeaseSettings(resource="app", ttl=3.0)


def config_file(tmp_path, host: str, dbs, ttl: float = 2.0):
    """The qtp.toml of one replica (its own log folder) of node NODE."""
    path = tmp_path / f"{host}.toml"
    path.write_text(f'[node]\nid = "{NODE}"\nlog_dir = "{tmp_path / host / "logs"}"\nstore = "a"\n'
                    f'[resources.a]\nurl = "{dbs[0].url}"\n[resources.b]\nurl = "{dbs[1].url}"\n'
                    f'[lease]\nresource = "a"\nttl = {ttl}\n[recovery]\ninterval = 0\n')
    return path


def test_status_shows_the_owner_and_standbys_and_recover_refuses_beside_a_live_owner(tmp_path, dbs, closing):
    from qtp.recovery._node import node_status, recover_node
    from qtp.status_cli import render_lease

    config = load_config(config_file(tmp_path, "host-1", dbs))
    first = qtp.TransactionManager.from_config(config_file(tmp_path, "host-1", dbs))
    closing(first)
    status = node_status(config)
    assert status.lease["holder"] == first.lease.member and status.lease["epoch"] == 1
    assert status.lease["expires_in_s"] > 0 and not any("no process owns" in w for w in status.warnings)
    assert f"lease: owner {first.lease.member}, epoch 1" in render_lease(status.lease)
    with pytest.raises(qtp.errors.LiveManagerError, match="a live process owns it"):
        recover_node(load_config(config_file(tmp_path, "host-2", dbs)))
    first.close()
    status = node_status(config)
    assert any("no process owns it now" in w for w in status.warnings)
    assert {m["role"] for m in status.lease["members"]} == {"left"}
    report = recover_node(load_config(config_file(tmp_path, "host-2", dbs)))  # the owner is gone: it may act
    assert report.ok
    after = node_status(config).lease
    assert after["epoch"] == 2 and after["expires_in_s"] is None  # taken for the pass, then released


def test_metrics_show_the_lease(tmp_path, dbs, closing):
    from qtp.wsrm.runtime._settings import NodeSettings

    tm = manager(tmp_path, "host-1", dbs, LeaseSettings(resource="a", ttl=2.0))
    closing(tm)
    tm.start_recovery()
    node = qtp.Node(tm, NodeSettings(store="a"))
    text_ = node.metrics.exposition()[0].decode()
    assert f'qtp_lease_held{{member="{tm.lease.member}",node="{NODE}"}} 1.0' in text_
    assert f'qtp_lease_epoch{{node="{NODE}"}} 1.0' in text_ and "qtp_lease_renewed_seconds_ago" in text_
    with pytest.raises(ConfigurationError, match="cannot take over what is in memory"):
        qtp.Node(tm, NodeSettings(mode="memory"))


def test_an_application_transaction_may_idle_longer_than_the_lease_within_its_timeout(tmp_path, dbs, closing):
    """The database ends a leased node's idle transactions only after the transaction timeout (outside
    finding: with the limit at ttl, a handler slower than ttl was ended at every attempt, for ever)."""
    tm = manager(tmp_path, "host-1", dbs, LeaseSettings(resource="a", ttl=1.0), timeout=30)
    closing(tm)
    tm.start_recovery()
    with tm.transaction() as tx:
        tx.connection("a").execute(text("UPDATE accounts SET balance = balance - 3 WHERE id = 1"))
        tx.connection("b").execute(text("UPDATE accounts SET balance = balance + 3 WHERE id = 1"))
        time.sleep(2.5)  # idle in both branches, past the lease's ttl
        tx.connection("a").execute(text("UPDATE accounts SET balance = balance - 1 WHERE id = 2"))
    assert balances(dbs[0]) == {1: BALANCE - 3, 2: BALANCE - 1} and balances(dbs[1])[1] == BALANCE + 3


def test_a_standby_stopped_by_sigterm_is_marked_gone(tmp_path, dbs, closing):
    """Outside finding: SIGTERM killed a waiting `qtp serve` where it stood, and `qtp status` went on listing
    it as a live standby."""
    import os
    import signal
    import subprocess
    import sys

    first = qtp.TransactionManager.from_config(config_file(tmp_path, "host-1", dbs, ttl=5.0))
    closing(first)
    standby = subprocess.Popen([sys.executable, "-m", "qtp", "serve", "--config",
                                str(config_file(tmp_path, "host-2", dbs, ttl=5.0))],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        def roles():
            return {m["role"] for m in read_lease(first.resource("a").url, NODE).members
                    if m["member"] != first.lease.member}
        deadline = time.monotonic() + 60
        while roles() != {"standby"}:
            assert time.monotonic() < deadline and standby.poll() is None, standby.stdout.read().decode()[-2000:]
            time.sleep(0.1)
        os.kill(standby.pid, signal.SIGTERM)
        assert standby.wait(30) == 128 + signal.SIGTERM
        assert roles() == {"left"}
    finally:
        standby.kill()
        standby.wait()


@pytest.fixture(scope="module")
def binlog_maria(tmp_path_factory):
    from embedded_support import discard
    from qtp.embedded import EmbeddedMariaDB

    server = EmbeddedMariaDB(tmp_path_factory.mktemp("lease-binlog"), binlog=True)
    server.start()
    yield server
    discard(server)


def test_a_lease_over_databases_that_cannot_hold_a_decision_is_refused_at_start(tmp_path, binlog_maria, closing):
    """Outside finding: with MariaDB's binary log on in every resource, the node started and then rolled back
    every two-phase commit, for ever."""
    a, b = make_accounts(binlog_maria.create_database("la")), make_accounts(binlog_maria.create_database("lb"))
    tm = manager(tmp_path, "host-1", (a, b), LeaseSettings(resource="a"))
    closing(tm)
    with pytest.raises(ConfigurationError, match="needs a database that can hold commit decisions"):
        tm.start_recovery()
    assert tm.lease is None


def test_recover_beside_a_standby_of_this_host_names_the_owner(tmp_path, dbs, closing):
    """Outside re-check: `qtp recover` with a waiting standby's file blamed that standby's "transaction manager"
    for holding the log and did not say who owns the node."""
    from qtp.recovery._node import recover_node

    first = qtp.TransactionManager.from_config(config_file(tmp_path, "host-1", dbs, ttl=5.0))
    closing(first)
    standby = qtp.TransactionManager(NODE, tmp_path / "host-2" / "logs", recovery_interval=None,
                                     lease=LeaseSettings(resource="a", ttl=5.0))
    closing(standby)  # it holds its log folder's lock from here on, as a waiting `qtp serve` does
    with pytest.raises(qtp.errors.LiveManagerError, match=f"owner is {first.lease.member} \\(epoch 1\\)"):
        recover_node(load_config(config_file(tmp_path, "host-2", dbs, ttl=5.0)))
