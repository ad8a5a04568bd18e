"""The invoker buffer: which accepted messages may go to the application, and when.

Theory. Exactly-once delivery needs two sets beside the destination's ``received``: ``delivered`` (the
application's transaction for that number committed) and ``in_flight`` (handed over, outcome unknown). A
number is handed over only if it is stored, not delivered and not in flight, so it is never handed to two
workers at once; it becomes delivered only by DeliveryCommitted, saved in the same transaction as the
application's update, and an aborted delivery returns it to the pool. With InOrder, only the lowest number
not yet delivered may be in flight, so the application sees 1, 2, 3, ... one at a time. Once the sequence
ends, ``final`` is its complete set of numbers; in order delivery then skips the gaps that will never be
filled (the WS-RM 1.1 NoDiscard behaviour) and the buffer completes when every final number is delivered.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import ClassVar

from qtp.wsrm.protocol import _ranges as ranges
from qtp.wsrm.protocol._events import (
    Action,
    Deliver,
    DeliveryAborted,
    DeliveryCommitted,
    DeliveryFinished,
    MessageStored,
    SequenceCompleted,
)
from qtp.wsrm.protocol._machine import Machine, _Violation
from qtp.wsrm.protocol._messages import AckRanges
from qtp.wsrm.protocol._tables import INVOKER, InvokerState, Table

I = InvokerState  # noqa: E741


@dataclass(frozen=True, slots=True)
class InvokerRecord:
    identifier: str
    in_order: bool
    state: InvokerState = I.ACTIVE
    stored: AckRanges = ()
    delivered: AckRanges = ()
    in_flight: tuple[int, ...] = ()
    final: AckRanges | None = None
    failure: str | None = None

    ENUMS: ClassVar[dict[str, type[Enum]]] = {"state": InvokerState}


Step = tuple[InvokerRecord, list[Action]]


class InvokerBuffer(Machine[InvokerRecord]):
    """Invoker machine for one destination sequence."""

    name = "Invoker buffer"

    def table(self) -> Table:
        return INVOKER

    def on_MessageStored(self, e: MessageStored) -> Step:
        r = self._record
        if ranges.contains(r.stored, e.number):
            return r, []  # stored twice: still delivered once
        if r.final is not None and not ranges.contains(r.final, e.number):
            raise _Violation(f"message {e.number} is not part of the completed sequence")
        return self._dispatch(dataclasses.replace(r, stored=ranges.add(r.stored, e.number)))

    def on_DeliveryCommitted(self, e: DeliveryCommitted) -> Step:
        r = self._record
        if e.number not in r.in_flight:
            raise _Violation(f"message {e.number} was not handed to the application")
        r = dataclasses.replace(r, delivered=ranges.add(r.delivered, e.number),
                                in_flight=tuple(n for n in r.in_flight if n != e.number))
        return self._dispatch(r)

    def on_DeliveryAborted(self, e: DeliveryAborted) -> Step:
        r = self._record
        if e.number not in r.in_flight:
            raise _Violation(f"message {e.number} was not handed to the application")
        return self._dispatch(dataclasses.replace(r, in_flight=tuple(n for n in r.in_flight if n != e.number)))

    def on_SequenceCompleted(self, e: SequenceCompleted) -> Step:
        r = self._record
        if r.final is not None:
            return r, []
        if ranges.difference(r.stored, e.received):
            raise _Violation("the completed sequence lacks messages that were stored")
        return self._dispatch(dataclasses.replace(r, final=e.received, state=I.DRAINING))

    def _dispatch(self, r: InvokerRecord) -> Step:
        actions: list[Action] = []
        for number in self._ready(r):
            actions.append(Deliver(r.identifier, number))
            r = dataclasses.replace(r, in_flight=(*r.in_flight, number))
        if r.final is not None and r.state is not I.COMPLETE and not ranges.difference(r.final, r.delivered):
            r = dataclasses.replace(r, state=I.COMPLETE)
            actions.append(DeliveryFinished(r.identifier))
        return r, actions

    @staticmethod
    def _ready(r: InvokerRecord) -> list[int]:
        waiting = ranges.difference(r.stored, r.delivered)
        if not r.in_order:
            return [n for n in ranges.numbers(waiting) if n not in r.in_flight]
        if r.in_flight:
            return []
        if r.final is None:
            expected = ranges.contiguous_from_one(r.delivered) + 1
        else:
            remaining = ranges.difference(r.final, r.delivered)
            expected = remaining[0][0] if remaining else 0
        return [expected] if expected and ranges.contains(r.stored, expected) else []
