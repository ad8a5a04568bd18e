"""XA-style resources: the Xid, the resource contract, PostgreSQL, MySQL/MariaDB and in-memory resources."""

from __future__ import annotations

from typing import Any

from sqlalchemy.engine import Engine

from qtp.xa._memory import MemoryConnection, MemoryResource, MemoryDatabase
from qtp.xa._mysql import MySQLResource, share_tls_context
from qtp.xa._postgres import PostgresResource
from qtp.xa._resource import Resource, Vote
from qtp.xa._sql import BranchConnection, normalize_url
from qtp.xa._xid import FORMAT_ID, Xid

__all__ = [
    "FORMAT_ID", "BranchConnection", "MemoryConnection", "MemoryResource", "MemoryDatabase", "MySQLResource",
    "PostgresResource", "Resource", "Vote", "Xid", "normalize_url", "resource_for", "share_tls_context",
]


def resource_for(name: str, target: str | Engine | Resource, node_id: str, **engine_kw: Any) -> Resource:
    """Build the resource for a URL (``postgresql://``, ``mysql+pymysql://``, ``memory://``) or an engine."""
    if isinstance(target, Resource):
        return target
    if isinstance(target, str) and target.startswith("memory://"):
        return MemoryResource(name, node_id, MemoryDatabase.named(target[len("memory://"):] or name))
    url = normalize_url(target.url if isinstance(target, Engine) else target)
    cls = PostgresResource if url.get_backend_name() == "postgresql" else MySQLResource
    return cls(name, target, node_id, **engine_kw)
