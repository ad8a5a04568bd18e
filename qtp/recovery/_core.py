"""One recovery pass: the decision log and every resource's in-doubt list in, one action per branch out.

Why presumed abort makes this simple. The manager forces a COMMIT record (listing the prepared branches)
before the first phase-2 commit, and logs nothing for a transaction that aborts. So, for each in-doubt
branch of this node:

- its global transaction has an open COMMIT record  -> commit the branch;
- or a decision row in the ``qtp_llr_decision`` table of one of the node's SQL databases (Logging Last
  Resource: the row was committed with the last branch, so it exists if and only if the transaction
  committed)                                        -> commit the branch;
- it has neither                                    -> nothing can have committed: roll the branch back.
  But if a SQL database's decision table cannot be read, its row may be the one missing: the branch is
  left in doubt, with the reason, and never presumed aborted.

Both actions are idempotent by xid (the resource contract), so a pass that dies half-way (or a second
pass racing the phase-2 retry of the live manager) only repeats work. Once every branch of a decided
transaction is known to be resolved, an END record lets the log forget it.

Never racing a live transaction. Inside a running manager the scan is ordered: (1) read the in-doubt
lists, (2) read ``in_flight()``, (3) read the open decisions. A branch seen prepared in (1) belongs to a
transaction that had begun by then; if it is no longer in flight at (2), that transaction has reached its
outcome, and the decisions read at (3) are final for it (a decided transaction keeps its COMMIT record
until all its branches committed). The periodic pass adds Narayana's two-pass rule on top: a branch is
acted on only if the previous pass saw it in doubt too. A transaction still in flight is never touched,
and its COMMIT record never receives an END from recovery.

What cannot be known. PostgreSQL and MariaDB forget a branch once it is committed or rolled back, by
whoever did it. So a branch of a decided transaction that is no longer in doubt was *most likely* committed
before the crash (the normal case after ``after_commit_i`` or ``before_end_record``), but it may also have
been rolled back by hand: recovery reports it as "resolved earlier, not verifiable" and does not fail on it.
What is detected and fails the pass: a branch whose phase-2 action the database refused (a heuristic hazard),
a branch of a decided transaction on a resource that is not configured, a branch in doubt that the COMMIT
record does not list, an unreachable resource, and in-doubt branches for which the log is missing.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Callable, Iterable

from qtp.coordinator.failpoints import failpoint
from qtp.errors import QtpError, ResourceUnavailableError
from qtp.xa import Resource, Xid

log = logging.getLogger("qtp.recovery")

# Problems that leave a branch in doubt (or make the outcome uncertain); each fails the pass.
UNREACHABLE = "resource unreachable"
HEURISTIC = "heuristic hazard"
LOG_MISSING = "decision log missing"
QUARANTINED = "quarantined (log was missing)"
UNVETTED = "log was lost, resource not yet vetted"
DECISIONS_UNREADABLE = "a last-resource decision table is unreadable"
NOT_CONFIGURED = "resource not configured"
ACTION_FAILED = "action failed"


@dataclass
class Found:
    """One in-doubt branch as a resource listed it."""

    xid: Xid
    resource: Resource
    prepared_at: datetime | None

    @property
    def gtrid(self) -> str:
        return self.xid.gtrid.decode(errors="replace")


@dataclass
class Row:
    """One line of the recovery table."""

    xid: str
    resource: str
    age_s: float | None
    decision: str  # "commit", "none (presumed abort)", "log missing", "quarantined"
    action: str  # "commit", "rollback", "end record", "leave in doubt", "skip (in flight)", "wait (second pass)"
    result: str
    problem: str | None = None

    @property
    def resolved(self) -> bool:
        return self.problem is None and self.action in ("commit", "rollback", "end record")


@dataclass
class RecoveryReport:
    """What one pass found and did. ``ok`` means nothing of this node is left in doubt and nothing is suspect."""

    node_id: str
    dry_run: bool = False
    rows: list[Row] = field(default_factory=list)
    unreachable: dict[str, str] = field(default_factory=dict)  # resource name -> error
    ended: list[str] = field(default_factory=list)  # gtrids whose END record this pass wrote
    open_decisions: int = 0
    duration_s: float = 0.0
    error: str | None = None  # a reason the pass could not run at all (corrupt log, live manager)

    def count(self, action: str) -> int:
        return sum(1 for r in self.rows if r.action == action and r.problem is None)

    @property
    def committed(self) -> int:
        return self.count("commit")

    @property
    def rolled_back(self) -> int:
        return self.count("rollback")

    @property
    def problems(self) -> list[Row]:
        return [r for r in self.rows if r.problem is not None]

    @property
    def deferred(self) -> list[Row]:
        return [r for r in self.rows if r.action in ("skip (in flight)", "wait (second pass)")]

    @property
    def ok(self) -> bool:
        return self.error is None and not self.unreachable and not self.problems

    def reasons(self, unreachable: bool = True) -> list[str]:
        """Why the pass is not ``ok``, one sentence each, naming the fix (without the unreachable resources'
        when ``unreachable`` is false)."""
        out = [self.error] if self.error else []
        for name, message in sorted(self.unreachable.items() if unreachable else ()):
            out.append(f"resource {name!r} is unreachable ({message}); start it or fix its URL, then run "
                       "`qtp recover` again")
        kinds: dict[str, int] = {}
        for row in self.problems:
            kinds[row.problem] = kinds.get(row.problem, 0) + 1
        fixes = {
            HEURISTIC: "inspect the branch in the database: it was resolved against the logged decision or "
                       "refused the action; repair the data by hand, then run `qtp recover` again",
            LOG_MISSING: "the decision log directory is missing or empty: restore it from a backup and run "
                         "`qtp recover` again, or resolve these branches by hand (docs/recovery.md)",
            DECISIONS_UNREADABLE: "a SQL database that may hold this transaction's commit decision (Logging Last "
                                  "Resource) could not be read: bring it back and run `qtp recover` again",
            UNVETTED: "the node's decision log was lost and this resource has not been checked since: start the "
                      "node's manager while the resource is reachable (it quarantines what the lost log may have "
                      "decided), then resolve the quarantined branches by hand (docs/recovery.md)",
            QUARANTINED: "these branches were found while the decision log was missing: resolve them by hand "
                         "(docs/recovery.md), then delete the QUARANTINE file in the log directory",
            NOT_CONFIGURED: "the log names a resource that qtp.toml does not configure: add it back under "
                            "[resources.NAME] and run `qtp recover` again",
            ACTION_FAILED: "the database refused the action; read the result column, fix the cause and run "
                           "`qtp recover` again",
            UNREACHABLE: "the branch's database was unreachable during the action; run `qtp recover` again",
        }
        for kind, n in sorted(kinds.items()):
            out.append(f"{n} branch(es): {kind}: {fixes.get(kind, '')}")
        return out

    def summary(self) -> str:
        left = sum(1 for r in self.rows if not r.resolved and r.action != "end record")
        verb, verb2, verb3 = ("would commit", "would roll back", "would end") if self.dry_run else (
            "committed", "rolled back", "ended")
        return (f"node {self.node_id}: {verb} {self.committed}, {verb2} {self.rolled_back}, "
                f"{verb3} {len(self.ended)} decision(s), {left} left in doubt or suspect, "
                f"{len(self.unreachable)} resource(s) unreachable, {self.duration_s:.2f} s")

    def to_dict(self) -> dict:
        return {
            "node_id": self.node_id, "dry_run": self.dry_run, "ok": self.ok,
            "committed": self.committed, "rolled_back": self.rolled_back, "ended": self.ended,
            "open_decisions": self.open_decisions, "unreachable": self.unreachable,
            "duration_s": round(self.duration_s, 4), "error": self.error, "reasons": self.reasons(),
            "rows": [asdict(r) for r in self.rows],
        }


# ---------------------------------------------------------------------------------------------- scanning


def scan(resources: Iterable[Resource], report: RecoveryReport) -> list[Found]:
    """Every distinct resource's in-doubt branches of this node; unreachable resources go in the report."""
    found: list[Found] = []
    for resource in resources:
        try:
            if hasattr(resource, "in_doubt"):
                listed = resource.in_doubt()
            else:
                listed = [(xid, None) for xid in resource.recover()]
        except QtpError as exc:
            report.unreachable[resource.name] = str(exc)
            continue
        found += [Found(xid, resource, at) for xid, at in listed]
    return found


