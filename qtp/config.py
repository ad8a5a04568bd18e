"""``qtp.toml``: the node, its decision log, its resources.

::

    [node]
    id = "orders-1"              # 1-31 characters: A-Z a-z 0-9 _ . -
    log_dir = "recovery_logs"    # root of decision logs; this node's log is <log_dir>/<id>/
    timeout = 60                 # seconds a transaction may run before it is prepared

    llr = true                   # Logging Last Resource: the decision in the last SQL branch's commit

    [resources.app]
    url = "postgresql://app@db1/app"
    last_resource = true         # optional: prefer this database as the last resource

    [resources.queue]
    url = "mysql+pymysql://qtp@db2/queue"

    [lease]                      # optional: the node runs as several processes (replicas), one owner at a time
    resource = "app"             # the SQL resource holding the lease (default: [node] store, else the only one)
    ttl = 10                     # seconds; a standby takes over this long after the owner stopped renewing
    standby = "wait"             # a second process waits as a standby, or "refuse"s to start
    slots = 1                    # > 1: the replicas share the node's work, each holding some of its slots
    address = "http://10.0.0.5:8080/rm"  # with slots: where the other replicas reach this one (default: listen)

    [recovery]                   # optional
    interval = 60                # seconds between background recovery passes (0: only at start)
    warn_prepared_age = 300      # `qtp status` warns about branches prepared longer ago than this

Messaging (optional; see ``qtp.wsrm.runtime`` and docs/messaging.md)::

    [node]
    endpoint = "http://127.0.0.1:8001/rm"   # where peers reach this node; `qtp serve` listens there
    store = "app"                # resource holding the inbound (RM Destination) store
    mode = "xa"                  # xa | persistent | memory, for the inbound side

    [channels.orders]
    peer = "http://127.0.0.1:8002/rm"
    store = "app"                # resource holding this channel's outbound store (default: [node] store)
    mode = "xa"
    wsrm = "1.1"                 # 1.1 | 1.0
    soap = "1.2"                 # 1.2 | 1.1
    reply = true                 # request-reply: offer a sequence for replies (needs [node] endpoint)

    [limits]                     # see ``qtp.wsrm.runtime.Limits`` for every limit and its default

    [peers.billing-1]            # a peer, by its [node] id (see qtp.wsrm.runtime._security, docs/security.md)
    endpoint = "https://billing-1:8443/rm"
    secret_env = "QTP_SECRET_BILLING"   # or secret = "...", or fingerprint = "sha256:..." (TLS client cert)

``[node]`` also takes ``allow_anonymous``, ``tls_cert``, ``tls_key``, ``tls_ca``, ``tls_client_ca``,
``metrics_token`` and ``anonymous_addresses``; relative certificate paths are taken from the file's folder.

Relative ``log_dir`` paths are taken from the folder holding the file.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path

from qtp.errors import ConfigurationError

_MESSAGING_NODE_KEYS = ("endpoint", "listen", "store", "mode", "allow_anonymous", "tls_cert", "tls_key",
                        "tls_client_ca", "tls_ca", "metrics_token", "anonymous_addresses")


MAX_SLOTS = 64


@dataclass(frozen=True)
class LeaseSettings:
    """``[lease]``: where the lease lives, how long it lasts, what a second process does."""

    resource: str | None = None  # the SQL resource holding the lease (None: the node's store, else the only one)
    ttl: float = 10.0            # seconds a lease lasts without renewal: a standby takes over this long after
    renew: float | None = None   # seconds between renewals (default ttl / 5)
    standby: str = "wait"        # wait (as a standby) | refuse (raise LeaseHeldError)
    slots: int = 1               # > 1: the node's work in this many slots, shared by its live processes
    address: str | None = None   # with slots: this process's own URL for the others (default: from listen)

    def __post_init__(self) -> None:
        if not 0.5 <= self.ttl <= 3600:
            raise ConfigurationError(f"[lease] ttl must be between 0.5 and 3600 seconds, got {self.ttl!r}")
        if self.renew is not None and not 0 < self.renew <= self.ttl / 2:
            raise ConfigurationError(f"[lease] renew must be positive and at most half of ttl ({self.ttl / 2:g} s), "
                                     f"got {self.renew!r}")
        if self.standby not in ("wait", "refuse"):
            raise ConfigurationError(f"[lease] standby must be \"wait\" or \"refuse\", got {self.standby!r}")
        if isinstance(self.slots, bool) or not isinstance(self.slots, int) or not 1 <= self.slots <= MAX_SLOTS:
            raise ConfigurationError(f"[lease] slots must be a whole number from 1 to {MAX_SLOTS}, got {self.slots!r}")
        if self.address is not None and (not isinstance(self.address, str) or
                                         not self.address.startswith("http://")):
            raise ConfigurationError(f"[lease] address must be an http:// URL (replicas forward to each other over "
                                     f"plain HTTP), got {self.address!r}")

    @property
    def renew_every(self) -> float:
        return self.renew if self.renew is not None else self.ttl / 5


@dataclass
class Config:
    node_id: str
    log_dir: Path
    timeout: float = 60.0
    resources: dict[str, str] = field(default_factory=dict)
    path: Path | None = None
    recovery_interval: float | None = 60.0
    warn_prepared_age: float = 300.0
    messaging: dict = field(default_factory=dict)  # [node] endpoint/store/mode, [channels.*], [limits]
    llr: bool = True
    last_resources: set[str] = field(default_factory=set)
    lease: LeaseSettings | None = None  # [lease]: one owner among the node's processes (qtp.coordinator._lease)
    slot: int | None = None  # one slot of a node whose replicas share the work (slot_configs)


def slot_configs(config: Config) -> list[Config]:
    """The node of ``config`` as the commands see it: itself, or with ``[lease] slots`` above 1 each of its slots
    (``<node>.s<k>``: its own decision log folder, lease and fence, store tables ``qtp_rm_s<k>_*``)."""
    if config.lease is None or config.lease.slots < 2:
        return [config]
    return [replace(config, node_id=f"{config.node_id}.s{k}", slot=k, lease=replace(config.lease, slots=1))
            for k in range(config.lease.slots)]


def load_config(path: str | Path) -> Config:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigurationError(f"configuration file {path} not found; pass --config PATH") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigurationError(f"configuration file {path} cannot be read: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigurationError(f"{path} is not valid TOML: {exc}") from exc
    node = data.get("node")
    if not isinstance(node, dict) or "id" not in node:
        raise ConfigurationError(f"{path}: missing [node] table with an id (e.g. id = \"orders-1\")")
    log_dir = Path(node.get("log_dir", "recovery_logs"))
    if not log_dir.is_absolute():
        log_dir = path.parent / log_dir
    resources, last_resources = {}, set()
    for name, table in (data.get("resources") or {}).items():
        if not isinstance(table, dict) or not isinstance(table.get("url"), str):
            raise ConfigurationError(f"{path}: [resources.{name}] needs a url = \"...\" entry")
        if set(table) - {"url", "last_resource"} or not isinstance(table.get("last_resource", False), bool):
            raise ConfigurationError(f"{path}: [resources.{name}] takes url = \"...\" and last_resource = "
                                     "true|false")
        resources[name] = table["url"]
        if table.get("last_resource"):
            last_resources.add(name)
    if not isinstance(node.get("llr", True), bool):
        raise ConfigurationError(f"{path}: [node] llr must be true or false")
    unknown = set(data) - {"node", "resources", "channels", "recovery", "limits", "peers", "coupled", "lease"}
    if unknown:
        raise ConfigurationError(f"{path}: unknown table(s) {sorted(unknown)}; expected [node] and [resources.NAME]")
    try:
        timeout = float(node.get("timeout", 60.0))
    except (TypeError, ValueError):
        raise ConfigurationError(f"{path}: [node] timeout must be a number of seconds") from None
    interval, warn_age = _recovery_settings(path, data.get("recovery", {}))
    messaging = {"node": {k: v for k, v in node.items() if k in _MESSAGING_NODE_KEYS},
                 "channels": data.get("channels") or {}, "limits": data.get("limits") or {},
                 "peers": data.get("peers") or {}, "coupled": data.get("coupled") or {}}
    for key in ("tls_cert", "tls_key", "tls_client_ca", "tls_ca"):  # relative to the file, like log_dir
        if isinstance(messaging["node"].get(key), str) and not Path(messaging["node"][key]).is_absolute():
            messaging["node"][key] = str(path.parent / messaging["node"][key])
    lease = _lease_settings(path, data, resources)
    return Config(node_id=str(node["id"]), log_dir=log_dir, timeout=timeout, resources=resources, path=path,
                  recovery_interval=interval, warn_prepared_age=warn_age, messaging=messaging,
                  llr=node.get("llr", True), last_resources=last_resources, lease=lease)


def _lease_settings(path: Path, data: dict, resources: dict[str, str]) -> LeaseSettings | None:
    """``[lease] resource, ttl, renew, standby`` (docs/operations.md, "Running a node as replicas")."""
    table = data.get("lease")
    if table is None:
        return None
    if not isinstance(table, dict) or set(table) - {"resource", "ttl", "renew", "standby", "slots", "address"}:
        raise ConfigurationError(f"{path}: [lease] takes resource = \"NAME\", ttl = SECONDS, renew = SECONDS, "
                                 "standby = \"wait\" | \"refuse\", slots = N and address = \"URL\"")
    if data.get("coupled"):
        raise ConfigurationError(f"{path}: [lease] with [coupled] is not supported: a coupled node runs as one process")
    memory = [f"[channels.{name}]" for name, c in (data.get("channels") or {}).items()
              if isinstance(c, dict) and c.get("mode") == "memory"]
    if (data.get("node") or {}).get("mode") == "memory":
        memory.insert(0, "[node]")
    if memory:
        raise ConfigurationError(f"{path}: [lease] with mode = \"memory\" ({', '.join(memory)}): a standby cannot take "
                                 "over what is in a process's memory; use xa"
                                 + (" (slots need it)" if table.get("slots", 1) != 1 else " or persistent"))
    resource = table.get("resource", (data.get("node") or {}).get("store"))
    if resource is not None and resource not in resources:
        raise ConfigurationError(f"{path}: [lease] resource {resource!r} is not one of [resources.*] "
                                 f"({', '.join(sorted(resources)) or 'none'})")
    try:
        ttl = float(table.get("ttl", 10.0))
        renew = None if table.get("renew") is None else float(table["renew"])
    except (TypeError, ValueError):
        raise ConfigurationError(f"{path}: [lease] ttl and renew must be numbers of seconds") from None
    try:
        settings = LeaseSettings(resource, ttl, renew, str(table.get("standby", "wait")), table.get("slots", 1),
                                 table.get("address"))
    except ConfigurationError as exc:
        raise ConfigurationError(f"{path}: {exc}") from None
    if settings.slots > 1:
        _check_sharing(path, data)
    return settings


def _check_sharing(path: Path, data: dict) -> None:
    """What replicas that share the work ([lease] slots > 1) cannot do yet, refused when the file is read."""
    node, slots = data.get("node") or {}, data["lease"].get("slots")
    longest = f"{node.get('id', '')}.s{slots - 1}"
    if len(longest) > 31:
        raise ConfigurationError(f"{path}: with [lease] slots = {slots} the node id is too long: its slots' ids, such "
                                 f"as {longest!r}, must fit in 31 characters")
    if not node.get("endpoint"):
        raise ConfigurationError(f"{path}: [lease] slots > 1 needs [node] endpoint: the replicas share the requests "
                                 "that reach the node's one address (a node without an endpoint runs as one process, "
                                 "with standbys: slots = 1)")
    if node.get("tls_cert"):
        raise ConfigurationError(f"{path}: [lease] slots > 1 is not supported yet with TLS: a replica forwards a "
                                 "request to the replica holding its slot over plain HTTP, and a client certificate "
                                 "does not travel with it (docs/operations.md, \"Replicas that share the work\"); "
                                 "use slots = 1 (a standby), or TLS ended at the balancer")
    if node.get("mode", "xa") != "xa" or any(isinstance(c, dict) and c.get("mode", "xa") != "xa"
                                              for c in (data.get("channels") or {}).values()):
        raise ConfigurationError(f"{path}: [lease] slots > 1 needs mode = \"xa\" everywhere")


def _recovery_settings(path: Path, table: object) -> tuple[float | None, float]:
    """``[recovery] interval, warn_prepared_age`` (seconds); interval 0 turns the background passes off."""
    if not isinstance(table, dict) or set(table) - {"interval", "warn_prepared_age"}:
        raise ConfigurationError(f"{path}: [recovery] takes interval = SECONDS and warn_prepared_age = SECONDS")
    try:
        interval = float(table.get("interval", 60.0))
        warn_age = float(table.get("warn_prepared_age", 300.0))
    except (TypeError, ValueError):
        raise ConfigurationError(f"{path}: [recovery] interval and warn_prepared_age must be numbers of seconds") \
            from None
    if interval < 0 or warn_age < 0:
        raise ConfigurationError(f"{path}: [recovery] interval and warn_prepared_age must not be negative")
    return (interval or None), warn_age
