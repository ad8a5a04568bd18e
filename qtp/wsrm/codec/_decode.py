"""bytes -> Envelope. Hardened and tolerant.

Hardened: input above ``max_bytes`` is refused before parsing; any DTD is refused (so no entity expansion,
no billion laughs, no external entities); the parser never touches the network; libxml2's own limits stop
documents deeper than 256 levels and qtp refuses deeper than ``max_depth``; a document of more than
``max_elements`` elements is refused while it is parsed, before its tree (about 130 bytes an element)
grows past that. Every failure becomes an ``InvalidMessage`` carrying the wire fault code to answer with.

Tolerant: blanks around numbers and identifiers, unknown extension elements and attributes (the schemas'
``xs:any ##other``), comments, unmerged or unsorted acknowledgement ranges, and either WS-Addressing
version are all accepted. Unknown headers are ignored unless they carry mustUnderstand.

Answers (``decode(data, answer=True)``, what a peer returns on the HTTP response to our POST or poll) are
read like requests, with one exception: a Sequence header that breaks the schema (a MessageNumber of 0, as
gSOAP writes on an empty-body answer, docs/interop.md D17) on an envelope whose Body is empty is left out
and named in ``Envelope.ignored``, so that the acknowledgements next to it still count. A request with such
a header, or an answer that carries a message or a protocol body, is refused as before.

WS-MakeConnection 1.1 (MakeConnection, MessagePending, its two faults) belongs to the WS-RM 1.1 family: a
message using it is read as WS-RM 1.1 even when it holds no WS-RM element, and refused with WS-RM 1.0 or
WS-Addressing 2004/08, as the encoder refuses to write it.

Speed (benchmarks/wsrm_codec.py): every element name is compared as a precomputed ``{namespace}local``
string, header blocks are dispatched by that name through a dict, children are looked up with lxml's
C-level tag filter, and the acknowledgement ranges' attributes are read by compiled XPath expressions,
so that no Python object is made for a range element unless the message is malformed.
"""

from __future__ import annotations

import functools
import operator
import re
import sys
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from lxml import etree

