"""A hostile client against real node processes (issue 21): each attack is refused, and the honest peer
that keeps sending through it loses nothing (its orders are reconciled exactly once at the end).

The honest pair authenticates with a shared secret and takes no anonymous requests. The attacker is this
test process, either anonymous or as ``mallory``: a peer the server (and the client) know and authenticate,
with its own secret, which must still not touch the honest peer's sequences nor make a node send elsewhere.
What each attack did before the fix is in the module's git history and in docs/security.md.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

import pytest
import requests
import sqlalchemy

from qtp.embedded import free_port
from qtp.errors import ConfigurationError, TransportError
from qtp.testing.lossy_proxy import LossyProxy
from qtp.testing.nodes import (
    NodeProcess,
    Pair,
    check_exactly_once,
    client_schema,
    post_as,
    request,
    rows,
    server_schema,
    wait_until,
)
from qtp.wsrm.codec import (
    Envelope,
    MakeConnection,
    SoapFault,
    SoapVersion,
    WsaVersion,
    anonymous,
    decode,
    encode,
)
from qtp.wsrm.protocol import (
    AckRequested,
    CreateSequence,
    CreateSequenceResponse,
    FaultCode,
    Offer,
    Sequence,
    SequenceAcknowledgement,
    SequenceFault,
    TerminateSequence,
)
from qtp.wsrm.runtime._security import HEADER, sign_response
from qtp.wsrm.runtime._transport import Transport, content_type

SECRET = "honest-pair-secret-0123456789abcdefghij"
MALLORY = "mallory-secret-0123456789abcdefghijklmn"
WSA = WsaVersion.WSA200508
ANON = anonymous(WSA)
ACTION = "urn:test:apply"


# ---------------------------------------------------------------------------------------------- set-up

class Trap:
    """An HTTP server that counts what reaches it: the 'internal service' an attacker aims a node at, and
    mallory's own endpoint. ``forge(body)``, when set, gives what mallory answers a request with (an envelope,
    signed as mallory when the request was signed; None: 202 and nothing)."""

    def __init__(self) -> None:
        hits = self.hits = []
        self.forge: Callable[[bytes], Envelope | None] | None = None
        trap = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                hits.append(self.path)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                forged = trap.forge(body) if trap.forge is not None else None
                if forged is None:
                    self.send_response(202)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                answer = encode(forged)
                self.send_response(200)
                self.send_header("Content-Type", content_type(SoapVersion.SOAP12, None))
                self.send_header("Content-Length", str(len(answer)))
                if self.headers.get(HEADER):
                    self.send_header(HEADER, sign_response(MALLORY.encode(), "mallory", self.headers[HEADER], 200,
                                                           answer))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/rm"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


@pytest.fixture
def trap():
    t = Trap()
    yield t
    t.close()


@pytest.fixture
def hostile(pg_db, maria_db, trap, run_pair):
    """Factory: hostile(send=N, reply=..., limits=..., rate=...) -> (pair, client, server), both running."""
    def make(send: int, reply: bool = False, limits: str = "", rate: float = 0.0, acks_to: str = "anonymous",
             client_extra: str = "", server_env: dict[str, str] | None = None, **options):
        client_app, server_app = pg_db("client"), maria_db("server")
        client_schema(client_app)
        server_schema(server_app)
        mallory = f'\n[peers.mallory]\nendpoint = "{trap.url}"\nsecret = "{MALLORY}"\n'
        pair = Pair(client_app, server_app, reply=reply, limits=limits, secret=SECRET, acks_to=acks_to,
                    server_extra=mallory, client_extra=mallory + client_extra, **options)
        client, server = run_pair(pair, send, rate, server_env)
        return pair, client, server

    return make


def _post(url: str, envelope: Envelope | bytes, as_peer: str | None = "mallory",
          secret: str = MALLORY) -> tuple[int, bytes]:
    """POST as ``as_peer`` (signed with ``secret``) or anonymously (None)."""
    answer = post_as(url, envelope, as_peer, secret)
    return answer.status_code, answer.content


def _answer(content: bytes) -> Envelope:
    return decode(content)


def _url(node: NodeProcess) -> str:
    return f"http://127.0.0.1:{node.port}/rm"


def _client_sequence(pair: Pair) -> str:
    """The identifier of the honest client's sequence, as the server stored it."""
    found = rows(pair.server_app, "SELECT identifier, info FROM qtp_rm_destination")
    return next(i for i, info in found if (json.loads(info).get("owner") or "").startswith("client-"))


