"""The coordinator against a simple model, through faults, interrupts, crashes, restarts and recovery.

The "databases" are three ``MemoryDatabase`` objects. Like real databases they outlive the transaction manager
that wrote to them: committed data, prepared branches and the locks those hold survive a crash; a branch not
yet prepared dies with its connection. The rules run global transactions over them with faults injected
(a resource that votes no or loses its connection, a KeyboardInterrupt at a failpoint or inside a resource
call, a kill -9 at a failpoint or inside a resource call), and crash, shut down, restart and recover the
manager in between. Phase-2 retries wait in a queue until a rule runs them, so a crash can come first.

Transaction number ``n`` writes keys ``(n, k)`` that no other transaction writes, so what is visible of each
transaction can be read from the stores. A written branch is *committed* (its writes visible), *prepared*
(in doubt: recovery may still go either way) or *gone* (rolled back, or dropped with its connection).

After every step:

- atomicity: no transaction has one branch committed and another gone, and no branch is half applied;
- the reported outcome holds: COMMITTED -> every branch committed; COMMITTED_PENDING -> no branch gone;
  ROLLED_BACK -> no branch committed and no COMMIT record on disk; UNKNOWN, or a crash before the
  transaction had an outcome -> atomicity only;
- only prepared branches hold locks (no transaction is active between steps), and the only transactions in
  flight are those whose phase-2 retry is queued.

After a recovery pass on a manager with no retry queued: nothing is prepared or locked and the log on disk
holds no open decision, so every transaction ended all or nothing, the way it was reported.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import tempfile
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable
from unittest import mock

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from qtp.coordinator import Outcome, TransactionManager, _log, _transaction, failpoints, read_log
from qtp.errors import (
    LogError,
    OutcomeUnknownError,
    ResourceError,
    ResourceUnavailableError,
    RollbackError,
)
from qtp.xa import MemoryResource
from qtp.xa._memory import MemoryDatabase

NAMES = ("r0", "r1", "r2")
NODE = "model"

STEPS = ("begin", "prepare", "commit", "rollback")

work = st.dictionaries(
    st.sampled_from(NAMES),
    st.dictionaries(st.integers(0, 4), st.integers(0, 99), max_size=3),  # {} = enlisted, wrote nothing
    max_size=3,
)
two_phase_work = st.dictionaries(  # two writers or more: the commit decision is logged
    st.sampled_from(NAMES), st.dictionaries(st.integers(0, 4), st.integers(0, 99), min_size=1, max_size=3),
    min_size=2, max_size=3,
)
faults = st.one_of(st.none(), st.tuples(st.sampled_from(NAMES), st.sampled_from(["begin", "prepare", "commit"])))
resource_calls = st.tuples(st.sampled_from(NAMES), st.sampled_from(STEPS))  # where an interrupt or a kill strikes
# A branch whose rollback fails, if one is asked: the database does not answer, or Ctrl-C comes then.
failed_rollbacks = st.one_of(st.none(), st.tuples(st.sampled_from(NAMES), st.sampled_from(["error", "interrupt"])))



# Where a two-phase commit can be cut (``last``: the last branch's point).
STAGES = ("before_prepare", "after_prepare_0", "after_prepare_last", "decision_appended", "log_write",
          "after_decision_forced", "after_commit_0", "after_commit_last", "before_end_record")


def failpoint_at(plan: dict[str, dict[int, int]], stage: str) -> str | None:
    """The failpoint of ``stage`` on the commit path of ``plan``; a lone writer's path has one point, after
    its one-phase commit, and a plan without writes has none."""
    writers = sum(1 for writes in plan.values() if writes)
    if writers <= 1:
        return "after_one_phase_commit" if writers else None
    return stage.replace("last", str(writers - 1))


ENDED = (RollbackError, ResourceError, OutcomeUnknownError, KeyboardInterrupt)  # what a transaction may raise


class Crash(BaseException):
    """kill -9 of the manager's process, struck at a failpoint or inside a resource call."""


