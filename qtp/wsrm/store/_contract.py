"""The store contract: where a node keeps its WS-RM state, written once.

A node's reliable-messaging state is six kinds of record, after the storage API of the Mercury
dissertation (seed 000, chapter 4):

- **outgoing messages** (RM Source side): enqueued by an application transaction on a *route* (a channel
  name, or ``offer:<identifier>`` for the replies of an offered sequence), numbered later by the sender
  (sequence key + message number), deleted once acknowledged;
- **source records**: one ``SourceRecord`` per RM Source sequence (``to_row`` / ``from_row``);
- **destination records**: one ``DestinationRecord`` per RM Destination sequence, with the facts the
  runtime needs beside the machine (where replies go, which channel an offered sequence belongs to);
- **incoming messages**: the payloads the destination accepted, stored before they are acknowledged and
  deleted by the transaction that applies them (the *dequeue*);
- **invoker records**: one ``InvokerRecord`` per destination sequence, the numbers already applied;
- **dead letters**: messages whose handler kept failing, with the error text;
- **applied message ids**: the WS-Addressing MessageID of every message applied in ``xa`` mode, kept for
  ``dedup_retention``; a message sent again in a *new* sequence (its sender lost the acknowledgements
  and the destination forgot the old sequence) keeps its MessageID and is recognised here, consumed and
  not applied again.

Every method takes a *session* ``s`` as its first argument. A session is the store's unit of atomicity:

- ``with store.local() as s:`` a local transaction of the store (the sender's numbering, the endpoint's
  receive path, acknowledgements): committed when the block ends, rolled back on an exception;
- the store's part of a global transaction ``tx`` (the runtime's ``Stores.enlisted(tx, channel)``, the one
  place that looks at a channel's mode). For a SQL store in ``xa`` mode the session is the branch connection
  of its resource (``tx.connection(name)``), so enqueue and dequeue commit or roll back with the
  application's own updates, in one local commit when the application's database is the store's. In
  ``memory`` and ``persistent`` modes the calls are recorded (``Buffered``) and replayed in a local
  transaction after the global transaction commits: that is what makes those modes lose or duplicate
  messages when a node dies between the two commits (docs/messaging.md lists the windows).

Rules every implementation keeps (tests/test_wsrm_store.py runs them on memory, PostgreSQL and MariaDB):

- ``enqueue`` takes no lock that another sending transaction waits for: concurrent senders never
  serialise on a shared row. Outgoing messages get increasing ``seq`` ids; ``unnumbered`` returns them
  in ``seq`` order, which is the order of enqueue within one application thread.
- ``store_incoming`` of a (identifier, number) already stored is a no-op (a retransmission) and returns
  False; ``consume`` returns False when the message was not there (already applied).
- A record saved in a session is read back by ``sources()`` / ``destinations()`` / ``invokers()`` once
  that session committed, and is absent if it rolled back. A source record is read back without its
  ``pending`` list: those numbers are the outgoing rows still numbered in the sequence (``numbered()``),
  so a save writes a few hundred bytes however many messages are in flight.
- ``applied_before`` / ``remember_applied`` are called in the apply transaction; a MessageID is remembered
  at most once (a second ``remember_applied`` of it fails the transaction, as a primary key does), so two
  copies of a message can never both commit their apply. ``forget_applied`` deletes ids remembered
  before a time, in batches.
- ``store_incoming_many`` stores a batch of a sequence's messages in as few statements as the database
  allows, skipping those already stored.
"""

from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass
from typing import Any

