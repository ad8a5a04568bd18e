"""The model of ``test_coordinator_model`` catches the coordinator's old holes when they are put back.

Each test monkeypatches one fix of issue 13 away and runs the state machine until it fails, without the
example database (a stored failing example would make the catch free) and without shrinking (the first
failure is the proof; shrinking it only costs time). The failure must be a broken promise of atomicity or
of the reported outcome, not any error.

- hole b: a committer interrupted after its COMMIT record was appended rolled back, though the next flush
  (another committer's, the retry's, close()) still wrote the record; a branch whose rollback then failed
  was committed by recovery. Put back by rolling back where the fix now flushes the appended record.
- hole g: a one-phase COMMIT cut by an interrupt was reported rolled back, though the COMMIT had landed.
  Put back by the old ``_commit_one_phase``, which rolled back on any exception but a lost connection.
"""

import logging

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from qtp.coordinator import Event, Transaction
from qtp.coordinator.failpoints import failpoint
from qtp.errors import ResourceUnavailableError
from test_coordinator_model import CoordinatorModel

HUNT = settings(max_examples=300, stateful_step_count=25, deadline=None, database=None, phases=[Phase.generate],
                suppress_health_check=list(HealthCheck))

BROKEN_PROMISES = ("mixed outcome", "reported rolled back", "after recovery")


def _old_commit_one_phase(self, branches):
    """``Transaction._commit_one_phase`` before issue 13: only a lost connection made the outcome unknown."""
    if branches:
        branch = branches[0]
        try:
            branch.resource.commit(branch.xid, one_phase=True)
            failpoint("after_one_phase_commit")
        except ResourceUnavailableError as exc:
            self._give_up_knowing(exc, "the connection broke during the one-phase commit", leave=branches)
        except BaseException as exc:
            self._abort(exc, "the one-phase commit failed")
    self._fire(Event.COMMITTED)


def _roll_back_regardless(self, cause):
    """Before issue 13: a committer cut after appending its COMMIT record rolled back all the same."""
    self._roll_back_all(Event.ROLLBACK)


HOLES = {
    "b": (Transaction, "_settle_appended", _roll_back_regardless),
    "g": (Transaction, "_commit_one_phase", _old_commit_one_phase),
}


class DataOnlyModel(CoordinatorModel):
    """The model without its look at the log: hole b must then show as data, a branch that recovery
    committed beside one that was rolled back."""

    checks_the_log = False


def hunt(model: type[CoordinatorModel]) -> AssertionError:
    """Run ``model`` until it fails; return the failure."""
    logging.disable(logging.CRITICAL)  # thousands of expected CRITICAL lines about cut commits
    try:
        with pytest.raises(AssertionError) as caught:
            run_state_machine_as_test(model, settings=HUNT)
    finally:
        logging.disable(logging.NOTSET)
    return caught.value


@pytest.mark.parametrize("hole", sorted(HOLES))
def test_the_model_catches_the_hole_put_back(hole, monkeypatch):
    monkeypatch.setattr(*HOLES[hole])
    failure = hunt(CoordinatorModel)
    assert any(promise in str(failure) for promise in BROKEN_PROMISES), failure


def test_hole_b_shows_as_a_mixed_outcome_in_the_data(monkeypatch):
    monkeypatch.setattr(*HOLES["b"])
    failure = hunt(DataOnlyModel)
    assert "mixed outcome" in str(failure) or "reported rolled back, but a branch committed" in str(failure), failure
