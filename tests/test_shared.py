"""Replicas that share the work ([lease] slots, qtp.wsrm.runtime._shared): real `qtp serve` processes of one
server node, each holding some of its slots, behind one proxy; judged from the databases."""

from __future__ import annotations

import concurrent.futures
import re
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import requests

from qtp.config import load_config
from qtp.embedded import free_port
from qtp.errors import ConfigurationError
from qtp.testing.lossy_proxy import LossyProxy
from qtp.testing.nodes import (NodeProcess, Pair, Replicas, applied_id_mark, check_exactly_once, client_schema, counter,
                               create, rows, server_schema, wait_until)

TOOK_SLOT = re.compile(rb"took slot (\d+) of node")


def _share(config: Path, slots: int) -> None:
    """Turn one replica's [lease] (written by the harness without slots) into one that shares the work in
    ``slots`` slots: for replicas of one node with different files (``Replicas(slots=)`` gives them all one)."""
    text = config.read_text()
    config.write_text(text.replace("\n[lease]\n", f"\n[lease]\nslots = {slots}\n", 1))


def _slots_of(node: NodeProcess) -> list[int]:
    """The slots ``node`` took, by its log (in order)."""
    return [int(k) for k in TOOK_SLOT.findall(node.said())]


def _serving(node: NodeProcess, timeout: float = 60.0) -> NodeProcess:
    node.launch()
    wait_until(node.serving, timeout, f"{node} serving")
    return node


