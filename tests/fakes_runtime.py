"""Fakes for testing the runtime's workers alone (h11 style: no sockets, no sleeps, no database).

- ``FakeClock``: settable ``time()`` and ``monotonic()``, moved together by ``advance(s)``.
- ``FakeTransport``: the ``Transport`` a worker posts with, routing each request in-process to a handler
  (``handler(url, envelopes) -> Answer``: a fake peer, or a real ``Receiver`` through ``receiver_handler``);
  it records every request, can lose requests before they arrive (``lose``), and can make the round trip
  take time on the fake clock (``latency``).
- ``FakePeer``: a WS-RM destination in a few lines, as a transport handler: it creates sequences (agreeing to
  qtp's batches when told to), records what it receives, acknowledges it unless told not to, and answers
  Close and Terminate.
- ``RecordingStore``: a ``MemoryStore`` counting its calls, whose next commit after a given call can land
  and then raise, as a database connection lost during COMMIT does (the outcome unknown to the caller).
- ``OneStore``: the node's ``Stores`` for a worker whose every route lives in one store.
- ``FakeTransactions``: the transaction manager as the invoker uses it: ``transaction()`` runs the
  transaction's ``on_commit`` callbacks when its block ends normally and drops them when it raises.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

from sqlalchemy.exc import OperationalError

from qtp.errors import TransportError
from qtp.wsrm.codec import (
    BATCH_CONTENT_TYPE,
    Envelope,
    SoapVersion,
    decode,
    decode_batch,
    default_action,
    encode_batch,
)
from qtp.wsrm.protocol import (
    CloseSequence,
    CloseSequenceResponse,
    CreateSequence,
    CreateSequenceResponse,
    SequenceAcknowledgement,
    TerminateSequence,
    TerminateSequenceResponse,
)
from qtp.wsrm.protocol import _ranges as ranges
from qtp.wsrm.runtime._answers import NOTHING, Answer, reply_addressing
from qtp.wsrm.runtime._ids import new_identifier
from qtp.wsrm.runtime._transport import Reply, wire
from qtp.wsrm.store import MemoryStore, Store

Handler = Callable[[str, list[Envelope]], Answer]


def inline(fn: Callable[..., None], *args: Any) -> None:
    """A worker's ``run`` that runs the work at once, on the caller's thread."""
    fn(*args)


class FakeClock:
    """A clock that moves only when told to."""

    def __init__(self, time: float = 1_800_000_000.0, monotonic: float = 1000.0):
        self._time, self._monotonic = time, monotonic

    def time(self) -> float:
        return self._time

    def monotonic(self) -> float:
        return self._monotonic

    def advance(self, seconds: float) -> float:
        """Move both clocks ``seconds`` on; returns the new ``time()``."""
        self._time += seconds
        self._monotonic += seconds
        return self._time


@dataclass
class Request:
    """One request a worker posted: where, and its envelopes (several for a qtp batch)."""

    url: str
    envelopes: list[Envelope]
    accept: str | None = None  # the Accept header (a poll's, naming the batch it takes)
    slot: int | None = None  # the peer's slot put in the URL (?qtp-slot=)

    @property
    def messages(self) -> list[tuple[str, int]]:
        """(identifier, number) of each sequence message it carries."""
        return [(e.sequence.identifier, e.sequence.number) for e in self.envelopes if e.sequence is not None]

    @property
    def body(self) -> Any:
        return self.envelopes[0].body


class FakeTransport:
    """Posts to ``handler`` in-process. ``lose(request)`` True: the request is lost on the way (TransportError,
    the handler never sees it); ``lose_answer(request)`` True: the handler took it, its answer is lost.
    ``latency``: seconds the fake ``clock`` moves during each round trip."""

    def __init__(self, handler: Handler, clock: FakeClock | None = None, latency: float = 0.0):
        self.handler = handler
        self.clock = clock
        self.latency = latency
        self.lose: Callable[[Request], bool] = lambda request: False
        self.lose_answer: Callable[[Request], bool] = lambda request: False
        self.requests: list[Request] = []

    def post(self, url: str, data: bytes, soap: SoapVersion, action: str | None, accept: str | None = None,
             slot: int | None = None) -> Reply:
        return self._deliver(Request(url, [decode(data)], accept, slot))

    def post_raw(self, url: str, data: bytes, content_type: str, slot: int | None = None) -> Reply:
        assert content_type == BATCH_CONTENT_TYPE
        return self._deliver(Request(url, [decode(part) for part in decode_batch(data, 10_000)], slot=slot))

    def _deliver(self, request: Request) -> Reply:
        self.requests.append(request)
        if self.clock is not None and self.latency:
            self.clock.advance(self.latency)
        if self.lose(request):
            raise TransportError(f"request to {request.url} lost (fake)")
        answer = self.handler(request.url, request.envelopes)
        if self.lose_answer(request):
            raise TransportError(f"the answer from {request.url} lost (fake)")
        if answer.batch:
            return Reply(answer.status, BATCH_CONTENT_TYPE, encode_batch(list(answer.batch)))
        body = b"" if answer.envelope is None else wire(answer.envelope)
        return Reply(answer.status, "application/soap+xml", body)

    def messages(self) -> list[tuple[str, int]]:
        """(identifier, number) of every sequence message posted, in order, retransmissions included."""
        return [m for r in self.requests for m in r.messages]

    def carrying(self, kind: type) -> list[Request]:
        """The requests whose body is a ``kind`` (CreateSequence, CloseSequence...)."""
        return [r for r in self.requests if isinstance(r.body, kind)]

    def close(self) -> None:
        pass


def receiver_handler(receiver: Any, caller: str | None = None) -> Handler:
    """A transport handler that gives each request to a real ``Receiver`` as peer ``caller``."""
    def handle(url: str, envelopes: list[Envelope]) -> Answer:
        if len(envelopes) == 1:
            return receiver.handle(envelopes[0], caller)
        return receiver.handle_batch(envelopes, caller)
    return handle


def answer(request: Envelope, **fields: Any) -> Answer:
    """The answer to ``request`` on its HTTP response, with ``fields`` (acks, body)."""
    reply = Envelope(soap=request.soap, rm=request.rm, wsa=request.wsa, addressing=reply_addressing(request, ""),
                     **fields)
    return Answer(replace(reply, addressing=replace(reply.addressing, action=default_action(reply))), 200)


@dataclass
class FakePeer:
    """A WS-RM destination. ``batch``: the messages per request it agrees to when asked (None: it does not
    know qtp's batches); ``acknowledge`` False: it takes messages and says nothing (its acknowledgements
    are lost); ``received``: per identifier, the numbers that came, in order, duplicates included."""

    batch: int | None = None
    acknowledge: bool = True
    tag: str = ""  # a slot of a node whose replicas share the work (``<node>:s<k>``), named in its identifiers
    received: dict[str, list[int]] = field(default_factory=dict)
    created: list[CreateSequence] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)
    terminated: list[str] = field(default_factory=list)

    def __call__(self, url: str, envelopes: list[Envelope]) -> Answer:
        first = envelopes[0]
        body = first.body
        if isinstance(body, CreateSequence):
            identifier = new_identifier(self.tag)
            self.created.append(body)
            self.received[identifier] = []
            batch = min(body.batch, self.batch) if body.batch and self.batch else None
            return answer(first, body=CreateSequenceResponse(
                identifier, accept_acks_to=url if body.offer is not None else None, batch=batch))
        if isinstance(body, CloseSequence):
            self.closed.append(body.identifier)
            return answer(first, body=CloseSequenceResponse(body.identifier), acks=self._acks(body.identifier))
        if isinstance(body, TerminateSequence):
            self.terminated.append(body.identifier)
            return answer(first, body=TerminateSequenceResponse(body.identifier))
        named = set()
        for env in envelopes:
            if env.sequence is not None:
                self.received.setdefault(env.sequence.identifier, []).append(env.sequence.number)
                named.add(env.sequence.identifier)
            named.update(r.identifier for r in env.ack_requests)
        if not self.acknowledge or not named:
            return NOTHING
        return answer(first, acks=tuple(a for identifier in sorted(named) for a in self._acks(identifier)))

    def _acks(self, identifier: str) -> tuple[SequenceAcknowledgement, ...]:
        got = self.received.get(identifier)
        if not got:
            return ()
        return (SequenceAcknowledgement(identifier, ranges=ranges.from_numbers(got)),)


class RecordingStore(MemoryStore):
    """The memory store, counting calls by method name (``calls``); ``fail_commit_after(method)``: the next
    local transaction that calls ``method`` commits, then raises as if the connection broke during COMMIT."""

    _COUNTED = ("unnumbered", "assign", "numbered", "acknowledged", "release", "save_source", "drop_source",
                "create_source", "sources", "save_destination")

    def __init__(self, name: str = "memory"):
        super().__init__(name)
        self.calls: Counter[str] = Counter()
        self._armed: str | None = None
        self._seen: set[str] = set()

    def __getattribute__(self, name: str) -> Any:
        attr = super().__getattribute__(name)
        if name in RecordingStore._COUNTED:
            def counted(*args: Any, **kwargs: Any) -> Any:
                self.calls[name] += 1
                self._seen.add(name)
                return attr(*args, **kwargs)
            return counted
        return attr

    def fail_commit_after(self, method: str) -> None:
        self._armed = method

    @contextmanager
    def local(self) -> Iterator[Any]:
        self._seen = set()
        with super().local() as s:
            yield s
        if self._armed is not None and self._armed in self._seen:
            self._armed = None
            raise OperationalError("COMMIT", None, ConnectionError("server closed the connection unexpectedly"))

    def read(self, method: str, *args: Any) -> Any:
        """``method(session, *args)`` in a local transaction of its own, uncounted (for the test's asserts)."""
        with super().local() as s:
            return getattr(MemoryStore, method)(self, s, *args)


class OneStore:
    """The node's stores (``Stores``) when every route, and the inbound side, live in ``store``."""

    def __init__(self, store: Store):
        self.inbound = store

    def for_route(self, route: str) -> Store:
        return self.inbound

    def distinct(self) -> list[Store]:
        return [self.inbound]


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
