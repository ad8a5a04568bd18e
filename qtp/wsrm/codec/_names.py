"""Namespaces, element names and action URIs of every SOAP / WS-Addressing / WS-RM version qtp speaks."""

from __future__ import annotations

from enum import Enum

from qtp.wsrm.protocol import RMVersion


class SoapVersion(str, Enum):
    SOAP11 = "1.1"
    SOAP12 = "1.2"


class WsaVersion(str, Enum):
    """WS-Addressing: the 2004/08 member submission (WS-RM 1.0 peers) or the W3C 2005/08 recommendation."""

    WSA200408 = "2004/08"
    WSA200508 = "2005/08"


SOAP_NS = {
    SoapVersion.SOAP11: "http://schemas.xmlsoap.org/soap/envelope/",
    SoapVersion.SOAP12: "http://www.w3.org/2003/05/soap-envelope",
}
SOAP_BY_NS = {ns: version for version, ns in SOAP_NS.items()}
MUST_UNDERSTAND_TRUE = {SoapVersion.SOAP11: "1", SoapVersion.SOAP12: "true"}

WSA_NS = {
    WsaVersion.WSA200408: "http://schemas.xmlsoap.org/ws/2004/08/addressing",
    WsaVersion.WSA200508: "http://www.w3.org/2005/08/addressing",
}
WSA_BY_NS = {ns: version for version, ns in WSA_NS.items()}
WSA_FAULT_ACTION = {
    WsaVersion.WSA200408: "http://schemas.xmlsoap.org/ws/2004/08/addressing/fault",
    WsaVersion.WSA200508: "http://www.w3.org/2005/08/addressing/soap/fault",
}

RM_NS = {
    RMVersion.WSRM10: "http://schemas.xmlsoap.org/ws/2005/02/rm",
    RMVersion.WSRM11: "http://docs.oasis-open.org/ws-rx/wsrm/200702",
}
RM_BY_NS = {ns: version for version, ns in RM_NS.items()}

# The combinations peers use: WS-RM 1.0 with either addressing (Sandesha2, CXF), WS-RM 1.1 with W3C only.
QTP_NS = "urn:qtp:wsrm:2026"  # qtp's own extensions (docs/interop.md, "Batching between qtp nodes")

COMBINATIONS = (
    (RMVersion.WSRM10, WsaVersion.WSA200408),
    (RMVersion.WSRM10, WsaVersion.WSA200508),
    (RMVersion.WSRM11, WsaVersion.WSA200508),
)

PREFIX = {"soap": "S", "wsa": "wsa", "wsrm": "wsrm"}
XML_LANG = "{http://www.w3.org/XML/1998/namespace}lang"


def action(rm: RMVersion, name: str) -> str:
    """The WS-Addressing Action of a WS-RM message (``name``: CreateSequence, SequenceAcknowledgement, ...)."""
    return f"{RM_NS[rm]}/{name}"


def anonymous(wsa: WsaVersion) -> str:
    if wsa is WsaVersion.WSA200408:
        return WSA_NS[wsa] + "/role/anonymous"
    return WSA_NS[wsa] + "/anonymous"


# WS-MakeConnection 1.1: polling for messages by nodes that cannot listen (docs/messaging.md)
WSMC_NS = "http://docs.oasis-open.org/ws-rx/wsmc/200702"
WSMC_ANONYMOUS = WSMC_NS + "/anonymous?id="
MAKE_CONNECTION_ACTION = WSMC_NS + "/MakeConnection"
WSMC_FAULT_ACTION = WSMC_NS + "/fault"
MISSING_SELECTION = f"{{{WSMC_NS}}}MissingSelection"
UNSUPPORTED_SELECTION = f"{{{WSMC_NS}}}UnsupportedSelection"
WSMC_SUBCODES = (MISSING_SELECTION, UNSUPPORTED_SELECTION)


def mc_anonymous(identifier: str) -> str:
    """The WS-MC anonymous URI of a polling endpoint named ``identifier`` (a URI, e.g. urn:uuid:...)."""
    return WSMC_ANONYMOUS + identifier


def mc_id(address: str | None) -> str | None:
    """The id of a WS-MC anonymous URI, or None when ``address`` is not one."""
    if address is None or not address.startswith(WSMC_ANONYMOUS) or len(address) == len(WSMC_ANONYMOUS):
        return None
    return address[len(WSMC_ANONYMOUS):]


def reply_destination(reply_to: str | None, wsa: WsaVersion) -> str:
    """The To of an answer on the HTTP response to a request whose ReplyTo is ``reply_to``: a WS-MC anonymous
    URI stays (WS-Addressing 1.0 Core 3.4: the reply's [destination] is the [reply endpoint]'s address, and
    it tells a client that polls which of its endpoints the answer is for); anything else is anonymous."""
    return reply_to if mc_id(reply_to) is not None else anonymous(wsa)  # type: ignore[return-value]
