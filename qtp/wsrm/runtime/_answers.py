"""Answers, both ways: what the endpoint sends back for a request (an envelope, or nothing, and an HTTP
status), and how what a peer returns on the HTTP response to our request or poll is read.

An answer we read is decoded with ``decode(answer=True)``: a Sequence header that breaks the schema on an
empty-body answer (gSOAP writes MessageNumber 0 there, docs/interop.md D17) is set aside so that the
acknowledgements next to it still count. Each such answer is counted (``qtp_answer_headers_ignored_total``)
and logged as a warning, at most one line a minute (``RefusalWarnings``).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, replace
from typing import Any

from qtp.wsrm.codec import (
    WSMC_FAULT_ACTION,
    WSMC_NS,
    Addressing,
    Envelope,
    SoapFault,
    WsaVersion,
    decode,
    default_action,
    reply_destination,
)
from qtp.wsrm.codec._names import WSA_FAULT_ACTION
from qtp.wsrm.protocol import SequenceFault
from qtp.wsrm.runtime._refusals import RefusalWarnings

log = logging.getLogger("qtp.wsrm.answers")

_warnings = RefusalWarnings(summary="set aside %s more %s header(s) of answers in the last %.0f s")


@dataclass(frozen=True, slots=True)
class Answer:
    """What the endpoint sends back: an envelope (None: nothing, 202) and the HTTP status; or, answering a
    poll that takes a batch, ``batch``: the envelopes given, encoded (the first of them is ``envelope``)."""

    envelope: Envelope | None
    status: int = 200
    batch: tuple[bytes, ...] = ()


NOTHING = Answer(None, 202)


def reply_addressing(env: Envelope, act: str) -> Addressing:
    """The addressing of an answer to ``env`` (on its HTTP response): To is the anonymous URI, or the WS-MC
    anonymous URI the request named as its ReplyTo (WS-Addressing: a reply's destination is the reply endpoint)."""
    wsa = env.wsa or WsaVersion.WSA200508
    return Addressing(action=act, to=reply_destination(env.addressing.reply_to, wsa),
                      message_id=f"urn:uuid:{uuid.uuid4()}", relates_to=env.addressing.message_id)


def fault(env: Envelope, body: SequenceFault | SoapFault, status: int | None = None) -> Answer:
    """A fault answering ``env``: HTTP 400 for a sender's fault over SOAP 1.2, else 500 (or ``status``)."""
    reply = Envelope(soap=env.soap, rm=env.rm, wsa=env.wsa or WsaVersion.WSA200508, body=body,
                     addressing=reply_addressing(env, ""))
    if isinstance(body, SequenceFault) and env.rm is not None:
        act = default_action(reply)
    elif isinstance(body, SoapFault) and (body.subcode or "").startswith(f"{{{WSMC_NS}}}"):
        act = WSMC_FAULT_ACTION
    else:
        act = WSA_FAULT_ACTION[env.wsa or WsaVersion.WSA200508]
    reply = replace(reply, addressing=replace(reply.addressing, action=act))
    if status is None:
        sender = isinstance(body, SequenceFault) or body.code.endswith("Sender")
        status = 400 if sender and env.soap.value == "1.2" else 500
    return Answer(reply, status)


def read_answer(data: bytes, peer: str, metrics: Any) -> Envelope:
    """The envelope ``peer`` answered with; raises InvalidMessage as ``decode`` does. ``metrics``: the node's
    ``Metrics`` (its ``ignored_headers`` counter)."""
    envelope = decode(data, answer=True)
    if envelope.ignored:
        metrics.ignored_headers.inc(len(envelope.ignored))
        _warnings.warn(log, "invalid", "%s answered with a header that breaks the schema, set aside (the "
                       "acknowledgements next to it are taken): %s", peer, "; ".join(envelope.ignored))
    return envelope
