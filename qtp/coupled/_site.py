"""What both sides of coupled messaging use of their node: its store and channels, its peers, its limits,
and the one way a control message leaves (``Site.send``). The sender (``_sender``) and the recipient
(``_recipient``) reach the node only through this object.

Peer binding, failing closed: a control message about a coupling is taken only from the party the coupling
is bound to. Two checks, both required:

- the coupling's *token*, a secret the sender chose for this one original and recipient, which every
  control message about it carries (a peer that never saw the original cannot name it);
- the *identity*: the authenticated peer that sent the original (recorded at the recipient) must send its
  decisions, and the peer the runtime resolves for a channel's address (``Security.peer_for_url``, the
  same comparison the runtime uses everywhere) must send the recipient's reports. An authenticated
  message about a coupling whose channel no configured peer matches is refused, not waved through.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from qtp.coupled._wire import ACTION, Control, encode
from qtp.errors import ConfigurationError, MessageRefusedError
from qtp.wsrm.store import Outgoing

log = logging.getLogger("qtp.coupled")


class Site:
    def __init__(self, node: Any, replies: dict[str, str] | None = None):
        self.node = node
        self.manager = node.manager
        self.replies = dict(replies or {})
        inbound = node.inbound_store
        if node.inbound_mode != "xa" or not hasattr(inbound, "engine"):
            raise ConfigurationError("coupled messaging needs the node's store in mode \"xa\" on a SQL database: "
                                     "its state joins the transactions it couples")
        self.store = inbound
        for channel in self.replies.values():
            self.channel(channel)

    @property
    def node_id(self) -> str:
        return self.manager.node_id

    @property
    def limits(self) -> Any:
        return self.node.limits

    @property
    def stopping(self) -> Any:
        return self.node.stopping

    def conn(self, tx: Any) -> Any:
        """The inbound store's connection inside ``tx`` (the recipient's rows live there)."""
        return tx.connection(self.node.settings.store)

    def channel(self, name: str) -> tuple[Any, Any]:
        """A channel's settings and store, refused unless it can carry coupled messages."""
        settings = self.node.channels.get(name)
        if settings is None:
            known = ", ".join(sorted(self.node.channels)) or "none"
            raise ConfigurationError(f"unknown channel {name!r} on node {self.node_id!r} (known: {known})")
        if settings.mode != "xa" or settings.store is None:
            raise ConfigurationError(f"channel {name!r}: coupled messages need mode \"xa\" with a SQL store")
        return settings, self.node.store_for(settings.store, settings.mode)

    def coupled_stores(self) -> list[Any]:
        """Every store a sphere-log row can be in (each coupled channel's), once."""
        found = [self.node.store_for(c.store, c.mode) for c in self.node.channels.values()
                 if c.mode == "xa" and c.store is not None]
        return list({id(s): s for s in found}.values())

    def store_resources(self) -> list[str]:
        return sorted({c.store for c in self.node.channels.values() if c.mode == "xa" and c.store})

    def outgoing(self, channel: str, coupling_id: str, kind: str, body: bytes) -> Outgoing:
        """An encoded control message of ``kind`` as a message of ``channel``, in the lane of its coupling."""
        settings = self.node.channels[channel]
        return Outgoing(route=settings.route_for(coupling_id), message_id=f"urn:uuid:{uuid.uuid4()}",
                        action=ACTION[kind], payload=body, enqueued_at=time.time())

    def enqueue(self, conn: Any, channel: str, control: Control) -> None:
        """Write ``control`` into ``channel``'s store on ``conn`` (a local or global transaction's)."""
        settings, store = self.channel(channel)
        store.enqueue(conn, self.outgoing(channel, control.id, control.kind, encode(control)))

    def send(self, tx: Any, channel: str, control: Control) -> None:
        self.node.enqueue(tx, channel, encode(control), action=ACTION[control.kind], key=control.id)

    def wake_sender(self) -> None:
        self.node.wake()

    # ------------------------------------------------------------------ peers

    def owner(self, message: Any) -> str | None:
        """The authenticated peer that sent ``message`` (None: anonymous)."""
        info = self.node.destinations.info(message.identifier)
        return None if info is None else info.owner

    def peer_of(self, channel: str) -> str | None:
        """The configured peer whose address a channel sends to (None: no peer matches it)."""
        security = self.node.settings.security
        peer = security.peer_for_url(self.node.channels[channel].peer)
        return None if peer is None else peer.name

    def from_recipient(self, owner: str | None, channel: str) -> bool:
        """Whether ``owner`` may report about an original sent on ``channel``: the channel's peer only; an
        authenticated peer is refused for a channel no peer matches (fail closed)."""
        expected = self.peer_of(channel)
        if owner == expected:
            return True
        log.warning("peer %s sent a coupled message about an original sent on channel %s (to %s): refused",
                    owner or "(anonymous)", channel, expected or "an address no configured peer matches")
        return False

    def reply_channel(self, coordinator: str | None, owner: str | None) -> str:
        """The channel this node answers coupled sender ``coordinator`` on: one named in ``replies``, else one
        named like the sender's node, else the node's only channel; when the sender is an authenticated
        peer, that channel must lead to it. MessageRefusedError when there is none: an original or decision
        that cannot be answered is refused once, as a dead letter, never retried."""
        name = self.replies.get(coordinator or "")
        if name is None and coordinator in self.node.channels:
            name = coordinator
        if name is None and len(self.node.channels) == 1:
            name = next(iter(self.node.channels))
        if name is None:
            raise MessageRefusedError(
                f"node {self.node_id!r} has no channel back to coupled sender {coordinator!r}: name one in "
                f"Coupled(node, replies={{{coordinator!r}: 'CHANNEL'}}) or call the channel {coordinator!r}")
        if owner is not None and self.peer_of(name) != owner:
            raise MessageRefusedError(f"peer {owner} names coupled sender {coordinator!r}, whose channel {name!r} "
                                      f"leads to {self.peer_of(name) or 'no configured peer'}")
        return name
