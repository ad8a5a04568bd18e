"""Two qtp nodes as separate OS processes (``qtp serve --app qtp.testing.e2e_app:node``), their configs, and
the exactly-once check of their tables. Used by the two-node tests and by benchmarks/e2e_campaign.py.

A node may also run as several replicas (``Replicas``): processes with the same config but for their log
folder and listening port, as on hosts of their own, sharing the node's identity through the ``[lease]`` in
its store. One owns the node and serves; the others wait inside ``Node.from_config`` as standbys, listening
on nothing, until the owner's lease runs out. Peers reach the node through a proxy in front of all its
replicas (``qtp.testing.lossy_proxy`` with several targets fails over to the one that answers). With
``Replicas.slots`` > 1 the server's replicas share its work instead (``[lease] slots``): each holds some of
the node's slots and serves from its start, and the proxy in front of them sends each request to the next
replica in turn (``Replicas.balance``)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import tomllib
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlsplit

import requests
import sqlalchemy as sa
from sqlalchemy import text

from qtp.embedded import free_port
from qtp.wsrm.codec import Addressing, Envelope, SoapVersion, WsaVersion, anonymous, default_action, encode
from qtp.wsrm.protocol import RMVersion
from qtp.wsrm.runtime._security import HEADER, answer_boot, sign_request
from qtp.wsrm.runtime._transport import content_type



def create(url: str, ddl: str) -> None:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with engine.begin() as conn:
        conn.execute(text(ddl))
    engine.dispose()


def client_schema(url: str) -> None:
    """``orders``: one row per order, status committed (its transaction sent it) or aborted (rolled back on
    purpose, recorded afterwards); ``replies``: one row per reply or fault applied (kind reply / fault). Each
    row also says which process inserted it (``pid``: replicas) and when, by the database's clock at the
    INSERT (``written_at``, see ``written_after``)."""
    stamp = "timestamp DEFAULT clock_timestamp()" if url.startswith("postgresql") else \
        "datetime(6) DEFAULT CURRENT_TIMESTAMP(6)"
    create(url, "CREATE TABLE orders (k int PRIMARY KEY, status varchar(16) NOT NULL DEFAULT 'committed', "
                f"pid int, written_at {stamp})")
    create(url, f"CREATE TABLE replies (k int NOT NULL, kind varchar(8) NOT NULL, pid int, written_at {stamp})")


def clock_mark(url: str) -> Any:
    """The client database's clock now, as ``written_at`` stamps rows: a row stamped later was inserted later."""
    return rows(url, "SELECT clock_timestamp()::timestamp" if url.startswith("postgresql") else "SELECT NOW(6)")[0][0]


def written_after(url: str, pid: int, mark: Any) -> int:
    """Rows of the client's ``orders`` and ``replies`` that process ``pid`` inserted after ``mark``."""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return sum(conn.execute(text(f"SELECT COUNT(*) FROM {table} WHERE pid = :p AND written_at > :m"),
                                    {"p": pid, "m": mark}).scalar() for table in ("orders", "replies"))
    finally:
        engine.dispose()


def server_schema(url: str) -> None:
    """``applied``: one row per order applied (no unique key: a duplicate apply shows as two rows), ``id``
    in the order the rows were inserted, ``pid`` the process that inserted it (replicas: which one wrote)."""
    auto = "SERIAL" if url.startswith("postgresql") else "int AUTO_INCREMENT"
    create(url, f"CREATE TABLE applied (id {auto} PRIMARY KEY, k int NOT NULL, seq varchar(255), num bigint, "
                "lat_ms double precision, pid int)")


def applied_id_mark(url: str) -> int:
    """The highest ``applied.id`` handed out so far, committed or not (the sequence's or the AUTO_INCREMENT
    counter's position, not MAX(id)): a row inserted after this call gets a higher id."""
    if url.startswith("postgresql"):
        query = "SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END FROM applied_id_seq"
    else:
        query = ("SELECT AUTO_INCREMENT - 1 FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE() "
                 "AND TABLE_NAME = 'applied'")
    return int(rows(url, query)[0][0] or 0)


