"""Envelope -> bytes. Strict: anything the chosen versions cannot express raises ``EncodingError``.

Every element is built with lxml under one set of prefixes declared on the Envelope (S, wsa, wsrm), in
the order the schemas' sequences require, so the output validates against the official schemas
(tests/test_wsrm_conformance.py checks each kind of message in each version).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lxml import etree

from qtp.wsrm.codec._envelope import Addressing, EncodingError, Envelope, SoapFault
from qtp.wsrm.codec._names import (
    COMBINATIONS,
    MUST_UNDERSTAND_TRUE,
    RM_NS,
    SOAP_NS,
    WSA_FAULT_ACTION,
    WSA_NS,
    XML_LANG,
    SoapVersion,
    WsaVersion,
    action,
)
from qtp.wsrm.protocol import (
    FAULT_VERSIONS,
    AckRequested,
    CloseSequence,
    CloseSequenceResponse,
    CreateSequence,
    CreateSequenceResponse,
    Offer,
    RMVersion,
    Sequence,
    SequenceAcknowledgement,
    SequenceFault,
    TerminateSequence,
    TerminateSequenceResponse,
)

_PAYLOAD_PARSER = etree.XMLParser(resolve_entities=False, no_network=True, load_dtd=False, huge_tree=False)


def format_duration(seconds: float) -> str:
    """xs:duration for a number of seconds, millisecond precision: 90.5 -> 'PT90.5S'."""
    text = f"{seconds:.3f}".rstrip("0").rstrip(".")
    return f"PT{text}S"


def default_action(envelope: Envelope) -> str:
    """The Action a WS-RM envelope must carry, from its body or, for a bare message, its headers."""
    rm, body = envelope.rm, envelope.body
    if rm is None:
        raise EncodingError("an envelope without WS-RM content needs an explicit Action")
    if isinstance(body, SequenceFault):
        if rm is RMVersion.WSRM11:
            return action(rm, "fault")
        return WSA_FAULT_ACTION[envelope.wsa or WsaVersion.WSA200508]
    if body is not None:
        return action(rm, type(body).__name__)
    if envelope.sequence is not None and envelope.sequence.last_message and envelope.payload is None:
        return action(rm, "LastMessage")
    if envelope.acks and not envelope.ack_requests and envelope.sequence is None:
        return action(rm, "SequenceAcknowledgement")
    if envelope.ack_requests and envelope.sequence is None:
        return action(rm, "AckRequested")
    raise EncodingError("an application message needs the application's Action")


class _Builder:
    def __init__(self, envelope: Envelope):
        self.env = envelope
        self.soap = SOAP_NS[envelope.soap]
        self.rm_ns = RM_NS[envelope.rm] if envelope.rm is not None else None
        self.wsa_ns = WSA_NS[envelope.wsa] if envelope.wsa is not None else None
        nsmap = {"S": self.soap}
        if self.wsa_ns:
            nsmap["wsa"] = self.wsa_ns
        if self.rm_ns:
            nsmap["wsrm"] = self.rm_ns
        self.root = etree.Element(f"{{{self.soap}}}Envelope", nsmap=nsmap)

    def rm(self, parent: Any, name: str, text: str | None = None) -> Any:
        if self.rm_ns is None:
            raise EncodingError("WS-RM content needs Envelope.rm")
        element = etree.SubElement(parent, f"{{{self.rm_ns}}}{name}")
        if text is not None:
            element.text = text
        return element

    def wsa(self, parent: Any, name: str, text: str) -> Any:
        element = etree.SubElement(parent, f"{{{self.wsa_ns}}}{name}")
        element.text = text
        return element

    def epr(self, parent: Any, name: str, address: str, ns: str | None = None) -> Any:
        element = etree.SubElement(parent, f"{{{ns}}}{name}" if ns else name)
        self.wsa(element, "Address", address)
        return element


def encode(envelope: Envelope) -> bytes:
    """Serialise ``envelope`` as UTF-8 SOAP. Raises EncodingError when its versions cannot express it."""
    _check_versions(envelope)
    b = _Builder(envelope)
    header = etree.SubElement(b.root, f"{{{b.soap}}}Header")
    _addressing(b, header, envelope.addressing)
    if envelope.sequence is not None:
        _sequence(b, header, envelope.sequence)
    for ack in envelope.acks:
        _ack(b, header, ack)
    for request in envelope.ack_requests:
        _ack_requested(b, header, request)
    body = etree.SubElement(b.root, f"{{{b.soap}}}Body")
    content = envelope.body
    if content is None:
        if envelope.payload is not None:
            body.append(_payload(envelope.payload))
    elif isinstance(content, SequenceFault):
        _fault(b, header, body, content)
    elif isinstance(content, SoapFault):
        raise EncodingError("qtp emits WS-RM faults only; a foreign SoapFault is for reading")
    else:
        if envelope.payload is not None:
            raise EncodingError("an envelope has either a WS-RM body or an application payload")
        _BODY[type(content)](b, body, content)
    if len(header) == 0:
        b.root.remove(header)
    return etree.tostring(b.root, xml_declaration=True, encoding="UTF-8")


def _check_versions(envelope: Envelope) -> None:
    if envelope.rm is not None and (envelope.rm, envelope.wsa) not in COMBINATIONS:
        raise EncodingError(f"WS-RM {envelope.rm.value} is not used with WS-Addressing {envelope.wsa}")
    if envelope.addressing.action is None:
        raise EncodingError("every envelope needs a WS-Addressing Action (see default_action)")
    if envelope.wsa is None:
        raise EncodingError("every envelope needs a WS-Addressing version")
    if isinstance(envelope.body, SequenceFault) and envelope.rm not in FAULT_VERSIONS[envelope.body.code]:
        raise EncodingError(f"{envelope.body.code.value} does not exist in WS-RM {envelope.rm}")


def _addressing(b: _Builder, header: Any, a: Addressing) -> None:
    if a.to is not None:
        b.wsa(header, "To", a.to)
    if a.from_ is not None:
        b.epr(header, "From", a.from_, b.wsa_ns)
    if a.reply_to is not None:
        b.epr(header, "ReplyTo", a.reply_to, b.wsa_ns)
    if a.fault_to is not None:
        b.epr(header, "FaultTo", a.fault_to, b.wsa_ns)
    b.wsa(header, "Action", a.action or "")
    if a.message_id is not None:
        b.wsa(header, "MessageID", a.message_id)
    if a.relates_to is not None:
        b.wsa(header, "RelatesTo", a.relates_to)


def _must_understand(b: _Builder, element: Any) -> None:
    element.set(f"{{{b.soap}}}mustUnderstand", MUST_UNDERSTAND_TRUE[b.env.soap])


def _sequence(b: _Builder, header: Any, s: Sequence) -> None:
    if s.last_message and b.env.rm is RMVersion.WSRM11:
        raise EncodingError("WS-RM 1.1 has no LastMessage; close the sequence with CloseSequence")
    element = b.rm(header, "Sequence")
    _must_understand(b, element)
    b.rm(element, "Identifier", s.identifier)
    b.rm(element, "MessageNumber", str(s.number))
    if s.last_message:
        b.rm(element, "LastMessage")


def _ack(b: _Builder, header: Any, ack: SequenceAcknowledgement) -> None:
    if b.env.rm is RMVersion.WSRM10 and (ack.none or ack.final):
        raise EncodingError("WS-RM 1.0 acknowledgements have no None or Final")
    element = b.rm(header, "SequenceAcknowledgement")
    b.rm(element, "Identifier", ack.identifier)
    rm_ns = b.rm_ns
    for lower, upper in ack.ranges:
        etree.SubElement(element, f"{{{rm_ns}}}AcknowledgementRange", Upper=str(upper), Lower=str(lower))
    for number in ack.nacks:
        b.rm(element, "Nack", str(number))
    if ack.none:
        b.rm(element, "None")
    if ack.final:
        b.rm(element, "Final")


def _ack_requested(b: _Builder, header: Any, request: AckRequested) -> None:
    if request.max_message_number_used is not None and b.env.rm is RMVersion.WSRM11:
        raise EncodingError("WS-RM 1.1 AckRequested has no MaxMessageNumberUsed")
    element = b.rm(header, "AckRequested")
    b.rm(element, "Identifier", request.identifier)
    if request.max_message_number_used is not None:
        b.rm(element, "MaxMessageNumberUsed", str(request.max_message_number_used))


def _payload(payload: bytes) -> Any:
    try:
        return etree.fromstring(payload, _PAYLOAD_PARSER)
    except etree.XMLSyntaxError as exc:
        raise EncodingError(f"the application payload is not one well-formed XML element: {exc}") from exc


def _expires(b: _Builder, parent: Any, expires: float | None) -> None:
    if expires is not None:
        b.rm(parent, "Expires", format_duration(expires))


def _create_sequence(b: _Builder, body: Any, m: CreateSequence) -> None:
    element = b.rm(body, "CreateSequence")
    b.epr(element, "AcksTo", m.acks_to, b.rm_ns)
    _expires(b, element, m.expires)
    if m.offer is not None:
        _offer(b, element, m.offer)


def _offer(b: _Builder, parent: Any, offer: Offer) -> None:
    v11 = b.env.rm is RMVersion.WSRM11
    if v11 and offer.endpoint is None:
        raise EncodingError("a WS-RM 1.1 Offer needs its Endpoint")
    if not v11 and (offer.endpoint is not None or offer.incomplete_behavior is not None):
        raise EncodingError("a WS-RM 1.0 Offer has no Endpoint or IncompleteSequenceBehavior")
    element = b.rm(parent, "Offer")
    b.rm(element, "Identifier", offer.identifier)
    if offer.endpoint is not None:
        b.epr(element, "Endpoint", offer.endpoint, b.rm_ns)
    _expires(b, element, offer.expires)
    if offer.incomplete_behavior is not None:
        b.rm(element, "IncompleteSequenceBehavior", offer.incomplete_behavior.value)


def _create_sequence_response(b: _Builder, body: Any, m: CreateSequenceResponse) -> None:
    if m.incomplete_behavior is not None and b.env.rm is RMVersion.WSRM10:
        raise EncodingError("WS-RM 1.0 has no IncompleteSequenceBehavior")
    element = b.rm(body, "CreateSequenceResponse")
    b.rm(element, "Identifier", m.identifier)
    _expires(b, element, m.expires)
    if m.incomplete_behavior is not None:
        b.rm(element, "IncompleteSequenceBehavior", m.incomplete_behavior.value)
    if m.accept_acks_to is not None:
        accept = b.rm(element, "Accept")
        b.epr(accept, "AcksTo", m.accept_acks_to, b.rm_ns)


def _only_11(b: _Builder, name: str) -> None:
    if b.env.rm is not RMVersion.WSRM11:
        raise EncodingError(f"{name} exists in WS-RM 1.1 only")


def _close_sequence(b: _Builder, body: Any, m: CloseSequence) -> None:
    _only_11(b, "CloseSequence")
    element = b.rm(body, "CloseSequence")
    b.rm(element, "Identifier", m.identifier)
    if m.last_msg_number is not None:
        b.rm(element, "LastMsgNumber", str(m.last_msg_number))


def _terminate_sequence(b: _Builder, body: Any, m: TerminateSequence) -> None:
    if m.last_msg_number is not None:
        _only_11(b, "TerminateSequence/LastMsgNumber")
    element = b.rm(body, "TerminateSequence")
    b.rm(element, "Identifier", m.identifier)
    if m.last_msg_number is not None:
        b.rm(element, "LastMsgNumber", str(m.last_msg_number))


def _identifier_only(name: str) -> Callable[[_Builder, Any, Any], None]:
    def build(b: _Builder, body: Any, m: Any) -> None:
        _only_11(b, name)
        b.rm(b.rm(body, name), "Identifier", m.identifier)

    return build


_BODY: dict[type, Callable[[_Builder, Any, Any], None]] = {
    CreateSequence: _create_sequence,
    CreateSequenceResponse: _create_sequence_response,
    CloseSequence: _close_sequence,
    CloseSequenceResponse: _identifier_only("CloseSequenceResponse"),
    TerminateSequence: _terminate_sequence,
    TerminateSequenceResponse: _identifier_only("TerminateSequenceResponse"),
}


def _fault(b: _Builder, header: Any, body: Any, fault: SequenceFault) -> None:
    """SOAP 1.2: Sender with the WS-RM subcode; SOAP 1.1: Client, the code in a SequenceFault header."""
    soap = b.soap
    code = f"wsrm:{fault.code.value}"
    element = etree.SubElement(body, f"{{{soap}}}Fault")
    if b.env.soap is SoapVersion.SOAP12:
        code_el = etree.SubElement(element, f"{{{soap}}}Code")
        etree.SubElement(code_el, f"{{{soap}}}Value").text = "S:Sender"
        subcode = etree.SubElement(code_el, f"{{{soap}}}Subcode")
        etree.SubElement(subcode, f"{{{soap}}}Value").text = code
        reason = etree.SubElement(element, f"{{{soap}}}Reason")
        text = etree.SubElement(reason, f"{{{soap}}}Text")
        text.set(XML_LANG, "en")
        text.text = fault.reason
        detail_name = f"{{{soap}}}Detail"
    else:
        sequence_fault = b.rm(header, "SequenceFault")
        b.rm(sequence_fault, "FaultCode", code)
        etree.SubElement(element, "faultcode").text = "S:Client"
        etree.SubElement(element, "faultstring").text = fault.reason
        detail_name = "detail"
    if fault.identifier is not None:
        b.rm(etree.SubElement(element, detail_name), "Identifier", fault.identifier)
