"""The node's HTTP endpoint as a WSGI application (mount it in any WSGI server; ``qtp serve`` runs it in
``qtp.wsrm.runtime._http``).

HTTP rules (SOAP 1.1 and 1.2 HTTP bindings, WS-RM 1.1 section 3):

- ``POST`` with a SOAP content type (``text/xml`` for SOAP 1.1, ``application/soap+xml`` for 1.2);
  anything else: 405 (method), 411 (no length), 413 (over ``max_request_bytes``, not read), 415 (not SOAP).
- ``200`` with an envelope when there is something to say (an acknowledgement, a protocol response),
  ``202`` with an empty body for a one-way message with nothing to return (acknowledgements then go to an
  addressable AcksTo), and a SOAP fault with ``500`` (SOAP 1.1; SOAP 1.2 Receiver) or ``400`` (SOAP 1.2
  Sender), or ``503`` when the node cannot take the message now (it stored nothing; the sender retries).
- ``GET /metrics``: Prometheus metrics (with ``[node] metrics_token``, only for ``Authorization: Bearer
  TOKEN``; a node listening beyond loopback does not start without it); ``GET /health``: ``ok`` once the
  node has started. Exactly these paths; SOAP is taken at the endpoint's own path only (404 elsewhere).
- ``401`` for a request whose signature or client certificate does not hold (a malformed signature header,
  one for another node or another start of this one, one taken before, a peer's credential missing), or
  that proves nothing when the node takes no anonymous requests (see ``qtp.wsrm.runtime._security``).
  Every answer gives the node's current start in ``X-Qtp-Boot``, which signed requests name. The caller's
  identity goes with the envelope to the receiver, which checks it against the sequence's owner.

Memory: an envelope of more than ``[limits] max_elements`` elements is refused while it is parsed, and the
envelopes parsed at once hold at most twice that many elements between them (a parse waits for room), so
that concurrent requests full of tiny elements cannot multiply the trees they make.

Input that is not a usable envelope is answered with a fault and never reaches the store. Faults say
what went wrong, never how: SQL, parameters and stack traces stay in the node's log.
"""

from __future__ import annotations

import hmac
import logging
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Protocol
from urllib.parse import urlsplit

from sqlalchemy.exc import SQLAlchemyError

from qtp._failures import first_line
from qtp.errors import QtpError
from qtp.wsrm.codec import (
    BATCH_CONTENT_TYPE,
    Addressing,
    BatchRoom,
    Envelope,
    InvalidMessage,
    SoapFault,
    SoapVersion,
    WsaVersion,
    accepted_batch,
    decode,
    decode_batch,
    encode_batch,
    most_elements,
)
from qtp.wsrm.codec._names import WSA_FAULT_ACTION
from qtp.wsrm.runtime._refusals import outages, refusals
from qtp.wsrm.runtime._security import (
    BOOT_HEADER,
    HEADER,
    WSGI_HEADER,
    AuthenticationError,
    SeenSignatures,
    StaleBoot,
    certificate_peer,
    identify,
    sign_response,
    verify_request,
)
from qtp.wsrm.runtime._transport import content_type, soap_version_of, wire


class Receiving(Protocol):
    """What the endpoint hands a decoded request to (the receiver)."""

    def handle(self, env: Envelope, caller: str | None = None, room: BatchRoom | None = None) -> Any: ...

    def handle_batch(self, envelopes: list[Envelope], caller: str | None = None) -> Any: ...

log = logging.getLogger("qtp.wsrm.endpoint")
CHALLENGE = [("WWW-Authenticate", 'QtpHmac realm="qtp"')]  # on each 401 for a request not signed as [peers] says

_REASONS = {200: "200 OK", 202: "202 Accepted", 400: "400 Bad Request", 401: "401 Unauthorized",
            403: "403 Forbidden", 404: "404 Not Found", 405: "405 Method Not Allowed",
            411: "411 Length Required", 413: "413 Content Too Large", 415: "415 Unsupported Media Type",
            500: "500 Internal Server Error", 503: "503 Service Unavailable"}

StartResponse = Callable[..., Any]


def _plain(start_response: StartResponse, status: int, text: str,
           extra: list[tuple[str, str]] | None = None) -> list[bytes]:
    body = (text + "\n").encode()
    start_response(_REASONS[status], [("Content-Type", "text/plain; charset=utf-8"),
                                      ("Content-Length", str(len(body))), *(extra or [])])
    return [body]


class _Request:
    """What the endpoint learnt of one request: who sent it (a peer's name, None: anonymous) and how to
    sign the answer."""

    __slots__ = ("caller", "signature", "secret")

    def __init__(self, caller: str | None, signature: str | None = None, secret: bytes | None = None):
        self.caller, self.signature, self.secret = caller, signature, secret


