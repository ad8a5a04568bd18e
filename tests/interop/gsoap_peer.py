"""The gSOAP WS-RM peer for interop tests: build it, run its server, run its client, watch the wire.

gSOAP (Genivia) is the one third-party WS-RM stack installable here (Debian ``gsoap``/``libgsoap-dev``);
``tests/interop/gsoap`` holds a small client and server on its wsrm plugin. This module builds them when
missing or older than their sources and runs them as subprocesses:

    from gsoap_peer import GsoapServer, RecordingProxy, run_client

    with GsoapServer(47110, rm="1.1") as server:                  # a gSOAP RM Destination
        result = run_client(server.url, rm="1.1", soap="1.2", count=5)   # a gSOAP RM Source
        assert result.ok
        assert [d.number for d in server.deliveries()] == [1, 2, 3, 4, 5]

    with RecordingProxy(47111, "http://127.0.0.1:47110/", drop=lambda n, body: ...) as proxy:
        ...  # point a client at proxy.url; proxy.exchanges holds every request and response

gSOAP fixes the WS-RM version at build time (one binary each for 1.0 and 1.1) and always uses
WS-Addressing 2005/08; the SOAP version of the client is chosen per run, the server answers in the
version it was spoken to. Ports: choose them in 47000-47999.
"""

from __future__ import annotations

import fcntl
import http.client
import re
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent / "gsoap"
BUILD_DIR = SOURCE_DIR / "build"
RM_VERSIONS = ("1.0", "1.1")
SOAP_VERSIONS = ("1.1", "1.2")
_SOURCES = ("build.sh", "client.c", "server.c", "rmtest.h", "rmtest10.h", "rmtest11.h")
_build_lock = threading.Lock()


class PeerError(RuntimeError):
    """The gSOAP peer could not be built or started."""