def rows(url: str, query: str) -> list[tuple]:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(text(query))]
    finally:
        engine.dispose()


@dataclass
class Pair:
    """The configuration of a client node and a server node."""

    client_app: str
    server_app: str
    client_store: str | None = None   # URL of the client's store database (None: its app database)
    server_store: str | None = None
    wsrm: str = "1.1"
    soap: str = "1.2"
    reply: bool = False
    acks_to: str = "anonymous"
    mode: str = "xa"
    node_modes: tuple[str, str] | None = None  # the client's and the server's [node] mode (receiving); None: ``mode``
    limits: str = ""
    server_port: int = 0
    client_port: int = 0
    proxy_port: int | None = None     # the client talks to this port (a lossy proxy) instead of the server
    back_proxy_port: int | None = None  # the server reaches the client through this port (replies, acks)
    secret: str | None = None         # both nodes authenticate each other with it and take nothing anonymous
    server_extra: str = ""            # more TOML for the server ([peers.*] of other clients, ...)
    client_extra: str = ""
    client_listens: bool = True       # False: the client has no endpoint, binds no port, polls (WS-MakeConnection)

    def __post_init__(self) -> None:
        self.server_port = self.server_port or free_port()
        self.client_port = self.client_port or free_port()

    def write(self, folder: Path) -> tuple[Path, Path]:
        client, server = self.texts(folder)
        (folder / "client.toml").write_text(client)
        (folder / "server.toml").write_text(server)
        return folder / "client.toml", folder / "server.toml"

    def texts(self, folder: Path, server_advertised: int | None = None) -> tuple[str, str]:
        """The client's and the server's qtp.toml; the server's endpoint on port ``server_advertised`` (a
        proxy in front of it) when given, else on the port it listens on."""
        peer = self.proxy_port or self.server_port
        client_mode, server_mode = self.node_modes or (self.mode, self.mode)
        client = _toml("client", self.client_app, self.client_store, self.client_port, client_mode, self.limits,
                       folder, f'''
[channels.orders]
peer = "http://127.0.0.1:{peer}/rm"
store = "{'store' if self.client_store else 'app'}"
mode = "{self.mode}"
wsrm = "{self.wsrm}"
soap = "{self.soap}"
reply = {str(self.reply).lower()}
acks_to = "{self.acks_to}"
{self.client_extra}''', advertised=self.back_proxy_port, listens=self.client_listens)
        server = _toml("server", self.server_app, self.server_store, self.server_port, server_mode, self.limits,
                       folder, self.server_extra, advertised=server_advertised)
        if self.secret is not None:
            client += _peer(node_id("server", folder), f"http://127.0.0.1:{peer}/rm", self.secret)
            server += _peer(node_id("client", folder),
                            f"http://127.0.0.1:{self.back_proxy_port or self.client_port}/rm"
                            if self.client_listens else None, self.secret)
            client = client.replace("\n[node]\n", "\n[node]\nallow_anonymous = false\n", 1)
            server = server.replace("\n[node]\n", "\n[node]\nallow_anonymous = false\n", 1)
        return client, server


def node_id(role: str, folder: Path) -> str:
    return f"{role}-{folder.name[-20:].replace('_', '-')}"


def _peer(name: str, endpoint: str | None, secret: str) -> str:
    address = f'endpoint = "{endpoint}"\n' if endpoint else ""
    return f'\n[peers.{name}]\n{address}secret = "{secret}"\n'


def _toml(role: str, app: str, store: str | None, port: int, mode: str, limits: str, folder: Path,
          channels: str, advertised: int | None = None, listens: bool = True) -> str:
    store_resource = f'\n[resources.store]\nurl = "{store}"\n' if store else ""
    address = f'endpoint = "http://127.0.0.1:{advertised or port}/rm"\nlisten = "127.0.0.1:{port}"\n' if listens else ""
    return f'''
[node]
id = "{node_id(role, folder)}"
log_dir = "{folder / 'logs'}"
{address}store = "{'store' if store else 'app'}"
mode = "{mode}"

[resources.app]
url = "{app}"
{store_resource}
[recovery]
interval = 2

[limits]
retransmit_interval = 0.3
retransmit_interval_max = 2.0
retry_backoff = 0.1
retry_backoff_max = 1.0
http_timeout = 5
{limits}
{channels}'''