class _Room:
    """A number of units (elements being parsed) shared by threads: ``with room.hold(n):`` waits until ``n``
    are free and keeps them for the block."""

    def __init__(self, total: int):
        self.total = self.free = total
        self._changed = threading.Condition()

    @contextmanager
    def hold(self, n: int) -> Iterator[None]:
        n = min(n, self.total)
        with self._changed:
            while self.free < n:
                self._changed.wait()
            self.free -= n
        try:
            yield
        finally:
            with self._changed:
                self.free += n
                self._changed.notify_all()


class Endpoint:
    """The WSGI application of a node: authenticates, bounds and decodes requests for ``receiver``; serves
    ``/metrics`` and ``/health`` (``started``: whether the node takes messages yet)."""

    def __init__(self, node_id: str, endpoint: str | None, limits: Any, security: Any, listen_host: str | None,
                 metrics: Any, receiver: Receiving, started: Callable[[], bool]):
        self.node_id = node_id
        self.limits = limits
        self.metrics = metrics
        self.receiver = receiver
        self.started = started
        self.security = security
        self.path = (urlsplit(endpoint).path if endpoint else "") or "/"
        self.anonymous = self.security.anonymous_allowed(listen_host)
        self.seen = SeenSignatures(limits.max_clock_skew)
        self.exposition: Callable[[], tuple[bytes, str]] = metrics.exposition  # (a shared node's: every slot's)
        self._parsing = _Room(2 * limits.max_elements)

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        boot = (BOOT_HEADER, self.seen.boot)
        return self._route(environ, lambda status, headers, *rest: start_response(status, [*headers, boot], *rest))

    def _route(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        method = environ.get("REQUEST_METHOD", "GET")
        path = environ.get("PATH_INFO", "") or "/"
        if path == "/metrics" and method == "GET":
            token = self.security.metrics_token
            given = environ.get("HTTP_AUTHORIZATION", "")
            if token is not None and not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                return _plain(start_response, 401, "metrics need Authorization: Bearer TOKEN",
                              [("WWW-Authenticate", 'Bearer realm="qtp"')])
            body, media = self.exposition()
            start_response("200 OK", [("Content-Type", media), ("Content-Length", str(len(body)))])
            return [body]
        if path == "/health" and method == "GET":
            return _plain(start_response, 200 if self.started() else 503, "ok" if self.started() else "starting")
        if path.rstrip("/") != self.path.rstrip("/"):
            return _plain(start_response, 404, f"SOAP messages go to {self.path}; GET /health, GET /metrics")
        if method != "POST":
            return _plain(start_response, 405, "POST SOAP messages here", [("Allow", "POST")])
        length = environ.get("CONTENT_LENGTH") or ""
        if not length.isdigit():
            return _plain(start_response, 411, "a Content-Length is required")
        limit = self.limits.max_request_bytes
        if int(length) > limit:
            return _plain(start_response, 413, f"the request is over this node's limit of {limit} bytes",
                          [("Connection", "close")])
        data = environ["wsgi.input"].read(int(length))
        try:
            request = self._authenticate(environ, path, data)
        except StaleBoot as exc:  # each signing peer once after either node starts; a replay of an earlier start
            log.info("refused a request from %s: %s", environ.get("REMOTE_ADDR", "?"), exc)
            self.metrics.refused.labels(reason="boot").inc()
            return _plain(start_response, 401, "signed for another start of this node: sign again naming the "
                          "boot in X-Qtp-Boot", CHALLENGE)
        except AuthenticationError as exc:
            refusals.warn(log, "unauthenticated", "refused a request from %s: %s", environ.get("REMOTE_ADDR", "?"),
                          exc)
            self.metrics.refused.labels(reason="unauthenticated").inc()
            return _plain(start_response, 401, "not authenticated: sign requests as [peers] says, or present a "
                          "client certificate this node knows", CHALLENGE)
        media = (environ.get("CONTENT_TYPE") or "").split(";", 1)[0].strip().lower()
        if media == BATCH_CONTENT_TYPE:
            return self._signed(request, self._batch(data, request), start_response)
        soap = soap_version_of(environ.get("CONTENT_TYPE"))
        if soap is None:
            return _plain(start_response, 415, "expected text/xml (SOAP 1.1) or application/soap+xml (SOAP 1.2)")
        room = accepted_batch(environ.get("HTTP_ACCEPT"))
        return self._signed(request, self._soap(soap, data, request, room), start_response)

    def _authenticate(self, environ: dict[str, Any], path: str, data: bytes) -> _Request:
        header = environ.get(WSGI_HEADER)
        signed = None
        if header:
            signed = verify_request(self.security, header, "POST", path, data, self.node_id, self.seen)
        certified = certificate_peer(self.security, environ)
        if certified is None and signed is None and environ.get("SSL_CLIENT_VERIFY") == "SUCCESS":
            raise AuthenticationError("the client certificate names no peer of this node")
        peer = identify(signed, certified)
        if peer is not None:
            return _Request(peer.name, header if signed else None, peer.secret if signed else None)
        if not self.anonymous:
            raise AuthenticationError("the request is not signed and this node takes no anonymous requests")
        return _Request(None)

    def _signed(self, request: _Request, answer: tuple[int, list[tuple[str, str]], bytes],
                start_response: StartResponse) -> list[bytes]:
        status, headers, body = answer
        if request.signature is not None and request.secret is not None:
            headers.append((HEADER, sign_response(request.secret, self.node_id, request.signature,
                                                  status, body)))
        start_response(_REASONS[status], headers)
        return [body]

    def _batch(self, data: bytes, request: _Request) -> tuple[int, list[tuple[str, str]], bytes]:
        """qtp's batching extension: several standard envelopes in one request (see qtp.wsrm.codec._batch)."""
        limits = self.limits
        try:
            envelopes = [self._decode(part) for part in decode_batch(data, limits.max_batch)]
        except InvalidMessage as exc:
            log.info("refused a batch: %s%s", exc, _cause(exc))
            return self._respond(_bare_fault(SoapVersion.SOAP12, "Sender", str(exc)), 400)
        return self._answer(envelopes[0], lambda: self.receiver.handle_batch(envelopes, request.caller))

    def _soap(self, soap: SoapVersion, data: bytes, request: _Request,
              room: BatchRoom | None) -> tuple[int, list[tuple[str, str]], bytes]:
        try:
            envelope = self._decode(data)
        except InvalidMessage as exc:
            log.info("refused a request: %s%s", exc, _cause(exc))
            return self._respond(_bare_fault(soap, "Sender", str(exc)), 400 if soap is SoapVersion.SOAP12 else 500)
        return self._answer(envelope, lambda: self.receiver.handle(envelope, request.caller, room))

    def _decode(self, data: bytes) -> Envelope:
        limits = self.limits
        with self._parsing.hold(min(most_elements(data), limits.max_elements + 1)):
            return decode(data, max_bytes=limits.max_request_bytes, max_elements=limits.max_elements)

    def _answer(self, envelope: Envelope, handle: Callable[[], Any]) -> tuple[int, list[tuple[str, str]], bytes]:
        if not self.started():
            return self._respond(_bare_fault(envelope.soap, "Receiver", "the node is starting"), 503)
        try:
            answer = handle()
        except (QtpError, SQLAlchemyError) as exc:  # the store is unreachable: nothing acknowledged
            outages.warn(log, "could not take a message now", "could not take a message now: %s", first_line(exc))
            return self._respond(_bare_fault(envelope.soap, "Receiver", "the node cannot take messages now; "
                                             "retry later"), 503)
        except Exception:  # a bug: the peer learns that it happened, the log learns what
            log.exception("a request failed")
            return self._respond(_bare_fault(envelope.soap, "Receiver", "internal error; retry later"), 500)
        if answer.envelope is None:
            return 202, [("Content-Length", "0")], b""
        if answer.batch:  # several messages for a qtp poller (qtp.wsrm.codec._batch)
            body = encode_batch(list(answer.batch))
            return answer.status, [("Content-Type", BATCH_CONTENT_TYPE), ("Content-Length", str(len(body)))], body
        return self._respond(answer.envelope, answer.status)

    @staticmethod
    def _respond(envelope: Envelope, status: int) -> tuple[int, list[tuple[str, str]], bytes]:
        body = wire(envelope)
        return status, [("Content-Type", content_type(envelope.soap, envelope.addressing.action)),
                        ("Content-Length", str(len(body)))], body


def _bare_fault(soap: SoapVersion, code: str, reason: str) -> Envelope:
    """A fault for a request too broken to answer in its own WS-RM and addressing versions."""
    wsa = WsaVersion.WSA200508
    return Envelope(soap=soap, rm=None, wsa=wsa, addressing=Addressing(action=WSA_FAULT_ACTION[wsa]),
                    body=SoapFault(code, None, reason[:500]))


def _cause(exc: BaseException) -> str:
    """The parser's own words behind a refusal, for the log (the fault says what, not how)."""
    return f" ({exc.__cause__})" if exc.__cause__ is not None else ""
