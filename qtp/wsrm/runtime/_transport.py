"""SOAP over HTTP: content types, status codes, and the node's one pooled HTTP client.

A transport failure is never a message failure: the RM Source keeps every unacknowledged message and
retransmits on its timer, so the transport only retries briefly (connection refused or reset, a few times,
exponential backoff with jitter) to ride over a peer that is restarting, then reports the failure and
lets the protocol's retransmission take over.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import requests
import tenacity
from requests.adapters import HTTPAdapter

from qtp.errors import TransportError
from qtp.wsrm.codec import Envelope, SoapVersion, encode
from qtp.wsrm.runtime._ids import SLOT_QUERY
from qtp.wsrm.runtime._security import (
    HEADER,
    AuthenticationError,
    Peer,
    Security,
    answer_boot,
    sign_request,
    verify_response,
)

log = logging.getLogger("qtp.wsrm.transport")

CONTENT_TYPE = {
    SoapVersion.SOAP11: "text/xml; charset=utf-8",
    SoapVersion.SOAP12: "application/soap+xml; charset=utf-8",
}


def content_type(soap: SoapVersion, action: str | None) -> str:
    """The Content-Type of a SOAP message; SOAP 1.2 carries the action as a media type parameter."""
    if soap is SoapVersion.SOAP12 and action:
        return f'{CONTENT_TYPE[soap]}; action="{action}"'
    return CONTENT_TYPE[soap]


_EMPTY_BODY = b"<S:Body/></S:Envelope>"


def wire(envelope: Envelope) -> bytes:
    """``envelope`` as the node sends it: encoded, with an empty Body written ``<S:Body></S:Body>``.

    Both spellings are the same XML, but gSOAP 2.8 fails to read a self-closed Body (SOAP_TAG_MISMATCH) in
    the answer to a one-way message, in a SequenceAcknowledgement or AckRequested it receives, ... (see
    docs/interop.md, D13); the codec keeps writing ``<S:Body/>`` (as lxml does) for everything else.
    """
    data = encode(envelope)
    if data.endswith(_EMPTY_BODY):
        return data[:-len(_EMPTY_BODY)] + b"<S:Body></S:Body></S:Envelope>"
    return data


def soap_version_of(content_type_header: str | None) -> SoapVersion | None:
    """Which SOAP binding a request's Content-Type names (None: not SOAP)."""
    media = (content_type_header or "").split(";", 1)[0].strip().lower()
    return {"text/xml": SoapVersion.SOAP11, "application/soap+xml": SoapVersion.SOAP12}.get(media)



@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    content_type: str
    body: bytes


