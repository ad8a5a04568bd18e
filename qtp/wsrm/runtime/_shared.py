"""Replicas that share the work: a node's sequences in ``[lease] slots``, each slot held by one live process.

With ``[lease] slots = N`` (N > 1) a node's work is cut into N *slots*. A slot is a whole qtp node inside the
node: a transaction manager of its own (id ``<node>.s<k>``, so its global transactions, its Logging Last
Resource rows and its in-doubt branches are its own), its own lease and fence (qtp.coordinator._lease, keyed
by that id), its own store tables (``qtp_rm_s<k>_*``; slot 0 keeps the node's usual ``qtp_rm_*``), its own
sender, receiver and invoker. Everything the lease proves for a node it proves for a slot: one live holder,
fenced commits, recovery of a dead holder's in-doubt transactions before the slot works again. The applied
MessageIDs (``qtp_rm_applied``) are one table for all slots, so a message sent again in a new sequence is
recognised whichever slot receives it.

Every process of the node (a *replica*) runs a ``SharedNode``: it serves HTTP on its own ``listen`` address
(behind the node's one endpoint: a balancer), heartbeats a row in ``qtp_node_replica`` (with the address the
others reach it at), and holds a fair share of the slots, ``ceil(N / live replicas)``: it takes free ones
(never held, released, or whose holder's lease expired: that is the takeover), and hands one back when it
holds more than its share (a replica joined), by closing that slot cleanly, so the other takes it at once.

**Routing.** Any replica takes any request, and passes it to the slot it belongs to:

- a sequence this node made names its slot: identifiers are ``urn:qtp:<node>:s<k>:<uuid>`` (the
  destination's, and the Offers' for replies), and an AcksTo of this node says ``?qtp-slot=k``;
- a CreateSequence goes to the slot given the fewest in the last hour, and that choice is kept by its MessageID
  (``qtp_node_route``), so a retransmitted one reaches the slot that made the sequence whichever replica it
  reaches, and a channel's lanes (one sequence each) spread evenly over the slots;
- a MakeConnection poll without an identifier of ours goes to the slots in turn (each keeps its own replies);
- anything else (a sequence made before the node had slots) to slot 0.

A qtp peer sending in a sequence of slot k says so in the URL (``?qtp-slot=k``, from the identifier), and
``GET /health?qtp-slot=k`` answers 200 only where slot k is held: a balancer that routes on both sends the
request straight to the slot's replica (docs/operations.md, "The balancer"); the routing above still decides.

A request for a slot this process holds goes to that slot's endpoint; for a slot another replica holds it is
forwarded there (``X-Qtp-Forwarded``: never forwarded twice) and the answer relayed; for a slot nobody holds
now (a takeover under way) it is answered 503, and the peer sends it again. Forwarding waits for at most
half of the HTTP threads, so two replicas forwarding to each other cannot fill each other's pools.

A sequence is worked by one slot, and a slot by one process at a time: per-sequence order and exactly-once
are the slot's, as for a whole node. What a slot's replica sends for the application (``tx.send`` in a
transaction begun on this replica) goes out in that replica's lowest slot, so one process's messages keep
their order per key; messages sent by two replicas travel in different sequences.
"""

from __future__ import annotations

import contextlib
import http.client
import itertools
import logging
import math
import re
import socket
import threading
import time
import zlib
from dataclasses import replace
from io import BytesIO
from pathlib import Path
from typing import Any, Callable, Iterable
from urllib.parse import parse_qs, urlsplit

import sqlalchemy
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, Metric

from qtp._failures import Failures, driver_first_line
from qtp.config import load_config
from qtp.coordinator._lease import (_NOW, FORGET_MEMBERS_S, LEASE_TABLE, MEMBER_TABLE, REPLICA_TABLE, lease_home,
                                   process_member)
from qtp.coordinator._lease import DDL as LEASE_DDL
from qtp.errors import AuthenticationError, ConfigurationError, QtpError
from qtp.wsrm.runtime._endpoint import CHALLENGE, Endpoint, _bare_fault, _plain
from qtp.wsrm.runtime._http import RELEASE_BODY, HttpServer
from qtp.wsrm.runtime._ids import SLOT_QUERY
from qtp.wsrm.runtime._node import Node, _listen_address
from qtp.wsrm.runtime._refusals import refusals
from qtp.wsrm.runtime._security import BOOT_HEADER, HEADER, WSGI_HEADER, SeenSignatures, signed_by
from qtp.wsrm.runtime._settings import node_settings
from qtp.wsrm.runtime._transport import soap_version_of
from qtp.xa import normalize_url

log = logging.getLogger("qtp.wsrm.shared")

REPLICA_DDL = (f"CREATE TABLE IF NOT EXISTS {REPLICA_TABLE} (node_id varchar(31) NOT NULL, member varchar(120) "
               "NOT NULL, address varchar(400) NOT NULL, boot varchar(64) NOT NULL, slots integer NOT NULL, "
               "ready integer NOT NULL, seen_at double precision NOT NULL, expires_at double precision NOT NULL, "
               "PRIMARY KEY (node_id, member))")