from qtp.wsrm.protocol import AckRanges, DestinationRecord, InvokerRecord, SourceRecord


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One application message (or reply) waiting at the RM Source."""

    route: str
    message_id: str
    action: str
    payload: bytes | None
    enqueued_at: float
    relates_to: str | None = None   # for replies and faults: the request's message id
    fault: str | None = None        # an application fault travelling back (its reason text)
    seq: int | None = None          # the store's enqueue order, set by the store
    key: str | None = None          # the RM Source sequence it was numbered in
    number: int | None = None


@dataclass(frozen=True, slots=True)
class Incoming:
    """One message accepted by an RM Destination, waiting for its handler."""

    identifier: str
    number: int
    message_id: str
    action: str
    payload: bytes | None
    received_at: float
    enqueued_at: float | None = None  # the sender's enqueue time, when the sender told it (qtp peers)
    relates_to: str | None = None
    fault: str | None = None
    attempts: int = 0
    not_before: float = 0.0
    last_error: str | None = None


@dataclass(frozen=True, slots=True)
class DeadLetter:
    id: int
    message: Incoming
    error: str
    failed_at: float
    peer: str | None = None  # the peer that owned the message's sequence (None: an anonymous one)


@dataclass(frozen=True, slots=True)
class DestinationInfo:
    """What the runtime keeps beside an RM Destination machine.

    ``reply_to``: where replies to this sequence's messages go (the peer's endpoint), if anywhere;
    ``channel``: for a sequence our own RM Source offered (replies coming back), the channel it serves.
    ``soap`` / ``wsa``: the versions the peer spoke when it created the sequence.
    """

    reply_to: str | None = None
    channel: str | None = None
    soap: str = "1.2"
    wsa: str = "2005/08"
    acks_to: str | None = None
    create_message_id: str | None = None  # the CreateSequence's MessageID: a retransmission gets this sequence
    owner: str | None = None  # the peer that created the sequence (None: an anonymous one); only it may use it


@dataclass(frozen=True, slots=True)
class SourceInfo:
    """What the runtime keeps beside an RM Source machine: its route and the peer it talks to."""

    route: str
    peer: str
    soap: str = "1.2"
    wsa: str = "2005/08"
    owner: str | None = None  # an offered sequence's: the peer whose inbound sequence accepted the offer


@dataclass(frozen=True, slots=True)
class Summary:
    outgoing: dict[tuple[str, str | None], tuple[int, float]]  # (route, key or None) -> (count, oldest)
    incoming: dict[str, int]
    dead_letters: int


class Session(abc.ABC):
    """A store's unit of atomicity (see the module docstring); only the store knows what is inside."""


