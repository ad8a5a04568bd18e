"""A lossy HTTP proxy between two qtp nodes, for tests and crash campaigns.

Two qtp nodes send each other WS-RM messages as HTTP POSTs over loopback. Loopback loses nothing, so the
code that makes messaging reliable (retransmission, acknowledgement ranges, duplicate detection, delivery in
order) would never be exercised. The proxy stands between the nodes, forwards everything to its target (or
to one of several, see *Failover* below), and does to each exchange what a real network and real peers do.
Every fault has its own probability and is drawn on its own for every exchange, so any combination can
happen to one message:

``drop_request``
    The request dies on the way: lost packets whose retransmissions failed too, a peer that crashed before
    reading it, a middlebox that reset the connection. The target never sees it.
``drop_response``
    The target received and processed the request, but the answer dies on the way back: the connection
    broke after the peer committed, or the peer crashed between committing and replying. The sender cannot
    tell this from a dropped request, and it is the case that makes duplicates unavoidable.
``duplicate_request``
    The target gets the request twice, the copies one after the other or both at once: somebody on the path
    retransmitted because the answer was slow, and both copies arrived. The client gets one of the answers.
``delay`` / ``delay_ms``
    Queueing and scheduling jitter: the request and, separately, the response wait a random time within
    ``delay_ms``. Concurrent exchanges then reach the target in another order than they were sent in.
``reorder`` / ``reorder_max_ms``
    One request is held back much longer than its neighbours (a retransmission after a timeout, a changed
    route), so requests sent after it overtake it.

Why a lost message is a closed connection: HTTP cannot say "your request was lost". A client that wrote its
request and then sees the connection end without a status line (or sees nothing until its own timeout)
cannot know whether the peer got the request, acted on it, or both and only the answer was lost. So for
both drops the proxy closes the client's connection without sending a byte, which is what loss looks like
to an HTTP client. A ``502`` would be wrong: it is an answer, and it tells the client something a lossy
network never would. WS-RM resolves the doubt by retransmitting and by the receiver discarding duplicates;
the proxy is there to show that it does.

Failover: a node run as several replicas (processes on other hosts sharing one database, one of them owning
the node's identity, the others waiting as standbys) has one address for its peers, a load balancer in front
of the replicas. Given several targets, the proxy is that balancer. Each copy of a request goes to the
*current* target, the one that answered last; when that target

- refuses the connection (a standby does not listen; a killed process left no listener),
- resets or closes it before the status line (a process dying with the request in hand),
- answers ``503`` (a node starting, or too busy to store the message), or
- sends no byte of answer for ``failover_s`` (a SIGSTOPped process: the kernel still accepts its connections
  and takes the request into its buffers, but nobody reads them),

the proxy sends the copy to the next target, each target at most once per copy, and the first one to give
another answer becomes the current target. When none does, the client's connection is closed without a byte,
as for a lost message (but a ``503``, when one came, is relayed: it is an answer). An answer that breaks off
after its status line is not retried elsewhere: the target had the request. A copy given up on a paused
target and sent to the next one reaches the node twice if the paused process later wakes and reads it, one
more duplicate for WS-RM to discard. With one target, nothing changes: its answers, 503 included, are
relayed, and ``failover_s`` (default: ``timeout``) bounds the wait for them.

Round-robin (``balance="round-robin"``): the replicas of a node that share its work (``[lease] slots``) all
serve, so the balancer spreads the requests over all of them instead of keeping to a current one. Each copy
of a request goes to the next target in turn (the two copies of a duplicated request to two targets, when
there are two); the failover above still applies to it, from that target on, and a target that refused the
connection or was silent for ``failover_s`` is also marked down for ``down_s`` seconds: copies then skip it,
and try it only after every target that is not down (so with all of them down, each is still tried once, and
the answer is as above: the connection closed, or a ``503`` relayed). There is no current target:
``switches`` stays 0, ``current`` is the target that answered last.

With several targets, ``stats`` also gives ``per_target``: for each target's URL, the copies it answered
(the split of ``forwarded``).

Everything else is forwarded faithfully: method, path and query, headers except the hop-by-hop ones, body;
the target's status, headers and body come back unchanged. The proxy listens on 127.0.0.1 and forwards to
loopback only (a tool that loses messages on purpose must not be reachable from a network), it is bounded
(request body size, connections at once, time per forwarded request), and it is seeded: one
``random.Random`` makes every draw, so a run with one client thread repeats exactly and a concurrent run
repeats as far as thread scheduling allows.

Control paths, answered by the proxy and never forwarded::

    GET  /__proxy__/stats    the counters (JSON object; see COUNTERS)
    GET  /__proxy__/faults   the current faults
    POST /__proxy__/faults   change some faults, e.g. {"drop_request": 0} to let everything drain

Command line (prints its URL on the first line of stdout, runs until SIGTERM or SIGINT)::

    python -m qtp.testing.lossy_proxy --target http://127.0.0.1:8002 --drop-request 0.1 --seed 7
    python -m qtp.testing.lossy_proxy --target http://127.0.0.1:8002 --target http://127.0.0.1:8003 --failover-s 2
    python -m qtp.testing.lossy_proxy --target http://127.0.0.1:8002 --target http://127.0.0.1:8003 --balance round-robin
"""

