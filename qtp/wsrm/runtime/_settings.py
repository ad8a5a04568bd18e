"""A node's messaging settings: its endpoint, its inbound store, its channels, its limits.

They come from ``qtp.toml`` (``[node] endpoint/store/mode``, ``[channels.NAME]``, ``[limits]``) or are
built in code. Every value is checked here, once, with a message naming the setting and the fix.
"""

from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from qtp.errors import ConfigurationError
from qtp.wsrm.codec import SoapVersion, WsaVersion
from qtp.wsrm.protocol import MAX_MESSAGE_NUMBER, RMVersion
from qtp.wsrm.runtime._security import Security, is_loopback, security_settings

MODES = ("xa", "persistent", "memory")
LANE_MARK = "#"  # a lane's route is NAME#i
MAX_LANES = 64


def channel_name(route: str) -> str:
    """The channel a route belongs to (a lane's route carries ``#i``; ``offer:...`` routes are their own)."""
    return route if route.startswith("offer:") else route.split(LANE_MARK, 1)[0]


PAYLOAD_ROOM = 4096  # bytes of a request left to the envelope around payloads: tx.send's payloads are smaller by it


@dataclass(frozen=True)
class Limits:
    """Limits of one node; every one can be set in ``[limits]``.

    - ``max_request_bytes``: larger HTTP bodies get 413 and are not read.
    - ``max_open_sequences``: inbound sequences at once; a CreateSequence beyond it is refused
      (CreateSequenceRefused).
    - ``max_unacknowledged``: messages of one outbound sequence sent and not yet acknowledged (the window).
    - ``max_backlog``: messages of one channel enqueued and not yet acknowledged; ``tx.send`` beyond it
      raises BacklogFullError (retryable) instead of growing the queue without bound.
    - ``max_invoker_backlog``: messages stored and not yet applied on this node; beyond it new messages are
      refused with a Receiver fault *before* they are stored or acknowledged, so the sender retries later.
    - ``max_attempts``: handler attempts before a message becomes a dead letter.
    - ``retry_backoff`` / ``retry_backoff_max``: seconds between handler attempts (doubling, capped).
    - ``retransmit_interval``: the first retransmission timeout of a sequence, before any round trip was
      measured; after that it is the measured round-trip time plus four deviations (RFC 6298), at least
      ``retransmit_interval_min``; it doubles per retransmission of a message up to ``retransmit_interval_max``.
    - ``max_batch``: messages in one request between qtp nodes (agreed at CreateSequence; other peers get
      one message per request, always in number order).
    - ``http_timeout``: seconds to connect and to read a peer's answer.
    - ``sequence_max_messages``: a new outbound sequence starts after this many messages.
    - ``inactivity_timeout``: an inbound sequence silent this long is ended (seconds).
    - ``ended_retention``: an ended inbound sequence is remembered this long (late messages get
      SequenceTerminated rather than UnknownSequence), then forgotten.
    - ``dedup_retention``: how long the MessageID of an applied message is remembered (``xa`` mode), so
      that a copy sent again in a new sequence is not applied twice; longer than ``inactivity_timeout`` +
      ``ended_retention``, after which a destination forgets a sequence.
    - ``max_dead_letters``: dead letters kept at most per peer (the one that owns the message's sequence);
      at its cap a message of that peer whose handler keeps failing stays queued (retried every
      ``retry_backoff_max``) instead of becoming a dead letter. Other peers' sequences go on.
    - ``invoker_batch``: consecutive messages of one sequence applied in one global transaction (all or
      none; a batch that fails is applied again one message per transaction).
    - ``apply_on_receipt`` (``xa`` mode): a message that is next in its sequence, with nothing of the
      sequence in the invoker's hands, is applied in the same global transaction that stores it, before it
      is acknowledged; otherwise (or when its handler raises there, or took over 0.1 s per message there in
      the last 10 s) it is stored and acknowledged first and applied by the invoker's threads.
    - ``sender_threads`` / ``invoker_threads`` / ``http_threads``: worker threads.
    - Per peer (an authenticated peer, or all anonymous peers together), so that one peer cannot take
      what the others need: ``max_sequences_per_peer`` inbound sequences open at once;
      ``max_backlog_per_peer`` of its messages stored and not yet applied (beyond it: 503 before storing);
      ``max_gap``: a message number more than this far above the highest number received in order is
      refused before it is stored (a sender within its window never comes near it). A reply sequence a peer
      offered counts against ``max_sequences_per_peer`` once it outlives the inbound sequence that accepted
      it, until it ends. ``max_replies_per_peer``: replies sent to one peer on its offered sequences and not
      yet acknowledged; at the cap its new messages get 503 before they are stored, as do those of a
      sequence whose reply window (``max_unacknowledged``) is full, and a CreateSequence with an Offer is
      refused. ``offer_inactivity_timeout``: an offered sequence waiting on its peer (replies
      unacknowledged, or closing) whose peer neither acknowledged, answered nor polled anything of it for
      this long ends; its unacknowledged replies stay in ``qtp_rm_outgoing`` (``qtp status`` shows them as
      QUEUED on route ``offer:<identifier>``), never deleted.
    - ``max_response_bytes``: a peer's answer longer than this is not read (the request counts as failed).
    - ``http_idle_timeout``: seconds an HTTP connection may wait before the first byte of its next request.
    - ``http_request_timeout``: seconds from the first byte of a request to the last byte of its body (head
      and body together); a request not complete by then is dropped with its connection.
    - ``http_handshake_timeout``: seconds a new connection's TLS handshake may take.
    - ``max_connections_per_address``: open HTTP connections (TLS handshakes included) from one client
      address; more are closed as soon as they are accepted.
    - ``max_connections``: open HTTP connections on the node, from all addresses. At the bound a new
      connection closes the one that has waited longest without a request under way (in its TLS handshake
      or between requests); only when every connection is in the middle of a request is the new one closed.
    - ``max_body_memory``: bytes of large request bodies (over 64 KiB) read or being handled at once; a
      request beyond it waits, unread, until earlier ones are done. At least ``max_request_bytes``.
    - ``max_elements``: XML elements in one envelope (each parsed element costs about 130 bytes); a larger
      envelope is refused while it is parsed, and the envelopes parsed at once hold at most twice this many.
    - ``max_clock_skew``: seconds a signed request's timestamp may be off this node's clock; the node
      remembers each signature it took for that long to refuse its replay (82 bytes per signed request:
      5 MB at 1,000 requests/s with the default 60 s), so a wider window costs memory.
    - Coupled messaging (``qtp.coupled``): ``max_coupled_deadline``: seconds; a coupled send may not ask for
      more (``within=``), and a recipient treats an original's deadline as at most this far from its
      arrival; ``max_prepared_per_peer``: a shared recipient holds at most this many subordinate
      transactions (prepared or being prepared) for one peer (or for all anonymous peers together), and
      refuses further originals of that peer until some are decided; ``coupled_lock_timeout``: seconds a
      shared recipient's handler may wait for a row lock before its attempt fails (and is tried again).
    - ``poll_interval_min`` / ``poll_interval_max``: a node without an endpoint polls its reply channels'
      peers with WS-MakeConnection at once while they say more is waiting, ``poll_interval_min`` after a
      message, and backs off (doubling) to ``poll_interval_max`` while idle: the idle reply latency.
    """

    max_request_bytes: int = 4 * 1024 * 1024
    max_open_sequences: int = 1000
    max_unacknowledged: int = 1024
    max_backlog: int = 1_000_000
    max_invoker_backlog: int = 100_000
    max_attempts: int = 5
    retry_backoff: float = 0.5
    retry_backoff_max: float = 60.0
    retransmit_interval: float = 1.0
    retransmit_interval_min: float = 0.2
    retransmit_interval_max: float = 30.0
    max_batch: int = 256
    http_timeout: float = 10.0
    sequence_max_messages: int = MAX_MESSAGE_NUMBER
    inactivity_timeout: float = 24 * 3600.0
    ended_retention: float = 3600.0
    invoker_batch: int = 128
    dedup_retention: float = 7 * 24 * 3600.0
    max_dead_letters: int = 10_000
    sender_threads: int = 8
    invoker_threads: int = 4
    http_threads: int = 16
    max_sequences_per_peer: int = 100
    max_backlog_per_peer: int = 20_000
    max_gap: int = 4096
    max_replies_per_peer: int = 10_000
    offer_inactivity_timeout: float = 24 * 3600.0
    max_response_bytes: int = 4 * 1024 * 1024
    http_idle_timeout: float = 30.0
    http_request_timeout: float = 30.0
    http_handshake_timeout: float = 10.0
    max_connections_per_address: int = 64
    max_connections: int = 1000
    max_body_memory: int = 8 * 1024 * 1024
    max_elements: int = 100_000
    max_clock_skew: float = 60.0
    poll_interval_min: float = 0.05
    poll_interval_max: float = 1.0
    max_coupled_deadline: float = 300.0
    max_prepared_per_peer: int = 16
    coupled_lock_timeout: float = 5.0
    apply_on_receipt: bool = True

    def backoff(self, attempts: int) -> float:
        """Seconds before attempt ``attempts + 1`` of something that failed ``attempts`` times: doubling from
        ``retry_backoff``, capped at ``retry_backoff_max``."""
        return min(self.retry_backoff * 2 ** max(0, attempts - 1), self.retry_backoff_max)


