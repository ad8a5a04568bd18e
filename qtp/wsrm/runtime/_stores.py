"""A node's stores: one per database its queues live in (plus one in memory), and how each joins a global
transaction (``enlisted``).

The channels' ``mode`` decides the seam, once, here: in ``xa`` a store's calls in an application's
transaction run on that transaction's branch connection of the store's resource, so they commit or roll
back with it (``Enlisted.atomic``); in ``persistent`` and ``memory`` they are recorded and replayed in a
local transaction of the store after the global one committed (docs/messaging.md says what each mode
can lose or repeat).
"""

from __future__ import annotations

from typing import Any

import sqlalchemy

from qtp.errors import ConfigurationError
from qtp.wsrm.runtime._settings import ChannelSettings, NodeSettings, channel_name
from qtp.wsrm.store import Buffered, MemoryStore, SqlStore, Store
from qtp.xa import share_tls_context


class Enlisted:
    """A store's part of one global transaction. ``atomic``: the calls run now, on the transaction's branch
    connection, and commit with it; else they are recorded and replayed after it commits (so they return
    None and see nothing of the transaction)."""

    __slots__ = ("store", "atomic", "_session")

    def __init__(self, store: Store, tx: Any, resource: str | None, atomic: bool):
        self.store, self.atomic = store, atomic
        if atomic:
            self._session: Any = tx.connection(resource)
        else:
            self._session = Buffered(store)
            tx.on_commit(self._session.replay)

    def __call__(self, method: str, *args: Any) -> Any:
        if self.atomic:
            return getattr(self.store, method)(self._session, *args)
        self._session.record(method, *args)
        return None


class Stores:
    def __init__(self, manager: Any, settings: NodeSettings):
        self._manager = manager
        self._channels = settings.channels
        self._stores: dict[Any, Store] = {}
        # a slot of a shared node keeps its sequences in tables of its own (slot 0 in the node's usual ones)
        self._prefix = "qtp_rm_" if not settings.slot else f"qtp_rm_s{settings.slot}_"
        self.inbound_resource = settings.store
        self.inbound_mode = settings.mode
        self.inbound = self.store_for(settings.store, settings.mode)

    def store_for(self, resource: str | None, mode: str) -> Store:
        if mode == "memory":
            if "memory" not in self._stores:
                self._stores["memory"] = MemoryStore(f"{self._manager.node_id}-memory")
            return self._stores["memory"]
        if resource is None:
            raise ConfigurationError(f"mode {mode!r} needs a store resource")
        target = self._manager.resource(resource)
        key = id(target)
        if key not in self._stores:
            url = getattr(target, "url", None)
            if url is None:
                raise ConfigurationError(f"resource {resource!r} is not a SQL database; a store needs one "
                                         "(or mode = \"memory\")")
            # The store's local transactions get their own engine: the resource's pooled connections are
            # left in XA/two-phase modes (MariaDB: autocommit on) that would make them non-atomic. No ping on
            # checkout and no ROLLBACK on return (each costs a round trip per transaction): every use is
            # `engine.begin()`, which ends its transaction itself, and a connection found dead raises, which
            # SQLAlchemy answers by emptying the pool; each caller already retries a failed transaction.
            engine = share_tls_context(sqlalchemy.create_engine(url, pool_size=8, max_overflow=16,
                                                                pool_reset_on_return=None))
            fence = None
            if getattr(self._manager, "lease_settings", None) is not None:  # replicas: see qtp.coordinator._lease
                self._manager.limit_idle(engine)
                fence = self._manager.fence
            self._stores[key] = SqlStore(resource, engine, fence, self._prefix)
        return self._stores[key]

    def for_channel(self, channel: ChannelSettings) -> Store:
        return self.store_for(channel.store, channel.mode)

    def for_route(self, route: str) -> Store:
        channel = self._channels.get(channel_name(route))
        return self.inbound if channel is None else self.for_channel(channel)

    def distinct(self) -> list[Store]:
        return list({id(s): s for s in self._stores.values()}.values())

    def enlisted(self, tx: Any, channel: ChannelSettings | None = None) -> Enlisted:
        """The store of ``channel`` (None: the inbound store) as part of global transaction ``tx``."""
        if channel is None:
            return Enlisted(self.inbound, tx, self.inbound_resource, self.inbound_mode == "xa")
        return Enlisted(self.for_channel(channel), tx, channel.store, channel.mode == "xa")