def age_of(prepared_at: datetime | None, now: datetime | None = None) -> float | None:
    if prepared_at is None:
        return None
    if prepared_at.tzinfo is None:
        prepared_at = prepared_at.replace(tzinfo=timezone.utc)
    return max(0.0, ((now or datetime.now(timezone.utc)) - prepared_at).total_seconds())


# ---------------------------------------------------------------------------------------------- the pass


@dataclass
class Plan:
    """The inputs of a pass once scanned: what to do with each found branch."""

    found: list[Found]
    decisions: dict[str, list[str]] | None  # None: the log is missing
    in_flight: set[str]
    previous: set[Xid] | None = None  # the previous pass's scan (two-pass rule); None: act at once
    quarantine: set[str] = field(default_factory=set)  # str(xid) never to be touched automatically
    unvetted: set[str] = field(default_factory=set)  # resources the (lost) log may not speak for
    llr: dict[str, tuple[list[str], Resource]] = field(default_factory=dict)  # gtrid -> (branches, holder)
    unreadable: dict[str, str] = field(default_factory=dict)  # decision tables that could not be read


def run_pass(
    node_id: str,
    resources: list[Resource],
    read_decisions: Callable[[], dict[str, list[str]] | None],
    *,
    in_flight: Callable[[], set[str]] = set,
    end: Callable[[str], None] | None = None,
    previous: set[Xid] | None = None,
    quarantine: set[str] | frozenset = frozenset(),
    unvetted: set[str] | frozenset = frozenset(),
    dry_run: bool = False,
    workers: int = 16,
    held: Callable[[], None] | None = None,
) -> tuple[RecoveryReport, set[Xid]]:
    """Scan, decide, act, write END records. Returns the report and the set of xids seen in doubt.

    Branches on ``unvetted`` resources (the node's log was lost and they have not been checked since, see
    ``qtp.coordinator._log.read_lost_mark``) are left in doubt whatever the log says.

    The order of the reads (in-doubt lists, then ``in_flight()``, then the decisions) is what makes the
    pass safe beside a live manager; see the module docstring. ``held`` (a node run as replicas) raises
    unless this process still owns the node once the scan is done: then every branch scanned is of an owner
    before it, never of a process that took over since (qtp.coordinator._lease).
    """
    started = time.monotonic()
    report = RecoveryReport(node_id, dry_run=dry_run)
    found = scan(resources, report)
    if held is not None:
        held()
    plan = Plan(found, None, set(in_flight()), previous, set(quarantine), set(unvetted))
    plan.decisions = read_decisions()
    plan.llr, plan.unreadable = read_last_resource_decisions(node_id, resources)
    report.open_decisions = len(plan.decisions or {}) + len(plan.llr)
    rows, work = _decide(plan, report)
    _act(work, dry_run, workers)
    _end_records(plan, resources, report, rows, end, dry_run)
    report.rows = sorted(rows, key=lambda r: (r.xid, r.resource))
    report.duration_s = time.monotonic() - started
    return report, {f.xid for f in found}


