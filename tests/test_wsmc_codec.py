"""The codec's WS-MakeConnection 1.1: MakeConnection polls, the MessagePending header and the two WS-MC faults,
in SOAP 1.1 and 1.2 (with WS-RM 1.1 and WS-Addressing 2005/08, the only versions WS-MC goes with)."""

from __future__ import annotations

import dataclasses

import pytest
from lxml import etree
from wsrm_support import S11, S12, V10, V11, W04, W05, finish, payload, receiver, validator, wsmc_fault

from qtp.wsrm.codec import (
    MAKE_CONNECTION_ACTION,
    MISSING_SELECTION,
    RM_NS,
    UNSUPPORTED_SELECTION,
    WSMC_FAULT_ACTION,
    WSMC_NS,
    Addressing,
    BatchRoom,
    EncodingError,
    Envelope,
    InvalidMessage,
    MakeConnection,
    SoapFault,
    SoapVersion,
    accepted_batch,
    batch_accept,
    decode,
    default_action,
    encode,
    encode_batch,
    framed_size,
    mc_anonymous,
)
from qtp.wsrm.protocol import Sequence, SequenceAcknowledgement

POLLER = mc_anonymous("urn:uuid:poller")
ACK = SequenceAcknowledgement("urn:uuid:seq", ((1, 4),))


def messages(soap: SoapVersion) -> dict[str, Envelope]:
    """Every WS-MC message qtp sends, in ``soap``."""
    base = Envelope(soap=soap, rm=V11, wsa=W05)
    application = finish(dataclasses.replace(base, sequence=Sequence("urn:uuid:seq", 3), payload=payload("x", 3)))
    ack_only = finish(dataclasses.replace(base, acks=(ACK,)))
    return {
        "MakeConnection-by-address": finish(dataclasses.replace(base, body=MakeConnection(POLLER))),
        "MakeConnection-by-identifier": finish(dataclasses.replace(base, body=MakeConnection(None, "urn:uuid:seq"))),
        "MakeConnection-both": finish(dataclasses.replace(base, body=MakeConnection(POLLER, "urn:uuid:seq"))),
        "MakeConnection+acks": finish(dataclasses.replace(base, body=MakeConnection(POLLER), acks=(ACK,))),
        "application+MessagePending-true": dataclasses.replace(application, message_pending=True),
        "application+MessagePending-false": dataclasses.replace(application, message_pending=False),
        "ack+MessagePending-true": dataclasses.replace(ack_only, message_pending=True),
        "ack+MessagePending-false": dataclasses.replace(ack_only, message_pending=False),
        "fault:MissingSelection": finish(dataclasses.replace(base, body=wsmc_fault(soap))),
        "fault:UnsupportedSelection": finish(dataclasses.replace(
            base, body=wsmc_fault(soap, ("{urn:vendor:mc}Topic", "{}Filter")))),
    }


MATRIX = [(name, soap) for soap in SoapVersion for name in messages(soap)]


@pytest.mark.parametrize(("name", "soap"), MATRIX, ids=[f"{name}-soap{soap.value}" for name, soap in MATRIX])
def test_every_wsmc_message_validates_and_round_trips(name: str, soap: SoapVersion) -> None:
    envelope = messages(soap)[name]
    data = encode(envelope)
    assert WSMC_NS.encode() in data
    assert validator().errors(data, V11, W05) == []
    assert decode(data) == envelope


def wire(envelope: Envelope) -> etree._Element:
    return etree.fromstring(encode(envelope))


def test_make_connection_on_the_wire() -> None:
    envelope = messages(S12)["MakeConnection-both"]
    assert envelope.addressing.action == MAKE_CONNECTION_ACTION
    poll = wire(envelope).find(f".//{{{WSMC_NS}}}MakeConnection")
    assert [child.tag for child in poll] == [f"{{{WSMC_NS}}}Address", f"{{{RM_NS[V11]}}}Identifier"]
    assert [child.text for child in poll] == [POLLER, "urn:uuid:seq"]
    pending = wire(messages(S11)["ack+MessagePending-false"]).find(f".//{{{WSMC_NS}}}MessagePending")
    assert pending.get("pending") == "false" and pending.getparent().tag.endswith("Header")


