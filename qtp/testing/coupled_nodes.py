"""Nodes for the coupled-messaging tests, campaign and benchmark: configs with a channel from every node to
every other (named by the peer's node id, which is how a recipient finds its way back to a sender), the
bank-account schema of the Dependency-Spheres example, and the app run by ``qtp serve`` in crash tests
(``qtp.testing.coupled_app``)."""

from __future__ import annotations

import os
from pathlib import Path

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