@dataclass
class Replicas:
    """The pair's server as ``servers`` replicas and its client as ``clients`` replicas, named ``server-a``,
    ``server-b``, ..., ``client-a``, ...: the node's config but for ``[node] log_dir`` and ``listen`` (each
    replica its own), with a ``[lease]`` of ``ttl`` seconds, and the node's endpoint the proxy in front of its
    replicas: ``pair.proxy_port`` for the server (the client's channel peer already), ``pair.back_proxy_port``
    for the client. The proxies are the caller's: one LossyProxy per side with that side's ``urls`` as
    targets and ``balance(role)`` as its balance. A node of one replica keeps the config ``Pair.write``
    writes (named ``server`` or ``client``, no lease).

    ``slots`` > 1: the server's replicas share its work, ``[lease] slots = slots`` in each one's config (with
    the ttl; no standby setting, which slots make irrelevant); every replica serves, so the proxy in front of
    them balances round-robin. A server of one replica then gets that ``[lease]`` too (one process holding
    every slot). The client's replicas stay owner and standbys."""

    pair: Pair
    servers: int = 2
    clients: int = 2
    ttl: float = 10.0
    standby: str = "wait"
    ports: dict[str, int] = field(default_factory=dict)  # replica name -> the port it listens on
    slots: int = 1                                        # the server's [lease] slots (1: no slots)

    def __post_init__(self) -> None:
        if self.servers > 1 and self.pair.proxy_port is None or \
                self.clients > 1 and self.pair.client_listens and self.pair.back_proxy_port is None:
            raise ValueError("replicas are reached through a proxy: give the pair proxy_port (server replicas) "
                             "and back_proxy_port (client replicas)")
        for role, first in (("server", self.pair.server_port), ("client", self.pair.client_port)):
            for i, name in enumerate(self.names(role)):
                self.ports.setdefault(name, first if i == 0 else free_port())

    def names(self, role: str) -> list[str]:
        """The names of the replicas of node ``role`` (``server`` or ``client``)."""
        count = self.servers if role == "server" else self.clients
        return [role] if count == 1 else [f"{role}-{chr(ord('a') + i)}" for i in range(count)]

    def urls(self, role: str) -> list[str]:
        """Where the replicas of node ``role`` listen: the targets of the proxy in front of them."""
        return [f"http://127.0.0.1:{self.ports[name]}" for name in self.names(role)]

    def balance(self, role: str) -> str:
        """How the proxy in front of node ``role`` spreads requests (LossyProxy's ``balance``): round-robin
        over replicas that share the work (the server with slots), else failover to the one that owns it."""
        return "round-robin" if role == "server" and self.slots > 1 else "failover"

    def lease(self, role: str) -> str:
        """The ``[lease]`` section of node ``role``'s replicas."""
        if role == "server" and self.slots > 1:
            return f'\n[lease]\nttl = {self.ttl:g}\nslots = {self.slots}\n'
        return f'\n[lease]\nttl = {self.ttl:g}\nstandby = "{self.standby}"\n'

    def write(self, folder: Path) -> dict[str, Path]:
        """Write every replica's config to ``folder`` (``<name>.toml``); replica name -> its config."""
        advertised = self.pair.proxy_port if self.servers > 1 else None
        texts = dict(zip(("client", "server"), self.pair.texts(folder, server_advertised=advertised)))
        configs = {}
        for role, toml in texts.items():
            for name in self.names(role):
                configs[name] = folder / f"{name}.toml"
                if name != role:
                    configs[name].write_text(self._own(toml, folder, name) + self.lease(role))
                else:  # one process: no lease, but for one that holds every slot
                    configs[name].write_text(toml + (self.lease(role) if self.balance(role) == "round-robin" else ""))
        return configs

    def _own(self, toml: str, folder: Path, name: str) -> str:
        """The node's config as replica ``name`` has it: its own log folder and port."""
        toml = re.sub(r'(?m)^log_dir = ".*"$', f'log_dir = "{folder / f"logs-{name}"}"', toml, count=1)
        return re.sub(r'(?m)^listen = ".*"$', f'listen = "127.0.0.1:{self.ports[name]}"', toml, count=1)


