"""WS-MakeConnection 1.1: messages held for peers that cannot listen, and the poller of a node that cannot.

**Serving side (``Mailbox``).** A peer behind NAT or a firewall names a WS-MC anonymous URI
(``http://docs.oasis-open.org/ws-rx/wsmc/200702/anonymous?id=X``) as the endpoint of the sequence it offers
for replies (or as an AcksTo). What this node would POST there is held here instead, keyed by the peer that
owns the sequence and the URI's id: the sender's messages of that sequence, and the latest acknowledgement of
an inbound sequence whose AcksTo is such a URI. Each MakeConnection from that peer takes one (the lowest
message number, with the acknowledgements riding along; then lone acknowledgements), with MessagePending
saying whether more wait; a qtp poller, whose Accept header names the count and bytes it reads at once
(``BatchRoom``), takes every waiting message of its client that fits, in one qtp batch answer, and is never
given more bytes than it reads (acknowledgements ride only when they fit; a message larger than it reads is
not given to it, and is reported). A message given out is given again after ``retransmit_interval`` until it is
acknowledged. The messages themselves stay in the store (``qtp_rm_outgoing``) until acknowledged: after a
restart the sender's timers hold them here again.

Entries belong to the peer that created the sequence: a poll from another peer for the same URI finds nothing.

**Polling side (``Poller``).** A node without ``[node] endpoint`` offers its reply sequences at its own WS-MC
URI (``mc_anonymous("urn:qtp:node:<node id>")``, the same after a restart), names it as AcksTo on channels
with ``acks_to = "poll"``, and polls each peer of those channels: at once while MessagePending says more
wait, backing off to ``poll_interval_max`` while idle. A polled message goes through the receiver as if the
peer had POSTed it (a CreateSequence is ignored: a peer we poll cannot open sequences here), from the peer
we polled (a batch answer as one batch request): what it says of another peer's sequences is refused like a
request that does (``Ownership``), so a peer cannot answer a poll with messages or acknowledgements "from"
another. The acknowledgement it
produces rides on the next poll, sent at once, and any other answer (a TerminateSequenceResponse, a fault)
is POSTed to the peer.

What a poll is given carries ``ReplyTo`` = this node's endpoint (a message given on a poll's response has no
back channel to be answered on: a client answers a Close, Terminate, CreateSequence or AckRequested of ours
with a POST to the endpoint), and the answers to a request whose ReplyTo is a WS-MC anonymous URI carry it as
their ``To`` (``reply_destination``).

A peer without WS-MC answers a MakeConnection with a bare HTTP 202 (gSOAP does), exactly as a peer that holds
nothing for us. The poller cannot tell them apart from one answer; it reports a peer that has answered
``SUSPECT_POLLS`` polls in a row and for ``SUSPECT_SECONDS`` with a bare 202 without ever returning a message
to a poll: a warning in the log (then at most every ``REPORT_INTERVAL``), and ``polled-peers.json`` in the
node's log folder, which ``qtp status`` shows (``_status.polled_peers``). Such a peer is polled, backing off
to ``poll_interval_max``, for as long as the node runs.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping
from urllib.parse import quote

from qtp.errors import TransportError
from qtp.wsrm.codec import (
    BATCH_CONTENT_TYPE,
    MAKE_CONNECTION_ACTION,
    MISSING_SELECTION,
    UNSUPPORTED_SELECTION,
    Addressing,
    BatchRoom,
    Envelope,
    InvalidMessage,
    MakeConnection,
    SoapFault,
    anonymous,
    batch_accept,
    decode_batch,
    framed_size,
    mc_anonymous,
    mc_id,
)
from qtp.wsrm.protocol import CreateSequence, RMVersion, SequenceAcknowledgement
from qtp.wsrm.runtime._answers import NOTHING, Answer, fault, read_answer
from qtp.wsrm.runtime._ownership import Source
from qtp.wsrm.runtime._ports import SYSTEM_CLOCK, Clock
from qtp.wsrm.runtime._refusals import RefusalWarnings
from qtp.wsrm.runtime._security import Security
from qtp.wsrm.runtime._sequences import Destinations, Sources
from qtp.wsrm.runtime._status import POLLED_PEERS_FILE
from qtp.wsrm.runtime._transport import Transport, wire

log = logging.getLogger("qtp.wsrm.mailbox")
_too_large = RefusalWarnings(summary="%s more poll(s) found a held message too large for its client (%s) in the "
                             "last %.0f s")
_unread = RefusalWarnings(summary="%s more poll answer(s) over this node's max_response_bytes (%s) in the last %.0f s")

_SPARE = len("false") - len("true")  # the last envelope given is written again with MessagePending false
SUSPECT_POLLS = 5          # bare 202 answers in a row, and
SUSPECT_SECONDS = 60.0     # for this long, from a peer that never returned a message to a poll: reported
REPORT_INTERVAL = 600.0    # the warning again, at most this often, while it lasts


def _answer_size(parts: list[bytes]) -> int:
    """The body of the answer that gives ``parts``: one standard envelope alone, else a qtp batch."""
    return len(parts[0]) if len(parts) == 1 else framed_size(parts)


def node_address(node_id: str) -> str:
    """The WS-MC anonymous URI a node without an endpoint is reached at: stable across restarts."""
    return mc_anonymous("urn:qtp:node:" + quote(node_id, safe=""))


@dataclass
class _Held:
    envelope: Envelope
    identifier: str | None  # the sequence the envelope is about
    key: str | None = None  # our RM Source sequence, for a message of it (None: an acknowledgement)
    number: int | None = None
    given_at: float = float("-inf")  # monotonic time a poll last took it


class Mailbox:
    """What is held for peers that poll. ``_mutex`` guards the boxes; it is never held while anything else
    is locked or read."""

    def __init__(self, limits: Any, metrics: Any, sources: Sources, destinations: Destinations,
                 endpoint: str | None, clock: Clock = SYSTEM_CLOCK):
        self.limits = limits
        self.endpoint = endpoint
        self.metrics = metrics
        self.sources = sources
        self.destinations = destinations
        self.clock = clock
        self._mutex = threading.Lock()
        self._boxes: dict[tuple[str | None, str], dict[tuple[Any, ...], _Held]] = {}

    # ------------------------------------------------------------------ what the node would have POSTed

    def hold(self, owner: str | None, client: str, envelope: Envelope, key: str | None = None) -> None:
        """Keep ``envelope`` for ``client`` (a WS-MC id) of peer ``owner``, replacing an older copy of it."""
        identifier = _about(envelope)
        if envelope.sequence is not None:
            slot: tuple[Any, ...] = ("message", key, envelope.sequence.number)
            held = _Held(envelope, identifier, key, envelope.sequence.number)
        elif envelope.acks and envelope.body is None:
            slot, held = ("ack", identifier), _Held(envelope, identifier)
        else:
            slot, held = ("control", key, type(envelope.body).__name__), _Held(envelope, identifier, key)
        with self._mutex:
            box = self._boxes.setdefault((owner, client), {})
            known = box.get(slot)
            if known is not None:
                held.given_at = known.given_at
            box[slot] = held

    def holds(self, owner: str | None, client: str, key: str) -> set[int]:
        """The numbers of our sequence ``key`` held for ``client`` of peer ``owner``: the sender need not
        hold them again (they are given again by themselves until acknowledged)."""
        with self._mutex:
            box = self._boxes.get((owner, client), {})
            return {slot[2] for slot in box if slot[0] == "message" and slot[1] == key}

    def forget(self, key: str) -> None:
        """Our sequence ``key`` ended: what is held of it goes (its unacknowledged messages stay in the store)."""
        with self._mutex:
            for box in self._boxes.values():
                for slot in [slot for slot, held in box.items() if held.key == key]:
                    del box[slot]

    # ------------------------------------------------------------------ polls

    def answer(self, env: Envelope, poll: MakeConnection, caller: str | None, room: BatchRoom | None = None) -> Answer:
        """The answer to a MakeConnection from ``caller``: one held message (200), nothing (202), or a fault; or,
        for a qtp poller that takes a batch (``room``, from its Accept header), as many held messages as
        ``room`` allows, when there are two or more."""
        metrics = self.metrics
        if poll.unsupported:
            metrics.polls.labels(result="fault").inc()
            return fault(env, SoapFault(
                "Receiver", UNSUPPORTED_SELECTION, "The extension element used in the message selection is not "
                "supported by the MakeConnection receiver", unsupported=poll.unsupported))
        if poll.address is None and poll.identifier is None:
            metrics.polls.labels(result="fault").inc()
            return fault(env, SoapFault("Receiver", MISSING_SELECTION,
                                        "The MakeConnection element did not contain any selection criteria"))
        client = mc_id(poll.address)
        if poll.address is not None and client is None:
            metrics.polls.labels(result="fault").inc()
            return fault(env, SoapFault("Receiver", UNSUPPORTED_SELECTION,
                                        "the Address is not a WS-MakeConnection anonymous URI"))
        return self._fill(caller, client, poll.identifier, room)

    def _answerable(self, addressing: Addressing) -> Addressing:
        """``addressing`` with ReplyTo = this node's endpoint: a message given on a poll's response can be
        answered only by a POST there (whatever it said when it was held: anonymous, for the back channel)."""
        if self.endpoint is None or addressing.reply_to == self.endpoint:
            return addressing
        return replace(addressing, reply_to=self.endpoint)

    def _given(self, envelope: Envelope, pending: bool, acks: tuple[SequenceAcknowledgement, ...] = ()) -> Envelope:
        """``envelope`` as a poll is given it."""
        return replace(envelope, message_pending=pending, acks=envelope.acks + acks,
                       addressing=self._answerable(envelope.addressing))

    def _ready(self, owner: str | None, client: str | None, identifier: str | None,
               now: float) -> list[tuple[tuple[Any, ...], _Held, dict[tuple[Any, ...], _Held]]]:
        """What may go to a poll now, in the order it goes: messages lowest number first, then
        acknowledgements, then control messages (``_mutex`` held)."""
        again = self.limits.retransmit_interval
        ready = [(slot, held, box) for (o, c), box in self._boxes.items() if o == owner and client in (None, c)
                 for slot, held in box.items()
                 if (identifier is None or held.identifier == identifier) and now - held.given_at >= again]
        order = {"message": 0, "ack": 1, "control": 2}
        ready.sort(key=lambda r: (order[r[0][0]], r[1].key or "", r[1].number or 0))
        return ready

    def _mark_polled(self, held: _Held) -> None:
        seq = None if held.key is None else self.sources.get(held.key)
        if seq is not None and seq.offered:  # a poll took something of it: it lives on
            seq.polled = True

    def _fill(self, owner: str | None, client: str | None, identifier: str | None, room: BatchRoom | None) -> Answer:
        """The answer to a poll of ``client`` (or, with ``client`` None, of any of ``owner``'s clients), only
        about sequence ``identifier`` when given. Messages of one client go first, lowest number first, the
        acknowledgements held for that client riding on the first; with no message, one acknowledgement or
        control message goes (once: its sender asks again if it is lost). Another stack's poll (``room``
        None) takes one message. A qtp poller's takes as many as ``room`` allows (count and bytes), and
        nothing it could not read: the acknowledgements ride only when they fit (else they wait for the next
        poll), and a message larger than it reads in one answer is never given to it (it would poll for it
        again at once): it waits, reported, until the poller's limit is raised."""
        self._drop_acknowledged()
        now = self.clock.monotonic()
        with self._mutex:
            ready = self._ready(owner, client, identifier, now)
            if not ready:
                self.metrics.polls.labels(result="empty").inc()
                return NOTHING
            slot, held, box = ready[0]
            self._mark_polled(held)
            if slot[0] != "message":
                del box[slot]
                self.metrics.polls.labels(result="message").inc()
                return Answer(self._given(held.envelope, len(ready) > 1), 200)
            acks = [(s, h) for s, h, b in ready if s[0] == "ack" and b is box]
            riding = tuple(a for _, h in acks for a in h.envelope.acks)
            messages = [h for s, h, b in ready if s[0] == "message" and b is box][:1 if room is None else room.most]
            envelopes, parts, too_large, carried = self._pack(messages, riding, room)
            went = len(envelopes)  # messages given
            for entry in messages[len(too_large):len(too_large) + went]:
                entry.given_at = now
            if not envelopes and acks:  # every message was too large for the poller: its acknowledgements go
                envelopes, carried = [self._given(acks[0][1].envelope, True, tuple(
                    a for _, h in acks[1:] for a in h.envelope.acks))], True
            if carried:
                for s, _ in acks:
                    del box[s]
            used = went + (len(acks) if carried else 0)
            more = len(ready) - used - len(too_large) > 0
        if too_large and room is not None:
            self._report_too_large(owner, client, too_large, room)
        if not envelopes:
            self.metrics.polls.labels(result="empty").inc()
            return NOTHING
        self.metrics.polls.labels(result="message").inc()
        if not more:  # the last says that nothing more waits
            envelopes[-1] = replace(envelopes[-1], message_pending=False)
        self.metrics.poll_batch.observe(len(envelopes))
        if len(envelopes) == 1:
            return Answer(envelopes[0], 200)
        if not more:
            parts[-1] = wire(envelopes[-1])
        return Answer(envelopes[0], 200, tuple(parts))

    def _pack(self, messages: list[_Held], riding: tuple[SequenceAcknowledgement, ...],
              room: BatchRoom | None) -> tuple[list[Envelope], list[bytes], list[_Held], bool]:
        """The envelopes (and their bytes) of ``messages`` that fit in ``room``, in order, the ``riding``
        acknowledgements on the first when they fit with it; the leading messages too large for ``room``
        even alone (skipped); and whether the acknowledgements went. Without ``room`` (another stack's poll:
        one message, its size unknown to us) everything fits and nothing is encoded here."""
        if room is None:
            return [self._given(held.envelope, True, riding) for held in messages], [], [], bool(riding)
        envelopes: list[Envelope] = []
        parts: list[bytes] = []
        too_large: list[_Held] = []
        carried = False
        for held in messages:
            envelope = self._given(held.envelope, True)
            data = wire(envelope)
            if not parts and riding:
                with_acks = self._given(held.envelope, True, riding)
                if _answer_size([with_data := wire(with_acks)]) + _SPARE <= room.size:
                    envelope, data, carried = with_acks, with_data, True
            if _answer_size([*parts, data]) + _SPARE > room.size:
                if parts:
                    break  # the rest go on the next poll
                too_large.append(held)
                continue
            envelopes.append(envelope)
            parts.append(data)
        return envelopes, parts, too_large, carried

    def _report_too_large(self, owner: str | None, client: str | None, held: list[_Held], room: BatchRoom) -> None:
        """A poll found ``held`` too large for its poller: counted once per poll, warned at most once a minute."""
        self.metrics.polls.labels(result="too_large").inc()
        _too_large.warn(log, "held", "message %s of sequence %s is larger than the client %s of peer %s reads in "
                        "one answer (%d bytes, its [limits] max_response_bytes): it is not given, and the messages "
                        "after it wait behind it, until that client's limit is raised", held[0].number,
                        held[0].identifier, client, owner or "(anonymous)", room.size)

    def _drop_acknowledged(self) -> None:
        """Forget messages acknowledged since they were held, acknowledgements of inbound sequences the
        node has forgotten, control messages of outbound sequences it has forgotten, and empty boxes."""
        with self._mutex:
            entries = [(box, slot, held) for box in self._boxes.values() for slot, held in box.items()]
        waiting = {key: self._unacknowledged(key) for key in {h.key for _, s, h in entries if s[0] == "message"}}
        gone = [(box, slot) for box, slot, held in entries
                if (slot[0] == "message" and held.number not in waiting[held.key])
                or (slot[0] == "ack" and (held.identifier or "") not in self.destinations)
                or (slot[0] == "control" and (held.key or "") not in self.sources)]
        with self._mutex:
            for box, slot in gone:
                box.pop(slot, None)
            for key in [k for k, box in self._boxes.items() if not box]:
                del self._boxes[key]

    def _unacknowledged(self, key: str | None) -> set[int]:
        seq = None if key is None else self.sources.get(key)
        return set() if seq is None else seq.unacknowledged()

    def waiting(self) -> dict[tuple[str | None, str], int]:
        """Messages held per (peer, WS-MC id), for /metrics and the log."""
        self._drop_acknowledged()
        with self._mutex:
            return {k: sum(1 for s in box if s[0] == "message") for k, box in self._boxes.items() if box}


