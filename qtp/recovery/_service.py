"""Recovery inside a running TransactionManager: once at start, then periodically in the background.

The manager holds its log lock, so no other process recovers this node meanwhile. The start-up pass acts
on every in-doubt branch of the node that is not in flight (nothing of this manager can be in doubt yet
except its own live transactions, which the ordered reads of ``run_pass`` protect). The periodic passes
use the two-pass rule as well: a branch is resolved only when the previous pass saw it in doubt too, so a
transaction the manager is in the middle of committing is never second-guessed.

A manager started on a missing log (the ``LOG_LOST`` mark, ``qtp.coordinator._log.read_lost_mark``) first
vets each resource: the in-doubt branches it finds there that are neither in flight nor decided in the new
log, and (where the database records it) were prepared before the mark was made, are put in QUARANTINE
(durably), never rolled back; only then is the resource noted as vetted in the mark, and the mark removed
once every resource is. A resource that cannot be vetted (unreachable) is left out of every pass until it
can be: its branches are never presumed aborted on the word of the new log.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from qtp._failures import Failures, RefusalWarnings, first_line
from qtp.coordinator._log import clear_lost_mark, read_lost_mark, write_lost_mark
from qtp.recovery._core import RecoveryReport, run_pass, scan
from qtp.recovery._node import add_quarantine, read_quarantine
from qtp.xa import Xid

if TYPE_CHECKING:
    from qtp.coordinator._manager import TransactionManager

log = logging.getLogger("qtp.recovery")


class RecoveryService:
    """One manager's recovery: ``run_once()`` on demand, ``start()`` for the start-up pass and the thread."""

    def __init__(self, manager: "TransactionManager", interval: float | None):
        self.manager = manager
        self.interval = interval
        self._mark = read_lost_mark(manager.log_dir)
        self._unvetted: set[str] = set() if self._mark is None else {
            r.name for r in manager.distinct_resources()} - set(self._mark["vetted"])
        self._quarantine = set(read_quarantine(manager.log_dir))
        self._previous: set[Xid] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_report: RecoveryReport | None = None
        self.passes = 0
        self._out_of_reach = RefusalWarnings(summary="recovery: %s more passes found %s unreachable (in the last "
                                                     "%.0f s)")
        self._unreachable: set[str] = set()  # the resources the last pass could not reach

    # ------------------------------------------------------------------ passes

    def run_once(self, dry_run: bool = False, two_pass: bool = False) -> RecoveryReport:
        """One pass now. ``two_pass``: act only on branches the previous pass saw in doubt too."""
        with self._lock:
            resources = self.manager.distinct_resources()
            if self._unvetted:
                self._vet(resources)
            report, seen = run_pass(
                self.manager.node_id, resources, lambda: dict(self.manager.log.open),
                in_flight=self.manager.in_flight, end=self.manager.log.log_end,
                previous=self._previous if two_pass else None, quarantine=self._quarantine,
                unvetted=self._unvetted, dry_run=dry_run,
                held=None if self.manager.lease is None else self.manager.lease.verify,
            )
            if report.ended and not dry_run:
                self.manager.log.flush()
                self.manager.log.checkpoint()
            if not dry_run:
                self._previous = seen
                self.passes += 1
                self.last_report = report
            self._log(report)
            return report

    def _vet(self, resources: list) -> None:
        """The log was missing at start: quarantine what was in doubt before this manager began."""
        pending = [r for r in resources if r.name in self._unvetted]
        probe = RecoveryReport(self.manager.node_id)
        found = scan(pending, probe)
        in_flight = self.manager.in_flight()
        decided = set(self.manager.log.open)
        fresh = []
        for f in found:
            if f.gtrid in in_flight or f.gtrid in decided or str(f.xid) in self._quarantine:
                continue
            if f.prepared_at is not None and _aware(f.prepared_at).timestamp() >= self._mark["created_at"]:
                continue
            fresh.append({"xid": str(f.xid), "resource": f.resource.name, "found_at": time.time(),
                          "reason": "in doubt when the manager started on a missing decision log"})
        add_quarantine(self.manager.log_dir, fresh)
        self._quarantine |= {e["xid"] for e in fresh}
        if fresh:
            log.critical("node %s started without a decision log, and %d in-doubt branch(es) of this node exist "
                         "(%s ...): their outcome is unknown, so they are quarantined, not rolled back; restore the "
                         "log or resolve them by hand (docs/recovery.md)", self.manager.node_id, len(fresh),
                         fresh[0]["xid"])
        vetted = {r.name for r in pending if r.name not in probe.unreachable}
        if vetted:
            self._unvetted -= vetted
            self._mark["vetted"] = sorted(set(self._mark["vetted"]) | vetted)
            if self._unvetted:
                write_lost_mark(self.manager.log_dir, self._mark)
            else:
                clear_lost_mark(self.manager.log_dir)

    def _log(self, report: RecoveryReport) -> None:
        if report.committed or report.rolled_back or report.ended:
            log.warning("recovery: %s", report.summary())
        for reason in report.reasons(unreachable=False):
            log.error("recovery: %s", reason)
        # a resource out of reach is said at its first pass, then once a minute with a count, and when it is
        # back (every pass said it: 30 lines a minute with a 2 s interval)
        for name, message in sorted(report.unreachable.items()):
            self._out_of_reach.warn(log, f"resource {name!r}", "recovery: resource %r is unreachable (%s); start "
                                    "it or fix its URL, then run `qtp recover` again", name,
                                    first_line(message), level=logging.ERROR)
        for name in sorted(self._unreachable - set(report.unreachable)):
            log.warning("recovery: resource %r is reachable again", name)
        self._unreachable = set(report.unreachable)

    # ------------------------------------------------------------------ background

    def start(self) -> RecoveryReport | None:
        """The start-up pass, then the periodic thread (when an interval is set)."""
        report = None
        try:
            report = self.run_once()
        except Exception as exc:  # a failed start-up pass must not stop the manager; the thread retries
            log.error("recovery at start of node %s failed: %s", self.manager.node_id, exc)
        if self.interval and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="qtp-recovery", daemon=True)
            self._thread.start()
        return report

    def _loop(self) -> None:
        failures = Failures(log, f"periodic recovery of node {self.manager.node_id}", level=logging.ERROR)
        while not self._stop.wait(self.interval):
            try:
                self.run_once(two_pass=True)
            except Exception as exc:  # the background pass must survive anything; it reports and retries
                failures.failed(exc)
                continue
            failures.worked()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


def _aware(at: datetime) -> datetime:
    return at if at.tzinfo is not None else at.replace(tzinfo=timezone.utc)