_NODE_IDS: dict[int, str] = {}  # port -> the [node] id of the NodeProcess listening there


# How NodeProcess starts ``python -m qtp serve``: None, a new interpreter (subprocess.Popen); the test suite sets
# launch(args, env, log) -> a Popen-like handle that forks an interpreter which imported qtp once (tests/zygote.py).
LAUNCH: Callable[[list[str], dict[str, str], Path], Any] | None = None


#: What a replica's log says (qtp.coordinator's lease) when it starts waiting for the lease, when it gets it,
#: and when it finds it lost it (it then exits with LOST_LEASE_STATUS, EX_TEMPFAIL); with slots, each slot it
#: takes ("took slot <k> of node <id>") and gives back ("node <id>: this process gives slot <k> back: <why>").
STANDBY_LINE, TOOK_OVER_LINE, LOST_LEASE_LINE = b"standby for node", b"took over node", b"lost the lease of node"
TOOK_SLOT, GAVE_SLOT = re.compile(rb"took slot (\d+) of node"), re.compile(rb"gives slot (\d+) back")
_SLOT_EVENT = re.compile(rb"(took|gives) slot (\d+) (?:of node|back)")
LOST_LEASE_STATUS = 75


class NodeProcess:
    """``qtp serve --app qtp.testing.e2e_app:node`` (or another ``app``) for one config; ``start``, ``kill``
    (SIGKILL), ``stop``; for a replica of a node (``Replicas``), ``start_replica`` and ``role``; ``pause``
    (SIGSTOP) and ``resume`` (SIGCONT). ``slots``: the config's ``[lease] slots`` (1 without)."""

    def __init__(self, config: Path, log: Path, env: dict[str, str] | None = None,
                 app: str = "qtp.testing.e2e_app:node"):
        self.config = config
        self.app = app
        self.log = log
        self.env = env or {}
        self.proc: subprocess.Popen | None = None
        self.paused = False
        self._began = 0     # the log's size when the process was started: what it said since is after this
        text = config.read_text()
        listen = next((line for line in text.splitlines() if line.startswith("listen")), None)
        self.port = None if listen is None else int(listen.rsplit(":", 1)[1].strip('"'))  # None: no endpoint
        if self.port is not None:  # post_as signs for the node listening there
            _NODE_IDS[self.port] = next(line for line in text.splitlines() if line.startswith("id =")).split('"')[1]
        self.scheme = "https" if "\ntls_cert" in text else "http"
        self.slots = int(tomllib.loads(text).get("lease", {}).get("slots", 1))

    def start(self, timeout: float = 60.0) -> "NodeProcess":
        """Start the process; return once it serves (raises RuntimeError if it exits or takes ``timeout``)."""
        return self.launch()._await(self.serving, timeout)

    def start_replica(self, timeout: float = 60.0) -> "NodeProcess":
        """Start a replica; return once it is the owner (it serves) or a standby (waiting for the lease); a
        replica sharing the work (``slots`` > 1) once it serves (``start_sharing``)."""
        if self.slots > 1:
            return self.start_sharing(timeout)
        return self.launch()._await(lambda: self.role() in ("owner", "standby"), timeout)

    def start_sharing(self, timeout: float = 60.0) -> "NodeProcess":
        """Start a replica that shares the node's work with the others (``[lease] slots``): it serves HTTP from
        its start, whatever slots it holds, so return once /health answers 200 on its listen port."""
        return self.launch()._await(self.serving, timeout)

    def slots_taken(self) -> list[int]:
        """The slots its log says it took since it was started, in that order (a slot again when it took it
        again after losing it)."""
        return [int(k) for k in TOOK_SLOT.findall(self.said())]

    def slots_given_back(self) -> list[int]:
        """The slots its log says it gave back since it was started (its lease lost, more than its share, stopping)."""
        return [int(k) for k in GAVE_SLOT.findall(self.said())]

    def slots_held(self) -> list[int]:
        """The slots it holds as far as its log says: taken and not given back since."""
        held: set[int] = set()
        for event, k in _SLOT_EVENT.findall(self.said()):
            (held.add if event == b"took" else held.discard)(int(k))
        return sorted(held)

    def launch(self) -> "NodeProcess":
        """Start the process and return at once."""
        env = dict(os.environ, QTP_TEST_CONFIG=str(self.config), **self.env)
        self._began = self.log.stat().st_size if self.log.exists() else 0
        self.paused = False
        if LAUNCH is not None:
            self.log.touch()  # (read before the launched process may have opened it)
            self.proc = LAUNCH(["serve", "--app", self.app], env, self.log)
        else:
            with open(self.log, "ab") as out:
                self.proc = subprocess.Popen([sys.executable, "-m", "qtp", "serve", "--app", self.app],
                                             env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def _await(self, ready: Callable[[], bool], timeout: float) -> "NodeProcess":
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"node {self.config.name} exited with {self.proc.returncode}:\n{self.tail()}")
            if ready():
                return self
            time.sleep(0.1)
        raise RuntimeError(f"node {self.config.name} did not start:\n{self.tail()}")

    def serving(self) -> bool:
        """/health answers 200 (a node without an endpoint: its log since the start says it started)."""
        if self.port is None:
            return b"qtp serve: node" in self.said()
        try:
            return requests.get(f"{self.scheme}://127.0.0.1:{self.port}/health", timeout=1,
                                verify=False).status_code == 200
        except requests.RequestException:
            return False

    def said(self) -> bytes:
        """What the process wrote to its log since it was started."""
        try:
            with open(self.log, "rb") as out:
                out.seek(self._began)
                return out.read()
        except OSError:
            return b""

    def role(self) -> str:
        """``dead`` (not running), ``paused`` (by ``pause``), ``owner`` (it serves), ``standby`` (its log since
        the start says it waits for the lease and not that it took over), else ``starting``; a replica that
        shares the work (``slots`` > 1) is ``sharing`` once it serves."""
        if not self.alive():
            return "dead"
        if self.paused:
            return "paused"
        if self.serving():
            return "sharing" if self.slots > 1 else "owner"
        said = self.said()
        return "standby" if STANDBY_LINE in said and TOOK_OVER_LINE not in said else "starting"

    def pause(self, timeout: float = 10.0) -> None:
        """SIGSTOP the process group, and return once every thread of the process has stopped (the signal
        takes effect later than kill() returns): it holds its sockets and connections but runs no more."""
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGSTOP)
            self.paused = True
            wait_until(lambda: _stopped(self.proc.pid), timeout, f"process {self.proc.pid} to stop", poll=0.005)

    def resume(self) -> None:
        """SIGCONT the process group."""
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGCONT)
        self.paused = False

    def wait_exit(self, timeout: float) -> int | None:
        """The process's exit status once it has exited, None if it still runs after ``timeout`` seconds."""
        if self.proc is None:
            return None
        deadline = time.monotonic() + timeout
        try:
            status = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        while status == -1 and time.monotonic() < deadline:  # a LAUNCH handle's "ended, status not read yet"
            time.sleep(0.05)
            status = self.proc.poll()
        return status

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        self.paused = False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            if self.paused:  # it would hold the signal
                self.resume()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def owner_of(replicas: list[NodeProcess], timeout: float = 0.0) -> NodeProcess | None:
    """The replica that owns the node (it serves), waiting up to ``timeout`` seconds for one; None if none."""
    deadline = time.monotonic() + timeout
    while True:
        found = next((node for node in replicas if node.role() == "owner"), None)
        if found is not None or time.monotonic() >= deadline:
            return found
        time.sleep(0.1)