ROUTE_TABLE = "qtp_node_route"  # the slot each CreateSequence (by its MessageID) was given
ROUTE_DDL = (f"CREATE TABLE IF NOT EXISTS {ROUTE_TABLE} (node_id varchar(31) NOT NULL, message_id varchar(255) NOT "
             "NULL, slot integer NOT NULL, routed_at double precision NOT NULL, PRIMARY KEY (node_id, message_id))")
ROUTES_KEPT_S = 86400.0  # routes older than this are deleted (a CreateSequence is not retransmitted that late)
FORWARDED = "X-Qtp-Forwarded"  # set on a request one replica passes to another
SLOT_HEADER = "X-Qtp-Slot"
_PASSED = (("Content-Type", "CONTENT_TYPE"), ("Accept", "HTTP_ACCEPT"), ("SOAPAction", "HTTP_SOAPACTION"),
           (HEADER, WSGI_HEADER))  # request headers a forwarded request keeps (the signature: the slot checks it)
_RELAYED = ("content-type", "retry-after", BOOT_HEADER.lower(), HEADER.lower())  # answer headers relayed back
_NOT_A_SLOT = 1 << 30
UNANSWERED_SAID_S = 60.0  # a replica that does not answer forwards is logged at most this often per address
SETTLE_S = 1.0  # a slot is handed back (to a replica below its share) only once held this long
_RETRY = [("Retry-After", "1")]  # on every 503 of a replica: the slot's holder is being settled, soon back
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, ConnectionAbortedError, BrokenPipeError)
_MESSAGE_ID = re.compile(rb"MessageID[^>]*>\s*([^<\s]+)\s*<")


def slot_id(node_id: str, slot: int) -> str:
    """The id of slot ``slot`` of node ``node_id``: its transaction manager's, its lease's and its fence's."""
    return f"{node_id}.s{slot}"


class _Registration:
    """A handler the application registered: given to every slot this process starts."""

    def __init__(self, kind: str, key: str, on_receipt: bool, fn: Callable[..., Any]):
        self.kind, self.key, self.on_receipt, self.fn = kind, key, on_receipt, fn

    def apply(self, node: Node) -> None:
        if self.kind == "handler":
            node.handler(self.key, self.on_receipt)(self.fn)
        elif self.kind == "batch":
            node.batch_handler(self.key, self.on_receipt)(self.fn)
        else:
            node.reply_handler(self.key)(self.fn)


class _Named:
    """A resource as the application sees it before this process holds a slot: its name and URL."""

    def __init__(self, name: str, url: str):
        self.name, self.url = name, url


class Managers:
    """``shared.manager``: what an application does with a node's transaction manager, on this process's
    slots: ``transaction()`` begins in the lowest slot held (QtpError while it holds none)."""

    def __init__(self, shared: "SharedNode"):
        self._shared = shared
        self.node_id = shared.node_id
        self.log_dir = shared.config.log_dir / shared.node_id
        self.lease = None  # a slot's lease is its own: losing one does not end the process
        self.node = shared

    def _slot(self) -> Node:
        node = self._shared.first_slot()
        if node is None:
            raise QtpError(f"node {self.node_id!r}: this process holds none of its {self._shared.slot_count} slots now "
                           "(they are held by other replicas, or being taken over): try again shortly")
        return node

    def transaction(self, timeout: float | None = None) -> contextlib.AbstractContextManager[Any]:
        return self._slot().manager.transaction(timeout)

    def current(self) -> Any:
        for node in self._shared.held():
            tx = node.manager.current()
            if tx is not None:
                return tx
        return None

    def resource(self, name: str) -> Any:
        node = self._shared.first_slot()
        if node is not None:
            return node.manager.resource(name)
        if name not in self._shared.config.resources:
            raise ConfigurationError(f"unknown resource {name!r} on node {self.node_id!r}")
        return _Named(name, self._shared.config.resources[name])

    def close(self, drain_s: float | None = None) -> None:
        self._shared.close()