@dataclass(frozen=True)
class ChannelSettings:
    """One outbound channel: where its messages go and how."""

    name: str
    peer: str
    store: str | None = None       # resource name; None: the node's store
    mode: str = "xa"
    wsrm: RMVersion = RMVersion.WSRM11
    soap: SoapVersion = SoapVersion.SOAP12
    wsa: WsaVersion = WsaVersion.WSA200508
    reply: bool = False
    acks_to: str = "anonymous"     # anonymous: on the HTTP response; endpoint: to our endpoint; poll: fetched (WS-MC)
    batch: bool = True             # offer qtp's batching extension (several messages per request)
    lanes: int = 1                 # sequences in parallel; tx.send(key=...) keeps one key's messages in one

    def routes(self) -> list[str]:
        """The routes of the channel's lanes: lane 0 is the channel's name, lane i > 0 is ``NAME#i``."""
        return [self.name] + [f"{self.name}{LANE_MARK}{i}" for i in range(1, self.lanes)]

    def route_for(self, key: str | None) -> str:
        """The lane of a message: lane 0 without a key, else one chosen by the key's CRC-32."""
        if key is None or self.lanes == 1:
            return self.name
        return self.routes()[zlib.crc32(key.encode("utf-8")) % self.lanes]


@dataclass(frozen=True)
class NodeSettings:
    endpoint: str | None = None    # the URL peers use; None: this node only sends one-way messages
    listen: tuple[str, int] | None = None
    store: str | None = None       # resource of the inbound store; None with mode memory
    mode: str = "xa"
    channels: dict[str, ChannelSettings] = field(default_factory=dict)
    limits: Limits = field(default_factory=Limits)
    security: Security = field(default_factory=Security)
    coupled: dict[str, Any] = field(default_factory=dict)  # [coupled]: Coupled(node)'s defaults (qtp.coupled)
    # a slot of a node whose replicas share the work (qtp.wsrm.runtime._shared): its number and the node's id
    # (the slot's transaction manager has an id of its own, <node>.s<k>); None: a whole node
    slot: int | None = None
    node_name: str | None = None

    def listen_host(self) -> str | None:
        if self.listen is not None:
            return self.listen[0]
        return None if self.endpoint is None else (urlsplit(self.endpoint).hostname or "127.0.0.1")


