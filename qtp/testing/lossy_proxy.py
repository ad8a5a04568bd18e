"""A lossy HTTP proxy for tests and crash campaigns: loopback only, bounded, seeded.

It sits between two nodes and forwards every request to one target, while, with the probabilities it is
given, it

- drops a request (the target never sees it; the client's connection is closed without an answer),
- drops a response (the target processed the request; the client gets no answer),
- duplicates a request (the target sees it twice; the client gets one answer),
- delays requests and responses by a random time, which also reorders concurrent requests.

To an HTTP client a lost message looks like a connection closed without a response (or a timeout): it
cannot know whether the request reached the peer. That is exactly the uncertainty WS-RM resolves with
retransmission and duplicate detection, so it is what the proxy produces. ``GET /__proxy__/stats`` gives
the counters and ``POST /__proxy__/faults`` (JSON) changes the probabilities at run time (e.g. to let
everything drain at the end of a test).

    python -m qtp.testing.lossy_proxy --target http://127.0.0.1:8002 --drop-request 0.1 --seed 7
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, fields
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import requests

_HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
               "transfer-encoding", "upgrade", "host", "content-length"}
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@dataclass
class Faults:
    drop_request: float = 0.0
    drop_response: float = 0.0
    duplicate_request: float = 0.0
    delay: float = 0.0           # probability that a request (and its response) is delayed
    delay_max_ms: float = 0.0


class LossyProxy:
    """``LossyProxy(target, **faults).start()``; ``.url``; ``.stats()``; ``.set_faults(**faults)``; ``.stop()``."""

    def __init__(self, target: str, port: int = 0, seed: int | None = None, max_body: int = 16 * 1024 * 1024,
                 max_connections: int = 64, timeout: float = 30.0, **faults: float):
        if urlsplit(target).hostname not in _LOOPBACK:
            raise ValueError(f"the lossy proxy forwards to loopback only, not {target!r}")
        self.target = target.rstrip("/")
        self.faults = Faults(**faults)
        self.max_body = max_body
        self.timeout = timeout
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_connections)
        self._counts = {k: 0 for k in ("requests", "forwarded", "dropped_requests", "dropped_responses",
                                       "duplicated", "delayed", "errors")}
        self._session = requests.Session()
        self._server = ThreadingHTTPServer(("127.0.0.1", port), _handler(self))
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "LossyProxy":
        self._thread = threading.Thread(target=self._server.serve_forever, name="lossy-proxy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._session.close()

    def __enter__(self) -> "LossyProxy":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def set_faults(self, **faults: float) -> None:
        known = {f.name for f in fields(Faults)}
        if set(faults) - known:
            raise ValueError(f"unknown faults {sorted(set(faults) - known)}; known: {sorted(known)}")
        with self._lock:
            for name, value in faults.items():
                setattr(self.faults, name, float(value))

    def count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def draw(self, name: str) -> bool:
        with self._lock:
            return self._random.random() < getattr(self.faults, name)

    def pause(self) -> None:
        if self.draw("delay"):
            with self._lock:
                seconds = self._random.uniform(0, self.faults.delay_max_ms) / 1000
            self.count("delayed")
            time.sleep(seconds)

    def forward(self, method: str, path: str, headers: dict[str, str], body: bytes) -> requests.Response:
        return self._session.request(method, self.target + path, data=body, headers=headers,
                                     timeout=self.timeout, allow_redirects=False)


def _handler(proxy: LossyProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:  # quiet
            pass

        def do_GET(self) -> None:
            if self.path == "/__proxy__/stats":
                self._reply(200, json.dumps(proxy.stats()).encode(), "application/json")
            else:
                self._relay()

        def do_POST(self) -> None:
            if self.path == "/__proxy__/faults":
                try:
                    proxy.set_faults(**json.loads(self._body() or b"{}"))
                except (ValueError, TypeError) as exc:
                    self._reply(400, str(exc).encode(), "text/plain")
                    return
                self._reply(200, json.dumps(asdict(proxy.faults)).encode(), "application/json")
            else:
                self._relay()

        do_PUT = do_DELETE = do_POST  # noqa: N815

        def _body(self) -> bytes:
            length = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(length) if length else b""

        def _relay(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length > proxy.max_body:
                self.close_connection = True
                self._reply(413, b"request over the proxy's limit", "text/plain")
                return
            body = self.rfile.read(length) if length else b""
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
            proxy.count("requests")
            with proxy._slots:
                proxy.pause()
                if proxy.draw("drop_request"):
                    proxy.count("dropped_requests")
                    self._vanish()
                    return
                try:
                    response = proxy.forward(self.command, self.path, headers, body)
                    if proxy.draw("duplicate_request"):
                        proxy.count("duplicated")
                        response = proxy.forward(self.command, self.path, headers, body)
                except requests.RequestException:
                    proxy.count("errors")
                    self._vanish()
                    return
                proxy.count("forwarded")
                proxy.pause()
                if proxy.draw("drop_response"):
                    proxy.count("dropped_responses")
                    self._vanish()
                    return
            kept = [(k, v) for k, v in response.headers.items() if k.lower() not in _HOP_BY_HOP]
            self._reply(response.status_code, response.content, None, kept)

        def _vanish(self) -> None:
            """The message is lost: close the connection without an answer."""
            self.close_connection = True
            try:
                self.connection.shutdown(2)
            except OSError:
                pass

        def _reply(self, status: int, body: bytes, content_type: str | None,
                   headers: list[tuple[str, str]] | None = None) -> None:
            self.send_response(status)
            for key, value in headers or []:
                self.send_header(key, value)
            if content_type:
                self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Handler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qtp.testing.lossy_proxy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--seed", type=int)
    for f in fields(Faults):
        parser.add_argument("--" + f.name.replace("_", "-"), type=float, default=0.0)
    args = parser.parse_args(argv)
    faults = {f.name: getattr(args, f.name) for f in fields(Faults)}
    proxy = LossyProxy(args.target, port=args.port, seed=args.seed, **faults).start()
    print(proxy.url, flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    proxy.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
