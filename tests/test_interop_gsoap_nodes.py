"""qtp nodes and gSOAP's wsrm plugin, both directions, as OS processes over loopback HTTP.

gSOAP client -> qtp node: the gSOAP RM Source (tests/interop/gsoap/client.c) sends N one-way ``ns:deliver``
messages to a qtp node (``qtp serve --app interop.gsoap_app:node``), whose handler inserts each into the
table ``delivered`` in the global transaction that dequeues it. Checked: every message applied exactly
once, in order, and gSOAP's source saw every message acknowledged and its sequence terminated.

qtp node -> gSOAP server: application transactions at the qtp node insert a row into ``sent`` and
``tx.send`` a message on channel ``gsoap`` (some roll back); the gSOAP RM Destination reports every message
it hands to its application (``GsoapServer.deliveries()``). Checked: each committed message delivered
exactly once, in order, nothing rolled back delivered.

Loss comes from ``RecordingProxy``'s drop callback (tests/interop/gsoap_peer.py) between the two.
"""

from __future__ import annotations

import itertools
import time
import subprocess
from pathlib import Path

import pytest
from interop.gsoap_peer import ClientResult, GsoapServer, RecordingProxy, client_command, post, run_client

from qtp.embedded import free_port
from qtp.wsrm.codec import decode
from qtp.wsrm.protocol import CloseSequenceResponse, FaultCode, SequenceFault, TerminateSequenceResponse
from qtp.testing.lossy_proxy import LossyProxy
from qtp.testing.nodes import NodeProcess, create, rows, wait_until

APP = "interop.gsoap_app:node"
TESTS = Path(__file__).resolve().parent


def _schema(url: str) -> None:
    auto = "SERIAL" if url.startswith("postgresql") else "int AUTO_INCREMENT"
    create(url, f"CREATE TABLE delivered (id {auto} PRIMARY KEY, txt varchar(255) NOT NULL, seq varchar(255), "
                "num bigint)")
    create(url, "CREATE TABLE sent (k int PRIMARY KEY)")


def _config(folder: Path, app: str, port: int, channel: str = "", limits: str = "", defaults: bool = False) -> Path:
    """The node's qtp.toml; ``defaults``: the node's own limits, not the tests' faster retransmission."""
    path = folder / "qtp.toml"
    path.write_text(f'''
[node]
id = "gsoap-{folder.name[-20:].replace('_', '-')}"
log_dir = "{folder / 'logs'}"
endpoint = "http://127.0.0.1:{port}/rm"
listen = "127.0.0.1:{port}"
store = "app"
mode = "xa"

[resources.app]
url = "{app}"

[recovery]
interval = 2

[limits]
{"" if defaults else LIMITS}
{limits}
{channel}''')
    return path


LIMITS = "\n".join(f"{k} = {v}" for k, v in {"retransmit_interval": 0.3, "retransmit_interval_max": 2.0,
                                                "retry_backoff": 0.1, "retry_backoff_max": 1.0,
                                                "http_timeout": 5}.items())


def _channel(peer: str, rm: str, soap: str, acks_to: str = "endpoint") -> str:
    return f'''
[channels.gsoap]
peer = "{peer}"
wsrm = "{rm}"
soap = "{soap}"
addressing = "2005/08"
acks_to = "{acks_to}"
'''


@pytest.fixture
def app_db(request):
    """Factory: app_db("pg" | "maria") -> the URL of a fresh database with the tables of gsoap_app."""
    def make(kind: str) -> str:
        url = request.getfixturevalue("pg_db" if kind == "pg" else "maria_db")("gsoap")
        _schema(url)
        return url
    return make


@pytest.fixture
def qtp_node(tmp_path):
    """Factory: qtp_node(app_url, channel=..., env=...) -> a started NodeProcess; killed at the end."""
    started: list[NodeProcess] = []

    def make(app: str, channel: str = "", env: dict[str, str] | None = None, limits: str = "",
             port: int | None = None, defaults: bool = False) -> NodeProcess:
        config = _config(tmp_path, app, port or free_port(), channel, limits, defaults)
        env = {"PYTHONPATH": str(TESTS), **(env or {})}
        node = NodeProcess(config, tmp_path / "node.log", env, app=APP)
        started.append(node)
        return node.start()

    yield make
    for node in started:
        node.kill()


def _delivered(url: str) -> list[tuple[str, str, int]]:
    return [(t, s, n) for t, s, n in rows(url, "SELECT txt, seq, num FROM delivered ORDER BY id")]