def build(force: bool = False) -> Path:
    """Build the four binaries (client and server for WS-RM 1.0 and 1.1) unless they are up to date.

    Returns the build directory. Raises PeerError with the compiler's output when the build fails.
    """
    BUILD_DIR.mkdir(exist_ok=True)
    with _build_lock, open(BUILD_DIR / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # make test's xdist workers share the build folder: one builds it
        binaries = [BUILD_DIR / f"{kind}-rm{v}" for kind in ("client", "server") for v in ("10", "11")]
        newest_source = max((SOURCE_DIR / name).stat().st_mtime for name in _SOURCES)
        if not force and all(b.exists() and b.stat().st_mtime >= newest_source for b in binaries):
            return BUILD_DIR
        done = subprocess.run(["bash", str(SOURCE_DIR / "build.sh"), str(BUILD_DIR)], capture_output=True,
                              text=True, timeout=600)
        if done.returncode != 0:
            raise PeerError(f"building the gSOAP peer failed:\n{done.stdout}\n{done.stderr}")
        return BUILD_DIR


def binary(kind: str, rm: str) -> Path:
    """The path of ``client`` or ``server`` for WS-RM ``rm`` ("1.0" or "1.1"), built if needed."""
    if kind not in ("client", "server") or rm not in RM_VERSIONS:
        raise ValueError(f"no gSOAP {kind} for WS-RM {rm}")
    return build() / f"{kind}-rm{rm.replace('.', '')}"


# --------------------------------------------------------------------------------------------- client

_EVENT = re.compile(r"^([A-Z]+)((?:\s+[a-z]+=(?:\"[^\"]*\"|\S*))*)\s*$")
_PAIR = re.compile(r"([a-z]+)=(\"[^\"]*\"|\S*)")


def _parse_event(line: str) -> tuple[str, dict[str, str]] | None:
    match = _EVENT.match(line)
    if match is None:
        return None
    values = {key: value.strip('"') for key, value in _PAIR.findall(match.group(2))}
    return match.group(1), values


@dataclass(frozen=True)
class ClientResult:
    """What the gSOAP client did: its exit code, its event lines parsed, and its raw output."""

    returncode: int
    events: tuple[tuple[str, dict[str, str]], ...]
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        """True when every message was acknowledged and the sequence terminated (exit status 0)."""
        return self.returncode == 0

    @property
    def sequence_id(self) -> str | None:
        """The identifier the destination gave the sequence (None when creation failed)."""
        return next((values["id"] for name, values in self.events if name == "CREATED"), None)

    @property
    def sent(self) -> list[int]:
        """Message numbers the client sent and got an HTTP answer for, in order."""
        return [int(values["number"]) for name, values in self.events if name == "SENT"]

    @classmethod
    def of(cls, returncode: int, stdout: str, stderr: str) -> ClientResult:
        """The result of a client run from its exit code and output (for tests that start it themselves)."""
        events = tuple(event for line in stdout.splitlines() if (event := _parse_event(line)) is not None)
        return cls(returncode, events, stdout, stderr)

    def named(self, name: str) -> list[dict[str, str]]:
        """Every event of one kind (START, CREATED, SENT, CLOSED, RESENT, TERMINATED, ERROR, EXIT)."""
        return [values for event, values in self.events if event == name]


def client_command(url: str, *, rm: str = "1.1", soap: str = "1.1", count: int = 3, prefix: str = "message",
                   rounds: int = 5, tries: int = 20, timeout: int = 5, pause_ms: int = 200,
                   expires_ms: int = 600000) -> list[str]:
    """The command line that runs the gSOAP client (for tests that start it themselves)."""
    if soap not in SOAP_VERSIONS:
        raise ValueError(f"gSOAP speaks SOAP 1.1 and 1.2, not {soap}")
    return [str(binary("client", rm)), "--url", url, "--soap", soap, "--count", str(count), "--prefix", prefix,
            "--rounds", str(rounds), "--tries", str(tries), "--timeout", str(timeout), "--pause-ms",
            str(pause_ms), "--expires-ms", str(expires_ms)]


def run_client(url: str, *, rm: str = "1.1", soap: str = "1.1", count: int = 3, prefix: str = "message",
               rounds: int = 5, tries: int = 20, timeout: int = 5, pause_ms: int = 200,
               expires_ms: int = 600000, deadline: float = 120.0) -> ClientResult:
    """Run the gSOAP RM Source once against ``url`` and wait for it (at most ``deadline`` seconds).

    It creates a sequence (no Offer, anonymous AcksTo and ReplyTo), sends ``count`` one-way messages
    whose body is ``<ns:deliver xmlns:ns="urn:qtp:interop:gsoap"><text>{prefix}-{n}</text></ns:deliver>``
    with Action ``urn:qtp:interop:gsoap/deliver``, each with AckRequested; retries a message up to ``tries``
    times on transport errors; completes the sequence (1.1: CloseSequence, 1.0: LastMessage); resends the
    unacknowledged messages for up to ``rounds`` rounds; and terminates. ``timeout`` is gSOAP's connect,
    send and receive timeout in seconds.
    """
    command = client_command(url, rm=rm, soap=soap, count=count, prefix=prefix, rounds=rounds, tries=tries,
                             timeout=timeout, pause_ms=pause_ms, expires_ms=expires_ms)
    done = subprocess.run(command, capture_output=True, text=True, timeout=deadline)
    return ClientResult.of(done.returncode, done.stdout, done.stderr)


# --------------------------------------------------------------------------------------------- server


@dataclass(frozen=True)
class Delivery:
    """One message the gSOAP destination handed to its application."""

    identifier: str
    number: int
    text: str


class GsoapServer:
    """The gSOAP RM Destination as a subprocess listening on 127.0.0.1:``port``.

    ``wait_ms`` > 0 makes it hold a message that arrives after a gap for up to that long
    (soap_wsrm_check_and_wait); with 0 it discards such a message and the source must resend it.
    ``pulse_ms``: how often, when idle, it sends acknowledgements to addressable AcksTo endpoints.
    ``mode``: "check" runs soap_wsrm_check and then answers 202, so faults reach the source; "empty" uses
    soap_wsrm_check_send_empty_response (the plugin's documented one-way call), which answers 202 before
    checking anything, so a message for an unknown or terminated sequence still gets 202.
    Use as a context manager, or call ``start()`` and ``stop()``.
    """

    def __init__(self, port: int, rm: str = "1.1", *, log: Path | None = None, wait_ms: int = 0,
                 pulse_ms: int = 200, mode: str = "check"):
        if mode not in ("check", "empty"):
            raise ValueError(f"mode is 'check' or 'empty', not {mode!r}")
        self.port, self.rm, self.wait_ms, self.pulse_ms, self.mode = port, rm, wait_ms, pulse_ms, mode
        self.log = log
        self._process: subprocess.Popen[str] | None = None
        self._stdout: list[str] = []
        self._stderr: list[str] = []
        self._reader: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self, ready_timeout: float = 10.0) -> GsoapServer:
        if self.running:
            return self
        command = [str(binary("server", self.rm)), "--port", str(self.port), "--wait-ms", str(self.wait_ms),
                   "--pulse-ms", str(self.pulse_ms), "--mode", self.mode]
        if self.log is not None:
            command += ["--log", str(self.log)]
        self._stdout, self._stderr = [], []
        self._process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                         bufsize=1)
        ready = threading.Event()
        self._reader = threading.Thread(target=self._read, args=(self._process, ready), daemon=True)
        self._reader.start()
        threading.Thread(target=self._read_errors, args=(self._process,), daemon=True).start()
        if not ready.wait(ready_timeout):
            self.stop()
            raise PeerError(f"the gSOAP server did not start on port {self.port}: {''.join(self._stderr)}")
        return self

    def _read(self, process: subprocess.Popen[str], ready: threading.Event) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            self._stdout.append(line)
            if line.startswith("READY"):
                ready.set()

    def _read_errors(self, process: subprocess.Popen[str]) -> None:
        assert process.stderr is not None
        for line in process.stderr:
            self._stderr.append(line)

    def stop(self, timeout: float = 5.0) -> int | None:
        """Stop the server (SIGTERM, then SIGKILL); returns its exit code."""
        process, self._process = self._process, None
        if process is None:
            return None
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout)
        if self._reader is not None:
            self._reader.join(timeout)
        return process.returncode

    def kill(self) -> None:
        """SIGKILL, as a crash; ``start()`` brings up a fresh server (gSOAP keeps sequences in memory only)."""
        if self._process is not None:
            self._process.kill()
            self._process.wait()
        self.stop()

    def lines(self) -> list[str]:
        """The server's report: stdout lines, or the --log file's lines when one was given."""
        if self.log is not None:
            return self.log.read_text().splitlines() if self.log.exists() else []
        return [line.rstrip("\n") for line in list(self._stdout)]

    @property
    def stderr(self) -> str:
        return "".join(self._stderr)

    def deliveries(self) -> list[Delivery]:
        """Every message delivered so far, in delivery order."""
        found = []
        for line in self.lines():
            event = _parse_event(line)
            if event is not None and event[0] == "DELIVERED":
                values = event[1]
                found.append(Delivery(values["id"], int(values["number"]), values.get("text", "")))
        return found

    def wait_for(self, count: int, timeout: float = 30.0) -> list[Delivery]:
        """Wait until at least ``count`` messages were delivered; returns the deliveries."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            found = self.deliveries()
            if len(found) >= count:
                return found
            time.sleep(0.05)
        return self.deliveries()

    def __enter__(self) -> GsoapServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---------------------------------------------------------------------------------------------- proxy


@dataclass
class Exchange:
    """One HTTP request through the proxy and its answer (``status`` None when none was returned)."""

    index: int
    path: str
    request_headers: dict[str, str]
    request: bytes
    status: int | None = None
    response_headers: dict[str, str] = field(default_factory=dict)
    response: bytes = b""
    dropped: str | None = None  # "request", "response" or "swallow": see RecordingProxy


Drop = Callable[[int, bytes], str | None]


class RecordingProxy:
    """An HTTP proxy on 127.0.0.1:``port`` that forwards POSTs to ``target`` and records each exchange.

    ``drop(index, request_body)`` may return "request" (the request is not forwarded and the connection is
    closed without an answer: the sender sees a transport error), "response" (forwarded, but the answer is
    lost: the sender sees a transport error although the message arrived), or "swallow" (not forwarded,
    yet answered 202 with an empty body: a message lost by a store-and-forward intermediary, which the
    sender cannot notice); None forwards normally. ``index`` counts requests from 0.
    """

    def __init__(self, port: int, target: str, drop: Drop | None = None, timeout: float = 30.0):
        self.port, self.target, self.drop, self.timeout = port, target, drop, timeout
        self.exchanges: list[Exchange] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def start(self) -> RecordingProxy:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                proxy._handle(self)

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def _handle(self, handler: BaseHTTPRequestHandler) -> None:
        body = _read_body(handler)
        with self._lock:
            exchange = Exchange(len(self.exchanges), handler.path, dict(handler.headers.items()), body)
            self.exchanges.append(exchange)
        verdict = self.drop(exchange.index, body) if self.drop is not None else None
        if verdict == "request":
            exchange.dropped = "request"
            handler.close_connection = True
            return
        if verdict == "swallow":
            exchange.dropped, exchange.status = "swallow", 202
            handler.send_response(202)
            handler.send_header("Content-Length", "0")
            handler.send_header("Connection", "close")
            handler.end_headers()
            handler.close_connection = True
            return
        target = urllib.parse.urlsplit(self.target)
        connection = http.client.HTTPConnection(target.hostname, target.port, timeout=self.timeout)
        try:
            headers = {k: v for k, v in handler.headers.items()
                       if k.lower() in ("content-type", "soapaction", "accept")}
            connection.request("POST", target.path or "/", body=body, headers=headers)
            answer = connection.getresponse()
            exchange.status = answer.status
            exchange.response_headers = dict(answer.getheaders())
            exchange.response = answer.read()
        except OSError as exc:
            exchange.dropped = f"target unreachable: {exc}"
            handler.close_connection = True
            return
        finally:
            connection.close()
        if verdict == "response":
            exchange.dropped = "response"
            handler.close_connection = True
            return
        handler.send_response(exchange.status)
        for name in ("Content-Type",):
            if name in exchange.response_headers:
                handler.send_header(name, exchange.response_headers[name])
        handler.send_header("Content-Length", str(len(exchange.response)))
        handler.send_header("Connection", "close")
        handler.end_headers()
        handler.wfile.write(exchange.response)
        handler.close_connection = True

    def __enter__(self) -> RecordingProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _read_body(handler: BaseHTTPRequestHandler) -> bytes:
    if handler.headers.get("Transfer-Encoding", "").lower() == "chunked":
        chunks = []
        while True:
            size = int(handler.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while handler.rfile.readline().strip():
                    pass
                return b"".join(chunks)
            chunks.append(handler.rfile.read(size))
            handler.rfile.readline()
    length = int(handler.headers.get("Content-Length") or 0)
    return handler.rfile.read(length) if length else b""


def post(url: str, body: bytes, content_type: str, soap_action: str | None = None,
         timeout: float = 10.0) -> tuple[int, dict[str, str], bytes]:
    """POST one envelope (for example one qtp encoded) to a gSOAP endpoint; returns status, headers, body."""
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    headers = {"Content-Type": content_type}
    if soap_action is not None:
        headers["SOAPAction"] = soap_action
    try:
        connection.request("POST", parts.path or "/", body=body, headers=headers)
        answer = connection.getresponse()
        return answer.status, dict(answer.getheaders()), answer.read()
    finally:
        connection.close()


__all__ = [
    "BUILD_DIR", "RM_VERSIONS", "SOAP_VERSIONS", "SOURCE_DIR", "ClientResult", "Delivery", "Exchange",
    "GsoapServer", "PeerError", "RecordingProxy", "binary", "build", "client_command", "post", "run_client",
]
