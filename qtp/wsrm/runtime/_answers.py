"""What the endpoint sends back for a request: an envelope (or nothing) and an HTTP status."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, replace

from qtp.wsrm.codec import WSMC_FAULT_ACTION, WSMC_NS, Addressing, Envelope, SoapFault, WsaVersion, anonymous, default_action
from qtp.wsrm.codec._names import WSA_FAULT_ACTION
from qtp.wsrm.protocol import SequenceFault


@dataclass(frozen=True, slots=True)
class Answer:
    """What the endpoint sends back: an envelope (None: nothing, 202) and the HTTP status."""

    envelope: Envelope | None
    status: int = 200


NOTHING = Answer(None, 202)


def reply_addressing(env: Envelope, act: str) -> Addressing:
    """The addressing of an answer to ``env`` (on its HTTP response)."""
    wsa = env.wsa or WsaVersion.WSA200508
    return Addressing(action=act, to=anonymous(wsa), message_id=f"urn:uuid:{uuid.uuid4()}",
                      relates_to=env.addressing.message_id)


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
