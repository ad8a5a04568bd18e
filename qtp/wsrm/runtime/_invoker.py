"""The invoker: applies stored messages with the application's handlers, each in a global transaction.

Theory (the dissertation's InvokerBuffer, chapter 3). In ``xa`` mode the delivery transaction does three
things (four: below) on one global transaction: it deletes the stored message (the *dequeue*), runs the handler (the
application's own updates, on any resources), and saves the sequence's invoker record with the number
marked delivered; for request-reply it also enqueues the reply on the sequence the peer offered. Either
all of them commit or none: a handler that raises, a branch that votes no, or a crash before the decision
leaves the message stored, and it is delivered again. The dequeue runs first, so two deliveries of one
message can never both commit: the second finds nothing to delete (or waits on the first's row lock, and
then finds nothing) and is recognised as already applied.

The fourth: the same transaction remembers each applied message's MessageID (``qtp_rm_applied``, kept for
``dedup_retention``) and skips any it finds there. A sender that lost its acknowledgements (killed
before applying them) and whose old sequence the destination has since forgotten sends the messages again
in a new sequence, with new numbers but the same MessageIDs; they are consumed without being applied.

In ``persistent`` and ``memory`` modes the handler's transaction does only the application's work, and
the dequeue follows in a local transaction of the store after it committed: a crash between the two
applies the message again after restart (persistent) or loses it (memory). That is the point of those
modes; see docs/messaging.md.

A handler that fails is retried after a backoff that doubles per attempt; after ``max_attempts`` the
message becomes a dead letter (with the error text) in a local transaction that also marks it delivered,
so the sequence moves on; for request-reply a SOAP fault goes back to the client reliably.
"""

from __future__ import annotations

import hashlib
import heapq
import logging
import threading
import traceback
from dataclasses import replace
from typing import Any, Callable, ContextManager

from qtp._failures import first_line
from qtp.coordinator.failpoints import failpoint
from sqlalchemy.exc import SQLAlchemyError

from qtp.errors import MessageRefusedError, OutcomeUnknownError, QtpError, transient
from qtp.wsrm.codec import WsaVersion, check_payload
from qtp.wsrm.codec._names import WSA_FAULT_ACTION
from qtp.wsrm.protocol import (
    AckRanges,
    Deliver,
    DeliveryAborted,
    DeliveryCommitted,
    DeliveryFinished,
    InvokerBuffer,
    InvokerRecord,
    MessageStored,
    SequenceCompleted,
)
from qtp.wsrm.protocol import _ranges as ranges
from qtp.wsrm.runtime._ids import new_message_id
from qtp.wsrm.runtime._ports import SYSTEM_CLOCK, Clock, Handlers
from qtp.wsrm.runtime._refusals import RefusalWarnings, outages, refusals
from qtp.wsrm.runtime._sequences import Destinations
from qtp.wsrm.runtime._settings import Limits
from qtp.wsrm.runtime._stores import Enlisted
from qtp.wsrm.store import Incoming, Outgoing, Store

log = logging.getLogger("qtp.wsrm.invoker")
# a handler that answers every message of a one-way sequence would write a line per message
dropped = RefusalWarnings(summary="dropped %s more replies (%s: their sequence offered none) in the last %.0f s")

Message = Incoming  # what a handler receives
REDELIVERY = "urn:qtp:redelivery"  # dead letters sent back by `qtp dead-letters retry` (numbered by letter id)
BatchHandler = Callable[[Any, list[Incoming]], "list[bytes | str | None] | None"]
CACHE_MAX = 4096  # messages kept in memory between their store and their apply; beyond, read from the store
RECEIPT_BUDGET = 0.1  # seconds per message: a handler slower than this in a receiving commit is ...
RECEIPT_COOLDOWN = 10.0  # ... left to the invoker's threads for this long (its acknowledgements waited on it)