def _check_applied_once(url: str, sequence: str | None, count: int, prefix: str = "message") -> None:
    applied = _delivered(url)
    assert [t for t, _, _ in applied] == [f"{prefix}-{n}" for n in range(1, count + 1)], applied
    assert [n for _, _, n in applied] == list(range(1, count + 1))
    assert {s for _, s, _ in applied} == {sequence}


# ---------------------------------------------------------------------------- gSOAP client -> qtp node

CLIENT_COMBINATIONS = [(rm, soap, db) for (rm, soap), db in
                       zip(itertools.product(("1.1", "1.0"), ("1.1", "1.2")), ("pg", "maria", "maria", "pg"))]


def _check_client_finished(result: ClientResult, rm: str, count: int) -> None:
    """gSOAP's source saw every message acknowledged and terminated its sequence. WS-RM 1.0: the empty
    LastMessage stays unacknowledged in gSOAP's source although qtp's answer acknowledges it (D14), so
    the client exits 1 with exactly that one message left."""
    finished = result.named("TERMINATED")
    assert finished, result.stdout
    if rm == "1.1":
        assert result.ok, result.stdout
        assert finished[0]["unacknowledged"] == "0"
    else:
        assert (finished[0]["sent"], finished[0]["unacknowledged"]) == (str(count + 1), "1"), result.stdout


@pytest.mark.parametrize(("rm", "soap", "db"), CLIENT_COMBINATIONS,
                         ids=[f"rm{r}-soap{s}-{d}" for r, s, d in CLIENT_COMBINATIONS])
def test_gsoap_client_to_qtp_node_applies_each_message_once_in_order(app_db, qtp_node, rm, soap, db):
    app = app_db(db)
    node = qtp_node(app)
    result = run_client(f"http://127.0.0.1:{node.port}/rm", rm=rm, soap=soap, count=5, pause_ms=50, timeout=5)
    _check_client_finished(result, rm, 5)
    wait_until(lambda: len(_delivered(app)) >= 5, 30, "5 applied messages")
    _check_applied_once(app, result.sequence_id, 5)


@pytest.mark.parametrize(("rm", "soap"), [("1.1", "1.2"), ("1.0", "1.1")], ids=["rm1.1-soap1.2", "rm1.0-soap1.1"])
def test_gsoap_client_to_qtp_node_through_loss_and_duplicates(app_db, qtp_node, rm, soap):
    """Requests and answers lost, requests duplicated: gSOAP retries a message whose exchange failed
    (same number), the qtp node acknowledges duplicates without applying them twice."""
    app = app_db("pg")
    node = qtp_node(app)
    with LossyProxy(f"http://127.0.0.1:{node.port}", drop_request=0.15, drop_response=0.15,
                    duplicate_request=0.2, seed=10).start() as proxy:
        result = run_client(proxy.url + "/rm", rm=rm, soap=soap, count=12, pause_ms=50, timeout=3, tries=40,
                            rounds=10, deadline=240)
        stats = proxy.stats()
    assert stats["dropped_requests"] and stats["dropped_responses"] and stats["duplicated"], stats
    _check_client_finished(result, rm, 12)
    wait_until(lambda: len(_delivered(app)) >= 12, 30, "12 applied messages")
    _check_applied_once(app, result.sequence_id, 12)


@pytest.mark.parametrize("rm", ["1.1", "1.0"])
def test_gsoap_client_to_qtp_node_sigkilled_mid_sequence(app_db, qtp_node, rm):
    """xa mode: the qtp node is SIGKILLed twice while gSOAP sends; gSOAP retries against the restarted
    node, which resumes the sequence from its store: every message applied once, in order."""
    app = app_db("maria" if rm == "1.1" else "pg")
    node = qtp_node(app)
    count = 30
    command = client_command(f"http://127.0.0.1:{node.port}/rm", rm=rm, soap="1.1", count=count, pause_ms=200,
                             timeout=3, tries=150, rounds=10)
    client = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for at in (8, 20):
            wait_until(lambda: len(_delivered(app)) >= at, 60, f"{at} applied messages")
            node.kill()
            node.start()
        wait_until(lambda: len(_delivered(app)) >= count, 300, f"{count} applied messages")
        if rm == "1.0":
            # gSOAP's WS-RM 1.0 client never records the acknowledgement of its LastMessage (D14) and retries
            # it for as long as its --tries allow: its exit says nothing more, so it is stopped here.
            client.kill()
        stdout, stderr = client.communicate(timeout=420)
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
    result = ClientResult.of(client.returncode, stdout, stderr)
    if rm == "1.1":
        _check_client_finished(result, rm, count)
        sequence = result.sequence_id
    else:  # the killed client's own report may be lost in its buffer: all must be in one sequence anyway
        sequence = next(iter({s for _, s, _ in _delivered(app)}), None)
    _check_applied_once(app, sequence, count)


