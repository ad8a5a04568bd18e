"""The poller of a node without an endpoint reports a peer that never answers a poll with a message.

A peer without WS-MakeConnection (gSOAP) answers MakeConnection with a bare HTTP 202, as a WS-MC peer with
nothing to give does. The poller reports a peer that has done so for ``SUSPECT_POLLS`` polls in a row and
``SUSPECT_SECONDS`` without ever returning a message: one warning (again at most every ``REPORT_INTERVAL``),
and ``polled-peers.json`` in the node's log folder, which ``qtp status`` shows. Fake transport and clock,
no sockets, no sleeps.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from types import SimpleNamespace

from interop.gsoap_peer import GsoapServer

import qtp
from qtp.config import load_config
from qtp.embedded import free_port
from qtp.testing.nodes import wait_until
from qtp.wsrm.codec import SoapVersion, WsaVersion
from qtp.wsrm.runtime import Limits, Node, NodeSettings, _mailbox
from qtp.wsrm.runtime._mailbox import REPORT_INTERVAL, SUSPECT_POLLS, SUSPECT_SECONDS, Poller
from qtp.wsrm.runtime._settings import ChannelSettings
from qtp.wsrm.runtime._status import messaging_status, messaging_warnings, polled_peers, render_messaging

PEER = "http://gsoap.example:8080/"


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class Counter:
    def labels(self, **labels: str) -> "Counter":
        return self

    def inc(self, amount: float = 1) -> None:
        pass


def _poller(folder: Path, clock: Clock, status: int = 202) -> Poller:
    channel = SimpleNamespace(peer=PEER, reply=True, acks_to="anonymous", wsa=WsaVersion.WSA200508,
                              soap=SoapVersion.SOAP11)
    transport = SimpleNamespace(post=lambda peer, data, soap, action, accept=None: SimpleNamespace(status=status,
                                                                                                  body=b""))
    metrics = SimpleNamespace(polls=Counter(), ignored_headers=Counter())
    return Poller("http://docs.oasis-open.org/ws-rx/wsmc/200702/anonymous?id=urn:qtp:node:n1", {"gsoap": channel},
                  SimpleNamespace(poll_interval_max=1.0, max_batch=256, max_response_bytes=1 << 22), transport, metrics,
                  None, _no_handling, _no_handling, folder, clock)


def _no_handling(message, source):
    raise AssertionError("a bare 202 carries nothing to handle")


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "qtp.wsrm.mailbox" and r.levelno == logging.WARNING]


def test_a_peer_answering_every_poll_with_a_bare_202_is_reported_once_then_rate_limited(tmp_path, caplog):
    clock = Clock()
    poller = _poller(tmp_path, clock)
    step = SUSPECT_SECONDS / (SUSPECT_POLLS - 1)
    with caplog.at_level(logging.WARNING, logger="qtp.wsrm.mailbox"):
        for _ in range(SUSPECT_POLLS - 1):
            assert poller.poll(PEER) == (False, False)
            clock.now += step
        assert _warnings(caplog) == [] and not (tmp_path / "polled-peers.json").exists()
        poller.poll(PEER)  # the 5th bare 202, 60 s after the first
        assert len(_warnings(caplog)) == 1 and "may not support WS-MakeConnection" in _warnings(caplog)[0]
        for _ in range(50):  # polled every second meanwhile: no new line
            clock.now += 1
            poller.poll(PEER)
        assert len(_warnings(caplog)) == 1
        clock.now += REPORT_INTERVAL
        poller.poll(PEER)
        assert len(_warnings(caplog)) == 2
    [seen] = poller.peers_seen.snapshot()
    assert (seen.suspect, seen.messages, seen.last_status) == (True, 0, 202)
    assert seen.empty_in_a_row == SUSPECT_POLLS + 51


def test_bare_202s_from_a_peer_that_once_returned_a_message_or_for_a_short_while_are_not_reported(tmp_path, caplog):
    clock = Clock()
    quick = _poller(tmp_path / "quick", clock)
    with caplog.at_level(logging.WARNING, logger="qtp.wsrm.mailbox"):
        for _ in range(SUSPECT_POLLS * 10):  # many polls, all within less than SUSPECT_SECONDS
            clock.now += (SUSPECT_SECONDS - 1) / (SUSPECT_POLLS * 10)
            quick.poll(PEER)
        speaks = _poller(tmp_path / "speaks", clock)
        speaks.peers_seen.message(PEER)
        for _ in range(SUSPECT_POLLS * 10):
            clock.now += SUSPECT_SECONDS
            speaks.poll(PEER)
    assert _warnings(caplog) == []
    assert not [p for p in quick.peers_seen.snapshot() + speaks.peers_seen.snapshot() if p.suspect]


def test_the_report_clears_at_the_first_message_a_poll_returns(tmp_path):
    clock = Clock()
    poller = _poller(tmp_path, clock)
    for _ in range(SUSPECT_POLLS):
        poller.poll(PEER)
        clock.now += SUSPECT_SECONDS
    assert [p["suspect"] for p in polled_peers(tmp_path, clock.now)] == [True]
    poller.peers_seen.message(PEER)
    assert [(p["suspect"], p["messages"], p["empty_in_a_row"]) for p in polled_peers(tmp_path, clock.now)] == \
        [(False, 1, 0)]


def test_qtp_status_shows_the_reported_peer_and_warns(tmp_path):
    config = tmp_path / "qtp.toml"
    config.write_text(f'''
[node]
id = "poller-1"
log_dir = "{tmp_path / 'logs'}"
mode = "memory"

[channels.gsoap]
peer = "{PEER}"
mode = "memory"
reply = true
''')
    clock = Clock()
    poller = _poller(tmp_path / "logs" / "poller-1", clock)
    status = messaging_status(load_config(config))
    assert status["polled_peers"] == [] and messaging_warnings(status) == []
    for _ in range(SUSPECT_POLLS):
        poller.poll(PEER)
        clock.now += SUSPECT_SECONDS
    status = messaging_status(load_config(config))
    [peer] = status["polled_peers"]
    assert (peer["peer"], peer["suspect"], peer["messages"]) == (PEER, True, 0)
    [warning] = messaging_warnings(status)
    assert PEER in warning and "WS-MakeConnection" in warning
    rendered = render_messaging(status)
    assert "peers this node polls (WS-MakeConnection): 1" in rendered and PEER in rendered


def test_a_node_without_endpoint_reports_the_real_gsoap_peer_that_has_no_wsmc(tmp_path, monkeypatch, caplog):
    """The real gSOAP server (tests/interop) answers MakeConnection with a bare 202. Thresholds shortened."""
    monkeypatch.setattr(_mailbox, "SUSPECT_SECONDS", 1.0)
    with GsoapServer(free_port(), "1.1") as server, caplog.at_level(logging.WARNING, logger="qtp.wsrm.mailbox"):
        tm = qtp.TransactionManager(f"p-{uuid.uuid4().hex[:6]}", tmp_path / "logs", recovery_interval=None)
        channel = ChannelSettings("gsoap", peer=server.url, mode="memory", reply=True, soap=SoapVersion.SOAP11)
        node = Node(tm, NodeSettings(mode="memory", channels={"gsoap": channel},
                                     limits=Limits(poll_interval_max=0.2))).start()
        try:
            wait_until(lambda: any(p["suspect"] for p in polled_peers(tm.log_dir, 0)), 30, "gSOAP reported")
        finally:
            node.close()
            tm.close()
    assert any(server.url in w and "may not support WS-MakeConnection" in w for w in _warnings(caplog))


def test_qtp_status_lists_polling_clients_per_peer_that_owns_their_sequences():
    """Another signed peer may name a client's WS-MC address for sequences of its own (nothing of them
    reaches that client: only the owner's polls get them). `qtp status` showed their held replies under the
    client's id, as if they were the client's (an outside tester's finding); each owner now has its row."""
    from qtp.wsrm.runtime._status import polling_clients, render_messaging

    address = "http://docs.oasis-open.org/ws-rx/wsmc/200702/anonymous?id=urn:qtp:node:vic"

    def out(owner, waiting):
        return {"direction": "out", "peer": address, "owner": owner, "unacknowledged": waiting,
                "oldest_unacknowledged_age_s": 3.0 if waiting else None}

    clients = polling_clients([out("vic", 2), out("mal", 60), out("mal", 1)])
    assert [(c["peer"], c["client"], c["sequences"], c["waiting"]) for c in clients] == [
        ("mal", "urn:qtp:node:vic", 2, 61), ("vic", "urn:qtp:node:vic", 1, 2)]
    text = render_messaging({"sequences": [], "polling_clients": clients, "dead_letters": 0, "invoker_backlog": 0})
    assert any("mal" in line and "61" in line for line in text.splitlines())