class _Batch:
    """A batch handler as the invoker sees it: called once with every message of a transaction."""

    __slots__ = ("fn",)

    def __init__(self, fn: BatchHandler):
        self.fn = fn

    def __call__(self, tx: Any, message: Incoming) -> "bytes | str | None":
        results = self.fn(tx, [message])
        return results[0] if results else None

    def apply(self, tx: Any, messages: list[Incoming]) -> list["bytes | str | None"]:
        results = self.fn(tx, messages)
        if results is None:
            return [None] * len(messages)
        if len(results) != len(messages):
            raise TypeError(f"batch handler {getattr(self.fn, '__name__', self.fn)!r} returned {len(results)} "
                            f"replies for {len(messages)} messages")
        return list(results)


class _Schedule:
    """Work items with a due time; ``get`` blocks until one is due (or ``timeout``)."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._heap: list[tuple[float, int, tuple[str, int]]] = []
        self._counter = 0
        self._cond = threading.Condition()

    def put(self, item: tuple[str, int], at: float = 0.0) -> None:
        with self._cond:
            self._counter += 1
            heapq.heappush(self._heap, (at, self._counter, item))
            self._cond.notify()

    def get(self, timeout: float) -> tuple[str, int] | None:
        deadline = self._clock.time() + timeout
        with self._cond:
            while True:
                now = self._clock.time()
                if self._heap and self._heap[0][0] <= now:
                    return heapq.heappop(self._heap)[2]
                wait = deadline - now
                if self._heap:
                    wait = min(wait, self._heap[0][0] - now)
                if wait <= 0:
                    return None
                self._cond.wait(wait)

    def wake_all(self) -> None:
        with self._cond:
            self._cond.notify_all()


def _peer_name(peer: str | None) -> str:
    return "an anonymous peer" if peer is None else f"peer {peer!r}"


def applied_key(owner: str | None, message_id: str) -> str:
    """What ``qtp_rm_applied`` remembers for a message: its MessageID within its sender's scope. A peer's
    MessageIDs are hashed with the peer's name, so another peer that sends the same MessageID first (it saw
    it on the wire, or guessed it) cannot make the real message be consumed as a duplicate; anonymous
    senders share one scope, the MessageID itself."""
    if owner is None:
        return message_id
    return "peer:" + hashlib.sha256(f"{owner}\0{message_id}".encode()).hexdigest()


class _AlreadyApplied(Exception):
    """The message was no longer stored: an earlier delivery committed it."""


class Invoker:
    """Applies the inbound store's messages. ``_mutex`` guards the per-sequence buffers (``_machines``), the
    cache and the outage counts; it is never held while a handler runs or the store is used."""

    def __init__(self, limits: Limits, store: Store, destinations: Destinations, handlers: Handlers,
                 transaction: Callable[[], ContextManager[Any]], enlist: Callable[[Any], Enlisted],
                 finished: Callable[[str], None], metrics: Any, wake: Callable[[], None],
                 clock: Clock = SYSTEM_CLOCK, on_receipt: bool = False):
        self.limits = limits
        self.on_receipt = on_receipt  # apply in the receiving commit (``receipt``): xa mode, not turned off
        self.store = store
        self.destinations = destinations
        self.handlers = handlers
        self._transaction = transaction
        self._enlist = enlist
        self._finished = finished
        self.metrics = metrics
        self._wake = wake
        self.clock = clock
        self._machines: dict[str, InvokerBuffer] = {}
        self._mutex = threading.Lock()
        self._schedule = _Schedule(clock)
        self._cache: dict[tuple[str, int], Incoming] = {}  # just stored, not yet applied
        self._outages: dict[tuple[str, int], int] = {}  # transient failures in a row, per message (not attempts)
        self._alone: set[tuple[str, int]] = set()  # of a batch that failed: applied one per transaction
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self._dead_mutex = threading.Lock()
        self._dead_counts: dict[str | None, int] | None = None  # dead letters per peer, read when first needed
        self._dead_read_at = 0.0
        self._slow: dict[Any, float] = {}  # handlers too slow for the receiving commit, until when

    # ------------------------------------------------------------------ state

    def load(self) -> None:
        """Rebuild the buffers: delivered numbers from the invoker records, stored ones from the messages."""
        with self.store.local() as s:
            records = self.store.invokers(s)
            stored = self.store.incoming(s)
        with self._mutex:
            for record in records:
                self._machines[record.identifier] = InvokerBuffer(replace(record, stored=(), in_flight=(),
                                                                          final=None))
        for message in stored:
            self.stored(message.identifier, message.number)
        for identifier in list(self._machines):
            record = self.destinations.record(identifier)
            if record is not None and record.end_reason is not None:
                self.completed(identifier, record.received)

    def ensure(self, identifier: str) -> InvokerBuffer:
        with self._mutex:
            return self._buffer(identifier)

    def _buffer(self, identifier: str) -> InvokerBuffer:
        """The buffer of ``identifier``, made when missing; ``_mutex`` is held."""
        machine = self._machines.get(identifier)
        if machine is None:
            record = InvokerRecord(identifier, in_order=identifier != REDELIVERY)
            machine = self._machines[identifier] = InvokerBuffer(record)
        return machine

    def stored(self, identifier: str, number: int, message: Incoming | None = None) -> None:
        """``number`` of ``identifier`` is stored; ``message``, when given, is what was stored (kept in memory
        so that its delivery need not read it back)."""
        with self._mutex:
            if message is not None and len(self._cache) < CACHE_MAX:
                self._cache[identifier, number] = message
            actions = self._buffer(identifier).handle(MessageStored(number))
        self._dispatch(actions)

    def completed(self, identifier: str, received: AckRanges) -> None:
        with self._mutex:
            machine = self._buffer(identifier)
            if machine.record.final is not None:
                return
            actions = machine.handle(SequenceCompleted(received))
        self._dispatch(actions)

    def poll_redeliveries(self) -> None:
        """Pick up dead letters that an operator queued again (``qtp dead-letters retry``)."""
        with self.store.local() as s:
            waiting = self.store.incoming(s, REDELIVERY)
        with self._mutex:
            known = self._buffer(REDELIVERY).record
            fresh = [m.number for m in waiting
                     if not ranges.contains(known.stored, m.number) and not ranges.contains(known.delivered, m.number)]
        for number in fresh:
            self.stored(REDELIVERY, number)

    def pending(self, identifier: str) -> bool:
        """Does sequence ``identifier`` still have messages to apply?"""
        with self._mutex:
            machine = self._machines.get(identifier)
            return machine is not None and bool(ranges.difference(machine.record.stored, machine.record.delivered))

    def backlog_of(self, identifiers: set[str]) -> int:
        """Messages of these sequences stored and not yet applied."""
        with self._mutex:
            return sum(ranges.count(ranges.difference(m.record.stored, m.record.delivered))
                       for i, m in self._machines.items() if i in identifiers)

    def backlog(self) -> int:
        with self._mutex:
            return sum(ranges.count(ranges.difference(m.record.stored, m.record.delivered))
                       for m in self._machines.values())

    def _dispatch(self, actions: list[Any]) -> None:
        for a in actions:
            if isinstance(a, Deliver):
                self._schedule.put((a.identifier, a.number))
            elif isinstance(a, DeliveryFinished):
                with self._mutex:
                    self._machines.pop(a.identifier, None)
                self._finished(a.identifier)

    # ------------------------------------------------------------------ workers

    def start(self) -> None:
        for i in range(self.limits.invoker_threads):
            thread = threading.Thread(target=self._work, name=f"qtp-invoker-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stopping = True
        self._schedule.wake_all()
        for thread in self._threads:
            thread.join(timeout=30)

    def _work(self) -> None:
        while not self._stopping:
            self.step(timeout=0.5)

    def step(self, timeout: float = 0.0) -> bool:
        """Deliver one due message (waiting up to ``timeout`` for one); False when none was due. The worker
        threads loop on it; a test drives it directly with a fake clock."""
        item = self._schedule.get(timeout=timeout)
        if item is None:
            return False
        try:
            self._deliver(*item)
        except (QtpError, SQLAlchemyError) as exc:  # a database out of reach: the message waits a second
            outages.warn(log, "a message cannot be delivered now", "delivering %s #%d failed: %s", *item,
                         first_line(exc))
            self._abort(item[0], item[1], at=self.clock.time() + 1.0)
        except Exception:  # the worker survives; the message stays stored and in flight is released
            log.exception("delivering %s #%d failed unexpectedly", *item)
            self._abort(item[0], item[1], at=self.clock.time() + 1.0)
        return True

    def _deliver(self, identifier: str, number: int) -> None:
        batch = self.limits.invoker_batch if identifier != REDELIVERY else 1
        found = self._cached(identifier, number, batch)
        if not found:
            with self.store.local() as s:
                found = self.store.incoming(s, identifier, start=number, limit=batch)
        if not found or found[0].number != number:
            record = self.destinations.record(identifier)
            if identifier != REDELIVERY and (record is None or not ranges.contains(record.received, number)):
                self._abort(identifier, number, at=self.clock.time() + 0.2)  # not stored yet: look again soon
                return
            self._committed(identifier, number)  # stored once and consumed since: applied before
            return
        message = found[0]
        now = self.clock.time()
        if message.not_before > now:
            self._schedule.put((identifier, number), at=message.not_before)
            return
        if message.payload is None and message.action.endswith("/LastMessage"):
            self._finish_without_handler(message)
            return
        info = self.destinations.info(identifier)
        handler = self.handlers.for_message(message, info)
        if handler is None:
            self._no_handler(message, info, now)
            return
        following = self._batchable(message, found[1:], handler, info, now)
        if following:
            try:
                self._apply(handler, [message, *following])
                return
            except Exception as exc:  # each message gets its own transaction (and its own failure count)
                log.info("a batch of %d messages from %s #%d failed (%s); applying them one by one",
                         1 + len(following), identifier, number, exc)
                with self._mutex:
                    self._alone.update((identifier, m.number) for m in following)
        try:
            self._apply(handler, [message])
        except _AlreadyApplied:
            self._committed(identifier, number)
        except OutcomeUnknownError as exc:
            log.error("delivery of %s #%d: %s; it is tried again after recovery", identifier, number, exc)
            self._abort(identifier, number, at=self.clock.time() + self.limits.retry_backoff_max)
        except Exception as exc:
            self._failed(message, exc)

    def _no_handler(self, message: Incoming, info: Any, now: float) -> None:
        """A request no handler takes is refused (a dead letter at once, with a fault for a client that offered
        a sequence for replies): its sequence goes on. A reply waits, stored, for the reply handler of its
        channel (registered before a later start): a dead letter could not be given back to it."""
        if info is not None and info.channel is not None:
            refusals.warn(log, "no_reply_handler", "replies of channel %s wait: no reply handler is registered "
                          "(@node.reply_handler(%r) before node.start())", info.channel, info.channel)
            self._abort(message.identifier, message.number, at=now + self.limits.retry_backoff_max)
            return
        self._failed(message, MessageRefusedError(f"no handler is registered for action {message.action!r}"))

    # ------------------------------------------------------------------ apply on receipt

    def receipt(self, info: Any, record: Any, before: Any, messages: list[Incoming]) -> set[int] | None:
        """Store ``messages`` (just accepted for ``info``'s sequence, whose record becomes ``record``) and apply
        the ones at the head of the sequence in *one* global transaction: the destination record, the rows of
        the others, and for the head the handler, the applied MessageIDs, the replies and the invoker record
        commit together or not at all. Returns the numbers applied; None when it did nothing (not ``xa``, the
        invoker has work of the sequence, no head, no handler, or the handler raised: the transaction rolled
        back, and the caller stores the messages as usual, for the invoker to apply and count attempts). A
        failed or unknown commit raises (the caller's sequence is then stale and reloaded from the store).

        The receiver calls it under the sequence's lock, so no other message of the sequence can be stored
        (and handed to the invoker) meanwhile; the head must be the next number to deliver, with nothing of
        the sequence in flight, so in-order delivery is kept. Messages stored earlier beyond the head (they
        came before it: a gap, requests that overtook each other) are handed to the invoker after the commit."""
        if not self.on_receipt or not messages:
            return None
        head, handler = self._receipt_head(info, messages)
        if not head:
            return None
        identifier = messages[0].identifier
        numbers = [m.number for m in head]
        invoker_record = self._delivered_record(identifier, numbers)
        rest = messages[len(head):]
        in_body = False
        spent = 0.0
        try:
            with self._transaction() as tx:
                in_body = True
                queue = self._enlist(tx)
                if rest:
                    queue("store_incoming_many", rest)
                queue("save_destination", info, record, before)
                fresh = self._not_applied_before(queue, head)
                began = self.clock.monotonic()
                self._handle(tx, queue, handler, fresh)
                spent = self.clock.monotonic() - began
                queue("save_invoker", invoker_record)
                in_body = False
        except Exception as exc:
            if not in_body or isinstance(exc, OutcomeUnknownError):
                raise
            log.debug("applying %s #%d on receipt failed (%s); stored for the invoker", identifier, numbers[0], exc)
            return None
        failpoint("after_apply_before_ack")
        if spent > RECEIPT_BUDGET * len(head):  # the acknowledgement waited on the handler: not for a while
            self._slow[handler] = self.clock.monotonic() + RECEIPT_COOLDOWN
        now = self.clock.time()
        self.metrics.on_receipt.inc(len(head))
        for message in head:
            self.metrics.delivered.inc()
            self.metrics.latency.observe(max(0.0, now - (message.enqueued_at or message.received_at)))
        with self._mutex:  # messages stored beyond them are handed out next
            actions = self._commit_unhanded(identifier, numbers)
        self._dispatch(actions)
        return set(numbers)

    def _receipt_head(self, info: Any, messages: list[Incoming]) -> tuple[list[Incoming], Any]:
        """The messages at the head of ``messages`` that ``receipt`` may apply, and their handler."""
        first = messages[0]
        if first.identifier == REDELIVERY or info is None:
            return [], None
        handler = self.handlers.for_message(first, info)
        if handler is None:
            return [], None
        if handler in self._slow:
            if self._slow[handler] > self.clock.monotonic():
                return [], None
            del self._slow[handler]
        with self._mutex:
            r = self._buffer(first.identifier).record
            waiting = ranges.difference(r.stored, r.delivered)
            expected = ranges.contiguous_from_one(r.delivered) + 1
        if not r.in_order or r.in_flight or r.final is not None or first.number != expected:
            return [], None
        head: list[Incoming] = []
        for m in messages:  # the whole request: a rest left over would make the invoker take the next ones
            if m.number != expected + len(head) or m.payload is None or m.attempts or m.not_before \
                    or self.handlers.for_message(m, info) is not handler or not self.handlers.on_receipt(m, info):
                break  # (one function may serve an action on receipt and another not: each message's own say)
            head.append(m)
        if waiting and head and waiting[0][0] <= head[-1].number:
            return [], None  # (cannot be: the invoker has what the head brings) the invoker's, then
        return head, handler

    def _cached(self, identifier: str, number: int, limit: int) -> list[Incoming]:
        """The consecutive messages from ``number`` on that are in memory (empty when ``number`` is not)."""
        with self._mutex:
            found: list[Incoming] = []
            while len(found) < limit and (identifier, number + len(found)) in self._cache:
                found.append(self._cache[identifier, number + len(found)])
            return found

    def _uncache(self, identifier: str, numbers: list[int]) -> None:
        with self._mutex:
            for number in numbers:
                self._cache.pop((identifier, number), None)
                self._alone.discard((identifier, number))

    def _batchable(self, head: Incoming, rest: list[Incoming], handler: Callable[..., Any],
                   info: Any, now: float) -> list[Incoming]:
        """The stored messages right after ``head`` that can share its transaction: consecutive numbers of an
        in-order sequence, never tried before, for the same handler, none a WS-RM 1.0 LastMessage."""
        if head.attempts or not rest:
            return []
        with self._mutex:
            record = self._buffer(head.identifier).record
            alone = (head.identifier, head.number) in self._alone
        if alone or not record.in_order:
            return []
        batch: list[Incoming] = []
        expected = head.number + 1
        for m in rest:
            if m.number != expected or m.attempts or m.not_before > now or m.payload is None \
                    or ranges.contains(record.delivered, m.number) or self.handlers.for_message(m, info) is not handler:
                break
            batch.append(m)
            expected += 1
        return batch

    def _delivered_record(self, identifier: str, numbers: list[int]) -> InvokerRecord:
        """The invoker record once ``numbers`` (consecutive, the first one in flight) are delivered."""
        with self._mutex:
            probe = InvokerBuffer(self._buffer(identifier).record)
        for number in numbers:
            if number not in probe.record.in_flight:
                probe = InvokerBuffer(replace(probe.record, in_flight=(*probe.record.in_flight, number)))
            probe.handle(DeliveryCommitted(number))
        return replace(probe.record, in_flight=(), stored=(), final=None)

    def _apply(self, handler: Callable[..., Any], messages: list[Incoming]) -> None:
        """One global transaction: for each message its dequeue, its handler, its reply; then the record.
        Several messages share it only as a whole: all their effects commit together or none does."""
        identifier = messages[0].identifier
        numbers = [m.number for m in messages]
        record = self._delivered_record(identifier, numbers)
        with self._transaction() as tx:
            queue = self._enlist(tx)
            consumed = queue("consume_many", identifier, numbers)
            if queue.atomic and consumed != len(numbers):
                raise _AlreadyApplied()
            fresh = self._not_applied_before(queue, messages) if queue.atomic else messages
            self._handle(tx, queue, handler, fresh)
            queue("save_invoker", record)
        failpoint("after_apply_before_ack")
        now = self.clock.time()
        for message in messages:
            self.metrics.delivered.inc()
            self.metrics.latency.observe(max(0.0, now - (message.enqueued_at or message.received_at)))
        self._committed(identifier, messages[0].number, [m.number for m in messages[1:]])

    def _handle(self, tx: Any, queue: Enlisted, handler: Callable[..., Any], messages: list[Incoming]) -> None:
        """Run the handler on ``messages`` in ``tx`` (a batch handler with at most ``invoker_batch`` at a
        time) and enqueue their replies."""
        if isinstance(handler, _Batch):
            size = self.limits.invoker_batch
            results = [r for i in range(0, len(messages), size) for r in handler.apply(tx, messages[i:i + size])]
        else:
            results = [handler(tx, m) for m in messages]
        for message, result in zip(messages, results):
            reply = self._reply(message, result)
            if reply is not None:
                queue("enqueue", reply)
                tx.on_commit(self._wake)

    def _not_applied_before(self, queue: Enlisted, messages: list[Incoming]) -> list[Incoming]:
        """The messages whose MessageID was not applied before (under another sequence: their sender sent them
        again after the destination forgot the first one), remembered as applied by this transaction."""
        info = self.destinations.info(messages[0].identifier)
        keys = [applied_key(None if info is None else info.owner, m.message_id) for m in messages]
        seen = queue("applied_before", keys)
        for m, key in zip(messages, keys):
            if key in seen:
                log.warning("message %s (%s #%d) was applied before, under another sequence; consumed, not "
                            "applied again", m.message_id, m.identifier, m.number)
        queue("remember_applied", [key for key in keys if key not in seen], self.clock.time())
        return [m for m, key in zip(messages, keys) if key not in seen]

    def _reply(self, message: Incoming, result: Any, fault: str | None = None) -> Outgoing | None:
        """The reply (or fault) to enqueue, when the peer offered a sequence for replies."""
        if result is None and fault is None:
            return None
        if isinstance(result, str):
            result = result.encode("utf-8")
        if result is not None:
            check_payload(result)  # a handler returning bad XML fails here, not forever at the sender
        record = self.destinations.record(message.identifier)
        if record is None or record.accepted_offer is None:
            dropped.warn(log, "no_offer", "sequence %s offered no sequence for replies: the reply to %s is dropped",
                         message.identifier, message.message_id)
            return None
        info = self.destinations.info(message.identifier)
        wsa = WsaVersion(info.wsa) if info is not None else WsaVersion.WSA200508
        now = self.clock.time()
        return Outgoing(route=f"offer:{record.accepted_offer}", message_id=new_message_id(now),
                        action=WSA_FAULT_ACTION[wsa] if fault is not None else message.action + "Response",
                        payload=result, enqueued_at=now, relates_to=message.message_id, fault=fault)

    def _committed(self, identifier: str, number: int, following: list[int] | None = None) -> None:
        """``number`` (in flight) and the ``following`` numbers of its batch are applied."""
        done = set(following or ())
        self._uncache(identifier, [number, *done])
        if self._outages:
            self._outages.pop((identifier, number), None)
        actions: list[Any] = []
        with self._mutex:
            machine = self._buffer(identifier)
            if number not in machine.record.in_flight:
                return
            pending = list(machine.handle(DeliveryCommitted(number)))
            while pending:
                action = pending.pop(0)
                if isinstance(action, Deliver) and action.identifier == identifier and action.number in done:
                    done.discard(action.number)  # handed out by the machine, applied already by the batch
                    pending.extend(machine.handle(DeliveryCommitted(action.number)))
                else:
                    actions.append(action)
            # Applied by the batch before the receiver's MessageStored for them reached this machine (the store
            # commit comes first)
            actions.extend(self._commit_unhanded(identifier, sorted(done)))
        self._dispatch(actions)

    def _commit_unhanded(self, identifier: str, numbers: list[int]) -> list[Any]:
        """``numbers`` of ``identifier`` committed without the machine having handed them out (``_mutex`` held):
        each is marked stored and handed out first, so that the commit is legal in the machine; the actions
        that follow (the next numbers handed out)."""
        actions: list[Any] = []
        machine = self._buffer(identifier)
        for number in numbers:
            machine = self._machines[identifier] = InvokerBuffer(replace(
                machine.record, stored=ranges.add(machine.record.stored, number),
                in_flight=(*machine.record.in_flight, number)))
            actions.extend(machine.handle(DeliveryCommitted(number)))
        return actions

    def _abort(self, identifier: str, number: int, at: float) -> None:
        with self._mutex:
            machine = self._buffer(identifier)
            if number not in machine.record.in_flight:
                return
            actions = machine.handle(DeliveryAborted(number))
        for a in actions:
            if isinstance(a, Deliver):
                self._schedule.put((a.identifier, a.number), at=at if a.number == number else 0.0)

    def _failed(self, message: Incoming, exc: BaseException) -> None:
        limits = self.limits
        self._uncache(message.identifier, [message.number])  # its attempts change: read it back next time
        error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        now = self.clock.time()
        if transient(exc):  # an outage delays the message and never ends it: only a refusal counts
            key = (message.identifier, message.number)
            outages = self._outages[key] = self._outages.get(key, 0) + 1
            delay = limits.backoff(outages)
            log.warning("delivery of %s #%d failed for a transient cause (%d time(s); not counted as an attempt, "
                        "next in %.1f s): %s", message.identifier, message.number, outages, delay, error)
            self._abort(message.identifier, message.number, at=now + delay)
            return
        self._outages.pop((message.identifier, message.number), None)
        attempts = max(message.attempts + 1, limits.max_attempts if isinstance(exc, MessageRefusedError) else 0)
        peer = self._peer_of(message.identifier) if attempts >= limits.max_attempts else None
        if attempts >= limits.max_attempts and not self._dead_letters_full(peer):
            self._dead_letter(replace(message, attempts=attempts, last_error=error), error, now, peer)
            return
        delay = limits.backoff(attempts)
        if attempts >= limits.max_attempts:
            delay = limits.retry_backoff_max
            log.error("message %s (%s #%d) failed %d times, but %s has its cap of dead letters ([limits] "
                      "max_dead_letters = %d, per peer): it stays queued and its sequence waits; act on that "
                      "peer's dead letters (qtp dead-letters list|retry|drop)", message.message_id,
                      message.identifier, message.number, attempts, _peer_name(peer), limits.max_dead_letters)
        else:
            log.warning("handler failed for %s #%d (attempt %d of %d, next in %.1f s): %s", message.identifier,
                        message.number, attempts, limits.max_attempts, delay, error)
        with self.store.local() as s:
            self.store.note_failure(s, message.identifier, message.number, error, now + delay)
        self._abort(message.identifier, message.number, at=now + delay)

    def _peer_of(self, identifier: str) -> str | None:
        """The peer that owns inbound sequence ``identifier`` (None: an anonymous one, or redeliveries)."""
        info = self.destinations.info(identifier)
        return None if info is None else info.owner

    def _dead_letters_full(self, peer: str | None) -> bool:
        """Has ``peer`` its ``max_dead_letters``? The cap counts per peer, so one peer's refused messages never
        hold another's sequence. The counts are read from the store when first needed and then kept here: only
        this process adds dead letters, and ``qtp dead-letters retry|drop`` only removes them, so a kept count
        is never too low. A peer at its cap is read again (at most once a second) to see an operator's drops."""
        cap = self.limits.max_dead_letters
        with self._dead_mutex:
            counts = self._dead_counts
            stale = counts is not None and counts.get(peer, 0) >= cap and self.clock.monotonic() - self._dead_read_at >= 1.0
            if counts is None or stale:
                with self.store.local() as s:
                    counts = self._dead_counts = self.store.dead_letters_per_peer(s)
                self._dead_read_at = self.clock.monotonic()
            return counts.get(peer, 0) >= cap

    def _counted_dead_letter(self, peer: str | None) -> None:
        with self._dead_mutex:
            if self._dead_counts is not None:
                self._dead_counts[peer] = self._dead_counts.get(peer, 0) + 1

    def _dead_letter(self, message: Incoming, error: str, now: float, peer: str | None) -> None:
        """The message leaves its sequence for the dead letters (with the whole error); for request-reply the
        client gets a fault that says only that (the error, often SQL with its parameters, stays here). A
        fault that cannot be enqueued (the offered sequence is gone, its identifier does not fit) does not
        keep the message from becoming a dead letter."""
        record = self._delivered_record(message.identifier, [message.number])
        reason = (f"message {message.message_id[:200]} was not processed: it failed {message.attempts} time(s) "
                  "and is kept with the receiving node's dead letters")
        fault = None if message.fault is not None else self._reply(message, None, fault=reason)
        try:
            self._write_dead_letter(message, error, now, record, fault, peer)
        except (QtpError, SQLAlchemyError) as exc:
            if fault is None:
                raise
            log.error("the fault for dead letter %s could not be enqueued (%s); it is kept without one",
                      message.message_id, exc)
            fault = None
            self._write_dead_letter(message, error, now, record, None, peer)
        self._counted_dead_letter(peer)
        log.error("message %s (%s #%d from %s) is a dead letter after %d attempts: %s", message.message_id,
                  message.identifier, message.number, _peer_name(peer), self.limits.max_attempts, error)
        self.metrics.dead_lettered.inc()
        if fault is not None:
            self._wake()
        self._committed(message.identifier, message.number)

    def _write_dead_letter(self, message: Incoming, error: str, now: float, record: Any,
                           fault: Outgoing | None, peer: str | None) -> None:
        with self.store.local() as s:
            self.store.dead_letter(s, message, error, now, peer)
            self.store.save_invoker(s, record)
            if fault is not None:
                self.store.enqueue(s, fault)

    def _finish_without_handler(self, message: Incoming) -> None:
        """WS-RM 1.0's empty LastMessage: consumed, never shown to a handler."""
        record = self._delivered_record(message.identifier, [message.number])
        with self.store.local() as s:
            self.store.consume(s, message.identifier, message.number)
            self.store.save_invoker(s, record)
        self._committed(message.identifier, message.number)
