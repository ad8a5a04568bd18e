"""Shared by the WS-RM codec tests: Hypothesis strategies for envelopes, one example of every kind, schemas."""

from __future__ import annotations

import dataclasses
from functools import cache
from pathlib import Path

from hypothesis import strategies as st
from lxml import etree

from qtp.wsrm.codec import (
    COMBINATIONS,
    MISSING_SELECTION,
    SOAP_NS,
    UNSUPPORTED_SELECTION,
    Addressing,
    Envelope,
    MakeConnection,
    SoapFault,
    SoapVersion,
    Validator,
    WsaVersion,
    anonymous,
    default_action,
    mc_anonymous,
)
from qtp.wsrm.protocol import (
    FAULT_VERSIONS,
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

SCHEMA_DIR = Path(__file__).resolve().parent / "data" / "wsrm" / "xsd"
V10, V11 = RMVersion.WSRM10, RMVersion.WSRM11
S11, S12 = SoapVersion.SOAP11, SoapVersion.SOAP12
W04, W05 = WsaVersion.WSA200408, WsaVersion.WSA200508
APP_NS = "urn:example:orders"


@cache
def validator() -> Validator:
    return Validator.from_directory(SCHEMA_DIR)


def payload(text: str, number: int) -> bytes:
    element = etree.Element(f"{{{APP_NS}}}order", nsmap={"o": APP_NS}, id=str(number))
    etree.SubElement(element, f"{{{APP_NS}}}note").text = text or None
    return etree.tostring(element)


def finish(envelope: Envelope, message_id: str = "urn:uuid:m-1", to: str | None = "http://server/rm") -> Envelope:
    """Give an envelope the addressing a real message carries, with the Action its content requires."""
    assert envelope.wsa is not None
    action = "urn:example:orders/Submit" if envelope.payload is not None else default_action(envelope)
    reply_to = anonymous(envelope.wsa)
    return dataclasses.replace(envelope, addressing=Addressing(action=action, to=to, message_id=message_id,
                                                               reply_to=reply_to))


# ------------------------------------------------------------------------------------- strategies

identifiers = st.one_of(
    st.integers(0, 2**64).map(lambda n: f"urn:uuid:{n:016x}"),
    st.from_regex(r"http://[a-z]{1,10}\.example/[a-z0-9/]{0,20}", fullmatch=True),
)
addresses = st.from_regex(r"https?://[a-z]{1,12}(:[0-9]{2,4})?/[a-zA-Z0-9/_.-]{0,30}", fullmatch=True)
numbers = st.integers(1, MAX_MESSAGE_NUMBER)
durations = st.none() | st.integers(0, 10**11).map(lambda ms: ms / 1000)
batches = st.none() | st.integers(1, MAX_BATCH)  # qtp's batching extension
behaviors = st.none() | st.sampled_from(list(IncompleteSequenceBehavior))
texts = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), max_size=60)
polls = st.one_of(  # WS-MakeConnection: by address, by sequence, or both
    st.builds(MakeConnection, identifiers.map(mc_anonymous), st.none()),
    st.builds(MakeConnection, st.none(), identifiers),
    st.builds(MakeConnection, identifiers.map(mc_anonymous), identifiers),
)
selections = st.lists(st.tuples(st.sampled_from(["", "urn:vendor:x", "http://a.example/s?q=1&r=%3C2%3E"]),
                                st.from_regex(r"[A-Za-z_][A-Za-z0-9_.-]{0,15}", fullmatch=True)),
                      max_size=3).map(lambda names: tuple("{%s}%s" % name for name in names))


def receiver(soap: SoapVersion) -> str:
    """The code Receiver as the decoder reads it back in ``soap`` (SOAP 1.1 calls it Server)."""
    return f"{{{SOAP_NS[soap]}}}{'Receiver' if soap is SoapVersion.SOAP12 else 'Server'}"