class Poller:
    """The MakeConnection loop of a node without an endpoint, one thread per peer of its reply channels."""

    def __init__(self, address: str, channels: Mapping[str, Any], limits: Any, transport: Transport, metrics: Any,
                 security: Security, handle: Callable[[Envelope, Source], Answer],
                 handle_batch: Callable[[list[Envelope], Source], Answer], log_dir: Path | None = None,
                 clock: Callable[[], float] = time.time):
        self.address = address
        self.channels = channels
        self.limits = limits
        self.transport = transport
        self.metrics = metrics
        self.security = security
        self._handle = handle
        self._handle_batch = handle_batch
        self._accept = batch_accept(limits.max_batch, limits.max_response_bytes)
        self.peers_seen = PolledPeers(None if log_dir is None else Path(log_dir) / POLLED_PEERS_FILE,
                                      limits.poll_interval_max, clock)
        self._acks: dict[str, dict[str, SequenceAcknowledgement]] = {}
        self._mutex = threading.Lock()

    def peers(self) -> list[str]:
        return sorted({c.peer for c in self.channels.values() if _polled(c)})

    def run(self, peer: str, stopping: threading.Event) -> None:
        limits = self.limits
        delay = limits.poll_interval_min
        while not stopping.is_set():
            try:
                got, more = self.poll(peer)
            except Exception:  # the loop survives anything; the peer keeps what it holds
                log.exception("polling %s failed", peer)
                got, more = False, False
            if more or (got and self.has_acks(peer)):  # more waits, or an acknowledgement to deliver
                continue
            delay = limits.poll_interval_min if got else min(limits.poll_interval_max, delay * 2)
            stopping.wait(delay)

    def poll(self, peer: str) -> tuple[bool, bool]:
        """One MakeConnection to ``peer``: (a message came, the peer says more wait)."""
        channel = next(c for c in self.channels.values() if _polled(c) and c.peer == peer)
        wsa = channel.wsa
        with self._mutex:
            acks = tuple(self._acks.pop(peer, {}).values())
        poll = Envelope(soap=channel.soap, rm=RMVersion.WSRM11, wsa=wsa, acks=acks, body=MakeConnection(self.address),
                        addressing=Addressing(action=MAKE_CONNECTION_ACTION, to=peer,
                                              message_id=f"urn:uuid:{uuid.uuid4()}", reply_to=anonymous(wsa)))
        try:
            reply = self.transport.post(peer, wire(poll), poll.soap, MAKE_CONNECTION_ACTION, accept=self._accept)
        except TransportError as exc:
            if "max_response_bytes" in str(exc):  # read again it would be refused again: say so
                _unread.warn(log, "poll", "the answer to a poll of %s is larger than this node reads (%s); raise "
                             "[limits] max_response_bytes", peer, exc)
            else:
                log.debug("poll of %s failed: %s", peer, exc)
            self._keep(peer, acks)
            return False, False
        self.metrics.polls.labels(result="sent").inc()
        if not reply.body.strip():
            self.peers_seen.empty(peer, reply.status)
            return False, False
        try:
            messages = self._read(peer, reply)
        except InvalidMessage as exc:
            log.warning("unreadable answer to a poll (HTTP %d) from %s: %s", reply.status, peer, exc)
            return False, False
        if not messages:
            return False, False
        self.peers_seen.message(peer)
        source = Source.answer(self.security, peer)
        answer = self._handle(messages[0], source) if len(messages) == 1 else self._handle_batch(messages, source)
        back = answer.envelope
        if back is not None and back.body is None and back.sequence is None and not back.ack_requests:
            self._keep(peer, back.acks)  # on the next poll
        elif back is not None:
            try:
                self.transport.post(peer, wire(back), back.soap, back.addressing.action)
            except TransportError as exc:
                log.debug("answer to a polled message not delivered to %s: %s", peer, exc)
        return True, bool(messages[-1].message_pending)

    def _read(self, peer: str, reply: Any) -> list[Envelope]:
        """What ``peer`` gave on a poll's answer: one envelope, or a qtp batch of sequence messages; nothing
        when it is a fault, a CreateSequence, or a batch holding anything else (each logged)."""
        media = reply.content_type.split(";", 1)[0].strip().lower()
        if media != BATCH_CONTENT_TYPE:
            message = read_answer(reply.body, peer, self.metrics)
            if isinstance(message.body, SoapFault) and message.sequence is None:  # (a fault *reply* has a Sequence)
                log.warning("%s refused a poll: %s", peer, message.body.reason)
                return []
            if isinstance(message.body, CreateSequence):  # a peer we poll cannot open sequences here
                log.warning("%s answered a poll with a CreateSequence; ignored", peer)
                return []
            return [message]
        messages = [read_answer(part, peer, self.metrics) for part in decode_batch(reply.body, self.limits.max_batch)]
        if any(m.sequence is None or m.body is not None and not isinstance(m.body, SoapFault) for m in messages):
            log.warning("%s answered a poll with a batch that holds more than sequence messages; ignored", peer)
            return []
        return messages

    def has_acks(self, peer: str) -> bool:
        with self._mutex:
            return bool(self._acks.get(peer))

    def _keep(self, peer: str, acks: tuple[SequenceAcknowledgement, ...]) -> None:
        with self._mutex:
            kept = self._acks.setdefault(peer, {})
            for ack in acks:
                kept[ack.identifier] = ack  # acknowledgements only grow: the newest covers the older


