"""bytes -> Envelope. Hardened and tolerant.

Hardened: input above ``max_bytes`` is refused before parsing; any DTD is refused (so no entity expansion,
no billion laughs, no external entities); the parser never touches the network; libxml2's own limits stop
documents deeper than 256 levels and qtp refuses deeper than ``max_depth``. Every failure becomes an
``InvalidMessage`` carrying the wire fault code to answer with.

Tolerant: blanks around numbers and identifiers, unknown extension elements and attributes (the schemas'
``xs:any ##other``), comments, unmerged or unsorted acknowledgement ranges, and either WS-Addressing
version are all accepted. Unknown headers are ignored unless they carry mustUnderstand.
"""

from __future__ import annotations

import functools
import operator
import re
from collections.abc import Callable
from typing import Any

from lxml import etree

from qtp.wsrm.codec._envelope import Addressing, Envelope, InvalidMessage, SoapFault
from qtp.wsrm.codec._names import RM_BY_NS, SOAP_BY_NS, SOAP_NS, WSA_BY_NS, SoapVersion, WsaVersion
from qtp.wsrm.protocol import (
    MAX_MESSAGE_NUMBER,
    AckRequested,
    CloseSequence,
    CloseSequenceResponse,
    CreateSequence,
    CreateSequenceResponse,
    FaultCode,
    IncompleteSequenceBehavior,
    Offer,
    RMVersion,
    Sequence,
    SequenceAcknowledgement,
    SequenceFault,
    TerminateSequence,
    TerminateSequenceResponse,
)
from qtp.wsrm.protocol import _ranges as ranges

DEFAULT_MAX_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_DEPTH = 100

_PARSER = etree.XMLParser(
    resolve_entities=False, no_network=True, load_dtd=False, dtd_validation=False, huge_tree=False,
    collect_ids=False,
)
_DIGITS = re.compile(r"\+?[0-9]{1,25}")
_DIGIT_LIST = re.compile(r"(?:\s*\+?[0-9]{1,25}\s*,)*")
_DURATION = re.compile(
    r"P(?:(\d+)Y)?(?:(\d+)M)?(?:(\d+)D)?(?:T(?:(\d+)H)?(?:(\d+)M)?(?:(\d+(?:\.\d+)?)S)?)?"
)
_FAULT_CODES = {code.value: code for code in FaultCode}
_TRUE = {"1", "true"}
SENDER = "Sender"


@functools.lru_cache(maxsize=8)
def _deeper_than(max_depth: int) -> etree.XPath:
    """A compiled XPath that is true when some element sits below ``max_depth`` levels."""
    return etree.XPath("boolean(" + "/*" * (max_depth + 1) + ")")


def _split(tag: str) -> tuple[str, str]:
    if tag[:1] == "{":
        ns, _, local = tag[1:].partition("}")
        return ns, local
    return "", tag


def _text(element: Any) -> str:
    return (element.text or "").strip()


def _bad(reason: str, code: str = SENDER) -> InvalidMessage:
    return InvalidMessage(code, reason)


def parse_duration(text: str) -> float:
    """Seconds in an xs:duration; a year counts 365 days and a month 30 (WS-RM uses short durations)."""
    match = _DURATION.fullmatch(text.strip())
    if match is None or text.strip() in ("P", "") or text.strip().endswith("T"):
        raise _bad(f"Expires is not a non-negative xs:duration: {text!r}")
    years, months, days, hours, minutes, seconds = match.groups()
    total = (int(years or 0) * 365 + int(months or 0) * 30 + int(days or 0)) * 86400
    total += int(hours or 0) * 3600 + int(minutes or 0) * 60
    return total + float(seconds or 0)