from __future__ import annotations

import argparse
import http.client
import ipaddress
import json
import random
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass, fields, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from qtp.errors import ConfigurationError

BIND_HOST = "127.0.0.1"
DEFAULT_MAX_BODY = 16 * 1024 * 1024
CONTROL_PREFIX = "/__proxy__/"
STATS_PATH = CONTROL_PREFIX + "stats"
FAULTS_PATH = CONTROL_PREFIX + "faults"
BALANCES = ("failover", "round-robin")  # see the module's *Failover* and *Round-robin*
DEFAULT_DOWN_S = 1.0

#: requests: client requests seen (control paths and refused ones excluded); forwarded: copies the target
#: answered; duplicated: requests sent twice; delayed: directions delayed (two per exchange at most);
#: reordered: requests held back; rejected: answered 400/413 by the proxy; errors: copies no target answered
#: (failed or timed out); failovers: copies sent on to the next target, of which failovers_<cause>: because the
#: one before refused the connection, reset it before answering, answered 503, or was silent for failover_s;
#: switches: times the current target changed (failover only). With several targets, ``stats`` adds per_target.
FAILOVER_CAUSES = ("refused", "reset", "503", "silent")
COUNTERS = ("requests", "forwarded", "dropped_requests", "dropped_responses", "duplicated", "delayed",
            "reordered", "rejected", "errors", "failovers", *(f"failovers_{cause}" for cause in FAILOVER_CAUSES),
            "switches")

_HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "proxy-authenticate",
                         "proxy-authorization", "te", "trailer", "trailers", "transfer-encoding", "upgrade"})
_REWRITTEN = frozenset({"host", "content-length", "expect"})  # the proxy frames each hop itself
_PROBABILITIES = ("drop_request", "drop_response", "duplicate_request", "delay", "reorder")
_NO_BODY_STATUS = frozenset({204, 304})


@dataclass(frozen=True)
class Faults:
    """What the proxy does to each exchange: probabilities in [0, 1] and times in milliseconds.

    ``delay`` is the probability that one direction of an exchange waits ``uniform(*delay_ms)``; it is 1 by
    default, so ``delay_ms`` alone delays every request and every response.
    """

    drop_request: float = 0.0
    drop_response: float = 0.0
    duplicate_request: float = 0.0
    delay: float = 1.0
    delay_ms: tuple[float, float] = (0.0, 0.0)
    reorder: float = 0.0
    reorder_max_ms: float = 0.0

    def __post_init__(self) -> None:
        for name in _PROBABILITIES:
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigurationError(f"{name} is a probability between 0 and 1, not {value!r}")
        low, high = self.delay_ms
        if not 0.0 <= low <= high:
            raise ConfigurationError(f"delay_ms is (min, max) with 0 <= min <= max, not {self.delay_ms!r}")
        if self.reorder_max_ms < 0:
            raise ConfigurationError(f"reorder_max_ms must be 0 or more, not {self.reorder_max_ms!r}")

    def changed(self, changes: dict[str, Any]) -> Faults:
        """A copy with ``changes`` applied; unknown names and bad values raise ConfigurationError."""
        known = [f.name for f in fields(self)]
        unknown = sorted(set(changes) - set(known))
        if unknown:
            raise ConfigurationError(f"unknown faults {unknown}; the faults are {known}")
        return replace(self, **{name: _coerce(name, value) for name, value in changes.items()})