def _applied(pair: Pair) -> int:
    return rows(pair.server_app, "SELECT COUNT(*) FROM applied")[0][0]


def _finish(pair: Pair, count: int, reply: bool = False) -> None:
    wait_until(lambda: _applied(pair) >= count, 120, f"{count} applied orders")
    if reply:
        wait_until(lambda: rows(pair.client_app, "SELECT COUNT(*) FROM replies")[0][0] >= count, 120,
                   f"{count} replies")
    result = check_exactly_once(pair.client_app, pair.server_app, reply)
    assert result["committed"] == count == result["applied"]


# ---------------------------------------------------------------------------------------------- attacks

def test_a_forged_acknowledgement_loses_no_committed_message(hostile):
    """Attack 1: with the server down, acknowledge the client's unacknowledged messages on its behalf."""
    pair, client, server = hostile(send=40, rate=8)
    wait_until(lambda: _applied(pair) >= 8, 60, "the first orders applied")
    identifier = _client_sequence(pair)
    server.kill()
    wait_until(lambda: rows(pair.client_app, "SELECT COUNT(*) FROM qtp_rm_outgoing")[0][0] >= 5, 30,
               "orders waiting at the client")
    waiting = rows(pair.client_app, "SELECT COUNT(*) FROM qtp_rm_outgoing")[0][0]
    wait_until(lambda: rows(pair.client_app, "SELECT MAX(number) FROM qtp_rm_outgoing")[0][0], 30, "numbered")
    top = rows(pair.client_app, "SELECT MAX(number) FROM qtp_rm_outgoing")[0][0]  # exactly what was sent
    forged = request(acks=(SequenceAcknowledgement(identifier, ((1, top),)),))
    status, _ = _post(_url(client), forged, as_peer=None)
    assert status == 401  # anonymous: not even read
    status, body = _post(_url(client), forged)  # mallory: authenticated, but not the server
    assert status == 403 and b"another peer" in body
    time.sleep(1.0)  # the client's maintenance tick would have applied it by now
    assert rows(pair.client_app, "SELECT COUNT(*) FROM qtp_rm_outgoing")[0][0] >= waiting
    server.start()
    _finish(pair, 40)


def test_another_peers_sequence_cannot_be_used_ended_or_taken_over(hostile):
    """A peer writes into, asks about, terminates, or re-creates (by its CreateSequence MessageID) the
    honest client's sequence at the server."""
    pair, client, server = hostile(send=30, rate=10)
    wait_until(lambda: _applied(pair) >= 3, 60, "the first orders applied")
    identifier = _client_sequence(pair)
    before = _applied(pair)
    attempts = [
        request(sequence=Sequence(identifier, 10_000), payload=b"<o xmlns='urn:test' k='999999'/>", action=ACTION),
        request(ack_requests=(AckRequested(identifier),)),
        request(TerminateSequence(identifier)),
    ]
    for envelope in attempts:
        status, body = _post(_url(server), envelope)
        assert status == 403, body
    (info,) = [i for (i,) in rows(pair.server_app, f"SELECT info FROM qtp_rm_destination WHERE identifier = "
                                                   f"'{identifier}'")]
    create_id = json.loads(info)["create_message_id"]
    status, body = _post(_url(server), request(CreateSequence(ANON), message_id=create_id))
    assert status == 200
    assert _answer(body).body.identifier != identifier  # a sequence of its own, not the client's
    assert rows(pair.server_app, "SELECT COUNT(*) FROM applied WHERE k = 999999")[0][0] == 0
    assert _applied(pair) >= before
    _finish(pair, 30)


