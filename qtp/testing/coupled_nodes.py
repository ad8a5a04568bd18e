"""Nodes for the coupled-messaging tests, campaign and benchmark: configs with a channel from every node to
every other (named by the peer's node id, which is how a recipient finds its way back to a sender), the
bank-account schema of the Dependency-Spheres example, and the app run by ``qtp serve`` in crash tests
(``qtp.testing.coupled_app``)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from qtp.embedded import free_port

# k: the account's number (acc-K), the key the Spark reconciliation compares on
ACCOUNTS_DDL = ("CREATE TABLE accounts (id VARCHAR(64) PRIMARY KEY, k INTEGER, status VARCHAR(16) NOT NULL, "
                "opened_by VARCHAR(255))")
# the sender's view for the reconciliation: every transaction it tried, committed when its account exists
OUTCOMES_VIEW = ("CREATE VIEW coupled_outcomes AS SELECT t.k AS k, CASE WHEN a.id IS NULL THEN 'aborted' "
                 "ELSE 'committed' END AS status FROM attempts t LEFT JOIN accounts a ON a.k = t.k")


def accounts_schema(url: str) -> None:
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql(ACCOUNTS_DDL)
        conn.exec_driver_sql("CREATE TABLE attempts (k INTEGER PRIMARY KEY)")  # the transactions a sender tried
        conn.exec_driver_sql(OUTCOMES_VIEW)
    engine.dispose()


def accounts(url: str) -> dict[str, str]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return dict(conn.exec_driver_sql("SELECT id, status FROM accounts").all())
    finally:
        engine.dispose()


def node_ids(roles: list[str]) -> dict[str, str]:
    """Role -> a node id unique on this machine (prepared xids of MariaDB are server-wide)."""
    tag = os.urandom(3).hex()
    return {role: f"{role}-{tag}" for role in roles}


LIMITS = {"retransmit_interval": "0.3", "retransmit_interval_max": "1.0", "retry_backoff": "0.1",
          "retry_backoff_max": "0.5", "http_timeout": "3", "max_attempts": "2"}


def _limits(overrides: str) -> str:
    """The tests' [limits], with ``overrides`` ("key = value" lines) replacing or adding entries."""
    merged = dict(LIMITS)
    for line in overrides.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            merged[key.strip()] = value.strip()
    return "\n".join(f"{key} = {value}" for key, value in merged.items())


def write_configs(folder: Path, urls: dict[str, str], ids: dict[str, str], limits: str = "",
                  extra: dict[str, str] | None = None, ports: dict[str, int] | None = None,
                  via: dict[str, int] | None = None, lanes: int = 1) -> dict[str, Path]:
    """One qtp.toml per role: its app database (also its store, xa), an endpoint, a channel to every other
    node named by that node's id. ``via``: role -> the port others reach it through (a lossy proxy)."""
    ports = ports or {role: free_port() for role in urls}
    via = via or {}
    paths = {}
    for role, url in urls.items():
        channels = "".join(f'''
[channels.{ids[other]}]
peer = "http://127.0.0.1:{via.get(other, ports[other])}/rm"
store = "app"
mode = "xa"
lanes = {lanes}
''' for other in urls if other != role)
        text = f'''
[node]
id = "{ids[role]}"
log_dir = "{folder / 'logs'}"
endpoint = "http://127.0.0.1:{ports[role]}/rm"
listen = "127.0.0.1:{ports[role]}"
store = "app"
mode = "xa"

[resources.app]
url = "{url}"

[recovery]
interval = 2

[limits]
{_limits(limits)}
{(extra or {}).get(role, "")}
{channels}'''
        paths[role] = folder / f"{role}.toml"
        paths[role].write_text(text)
    return paths


PENDING_IN = ("SELECT COUNT(*) FROM qtp_coupled_in WHERE state NOT IN ('committed', 'cancelled', 'rolled-back', "
              "'compensated', 'failed', 'compensation-failed')")