def wsmc_fault(soap: SoapVersion, unsupported: tuple[str, ...] | None = None) -> SoapFault:
    """A WS-MakeConnection fault: MissingSelection, or UnsupportedSelection naming ``unsupported``."""
    if unsupported is None:
        return SoapFault(receiver(soap), MISSING_SELECTION, "The MakeConnection element has no selection")
    return SoapFault(receiver(soap), UNSUPPORTED_SELECTION, "This selection is not supported", unsupported)


@st.composite
def ack_ranges(draw: st.DrawFn) -> tuple[tuple[int, int], ...]:
    offset = draw(st.integers(0, MAX_MESSAGE_NUMBER - 500))
    values = draw(st.lists(st.integers(1, 500), min_size=1, max_size=30))
    return ranges.from_numbers(offset + v for v in values)


@st.composite
def acknowledgements(draw: st.DrawFn, rm: RMVersion) -> SequenceAcknowledgement:
    identifier = draw(identifiers)
    kinds = ["ranges", "nacks"] + (["none"] if rm is V11 else [])
    kind = draw(st.sampled_from(kinds))
    final = rm is V11 and kind != "nacks" and draw(st.booleans())
    if kind == "ranges":
        return SequenceAcknowledgement(identifier, ranges=draw(ack_ranges()), final=final)
    if kind == "none":
        return SequenceAcknowledgement(identifier, none=True, final=final)
    nacks = draw(st.lists(numbers, min_size=1, max_size=5, unique=True))
    return SequenceAcknowledgement(identifier, nacks=tuple(sorted(nacks)))


@st.composite
def bodies(draw: st.DrawFn, rm: RMVersion) -> object:
    v11 = rm is V11
    kinds = ["create", "created", "terminate", "fault"] + (["close", "closed", "terminated"] if v11 else [])
    kind = draw(st.sampled_from(kinds))
    identifier = draw(identifiers)
    if kind == "create":
        offer = draw(st.none() | st.builds(
            Offer, identifiers, addresses if v11 else st.none(), durations, behaviors if v11 else st.none()))
        return CreateSequence(draw(addresses), draw(durations), offer, draw(batches))
    if kind == "created":
        return CreateSequenceResponse(identifier, draw(durations), draw(behaviors) if v11 else None,
                                      draw(st.none() | addresses), draw(batches))
    if kind == "terminate":
        return TerminateSequence(identifier, draw(st.none() | numbers) if v11 else None)
    if kind == "close":
        return CloseSequence(identifier, draw(st.none() | numbers))
    if kind == "closed":
        return CloseSequenceResponse(identifier)
    if kind == "terminated":
        return TerminateSequenceResponse(identifier)
    code = draw(st.sampled_from([c for c in FaultCode if rm in FAULT_VERSIONS[c]]))
    return SequenceFault(code, draw(st.none() | identifiers), draw(texts))


@st.composite
def envelopes(draw: st.DrawFn) -> Envelope:
    rm, wsa = draw(st.sampled_from(COMBINATIONS))
    soap = draw(st.sampled_from(list(SoapVersion)))
    base = Envelope(soap=soap, rm=rm, wsa=wsa)
    acks = tuple(draw(st.lists(acknowledgements(rm), max_size=2)))
    requests = tuple(
        AckRequested(i, draw(st.none() | numbers) if rm is not V11 else None)
        for i in draw(st.lists(identifiers, max_size=2))
    )
    kinds = ["body", "application", "acks", "requests", "last"] + (["poll", "wsmc-fault"] if rm is V11 else [])
    kind = draw(st.sampled_from(kinds))
    if rm is V11:
        base = dataclasses.replace(base, message_pending=draw(st.none() | st.booleans()))
    if kind == "poll":
        envelope = dataclasses.replace(base, body=draw(polls), acks=acks)
    elif kind == "wsmc-fault":
        envelope = dataclasses.replace(base, body=wsmc_fault(soap, draw(st.none() | selections)))
    elif kind == "body":
        envelope = dataclasses.replace(base, body=draw(bodies(rm)), acks=acks)
    elif kind == "application":
        sequence = Sequence(draw(identifiers), draw(numbers))
        envelope = dataclasses.replace(base, sequence=sequence, acks=acks, ack_requests=requests,
                                       payload=payload(draw(texts), sequence.number))
    elif kind == "last" and rm is not V11:
        envelope = dataclasses.replace(base, sequence=Sequence(draw(identifiers), draw(numbers), True))
    elif kind == "requests" and requests:
        envelope = dataclasses.replace(base, ack_requests=requests, acks=acks)
    else:
        envelope = dataclasses.replace(base, acks=acks or (draw(acknowledgements(rm)),))
    return finish(envelope, message_id=f"urn:uuid:{draw(st.integers(0, 2**32)):08x}",
                  to=draw(st.none() | addresses))


