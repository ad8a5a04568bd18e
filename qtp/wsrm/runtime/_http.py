"""The node's HTTP/1.1 server: connections on one asyncio event loop, complete requests to a thread pool.

Why it is built this way: a node must keep answering its peers (and ``/health``) whatever a client does
with its sockets. Every connection is a coroutine on the loop, so a silent, slow or half-sent one holds no
thread and little memory (a TLS connection about 70 KB: asyncio's 256 KiB read buffer is cut to 16 KiB);
only a request that has fully arrived (head and body) reaches the pool of ``[limits] http_threads``
threads running the WSGI application. The bounds, all in ``[limits]``:

- the TLS handshake runs on the loop (``loop.connect_accepted_socket`` with a handshake timeout), never in
  the accepting code: a client that stalls it is dropped after ``http_handshake_timeout``;
- a connection waits at most ``http_idle_timeout`` for the first byte of its next request (keep-alive);
  from that byte, the head and the body must have arrived within ``http_request_timeout`` (the time spent
  waiting for room in the body budget below is not the client's and is not counted; that wait has its own
  ``http_request_timeout``, then 503);
- connections take turns: one request at a time each, the loop yielded between them, and the answer to
  one must have left the process before the next is read (a client that pipelines thousands of requests
  and reads nothing holds one answer and delays nobody);
- one client address holds at most ``max_connections_per_address`` connections, handshakes included; the
  next ones are closed as soon as they are accepted; the node holds at most ``max_connections``: at that
  bound a newcomer closes the connection longest without a request under way (a stalled handshake, an idle
  keep-alive), so many addresses holding stalled connections cannot lock honest peers out;
- request bodies over ``LARGE`` bytes are read only while their bytes fit in ``max_body_memory`` together
  with the other large bodies being read or handled; the others wait, their bytes left in the kernel's
  buffers (TCP then slows the sender). When the last large body is done, and after a burst of closed
  connections, ``malloc_trim`` hands the freed heap back to the system (glibc otherwise keeps it for the
  next allocation, for good).

``GET /health`` is answered on the loop, without the pool: it says whether the node has started (given the
query: a replica of a node whose replicas share the work answers ``/health?qtp-slot=k`` for slot k), and a
pool busy with slow handlers does not make a healthy node look dead.
"""

from __future__ import annotations

import asyncio
import collections
import ctypes
import ctypes.util
import gc
import io
import logging
import socket
import ssl
import sys
import threading
from asyncio import sslproto
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable
from urllib.parse import unquote

from qtp.wsrm.runtime._refusals import refusals

log = logging.getLogger("qtp.wsrm.http")

MAX_HEAD = 64 * 1024         # request line and headers
MAX_HEADERS = 100
LARGE = 64 * 1024            # bodies above this take room in the body budget
TRIM_DELAY = 0.5             # seconds without a large body or a closed connection before the heap is trimmed
TRIM_EVERY = 5.0             # seconds at most between trims while connections keep closing
TRIM_CONNECTIONS = 100       # connections closed that make a burst worth a trim
TLS_READ = 16 * 1024         # bytes a TLS connection reads at once (a TLS record's plaintext at most)
BODY_READ = 256 * 1024       # bytes per read of a body (the reader's buffer never holds a whole one)
RELEASE_BODY = "qtp.release_body"  # environ: a large body's room handed back before the answer (call once, any thread)
CLOSE_GRACE = 5.0            # seconds a closing connection may take to deliver its last answer

Answer = tuple[str, list[tuple[str, str]], list[bytes]]  # status line, headers, body chunks
_REASONS = {400: "Bad Request", 411: "Length Required", 413: "Content Too Large",
            431: "Request Header Fields Too Large", 500: "Internal Server Error", 505: "HTTP Version Not Supported"}


class _Budget:
    """Bytes of large bodies held at once, handed out first come, first served (a large request is not
    overtaken for ever by smaller ones). ``take(n)`` waits until ``n`` bytes are free; ``give(n)`` returns them."""

    def __init__(self, total: int):
        self.total = total
        self.free = total
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    async def take(self, n: int) -> None:
        if not self._waiters and self.free >= n:
            self.free -= n
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append((n, waiter))
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.give(n)  # granted as it was cancelled: hand it on
            else:
                self._waiters.remove((n, waiter))
                self._wake()
            raise

    def give(self, n: int) -> None:
        self.free += n
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self._waiters[0][0] <= self.free:
            n, waiter = self._waiters.popleft()
            self.free -= n
            waiter.set_result(None)

    @property
    def idle(self) -> bool:
        return self.free == self.total


