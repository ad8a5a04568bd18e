"""The endpoint and the node's limits against bad input: every refusal leaves nothing in the store.

A node runs in this process (its HTTP server included) on a PostgreSQL store; requests are made with
``requests`` and hand-built envelopes, as a hostile or broken peer would send them.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import sqlalchemy as sa

import qtp
from qtp.embedded import free_port
from qtp.errors import BacklogFullError, ConfigurationError, ResourceUnavailableError
from qtp.testing.nodes import counter
from qtp.wsrm.codec import (
    BATCH_CONTENT_TYPE,
    Addressing,
    Envelope,
    SoapVersion,
    WsaVersion,
    decode,
    default_action,
    encode,
    encode_batch,
)
from qtp.wsrm.codec import EncodingError
from qtp.wsrm.protocol import (
    AckRequested,
    CreateSequence,
    CreateSequenceResponse,
    FaultCode,
    RMVersion,
    Sequence,
    SequenceFault,
    TerminateSequence,
)
from qtp.wsrm.runtime import Limits, Node, NodeSettings
from qtp.wsrm.runtime._settings import ChannelSettings
from qtp.wsrm.runtime._transport import content_type

WSA = WsaVersion.WSA200508
ANON = "http://www.w3.org/2005/08/addressing/anonymous"


def _store_counts(url: str) -> tuple[int, int, int]:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with engine.connect() as conn:
        counts = tuple(conn.execute(sa.text(f"SELECT COUNT(*) FROM {t}")).scalar()
                       for t in ("qtp_rm_incoming", "qtp_rm_destination", "qtp_rm_outgoing"))
    engine.dispose()
    return counts  # type: ignore[return-value]


@pytest.fixture
def node(pg_db, tmp_path):
    """Factory: node(**limits) -> (Node, store url), started with an HTTP endpoint; closed at the end."""
    made = []

    def make(channels: dict | None = None, **limits) -> tuple[Node, str]:
        url = pg_db("node")
        tm = qtp.TransactionManager(f"n{len(made)}-{uuid.uuid4().hex[:6]}", tmp_path / "logs", recovery_interval=None)
        tm.add_resource("app", url)
        port = free_port()
        settings = NodeSettings(endpoint=f"http://127.0.0.1:{port}/rm", store="app", channels=channels or {},
                                limits=Limits(**{"retransmit_interval": 0.2, **limits}))
        n = Node(tm, settings)

        @n.handler("urn:t:do")
        def hold(tx, message):  # the messages stay stored: what these tests count
            raise ResourceUnavailableError("held by the test")

        n.start()
        made.append(n)
        return n, url

    yield make
    for n in made:
        n.close()


def _post(n: Node, envelope: Envelope) -> tuple[int, Envelope | None]:
    envelope = _with_action(envelope)
    r = requests.post(n.endpoint, data=encode(envelope), timeout=10,
                      headers={"Content-Type": content_type(envelope.soap, envelope.addressing.action)})
    return r.status_code, (decode(r.content) if r.content else None)


def _env(body=None, **kw) -> Envelope:
    addressing = Addressing(action=kw.pop("action", None), to="http://x/rm", message_id=f"urn:uuid:{uuid.uuid4()}",
                            reply_to=ANON)
    return Envelope(soap=kw.pop("soap", SoapVersion.SOAP12), rm=kw.pop("rm", RMVersion.WSRM11), wsa=WSA,
                    addressing=addressing, body=body, **kw)


def _create(n: Node) -> str:
    status, answer = _post(n, _env(CreateSequence(ANON)))
    assert status == 200 and isinstance(answer.body, CreateSequenceResponse)
    return answer.body.identifier


def _message(identifier: str, number: int, payload: bytes = b"<o xmlns='urn:t'/>") -> Envelope:
    return _env(sequence=Sequence(identifier, number), payload=payload, action="urn:t:do")


def test_http_level_refusals(node):
    n, url = node(max_request_bytes=2000)
    assert requests.get(n.endpoint, timeout=5).status_code == 405
    assert requests.put(n.endpoint, data=b"x", timeout=5).status_code == 405
    assert requests.post(n.endpoint, data=b"<a/>", headers={"Content-Type": "application/json"}, timeout=5).status_code == 415
    big = b"<a>" + b"x" * 5000 + b"</a>"
    assert requests.post(n.endpoint, data=big, headers={"Content-Type": "text/xml"}, timeout=5).status_code == 413
    assert requests.get(n.endpoint.replace("/rm", "/health"), timeout=5).text.strip() == "ok"
    assert _store_counts(url) == (0, 0, 0)


@pytest.mark.parametrize("body", [
    b"not xml at all", b"<unclosed", b"<?xml version='1.0'?><!DOCTYPE x [<!ENTITY a 'b'>]><x>&a;</x>",
    b"<S:Envelope xmlns:S='http://www.w3.org/2003/05/soap-envelope'><S:Body><a/><b/></S:Body></S:Envelope>",
    b"<a>" * 5000 + b"</a>" * 5000,
])
def test_malformed_or_hostile_soap_gets_a_fault_and_stores_nothing(node, body):
    n, url = node()
    r = requests.post(n.endpoint, data=body, headers={"Content-Type": "application/soap+xml"}, timeout=10)
    assert r.status_code == 400
    assert b"Fault" in r.content
    assert _store_counts(url) == (0, 0, 0)


def test_unknown_and_terminated_sequences_get_their_ws_rm_faults(node):
    n, url = node()
    status, answer = _post(n, _message("urn:uuid:nobody", 1))
    assert status == 400 and isinstance(answer.body, SequenceFault)
    assert answer.body.code is FaultCode.UNKNOWN_SEQUENCE
    identifier = _create(n)
    status, answer = _post(n, _env(TerminateSequence(identifier)))
    assert status == 200
    status, answer = _post(n, _message(identifier, 1))
    assert answer.body.code is FaultCode.SEQUENCE_TERMINATED
    assert _store_counts(url)[0] == 0


def test_messages_are_stored_once_and_acknowledged_after_storing(node):
    n, url = node()
    identifier = _create(n)
    for number, acknowledged in ((1, ((1, 1),)), (2, ((1, 2),)), (2, ((1, 2),)), (1, ((1, 2),))):
        status, answer = _post(n, _message(identifier, number))
        assert status == 200 and answer.acks[0].ranges == acknowledged
    status, answer = _post(n, _env(ack_requests=(AckRequested(identifier),), action=None))
    assert answer.acks[0].ranges == ((1, 2),)
    assert _store_counts(url)[0] == 2  # held by the handler: both wait, each stored once


def test_create_sequence_beyond_the_limit_is_refused(node):
    n, url = node(max_open_sequences=2)
    _create(n)
    _create(n)
    status, answer = _post(n, _env(CreateSequence(ANON)))
    assert isinstance(answer.body, SequenceFault) and answer.body.code is FaultCode.CREATE_SEQUENCE_REFUSED
    assert _store_counts(url)[1] == 2


def test_a_retransmitted_create_sequence_gets_the_same_sequence(node):
    n, _ = node()
    request = _env(CreateSequence(ANON))
    first = _post(n, request)[1].body.identifier
    again = _post(n, request)[1].body.identifier
    assert first == again


def test_a_full_invoker_backlog_refuses_before_storing(node):
    n, url = node(max_invoker_backlog=3)
    identifier = _create(n)
    for number in (1, 2, 3):
        assert _post(n, _message(identifier, number))[0] == 200
    status, answer = _post(n, _message(identifier, 4))
    assert status == 503 and answer.body.reason.startswith("the node's backlog")
    assert _store_counts(url)[0] == 3
    status, answer = _post(n, _message(identifier, 2))  # a duplicate is still acknowledged
    assert status == 200 and answer.acks[0].ranges == ((1, 3),)


def test_send_refuses_bad_input_and_a_full_backlog(node):
    channel = ChannelSettings("out", peer="http://127.0.0.1:9/rm", store="app")  # nobody listens there
    n, url = node(channels={"out": channel}, max_backlog=3)
    qtp.install(n.manager)
    try:
        with pytest.raises(ConfigurationError, match="unknown channel"):
            with qtp.transaction() as tx:
                tx.send("nope", b"<a/>", action="urn:a")
        with pytest.raises(EncodingError):
            with qtp.transaction() as tx:
                tx.send("out", b"<a><b></a>", action="urn:a")
        with pytest.raises(ConfigurationError, match="action"):
            with qtp.transaction() as tx:
                tx.send("out", b"<a/>", action="")
        for _ in range(3):
            with qtp.transaction() as tx:
                tx.send("out", b"<a/>", action="urn:a")
        time.sleep(1.1)  # the node re-counts its backlog at most once a second
        with pytest.raises(BacklogFullError) as caught:
            with qtp.transaction() as tx:
                tx.send("out", b"<a/>", action="urn:a")
        assert caught.value.retryable
        assert _store_counts(url)[2] == 3
    finally:
        qtp.install(None)


def test_metrics_are_served(node):
    n, _ = node()
    identifier = _create(n)
    _post(n, _message(identifier, 1))
    text = requests.get(n.endpoint.replace("/rm", "/metrics"), timeout=5).text
    assert 'qtp_messages_received_total{node="' in text and "qtp_sequences_open" in text
    line = next(x for x in text.splitlines() if x.startswith("qtp_messages_received_total"))
    assert line.endswith(" 1.0")


# ---------------------------------------------------------------------------------------- the transfer path


def _stored_commits(n: Node) -> tuple[float, float]:
    """(local commits that stored messages, messages they stored), from the node's /metrics."""
    url = n.endpoint.replace("/rm", "/metrics")
    return counter(url, "qtp_store_messages_count") or 0.0, counter(url, "qtp_store_messages_sum") or 0.0