class _Reader:
    """One decode call: remembers which WS-RM and WS-Addressing versions the message used."""

    def __init__(self, soap: SoapVersion):
        self.soap = soap
        self.rm: RMVersion | None = None
        self.rm_ns = ""
        self.wsa: WsaVersion | None = None
        self.fault_code: FaultCode | None = None

    def see_rm(self, ns: str) -> None:
        version = RM_BY_NS[ns]
        if self.rm is not None and version is not self.rm:
            raise _bad("the message mixes WS-RM 1.0 and WS-RM 1.1 elements")
        self.rm, self.rm_ns = version, ns

    def see_wsa(self, ns: str) -> None:
        version = WSA_BY_NS[ns]
        if self.wsa is not None and version is not self.wsa:
            raise _bad("the message mixes two WS-Addressing versions")
        self.wsa = version

    def child(self, parent: Any, local: str, required: bool = True) -> Any:
        tag = f"{{{self.rm_ns}}}{local}"
        element = next((c for c in parent if c.tag == tag), None)  # cheaper than find() for a few children
        if element is None and required:
            raise _bad(f"{_split(parent.tag)[1]} lacks its {local}")
        return element

    def identifier(self, parent: Any) -> str:
        value = _text(self.child(parent, "Identifier"))
        if not value:
            raise _bad(f"{_split(parent.tag)[1]} has an empty Identifier")
        return value

    def number(self, text: str, what: str) -> int:
        text = text.strip()
        if not _DIGITS.fullmatch(text):
            raise _bad(f"{what} is not an unsigned integer: {text[:40]!r}")
        value = int(text)
        if value > MAX_MESSAGE_NUMBER:
            raise _bad(f"{what} {value} is above {MAX_MESSAGE_NUMBER}", FaultCode.MESSAGE_NUMBER_ROLLOVER.value)
        if value < 1:
            raise _bad(f"{what} must be at least 1")
        return value

    def numbers(self, texts: list[str], what: str) -> list[int]:
        """Many numbers at once: one regular-expression pass over all of them, then int()."""
        if not texts:
            return []
        joined = "".join(texts)
        plain = joined.isascii() and joined.isdigit() and all(texts)  # the common case: no blanks, signs
        if not plain and not _DIGIT_LIST.fullmatch(",".join(texts) + ","):
            return [self.number(text, what) for text in texts]  # names the culprit
        values = list(map(int, texts))
        if max(values) > MAX_MESSAGE_NUMBER or min(values) < 1:
            return [self.number(text, what) for text in texts]
        return values

    def optional_number(self, parent: Any, local: str) -> int | None:
        element = self.child(parent, local, required=False)
        return None if element is None else self.number(_text(element), local)

    def address(self, epr: Any, what: str) -> str:
        for child in epr:
            if isinstance(child.tag, str) and child.tag.endswith("}Address") and _split(child.tag)[0] in WSA_BY_NS:
                self.see_wsa(_split(child.tag)[0])
                value = _text(child)
                if value:
                    return value
        raise _bad(f"{what} has no Address")

    def expires(self, parent: Any) -> float | None:
        element = self.child(parent, "Expires", required=False)
        return None if element is None else parse_duration(_text(element))

    def behavior(self, parent: Any) -> IncompleteSequenceBehavior | None:
        element = self.child(parent, "IncompleteSequenceBehavior", required=False)
        if element is None:
            return None
        try:
            return IncompleteSequenceBehavior(_text(element))
        except ValueError:
            raise _bad(f"unknown IncompleteSequenceBehavior {_text(element)[:40]!r}") from None

    def qname(self, element: Any) -> tuple[str, str]:
        prefix, _, local = _text(element).rpartition(":")
        ns = element.nsmap.get(prefix or None)
        if ns is None and prefix:
            raise _bad(f"undeclared prefix in fault code {_text(element)[:40]!r}")
        return ns or "", local


def decode(data: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES, max_depth: int = DEFAULT_MAX_DEPTH) -> Envelope:
    """Parse one SOAP envelope. Raises InvalidMessage (a WsrmFault with the wire code) for bad input."""
    if not isinstance(data, (bytes, bytearray)):
        raise TypeError(f"decode takes bytes, not {type(data).__name__}")
    if len(data) > max_bytes:
        raise _bad(f"the envelope has {len(data)} bytes, more than the limit of {max_bytes}")
    if b"<!DOCTYPE" in data or b"<!ENTITY" in data:
        raise _bad("DTDs and entity declarations are not accepted")
    try:
        root = etree.fromstring(bytes(data), _PARSER)
    except etree.XMLSyntaxError as exc:
        raise _bad(f"the envelope is not well-formed XML: {exc}") from exc
    if root.getroottree().docinfo.doctype:
        raise _bad("DTDs are not accepted")
    if _deeper_than(max_depth)(root):
        raise _bad(f"the envelope is nested deeper than {max_depth} elements")
    ns, local = _split(root.tag)
    soap = SOAP_BY_NS.get(ns)
    if soap is None or local != "Envelope":
        code = "VersionMismatch" if local == "Envelope" else SENDER
        raise _bad(f"the document is not a SOAP 1.1 or 1.2 Envelope: {root.tag[:80]}", code)
    try:
        return _envelope(_Reader(soap), root)
    except ValueError as exc:  # a value the message classes refuse (an Expires of a million years, ...)
        raise _bad(f"invalid value: {exc}") from exc


