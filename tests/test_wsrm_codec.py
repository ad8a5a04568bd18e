"""The codec: round trips, schema conformance of everything qtp emits, strictness, tolerance."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from lxml import etree
from wsrm_support import envelope_of, envelopes, every_kind, finish, matrix, payload, validator

from qtp.errors import WsrmFault
from qtp.wsrm.codec import (
    Addressing,
    CheckedPayload,
    EncodingError,
    Envelope,
    InvalidMessage,
    SoapFault,
    SoapVersion,
    WsaVersion,
    decode,
    encode,
    format_duration,
    parse_duration,
)
from qtp.wsrm.protocol import (
    AckRequested,
    CloseSequence,
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

V10, V11 = RMVersion.WSRM10, RMVersion.WSRM11
S11, S12 = SoapVersion.SOAP11, SoapVersion.SOAP12
W04, W05 = WsaVersion.WSA200408, WsaVersion.WSA200508
MATRIX = matrix()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(envelopes())
def test_decode_of_encode_is_identity(envelope: Envelope) -> None:
    assert decode(encode(envelope)) == envelope


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(envelopes())
def test_generated_envelopes_validate_against_the_official_schemas(envelope: Envelope) -> None:
    assert envelope.rm is not None and envelope.wsa is not None
    assert validator().errors(encode(envelope), envelope.rm, envelope.wsa) == []


@pytest.mark.parametrize(("name", "soap", "rm", "wsa"), MATRIX, ids=[f"{n}-soap{s.value}-rm{r.value}-wsa{w.value}"
                                                                     for n, s, r, w in MATRIX])
def test_every_message_and_fault_in_every_version_validates(name: str, soap: SoapVersion, rm: RMVersion,
                                                            wsa: WsaVersion) -> None:
    envelope = envelope_of(every_kind(rm)[name], soap, rm, wsa)
    data = encode(envelope)
    assert validator().errors(data, rm, wsa) == []
    assert decode(data) == envelope


def test_the_matrix_covers_every_message_and_fault() -> None:
    names = {name for name, _, _, _ in MATRIX}
    assert {f"fault:{code.value}" for code in FaultCode} <= names
    for message in ("CreateSequence+Offer", "CreateSequenceResponse+Accept", "Sequence", "AckRequested",
                    "SequenceAcknowledgement", "CloseSequence", "CloseSequenceResponse", "TerminateSequence",
                    "TerminateSequenceResponse", "LastMessage"):
        assert message in names
    assert len({(s, r, w) for _, s, r, w in MATRIX}) == 6


def test_the_validator_rejects_what_the_schemas_forbid() -> None:
    data = encode(envelope_of(Sequence("urn:uuid:seq", 1), S12, V11, W05))
    broken = data.replace(b"<wsrm:MessageNumber>1<", b"<wsrm:MessageNumber>0<")
    assert any("MessageNumber" in error for error in validator().errors(broken, V11, W05))
    addressing = encode(envelope_of(CreateSequence("http://client/acks"), S11, V10, W04))
    wrong = addressing.replace(b"<wsa:Address>http://client/acks</wsa:Address>", b"")
    assert validator().errors(wrong, V10, W04) != []


def test_sequence_header_is_must_understand_in_both_soap_versions() -> None:
    for soap, value in ((S11, "1"), (S12, "true")):
        root = etree.fromstring(encode(envelope_of(Sequence("urn:uuid:seq", 4), soap, V11, W05)))
        sequence = root.find(".//{http://docs.oasis-open.org/ws-rx/wsrm/200702}Sequence")
        assert sequence.get(f"{{{root.nsmap['S']}}}mustUnderstand") == value


def test_acknowledgement_piggy_backs_on_an_application_message() -> None:
    ack = SequenceAcknowledgement("urn:uuid:other", ((1, 9),))
    envelope = finish(Envelope(soap=S12, rm=V10, wsa=W05, sequence=Sequence("urn:uuid:seq", 2),
                               acks=(ack,), ack_requests=(AckRequested("urn:uuid:seq", 2),),
                               payload=payload("x", 2)))
    decoded = decode(encode(envelope))
    assert decoded.acks == (ack,) and decoded.payload == payload("x", 2)
    assert decoded.addressing.action == "urn:example:orders/Submit"


def test_faults_carry_their_wire_codes() -> None:
    for soap in SoapVersion:
        fault = SequenceFault(FaultCode.SEQUENCE_CLOSED, "urn:uuid:seq", "closed")
        data = encode(envelope_of(fault, soap, V11, W05))
        if soap is S12:
            assert b"<S:Value>wsrm:SequenceClosed</S:Value>" in data and b"S:Sender" in data
        else:
            assert b"<wsrm:FaultCode>wsrm:SequenceClosed</wsrm:FaultCode>" in data and b"S:Client" in data
        assert decode(data).body == fault


@pytest.mark.parametrize(
    ("envelope", "message"),
    [
        (Envelope(S12, V10, W04, body=CloseSequence("urn:uuid:s")), "1.1 only"),
        (Envelope(S12, V10, W04, body=TerminateSequenceResponse("urn:uuid:s")), "1.1 only"),
        (Envelope(S12, V10, W04, body=TerminateSequence("urn:uuid:s", 3)), "1.1 only"),
        (Envelope(S12, V11, W05, sequence=Sequence("urn:uuid:s", 1, True)), "no LastMessage"),
        (Envelope(S12, V10, W04, acks=(SequenceAcknowledgement("urn:uuid:s", none=True),)), "no None or Final"),
        (Envelope(S12, V11, W05, ack_requests=(AckRequested("urn:uuid:s", 4),)), "MaxMessageNumberUsed"),
        (Envelope(S12, V11, W05, body=CreateSequence("http://a", offer=Offer("urn:uuid:o"))), "needs its Endpoint"),
        (Envelope(S12, V10, W05, body=CreateSequenceResponse(
            "urn:uuid:s", incomplete_behavior=IncompleteSequenceBehavior.NO_DISCARD)), "IncompleteSequence"),
        (Envelope(S12, V10, W04, body=SequenceFault(FaultCode.SEQUENCE_CLOSED)), "does not exist in WS-RM"),
        (Envelope(S12, V11, W05, body=SequenceFault(FaultCode.LAST_MESSAGE_NUMBER_EXCEEDED)), "does not exist"),
        (Envelope(S12, V11, W04, body=CloseSequence("urn:uuid:s")), "not used with"),
    ],
)
def test_strict_when_emitting(envelope: Envelope, message: str) -> None:
    envelope = dataclasses.replace(envelope, addressing=Addressing(action="urn:x"))
    with pytest.raises(EncodingError, match=message):
        encode(envelope)


def test_emitting_requires_an_action_and_a_wellformed_payload() -> None:
    with pytest.raises(EncodingError, match="Action"):
        encode(Envelope(S12, V11, W05, body=CloseSequence("urn:uuid:s")))
    bad = Envelope(S12, V11, W05, addressing=Addressing(action="urn:x"), payload=b"<a><b></a>")
    with pytest.raises(EncodingError, match="well-formed"):
        encode(bad)
    with pytest.raises(ValueError):
        Sequence("urn:uuid:s", 0)
    with pytest.raises(ValueError):
        SequenceAcknowledgement("urn:uuid:s", ((1, 3), (4, 5)))  # adjacent: must be merged


TOLERANT = b"""<?xml version="1.0"?>
<soap:Envelope xmlns:soap="http://www.w3.org/2003/05/soap-envelope"
    xmlns:a="http://www.w3.org/2005/08/addressing" xmlns:rm="http://docs.oasis-open.org/ws-rx/wsrm/200702"
    xmlns:ext="urn:vendor:extension">
  <!-- a comment -->
  <soap:Header>
    <a:Action> http://docs.oasis-open.org/ws-rx/wsrm/200702/SequenceAcknowledgement </a:Action>
    <ext:Trace ext:level="3">ignored, not mustUnderstand</ext:Trace>
    <rm:SequenceAcknowledgement ext:attr="x">
      <rm:Identifier>
          urn:uuid:seq
      </rm:Identifier>
      <rm:AcknowledgementRange Upper=" 9 " Lower="7" ext:weight="1"/>
      <rm:AcknowledgementRange Upper="3" Lower=" 1"/>
      <rm:AcknowledgementRange Upper="6" Lower="2"/>
      <ext:Unknown><ext:Deep/></ext:Unknown>
    </rm:SequenceAcknowledgement>
    <rm:Sequence soap:mustUnderstand="true">
      <rm:Identifier>urn:uuid:seq2</rm:Identifier>
      <rm:MessageNumber>
        +42
      </rm:MessageNumber>
      <ext:Priority>high</ext:Priority>
    </rm:Sequence>
  </soap:Header>
  <soap:Body><o:order xmlns:o="urn:example:orders">x</o:order></soap:Body>
