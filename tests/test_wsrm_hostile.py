"""Hostile and broken input: every case ends in InvalidMessage with the right code, fast; fuzzed too."""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from wsrm_support import envelope_of, envelopes

from qtp.wsrm.codec import InvalidMessage, SoapVersion, WsaVersion, decode, encode
from qtp.wsrm.protocol import RMVersion, Sequence

S12 = "http://www.w3.org/2003/05/soap-envelope"
RM11 = "http://docs.oasis-open.org/ws-rx/wsrm/200702"
RM10 = "http://schemas.xmlsoap.org/ws/2005/02/rm"


def envelope(header: str = "", body: str = "", soap: str = S12) -> bytes:
    return (f'<S:Envelope xmlns:S="{soap}" xmlns:wsrm="{RM11}" xmlns:r0="{RM10}">'
            f"<S:Header>{header}</S:Header><S:Body>{body}</S:Body></S:Envelope>").encode()


def sequence(number: str) -> str:
    return f"<wsrm:Sequence><wsrm:Identifier>urn:s</wsrm:Identifier><wsrm:MessageNumber>{number}" \
           f"</wsrm:MessageNumber></wsrm:Sequence>"


def ack(content: str, ns: str = "wsrm") -> str:
    return f"<{ns}:SequenceAcknowledgement><{ns}:Identifier>urn:s</{ns}:Identifier>{content}" \
           f"</{ns}:SequenceAcknowledgement>"


def code_of(data: bytes, **limits: int) -> str:
    with pytest.raises(InvalidMessage) as caught:
        decode(data, **limits)
    return caught.value.code


LAUGHS = b"""<?xml version="1.0"?>
<!DOCTYPE lolz [<!ENTITY lol "lol"><!ENTITY lol2 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">
<!ENTITY lol3 "&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;">
<!ENTITY lol4 "&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;">]>
<S:Envelope xmlns:S="http://www.w3.org/2003/05/soap-envelope"><S:Body>&lol4;</S:Body></S:Envelope>"""

XXE = b"""<?xml version="1.0"?>
<!DOCTYPE e [<!ENTITY x SYSTEM "file:///etc/passwd">]>
<S:Envelope xmlns:S="http://www.w3.org/2003/05/soap-envelope"><S:Body><a>&x;</a></S:Body></S:Envelope>"""


@pytest.mark.parametrize("data", [LAUGHS, XXE], ids=["billion-laughs", "external-entity"])
def test_dtds_are_refused(data: bytes) -> None:
    assert code_of(data) == "Sender"


def test_a_dtd_hidden_by_utf16_is_still_refused_and_not_expanded() -> None:
    data = XXE.decode().replace('<?xml version="1.0"?>', '<?xml version="1.0" encoding="UTF-16"?>').encode("utf-16")
    with pytest.raises(InvalidMessage, match="DTD"):
        decode(data)


def test_size_and_depth_limits() -> None:
    big = envelope(body="<a>" + "x" * 5000 + "</a>")
    with pytest.raises(InvalidMessage, match="more than the limit of 1000"):
        decode(big, max_bytes=1000)
    deep = envelope(body="<a>" * 120 + "</a>" * 120)
    with pytest.raises(InvalidMessage, match="deeper than 100"):
        decode(deep)
    assert code_of(envelope(body="<a>" * 400 + "</a>" * 400), max_depth=1000) == "Sender"  # libxml2's own limit
    assert decode(envelope(body="<a>" * 90 + "</a>" * 90)).payload is not None


