"""WS-MakeConnection (issue 23): a client node with no endpoint runs a request-reply channel by polling.

Real node processes: the client's config has no ``endpoint`` and no ``listen``; it offers its reply sequence
at its WS-MC anonymous URI and fetches the replies with MakeConnection. Every test ends with the orders and
replies reconciled exactly once.
"""

from __future__ import annotations

import json
import re
import tomllib
import uuid

import pytest
import requests

from qtp.testing.nodes import (
    Pair,
    check_exactly_once,
    client_schema,
    counter,
    listening_ports,
    post_as,
    request,
    rows,
    server_schema,
    wait_until,
)
from qtp.wsrm.codec import (
    BATCH_CONTENT_TYPE,
    MISSING_SELECTION,
    UNSUPPORTED_SELECTION,
    Envelope,
    MakeConnection,
    WsaVersion,
    anonymous,
    batch_accept,
    decode,
    decode_batch,
    encode,
    mc_anonymous,
    mc_id,
)
from qtp.wsrm.protocol import CreateSequence, CreateSequenceResponse, Sequence

from zygote import qtp_command

SECRET = "makeconnection-pair-secret-0123456789ab"


@pytest.fixture
def polling_pair(pg_db, maria_db, run_pair):
    def make(send: int, secret: str | None = SECRET, rate: float = 0.0, server_extra: str = "", limits: str = "",
             server_env: dict | None = None, acks_to: str = "anonymous"):
        client_app, server_app = pg_db("client"), maria_db("server")
        client_schema(client_app)
        server_schema(server_app)
        pair = Pair(client_app, server_app, reply=True, secret=secret, client_listens=False, server_extra=server_extra,
                    limits=limits, acks_to=acks_to)
        client, server = run_pair(pair, send, rate, server_env)
        node = tomllib.loads(client.config.read_text())["node"]
        assert "endpoint" not in node and "listen" not in node
        return pair, client, server

    return make


def _replies(pair: Pair) -> int:
    return rows(pair.client_app, "SELECT COUNT(*) FROM replies")[0][0]


def _finish(pair: Pair, count: int) -> None:
    wait_until(lambda: _replies(pair) >= count, 120, f"{count} replies")
    result = check_exactly_once(pair.client_app, pair.server_app, reply=True)
    assert result["committed"] == count == result["applied"]


@pytest.mark.parametrize("secret", [SECRET, None], ids=["authenticated", "anonymous-loopback"])
def test_a_client_without_endpoint_gets_its_replies_by_polling(polling_pair, secret):
    pair, client, server = polling_pair(send=40, secret=secret)
    assert client.port is None and listening_ports(client.proc.pid) == []  # nothing bound
    _finish(pair, 40)
    assert listening_ports(client.proc.pid) == []
    metrics = requests.get(f"http://127.0.0.1:{server.port}/metrics", timeout=5).text
    assert 'qtp_polls_total{node="' in metrics and 'result="message"' in metrics
    (info,) = [i for (i,) in rows(pair.server_app, "SELECT info FROM qtp_rm_source")]
    assert "wsmc/200702/anonymous?id=urn:qtp:node:" in info  # the offered sequence's endpoint


def test_replies_held_for_a_polling_client_survive_a_server_restart(polling_pair):
    pair, client, server = polling_pair(send=60, rate=20)
    wait_until(lambda: _replies(pair) >= 5, 60, "the first replies")
    server.kill()
    server.start()
    wait_until(lambda: _replies(pair) >= 20, 60, "replies after the server's restart")
    client.kill()  # and the client: its offered sequence and what it had stored survive too
    committed = rows(pair.client_app, "SELECT COUNT(*) FROM orders WHERE status = 'committed'")[0][0]
    client.env["QTP_TEST_SEND"] = "0"  # what it committed before the kill is all there is
    client.start()
    _finish(pair, committed)