UNSETTLED_OUT = ("SELECT COUNT(*) FROM qtp_coupled_out WHERE state = 'active' OR (state = 'committed' AND "
                 "recipient NOT IN ('committed', 'failed')) OR (state = 'aborted' AND recipient NOT IN "
                 "('cancelled', 'rolled-back', 'compensated', 'failed'))")


def settled(sender_url: str, recipient_urls: list[str], count: int) -> bool:
    """The sender tried all ``count`` transactions and every coupled message reached its end on both sides."""
    from qtp.testing.nodes import rows

    if rows(sender_url, "SELECT COALESCE(MAX(k), 0) FROM attempts")[0][0] < count:
        return False
    if rows(sender_url, UNSETTLED_OUT)[0][0]:
        return False
    return all(rows(url, PENDING_IN)[0][0] == 0 for url in recipient_urls)


def judge(sender_url: str, recipients: list[tuple[str, str]]) -> dict[str, int]:
    """Every coupled transaction atomic by its coupling, from the databases alone. Shared: the account is open
    at the sender if and only if it is open at every recipient. Compensatable: opened at the sender means
    open at every recipient; not opened there means absent or closed (compensated) at every recipient.
    Nothing exists that was never tried. Raises AssertionError with the first violations."""
    from qtp.testing.nodes import rows

    tried = {f"acc-{k}" for (k,) in rows(sender_url, "SELECT k FROM attempts")}
    here = accounts(sender_url)
    there = [(accounts(url), coupling) for url, coupling in recipients]
    problems = [f"{a} exists at the sender but was never tried" for a in set(here) - tried]
    compensated = 0
    for account in sorted(tried):
        states = [(t.get(account), coupling) for t, coupling in there]
        if account in here:
            if any(s != "open" for s, _ in states):
                problems.append(f"{account} committed at the sender, at the recipients: {states}")
        elif any(s is not None for s, c in states if c == "shared"):
            problems.append(f"{account} rolled back at the sender, at a shared recipient: {states}")
        elif any(s == "open" for s, _ in states):
            problems.append(f"{account} rolled back at the sender, still open at a recipient: {states}")
        compensated += account not in here and any(s == "closed" for s, _ in states)
    for t, _ in there:
        problems += [f"{a} at a recipient but never tried" for a in set(t) - tried]
    if problems:
        raise AssertionError(f"{len(problems)} violation(s): " + "; ".join(sorted(set(problems))[:10]))
    return {"tried": len(tried), "committed": len(here), "rolled_back": len(tried) - len(here),
            "compensated": compensated}


# ================================================================== the mixed fan-out (issue 27, item 8)

@dataclass(frozen=True)
class MixedRecipient:
    """One recipient of the mixed fan-out: its role, app database, node id (the sender's channel to it), its
    coupling and its business rule (``refuse``: it refuses acc-K when K % refuse == 0; 0: never)."""

    role: str
    url: str
    node_id: str
    coupling: str
    refuse: int = 0

    def refuses(self, k: int) -> bool:
        return bool(self.refuse) and k % self.refuse == 0


SENDER_FINAL = {"committed": {"committed", "failed"}, "aborted": {"cancelled", "rolled-back", "compensated", "failed"}}
_ACCOUNT = re.compile(rb"acc-(\d+)")


def _fetch(url: str, query: str) -> list[dict[str, Any]]:
    """Rows as dicts, binary columns as bytes."""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return [{k: bytes(v) if isinstance(v, memoryview) else v for k, v in r.items()}
                    for r in conn.execute(sa.text(query)).mappings()]
    finally:
        engine.dispose()


def _number(blob: bytes | None) -> int | None:
    found = _ACCOUNT.search(blob or b"")
    return int(found.group(1)) if found else None


def expected_view(recipient: MixedRecipient) -> str:
    """The sender's view of what ``recipient`` must hold, for Spark: committed when the account exists at the
    sender and the recipient's rule does not refuse it, else aborted (absent, or closed: compensated)."""
    refused = f" AND MOD(t.k, {recipient.refuse}) <> 0" if recipient.refuse else ""
    return (f"CREATE VIEW coupled_expected_{recipient.role} AS SELECT t.k AS k, CASE WHEN a.id IS NOT NULL{refused} "
            "THEN 'committed' ELSE 'aborted' END AS status FROM attempts t LEFT JOIN accounts a ON a.k = t.k")