def _coerce(name: str, value: Any) -> Any:
    try:
        if name == "delay_ms":
            low, high = value
            return (float(low), float(high))
        return float(value)
    except (TypeError, ValueError) as exc:
        wanted = "a pair of numbers [min, max]" if name == "delay_ms" else "a number"
        raise ConfigurationError(f"{name} = {value!r}; it must be {wanted}") from exc


@dataclass(frozen=True)
class _Request:
    method: str
    target: str                         # path and query, as the client sent them
    headers: list[tuple[str, str]]      # end-to-end headers only
    body: bytes


@dataclass(frozen=True)
class _Response:
    status: int
    reason: str
    headers: list[tuple[str, str]]
    body: bytes


class _TooLarge(Exception):
    """The target's response body is over the proxy's limit."""


class _Unanswered(Exception):
    """The target gave no answer: ``cause`` is one of FAILOVER_CAUSES but 503."""

    def __init__(self, cause: str) -> None:
        super().__init__(cause)
        self.cause = cause


def _cause(exc: BaseException) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "refused"
    return "silent" if isinstance(exc, TimeoutError) else "reset"


def _end_to_end(headers: list[tuple[str, str]], rewritten: frozenset[str] = _REWRITTEN) -> list[tuple[str, str]]:
    """The headers without hop-by-hop ones (including those the Connection header names) and ``rewritten``."""
    named = {token.strip().lower() for key, value in headers if key.lower() == "connection"
             for token in value.split(",")}
    dropped = _HOP_BY_HOP | rewritten | named
    return [(key, value) for key, value in headers if key.lower() not in dropped]


def _is_loopback(host: str | None) -> bool:
    if host == "localhost":
        return True
    try:
        return host is not None and ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class _Target:
    host: str
    port: int
    netloc: str
    prefix: str

    @classmethod
    def parse(cls, url: str) -> _Target:
        parts = urlsplit(url)
        if parts.scheme != "http" or not _is_loopback(parts.hostname):
            raise ConfigurationError(f"the lossy proxy forwards to http:// on loopback only (127.0.0.1, ::1, "
                                     f"localhost), not {url!r}")
        return cls(parts.hostname or "", parts.port or 80, parts.netloc, parts.path.rstrip("/"))

    @property
    def url(self) -> str:
        return f"http://{self.netloc}{self.prefix}"

    def send(self, request: _Request, answer_within: float, timeout: float, max_body: int) -> _Response:
        """One exchange with the target on a fresh connection. ``answer_within`` bounds each socket operation
        until the status line and headers are in, ``timeout`` each one after; _Unanswered when no answer came."""
        connection = http.client.HTTPConnection(self.host, self.port, timeout=answer_within)
        try:
            try:
                connection.putrequest(request.method, self.prefix + request.target, skip_host=True,
                                      skip_accept_encoding=True)
                connection.putheader("Host", self.netloc)
                for key, value in request.headers:
                    connection.putheader(key, value)
                if request.body or request.method in ("POST", "PUT", "PATCH"):
                    connection.putheader("Content-Length", str(len(request.body)))
                connection.endheaders(request.body or None)
                sock = connection.sock
                reply = connection.getresponse()
            except (OSError, http.client.HTTPException) as exc:
                raise _Unanswered(_cause(exc)) from exc
            sock.settimeout(timeout)
            return _read_response(reply, request.method, max_body)
        finally:
            connection.close()