def test_replies_wait_while_the_client_is_down_and_are_fetched_when_it_returns(polling_pair):
    pair, client, server = polling_pair(send=40, rate=40)
    wait_until(lambda: _replies(pair) >= 5, 60, "the first replies")
    client.kill()
    committed = rows(pair.client_app, "SELECT COUNT(*) FROM orders WHERE status = 'committed'")[0][0]
    metrics = f"http://127.0.0.1:{server.port}/metrics"
    if rows(pair.server_app, "SELECT COUNT(*) FROM applied")[0][0] > _replies(pair):  # replies owed: held
        wait_until(lambda: (counter(metrics, "qtp_polling_client_messages") or 0) > 0, 15,
                   "the server holding replies for the client that is down")
        done = qtp_command("status", "--json", "--config", server.config)
        (polled,) = json.loads(done.stdout)["messaging"]["polling_clients"]
        assert polled["client"].startswith("urn:qtp:node:client-") and polled["waiting"] > 0
    client.env["QTP_TEST_SEND"] = "0"
    client.start()
    _finish(pair, committed)
    wait_until(lambda: counter(metrics, "qtp_polling_client_messages") in (None, 0.0), 15, "nothing held")


MALLORY = "mallory-secret-for-polls-0123456789abcdef"


def _poll_bytes(url: str, poll: MakeConnection) -> bytes:
    return encode(request(poll, to=url))


def _poll(url: str, body: MakeConnection | Envelope | bytes, as_peer: str | None = "mallory",
          accept: str | None = None) -> requests.Response:
    """POST a MakeConnection (or another request, or raw bytes) to the server, signed as ``as_peer`` (None:
    anonymous), with ``accept`` as its Accept header."""
    return post_as(url, request(body, to=url) if isinstance(body, MakeConnection) else body, as_peer, MALLORY,
                   accept=accept)


def test_polls_for_another_peers_client_or_without_selection_get_nothing(polling_pair):
    """Another authenticated peer polls with the client's WS-MC address while replies wait for that client
    (which polls every 4 s here): it gets nothing, and the client gets every reply. Polls that select nothing, select
    with an extension, name a plain URL or an oversized address are refused cleanly."""
    pair, client, server = polling_pair(send=30, server_extra=f'\n[peers.mallory]\nsecret = "{MALLORY}"\n',
                                        limits="poll_interval_min = 4\npoll_interval_max = 4")  # a slow poller
    url, metrics = f"http://127.0.0.1:{server.port}/rm", f"http://127.0.0.1:{server.port}/metrics"
    wait_until(lambda: rows(pair.server_app, "SELECT COUNT(*) FROM applied")[0][0] == 30, 60, "30 orders applied")
    wait_until(lambda: (counter(metrics, "qtp_polling_client_messages") or 0) > 0, 10, "replies held")
    (info,) = [i for (i,) in rows(pair.server_app, "SELECT info FROM qtp_rm_source")]
    address = json.loads(info)["peer"]
    assert mc_id(address) is not None
    for accept in (None, batch_accept(256, 1 << 22), None):
        answer = _poll(url, MakeConnection(address), accept=accept)
        assert answer.status_code == 202 and not answer.content  # held for the client's peer, not for mallory
    assert _poll(url, MakeConnection(address), as_peer=None).status_code == 401  # this server takes no anonymous
    selected = _poll_bytes(url, MakeConnection(mc_anonymous("urn:x")))
    missing = _poll(url, re.sub(rb"(<(?:\w+:)?MakeConnection[^>]*>).*?(</(?:\w+:)?MakeConnection>)", rb"\1\2", selected,
                                flags=re.S))
    assert missing.status_code == 500 and decode(missing.content).body.subcode == MISSING_SELECTION
    unsupported = _poll(url, MakeConnection("http://127.0.0.1:1/rm"))
    assert unsupported.status_code == 500 and decode(unsupported.content).body.subcode == UNSUPPORTED_SELECTION
    huge = selected.replace(b"urn:x", b"urn:" + b"x" * 3000)
    assert _poll(url, huge).status_code == 400
    _finish(pair, 30)


def _poll_answers(metrics: str) -> tuple[float, float]:
    """(polls the server answered with messages, messages it gave on them): ``qtp_poll_messages``'s count and
    sum."""
    return counter(metrics, "qtp_poll_messages_count") or 0.0, counter(metrics, "qtp_poll_messages_sum") or 0.0


