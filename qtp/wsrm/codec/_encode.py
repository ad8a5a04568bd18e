"""Envelope -> bytes. Strict: anything the chosen versions cannot express raises ``EncodingError``.

The writer emits the XML text directly under one set of prefixes declared on the Envelope (S, wsa,
wsrm; a WS-MakeConnection element declares wsmc itself), every element in the order the schemas' sequences
require; tests/test_wsrm_codec.py and tests/test_wsmc_codec.py validate each kind of message in each version
against the official schemas. Writing text instead of building an lxml
tree first keeps qtp's cost near that of lxml merely serialising the same bytes (benchmarks/wsrm_codec.py):
numbers are ints by construction, every string goes through ``_text`` (escaping, and refusing characters
XML 1.0 cannot carry), and the application payload is checked with lxml to be one well-formed element
before it is spliced in (the verdict is remembered for recently checked payloads, see ``_payload``).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

from lxml import etree

from qtp.wsrm.codec._envelope import Addressing, EncodingError, Envelope, MakeConnection, SoapFault
from qtp.wsrm.codec._names import (
    COMBINATIONS,
    MAKE_CONNECTION_ACTION,
    MUST_UNDERSTAND_TRUE,
    QTP_NS,
    RM_NS,
    SOAP_NS,
    UNSUPPORTED_SELECTION,
    WSA_FAULT_ACTION,
    WSA_NS,
    WSMC_FAULT_ACTION,
    WSMC_NS,
    WSMC_SUBCODES,
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

_PAYLOAD_PARSER = etree.XMLParser(resolve_entities=False, no_network=True, load_dtd=False, huge_tree=False,
                                  collect_ids=False)
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")
_DECLARATION = "<?xml version='1.0' encoding='UTF-8'?>\n"


# The declaration and Envelope start tag, with every namespace it declares, of each version combination.
_START = {
    (soap, wsa, rm): f'{_DECLARATION}<S:Envelope xmlns:S="{SOAP_NS[soap]}" xmlns:wsa="{WSA_NS[wsa]}"'
                     + ("" if rm is None else f' xmlns:wsrm="{RM_NS[rm]}"') + "><S:Header>"
    for soap in SoapVersion
    for wsa in WsaVersion
    for rm in (None, *RMVersion)
}
_CHECKED_PAYLOADS_MAX_BYTES = 16 * 1024
_WSMC = f'xmlns:wsmc="{WSMC_NS}"'
# {namespace}local: the namespace in the URI characters libxml2 accepts, the local name an NCName (roughly)
_CLARK = re.compile(r"\{((?:[A-Za-z0-9._~:/?#@!$&'()*+,;=-]|%[0-9A-Fa-f]{2})*)\}([^\W\d][\w.-]*)")


def _text(value: str) -> str:
    """``value`` as XML character data; refuses characters XML 1.0 cannot represent."""
    if _NOT_XML.search(value):
        raise EncodingError(f"{value[:40]!r} holds a character XML 1.0 cannot carry")
    if "&" in value or "<" in value or ">" in value or "\r" in value:
        value = value.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("\r", "&#13;")
    return value


def format_duration(seconds: float) -> str:
    """xs:duration for a number of seconds, millisecond precision: 90.5 -> 'PT90.5S'."""
    text = f"{seconds:.3f}".rstrip("0").rstrip(".")
    return f"PT{text}S"


def default_action(envelope: Envelope) -> str:
    """The Action a WS-RM envelope must carry, from its body or, for a bare message, its headers."""
    rm, body = envelope.rm, envelope.body
    if isinstance(body, MakeConnection):
        return MAKE_CONNECTION_ACTION
    if isinstance(body, SoapFault) and body.subcode in WSMC_SUBCODES:
        return WSMC_FAULT_ACTION
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


class _Writer:
    """The text of one envelope, built as a list of strings."""

    def __init__(self, envelope: Envelope):
        self.env = envelope
        self.v11 = envelope.rm is RMVersion.WSRM11
        self.out: list[str] = []

    def rm(self, name: str, text: str) -> None:
        self.out.append(f"<wsrm:{name}>{text}</wsrm:{name}>")

    def epr(self, tag: str, address: str) -> None:
        self.out.append(f"<{tag}><wsa:Address>{_text(address)}</wsa:Address></{tag}>")


def encode(envelope: Envelope) -> bytes:
    """Serialise ``envelope`` as UTF-8 SOAP. Raises EncodingError when its versions cannot express it."""
    _check_versions(envelope)
    w = _Writer(envelope)
    w.out.append(_START[envelope.soap, envelope.wsa, envelope.rm])  # type: ignore[index]
    _addressing(w, envelope.addressing)
    if envelope.sequence is not None:
        _sequence(w, envelope.sequence)
    for ack in envelope.acks:
        _ack(w, ack)
    for request in envelope.ack_requests:
        _ack_requested(w, request)
    if envelope.message_pending is not None:
        w.out.append(f'<wsmc:MessagePending {_WSMC} pending="{"true" if envelope.message_pending else "false"}"/>')
    body_at = len(w.out)
    w.out.append("</S:Header><S:Body>")
    content = envelope.body
    if content is None:
        if envelope.payload is not None:
            w.out.append(_payload(envelope.payload))
    elif isinstance(content, SequenceFault):
        _fault(w, content, body_at)
    elif isinstance(content, SoapFault):
        _soap_fault(w, content)
    else:
        if envelope.payload is not None:
            raise EncodingError("an envelope has either a WS-RM body or an application payload")
        _BODY[type(content)](w, content)
    if len(w.out) == body_at + 1:
        w.out[body_at] = "</S:Header><S:Body/></S:Envelope>"  # as lxml writes an empty element
    else:
        w.out.append("</S:Body></S:Envelope>")
    return "".join(w.out).encode("utf-8")


def _check_versions(envelope: Envelope) -> None:
    if envelope.rm is not None and (envelope.rm, envelope.wsa) not in COMBINATIONS:
        raise EncodingError(f"WS-RM {envelope.rm.value} is not used with WS-Addressing {envelope.wsa}")
    if envelope.addressing.action is None:
        raise EncodingError("every envelope needs a WS-Addressing Action (see default_action)")
    if envelope.wsa is None:
        raise EncodingError("every envelope needs a WS-Addressing version")
    if (envelope.sequence is not None or envelope.acks or envelope.ack_requests) and envelope.rm is None:
        raise EncodingError("WS-RM headers need Envelope.rm")
    if isinstance(envelope.body, SequenceFault) and envelope.rm not in FAULT_VERSIONS[envelope.body.code]:
        raise EncodingError(f"{envelope.body.code.value} does not exist in WS-RM {envelope.rm}")
    if _uses_wsmc(envelope) and (envelope.rm, envelope.wsa) != (RMVersion.WSRM11, WsaVersion.WSA200508):
        raise EncodingError("WS-MakeConnection 1.1 goes with WS-RM 1.1 and WS-Addressing 2005/08, not WS-RM "
                            f"{envelope.rm and envelope.rm.value} with WS-Addressing {envelope.wsa.value}")


def _uses_wsmc(envelope: Envelope) -> bool:
    body = envelope.body
    return envelope.message_pending is not None or isinstance(body, MakeConnection) or (
        isinstance(body, SoapFault) and body.subcode in WSMC_SUBCODES)


def _addressing(w: _Writer, a: Addressing) -> None:
    out = w.out
    if a.to is not None:
        out.append(f"<wsa:To>{_text(a.to)}</wsa:To>")
    if a.from_ is not None:
        w.epr("wsa:From", a.from_)
    if a.reply_to is not None:
        w.epr("wsa:ReplyTo", a.reply_to)
    if a.fault_to is not None:
        w.epr("wsa:FaultTo", a.fault_to)
    out.append(f"<wsa:Action>{_text(a.action or '')}</wsa:Action>")
    if a.message_id is not None:
        out.append(f"<wsa:MessageID>{_text(a.message_id)}</wsa:MessageID>")
    if a.relates_to is not None:
        out.append(f"<wsa:RelatesTo>{_text(a.relates_to)}</wsa:RelatesTo>")


def _sequence(w: _Writer, s: Sequence) -> None:
    if s.last_message and w.v11:
        raise EncodingError("WS-RM 1.1 has no LastMessage; close the sequence with CloseSequence")
    must_understand = MUST_UNDERSTAND_TRUE[w.env.soap]
    last = "<wsrm:LastMessage/>" if s.last_message else ""
    w.out.append(
        f'<wsrm:Sequence S:mustUnderstand="{must_understand}"><wsrm:Identifier>{_text(s.identifier)}'
        f"</wsrm:Identifier><wsrm:MessageNumber>{s.number}</wsrm:MessageNumber>{last}</wsrm:Sequence>"
    )


def _ack(w: _Writer, ack: SequenceAcknowledgement) -> None:
    if not w.v11 and (ack.none or ack.final):
        raise EncodingError("WS-RM 1.0 acknowledgements have no None or Final")
    out = w.out
    out.append(f"<wsrm:SequenceAcknowledgement><wsrm:Identifier>{_text(ack.identifier)}</wsrm:Identifier>")
    out.extend([f'<wsrm:AcknowledgementRange Upper="{upper}" Lower="{lower}"/>' for lower, upper in ack.ranges])
    out.extend([f"<wsrm:Nack>{number}</wsrm:Nack>" for number in ack.nacks])
    if ack.none:
        out.append("<wsrm:None/>")
    if ack.final:
        out.append("<wsrm:Final/>")
    out.append("</wsrm:SequenceAcknowledgement>")


def _ack_requested(w: _Writer, request: AckRequested) -> None:
    used = request.max_message_number_used
    if used is not None and w.v11:
        raise EncodingError("WS-RM 1.1 AckRequested has no MaxMessageNumberUsed")
    extra = "" if used is None else f"<wsrm:MaxMessageNumberUsed>{used}</wsrm:MaxMessageNumberUsed>"
    w.out.append(f"<wsrm:AckRequested><wsrm:Identifier>{_text(request.identifier)}</wsrm:Identifier>"
                 f"{extra}</wsrm:AckRequested>")


class CheckedPayload(bytes):
    """A payload that ``check_payload`` accepted before (a node checks every payload when it is enqueued):
    the encoder writes it without parsing it again."""

    __slots__ = ()


def _payload(payload: bytes) -> str:
    """The payload's text, once lxml has confirmed it is one well-formed UTF-8 element and nothing else.

    The verdict on a payload of up to 16 KiB is remembered by value for the last 256 payloads (4 MiB at
    most), so that a message encoded again (a retransmission) is not parsed again; a payload not seen
    before is parsed.
    """
    if type(payload) is CheckedPayload:
        return payload.decode("utf-8").strip()
    if type(payload) is bytes and len(payload) <= _CHECKED_PAYLOADS_MAX_BYTES:
        return _checked_payload(payload)
    return _check_payload(payload)


def check_payload(payload: bytes) -> None:
    """Raise EncodingError unless ``payload`` is one well-formed UTF-8 XML element (what a Body may carry)."""
    if not isinstance(payload, bytes):
        raise EncodingError(f"the application payload must be bytes, got {type(payload).__name__}")
    _payload(payload)


@functools.lru_cache(maxsize=256)
def _checked_payload(payload: bytes) -> str:
    return _check_payload(payload)


def _check_payload(payload: bytes) -> str:
    try:
        text = payload.decode("utf-8").strip()
        tree = etree.fromstring(payload, _PAYLOAD_PARSER).getroottree()
    except (UnicodeDecodeError, etree.XMLSyntaxError) as exc:
        raise EncodingError(f"the application payload is not one well-formed UTF-8 XML element: {exc}") from exc
    if text.startswith("<?xml") or tree.docinfo.doctype or not text.startswith("<") or not text.endswith(">"):
        raise EncodingError("the application payload must be one element without XML declaration or DTD")
    return text


def _expires(w: _Writer, expires: float | None) -> None:
    if expires is not None:
        w.rm("Expires", format_duration(expires))


def _create_sequence(w: _Writer, m: CreateSequence) -> None:
    w.out.append("<wsrm:CreateSequence>")
    w.epr("wsrm:AcksTo", m.acks_to)
    _expires(w, m.expires)
    if m.offer is not None:
        _offer(w, m.offer)
    _batch(w, m.batch)
    w.out.append("</wsrm:CreateSequence>")


def _offer(w: _Writer, offer: Offer) -> None:
    if w.v11 and offer.endpoint is None:
        raise EncodingError("a WS-RM 1.1 Offer needs its Endpoint")
    if not w.v11 and (offer.endpoint is not None or offer.incomplete_behavior is not None):
        raise EncodingError("a WS-RM 1.0 Offer has no Endpoint or IncompleteSequenceBehavior")
    w.out.append("<wsrm:Offer>")
    w.rm("Identifier", _text(offer.identifier))
    if offer.endpoint is not None:
        w.epr("wsrm:Endpoint", offer.endpoint)
    _expires(w, offer.expires)
    if offer.incomplete_behavior is not None:
        w.rm("IncompleteSequenceBehavior", offer.incomplete_behavior.value)
    w.out.append("</wsrm:Offer>")


def _create_sequence_response(w: _Writer, m: CreateSequenceResponse) -> None:
    if m.incomplete_behavior is not None and not w.v11:
        raise EncodingError("WS-RM 1.0 has no IncompleteSequenceBehavior")
    w.out.append("<wsrm:CreateSequenceResponse>")
    w.rm("Identifier", _text(m.identifier))
    _expires(w, m.expires)
    if m.incomplete_behavior is not None:
        w.rm("IncompleteSequenceBehavior", m.incomplete_behavior.value)
    if m.accept_acks_to is not None:
        w.out.append("<wsrm:Accept>")
        w.epr("wsrm:AcksTo", m.accept_acks_to)
        w.out.append("</wsrm:Accept>")
    _batch(w, m.batch)
    w.out.append("</wsrm:CreateSequenceResponse>")


def _batch(w: _Writer, batch: int | None) -> None:
    """qtp's batching extension (docs/interop.md): an element in qtp's namespace, which other stacks ignore
    (the schemas allow any element of another namespace at the end of both messages)."""
    if batch is not None:
        w.out.append(f'<qtp:Batch xmlns:qtp="{QTP_NS}" max="{batch}"/>')


def _only_11(w: _Writer, name: str) -> None:
    if not w.v11:
        raise EncodingError(f"{name} exists in WS-RM 1.1 only")


def _with_last_number(name: str, only_11: bool) -> Callable[[_Writer, Any], None]:
    """CloseSequence (1.1 only) and TerminateSequence: Identifier, then LastMsgNumber in WS-RM 1.1."""

    def write(w: _Writer, m: CloseSequence | TerminateSequence) -> None:
        if only_11 or m.last_msg_number is not None:
            _only_11(w, name if only_11 else f"{name}/LastMsgNumber")
        last = "" if m.last_msg_number is None else f"<wsrm:LastMsgNumber>{m.last_msg_number}</wsrm:LastMsgNumber>"
        w.out.append(f"<wsrm:{name}><wsrm:Identifier>{_text(m.identifier)}</wsrm:Identifier>{last}</wsrm:{name}>")

    return write


def _identifier_only(name: str) -> Callable[[_Writer, Any], None]:
    def write(w: _Writer, m: CloseSequenceResponse | TerminateSequenceResponse) -> None:
        _only_11(w, name)
        w.out.append(f"<wsrm:{name}><wsrm:Identifier>{_text(m.identifier)}</wsrm:Identifier></wsrm:{name}>")

    return write


def _make_connection(w: _Writer, m: MakeConnection) -> None:
    """wsmc:Address, then the sequence selection as a wsrm:Identifier (the order the WS-MC schema requires:
    its Address, then elements of other namespaces)."""
    if m.unsupported:
        raise EncodingError("MakeConnection.unsupported lists selections a peer sent; qtp never sends them")
    if not m.address and not m.identifier:
        raise EncodingError("a MakeConnection needs an Address or an Identifier (else the peer answers "
                            "MissingSelection)")
    if "" in (m.address, m.identifier):
        raise EncodingError("a MakeConnection's Address or Identifier is empty")
    address = "" if m.address is None else f"<wsmc:Address>{_text(m.address)}</wsmc:Address>"
    identifier = "" if m.identifier is None else f"<wsrm:Identifier>{_text(m.identifier)}</wsrm:Identifier>"
    w.out.append(f"<wsmc:MakeConnection {_WSMC}>{address}{identifier}</wsmc:MakeConnection>")


_BODY: dict[type, Callable[[_Writer, Any], None]] = {
    CreateSequence: _create_sequence,
    CreateSequenceResponse: _create_sequence_response,
    CloseSequence: _with_last_number("CloseSequence", only_11=True),
    CloseSequenceResponse: _identifier_only("CloseSequenceResponse"),
    TerminateSequence: _with_last_number("TerminateSequence", only_11=False),
    TerminateSequenceResponse: _identifier_only("TerminateSequenceResponse"),
    MakeConnection: _make_connection,
}


def _fault(w: _Writer, fault: SequenceFault, header_end: int) -> None:
    """SOAP 1.2: Sender with the WS-RM subcode; SOAP 1.1: Client, the code in a SequenceFault header."""
    code = f"wsrm:{fault.code.value}"
    reason = _text(fault.reason)
    detail_tag = "S:Detail" if w.env.soap is SoapVersion.SOAP12 else "detail"
    detail = "" if fault.identifier is None else \
        f"<{detail_tag}><wsrm:Identifier>{_text(fault.identifier)}</wsrm:Identifier></{detail_tag}>"
    if w.env.soap is SoapVersion.SOAP12:
        w.out.append(
            f"<S:Fault><S:Code><S:Value>S:Sender</S:Value><S:Subcode><S:Value>{code}</S:Value></S:Subcode>"
            f'</S:Code><S:Reason><S:Text xml:lang="en">{reason}</S:Text></S:Reason>{detail}</S:Fault>'
        )
        return
    w.out.insert(header_end, f"<wsrm:SequenceFault><wsrm:FaultCode>{code}</wsrm:FaultCode></wsrm:SequenceFault>")
    w.out.append(f"<S:Fault><faultcode>S:Client</faultcode><faultstring>{reason}</faultstring>{detail}</S:Fault>")


def _soap_fault(w: _Writer, fault: SoapFault) -> None:
    """A fault that is not WS-RM's (an application's, a busy server's, or a WS-MakeConnection one): the code's
    local name decides between Sender (SOAP 1.1: Client) and Receiver (SOAP 1.1: Server). Subcodes are written
    for the WS-MC faults only (see ``_wsmc_fault``)."""
    sender = fault.code.rsplit("}", 1)[-1] in ("Sender", "Client")
    reason = _text(fault.reason)
    declaration, subcode, detail = _wsmc_fault(fault, sender)
    if w.env.soap is SoapVersion.SOAP12:
        code = "S:Sender" if sender else "S:Receiver"
        sub = "" if subcode is None else f"<S:Subcode><S:Value>{subcode}</S:Value></S:Subcode>"
        detail = detail and f"<S:Detail>{detail}</S:Detail>"
        w.out.append(f'<S:Fault{declaration}><S:Code><S:Value>{code}</S:Value>{sub}</S:Code><S:Reason>'
                     f'<S:Text xml:lang="en">{reason}</S:Text></S:Reason>{detail}</S:Fault>')
        return
    code = subcode or ("S:Client" if sender else "S:Server")
    detail = detail and f"<detail>{detail}</detail>"
    w.out.append(f"<S:Fault{declaration}><faultcode>{code}</faultcode><faultstring>{reason}</faultstring>"
                 f"{detail}</S:Fault>")


def _wsmc_fault(fault: SoapFault, sender: bool) -> tuple[str, str | None, str]:
    """The wsmc declaration, subcode and Detail content of a WS-MakeConnection fault; ("", None, "") for any
    other fault. WS-MakeConnection 1.1 section 4 gives both faults the code Receiver; SOAP 1.1 has no
    subcodes, so there the subcode is the faultcode (as Metro and Sandesha2 write it). An UnsupportedSelection
    fault's Detail holds one wsmc:UnsupportedSelection QName per unsupported element."""
    if fault.unsupported and fault.subcode != UNSUPPORTED_SELECTION:
        raise EncodingError("only an UnsupportedSelection fault names unsupported selections")
    if fault.subcode not in WSMC_SUBCODES:
        return "", None, ""
    if sender:
        raise EncodingError("the WS-MakeConnection faults have the code Receiver (WS-MakeConnection 1.1, 4)")
    detail = "".join(map(_unsupported_selection, fault.unsupported))
    return f" {_WSMC}", "wsmc:" + fault.subcode.rpartition("}")[2], detail


def _unsupported_selection(name: str) -> str:
    match = _CLARK.fullmatch(name)
    if match is None:
        raise EncodingError(f"unsupported selection {name[:80]!r} is not a {{namespace}}local name (namespace: "
                            "a URI in ASCII)")
    namespace, local = match.groups()
    if not namespace:
        return f"<wsmc:UnsupportedSelection>{local}</wsmc:UnsupportedSelection>"
    return f'<wsmc:UnsupportedSelection xmlns:u="{_text(namespace)}">u:{local}</wsmc:UnsupportedSelection>'
