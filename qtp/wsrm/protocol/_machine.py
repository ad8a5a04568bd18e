"""What every WS-RM machine shares: the table check, the move to FAILED, and the database-row round trip.

A machine object wraps one *record*, a frozen dataclass of plain values (strings, numbers, tuples, enums).
``handle(event)`` looks the event up in the machine's transition table, lets the event's handler compute
the next record and the actions, checks that the handler landed in a state the table allows, and only then
keeps the new record. The record is all the state there is: ``to_row(machine.record)`` gives a JSON-able
dict for a database row, ``from_row`` gives the record back, and a machine rebuilt from it behaves the same.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from enum import Enum
from typing import Any, ClassVar, Generic, NoReturn, Protocol, TypeVar

from qtp.wsrm.protocol._errors import ProtocolError
from qtp.wsrm.protocol._events import Action, Event, SetTimer
from qtp.wsrm.protocol._tables import Table


class Record(Protocol):
    state: Any
    failure: str | None
    ENUMS: ClassVar[dict[str, type[Enum]]]


R = TypeVar("R", bound=Record)


class _Violation(Exception):
    """Raised by a handler when an allowed event carries something impossible (a number never delivered)."""


class Machine(Generic[R]):
    """Base of the RM Source, RM Destination and invoker machines."""

    name: ClassVar[str] = "machine"

    def __init__(self, record: R):
        self._record = record

    @property
    def record(self) -> R:
        return self._record

    @property
    def state(self) -> Enum:
        return self._record.state

    def table(self) -> Table:
        raise NotImplementedError

    def next_timer(self, record: R) -> float | None:
        return None

    def handle(self, event: Event) -> list[Action]:
        """Apply one event; return the actions to carry out. Raises ProtocolError for a disallowed event."""
        event_name = type(event).__name__
        allowed = self.table().get(self._record.state, {}).get(event_name)
        if allowed is None:
            self._fail(event_name, self._why_disallowed())
        handler: Callable[[Any], tuple[R, list[Action]]] = getattr(self, "on_" + event_name)
        try:
            record, actions = handler(event)
        except _Violation as exc:
            self._fail(event_name, str(exc))
        if record.state not in allowed:
            self._fail(event_name, f"handler chose {record.state.value}, table allows {_names(allowed)}")
        before = self.next_timer(self._record)
        self._record = record
        after = self.next_timer(record)
        if after != before:
            actions.append(SetTimer(after))
        return actions

    def _why_disallowed(self) -> str:
        if self._record.failure is not None:
            return f"the machine failed earlier: {self._record.failure}"
        return "not in the transition table"

    def _fail(self, event_name: str, why: str) -> NoReturn:
        state = self._record.state
        if self._record.failure is None:
            failed = type(state)["FAILED"]
            self._record = dataclasses.replace(
                self._record, state=failed, failure=f"{event_name} in {state.value}: {why}"
            )
        raise ProtocolError(self.name, state.value, event_name, why)


def _names(states: frozenset[Enum]) -> str:
    return ", ".join(sorted(s.value for s in states))


def to_row(record: Any) -> dict[str, Any]:
    """A JSON-able dict of the record: enums by value, tuples as lists."""
    return {f.name: _plain(getattr(record, f.name)) for f in dataclasses.fields(record)}


def from_row(cls: type[R], row: dict[str, Any]) -> R:
    """The record saved by ``to_row`` (also after a JSON round trip)."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name not in row:
            continue
        value = _tuples(row[f.name])
        enum = cls.ENUMS.get(f.name)
        values[f.name] = enum(value) if enum is not None and value is not None else value
    return cls(**values)


def _plain(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def _tuples(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    return value