class SharedNode:
    """One replica of a node whose replicas share the work (see the module docstring). Built by
    ``qtp.Node.from_config`` when ``[lease] slots`` is above 1: register the handlers, then ``start()``."""

    def __init__(self, path: str | Path):
        config = load_config(path)
        lease = config.lease
        if lease is None or lease.slots < 2:
            raise ConfigurationError(f"{path}: a shared node needs [lease] slots = 2 or more")
        self.config = config
        self.lease_settings = lease
        self.node_id = config.node_id
        self.slot_count = lease.slots
        self.settings = node_settings(config.messaging, set(config.resources))
        self.channels = self.settings.channels
        self.endpoint = self.settings.endpoint
        self.limits = self.settings.limits
        self.mc_address = None
        assert self.endpoint is not None  # (the configuration refuses slots without an endpoint)
        self._path = urlsplit(self.endpoint).path or "/"
        host, port = self.settings.listen or _listen_address(self.endpoint)
        self._listen = (host, port)
        # where the others forward to: the scheme and host of [lease] address (default: listen), the endpoint's
        # path (a signature covers the path, and a slot's endpoint takes only its own)
        base = urlsplit(lease.address) if lease.address else None
        where = f"{base.scheme}://{base.netloc}" if base else \
            f"http://{socket.gethostname() if host in ('0.0.0.0', '::', '') else host}:{port}"
        self.address = where + self._path
        self.member = process_member()
        home = lease_home(self.node_id, lease, list(config.resources))
        self._home = sqlalchemy.create_engine(normalize_url(config.resources[home]), pool_size=2, max_overflow=2,
                                              pool_pre_ping=True)
        self._family = "postgresql" if self._home.dialect.name == "postgresql" else "mysql"
        self._now = _NOW[self._family]  # the lease database's clock: every time in these tables is its
        self._routes_pruned = -math.inf  # (the first look prunes)
        self._registrations: list[_Registration] = []
        self.handlers: dict[str, Any] = {}  # by action, as Node.handlers (what `qtp serve` counts)
        self._slots: dict[int, Node] = {}
        self._held_since: dict[int, float] = {}
        self._slots_lock = threading.Lock()
        self._holders: dict[int, str] = {}  # slot -> the address of the replica holding it (from the last look)
        self._live = 1
        self._free_since: dict[int, float] = {}  # slot -> when this replica first saw it held by nobody
        self._failures = 0  # takes that failed in a row (not for a held lease)
        self._unready_until = 0.0  # monotonic: till then this replica counts itself out of the fair share
        self.fatal: ConfigurationError | None = None  # why this replica stopped by itself (qtp serve exits)
        self.started = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._server: HttpServer | None = None
        if self.limits.http_threads < 2:
            raise ConfigurationError(f"node {self.node_id!r}: replicas that share the work need [limits] http_threads "
                                     f"of 2 or more (half of them may wait on forwards), got {self.limits.http_threads}")
        forwards = self.limits.http_threads // 2
        self._forwarding = threading.BoundedSemaphore(forwards)
        self._links = _Links(self.limits.http_timeout, keep=forwards)
        self._unanswered: dict[str, float] = {}  # address -> when a failed forward to it was last logged
        self._forwarded = [0] * self.slot_count  # requests this replica forwarded, per slot (/metrics)
        self._forwarded_lock = threading.Lock()
        self._polls = itertools.count()
        self._tag = re.compile(rb"urn:qtp:" + re.escape(self.node_id.encode()) + rb":s(\d+):")
        # one boot and one memory of signatures for all this replica's slots; the other live replicas' boots are
        # taken too (docs/operations.md, "Replicas that share the work", on signatures)
        self.seen = SeenSignatures(self.limits.max_clock_skew)
        self._anonymous = self.settings.security.anonymous_allowed(self.settings.listen_host())
        self.manager = Managers(self)
        self.poll_s = max(0.05, min(1.0, lease.ttl / 10))

    def __repr__(self) -> str:
        return f"<SharedNode {self.node_id} slots {sorted(self._slots)} of {self.slot_count} at {self.address}>"

    # ------------------------------------------------------------------ application API (as Node's)

    def handler(self, action: str, on_receipt: bool = True) -> Callable[[Any], Any]:
        return self._register("handler", action, on_receipt)

    def batch_handler(self, action: str, on_receipt: bool = True) -> Callable[[Any], Any]:
        return self._register("batch", action, on_receipt)

    def reply_handler(self, channel: str) -> Callable[[Any], Any]:
        if channel not in self.channels or not self.channels[channel].reply:
            raise ConfigurationError(f"channel {channel!r} is not a request-reply channel (reply = true)")
        return self._register("reply", channel, True)

    def _register(self, kind: str, key: str, on_receipt: bool) -> Callable[[Any], Any]:
        def register(fn: Any) -> Any:
            if self.started:
                raise ConfigurationError(f"a handler for {key!r} is registered after node {self.node_id!r} "
                                         "started: register every handler first")
            if kind != "reply":
                if key in self.handlers:
                    raise ConfigurationError(f"a handler for action {key!r} is already registered")
                self.handlers[key] = fn
            self._registrations.append(_Registration(kind, key, on_receipt, fn))
            return fn
        return register

    # ------------------------------------------------------------------ the slots this process holds

    def held(self) -> list[Node]:
        with self._slots_lock:
            return [self._slots[k] for k in sorted(self._slots)]

    def first_slot(self) -> Node | None:
        for node in self.held():
            lease = node.manager.lease
            if node.started and lease is not None and lease.valid():
                return node
        return None

    def slots(self) -> list[int]:
        with self._slots_lock:
            return sorted(self._slots)

    # ------------------------------------------------------------------ running

    def start(self) -> "SharedNode":
        """Serve HTTP, take this process's share of the slots (at least one pass before returning), and keep
        the share right in a thread of its own until ``close()``."""
        if self.started:
            return self
        # what would make every slot's start fail, refused once here (not at each take of each slot)
        self.settings.security.require_metrics_token(self.settings.listen_host())
        if not self.config.llr:
            raise ConfigurationError(f"node {self.node_id!r}: [lease] needs llr = true: a slot's commit decisions must "
                                     "be rows in its databases, where the replica taking it over finds them")
        with self._home.begin() as conn:
            conn.exec_driver_sql(REPLICA_DDL)
            conn.exec_driver_sql(ROUTE_DDL)
        try:  # the row that route choices lock (message_id ''): once per node
            with self._home.begin() as conn:
                conn.exec_driver_sql(f"INSERT INTO {ROUTE_TABLE} (node_id, message_id, slot, routed_at) "
                                     "VALUES (%s, '', -1, 0)", (self.node_id,))
        except sqlalchemy.exc.IntegrityError:
            pass
        with self._home.begin() as conn:
            for ddl in LEASE_DDL:
                conn.exec_driver_sql(ddl)
        with self._home.begin() as conn:
            self._check_alone(conn, conn.exec_driver_sql(f"SELECT {self._now}").scalar())
        self.started = True
        host, port = self._listen
        self._server = HttpServer(self, host, port, self.limits, health=self._healthy,
                                  health_headers=((BOOT_HEADER, self.seen.boot),))
        self._server.start()
        try:
            self._balance_once()
        except ConfigurationError:
            self.close()
            raise
        except (sqlalchemy.exc.SQLAlchemyError, QtpError) as exc:
            log.warning("node %s: slots not taken yet (%s); trying again", self.node_id, driver_first_line(exc))
        self._thread = threading.Thread(target=self._balance_loop, name="qtp-slots", daemon=True)
        self._thread.start()
        log.info("node %s: replica %s serving at %s (slots %s of %d)", self.node_id, self.member, self.address,
                 self.slots(), self.slot_count)
        return self

    def _healthy(self, query: str) -> bool:
        """``GET /health``: whether this replica has started; ``/health?qtp-slot=k``: whether it serves slot k
        now, so that a balancer checking that sends slot k's requests here only while it holds the slot."""
        if SLOT_QUERY not in query:
            return self.started
        slot = _number((parse_qs(query).get(SLOT_QUERY) or [""])[0])
        with self._slots_lock:
            node = self._slots.get(slot)
        return node is not None and node.started

    def close(self) -> None:
        """Hand every slot back (each released cleanly: another replica takes it at once), stop serving."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        for k in self.slots():
            self._release(k, "this process is stopping")
        try:
            with self._home.begin() as conn:
                conn.exec_driver_sql(f"DELETE FROM {REPLICA_TABLE} WHERE node_id = %s AND member = %s",
                                     (self.node_id, self.member))
        except sqlalchemy.exc.SQLAlchemyError as exc:
            log.warning("node %s: replica row not removed (%s): it expires", self.node_id, driver_first_line(exc))
        if self._server is not None:
            self._server.stop()
        self.started = False
        self._links.close()
        self._home.dispose()

    stop = close

    def __enter__(self) -> "SharedNode":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _balance_loop(self) -> None:
        failures = Failures(log, f"node {self.node_id}: balancing the slots")
        while not self._stop.wait(self.poll_s):
            try:
                self._balance_once()
            except ConfigurationError as exc:  # this replica cannot work (its file, or its neighbours'): it stops
                self._fail(exc)
                return
            except (sqlalchemy.exc.SQLAlchemyError, QtpError) as exc:
                failures.failed(exc, detail="trying again")
                continue
            except Exception:  # a bug: keep the replica running, say what
                log.exception("node %s: balancing the slots failed", self.node_id)
                continue
            failures.worked()

    def _balance_once(self) -> None:
        """One look at the replicas and the slots' leases: drop lost slots, take a free one while below the fair
        share, hand one back while above it."""
        for k in self.slots():
            node = self._slots[k]
            lease = node.manager.lease
            if lease is None or lease.lost.is_set():
                self._release(k, f"its lease was lost ({lease.lost_reason if lease else 'never taken'})")
        live, ready, holders = self._look()
        self._links.keep_only(address for member, address in live.items() if member != self.member)
        self._live = len(live)
        self._holders = {k: live[m] for k, m in holders.items() if m in live}
        # the fair share counts the replicas that can take slots: not one whose last take failed (its backoff)
        fair = math.ceil(self.slot_count / max(1, len(ready)))
        mine = self.slots()
        now = time.monotonic()
        free = [k for k in range(self.slot_count) if k not in mine and k not in self._holders]
        self._free_since = {k: self._free_since.get(k, now) for k in free}
        # a slot nobody took for a ttl (its fair holder cannot: a replica that keeps failing) is taken anyway
        orphaned = [k for k in free if now - self._free_since[k] > self.lease_settings.ttl]
        if free and (len(mine) < fair or orphaned) and now >= self._unready_until:
            # its whole share at once (a replica starting alone, or the one left when the other died, serves
            # every slot now, not one more per look); a slot another replica took meanwhile is left to it
            for k in free[:fair - len(mine)] if len(mine) < fair else orphaned[:1]:
                try:
                    self._take(k)
                    self._failures = 0
                except ConfigurationError:
                    raise
                except (sqlalchemy.exc.SQLAlchemyError, QtpError) as exc:  # e.g. a database this host cannot reach
                    self._failures += 1
                    backoff = min(300.0, 3 * self.lease_settings.ttl * 2 ** (self._failures - 1))
                    self._unready_until = time.monotonic() + backoff
                    log.warning("node %s: this replica could not take a slot (%s); it counts itself out of the "
                                "fair share for %.0f s", self.node_id, driver_first_line(exc), backoff)
                    break
        elif len(mine) > fair:
            counts = {m: 0 for m in ready}
            for m in holders.values():
                if m in counts:
                    counts[m] += 1
            settled = [k for k in mine if time.monotonic() - self._held_since.get(k, 0.0) > SETTLE_S]
            if settled and any(n < fair for m, n in counts.items() if m != self.member):
                self._release(settled[-1], f"this process holds {len(mine)} slots, more than its share of {fair}")

    def _fail(self, exc: ConfigurationError) -> None:
        log.critical("node %s: this replica (%s) stops: %s", self.node_id, self.member, exc)
        self.fatal = exc
        threading.Thread(target=self.close, name="qtp-slots-stop", daemon=True).start()

    def _look(self) -> tuple[dict[str, str], set[str], dict[int, str]]:
        """(live replicas: member -> address; those ready to take slots; slots held by a live lease: slot ->
        member), heartbeating this replica on the way; ConfigurationError beside a process of the node without
        slots or a replica with other slots. Times are the lease database's."""
        ttl = self.lease_settings.ttl
        ids = [slot_id(self.node_id, k) for k in range(self.slot_count)]
        with self._home.begin() as conn:
            now = conn.exec_driver_sql(f"SELECT {self._now}").scalar()
            self._check_alone(conn, now)
            ready = 1 if time.monotonic() >= self._unready_until else 0
            values = (self.address, self.seen.boot, self.slot_count, ready, now, now + ttl, self.node_id, self.member)
            if not conn.exec_driver_sql(f"UPDATE {REPLICA_TABLE} SET address = %s, boot = %s, slots = %s, ready = %s, "
                                        "seen_at = %s, expires_at = %s WHERE node_id = %s AND member = %s",
                                        values).rowcount:
                conn.exec_driver_sql(f"INSERT INTO {REPLICA_TABLE} (address, boot, slots, ready, seen_at, expires_at, "
                                     "node_id, member) VALUES (%s, %s, %s, %s, %s, %s, %s, %s)", values)
            found = conn.exec_driver_sql(f"SELECT member, address, boot, slots, ready FROM {REPLICA_TABLE} WHERE "
                                         "node_id = %s AND expires_at > %s", (self.node_id, now)).all()
            other = sorted({int(n) for _, _, _, n, _ in found if int(n) != self.slot_count})
            if other:
                raise ConfigurationError(
                    f"node {self.node_id!r}: live replicas share its work in {', '.join(map(str, other))} slots, "
                    f"this one in {self.slot_count}: every replica of a node needs the same [lease] slots (change "
                    "it with every replica stopped)")
            if time.monotonic() - self._routes_pruned > 600:
                self._routes_pruned = time.monotonic()
                conn.exec_driver_sql(f"DELETE FROM {ROUTE_TABLE} WHERE node_id = %s AND message_id <> '' AND "
                                     "routed_at < %s", (self.node_id, now - ROUTES_KEPT_S))
                # rows of replicas gone that long (a clean close deletes its own; a kill leaves it)
                conn.exec_driver_sql(f"DELETE FROM {REPLICA_TABLE} WHERE node_id = %s AND expires_at < %s",
                                     (self.node_id, now - FORGET_MEMBERS_S))
            marks = ", ".join(["%s"] * len(ids))
            rows = conn.exec_driver_sql(
                f"SELECT l.node_id, l.holder FROM {LEASE_TABLE} l JOIN {MEMBER_TABLE} m ON m.node_id = l.node_id "
                f"AND m.member = l.holder WHERE l.node_id IN ({marks}) AND m.role = 'owner' AND m.expires_at > %s",
                (*ids, now)).all()
        self.seen.others = frozenset(boot for member, _, boot, _, _ in found if member != self.member)
        live = {member: address for member, address, _, _, _ in found}
        able = {member for member, _, _, _, r in found if r}
        return live, able, {ids.index(n): holder for n, holder in rows}

    def _check_alone(self, conn: Any, now: float) -> None:
        """ConfigurationError while a process of this node without slots (a [lease] of the whole node) is
        live: its tables are slot 0's, and two owners of them would write at once."""
        holder = conn.exec_driver_sql(
            f"SELECT m.member, m.role FROM {MEMBER_TABLE} m WHERE m.node_id = %s AND m.role IN ('owner', 'standby') "
            "AND m.expires_at > %s", (self.node_id, now)).first()
        if holder is not None:
            raise ConfigurationError(
                f"node {self.node_id!r} has a live process without slots ({holder[0]}, {holder[1]}): replicas with "
                "[lease] slots cannot run beside it (both would work the node's tables); stop it first, or give "
                "every replica the same [lease] slots")

    def _take(self, k: int) -> None:
        """Hold slot ``k``: its manager takes the slot's lease (or finds it held: nothing done), recovers the
        slot's in-doubt transactions, and its node loads the slot's sequences and starts."""
        from qtp.coordinator import TransactionManager
        from qtp.errors import LeaseHeldError

        config, name = self.config, slot_id(self.node_id, k)
        manager = TransactionManager(name, config.log_dir, timeout=config.timeout,
                                     recovery_interval=config.recovery_interval, llr=config.llr,
                                     lease=replace(self.lease_settings, standby="refuse", slots=1))
        manager.lease_member = self.member
        try:
            for resource, url in config.resources.items():
                manager.add_resource(resource, url, last_resource=resource in config.last_resources)
            manager.start_recovery()
            node = Node(manager, replace(self.settings, slot=k, node_name=self.node_id))
            node.wsgi.seen = self.seen
            node.wsgi.exposition = self.exposition
            for registration in self._registrations:
                registration.apply(node)
            node.start()
        except LeaseHeldError:
            manager.close()
            return
        except BaseException:
            manager.close()
            raise
        with self._slots_lock:
            self._slots[k] = node
            self._held_since[k] = time.monotonic()
        log.warning("took slot %d of node %s (epoch %d); this process (%s) holds slots %s", k, self.node_id,
                    manager.lease.epoch if manager.lease else 0, self.member, self.slots())

    def _release(self, k: int, why: str) -> None:
        with self._slots_lock:
            node = self._slots.pop(k, None)
            self._held_since.pop(k, None)
        if node is None:
            return
        log.warning("node %s: this process gives slot %d back: %s", self.node_id, k, why)
        try:
            node.stop()
            node.manager.close(drain_s=1.0)
        except Exception:  # the slot is gone from this process either way; its lease expires if not released
            log.exception("node %s: slot %d not closed cleanly", self.node_id, k)

    # ------------------------------------------------------------------ HTTP: route, serve or forward

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        method = environ.get("REQUEST_METHOD", "GET")
        path = environ.get("PATH_INFO", "") or "/"
        length = environ.get("CONTENT_LENGTH") or ""
        if method != "POST" or path.rstrip("/") != self._path.rstrip("/") or not length.isdigit() \
                or int(length) > self.limits.max_request_bytes:
            node = self.first_slot()  # its endpoint answers /metrics, 404, 405, 411, 413 as a node does
            if node is None:
                return _plain(start_response, 503, "this replica holds no slot now; retry", _RETRY)
            return node.wsgi(environ, start_response)
        body = environ["wsgi.input"].read(int(length))
        slot = self._route(environ, body)
        with self._slots_lock:
            node = self._slots.get(slot)
        if node is not None and node.started:
            environ["wsgi.input"] = BytesIO(body)
            return node.wsgi(environ, start_response)
        # before any answer of its own (a forward, a 503): a request the slot would refuse is refused here, a
        # forwarded one too (a replica passes on what the peer sent, signature and all)
        refused = self._unsigned(environ, body)
        if refused is not None:
            return _plain(start_response, 401, f"not authenticated ({refused}): sign requests as [peers] says",
                          CHALLENGE)
        if environ.get("HTTP_X_QTP_FORWARDED"):
            return _busy(environ, start_response, f"slot {slot} is not held here (any more); retry")
        address = self._holders.get(slot)
        if address is None or address == self.address:
            return _busy(environ, start_response, f"slot {slot} of node {self.node_id} is being taken over; retry")
        return self._forward(address, slot, environ, body, start_response)

    def _unsigned(self, environ: dict[str, Any], body: bytes) -> str | None:
        """Why a request this replica would pass on is refused here already (None: it is not), so that requests
        the slot's replica would refuse (unsigned, signed by no peer, for another node, with a wrong or stale
        signature) take no forward, nor the room of a large body in both replicas. The slot's replica checks
        everything again, the boot and that each signature is taken once included."""
        header = environ.get(WSGI_HEADER)
        try:
            if not header:
                if self._anonymous:
                    return None
                raise AuthenticationError("the request is not signed and this node takes no anonymous requests")
            signed_by(self.settings.security, header, "POST", environ.get("PATH_INFO", "") or "/", body,
                      self.node_id, self.limits.max_clock_skew)
        except AuthenticationError as exc:
            refusals.warn(log, "unauthenticated", "refused a request from %s before passing it on: %s",
                          environ.get("REMOTE_ADDR", "?"), exc)
            node = self.first_slot()
            if node is not None:  # counted where it was refused: at one of this replica's slots
                node.metrics.refused.labels(reason="unauthenticated").inc()
            return str(exc)
        return None

    def _route(self, environ: dict[str, Any], body: bytes) -> int:
        """The slot a request belongs to. A sender can steer only its own requests by what it writes: a slot
        holds only its own sequences (any other identifier is unknown there), and sequences are made by
        CreateSequence, whichever slot it reaches."""
        header = environ.get("HTTP_X_QTP_SLOT")
        if environ.get("HTTP_X_QTP_FORWARDED") and _number(header or "") < self.slot_count:
            return int(header)  # as the replica that forwarded it chose (a poll's turn, a CreateSequence's route)
        tagged = self._tag.search(body)
        if tagged is not None and int(tagged.group(1)) < self.slot_count:
            return int(tagged.group(1))
        query = (parse_qs(environ.get("QUERY_STRING", "")).get(SLOT_QUERY) or [""])[0]
        if _number(query) < self.slot_count:
            return int(query)  # acknowledgements POSTed to a slot's AcksTo
        if b"CreateSequence" in body:
            found = _MESSAGE_ID.search(body)
            if found is None:
                return zlib.crc32(body) % self.slot_count
            try:
                return self._slot_for_create(found.group(1).decode("utf-8", "replace")[:255])
            except sqlalchemy.exc.SQLAlchemyError as exc:  # the lease database is down: a slot by the hash
                log.info("node %s: CreateSequence routed by its hash (%s)", self.node_id, driver_first_line(exc))
                return zlib.crc32(found.group(1)) % self.slot_count
        if b"MakeConnection" in body:
            return next(self._polls) % self.slot_count
        return 0

    def _slot_for_create(self, message_id: str) -> int:
        """The slot of a CreateSequence: the one its MessageID was given before (a retransmission reaches the
        slot that made the sequence, whichever replica it reaches), else the slot given the fewest
        CreateSequence in the last hour (so that a channel's few lanes spread over the slots evenly)."""
        with self._home.begin() as conn:
            row = conn.exec_driver_sql(f"SELECT slot FROM {ROUTE_TABLE} WHERE node_id = %s AND message_id = %s",
                                       (self.node_id, message_id)).first()
            if row is not None:
                return int(row[0]) % self.slot_count
            # one choice at a time (the node's sentinel row, locked): CreateSequences arriving together at
            # several replicas would otherwise all count the same slot as the least used
            conn.exec_driver_sql(f"SELECT slot FROM {ROUTE_TABLE} WHERE node_id = %s AND message_id = '' FOR UPDATE",
                                 (self.node_id,)).first()
            row = conn.exec_driver_sql(f"SELECT slot FROM {ROUTE_TABLE} WHERE node_id = %s AND message_id = %s",
                                       (self.node_id, message_id)).first()
            if row is not None:  # routed by another replica while this one waited
                return int(row[0]) % self.slot_count
            now = conn.exec_driver_sql(f"SELECT {self._now}").scalar()
            counts = dict.fromkeys(range(self.slot_count), 0)
            for slot, n in conn.exec_driver_sql(f"SELECT slot, COUNT(*) FROM {ROUTE_TABLE} WHERE node_id = %s AND "
                                                "message_id <> '' AND routed_at > %s GROUP BY slot",
                                                (self.node_id, now - 3600)).all():
                if int(slot) in counts:
                    counts[int(slot)] = int(n)
            slot = min(counts, key=lambda k: (counts[k], zlib.crc32(message_id.encode()) % self.slot_count != k, k))
            try:
                with conn.begin_nested():
                    conn.exec_driver_sql(f"INSERT INTO {ROUTE_TABLE} (node_id, message_id, slot, routed_at) "
                                         "VALUES (%s, %s, %s, %s)", (self.node_id, message_id, slot, now))
            except sqlalchemy.exc.IntegrityError:  # another replica routed the same CreateSequence just now
                row = conn.exec_driver_sql(f"SELECT slot FROM {ROUTE_TABLE} WHERE node_id = %s AND message_id = %s",
                                           (self.node_id, message_id)).first()
                slot = int(row[0]) if row is not None else slot
        return slot % self.slot_count

    def _forward(self, address: str, slot: int, environ: dict[str, Any], body: bytes,
                 start_response: Callable[..., Any]) -> Iterable[bytes]:
        if not self._forwarding.acquire(blocking=False):
            return _busy(environ, start_response, "this replica is forwarding as much as it may now; retry")
        with self._forwarded_lock:
            self._forwarded[slot] += 1
        try:
            # the body is not read any more here: its room in max_body_memory goes to bodies being read, so two
            # replicas forwarding large bodies to each other do not wait on each other's room (the bodies waiting
            # on forwards are bounded apart: http_threads / 2 of them)
            release = environ.get(RELEASE_BODY)
            if release is not None:
                release()
            headers = {name: environ[key] for name, key in _PASSED if environ.get(key)}
            headers[FORWARDED] = self.member
            headers[SLOT_HEADER] = str(slot)
            try:
                status, reason, answer_headers, content = self._links.post(address, body, headers)
            except (OSError, http.client.HTTPException) as exc:
                now = time.monotonic()
                if now - self._unanswered.get(address, -math.inf) >= UNANSWERED_SAID_S:
                    self._unanswered[address] = now
                    log.warning("node %s: slot %d's replica at %s did not answer a forward (%s); requests for "
                                "the slot are answered 503 (said once a minute per address: is it down, or is "
                                "its [lease] address wrong?)", self.node_id, slot, address, driver_first_line(exc))
                return _busy(environ, start_response, f"slot {slot}'s replica did not answer; retry")
            except ValueError as exc:  # a header http.client will not send (the server refuses CR, LF, NUL first)
                return _plain(start_response, 400, f"not forwarded: {driver_first_line(exc)}")
        finally:
            self._forwarding.release()
        passed = [(k, v) for k, v in answer_headers if k.lower() in _RELAYED]
        passed.append(("Content-Length", str(len(content))))
        start_response(f"{status} {reason or 'Answer'}", passed)
        return [content]

    def exposition(self) -> tuple[bytes, str]:
        """``/metrics`` of this replica: every slot it holds, each sample labelled with its ``slot``."""
        families: dict[str, Metric] = {}
        for node in self.held():
            for family in node.metrics.registry.collect():
                merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type,
                                                                 family.unit))
                merged.samples += [sample._replace(labels={**sample.labels, "slot": str(node.slot)})
                                   for sample in family.samples]
        forwarded = CounterMetricFamily("qtp_requests_forwarded", "Requests this replica passed to the replica "
                                        "holding their slot (a balancer routing on ?qtp-slot= leaves few)",
                                        labels=["slot"])
        with self._forwarded_lock:
            for slot, count in enumerate(self._forwarded):
                forwarded.add_metric([str(slot)], count)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Families([*families.values(), forwarded]))
        return generate_latest(registry), CONTENT_TYPE_LATEST

    # ------------------------------------------------------------------ for status

    def describe(self) -> dict[str, Any]:
        return {"node": self.node_id, "member": self.member, "address": self.address, "slots": self.slots(),
                "slot_count": self.slot_count, "live_replicas": self._live, "holders": dict(self._holders)}


