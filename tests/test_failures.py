"""qtp._failures.Failures: what a retrying loop says while its work keeps failing."""

from __future__ import annotations

import logging

from qtp._failures import Failures, RefusalWarnings


def test_the_first_failure_is_said_then_one_line_per_interval_then_once_when_it_works_again(caplog) -> None:
    """Outside finding: a 75 s outage of the database of a replica holding four slots wrote 7,066 log lines
    (lease renewal 2.5 a second per slot, recovery, balancing, each request), burying what mattered."""
    now = [0.0]
    log = logging.getLogger("test.failures")
    caplog.set_level(logging.INFO, logger="test.failures")
    failures = Failures(log, "node n: lease renewal", every=60.0, level=logging.ERROR, clock=lambda: now[0])
    error = ConnectionRefusedError("(2003, \"Can't connect\")\nsecond line")
    for _ in range(300):  # 75 s at four turns a second
        failures.failed(error, traceback=True, detail="writes refused until it succeeds")
        now[0] += 0.25
    failures.worked()
    failures.worked()  # nothing more to say
    said = [(r.levelno, r.getMessage(), bool(r.exc_info)) for r in caplog.records]
    assert said == [
        (logging.ERROR, "node n: lease renewal failed: (2003, \"Can't connect\"); writes refused until it succeeds", True),
        (logging.ERROR, "node n: lease renewal still failing (241 times in a row): (2003, \"Can't connect\"); "
                        "writes refused until it succeeds", False),
        (logging.WARNING, "node n: lease renewal works again after 300 failed turns", False),
    ]
    caplog.clear()
    failures.failed(error)  # a new outage: said again at once, without a traceback unless asked
    assert [(r.getMessage(), bool(r.exc_info)) for r in caplog.records] == [
        ("node n: lease renewal failed: (2003, \"Can't connect\")", False)]


def test_recovery_says_an_unreachable_resource_once_a_minute_and_when_it_is_back(caplog) -> None:
    """Outside finding (helper-37): on a node without slots, every periodic recovery pass logged "resource
    'app' is unreachable" at ERROR (30 lines a minute with a 2 s interval), with no line when it came back."""
    from qtp.recovery._core import RecoveryReport
    from qtp.recovery._service import RecoveryService

    now = [0.0]
    service = RecoveryService.__new__(RecoveryService)  # only what _log uses
    service._out_of_reach = RefusalWarnings(summary="recovery: %s more passes found %s unreachable (in the last "
                                                    "%.0f s)", clock=lambda: now[0])
    service._unreachable = set()
    caplog.set_level(logging.INFO, logger="qtp.recovery")
    down = RecoveryReport("n", unreachable={"app": "connection refused\n\tIs the server running?"})
    for _ in range(45):  # 90 s of passes every 2 s
        service._log(down)
        now[0] += 2.0
    service._log(RecoveryReport("n"))
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert said == [
        ("ERROR", "recovery: resource 'app' is unreachable (connection refused); start it or fix its URL, then run "
                  "`qtp recover` again"),
        ("ERROR", "recovery: 29 more passes found resource 'app' unreachable (in the last 60 s)"),
        ("ERROR", "recovery: resource 'app' is unreachable (connection refused); start it or fix its URL, then run "
                  "`qtp recover` again"),
        ("WARNING", "recovery: resource 'app' is reachable again"),
    ], said


def test_a_delivery_that_finds_its_database_out_of_reach_is_said_once_a_minute_not_with_a_traceback_each(
        caplog, monkeypatch) -> None:
    """Outside finding (helper-37): each delivery attempt during a 75 s outage logged "failed unexpectedly"
    at ERROR with a 120-line traceback, about once a second (10,784 lines)."""
    import sqlalchemy.exc

    from qtp.wsrm.runtime import _invoker, _refusals
    from qtp.wsrm.runtime._invoker import Invoker

    now = [0.0]
    monkeypatch.setattr(_refusals.outages, "_clock", lambda: now[0])
    monkeypatch.setattr(_refusals.outages, "_windows", {})
    invoker = Invoker.__new__(Invoker)  # only what step uses
    aborted: list[tuple[str, int]] = []

    class _Schedule:
        def get(self, timeout: float) -> tuple[str, int]:
            return ("urn:uuid:s", 7)

    def down(identifier: str, number: int) -> None:
        raise sqlalchemy.exc.OperationalError("SELECT", {}, ConnectionRefusedError("(2003, \"Can't connect\")"))

    invoker._schedule, invoker._deliver = _Schedule(), down
    invoker._abort = lambda identifier, number, at: aborted.append((identifier, number))
    invoker.clock = type("C", (), {"time": staticmethod(lambda: now[0])})()
    caplog.set_level(logging.INFO, logger=_invoker.log.name)
    for _ in range(75):  # a second apart
        assert invoker.step() is True
        now[0] += 1.0
    said = [r for r in caplog.records if r.name == _invoker.log.name]
    assert len(aborted) == 75 and not any(r.exc_info for r in said), said
    # the first with its cause, then at 60 s the count of those in between and the next one
    assert [r.getMessage().split(":")[0] for r in said] == ["delivering urn", "59 more times", "delivering urn"], \
        [r.getMessage() for r in said]


def test_a_lease_renewal_that_keeps_failing_says_once_that_the_lease_ran_out(caplog) -> None:
    """The lease renewal loop: the first failure, the moment the lease runs out (once, though the loop then
    turns four times a second), and the return; not a line per turn."""
    import threading
    import time
    from types import SimpleNamespace

    import sqlalchemy.exc

    from qtp.coordinator._lease import Lease

    lease = Lease.__new__(Lease)  # only what the renewal loop uses
    lease.node_id, lease.member, lease.epoch = "n", "m", 1
    lease.settings = SimpleNamespace(renew_every=0.6)  # past the lease the loop turns every 0.25 s
    lease._stop = threading.Event()
    lease._valid_until = time.monotonic() + 0.5
    lease.valid = lambda: time.monotonic() < lease._valid_until
    turns = {"n": 0}

    def renew() -> tuple[str, int]:
        turns["n"] += 1
        if turns["n"] <= 8:  # the first at 0.6 s, after the lease ran out; then every 0.25 s
            raise sqlalchemy.exc.OperationalError("SELECT", {}, ConnectionRefusedError("refused"))
        if turns["n"] >= 10:
            lease._stop.set()
        return ("m", 1)

    lease._renew, lease._forget_gone = renew, lambda: None
    caplog.set_level(logging.INFO, logger="qtp.lease")
    loop = threading.Thread(target=lease._renew_loop, daemon=True)
    loop.start()
    loop.join(10)
    said = [r.getMessage() for r in caplog.records if r.name == "qtp.lease"]
    assert turns["n"] >= 10
    assert sum("the lease ran out" in line for line in said) == 1, said
    assert sum(line.startswith("node n: lease renewal failed: ") for line in said) == 1, said
    assert said[-1].startswith("node n: lease renewal works again after 8 failed turns"), said
    assert len(said) == 3, said