def test_a_polling_qtp_client_fetches_what_waits_in_batches(polling_pair):
    """The client polls every 2 s while 40 orders' replies are made: each poll brings every reply that waits
    (qtp's batch answer, asked for in the poll's Accept header), not one per poll as a foreign poller gets
    them; the polls answered with messages are fewer than the replies, and every reply counts once."""
    pair, client, server = polling_pair(send=40, rate=40, limits="poll_interval_min = 2\npoll_interval_max = 2")
    _finish(pair, 40)
    metrics = f"http://127.0.0.1:{server.port}/metrics"
    polls, given = _poll_answers(metrics)
    assert given >= 40 and polls < given / 3, (polls, given)


def test_a_poll_that_takes_a_batch_gets_standard_envelopes_framed_as_a_batch(polling_pair):
    """What a qtp poller is given, read raw: the batch's parts are each a standard WS-RM message of the
    offered sequence, in order, MessagePending true (more wait). (No secrets here: the client is an anonymous
    peer on loopback, and so is this poll.)"""
    pair, client, server = polling_pair(send=12, secret=None, limits="poll_interval_min = 30\npoll_interval_max = 30")
    url, metrics = f"http://127.0.0.1:{server.port}/rm", f"http://127.0.0.1:{server.port}/metrics"
    wait_until(lambda: (counter(metrics, "qtp_polling_client_messages") or 0) >= 12, 60, "12 replies held")
    (info,) = [i for (i,) in rows(pair.server_app, "SELECT info FROM qtp_rm_source")]
    address = json.loads(info)["peer"]
    answer = _poll(url, MakeConnection(address), as_peer=None, accept=batch_accept(5, 1 << 20))
    assert answer.status_code == 200 and answer.headers["Content-Type"] == BATCH_CONTENT_TYPE
    parts = [decode(part) for part in decode_batch(answer.content, 100)]
    assert [p.sequence.number for p in parts] == [1, 2, 3, 4, 5]
    assert [p.message_pending for p in parts] == [True] * 5
    assert len({p.sequence.identifier for p in parts}) == 1
    single = _poll(url, MakeConnection(address), as_peer=None)  # no Accept: one standard envelope
    assert single.headers["Content-Type"].startswith("application/soap+xml")
    assert decode(single.content).sequence.number == 6
    _finish(pair, 12)  # the client's own polls fetch them all again, and every reply counts once


def test_acknowledgements_for_a_wsmc_acks_to_are_fetched_by_address_or_by_sequence(polling_pair):
    """A peer whose sequence names a WS-MC anonymous URI as AcksTo (as Metro's clients do) gets no
    acknowledgement on the response; it fetches it with MakeConnection, by that address or by the sequence's
    identifier, and a poll that finds nothing more gets 202."""
    pair, client, server = polling_pair(send=1, server_extra=f'\n[peers.mallory]\nsecret = "{MALLORY}"\n')
    url = f"http://127.0.0.1:{server.port}/rm"
    address = mc_anonymous(f"urn:uuid:{uuid.uuid4()}")

    def post(envelope: Envelope) -> requests.Response:
        return _poll(url, envelope)

    created = decode(post(request(CreateSequence(address), to=url)).content).body
    assert isinstance(created, CreateSequenceResponse), created
    sent = post(request(to=url, sequence=Sequence(created.identifier, 1), payload=b'<order xmlns="urn:test" k="900001"/>',
                         action="urn:test:apply"))
    assert sent.status_code == 202 and not sent.content  # no acknowledgement on the response: it is held
    by_identifier = _poll(url, MakeConnection(identifier=created.identifier))
    assert by_identifier.status_code == 200
    (ack,) = decode(by_identifier.content).acks
    assert ack.identifier == created.identifier and ack.ranges == ((1, 1),)
    assert _poll(url, MakeConnection(address)).status_code == 202  # given once: nothing more waits
    post(request(to=url, sequence=Sequence(created.identifier, 2), payload=b'<order xmlns="urn:test" k="900002"/>',
                  action="urn:test:apply"))
    by_address = decode(_poll(url, MakeConnection(address)).content)
    assert by_address.acks[0].ranges == ((1, 2),) and by_address.message_pending is False