def read_last_resource_decisions(node_id: str, resources: list[Resource]
                                 ) -> tuple[dict[str, tuple[list[str], Resource]], dict[str, str]]:
    """The Logging Last Resource decision rows of ``node_id`` in every SQL resource (gtrid -> (the other
    branches, the resource holding the row)), and the resources whose table could not be read."""
    found: dict[str, tuple[list[str], Resource]] = {}
    unreadable: dict[str, str] = {}
    for resource in resources:
        if not resource.last_resource_capable:
            continue
        try:
            rows = resource.read_decisions(node_id)
        except QtpError as exc:
            unreadable[resource.name] = str(exc)
            continue
        found.update((gtrid, (branches, resource)) for gtrid, branches in rows.items())
    return found, unreadable


def _decide(plan: Plan, report: RecoveryReport) -> tuple[list[Row], list[tuple[Row, Found, bool]]]:
    rows: list[Row] = []
    work: list[tuple[Row, Found, bool]] = []  # (row, branch, commit?)
    for f in plan.found:
        row = Row(str(f.xid), f.resource.name, age_of(f.prepared_at), "", "", "")
        rows.append(row)
        decided = plan.decisions.get(f.gtrid) if plan.decisions is not None else None
        if decided is None and f.gtrid in plan.llr:
            decided = plan.llr[f.gtrid][0]  # a committed decision row needs no log to be believed
        if f.gtrid in plan.in_flight:
            row.decision = "commit" if decided is not None else "none yet"
            row.action, row.result = "skip (in flight)", "left to the live transaction"
        elif str(f.xid) in plan.quarantine:
            row.decision, row.action, row.result, row.problem = ("unknown", "leave in doubt", "left in doubt",
                                                                 QUARANTINED)
        elif decided is None and plan.decisions is None:
            row.decision, row.action, row.result, row.problem = ("log missing", "leave in doubt", "left in doubt",
                                                                 LOG_MISSING)
        elif decided is None and f.resource.name in plan.unvetted:
            row.decision, row.action, row.result, row.problem = ("unknown", "leave in doubt", "left in doubt",
                                                                 UNVETTED)
        elif decided is None and plan.unreadable:
            row.decision, row.action, row.problem = "unknown", "leave in doubt", DECISIONS_UNREADABLE
            row.result = "left in doubt: " + "; ".join(f"{n}: {e}" for n, e in sorted(plan.unreadable.items()))
        elif plan.previous is not None and f.xid not in plan.previous:
            row.decision = "commit" if decided is not None else "none (presumed abort)"
            row.action, row.result = "wait (second pass)", "acted on at the next pass if still in doubt"
        elif decided is not None and f.xid.branch not in decided:
            row.decision, row.action, row.problem = "commit", "leave in doubt", HEURISTIC
            row.result = f"branch not among the decision's branches {decided}: left in doubt"
        else:
            commit = decided is not None
            row.decision = "commit" if commit else "none (presumed abort)"
            row.action = "commit" if commit else "rollback"
            work.append((row, f, commit))
    return rows, work


