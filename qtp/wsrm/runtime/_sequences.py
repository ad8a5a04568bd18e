"""One object per sequence, in one registry per side, and the one way their durable state changes.

An outbound sequence (``Outbound``: our RM Source) and an inbound one (``Inbound``: our RM Destination)
carry everything the runtime keeps of them: the protocol machine, where it goes and whose it is, its
lock, and (outbound) its pump, its cache of numbered messages and its round-trip estimator. ``Sources``
and ``Destinations`` are the registries.

Lock rules (the only ones in the runtime's sequence state):

- A registry's ``_mutex`` guards its maps (which sequences exist and the indexes over them). It is held
  for map operations only: never across I/O, never while taking another lock.
- A sequence's ``lock`` serialises changes of its durable state: ``machine`` is replaced and ``stale`` set
  or cleared only under it, by ``changing`` / ``adopt``. It is held across the store transaction that
  makes a change durable (that is the point: one writer per sequence).
- ``machine`` is read without a lock: a machine is replaced, never changed in place (its record is a
  frozen value), so a reader sees the last adopted one, whole.
- An ``Outbound``'s ``io`` lock guards its transmission state (``pump``, ``cache``, ``rtt``); it may be
  taken while ``lock`` is held, never the other way round. An ``Inbound``'s ``io`` lock guards the
  requests waiting for its next group commit (``arrivals``).

The durable-apply cycle (both sides): take the lock, reload from the store first if the last change's
outcome is unknown (``stale``), apply the events to a *copy* of the machine, commit the copy's record,
and only then adopt the copy. A crash or a failed commit leaves the live machine at the last committed
record, or marked stale so that the store (the truth) is read again before anything else happens.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Callable, Generic, Iterator, TypeVar

from qtp.wsrm.protocol import (
    DestinationRecord,
    DestinationSequence,
    DestinationState,
    SourceRecord,
    SourceSequence,
    SourceState,
    Transmit,
)
from qtp.wsrm.store import DestinationInfo, Outgoing, SourceInfo

_OPEN = (DestinationState.ACTIVE, DestinationState.CLOSED)
_ENDED = (SourceState.TERMINATED, SourceState.FAILED)


class Durable:
    """What both sides share: a machine changed only through ``changing`` and ``adopt``."""

    __slots__ = ("machine", "lock", "stale", "io")

    def __init__(self, machine: Any):
        self.machine = machine
        self.lock = threading.Lock()
        self.stale = False  # the last store transaction ended with an error: its outcome is unknown
        self.io = threading.Lock()

    @contextmanager
    def changing(self, reload: Callable[["Any"], None]) -> Iterator[Any]:
        """Hold the sequence's lock; first rebuild it from the store (``reload(self)``) when ``stale``.
        Yields the live machine, which the block copies, changes and ``adopt``s."""
        with self.lock:
            if self.stale:
                reload(self)
                self.stale = False
            yield self.machine

    def adopt(self, probe: Any, save: Callable[[], None] | None) -> None:
        """Make ``probe`` the live machine once ``save`` (the store transaction with its record) committed;
        ``save`` None: nothing durable changed. If ``save`` raises, the sequence stays stale."""
        if save is not None:
            self.stale = True
            save()
        self.machine = probe
        self.stale = False


class Outbound(Durable):
    """Our RM Source ``key``: where it goes (``info``), its machine, and its transmission state."""

    __slots__ = ("key", "info", "pump", "cache", "rtt", "polled", "deferred")

    def __init__(self, info: SourceInfo, record: SourceRecord, limits: Any):
        super().__init__(SourceSequence(record))
        self.key = record.key
        self.info = info
        self.pump = Pump()
        self.cache: dict[int, Outgoing] = {}  # numbered, unacknowledged messages (io)
        self.rtt = RoundTrip(limits.retransmit_interval, limits.retransmit_interval_min,
                             limits.retransmit_interval_max)  # (io)
        self.polled = False  # offered: a poll took something of it since its last event
        self.deferred = False  # (io) new messages wait unnumbered for its request in flight to end

    @property
    def offered(self) -> bool:
        """A sequence a peer offered us for our replies (route ``offer:<identifier>``)."""
        return self.info.route.startswith("offer:")

    @property
    def identifier(self) -> str | None:
        return self.machine.record.identifier

    def unacknowledged(self) -> set[int]:
        return {n for n, *_ in self.machine.record.pending}


class Pump:
    """The transmissions one sequence still has to make, by number, whether a thread is sending them, and
    when each unacknowledged number last left (monotonic clock). Guarded by its sequence's ``io``."""

    __slots__ = ("waiting", "running", "sent_at")

    def __init__(self) -> None:
        self.waiting: dict[int, Transmit] = {}
        self.running = False
        self.sent_at: dict[int, float] = {}


class RoundTrip:
    """RFC 6298's estimator: smoothed round-trip time and its deviation give the retransmission timeout."""

    __slots__ = ("srtt", "rttvar", "timeout", "low", "high")

    def __init__(self, initial: float, low: float, high: float):
        self.srtt: float | None = None
        self.rttvar = 0.0
        self.timeout, self.low, self.high = initial, low, high

    def sample(self, rtt: float) -> None:
        if self.srtt is None:
            self.srtt, self.rttvar = rtt, rtt / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt)
            self.srtt = 0.875 * self.srtt + 0.125 * rtt
        self.timeout = min(self.high, max(self.low, self.srtt + max(0.01, 4 * self.rttvar)))


