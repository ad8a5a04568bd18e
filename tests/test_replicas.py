"""The harness for a node run as several replicas (qtp.testing.nodes): their configs, and the node processes'
roles, pause and resume."""

from __future__ import annotations

import socket
import tomllib
from pathlib import Path

import pytest
import requests

from qtp.embedded import free_port
from qtp.testing.nodes import NodeProcess, Pair, Replicas, server_schema


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