def _envelope(reader: _Reader, root: Any) -> Envelope:
    soap_ns = SOAP_NS[reader.soap]
    header = body = None
    for child in root:
        if not isinstance(child.tag, str):
            continue
        if child.tag == f"{{{soap_ns}}}Header" and header is None and body is None:
            header = child
        elif child.tag == f"{{{soap_ns}}}Body" and body is None:
            body = child
        else:
            raise _bad(f"unexpected {child.tag[:80]} in the Envelope")
    if body is None:
        raise _bad("the Envelope has no Body")
    fields: dict[str, Any] = {"acks": [], "ack_requests": [], "addressing": {}}
    if header is not None:
        _header(reader, header, fields)
    content, payload = _body(reader, body)
    return Envelope(
        soap=reader.soap, rm=reader.rm, wsa=reader.wsa, addressing=Addressing(**fields["addressing"]),
        sequence=fields.get("sequence"), acks=tuple(fields["acks"]), ack_requests=tuple(fields["ack_requests"]),
        body=content, payload=payload,
    )


_WSA_TEXT = {"To": "to", "Action": "action", "MessageID": "message_id", "RelatesTo": "relates_to"}
_WSA_EPR = {"ReplyTo": "reply_to", "From": "from_", "FaultTo": "fault_to"}


def _header(reader: _Reader, header: Any, fields: dict[str, Any]) -> None:
    must_understand = f"{{{SOAP_NS[reader.soap]}}}mustUnderstand"
    for block in header:
        if not isinstance(block.tag, str):
            continue
        ns, local = _split(block.tag)
        if ns in WSA_BY_NS and (local in _WSA_TEXT or local in _WSA_EPR):
            reader.see_wsa(ns)
            if local in _WSA_TEXT:
                fields["addressing"][_WSA_TEXT[local]] = _text(block)
            else:
                fields["addressing"][_WSA_EPR[local]] = reader.address(block, local)
        elif ns in RM_BY_NS and local in _HEADERS:
            reader.see_rm(ns)
            _HEADERS[local](reader, block, fields)
        elif (block.get(must_understand) or "").strip() in _TRUE:
            raise _bad(f"header {block.tag[:80]} is not understood", "MustUnderstand")


def _sequence(reader: _Reader, block: Any, fields: dict[str, Any]) -> None:
    if "sequence" in fields:
        raise _bad("more than one Sequence header")
    number = reader.number(_text(reader.child(block, "MessageNumber")), "MessageNumber")
    last = reader.child(block, "LastMessage", required=False) is not None
    if last and reader.rm is RMVersion.WSRM11:
        raise _bad("LastMessage does not exist in WS-RM 1.1")
    fields["sequence"] = Sequence(reader.identifier(block), number, last)


def _acknowledgement(reader: _Reader, block: Any, fields: dict[str, Any]) -> None:
    invalid = FaultCode.INVALID_ACKNOWLEDGEMENT.value
    ns = reader.rm_ns
    found = block.findall(f"{{{ns}}}AcknowledgementRange")
    pairs: tuple[tuple[int, int], ...] = ()
    if found:
        lowers = reader.numbers(list(map(_LOWER, found)), "AcknowledgementRange Lower")
        uppers = reader.numbers(list(map(_UPPER, found)), "AcknowledgementRange Upper")
        pairs = tuple(zip(lowers, uppers))
    nacks = reader.numbers([_text(e) for e in block.findall(f"{{{ns}}}Nack")], "Nack")
    none = block.find(f"{{{ns}}}None") is not None
    final = block.find(f"{{{ns}}}Final") is not None
    if (none or final) and reader.rm is RMVersion.WSRM10:
        raise _bad("WS-RM 1.0 acknowledgements have no None or Final", invalid)
    identifier = reader.identifier(block)
    nack_tuple = tuple(sorted(set(nacks)))
    try:
        ack = SequenceAcknowledgement(identifier, pairs, nack_tuple, none, final)
    except ValueError:
        # Tolerant: peers may send ranges unsorted, overlapping or adjacent; merge them and try again.
        if any(lower > upper for lower, upper in pairs):
            raise _bad("an acknowledgement range has Lower above Upper", invalid) from None
        try:
            ack = SequenceAcknowledgement(identifier, ranges.union((), pairs), nack_tuple, none, final)
        except ValueError as exc:
            raise _bad(f"invalid SequenceAcknowledgement: {exc}", invalid) from None
    fields["acks"].append(ack)


_LOWER = operator.methodcaller("get", "Lower", "")
_UPPER = operator.methodcaller("get", "Upper", "")


def _ack_requested(reader: _Reader, block: Any, fields: dict[str, Any]) -> None:
    used = reader.optional_number(block, "MaxMessageNumberUsed")
    fields["ack_requests"].append(AckRequested(reader.identifier(block), used))


