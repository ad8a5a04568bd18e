"""HAProxy as the load balancer in front of a node's replicas, for tests and benchmarks.

In production a node run as replicas has one address for its peers: a load balancer (HAProxy, nginx, a
Kubernetes Service) in front of the processes (docs/operations.md). ``LossyProxy`` plays that part where
faults are wanted; it is Python and opens a connection to its target for every request, which costs the
machine about as much CPU as a qtp node does. ``Haproxy`` is the real thing, started from the system's
``haproxy`` binary (Debian's package ``haproxy``; ``scripts/system-deps.sh`` installs it):

- requests are spread round-robin, each request on its own (HTTP mode, connections to the replicas kept
  and reused: ``http-reuse always``), as a balancer set up for a service of this kind does;
- a replica that refuses the connection is retried on the next one (``retries``, ``option redispatch``),
  and so is a ``503`` (a takeover under way), with the request buffered for that;
- each replica's ``GET /health`` every second: one that fails it twice (killed, not started yet) gets no
  requests until it answers 200 again;
- one thread (``nbthread 1``): on a small machine it must not take cores from the processes measured;
- with ``slots=N`` (the node's ``[lease] slots``), routing by slot: a request whose URL says
  ``?qtp-slot=k`` (a qtp sender says so for a sequence of slot k; acknowledgements to a slot's AcksTo too)
  goes to the replica that answers ``GET /health?qtp-slot=k`` with 200, i.e. holds slot k; it is checked
  every ``slot_check_ms``. While none does (a takeover, a handover seen late), or for any other request,
  round-robin as above; a replica that gets a request for a slot it does not hold forwards it, as always.

``Haproxy(["http://127.0.0.1:8001/rm", ...], port, folder).start()`` ... ``stop()``; ``per_target()`` gives
the requests each replica answered (from HAProxy's statistics socket), ``pid`` its process for CPU figures.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

from qtp.errors import ConfigurationError
from qtp.wsrm.runtime._ids import SLOT_QUERY

INSTALL_HINT = "install Debian's package haproxy (scripts/system-deps.sh does, as root)"


def haproxy_binary() -> str | None:
    """The system's haproxy, or None."""
    return shutil.which("haproxy") or next((p for p in ("/usr/sbin/haproxy",) if Path(p).exists()), None)


class Haproxy:
    def __init__(self, targets: list[str], port: int, folder: Path, *, timeout_s: float = 30.0, slots: int = 0,
                 slot_check_ms: int = 500):
        binary = haproxy_binary()
        if binary is None:
            raise ConfigurationError(f"no haproxy on this machine: {INSTALL_HINT}")
        if not targets:
            raise ConfigurationError("a balancer needs at least one target")
        if slots < 0 or slot_check_ms < 10:
            raise ConfigurationError(f"slots is 0 (no routing by slot) or more, slot_check_ms 10 or more; got "
                                     f"{slots}, {slot_check_ms}")
        self.binary, self.port, self.folder, self.timeout_s = binary, port, Path(folder), timeout_s
        self.slots, self.slot_check_ms = slots, slot_check_ms
        self.targets = [urlsplit(url) for url in targets]
        for url in self.targets:
            if url.scheme != "http" or url.port is None:
                raise ConfigurationError(f"targets are http://host:port/...; got {url.geturl()!r}")
        self.folder.mkdir(parents=True, exist_ok=True)
        self.config = self.folder / "haproxy.cfg"
        self._socket_dir: Path | None = None  # the statistics socket's, made by start()
        self.log = self.folder / "haproxy.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def socket(self) -> Path:
        """HAProxy's statistics socket (while it runs)."""
        if self._socket_dir is None:
            raise RuntimeError("the balancer is not running")
        return self._socket_dir / "stats.sock"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _render(self) -> str:
        timeout_ms = int(self.timeout_s * 1000)
        servers = "\n".join(f"    server r{i} {url.hostname}:{url.port} check inter 1s fall 2 rise 1"
                            for i, url in enumerate(self.targets))
        routes = "".join(f"    use_backend slot{k} if {{ url_param({SLOT_QUERY}) -m str {k} }} "
                         f"{{ nbsrv(slot{k}) gt 0 }}\n" for k in range(self.slots))
        inter = self.slot_check_ms
        by_slot = "".join(
            f"\nbackend slot{k}\n    option httpchk GET /health?{SLOT_QUERY}={k}\n"
            + "".join(f"    server r{i} {url.hostname}:{url.port} check inter {inter}ms fall 1 rise 1\n"
                      for i, url in enumerate(self.targets))
            for k in range(self.slots))
        return f"""# written by qtp.testing.balancer: round-robin over a node's replicas
global
    nbthread 1
    maxconn 4096
    stats socket {self.socket} mode 600 level admin

defaults
    mode http
    option http-keep-alive
    http-reuse always
    timeout connect 2s
    timeout client {timeout_ms}ms
    timeout server {timeout_ms}ms
    timeout http-keep-alive {timeout_ms}ms
    retries 3
    option redispatch 1
    retry-on conn-failure empty-response 503

frontend node
    bind 127.0.0.1:{self.port}
    option http-buffer-request
{routes}    default_backend replicas

backend replicas
    balance roundrobin
    option httpchk GET /health
{servers}
{by_slot}"""

    def start(self) -> "Haproxy":
        # a Unix socket's path has at most 107 bytes: the statistics socket goes to a short folder of its own
        self._socket_dir = Path(tempfile.mkdtemp(prefix="qtp-haproxy-"))
        self.config.write_text(self._render())
        check = subprocess.run([self.binary, "-c", "-q", "-f", str(self.config)], capture_output=True, text=True)
        if check.returncode != 0:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            self._socket_dir = None
            raise ConfigurationError(f"haproxy refused its configuration: {check.stderr.strip() or check.stdout}")
        with self.log.open("ab") as out:
            self._proc = subprocess.Popen([self.binary, "-db", "-f", str(self.config)], stdout=out,
                                          stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"haproxy exited with {self._proc.returncode}: see {self.log}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"haproxy did not listen on {self.port} within 10 s: see {self.log}")

    def stop(self) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(10)
        self._proc = None
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)
            self._socket_dir = None

    def __enter__(self) -> "Haproxy":
        return self.start() if self._proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def per_target(self) -> dict[str, int]:
        """Requests each replica answered (HTTP responses counted by HAProxy), by target URL."""
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(5)
            sock.connect(str(self.socket))
            sock.sendall(b"show stat\n")
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        lines = data.decode().splitlines()
        header = lines[0].lstrip("# ").split(",")
        out: dict[str, int] = {}
        for line in lines[1:]:
            row = dict(zip(header, line.split(",")))
            proxy, server = row.get("pxname", ""), row.get("svname", "")
            if (proxy == "replicas" or proxy.startswith("slot")) and server[:1] == "r" and server[1:].isdigit():
                url = self.targets[int(server[1:])].geturl()
                out[url] = out.get(url, 0) + sum(int(row.get(f"hrsp_{k}xx") or 0) for k in range(1, 6))
        return out
