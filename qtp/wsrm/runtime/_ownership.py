"""Who may speak about a sequence: the one place the runtime decides what an envelope is about.

Theory. Every sequence a node knows belongs to one peer. An inbound sequence belongs to the peer that
created it, or, when we offered it for our replies, to the peer of that channel; an outbound sequence
belongs to the peer we send it to: a channel's peer, or the peer that offered it to us. Whatever names a
sequence (a message of it, an AckRequested, CloseSequence and TerminateSequence and their responses, an
acknowledgement, a SequenceFault) is believed only when it comes from that peer, whichever way it comes: in
a request to our endpoint, in the answer to our own POST, or in the answer to our poll (WS-MakeConnection).
Authentication says who is talking; this says what they may talk about. Without it an authenticated peer
could acknowledge (delete) or fault (end) another peer's sequence by putting it in its answers, or answer a
poll with messages "from" another peer.

Who is talking (``Source``): for a request, the peer the endpoint authenticated (None: anonymous); for an
answer, the configured peer whose address we POSTed to (the transport has verified its signature) and that
address. Anonymous requests share one identity: nothing tells two anonymous clients apart. An answer from an
address that no peer is configured for is bound to that exact address instead, so one anonymous peer's
answers cannot touch the sequences of another.

Requests carry one more rule: acknowledgements, Close/Terminate responses and faults for one of our
outbound sequences come in a request only if that sequence asked for them there (an addressable or WS-MC
AcksTo, or a sequence a peer offered us); with the default anonymous AcksTo they are believed only on the
answers to our own requests.

A part that names a sequence this node does not know is not refused: an inbound one is answered
UnknownSequence by the receiver, an outbound one finds nothing to act on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from qtp.wsrm.codec import Envelope
from qtp.wsrm.protocol import (
    AckRequested,
    CloseSequence,
    CloseSequenceResponse,
    CreateSequenceResponse,
    SequenceAcknowledgement,
    SequenceFault,
    TerminateSequence,
    TerminateSequenceResponse,
)
from qtp.wsrm.runtime._refusals import refusals
from qtp.wsrm.runtime._settings import channel_name

from qtp.wsrm.runtime._sequences import Destinations, Sources

if TYPE_CHECKING:
    from qtp.wsrm.runtime._security import Security

log = logging.getLogger("qtp.wsrm.ownership")


@dataclass(frozen=True, slots=True)
class Source:
    """Who sent an HTTP request or answer: a configured peer's name (None: anonymous) and, for an answer,
    the address we POSTed to (None: a request to our endpoint)."""

    peer: str | None = None
    address: str | None = None

    @classmethod
    def of(cls, caller: "Source | str | None") -> "Source":
        """A request's source from the endpoint's caller (a peer's name; None: anonymous), or ``caller`` itself."""
        return caller if isinstance(caller, Source) else cls(caller)

    @classmethod
    def answer(cls, security: "Security", address: str) -> "Source":
        """Whoever answered our POST to ``address``: the peer configured there, else that address."""
        peer = security.peer_for_url(address)
        return cls(None if peer is None else peer.name, address)

    def __str__(self) -> str:
        who = f"peer {self.peer}" if self.peer is not None else "an anonymous peer"
        return who if self.address is None else f"{who} (answering at {self.address[:200]})"


@dataclass(frozen=True, slots=True)
class Owner:
    """The peer a sequence belongs to: its name (None: anonymous), where we send to it (None: unknown, a
    sequence an anonymous request created), and whether it may speak about the sequence in a request."""

    peer: str | None
    address: str | None = None
    by_request: bool = True

    def admits(self, source: Source) -> bool:
        if source.address is None and not self.by_request:
            return False
        if self.peer is not None or source.peer is not None:
            return self.peer == source.peer
        if source.address is None:  # an anonymous request: anonymous peers share one identity
            return True
        return self.address == source.address


@dataclass(frozen=True, slots=True)
class About:
    """An envelope's parts sorted by whether its source may say them. ``acks``, ``ack_requests``: the ones
    it may give; ``sequence``, ``body``: whether its Sequence header and its body may be taken (True when
    they name no sequence); ``refused``: the identifiers of the sequences it named and does not own."""

    acks: tuple[SequenceAcknowledgement, ...]
    ack_requests: tuple[AckRequested, ...]
    sequence: bool
    body: bool
    refused: tuple[str, ...]


class Ownership:
    """Sorts what a source says into what it may say (its own sequences) and what it may not."""

    def __init__(self, destinations: Destinations, sources: Sources, channels: Mapping[str, Any],
                 security: "Security", metrics: Any):
        self.destinations = destinations
        self.sources = sources
        self.channels = channels
        self.security = security
        self.metrics = metrics

    def sort(self, source: Source, envelope: Envelope, key: str | None = None) -> About:
        """What ``envelope`` from ``source`` may be taken for; ``key``: the outbound sequence we POSTed for,
        when ``envelope`` is its answer (a CreateSequenceResponse names an identifier not known yet).
        Refused parts are logged and counted here."""
        refused: list[tuple[str, str]] = []

        def allowed(what: str, identifier: str, owner: Owner | None) -> bool:
            if owner is None or owner.admits(source):
                return True
            refused.append((what, identifier))
            return False

        acks = []
        for ack in envelope.acks:
            owner = self._outbound(ack.identifier, key)
            if owner is not None and allowed("acknowledgement", ack.identifier, owner):  # unknown: nothing to do
                acks.append(ack)
        requests = tuple(r for r in envelope.ack_requests
                         if allowed("AckRequested", r.identifier, self._inbound(r.identifier)))
        sequence = envelope.sequence is None or allowed("message", envelope.sequence.identifier,
                                                        self._inbound(envelope.sequence.identifier))
        named = self._named(envelope.body, key)
        body = named is None or allowed(type(envelope.body).__name__, named[0], named[1])
        for what, identifier in refused:
            refusals.warn(log, "not_owner", "refused a %s for sequence %s from %s: it is not that sequence's "
                          "peer", what, identifier[:200], source)
            self.metrics.refused.labels(reason="not_owner").inc()
        return About(tuple(acks), requests, sequence, body, tuple(identifier for _, identifier in refused))

    # ------------------------------------------------------------------ owners

    def _named(self, body: Any, key: str | None) -> tuple[str, Owner | None] | None:
        """The sequence a body is about and its owner (None: it names none)."""
        if isinstance(body, (CloseSequence, TerminateSequence)):
            return body.identifier, self._inbound(body.identifier)
        if isinstance(body, CreateSequenceResponse) and key is not None:
            return body.identifier, self._outbound_key(key)
        if isinstance(body, (CreateSequenceResponse, CloseSequenceResponse, TerminateSequenceResponse)):
            return body.identifier, self._outbound(body.identifier)
        if isinstance(body, SequenceFault):
            if body.identifier is None:
                return None if key is None else ("(none)", self._outbound_key(key))
            return body.identifier, self._inbound(body.identifier) or self._outbound(body.identifier)
        return None

    def _inbound(self, identifier: str) -> Owner | None:
        info = self.destinations.info(identifier)
        if info is None:
            return None
        if info.channel is not None:  # offered by us for our replies: the channel's peer sends on it
            channel = self.channels.get(channel_name(info.channel))
            return Owner(info.owner, channel.peer if channel is not None else None)
        return Owner(info.owner)

    def _outbound(self, identifier: str, key: str | None = None) -> Owner | None:
        """``key``: the sequence an answer is for, most often the one its acknowledgement names."""
        seq = None if key is None else self.sources.get(key)
        if seq is None or seq.identifier != identifier:
            seq = self.sources.by_identifier(identifier)
        return None if seq is None else self._outbound_key(seq.key)

    def _outbound_key(self, key: str) -> Owner | None:
        seq = self.sources.get(key)
        if seq is None:
            return None
        info = seq.info
        if info.route.startswith("offer:"):  # offered by the peer that created the inbound sequence
            return Owner(info.owner, info.peer)
        channel = self.channels.get(channel_name(info.route))
        peer = self.security.peer_for_url(info.peer)
        by_request = channel is not None and channel.acks_to in ("endpoint", "poll")
        return Owner(None if peer is None else peer.name, info.peer, by_request)