def test_concurrent_requests_of_one_sequence_share_commits(node):
    """Group commit: 16 clients post one sequence's 320 messages one per request at once; each request is
    acknowledged with its own number, every message is stored once, and in fewer commits than messages."""
    n, url = node()
    identifier = _create(n)

    def post(number: int) -> bool:
        status, answer = _post(n, _message(identifier, number))
        return status == 200 and any(lo <= number <= hi for ack in answer.acks for lo, hi in ack.ranges)

    with ThreadPoolExecutor(16) as pool:
        acknowledged = list(pool.map(post, range(1, 321)))
    assert all(acknowledged)
    assert _store_counts(url)[0] == 320
    commits, stored = _stored_commits(n)
    assert stored == 320 and commits < 320, (commits, stored)


def test_a_qtp_batch_is_stored_in_one_commit_and_acknowledged_in_one_answer(node):
    n, url = node(max_batch=8)
    status, answer = _post(n, _env(CreateSequence(ANON, batch=500)))
    assert answer.body.batch == 8  # the smaller of the two
    identifier = answer.body.identifier
    parts = [encode(_with_action(_message(identifier, k))) for k in (1, 2, 3)]
    r = requests.post(n.endpoint, data=encode_batch(parts), headers={"Content-Type": BATCH_CONTENT_TYPE}, timeout=10)
    assert r.status_code == 200
    assert decode(r.content).acks[0].ranges == ((1, 3),)
    assert _store_counts(url)[0] == 3 and _stored_commits(n) == (1.0, 3.0)


