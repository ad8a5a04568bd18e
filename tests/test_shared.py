"""Replicas that share the work ([lease] slots, qtp.wsrm.runtime._shared): real `qtp serve` processes of one
server node, each holding some of its slots, behind one proxy; judged from the databases."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from qtp.config import load_config
from qtp.embedded import free_port
from qtp.errors import ConfigurationError
from qtp.testing.lossy_proxy import LossyProxy
from qtp.testing.nodes import (NodeProcess, Pair, Replicas, check_exactly_once, client_schema, rows, server_schema,
                               wait_until)

TOOK_SLOT = re.compile(rb"took slot (\d+) of node")


def _share(config: Path, slots: int) -> None:
    """Turn a replica's [lease] (written by the harness) into one that shares the work in ``slots`` slots."""
    text = config.read_text()
    config.write_text(text.replace("\n[lease]\n", f"\n[lease]\nslots = {slots}\n", 1))


def _slots_of(node: NodeProcess) -> list[int]:
    """The slots ``node`` took, by its log (in order)."""
    return [int(k) for k in TOOK_SLOT.findall(node.said())]


def _serving(node: NodeProcess, timeout: float = 60.0) -> NodeProcess:
    node.launch()
    wait_until(node.serving, timeout, f"{node} serving")
    return node


def test_slots_are_refused_where_a_forwarded_request_could_not_be_vouched_for(tmp_path: Path) -> None:
    base = '[node]\nid = "s"\nendpoint = "http://127.0.0.1:1/rm"\nstore = "app"\n' \
           '[resources.app]\nurl = "postgresql://u@h/d"\n[lease]\nslots = 2\n'
    cases = {
        "peers": base + '[peers.c]\nsecret = "0123456789abcdef0123456789abcdef"\n',
        "no endpoint": base.replace('endpoint = "http://127.0.0.1:1/rm"\n', ""),
        "persistent": base.replace('store = "app"\n', 'store = "app"\nmode = "persistent"\n'),
        "too many": base.replace("slots = 2", "slots = 65"),
        "long id": base.replace('id = "s"', f'id = "{"n" * 29}"'),
    }
    for name, text in cases.items():
        path = tmp_path / f"{name.replace(' ', '-')}.toml"
        path.write_text(text)
        with pytest.raises(ConfigurationError):
            load_config(path)
    ok = tmp_path / "ok.toml"
    ok.write_text(base)
    assert load_config(ok).lease.slots == 2
    from qtp.coordinator import TransactionManager

    with pytest.raises(ConfigurationError, match="qtp.Node.from_config"):
        TransactionManager.from_config(ok)


def test_two_replicas_share_a_channels_lanes_and_one_takes_the_others_slot_when_it_dies(pg_db, maria_db,
                                                                                      tmp_path: Path) -> None:
    client_app, server_app = pg_db("client"), maria_db("server")
    client_schema(client_app)
    server_schema(server_app)
    pair = Pair(client_app, server_app, proxy_port=free_port(), reply=True, client_extra="lanes = 4\n")
    replicas = Replicas(pair, servers=2, clients=1, ttl=2)
    configs = replicas.write(tmp_path)
    for name in ("server-a", "server-b"):
        _share(configs[name], 2)
    a, b = (NodeProcess(configs[name], tmp_path / f"{name}.log", {"QTP_TEST_LOG": "INFO"}) for name in ("server-a", "server-b"))
    client = NodeProcess(configs["client"], tmp_path / "client.log",
                         {"QTP_TEST_SEND": "600", "QTP_TEST_RATE": "40", "QTP_TEST_ABORT_EVERY": "0",
                          "QTP_TEST_THREADS": "4", "QTP_TEST_KEYS": "1"})
    written_by = lambda node: rows(server_app, f"SELECT COUNT(*) FROM applied WHERE pid = {node.proc.pid}")[0][0]  # noqa: E731
    applied = lambda: rows(server_app, "SELECT COUNT(*) FROM applied")[0][0]  # noqa: E731
    # the proxy sends everything to server-a while it lives: server-b's slot is reached by forwarding
    with LossyProxy(replicas.urls("server"), port=pair.proxy_port, failover_s=1):
        try:
            _serving(a)
            wait_until(lambda: _slots_of(a) == [0, 1], 30, "server-a holding both slots alone")
            _serving(b)
            wait_until(lambda: len(_slots_of(b)) == 1, 30, "server-b taking one slot from server-a")
            client.start()
            wait_until(lambda: written_by(a) >= 20 and written_by(b) >= 20, 90, "both replicas applying orders")
            mine = set(rows(server_app, f"SELECT DISTINCT seq FROM applied WHERE pid = {b.proc.pid}"))
            theirs = set(rows(server_app, f"SELECT DISTINCT seq FROM applied WHERE pid = {a.proc.pid}"))
            assert mine and theirs and not mine & theirs  # a sequence is worked by one replica
            b.kill()
            wait_until(lambda: _slots_of(a).count(_slots_of(b)[0]) == 2, 30, "server-a taking server-b's slot")
            wait_until(lambda: applied() >= 600, 180, "every order applied")
            wait_until(lambda: rows(client_app, "SELECT COUNT(*) FROM replies")[0][0] >= 600, 120, "every reply")
        finally:
            for node in (client, a, b):
                node.kill()
    check_exactly_once(client_app, server_app, reply=True)
