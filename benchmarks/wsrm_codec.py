"""WS-RM codec throughput against bare lxml on the same bytes (issue 4). Not a test: run it by hand.

    .venv/bin/python benchmarks/wsrm_codec.py [--seconds 1.0]

Two messages: an application message (Sequence header, 1 KB payload) and a SequenceAcknowledgement with
100 ranges, both SOAP 1.2 + WS-RM 1.1. For each, these rates in operations per second:

- qtp encode: build the ``Envelope`` value and ``encode`` it to bytes (build + serialise); the codec
  remembers its verdict on recently checked payloads, so for the 1 KB message this is a payload encoded
  again (a retransmission), and a second figure, "first encoding", cycles through 4,096 distinct payloads
  of the same size (more than the codec remembers) so that every payload is parsed and checked;
- qtp decode: ``decode(bytes)`` to an ``Envelope`` with typed headers (parse + decode);
- lxml serialise: ``etree.tostring`` of the already parsed tree of the same bytes;
- lxml parse: ``etree.fromstring`` of the same bytes with the same hardened parser settings;
- lxml build + serialise: the same tree built with bare ``etree.SubElement`` calls, then ``tostring``
  (what a hand-written lxml encoder without qtp's checks would cost; context for the encode ratio);
- lxml parse + visit: parse, then read every element's tag, text and attributes once from Python (the
  floor of any lxml-based decoder that looks at each element; context for the decode ratio).

The target is qtp >= 0.5 x the bare lxml rate (qtp's overhead at most 2x). Each figure is the best of
``--rounds`` short rounds in which all five are timed one after the other, so that load from other
processes on a shared machine falls on qtp and on its baseline alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import platform
import timeit
from collections.abc import Callable

from lxml import etree

from qtp.wsrm.codec._encode import _CHECKED_PAYLOADS_MAX_BYTES, _check_payload as check_payload
from qtp.wsrm.codec import Addressing, Envelope, SoapVersion, WsaVersion, decode, encode
from qtp.wsrm.protocol import RMVersion, Sequence, SequenceAcknowledgement

SOAP = "http://www.w3.org/2003/05/soap-envelope"
WSA = "http://www.w3.org/2005/08/addressing"
RM = "http://docs.oasis-open.org/ws-rx/wsrm/200702"
APP = "urn:example:orders"
PARSER = etree.XMLParser(resolve_entities=False, no_network=True, load_dtd=False, huge_tree=False,
                         collect_ids=False)


def one_kb_payload(number: int = 42) -> bytes:
    order = etree.Element(f"{{{APP}}}order", nsmap={"o": APP}, id=f"{number:05d}")
    for i in range(9):
        line = etree.SubElement(order, f"{{{APP}}}line", sku=f"SKU-{i:05d}", quantity=str(i + 1))
        line.text = f"Item {i}: widget, blue, large, boxed"
    data = etree.tostring(order)
    while len(data) < 1024:
        etree.SubElement(order, f"{{{APP}}}note").text = "padding to one kilobyte"
        data = etree.tostring(order)
    return data


PAYLOAD = one_kb_payload()
FRESH_PAYLOADS = itertools.cycle([one_kb_payload(number) for number in range(4096)])
ADDRESSING = Addressing(action="urn:example:orders/Submit", to="http://server.example/rm",
                        message_id="urn:uuid:6f1c2b0e-8d5b-4a4e-9d0a-3c7e5f1a2b3c",
                        reply_to=f"{WSA}/anonymous")
RANGES = tuple((3 * i + 1, 3 * i + 2) for i in range(100))


def build_sequence_message() -> Envelope:
    return Envelope(SoapVersion.SOAP12, RMVersion.WSRM11, WsaVersion.WSA200508, ADDRESSING,
                    sequence=Sequence("urn:uuid:seq-0001", 12345), payload=PAYLOAD)


def build_fresh_sequence_message() -> Envelope:
    return Envelope(SoapVersion.SOAP12, RMVersion.WSRM11, WsaVersion.WSA200508, ADDRESSING,
                    sequence=Sequence("urn:uuid:seq-0001", 12345), payload=next(FRESH_PAYLOADS))


def build_ack_message() -> Envelope:
    addressing = dataclasses.replace(ADDRESSING, action=f"{RM}/SequenceAcknowledgement")
    ack = SequenceAcknowledgement("urn:uuid:seq-0001", RANGES)
    return Envelope(SoapVersion.SOAP12, RMVersion.WSRM11, WsaVersion.WSA200508, addressing, acks=(ack,))


def bare_build(payload: bytes | None, ranges: tuple[tuple[int, int], ...] | None, action: str) -> bytes:
    """The same document with bare lxml calls and no checks."""
    root = etree.Element(f"{{{SOAP}}}Envelope", nsmap={"S": SOAP, "wsa": WSA, "wsrm": RM})
    header = etree.SubElement(root, f"{{{SOAP}}}Header")
    etree.SubElement(header, f"{{{WSA}}}To").text = ADDRESSING.to
    reply = etree.SubElement(header, f"{{{WSA}}}ReplyTo")
    etree.SubElement(reply, f"{{{WSA}}}Address").text = ADDRESSING.reply_to
    etree.SubElement(header, f"{{{WSA}}}Action").text = action
    etree.SubElement(header, f"{{{WSA}}}MessageID").text = ADDRESSING.message_id
    if ranges is None:
        sequence = etree.SubElement(header, f"{{{RM}}}Sequence")
        sequence.set(f"{{{SOAP}}}mustUnderstand", "true")
        etree.SubElement(sequence, f"{{{RM}}}Identifier").text = "urn:uuid:seq-0001"
        etree.SubElement(sequence, f"{{{RM}}}MessageNumber").text = "12345"
    else:
        ack = etree.SubElement(header, f"{{{RM}}}SequenceAcknowledgement")
        etree.SubElement(ack, f"{{{RM}}}Identifier").text = "urn:uuid:seq-0001"
        for lower, upper in ranges:
            etree.SubElement(ack, f"{{{RM}}}AcknowledgementRange", Upper=str(upper), Lower=str(lower))
    body = etree.SubElement(root, f"{{{SOAP}}}Body")
    if payload is not None:
        body.append(etree.fromstring(payload, PARSER))
    return etree.tostring(root, xml_declaration=True, encoding="UTF-8")


def rates(functions: dict[str, Callable[[], object]], seconds: float, rounds: int) -> dict[str, float]:
    """Operations per second of each function: the best of ``rounds`` rounds, the functions interleaved
    within each round so that load from other processes falls on all of them alike."""
    timers = {name: timeit.Timer(function) for name, function in functions.items()}
    counts = {}
    for name, timer in timers.items():
        number, elapsed = timer.autorange()
        counts[name] = max(1, int(number * seconds / rounds / max(elapsed, 1e-9)))
    best = {name: float("inf") for name in functions}
    for _ in range(rounds):
        for name, timer in timers.items():
            best[name] = min(best[name], timer.timeit(counts[name]) / counts[name])
    return {name: 1 / seconds_per_op for name, seconds_per_op in best.items()}


def measure(name: str, build: Callable[[], Envelope], bare: Callable[[], bytes], seconds: float,
            rounds: int) -> list[tuple[str, str, float, float, float]]:
    data = encode(build())
    if decode(data) != build():
        raise SystemExit(f"{name}: round trip failed")
    if etree.tostring(etree.fromstring(bare(), PARSER), method="c14n") != etree.tostring(
        etree.fromstring(data, PARSER), method="c14n"
    ):
        raise SystemExit(f"{name}: the bare lxml document differs from qtp's output")
    tree = etree.fromstring(data, PARSER)
    if etree.tostring(tree, xml_declaration=True, encoding="UTF-8") != data:
        raise SystemExit(f"{name}: lxml does not serialise the parsed tree to the same bytes as qtp")
    functions: dict[str, Callable[[], object]] = {
        "encode": lambda: encode(build()),
        "serialise": lambda: etree.tostring(tree, xml_declaration=True, encoding="UTF-8"),
        "bare build": bare,
        "decode": lambda: decode(data),
        "parse": lambda: etree.fromstring(data, PARSER),
        "parse + visit": lambda: [(e.tag, e.text, e.attrib) for e in etree.fromstring(data, PARSER).iter()],
    }
    payload = build().payload
    if payload is not None:
        assert len(payload) <= _CHECKED_PAYLOADS_MAX_BYTES
        functions["first encoding"] = lambda: encode(build_fresh_sequence_message())
        functions["payload check"] = lambda: check_payload(payload)
    r = rates(functions, seconds, rounds)
    print(f"{name} ({len(data)} bytes)")
    rows = [(name, "build + serialise", r["encode"], r["serialise"], r["bare build"])]
    if payload is not None:
        print(f"  the payload well-formedness check alone (a payload not seen before): {r['payload check']:,.0f}/s")
        rows.append((name, "build + serialise, first encoding of each payload", r["first encoding"],
                     r["serialise"], r["bare build"]))
    return rows + [(name, "parse + decode", r["decode"], r["parse"], r["parse + visit"])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="time per function and message")
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    rows = measure("Sequence + 1 KB payload", build_sequence_message,
                   lambda: bare_build(PAYLOAD, None, ADDRESSING.action or ""), args.seconds, args.rounds)
    rows += measure("SequenceAcknowledgement, 100 ranges", build_ack_message,
                    lambda: bare_build(None, RANGES, f"{RM}/SequenceAcknowledgement"), args.seconds, args.rounds)
    print(f"\npython {platform.python_version()}, lxml {etree.__version__}, libxml2 "
          f"{'.'.join(map(str, etree.LIBXML_VERSION))}\n")
    print("| message | operation | qtp /s | bare lxml, same bytes /s | ratio (target >= 0.5) "
          "| context: bare lxml doing more /s | ratio |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, operation, qtp, bare, context in rows:
        what = "build + serialise" if operation.startswith("build") else "parse + visit each element"
        print(f"| {name} | {operation} | {qtp:,.0f} | {bare:,.0f} | {qtp / bare:.2f} "
              f"| {what}: {context:,.0f} | {qtp / context:.2f} |")


if __name__ == "__main__":
    main()
