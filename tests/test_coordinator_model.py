"""The coordinator against a simple model: in-memory resources that vote no or fail at any step.

Each rule runs one global transaction over three in-memory resources with random writes and at most one
injected fault. The model says what must be visible afterwards: all of the transaction's writes (committed,
possibly after the background phase-2 retry) or none of them (rolled back). After every step no branch is
left prepared, no key stays locked, and the decision log holds no open decision.
"""

import shutil
import tempfile

from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from qtp.coordinator import Outcome, TransactionManager, read_log
from qtp.errors import OutcomeUnknownError, ResourceError, ResourceUnavailableError, RollbackError
from qtp.xa import MemoryResource

NAMES = ("r0", "r1", "r2")

work = st.dictionaries(
    st.sampled_from(NAMES),
    st.dictionaries(st.integers(0, 4), st.integers(0, 99), max_size=3),  # {} = enlisted, wrote nothing
    max_size=3,
)
faults = st.one_of(st.none(), st.tuples(st.sampled_from(NAMES), st.sampled_from(["begin", "prepare", "commit"])))


class CoordinatorModel(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="qtp-model-")
        self.tm = TransactionManager("model", self.dir, recovery_interval=None, phase_two_retry_s=5)
        self.res = {n: self.tm.add_resource(n, MemoryResource(n, "model")) for n in NAMES}
        self.model = {n: {} for n in NAMES}

    def teardown(self):
        self.tm.close()
        shutil.rmtree(self.dir, ignore_errors=True)

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

    @rule(plan=work, fault=faults)
    def transaction(self, plan, fault):
        if fault is not None and fault[0] in plan:
            exc = ResourceUnavailableError("injected") if fault[1] == "commit" else ResourceError("injected")
            self.res[fault[0]].inject(fault[1], exc)
        expected = self._expected(plan, fault)
        outcome = tx = None
        try:
            with self.tm.transaction() as tx:
                for name, writes in plan.items():
                    conn = tx.connection(name)
                    for key, value in writes.items():
                        conn.put(key, value)
            outcome = tx.outcome
        except (RollbackError, ResourceError):
            outcome = Outcome.ROLLED_BACK
        except OutcomeUnknownError:
            outcome = tx.outcome
        for res in self.res.values():
            res._faults.clear()
        want = {"commit": Outcome.COMMITTED, "pending": Outcome.COMMITTED_PENDING,
                "rollback": Outcome.ROLLED_BACK, "unknown": Outcome.UNKNOWN}[expected]
        assert outcome is want, (plan, fault, outcome)
        if outcome in (Outcome.COMMITTED, Outcome.COMMITTED_PENDING):
            for name, writes in plan.items():
                self.model[name].update(writes)
        self.tm.wait_retries()

    @invariant()
    def stores_match_the_model(self):
        for name, res in self.res.items():
            assert res.store.data == self.model[name]

    @invariant()
    def nothing_left_prepared_or_locked(self):
        for res in self.res.values():
            assert res.store.prepared == {}
            assert res.store.locks == {}

    @invariant()
    def no_transaction_left_in_flight(self):
        assert self.tm.in_flight() == set()

    @invariant()
    def no_open_decision(self):
        self.tm.log.flush()
        assert read_log(self.tm.log_dir).open == {}


CoordinatorModel.TestCase.settings = settings(
    max_examples=60, stateful_step_count=12, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestCoordinatorModel = CoordinatorModel.TestCase
