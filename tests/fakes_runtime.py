"""Fakes for the runtime's workers built alone (no node, no socket, no database, no sleep): a settable clock,
a transport that records what is posted (or routes it to a handler), an inline runner, and a transaction
manager whose transactions run their ``on_commit`` callbacks when the block ends without an exception."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator


class FakeClock:
    """Time that moves only when a test moves it; ``time()`` and ``monotonic()`` move together."""

    def __init__(self, now: float = 1_700_000_000.0):
        self.now = now
        self._origin = now

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now - self._origin

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


@dataclass
class FakeReply:
    status: int
    body: bytes = b""


class FakeTransport:
    """Records every POST; answers with ``route(url, data, content_type)`` when given, else 202."""

    def __init__(self, route: Callable[[str, bytes, str], FakeReply] | None = None):
        self.route = route
        self.posts: list[tuple[str, bytes]] = []

    def post(self, url: str, data: bytes, soap: Any, action: str | None) -> FakeReply:
        return self._post(url, data, f"soap {getattr(soap, 'value', soap)}; action={action}")

    def post_raw(self, url: str, data: bytes, content_type: str) -> FakeReply:
        return self._post(url, data, content_type)

    def _post(self, url: str, data: bytes, content_type: str) -> FakeReply:
        self.posts.append((url, data))
        return FakeReply(202) if self.route is None else self.route(url, data, content_type)


def run_inline(fn: Callable[..., None], *args: Any) -> None:
    """A ``Run`` that runs the work at once, on the caller's thread."""
    fn(*args)


class FakeTransaction:
    """What the invoker uses of a global transaction: ``on_commit`` and ``connection``."""

    def __init__(self) -> None:
        self.callbacks: list[Callable[[], None]] = []

    def on_commit(self, fn: Callable[[], None]) -> None:
        self.callbacks.append(fn)

    def connection(self, resource: str | None = None) -> Any:
        raise AssertionError(f"a memory-mode transaction has no connection (asked for {resource!r})")


class FakeTransactions:
    """``transaction()`` like the transaction manager's: commits (runs the callbacks) when the block ends
    normally, rolls back (drops them) when it raises. Counts both."""

    def __init__(self) -> None:
        self.committed = 0
        self.rolled_back = 0

    @contextmanager
    def transaction(self) -> Iterator[FakeTransaction]:
        tx = FakeTransaction()
        try:
            yield tx
        except BaseException:
            self.rolled_back += 1
            raise
        self.committed += 1
        for fn in tx.callbacks:
            fn()