def _check_url(what: str, url: Any) -> str:
    if not isinstance(url, str):
        raise ConfigurationError(f"{what} must be an http:// or https:// URL, got {url!r}")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigurationError(f"{what} must be an http:// or https:// URL with a host, got {url!r}")
    return url


def _check_mode(what: str, mode: Any) -> str:
    if mode not in MODES:
        raise ConfigurationError(f"{what} must be one of {', '.join(MODES)}, got {mode!r}")
    return str(mode)


def _enum(what: str, kind: type, value: Any) -> Any:
    try:
        return kind(str(value))
    except ValueError:
        allowed = ", ".join(repr(v.value) for v in kind)
        raise ConfigurationError(f"{what} must be one of {allowed}, got {value!r}") from None


def channel_settings(name: str, table: dict[str, Any], node_store: str | None) -> ChannelSettings:
    where = f"[channels.{name}]"
    known = {"peer", "store", "mode", "wsrm", "soap", "addressing", "reply", "acks_to", "batch", "lanes"}
    if not isinstance(table, dict) or set(table) - known:
        raise ConfigurationError(f"{where} takes {', '.join(sorted(known))}; got {sorted(table)}")
    if "peer" not in table:
        raise ConfigurationError(f"{where} needs peer = \"http://host:port/path\" (the other node's endpoint)")
    wsrm = _enum(f"{where} wsrm", RMVersion, table.get("wsrm", "1.1"))
    default_wsa = "2005/08" if wsrm is RMVersion.WSRM11 else "2004/08"
    wsa = _enum(f"{where} addressing", WsaVersion, table.get("addressing", default_wsa))
    if wsrm is RMVersion.WSRM11 and wsa is not WsaVersion.WSA200508:
        raise ConfigurationError(f"{where}: WS-RM 1.1 is used with WS-Addressing 2005/08 only")
    mode = _check_mode(f"{where} mode", table.get("mode", "xa"))
    store = table.get("store", node_store)
    if store is None and mode != "memory":
        raise ConfigurationError(f"{where} needs store = \"RESOURCE\" (or [node] store) for mode {mode!r}")
    reply, batch = table.get("reply", False), table.get("batch", True)
    if not isinstance(reply, bool) or not isinstance(batch, bool):
        raise ConfigurationError(f"{where} reply and batch must be true or false")
    lanes = table.get("lanes", 1)
    if isinstance(lanes, bool) or not isinstance(lanes, int) or not 1 <= lanes <= MAX_LANES:
        raise ConfigurationError(f"{where} lanes must be a whole number from 1 to {MAX_LANES}, got {lanes!r}")
    acks_to = table.get("acks_to", "anonymous")
    if acks_to not in ("anonymous", "endpoint", "poll"):
        raise ConfigurationError(f"{where} acks_to must be \"anonymous\" (on the HTTP response), \"poll\" (fetched "
                                 "with WS-MakeConnection, for a node without an endpoint) or \"endpoint\" "
                                 "(sent to this node's endpoint)")
    return ChannelSettings(name=name, peer=_check_url(f"{where} peer", table["peer"]), store=store, mode=mode,
                           wsrm=wsrm, soap=_enum(f"{where} soap", SoapVersion, table.get("soap", "1.2")),
                           wsa=wsa, reply=reply, acks_to=acks_to, batch=batch, lanes=lanes)