# ---------------------------------------------------------------------------- qtp node -> gSOAP server

def _committed(url: str) -> list[int]:
    return [k for (k,) in rows(url, "SELECT k FROM sent ORDER BY k")]


def _unacknowledged(url: str) -> int:
    return rows(url, "SELECT COUNT(*) FROM qtp_rm_outgoing")[0][0]


def _check_delivered_once(server: GsoapServer, app: str) -> None:
    """Every committed message delivered once by gSOAP, per sequence in order; nothing rolled back."""
    committed = _committed(app)
    delivered = server.wait_for(len(committed), 60)
    texts = [d.text for d in delivered]
    assert sorted(texts, key=lambda t: int(t.split("-")[1])) == [f"qtp-{k}" for k in committed], texts
    assert len(set(texts)) == len(texts), texts
    for identifier in {d.identifier for d in delivered}:
        numbers = [d.number for d in delivered if d.identifier == identifier]
        assert numbers == sorted(numbers)
        keys = [int(d.text.split("-")[1]) for d in delivered if d.identifier == identifier]
        assert keys == sorted(keys)


SERVER_COMBINATIONS = [(rm, soap, db) for (rm, soap), db in
                       zip(itertools.product(("1.1", "1.0"), ("1.1", "1.2")), ("maria", "pg", "pg", "maria"))]


@pytest.mark.parametrize(("rm", "soap", "db"), SERVER_COMBINATIONS,
                         ids=[f"rm{r}-soap{s}-{d}" for r, s, d in SERVER_COMBINATIONS])
def test_qtp_node_to_gsoap_server_delivers_each_committed_message_once(app_db, qtp_node, rm, soap, db):
    app = app_db(db)
    with GsoapServer(free_port(), rm) as server:
        qtp_node(app, _channel(server.url, rm, soap), {"QTP_TEST_SEND": "12", "QTP_TEST_ABORT_EVERY": "5"})
        wait_until(lambda: len(_committed(app)) == 10, 60, "10 committed sends")
        _check_delivered_once(server, app)
        wait_until(lambda: _unacknowledged(app) == 0, 60, "every message acknowledged")
        assert len(server.deliveries()) == 10


@pytest.mark.parametrize(("rm", "soap"), [("1.1", "1.1"), ("1.0", "1.2")], ids=["rm1.1-soap1.1", "rm1.0-soap1.2"])
def test_qtp_node_to_gsoap_server_through_loss_and_duplicates(app_db, qtp_node, rm, soap):
    app = app_db("pg")
    with GsoapServer(free_port(), rm) as server, \
            LossyProxy(server.url.rstrip("/"), drop_request=0.15, drop_response=0.15, duplicate_request=0.2,
                       seed=3).start() as proxy:
        qtp_node(app, _channel(proxy.url + "/", rm, soap), {"QTP_TEST_SEND": "20", "QTP_TEST_ABORT_EVERY": "7"})
        wait_until(lambda: len(_committed(app)) == 18, 60, "18 committed sends")
        _check_delivered_once(server, app)
        wait_until(lambda: _unacknowledged(app) == 0, 90, "every message acknowledged")
        stats = proxy.stats()
    assert stats["dropped_requests"] and stats["dropped_responses"] and stats["duplicated"], stats
    assert len(server.deliveries()) == 18



# ---------------------------------------------------------------------------- 2006 plug-fest scenarios
# Those that apply to a one-way peer: sequence creation and retransmission after loss are in every test
# above; here: acknowledgement ranges with gaps, close and terminate, faults for unknown sequences.