@pytest.mark.parametrize("soap", list(SoapVersion))
def test_wsmc_faults_on_the_wire(soap: SoapVersion) -> None:
    envelope = messages(soap)["fault:UnsupportedSelection"]
    assert envelope.addressing.action == WSMC_FAULT_ACTION
    root = wire(envelope)
    fault = root.find(".//{%s}Fault" % root.nsmap["S"])
    if soap is S12:
        code, subcode = (v.text for v in fault.iter("{%s}Value" % root.nsmap["S"]))
        assert code == "S:Receiver"
    else:
        subcode = fault.findtext("faultcode")
    assert subcode == "wsmc:UnsupportedSelection" and fault.nsmap["wsmc"] == WSMC_NS
    entries = list(fault.iter(UNSUPPORTED_SELECTION))
    assert [entry.text for entry in entries] == ["u:Topic", "Filter"] and entries[0].nsmap["u"] == "urn:vendor:mc"


@pytest.mark.parametrize(
    ("envelope", "message"),
    [
        (Envelope(S12, V11, W05, body=MakeConnection()), "needs an Address or an Identifier"),
        (Envelope(S12, V11, W05, body=MakeConnection(POLLER, None, ("{urn:x}Topic",))), "never sends"),
        (Envelope(S12, V11, W05, body=MakeConnection("", "urn:uuid:s")), "empty"),
        (Envelope(S12, V10, W05, body=MakeConnection(POLLER)), "goes with WS-RM 1.1"),
        (Envelope(S12, V10, W04, body=MakeConnection(POLLER)), "goes with WS-RM 1.1"),
        (Envelope(S11, None, W05, body=MakeConnection(POLLER)), "goes with WS-RM 1.1"),
        (Envelope(S12, V10, W04, acks=(ACK,), message_pending=True), "goes with WS-RM 1.1"),
        (Envelope(S12, V11, W05, body=SoapFault("Sender", MISSING_SELECTION, "x")), "code Receiver"),
        (Envelope(S11, V11, W05, body=SoapFault("Client", UNSUPPORTED_SELECTION, "x")), "code Receiver"),
        (Envelope(S12, V11, W05, body=SoapFault("Receiver", MISSING_SELECTION, "x", ("{a}b",))), "only an Unsup"),
        (Envelope(S12, V11, W05, body=SoapFault("Receiver", UNSUPPORTED_SELECTION, "x", ("a:b",))), "{namespace}"),
        (Envelope(S12, V11, W05, body=SoapFault("Receiver", UNSUPPORTED_SELECTION, "x", ("{urn:é}b",))), "ASCII"),
    ],
)
def test_strict_when_emitting(envelope: Envelope, message: str) -> None:
    with pytest.raises(EncodingError, match=message):
        encode(dataclasses.replace(envelope, addressing=Addressing(action="urn:x")))


def test_default_actions() -> None:
    assert default_action(Envelope(S12, V11, W05, body=MakeConnection(POLLER))) == MAKE_CONNECTION_ACTION
    assert default_action(Envelope(S11, V11, W05, body=wsmc_fault(S11))) == WSMC_FAULT_ACTION
    assert default_action(Envelope(S11, V11, W05, body=SoapFault("Receiver", None, "busy"))) != WSMC_FAULT_ACTION


def poll(selections: str, soap_ns: str = "http://www.w3.org/2003/05/soap-envelope",
         wsa_ns: str = "http://www.w3.org/2005/08/addressing", header: str = "") -> bytes:
    return (f'<S:Envelope xmlns:S="{soap_ns}" xmlns:wsa="{wsa_ns}" xmlns:wsmc="{WSMC_NS}" '
            'xmlns:wsrm="http://docs.oasis-open.org/ws-rx/wsrm/200702" xmlns:x="urn:vendor:mc">'
            f"<S:Header><wsa:Action>{MAKE_CONNECTION_ACTION}</wsa:Action>{header}</S:Header>"
            f"<S:Body><wsmc:MakeConnection>{selections}</wsmc:MakeConnection></S:Body></S:Envelope>").encode()