class Transport:
    """One pooled ``requests.Session`` per node, with connect/read timeouts and brief transport retries.

    Requests to a peer with a secret are signed, and its answer is read only if it is signed by it (else
    TransportError: the answer is not believed, and the protocol retransmits). A signature names the peer's
    boot (its current start) as its last answer at that address gave it; a 401 that gives another boot than
    the request named (the peer restarted, or we did and knew none) is signed again with it and sent once
    more at once. Redirects are never followed and an answer longer than ``max_response_bytes`` is not read.
    With ``[node] tls_ca`` the peers' server certificates are verified against that bundle (the system's
    otherwise); with ``tls_cert`` / ``tls_key`` the node presents its own certificate to peers that ask for
    one.
    """

    def __init__(self, timeout: float = 10.0, pool: int = 32, attempts: int = 3, backoff_max: float = 1.0, *,
                 name: str = "", security: Security | None = None, max_response_bytes: int = 4 * 1024 * 1024):
        self.timeout = (min(timeout, 5.0), timeout)
        self.name = name
        self.security = security or Security()
        self.max_response_bytes = max_response_bytes
        self._boots: dict[str, str] = {}  # URL -> the boot of the node that last answered there
        self.session = requests.Session()
        self.session.trust_env = False  # no proxy or netrc from the environment between two nodes
        if self.security.tls_ca:
            self.session.verify = self.security.tls_ca
        if self.security.tls_cert and self.security.tls_key:
            self.session.cert = (self.security.tls_cert, self.security.tls_key)
        adapter = HTTPAdapter(pool_connections=pool, pool_maxsize=pool, max_retries=0)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        self._retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(attempts),
            wait=tenacity.wait_random_exponential(multiplier=0.05, max=backoff_max),
            retry=tenacity.retry_if_exception_type(requests.ConnectionError),
            reraise=True,
        )

    def post(self, url: str, body: bytes, soap: SoapVersion, action: str | None, accept: str | None = None,
             slot: int | None = None) -> Reply:
        """POST one SOAP envelope; ``accept``: the Accept header (a poll's, naming the batch it takes);
        ``slot``: the slot of the peer's the sequence belongs to (qtp.wsrm.runtime._ids.slot_of), put in the URL
        for the peer's balancer."""
        headers = {"Content-Type": content_type(soap, action)}
        if accept is not None:
            headers["Accept"] = accept
        if soap is SoapVersion.SOAP11:
            headers["SOAPAction"] = f'"{action or ""}"'
        return self._post(url, body, headers, slot)

    def post_raw(self, url: str, body: bytes, media_type: str, slot: int | None = None) -> Reply:
        """POST ``body`` as ``media_type`` (a qtp batch)."""
        return self._post(url, body, {"Content-Type": media_type}, slot)

    def _post(self, url: str, body: bytes, headers: dict[str, str], slot: int | None) -> Reply:
        peer = self.security.peer_for_url(url)
        signer = peer if peer is not None and peer.secret is not None else None
        # the signature covers the path, not the query; the boot is the peer's (any replica's), kept per address
        target = url if slot is None else f"{url}{'&' if '?' in url else '?'}{SLOT_QUERY}={slot}"
        try:
            boot = self._boots.get(url, "")
            status, answer_headers, data, signature = self._retrying(self._send, url, target, body, headers, signer,
                                                                     boot)
            if signer is not None and status == 401 and self._boots.get(url, "") != boot:
                boot = self._boots[url]  # the peer restarted (or we did): its boot, learnt from this 401
                status, answer_headers, data, signature = self._retrying(self._send, url, target, body, headers,
                                                                         signer, boot)
        except requests.RequestException as exc:
            raise TransportError(f"POST {url} failed: {type(exc).__name__}: {exc}") from exc
        if signer is not None and data.strip():
            try:
                verify_response(signer, answer_headers.get(HEADER, ""), signature, status, data)
            except AuthenticationError as exc:
                raise TransportError(f"POST {url}: {exc} (HTTP {status}); the answer is ignored") from None
        return Reply(status, answer_headers.get("Content-Type", ""), data)

    def _send(self, url: str, target: str, body: bytes, headers: dict[str, str], signer: Peer | None,
              boot: str) -> tuple[int, Any, bytes, str]:
        """One attempt at ``target`` (``url``, perhaps with a query), signed anew for ``signer``'s ``boot`` (the
        peer takes a signature once: an attempt whose answer was lost after the peer read it must not be
        refused as its replay); the answer and the signature. The boot the answer gives is remembered for the
        next request to ``url``."""
        signature = ""
        if signer is not None:
            signature = sign_request(signer.secret or b"", self.name, signer.name, "POST", urlsplit(url).path, body,
                                     boot=boot)
            headers = {**headers, HEADER: signature}
        with self.session.post(target, data=body, headers=headers, timeout=self.timeout, allow_redirects=False,
                               stream=True) as response:
            if 300 <= response.status_code < 400:
                raise requests.RequestException(f"the peer redirects (HTTP {response.status_code}); "
                                                "qtp does not follow redirects: configure the final address")
            answered = answer_boot(response.headers)
            if answered is not None:
                self._boots[url] = answered
            declared = response.headers.get("Content-Length", "")
            if declared.isdigit() and int(declared) > self.max_response_bytes:
                raise requests.RequestException(f"the answer is {declared} bytes, over [limits] max_response_bytes "
                                                f"({self.max_response_bytes}); not read")
            data = bytearray()
            for chunk in response.iter_content(64 * 1024):
                data += chunk
                if len(data) > self.max_response_bytes:
                    raise requests.RequestException(f"the answer is over [limits] max_response_bytes "
                                                    f"({self.max_response_bytes}); not read further")
            return response.status_code, response.headers, bytes(data), signature

    def close(self) -> None:
        self.session.close()
