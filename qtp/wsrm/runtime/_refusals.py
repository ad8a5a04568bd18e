"""Warnings about refused requests, at most a few lines a minute per reason.

A stranger who floods a node with unsigned requests, or a peer who keeps touching another's sequences, must
not grow the node's log without limit (160,510 lines, 28 MB, in a few minutes before this module). Per reason
(``unauthenticated``, ``not_owner``, ``create``, ``unknown_action``, ``connections``) the first refusal is
logged with its detail; the ones that follow within ``interval`` seconds are only counted, and the next
refusal after it logs one summary line ("refused 15,234 more unauthenticated requests in the last 60 s")
before its own detail. The metric ``qtp_requests_refused_total`` still counts every refusal: the sites
increment it themselves.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable


class RefusalWarnings:
    """Rate-limited refusal warnings, per reason (see the module docstring)."""

    def __init__(self, interval: float = 60.0, clock: Callable[[], float] = time.monotonic,
                 summary: str = "refused %s more %s request(s) in the last %.0f s"):
        self.interval = interval
        self.summary = summary  # the line for the ones not logged: % (count, reason, seconds)
        self._clock = clock
        self._mutex = threading.Lock()
        self._windows: dict[str, tuple[float, int]] = {}  # reason -> (window start, refusals not logged since)

    def warn(self, log: logging.Logger, reason: str, message: str, *args: Any, level: int = logging.WARNING) -> None:
        """Log ``message % args`` (a warning, or ``level``) unless ``reason`` was logged less than ``interval``
        ago."""
        now = self._clock()
        with self._mutex:
            started, quiet = self._windows.get(reason, (None, 0))
            if started is not None and now - started < self.interval:
                self._windows[reason] = (started, quiet + 1)
                return
            self._windows[reason] = (now, 0)
        if quiet:
            log.log(level, self.summary, f"{quiet:,}", reason, now - started)
        log.log(level, message, *args)


refusals = RefusalWarnings()  # the process's one node shares it: the log it limits is the process's
# what a database out of reach makes every loop and request say (a store, a lease, recovery): the first of each
# kind with its detail, then a count a minute (a 75 s outage of a 4-slot replica's database wrote 7,066 lines)
outages = RefusalWarnings(summary="%s more times: %s (in the last %.0f s)")