class Store(abc.ABC):
    """Where a node keeps its WS-RM state. See the module docstring for the rules."""

    name: str
    durable: bool  # False: nothing survives the process (memory)

    @abc.abstractmethod
    def create(self) -> None:
        """Create what the store needs (tables) if missing; safe to call on every start."""

    @abc.abstractmethod
    def local(self) -> contextlib.AbstractContextManager[Any]:
        """A local transaction of the store: ``with store.local() as s:``."""

    def close(self) -> None:
        """Release connections."""

    # ------------------------------------------------------------------ RM Source side

    @abc.abstractmethod
    def enqueue(self, s: Any, message: Outgoing) -> None:
        """Add ``message`` (its ``seq``, ``key`` and ``number`` are ignored) to its route's outgoing queue."""

    @abc.abstractmethod
    def unnumbered(self, s: Any, route: str, limit: int) -> list[Outgoing]:
        """At most ``limit`` messages of ``route`` not yet numbered, oldest ``seq`` first."""

    @abc.abstractmethod
    def assign(self, s: Any, key: str, numbered: list[tuple[int, int]]) -> None:
        """Give each ``(seq, number)`` its number in sequence ``key``."""

    @abc.abstractmethod
    def numbered(self, s: Any, key: str, numbers: list[int] | None = None) -> list[Outgoing]:
        """The messages of sequence ``key`` (only ``numbers`` when given), by number."""

    @abc.abstractmethod
    def release(self, s: Any, key: str, ranges: AckRanges) -> int:
        """Take the numbers in ``ranges`` of sequence ``key`` off their messages, which wait unnumbered again in
        their original enqueue order (before any message enqueued after them); return how many."""

    @abc.abstractmethod
    def acknowledged(self, s: Any, key: str, ranges: AckRanges) -> int:
        """Delete the messages of ``key`` whose numbers are in ``ranges``; return how many were deleted."""

    @abc.abstractmethod
    def backlog(self, s: Any, route: str | None = None) -> int:
        """Outgoing messages not yet acknowledged (of ``route``, or of every route)."""

    def create_source(self, s: Any, info: SourceInfo, record: SourceRecord) -> None:
        """Save the record of an RM Source just made (no row of it can exist yet)."""
        self.save_source(s, info, record)

    @abc.abstractmethod
    def save_source(self, s: Any, info: SourceInfo, record: SourceRecord) -> None:
        """Insert or replace the record of RM Source sequence ``record.key``."""

    @abc.abstractmethod
    def sources(self, s: Any) -> list[tuple[SourceInfo, SourceRecord]]:
        """Every saved RM Source record."""

    @abc.abstractmethod
    def drop_source(self, s: Any, key: str) -> None:
        """Forget an ended RM Source sequence (and any of its messages still stored)."""

    # ------------------------------------------------------------------ RM Destination side

    @abc.abstractmethod
    def save_destination(self, s: Any, info: DestinationInfo, record: DestinationRecord,
                         before: DestinationRecord | None = None) -> None:
        """Insert or replace the record of RM Destination sequence ``record.identifier``. ``before``, when
        given, is the record as last committed: a store may then write only what changed (a sequence
        with thousands of gaps must not rewrite them all per message)."""

    def create_destination(self, s: Any, info: DestinationInfo, record: DestinationRecord) -> None:
        """Save the record of a sequence this node just named (no row of it can exist yet)."""
        self.save_destination(s, info, record)

    @abc.abstractmethod
    def destinations(self, s: Any) -> list[tuple[DestinationInfo, DestinationRecord]]:
        """Every saved RM Destination record."""

    @abc.abstractmethod
    def drop_destination(self, s: Any, identifier: str) -> None:
        """Forget a finished destination sequence, its invoker record and any stored message of it."""

    @abc.abstractmethod
    def store_incoming(self, s: Any, message: Incoming) -> bool:
        """Store an accepted message; False (and nothing changes) when it is already stored."""

    def store_incoming_many(self, s: Any, messages: list[Incoming]) -> None:
        for message in messages:
            self.store_incoming(s, message)

    @abc.abstractmethod
    def incoming(self, s: Any, identifier: str | None = None, number: int | None = None,
                 start: int | None = None, limit: int | None = None) -> list[Incoming]:
        """Stored messages not yet applied (of one sequence, or all; one ``number``, or from ``start`` on, at
        most ``limit``), by identifier then number."""

    @abc.abstractmethod
    def consume(self, s: Any, identifier: str, number: int) -> bool:
        """The dequeue: delete a stored message. False when it was not there."""

    @abc.abstractmethod
    def applied_before(self, s: Any, message_ids: list[str]) -> set[str]:
        """Which of ``message_ids`` were applied already (and are still remembered)."""

    @abc.abstractmethod
    def remember_applied(self, s: Any, message_ids: list[str], now: float) -> None:
        """``message_ids`` are applied by the transaction of session ``s``."""

    @abc.abstractmethod
    def forget_applied(self, s: Any, before: float, limit: int) -> int:
        """Forget up to ``limit`` ids remembered before ``before``; how many were forgotten."""

    def consume_many(self, s: Any, identifier: str, numbers: list[int]) -> int:
        """``consume`` for several messages of one sequence; how many were there."""
        return sum(1 for number in numbers if self.consume(s, identifier, number))

    @abc.abstractmethod
    def note_failure(self, s: Any, identifier: str, number: int, error: str, not_before: float) -> None:
        """Count a failed attempt of a stored message; do not retry it before ``not_before``."""

    @abc.abstractmethod
    def save_invoker(self, s: Any, record: InvokerRecord) -> None:
        """Insert or replace the invoker record of ``record.identifier``."""

    @abc.abstractmethod
    def invokers(self, s: Any) -> list[InvokerRecord]:
        """Every saved invoker record."""

    @abc.abstractmethod
    def summary(self, s: Any) -> "Summary":
        """Counts for operators: outgoing messages per (route, sequence key) with the oldest enqueue time,
        stored messages per inbound sequence, dead letters."""

    # ------------------------------------------------------------------ dead letters

    @abc.abstractmethod
    def dead_letter(self, s: Any, message: Incoming, error: str, now: float, peer: str | None = None) -> None:
        """Move a stored message to the dead letters (consuming it), remembering the peer that owned its
        sequence (the cap on dead letters counts per peer)."""

    @abc.abstractmethod
    def dead_letters_per_peer(self, s: Any) -> dict[str | None, int]:
        """How many dead letters each peer has (None: anonymous sequences'). Reads every letter's
        description: for the invoker when a message is about to become a dead letter, never per message."""

    @abc.abstractmethod
    def dead_letters(self, s: Any) -> list[DeadLetter]:
        """Every dead letter, oldest first."""

    @abc.abstractmethod
    def take_dead_letter(self, s: Any, letter_id: int) -> DeadLetter | None:
        """Remove and return one dead letter (None when there is no such id)."""


class Buffered:
    """A session that records store calls and replays them later in one local transaction.

    Used by the ``memory`` and ``persistent`` modes: the calls run after the application's transaction
    committed, in the store's own local transaction.
    """

    def __init__(self, store: Store):
        self.store = store
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def record(self, method: str, *args: Any) -> None:
        self.calls.append((method, args))

    def replay(self) -> None:
        if not self.calls:
            return
        with self.store.local() as s:
            for method, args in self.calls:
                getattr(self.store, method)(s, *args)
        self.calls.clear()
