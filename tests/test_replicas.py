"""The harness for a node run as several replicas (qtp.testing.nodes): their configs (owner and standbys, or
sharing the work in slots), the node processes' roles, pause and resume, and a replicated server behind a
failover proxy (qtp.testing.lossy_proxy) taking over from a killed owner and from a paused one, which exits 75
without writing."""

from __future__ import annotations

import socket
import tomllib
from pathlib import Path

import pytest
import requests

from qtp.embedded import free_port
from qtp.testing.lossy_proxy import LossyProxy
from qtp.testing.nodes import (LOST_LEASE_LINE, LOST_LEASE_STATUS, TOOK_OVER_LINE, NodeProcess, Pair, Replicas,
                               applied_id_mark, balanced, check_exactly_once, client_schema, rows, server_schema,
                               wait_until)


def _read(path: Path) -> dict:
    return tomllib.loads(path.read_text())


def _without_own(config: dict) -> dict:
    """The config but for what each replica has of its own."""
    node = {k: v for k, v in config["node"].items() if k not in ("log_dir", "listen")}
    return {**config, "node": node}


def test_replicas_share_a_config_but_for_log_dir_and_listen_and_are_reached_through_proxies(tmp_path: Path) -> None:
    pair = Pair("postgresql://u@127.0.0.1/c", "mysql+pymysql://u@127.0.0.1/s", reply=True,
                proxy_port=free_port(), back_proxy_port=free_port())
    replicas = Replicas(pair, servers=3, clients=2, ttl=2.5)
    configs = {name: _read(path) for name, path in replicas.write(tmp_path).items()}
    assert sorted(configs) == ["client-a", "client-b", "server-a", "server-b", "server-c"]
    for role, endpoint in (("server", pair.proxy_port), ("client", pair.back_proxy_port)):
        names = replicas.names(role)
        own = [(configs[n]["node"]["log_dir"], configs[n]["node"]["listen"]) for n in names]
        assert own == [(str(tmp_path / f"logs-{n}"), f"127.0.0.1:{replicas.ports[n]}") for n in names]
        assert replicas.urls(role) == [f"http://{listen}" for _, listen in own]
        assert all(_without_own(configs[n]) == _without_own(configs[names[0]]) for n in names)
        assert configs[names[0]]["node"]["endpoint"] == f"http://127.0.0.1:{endpoint}/rm"
        assert configs[names[0]]["lease"] == {"ttl": 2.5, "standby": "wait"}
    assert configs["client-a"]["channels"]["orders"]["peer"] == f"http://127.0.0.1:{pair.proxy_port}/rm"
    assert len(set(replicas.ports.values())) == 5


def test_server_replicas_with_slots_share_the_work_behind_a_round_robin_proxy(tmp_path: Path) -> None:
    pair = Pair("postgresql://u@127.0.0.1/c", "mysql+pymysql://u@127.0.0.1/s",
                proxy_port=free_port(), back_proxy_port=free_port())
    replicas = Replicas(pair, servers=2, clients=2, ttl=3, slots=4)
    paths = replicas.write(tmp_path)
    configs = {name: _read(path) for name, path in paths.items()}
    assert configs["server-a"]["lease"] == configs["server-b"]["lease"] == {"ttl": 3, "slots": 4}
    assert configs["client-a"]["lease"] == {"ttl": 3, "standby": "wait"}      # the client: owner and standby
    assert _without_own(configs["server-a"]) == _without_own(configs["server-b"])
    assert configs["server-b"]["node"]["endpoint"] == f"http://127.0.0.1:{pair.proxy_port}/rm"
    assert (replicas.balance("server"), replicas.balance("client")) == ("round-robin", "failover")
    assert [NodeProcess(paths[n], tmp_path / f"{n}.log").slots for n in ("server-a", "client-a")] == [4, 1]
    (tmp_path / "server-a.log").write_text("took slot 0 of node server-x (epoch 1); this process holds slots [0]\n"
                                           "took slot 3 of node server-x (epoch 2); ... holds slots [0, 3]\n"
                                           "node server-x: this process gives slot 0 back: its lease was lost\n")
    logged = NodeProcess(paths["server-a"], tmp_path / "server-a.log")
    assert (logged.slots_taken(), logged.slots_given_back(), logged.slots_held()) == ([0, 3], [0], [3])
    other = NodeProcess(paths["server-b"], tmp_path / "server-b.log")
    (tmp_path / "server-b.log").write_text("took slot 0 of node server-x (epoch 3); ... holds slots [0]\n")
    with pytest.raises(AssertionError, match="sharing 4 slots"):     # slots 1 and 2 held by nobody
        balanced([logged, other], timeout=0.3)
    with open(tmp_path / "server-b.log", "a") as log:
        log.write("took slot 1 of node server-x (epoch 1); ...\ntook slot 2 of node server-x (epoch 1); ...\n")
    assert balanced([logged, other], timeout=5) < 5
    assert Replicas(pair, servers=2, clients=2).balance("server") == "failover"
    (tmp_path / "one").mkdir()
    one = Replicas(pair, servers=1, clients=1, slots=2).write(tmp_path / "one")   # one process holds every slot
    assert _read(one["server"])["lease"] == {"ttl": 10, "slots": 2} and "lease" not in _read(one["client"])