def _read_response(reply: http.client.HTTPResponse, method: str, max_body: int) -> _Response:
    body = reply.read(max_body + 1)
    if len(body) > max_body:
        raise _TooLarge(f"response body over {max_body} bytes")
    keep_length = frozenset() if method == "HEAD" else frozenset({"content-length"})
    return _Response(reply.status, reply.reason, _end_to_end(reply.getheaders(), keep_length), body)


class LossyProxy:
    """An HTTP proxy on 127.0.0.1 that loses, duplicates, delays and reorders messages to one target, or to
    several: the current one with failover, or each in turn (round-robin).

    ``LossyProxy(target, drop_request=0.1, seed=7).start()`` binds at construction (so ``port`` and ``url``
    are known before ``start``), serves on background threads after ``start()``, and is closed by ``stop()``
    or by leaving a ``with`` block. Connections beyond ``max_connections`` wait until one ends. ``target`` is
    one URL or a list of them (replicas of one node, the first one current at the start); ``failover_s``
    bounds the wait for a target's first byte of answer (default: ``timeout``). ``balance`` is "failover"
    (one current target) or "round-robin" (each copy to the next target; one that refused or was silent is
    skipped for ``down_s`` seconds).
    """

    def __init__(self, target: str | list[str] | tuple[str, ...], *, host: str = BIND_HOST, port: int = 0,
                 drop_request: float = 0.0, drop_response: float = 0.0, duplicate_request: float = 0.0,
                 delay: float = 1.0, delay_ms: tuple[float, float] = (0, 0), reorder: float = 0.0,
                 reorder_max_ms: float = 0, seed: int | None = None, max_body: int = DEFAULT_MAX_BODY,
                 max_connections: int = 64, timeout: float = 30.0, failover_s: float | None = None,
                 balance: str = "failover", down_s: float = DEFAULT_DOWN_S) -> None:
        if host != BIND_HOST:
            raise ConfigurationError(f"the lossy proxy listens on {BIND_HOST} only (it loses messages on "
                                     f"purpose and must not be reachable from a network), not {host!r}")
        failover_s = timeout if failover_s is None else failover_s
        if max_body < 0 or max_connections < 1 or timeout <= 0 or failover_s <= 0:
            raise ConfigurationError(f"need max_body >= 0, max_connections >= 1, timeout > 0, failover_s > 0; "
                                     f"got {max_body}, {max_connections}, {timeout}, {failover_s}")
        if balance not in BALANCES or down_s < 0:
            raise ConfigurationError(f"balance is one of {list(BALANCES)} and down_s >= 0; got {balance!r}, {down_s}")
        urls = [target] if isinstance(target, str) else list(target)
        if not urls:
            raise ConfigurationError("the lossy proxy needs at least one target")
        self._targets = [_Target.parse(url) for url in urls]
        self._current = 0
        self.failover_s = failover_s
        self.balance = balance
        self.down_s = down_s
        self._next = 0                                      # round-robin: the target the next copy starts at
        self._down_until = [0.0] * len(self._targets)       # round-robin: skipped until then (time.monotonic)
        self._answered = [0] * len(self._targets)
        self._faults = Faults().changed(dict(
            drop_request=drop_request, drop_response=drop_response, duplicate_request=duplicate_request,
            delay=delay, delay_ms=delay_ms, reorder=reorder, reorder_max_ms=reorder_max_ms))
        self.max_body = max_body
        self.timeout = timeout
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._stopped = threading.Event()
        self._server = _Server((host, port), self, max_connections, self._stopped)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{BIND_HOST}:{self.port}"

    @property
    def targets(self) -> list[str]:
        return [target.url for target in self._targets]

    @property
    def current(self) -> str:
        """The target that answered last (the first one until another answered)."""
        with self._lock:
            return self._targets[self._current].url

    def start(self) -> LossyProxy:
        """Serve on background threads; returns self."""
        if self._thread is not None or self._stopped.is_set():
            raise RuntimeError("a LossyProxy starts once")
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),
                                        name=f"lossy-proxy-{self.port}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop accepting, close every client connection, lose the messages still held back. Idempotent."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
        self._server.server_close()
        self._server.close_connections()

    def __enter__(self) -> LossyProxy:
        return self if self._thread is not None else self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def stats(self) -> dict[str, Any]:
        """A snapshot of the counters (see ``COUNTERS``); with several targets also ``per_target``, the copies
        each target answered by its URL."""
        with self._lock:
            counts: dict[str, Any] = dict(self._counts)
            if len(self._targets) > 1:
                counts["per_target"] = {target.url: n for target, n in zip(self._targets, self._answered)}
            return counts

    def faults(self) -> dict[str, Any]:
        """The current faults, as ``set_faults`` takes them."""
        return asdict(self._faults)

    def set_faults(self, **changes: Any) -> None:
        """Change some faults for the exchanges that start from now on, e.g. ``set_faults(drop_request=0)``."""
        with self._lock:
            self._faults = self._faults.changed(changes)

    def _exchange(self, request: _Request) -> _Response | None:
        """What the network does to one request and its response; None means the client gets no answer."""
        self._count("requests")
        if not (self._delay() and self._hold_back()):
            return None
        if self._draw("drop_request"):
            self._count("dropped_requests")
            return None
        response = self._forward(request)
        if response is None or not self._delay():
            return None
        if self._draw("drop_response"):
            self._count("dropped_responses")
            return None
        return response

    def _forward(self, request: _Request) -> _Response | None:
        if not self._draw("duplicate_request"):
            return self._send(request)
        self._count("duplicated")
        if self._coin():
            answers = [self._send(request), self._send(request)]
        else:
            answers = self._send_concurrently(request)
        return self._pick([answer for answer in answers if answer is not None])

    def _send_concurrently(self, request: _Request) -> list[_Response | None]:
        copy: list[_Response | None] = []
        helper = threading.Thread(target=lambda: copy.append(self._send(request)), daemon=True)
        helper.start()
        first = self._send(request)
        helper.join()
        return [first, *copy]

    def _send(self, request: _Request) -> _Response | None:
        """Forward one copy to the current target (round-robin: the next one), on to the next ones while they
        give no answer (see the module's *Failover*); None (counted as an error) when none answered, or an
        answer broke off or overflowed."""
        busy = None
        order = self._round_robin_order() if self.balance == "round-robin" else self._failover_order()
        for tried, index in enumerate(order, 1):
            try:
                response = self._targets[index].send(request, self.failover_s, self.timeout, self.max_body)
            except _Unanswered as exc:
                cause = exc.cause
                if cause in ("refused", "silent"):
                    self._mark_down(index)
            except (OSError, http.client.HTTPException, _TooLarge):
                break
            else:
                if response.status != 503:
                    self._answered_by(index)
                    return response
                busy, cause = (index, response), "503"
            if tried < len(order):
                self._count("failovers", f"failovers_{cause}")
        if busy is not None:
            with self._lock:
                self._counts["forwarded"] += 1
                self._answered[busy[0]] += 1
            return busy[1]
        self._count("errors")
        return None

    def _failover_order(self) -> list[int]:
        """Every target's index once, the current target's first."""
        with self._lock:
            first = self._current
        return [(first + step) % len(self._targets) for step in range(len(self._targets))]

    def _round_robin_order(self) -> list[int]:
        """Every target's index once, from the next one in turn; those marked down after the others."""
        with self._lock:
            first = self._next
            self._next = (first + 1) % len(self._targets)
            now = time.monotonic()
            ring = [(first + step) % len(self._targets) for step in range(len(self._targets))]
            down = [index for index in ring if self._down_until[index] > now]
        return [index for index in ring if index not in down] + down

    def _mark_down(self, index: int) -> None:
        if self.balance == "round-robin":
            with self._lock:
                self._down_until[index] = time.monotonic() + self.down_s

    def _answered_by(self, index: int) -> None:
        with self._lock:
            self._counts["forwarded"] += 1
            self._answered[index] += 1
            if index != self._current:
                self._current = index
                if self.balance == "failover":
                    self._counts["switches"] += 1

    def _delay(self) -> bool:
        """Maybe delay one direction; False when the proxy stopped meanwhile (the message is then lost)."""
        low, high = self._faults.delay_ms
        if high <= 0 or not self._draw("delay"):
            return True
        self._count("delayed")
        return self._sleep_ms(low, high)

    def _hold_back(self) -> bool:
        """Maybe hold the request back so that later ones overtake it; False when the proxy stopped."""
        longest = self._faults.reorder_max_ms
        if longest <= 0 or not self._draw("reorder"):
            return True
        self._count("reordered")
        return self._sleep_ms(0.0, longest)

    def _sleep_ms(self, low: float, high: float) -> bool:
        with self._lock:
            seconds = self._random.uniform(low, high) / 1000
        return not self._stopped.wait(seconds)

    def _draw(self, fault: str) -> bool:
        with self._lock:
            return self._random.random() < getattr(self._faults, fault)

    def _coin(self) -> bool:
        with self._lock:
            return self._random.random() < 0.5

    def _pick(self, answers: list[_Response]) -> _Response | None:
        with self._lock:
            return self._random.choice(answers) if answers else None

    def _count(self, *names: str) -> None:
        with self._lock:
            for name in names:
                self._counts[name] += 1