def test_another_peer_sending_a_victims_message_ids_first_does_not_make_them_duplicates(hostile):
    """Duplicate detection across sequences remembers MessageIDs (qtp_rm_applied). A peer that sends the
    honest client's MessageIDs first (an eavesdropper saw them on the wire while the server was down) had its
    own messages applied under them, and the client's real orders were then consumed as duplicates: lost.
    Now a MessageID counts as applied only within the peer that sent it."""
    pair, client, server = hostile(send=20, rate=10)
    wait_until(lambda: _applied(pair) >= 3, 60, "the first orders applied")
    server.kill()
    wait_until(lambda: rows(pair.client_app, "SELECT COUNT(*) FROM qtp_rm_outgoing")[0][0] >= 3, 30,
               "orders waiting at the client")
    os.killpg(client.proc.pid, signal.SIGSTOP)  # the client cannot retransmit before mallory has struck
    try:
        seen = [m for (m,) in rows(pair.client_app, "SELECT message_id FROM qtp_rm_outgoing")]
        server.start()
        status, body = _post(_url(server), request(CreateSequence(ANON)))
        identifier = _answer(body).body.identifier
        for number, message_id in enumerate(seen, 1):
            order = f'<order xmlns="urn:test" k="{7_000_000 + number}"/>'.encode()
            status, body = _post(_url(server), request(sequence=Sequence(identifier, number), payload=order,
                                                    action=ACTION, message_id=message_id))
            assert status in (200, 202), body
        wait_until(lambda: rows(pair.server_app, "SELECT COUNT(*) FROM applied WHERE k >= 7000000")[0][0]
                   == len(seen), 30, "mallory's own orders applied")
        engine = sqlalchemy.create_engine(pair.server_app, poolclass=sqlalchemy.pool.NullPool)
        with engine.begin() as conn:  # mallory's own orders, not the client's: out of the tally
            conn.execute(sqlalchemy.text("DELETE FROM applied WHERE k >= 7000000"))
        engine.dispose()
    finally:
        os.killpg(client.proc.pid, signal.SIGCONT)
    _finish(pair, 20)


def test_a_node_sends_only_to_its_peers_addresses(hostile, trap):
    """Attack 2 (SSRF and reflection): AcksTo, ReplyTo and the Offer's Endpoint aimed at another service."""
    pair, client, server = hostile(send=10)
    elsewhere = f"http://127.0.0.1:{client.port + 1}/internal"
    for create in (request(CreateSequence(elsewhere)),
                   request(CreateSequence(ANON), reply_to=elsewhere),
                   request(CreateSequence(ANON, offer=Offer(f"urn:uuid:{uuid.uuid4()}", endpoint=elsewhere)))):
        status, body = _post(_url(server), create)
        answer = _answer(body)
        assert isinstance(answer.body, SequenceFault), body
        assert answer.body.code is FaultCode.CREATE_SEQUENCE_REFUSED and "not an address of this peer" in \
            answer.body.reason
    status, body = _post(_url(server), request(CreateSequence(elsewhere)), as_peer=None)
    assert status == 401
    # mallory's own address is fine: acknowledgements of a gapped message go there, and only there
    status, body = _post(_url(server), request(CreateSequence(trap.url)))
    identifier = _answer(body).body.identifier
    status, _ = _post(_url(server), request(sequence=Sequence(identifier, 3), payload=b"<o xmlns='urn:test' k='-1'/>",
                                         action=ACTION))
    assert status == 202
    wait_until(lambda: trap.hits, 10, "the acknowledgement at mallory's own AcksTo")
    _finish(pair, 10)


def test_an_offer_identifier_in_use_is_refused(hostile, trap):
    """Attack 3 (reply hijack): offer the identifier the honest client offered for its replies."""
    pair, client, server = hostile(send=20, reply=True, rate=10)
    wait_until(lambda: rows(pair.client_app, "SELECT COUNT(*) FROM replies")[0][0] >= 3, 60, "the first replies")
    (offered,) = [json.loads(r)["route"][len("offer:"):] for (r,) in
                  rows(pair.server_app, "SELECT info FROM qtp_rm_source") if "offer:" in r][:1]
    status, body = _post(_url(server), request(CreateSequence(trap.url, offer=Offer(offered, endpoint=trap.url))))
    answer = _answer(body)
    assert isinstance(answer.body, SequenceFault) and answer.body.code is FaultCode.CREATE_SEQUENCE_REFUSED
    assert "in use" in answer.body.reason
    _finish(pair, 20, reply=True)
    assert not [h for h in trap.hits if h]  # no reply went to mallory