def test_one_replica_is_the_pair_as_it_was(tmp_path: Path) -> None:
    pair = Pair("postgresql://u@127.0.0.1/c", "mysql+pymysql://u@127.0.0.1/s", proxy_port=free_port())
    client, server = (path.read_text() for path in pair.write(tmp_path))
    configs = Replicas(pair, servers=1, clients=1).write(tmp_path)
    assert {name: path.read_text() for name, path in configs.items()} == {"client": client, "server": server}
    assert "[lease]" not in client + server
    with pytest.raises(ValueError, match="through a proxy"):
        Replicas(Pair("postgresql://u@127.0.0.1/c", "postgresql://u@127.0.0.1/s"), servers=2, clients=1)


def test_a_paused_node_holds_its_port_but_answers_nothing_until_resumed(pg_db, tmp_path: Path) -> None:
    server_app = pg_db("server")
    server_schema(server_app)
    pair = Pair(pg_db("client"), server_app)
    _, server_config = pair.write(tmp_path)
    node = NodeProcess(server_config, tmp_path / "server.log")
    try:
        assert node.start().role() == "owner"
        node.pause()
        assert node.role() == "paused"
        with socket.create_connection(("127.0.0.1", node.port), timeout=5):
            pass                                        # the kernel still accepts for it
        with pytest.raises(requests.Timeout):
            requests.get(f"http://127.0.0.1:{node.port}/health", timeout=1)
        node.resume()
        assert node.role() == "owner"
        node.kill()
        assert (node.role(), node.wait_exit(5)) == ("dead", -9)
    finally:
        node.kill()


def test_a_standby_takes_over_from_a_killed_owner_and_from_a_paused_one_which_exits_75(pg_db, maria_db,
                                                                                       tmp_path: Path) -> None:
    client_app, server_app = pg_db("client"), maria_db("server")
    client_schema(client_app)
    server_schema(server_app)
    pair = Pair(client_app, server_app, proxy_port=free_port())
    replicas = Replicas(pair, servers=2, clients=1, ttl=2)
    configs = replicas.write(tmp_path)
    a, b = (NodeProcess(configs[name], tmp_path / f"{name}.log") for name in ("server-a", "server-b"))
    client = NodeProcess(configs["client"], tmp_path / "client.log",
                         {"QTP_TEST_SEND": "500", "QTP_TEST_RATE": "25", "QTP_TEST_ABORT_EVERY": "0"})
    applied = lambda: rows(server_app, "SELECT COUNT(*) FROM applied")[0][0]  # noqa: E731
    written_by = lambda node, after=0: rows(  # noqa: E731
        server_app, f"SELECT COUNT(*) FROM applied WHERE pid = {node.proc.pid} AND id > {after}")[0][0]
    with LossyProxy(replicas.urls("server"), port=pair.proxy_port, failover_s=1) as proxy:
        try:
            assert (a.start_replica().role(), b.start_replica().role()) == ("owner", "standby")
            client.start()
            wait_until(lambda: applied() >= 10, 60, "orders applied by the first owner")
            first = a.proc.pid
            a.kill()
            wait_until(lambda: b.role() == "owner", 30, "server-b taking over")
            assert a.start_replica().role() == "standby"
            wait_until(lambda: written_by(b) > 0, 60, "orders applied by server-b")
            b.pause()
            wait_until(lambda: TOOK_OVER_LINE in a.said(), 30, "server-a taking over from the paused server-b")
            mark = applied_id_mark(server_app)
            b.resume()
            assert b.wait_exit(30) == LOST_LEASE_STATUS and LOST_LEASE_LINE in b.said()
            # 20 s of orders: the client still sends after the pause, whatever the load (with 4 s of them a
            # loaded machine had everything applied by server-b before it, and nothing left for server-a)
            wait_until(lambda: written_by(a) > 0, 60, "orders applied by server-a after the pause")
            wait_until(lambda: applied() >= 500, 180, "every order applied")
        finally:
            for node in (client, a, b):
                node.kill()
        counts = proxy.stats()
    check_exactly_once(client_app, server_app, reply=False)
    assert written_by(b, after=mark) == 0
    assert {pid for (pid,) in rows(server_app, "SELECT DISTINCT pid FROM applied")} == {first, b.proc.pid, a.proc.pid}
    # the proxy moved off the killed owner (the client was still sending then); after the pause the new
    # owner may find everything already sent and apply it from the store, with no request to move for
    assert counts["switches"] >= 1


@pytest.mark.parametrize("db", ["pg", "mariadb"])
def test_written_after_counts_only_what_a_process_inserted_after_the_mark(db, pg_db, maria_db) -> None:
    """The campaign's check that a paused client wrote nothing after its takeover (nodes.written_after)."""
    import time

    from qtp.testing.nodes import clock_mark, create, written_after

    url = (pg_db if db == "pg" else maria_db)("client")
    client_schema(url)
    create(url, "INSERT INTO orders (k, pid) VALUES (1, 4242)")
    create(url, "INSERT INTO replies (k, kind, pid) VALUES (1, 'reply', 4242)")
    time.sleep(0.01)
    mark = clock_mark(url)
    assert written_after(url, 4242, mark) == 0
    time.sleep(0.01)
    create(url, "INSERT INTO orders (k, pid) VALUES (2, 4242)")
    create(url, "INSERT INTO orders (k, pid) VALUES (3, 4343)")
    create(url, "INSERT INTO replies (k, kind, pid) VALUES (2, 'reply', 4242)")
    assert written_after(url, 4242, mark) == 2 and written_after(url, 4343, mark) == 1