def _check_name(name: str) -> str:
    if LANE_MARK in name or name.startswith("offer:"):
        raise ConfigurationError(f"[channels.{name}]: a channel's name cannot contain {LANE_MARK!r} or start "
                                 "with 'offer:'")
    return name


def limits(table: dict[str, Any]) -> Limits:
    names = {f.name: f.type for f in dataclasses.fields(Limits)}
    unknown = set(table) - set(names)
    if unknown:
        raise ConfigurationError(f"[limits]: unknown {sorted(unknown)}; known: {', '.join(sorted(names))}")
    values: dict[str, Any] = {}
    for key, value in table.items():
        if names[key] in ("bool", bool):
            if not isinstance(value, bool):
                raise ConfigurationError(f"[limits] {key} must be true or false, got {value!r}")
            values[key] = value
            continue
        kind = int if names[key] in ("int", int) else float
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ConfigurationError(f"[limits] {key} must be a positive number, got {value!r}")
        values[key] = kind(value)
    return Limits(**values)


def node_settings(messaging: dict[str, Any], resources: set[str]) -> NodeSettings:
    """Settings from the ``messaging`` part of a loaded configuration (``qtp.config.Config.messaging``)."""
    node = messaging.get("node", {})
    endpoint = node.get("endpoint")
    if endpoint is not None:
        _check_url("[node] endpoint", endpoint)
    listen = None
    if node.get("listen") is not None:
        host, _, port = str(node["listen"]).rpartition(":")
        if not host or not port.isdigit():
            raise ConfigurationError(f"[node] listen must be HOST:PORT, got {node['listen']!r}")
        listen = (host, int(port))
    store = node.get("store")
    mode = _check_mode("[node] mode", node.get("mode", "xa"))
    channels = {_check_name(name): channel_settings(name, table, store)
                for name, table in messaging.get("channels", {}).items()}
    for name in [store, *(c.store for c in channels.values())]:
        if name is not None and name not in resources:
            raise ConfigurationError(f"store resource {name!r} is not defined; add a [resources.{name}] table")
    security = security_settings(node, messaging.get("peers", {}), _check_url)
    settings = NodeSettings(endpoint=endpoint, listen=listen, store=store, mode=mode, channels=channels,
                            limits=limits(messaging.get("limits", {})), security=security,
                            coupled=coupled_settings(messaging.get("coupled", {}), channels))
    check(settings)
    return settings


