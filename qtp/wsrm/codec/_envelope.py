"""The codec's value objects: ``Envelope``, its addressing headers, and the errors of encoding and decoding."""

from __future__ import annotations

from dataclasses import dataclass, field

from qtp.errors import EncodingError, InvalidMessage
from qtp.wsrm.protocol import (
    AckRequested,
    RMBody,
    RMVersion,
    Sequence,
    SequenceAcknowledgement,
    SequenceFault,
)
from qtp.wsrm.codec._names import SoapVersion, WsaVersion


__all__ = ["Addressing", "EncodingError", "Envelope", "InvalidMessage", "MakeConnection", "SoapFault"]


@dataclass(frozen=True, slots=True)
class Addressing:
    """WS-Addressing message headers; EPR-valued ones (reply_to, from_, fault_to) by their Address only."""

    action: str | None = None
    to: str | None = None
    message_id: str | None = None
    relates_to: str | None = None
    reply_to: str | None = None
    from_: str | None = None
    fault_to: str | None = None


@dataclass(frozen=True, slots=True)
class SoapFault:
    """A SOAP fault that is not a WS-RM fault (its code and subcode as ``{namespace}local`` names).

    The codec writes a subcode only for the WS-MakeConnection faults (``MISSING_SELECTION``,
    ``UNSUPPORTED_SELECTION``, whose code is Receiver); ``unsupported`` names (``{namespace}local``) the
    selection elements an UnsupportedSelection fault reports in its Detail, one QName each."""

    code: str
    subcode: str | None
    reason: str
    unsupported: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class MakeConnection:
    """A WS-MakeConnection 1.1 poll (the body of a one-way request): "answer this request with a message you
    hold for this address and/or this sequence". ``address`` is the wsmc:Address selection, a WS-MC anonymous
    URI (``mc_anonymous(id)``); ``identifier`` is a WS-RM 1.1 sequence Identifier, which WS-MC carries as an
    extension selection (a wsrm:Identifier child: the WS-MC schema has no Identifier of its own); a poll may
    carry both. ``unsupported`` names (``{namespace}local``) the other selection elements the decoder found,
    which qtp does not support (the receiver answers them with an UnsupportedSelection fault); the encoder never
    writes them."""

    address: str | None = None
    identifier: str | None = None
    unsupported: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Envelope:
    """One SOAP message: versions, addressing, WS-RM headers, and a body.

    The body is a WS-RM protocol message, a ``SequenceFault`` (sent as a SOAP fault), a ``SoapFault`` (an
    application's, a busy server's or a WS-MC fault), a WS-MC ``MakeConnection`` poll, or None, in which case
    ``payload`` (one serialised XML element) is the application's body, if any. Acknowledgements and
    AckRequested may ride on any message.
    """

    soap: SoapVersion
    rm: RMVersion | None
    wsa: WsaVersion | None
    addressing: Addressing = field(default_factory=Addressing)
    sequence: Sequence | None = None
    acks: tuple[SequenceAcknowledgement, ...] = ()
    ack_requests: tuple[AckRequested, ...] = ()
    body: RMBody | SequenceFault | SoapFault | MakeConnection | None = None
    payload: bytes | None = None
    message_pending: bool | None = None  # WS-MC MessagePending header on a message returned to a poll
    ignored: tuple[str, ...] = ()  # headers of an answer the decoder set aside, and why (decode(answer=True))