class _Server(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` at once; the rest wait in the listen backlog."""

    daemon_threads = True
    request_queue_size = 1024   # waiting connections queue here (the kernel caps it at net.core.somaxconn)

    def __init__(self, address: tuple[str, int], proxy: LossyProxy, max_connections: int,
                 stopped: threading.Event) -> None:
        self.proxy = proxy
        self._slots = threading.BoundedSemaphore(max_connections)
        self._stopped = stopped
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        while not self._slots.acquire(timeout=0.05):
            if self._stopped.is_set():
                self.shutdown_request(request)
                return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        with self._open_lock:
            self._open.add(request)
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._open_lock:
                self._open.discard(request)
            self._slots.release()

    def close_connections(self) -> None:
        """End every client connection still open (idle keep-alive ones included)."""
        with self._open_lock:
            open_now = list(self._open)
        for connection in open_now:
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], OSError):     # a client that went away is no news
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Headers and body leave in separate writes: with Nagle's algorithm on, the body waited for the client's
    # delayed ACK, about 40 ms per answer (a WS-MakeConnection client that polls one message per request
    # moved 20 messages/s through the proxy instead of hundreds).
    disable_nagle_algorithm = True
    server: _Server

    def setup(self) -> None:
        self.timeout = self.server.proxy.timeout    # an idle or stalled client gives its slot back
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
        pass

    def _serve(self) -> None:
        body = self._read_body()
        if body is None:
            return
        if urlsplit(self.path).path.startswith(CONTROL_PREFIX):
            self._control(body)
            return
        request = _Request(self.command, self.path, _end_to_end(list(self.headers.items())), body)
        response = self.server.proxy._exchange(request)
        if response is None:
            self._vanish()
        else:
            self._relay(response)

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _serve  # noqa: N815

    def _read_body(self) -> bytes | None:
        """The request body, or None after the proxy answered 400 or 413 (the connection then closes)."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return self._read_chunked()
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if length < 0:
            return self._refuse(400, "bad Content-Length")
        if length > self.server.proxy.max_body:
            return self._refuse(413, f"request body over the proxy's limit of {self.server.proxy.max_body} bytes")
        return self.rfile.read(length)

    def _read_chunked(self) -> bytes | None:
        chunks: list[bytes] = []
        total = 0
        while True:
            try:
                size = int(self.rfile.readline(1024).split(b";")[0].strip(), 16)
            except ValueError:
                size = -1
            if size < 0:
                return self._refuse(400, "bad chunked body")
            total += size
            if total > self.server.proxy.max_body:
                return self._refuse(413, f"request body over the proxy's limit of {self.server.proxy.max_body} bytes")
            if size == 0:
                break
            chunks.append(self.rfile.read(size))
            self.rfile.readline(1024)
        while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
            pass                                    # trailers end at an empty line
        return b"".join(chunks)

    def _control(self, body: bytes) -> None:
        proxy = self.server.proxy
        route = (self.command, urlsplit(self.path).path)
        if route == ("GET", STATS_PATH):
            self._json(200, proxy.stats())
        elif route == ("GET", FAULTS_PATH):
            self._json(200, proxy.faults())
        elif route == ("POST", FAULTS_PATH):
            self._change_faults(body)
        else:
            self._json(404, {"error": f"the proxy answers GET {STATS_PATH}, GET and POST {FAULTS_PATH}"})

    def _change_faults(self, body: bytes) -> None:
        try:
            changes = json.loads(body or b"{}")
            if not isinstance(changes, dict):
                raise ConfigurationError('the body is a JSON object such as {"drop_request": 0}')
            self.server.proxy.set_faults(**changes)
        except (ValueError, ConfigurationError) as exc:
            self._json(400, {"error": str(exc)})
            return
        self._json(200, self.server.proxy.faults())

    def _refuse(self, status: int, reason: str) -> None:
        self.server.proxy._count("rejected")
        self.close_connection = True                # the unread body must not be taken for the next request
        self._json(status, {"error": reason})

    def _json(self, status: int, payload: dict[str, Any]) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _relay(self, response: _Response) -> None:
        self.send_response_only(response.status, response.reason)
        for key, value in response.headers:
            self.send_header(key, value)
        if self.command != "HEAD" and response.status not in _NO_BODY_STATUS:
            self.send_header("Content-Length", str(len(response.body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(response.body)

    def _vanish(self) -> None:
        """The message is lost: end the connection without a byte of response."""
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m qtp.testing.lossy_proxy",
                                     description="A lossy HTTP proxy on 127.0.0.1 for tests and crash campaigns. "
                                                 "Prints its URL on the first line, runs until SIGTERM/SIGINT.")
    parser.add_argument("--target", required=True, action="append",
                        help="base URL to forward to (loopback only); repeated: replicas, with failover")
    parser.add_argument("--failover-s", type=float, default=None, metavar="SECONDS",
                        help="a target silent this long is passed over for the next (default: --timeout)")
    parser.add_argument("--balance", choices=BALANCES, default="failover",
                        help="several targets: one current with failover, or each in turn (round-robin)")
    parser.add_argument("--down-s", type=float, default=DEFAULT_DOWN_S, metavar="SECONDS",
                        help="round-robin: a target that refused or was silent is skipped this long")
    parser.add_argument("--host", default=BIND_HOST, help=f"address to listen on ({BIND_HOST} only)")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (default: a free one)")
    for name in ("drop_request", "drop_response", "duplicate_request", "reorder"):
        parser.add_argument("--" + name.replace("_", "-"), type=float, default=0.0, metavar="P")
    parser.add_argument("--delay", type=float, default=1.0, metavar="P",
                        help="probability that a direction is delayed within --delay-ms (default 1)")
    parser.add_argument("--delay-ms", type=float, nargs=2, default=(0.0, 0.0), metavar=("MIN", "MAX"))
    parser.add_argument("--reorder-max-ms", type=float, default=0.0, metavar="MS")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--max-body", type=int, default=DEFAULT_MAX_BODY, metavar="BYTES")
    parser.add_argument("--max-connections", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS")
    return parser


def main(argv: list[str] | None = None) -> int:
    options = vars(_parser().parse_args(argv))
    try:
        proxy = LossyProxy(options.pop("target"), **options)
    except (ConfigurationError, OSError) as exc:
        print(f"lossy_proxy: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    with proxy.start():
        print(proxy.url, flush=True)
        while not stop.wait(1.0):
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