def test_slots_are_refused_with_tls_without_an_endpoint_outside_xa_and_beyond_the_limits(tmp_path: Path) -> None:
    base = '[node]\nid = "s"\nendpoint = "http://127.0.0.1:1/rm"\nstore = "app"\n' \
           '[resources.app]\nurl = "postgresql://u@h/d"\n[lease]\nslots = 2\n'
    cases = {
        "tls": base.replace('endpoint = "http://127.0.0.1:1/rm"', 'endpoint = "https://127.0.0.1:1/rm"\n'
                                                                  'tls_cert = "c.pem"\ntls_key = "k.pem"'),
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
    # outside finding: with one HTTP thread, two replicas forwarding to each other waited on each other
    from qtp.wsrm.runtime._shared import SharedNode

    one = tmp_path / "one-thread.toml"
    one.write_text(base + "[limits]\nhttp_threads = 1\n")
    with pytest.raises(ConfigurationError, match="http_threads"):
        SharedNode(one)
    from qtp.coordinator import TransactionManager

    with pytest.raises(ConfigurationError, match="qtp.Node.from_config"):
        TransactionManager.from_config(ok)


def _one_slot_each(a: NodeProcess, b: NodeProcess) -> None:
    """Start replica ``a`` (it takes both slots), then ``b`` (it gets one of them)."""
    _serving(a)
    wait_until(lambda: len(_slots_of(a)) == 2, 30, "server-a holding both slots")
    _serving(b)
    wait_until(lambda: len(_slots_of(b)) == 1, 30, "server-b taking a slot")


def _replying_pair(pg_db: Any, maria_db: Any, tmp_path: Path) -> tuple[str, str, Pair, Replicas, NodeProcess,
                                                                     NodeProcess, NodeProcess]:
    """A request-reply pair whose server runs as two replicas sharing 2 slots, and a client sending 600
    orders at 40/s from 4 threads over 4 lanes: (client_app, server_app, pair, replicas, a, b, client)."""
    client_app, server_app = pg_db("client"), maria_db("server")
    client_schema(client_app)
    server_schema(server_app)
    pair = Pair(client_app, server_app, proxy_port=free_port(), reply=True, client_extra="lanes = 4\n")
    replicas = Replicas(pair, servers=2, clients=1, ttl=2, slots=2)
    configs = replicas.write(tmp_path)
    a, b = (NodeProcess(configs[name], tmp_path / f"{name}.log", {"QTP_TEST_LOG": "INFO"})
            for name in ("server-a", "server-b"))
    client = NodeProcess(configs["client"], tmp_path / "client.log",
                         {"QTP_TEST_SEND": "600", "QTP_TEST_RATE": "40", "QTP_TEST_ABORT_EVERY": "0",
                          "QTP_TEST_THREADS": "4", "QTP_TEST_KEYS": "1"})
    return client_app, server_app, pair, replicas, a, b, client


def test_two_replicas_share_a_channels_lanes_and_one_takes_the_others_slot_when_it_dies(pg_db, maria_db,
                                                                                      tmp_path: Path) -> None:
    client_app, server_app, pair, replicas, a, b, client = _replying_pair(pg_db, maria_db, tmp_path)
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
            # /metrics of a replica: each slot it holds, labelled; a 503 for a slot nobody holds is a SOAP fault
            metrics = requests.get(f"http://127.0.0.1:{replicas.ports['server-a']}/metrics", timeout=10).text
            assert {int(k) for k in re.findall(r'qtp_messages_delivered_total\{[^}]*slot="(\d+)"', metrics)} == \
                set(_slots_of(a)) - set(_slots_of(b))
            b.kill()
            wait_until(lambda: _slots_of(a).count(_slots_of(b)[0]) == 2, 30, "server-a taking server-b's slot")
            wait_until(lambda: applied() >= 600, 180, "every order applied")
            wait_until(lambda: rows(client_app, "SELECT COUNT(*) FROM replies")[0][0] >= 600, 120, "every reply")
        finally:
            for node in (client, a, b):
                node.kill()
    check_exactly_once(client_app, server_app, reply=True)


def test_status_and_recover_act_on_each_slot_and_recover_refuses_beside_a_live_replica(pg_db, tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    server_app = pg_db("server")
    server_schema(server_app)
    pair = Pair(pg_db("client"), server_app, proxy_port=free_port())
    configs = Replicas(pair, servers=2, clients=1, ttl=1).write(tmp_path)
    _share(configs["server-a"], 2)
    qtp = lambda *args: subprocess.run([sys.executable, "-m", "qtp", *args, "--config", str(configs["server-a"])],  # noqa: E731
                                       capture_output=True, text=True, timeout=120)
    a = NodeProcess(configs["server-a"], tmp_path / "server-a.log")
    # a replica killed long ago left its row (a clean close deletes it): the replicas prune it; another node's stays
    from qtp.wsrm.runtime._shared import REPLICA_DDL

    node_id = load_config(configs["server-a"]).node_id
    create(server_app, REPLICA_DDL)
    for node, member in ((node_id, "killed-long-ago"), ("another-node", "killed-long-ago")):
        create(server_app, "INSERT INTO qtp_node_replica (node_id, member, address, boot, slots, ready, seen_at, "
                         f"expires_at) VALUES ('{node}', '{member}', 'http://x/rm', 'b', 2, 1, 0, 1)")
    try:
        _serving(a)
        wait_until(lambda: _slots_of(a) == [0, 1], 30, "server-a holding both slots")
        assert rows(server_app, "SELECT node_id FROM qtp_node_replica WHERE member = 'killed-long-ago'") == \
            [("another-node",)]
        shown = qtp("status", "--json")
        statuses = json.loads(shown.stdout)
        assert [s["node_id"] for s in statuses] == [f"{load_config(configs['server-a']).node_id}.s{k}" for k in (0, 1)]
        member = re.search(rb"this process \(([^)]+)\) took over", a.said()).group(1).decode()
        assert [s["lease"]["holder"] for s in statuses] == [member, member]
        refused = qtp("recover")
        assert refused.returncode == 3 and "will not act beside it" in refused.stderr
        a.kill()
        time.sleep(1.5)  # past the slots' ttl
        done = qtp("recover", "--json")
        assert done.returncode == 0, done.stdout + done.stderr
        assert [r["node_id"] for r in json.loads(done.stdout)] == [s["node_id"] for s in statuses]
    finally:
        a.kill()


def test_a_paused_replica_loses_its_slot_writes_nothing_after_and_gets_a_slot_back_later(pg_db, maria_db,
                                                                                       tmp_path: Path) -> None:
    client_app, server_app = pg_db("client"), maria_db("server")
    client_schema(client_app)
    server_schema(server_app)
    pair = Pair(client_app, server_app, proxy_port=free_port(), client_extra="lanes = 4\n")
    replicas = Replicas(pair, servers=2, clients=1, ttl=2, slots=2)
    configs = replicas.write(tmp_path)
    a, b = (NodeProcess(configs[name], tmp_path / f"{name}.log") for name in ("server-a", "server-b"))
    client = NodeProcess(configs["client"], tmp_path / "client.log",
                         {"QTP_TEST_SEND": "1200", "QTP_TEST_RATE": "40", "QTP_TEST_ABORT_EVERY": "0",
                          "QTP_TEST_THREADS": "4", "QTP_TEST_KEYS": "1"})
    written_by = lambda node, after=0: rows(  # noqa: E731
        server_app, f"SELECT COUNT(*) FROM applied WHERE pid = {node.proc.pid} AND id > {after}")[0][0]
    with LossyProxy(replicas.urls("server"), port=pair.proxy_port, failover_s=1):
        try:
            _one_slot_each(a, b)
            client.start()
            wait_until(lambda: written_by(b) >= 10, 90, "server-b applying orders")
            lost = _slots_of(b)[0]
            b.pause()
            wait_until(lambda: _slots_of(a).count(lost) == 2, 30, "server-a taking the paused replica's slot")
            mark = applied_id_mark(server_app)
            b.resume()
            wait_until(lambda: b"gives slot" in b.said(), 30, "server-b giving its lost slot up")
            assert b.alive() and written_by(b, after=mark) == 0
            wait_until(lambda: len(_slots_of(b)) == 2, 60, "server-b given a slot again (fair share)")
            wait_until(lambda: rows(server_app, "SELECT COUNT(*) FROM applied")[0][0] >= 1200, 180, "every order")
        finally:
            for node in (client, a, b):
                node.kill()
    check_exactly_once(client_app, server_app, reply=False)


def test_signed_requests_are_checked_by_the_slot_whichever_replica_they_reach(pg_db, maria_db, tmp_path: Path) -> None:
    """With [peers], the replica holding the slot checks the signature of a forwarded request, and takes a
    signature naming the boot of any live replica (the peer signs with the boot of whichever answered last)."""
    client_app, server_app = pg_db("client"), maria_db("server")
    client_schema(client_app)
    server_schema(server_app)
    pair = Pair(client_app, server_app, proxy_port=free_port(), reply=True, client_extra="lanes = 4\n",
                secret="s" * 32)
    replicas = Replicas(pair, servers=2, clients=1, ttl=2, slots=2)
    configs = replicas.write(tmp_path)
    a, b = (NodeProcess(configs[name], tmp_path / f"{name}.log", {"QTP_TEST_LOG": "INFO"})
            for name in ("server-a", "server-b"))
    client = NodeProcess(configs["client"], tmp_path / "client.log",
                         {"QTP_TEST_SEND": "400", "QTP_TEST_RATE": "50", "QTP_TEST_ABORT_EVERY": "0",
                          "QTP_TEST_THREADS": "4", "QTP_TEST_KEYS": "1"})
    written_by = lambda node: rows(server_app, f"SELECT COUNT(*) FROM applied WHERE pid = {node.proc.pid}")[0][0]  # noqa: E731
    with LossyProxy(replicas.urls("server"), port=pair.proxy_port, failover_s=1):
        try:
            _one_slot_each(a, b)
            client.start()
            wait_until(lambda: rows(client_app, "SELECT COUNT(*) FROM replies")[0][0] >= 400, 180, "every reply")
            assert written_by(a) > 0 and written_by(b) > 0
            # a 401 for a boot only while the client learns the first one: not one per switch of replica
            stale = sum(node.said().count(b"names another start of this node") for node in (a, b))
            assert stale <= 8, stale
            # anonymous requests are refused by the slot, forwarded or not
            for port in (replicas.ports["server-a"], replicas.ports["server-b"]):
                answer = requests.post(f"http://127.0.0.1:{port}/rm", data=b"<x/>", timeout=10,
                                       headers={"Content-Type": "application/soap+xml", "X-Qtp-Slot": "1"})
                assert answer.status_code == 401
            # outside finding F4: requests for the other replica's slot that it would refuse (unsigned, a forged
            # signature), large ones included, were passed on first: refused where they arrive, not forwarded
            node_id = load_config(configs["server-a"]).node_id
            refused = lambda node: counter(  # noqa: E731
                f"http://127.0.0.1:{replicas.ports[node]}/metrics", "qtp_requests_refused_total") or 0.0
            for here, there in (("server-a", b), ("server-b", a)):
                before = {name: refused(name) for name in ("server-a", "server-b")}
                body = b"<x>urn:qtp:%s:s%d:q" % (node_id.encode(), _slots_of(there)[0]) + b" " * 300_000 + b"</x>"
                forged = 'id="%s", to="%s", boot="x", ts="%d", nonce="%s", sig="%s"' % (  # a peer's name, no MAC
                    load_config(configs["client"]).node_id, node_id, int(time.time() * 1000), "n" * 16, "A" * 43 + "=")
                # helper-35: one claiming to be a forward from another replica was answered 503, not counted
                # helper-36: one naming the slot in ?qtp-slot= (as acknowledgements to an AcksTo do) was forwarded
                query = f"?qtp-slot={_slots_of(there)[0]}"
                for headers, at in (({}, ""), ({"X-Qtp-Signature": forged}, ""), ({"X-Qtp-Forwarded": "1"}, ""),
                                    ({"X-Qtp-Forwarded": "1", "X-Qtp-Slot": str(_slots_of(there)[0])}, ""),
                                    ({}, query), ({"X-Qtp-Signature": forged}, query)):
                    answer = requests.post(f"http://127.0.0.1:{replicas.ports[here]}/rm{at}", data=body, timeout=10,
                                           headers={"Content-Type": "application/soap+xml", **headers})
                    assert answer.status_code == 401, (headers, at, answer.status_code, answer.text)
                    after = {name: refused(name) for name in ("server-a", "server-b")}
                    other = "server-b" if here == "server-a" else "server-a"
                    assert after[other] == before[other], (here, headers, at, before, after)
                assert after[here] - before[here] == 6, (here, before, after)
        finally:
            for node in (client, a, b):
                node.kill()
    check_exactly_once(client_app, server_app, reply=True)


def test_create_sequences_spread_evenly_over_the_slots_and_a_retransmitted_one_gets_its_sequence_anywhere(
        pg_db, tmp_path: Path) -> None:
    from qtp.testing.nodes import post_as, request
    from qtp.wsrm.codec import decode, encode
    from qtp.wsrm.protocol import CreateSequence

    anonymous = "http://www.w3.org/2005/08/addressing/anonymous"
    server_app = pg_db("server")
    server_schema(server_app)
    pair = Pair(pg_db("client"), server_app, proxy_port=free_port())
    replicas = Replicas(pair, servers=2, clients=1, ttl=2, slots=2)
    configs = replicas.write(tmp_path)
    a, b = (NodeProcess(configs[name], tmp_path / f"{name}.log") for name in ("server-a", "server-b"))
    url = lambda node: f"http://127.0.0.1:{replicas.ports[node]}/rm"  # noqa: E731

    def create(where: str, message_id: str) -> str:
        answer = post_as(where, request(CreateSequence(anonymous), message_id=message_id), None, "")
        assert answer.status_code == 200, answer.text
        return decode(answer.content).body.identifier

    try:
        _serving(a)
        wait_until(lambda: len(_slots_of(a)) == 2, 30, "server-a holding both slots")
        ids = [f"urn:uuid:{uuid}" for uuid in ("0" * 31 + str(k) for k in range(6))]
        # six CreateSequence at once: each choice waits for the one before, so they still spread evenly
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            made = list(pool.map(lambda m: create(url("server-a"), m), ids))
        slot = lambda identifier: int(re.search(r":s(\d+):", identifier).group(1))  # noqa: E731
        assert sorted(slot(i) for i in made) == [0, 0, 0, 1, 1, 1]
        assert create(url("server-a"), ids[0]) == made[0]
        _serving(b)
        wait_until(lambda: len(_slots_of(b)) == 1, 30, "server-b taking a slot")
        # through either replica, whichever holds the slot now: the sequence made for that MessageID
        assert [create(url("server-b"), m) for m in ids] == made
        assert [create(url("server-a"), m) for m in ids] == made
        # a request for a slot this replica does not hold, passed on to it already: a 503 SOAP fault to retry
        elsewhere = _slots_of(b)[0]
        answer = requests.post(url("server-a"), timeout=10, data=encode(request(CreateSequence(anonymous))),
                               headers={"Content-Type": "application/soap+xml", "X-Qtp-Forwarded": "x",
                                        "X-Qtp-Slot": str(elsewhere)})
        assert (answer.status_code, answer.headers.get("Retry-After")) == (503, "1")
        assert "not held here" in decode(answer.content).body.reason
        # outside findings, each a 500 and a traceback before: a slot number in other digits ("²", latin-1
        # B2, in the header or the query), a header value with a bare LF (passed on to the slot's replica)
        import socket

        def status_of(target: bytes, headers: bytes) -> bytes:
            body = encode(request(CreateSequence(anonymous)))
            with socket.create_connection(("127.0.0.1", replicas.ports["server-a"]), timeout=20) as sock:
                sock.sendall(b"POST " + target + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/soap+xml\r\n"
                             + headers + b"Content-Length: %d\r\n\r\n" % len(body) + body)
                return sock.recv(65536).split(b"\r\n", 1)[0]

        # (routed as if it named no slot: its CreateSequence's slot; 503 when that is the other replica's, since
        # a request said to be forwarded already is not forwarded again)
        assert status_of(b"/rm", b"X-Qtp-Forwarded: x\r\nX-Qtp-Slot: \xb2\r\n") in (
            b"HTTP/1.1 200 OK", b"HTTP/1.1 503 Service Unavailable")
        assert status_of(b"/rm?qtp-slot=%C2%B2", b"") == b"HTTP/1.1 200 OK"
        for name in (b"X-Qtp-Signature", b"SOAPAction"):
            assert status_of(b"/rm", name + b": a\nb\r\n") == b"HTTP/1.1 400 Bad Request"
        assert b"Traceback" not in a.said()
    finally:
        for node in (a, b):
            node.kill()


def test_replicas_with_and_without_slots_or_with_other_slots_refuse_to_run_beside_each_other(pg_db, tmp_path: Path
                                                                                              ) -> None:
    """Outside finding: a replica without slots (a rolling change of the file) and one with slots both ran, both
    worked slot 0's tables, and replies were lost. Now whichever comes second refuses to run."""
    server_app = pg_db("server")
    server_schema(server_app)
    pair = Pair(pg_db("client"), server_app, proxy_port=free_port())
    configs = Replicas(pair, servers=3, clients=1, ttl=2).write(tmp_path)
    whole, shared, other = (configs[name] for name in ("server-a", "server-b", "server-c"))
    _share(shared, 2)
    _share(other, 3)
    first = NodeProcess(whole, tmp_path / "whole.log")
    try:
        assert first.start_replica().role() == "owner"
        second = NodeProcess(shared, tmp_path / "shared.log").launch()
        assert second.wait_exit(60) == 2 and b"has a live process without slots" in second.said()
        first.kill()
        time.sleep(2.5)  # its lease expires
        second = _serving(NodeProcess(shared, tmp_path / "shared-2.log"))
        wait_until(lambda: len(_slots_of(second)) == 2, 30, "the replica with slots holding both")
        third = NodeProcess(whole, tmp_path / "whole-2.log").launch()
        assert third.wait_exit(60) not in (None, 0) and b"share the work in 2 slots" in third.said()
        fourth = NodeProcess(other, tmp_path / "other.log").launch()
        assert fourth.wait_exit(60) == 2 and b"every replica of a node needs the same [lease] slots" in fourth.said()
        assert second.alive() and _slots_of(second) == [0, 1]
    finally:
        for node in [n for n in locals().values() if isinstance(n, NodeProcess)]:
            node.kill()


def test_a_replica_that_cannot_take_slots_does_not_stall_the_node(pg_db, maria_db, tmp_path: Path) -> None:
    """Outside finding: a live replica that failed at every take (here: a database its host cannot reach) was
    counted in the fair share, the healthy one gave it a slot, and that slot stayed unheld: orders stalled."""
    client_app, server_app = pg_db("client"), maria_db("server")
    client_schema(client_app)
    server_schema(server_app)
    pair = Pair(client_app, server_app, proxy_port=free_port(), client_extra="lanes = 4\n")
    replicas = Replicas(pair, servers=2, clients=1, ttl=2, slots=2)
    configs = replicas.write(tmp_path)
    broken = configs["server-b"]  # it also names a database that does not answer
    broken.write_text(broken.read_text().replace("\n[recovery]\n", f'\n[resources.unreachable]\nurl = '
                                                 f'"postgresql://u@127.0.0.1:{free_port()}/x"\n\n[recovery]\n', 1))
    a, b = (NodeProcess(configs[name], tmp_path / f"{name}.log") for name in ("server-a", "server-b"))
    client = NodeProcess(configs["client"], tmp_path / "client.log",
                         {"QTP_TEST_SEND": "600", "QTP_TEST_RATE": "40", "QTP_TEST_ABORT_EVERY": "0",
                          "QTP_TEST_THREADS": "4", "QTP_TEST_KEYS": "1"})
    with LossyProxy(replicas.urls("server"), port=pair.proxy_port, failover_s=1, balance="round-robin"):
        try:
            _serving(a)
            wait_until(lambda: len(_slots_of(a)) == 2, 30, "server-a holding both slots")
            _serving(b)
            client.start()
            wait_until(lambda: b"could not take a slot" in b.said(), 60, "server-b failing to take a slot")
            wait_until(lambda: rows(server_app, "SELECT COUNT(*) FROM applied")[0][0] >= 600, 180, "every order")
            assert _slots_of(b) == [] and b.alive()
        finally:
            for node in (client, a, b):
                node.kill()
    check_exactly_once(client_app, server_app, reply=False)


def test_a_replica_whose_every_slot_would_fail_to_start_is_refused_before_it_takes_any(pg_db, tmp_path: Path) -> None:
    """Outside finding: listening beyond loopback without a metrics token (or llr = false) made each take of a
    slot fail after taking its lease, for ever; now `qtp serve` refuses such a file before taking anything."""
    server_app = pg_db("server")
    server_schema(server_app)
    pair = Pair(pg_db("client"), server_app, proxy_port=free_port())
    configs = Replicas(pair, servers=2, clients=1, ttl=2, slots=2).write(tmp_path)
    wide, no_llr = configs["server-a"], configs["server-b"]
    wide.write_text(re.sub(r'(?m)^listen = "127.0.0.1:', 'listen = "0.0.0.0:', wide.read_text(), count=1))
    no_llr.write_text(no_llr.read_text().replace("\n[node]\n", "\n[node]\nllr = false\n", 1))
    for config, said in ((wide, b"metrics_token"), (no_llr, b"llr = true")):
        node = NodeProcess(config, tmp_path / f"{config.stem}.log").launch()
        try:
            assert node.wait_exit(60) not in (None, 0) and said in node.said()
            assert b"took slot" not in node.said()
        finally:
            node.kill()
    # refused before it touched the database: not even the lease's tables were made
    assert rows(server_app, "SELECT COUNT(*) FROM information_schema.tables WHERE table_name = 'qtp_node_lease'") \
        == [(0,)]


def _stand_in(answer: Callable[[Any], None]) -> tuple[Any, list[tuple[str, bytes, str | None]], set[int]]:
    """An HTTP/1.1 server on loopback answering every POST with ``answer(handler)``: (server, requests seen
    as (path, body, X-Qtp-Slot), ids of the connections open now)."""
    import http.server
    import threading

    seen: list[tuple[str, bytes, str | None]] = []
    open_now: set[int] = set()

    class StandIn(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            open_now.add(id(self))

        def finish(self) -> None:
            open_now.discard(id(self))
            super().finish()

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            seen.append((self.path, body, self.headers.get("X-Qtp-Slot")))
            answer(self)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), StandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, seen, open_now


def _ok(handler: Any, close: bool = False) -> None:
    handler.send_response(200)
    handler.send_header("Content-Type", "text/plain")
    handler.send_header("Content-Length", "2")
    handler.end_headers()
    handler.wfile.write(b"ok")
    handler.close_connection = close


def test_forwarding_sends_again_on_a_fresh_connection_when_the_kept_one_was_closed_by_the_other_replica() -> None:
    """A replica keeps its connections to the others open between forwards; the other side may close one
    while idle (its idle limit, a restart). The next forward must reach it on a new connection, not fail."""
    from qtp.wsrm.runtime._shared import _Links

    # the answer says nothing of closing (the client keeps the connection), and then the server closes it
    server, seen, _ = _stand_in(lambda handler: _ok(handler, close=True))
    links = _Links(timeout=5.0, keep=2)
    try:
        address = f"http://127.0.0.1:{server.server_address[1]}/rm?qtp-slot=1"
        for n in range(3):
            time.sleep(0.1)  # the other side has closed the kept connection by now
            status, _, headers, content = links.post(address, f"m{n}".encode(), {"X-Qtp-Slot": "1"})
            assert (status, content) == (200, b"ok")
            assert ("Content-Type", "text/plain") in headers
        assert seen == [("/rm?qtp-slot=1", f"m{n}".encode(), "1") for n in range(3)]
        server.shutdown()
        server.server_close()
        with pytest.raises(OSError):  # nobody there: the caller answers 503
            links.post(address, b"m3", {})
    finally:
        links.close()


def test_a_forward_after_a_restart_of_the_other_replica_gets_through_though_every_kept_connection_is_stale() -> None:
    import concurrent.futures as futures

    from qtp.wsrm.runtime._shared import _Links

    server, seen, _ = _stand_in(lambda handler: (time.sleep(0.2), _ok(handler, close=True)))
    links = _Links(timeout=5.0, keep=3)
    address = f"http://127.0.0.1:{server.server_address[1]}/rm"
    try:
        with futures.ThreadPoolExecutor(3) as pool:  # three kept connections, each closed by the other side
            assert [r[0] for r in pool.map(lambda n: links.post(address, b"x", {}), range(3))] == [200] * 3
        time.sleep(0.1)
        assert links.post(address, b"after", {})[0] == 200 and seen[-1][1] == b"after"
    finally:
        links.close()
        server.shutdown()
        server.server_close()


def test_kept_connections_are_bounded_and_closed_when_their_replica_is_gone() -> None:
    """Outside finding: connections were kept per thread and address and never closed, so a replica that
    came back at new addresses left up to http_threads sockets in CLOSE-WAIT each time."""
    import concurrent.futures as futures

    from qtp.wsrm.runtime._shared import _Links

    old, _, old_open = _stand_in(lambda handler: (time.sleep(0.2), _ok(handler)))
    new, _, new_open = _stand_in(_ok)
    links = _Links(timeout=5.0, keep=2)
    at = lambda server: f"http://127.0.0.1:{server.server_address[1]}/rm"  # noqa: E731
    try:
        with futures.ThreadPoolExecutor(4) as pool:  # four forwards at once: four connections, two kept
            assert [r[0] for r in pool.map(lambda n: links.post(at(old), b"x", {}), range(4))] == [200] * 4
        wait_until(lambda: len(old_open) == 2, 5, "two connections kept", poll=0.05)
        assert links.post(at(new), b"y", {})[0] == 200
        links.keep_only([at(new)])  # the replica at the old address is not live any more
        wait_until(lambda: not old_open, 5, "the old address's connections closed", poll=0.05)
        assert len(new_open) == 1 and links.idle() == {f"127.0.0.1:{new.server_address[1]}": 1}
    finally:
        links.close()
        for server in (old, new):
            server.shutdown()
            server.server_close()


def test_a_forward_relays_retry_after_and_refuses_header_values_it_cannot_pass_on(caplog) -> None:
    """Outside findings: a 503 of the slot's replica lost its Retry-After on the way back; a header value with
    a bare LF, passed on, raised inside the forward (500 and a traceback, before any authentication); a
    replica unreachable at its published address (a wrong [lease] address) was said at INFO only."""
    import threading

    from qtp.wsrm.runtime._shared import SharedNode, _Links

    def busy(handler: Any) -> None:
        handler.send_response(503)
        for name, value in (("Content-Type", "text/plain"), ("Retry-After", "1"), ("X-Private", "z"),
                            ("Content-Length", "4")):
            handler.send_header(name, value)
        handler.end_headers()
        handler.wfile.write(b"busy")

    server, seen, _ = _stand_in(busy)
    replica = SharedNode.__new__(SharedNode)  # only what a forward uses
    replica.node_id, replica.member, replica._unanswered = "s", "m", {}
    replica._forwarding, replica._links = threading.BoundedSemaphore(1), _Links(5.0, keep=1)
    replica._forwarded, replica._forwarded_lock = [0, 0], threading.Lock()
    answered: list[tuple[str, list[tuple[str, str]]]] = []
    forward = lambda environ: b"".join(replica._forward(  # noqa: E731
        f"http://127.0.0.1:{server.server_address[1]}/rm", 1, environ, b"<x/>",
        lambda status, headers: answered.append((status, headers))))
    try:
        assert forward({"CONTENT_TYPE": "application/soap+xml"}) == b"busy"
        assert answered[0][0].startswith("503") and ("Retry-After", "1") in answered[0][1]
        assert not any(name.lower() == "x-private" for name, _ in answered[0][1])
        forward({"CONTENT_TYPE": "application/soap+xml", "HTTP_SOAPACTION": "a\nb"})
        assert answered[1][0].startswith("400") and len(seen) == 1
        server.shutdown()
        server.server_close()
        caplog.set_level("WARNING", logger="qtp.wsrm.shared")
        for _ in range(3):
            forward({"CONTENT_TYPE": "application/soap+xml"})
        assert [status[:3] for status, _ in answered[2:]] == ["503"] * 3
        assert len([r for r in caplog.records if "did not answer a forward" in r.getMessage()]) == 1
    finally:
        replica._links.close()
        server.shutdown()
        server.server_close()


def test_large_bodies_forwarded_both_ways_do_not_wait_on_each_others_room(pg_db, tmp_path: Path) -> None:
    """Outside finding: each replica held its own large bodies' room in max_body_memory while forwarding them,
    so neither could read the other's forwarded bodies: forwards timed out (503) and 3 MB orders stalled."""
    server_app = pg_db("server")
    server_schema(server_app)
    pair = Pair(pg_db("client"), server_app, proxy_port=free_port(),
                limits="max_request_bytes = 1500000\nmax_body_memory = 2500000")
    replicas = Replicas(pair, servers=2, clients=1, ttl=2, slots=2)
    configs = replicas.write(tmp_path)
    a, b = (NodeProcess(configs[name], tmp_path / f"{name}.log") for name in ("server-a", "server-b"))
    node_id = load_config(configs["server-a"]).node_id
    try:
        _one_slot_each(a, b)
        slot_b = _slots_of(b)[0]
        # three bodies of 1.1 MB into each replica at once (room for two each), every one for the other's slot
        posts = [(name, f"urn:qtp:{node_id}:s{slot}:x".encode()) for name, slot in
                 [("server-a", slot_b)] * 3 + [("server-b", 1 - slot_b)] * 3]

        import socket

        socks = []
        for name, tag in posts:  # every head first: each replica gives its room to its first two bodies
            body = b"<x>" + tag + b" " * 1_100_000 + b"</x>"
            sock = socket.create_connection(("127.0.0.1", replicas.ports[name]), timeout=30)
            sock.sendall(b"POST /rm HTTP/1.1\r\nHost: x\r\nContent-Type: application/soap+xml\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body))
            socks.append((sock, body))
        time.sleep(0.5)
        began = time.monotonic()

        def send(item: tuple[Any, bytes]) -> tuple[int, float]:
            sock, body = item
            with sock:
                try:
                    sock.sendall(body)
                except OSError:  # the third of each waits unread: its bytes stay in the buffers
                    pass
                line = sock.makefile("rb").readline()
            return int(line.split()[1]), time.monotonic() - began

        with concurrent.futures.ThreadPoolExecutor(len(socks)) as pool:
            answers = list(pool.map(send, socks))
        # each refused by the slot's replica (not a SOAP envelope), none a 503 after a forward timed out (5 s)
        assert all(status == 400 for status, _ in answers), answers
        assert max(took for _, took in answers) < 4.0, answers
    finally:
        for node in (a, b):
            node.kill()


def test_replicas_behind_haproxy_keep_exactly_once_when_each_is_killed_in_turn(pg_db, maria_db, tmp_path: Path) -> None:
    """The production shape (docs/operations.md): the node's replicas behind a real load balancer, HAProxy
    spreading requests round-robin over kept connections, with health checks; each replica killed (-9) and
    started again in turn while the client sends; every order and every reply exactly once."""
    from qtp.testing.balancer import Haproxy

    client_app, server_app, pair, replicas, a, b, client = _replying_pair(pg_db, maria_db, tmp_path)
    applied = lambda: rows(server_app, "SELECT COUNT(*) FROM applied")[0][0]  # noqa: E731
    balancer = Haproxy(replicas.urls("server"), pair.proxy_port, tmp_path / "haproxy", slots=2).start()
    try:
        _one_slot_each(a, b)
        client.start()
        for victim, other in ((b, a), (a, b)):
            mark = applied()
            wait_until(lambda: applied() >= mark + 100, 90, "orders applied before the kill")
            victim.kill()
            wait_until(lambda: len(_slots_of(other)) == 2, 30, "the other replica taking the killed one's slot")
            mark = applied()
            wait_until(lambda: applied() >= mark + 40, 60, "orders applied by the survivor alone")
            _serving(victim)
            wait_until(lambda: len(_slots_of(victim)) == 1, 60, "the restarted replica taking a slot back")
        wait_until(lambda: applied() >= 600, 180, "every order applied")
        wait_until(lambda: rows(client_app, "SELECT COUNT(*) FROM replies")[0][0] >= 600, 120, "every reply")
        answered = balancer.per_target()
        assert all(n > 0 for n in answered.values()) and len(answered) == 2, answered
    finally:
        for node in (client, a, b):
            node.kill()
        balancer.stop()
    check_exactly_once(client_app, server_app, reply=True)


def _forwarded(port: int) -> int:
    """Requests the replica listening at ``port`` forwarded to another, by its /metrics."""
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return sum(int(float(n)) for n in re.findall(r'^qtp_requests_forwarded_total\{slot="\d+"\} (\S+)$', text, re.M))


def test_a_balancer_routing_by_slot_leaves_the_replicas_next_to_nothing_to_forward(pg_db, maria_db,
                                                                                  tmp_path: Path) -> None:
    """Round-robin sends half the requests to the replica that does not hold their slot, which forwards them
    (a hop and 0.5 ms of CPU each). The client names the slot of each sequence in the URL (?qtp-slot=k, from
    the identifier the server made) and HAProxy, checking /health?qtp-slot=k, sends it to the holder: only
    requests that name no slot (the CreateSequences) may still be forwarded. Exactly once, as ever."""
    from qtp.testing.balancer import Haproxy

    client_app, server_app, pair, replicas, a, b, client = _replying_pair(pg_db, maria_db, tmp_path)
    balancer = Haproxy(replicas.urls("server"), pair.proxy_port, tmp_path / "haproxy", slots=2).start()
    try:
        _one_slot_each(a, b)
        slot_health = [requests.get(f"http://127.0.0.1:{replicas.ports[name]}/health?qtp-slot={k}", timeout=10)
                       .status_code for name in ("server-a", "server-b") for k in (0, 1)]
        assert sorted(slot_health) == [200, 200, 503, 503], slot_health  # each holds one slot, serves it only
        time.sleep(1.5)  # HAProxy's checks (every 0.5 s) see who holds which slot
        client.start()
        wait_until(lambda: rows(server_app, "SELECT COUNT(*) FROM applied")[0][0] >= 600, 120, "every order")
        wait_until(lambda: rows(client_app, "SELECT COUNT(*) FROM replies")[0][0] >= 600, 120, "every reply")
        answered = sum(balancer.per_target().values())
        forwarded = sum(_forwarded(replicas.ports[name]) for name in ("server-a", "server-b"))
        assert answered > 300 and forwarded <= 8, (forwarded, answered)  # 4 lanes' CreateSequence, some resent
    finally:
        for node in (client, a, b):
            node.kill()
        balancer.stop()
    check_exactly_once(client_app, server_app, reply=True)


def test_a_replica_alone_takes_every_slot_at_once(pg_db, tmp_path: Path) -> None:
    """A replica starting alone (or left alone) takes its whole share in one look, not one slot per look: the
    slots not taken yet answered 503 meanwhile (the benchmark's one-process run showed 0.6 s at p99 for it)."""
    server_app = pg_db("server")
    server_schema(server_app)
    replicas = Replicas(Pair(pg_db("client"), server_app, proxy_port=free_port()), servers=1, clients=1, ttl=10,
                        slots=4)
    configs = replicas.write(tmp_path)
    alone = NodeProcess(configs["server"], tmp_path / "server.log", {"QTP_TEST_LOG": "INFO"})
    try:
        _serving(alone)
        wait_until(lambda: b"serving at" in alone.said(), 30, "the replica saying it serves")
        said = re.search(rb"serving at \S+ \(slots (\[[0-9, ]*\]) of 4\)", alone.said())
        assert said is not None and said.group(1) == b"[0, 1, 2, 3]", alone.said()[-2000:]
    finally:
        alone.kill()