def test_a_fault_reply_reaches_a_polling_client_and_the_replies_after_it_follow(polling_pair):
    """Order 4's handler always fails: it becomes a dead letter at the server and its answer is a SOAP fault
    on the reply sequence. A polling client must store it like any reply (the first version took it for the
    server refusing the poll: the fault was given again for ever and every later reply waited behind it)."""
    pair, client, server = polling_pair(send=10, server_env={"QTP_TEST_FAIL": "4"},
                                        limits="max_attempts = 2")
    wait_until(lambda: rows(pair.client_app, "SELECT COUNT(*) FROM replies")[0][0] >= 10, 60, "10 answers")
    check_exactly_once(pair.client_app, pair.server_app, reply=True, failed={4})
    assert rows(pair.client_app, "SELECT kind FROM replies WHERE k = 4") == [("fault",)]


@pytest.mark.parametrize("listen, anonymous_addresses, accepted", [
    ("127.0.0.1", (), True),      # a loopback node (development): anonymous peers may poll
    ("0.0.0.0", (), False),       # reachable beyond loopback: anonymous peers share one identity, so no
    ("0.0.0.0", ("http://docs.oasis-open.org/ws-rx/wsmc/200702/anonymous*",), True),  # unless allowed
])
def test_anonymous_peers_offer_a_wsmc_endpoint_only_where_allowed(tmp_path, listen, anonymous_addresses, accepted):
    """Anonymous clients all poll as the same (anonymous) owner: on a node reachable beyond loopback one could
    fetch another's replies, so a WS-MC Offer Endpoint from an anonymous peer is refused there unless
    ``anonymous_addresses`` names the WS-MC prefix. Authenticated peers may always use one."""
    import qtp
    from qtp.embedded import free_port
    from qtp.wsrm.protocol import FaultCode, Offer, SequenceFault
    from qtp.wsrm.runtime import Node, NodeSettings
    from qtp.wsrm.runtime._security import Security

    port = free_port()
    tm = qtp.TransactionManager(f"anon-{uuid.uuid4().hex[:6]}", tmp_path / "logs", recovery_interval=None)
    node = Node(tm, NodeSettings(endpoint=f"http://127.0.0.1:{port}/rm", listen=(listen, port), mode="memory",
                                 security=Security(allow_anonymous=True, anonymous_addresses=anonymous_addresses)))
    try:
        offer = Offer(f"urn:uuid:{uuid.uuid4()}", endpoint=mc_anonymous(f"urn:uuid:{uuid.uuid4()}"))
        create = request(CreateSequence(anonymous(WsaVersion.WSA200508), offer=offer), to=node.endpoint)
        body = node.receiver.handle(create, None).envelope.body
        if accepted:
            assert isinstance(body, CreateSequenceResponse) and body.accept_acks_to is not None, body
        else:
            assert isinstance(body, SequenceFault) and body.code is FaultCode.CREATE_SEQUENCE_REFUSED, body
    finally:
        tm.close()


def test_a_client_without_endpoint_can_fetch_its_acknowledgements_too(polling_pair):
    """``acks_to = "poll"``: the client names its WS-MC address as the AcksTo of its own sequence, the server
    holds the acknowledgements (none on the responses) and the client fetches them with its polls."""
    pair, client, server = polling_pair(send=30, acks_to="poll")
    _finish(pair, 30)
    infos = [json.loads(i) for (i,) in rows(pair.server_app, "SELECT info FROM qtp_rm_destination")]
    assert [i["acks_to"] for i in infos if i.get("channel") is None] == [json.loads(
        rows(pair.server_app, "SELECT info FROM qtp_rm_source")[0][0])["peer"]]  # the client's WS-MC address
    wait_until(lambda: rows(pair.client_app, "SELECT COUNT(*) FROM qtp_rm_outgoing")[0][0] == 0, 30,
               "the client's orders acknowledged (by polling)")