from qtp.wsrm.codec._envelope import Addressing, Envelope, InvalidMessage, MakeConnection, SoapFault
from qtp.wsrm.codec._names import (
    QTP_NS,
    RM_BY_NS,
    RM_NS,
    SOAP_BY_NS,
    SOAP_NS,
    UNSUPPORTED_SELECTION,
    WSA_BY_NS,
    WSMC_NS,
    WSMC_SUBCODES,
    SoapVersion,
    WsaVersion,
)
from qtp.wsrm.protocol import (
    MAX_BATCH,
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
DEFAULT_MAX_ELEMENTS = 100_000

_PARSER_OPTIONS = dict(resolve_entities=False, no_network=True, load_dtd=False, dtd_validation=False,
                       huge_tree=False, collect_ids=False)
_PARSER = etree.XMLParser(**_PARSER_OPTIONS)
_DECLARED_ENCODING = re.compile(rb"encoding\s*=\s*[\"']([A-Za-z0-9._-]*)[\"']")
# encodings in which '<' is the byte 0x3C and no other character holds that byte
_ASCII_SAFE = {b"utf-8", b"utf8", b"us-ascii", b"ascii", b"iso-8859-1", b"latin1"}
_DIGITS = re.compile(r"\+?[0-9]{1,25}")
_DIGIT_LIST = re.compile(r"(?:\s*\+?[0-9]{1,25}\s*,)*")
_DURATION = re.compile(
    r"P(?:(\d+)Y)?(?:(\d+)M)?(?:(\d+)D)?(?:T(?:(\d+)H)?(?:(\d+)M)?(?:(\d+(?:\.\d+)?)S)?)?"
)
_FAULT_CODES = {code.value: code for code in FaultCode}
_TRUE = {"1", "true"}
_BOOLEAN = {"1": True, "true": True, "0": False, "false": False}  # xs:boolean
SENDER = "Sender"

_ENVELOPE = {f"{{{ns}}}Envelope": version for ns, version in SOAP_BY_NS.items()}
_HEADER = {version: f"{{{ns}}}Header" for version, ns in SOAP_NS.items()}
_BODY_TAG = {version: f"{{{ns}}}Body" for version, ns in SOAP_NS.items()}
_FAULT = {version: f"{{{ns}}}Fault" for version, ns in SOAP_NS.items()}
_MUST_UNDERSTAND = {version: f"{{{ns}}}mustUnderstand" for version, ns in SOAP_NS.items()}
_UTF8 = {"UTF-8", "utf-8"}

_WSA_TEXT = {"To": "to", "Action": "action", "MessageID": "message_id", "RelatesTo": "relates_to"}
_WSA_EPR = {"ReplyTo": "reply_to", "From": "from_", "FaultTo": "fault_to"}
# {ns}local of every addressing header qtp reads -> (Addressing field, local name if an EPR, version)
_WSA_HEADERS = {
    f"{{{ns}}}{local}": (field, local if local in _WSA_EPR else None, version)
    for ns, version in WSA_BY_NS.items()
    for local, field in (_WSA_TEXT | _WSA_EPR).items()
}
_WSA_ADDRESS = {f"{{{ns}}}Address": version for ns, version in WSA_BY_NS.items()}

_RM_LOCALS = (
    "Identifier", "MessageNumber", "LastMessage", "AcknowledgementRange", "Nack", "None", "Final",
    "MaxMessageNumberUsed", "FaultCode", "AcksTo", "Offer", "Endpoint", "Expires", "IncompleteSequenceBehavior",
    "Accept", "LastMsgNumber",
)
_RM_TAGS = {version: {local: f"{{{ns}}}{local}" for local in _RM_LOCALS} for version, ns in RM_NS.items()}


def _range_xpaths(ns: str) -> tuple[etree.XPath, etree.XPath, etree.XPath]:
    """The Lower attributes, the Upper attributes and the number of a SequenceAcknowledgement's ranges."""
    lowers, uppers, count = (
        etree.XPath(expression, namespaces={"rm": ns}, smart_strings=False)
        for expression in ("rm:AcknowledgementRange/@Lower", "rm:AcknowledgementRange/@Upper",
                           "count(rm:AcknowledgementRange)")
    )
    return lowers, uppers, count


# {ns}AcknowledgementRange -> _range_xpaths(ns)
_RANGE_XPATHS = {f"{{{ns}}}AcknowledgementRange": _range_xpaths(ns) for ns in RM_BY_NS}


@functools.lru_cache(maxsize=8)
def _deeper_than(max_depth: int) -> etree.XPath:
    """A compiled XPath that is true when some element sits below ``max_depth`` levels."""
    return etree.XPath("boolean(" + "/*" * (max_depth + 1) + ")")


MAX_IDENTIFIER = 255  # sequence Identifiers, MessageID, RelatesTo: what the store's key columns hold
MAX_ADDRESS = 2048    # an endpoint reference's Address
MAX_ACTION = 1024     # the store's action column
MAX_UNSUPPORTED = 16  # distinct unsupported WS-MC selections kept (and echoed in the fault) per MakeConnection


def _split(tag: str) -> tuple[str, str]:
    if tag[:1] == "{":
        ns, _, local = tag[1:].partition("}")
        return ns, local
    return "", tag


def _text(element: Any) -> str:
    return (element.text or "").strip()


def _bad(reason: str, code: str = SENDER) -> InvalidMessage:
    return InvalidMessage(code, reason)


def _address(element: Any, what: str) -> str:
    """The text of an Address element (perhaps empty), refused above MAX_ADDRESS characters or when it does
    not parse as a URI with a usable port (two ports, a port out of range or not in ASCII digits, an
    unclosed IPv6 literal): nothing could be sent there, and nothing after the decoder must trip on it."""
    value = _text(element)
    if len(value) > MAX_ADDRESS:
        raise _bad(f"{what} has an Address of {len(value)} characters; at most {MAX_ADDRESS}")
    try:
        urlsplit(value).port
    except ValueError as exc:
        raise _bad(f"{what} has an Address that is not a usable URI ({exc}): {value[:200]!r}") from None
    return value


def _identifier(element: Any, parent: Any) -> str:
    """The text of ``element``, ``parent``'s Identifier, which must be present and not empty."""
    if element is None:
        raise _bad(f"{_split(parent.tag)[1]} lacks its Identifier")
    value = _text(element)
    if not value:
        raise _bad(f"{_split(parent.tag)[1]} has an empty Identifier")
    if len(value) > MAX_IDENTIFIER:
        raise _bad(f"{_split(parent.tag)[1]} has an Identifier of {len(value)} characters; at most {MAX_IDENTIFIER}")
    return value


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
    """One decode call: the versions the message used, and the headers read so far."""

    __slots__ = ("soap", "rm", "tags", "wsa", "fault_code", "addressing", "sequence", "acks", "ack_requests", "wsmc",
                 "message_pending", "answer", "bad_sequence")

    def __init__(self, soap: SoapVersion, answer: bool = False):
        self.soap = soap
        self.answer = answer  # an answer to our request: a broken Sequence header may be set aside
        self.bad_sequence: InvalidMessage | None = None
        self.rm: RMVersion | None = None
        self.tags: dict[str, str] = {}
        self.wsa: WsaVersion | None = None
        self.fault_code: FaultCode | None = None
        self.addressing: dict[str, str] = {}
        self.sequence: Sequence | None = None
        self.acks: list[SequenceAcknowledgement] = []
        self.ack_requests: list[AckRequested] = []
        self.wsmc = False
        self.message_pending: bool | None = None

    def see_rm(self, version: RMVersion) -> None:
        if self.rm is not version:
            if self.rm is not None:
                raise _bad("the message mixes WS-RM 1.0 and WS-RM 1.1 elements")
            self.rm, self.tags = version, _RM_TAGS[version]

    def see_wsmc(self) -> None:
        """A WS-MakeConnection element: the message is WS-RM 1.1 (see the module's docstring)."""
        if self.rm is RMVersion.WSRM10:
            raise _bad("WS-MakeConnection 1.1 goes with WS-RM 1.1, not WS-RM 1.0")
        self.see_rm(RMVersion.WSRM11)
        self.wsmc = True

    def see_wsa(self, version: WsaVersion) -> None:
        if self.wsa is not version:
            if self.wsa is not None:
                raise _bad("the message mixes two WS-Addressing versions")
            self.wsa = version

    def child(self, parent: Any, local: str, required: bool = True) -> Any:
        element = next(parent.iterchildren(self.tags[local]), None)
        if element is None and required:
            raise _bad(f"{_split(parent.tag)[1]} lacks its {local}")
        return element

    def identifier(self, parent: Any) -> str:
        return _identifier(self.child(parent, "Identifier", required=False), parent)

    def number(self, text: str, what: str) -> int:
        text = text.strip()
        if text.isdigit() and text.isascii() and len(text) <= 18 and text.strip("0"):
            return int(text)  # plain digits, at least 1 and below MAX_MESSAGE_NUMBER (19 digits)
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
            version = _WSA_ADDRESS.get(child.tag)
            if version is not None:
                self.see_wsa(version)
                value = _address(child, what)
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


def decode(data: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES, max_depth: int = DEFAULT_MAX_DEPTH,
           max_elements: int = DEFAULT_MAX_ELEMENTS, answer: bool = False) -> Envelope:
    """Parse one SOAP envelope. Raises InvalidMessage (a WsrmFault with the wire code) for bad input.

    ``answer``: the envelope came back on the HTTP response to our request (or poll); an invalid Sequence
    header on one with an empty Body is then set aside (``Envelope.ignored``) instead of refusing it all."""
    if not isinstance(data, (bytes, bytearray)):
        raise TypeError(f"decode takes bytes, not {type(data).__name__}")
    if len(data) > max_bytes:
        raise _bad(f"the envelope has {len(data)} bytes, more than the limit of {max_bytes}")
    if b"<!DOCTYPE" in data:  # entities can only be declared inside one; other encodings: docinfo below
        raise _bad("DTDs and entity declarations are not accepted")
    if type(data) is not bytes:
        data = bytes(data)
    try:
        root = etree.fromstring(data, _PARSER) if most_elements(data) <= max_elements else _counted(data, max_elements)
    except etree.XMLSyntaxError as exc:  # the parser's words (its options, positions) are for the log only
        if "Excessive depth" in str(exc):  # libxml2's own bound, 256, past ours
            raise _bad(f"the envelope is nested deeper than {min(max_depth, 256)} elements") from exc
        raise _bad("the envelope is not well-formed XML") from exc
    docinfo = root.getroottree().docinfo
    if docinfo.doctype:
        raise _bad("DTDs are not accepted")
    if not _shallow(data, docinfo.encoding, max_depth) and _deeper_than(max_depth)(root):
        raise _bad(f"the envelope is nested deeper than {max_depth} elements")
    soap = _ENVELOPE.get(root.tag)
    if soap is None:
        code = "VersionMismatch" if _split(root.tag)[1] == "Envelope" else SENDER
        raise _bad(f"the document is not a SOAP 1.1 or 1.2 Envelope: {root.tag[:80]}", code)
    try:
        return _envelope(_Reader(soap, answer), root)
    except ValueError as exc:  # a value the message classes refuse (an Expires of a million years, ...)
        raise _bad(f"invalid value: {exc}") from exc


def most_elements(data: bytes) -> int:
    """At least the number of elements in ``data``, read from its bytes without parsing (a very large
    number when the bytes cannot tell).

    Every element has one start tag, whose '<' is the byte 0x3C in a document that starts with that byte and
    is UTF-8 or ASCII (or UTF-16LE / UCS-4LE, whose first bytes libxml2 reads as such, where '<' is a 0x3C
    byte too); an end tag's '<' is followed by '/'. Each count is one pass at memory speed.
    """
    if data[:1] != b"<":
        return sys.maxsize
    if data[:5] == b"<?xml":
        end = data.find(b"?>", 0, 1024)
        declared = _DECLARED_ENCODING.search(data, 0, end)
        if end < 0 or (declared is not None and declared.group(1).lower() not in _ASCII_SAFE):
            return sys.maxsize
    return data.count(b"<") - data.count(b"</")


class _TooMany(Exception):
    pass


class _Counter:
    """A parser target that counts start tags and stops the parse past ``limit``: it builds no tree."""

    def __init__(self, limit: int):
        self.limit, self.seen = limit, 0

    def start(self, tag: str, attrib: Any, nsmap: Any = None) -> None:
        self.seen += 1
        if self.seen > self.limit:
            raise _TooMany

    def close(self) -> int:
        return self.seen


def _counted(data: bytes, max_elements: int) -> Any:
    """``data`` parsed once to count its elements without building anything (refused past ``max_elements``),
    then into a tree. Only for documents whose bytes could not rule out more than ``max_elements``."""
    try:
        etree.fromstring(data, etree.XMLParser(target=_Counter(max_elements), **_PARSER_OPTIONS))
    except _TooMany:
        raise _bad(f"the envelope has more than {max_elements} elements") from None
    return etree.fromstring(data, _PARSER)


def _shallow(data: bytes, encoding: str | None, max_depth: int) -> bool:
    """True when ``data`` holds too few elements for any to be deeper than ``max_depth``.

    Every element has a start tag, whose '<' is the byte 0x3C in a document that starts with that byte
    and declares UTF-8 or no encoding (libxml2 then reads it as UTF-8, or as the UTF-16LE / UCS-4LE its
    first bytes announce, where '<' is a 0x3C byte too). Counting one byte is cheaper than the XPath.
    """
    return data[:1] == b"<" and encoding in _UTF8 and data.count(b"<") <= max_depth


def _envelope(reader: _Reader, root: Any) -> Envelope:
    header_tag, body_tag = _HEADER[reader.soap], _BODY_TAG[reader.soap]
    header = body = None
    for child in root:
        tag = child.tag
        if tag == header_tag and header is None and body is None:
            header = child
        elif tag == body_tag and body is None:
            body = child
        elif isinstance(tag, str):
            raise _bad(f"unexpected {tag[:80]} in the Envelope")
    if body is None:
        raise _bad("the Envelope has no Body")
    if header is not None:
        _header(reader, header)
    content, payload = _body(reader, body)
    ignored: tuple[str, ...] = ()
    if reader.bad_sequence is not None:
        if content is not None or payload is not None:  # a message or a protocol body needs a sound header
            raise reader.bad_sequence
        ignored = (f"Sequence: {reader.bad_sequence}",)
    for key in ("message_id", "relates_to"):
        value = reader.addressing.get(key)
        if value is not None and len(value) > MAX_IDENTIFIER:
            raise _bad(f"the {key.replace('_', ' ')} has {len(value)} characters; at most {MAX_IDENTIFIER}")
    if len(reader.addressing.get("action") or "") > MAX_ACTION:
        raise _bad(f"the Action has more than {MAX_ACTION} characters")
    if reader.wsmc and reader.wsa is WsaVersion.WSA200408:
        raise _bad("WS-MakeConnection 1.1 goes with WS-Addressing 2005/08, not 2004/08")
    return Envelope(reader.soap, reader.rm, reader.wsa, Addressing(**reader.addressing), reader.sequence,
                    tuple(reader.acks), tuple(reader.ack_requests), content, payload, reader.message_pending,
                    ignored)


def _header(reader: _Reader, header: Any) -> None:
    must_understand = _MUST_UNDERSTAND[reader.soap]
    for block in header:
        tag = block.tag
        addressing = _WSA_HEADERS.get(tag)
        if addressing is not None:
            field, epr, version = addressing
            reader.see_wsa(version)
            reader.addressing[field] = _text(block) if epr is None else reader.address(block, epr)
            continue
        rm_header = _RM_HEADERS.get(tag)
        if rm_header is not None:
            read, version = rm_header
            reader.see_rm(version)
            read(reader, block)
        elif tag == _MESSAGE_PENDING:
            _message_pending(reader, block)
        elif isinstance(tag, str) and (block.get(must_understand) or "").strip() in _TRUE:
            raise _bad(f"header {tag[:80]} is not understood", "MustUnderstand")


_MESSAGE_PENDING = f"{{{WSMC_NS}}}MessagePending"


def _message_pending(reader: _Reader, block: Any) -> None:
    """WS-MC MessagePending; without its (optional) pending attribute it announces nothing: False."""
    if reader.message_pending is not None:
        raise _bad("more than one MessagePending header")
    reader.see_wsmc()
    text = block.get("pending")
    pending = False if text is None else _BOOLEAN.get(text.strip())
    if pending is None:
        raise _bad(f"MessagePending's pending is not a boolean: {text[:40]!r}")
    reader.message_pending = pending


def _sequence(reader: _Reader, block: Any) -> None:
    if reader.sequence is not None or reader.bad_sequence is not None:
        raise _bad("more than one Sequence header")
    if not reader.answer:
        _read_sequence(reader, block)
        return
    try:
        _read_sequence(reader, block)
    except InvalidMessage as exc:  # decided once the Body is known (see _envelope)
        reader.bad_sequence = exc
    except ValueError as exc:
        reader.bad_sequence = _bad(f"invalid value: {exc}")


def _read_sequence(reader: _Reader, block: Any) -> None:
    tags = reader.tags
    children: dict[Any, Any] = {}
    for child in block:
        children.setdefault(child.tag, child)
    number_element = children.get(tags["MessageNumber"])
    if number_element is None:
        raise _bad("Sequence lacks its MessageNumber")
    number = reader.number(_text(number_element), "MessageNumber")
    last = tags["LastMessage"] in children
    if last and reader.rm is RMVersion.WSRM11:
        raise _bad("LastMessage does not exist in WS-RM 1.1")
    reader.sequence = Sequence(_identifier(children.get(tags["Identifier"]), block), number, last)


_LOWER = operator.methodcaller("get", "Lower", "")
_UPPER = operator.methodcaller("get", "Upper", "")


def _range_texts(reader: _Reader, block: Any) -> tuple[list[str], list[str], int]:
    """The Lower and Upper attributes of the AcknowledgementRange children, in document order (a range
    lacking one of them gets '', refused as a number by the caller), and the number of those children."""
    tag = reader.tags["AcknowledgementRange"]
    lowers_of, uppers_of, count_of = _RANGE_XPATHS[tag]
    lowers, uppers, count = lowers_of(block), uppers_of(block), int(count_of(block))
    if len(lowers) == len(uppers) == count:
        return lowers, uppers, count
    found = list(block.iterchildren(tag))
    return list(map(_LOWER, found)), list(map(_UPPER, found)), count


def _acknowledgement(reader: _Reader, block: Any) -> None:
    invalid = FaultCode.INVALID_ACKNOWLEDGEMENT.value
    tags = reader.tags
    lower_texts, upper_texts, count = _range_texts(reader, block)
    pairs: tuple[tuple[int, int], ...] = ()
    if lower_texts:
        lowers = reader.numbers(lower_texts, "AcknowledgementRange Lower")
        uppers = reader.numbers(upper_texts, "AcknowledgementRange Upper")
        pairs = tuple(zip(lowers, uppers))
    first = block[0] if len(block) == count + 1 else None
    if first is not None and first.tag == tags["Identifier"]:  # the usual form: Identifier, then ranges
        nacks: list[int] = []
        none = final = False
        identifier = _identifier(first, block)
    else:
        nacks = reader.numbers([_text(e) for e in block.iterchildren(tags["Nack"])], "Nack")
        none = next(block.iterchildren(tags["None"]), None) is not None
        final = next(block.iterchildren(tags["Final"]), None) is not None
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
    reader.acks.append(ack)


def _ack_requested(reader: _Reader, block: Any) -> None:
    used = reader.optional_number(block, "MaxMessageNumberUsed")
    reader.ack_requests.append(AckRequested(reader.identifier(block), used))


def _sequence_fault(reader: _Reader, block: Any) -> None:
    ns, local = reader.qname(reader.child(block, "FaultCode"))
    if RM_BY_NS.get(ns) is reader.rm and local in _FAULT_CODES:
        reader.fault_code = _FAULT_CODES[local]


_RM_HEADER_READERS: dict[str, Callable[[_Reader, Any], None]] = {
    "Sequence": _sequence,
    "SequenceAcknowledgement": _acknowledgement,
    "AckRequested": _ack_requested,
    "SequenceFault": _sequence_fault,
}
_RM_HEADERS = {
    f"{{{ns}}}{local}": (read, version)
    for ns, version in RM_BY_NS.items()
    for local, read in _RM_HEADER_READERS.items()
}


def _body(reader: _Reader, body: Any) -> tuple[Any, bytes | None]:
    elements = [child for child in body if isinstance(child.tag, str)]
    if not elements:
        return None, None
    if len(elements) > 1:
        raise _bad("the Body holds more than one element")
    element = elements[0]
    if element.tag == _FAULT[reader.soap]:
        return _fault(reader, element), None
    ns, local = _split(element.tag)
    version = RM_BY_NS.get(ns)
    if version is not None:
        reader.see_rm(version)
        read = _BODIES.get(local)
        if read is None:
            raise _bad(f"unsupported WS-RM body element {local[:40]}")
        return read(reader, element), None
    if ns == WSMC_NS:
        if local != "MakeConnection":
            raise _bad(f"unsupported WS-MakeConnection body element {local[:40]}")
        reader.see_wsmc()
        return _make_connection(reader, element), None
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
    return CreateSequence(acks_to, reader.expires(element), offer, _batch(element))


def _create_sequence_response(reader: _Reader, element: Any) -> CreateSequenceResponse:
    accept = reader.child(element, "Accept", required=False)
    acks_to = None if accept is None else reader.address(reader.child(accept, "AcksTo"), "Accept/AcksTo")
    return CreateSequenceResponse(reader.identifier(element), reader.expires(element),
                                  reader.behavior(element), acks_to, _batch(element))


_BATCH_TAG = f"{{{QTP_NS}}}Batch"


def _batch(element: Any) -> int | None:
    """qtp's batching extension; a value that is not a sensible count is ignored (the peer then gets
    standard one-message requests), never an error."""
    found = next(element.iterchildren(_BATCH_TAG), None)
    text = "" if found is None else (found.get("max") or "").strip()
    if not text.isdigit() or len(text) > 6:
        return None
    return min(int(text), MAX_BATCH) or None


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


_MC_ADDRESS = f"{{{WSMC_NS}}}Address"


def _make_connection(reader: _Reader, element: Any) -> MakeConnection:
    """The WS-MC schema's Address, and a WS-RM 1.1 Identifier as the sequence selection (an extension element
    there), at most once each and in any order; every other child element is a selection qtp does not support.

    The WS-MC schema lets the Address and extension selections stand together (Sandesha2 sends a
    wsrm:Identifier with the Address; the WS-I Reliable Secure Profile forbids the Identifier, which Metro
    answers with UnsupportedSelection), so both are read and the runtime decides. A poll with no selection
    decodes to ``MakeConnection(None, None)``, which the runtime answers with a MissingSelection fault."""
    identifier_tag = reader.tags["Identifier"]
    address = identifier = None
    unsupported: dict[str, None] = {}
    for child in element.iterchildren(tag=etree.Element):
        if child.tag == _MC_ADDRESS:
            if address is not None:
                raise _bad("MakeConnection has more than one Address")
            address = _address(child, "MakeConnection")
            if not address:
                raise _bad("MakeConnection has an empty Address")
        elif child.tag == identifier_tag:
            if identifier is not None:
                raise _bad("MakeConnection has more than one Identifier")
            identifier = _identifier(child, element)
        elif len(unsupported) < MAX_UNSUPPORTED:
            unsupported["{%s}%s" % _split(child.tag)] = None
    return MakeConnection(address, identifier, tuple(unsupported))


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
            reader.see_rm(RM_BY_NS[ns])
            rm_code = _FAULT_CODES[local]
    if rm_code is None:
        return _soap_fault(reader, code, subcode, reason, detail)
    identifier = None
    if detail is not None:
        for child in detail:
            if child.tag == reader.tags["Identifier"]:
                identifier = _text(child) or None
    return SequenceFault(rm_code, identifier, reason)


def _soap_fault(reader: _Reader, code: tuple[str, str], subcode: tuple[str, str] | None, reason: str,
                detail: Any) -> SoapFault:
    """A fault that is not WS-RM's. A WS-MC fault in SOAP 1.1 has its subcode as the faultcode; it is read back
    as the code Server with that subcode, the code WS-MakeConnection 1.1 gives both of its faults."""
    if reader.soap is SoapVersion.SOAP11 and "{%s}%s" % code in WSMC_SUBCODES:
        code, subcode = (SOAP_NS[SoapVersion.SOAP11], "Server"), code
    clark_subcode = None if subcode is None else "{%s}%s" % subcode
    if clark_subcode not in WSMC_SUBCODES:
        return SoapFault("{%s}%s" % code, clark_subcode, reason)
    reader.see_wsmc()
    unsupported = () if detail is None or clark_subcode != UNSUPPORTED_SELECTION else _unsupported(detail)
    return SoapFault("{%s}%s" % code, clark_subcode, reason, unsupported)


def _unsupported(detail: Any) -> tuple[str, ...]:
    """The QNames of an UnsupportedSelection fault's Detail as {namespace}local names (Metro writes them in
    that form already); an entry whose prefix is not declared is skipped."""
    names = []
    for entry in detail.iterchildren(UNSUPPORTED_SELECTION):
        text = _text(entry)
        if text.startswith("{"):
            names.append(text)
            continue
        prefix, _, local = text.rpartition(":")
        namespace = entry.nsmap.get(prefix or None)
        if namespace is not None or not prefix:
            names.append("{%s}%s" % (namespace or "", local))
    return tuple(names)
