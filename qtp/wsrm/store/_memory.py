"""The in-memory store: the same contract, kept in dictionaries; nothing survives the process.

A local transaction works on a copy-on-write view and publishes it when the block ends, so a failed block
leaves nothing behind, as a database transaction would. One lock serialises local transactions (they are
short: the sender's numbering, one received message, one acknowledgement).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import threading
from dataclasses import dataclass, field
from typing import Iterator

from qtp.errors import DuplicateApplyError
from qtp.wsrm.protocol import AckRanges, DestinationRecord, InvokerRecord, SourceRecord
from qtp.wsrm.protocol import _ranges as ranges
from qtp.wsrm.store._contract import DeadLetter, DestinationInfo, Incoming, Outgoing, SourceInfo, Store, Summary


@dataclass
class _Data:
    outgoing: dict[int, Outgoing] = field(default_factory=dict)
    sources: dict[str, tuple[SourceInfo, SourceRecord]] = field(default_factory=dict)
    destinations: dict[str, tuple[DestinationInfo, DestinationRecord]] = field(default_factory=dict)
    incoming: dict[tuple[str, int], Incoming] = field(default_factory=dict)
    invokers: dict[str, InvokerRecord] = field(default_factory=dict)
    dead: dict[int, DeadLetter] = field(default_factory=dict)
    applied: dict[str, float] = field(default_factory=dict)


class MemoryStore(Store):
    durable = False

    def __init__(self, name: str = "memory"):
        self.name = name
        self._data = _Data()
        self._lock = threading.RLock()
        self._ids = itertools.count(1)

    def __repr__(self) -> str:
        return f"<MemoryStore {self.name}>"

    def create(self) -> None:
        pass

    @contextlib.contextmanager
    def local(self) -> Iterator[_Data]:
        with self._lock:
            view = copy.copy(self._data)
            for name in ("outgoing", "sources", "destinations", "incoming", "invokers", "dead"):
                setattr(view, name, dict(getattr(view, name)))
            yield view
            self._data = view

    # ------------------------------------------------------------------ RM Source side

    def enqueue(self, s: _Data, message: Outgoing) -> None:
        seq = next(self._ids)
        s.outgoing[seq] = dataclasses.replace(message, seq=seq, key=None, number=None)

    def unnumbered(self, s: _Data, route: str, limit: int) -> list[Outgoing]:
        found = [m for seq, m in sorted(s.outgoing.items()) if m.route == route and m.key is None]
        return found[:limit]

    def assign(self, s: _Data, key: str, numbered: list[tuple[int, int]]) -> None:
        for seq, number in numbered:
            s.outgoing[seq] = dataclasses.replace(s.outgoing[seq], key=key, number=number)

    def numbered(self, s: _Data, key: str, numbers: list[int] | None = None) -> list[Outgoing]:
        wanted = None if numbers is None else set(numbers)
        found = [m for m in s.outgoing.values() if m.key == key and (wanted is None or m.number in wanted)]
        return sorted(found, key=lambda m: m.number or 0)

    def release(self, s: _Data, key: str, lost: AckRanges) -> int:
        freed = _in_ranges(s, key, lost)
        for seq in freed:
            s.outgoing[seq] = dataclasses.replace(s.outgoing[seq], key=None, number=None)
        return len(freed)

    def acknowledged(self, s: _Data, key: str, acked: AckRanges) -> int:
        gone = _in_ranges(s, key, acked)
        for seq in gone:
            del s.outgoing[seq]
        return len(gone)

    def backlog(self, s: _Data, route: str | None = None) -> int:
        return sum(1 for m in s.outgoing.values() if route is None or m.route == route)

    def save_source(self, s: _Data, info: SourceInfo, record: SourceRecord) -> None:
        s.sources[record.key] = (info, dataclasses.replace(record, pending=()))

    def sources(self, s: _Data) -> list[tuple[SourceInfo, SourceRecord]]:
        return [s.sources[key] for key in sorted(s.sources)]

    def drop_source(self, s: _Data, key: str) -> None:
        s.sources.pop(key, None)
        for seq in [seq for seq, m in s.outgoing.items() if m.key == key]:
            del s.outgoing[seq]

    # ------------------------------------------------------------------ RM Destination side

    def save_destination(self, s: _Data, info: DestinationInfo, record: DestinationRecord,
                         before: DestinationRecord | None = None) -> None:
        s.destinations[record.identifier] = (info, record)

    def destinations(self, s: _Data) -> list[tuple[DestinationInfo, DestinationRecord]]:
        return [s.destinations[i] for i in sorted(s.destinations)]

    def drop_destination(self, s: _Data, identifier: str) -> None:
        s.destinations.pop(identifier, None)
        s.invokers.pop(identifier, None)
        for key in [k for k in s.incoming if k[0] == identifier]:
            del s.incoming[key]

    def store_incoming(self, s: _Data, message: Incoming) -> bool:
        key = (message.identifier, message.number)
        if key in s.incoming:
            return False
        s.incoming[key] = message
        return True

    def incoming(self, s: _Data, identifier: str | None = None, number: int | None = None,
                 start: int | None = None, limit: int | None = None) -> list[Incoming]:
        if identifier is not None and number is not None:
            found = s.incoming.get((identifier, number))
            return [] if found is None else [found]
        chosen = [m for key, m in sorted(s.incoming.items())
                  if (identifier is None or key[0] == identifier) and (start is None or key[1] >= start)]
        return chosen if limit is None else chosen[:limit]

    def applied_before(self, s: _Data, message_ids: list[str]) -> set[str]:
        return {m for m in message_ids if m in s.applied}

    def remember_applied(self, s: _Data, message_ids: list[str], now: float) -> None:
        known = self.applied_before(s, message_ids)
        if known or len(set(message_ids)) != len(message_ids):
            raise DuplicateApplyError(f"message ids applied already: {sorted(known) or message_ids}")
        s.applied.update((m, now) for m in message_ids)

    def forget_applied(self, s: _Data, before: float, limit: int) -> int:
        old = [m for m, at in s.applied.items() if at < before][:limit]
        for m in old:
            del s.applied[m]
        return len(old)

    def consume(self, s: _Data, identifier: str, number: int) -> bool:
        return s.incoming.pop((identifier, number), None) is not None

    def note_failure(self, s: _Data, identifier: str, number: int, error: str, not_before: float) -> None:
        m = s.incoming.get((identifier, number))
        if m is not None:
            s.incoming[identifier, number] = dataclasses.replace(
                m, attempts=m.attempts + 1, not_before=not_before, last_error=error[:4000])

    def save_invoker(self, s: _Data, record: InvokerRecord) -> None:
        s.invokers[record.identifier] = record

    def invokers(self, s: _Data) -> list[InvokerRecord]:
        return [s.invokers[i] for i in sorted(s.invokers)]

    def summary(self, s: _Data) -> Summary:
        out: dict[tuple[str, str | None], tuple[int, float]] = {}
        for m in s.outgoing.values():
            count, oldest = out.get((m.route, m.key), (0, m.enqueued_at))
            out[m.route, m.key] = (count + 1, min(oldest, m.enqueued_at))
        inc: dict[str, int] = {}
        for identifier, _ in s.incoming:
            inc[identifier] = inc.get(identifier, 0) + 1
        return Summary(out, inc, len(s.dead))

    # ------------------------------------------------------------------ dead letters

    def dead_letter(self, s: _Data, message: Incoming, error: str, now: float, peer: str | None = None) -> None:
        self.consume(s, message.identifier, message.number)
        letter_id = next(self._ids)
        s.dead[letter_id] = DeadLetter(letter_id, message, error[:4000], now, peer)

    def dead_letters_per_peer(self, s: _Data) -> dict[str | None, int]:
        counts: dict[str | None, int] = {}
        for letter in s.dead.values():
            counts[letter.peer] = counts.get(letter.peer, 0) + 1
        return counts

    def dead_letters(self, s: _Data) -> list[DeadLetter]:
        return [s.dead[i] for i in sorted(s.dead)]

    def take_dead_letter(self, s: _Data, letter_id: int) -> DeadLetter | None:
        return s.dead.pop(letter_id, None)


def _in_ranges(s: _Data, key: str, numbers: AckRanges) -> list[int]:
    """The enqueue positions of sequence ``key``'s messages whose numbers are in ``numbers``."""
    return [seq for seq, m in s.outgoing.items()
            if m.key == key and m.number is not None and ranges.contains(numbers, m.number)]
