"""An in-memory resource: a real transactional key-value store that keeps the whole resource contract.

Each branch buffers its writes and holds a no-wait lock on every key it writes; prepare moves the
writes into the store's prepared set (which outlives the transaction manager that made them, as a
database would), commit applies them, rollback drops them. ``MemoryDatabase`` is the "database"; several
``MemoryResource`` objects on one store are the same database and share one branch.

Faults can be injected at any step (``resource.inject(step, exc)``) for the coordinator's model tests.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from qtp.errors import ConnectionClosedError, ResourceError, TransactionStateError
from qtp.xa._resource import Resource, Vote
from qtp.xa._xid import Xid, validate_name

_DELETED = object()


class MemoryDatabase:
    """The durable side of an in-memory resource: committed data, prepared branches, key locks.

    ``MemoryDatabase.named("x")`` returns the process's store called "x" (what ``memory://x`` URLs reach).
    """

    _named: dict[str, "MemoryDatabase"] = {}

    @classmethod
    def named(cls, name: str) -> "MemoryDatabase":
        return cls._named.setdefault(name, cls())

    def __init__(self) -> None:
        self.data: dict[Any, Any] = {}
        self.prepared: dict[Xid, dict[Any, Any]] = {}
        self.locks: dict[Any, Xid] = {}
        self.mutex = threading.RLock()


@dataclass
class _Branch:
    xid: Xid
    writes: dict[Any, Any] = field(default_factory=dict)
    open: bool = True


class MemoryConnection:
    """The application's handle on an in-memory branch: ``get``, ``put``, ``delete``, ``items``."""

    def __init__(self, resource: "MemoryResource", branch: _Branch):
        self._resource = resource
        self._branch = branch

    def _check(self) -> None:
        if not self._branch.open:
            raise ConnectionClosedError(
                f"this connection belonged to transaction {self._branch.xid}, which has ended; take a new one "
                "with tx.connection(name) inside a `with qtp.transaction()` block"
            )

    def get(self, key: Any, default: Any = None) -> Any:
        self._check()
        value = self._branch.writes.get(key, self._resource.store.data.get(key, default))
        return default if value is _DELETED else value

    def put(self, key: Any, value: Any) -> None:
        self._check()
        self._resource._lock_key(self._branch.xid, key)
        self._branch.writes[key] = value

    def delete(self, key: Any) -> None:
        self._check()
        self._resource._lock_key(self._branch.xid, key)
        self._branch.writes[key] = _DELETED

    def items(self) -> Iterator[tuple[Any, Any]]:
        self._check()
        merged = {**self._resource.store.data, **self._branch.writes}
        return iter([(k, v) for k, v in merged.items() if v is not _DELETED])


class MemoryResource(Resource):
    def __init__(self, name: str, node_id: str, store: MemoryDatabase | None = None):
        self.name = validate_name("resource name", name)
        self.node_id = node_id
        self.store = store if store is not None else MemoryDatabase()
        self.identity = ("memory", id(self.store))
        self._branches: dict[Xid, _Branch] = {}
        self._faults: dict[str, list[BaseException]] = {}
        self._counters: Counter = Counter()

    def __repr__(self) -> str:
        return f"<MemoryResource {self.name}>"

    # ------------------------------------------------------------------ fault injection

    def inject(self, step: str, fault: BaseException | Callable[[], None]) -> None:
        """At the next call of ``step`` (begin, prepare, commit, rollback, recover) raise ``fault``, or, when
        it is a function, call it first (to block on a barrier, say)."""
        self._faults.setdefault(step, []).append(fault)

    def _maybe_fail(self, step: str) -> None:
        pending = self._faults.get(step)
        if pending:
            fault = pending.pop(0)
            if isinstance(fault, BaseException):
                raise fault
            fault()

    # ------------------------------------------------------------------ the contract

    def begin(self, xid: Xid) -> None:
        self._maybe_fail("begin")
        if xid in self._branches:
            raise TransactionStateError(f"branch {xid} already begun on {self.name!r}")
        self._branches[xid] = _Branch(xid)
        self._counters["begin"] += 1

    def connection(self, xid: Xid) -> MemoryConnection:
        branch = self._branches.get(xid)
        if branch is None:
            raise TransactionStateError(f"resource {self.name!r} has no active branch {xid}")
        return MemoryConnection(self, branch)

    def _lock_key(self, xid: Xid, key: Any) -> None:
        with self.store.mutex:
            holder = self.store.locks.setdefault(key, xid)
        if holder != xid:
            raise ResourceError(f"key {key!r} of {self.name!r} is locked by {holder} (no-wait lock conflict)")

    def _release(self, xid: Xid) -> None:
        with self.store.mutex:
            for key in [k for k, holder in self.store.locks.items() if holder == xid]:
                del self.store.locks[key]

    def may_have_written(self, xid: Xid) -> bool:
        branch = self._branches.get(xid)
        return branch is None or bool(branch.writes)

    def prepare(self, xid: Xid) -> Vote:
        branch = self._branches.pop(xid, None)
        if branch is None:
            raise TransactionStateError(f"prepare: resource {self.name!r} has no active branch {xid}")
        branch.open = False
        try:
            self._maybe_fail("prepare")
        except BaseException:
            self._release(xid)
            raise
        if not branch.writes:
            self._release(xid)
            return Vote.READ_ONLY
        with self.store.mutex:
            self.store.prepared[xid] = branch.writes
        self._counters["prepare"] += 1
        return Vote.YES

    def commit(self, xid: Xid, one_phase: bool = False) -> None:
        self._maybe_fail("commit")
        with self.store.mutex:
            if one_phase:
                branch = self._branches.pop(xid, None)
                if branch is None:
                    raise TransactionStateError(f"one-phase commit: {self.name!r} has no active branch {xid}")
                branch.open = False
                writes = branch.writes
            else:
                writes = self.store.prepared.pop(xid, None)
            self._apply(writes or {})
            self._release(xid)
        self._counters["commit_one_phase" if one_phase else "commit"] += 1

    def _apply(self, writes: dict[Any, Any]) -> None:
        for key, value in writes.items():
            if value is _DELETED:
                self.store.data.pop(key, None)
            else:
                self.store.data[key] = value

    def rollback(self, xid: Xid) -> None:
        self._maybe_fail("rollback")
        with self.store.mutex:
            branch = self._branches.pop(xid, None)
            if branch is not None:
                branch.open = False
            self.store.prepared.pop(xid, None)
            self._release(xid)
        self._counters["rollback"] += 1

    def detach(self, xid: Xid) -> None:
        """An active branch is dropped, as a database drops it with its connection; a prepared one stays."""
        branch = self._branches.pop(xid, None)
        if branch is not None:
            branch.open = False
            self._release(xid)

    def recover(self) -> list[Xid]:
        self._maybe_fail("recover")
        with self.store.mutex:
            return [x for x in self.store.prepared if x.belongs_to(self.node_id)]

    def forget(self, xid: Xid) -> None:
        with self.store.mutex:
            self.store.prepared.pop(xid, None)
