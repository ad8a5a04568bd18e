"""Refusal warnings are rate-limited per reason (issue 28, F4): a stranger's flood of unsigned requests wrote
one WARNING line each (160,510 lines, a 28 MB log in a few minutes); the metric still counts every one."""

from __future__ import annotations

import logging

import requests

from qtp.testing.nodes import request
from qtp.wsrm.protocol import CreateSequence
from qtp.wsrm.codec import encode

from test_security_hostile import ANON, _finish, _url, hostile, trap  # noqa: F401 (fixtures)

FLOOD = 1500


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_first_refusal_is_logged_then_one_summary_per_interval_per_reason(caplog):
    from qtp.wsrm.runtime._refusals import RefusalWarnings

    clock = _Clock()
    warnings = RefusalWarnings(interval=60.0, clock=clock)
    log = logging.getLogger("qtp.test.refusals")
    with caplog.at_level(logging.WARNING, logger="qtp.test.refusals"):
        for n in range(15_235):
            warnings.warn(log, "unauthenticated", "refused a request from %s: %s", "10.0.0.9", f"unsigned {n}")
            clock.now += 0.001  # 15 s in all: one window
        warnings.warn(log, "not_owner", "refused a message for sequence %s", "urn:s")  # its own window
        clock.now += 60.0
        warnings.warn(log, "unauthenticated", "refused a request from %s: %s", "10.0.0.9", "unsigned again")
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "refused a request from 10.0.0.9: unsigned 0"
    assert lines[1] == "refused a message for sequence urn:s"
    assert lines[2].startswith("refused 15,234 more unauthenticated request(s) in the last ")
    assert lines[3] == "refused a request from 10.0.0.9: unsigned again"
    assert len(lines) == 4


def test_a_flood_of_unsigned_requests_does_not_grow_the_log(hostile):
    pair, client, server = hostile(send=20, rate=4)
    body = encode(request(CreateSequence(ANON)))
    with requests.Session() as session:
        for _ in range(FLOOD):
            answer = session.post(_url(server), data=body, timeout=10,
                                  headers={"Content-Type": "application/soap+xml; charset=utf-8"})
            assert answer.status_code == 401
    text = requests.get(f"http://127.0.0.1:{server.port}/metrics", timeout=5).text
    line = next(x for x in text.splitlines() if x.startswith("qtp_requests_refused_total") and "unauthenticated" in x)
    assert float(line.rsplit(" ", 1)[1]) == FLOOD  # every refusal still counted
    _finish(pair, 20)
    logged = [x for x in server.log.read_text(errors="replace").splitlines() if "refused" in x]
    assert len(logged) <= 4, f"{len(logged)} refusal lines for {FLOOD} unsigned requests"