def _glibc(function: str) -> Any:
    """A function of glibc's malloc, or None (another C library, another system)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), function)
    except (OSError, AttributeError):  # musl and others
        return None


def _trimmer() -> Callable[[], None]:
    """glibc's ``malloc_trim(0)`` (returns free heap pages to the system), or nothing elsewhere."""
    trim = _glibc("malloc_trim")
    if trim is None:
        return lambda: None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0) and None


M_ARENA_MAX = -8


def single_malloc_arena() -> None:
    """One glibc malloc arena for the whole process, as ``MALLOC_ARENA_MAX=1`` would do; to be called before
    the process starts threads (``qtp serve`` does; an application embedding a node sets the variable).

    glibc gives threads arenas of their own (up to 8 per core); memory freed in one of them stays with it,
    and ``malloc_trim`` does not give back the free top of a thread's heap: a pool thread that had parsed
    one large envelope kept about its size for good (16 threads, 16 times), and with two arenas 8 MB stayed
    after the 16 x 4 MiB attack. In the main arena everything freed is trimmed. Threads still allocate small
    blocks without a lock (glibc's per-thread cache), and Python's own objects come from pymalloc."""
    mallopt = _glibc("mallopt")
    if mallopt is not None:
        mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        mallopt(M_ARENA_MAX, 1)


class _TlsProtocol(sslproto.SSLProtocol):
    """asyncio's TLS protocol with a 16 KiB read buffer instead of 256 KiB: asyncio allocates (and fills) the
    buffer when the connection is accepted, so 640 half-sent handshakes held 210 MB, and freed in blocks of
    that size it stayed in the heap. Smaller reads only mean more of them for a large body."""

    max_size = TLS_READ


class _Protocol(asyncio.StreamReaderProtocol):
    """A stream protocol that keeps the transport it was given (behind TLS, the one that decrypts)."""

    transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        super().connection_made(transport)