def coupled_settings(table: Any, channels: dict[str, ChannelSettings]) -> dict[str, Any]:
    """``[coupled]``: ``workers`` (threads for coupled handlers), ``sweep_interval`` (seconds), ``replies``
    (a table: sender node id -> the channel this node answers it on); what ``Coupled(node)`` takes when
    its arguments do not say otherwise."""
    if not isinstance(table, dict) or set(table) - {"workers", "sweep_interval", "replies"}:
        raise ConfigurationError("[coupled] takes workers = N, sweep_interval = SECONDS and replies = "
                                 "{ SENDER_NODE_ID = \"CHANNEL\" }")
    workers = table.get("workers", 4)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigurationError(f"[coupled] workers must be a positive number of threads, got {workers!r}")
    interval = table.get("sweep_interval", 1.0)
    if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not interval > 0:
        raise ConfigurationError(f"[coupled] sweep_interval must be a positive number of seconds, got {interval!r}")
    replies = table.get("replies", {})
    if not isinstance(replies, dict) or not all(isinstance(v, str) for v in replies.values()):
        raise ConfigurationError("[coupled] replies is a table of sender node id = \"CHANNEL\"")
    unknown = sorted(v for v in replies.values() if v not in channels)
    if unknown:
        raise ConfigurationError(f"[coupled] replies names unknown channel(s) {unknown}; known: {sorted(channels)}")
    return {"workers": workers, "sweep_interval": float(interval), "replies": dict(replies)}


def check(settings: NodeSettings) -> None:
    """Cross-setting rules, for settings built in code as well as from a file."""
    limits = settings.limits
    if limits.dedup_retention <= limits.inactivity_timeout + limits.ended_retention:
        raise ConfigurationError(
            f"[limits] dedup_retention ({limits.dedup_retention:g} s) must be longer than inactivity_timeout + "
            f"ended_retention ({limits.inactivity_timeout + limits.ended_retention:g} s): a destination forgets "
            "a sequence after those, and a message its sender sends again must still be recognised")
    receives = settings.endpoint is not None or any(c.reply for c in settings.channels.values())
    if settings.store is None and settings.mode != "memory" and receives:
        raise ConfigurationError("[node] store = \"RESOURCE\" is needed to receive messages in mode "
                                 f"{settings.mode!r} (or set [node] mode = \"memory\")")
    security = settings.security
    if settings.endpoint is not None and settings.endpoint.startswith("https:") and not security.tls_cert:
        raise ConfigurationError(f"[node] endpoint {settings.endpoint} is https: give [node] tls_cert and tls_key "
                                 "(the server's certificate and private key, PEM files)")
    if security.tls_cert and settings.endpoint is not None and settings.endpoint.startswith("http:"):
        raise ConfigurationError("[node] tls_cert is set but the endpoint is http://; make it https://")
    if security.tls_client_ca and not security.tls_cert:
        raise ConfigurationError("[node] tls_client_ca asks peers for client certificates, which needs TLS: give "
                                 "tls_cert and tls_key")
    for channel in settings.channels.values():
        if channel.acks_to == "poll" and (settings.endpoint is not None or channel.wsrm is not RMVersion.WSRM11):
            raise ConfigurationError(f"[channels.{channel.name}] acks_to = \"poll\" is for a node without [node] "
                                     "endpoint, with wsrm = \"1.1\": its acknowledgements are then fetched with "
                                     "WS-MakeConnection")
        if channel.acks_to == "endpoint" and settings.endpoint is None:
            raise ConfigurationError(f"[channels.{channel.name}] acks_to = \"endpoint\" needs [node] endpoint: "
                                     "acknowledgements come back to it")
        if channel.peer.startswith("http://docs.oasis-open.org/ws-rx/wsmc/"):
            raise ConfigurationError(f"[channels.{channel.name}] peer is a WS-MakeConnection anonymous address: "
                                     "a channel needs the peer's real endpoint (http(s)://host:port/path)")
        if channel.reply and settings.endpoint is None and channel.wsrm is not RMVersion.WSRM11:
            raise ConfigurationError(f"[channels.{channel.name}] reply = true without [node] endpoint needs "
                                     "wsrm = \"1.1\": the replies are fetched with WS-MakeConnection, which "
                                     "offers the reply sequence at an address only WS-RM 1.1 can name")
    if limits.max_body_memory < limits.max_request_bytes:
        raise ConfigurationError(f"[limits] max_body_memory ({limits.max_body_memory}) must be at least "
                                 f"max_request_bytes ({limits.max_request_bytes}): a request that large could "
                                 "never be read")
    if not 0 < limits.poll_interval_min <= limits.poll_interval_max:
        raise ConfigurationError("[limits] poll_interval_min must be above 0 and at most poll_interval_max")