</soap:Envelope>"""


def test_tolerant_when_reading() -> None:
    envelope = decode(TOLERANT)
    assert envelope.acks == (SequenceAcknowledgement("urn:uuid:seq", ((1, 9),)),)
    assert envelope.sequence == Sequence("urn:uuid:seq2", 42)
    assert envelope.payload == b'<o:order xmlns:o="urn:example:orders">x</o:order>'
    assert envelope.addressing.action == "http://docs.oasis-open.org/ws-rx/wsrm/200702/SequenceAcknowledgement"


def test_reads_a_foreign_soap_fault_and_ws_rm_10_fault_in_soap_11() -> None:
    foreign = (b'<S:Envelope xmlns:S="http://schemas.xmlsoap.org/soap/envelope/"><S:Body><S:Fault>'
               b"<faultcode>S:Server</faultcode><faultstring>boom</faultstring></S:Fault></S:Body></S:Envelope>")
    body = decode(foreign).body
    assert body == SoapFault("{http://schemas.xmlsoap.org/soap/envelope/}Server", None, "boom")
    rm10 = envelope_of(SequenceFault(FaultCode.LAST_MESSAGE_NUMBER_EXCEEDED, "urn:uuid:s", "over"), S11, V10, W04)
    assert decode(encode(rm10)).body == rm10.body


def test_durations() -> None:
    assert format_duration(90.5) == "PT90.5S" and format_duration(0) == "PT0S"
    assert parse_duration(" P1DT2H3M4.5S ") == 86400 + 7200 + 180 + 4.5
    assert parse_duration("P1Y2M") == (365 + 60) * 86400
    for bad in ("P", "PT", "-PT1S", "1S", "PT1.S"):
        with pytest.raises(InvalidMessage):
            parse_duration(bad)


def test_invalid_message_is_a_wsrm_fault_with_a_code() -> None:
    with pytest.raises(WsrmFault) as caught:
        decode(b"<nope/>")
    assert caught.value.code == "Sender" and not caught.value.retryable


def test_create_sequence_response_with_expires_decodes_to_seconds() -> None:
    data = encode(envelope_of(CreateSequenceResponse("urn:uuid:s", 0.001), S11, V10, W05))
    assert b"<wsrm:Expires>PT0.001S</wsrm:Expires>" in data
    body = decode(data).body
    assert isinstance(body, CreateSequenceResponse) and body.expires == 0.001


def test_a_checked_payload_is_written_as_it_is_and_a_plain_one_is_parsed() -> None:
    def envelope(payload: bytes) -> Envelope:
        return Envelope(soap=S12, rm=V11, wsa=W05, addressing=Addressing(action="urn:a", to="http://p/rm"),
                        sequence=Sequence("urn:uuid:s", 1), payload=payload)

    assert b"<a>x</a>" in encode(envelope(CheckedPayload(b"<a>x</a>")))
    with pytest.raises(EncodingError):
        encode(envelope(b"<a>x</b>"))
