"""SOAP over HTTP: content types, status codes, and the node's one pooled HTTP client.

A transport failure is never a message failure: the RM Source keeps every unacknowledged message and
retransmits on its timer, so the transport only retries briefly (connection refused or reset, a few times,
exponential backoff with jitter) to ride over a peer that is restarting, then reports the failure and
lets the protocol's retransmission take over.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import requests
import tenacity
from requests.adapters import HTTPAdapter

from qtp.errors import TransportError
from qtp.wsrm.codec import Envelope, SoapVersion, encode

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
    """One pooled ``requests.Session`` per node, with connect/read timeouts and brief transport retries."""

    def __init__(self, timeout: float = 10.0, pool: int = 32, attempts: int = 3, backoff_max: float = 1.0):
        self.timeout = (min(timeout, 5.0), timeout)
        self.session = requests.Session()
        adapter = HTTPAdapter(pool_connections=pool, pool_maxsize=pool, max_retries=0)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        self._retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(attempts),
            wait=tenacity.wait_random_exponential(multiplier=0.05, max=backoff_max),
            retry=tenacity.retry_if_exception_type(requests.ConnectionError),
            reraise=True,
        )

    def post(self, url: str, body: bytes, soap: SoapVersion, action: str | None) -> Reply:
        headers = {"Content-Type": content_type(soap, action)}
        if soap is SoapVersion.SOAP11:
            headers["SOAPAction"] = f'"{action or ""}"'
        return self._post(url, body, headers)

    def post_raw(self, url: str, body: bytes, media_type: str) -> Reply:
        """POST ``body`` as ``media_type`` (a qtp batch)."""
        return self._post(url, body, {"Content-Type": media_type})

    def _post(self, url: str, body: bytes, headers: dict[str, str]) -> Reply:
        try:
            response = self._retrying(self.session.post, url, data=body, headers=headers, timeout=self.timeout)
        except requests.RequestException as exc:
            raise TransportError(f"POST {url} failed: {type(exc).__name__}: {exc}") from exc
        return Reply(response.status_code, response.headers.get("Content-Type", ""), response.content)

    def close(self) -> None:
        self.session.close()
