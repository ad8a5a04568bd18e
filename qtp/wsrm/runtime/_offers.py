"""The offer lifecycle, in one place: sequences offered for replies, in both directions.

*We offer* (a request-reply channel's CreateSequence carries an ``Offer``): before the CreateSequence can
leave, the offered identifier becomes one of our RM Destinations (``expect``), so the peer's first reply
finds it. *A peer offers* (its CreateSequence has one and we accept it): our RM Source for the replies is
created in the same local transaction as the inbound sequence (``accept``, route ``offer:<identifier>``,
born ACTIVE: it cannot be created again) and registered after that commit (``adopt``).

An offered sequence of ours ends with the inbound sequence that accepted it: once that one is over and
every message of it applied (``inbound_finished``), the offered route is marked ``ending`` and the sender
ends it once its replies are numbered, sent and acknowledged (or at once when it carried none).

The receiver counts a peer's offered sequences and their unacknowledged replies against its quotas
(``of``, ``replies_waiting``).
"""

from __future__ import annotations

import logging
import threading
import uuid
from typing import Any, Callable

from qtp.wsrm.codec import mc_id
from qtp.wsrm.protocol import DestinationRecord, DestinationState, RMVersion, SourceRecord, SourceState
from qtp.wsrm.runtime._ports import Clock
from qtp.wsrm.runtime._sequences import Destinations, Inbound, Outbound, Sources, ended
from qtp.wsrm.store import DestinationInfo, SourceInfo, Store

log = logging.getLogger("qtp.wsrm.offers")


def offer_route(identifier: str) -> str:
    return f"offer:{identifier}"


class Offers:
    def __init__(self, store: Store, sources: Sources, destinations: Destinations, limits: Any,
                 peer_for_url: Callable[[str], Any], wake: Callable[[], None], clock: Clock):
        self.store = store  # the inbound store: where our destinations are, and a peer's offered routes
        self.sources = sources
        self.destinations = destinations
        self.limits = limits
        self._peer_for_url = peer_for_url
        self._wake = wake
        self._clock = clock
        self._mutex = threading.Lock()
        self._ending: set[str] = set()  # offered routes to end once their replies are numbered

    # ------------------------------------------------------------------ we offer

    def expect(self, identifier: str, route: str, channel: Any) -> None:
        """Our RM Source on ``route`` is about to offer ``identifier``: be its destination first."""
        record = DestinationRecord(identifier, channel.wsrm, state=DestinationState.ACTIVE,
                                   last_activity=self._clock.time(),
                                   inactivity_timeout=self.limits.inactivity_timeout)
        peer = self._peer_for_url(channel.peer)
        info = DestinationInfo(channel=route, soap=channel.soap.value, wsa=channel.wsa.value,
                               owner=None if peer is None else peer.name)
        with self.store.local() as s:
            self.store.save_destination(s, info, record)
        self.destinations.add(Inbound(info, record))

    def accepted(self, identifier: str) -> None:
        log.info("the peer accepted offered sequence %s for replies", identifier)

    # ------------------------------------------------------------------ a peer offers

    def in_use(self, identifier: str) -> bool:
        """``identifier`` names a sequence of ours already (either side)."""
        return identifier in self.destinations or self.sources.by_identifier(identifier) is not None or \
            self.sources.has_offer_route(offer_route(identifier))

    def accept(self, s: Any, identifier: str, peer: str, rm: RMVersion, soap: str, wsa: str,
               batch: int | None = None, owner: str | None = None) -> Outbound:
        """Our RM Source for the replies on a peer's offered ``identifier``, saved in session ``s`` of the
        inbound store; ``adopt`` it after that session committed. ``batch``: the qtp peer takes batches of up
        to that many messages (its CreateSequence said so)."""
        # A WS-MC peer's mailbox gives what it holds again by itself: the timers need only hold it again after
        # a restart (and control messages, given once), so they back off without the usual cap.
        backoff = self.limits.offer_inactivity_timeout if mc_id(peer) else self.limits.retransmit_interval_max
        record = SourceRecord(key=uuid.uuid4().hex, version=rm, state=SourceState.ACTIVE, identifier=identifier,
                              retransmit_interval=self.limits.retransmit_interval, max_interval=backoff,
                              peer_batch=min(batch, self.limits.max_batch) if batch else 1)
        info = SourceInfo(offer_route(identifier), peer, soap, wsa, owner=owner)
        self.store.create_source(s, info, record)
        return Outbound(info, record, self.limits)

    def adopt(self, seq: Outbound) -> None:
        self.sources.add(seq, current=True)
        self._wake()

    # ------------------------------------------------------------------ quotas

    def of(self, owner: str | None) -> set[str]:
        """The identifiers of the offered sequences of peer ``owner`` (None: anonymous) that have not ended."""
        return {seq.identifier or "" for seq in self.sources.all()
                if seq.offered and seq.info.owner == owner and not ended(seq.machine)}

    def replies_waiting(self, owner: str | None, offer: str | None = None) -> tuple[int, bool]:
        """Replies sent to peer ``owner`` on its offered sequences and not acknowledged; and whether the
        window (``max_unacknowledged``) of offered sequence ``offer`` is full, so that further replies would
        wait unnumbered in the store."""
        route = offer_route(offer or "")
        waiting, full = 0, False
        for seq in self.sources.all():
            if seq.offered and seq.info.owner == owner:
                pending = len(seq.machine.record.pending)
                waiting += pending
                if seq.info.route == route:
                    full = pending >= self.limits.max_unacknowledged
        return waiting, full

    # ------------------------------------------------------------------ the end

    def inbound_finished(self, identifier: str) -> None:
        """Every message of ended inbound sequence ``identifier`` was applied: only its record stays (late
        messages still get SequenceTerminated, not UnknownSequence, until ``ended_retention``), and the
        sequence it accepted for replies ends once those are sent and acknowledged."""
        seq = self.destinations.get(identifier)
        with self.store.local() as s:
            self.store.drop_destination(s, identifier)
            if seq is not None:
                self.store.save_destination(s, seq.info, seq.machine.record)
        offer = None if seq is None else seq.machine.record.accepted_offer
        if offer is not None and self.sources.has_offer_route(offer_route(offer)):
            with self._mutex:
                self._ending.add(offer_route(offer))
            self._wake()

    def ending(self) -> list[str]:
        """The offered routes to end (``done`` takes one off once it is ended or ending)."""
        with self._mutex:
            return list(self._ending)

    def done(self, route: str) -> None:
        with self._mutex:
            self._ending.discard(route)