def test_one_peer_cannot_exhaust_what_another_needs(hostile):
    """Attack 4: sequences, unknown actions and far-ahead numbers from one peer; the honest peer goes on."""
    pair, client, server = hostile(send=30, rate=10, limits="max_sequences_per_peer = 4\nmax_gap = 64")
    created = []
    for _ in range(6):
        status, body = _post(_url(server), request(CreateSequence(ANON)))
        answer = _answer(body)
        if isinstance(answer.body, CreateSequenceResponse):
            created.append(answer.body.identifier)
        else:
            assert answer.body.code is FaultCode.CREATE_SEQUENCE_REFUSED and "max_sequences_per_peer" in \
                answer.body.reason
    assert len(created) == 4
    status, body = _post(_url(server), request(sequence=Sequence(created[0], 1), payload=b"<o xmlns='urn:x'/>",
                                            action="urn:nobody:handles-this"))
    # stored and acknowledged, then mallory's dead letter (capped per peer): its sequence is not held by a gap
    assert status == 200 and _answer(body).acks[0].ranges == ((1, 1),)
    wait_until(lambda: rows(pair.server_app, "SELECT COUNT(*) FROM qtp_rm_dead_letter")[0][0] == 1, 30,
               "the message no handler takes to become a dead letter")
    status, body = _post(_url(server), request(sequence=Sequence(created[1], 65), payload=b"<o xmlns='urn:test' k='1'/>",
                                            action=ACTION))
    assert status == 400 and "more than 64 above" in _answer(body).body.reason
    assert not rows(pair.server_app, f"SELECT number FROM qtp_rm_incoming WHERE identifier IN "
                                     f"('{created[0]}', '{created[1]}')")
    _finish(pair, 30)


def test_offered_sequences_end_with_their_inbound_sequence(hostile):
    """Attack 4c: every CreateSequence with an Offer left a reply sequence behind for ever (3,000 of them kept
    an idle node busy). Here the client rolls over to a new sequence every 5 orders: the server's offered
    sequences end once their inbound one is over and applied and their replies are acknowledged."""
    pair, client, server = hostile(send=30, reply=True, limits="sequence_max_messages = 5")
    _finish(pair, 30, reply=True)

    def offered() -> int:
        return sum(1 for (info,) in rows(pair.server_app, "SELECT info FROM qtp_rm_source")
                   if json.loads(info)["route"].startswith("offer:"))

    wait_until(lambda: offered() <= 1, 60, "the offered sequences of ended inbound sequences to end")