def test_plugfest_qtp_destination_acknowledges_a_gap_as_two_ranges_and_refuses_it_after_close(app_db, qtp_node):
    """gSOAP -> qtp, WS-RM 1.1: message 2 is swallowed on the way (answered 202 by the proxy). qtp's
    acknowledgements show the gap (1, 3-4), also the Final one in its CloseSequenceResponse. gSOAP's source
    resends only after closing (D15); qtp refuses a message for a closed sequence (SequenceClosed, WS-RM 1.1
    section 3.5), so 2 is never applied and gSOAP reports it unacknowledged; 1, 3 and 4 are applied once, in
    order (NoDiscard)."""
    app = app_db("pg")
    node = qtp_node(app)
    swallowed: list[int] = []

    def drop(index: int, body: bytes) -> str | None:
        if b"<wsrm:MessageNumber>2</wsrm:MessageNumber>" in body and not swallowed:
            swallowed.append(index)
            return "swallow"
        return None

    with RecordingProxy(free_port(), f"http://127.0.0.1:{node.port}/rm", drop=drop) as proxy:
        result = run_client(proxy.url, rm="1.1", soap="1.2", count=4, pause_ms=50, timeout=5, rounds=2)
        exchanges = list(proxy.exchanges)
    answers = [(e.request, decode(e.response)) for e in exchanges if e.response]
    acks = [a.ranges for _, answer in answers for a in answer.acks]
    assert acks[:3] == [((1, 1),), ((1, 1), (3, 3)), ((1, 1), (3, 4))]
    closes = [answer for request, answer in answers if b"/CloseSequence<" in request]
    assert isinstance(closes[0].body, CloseSequenceResponse) and closes[0].acks[0].final
    resent = [answer.body for request, answer in answers if b"<text>message-2<" in request]
    assert resent and all(isinstance(f, SequenceFault) and f.code is FaultCode.SEQUENCE_CLOSED for f in resent)
    assert result.named("TERMINATED")[0]["unacknowledged"] == "1" and result.returncode == 1
    wait_until(lambda: len(_delivered(app)) >= 3, 30, "3 applied messages")
    assert [(t, n) for t, _, n in _delivered(app)] == [("message-1", 1), ("message-3", 3), ("message-4", 4)]


@pytest.mark.parametrize("rm", ["1.1", "1.0"])
def test_plugfest_qtp_source_closes_and_terminates_its_sequences_at_gsoap(app_db, qtp_node, rm):
    """qtp -> gSOAP: a sequence ends after 4 messages ([limits] sequence_max_messages): qtp completes it
    (1.1 CloseSequence, 1.0 LastMessage), waits for the acknowledgements, terminates it, and goes on in a new
    sequence; gSOAP answers the 1.1 Close and Terminate with their responses."""
    app = app_db("maria")
    with GsoapServer(free_port(), rm) as server, RecordingProxy(free_port(), server.url) as proxy:
        qtp_node(app, _channel(proxy.url, rm, "1.1"), {"QTP_TEST_SEND": "10"}, limits="sequence_max_messages = 4")
        wait_until(lambda: len(_committed(app)) == 10, 60, "10 committed sends")
        _check_delivered_once(server, app)
        wait_until(lambda: _unacknowledged(app) == 0, 60, "every message acknowledged")
        wait_until(lambda: sum(b"/TerminateSequence<" in e.request for e in proxy.exchanges) >= 2, 60,
                   "two terminated sequences")
        exchanges = list(proxy.exchanges)
    assert len({d.identifier for d in server.deliveries()}) == 3
    if rm == "1.1":
        answers = [decode(e.response).body for e in exchanges
                   if (b"/CloseSequence<" in e.request or b"/TerminateSequence<" in e.request) and e.response]
        assert any(isinstance(a, CloseSequenceResponse) for a in answers)
        assert any(isinstance(a, TerminateSequenceResponse) for a in answers)
    else:
        assert sum(b"/LastMessage<" in e.request for e in exchanges) >= 2


def test_plugfest_qtp_destination_faults_a_message_for_an_unknown_sequence(app_db, qtp_node):
    """gSOAP -> qtp: a message of a sequence qtp never made gets an UnknownSequence fault (500, SOAP 1.1)."""
    app = app_db("pg")
    node = qtp_node(app)
    with RecordingProxy(free_port(), f"http://127.0.0.1:{node.port}/rm") as proxy:
        result = run_client(proxy.url, rm="1.1", soap="1.1", count=1, pause_ms=50, timeout=5)
        message = next(e.request for e in proxy.exchanges if b"<wsrm:MessageNumber>1<" in e.request)
    assert result.ok, result.stdout
    assert result.sequence_id is not None
    forged = message.replace(result.sequence_id.encode(), b"urn:uuid:00000000-0000-0000-0000-000000000000")
    status, _, body = post(f"http://127.0.0.1:{node.port}/rm", forged, "text/xml; charset=utf-8",
                           '"urn:qtp:interop:gsoap/deliver"')
    fault = decode(body).body
    assert status == 500 and isinstance(fault, SequenceFault) and fault.code is FaultCode.UNKNOWN_SEQUENCE
    assert [t for t, _, _ in _delivered(app)] == ["message-1"]


