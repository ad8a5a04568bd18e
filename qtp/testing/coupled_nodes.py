"""Nodes for the coupled-messaging tests, campaign and benchmark: configs with a channel from every node to
every other (named by the peer's node id, which is how a recipient finds its way back to a sender), the
bank-account schema of the Dependency-Spheres example, and the app run by ``qtp serve`` in crash tests
(``qtp.testing.coupled_app``)."""

from __future__ import annotations

import os
from pathlib import Path

import sqlalchemy as sa

from qtp.embedded import free_port

ACCOUNTS_DDL = ("CREATE TABLE accounts (id VARCHAR(64) PRIMARY KEY, status VARCHAR(16) NOT NULL, "
                "opened_by VARCHAR(255))")


def accounts_schema(url: str) -> None:
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql(ACCOUNTS_DDL)
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


def write_configs(folder: Path, urls: dict[str, str], ids: dict[str, str], limits: str = "",
                  extra: dict[str, str] | None = None) -> dict[str, Path]:
    """One qtp.toml per role: its app database (also its store, xa), an endpoint, a channel to every other
    node named by that node's id."""
    ports = {role: free_port() for role in urls}
    paths = {}
    for role, url in urls.items():
        channels = "".join(f'''
[channels.{ids[other]}]
peer = "http://127.0.0.1:{ports[other]}/rm"
store = "app"
mode = "xa"
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
retransmit_interval = 0.3
retransmit_interval_max = 1.0
retry_backoff = 0.1
retry_backoff_max = 0.5
http_timeout = 3
max_attempts = 2
{limits}
{(extra or {}).get(role, "")}
{channels}'''
        paths[role] = folder / f"{role}.toml"
        paths[role].write_text(text)
    return paths
