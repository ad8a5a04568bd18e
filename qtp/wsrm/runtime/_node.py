"""A qtp node: a transaction manager plus its queues, sender, endpoint and invoker.

::

    node = qtp.Node.from_config("server.toml")        # starts everything the file describes

    @node.handler("urn:shop:place")
    def place(tx, message):                           # in a global transaction with the dequeue
        tx.connection("app").execute(...)
        return b"<ack xmlns='urn:shop'>ok</ack>"     # optional reply, sent back reliably

    with qtp.transaction() as tx:                     # on a node with [channels.orders]
        tx.send("orders", b"<order/>", action="urn:shop:place")

Start-up order: the transaction manager recovers the node's in-doubt transactions first (so store rows
locked by prepared branches are settled), then the stores' tables are created if missing, the machines are
rebuilt from the stores, and only then do the workers and the HTTP server start.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

import sqlalchemy

from qtp.errors import BacklogFullError, ConfigurationError
from qtp.xa import share_tls_context
from qtp.wsrm.codec import Addressing, Envelope, WsaVersion, anonymous, check_payload, mc_id
from qtp.wsrm.codec._names import action as rm_action
from qtp.wsrm.protocol import RMVersion, SequenceAcknowledgement
from qtp.wsrm.runtime._endpoint import Endpoint
from qtp.wsrm.runtime._http import HttpServer
from qtp.wsrm.runtime._invoker import BatchHandler, Invoker, Message, _Batch
from qtp.wsrm.runtime._mailbox import Mailbox, Poller, node_address
from qtp.wsrm.runtime._metrics import Metrics
from qtp.wsrm.runtime._ownership import Ownership
from qtp.wsrm.runtime._receiver import Receiver, new_message_id
from qtp.wsrm.runtime._sender import Sender
from qtp.wsrm.runtime._security import BOOT_HEADER
from qtp.wsrm.runtime._settings import (
    ChannelSettings,
    Limits,
    NodeSettings,
    channel_name,
    check,
    node_settings,
)
from qtp.wsrm.runtime._transport import Transport, TransportError, wire
from qtp.wsrm.store import Buffered, DestinationInfo, MemoryStore, Outgoing, SqlStore, Store

log = logging.getLogger("qtp.wsrm.node")

Handler = Callable[[Any, Message], "bytes | str | None"]
class Node:
    """Messaging for one transaction manager. ``start()`` runs it; ``close()`` stops it (and the manager)."""

    def __init__(self, manager: Any, settings: NodeSettings | None = None):
        settings = settings or NodeSettings()
        check(settings)
        self.manager = manager
        self.settings = settings
        self.limits: Limits = settings.limits
        self.channels: dict[str, ChannelSettings] = dict(settings.channels)
        self.endpoint = settings.endpoint
        self._stores: dict[Any, Store] = {}
        self.inbound_mode = settings.mode
        self.inbound_store = self.store_for(settings.store, settings.mode)
        self.transport = Transport(self.limits.http_timeout, pool=self.limits.sender_threads + 4,
                                   name=manager.node_id, security=settings.security,
                                   max_response_bytes=self.limits.max_response_bytes)
        self.handlers: dict[str, Handler] = {}
        self.reply_handlers: dict[str, Handler] = {}
        self.receiver = Receiver(self)
        self.ownership = Ownership(self)
        self.invoker = Invoker(self)
        self.sender = Sender(self)
        self.metrics = Metrics(manager.node_id, self.receiver.open_sequences, self.invoker.backlog,
                               self.channel_stats)
        self.mailbox = Mailbox(self)
        self.metrics.watch_polling_clients(self.mailbox.waiting)
        # without an endpoint, replies are offered at this WS-MakeConnection address and fetched by polling
        self.mc_address = node_address(manager.node_id) if self.endpoint is None else None
        self.wsgi = Endpoint(self)
        self.started = False
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._server: Any = None
        self._backlog: dict[str, tuple[float, int]] = {}
        manager.node = self

    @classmethod
    def from_config(cls, path: str | Path) -> "Node":
        """The node described by ``qtp.toml``, recovered and started (HTTP server included when the file
        gives ``[node] endpoint``)."""
        from qtp.coordinator import TransactionManager

        manager = TransactionManager.from_config(path)
        node = getattr(manager, "node", None)
        if node is None:
            from qtp.config import load_config

            config = load_config(path)
            node = cls(manager, node_settings(config.messaging, set(config.resources)))
            node.start()
        return node

    def __repr__(self) -> str:
        return f"<Node {self.manager.node_id} endpoint={self.endpoint} channels={sorted(self.channels)}>"

    # ------------------------------------------------------------------ stores

    def store_for(self, resource: str | None, mode: str) -> Store:
        if mode == "memory":
            key: Any = "memory"
            if key not in self._stores:
                self._stores[key] = MemoryStore(f"{self.manager.node_id}-memory")
            return self._stores[key]
        if resource is None:
            raise ConfigurationError(f"mode {mode!r} needs a store resource")
        target = self.manager.resource(resource)
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
            self._stores[key] = SqlStore(resource, engine)
        return self._stores[key]

    def store_for_route(self, route: str) -> Store:
        channel = self.channels.get(channel_name(route))
        if channel is None:
            return self.inbound_store
        return self.store_for(channel.store, channel.mode)

    def distinct_stores(self) -> list[Store]:
        return list({id(s): s for s in self._stores.values()}.values())

    # ------------------------------------------------------------------ application API

    def handler(self, action: str) -> Callable[[Handler], Handler]:
        """Register ``fn(tx, message)`` for messages whose WS-Addressing Action is ``action``."""
        def register(fn: Handler) -> Handler:
            if action in self.handlers:
                raise ConfigurationError(f"a handler for action {action!r} is already registered")
            self.handlers[action] = fn
            self.invoker.handler_registered()
            return fn
        return register

    def batch_handler(self, action: str) -> Callable[[BatchHandler], BatchHandler]:
        """Register ``fn(tx, messages)`` for messages whose Action is ``action``, called with consecutive
        messages of one sequence (up to ``[limits] invoker_batch``) in one transaction, so that it can write
        them with one ``executemany``. It returns None or one reply (or None) per message, in order. A batch
        that fails is retried one message at a time (``fn`` with a list of one), each with its own attempts."""
        def register(fn: BatchHandler) -> BatchHandler:
            self.handler(action)(_Batch(fn))
            return fn
        return register

    def reply_handler(self, channel: str) -> Callable[[Handler], Handler]:
        """Register ``fn(tx, reply)`` for the replies and faults coming back on request-reply ``channel``;
        ``reply.relates_to`` is the request's MessageID, ``reply.fault`` the fault's text (None for a reply)."""
        def register(fn: Handler) -> Handler:
            if channel not in self.channels or not self.channels[channel].reply:
                raise ConfigurationError(f"channel {channel!r} is not a request-reply channel (reply = true)")
            self.reply_handlers[channel] = fn
            self.invoker.handler_registered()
            return fn
        return register

    def handler_for(self, message: Message, info: DestinationInfo | None) -> Handler | None:
        if info is not None and info.channel is not None:
            return self.reply_handlers.get(channel_name(info.channel))
        return self.handlers.get(message.action)

    def routes(self) -> list[str]:
        """Every route of the node's channels (one per lane)."""
        return [route for channel in self.channels.values() for route in channel.routes()]

    def check_size(self, payload: bytes) -> None:
        """ConfigurationError when ``payload`` would not fit in a request to a peer ([limits] max_request_bytes,
        less room for the envelope): refused when it is sent, rather than answered 413 by the peer for ever."""
        if len(payload) > self.limits.max_request_bytes - 4096:
            raise ConfigurationError(f"the payload of {len(payload)} bytes is over the limit of "
                                     f"{self.limits.max_request_bytes - 4096} ([limits] max_request_bytes)")

    def send(self, tx: Any, channel: str, payload: bytes | str, action: str, message_id: str | None = None,
             key: str | None = None) -> str:
        """Enqueue ``payload`` on ``channel`` inside transaction ``tx`` (see ``Transaction.send``); messages
        with the same ``key`` travel in one lane, in commit order."""
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
        self._check_backlog(channel, settings)
        now = time.time()
        message = Outgoing(route=settings.route_for(key), message_id=message_id or new_message_id(now), action=action,
                           payload=payload, enqueued_at=now)
        store = self.store_for(settings.store, settings.mode)
        if settings.mode == "xa":
            store.enqueue(tx.connection(settings.store), message)
        else:
            buffered = Buffered(store)
            buffered.record("enqueue", message)
            tx.on_commit(buffered.replay)
        tx.on_commit(self.sender.wake.set)
        return message.message_id

    def _check_backlog(self, channel: str, settings: ChannelSettings) -> None:
        checked_at, count = self._backlog.get(channel, (0.0, 0))
        now = time.monotonic()
        if now - checked_at > 1.0 or count >= self.limits.max_backlog:
            store = self.store_for(settings.store, settings.mode)
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
        now = time.time()
        for store in self.distinct_stores():
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
        if self.started:
            return self
        if self.endpoint is not None:
            self.settings.security.require_metrics_token(self.settings.listen_host())
        for store in self.distinct_stores():
            store.create()
        self.receiver.load()
        self.sender.load()
        self.invoker.load()
        self.invoker.start()
        self._spawn(self._maintain, "qtp-maintenance")
        if self.endpoint is not None:
            self._serve_http()
        else:
            poller = Poller(self, self.mc_address or "")
            for peer in poller.peers():
                self._spawn(lambda peer=peer: poller.run(peer, self._stopping), "qtp-poll")
        self.started = True
        log.info("node %s started (endpoint %s, channels %s)", self.manager.node_id, self.endpoint,
                 sorted(self.channels))
        return self

    @property
    def stopping(self) -> threading.Event:
        """Set when the node is closing: the loops of ``add_worker`` end on it."""
        return self._stopping

    def add_worker(self, target: Callable[[], None], name: str) -> None:
        """Run ``target`` in a thread of the node, joined by ``close()`` (it returns once ``stopping`` is set);
        how layers above the runtime (``qtp.coupled``) run their workers."""
        self._spawn(target, name)

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _maintain(self) -> None:
        polled = 0.0
        while not self._stopping.is_set():
            self.sender.wake.clear()
            now = time.time()
            try:
                due = self.sender.tick(now)
                self.receiver.tick(now)
                if now - polled > 2.0:
                    self.invoker.poll_redeliveries()
                    polled = now
            except Exception:  # keep running: the next tick retries from the stores
                log.exception("node maintenance failed")
                due = now + 1.0
            wait = 0.2 if due is None else max(0.0, min(0.2, due - time.time()))
            self.sender.wake.wait(wait)

    def _serve_http(self) -> None:
        """The endpoint in qtp's HTTP server (``qtp.wsrm.runtime._http``): connections on an event loop, so
        that no socket holds a thread, complete requests to ``http_threads`` threads; TLS (and client
        certificates) from the standard library's ``ssl``, handshakes under their own deadline."""
        assert self.endpoint is not None
        host, port = self.settings.listen or _listen_address(self.endpoint)
        security = self.settings.security
        tls = _tls_context(security) if security.tls_cert else None
        refused = self.metrics.refused
        server = HttpServer(self.wsgi, host, port, self.limits, tls=tls, health=lambda: self.started,
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

    def send_acks_to(self, info: DestinationInfo, request: Envelope, acks: list[SequenceAcknowledgement]) -> None:
        """Acknowledgements for a sequence whose AcksTo is addressable: POST them there."""
        assert info.acks_to is not None
        wsa = request.wsa or WsaVersion.WSA200508
        client = mc_id(info.acks_to)
        rm = request.rm or RMVersion.WSRM11
        envelope = Envelope(soap=request.soap, rm=rm, wsa=wsa, acks=tuple(acks), addressing=Addressing(
            action=rm_action(rm, "SequenceAcknowledgement"), to=info.acks_to, message_id=f"urn:uuid:{uuid.uuid4()}",
            reply_to=anonymous(wsa)))
        if client is not None:  # a peer that cannot listen: it fetches them with MakeConnection
            self.mailbox.hold(info.owner, client, envelope)
            return

        def post() -> None:
            try:
                self.transport.post(info.acks_to or "", wire(envelope), envelope.soap, envelope.addressing.action)
            except TransportError as exc:
                log.debug("acknowledgement to %s not delivered (the source will ask again): %s", info.acks_to, exc)

        self.sender.submit(post)

    def close(self) -> None:
        """Stop the HTTP server and the workers, then the transaction manager."""
        self._stopping.set()
        self.sender.wake.set()
        if self._server is not None:
            self._server.stop()
        self.invoker.stop()
        self.sender.close()
        for thread in self._threads:
            thread.join(timeout=10)
        self.transport.close()
        self.started = False
        self.manager.close()

    def __enter__(self) -> "Node":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def attach_from_config(manager: Any, config: Any) -> None:
    """The node a configuration describes, attached to ``manager`` and started (when the file has channels
    or an endpoint); registered with the coordinator by ``qtp.wsrm.runtime``."""
    if config.messaging["channels"] or config.messaging["node"].get("endpoint"):
        Node(manager, node_settings(config.messaging, set(config.resources))).start()


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