@dataclass
class PeerPolls:
    """What one polled peer answered since the node started (times: seconds since the epoch)."""

    peer: str
    messages: int = 0                 # polls it answered with a message
    empty_in_a_row: int = 0           # polls answered with an empty body (202) since the last message
    empty_since: float | None = None  # when that run of empty answers began
    last_status: int | None = None
    suspect: bool = False             # reported: maybe no WS-MakeConnection (see the module docstring)
    reported_at: float | None = field(default=None, repr=False)


class PolledPeers:
    """The poller's view of each peer it polls; reports the ones that look like they lack WS-MC."""

    def __init__(self, path: Path | None, interval: float, clock: Callable[[], float] = time.time):
        self.path = path
        self.interval = interval  # how often an idle peer is polled ([limits] poll_interval_max)
        self._clock = clock
        self._mutex = threading.Lock()
        self._peers: dict[str, PeerPolls] = {}
        try:
            if path is not None:  # (None: reported in the log only)
                path.unlink(missing_ok=True)  # what an earlier run of the node reported: polled afresh now
        except OSError as exc:
            log.warning("could not remove %s: %s", path, exc)

    def empty(self, peer: str, status: int) -> None:
        """``peer`` answered a poll with ``status`` and an empty body."""
        now = self._clock()
        with self._mutex:
            seen = self._peers.setdefault(peer, PeerPolls(peer))
            seen.empty_in_a_row += 1
            seen.last_status = status
            if seen.empty_since is None:
                seen.empty_since = now
            due = (seen.messages == 0 and seen.empty_in_a_row >= SUSPECT_POLLS
                   and now - seen.empty_since >= SUSPECT_SECONDS
                   and (seen.reported_at is None or now - seen.reported_at >= REPORT_INTERVAL))
            if due:
                seen.suspect, seen.reported_at = True, now
                polls, seconds = seen.empty_in_a_row, now - seen.empty_since
        if due:
            log.warning("%s answered %d polls in a row over %.0f s with an empty HTTP %d and never a message: it "
                        "may not support WS-MakeConnection (gSOAP does not), and then the replies and "
                        "acknowledgements this node fetches from it never come; it is polled every %.0f s for as "
                        "long as the node runs (docs/interop.md, WS-MakeConnection)", peer, polls, seconds, status,
                        self.interval)
            self._save()

    def message(self, peer: str) -> None:
        """``peer`` answered a poll with a message: it speaks WS-MC."""
        with self._mutex:
            seen = self._peers.setdefault(peer, PeerPolls(peer))
            cleared = seen.suspect
            seen.messages += 1
            seen.empty_in_a_row, seen.empty_since, seen.suspect = 0, None, False
        if cleared:
            log.info("%s answered a poll with a message: it does support WS-MakeConnection", peer)
            self._save()

    def snapshot(self) -> list[PeerPolls]:
        with self._mutex:
            return [replace(p) for p in sorted(self._peers.values(), key=lambda p: p.peer)]

    def _save(self) -> None:
        """Write the peers to ``path`` (atomically) for ``qtp status``; a failure is logged, not raised."""
        if self.path is None:
            return
        now = self._clock()
        peers = [{k: v for k, v in asdict(p).items() if k not in ("reported_at", "empty_since")}
                 | {"empty_for_s": None if p.empty_since is None else round(now - p.empty_since, 3)}
                 for p in self.snapshot()]
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            temporary = self.path.with_name(self.path.name + ".tmp")
            temporary.write_text(json.dumps({"updated_at": now, "peers": peers}, indent=1))
            os.replace(temporary, self.path)
        except OSError as exc:
            log.warning("could not write %s: %s", self.path, exc)


def _about(envelope: Envelope) -> str | None:
    """The sequence an envelope is about: its Sequence header's, its body's (Close, Terminate, a fault), its
    AckRequested's, or (an acknowledgement alone) its first acknowledgement's."""
    if envelope.sequence is not None:
        return envelope.sequence.identifier
    return getattr(envelope.body, "identifier", None) or next(
        (h.identifier for h in (*envelope.ack_requests, *envelope.acks)), None)


def _polled(channel: Any) -> bool:
    """A channel of a node without an endpoint whose replies or acknowledgements are fetched by polling."""
    return channel.reply or channel.acks_to == "poll"