# ------------------------------------------------------------------------------ one of every kind


def every_kind(rm: RMVersion) -> dict[str, object]:
    """Name -> body or header content: every WS-RM message and fault that exists in ``rm``."""
    v11 = rm is V11
    kinds: dict[str, object] = {
        "CreateSequence": CreateSequence("http://client/acks", 3600.0),
        "CreateSequence+Offer": CreateSequence(
            "http://client/acks", None,
            Offer("urn:uuid:offer", "http://client/replies" if v11 else None, 60.0,
                  IncompleteSequenceBehavior.DISCARD_FOLLOWING_FIRST_GAP if v11 else None)),
        "CreateSequenceResponse": CreateSequenceResponse(
            "urn:uuid:seq", 3600.0, IncompleteSequenceBehavior.NO_DISCARD if v11 else None),
        "CreateSequenceResponse+Accept": CreateSequenceResponse("urn:uuid:seq", None, None, "http://server/acks"),
        "CreateSequence+qtpBatch": CreateSequence("http://client/acks", None, None, batch=256),  # qtp extension
        "CreateSequenceResponse+qtpBatch": CreateSequenceResponse("urn:uuid:seq", batch=64),
        "TerminateSequence": TerminateSequence("urn:uuid:seq", 10 if v11 else None),
        "Sequence": Sequence("urn:uuid:seq", 1),
        "SequenceAcknowledgement": SequenceAcknowledgement("urn:uuid:seq", ((1, 4), (6, 6))),
        "SequenceAcknowledgement+Nack": SequenceAcknowledgement("urn:uuid:seq", nacks=(5, 7)),
        "AckRequested": AckRequested("urn:uuid:seq", None if v11 else 7),
    }
    if v11:
        kinds.update({
            "CloseSequence": CloseSequence("urn:uuid:seq", 10),
            "CloseSequenceResponse": CloseSequenceResponse("urn:uuid:seq"),
            "TerminateSequenceResponse": TerminateSequenceResponse("urn:uuid:seq"),
            "SequenceAcknowledgement+None+Final": SequenceAcknowledgement("urn:uuid:seq", none=True, final=True),
            "SequenceAcknowledgement+Final": SequenceAcknowledgement("urn:uuid:seq", ((1, 10),), final=True),
        })
    else:
        kinds["LastMessage"] = Sequence("urn:uuid:seq", 11, last_message=True)
    for code in FaultCode:
        if rm in FAULT_VERSIONS[code]:
            kinds[f"fault:{code.value}"] = SequenceFault(code, "urn:uuid:seq", f"{code.value} happened")
    return kinds


def envelope_of(content: object, soap: SoapVersion, rm: RMVersion, wsa: object) -> Envelope:
    base = Envelope(soap=soap, rm=rm, wsa=wsa)  # type: ignore[arg-type]
    if isinstance(content, Sequence):
        data = None if content.last_message else payload("hello", content.number)
        envelope = dataclasses.replace(base, sequence=content, payload=data)
    elif isinstance(content, SequenceAcknowledgement):
        envelope = dataclasses.replace(base, acks=(content,))
    elif isinstance(content, AckRequested):
        envelope = dataclasses.replace(base, ack_requests=(content,))
    else:
        envelope = dataclasses.replace(base, body=content)
    return finish(envelope)


def matrix() -> list[tuple[str, SoapVersion, RMVersion, object]]:
    return [
        (name, soap, rm, wsa)
        for rm, wsa in COMBINATIONS
        for soap in SoapVersion
        for name in every_kind(rm)
    ]