def _act(work: list[tuple[Row, Found, bool]], dry_run: bool, workers: int) -> None:
    if dry_run:
        for row, _, commit in work:
            row.result = "would commit" if commit else "would roll back"
        return
    if len(work) <= 1 or workers <= 1:
        for item in work:
            _act_one(*item)
        return
    with ThreadPoolExecutor(max_workers=min(workers, len(work)), thread_name_prefix="qtp-recovery") as pool:
        list(pool.map(lambda item: _act_one(*item), work))


def _act_one(row: Row, f: Found, commit: bool) -> None:
    try:
        if commit:
            f.resource.commit(f.xid)
        else:
            f.resource.rollback(f.xid)
        row.result = "committed" if commit else "rolled back"
    except ResourceUnavailableError as exc:
        row.result, row.problem = f"failed: {exc}", UNREACHABLE
    except QtpError as exc:
        row.result, row.problem = f"refused: {exc}", ACTION_FAILED
        log.critical("recovery: %s of %s was refused (%s): heuristic hazard, inspect it by hand",
                     row.action, row.xid, exc)
    failpoint("recovery_after_action")


def _end_records(plan: Plan, resources: list[Resource], report: RecoveryReport, rows: list[Row],
                 end: Callable[[str], None] | None, dry_run: bool) -> None:
    """END every open decision whose branches are all resolved, and say so for branches already gone.
    A Logging Last Resource decision is ended by deleting its row."""
    llr_end = (lambda gtrid: plan.llr[gtrid][1].forget_decisions([gtrid])) if not dry_run else None
    decisions = [(gtrid, branches, end) for gtrid, branches in (plan.decisions or {}).items()]
    decisions += [(gtrid, branches, llr_end) for gtrid, (branches, _) in plan.llr.items()
                  if gtrid not in (plan.decisions or {})]
    if not decisions:
        return
    reachable = {r.name for r in resources if r.name not in report.unreachable}
    configured = {r.name for r in resources}
    unresolved = {(r.xid.split("#", 1)[0]) for r in rows if not r.resolved}
    in_doubt = {(f.gtrid, f.xid.branch) for f in plan.found}
    for gtrid, branches, end in decisions:
        if gtrid in plan.in_flight or gtrid in unresolved:
            continue
        complete = True
        for branch in branches:
            if (gtrid, branch) in in_doubt:
                continue
            if branch not in configured:
                rows.append(Row(f"{gtrid}#{branch}", branch, None, "commit", "leave in doubt",
                                "the log names this branch but no configured resource has that name",
                                NOT_CONFIGURED))
                complete = False
            elif branch not in reachable:
                complete = False
            else:
                rows.append(Row(f"{gtrid}#{branch}", branch, None, "commit", "end record",
                                "not in doubt: committed before the crash, or resolved by hand (possibly "
                                "heuristic; not verifiable: the database keeps no record of it)"))
        if not complete:
            continue
        if not dry_run and end is not None:
            try:
                end(gtrid)
            except QtpError as exc:  # housekeeping: the decision stays, the next pass ends it
                log.warning("recovery: could not end decision %s yet: %s", gtrid, exc)
                continue
        report.ended.append(gtrid)