class _Refused(Exception):
    """A request that is answered with ``status`` and then the connection is closed."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status


class HttpServer:
    """``HttpServer(app, host, port, limits, tls=context, health=callable).start()`` serves the WSGI ``app``
    until ``stop()``. ``health(query)`` is True once the node has started (``query``: the request's query
    string), and its answer carries ``health_headers`` too (the node's boot); ``refused(reason)`` is told of
    each connection closed by a limit: ``connections`` (the per-address cap) or ``deadline`` (handshake or
    request too slow)."""

    def __init__(self, app: Callable[..., Iterable[bytes]], host: str, port: int, limits: Any,
                 tls: ssl.SSLContext | None = None, health: Callable[[str], bool] | None = None,
                 refused: Callable[[str], None] = lambda reason: None,
                 health_headers: tuple[tuple[str, str], ...] = ()):
        self.app, self.host, self.port, self.limits, self.tls, self.health = app, host, port, limits, tls, health
        self.refused = refused
        self.health_headers = list(health_headers)
        self.refused_connections = 0
        self._open: dict[str, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._budget = _Budget(limits.max_body_memory)
        self._trim = _trimmer()
        self._trimming: asyncio.TimerHandle | None = None
        self._trim_asked = 0.0  # when the pending trim was first asked for
        self._closed = 0        # connections closed since the last trim
        self._quiet: dict[asyncio.Task[None], None] = {}  # connections without a request under way, oldest first
        self._pool = ThreadPoolExecutor(max_workers=limits.http_threads, thread_name_prefix="qtp-http")
        self._loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None
        self._acceptor: asyncio.Task[None] | None = None
        self._listener: socket.socket | None = None
        self._scheme = "https" if tls is not None else "http"

    # ------------------------------------------------------------------ running

    def start(self) -> None:
        """Bind (errors such as a port in use are raised here) and serve in thread ``qtp-http``."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # A burst of connections waits in the kernel's queue until the loop accepts them; a full queue drops
        # the next SYN, which the client repeats only after a second: a queue as long as the connections the
        # node keeps (the kernel caps it at net.core.somaxconn)
        backlog = max(128, self.limits.max_connections)
        self._listener = socket.create_server((self.host, self.port), family=family, backlog=backlog)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]  # the one the system chose, for port 0
        self._thread = threading.Thread(target=self._run, name="qtp-http", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Close the listener and every connection (a request being handled is not waited for past 2 s)."""
        if self._thread is None:
            return
        future = asyncio.run_coroutine_threadsafe(self._close(), self._loop)
        try:
            future.result(timeout=5)
        except Exception as exc:  # the loop is stuck or gone: the daemon thread ends with the process
            log.warning("the HTTP server did not close cleanly: %r", exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._thread = None
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._acceptor = self._loop.create_task(self._accept())
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    async def _close(self) -> None:
        assert self._listener is not None and self._acceptor is not None
        self._acceptor.cancel()
        self._listener.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2)

    async def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, address = await self._loop.sock_accept(self._listener)
            except OSError as exc:
                if self._listener.fileno() < 0:
                    return
                log.warning("accept failed: %s", exc)  # out of descriptors, say: try again shortly
                await asyncio.sleep(0.1)
                continue
            client = address[0]
            if self._open.get(client, 0) >= self.limits.max_connections_per_address:
                self.refused_connections += 1
                refusals.warn(log, "connections", "refused a connection from %s: it holds %d already ([limits] "
                              "max_connections_per_address)", client, self._open[client])
                sock.close()
                self.refused("connections")
                continue
            if len(self._tasks) >= self.limits.max_connections and not self._make_room():
                sock.close()
                self.refused("connections")
                continue
            self._open[client] = self._open.get(client, 0) + 1
            task = self._loop.create_task(self._connection(sock, address))
            self._tasks.add(task)
            await asyncio.sleep(0)  # the task starts (and counts as quiet) before the next accept

    def _make_room(self) -> bool:
        """At ``max_connections``: close the connection that has waited longest without a request under way
        (a stalled TLS handshake, an idle keep-alive), so that addresses holding connections open cannot
        lock newcomers out; False when every connection is in the middle of a request."""
        if not self._quiet:
            self.refused_connections += 1
            if self.refused_connections % 1000 == 1:
                log.warning("refused a connection: %d are open, each with a request under way ([limits] "
                            "max_connections)", len(self._tasks))
            return False
        oldest = next(iter(self._quiet))
        del self._quiet[oldest]
        oldest.cancel()
        self.refused("connections")
        return True

    # ------------------------------------------------------------------ one connection

    async def _connection(self, sock: socket.socket, address: Any) -> None:
        client = address[0]
        task = asyncio.current_task()
        assert task is not None
        self._quiet[task] = None  # until its first request begins; only a started task is ever cancelled
        raw: asyncio.BaseTransport | None = None
        writer: asyncio.StreamWriter | None = None
        finished = False
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            reader = asyncio.StreamReader(limit=MAX_HEAD)
            protocol = _Protocol(reader)
            async with asyncio.timeout(self.limits.http_handshake_timeout):
                if self.tls is None:
                    raw, _ = await self._loop.connect_accepted_socket(lambda: protocol, sock)
                else:  # asyncio's own handshake timeout is a ConnectionAbortedError
                    handshake = self._loop.create_future()
                    tls = _TlsProtocol(self._loop, protocol, self.tls, handshake, server_side=True,
                                       ssl_handshake_timeout=self.limits.http_handshake_timeout + 1)
                    raw, _ = await self._loop.connect_accepted_socket(lambda: tls, sock)
                    await handshake
            transport = protocol.transport
            assert transport is not None
            transport.set_write_buffer_limits(high=0)  # an answer leaves the process before the next request is read
            writer = asyncio.StreamWriter(transport, protocol, reader, self._loop)
            base = self._environ(writer, address)
            while await self._exchange(reader, writer, base):
                pass
            finished = True
        except asyncio.TimeoutError:
            self.refused("deadline")
        except (OSError, EOFError, ssl.SSLError, asyncio.IncompleteReadError):
            pass  # the client went away or broke TLS: nothing to answer
        except asyncio.CancelledError:
            pass  # the server is stopping
        except Exception:
            log.exception("HTTP connection from %s failed", client)
        finally:
            self._quiet.pop(task, None)
            if writer is None:
                if raw is not None:
                    raw.abort()
                else:
                    sock.close()
            elif finished:  # the last answer is flushed, if the client reads it soon
                writer.close()
                self._loop.call_later(CLOSE_GRACE, writer.transport.abort)
            else:
                writer.transport.abort()
            left = self._open.get(client, 1) - 1
            if left:
                self._open[client] = left
            else:
                self._open.pop(client, None)
            self._tasks.discard(task)
            self._closed += 1
            if self._closed >= TRIM_CONNECTIONS:  # what a burst of them held goes back to the system
                self._trim_soon()

    def _environ(self, writer: asyncio.StreamWriter, address: Any) -> dict[str, Any]:
        """What every request of the connection shares: addresses, scheme and the client's certificate."""
        base: dict[str, Any] = {
            "SERVER_NAME": self.host, "SERVER_PORT": str(self.port), "SCRIPT_NAME": "",
            "REMOTE_ADDR": address[0], "REMOTE_PORT": str(address[1]),
            "wsgi.version": (1, 0), "wsgi.url_scheme": self._scheme, "wsgi.errors": sys.stderr,
            "wsgi.multithread": True, "wsgi.multiprocess": False, "wsgi.run_once": False,
        }
        tls = writer.get_extra_info("ssl_object")
        if tls is not None:
            base["HTTPS"] = "on"
            der = tls.getpeercert(binary_form=True)
            base["SSL_CLIENT_VERIFY"] = "SUCCESS" if der else "NONE"
            if der:
                base["SSL_CLIENT_CERT"] = ssl.DER_cert_to_PEM_cert(der)
                subject = dict(pair for rdn in tls.getpeercert().get("subject", ()) for pair in rdn)
                if "commonName" in subject:
                    base["SSL_CLIENT_S_DN_CN"] = subject["commonName"]
        return base

    async def _exchange(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        base: dict[str, Any]) -> bool:
        """Read one request, answer it; True when the connection stays open for the next one."""
        await asyncio.sleep(0)  # requests already buffered (pipelined) wait their turn behind other connections'
        task = asyncio.current_task()
        assert task is not None
        self._quiet[task] = None
        try:
            async with asyncio.timeout(self.limits.http_idle_timeout):
                first = await reader.read(1)
        except asyncio.TimeoutError:
            return False  # idle: closed, nothing refused
        finally:
            self._quiet.pop(task, None)
        if not first:
            return False
        deadline = self._loop.time() + self.limits.http_request_timeout
        try:
            async with asyncio.timeout_at(deadline):
                head = first + await reader.readuntil(b"\r\n\r\n")
            environ, length, keep = _parse_head(head, base, self.limits.max_request_bytes)
        except asyncio.LimitOverrunError:
            return await self._refuse(writer, _Refused(431, "the request head is over 64 KiB"))
        except _Refused as refused:
            return await self._refuse(writer, refused)
        if environ["PATH_INFO"] == "/health" and environ["REQUEST_METHOD"] == "GET" and self.health is not None:
            started = self.health(environ.get("QUERY_STRING", ""))
            status, headers, chunks = _plain(200 if started else 503, "ok" if started else "not serving")
            return await self._write(writer, status, headers + self.health_headers, chunks, keep, deadline)
        large = length > LARGE
        given = False

        def give() -> None:  # on the loop: the body's room back in the budget, once
            nonlocal given
            if not given:
                given = True
                self._budget.give(length)
                if self._budget.idle:
                    self._trim_soon()

        if large:
            waited = self._loop.time()
            try:
                async with asyncio.timeout(self.limits.http_request_timeout):
                    await self._budget.take(length)
            except asyncio.TimeoutError:
                self.refused("deadline")
                return await self._refuse(writer, _Refused(503, "too many large requests at once; try again later"))
            deadline += self._loop.time() - waited
        try:
            if length and environ.get("HTTP_EXPECT", "").lower() == "100-continue":
                writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            async with asyncio.timeout_at(deadline):
                body = await _read_body(reader, length)
            environ["wsgi.input"] = io.BytesIO(body)
            if large:  # the application may hand the body's room back early (a replica forwarding it)
                environ[RELEASE_BODY] = lambda: self._loop.call_soon_threadsafe(give)
            head_only = environ["REQUEST_METHOD"] == "HEAD"
            del body
            status, headers, chunks = await self._loop.run_in_executor(self._pool, _call, self.app, environ)
            del environ
            keep = keep and not any(k.lower() == "connection" and v.lower() == "close" for k, v in headers)
            if head_only:  # the length of the answer, not the answer
                chunks = []
            return await self._write(writer, status, headers, chunks, keep, deadline)
        finally:
            if large:
                give()

    def _trim_soon(self) -> None:
        """``malloc_trim`` (in a thread) once large bodies and closing connections have stopped coming for
        ``TRIM_DELAY``: one call per burst, or one every ``TRIM_EVERY`` while a burst lasts."""
        now = self._loop.time()
        if self._trimming is None:
            self._trim_asked = now
        else:
            self._trimming.cancel()
        self._trimming = self._loop.call_at(min(now + TRIM_DELAY, self._trim_asked + TRIM_EVERY), self._trim_now)

    def _trim_now(self) -> None:
        self._trimming = None
        if self._budget.idle:  # else the last large body asks again when it is done
            self._closed = 0
            gc.collect()  # a closed connection's protocol, transport and TLS objects refer to each other
            self._loop.run_in_executor(None, self._trim)

    async def _refuse(self, writer: asyncio.StreamWriter, refused: _Refused) -> bool:
        status, headers, chunks = _plain(refused.status, str(refused))
        return await self._write(writer, status, headers, chunks, False,
                                 self._loop.time() + self.limits.http_request_timeout)

    async def _write(self, writer: asyncio.StreamWriter, status: str, headers: list[tuple[str, str]],
                     chunks: list[bytes], keep: bool, deadline: float) -> bool:
        lines = [f"HTTP/1.1 {status}"]
        lines += [f"{k}: {v}" for k, v in headers]
        if not any(k.lower() == "content-length" for k, _ in headers):
            lines.append(f"Content-Length: {sum(len(c) for c in chunks)}")
        if not keep:
            lines.append("Connection: close")
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        writer.writelines(chunks)
        # the answer's own deadline: a client that does not read it does not hold it in memory for ever
        async with asyncio.timeout_at(max(deadline, self._loop.time() + self.limits.http_request_timeout)):
            await writer.drain()
        return keep


async def _read_body(reader: asyncio.StreamReader, length: int) -> bytes:
    """``length`` bytes, read a slice at a time and joined once (``readexactly`` would first gather the whole
    body in the reader's buffer and then copy it twice)."""
    chunks = []
    left = length
    while left:
        chunk = await reader.read(min(left, BODY_READ))
        if not chunk:
            raise asyncio.IncompleteReadError(b"", left)
        chunks.append(chunk)
        left -= len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _parse_head(head: bytes, base: dict[str, Any], max_body: int) -> tuple[dict[str, Any], int, bool]:
    """The WSGI environ of a request head, its body's length and whether the connection may be kept."""
    lines = head.lstrip(b"\r\n")[:-4].decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not (parts[0].isascii() and parts[0].isalpha()):
        raise _Refused(400, "malformed request line")
    method, target, version = parts
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise _Refused(505, "HTTP/1.1 or HTTP/1.0 only")
    if len(lines) > MAX_HEADERS + 1:
        raise _Refused(431, f"more than {MAX_HEADERS} header fields")
    path, _, query = target.partition("?")
    environ = dict(base, REQUEST_METHOD=method, PATH_INFO=unquote(path, "latin-1"), QUERY_STRING=query,
                   SERVER_PROTOCOL=version)
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep and "_" in name:  # dropped: X_Qtp_Signature would pose as X-Qtp-Signature in the environ
            continue
        if not sep or not name or name != name.strip():
            raise _Refused(400, "malformed header field")
        if "\r" in value or "\n" in value or "\0" in value:  # RFC 9110 5.5: refused, not passed on
            raise _Refused(400, "a header field value holds CR, LF or NUL")
        key = name.upper().replace("-", "_")
        key = key if key in ("CONTENT_TYPE", "CONTENT_LENGTH") else "HTTP_" + key
        value = value.strip()
        environ[key] = f"{environ[key]},{value}" if key in environ and key.startswith("HTTP_") else value
    if "HTTP_TRANSFER_ENCODING" in environ:
        raise _Refused(411, "a Content-Length is required (no Transfer-Encoding)")
    length_text = environ.get("CONTENT_LENGTH", "")
    if length_text and not (length_text.isascii() and length_text.isdigit()):
        raise _Refused(400, "malformed Content-Length")
    length = int(length_text[:18] or 0) if len(length_text) <= 18 else max_body + 1
    if length > max_body:
        raise _Refused(413, f"the request is over this node's limit of {max_body} bytes")
    connection = environ.get("HTTP_CONNECTION", "").lower()
    keep = "close" not in connection if version == "HTTP/1.1" else "keep-alive" in connection
    return environ, length, keep


def _call(app: Callable[..., Iterable[bytes]], environ: dict[str, Any]) -> Answer:
    """Run the WSGI application (in a pool thread) and collect its answer."""
    answer: list[Any] = []

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Callable[[bytes], None]:
        answer[:] = [status, list(headers)]
        return lambda data: None  # the write() callable: qtp's endpoint returns its body instead

    try:
        result = app(environ, start_response)
        try:
            chunks = [bytes(c) for c in result]
        finally:
            close = getattr(result, "close", None)
            if close is not None:
                close()
    except Exception:
        log.exception("the application failed")
        return _plain(500, "internal error")
    return answer[0], answer[1], chunks


def _plain(status: int, text: str) -> Answer:
    body = (text + "\n").encode()
    reason = _REASONS.get(status) or ("OK" if status == 200 else "Service Unavailable")
    return f"{status} {reason}", [("Content-Type", "text/plain; charset=utf-8"),
                                  ("Content-Length", str(len(body)))], [body]
