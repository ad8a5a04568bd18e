"""MessageIDs the node makes: they also tell a qtp peer when the message was enqueued (for its latency
histogram)."""

from __future__ import annotations

import re
import uuid

_ENQUEUED_PREFIX = "urn:qtp:m:"


def new_message_id(now: float) -> str:
    return f"{_ENQUEUED_PREFIX}{int(now * 1_000_000)}:{uuid.uuid4().hex}"


def enqueued_at(message_id: str) -> float | None:
    if not message_id.startswith(_ENQUEUED_PREFIX):
        return None
    stamp = message_id[len(_ENQUEUED_PREFIX):].split(":", 1)[0]
    return int(stamp) / 1_000_000 if stamp.isdigit() else None


def create_message_id(key: str) -> str:
    """The MessageID of a sequence's CreateSequence, the same on every retransmission, so the destination
    can answer a repeated request with the sequence it already made."""
    return f"urn:uuid:{uuid.UUID(hex=key)}"


def new_identifier(tag: str = "") -> str:
    """A sequence Identifier this node makes (its RM Destination's, or an Offer's). ``tag``: a slot of a node
    whose replicas share the work (``<node>:s<k>``), which any replica reads back from the identifier to route
    the sequence's messages to the replica that holds the slot (qtp.wsrm.runtime._shared)."""
    return f"urn:qtp:{tag}:{uuid.uuid4()}" if tag else f"urn:uuid:{uuid.uuid4()}"


SLOT_QUERY = "qtp-slot"  # AcksTo of a shared node's slot: <endpoint>?qtp-slot=<k>
_SLOT_OF = re.compile(r"^urn:qtp:.+:s(\d{1,9}):[0-9a-f]{8}-[0-9a-f-]{27}$")


def slot_tag(node: str, slot: int) -> str:
    return f"{node}:s{slot}"


def slot_of(identifier: str | None) -> int | None:
    """The slot a sequence ``identifier`` of a node whose replicas share the work names (None: it names none).
    A qtp sender puts it in the URL of the sequence's requests (``?qtp-slot=k``), where a balancer can route
    on it to the replica holding the slot without reading the body (docs/operations.md, "The balancer")."""
    found = _SLOT_OF.match(identifier) if identifier else None
    return int(found.group(1)) if found is not None else None
