"""qtp._failures.Failures: what a retrying loop says while its work keeps failing."""

from __future__ import annotations

import logging

from qtp._failures import Failures


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