def test_extension_selections_are_named_not_refused() -> None:
    body = decode(poll("<x:Topic>t</x:Topic><!-- c --><wsrm:Identifier> urn:uuid:s </wsrm:Identifier>"
                       f"<Filter/><x:Topic/><wsmc:Address>{POLLER}</wsmc:Address><wsmc:Future/>")).body
    assert body == MakeConnection(POLLER, "urn:uuid:s", ("{urn:vendor:mc}Topic", "{}Filter", f"{{{WSMC_NS}}}Future"))
    many = decode(poll("".join(f"<x:T{n}/>" for n in range(100)))).body
    assert isinstance(many, MakeConnection) and len(many.unsupported) == 16  # what the fault will echo: bounded
    assert decode(poll("")).body == MakeConnection(None, None)  # the runtime answers MissingSelection
    assert decode(poll(f"<wsmc:Address>{POLLER}</wsmc:Address>")).rm is V11


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (poll(f"<wsmc:Address>http://a/{'p' * 2040}</wsmc:Address>"), "at most 2048"),
        (poll(f"<wsrm:Identifier>urn:{'i' * 252}</wsrm:Identifier>"), "at most 255"),
        (poll(f"<wsmc:Address>{POLLER}</wsmc:Address><wsmc:Address>{POLLER}</wsmc:Address>"), "more than one Addr"),
        (poll("<wsrm:Identifier>urn:a</wsrm:Identifier><wsrm:Identifier>urn:a</wsrm:Identifier>"), "more than one Id"),
        (poll("<wsmc:Address> </wsmc:Address>"), "empty Address"),
        (poll("<wsrm:Identifier/>"), "empty Identifier"),
        (poll("", header='<wsmc:MessagePending pending="maybe"/>'), "not a boolean"),
        (poll("", header='<wsmc:MessagePending pending=""/>'), "not a boolean"),
        (poll("", header="<wsmc:MessagePending/><wsmc:MessagePending/>"), "more than one MessagePending"),
        (poll(f"<wsmc:Address>{POLLER}</wsmc:Address>", wsa_ns="http://schemas.xmlsoap.org/ws/2004/08/addressing"),
         "WS-Addressing 2005/08"),
        (poll("", header='<r:AckRequested xmlns:r="http://schemas.xmlsoap.org/ws/2005/02/rm"><r:Identifier>urn:a'
                         '</r:Identifier></r:AckRequested><wsmc:MessagePending pending="true"/>'), "not WS-RM 1.0"),
        (poll("").replace(b"wsmc:MakeConnection>", b"wsmc:Poll>"), "unsupported WS-MakeConnection body"),
    ],
)
def test_hostile_wsmc_input_is_refused(data: bytes, message: str) -> None:
    with pytest.raises(InvalidMessage, match=message) as caught:
        decode(data)
    assert caught.value.code == "Sender"


def test_selections_at_the_bounds_are_read() -> None:
    address, identifier = f"http://a/{'p' * 2039}", f"urn:{'i' * 251}"
    data = poll(f"<wsrm:Identifier>{identifier}</wsrm:Identifier><wsmc:Address>{address}</wsmc:Address>")
    assert decode(data).body == MakeConnection(address, identifier)