def _dies_with_the_process(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(self: "ModelResource", *args: Any, **kwargs: Any) -> Any:
        if self.dead:
            raise Crash(f"{self.name}: the manager's process was killed")
        return method(self, *args, **kwargs)
    return call


class ModelResource(MemoryResource):
    """A MemoryResource as the manager's process sees it: once ``dead`` (the process was killed) every call
    raises Crash and leaves the store alone, so code that runs after a simulated kill changes nothing."""

    dead = False


for _method in ("begin", "connection", "may_have_written", "prepare", "commit", "rollback", "detach", "recover",
                "forget"):
    setattr(ModelResource, _method, _dies_with_the_process(getattr(MemoryResource, _method)))


class HeldRetries:
    """Stands in for the manager's phase-2 retry pool: a retry waits until ``run()``, so that a crash can
    strike first (``drop()``: kill -9 ends the retry thread's work with the process)."""

    def __init__(self) -> None:
        self.queue: list[tuple[Future, Callable[..., Any], tuple]] = []

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        self.queue.append((future, fn, args))
        return future

    def gtrids(self) -> set[str]:
        return {args[0] for _, _, args in self.queue}

    def run(self) -> None:
        while self.queue:
            future, fn, args = self.queue.pop(0)
            future.set_running_or_notify_cancel()
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # kept on the future, as a pool thread would
                future.set_exception(exc)

    def drop(self) -> None:
        for future, _, _ in self.queue:
            future.cancel()
        self.queue.clear()

    def shutdown(self, wait: bool = True) -> None:
        self.run()


@dataclass
class Record:
    """One transaction as the model knows it: its writes per resource and what the coordinator reported
    (None: the process was killed before the transaction had an outcome)."""

    number: int
    writes: dict[str, dict[tuple[int, int], int]]
    gtrid: str = ""
    reported: Outcome | None = None
    crashed: bool = False
    notes: list[str] = field(default_factory=list)


class CoordinatorModel(RuleBasedStateMachine):
    checks_the_log = True  # no COMMIT record for a rolled-back transaction, none open after recovery (False: data only)

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="qtp-model-")
        self.stores = {n: MemoryDatabase() for n in NAMES}
        self.records: list[Record] = []
        self.tm: TransactionManager | None = None
        self.killed = False
        self._start()

    def _start(self) -> None:
        """A manager over the log directory and the stores, with new resource objects on the stores."""
        self.tm = TransactionManager(NODE, self.dir, recovery_interval=None, phase_two_retry_s=0.2)
        self.tm._retry_pool.shutdown()
        self.tm._retry_pool = self.retries = HeldRetries()  # type: ignore[assignment]
        self.tm._parallel_limit = -1  # branches one after another, so that every example replays the same way
        self.res = {n: ModelResource(n, NODE, self.stores[n]) for n in NAMES}
        for name, res in self.res.items():
            self.tm.add_resource(name, res)
        self.killed = False

    def teardown(self) -> None:
        failpoints.configure(None)
        if self.tm is not None:
            self.retries.run()
            self.tm.close(drain_s=0)
        shutil.rmtree(self.dir, ignore_errors=True)

    @property
    def log_dir(self) -> Path:
        return Path(self.dir) / NODE

    def usable(self) -> bool:
        return self.tm is not None and not self.tm.log.failed

    # ------------------------------------------------------------------ running one transaction

    def _run(self, plan: dict[str, dict[int, int]]) -> Record:
        """Run ``plan`` (resource -> {key: value}) as one transaction; record it and what it reported."""
        number = len(self.records)
        record = Record(number, {n: {(number, k): v for k, v in w.items()} for n, w in plan.items() if w})
        self.records.append(record)
        tx = None
        try:
            with self.tm.transaction() as tx:
                record.gtrid = tx.xid
                for name, writes in plan.items():
                    conn = tx.connection(name)
                    for key, value in writes.items():
                        conn.put((number, key), value)
        except ENDED as exc:
            record.notes.append(repr(exc))
        except Crash as exc:
            assert self.killed
            record.notes.append(repr(exc))
        finally:
            for res in self.res.values():
                res._faults.clear()
        if tx is None:  # begin() itself was cut (its start-up recovery pass): no transaction ran
            assert not record.gtrid and record.notes, record
            self.records.remove(record)
        if self.killed:
            record.crashed = True
            self._crash()
        elif tx is not None:
            record.reported = tx.outcome
            assert record.reported is not None, f"transaction {number} returned without an outcome"
        return record

    def _kill(self) -> None:
        """The instant of kill -9: from here on nothing the process does reaches a store or the log's disk."""
        self.killed = True
        for res in self.res.values():
            res.dead = True
        with self.tm.log._cond:
            if self.tm.log._failed is None:
                self.tm.log._failed = Crash("killed")
        raise Crash("killed")

    @contextlib.contextmanager
    def _killed_at(self, point: str | None):
        """Make failpoint ``point`` a kill -9 (the library's own ``crash`` action would kill the test run)."""
        real = failpoints.failpoint

        def reach(name: str) -> None:
            if name == point:
                self._kill()
            real(name)

        with mock.patch.object(_transaction, "failpoint", reach), mock.patch.object(_log, "failpoint", reach):
            yield

    def _crash(self) -> None:
        """kill -9 of the manager: the stores and the log's disk stay as they are; the log's unflushed buffer,
        the queued retries and every active (unprepared) branch are lost, the last with their connections."""
        tm, self.tm = self.tm, None
        for res in self.res.values():
            res.dead = True
        self.retries.drop()
        tm._closed = True  # the timeout reaper's loop ends
        with tm.log._cond:
            if tm.log._failed is None:
                tm.log._failed = Crash("killed")
        os.close(tm.log._fd)
        os.close(tm.log._lock_fd)  # the kernel releases the flock of a dead process
        tm.log._fd = tm.log._lock_fd = -1
        tm._pool.shutdown(wait=False)
        for store in self.stores.values():
            with store.mutex:
                for key, holder in list(store.locks.items()):
                    if holder not in store.prepared:
                        del store.locks[key]

    # ------------------------------------------------------------------ rules

    @staticmethod
    def _expected(plan, fault):
        """'commit', 'rollback' or 'pending' (committed; phase 2 finished by the background retry)."""
        if fault is None or fault[0] not in plan:
            return "commit"
        name, step = fault
        writers = [n for n, writes in plan.items() if writes]
        if step == "begin":
            return "rollback"
        if step == "prepare":  # asked of idle branches, and of writers when two or more wrote
            asked = not plan[name] or (len(writers) >= 2 and name in writers)
            return "rollback" if asked else "commit"
        if name not in writers:
            return "commit"
        # one writer: its one-phase commit lost the connection, so only the database knows the outcome (the
        # in-memory database, like a real one, drops a transaction whose connection went away)
        return "pending" if len(writers) >= 2 else "unknown"

    @precondition(usable)
    @rule(plan=work, fault=faults)
    def transaction(self, plan, fault):
        """One transaction with at most one ordinary fault (a no vote, a lost connection at commit); its
        outcome is known exactly."""
        self.tm.start_recovery()  # the start-up pass runs first, so the fault is this transaction's
        if fault is not None and fault[0] in plan:
            exc = ResourceUnavailableError("injected") if fault[1] == "commit" else ResourceError("injected")
            self.res[fault[0]].inject(fault[1], exc)
        expected = self._expected(plan, fault)
        record = self._run(plan)
        want = {"commit": Outcome.COMMITTED, "pending": Outcome.COMMITTED_PENDING,
                "rollback": Outcome.ROLLED_BACK, "unknown": Outcome.UNKNOWN}[expected]
        assert record.reported is want, (plan, fault, record)

    def _arm(self, plan, failed_rollback) -> None:
        if failed_rollback is not None and failed_rollback[0] in plan:
            name, kind = failed_rollback
            self.res[name].inject("rollback", ResourceUnavailableError("no answer") if kind == "error"
                                  else KeyboardInterrupt("Ctrl-C during rollback"))

    @precondition(usable)
    @rule(plan=work, stage=st.sampled_from(STAGES), failed_rollback=failed_rollbacks)
    def interrupted_at_failpoint(self, plan, stage, failed_rollback):
        """A transaction cut by a KeyboardInterrupt (Ctrl-C, a signal handler's exception) at a failpoint of
        its commit path; optionally a branch whose rollback then fails."""
        self._arm(plan, failed_rollback)
        point = failpoint_at(plan, stage)
        failpoints.configure(f"{point}=interrupt" if point else None)
        try:
            self._run(plan)
        finally:
            failpoints.configure(None)

    @precondition(usable)
    @rule(plan=two_phase_work, failed_rollback=failed_rollbacks)
    def interrupted_after_the_append(self, plan, failed_rollback):
        """Ctrl-C in the narrowest window of the commit path, between the COMMIT record's append and its
        flush (made, not yet durable); a rule of its own so that examples reach it often."""
        self.interrupted_at_failpoint(plan, "decision_appended", failed_rollback)

    @precondition(usable)
    @rule(plan=work, call=resource_calls, failed_rollback=failed_rollbacks)
    def interrupted_in_resource_call(self, plan, call, failed_rollback):
        """A KeyboardInterrupt raised inside a resource call (begin, prepare, commit, rollback), before the
        call does anything; optionally a branch whose rollback then fails."""
        self._arm(plan, failed_rollback)
        name, step = call
        self.res[name].inject(step, KeyboardInterrupt(f"Ctrl-C at {step}"))
        self._run(plan)

    @precondition(usable)
    @rule(plan=work, stage=st.sampled_from(STAGES), failed_rollback=failed_rollbacks)
    def killed_at_failpoint(self, plan, stage, failed_rollback):
        """kill -9 of the manager at a failpoint of its commit path."""
        self._arm(plan, failed_rollback)
        with self._killed_at(failpoint_at(plan, stage)):
            self._run(plan)

    @precondition(usable)
    @rule(plan=work, call=resource_calls, failed_rollback=failed_rollbacks)
    def killed_in_resource_call(self, plan, call, failed_rollback):
        """kill -9 of the manager inside a resource call, before the call does anything (if it is made)."""
        self._arm(plan, failed_rollback)
        name, step = call
        self.res[name].inject(step, self._kill)
        self._run(plan)

    @precondition(lambda self: self.tm is not None)
    @rule()
    def run_retries(self):
        """The background phase-2 retries queued so far run (the retry thread gets its turn)."""
        self.retries.run()

    @precondition(lambda self: self.tm is not None)
    @rule()
    def crash(self):
        """kill -9 of an idle manager (queued retries and the log's unflushed buffer are lost)."""
        self._crash()

    @precondition(lambda self: self.tm is not None)
    @rule()
    def shut_down(self):
        """A clean ``close()``: retries finish, the log is flushed and unlocked."""
        self.retries.run()
        self.tm.close(drain_s=0)
        self.tm = None

    @precondition(lambda self: self.tm is None)
    @rule()
    def restart(self):
        """A new manager on the same log directory, with new resource objects over the same stores."""
        self._start()

    @precondition(lambda self: self.tm is not None)
    @rule()
    def recover(self):
        """One recovery pass (``tm.recover()``). A failed log refuses (only a restart reads what reached the
        disk); otherwise the pass finds no problem, and with no retry queued it leaves nothing in doubt."""
        if self.tm.log.failed:
            with pytest.raises(LogError):
                self.tm.recover()
            return
        report = self.tm.recover()
        assert report.error is None and not report.problems, report.to_dict()
        if not self.retries.queue:
            self._assert_resolved()

    def _assert_resolved(self) -> None:
        self.reported_outcomes_hold()  # first: it names the transaction whose promise a leftover breaks
        assert self.tm.in_flight() == set()
        for name, store in self.stores.items():
            assert store.prepared == {}, f"after recovery {name} still holds prepared branches {store.prepared}"
            assert store.locks == {}, f"after recovery {name} still holds locks {store.locks}"
        if self.checks_the_log:
            assert read_log(self.log_dir).open == {}, "after recovery the log still holds open decisions"

    # ------------------------------------------------------------------ invariants

    def _branch_states(self, record: Record) -> dict[str, str]:
        """Each written branch of ``record``: 'committed', 'prepared' or 'gone'."""
        states = {}
        for name, writes in record.writes.items():
            store = self.stores[name]
            seen = [key in store.data and store.data[key] == value for key, value in writes.items()]
            assert all(seen) or not any(seen), f"transaction {record.number} is half applied on {name}: {record}"
            if all(seen):
                states[name] = "committed"
            elif any(x.gtrid.decode() == record.gtrid for x in store.prepared):
                states[name] = "prepared"
            else:
                states[name] = "gone"
        return states

    @invariant()
    def every_transaction_is_all_or_nothing(self):
        for record in self.records:
            states = self._branch_states(record)
            assert not {"committed", "gone"} <= set(states.values()), (
                f"mixed outcome: transaction {record.number} has branches {states} (reported {record.reported})")

    @invariant()
    def reported_outcomes_hold(self):
        on_disk = read_log(self.log_dir).open
        for record in self.records:
            states = set(self._branch_states(record).values())
            if record.reported is Outcome.COMMITTED:
                assert states <= {"committed"}, f"reported committed, but branches are {states}: {record}"
            elif record.reported is Outcome.COMMITTED_PENDING:
                assert "gone" not in states, f"reported committed (pending), but a branch is gone: {record}"
            elif record.reported is Outcome.ROLLED_BACK:
                assert "committed" not in states, f"reported rolled back, but a branch committed: {record}"
                assert not self.checks_the_log or record.gtrid not in on_disk, (
                    f"reported rolled back, but the log holds COMMIT: {record}")

    @invariant()
    def only_prepared_branches_hold_locks(self):
        known = {r.gtrid for r in self.records}
        for name, store in self.stores.items():
            for key, holder in store.locks.items():
                assert holder in store.prepared, f"{name}: key {key} is locked by {holder}, which is not prepared"
            for xid in store.prepared:
                assert xid.gtrid.decode() in known, f"{name}: {xid} is prepared by no transaction of the model"

    @invariant()
    def in_flight_only_while_a_retry_is_queued(self):
        if self.tm is not None:
            assert self.tm.in_flight() <= self.retries.gtrids()


