"""Failpoints: named places in the commit and recovery paths where a test can make qtp crash, fail or stall.

Enable them with the environment variable ``QTP_FAILPOINTS`` (read at import) or ``configure()``::

    QTP_FAILPOINTS="after_decision_forced=crash"
    QTP_FAILPOINTS="after_prepare_1=error;after_commit_0=delay:200"
    QTP_FAILPOINTS="after_commit_0=crash@3"         # on the third time the point is reached

Actions: ``crash`` (SIGKILL to this process: no cleanup, no flush, exactly like ``kill -9``), ``error``
(raise FailpointError), ``interrupt`` (raise KeyboardInterrupt, as Ctrl-C or a signal handler would),
``delay:MS`` (sleep). When nothing is configured a failpoint is one dictionary
truth test.

The points (``i`` is the branch's position in the transaction, from 0):

=========================  ==================================================================
``before_prepare``         every branch enlisted and flushed, no vote asked yet
``after_prepare_i``        branch i voted yes (prepared)
``decision_appended``      the COMMIT record is in the log's buffer, not yet durable
``log_write``              a flush leader is about to write and sync the log's buffer
``after_decision_forced``  the COMMIT record is durable, no branch committed yet
``after_commit_i``         branch i committed in phase 2
``before_end_record``      every branch committed, END record not yet appended
``after_one_phase_commit`` the sole branch's one-phase COMMIT returned, the outcome not yet recorded
``recovery_after_action``  recovery committed or rolled back one in-doubt branch
``coupled_after_send``     (qtp.coupled) a sender's originals are on their way, nothing decided
``coupled_before_commit``  (qtp.coupled) conditions met, Commit messages written, sender not committed
``coupled_after_prepare``  (qtp.coupled) a shared recipient prepared, its vote not yet recorded
=========================  ==================================================================
"""

from __future__ import annotations

import os
import signal
import threading
import time

from qtp.errors import ConfigurationError, FailpointError

POINTS = ("before_prepare", "after_prepare_i", "decision_appended", "log_write", "after_decision_forced",
          "after_commit_i", "before_end_record", "after_one_phase_commit", "recovery_after_action")


_active: dict[str, tuple[str, float, int]] = {}  # name -> (action, argument, fire on hit number)
_hits: dict[str, int] = {}
_lock = threading.Lock()


def configure(spec: str | None) -> None:
    """Replace the active failpoints with those of ``spec`` (the ``QTP_FAILPOINTS`` syntax)."""
    parsed: dict[str, tuple[str, float, int]] = {}
    for item in filter(None, (part.strip() for part in (spec or "").split(";"))):
        name, _, action = item.partition("=")
        action, _, nth = action.partition("@")
        verb, _, arg = action.partition(":")
        if verb not in ("crash", "error", "interrupt", "delay") or not name:
            raise ConfigurationError(f"bad failpoint {item!r}: write NAME=crash|error|interrupt|delay:MS[@N]")
        parsed[name.strip()] = (verb, float(arg or 0), int(nth or 1))
    _active.clear()
    _hits.clear()
    _active.update(parsed)


def failpoint(name: str) -> None:
    """Reach the failpoint ``name``: does nothing unless it is configured."""
    if not _active or name not in _active:
        return
    verb, arg, nth = _active[name]
    with _lock:
        _hits[name] = _hits.get(name, 0) + 1
        if _hits[name] != nth:
            return
    if verb == "crash":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # never reached: SIGKILL cannot be caught
    elif verb == "error":
        raise FailpointError(f"failpoint {name} fired")
    elif verb == "interrupt":
        raise KeyboardInterrupt(f"failpoint {name} fired")
    else:
        time.sleep(arg / 1000.0)


configure(os.environ.get("QTP_FAILPOINTS"))