class Inbound(Durable):
    """Our RM Destination ``identifier``: who sent it and how to answer (``info``), its machine, and the
    requests waiting for its next group commit."""

    __slots__ = ("identifier", "info", "arrivals")

    def __init__(self, info: DestinationInfo, record: DestinationRecord):
        super().__init__(DestinationSequence(record))
        self.identifier = record.identifier
        self.info = info
        self.arrivals: list[Any] = []  # (io)

    @property
    def record(self) -> Any:
        return self.machine.record


T = TypeVar("T", bound=Durable)


class _Registry(Generic[T]):
    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._by_id: dict[str, T] = {}

    def get(self, name: str) -> T | None:
        return self._by_id.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)

    def all(self) -> list[T]:
        """A snapshot: the sequences known now."""
        with self._mutex:
            return list(self._by_id.values())


class Sources(_Registry[Outbound]):
    """Our RM Sources by key, with the indexes: identifier -> key, route -> the sequence taking its new
    messages, and the offered routes (``offer:<identifier>``) that have not ended."""

    def __init__(self) -> None:
        super().__init__()
        self._keys: dict[str, str] = {}  # identifier -> key, once the peer gave (or we offered) one
        self._current: dict[str, str] = {}
        self._offer_routes: set[str] = set()

    def add(self, seq: Outbound, current: bool = False) -> Outbound:
        """Register ``seq`` (replacing a sequence with its key); ``current``: it takes its route's new messages."""
        with self._mutex:
            self._by_id[seq.key] = seq
            if seq.identifier:
                self._keys[seq.identifier] = seq.key
            if current:
                self._current[seq.info.route] = seq.key
            if seq.offered:
                self._offer_routes.add(seq.info.route)
        return seq

    def identified(self, seq: Outbound) -> None:
        """``seq``'s machine now has its identifier (the CreateSequenceResponse came)."""
        if seq.identifier:
            with self._mutex:
                self._keys[seq.identifier] = seq.key

    def remove(self, seq: Outbound) -> None:
        with self._mutex:
            self._by_id.pop(seq.key, None)
            if seq.identifier and self._keys.get(seq.identifier) == seq.key:
                del self._keys[seq.identifier]
            if self._current.get(seq.info.route) == seq.key:
                del self._current[seq.info.route]
            if seq.offered:  # an offered sequence cannot be created again
                self._offer_routes.discard(seq.info.route)

    def by_identifier(self, identifier: str) -> Outbound | None:
        key = self._keys.get(identifier)
        return None if key is None else self._by_id.get(key)

    def current(self, route: str) -> Outbound | None:
        key = self._current.get(route)
        return None if key is None else self._by_id.get(key)

    def offer_routes(self) -> list[str]:
        with self._mutex:
            return list(self._offer_routes)

    def has_offer_route(self, route: str) -> bool:
        return route in self._offer_routes


class Destinations(_Registry[Inbound]):
    """Our RM Destinations by identifier, with the index (owner, CreateSequence MessageID) -> identifier (a
    retransmitted CreateSequence gets the sequence it made; another peer's with the same MessageID does not,
    nor does it hide it)."""

    def __init__(self) -> None:
        super().__init__()
        self._created_by: dict[tuple[str | None, str], str] = {}

    def add(self, seq: Inbound) -> Inbound:
        with self._mutex:
            self._by_id[seq.identifier] = seq
            if seq.info.create_message_id:
                self._created_by[seq.info.owner, seq.info.create_message_id] = seq.identifier
        return seq

    def remove(self, seq: Inbound) -> None:
        with self._mutex:
            if self._by_id.get(seq.identifier) is seq:
                del self._by_id[seq.identifier]
            key = (seq.info.owner, seq.info.create_message_id or "")
            if self._created_by.get(key) == seq.identifier:
                del self._created_by[key]

    def created_by(self, owner: str | None, message_id: str) -> Inbound | None:
        """The sequence peer ``owner`` (None: anonymous) created with CreateSequence ``message_id``."""
        identifier = self._created_by.get((owner, message_id))
        return None if identifier is None else self._by_id.get(identifier)

    def info(self, identifier: str) -> DestinationInfo | None:
        seq = self._by_id.get(identifier)
        return None if seq is None else seq.info

    def record(self, identifier: str) -> Any:
        seq = self._by_id.get(identifier)
        return None if seq is None else seq.machine.record

    def open_count(self) -> int:
        return sum(1 for seq in self.all() if seq.machine.state in _OPEN)

    def owned(self, owner: str | None) -> list[Inbound]:
        """The sequences peer ``owner`` created here (None: anonymous ones), open or not."""
        return [seq for seq in self.all() if seq.info.owner == owner and seq.info.channel is None]


def ended(machine: SourceSequence) -> bool:
    return machine.state in _ENDED
