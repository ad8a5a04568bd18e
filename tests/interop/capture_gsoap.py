"""Capture the wire messages of gSOAP's wsrm plugin into tests/data/interop/gsoap (run by hand, not by pytest).

    .venv/bin/python tests/interop/capture_gsoap.py [OUTPUT_DIR]

For every WS-RM / SOAP version pair gSOAP supports it runs the gSOAP client against the gSOAP server through
``RecordingProxy`` (ports 47150-47151) and stores each HTTP request and answer byte for byte:

- ``normal``: 3 messages, completion (1.1 CloseSequence, 1.0 LastMessage), TerminateSequence;
- ``loss``: the same with message 2 swallowed once by the proxy (answered 202, never forwarded), so the
  destination sees a gap and the source learns of the loss only from acknowledgements;
- ``lost-answer``: the answer to message 2 lost once, so the source sends it again (a duplicate);
- ``unknown``: envelopes qtp encodes (Sequence, AckRequested, CloseSequence, TerminateSequence naming a
  sequence the server never created) posted straight to the gSOAP server, for its faults;
- ``qtp-create``: qtp's own CreateSequence (with an Offer; and with WS-Addressing 2004/08) and gSOAP's answer.

Each directory gets ``index.json``: one entry per exchange with the files, HTTP status, content types and
SOAPAction, and whether the proxy dropped it. The gSOAP messages are exactly what gSOAP wrote; only the
qtp-side requests of ``unknown`` and ``qtp-create`` are qtp's.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gsoap_peer import GsoapServer, RecordingProxy, post, run_client  # noqa: E402

from qtp.wsrm.codec import Addressing, Envelope, SoapVersion, WsaVersion, anonymous, encode  # noqa: E402
from qtp.wsrm.protocol import (  # noqa: E402
    AckRequested,
    CloseSequence,
    CreateSequence,
    Offer,
    RMVersion,
    Sequence,
    TerminateSequence,
)

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "tests" / "data" / "interop" / "gsoap"
SERVER_PORT, PROXY_PORT = 47150, 47151
UNKNOWN = "urn:uuid:00000000-0000-4000-8000-000000000bad"
CONTENT_TYPE = {SoapVersion.SOAP11: "text/xml; charset=utf-8",
                SoapVersion.SOAP12: "application/soap+xml; charset=utf-8"}


def _write(directory: Path, index: list[dict], label: str, request: bytes, status: int | None,
           response: bytes, request_type: str | None, response_type: str | None, soap_action: str | None,
           dropped: str | None, sender: str) -> None:
    number = len(index) + 1
    stem = f"{number:02d}-{label}"
    (directory / f"{stem}.request.xml").write_bytes(request)
    entry = {"request": f"{stem}.request.xml", "request_from": sender, "request_content_type": request_type,
             "soap_action": soap_action, "status": status, "response_content_type": response_type,
             "dropped": dropped, "response": None}
    if response:
        (directory / f"{stem}.response.xml").write_bytes(response)
        entry["response"] = f"{stem}.response.xml"
    index.append(entry)


def _label(body: bytes) -> str:
    if b"<wsrm:LastMessage" in body:
        return "LastMessage"
    if b"<wsrm:Sequence>" in body:
        number = body.split(b"<wsrm:MessageNumber>")[1].split(b"<")[0].decode()
        return f"message{number}"
    for name in ("CreateSequence", "CloseSequence", "TerminateSequence", "AckRequested"):
        if f"<wsrm:{name}>".encode() in body or f"/{name}<".encode() in body:
            return name
    return "other"


def capture_client_run(directory: Path, index: list[dict], rm: str, soap: str, scenario: str) -> dict:
    lost: set[int] = set()

    verdict = {"loss": "swallow", "lost-answer": "response", "unreachable": "request"}.get(scenario)

    def drop(i: int, body: bytes) -> str | None:
        if verdict and b"<wsrm:MessageNumber>2</wsrm:MessageNumber>" in body and not lost:
            lost.add(i)
            return verdict
        return None

    with GsoapServer(SERVER_PORT, rm) as server, RecordingProxy(PROXY_PORT, server.url, drop=drop) as proxy:
        result = run_client(proxy.url, rm=rm, soap=soap, count=3, rounds=2, pause_ms=100, timeout=3)
        deliveries = server.deliveries()
    for exchange in proxy.exchanges:
        _write(directory, index, f"{scenario}-{_label(exchange.request)}", exchange.request, exchange.status,
               exchange.response, exchange.request_headers.get("Content-Type"),
               exchange.response_headers.get("Content-Type"), exchange.request_headers.get("SOAPAction"),
               exchange.dropped, "gsoap-client")
    return {"scenario": scenario, "client_exit": result.returncode, "client_output": result.stdout.splitlines(),
            "delivered": [[d.identifier, d.number, d.text] for d in deliveries]}


def _qtp_envelope(soap: SoapVersion, rm: RMVersion, wsa: WsaVersion, kind: str) -> Envelope:
    to = f"http://127.0.0.1:{SERVER_PORT}/"
    reply = Addressing(to=to, message_id=f"urn:uuid:qtp-capture-{kind}", reply_to=anonymous(wsa))
    base = Envelope(soap, rm, wsa)
    if kind == "Sequence":
        payload = b'<ns:deliver xmlns:ns="urn:qtp:interop:gsoap"><text>unknown</text></ns:deliver>'
        return Envelope(soap, rm, wsa, Addressing(action="urn:qtp:interop:gsoap/deliver", to=to,
                                                  message_id="urn:uuid:qtp-capture-seq"),
                        sequence=Sequence(UNKNOWN, 1), ack_requests=(AckRequested(UNKNOWN),), payload=payload)
    if kind == "AckRequested":
        action = f"{_rm_ns(rm)}/AckRequested"
        return Envelope(soap, rm, wsa, Addressing(action=action, to=to, message_id="urn:uuid:qtp-capture-ackreq"),
                        ack_requests=(AckRequested(UNKNOWN),))
    if kind == "CloseSequence":
        return _with(base, reply, rm, "CloseSequence", CloseSequence(UNKNOWN))
    if kind == "TerminateSequence":
        return _with(base, reply, rm, "TerminateSequence", TerminateSequence(UNKNOWN))
    if kind == "CreateSequence-offer":
        offer = Offer("urn:uuid:qtp-offered-sequence", anonymous(wsa) if rm is RMVersion.WSRM11 else None)
        return _with(base, reply, rm, "CreateSequence", CreateSequence(anonymous(wsa), 600.0, offer))
    if kind == "CreateSequence":
        return _with(base, reply, rm, "CreateSequence", CreateSequence(anonymous(wsa)))
    raise ValueError(kind)


def _rm_ns(rm: RMVersion) -> str:
    from qtp.wsrm.codec import RM_NS
    return RM_NS[rm]


def _with(base: Envelope, addressing: Addressing, rm: RMVersion, name: str, body: object) -> Envelope:
    from dataclasses import replace
    return replace(base, addressing=replace(addressing, action=f"{_rm_ns(rm)}/{name}"), body=body)


def capture_qtp_requests(directory: Path, index: list[dict], rm: str, soap: str) -> None:
    rm_version = RMVersion(rm)
    soap_version = SoapVersion(soap)
    kinds = [("unknown", "Sequence"), ("unknown", "AckRequested"), ("unknown", "TerminateSequence"),
             ("qtp-create", "CreateSequence-offer")]
    if rm_version is RMVersion.WSRM11:
        kinds.insert(2, ("unknown", "CloseSequence"))
    wsa_versions = [WsaVersion.WSA200508]
    with GsoapServer(SERVER_PORT, rm) as server:
        for scenario, kind in kinds:
            for wsa in wsa_versions:
                envelope = _qtp_envelope(soap_version, rm_version, wsa, kind)
                data = encode(envelope)
                content_type = CONTENT_TYPE[soap_version]
                action = envelope.addressing.action
                if soap_version is SoapVersion.SOAP12:
                    content_type += f'; action="{action}"'
                    soap_action = None
                else:
                    soap_action = f'"{action}"'
                status, headers, answer = post(server.url, data, content_type, soap_action)
                _write(directory, index, f"{scenario}-{kind}", data, status, answer, content_type,
                       headers.get("Content-Type"), soap_action, None, "qtp")
        if rm_version is RMVersion.WSRM10:
            # WS-RM 1.0 peers also use the 2004/08 submission of WS-Addressing: what does gSOAP make of it?
            envelope = _qtp_envelope(soap_version, rm_version, WsaVersion.WSA200408, "CreateSequence")
            data = encode(envelope)
            content_type = CONTENT_TYPE[soap_version]
            soap_action = None if soap_version is SoapVersion.SOAP12 else f'"{envelope.addressing.action}"'
            status, headers, answer = post(server.url, data, content_type, soap_action)
            _write(directory, index, "qtp-create-wsa200408", data, status, answer, content_type,
                   headers.get("Content-Type"), soap_action, None, "qtp")


def main() -> int:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT
    version = subprocess.run(["dpkg-query", "-W", "-f", "${Version}", "libgsoap-dev"], capture_output=True,
                             text=True).stdout.strip()
    summary = {"gsoap_package_version": version, "runs": {}}
    for rm in ("1.1", "1.0"):
        for soap in ("1.1", "1.2"):
            name = f"rm{rm.replace('.', '')}-soap{soap.replace('.', '')}"
            directory = out / name
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir(parents=True)
            index: list[dict] = []
            runs = [capture_client_run(directory, index, rm, soap, scenario)
                    for scenario in ("normal", "loss", "lost-answer")]
            capture_qtp_requests(directory, index, rm, soap)
            (directory / "index.json").write_text(json.dumps(index, indent=1) + "\n")
            summary["runs"][name] = runs
            print(name, [(r["scenario"], r["client_exit"], len(r["delivered"])) for r in runs])
    (out / "runs.json").write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