def test_concurrent_create_sequences_all_succeed_on_mariadb(hostile):
    """Attack 8: concurrent CreateSequence deadlocked in the MariaDB upsert (10 of 3,000 got 503)."""
    pair, client, server = hostile(send=10, limits="max_sequences_per_peer = 5000\nmax_open_sequences = 10000")
    statuses: list[int] = []

    def create(n: int) -> None:
        for _ in range(n):
            statuses.append(_post(_url(server), request(CreateSequence(ANON)))[0])

    threads = [threading.Thread(target=create, args=(150,)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(statuses) == 1200 and set(statuses) == {200}, {s: statuses.count(s) for s in set(statuses)}
    _finish(pair, 10)


def test_idle_connections_do_not_lock_out_peers(hostile):
    """Attack 4e: more idle sockets than the old server's connection limit (100), from the attacker's own
    address (127.0.0.3: past [limits] max_connections_per_address they are closed at once)."""
    pair, client, server = hostile(send=20, rate=10)
    sockets = []
    try:
        for _ in range(150):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=5, source_address=("127.0.0.3", 0))
            sockets.append(s)
        began = time.monotonic()
        assert requests.get(f"http://127.0.0.1:{server.port}/health", timeout=10).text.strip() == "ok"
        assert time.monotonic() - began < 5
        _finish(pair, 20)
    finally:
        for s in sockets:
            s.close()


def test_poison_identifiers_are_refused_at_decode_and_faults_leak_no_sql(hostile):
    """Attacks 5 and 6: identifiers longer than the store holds used to reach the database (503 with the
    INSERT and its parameters, for ever)."""
    pair, client, server = hostile(send=10)
    status, body = _post(_url(server), request(CreateSequence(ANON)))
    identifier = _answer(body).body.identifier
    long_id = "urn:x:" + "a" * 300
    for envelope in (request(sequence=Sequence(identifier, 1), payload=b"<o xmlns='urn:test' k='7'/>", action=ACTION,
                          message_id=long_id),
                     request(CreateSequence(ANON, offer=Offer(long_id, endpoint=ANON))),
                     request(CreateSequence("http://h/" + "p" * 5000))):
        status, body = _post(_url(server), envelope)
        assert status == 400, (status, body[:300])
        fault = _answer(body).body
        assert isinstance(fault, SoapFault) and "at most" in fault.reason
        assert not any(word in body for word in (b"SQL", b"INSERT", b"pymysql", b"Traceback"))
    _finish(pair, 10)


def test_metrics_and_health_answer_on_their_exact_paths_only(hostile):
    pair, client, server = hostile(send=5)
    base = f"http://127.0.0.1:{server.port}"
    assert requests.get(f"{base}/metrics", timeout=5).status_code == 200
    assert requests.get(f"{base}/health", timeout=5).status_code == 200
    for path in ("/foo/metrics", "/rm/metrics", "/foo/health", "/rm/health"):
        assert requests.get(base + path, timeout=5).status_code == 404, path
    assert requests.post(f"{base}/elsewhere", data=b"<a/>", timeout=5,
                         headers={"Content-Type": "application/soap+xml"}).status_code == 404
    _finish(pair, 5)


def test_refusals_are_counted_in_metrics(hostile):
    pair, client, server = hostile(send=5)
    _post(_url(server), request(CreateSequence(ANON)), as_peer=None)
    _post(_url(server), request(CreateSequence(ANON)), as_peer="mallory", secret="wrong-" + MALLORY)
    text = requests.get(f"http://127.0.0.1:{server.port}/metrics", timeout=5).text
    line = next(x for x in text.splitlines() if x.startswith("qtp_requests_refused_total") and "unauthenticated" in x)
    assert float(line.rsplit(" ", 1)[1]) == 2.0
    _finish(pair, 5)


# ---------------------------------------------------------------------------------------------- answers and polls
#
# What a node reads from the answer to its own POST, or from the answer to its poll, speaks only for the
# sequences of the peer it POSTed to (issue 28). Mallory is a peer with an endpoint (``trap``) that answers
# with whatever ``trap.forge`` says, signed as mallory: the transport believes it is mallory's answer, which
# it is; what it must not believe is that mallory speaks for the honest peer.

POLLS_MALLORY = "\n[channels.m]\npeer = \"{url}\"\nreply = true\n"  # a client without endpoint polls mallory too
MALLORYS_ORDERS = 8_000_000  # k of the orders mallory sends itself: not the honest client's, out of the tally
FORGED_REPLIES = 9_000_000   # k of the replies mallory forges


def _offered_to_client(pair: Pair) -> str:
    """The identifier of the reply sequence the honest client offered (the server's route ``offer:...``)."""
    routes = [json.loads(info)["route"] for (info,) in rows(pair.server_app, "SELECT info FROM qtp_rm_source")]
    return next(r[len("offer:"):] for r in routes if r.startswith("offer:"))


def _replies_waiting(pair: Pair, offered: str, up_to: int | None = None) -> int:
    """Replies waiting at the server for the client (numbered ``up_to`` or below, when given)."""
    where = "" if up_to is None else f" AND number <= {up_to}"
    return rows(pair.server_app, f"SELECT COUNT(*) FROM qtp_rm_outgoing WHERE route = 'offer:{offered}'{where}")[0][0]


def _reply_route_state(pair: Pair, offered: str) -> str | None:
    """The state of the server's reply sequence to the client (None: ended and dropped)."""
    found = [json.loads(record)["state"] for info, record in rows(pair.server_app, "SELECT info, record FROM "
                                                                                   "qtp_rm_source")
             if json.loads(info)["route"] == f"offer:{offered}"]
    return found[0] if found else None


def _reply_sequence(pair: Pair) -> str:
    """The identifier of the client's inbound reply sequence (it offered it), as the client stored it."""
    def find() -> str | None:
        found = rows(pair.client_app, "SELECT identifier, info FROM qtp_rm_destination")
        return next((i for i, info in found if json.loads(info).get("channel")), None)

    wait_until(find, 60, "the client's reply sequence")
    return find()


def _make_the_server_post_to_mallory(server: NodeProcess, trap: Trap) -> None:
    """Mallory opens a sequence offering its own endpoint for the replies and sends one order: the server
    POSTs the reply to mallory, and reads mallory's answer."""
    offer = Offer(f"urn:uuid:{uuid.uuid4()}", endpoint=trap.url)
    status, body = _post(_url(server), request(CreateSequence(ANON, offer=offer)))
    identifier = _answer(body).body.identifier
    order = f"<order xmlns='urn:test' k='{MALLORYS_ORDERS + 1}'/>".encode()
    status, body = _post(_url(server), request(sequence=Sequence(identifier, 1), payload=order, action=ACTION))
    assert status in (200, 202), body
    wait_until(lambda: trap.hits, 30, "the server's reply POSTed to mallory")


def _forget_mallorys_orders(pair: Pair) -> None:
    engine = sqlalchemy.create_engine(pair.server_app, poolclass=sqlalchemy.pool.NullPool)
    with engine.begin() as conn:
        conn.execute(sqlalchemy.text(f"DELETE FROM applied WHERE k >= {MALLORYS_ORDERS}"))
    engine.dispose()


@pytest.mark.parametrize("forged", ["acknowledgement", "fault"])
def test_an_answer_speaks_only_for_the_answering_peers_sequences(hostile, trap, forged):
    """The server POSTs mallory the reply on a sequence mallory offered; mallory's signed answer names the
    honest client's reply sequence: an acknowledgement of every reply waiting for the client (which the server
    cannot reach for now), or an UnknownSequence fault. Before: 32 of 32 waiting replies deleted, never
    delivered; the fault ended the reply sequence, which cannot be created again: its 31 waiting replies
    were stuck for good."""
    back = free_port()  # the server reaches the client here: nothing listens until the attack is over
    pair, client, server = hostile(send=40, reply=True, rate=10, back_proxy_port=back)
    wait_until(lambda: _applied(pair) >= 30, 60, "30 orders applied")
    offered = _offered_to_client(pair)

    def highest() -> int:  # the highest reply number sent (and not acknowledged: the client is out of reach)
        return rows(pair.server_app, f"SELECT MAX(number) FROM qtp_rm_outgoing WHERE route = 'offer:{offered}'")[0][0] or 0

    wait_until(lambda: highest() >= 30, 30, "30 replies sent")
    top = highest()
    if forged == "acknowledgement":
        forgery = request(acks=(SequenceAcknowledgement(offered, ((1, top),)),))
    else:
        forgery = request(SequenceFault(FaultCode.UNKNOWN_SEQUENCE, offered, "no such sequence"))
    trap.forge = lambda body: forgery
    waiting = _replies_waiting(pair, offered, up_to=top)
    _make_the_server_post_to_mallory(server, trap)
    time.sleep(2.0)  # the server's ticks would have applied what the answers said
    assert (_replies_waiting(pair, offered, up_to=top), _reply_route_state(pair, offered)) == (waiting, "ACTIVE")
    to_client = LossyProxy(f"http://127.0.0.1:{pair.client_port}", port=back, seed=1).start()
    try:
        _forget_mallorys_orders(pair)
        _finish(pair, 40, reply=True)
    finally:
        to_client.stop()


def test_a_polling_client_takes_from_a_poll_only_the_polled_peers_sequences(hostile, trap):
    """A client without an endpoint polls the server for its replies, and mallory (it has a reply channel to
    mallory too). Mallory answers the polls with replies on the client's reply sequence from the server,
    numbered 1 to 45. Before: the client took them as the server's (43 to 45 of the 45 forged replies
    stored) and then dropped the genuine ones with those numbers as duplicates."""
    pair, client, server = hostile(send=40, reply=True, rate=4, client_listens=False,
                                   client_extra=POLLS_MALLORY.format(url=trap.url), limits="poll_interval_max = 0.5")
    reply_sequence = _reply_sequence(pair)
    numbers = list(range(1, 46))

    def forge(body: bytes) -> Envelope | None:
        if b"MakeConnection" not in body or not numbers:
            return None
        n = numbers.pop(0)
        reply = f'<done xmlns="urn:test" k="{FORGED_REPLIES + n}"/>'.encode()
        return request(sequence=Sequence(reply_sequence, n), payload=reply, action=ACTION, message_pending=bool(numbers))

    trap.forge = forge
    wait_until(lambda: not numbers, 60, "mallory's 45 forged replies given to the client's polls")
    time.sleep(1.0)
    assert rows(pair.client_app, f"SELECT COUNT(*) FROM replies WHERE k >= {FORGED_REPLIES}")[0][0] == 0
    _finish(pair, 40, reply=True)


def test_an_acknowledgement_in_a_poll_counts_only_from_the_polled_peer(hostile, trap):
    """``acks_to = "poll"``: the client fetches the acknowledgements of its orders with its polls. With the
    server down, mallory answers the client's poll with a duplicate reply on the client's reply sequence, an
    acknowledgement of every waiting order riding along. Before: the orders were deleted (21 of 21 committed
    orders never applied)."""
    pair, client, server = hostile(send=40, reply=True, rate=8, acks_to="poll", client_listens=False,
                                   client_extra=POLLS_MALLORY.format(url=trap.url), limits="poll_interval_max = 0.5")
    wait_until(lambda: rows(pair.client_app, "SELECT COUNT(*) FROM replies")[0][0] >= 3, 60, "the first replies")
    identifier, reply_sequence = _client_sequence(pair), _reply_sequence(pair)
    server.kill()
    wait_until(lambda: rows(pair.client_app, "SELECT COUNT(*) FROM qtp_rm_outgoing WHERE number IS NOT NULL")[0][0]
               >= 20, 30, "20 orders waiting at the client")
    top = rows(pair.client_app, "SELECT MAX(number) FROM qtp_rm_outgoing")[0][0]

    def waiting() -> int:
        return rows(pair.client_app, f"SELECT COUNT(*) FROM qtp_rm_outgoing WHERE number <= {top}")[0][0]

    before = waiting()
    carrier = request(sequence=Sequence(reply_sequence, 1), payload=b'<done xmlns="urn:test" k="1"/>', action=ACTION,
                      acks=(SequenceAcknowledgement(identifier, ((1, top),)),))
    given: list[int] = []

    def forge(body: bytes) -> Envelope | None:
        if b"MakeConnection" not in body or given:
            return None
        given.append(1)
        return carrier

    trap.forge = forge
    wait_until(lambda: given, 30, "mallory's answer to a poll")
    time.sleep(2.0)  # the client's tick would have applied the acknowledgement
    assert waiting() == before
    server.start()
    _finish(pair, 40, reply=True)


# ---------------------------------------------------------------------------------------------- in-process

def test_who_owns_a_sequence_is_decided_by_name_or_else_by_exact_address():
    """The rule ``Ownership`` applies to every part that names a sequence: a configured peer is its name;
    an answer from an address no peer is configured for speaks only for the sequences at that address, so
    one unconfigured peer cannot acknowledge another's; anonymous requests cannot be told apart."""
    from qtp.wsrm.runtime._ownership import Owner, Source

    a, b = "http://127.0.0.1:9001/rm", "http://127.0.0.1:9002/rm"
    assert Owner(None, a).admits(Source(None, a))
    assert not Owner(None, a).admits(Source(None, b))
    assert not Owner(None, a).admits(Source("mallory", a))
    assert not Owner("server", a).admits(Source("mallory", a))
    assert Owner("server", a).admits(Source("server", b))  # a peer may answer at any of its addresses
    assert Owner(None, a).admits(Source(None))  # anonymous requests share one identity
    assert not Owner(None, None).admits(Source(None, a))  # a sequence an anonymous request created
    assert not Owner("server", a, by_request=False).admits(Source("server"))  # asked for answers only
    assert Owner("server", a, by_request=False).admits(Source("server", a))


def test_a_huge_or_redirecting_answer_is_not_read():
    """Attack 4f: a peer answering with hundreds of MB; and a redirect to an internal address."""
    sent = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            if self.path == "/redirect":
                self.send_response(307)
                self.send_header("Location", "http://127.0.0.1:1/internal")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/soap+xml")
            self.end_headers()  # no length: streamed until the connection closes
            chunk = b"x" * 65536
            try:
                for _ in range(400 * 16):  # 400 MB
                    self.wfile.write(chunk)
                    sent.append(len(chunk))
            except OSError:
                pass

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    transport = Transport(5, max_response_bytes=1024 * 1024)
    try:
        base = f"http://127.0.0.1:{server.server_port}"
        with pytest.raises(TransportError, match="max_response_bytes"):
            transport.post(f"{base}/big", b"<a/>", SoapVersion.SOAP12, None)
        with pytest.raises(TransportError, match="redirect"):
            transport.post(f"{base}/redirect", b"<a/>", SoapVersion.SOAP12, None)
        assert sum(sent) < 64 * 1024 * 1024  # it stopped reading long before the end
    finally:
        transport.close()
        server.shutdown()


def test_https_endpoint_without_certificate_is_a_configuration_error(tmp_path):
    from qtp.config import load_config
    from qtp.wsrm.runtime._settings import node_settings

    config = tmp_path / "qtp.toml"
    config.write_text('[node]\nid = "n"\nendpoint = "https://127.0.0.1:8443/rm"\nmode = "memory"\n')
    loaded = load_config(config)
    with pytest.raises(ConfigurationError, match="tls_cert"):
        node_settings(loaded.messaging, set(loaded.resources))
    config.write_text('[node]\nid = "n"\nendpoint = "http://10.0.0.1:8443/rm"\nmode = "memory"\n'
                      '[peers.p]\nendpoint = "http://10.0.0.2/rm"\nsecret = "short"\n')
    loaded = load_config(config)
    with pytest.raises(ConfigurationError, match="at least 32"):
        node_settings(loaded.messaging, set(loaded.resources))


# ---------------------------------------------------------------------------------------------- TLS

def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _certificates(folder: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate whose CN is the client node's id."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=qtp-test-ca",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=folder)
    for name, extra in (("server", "subjectAltName=IP:127.0.0.1"), ("client", "extendedKeyUsage=clientAuth")):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
                 "-out", f"{name}.csr", cwd=folder)
        (folder / f"{name}.ext").write_text(extra + "\n")
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=folder)
    return {n: folder / n for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


def _fingerprint(pem: Path) -> str:
    out = subprocess.run(["openssl", "x509", "-noout", "-fingerprint", "-sha256", "-in", str(pem)],
                         capture_output=True, text=True, check=True).stdout
    return "sha256:" + out.strip().split("=", 1)[1]


def test_tls_with_client_certificates_carries_orders_and_refuses_strangers(tmp_path, pg_db, maria_db):
    """Mutual TLS in ``qtp serve`` (cheroot): the client verifies the server against the CA, the server
    identifies the client by its pinned certificate; no shared secret."""
    certs = _certificates(tmp_path)
    client_app, server_app = pg_db("client"), maria_db("server")
    client_schema(client_app)
    server_schema(server_app)
    pair = Pair(client_app, server_app)
    client_config, server_config = pair.write(tmp_path)
    server_id = f"server-{tmp_path.name[-20:].replace('_', '-')}"
    client_id = f"client-{tmp_path.name[-20:].replace('_', '-')}"
    s = server_config.read_text().replace(f"http://127.0.0.1:{pair.server_port}", f"https://127.0.0.1:{pair.server_port}")
    s = s.replace("\n[node]\n", f'\n[node]\nallow_anonymous = false\ntls_cert = "{certs["server.pem"]}"\n'
                  f'tls_key = "{certs["server.key"]}"\ntls_client_ca = "{certs["ca.pem"]}"\n', 1)
    s += f'\n[peers.{client_id}]\nfingerprint = "{_fingerprint(certs["client.pem"])}"\n'
    server_config.write_text(s)
    c = client_config.read_text().replace(f"http://127.0.0.1:{pair.server_port}", f"https://127.0.0.1:{pair.server_port}")
    c = c.replace("\n[node]\n", f'\n[node]\ntls_ca = "{certs["ca.pem"]}"\ntls_cert = "{certs["client.pem"]}"\n'
                  f'tls_key = "{certs["client.key"]}"\n', 1)
    c = c.replace(f'endpoint = "http://127.0.0.1:{pair.client_port}/rm"', "")  # a one-way client: no endpoint
    c += f'\n[peers.{server_id}]\nendpoint = "https://127.0.0.1:{pair.server_port}/rm"\n' \
         f'fingerprint = "{_fingerprint(certs["server.pem"])}"\n'
    client_config.write_text(c)
    server = NodeProcess(server_config, tmp_path / "server.log").start()
    c_proc = None
    try:
        url = f"https://127.0.0.1:{pair.server_port}/rm"
        body = encode(request(CreateSequence(ANON)))
        headers = {"Content-Type": content_type(SoapVersion.SOAP12, None)}
        # no client certificate: a stranger
        assert requests.post(url, data=body, headers=headers, verify=str(certs["ca.pem"]), timeout=10).status_code == 401
        # plain HTTP to the TLS port gets no SOAP service
        with pytest.raises(requests.RequestException):
            requests.post(url.replace("https", "http"), data=body, headers=headers, timeout=5).raise_for_status()
        c_proc = _start_client(client_config, tmp_path)
        wait_until(lambda: rows(server_app, "SELECT COUNT(*) FROM applied")[0][0] >= 10, 120, "10 orders over TLS")
        result = check_exactly_once(client_app, server_app, False)
        assert result["applied"] == 10
    finally:
        server.kill()
        if c_proc is not None:
            c_proc.kill()


def _start_client(config: Path, folder: Path) -> subprocess.Popen:
    """A client node without an endpoint (nothing to poll for health): started, it sends 10 orders."""
    import os
    import sys

    env = dict(os.environ, QTP_TEST_CONFIG=str(config), QTP_TEST_SEND="10", QTP_TEST_ABORT_EVERY="0")
    log = open(folder / "client.log", "ab")
    return subprocess.Popen([sys.executable, "-m", "qtp", "serve", "--app", "qtp.testing.e2e_app:node"], env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
