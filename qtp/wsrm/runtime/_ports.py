"""What the runtime's workers are given instead of the node: a clock, a wake-up call, and the narrow
interfaces they use of each other (``typing.Protocol``), so that each can be built alone (the worker tests
build them on the memory store with a fake transport and a fake clock) and no worker imports another."""

from __future__ import annotations

import threading
import time as _time
from typing import Any, Callable, Protocol

from qtp.wsrm.protocol import AckRanges, SequenceAcknowledgement
from qtp.wsrm.store import DestinationInfo, Incoming


class Clock(Protocol):
    def time(self) -> float:
        """Seconds since the epoch (what records and timers keep)."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (round trips, intervals)."""


class SystemClock:
    """The clock of the process."""

    time = staticmethod(_time.time)
    monotonic = staticmethod(_time.monotonic)


SYSTEM_CLOCK = SystemClock()


class Wake(threading.Event):
    """The sender's wake-up call (a message was enqueued, an acknowledgement came), counting the calls.
    Whoever makes work for the sender calls ``wake()``; the maintenance loop waits on it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def set(self) -> None:
        self.calls += 1
        super().set()

    __call__ = set


class Run(Protocol):
    def __call__(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on a worker thread, best effort (nothing waits for it; it logs its failures)."""


class OutboundEvents(Protocol):
    """What the receiving side tells the sender: acknowledgements and responses about our RM Sources."""

    def on_acks(self, acks: tuple[SequenceAcknowledgement, ...]) -> None: ...

    def on_body(self, body: Any, key: str | None = None) -> None: ...


class Deliveries(Protocol):
    """What the receiver tells the invoker, and asks it."""

    def ensure(self, identifier: str) -> Any: ...

    def stored(self, identifier: str, number: int, message: Incoming | None = None) -> None: ...

    def receipt(self, info: DestinationInfo, record: Any, before: Any, messages: list[Incoming]) -> set[int] | None: ...

    def completed(self, identifier: str, received: AckRanges) -> None: ...

    def pending(self, identifier: str) -> bool: ...

    def backlog(self) -> int: ...

    def backlog_of(self, identifiers: set[str]) -> int: ...


class Handlers(Protocol):
    """The application's handlers, as the invoker sees them."""

    def for_message(self, message: Incoming, info: DestinationInfo | None) -> Callable[..., Any] | None: ...

    def on_receipt(self, message: Incoming, info: DestinationInfo | None) -> bool: ...
