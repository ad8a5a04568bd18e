"""The gSOAP peer itself (tests/interop): gSOAP client -> gSOAP server in every combination gSOAP supports.

These prove the harness the qtp <-> gSOAP tests use: the binaries build from the Debian packages, the server
reports exactly what it delivered, the client reports what it did, and the proxy loses messages on demand.
"""

from __future__ import annotations

import itertools

import pytest
from interop.gsoap_peer import GsoapServer, RecordingProxy, post, run_client

from qtp.embedded import free_port
from qtp.wsrm.codec import Addressing, Envelope, SoapVersion, WsaVersion, decode, encode
from qtp.wsrm.protocol import AckRequested, FaultCode, RMVersion, Sequence, SequenceFault

COMBINATIONS = list(itertools.product(("1.1", "1.0"), ("1.1", "1.2")))


@pytest.mark.parametrize(("rm", "soap"), COMBINATIONS, ids=[f"rm{r}-soap{s}" for r, s in COMBINATIONS])
@pytest.mark.parametrize("loss", [None, "swallow", "response"])
def test_gsoap_client_to_gsoap_server_delivers_each_message_once_in_order(rm: str, soap: str,
                                                                          loss: str | None) -> None:
    port = free_port()
    lost: list[int] = []

    def drop(index: int, body: bytes) -> str | None:
        if loss and b"<wsrm:MessageNumber>2</wsrm:MessageNumber>" in body and not lost:
            lost.append(index)
            return loss
        return None

    with GsoapServer(port, rm) as server, RecordingProxy(free_port(), server.url, drop=drop) as proxy:
        result = run_client(proxy.url, rm=rm, soap=soap, count=4, rounds=3, pause_ms=50, timeout=3)
        delivered = server.wait_for(4, timeout=15)  # its output may trail the client's exit on a loaded machine
    assert [(d.number, d.text) for d in delivered] == [(n, f"message-{n}") for n in range(1, 5)], result.stdout
    assert {d.identifier for d in delivered} == {result.sequence_id}
    assert lost if loss else not lost
    soap_ns = (b"http://www.w3.org/2003/05/soap-envelope" if soap == "1.2"
               else b"http://schemas.xmlsoap.org/soap/envelope/")
    assert all(soap_ns in exchange.request for exchange in proxy.exchanges)
    if rm == "1.1":
        assert result.returncode == 0, result.stdout
        assert result.named("TERMINATED")[0]["unacknowledged"] == "0"
    else:
        # gSOAP's WS-RM 1.0 destination answers TerminateSequence with a TerminateSequence whose Identifier is
        # empty, which its own source takes for UnknownSequence (docs/interop.md, D9): every message is
        # acknowledged, the termination is reported failed.
        assert result.returncode == 3, result.stdout
        assert result.named("ERROR")[-1]["subcode"] == "wsrm:UnknownSequence"
    if loss == "swallow" and rm == "1.1":
        assert result.named("RESENT")   # the gap was seen in the CloseSequenceResponse and filled


@pytest.mark.parametrize("mode", ["check", "empty"])
@pytest.mark.parametrize("rm", ["1.1", "1.0"])
def test_gsoap_server_faults_a_message_for_an_unknown_sequence_only_in_check_mode(rm: str, mode: str) -> None:
    port = free_port()
    version = RMVersion(rm)
    envelope = Envelope(SoapVersion.SOAP11, version, WsaVersion.WSA200508,
                        Addressing(action="urn:qtp:interop:gsoap/deliver", to=f"http://127.0.0.1:{port}/",
                                   message_id="urn:uuid:test-unknown"),
                        sequence=Sequence("urn:uuid:no-such-sequence", 1),
                        ack_requests=(AckRequested("urn:uuid:no-such-sequence"),),
                        payload=b'<ns:deliver xmlns:ns="urn:qtp:interop:gsoap"><text>x</text></ns:deliver>')
    with GsoapServer(port, rm, mode=mode) as server:
        status, _, body = post(server.url, encode(envelope), "text/xml; charset=utf-8",
                               '"urn:qtp:interop:gsoap/deliver"')
        assert server.deliveries() == []
    if mode == "empty":
        assert (status, body) == (202, b"")
    else:
        assert status == 500
        fault = decode(body).body
        assert isinstance(fault, SequenceFault) and fault.code is FaultCode.UNKNOWN_SEQUENCE