def prepared_left(urls: list[str], marks: list[str]) -> list[str]:
    """Prepared transactions left on the database servers of ``urls`` that belong to the run: in one of its
    databases (PostgreSQL) or with an xid naming one of ``marks``, its node ids (``pg_prepared_xacts``,
    ``XA RECOVER``)."""
    from qtp.xa import Xid

    found = []
    servers: dict[tuple, list] = {}
    for url in urls:
        parsed = sa.engine.make_url(url)
        servers.setdefault((parsed.get_backend_name(), parsed.host, parsed.port), []).append(parsed.database)
    for (backend, _, port), databases in servers.items():
        url = next(u for u in urls if sa.engine.make_url(u).port == port)
        if backend == "postgresql":
            for r in _fetch(url, "SELECT gid, database FROM pg_prepared_xacts"):
                xid = Xid.from_pg_gid(r["gid"])
                gtrid = xid.gtrid.decode(errors="replace") if xid is not None else r["gid"]
                if r["database"] in databases or any(m in gtrid for m in marks):
                    found.append(f"postgresql:{port} {r['database']} {xid or r['gid']}")
        else:
            for r in _fetch(url, "XA RECOVER"):
                data = r["data"].decode(errors="replace") if isinstance(r["data"], bytes) else str(r["data"])
                if any(m in data for m in marks):
                    found.append(f"mariadb:{port} {data}")
    return found


