"""A qtp node: a transaction manager plus its queues, sender, endpoint and invoker.

::

    node = qtp.Node.from_config("server.toml")        # recovered, not started

    @node.handler("urn:shop:place")
    def place(tx, message):                           # in a global transaction with the dequeue
        tx.connection("app").execute(...)
        return b"<ack xmlns='urn:shop'>ok</ack>"     # optional reply, sent back reliably

    node.start()                                      # or `with node:`, or `qtp serve --app module:node`

    with node.manager.transaction() as tx:            # on a node with [channels.orders]
        tx.send("orders", b"<order/>", action="urn:shop:place")

Life cycle: a node is *built* (``Node(manager, settings)`` or ``from_config``: the transaction manager has
recovered its in-doubt transactions, so store rows locked by prepared branches are settled), its handlers
are *registered*, and then it *starts*: the stores' tables are created if missing, the machines rebuilt
from the stores, and only then do the workers and the HTTP server start, with every handler known (a
handler registered after the start is refused). ``close()`` stops the workers, then closes the manager.

Node only assembles the parts: each worker is given, when it is built, the few collaborators it uses
(``_ports``), and none of them holds the node.
"""

from __future__ import annotations

import logging
import ssl
import threading
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

from qtp._failures import Failures
from qtp.errors import BacklogFullError, ConfigurationError
from qtp.wsrm.codec import check_payload
from qtp.wsrm.runtime._endpoint import Endpoint
from qtp.wsrm.runtime._http import HttpServer
from qtp.wsrm.runtime._ids import SLOT_QUERY, new_message_id, slot_tag
from qtp.wsrm.runtime._invoker import BatchHandler, Invoker, Message, _Batch
from qtp.wsrm.runtime._mailbox import Mailbox, Poller, node_address
from qtp.wsrm.runtime._metrics import Metrics
from qtp.wsrm.runtime._offers import Offers
from qtp.wsrm.runtime._ownership import Ownership
from qtp.wsrm.runtime._ports import SYSTEM_CLOCK, Wake
from qtp.wsrm.runtime._receiver import Receiver
from qtp.wsrm.runtime._security import BOOT_HEADER
from qtp.wsrm.runtime._sender import Sender
from qtp.wsrm.runtime._sequences import Destinations, Sources
from qtp.wsrm.runtime._settings import (
    PAYLOAD_ROOM,
    ChannelSettings,
    Limits,
    NodeSettings,
    channel_name,
    check,
    node_settings,
)
from qtp.wsrm.runtime._stores import Stores
from qtp.wsrm.runtime._transport import Transport
from qtp.wsrm.store import DestinationInfo, Outgoing, Store

log = logging.getLogger("qtp.wsrm.node")

MAINTENANCE_SAID_S = 60.0  # a maintenance tick that keeps failing (a database down) is logged once a minute

Handler = Callable[[Any, Message], "bytes | str | None"]

# What Node.from_config builds for a file with [lease] slots > 1: qtp.wsrm.runtime._shared.SharedNode, put here
# by the package (that module builds Nodes, so this one does not import it)
_SHARING: list[Callable[[Any], Any]] = []


class HandlerTable:
    """The application's handlers: by WS-Addressing Action for requests, by channel for replies."""

    def __init__(self) -> None:
        self.requests: dict[str, Handler] = {}
        self.replies: dict[str, Handler] = {}
        self.queued: set[str] = set()  # actions registered with on_receipt=False

    def for_message(self, message: Message, info: DestinationInfo | None) -> Handler | None:
        if info is not None and info.channel is not None:
            return self.replies.get(channel_name(info.channel))
        return self.requests.get(message.action)

    def on_receipt(self, message: Message, info: DestinationInfo | None) -> bool:
        """May ``message``'s handler run in the commit that stores it? (Replies: always.)"""
        return info is not None and info.channel is not None or message.action not in self.queued