CoordinatorModel.TestCase.settings = settings(
    max_examples=100, stateful_step_count=20, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestCoordinatorModel = CoordinatorModel.TestCase


# ---------------------------------------------------------------------- failures the model found, replayed


def _replay(*steps: Callable[[CoordinatorModel], Any]) -> CoordinatorModel:
    """Run ``steps`` on a fresh model, checking every invariant after each, as Hypothesis does."""
    model = CoordinatorModel()
    checks = (model.every_transaction_is_all_or_nothing, model.reported_outcomes_hold,
              model.only_prepared_branches_hold_locks, model.in_flight_only_while_a_retry_is_queued)
    try:
        for step in steps:
            step(model)
            for check in checks:
                check()
    finally:
        model.teardown()
    return model


TWO_WRITERS = {"r0": {0: 0}, "r1": {0: 0}}


def test_a_commit_cut_after_its_append_is_not_lost_by_a_crash_before_the_retry():
    """Ctrl-C right after the COMMIT record was appended: tx.outcome said "committed (pending)" while the
    record waited for the retry's flush; a kill -9 first lost it and recovery rolled the branches back."""
    model = _replay(lambda m: m.interrupted_at_failpoint(TWO_WRITERS, "decision_appended", None), CoordinatorModel.crash, CoordinatorModel.restart, CoordinatorModel.recover)
    assert model.records[0].reported is Outcome.COMMITTED_PENDING


def test_a_commit_whose_log_write_is_cut_is_unknown_not_committed():
    """Ctrl-C inside the log write: the log fails with the record unwritten, so the outcome is unknown
    (recovery after a restart rolls back), not "committed (pending)"."""
    model = _replay(lambda m: m.interrupted_at_failpoint(TWO_WRITERS, "log_write", None), CoordinatorModel.crash, CoordinatorModel.restart, CoordinatorModel.recover)
    assert model.records[0].reported is Outcome.UNKNOWN


def test_a_branch_whose_rollback_fails_does_not_keep_its_locks():
    """A vote cut by Ctrl-C, then r0's rollback gets no answer: the active branch must die with its dropped
    connection instead of holding its locks for ever."""
    model = _replay(lambda m: m.interrupted_at_failpoint(TWO_WRITERS, "before_prepare", ("r0", "error")))
    assert model.records[0].reported is Outcome.ROLLED_BACK