def _sequence_fault(reader: _Reader, block: Any, fields: dict[str, Any]) -> None:
    ns, local = reader.qname(reader.child(block, "FaultCode"))
    if ns == reader.rm_ns and local in _FAULT_CODES:
        reader.fault_code = _FAULT_CODES[local]


_HEADERS: dict[str, Callable[[_Reader, Any, dict[str, Any]], None]] = {
    "Sequence": _sequence,
    "SequenceAcknowledgement": _acknowledgement,
    "AckRequested": _ack_requested,
    "SequenceFault": _sequence_fault,
}


def _body(reader: _Reader, body: Any) -> tuple[Any, bytes | None]:
    elements = [child for child in body if isinstance(child.tag, str)]
    if not elements:
        return None, None
    if len(elements) > 1:
        raise _bad("the Body holds more than one element")
    element = elements[0]
    ns, local = _split(element.tag)
    if ns == SOAP_NS[reader.soap] and local == "Fault":
        return _fault(reader, element), None
    if ns in RM_BY_NS:
        reader.see_rm(ns)
        reader_fn = _BODIES.get(local)
        if reader_fn is None:
            raise _bad(f"unsupported WS-RM body element {local[:40]}")
        return reader_fn(reader, element), None
    body.remove(element)  # detached, it keeps only the namespace declarations it uses
    return None, etree.tostring(element, with_tail=False)


def _create_sequence(reader: _Reader, element: Any) -> CreateSequence:
    acks_to = reader.address(reader.child(element, "AcksTo"), "AcksTo")
    offer_element = reader.child(element, "Offer", required=False)
    offer = None
    if offer_element is not None:
        endpoint = reader.child(offer_element, "Endpoint", required=False)
        offer = Offer(
            reader.identifier(offer_element),
            None if endpoint is None else reader.address(endpoint, "Endpoint"),
            reader.expires(offer_element), reader.behavior(offer_element),
        )
    return CreateSequence(acks_to, reader.expires(element), offer)


def _create_sequence_response(reader: _Reader, element: Any) -> CreateSequenceResponse:
    accept = reader.child(element, "Accept", required=False)
    acks_to = None if accept is None else reader.address(reader.child(accept, "AcksTo"), "Accept/AcksTo")
    return CreateSequenceResponse(reader.identifier(element), reader.expires(element),
                                  reader.behavior(element), acks_to)


def _close_sequence(reader: _Reader, element: Any) -> CloseSequence:
    return CloseSequence(reader.identifier(element), reader.optional_number(element, "LastMsgNumber"))


def _terminate_sequence(reader: _Reader, element: Any) -> TerminateSequence:
    return TerminateSequence(reader.identifier(element), reader.optional_number(element, "LastMsgNumber"))


_BODIES: dict[str, Callable[[_Reader, Any], Any]] = {
    "CreateSequence": _create_sequence,
    "CreateSequenceResponse": _create_sequence_response,
    "CloseSequence": _close_sequence,
    "CloseSequenceResponse": lambda r, e: CloseSequenceResponse(r.identifier(e)),
    "TerminateSequence": _terminate_sequence,
    "TerminateSequenceResponse": lambda r, e: TerminateSequenceResponse(r.identifier(e)),
}


def _fault(reader: _Reader, fault: Any) -> SequenceFault | SoapFault:
    soap_ns = SOAP_NS[reader.soap]
    if reader.soap is SoapVersion.SOAP12:
        value = fault.find(f"{{{soap_ns}}}Code/{{{soap_ns}}}Value")
        sub = fault.find(f"{{{soap_ns}}}Code/{{{soap_ns}}}Subcode/{{{soap_ns}}}Value")
        text = fault.find(f"{{{soap_ns}}}Reason/{{{soap_ns}}}Text")
        detail = fault.find(f"{{{soap_ns}}}Detail")
    else:
        value, sub = fault.find("faultcode"), None
        text, detail = fault.find("faultstring"), fault.find("detail")
    if value is None:
        raise _bad("the SOAP Fault has no code")
    code = reader.qname(value)
    subcode = None if sub is None else reader.qname(sub)
    reason = "" if text is None else (text.text or "")
    rm_code = reader.fault_code
    for ns, local in [pair for pair in (subcode, code) if pair is not None]:
        if ns in RM_BY_NS and local in _FAULT_CODES:
            reader.see_rm(ns)
            rm_code = _FAULT_CODES[local]
    if rm_code is None:
        clark = "{%s}%s" % code
        return SoapFault(clark, None if subcode is None else "{%s}%s" % subcode, reason)
    identifier = None
    if detail is not None:
        for child in detail:
            if isinstance(child.tag, str) and _split(child.tag) == (reader.rm_ns, "Identifier"):
                identifier = _text(child) or None
    return SequenceFault(rm_code, identifier, reason)