class _Links:
    """Kept-alive HTTP connections to the other replicas (http.client: a forward is one POST and its answer,
    relayed as they are, at a fraction of a general HTTP client's cost). A forward takes an idle connection
    to its replica or opens one, and gives it back after the answer; at most ``keep`` stay idle per replica
    (as many as may forward at once), and those of an address no live replica has any more are closed
    (``keep_only``).

    A kept connection the other replica has closed meanwhile (its idle limit, its restart) fails on the next
    use before any answer; the request is then sent once more on a new connection. Sending a request twice is
    what a peer's own retransmission does: the slot recognises what it already has."""

    def __init__(self, timeout: float, keep: int):
        self.timeout = timeout
        self.keep = keep
        self._idle: dict[str, list[http.client.HTTPConnection]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def post(self, address: str, body: bytes, headers: dict[str, str]) -> tuple[int, str, list[tuple[str, str]], bytes]:
        """(status, reason, headers, body) of the answer to a POST of ``body`` to ``address`` (http://)."""
        parts = urlsplit(address)
        target = parts.path or "/"
        if parts.query:
            target += "?" + parts.query
        for again in (False, True):
            with self._lock:
                idle = self._idle.get(parts.netloc)
                conn = idle.pop() if idle and not again else None
            reused = conn is not None
            if conn is None:
                conn = http.client.HTTPConnection(parts.hostname or "localhost", parts.port or 80,
                                                  timeout=self.timeout)
            try:
                conn.request("POST", target, body=body, headers=headers)
                answer = conn.getresponse()
                content = answer.read()
            except _STALE:
                conn.close()
                if reused and not again:  # the others kept to that replica are most likely closed as well
                    self._drop(parts.netloc)
                    continue
                raise
            except BaseException:
                conn.close()
                raise
            if answer.will_close:
                conn.close()
            else:
                self._give(parts.netloc, conn)
            return answer.status, answer.reason, answer.getheaders(), content
        raise AssertionError("unreachable")

    def _give(self, netloc: str, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            idle = self._idle.setdefault(netloc, [])
            if not self._closed and len(idle) < self.keep:
                idle.append(conn)
                return
        conn.close()

    def keep_only(self, addresses: Iterable[str]) -> None:
        """Close the idle connections to every address but ``addresses`` (the live replicas')."""
        live = {urlsplit(a).netloc for a in addresses}
        with self._lock:
            gone = [netloc for netloc in self._idle if netloc not in live]
        for netloc in gone:
            self._drop(netloc)

    def _drop(self, netloc: str) -> None:
        with self._lock:
            dropped = self._idle.pop(netloc, [])
        for conn in dropped:
            conn.close()

    def idle(self) -> dict[str, int]:
        """Idle kept connections per replica (host:port)."""
        with self._lock:
            return {netloc: len(conns) for netloc, conns in self._idle.items() if conns}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            dropped = [conn for conns in self._idle.values() for conn in conns]
            self._idle.clear()
        for conn in dropped:
            conn.close()


class _Families:
    """A collector of metric families already gathered."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def _number(text: str) -> int:
    """``text`` as a slot number when it is one (ASCII digits: ``str.isdigit`` also takes "²"), else a number
    above every slot."""
    return int(text) if text.isascii() and text.isdigit() and len(text) < 6 else _NOT_A_SLOT


def _busy(environ: dict[str, Any], start_response: Callable[..., Any], text: str) -> list[bytes]:
    """503 for a SOAP request a replica cannot pass on now: a SOAP fault (the peer reads why), Retry-After 1."""
    soap = soap_version_of(environ.get("CONTENT_TYPE"))
    if soap is None:
        return _plain(start_response, 503, text, _RETRY)
    status, headers, body = Endpoint._respond(_bare_fault(soap, "Receiver", text), 503)
    start_response("503 Service Unavailable", [*headers, *_RETRY])
    return [body]


