"""The resource contract: what the transaction manager may ask of a database, written once.

Every resource (PostgreSQL, MySQL/MariaDB, in-memory) implements :class:`Resource`, and one contract test
suite (tests/test_xa_contract.py) runs against all of them.

Call order for one branch (``xid``) of a global transaction::

    begin(xid) ── connection(xid)* ──┬── commit(xid, one_phase=True)                  (only writer)
                                     ├── prepare(xid) ──┬── YES ── commit(xid) | rollback(xid)
                                     │                  └── READ_ONLY (branch is finished)
                                     └── rollback(xid)

and, after a crash, on any process of the same node::

    recover() -> [xid, ...] ── commit(xid) | rollback(xid) ── (forget(xid) after a heuristic outcome)

A branch is identified by its xid alone, so the phase-2 calls and recovery work whether or not the
connection that did the work is still open.
"""

from __future__ import annotations

import abc
import enum
from typing import Any

from qtp.xa._xid import Xid


class Vote(enum.Enum):
    """A branch's answer to prepare. A "no" is not a value: prepare raises instead."""

    YES = "yes"              # prepared: durable, holding its locks, waiting for the decision
    READ_ONLY = "read-only"  # wrote nothing: already finished, takes no part in phase 2 or the log


class Resource(abc.ABC):
    """One database (or in-memory store) that can take part in two-phase commit.

    ``name`` is the branch qualifier of every xid this resource creates. ``identity`` names the underlying
    database: two resources with equal identity are the same database, and the manager gives them one
    branch per transaction (so a co-located store costs one local commit).
    """

    name: str
    identity: tuple

    @abc.abstractmethod
    def begin(self, xid: Xid) -> None:
        """Start branch ``xid``: take a connection and open the branch on it.

        May raise ResourceUnavailableError (cannot connect; nothing was started) or ResourceError.
        """

    @abc.abstractmethod
    def connection(self, xid: Xid) -> Any:
        """The application's handle on branch ``xid`` (a SQLAlchemy Connection for SQL resources).

        The handle refuses to work once the branch is prepared or finished (ConnectionClosedError).
        """

    @abc.abstractmethod
    def may_have_written(self, xid: Xid) -> bool:
        """False only when branch ``xid`` certainly did no work (known without asking the database).

        The manager uses it before phase 1: branches that did nothing are ended read-only at once, and when
        a single branch is left it is committed in one phase.
        """

    @abc.abstractmethod
    def prepare(self, xid: Xid) -> Vote:
        """The vote. Make the branch's work durable and promise to commit it on request.

        Returns YES, or READ_ONLY when the branch wrote nothing (the branch is then finished and released).
        Raising means "no": the branch is rolled back (or will be by ``rollback``), and the error says why
        (PrepareRefusedError when the database cannot prepare at all, with the setting to change).
        """

    @abc.abstractmethod
    def commit(self, xid: Xid, one_phase: bool = False) -> None:
        """Commit the branch.

        ``one_phase=True``: the branch was never prepared; commit it directly (may raise; then nothing
        was committed, and the caller rolls back). Otherwise the branch is prepared; commit it. This
        is idempotent: an xid the database no longer knows was already resolved, and returns quietly.
        After a durable decision this must never be turned into a rollback; it may raise
        ResourceUnavailableError, and the caller retries later.
        """

    @abc.abstractmethod
    def rollback(self, xid: Xid) -> None:
        """Roll the branch back, whether active, failed or prepared. Idempotent like ``commit``."""

    @abc.abstractmethod
    def recover(self) -> list[Xid]:
        """The prepared (in-doubt) branches of this resource's node and of qtp's format id only.

        Other managers' xids and hand-made prepared transactions are never listed, so never touched.
        """

    @abc.abstractmethod
    def forget(self, xid: Xid) -> None:
        """Drop what the resource remembers of a heuristically completed branch (a no-op where the
        database keeps nothing)."""

    @abc.abstractmethod
    def detach(self, xid: Xid) -> None:
        """Let go of branch ``xid`` without resolving it: close its connection. A prepared branch stays
        prepared in the database, for recovery; an active one is rolled back by the database as its
        connection closes. Never raises."""

    # ---------------------------------------------------------------- Logging Last Resource (optional)
    #
    # A resource that can hold the commit decision in its own local transaction (a SQL database) says so
    # with ``last_resource_capable``; the manager may then commit it in one phase, with the decision row
    # written into the branch, instead of preparing it and forcing the file log.

    last_resource_capable: bool = False

    # Whether a one-phase commit of this resource is durable once acknowledged. False for MariaDB with the
    # binary log on: an acknowledged XA COMMIT can come back prepared after a server crash (MDEV-31949,
    # MDEV-33168), so qtp never commits such a branch without a logged decision, and never makes it the
    # last resource.
    one_phase_safe: bool = True

    def work_done(self, xid: Xid) -> int:
        """How much branch ``xid`` did (statements run): the rule that picks the last resource."""
        return 0

    def write_decision(self, xid: Xid, gtrid: str, branches: list[str]) -> None:
        """Insert the commit decision row of ``gtrid`` (naming the other ``branches``) inside branch ``xid``.
        The row is committed, and the decision thereby made, by ``commit(xid, one_phase=True)``."""
        raise NotImplementedError(f"{type(self).__name__} cannot serve as the last resource")

    def read_decisions(self, node_id: str) -> dict[str, list[str]]:
        """The committed decision rows of ``node_id`` (gtrid -> other branches); raises when unreadable."""
        raise NotImplementedError(f"{type(self).__name__} cannot serve as the last resource")

    def forget_decisions(self, gtrids: list[str]) -> None:
        """Delete decision rows whose transactions are complete (an END record, in effect)."""
        raise NotImplementedError(f"{type(self).__name__} cannot serve as the last resource")

    def cancel(self, xid: Xid) -> None:
        """Interrupt the statement branch ``xid`` is running, from another thread (a no-op where nothing can
        block). The branch's owner then sees its statement fail and rolls back."""

    def close(self) -> None:
        """Release pooled connections. Prepared branches stay prepared."""

    # Statistics the tests and benchmarks read: how many of each call reached the database.
    def counters(self) -> dict[str, int]:
        return dict(getattr(self, "_counters", {}))
