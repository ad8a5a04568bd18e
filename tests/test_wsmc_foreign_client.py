"""A WS-MakeConnection client written from the specifications, against a qtp node: no qtp client code.

The client is raw SOAP (1.1 and 1.2) built from strings and read with lxml, as another stack would see the
node: it cannot listen, so it names a WS-MC anonymous URI (WS-MC 1.1 section 3.1) as ReplyTo, AcksTo and
Offer Endpoint, sends one request, fetches the reply and the acknowledgements with MakeConnection, ends its
own sequence, and answers the node's Close and Terminate of the offered sequence, which it also gets by
polling. What is checked is what such a client relies on:

- every answer on an HTTP response to a request whose ReplyTo is the MC URI has ``To`` = that URI
  (WS-Addressing 1.0 Core 3.4: the reply's [destination] is the [reply endpoint]'s [address]);
- every message a poll returns has a ``ReplyTo`` the client can answer: the node's endpoint (a poll's
  response has no back channel), and the client's POSTed answers to the node's Close and Terminate end the
  offered sequence.

The node is in this process (memory mode, no database), listening on loopback.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import pytest
import requests
from lxml import etree

import qtp
from qtp.embedded import free_port
from qtp.wsrm.runtime import Limits, Node, NodeSettings

WSA = "http://www.w3.org/2005/08/addressing"
RM = "http://docs.oasis-open.org/ws-rx/wsrm/200702"
MC = "http://docs.oasis-open.org/ws-rx/wsmc/200702"
SOAP = {"1.1": "http://schemas.xmlsoap.org/soap/envelope/", "1.2": "http://www.w3.org/2003/05/soap-envelope"}
ANONYMOUS = WSA + "/anonymous"
ACTION = "urn:test:foreign/echo"


@dataclass
class Read:
    """What the client reads of one envelope."""

    to: str | None
    reply_to: str | None
    action: str | None
    body: str | None            # the local name of the Body's element
    sequence: tuple[str, int] | None
    acks: dict[str, list[tuple[int, int]]]
    ack_requested: list[str]
    body_identifier: str | None
    pending: bool | None


def _read(data: bytes) -> Read:
    root = etree.fromstring(data)
    header = next((c for c in root if etree.QName(c).localname == "Header"), None)
    body = next(c for c in root if etree.QName(c).localname == "Body")

    def text(path: str) -> str | None:
        found = header.find(path, {"wsa": WSA, "rm": RM}) if header is not None else None
        return None if found is None else found.text.strip()

    sequence = header.find("rm:Sequence", {"rm": RM}) if header is not None else None
    acks = {a.findtext(f"{{{RM}}}Identifier").strip(): [(int(r.get("Lower")), int(r.get("Upper")))
                                                         for r in a.iter(f"{{{RM}}}AcknowledgementRange")]
            for a in (header.iter(f"{{{RM}}}SequenceAcknowledgement") if header is not None else [])}
    requested = [r.findtext(f"{{{RM}}}Identifier").strip()
                 for r in (header.iter(f"{{{RM}}}AckRequested") if header is not None else [])]
    pending = header.find(f"{{{MC}}}MessagePending") if header is not None else None
    content = next((c for c in body if isinstance(c.tag, str)), None)
    return Read(to=text("wsa:To"), reply_to=text("wsa:ReplyTo/wsa:Address"), action=text("wsa:Action"),
                body=None if content is None else etree.QName(content).localname,
                sequence=None if sequence is None else (sequence.findtext(f"{{{RM}}}Identifier").strip(),
                                                        int(sequence.findtext(f"{{{RM}}}MessageNumber"))),
                acks=acks, ack_requested=requested,
                body_identifier=None if content is None else content.findtext(f"{{{RM}}}Identifier"),
                pending=None if pending is None else pending.get("pending") == "true")


class ForeignClient:
    """A WS-RM 1.1 / WS-MC 1.1 client that cannot listen, reached at ``self.mc`` only through polls."""

    def __init__(self, url: str, soap: str):
        self.url, self.soap = url, soap
        self.mc = f"{MC}/anonymous?id=urn:uuid:{uuid.uuid4()}"

    def post(self, action: str, headers: str, body: str, reply_to: str | None = None) -> requests.Response:
        reply_to = self.mc if reply_to is None else reply_to
        s = SOAP[self.soap]
        must = "1" if self.soap == "1.1" else "true"
        envelope = (f'<?xml version="1.0" encoding="UTF-8"?><s:Envelope xmlns:s="{s}" xmlns:wsa="{WSA}" '
                    f'xmlns:wsrm="{RM}" xmlns:wsmc="{MC}"><s:Header>'
                    f'<wsa:To s:mustUnderstand="{must}">{self.url}</wsa:To>'
                    f'<wsa:ReplyTo><wsa:Address>{reply_to}</wsa:Address></wsa:ReplyTo>'
                    f'<wsa:Action s:mustUnderstand="{must}">{action}</wsa:Action>'
                    f'<wsa:MessageID>urn:uuid:{uuid.uuid4()}</wsa:MessageID>{headers}</s:Header>'
                    f'<s:Body>{body}</s:Body></s:Envelope>')
        if self.soap == "1.1":
            http = {"Content-Type": "text/xml; charset=utf-8", "SOAPAction": f'"{action}"'}
        else:
            http = {"Content-Type": f'application/soap+xml; charset=utf-8; action="{action}"'}
        return requests.post(self.url, data=envelope.encode(), headers=http, timeout=10)

    def poll(self) -> Read | None:
        answer = self.post(f"{MC}/MakeConnection", "",
                           f"<wsmc:MakeConnection><wsmc:Address>{self.mc}</wsmc:Address></wsmc:MakeConnection>",
                           reply_to=ANONYMOUS)
        assert answer.status_code in (200, 202), answer.text
        return _read(answer.content) if answer.status_code == 200 else None


def _node(port: int, tmp_path) -> Node:
    tm = qtp.TransactionManager(f"mc-{uuid.uuid4().hex[:6]}", tmp_path / "logs", recovery_interval=None)
    node = Node(tm, NodeSettings(endpoint=f"http://127.0.0.1:{port}/rm", listen=("127.0.0.1", port), mode="memory",
                                 limits=Limits(retransmit_interval=0.3, retransmit_interval_min=0.2,
                                               retransmit_interval_max=1.0)))

    @node.handler(ACTION)
    def echo(tx, message):
        return b'<echoed xmlns="urn:test:foreign"/>'

    return node.start()


@pytest.mark.parametrize("soap", ["1.1", "1.2"])
def test_a_foreign_polling_client_is_answered_at_its_mc_uri_and_can_answer_what_it_polls(soap, tmp_path):
    port = free_port()
    node = _node(port, tmp_path)
    try:
        _run_client(ForeignClient(node.endpoint, soap), node.endpoint)
    finally:
        node.close()
        node.manager.close()


def _run_client(client: ForeignClient, endpoint: str) -> None:
    mc, offered = client.mc, f"urn:uuid:{uuid.uuid4()}"
    created = client.post(f"{RM}/CreateSequence", "",
                          f"<wsrm:CreateSequence><wsrm:AcksTo><wsa:Address>{mc}</wsa:Address></wsrm:AcksTo>"
                          f"<wsrm:Offer><wsrm:Identifier>{offered}</wsrm:Identifier><wsrm:Endpoint><wsa:Address>"
                          f"{mc}</wsa:Address></wsrm:Endpoint></wsrm:Offer></wsrm:CreateSequence>")
    assert created.status_code == 200, created.text
    response = _read(created.content)
    assert response.body == "CreateSequenceResponse"
    assert response.to == mc  # the [destination] of a reply is the [reply endpoint]'s address
    sequence = etree.fromstring(created.content).findtext(f".//{{{RM}}}CreateSequenceResponse/{{{RM}}}Identifier")

    sent = client.post(ACTION, f'<wsrm:Sequence s:mustUnderstand="{"1" if client.soap == "1.1" else "true"}">'
                               f"<wsrm:Identifier>{sequence}</wsrm:Identifier><wsrm:MessageNumber>1"
                               f"</wsrm:MessageNumber></wsrm:Sequence>"
                               f"<wsrm:AckRequested><wsrm:Identifier>{sequence}</wsrm:Identifier></wsrm:AckRequested>",
                       '<echo xmlns="urn:test:foreign"/>')
    assert sent.status_code in (200, 202), sent.text
    if sent.status_code == 200:
        assert _read(sent.content).to == mc

    polled: list[Read] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (any(p.sequence == (offered, 1) for p in polled)
                                              and any(sequence in p.acks for p in polled)):
        got = client.poll()
        if got is not None:
            polled.append(got)
        else:
            time.sleep(0.1)
    assert any(p.sequence == (offered, 1) for p in polled), polled
    assert any(p.acks.get(sequence) == [(1, 1)] for p in polled), polled

    for local, extra in (("CloseSequence", "<wsrm:LastMsgNumber>1</wsrm:LastMsgNumber>"), ("TerminateSequence", "")):
        ended = client.post(f"{RM}/{local}", "", f"<wsrm:{local}><wsrm:Identifier>{sequence}</wsrm:Identifier>"
                                                  f"{extra}</wsrm:{local}>")
        assert ended.status_code == 200, ended.text
        answer = _read(ended.content)
        assert (answer.body, answer.to) == (f"{local}Response", mc)

    # The offered sequence: acknowledge the reply at the node's endpoint (its AcksTo), then answer the node's
    # CloseSequence and TerminateSequence, which come by polling, with POSTs to their ReplyTo.
    acked = client.post(f"{RM}/SequenceAcknowledgement",
                        f'<wsrm:SequenceAcknowledgement><wsrm:Identifier>{offered}</wsrm:Identifier>'
                        f'<wsrm:AcknowledgementRange Lower="1" Upper="1"/></wsrm:SequenceAcknowledgement>', "",
                        reply_to=ANONYMOUS)
    assert acked.status_code in (200, 202), acked.text
    ended_by_node: set[str] = set()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and ended_by_node != {"CloseSequence", "TerminateSequence"}:
        got = client.poll()
        if got is None:
            time.sleep(0.1)
            continue
        polled.append(got)
        if got.body in ("CloseSequence", "TerminateSequence") and got.body_identifier == offered:
            assert got.reply_to not in (None, ANONYMOUS), got
            answered = ForeignClient(got.reply_to, client.soap)
            answered.mc = mc
            back = answered.post(f"{RM}/{got.body}Response", "",
                                 f"<wsrm:{got.body}Response><wsrm:Identifier>{offered}</wsrm:Identifier>"
                                 f"</wsrm:{got.body}Response>", reply_to=ANONYMOUS)
            assert back.status_code in (200, 202), back.text
            ended_by_node.add(got.body)
    assert ended_by_node == {"CloseSequence", "TerminateSequence"}, polled
    answerable = [p for p in polled if p.body is not None or p.sequence is not None or p.ack_requested]
    assert answerable and all(p.reply_to == endpoint for p in answerable), \
        [(p.body, p.sequence, p.ack_requested, p.reply_to) for p in answerable]