@pytest.mark.parametrize("body", [b"QTP-BATCH/1\n99\n<a/>", b"QTP-BATCH/1\nx\n", b"QTP-BATCH/2\n4\n<a/>",
                                  b"QTP-BATCH/1\n"])
def test_a_broken_batch_gets_a_sender_fault_and_stores_nothing(node, body):
    n, url = node()
    r = requests.post(n.endpoint, data=body, headers={"Content-Type": BATCH_CONTENT_TYPE}, timeout=10)
    assert r.status_code == 400 and b"unreadable qtp batch" in r.content
    assert _store_counts(url) == (0, 0, 0)


def test_a_batch_over_the_agreed_size_is_refused(node):
    n, url = node(max_batch=2)
    identifier = _create(n)
    parts = [encode(_with_action(_message(identifier, k))) for k in (1, 2, 3)]
    r = requests.post(n.endpoint, data=encode_batch(parts), headers={"Content-Type": BATCH_CONTENT_TYPE}, timeout=10)
    assert r.status_code == 400 and b"more than 2 envelopes" in r.content
    assert _store_counts(url)[0] == 0


def _with_action(envelope: Envelope) -> Envelope:
    return dataclasses.replace(envelope, addressing=dataclasses.replace(
        envelope.addressing, action=envelope.addressing.action or default_action(envelope)))
