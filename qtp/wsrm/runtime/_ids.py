"""MessageIDs the node makes: they also tell a qtp peer when the message was enqueued (for its latency
histogram)."""

from __future__ import annotations

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