def judge_mixed(sender_url: str, sender_id: str, recipients: list[MixedRecipient], at_least: int,
                by: list[str]) -> dict[str, Any]:
    """The mixed fan-out judged from the databases alone (every node stopped, everything settled): one coupled
    send per transaction to every recipient, condition processed(at_least=, by= roles).

    - committed at the sender => open exactly once at every shared recipient; at every compensatable one
      open, or absent only if that recipient's rule refuses it and its row there is 'failed'; never closed;
      the condition held: at least ``at_least`` recipients hold it open, every one of ``by`` among them;
    - rolled back at the sender => absent at every shared recipient, absent or closed at every compensatable
      one;
    - every sphere-log row final (committed / aborted with a settled report), one per recipient for a
      committed transaction, in the sender's decision; every recipient row in a final state (_states.FINAL),
      its state the one its sender's log holds as its report, and the recipient's account as that state
      says (committed: open; compensated: closed; cancelled, rolled-back, failed: absent); a 'failed' row
      only where the recipient's rule refuses the account (no outage counted as a refusal);
    - nothing at a recipient, nor in any log, that was never tried; the account opened by that transaction;
    - no prepared transaction of the run left on either database server.

    Returns the figures; raises AssertionError naming every violation class with up to 10 examples each."""
    from qtp.coupled._states import FINAL

    problems: dict[str, list[str]] = {}

    def bad(kind: str, text: str) -> None:
        problems.setdefault(kind, []).append(text)

    tried = {r["k"] for r in _fetch(sender_url, "SELECT k FROM attempts")}
    here = {r["k"]: r for r in _fetch(sender_url, "SELECT id, k, status FROM accounts")}
    by_channel = {r.node_id: r for r in recipients}
    out = _fetch(sender_url, "SELECT * FROM qtp_coupled_out")
    outbound: dict[str, dict[str, Any]] = {}
    sent: dict[int, list[dict[str, Any]]] = {}
    for row in out:
        k = _number(row["compensation"])
        row["k"] = k
        outbound[row["id"]] = row
        sent.setdefault(k, []).append(row)
        if k not in tried:
            bad("sent, never tried", f"sphere-log row {row['id']} (acc-{k})")
        if row["channel"] not in by_channel:
            bad("sent to an unknown channel", f"{row['id']} -> {row['channel']}")
        if row["state"] not in SENDER_FINAL:
            bad("sphere-log row undecided", f"acc-{k} {row['id']} {row['state']}/{row['recipient']}")
        elif row["recipient"] not in SENDER_FINAL[row["state"]]:
            bad("sphere-log row not settled", f"acc-{k} {row['id']} to {row['channel']}: {row['state']} with "
                f"report {row['recipient']} ({row['reason']})")
    for k in set(here) - tried:
        bad("committed at the sender, never tried", f"acc-{k}")
    inbound: dict[str, dict[str, dict[str, Any]]] = {}
    held: dict[str, dict[int, dict[str, Any]]] = {}
    for r in recipients:
        inbound[r.role] = {row["id"]: row for row in _fetch(r.url, "SELECT * FROM qtp_coupled_in")}
        held[r.role] = {}
        for row in _fetch(r.url, "SELECT id, k, status, opened_by FROM accounts"):
            if row["k"] in held[r.role]:
                bad("account twice at a recipient", f"acc-{row['k']} at {r.role}")
            held[r.role][row["k"]] = row
            if row["k"] not in tried:
                bad("at a recipient, never tried", f"acc-{row['k']} at {r.role} ({row['status']})")
        for row in inbound[r.role].values():
            k = _number(row["payload"])
            origin = outbound.get(row["id"])
            if origin is None or origin["channel"] != r.node_id:
                bad("recipient row unknown to the sender", f"{r.role} {row['id']} acc-{k} {row['state']}")
                continue
            k = origin["k"] if k is None else k
            row["k"] = k
            if k != origin["k"]:
                bad("recipient row about another account", f"{r.role} {row['id']}: acc-{k}, sent acc-{origin['k']}")
            if row["state"] not in FINAL:
                bad("recipient row not final", f"acc-{k} at {r.role}: {_show(row)}")
            if row["state"] != origin["recipient"]:
                bad("the sender's log and the recipient disagree",
                    f"acc-{k} at {r.role}: recipient row {row['state']}, the sender's log {origin['state']}/"
                    f"{origin['recipient']}")
            if row["action"] and row["coupling"] != r.coupling:
                bad("coupled as another coupling", f"acc-{k} at {r.role}: {row['coupling']}, not {r.coupling}")
            if row["state"] == "failed" and not r.refuses(k):
                bad("refused without a business refusal", f"acc-{k} at {r.role}: {_show(row)}")
            account = held[r.role].get(k)
            status = None if account is None else account["status"]
            expect = {"committed": "open", "compensated": "closed", "cancelled": None, "rolled-back": None,
                      "failed": None}.get(row["state"], status)
            if status != expect:
                bad("recipient row and account disagree", f"acc-{k} at {r.role}: row {row['state']}, account "
                    f"{status}")
        for row in out:
            if row["channel"] == r.node_id and row["id"] not in inbound[r.role] and \
                    row["recipient"] not in ("sent", "delivered"):
                bad("a report from a recipient that has no row", f"acc-{row['k']} at {r.role}: {row['id']} "
                    f"{row['state']}/{row['recipient']}")
    figures: dict[str, Any] = {"tried": len(tried), "committed": len(here), "rolled_back": len(tried - set(here)),
                               "committed_by": {}, "compensated": {r.role: 0 for r in recipients},
                               "refused": {r.role: 0 for r in recipients}}
    roles = {r.role: r for r in recipients}
    for k in sorted(tried):
        rows_ = sent.get(k, [])
        gtrids = {row["gtrid"] for row in rows_}
        if len(gtrids) > 1:
            bad("sent by more than one transaction", f"acc-{k}: {sorted(gtrids)}")
        channels = [row["channel"] for row in rows_]
        committed = k in here
        states_ = {r.role: (held[r.role].get(k) or {}).get("status") for r in recipients}
        if committed:
            if here[k]["status"] != "open":
                bad("not open at the sender", f"acc-{k}: {here[k]['status']}")
            if sorted(channels) != sorted(by_channel):
                bad("committed without one original per recipient", f"acc-{k}: sent to {sorted(channels)}")
            if any(row["state"] != "committed" for row in rows_):
                bad("committed at the sender, the sphere log says otherwise",
                    f"acc-{k}: " + ", ".join(f"{by_channel[row['channel']].role} {row['state']}" for row in rows_
                                             if row["channel"] in by_channel))
            processed = [role for role, s in states_.items() if s == "open"]
            for r in recipients:
                s = states_[r.role]
                mine = [row for row in inbound[r.role].values() if row.get("k") == k]
                if r.coupling == "shared" and s != "open":
                    bad("committed at the sender, not open at a shared recipient", f"acc-{k} at {r.role}: {s}; "
                        f"all: {states_}; rows: {[_show(row) for row in mine]}")
                elif s == "closed":
                    bad("committed at the sender, compensated at a recipient", f"acc-{k} at {r.role}; all: {states_}")
                elif s is None and not (r.refuses(k) and [row["state"] for row in mine] == ["failed"]):
                    bad("committed at the sender, absent at a recipient that did not refuse it",
                        f"acc-{k} at {r.role}; all: {states_}; rows: {[_show(row) for row in mine]}")
                if s is not None and held[r.role][k]["opened_by"] != next(iter(gtrids), None):
                    bad("opened by another transaction", f"acc-{k} at {r.role}: {held[r.role][k]['opened_by']}")
            if len(processed) < at_least or any(b not in processed for b in by):
                bad("committed, its condition did not hold", f"acc-{k}: open at {processed}, at least {at_least} "
                    f"including {by} asked")
            figures["committed_by"][len(processed)] = figures["committed_by"].get(len(processed), 0) + 1
        else:
            if any(row["state"] != "aborted" for row in rows_):
                bad("rolled back at the sender, the sphere log says otherwise",
                    f"acc-{k}: " + ", ".join(f"{row['channel']} {row['state']}" for row in rows_))
            for r in recipients:
                s = states_[r.role]
                if r.coupling == "shared" and s is not None:
                    bad("rolled back at the sender, present at a shared recipient", f"acc-{k} at {r.role}: {s}; "
                        f"all: {states_}")
                elif s == "open":
                    bad("rolled back at the sender, open at a recipient", f"acc-{k} at {r.role}; all: {states_}")
                figures["compensated"][r.role] += s == "closed"
    for r in recipients:
        figures["refused"][r.role] = sum(1 for row in inbound[r.role].values() if row["state"] == "failed")
        histogram: dict[str, int] = {}
        for row in inbound[r.role].values():
            histogram[row["state"]] = histogram.get(row["state"], 0) + 1
        figures.setdefault("recipient_rows", {})[r.role] = dict(sorted(histogram.items()))
        expected = {k for k in tried if r.refuses(k)}
        figures.setdefault("rule_refuses", {})[r.role] = len(expected)
    reports: dict[str, int] = {}
    for row in out:
        key = f"{row['state']}/{row['recipient']}"
        reports[key] = reports.get(key, 0) + 1
    figures["sphere_log"] = dict(sorted(reports.items()))
    figures["committed_by"] = dict(sorted(figures["committed_by"].items()))
    left = prepared_left([sender_url] + [r.url for r in recipients], [sender_id] + [r.node_id for r in recipients])
    for xid in left:
        bad("prepared transaction left", xid)
    figures["prepared_left"] = len(left)
    if problems:
        count = sum(len(v) for v in problems.values())
        raise AssertionError(f"{count} violation(s): " + "; ".join(
            f"[{kind}: {len(found)}] " + " | ".join(found[:10]) for kind, found in sorted(problems.items())))
    return figures


def _show(row: dict[str, Any]) -> str:
    """A qtp_coupled_in row, every column, for a report."""
    return "{" + ", ".join(f"{k}={v!r}" for k, v in row.items() if k not in ("payload", "compensation")) + \
        f", payload={row.get('payload')!r}, compensation={row.get('compensation')!r}" + "}"
