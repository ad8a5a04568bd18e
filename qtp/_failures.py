"""What a loop that retries says while its work keeps failing (a database out of reach, say).

Every background loop of a node (maintenance, lease renewal, recovery, slot balancing) retries its work on its
next turn. Logging every failed turn wrote thousands of lines a minute during a database outage (one replica
holding four slots: 7,066 lines in 75 s), burying what the operator needs. ``Failures`` says the first failure
(with its traceback when asked), then one line every ``every`` seconds while the failures go on, and one line
when the work succeeds again; in between it counts. ``RefusalWarnings`` does the same for what many threads
say about many requests (refused ones, ones that cannot be stored now): per kind, the first with its detail,
then a count with the next line after ``interval``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any, Callable


def first_line(exc: BaseException | str | None) -> str:
    """The first line of an error's message (its type's name when it has none): what a log line or a one-line
    error names."""
    text = str(exc or "").strip()
    return text.splitlines()[0] if text else type(exc).__name__


def driver_first_line(exc: BaseException) -> str:
    """The driver's own message when SQLAlchemy wraps one (``exc.orig``), first line, at most 200 characters."""
    return first_line(getattr(exc, "orig", None) or exc)[:200]


class Failures:
    def __init__(self, log: logging.Logger, what: str, every: float = 60.0, level: int = logging.WARNING,
                 clock: Callable[[], float] = time.monotonic):
        self.log, self.what, self.every, self.level, self.clock = log, what, every, level, clock
        self.count = 0  # failed turns in a row
        self._said = -math.inf

    def failed(self, exc: BaseException, traceback: bool = False, detail: str = "") -> None:
        """One failed turn of the loop; ``detail`` is added to what is said (e.g. how long the lease holds)."""
        self.count += 1
        now = self.clock()
        extra = f"; {detail}" if detail else ""
        if self.count == 1:
            self.log.log(self.level, "%s failed: %s%s", self.what, first_line(exc), extra,
                         exc_info=exc if traceback else None)
        elif now - self._said >= self.every:
            self.log.log(self.level, "%s still failing (%d times in a row): %s%s", self.what, self.count,
                         first_line(exc), extra)
        else:
            return
        self._said = now

    def worked(self) -> None:
        """A turn that succeeded: said once after failures."""
        if self.count:
            self.log.warning("%s works again after %d failed turns", self.what, self.count)
            self.count = 0
            self._said = -math.inf


class RefusalWarnings:
    """Rate-limited warnings, per reason: the first with its detail; those within ``interval`` after it only
    counted, the count said before the next one logged (qtp.wsrm.runtime._refusals has the node's)."""

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