def test_reads_message_pending_and_faults_as_other_stacks_write_them() -> None:
    assert decode(poll("", header='<wsmc:MessagePending pending=" 1 "/>')).message_pending is True
    assert decode(poll("", header="<wsmc:MessagePending/>")).message_pending is False  # announces nothing
    assert decode(poll("")).message_pending is None
    soap11 = (b'<S:Envelope xmlns:S="http://schemas.xmlsoap.org/soap/envelope/"><S:Body><S:Fault>'
              b'<faultcode xmlns:mc="' + WSMC_NS.encode() + b'">mc:MissingSelection</faultcode>'
              b"<faultstring>none</faultstring></S:Fault></S:Body></S:Envelope>")
    assert decode(soap11).body == SoapFault(receiver(S11), MISSING_SELECTION, "none")
    metro = (b'<S:Envelope xmlns:S="http://www.w3.org/2003/05/soap-envelope" xmlns:mc="' + WSMC_NS.encode() +
             b'"><S:Body><S:Fault><S:Code><S:Value>S:Receiver</S:Value><S:Subcode><S:Value>mc:UnsupportedSelection'
             b'</S:Value></S:Subcode></S:Code><S:Reason><S:Text xml:lang="en">no</S:Text></S:Reason><S:Detail>'
             b"<mc:UnsupportedSelection>{http://docs.oasis-open.org/ws-rx/wsrm/200702}Identifier"
             b"</mc:UnsupportedSelection><mc:UnsupportedSelection>zz:Undeclared</mc:UnsupportedSelection>"
             b"</S:Detail></S:Fault></S:Body></S:Envelope>")
    fault = decode(metro)
    assert fault.rm is V11 and fault.body == SoapFault(
        receiver(S12), UNSUPPORTED_SELECTION, "no", ("{http://docs.oasis-open.org/ws-rx/wsrm/200702}Identifier",))


def test_the_validator_checks_wsmc_elements_against_the_wsmc_schema() -> None:
    data = encode(messages(S12)["MakeConnection-both"])
    text_child = data.replace(b"<wsmc:Address>", b"stray text<wsmc:Address>")
    own_namespace = data.replace(b"</wsmc:MakeConnection>", b"<wsmc:Identifier>urn:a</wsmc:Identifier>"
                                                            b"</wsmc:MakeConnection>")
    bad_identifier = data.replace(b"<wsrm:Identifier>", b'<wsrm:Identifier unqualified="attribute">')
    assert any("Identifier" in error for error in validator().errors(bad_identifier, V11, W05))
    for broken in (text_child, own_namespace):
        assert any("MakeConnection" in error for error in validator().errors(broken, V11, W05))
    pending = encode(messages(S11)["ack+MessagePending-true"]).replace(b'pending="true"', b'pending="maybe"')
    assert any("pending" in error for error in validator().errors(pending, V11, W05))
    assert validator().errors(encode(messages(S11)["ack+MessagePending-true"]), V10, W05) != []


# ---------------------------------------------------------------------- qtp's batch answer to a poll

@pytest.mark.parametrize("header, room", [
    (batch_accept(256, 4 << 20), BatchRoom(256, 4 << 20)),
    ("application/vnd.qtp.soap-batch;max=3;bytes=100", BatchRoom(3, 100)),
    ("text/xml, Application/Vnd.Qtp.Soap-Batch ; max=20000 ; bytes=5", BatchRoom(10_000, 5)),  # capped
    (None, None), ("", None), ("application/soap+xml, text/xml", None), ("*/*", None),
    ("application/vnd.qtp.soap-batch", None),  # no count or size: not taken
    ("application/vnd.qtp.soap-batch; max=1; bytes=100", None),  # one per poll is the standard answer
    ("application/vnd.qtp.soap-batch; max=-3; bytes=100", None),
    ("application/vnd.qtp.soap-batch; max=3; bytes=0", None),
    ("application/vnd.qtp.soap-batch; max=3; bytes=1e9", None),
    ("application/vnd.qtp.soap-batch; max=99999999999; bytes=10", None),
    ("application/vnd.qtp.soap-batch; max=3; bytes=9999999999999", None),
    ("application/vnd.qtp.soap-batch; q=0; max=3; bytes=100", None),  # q=0: not acceptable
    ("application/vnd.qtp.soap-batch; q=0.000; max=3; bytes=100", None),
    ("application/vnd.qtp.soap-batch; q=0.5; max=3; bytes=100", BatchRoom(3, 100)),
])
def test_the_batch_a_polls_accept_header_takes(header, room):
    assert accepted_batch(header) == room


def test_framed_size_is_the_encoded_batchs_length():
    parts = [b"<a/>", b"x" * 1234, b"<b>" * 7]
    assert framed_size(parts) == len(encode_batch(parts))
