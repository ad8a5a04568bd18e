"""The node's HTTP endpoint as a WSGI application (mount it in any WSGI server; ``qtp serve`` uses waitress).

HTTP rules (SOAP 1.1 and 1.2 HTTP bindings, WS-RM 1.1 section 3):

- ``POST`` with a SOAP content type (``text/xml`` for SOAP 1.1, ``application/soap+xml`` for 1.2);
  anything else: 405 (method), 411 (no length), 413 (over ``max_request_bytes``, not read), 415 (not SOAP).
- ``200`` with an envelope when there is something to say (an acknowledgement, a protocol response),
  ``202`` with an empty body for a one-way message with nothing to return (acknowledgements then go to an
  addressable AcksTo), and a SOAP fault with ``500`` (SOAP 1.1; SOAP 1.2 Receiver) or ``400`` (SOAP 1.2
  Sender), or ``503`` when the node cannot take the message now (it stored nothing; the sender retries).
- ``GET /metrics``: Prometheus metrics; ``GET /health``: ``ok`` once the node has started.

Input that is not a usable envelope is answered with a fault and never reaches the store.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Iterable

from sqlalchemy.exc import SQLAlchemyError

from qtp.errors import QtpError
from qtp.wsrm.codec import (
    BATCH_CONTENT_TYPE,
    Addressing,
    Envelope,
    InvalidMessage,
    SoapFault,
    SoapVersion,
    WsaVersion,
    decode,
    decode_batch,
)
from qtp.wsrm.codec._names import WSA_FAULT_ACTION
from qtp.wsrm.runtime._transport import content_type, soap_version_of, wire

if TYPE_CHECKING:
    from qtp.wsrm.runtime._node import Node

log = logging.getLogger("qtp.wsrm.endpoint")

_REASONS = {200: "200 OK", 202: "202 Accepted", 400: "400 Bad Request", 405: "405 Method Not Allowed",
            411: "411 Length Required", 413: "413 Content Too Large", 415: "415 Unsupported Media Type",
            500: "500 Internal Server Error", 503: "503 Service Unavailable"}

StartResponse = Callable[..., Any]


def _plain(start_response: StartResponse, status: int, text: str,
           extra: list[tuple[str, str]] | None = None) -> list[bytes]:
    body = (text + "\n").encode()
    start_response(_REASONS[status], [("Content-Type", "text/plain; charset=utf-8"),
                                      ("Content-Length", str(len(body))), *(extra or [])])
    return [body]


class Endpoint:
    """``Endpoint(node)`` is the WSGI application of ``node``."""

    def __init__(self, node: "Node"):
        self.node = node

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        method = environ.get("REQUEST_METHOD", "GET")
        path = environ.get("PATH_INFO", "")
        if method == "GET" and path.rstrip("/").endswith("/metrics"):
            body, media = self.node.metrics.exposition()
            start_response("200 OK", [("Content-Type", media), ("Content-Length", str(len(body)))])
            return [body]
        if method == "GET" and path.rstrip("/").endswith("/health"):
            return _plain(start_response, 200 if self.node.started else 503, "ok" if self.node.started else "starting")
        if method != "POST":
            return _plain(start_response, 405, "POST SOAP messages here", [("Allow", "POST")])
        length = environ.get("CONTENT_LENGTH") or ""
        if not length.isdigit():
            return _plain(start_response, 411, "a Content-Length is required")
        limit = self.node.limits.max_request_bytes
        if int(length) > limit:
            return _plain(start_response, 413, f"the request is over this node's limit of {limit} bytes",
                          [("Connection", "close")])
        media = (environ.get("CONTENT_TYPE") or "").split(";", 1)[0].strip().lower()
        if media == BATCH_CONTENT_TYPE:
            return self._batch(environ["wsgi.input"].read(int(length)), start_response)
        soap = soap_version_of(environ.get("CONTENT_TYPE"))
        if soap is None:
            return _plain(start_response, 415, "expected text/xml (SOAP 1.1) or application/soap+xml (SOAP 1.2)")
        data = environ["wsgi.input"].read(int(length))
        return self._soap(soap, data, start_response)

    def _batch(self, data: bytes, start_response: StartResponse) -> list[bytes]:
        """qtp's batching extension: several standard envelopes in one request (see qtp.wsrm.codec._batch)."""
        limits = self.node.limits
        try:
            envelopes = [decode(part, max_bytes=limits.max_request_bytes)
                         for part in decode_batch(data, limits.max_batch)]
        except InvalidMessage as exc:
            log.info("refused a batch: %s", exc)
            return self._respond(start_response, _bare_fault(SoapVersion.SOAP12, "Sender", str(exc)), 400)
        return self._answer(envelopes[0], lambda: self.node.receiver.handle_batch(envelopes), start_response)

    def _soap(self, soap: SoapVersion, data: bytes, start_response: StartResponse) -> list[bytes]:
        try:
            envelope = decode(data, max_bytes=self.node.limits.max_request_bytes)
        except InvalidMessage as exc:
            log.info("refused a request: %s", exc)
            return self._respond(start_response, _bare_fault(soap, "Sender", str(exc)),
                                 400 if soap is SoapVersion.SOAP12 else 500)
        return self._answer(envelope, lambda: self.node.receiver.handle(envelope), start_response)

    def _answer(self, envelope: Envelope, handle: Callable[[], Any], start_response: StartResponse) -> list[bytes]:
        if not self.node.started:
            return self._respond(start_response, _bare_fault(envelope.soap, "Receiver", "the node is starting"), 503)
        try:
            answer = handle()
        except (QtpError, SQLAlchemyError) as exc:  # the store is unreachable: nothing acknowledged
            log.warning("could not take a message now: %s", exc)
            fault = _bare_fault(envelope.soap, "Receiver", f"the node cannot take messages now: {exc}")
            return self._respond(start_response, fault, 503)
        if answer.envelope is None:
            start_response("202 Accepted", [("Content-Length", "0")])
            return [b""]
        return self._respond(start_response, answer.envelope, answer.status)

    @staticmethod
    def _respond(start_response: StartResponse, envelope: Envelope, status: int) -> list[bytes]:
        body = wire(envelope)
        start_response(_REASONS[status], [("Content-Type", content_type(envelope.soap, envelope.addressing.action)),
                                          ("Content-Length", str(len(body)))])
        return [body]


def _bare_fault(soap: SoapVersion, code: str, reason: str) -> Envelope:
    """A fault for a request too broken to answer in its own WS-RM and addressing versions."""
    wsa = WsaVersion.WSA200508
    return Envelope(soap=soap, rm=None, wsa=wsa, addressing=Addressing(action=WSA_FAULT_ACTION[wsa]),
                    body=SoapFault(code, None, reason[:500]))
