"""Recovery of a node from outside its manager (``qtp recover``, ``qtp status``), and the files it shares
with the manager's own recovery: the QUARANTINE list (the log-present test and the lost-log mark belong to
the log, ``qtp.coordinator._log``).

Missing versus empty. A manager creates its log directory together with a first segment (a checkpoint
record), and a checkpoint always writes the new segment before deleting the old ones. So a node that has
ever run a transaction has at least one ``segment-*.log``; "no segment" means the log was never created
or has been lost. In-doubt branches of this node with no log present are therefore the mark of a lost log:
they are reported and left alone, never presumed aborted. A manager that starts on a missing log leaves
the ``LOG_LOST`` mark until it has vetted every resource; ``qtp recover`` leaves the branches of resources
not yet vetted in doubt.

QUARANTINE. When a manager starts on a missing log and finds in-doubt branches of its node that it did not
create, it cannot know their outcome either; it writes them, one JSON object a line, to
``<log dir>/QUARANTINE`` so that every later pass (its own, or ``qtp recover``) leaves them alone until an
operator resolves them by hand and deletes the file.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

from qtp.config import Config
from qtp.coordinator._lease import Lease, lease_home, read_lease
from qtp.coordinator._log import (
    LOST_MARK,
    DecisionLog,
    append_durably,
    lock_holder,
    log_present,
    read_log,
    read_lost_mark,
)
from qtp.errors import LeaseHeldError, LiveManagerError, LogLockedError, QtpError
from qtp.recovery._core import RecoveryReport, age_of, read_last_resource_decisions, run_pass, scan
from qtp.xa import Resource, resource_for
from qtp.xa._sql import identity_of, normalize_url

QUARANTINE_FILE = "QUARANTINE"


def node_log_dir(config: Config) -> Path:
    return Path(config.log_dir) / config.node_id


def read_quarantine(directory: Path | str) -> dict[str, dict]:
    path = Path(directory) / QUARANTINE_FILE
    if not path.exists():
        return {}
    entries = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {entry["xid"]: entry for entry in entries}


def add_quarantine(directory: Path | str, entries: list[dict]) -> None:
    """Append to QUARANTINE, durably: a quarantined branch must stay quarantined after any crash."""
    if entries:
        append_durably(Path(directory) / QUARANTINE_FILE, [json.dumps(entry) for entry in entries])


def unvetted_resources(directory: Path | str, names: list[str]) -> set[str]:
    """The resources among ``names`` that the lost-log mark says were not vetted yet (none without a mark)."""
    mark = read_lost_mark(directory)
    return set() if mark is None else set(names) - set(mark["vetted"])


def open_resources(config: Config) -> list[Resource]:
    """One resource per distinct database of the configuration, named as the manager names it."""
    distinct: list[Resource] = []
    for name, url in config.resources.items():
        resource = resource_for(name, url, config.node_id, pool_size=16, max_overflow=16)
        if any(r.identity == resource.identity for r in distinct):
            resource.close()
            continue
        distinct.append(resource)
    return distinct


def recover_node(config: Config, dry_run: bool = False, workers: int = 16) -> RecoveryReport:
    """Run one recovery pass for the node of ``config``, outside any manager.

    Refuses (LiveManagerError) when a live manager holds the node's log: that manager recovers its own
    in-doubt branches, and acting beside it could race its live transactions.
    """
    directory = node_log_dir(config)
    holder = lock_holder(directory)
    if holder is not None:
        raise _live(config, directory, holder)
    resources = open_resources(config)
    quarantine = set(read_quarantine(directory))
    log: DecisionLog | None = None
    lease = None
    try:
        if config.lease is not None and not dry_run:
            lease = _take_lease(config, resources)
        if not log_present(directory):
            read = lambda: None  # noqa: E731 - the log is missing: nothing may be presumed
            end = None
        elif dry_run:
            state = read_log(directory)
            read, end = (lambda: dict(state.open)), None
        else:
            try:
                log = DecisionLog(directory)
            except LogLockedError as exc:
                raise _live(config, directory, lock_holder(directory) or "unknown") from exc
            read, end = (lambda: dict(log.open)), log.log_end
        unvetted = unvetted_resources(directory, [r.name for r in resources])
        report, _ = run_pass(config.node_id, resources, read, end=end, quarantine=quarantine, unvetted=unvetted,
                             dry_run=dry_run, workers=workers, held=None if lease is None else lease.verify)
        if log is not None and report.ended:
            log.flush()
            log.checkpoint()
        return report
    finally:
        if lease is not None:
            lease.release()
        if log is not None:
            log.close()
        for resource in resources:
            resource.close()


def _take_lease(config: Config, resources: list[Resource]) -> Lease:
    """A node run as replicas ([lease]): `qtp recover` acts only as the node's owner, never beside a live one."""
    assert config.lease is not None
    name = lease_home(config.node_id, config.lease, list(config.resources))
    home = next((r for r in resources if r.identity == identity_of(normalize_url(config.resources[name]))), None)
    lease = Lease(config.node_id, replace(config.lease, standby="refuse"), home, resources, lambda why: None)
    try:
        lease.acquire()
    except LeaseHeldError as exc:
        lease.release()
        raise LiveManagerError(f"node {config.node_id!r} runs as replicas and a live process owns it ({exc}); it "
                               "recovers its own in-doubt branches at start and in the background, so `qtp recover` "
                               "will not act beside it. `qtp status` shows the owner and its lease") from exc
    return lease