class Node:
    """Messaging for one transaction manager: build it, register its handlers, ``start()`` it; ``close()``
    stops it and its manager."""

    def __init__(self, manager: Any, settings: NodeSettings | None = None):
        settings = settings or NodeSettings()
        check(settings)
        # (a file's [lease] with memory mode is refused when it is read; this is for nodes built in code)
        memory = (["[node]"] if settings.mode == "memory" else []) + \
            [name for name, c in settings.channels.items() if c.mode == "memory"]
        if getattr(manager, "lease_settings", None) is not None and memory:
            raise ConfigurationError(f"node {manager.node_id!r} has a [lease] (replicas), and a standby cannot take "
                                     f"over what is in memory: mode \"memory\" on {', '.join(memory)}; use xa or "
                                     "persistent")
        self.manager = manager
        self.settings = settings
        # the id peers know the node by: a slot of a shared node (qtp.wsrm.runtime._shared) has a transaction
        # manager of its own (<node>.s<k>), and answers as the node; its replica serves HTTP for it
        self.node_id: str = settings.node_name or manager.node_id
        self.slot = settings.slot
        self.limits: Limits = settings.limits
        self.channels: dict[str, ChannelSettings] = dict(settings.channels)
        self.endpoint = settings.endpoint
        # without an endpoint, replies are offered at this WS-MakeConnection address and fetched by polling
        self.mc_address = node_address(manager.node_id) if self.endpoint is None else None
        self.started = False
        self._table = HandlerTable()
        self._stopping = threading.Event()
        self._stop_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._deferred: list[tuple[Callable[[], None], str]] = []
        self._server: Any = None
        self._backlog: dict[str, tuple[float, int]] = {}
        self._unstarted_warned = False
        self._tables_created = False
        self._tables_lock = threading.Lock()
        self._assemble(manager, settings)
        manager.node = self

    def _assemble(self, manager: Any, settings: NodeSettings) -> None:
        """Build the parts, each given what it uses. The order is the dependency order: registries, then
        the workers that share them, the sender before the receiver (which reports acknowledgements and
        responses to it), the invoker before the receiver (which tells it what is stored)."""
        limits, security, clock = self.limits, settings.security, SYSTEM_CLOCK
        self.stores = Stores(manager, settings)
        self.inbound_store: Store = self.stores.inbound
        self.wake = Wake()
        self.sources, self.destinations = Sources(), Destinations()
        self.metrics = Metrics(self.node_id, self.destinations.open_count, lambda: self.invoker.backlog(),
                               self.channel_stats)
        self.transport = Transport(limits.http_timeout, pool=limits.sender_threads + 4, name=self.node_id,
                                   security=security, max_response_bytes=limits.max_response_bytes)
        self.offers = Offers(self.inbound_store, self.sources, self.destinations, limits, security.peer_for_url,
                             self.wake, clock)
        self.ownership = Ownership(self.destinations, self.sources, self.channels, security, self.metrics)
        self.mailbox = Mailbox(limits, self.metrics, self.sources, self.destinations, self.endpoint, clock)
        self.metrics.watch_polling_clients(self.mailbox.waiting)
        if getattr(manager, "lease_settings", None) is not None:
            self.metrics.watch_lease(lambda: manager.lease)
        self.sender = Sender(limits, self.channels, self.stores, self.sources, self.offers, self.transport,
                             self.mailbox, self.ownership, self.metrics, security, self.endpoint, self.mc_address,
                             self.wake, clock)
        self.invoker = Invoker(limits, self.inbound_store, self.destinations, self._table, manager.transaction,
                               self.stores.enlisted, self.offers.inbound_finished, self.metrics, self.wake, clock,
                               on_receipt=limits.apply_on_receipt and settings.mode == "xa")
        self.receiver = Receiver(limits, security, settings.listen_host(), self.endpoint, self.inbound_store,
                                 self.destinations, self.offers, self.sender, self.invoker,
                                 self.mailbox, self.ownership, self.metrics, self.transport, self.sender.submit,
                                 clock)
        self.wsgi = Endpoint(self.node_id, self.endpoint, limits, security, settings.listen_host(), self.metrics,
                             self.receiver, lambda: self.started)
        if self.slot is not None:
            self.receiver.tag = self.sender.tag = slot_tag(self.node_id, self.slot)
            if self.endpoint is not None:
                self.sender.acks_endpoint = f"{self.endpoint}?{SLOT_QUERY}={self.slot}"

    @classmethod
    def from_config(cls, path: str | Path) -> "Node":
        """The node described by ``qtp.toml``, its transactions recovered; not started: register the handlers,
        then ``start()`` it (``qtp serve`` does, after importing the application)."""
        from qtp.config import load_config
        from qtp.coordinator import TransactionManager

        lease = load_config(path).lease
        if lease is not None and lease.slots > 1:  # replicas that share the work: qtp.wsrm.runtime._shared
            return _SHARING[0](path)  # type: ignore[no-any-return]
        manager = TransactionManager.from_config(path)
        node = getattr(manager, "node", None)
        if node is None:
            config = load_config(path)
            node = cls(manager, node_settings(config.messaging, set(config.resources)))
        return node

    def __repr__(self) -> str:
        state = "started" if self.started else "not started"
        return f"<Node {self.manager.node_id} endpoint={self.endpoint} channels={sorted(self.channels)} {state}>"

    # ------------------------------------------------------------------ stores

    def store_for(self, resource: str | None, mode: str) -> Store:
        return self.stores.store_for(resource, mode)

    @property
    def inbound_mode(self) -> str:
        return self.settings.mode

    # ------------------------------------------------------------------ application API

    @property
    def handlers(self) -> dict[str, Handler]:
        """The registered request handlers, by action."""
        return self._table.requests

    def handler(self, action: str, on_receipt: bool = True) -> Callable[[Handler], Handler]:
        """Register ``fn(tx, message)`` for messages whose WS-Addressing Action is ``action``. ``on_receipt``
        False: never run it in the commit that stores its message (docs/messaging.md, "Apply on receipt"):
        its messages are always acknowledged first and applied by the invoker's threads."""
        def register(fn: Handler) -> Handler:
            self._registering(f"a handler for action {action!r}")
            if action in self._table.requests:
                raise ConfigurationError(f"a handler for action {action!r} is already registered")
            self._table.requests[action] = fn
            if not on_receipt:
                self._table.queued.add(action)
            return fn
        return register

    def batch_handler(self, action: str, on_receipt: bool = True) -> Callable[[BatchHandler], BatchHandler]:
        """Register ``fn(tx, messages)`` for messages whose Action is ``action``, called with consecutive
        messages of one sequence (up to ``[limits] invoker_batch``) in one transaction, so that it can write
        them with one ``executemany``. It returns None or one reply (or None) per message, in order. A batch
        that fails is retried one message at a time (``fn`` with a list of one), each with its own attempts."""
        def register(fn: BatchHandler) -> BatchHandler:
            self.handler(action, on_receipt)(_Batch(fn))
            return fn
        return register

    def reply_handler(self, channel: str) -> Callable[[Handler], Handler]:
        """Register ``fn(tx, reply)`` for the replies and faults coming back on request-reply ``channel``;
        ``reply.relates_to`` is the request's MessageID, ``reply.fault`` the fault's text (None for a reply)."""
        def register(fn: Handler) -> Handler:
            self._registering(f"a reply handler for channel {channel!r}")
            if channel not in self.channels or not self.channels[channel].reply:
                raise ConfigurationError(f"channel {channel!r} is not a request-reply channel (reply = true)")
            self._table.replies[channel] = fn
            return fn
        return register

    def _registering(self, what: str) -> None:
        if self.started:
            raise ConfigurationError(f"{what} is registered after node {self.manager.node_id!r} started: register "
                                     "every handler first, then start the node (node.start(), `with node:`, or "
                                     "`qtp serve --app module:node`, which starts it after importing the module)")

    def check_size(self, payload: bytes) -> None:
        """ConfigurationError when ``payload`` would not fit in a request to a peer ([limits] max_request_bytes,
        less room for the envelope): refused when it is sent, rather than answered 413 by the peer for ever."""
        if len(payload) > self.limits.max_request_bytes - PAYLOAD_ROOM:
            raise ConfigurationError(f"the payload of {len(payload)} bytes is over the limit of "
                                     f"{self.limits.max_request_bytes - PAYLOAD_ROOM} ([limits] max_request_bytes)")

    def enqueue(self, tx: Any, channel: str, payload: bytes | str, action: str, message_id: str | None = None,
                key: str | None = None) -> str:
        """Enqueue ``payload`` on ``channel`` inside transaction ``tx``: what ``tx.send`` does (the one way an
        application sends); messages with the same ``key`` travel in one lane (order: docs/messaging.md, "Lanes")."""
        settings = self.channels.get(channel)
        if settings is None:
            known = ", ".join(sorted(self.channels)) or "none"
            raise ConfigurationError(f"unknown channel {channel!r} on node {self.manager.node_id!r} (known: {known})")
        if not isinstance(action, str) or not action.strip():
            raise ConfigurationError("tx.send needs action=\"...\": the WS-Addressing Action handlers are chosen by")
        if isinstance(payload, str):
            payload = payload.encode("utf-8")
        check_payload(payload)
        self.check_size(payload)
        if not self.started and not self._unstarted_warned:
            self._unstarted_warned = True
            self.create_tables()
            log.warning("node %s is not started: what is sent waits in its store until node.start()",
                        self.manager.node_id)
        self._check_backlog(channel, settings)
        now = SYSTEM_CLOCK.time()
        message = Outgoing(route=settings.route_for(key), message_id=message_id or new_message_id(now), action=action,
                           payload=payload, enqueued_at=now)
        self.stores.enlisted(tx, settings)("enqueue", message)
        tx.on_commit(self.wake)
        return message.message_id

    def _check_backlog(self, channel: str, settings: ChannelSettings) -> None:
        checked_at, count = self._backlog.get(channel, (0.0, 0))
        now = SYSTEM_CLOCK.monotonic()
        if now - checked_at > 1.0 or count >= self.limits.max_backlog:
            store = self.stores.for_channel(settings)
            with store.local() as s:
                count = sum(store.backlog(s, route) for route in settings.routes())
            self._backlog[channel] = (now, count)
        if count >= self.limits.max_backlog:
            raise BacklogFullError(
                f"channel {channel!r} has {count} messages waiting ([limits] max_backlog = "
                f"{self.limits.max_backlog}); the peer at {settings.peer} is slow or down: retry later"
            )

    def channel_stats(self) -> dict[str, dict[str, float]]:
        """For /metrics: per channel, the sender's view and the stores' backlog and oldest message."""
        stats = self.sender.channel_stats()
        now = SYSTEM_CLOCK.time()
        for store in self.stores.distinct():
            try:
                with store.local() as s:
                    outgoing = store.summary(s).outgoing
            except Exception as exc:  # the store is down: the scrape still answers, without these
                log.debug("channel backlog not read: %s", exc)
                continue
            for (route, _), (count, oldest) in outgoing.items():
                entry = stats.setdefault("offer" if route.startswith("offer:") else channel_name(route),
                                         {"in_flight": 0.0})
                entry["backlog"] = entry.get("backlog", 0.0) + count
                age = max(0.0, now - oldest)
                entry["oldest_message_age_seconds"] = max(entry.get("oldest_message_age_seconds", 0.0), age)
        return stats

    # ------------------------------------------------------------------ running

    def start(self) -> "Node":
        """Create the stores' tables, rebuild the sequences, start the workers and the endpoint."""
        if self.started:
            return self
        if self.endpoint is not None:
            self.settings.security.require_metrics_token(self.settings.listen_host())
        for name, channel in self.channels.items():
            if channel.reply and name not in self._table.replies:
                log.warning("channel %r is request-reply but no reply handler is registered: its replies wait, "
                            "stored (register one with @node.reply_handler(%r) before start)", name, name)
        self.create_tables()
        self.receiver.load()
        self.sender.load()
        self.invoker.load()
        self.invoker.start()
        self._spawn(self._maintain, "qtp-maintenance")
        if self.endpoint is not None:
            if self.slot is None:  # (a slot's replica serves HTTP for all its slots)
                self._serve_http()
        else:
            poller = Poller(self.mc_address or "", self.channels, self.limits, self.transport, self.metrics,
                            self.settings.security, self.receiver.handle, self.receiver.handle_batch,
                            self.manager.log_dir)
            for peer in poller.peers():
                self._spawn(lambda peer=peer: poller.run(peer, self._stopping), "qtp-poll")
        self.started = True
        for target, name in self._deferred:
            self._spawn(target, name)
        self._deferred.clear()
        log.info("node %s started (endpoint %s, channels %s)", self.manager.node_id, self.endpoint,
                 sorted(self.channels))
        return self

    def create_tables(self) -> None:
        """Create the stores' tables where missing (once): ``start()`` does, and so does the first message
        enqueued before it; a layer that writes to the queues itself before the start calls it."""
        with self._tables_lock:  # (a sending thread and start() may both come here first)
            if not self._tables_created:
                for store in self.stores.distinct():
                    store.create()
                self._tables_created = True

    @property
    def stopping(self) -> threading.Event:
        """Set when the node is closing: the loops of ``add_worker`` end on it."""
        return self._stopping

    def add_worker(self, target: Callable[[], None], name: str) -> None:
        """Run ``target`` in a thread of the node, from its start (at once if it has started), joined by
        ``close()`` (it returns once ``stopping`` is set); how layers above the runtime (``qtp.coupled``) run
        their workers."""
        if self.started:
            self._spawn(target, name)
        else:
            self._deferred.append((target, name))

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _maintain(self) -> None:
        polled = 0.0
        failures = Failures(log, f"node {self.manager.node_id} maintenance", every=MAINTENANCE_SAID_S,
                            level=logging.ERROR)
        while not self._stopping.is_set():
            self.wake.clear()
            now = SYSTEM_CLOCK.time()
            try:
                due = self.sender.tick(now)
                self.receiver.tick(now)
                if now - polled > 2.0:
                    self.invoker.poll_redeliveries()
                    polled = now
            except Exception as exc:  # keep running: the next tick retries from the stores, a second later
                failures.failed(exc, traceback=True)
                self.wake.wait(1.0)
                continue
            failures.worked()
            wait = 0.2 if due is None else max(0.0, min(0.2, due - SYSTEM_CLOCK.time()))
            self.wake.wait(wait)

    def _serve_http(self) -> None:
        """The endpoint in qtp's HTTP server (``qtp.wsrm.runtime._http``): connections on an event loop, so
        that no socket holds a thread, complete requests to ``http_threads`` threads; TLS (and client
        certificates) from the standard library's ``ssl``, handshakes under their own deadline."""
        assert self.endpoint is not None
        host, port = self.settings.listen or _listen_address(self.endpoint)
        security = self.settings.security
        tls = _tls_context(security) if security.tls_cert else None
        refused = self.metrics.refused
        server = HttpServer(self.wsgi, host, port, self.limits, tls=tls, health=lambda query: self.started,
                            refused=lambda reason: refused.labels(reason=reason).inc(),
                            health_headers=((BOOT_HEADER, self.wsgi.seen.boot),))
        if not security.anonymous_allowed(self.settings.listen_host()):
            log.info("node %s takes authenticated requests only (%d peer(s) known)", self.manager.node_id,
                     len(security.peers))
        elif security.allow_anonymous:
            log.warning("node %s takes anonymous requests ([node] allow_anonymous = true): any client that "
                        "reaches %s:%d can create sequences and send messages", self.manager.node_id, host, port)
        server.start()
        self._server = server

    def stop(self) -> None:
        """Stop the HTTP server and the workers (the manager stays open); what ``close`` and the manager's
        own ``close`` call first."""
        with self._stop_lock:  # (a lost lease stops the node from its own thread, beside `qtp serve`)
            if not self.started:
                return
            self._stopping.set()
            self.wake.set()
            if self._server is not None:
                self._server.stop()
            self.invoker.stop()
            self.sender.close()
            for thread in self._threads:
                thread.join(timeout=10)
            self.transport.close()
            self.started = False

    def close(self) -> None:
        """Stop the node, then close its transaction manager."""
        self.stop()
        self.manager.close()

    def __enter__(self) -> "Node":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()


def attach_from_config(manager: Any, config: Any) -> None:
    """The node a configuration describes, built and attached to ``manager`` (when the file has channels
    or an endpoint), not started; registered with the coordinator by ``qtp.wsrm.runtime``."""
    if config.messaging["channels"] or config.messaging["node"].get("endpoint"):
        Node(manager, node_settings(config.messaging, set(config.resources)))


def _tls_context(security: Any) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(security.tls_cert, security.tls_key)
    if security.tls_client_ca:
        context.load_verify_locations(security.tls_client_ca)
        context.verify_mode = ssl.CERT_OPTIONAL  # a peer may also authenticate by signature
    return context


def _listen_address(endpoint: str) -> tuple[str, int]:
    parts = urlsplit(endpoint)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts.hostname or "127.0.0.1", port
