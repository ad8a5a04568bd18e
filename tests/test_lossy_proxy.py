"""The lossy proxy does what it is told: forwards faithfully, drops, duplicates, delays, stays on loopback."""

from __future__ import annotations

import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from qtp.testing.lossy_proxy import LossyProxy


@pytest.fixture
def echo():
    """A loopback HTTP server that echoes the body and records each request body it saw."""
    seen: list[bytes] = []

    class Echo(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            seen.append(body)
            self.send_response(200)
            self.send_header("Content-Type", self.headers.get("Content-Type", "text/plain"))
            self.send_header("X-Action", self.headers.get("SOAPAction", ""))
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()


def test_without_faults_everything_passes_unchanged(echo):
    target, seen = echo
    with LossyProxy(target) as proxy:
        r = requests.post(proxy.url + "/rm", data=b"<a/>", timeout=5,
                          headers={"Content-Type": "text/xml; charset=utf-8", "SOAPAction": '"urn:x"'})
        assert (r.status_code, r.content, r.headers["Content-Type"], r.headers["X-Action"]) == \
            (200, b"<a/>", "text/xml; charset=utf-8", '"urn:x"')
        assert seen == [b"<a/>"] and proxy.stats()["forwarded"] == 1


def test_dropped_requests_never_arrive_and_dropped_responses_did(echo):
    target, seen = echo
    with LossyProxy(target, drop_request=1.0) as proxy:
        with pytest.raises(requests.ConnectionError):
            requests.post(proxy.url, data=b"<a/>", timeout=5)
        assert seen == []
    with LossyProxy(target, drop_response=1.0) as proxy:
        with pytest.raises(requests.ConnectionError):
            requests.post(proxy.url, data=b"<b/>", timeout=5)
        assert seen == [b"<b/>"]


def test_duplicated_requests_arrive_twice_and_faults_change_at_run_time(echo):
    target, seen = echo
    with LossyProxy(target, duplicate_request=1.0) as proxy:
        assert requests.post(proxy.url, data=b"<c/>", timeout=5).content == b"<c/>"
        assert seen == [b"<c/>", b"<c/>"]
        assert requests.post(proxy.url + "/__proxy__/faults", json={"duplicate_request": 0}, timeout=5).ok
        requests.post(proxy.url, data=b"<d/>", timeout=5)
        assert seen[2:] == [b"<d/>"]
        assert requests.get(proxy.url + "/__proxy__/stats", timeout=5).json()["duplicated"] == 1


def test_delays_reorder_concurrent_requests(echo):
    target, seen = echo
    with LossyProxy(target, delay=0.5, delay_max_ms=100, seed=3) as proxy:
        threads = [threading.Thread(target=requests.post, args=(proxy.url,), kwargs={"data": str(i).encode()})
                   for i in range(30)]
        for t in threads:
            t.start()
            t.join(0.005)
        for t in threads:
            t.join()
    assert sorted(seen, key=int) == [str(i).encode() for i in range(30)]
    assert seen != sorted(seen, key=int)


def test_bounds_and_loopback_only(echo):
    target, _ = echo
    with pytest.raises(ValueError, match="loopback"):
        LossyProxy("http://example.com:80")
    with LossyProxy(target, max_body=10) as proxy:
        assert requests.post(proxy.url, data=b"x" * 100, timeout=5).status_code == 413


def test_command_line_prints_its_url_and_forwards(echo):
    target, seen = echo
    proc = subprocess.Popen([sys.executable, "-m", "qtp.testing.lossy_proxy", "--target", target],
                            stdout=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().strip()
        assert requests.post(url, data=b"<e/>", timeout=5).content == b"<e/>"
    finally:
        proc.terminate()
        proc.wait(10)
    assert seen == [b"<e/>"]