def lease_view(config: Config) -> dict | None:
    """The node's lease as its database holds it ([lease] only), for ``qtp status``."""
    if config.lease is None:
        return None
    name = lease_home(config.node_id, config.lease, list(config.resources))
    view = read_lease(normalize_url(config.resources[name]), config.node_id)
    return None if view is None else asdict(view)


def _live(config: Config, directory: Path, holder: str) -> LiveManagerError:
    if config.lease is not None:  # a replica on this host: the owner, or a standby waiting for the lease
        try:
            view = lease_view(config)
        except Exception as exc:  # noqa: BLE001 - the lease's database is down: say so, refuse all the same
            owner = f"its lease cannot be read: {exc}"
        else:
            owner = f"the node's owner is {view['holder']} (epoch {view['epoch']})" if view else "nobody owns it yet"
        return LiveManagerError(
            f"node {config.node_id!r} runs as replicas and a process of it on this host (pid {holder}, the owner "
            f"or a standby) holds the decision log {directory}; {owner}. The owner recovers the node's in-doubt "
            "branches by itself, so `qtp recover` will not act beside it; `qtp status` shows the owner and its "
            "lease")
    return LiveManagerError(
        f"node {config.node_id!r} is running: its transaction manager (pid {holder}) holds the decision log "
        f"{directory}, and recovers its own in-doubt branches at start and in the background; `qtp recover` "
        "will not act beside it. Use `qtp status` to look, or stop that process and run `qtp recover` again"
    )


# ---------------------------------------------------------------------------------------------- status


@dataclass
class NodeStatus:
    node_id: str
    log_dir: str
    log_present: bool
    log_locked_by: str | None
    log_size: int = 0
    log_segments: int = 0
    log_records: int = 0
    last_checkpoint: str | None = None
    last_checkpoint_age_s: float | None = None
    open_decisions: int = 0  # in the file log
    last_resource_decisions: int = 0  # Logging Last Resource rows not yet deleted
    torn_tail: str | None = None
    log_error: str | None = None
    quarantined: int = 0
    resources: dict[str, dict] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    lease: dict | None = None  # [lease]: holder, epoch, members (qtp.coordinator._lease.LeaseView)