def test_huge_input_is_refused_quickly() -> None:
    started = time.perf_counter()
    with pytest.raises(InvalidMessage):
        decode(b"<" * (5 * 1024 * 1024))
    assert time.perf_counter() - started < 1.0


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (b"", "Sender"),
        (b"\x00\xff\xfe garbage", "Sender"),
        (b"<S:Envelope xmlns:S='http://www.w3.org/2003/05/soap-envelope'><S:Body>", "Sender"),
        (b"<Envelope xmlns='urn:not-soap'><Body/></Envelope>", "VersionMismatch"),
        (b"<html/>", "Sender"),
        (envelope().replace(b"<S:Body></S:Body>", b""), "Sender"),
        (envelope(sequence("abc")), "Sender"),
        (envelope(sequence("0")), "Sender"),
        (envelope(sequence("-1")), "Sender"),
        (envelope(sequence("9" * 5000)), "Sender"),
        (envelope(sequence("9223372036854775808")), "MessageNumberRollover"),
        (envelope("<wsrm:Sequence><wsrm:MessageNumber>1</wsrm:MessageNumber></wsrm:Sequence>"), "Sender"),
        (envelope(sequence("1") + sequence("2")), "Sender"),
        (envelope('<x:Sec xmlns:x="urn:sec" S:mustUnderstand="true"/>'), "MustUnderstand"),
        (envelope(ack('<wsrm:AcknowledgementRange Upper="1" Lower="5"/>')), "InvalidAcknowledgement"),
        (envelope(ack('<wsrm:AcknowledgementRange Upper="5" Lower="1"/><wsrm:Nack>7</wsrm:Nack>')),
         "InvalidAcknowledgement"),
        (envelope(ack("")), "InvalidAcknowledgement"),
        (envelope(ack("<r0:None/>", ns="r0")), "InvalidAcknowledgement"),
        (envelope(ack('<wsrm:AcknowledgementRange Upper="x" Lower="1"/>')), "Sender"),
        (envelope(ack('<wsrm:AcknowledgementRange Lower="1"/>')), "Sender"),
        (envelope(sequence("1") + ack('<r0:AcknowledgementRange Upper="1" Lower="1"/>', ns="r0")), "Sender"),
        (envelope(body="<wsrm:CreateSequence><wsrm:AcksTo/></wsrm:CreateSequence>"), "Sender"),
        (envelope(body="<wsrm:CreateSequence><wsrm:AcksTo><wsa:Address xmlns:wsa='http://www.w3.org/2005/08/"
                       "addressing'>http://a</wsa:Address></wsrm:AcksTo><wsrm:Expires>P99999999999999Y"
                       "</wsrm:Expires></wsrm:CreateSequence>"), "Sender"),
        (envelope(body="<wsrm:MakeConnection/>"), "Sender"),
        (envelope(body="<a/><b/>"), "Sender"),
        (envelope(body="<S:Fault><S:Reason/></S:Fault>"), "Sender"),
    ],
)
def test_broken_input_gets_the_right_fault_code(data: bytes, code: str) -> None:
    assert code_of(data) == code


def test_decode_refuses_text() -> None:
    with pytest.raises(TypeError):
        decode("<a/>")  # type: ignore[arg-type]


def _decode_or_fault(data: bytes) -> None:
    try:
        decode(data)
    except InvalidMessage as exc:
        assert exc.code and str(exc)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_fuzz_random_bytes(data: bytes) -> None:
    _decode_or_fault(data)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(envelopes(), st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 8), st.binary(max_size=8)),
                             min_size=1, max_size=4))
def test_fuzz_mutated_envelopes(envelope: object, edits: list[tuple[int, int, bytes]]) -> None:
    data = bytearray(encode(envelope))  # type: ignore[arg-type]
    for position, length, insert in edits:
        position %= len(data) + 1
        data[position:position + length] = insert
    _decode_or_fault(bytes(data))


FRAGMENTS = ["<", ">", "</wsrm:Identifier>", "<wsrm:Identifier>", "0", "-", "99999999999999999999", "&amp;",
             "<![CDATA[x]]>", "<?pi x?>", "<!-- c -->", 'S:mustUnderstand="1"', "wsrm:", "xmlns:wsrm='urn:x'", " "]


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 10**9), st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(FRAGMENTS)), max_size=5))
def test_fuzz_structural_splices(number: int, splices: list[tuple[int, str]]) -> None:
    text = encode(envelope_of(Sequence("urn:uuid:seq", number), SoapVersion.SOAP12, RMVersion.WSRM11,
                              WsaVersion.WSA200508)).decode()
    for position, fragment in splices:
        position %= len(text) + 1
        text = text[:position] + fragment + text[position:]
    _decode_or_fault(text.encode())