def balanced(replicas: list[NodeProcess], timeout: float) -> float:
    """Wait until replicas that share the work hold every slot between them, as far as their logs say, and
    each holds one at least (with fewer slots than replicas: as many replicas as slots). A replica that joins
    gets its share only once another hands one back, which that one does for a slot it has held for twice the
    lease's ttl. Returns the seconds waited; raises AssertionError after ``timeout``."""
    began = time.monotonic()
    count = replicas[0].slots

    def shared() -> bool:
        held = [node.slots_held() for node in replicas]
        return len(set().union(*held)) == count and sum(1 for slots in held if slots) == min(count, len(replicas))

    wait_until(shared, timeout, f"{len(replicas)} replicas sharing {count} slots")
    return round(time.monotonic() - began, 3)


def _stopped(pid: int) -> bool:
    """Every thread of process ``pid`` is stopped (or gone), as /proc says."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    for task in tasks:
        try:
            stat = Path(f"/proc/{pid}/task/{task}/stat").read_text()
        except OSError:
            continue
        if stat.rsplit(")", 1)[1].split()[0] not in ("T", "t", "Z", "X"):
            return False
    return True


def pair_processes(pair: Pair, folder: Path, send: int, rate: float = 0.0,
                   server_env: dict[str, str] | None = None) -> tuple["NodeProcess", "NodeProcess"]:
    """The pair's two node processes (not started), its configs written to ``folder``: the client sends
    orders 1..``send`` (``rate`` per second, 0: at once), none of them aborted."""
    client_config, server_config = pair.write(folder)
    server = NodeProcess(server_config, folder / "server.log", server_env)
    client = NodeProcess(client_config, folder / "client.log",
                         {"QTP_TEST_SEND": str(send), "QTP_TEST_ABORT_EVERY": "0", "QTP_TEST_RATE": str(rate)})
    return client, server


def listening_ports(pid: int) -> list[int]:
    """The TCP ports process ``pid`` listens on (its sockets in LISTEN state, from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.append(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def request(body: object = None, *, to: str = "http://x/rm", message_id: str | None = None,
            reply_to: str | None = None, action: str | None = None, **fields: object) -> Envelope:
    """A request as a hand-made client writes it (SOAP 1.2, WS-RM 1.1, WS-Addressing 2005/08): a fresh
    MessageID, ReplyTo anonymous, and the Action its body or headers call for unless ``action`` is given."""
    wsa = WsaVersion.WSA200508
    envelope = Envelope(soap=SoapVersion.SOAP12, rm=RMVersion.WSRM11, wsa=wsa, body=body, **fields,  # type: ignore[arg-type]
                        addressing=Addressing(action=action, to=to, message_id=message_id or f"urn:uuid:{uuid.uuid4()}",
                                              reply_to=reply_to or anonymous(wsa)))
    if action is None:
        envelope = replace(envelope, addressing=replace(envelope.addressing, action=default_action(envelope)))
    return envelope


_BOOTS: dict[str, str] = {}  # URL -> the boot the node answering there gave last


def post_as(url: str, message: Envelope | bytes, peer: str | None, secret: str, to: str | None = None,
            now: float | None = None, accept: str | None = None, **options: object) -> requests.Response:
    """POST a SOAP 1.2 request (an envelope, or bytes as they are) signed as ``peer`` with ``secret`` for the
    node ``to`` (by default the NodeProcess listening at ``url``), or anonymously (``peer`` None), at time
    ``now`` (a clock ahead or behind; the present by default), with an ``Accept`` header when given (a qtp
    poller's names the batch it takes); ``options`` go to ``requests.post``
    (``verify``, ``cert``). As a node's transport does, the signature names the boot the node last gave,
    and a 401 that gives another one is signed again with it and sent once more."""
    body = message if isinstance(message, bytes) else encode(message)
    headers = {"Content-Type": content_type(SoapVersion.SOAP12, None)}
    if accept is not None:
        headers["Accept"] = accept
    receiver = None
    if peer is not None:
        receiver = to or _NODE_IDS.get(urlsplit(url).port or 0)
        if receiver is None:
            raise ValueError(f"post_as: no NodeProcess listens at {url}; give to=<its [node] id>")
    for _ in range(2):
        boot = _BOOTS.get(url, "")
        if peer is not None and receiver is not None:
            headers[HEADER] = sign_request(secret.encode(), peer, receiver, "POST", "/rm", body, now=now, boot=boot)
        answer = requests.post(url, data=body, headers=headers, timeout=10, **options)  # type: ignore[arg-type]
        answered = answer_boot(answer.headers)
        if answered is not None:
            _BOOTS[url] = answered
        if peer is None or answer.status_code != 401 or answered in (None, boot):
            break
    return answer


def counter(url: str, name: str) -> float | None:
    """The value of metric ``name`` at a node's ``/metrics`` ``url``, summed over its series (a replica sharing
    the work has one per slot it holds); None when the node does not answer or does not have it."""
    try:
        body = requests.get(url, timeout=2).text
    except requests.RequestException:
        return None
    values = [float(x.rsplit(" ", 1)[1]) for x in body.splitlines() if x.startswith(name + "{")]
    return sum(values) if values else None


def wait_until(condition, timeout: float, what: str, poll: float = 0.25) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def check_exactly_once(client_url: str, server_url: str, reply: bool, failed: set[int] = frozenset()) -> dict:
    """Every committed order applied exactly once (except refused ones), nothing else applied, in order per
    sequence; with replies: every applied order got exactly one reply, refused ones exactly one fault."""
    committed = {k for (k,) in rows(client_url, "SELECT k FROM orders WHERE status = 'committed'")}
    applied = rows(server_url, "SELECT id, k, seq, num FROM applied ORDER BY id")
    counts: dict[int, int] = {}
    for _, k, _, _ in applied:
        counts[k] = counts.get(k, 0) + 1
    duplicated = sorted(k for k, n in counts.items() if n > 1)
    lost = sorted(committed - set(counts) - set(failed))
    unexpected = sorted(set(counts) - committed)
    assert not duplicated, f"applied twice: {duplicated[:20]}"
    assert not lost, f"committed but never applied: {lost[:20]}"
    assert not unexpected, f"applied without a committed order: {unexpected[:20]}"
    by_sequence: dict[str, list[int]] = {}
    for _, k, seq, num in applied:
        by_sequence.setdefault(seq, []).append(num)
    for seq, numbers in by_sequence.items():
        assert numbers == sorted(numbers), f"sequence {seq} applied out of order: {numbers[:20]}"
    if reply:
        got: dict[int, tuple[int, int]] = {}
        for k, kind, n in rows(client_url, "SELECT k, kind, COUNT(*) FROM replies GROUP BY k, kind"):
            r, f = got.get(k, (0, 0))
            got[k] = (r + n, f) if kind == "reply" else (r, f + n)
        wrong = [(k, got.get(k, (0, 0))) for k in committed
                 if got.get(k, (0, 0)) != ((0, 1) if k in failed else (1, 0))]
        wrong += [(k, v) for k, v in got.items() if k not in committed]
        assert not wrong, f"orders without exactly one reply (k, (replies, faults)): {sorted(wrong)[:20]}"
    return {"committed": len(committed), "applied": len(applied), "sequences": len(by_sequence)}


def reconcile_reports(jobs: list[tuple[Any, ...]]) -> list[dict]:
    """Run ``qtp reconcile`` (Spark) on the key ``k`` with the client's ``status`` column for each job
    ``(report, client_url, client_table, server_url, server_table, *extra options)``, one after the other in
    one process of their own (the first starts the Spark driver, a JVM, 10-20 s of CPU on this kind of
    machine; the others reuse it); return their JSON reports (a campaign's verdicts)."""
    import json

    argvs = [["--client-url", client_url, "--client-table", client_table, "--server-url", server_url,
              "--server-table", server_table, "--key", "k", "--client-status-column", "status", *extra,
              "--json", str(report), "--quiet", "--conf", "spark.ui.enabled=false"]
             for report, client_url, client_table, server_url, server_table, *extra in jobs]
    program = ("import json, sys\nfrom qtp.reconcile.cli import main\n"
               "sys.exit(max(main(argv) for argv in json.loads(sys.argv[1])))")
    done = subprocess.run([sys.executable, "-c", program, json.dumps(argvs)], capture_output=True, text=True)
    reports = [Path(job[0]) for job in jobs]
    if done.returncode not in (0, 1) or not all(report.exists() for report in reports):
        raise SystemExit(f"qtp reconcile failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return [json.loads(report.read_text()) for report in reports]