def test_plugfest_qtp_source_starts_over_when_a_restarted_gsoap_knows_its_sequence_no_more(app_db, qtp_node):
    """qtp -> gSOAP, WS-RM 1.1: gSOAP keeps sequences in memory only; after it is SIGKILLed and restarted it
    answers qtp's messages with UnknownSequence faults. qtp ends that sequence and sends what was not
    acknowledged again in a new one: every committed message delivered, at least once (those delivered but
    not acknowledged before the crash twice: gSOAP forgot it had them). 200 messages, and a close watch
    for the third delivery, so that the application is still committing when gSOAP is killed (a qtp node
    delivers a dozen in a few milliseconds)."""
    app = app_db("pg")
    server = GsoapServer(free_port(), "1.1").start()
    try:
        qtp_node(app, _channel(server.url, "1.1", "1.1"), {"QTP_TEST_SEND": "200"})
        wait_until(lambda: len(server.deliveries()) >= 3, 60, "3 deliveries", poll=0.005)
        before = server.deliveries()
        server.kill()
        server.start()
        wait_until(lambda: len(_committed(app)) == 200, 60, "200 committed sends")
        wait_until(lambda: {d.text for d in before + server.deliveries()} >= {f"qtp-{k}" for k in range(1, 201)},
                   90, "every committed message delivered")
        after = server.deliveries()
    finally:
        server.stop()
    assert len({d.identifier for d in after}) >= 1
    assert not {d.identifier for d in before} & {d.identifier for d in after}
    for identifier in {d.identifier for d in after}:
        keys = [int(d.text.split("-")[1]) for d in after if d.identifier == identifier]
        assert keys == sorted(keys) and len(set(keys)) == len(keys)


# ---------------------------------------------------------------------------- a strict gSOAP, qtp at its defaults


def _channel_at_defaults(peer: str, rm: str) -> str:
    """Only what must be said: WS-RM version and addressing; every limit and option at qtp's default."""
    return f'''
[channels.gsoap]
peer = "{peer}"
wsrm = "{rm}"
addressing = "{'2005/08' if rm == '1.1' else '2004/08'}"
'''


def _in_order(delivered: list) -> str:
    return " ".join(f"{d.text}@{d.number}" for d in delivered)


@pytest.mark.parametrize("rm", ["1.1", "1.0"])
def test_a_strict_gsoap_at_its_defaults_gets_30_messages_in_order_within_5_s(app_db, qtp_node, rm):
    """gSOAP's server at its defaults discards a message that arrives after a gap (no wait_ms). A qtp node at
    its defaults sends one sequence's messages one request at a time in number order, so none is
    discarded: 30 messages committed at once are delivered, in order, within 5 s of starting the node
    (its start-up included)."""
    app = app_db("pg")
    with GsoapServer(free_port(), rm, wait_ms=0) as server:
        began = time.monotonic()
        qtp_node(app, _channel_at_defaults(server.url, rm), {"QTP_TEST_SEND": "30"}, defaults=True)
        delivered = server.wait_for(30, timeout=max(0.1, began + 5.0 - time.monotonic()))
        took = time.monotonic() - began
    texts = [d.text for d in delivered]
    assert texts == [f"qtp-{k}" for k in range(1, 31)], f"{len(texts)} of 30 in {took:.1f} s: {_in_order(delivered)}"


@pytest.mark.parametrize("rm", ["1.1", "1.0"])
def test_a_strict_gsoap_behind_a_lossy_network_gets_every_message(app_db, qtp_node, rm):
    """The same through a proxy that drops, duplicates and delays: every message arrives once, in order
    (gSOAP delivers each number once); a lost one costs a retransmission timeout, hence the longer bound."""
    app = app_db("pg")
    with GsoapServer(free_port(), rm, wait_ms=0) as server, \
            LossyProxy(server.url, drop_request=0.1, drop_response=0.1, duplicate_request=0.1, seed=3) as proxy:
        qtp_node(app, _channel_at_defaults(proxy.url, rm), {"QTP_TEST_SEND": "30"}, defaults=True)
        delivered = server.wait_for(30, timeout=60)
    texts = [d.text for d in delivered]
    assert texts == [f"qtp-{k}" for k in range(1, 31)], f"{len(texts)} of 30: {_in_order(delivered)}"
