"""gSOAP's empty-body answer with a ``Sequence`` header of MessageNumber 0 (docs/interop.md D17).

Once gSOAP has accepted an Offer, its answer on the HTTP response carries a Sequence header for the offered
sequence with the number it has reached, 0 before its first reply (the schema starts at 1), next to the
SequenceAcknowledgement that matters. The answers replayed here are in
``tests/data/interop/gsoap/from-source`` (written from gSOAP's source, see its README). A request with such a
header is still refused; an answer keeps its acknowledgements and the header is set aside (counted, logged).
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import qtp
from qtp.embedded import free_port
from qtp.errors import InvalidMessage
from qtp.wsrm.codec import SoapVersion, decode
from qtp.wsrm.protocol import SequenceAcknowledgement
from qtp.wsrm.runtime import Limits, Node, NodeSettings
from qtp.wsrm.runtime._settings import ChannelSettings

DATA = Path(__file__).resolve().parent / "data" / "interop" / "gsoap"
SOAPS = ["11", "12"]
ACTION = "urn:qtp:interop:gsoap/deliver"


def _answer(soap: str) -> bytes:
    return (DATA / "from-source" / f"rm11-soap{soap}-empty-answer-Sequence0.response.xml").read_bytes()


@pytest.mark.parametrize("soap", SOAPS)
def test_a_request_with_message_number_0_is_still_refused(soap):
    with pytest.raises(InvalidMessage, match="MessageNumber must be at least 1"):
        decode(_answer(soap))


@pytest.mark.parametrize("soap", SOAPS)
def test_an_empty_answer_keeps_its_acknowledgement_and_sets_the_sequence_header_aside(soap):
    envelope = decode(_answer(soap), answer=True)
    assert envelope.acks == (SequenceAcknowledgement("urn:uuid:28f1e39b-1787-4e12-ab8b-45673200000000",
                                                     ((1, 3),)),)
    assert envelope.sequence is None and envelope.body is None and envelope.payload is None
    assert len(envelope.ignored) == 1 and "MessageNumber must be at least 1" in envelope.ignored[0]


@pytest.mark.parametrize("soap", SOAPS)
def test_an_answer_that_carries_a_message_or_a_body_still_needs_a_valid_sequence_header(soap):
    with_payload = _answer(soap).replace(b"<SOAP-ENV:Body></SOAP-ENV:Body>",
                                         b'<SOAP-ENV:Body><ns:deliver><text>x</text></ns:deliver></SOAP-ENV:Body>')
    with pytest.raises(InvalidMessage, match="MessageNumber"):
        decode(with_payload, answer=True)
    with_body = _answer(soap).replace(b"<SOAP-ENV:Body></SOAP-ENV:Body>",
                                      b"<SOAP-ENV:Body><wsrm:CloseSequence><wsrm:Identifier>urn:uuid:x"
                                      b"</wsrm:Identifier></wsrm:CloseSequence></SOAP-ENV:Body>")
    with pytest.raises(InvalidMessage, match="MessageNumber"):
        decode(with_body, answer=True)


class GsoapReplay:
    """An HTTP peer that answers as gSOAP's wsrm plugin does once it accepted an Offer: CreateSequence with
    the captured CreateSequenceResponse (Offer accepted), each message with the empty-body answer of
    MessageNumber 0 acknowledging what it received, MakeConnection (which gSOAP does not know) with a bare
    202."""

    def __init__(self, soap: str):
        self.soap = soap
        self.received: set[int] = set()
        self.offered: str | None = None
        self.sequence = f"urn:uuid:{uuid.uuid4()}"
        self.polls = 0
        self._server = ThreadingHTTPServer(("127.0.0.1", free_port()), self._handler())
        self._server.daemon_threads = True

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/"

    def __enter__(self) -> "GsoapReplay":
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def answer(self, request: bytes) -> tuple[int, bytes]:
        if b"MakeConnection" in request:
            self.polls += 1
            return 202, b""
        if b"<wsrm:CreateSequence>" in request:
            self.offered = re.search(rb"<wsrm:Offer><wsrm:Identifier>([^<]+)<", request).group(1).decode()
            captured = (DATA / f"rm11-soap{self.soap}" / "27-qtp-create-CreateSequence-offer.response.xml").read_bytes()
            return 200, re.sub(rb"(<wsrm:CreateSequenceResponse><wsrm:Identifier>)[^<]+", rb"\g<1>" +
                               self.sequence.encode(), captured)
        numbers = re.findall(rb"<wsrm:MessageNumber>(\d+)</wsrm:MessageNumber>", request)
        self.received.update(int(n) for n in numbers)
        if not self.received:
            return 202, b""
        ranges = "".join(f'<wsrm:AcknowledgementRange Upper="{u}" Lower="{lo}"></wsrm:AcknowledgementRange>'
                         for lo, u in _ranges(self.received))
        body = _answer(self.soap).decode()
        body = body.replace("urn:uuid:offered-by-qtp", self.offered or "urn:uuid:none")
        body = body.replace("urn:uuid:28f1e39b-1787-4e12-ab8b-45673200000000", self.sequence)
        body = re.sub(r"<wsrm:AcknowledgementRange [^>]*></wsrm:AcknowledgementRange>", ranges, body)
        return 200, body.encode()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        peer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                request = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                status, body = peer.answer(request)
                self.send_response(status)
                kind = "text/xml" if peer.soap == "11" else "application/soap+xml"
                self.send_header("Content-Type", f"{kind}; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        return Handler


def _ranges(numbers: set[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for n in sorted(numbers):
        if out and out[-1][1] == n - 1:
            out[-1] = (out[-1][0], n)
        else:
            out.append((n, n))
    return out


@pytest.mark.parametrize("soap", SOAPS)
def test_a_node_without_endpoint_gets_its_messages_acknowledged_by_gsoap(soap, tmp_path):
    """The node offers a reply sequence (it polls for replies); gSOAP accepts it and answers each message with
    the MessageNumber-0 answer. Before the fix the node dropped every answer: 30 of 30 stayed unacknowledged."""
    with GsoapReplay(soap) as peer:
        tm = qtp.TransactionManager(f"g0-{uuid.uuid4().hex[:6]}", tmp_path / "logs", recovery_interval=None)
        channel = ChannelSettings("gsoap", peer=peer.url, mode="memory", reply=True,
                                  soap=SoapVersion.SOAP11 if soap == "11" else SoapVersion.SOAP12)
        node = Node(tm, NodeSettings(mode="memory", channels={"gsoap": channel},
                                     limits=Limits(retransmit_interval=0.2, retransmit_interval_max=0.5))).start()
        assert node.endpoint is None
        qtp.install(tm)
        try:
            for i in range(30):
                with qtp.transaction() as tx:
                    tx.send("gsoap", f'<ns:deliver xmlns:ns="urn:qtp:interop:gsoap"><text>{i}</text></ns:deliver>',
                            action=ACTION)
            store = node.stores.for_route("gsoap")
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and _backlog(store) != 0:
                time.sleep(0.1)
            assert _backlog(store) == 0, f"{_backlog(store)} of 30 unacknowledged; gSOAP received {len(peer.received)}"
            assert peer.received == set(range(1, 31))
            assert node.metrics.registry.get_sample_value("qtp_answer_headers_ignored_total",
                                                          {"node": tm.node_id}) >= 1
        finally:
            node.close()
            tm.close()


def _backlog(store) -> int:
    with store.local() as s:
        return store.backlog(s, "gsoap")