def node_status(config: Config, warn_age_s: float = 300.0) -> NodeStatus:
    """Read-only: the log's state and each resource's in-doubt branches (never locks, never acts)."""
    directory = node_log_dir(config)
    status = NodeStatus(config.node_id, str(directory), log_present(directory), lock_holder(directory))
    decisions: dict[str, list[str]] = {}
    if status.log_present:
        try:
            state = read_log(directory)
            decisions = state.open
            status.log_size, status.log_segments, status.log_records = state.size, len(state.segments), state.records
            status.open_decisions = len(state.open)
            if state.last_checkpoint is not None:
                path = directory / f"segment-{state.last_checkpoint:08d}.log"
                status.last_checkpoint = path.name
                if path.exists():
                    status.last_checkpoint_age_s = max(0.0, time.time() - path.stat().st_mtime)
            if state.torn_tail is not None:
                status.torn_tail = f"{state.torn_tail[0]} at offset {state.torn_tail[1]}"
        except QtpError as exc:
            status.log_error = str(exc)
            status.warnings.append(str(exc))
    status.quarantined = len(read_quarantine(directory))
    mark = read_lost_mark(directory)
    if mark is not None:
        waiting = sorted(set(config.resources) - set(mark["vetted"]))
        status.warnings.append(
            f"the decision log of this node was lost (mark {directory / LOST_MARK}); resource(s) {waiting} not "
            "vetted yet: their in-doubt branches are left alone until the node's manager starts with them "
            "reachable")
    report = RecoveryReport(config.node_id)
    resources = open_resources(config)
    try:
        status.lease = _lease_status(config, status.warnings)
        found = scan(resources, report)
        llr, unreadable = read_last_resource_decisions(config.node_id, resources)
    finally:
        for resource in resources:
            resource.close()
    status.last_resource_decisions = len(llr)
    for name, error in sorted(unreadable.items()):
        if name not in report.unreachable:
            status.warnings.append(f"the decision table of resource {name!r} cannot be read: {error}")
    decisions = {**{g: b for g, (b, _) in llr.items()}, **decisions}
    now = datetime.now(timezone.utc)
    for resource in resources:
        entry: dict = {"in_doubt": [], "unreachable": report.unreachable.get(resource.name),
                       "family": getattr(resource, "family", "memory")}
        status.resources[resource.name] = entry
        if entry["unreachable"]:
            status.warnings.append(f"resource {resource.name!r} is unreachable: {entry['unreachable']}")
    old = 0
    for f in found:
        age = age_of(f.prepared_at, now)
        decided = f.gtrid in decisions
        status.resources[f.resource.name]["in_doubt"].append(
            {"xid": str(f.xid), "age_s": age, "decision": "commit" if decided else "none (presumed abort)"})
        if age is not None and age > warn_age_s:
            old += 1
    if old:
        status.warnings.append(
            f"{old} prepared branch(es) older than {warn_age_s:g} s: in PostgreSQL they hold their row locks and "
            "keep VACUUM from removing dead rows; run `qtp recover` (or check that the node's manager is running)")
    unaged = sum(1 for f in found if f.prepared_at is None)
    owned = status.lease is not None and (status.lease["expires_in_s"] or 0) > 0
    if unaged and status.log_locked_by is None and not owned:
        status.warnings.append(
            f"{unaged} in-doubt branch(es) on MariaDB/MySQL, whose age the server does not record, and no live "
            "manager holds the log: run `qtp recover`")
    if found and not status.log_present:
        status.warnings.append(f"{len(found)} in-doubt branch(es) but the decision log {directory} is missing: "
                               "restore it before recovering; `qtp recover` will leave them in doubt")
    if status.quarantined:
        status.warnings.append(f"{status.quarantined} quarantined branch(es) listed in {directory / QUARANTINE_FILE}:"
                               " resolve them by hand (docs/recovery.md)")
    return status


def _lease_status(config: Config, warnings: list[str]) -> dict | None:
    try:
        view = lease_view(config)
    except Exception as exc:  # noqa: BLE001 - the database is down: said, and the rest is still shown
        warnings.append(f"the lease of node {config.node_id!r} cannot be read: {exc}")
        return None
    if config.lease is not None and (view is None or (view["expires_in_s"] or 0) <= 0):
        standbys = sum(1 for m in (view or {}).get("members", []) if m["role"] == "standby" and m["expires_in_s"] > 0)
        warnings.append(f"node {config.node_id!r} runs as replicas ([lease]) and no process owns it now "
                        f"({standbys} live standby(s)): nothing is sent, received or recovered until one takes over")
    return view
