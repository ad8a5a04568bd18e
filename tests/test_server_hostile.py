"""Sockets against a node's HTTP server (issue 28): no connection can stall it, no body can blow up its memory.

Real node processes in the deployed configuration (the honest pair authenticates with a secret, takes no
anonymous requests; ``mallory`` is a peer the server knows). Throughout each attack ``/health`` is asked
every half second from another local address (127.0.0.2: the per-address cap is not what keeps it
answering) and must answer within 1 s every time; the honest client keeps sending orders through the
attack, and they are reconciled exactly once at the end. What each attack did before (cheroot, main
4e8babd) is in the test's docstring and in docs/security.md.

Each attack lasts ``ATTACK_S`` (15 s: 30 probes of /health, so one isolated miss on a loaded machine is 1 in
30, as it was 1 in 40 at 20 s); the "before" figures in the docstrings were measured with 20 s attacks (and
the fixed waits noted there). A server that stalls fails the probes in a row from the first stalled one on,
so a stall shows within the first seconds of an attack.
"""

from __future__ import annotations

import socket
import ssl
import subprocess
import threading
import time
from pathlib import Path

import pytest
import requests

from qtp.testing.nodes import (
    NodeProcess,
    Pair,
    check_exactly_once,
    client_schema,
    post_as,
    rows,
    server_schema,
    wait_until,
)

# long tests (a quick run leaves them out: -m 'not slow')
pytestmark = pytest.mark.slow

SECRET = "honest-pair-secret-0123456789abcdefghij"
MALLORY = "mallory-secret-0123456789abcdefghijklmn"
PROBE_FROM = "127.0.0.2"     # /health is asked from here
ATTACK_FROM = "127.0.0.3"    # the attacker's sockets come from here
ATTACK_S = 15                # seconds each attack lasts
ORDERS = 32                  # sent at 2 a second: 16 s, through the attack


# ---------------------------------------------------------------------------------------------- set-up

def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _server_certificate(folder: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1 signed by it: (ca.pem, server.pem, server.key)."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=qtp-test-ca",
             "-keyout", "ca.key", "-out", "ca.pem", cwd=folder)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=server", "-keyout", "server.key",
             "-out", "server.csr", cwd=folder)
    (folder / "server.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "2", "-extfile", "server.ext", "-out", "server.pem", cwd=folder)
    return folder / "ca.pem", folder / "server.pem", folder / "server.key"


class Deployment:
    """The honest pair (client sending ``ORDERS`` orders, 2 a second) and mallory's credentials on the server."""

    def __init__(self, pair: Pair, client: NodeProcess, server: NodeProcess, tls: bool):
        self.pair, self.client, self.server, self.tls = pair, client, server, tls
        self.port = pair.server_port
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}/rm"

    def reconcile(self) -> dict:
        """Every order applied exactly once (waits up to 120 s for the last ones)."""
        wait_until(lambda: rows(self.pair.server_app, "SELECT COUNT(*) FROM applied")[0][0] >= ORDERS, 120,
                   f"the {ORDERS} honest orders applied")
        result = check_exactly_once(self.pair.client_app, self.pair.server_app, False)
        assert result["applied"] == ORDERS, result
        return result


@pytest.fixture
def deploy(pg_db, maria_db, tmp_path):
    """Factory: deploy(tls=False, limits="") -> Deployment, both nodes running; killed at the end."""
    started: list[NodeProcess] = []

    def make(tls: bool = False, limits: str = "") -> Deployment:
        client_app, server_app = pg_db("client"), maria_db("server")
        client_schema(client_app)
        server_schema(server_app)
        mallory = f'\n[peers.mallory]\nsecret = "{MALLORY}"\n'
        pair = Pair(client_app, server_app, secret=SECRET, limits=limits, server_extra=mallory)
        client_config, server_config = pair.write(tmp_path)
        if tls:
            ca, cert, key = _server_certificate(tmp_path)
            plain, secure = f"http://127.0.0.1:{pair.server_port}", f"https://127.0.0.1:{pair.server_port}"
            server_text = server_config.read_text().replace(plain, secure)
            server_config.write_text(server_text.replace(
                "\n[node]\n", f'\n[node]\ntls_cert = "{cert}"\ntls_key = "{key}"\n', 1))
            client_text = client_config.read_text().replace(plain, secure)
            client_config.write_text(client_text.replace("\n[node]\n", f'\n[node]\ntls_ca = "{ca}"\n', 1))
        server = NodeProcess(server_config, tmp_path / "server.log")
        client = NodeProcess(client_config, tmp_path / "client.log",
                             {"QTP_TEST_SEND": str(ORDERS), "QTP_TEST_ABORT_EVERY": "0", "QTP_TEST_RATE": "2"})
        started.extend([server, client])
        server.start()
        client.start()
        return Deployment(pair, client, server, tls)

    yield make
    for node in started:
        node.kill()


def _connect(port: int, source: str, timeout: float) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=timeout, source_address=(source, 0))


def _health(port: int, tls: bool, timeout: float = 1.0) -> float | None:
    """Seconds ``GET /health`` took from a fresh connection (TLS handshake included), None when it did not
    answer 200 within ``timeout``."""
    began = time.monotonic()
    try:
        sock = _connect(port, PROBE_FROM, timeout)
        if tls:
            context = ssl.create_default_context()
            context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
            sock = context.wrap_socket(sock)
        with sock:
            sock.settimeout(max(0.01, timeout - (time.monotonic() - began)))
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            answer = b""
            while chunk := sock.recv(4096):
                answer += chunk
    except OSError:
        return None
    took = time.monotonic() - began
    return took if answer.startswith(b"HTTP/1.1 200") and took <= timeout else None


class Prober:
    """Asks ``/health`` every half second (on a fixed schedule) in a thread until ``stop()``; ``failed`` of ``asked`` did not answer
    within 1 s, ``worst_run`` is the most that failed in a row, ``slowest`` is the longest answer. ``stalled()``:
    two in a row failed, or more than one in ten. A stall fails probes in a row (17 of 17, 13 of 13 before the
    fixes below); one isolated miss of the 1 s deadline is what a shared 2-core machine does now and then
    while the test itself opens hundreds of connections (seen: 1 of 26, 1 of 32), and not a stall."""

    def __init__(self, port: int, tls: bool):
        self.port, self.tls = port, tls
        self.asked = self.failed = self.worst_run = self._run_length = 0
        self.slowest = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        due = time.monotonic()
        while True:  # on a schedule: slow answers on a loaded machine do not thin the probes out
            due += 0.5
            if self._stop.wait(max(0.0, due - time.monotonic())):
                return
            took = _health(self.port, self.tls)
            self.asked += 1
            if took is None:
                self.failed += 1
                self._run_length += 1
                self.worst_run = max(self.worst_run, self._run_length)
            else:
                self._run_length = 0
                self.slowest = max(self.slowest, took)

    def stop(self) -> str:
        self._stop.set()
        self._thread.join(5)
        report = (f"/health failed {self.failed} of {self.asked} times, at most {self.worst_run} in a row "
                  f"(slowest answer {self.slowest:.2f} s)")
        print(report)
        return report

    def stalled(self) -> bool:
        return self.worst_run >= 2 or self.failed * 10 > self.asked


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def _rss_back_to(pid: int, bound: float, within: float) -> float:
    """RSS in MB once it is at most ``bound``, or after ``within`` seconds if it never gets there (asked
    every 0.1 s: a server that keeps the memory is still measured at the end of the whole wait)."""
    deadline = time.monotonic() + within
    while (rss := _rss_mb(pid)) > bound and time.monotonic() < deadline:
        time.sleep(0.1)
    return rss


# ---------------------------------------------------------------------------------------------- attacks

def _withstood(d: Deployment, sockets: list[socket.socket], attack) -> None:
    """Run ``attack()`` while /health is asked, then close ``sockets``: /health never failed, and the honest
    orders sent meanwhile are all applied exactly once."""
    probe = Prober(d.port, d.tls)
    try:
        attack()
    finally:
        report = probe.stop()
        for sock in sockets:
            sock.close()
    assert not probe.stalled() and probe.asked >= 1.5 * ATTACK_S, report  # (2 a second when answered)
    d.reconcile()


def test_silent_tls_sockets_do_not_stall_the_server(deploy):
    """Before (cheroot): the TLS handshake ran in the accepting thread, so one silent TCP connection stalled
    every new connection for up to 30 s. One silent socket every 2 s for 20 s: /health failed 17 of 17
    times, and a keep-alive connection opened before the attack did not answer. After: 0 failed, the
    keep-alive connection answers. Now one every 2 s for ATTACK_S (15 s): the first one alone stalled
    cheroot for longer than that."""
    d = deploy(tls=True)
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    kept = context.wrap_socket(_connect(d.port, PROBE_FROM, 5))
    silent: list[socket.socket] = [kept]
    answers: list[bytes] = []

    def attack() -> None:
        deadline = time.monotonic() + ATTACK_S
        while time.monotonic() < deadline:
            silent.append(_connect(d.port, ATTACK_FROM, 5))
            time.sleep(2)
        kept.settimeout(5)
        try:
            kept.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            answers.append(kept.recv(4096))
        except OSError as exc:
            answers.append(repr(exc).encode())

    _withstood(d, silent, attack)
    assert answers[0].startswith(b"HTTP/1.1 200"), f"the keep-alive connection answered {answers[0][:60]!r}"


def test_slowloris_does_not_stall_the_server(deploy):
    """Before (cheroot): sockets sending a request head one byte at a time held cheroot's workers (the issue:
    24 sockets, one byte every 10 s, /health failed 12 of 12 over 60 s). Here 64 sockets, one byte every 2 s:
    before, for 20 s, /health failed 13 of 13; after, 0 failed. Now for ATTACK_S (15 s)."""
    d = deploy()
    sockets = [_connect(d.port, ATTACK_FROM, 5) for _ in range(64)]
    head = b"POST /rm HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/soap+xml\r\nX-Slow: "

    def attack() -> None:
        deadline = time.monotonic() + ATTACK_S
        at = 0
        while time.monotonic() < deadline:
            for sock in sockets:
                try:
                    sock.send(head[at:at + 1] or b"a")
                except OSError:
                    pass  # closed by the server: its deadline
            at += 1
            time.sleep(2)

    _withstood(d, sockets, attack)


def test_half_sent_requests_do_not_stall_the_server(deploy):
    """Before (cheroot): requests whose head announced a body that never came held every worker (the issue:
    /health timed out after 40 s). Here 110 of them stay open: before, for 20 s, /health failed 13 of 13;
    after, 0 failed (the ones over the per-address cap are closed at once). Now for ATTACK_S (15 s)."""
    d = deploy()
    sockets = []
    for _ in range(110):
        try:
            sock = _connect(d.port, ATTACK_FROM, 5)
            sock.sendall(b"POST /rm HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/soap+xml\r\n"
                         b"Content-Length: 2000\r\n\r\n<s:Envelope xmlns:s='http://www.w3.org/2003/05/soap-envelope'>")
            sockets.append(sock)
        except OSError:
            pass  # over the per-address cap: refused at once
    _withstood(d, sockets, lambda: time.sleep(ATTACK_S))


def _bomb() -> bytes:
    """A SOAP 1.2 envelope just under 4 MiB whose payload is empty elements: a million of them."""
    head = b"<s:Envelope xmlns:s='http://www.w3.org/2003/05/soap-envelope'><s:Body><x>"
    tail = b"</x></s:Body></s:Envelope>"
    return head + b"<a/>" * ((4 * 1024 * 1024 - 4096 - len(head) - len(tail)) // 4) + tail


def test_bodies_of_empty_elements_keep_memory_bounded(deploy):
    """Before (cheroot, no element limit): 16 threads each posting two 4 MiB bodies of empty elements signed by
    mallory took the server from 74 MB to 1,541 MB RSS, and 1,413 MB stayed (5 s after); /health failed once.
    After: 73 MB idle (warm), 95 MB peak, 73 MB after (at most 2x idle, and back within 10 % of idle
    within 5 s), every body refused with a Sender fault, /health answering throughout."""
    d = deploy()
    pid = d.server.proc.pid
    wait_until(lambda: rows(d.pair.server_app, "SELECT COUNT(*) FROM applied")[0][0] >= 5, 60, "orders flowing")
    body = _bomb()
    # idle means warm: the 16 request threads started, as any burst of honest requests does
    warm = [threading.Thread(target=requests.get, args=(d.url.replace("/rm", "/metrics"),)) for _ in range(32)]
    for thread in warm:
        thread.start()
    for thread in warm:
        thread.join(30)
    time.sleep(1)
    idle = _rss_mb(pid)
    statuses: list[int] = []
    peak = [idle]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            peak[0] = max(peak[0], _rss_mb(pid))

    def attack() -> None:
        for _ in range(2):
            try:
                statuses.append(post_as(d.url, body, "mallory", MALLORY).status_code)
            except OSError as exc:
                statuses.append(-1)
                print("attack request failed:", exc)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    probe = Prober(d.port, tls=False)
    attackers = [threading.Thread(target=attack) for _ in range(16)]
    try:
        for thread in attackers:
            thread.start()
        for thread in attackers:
            thread.join(300)
    finally:
        report = probe.stop()
        done.set()
        sampler.join(5)
    after = _rss_back_to(pid, 1.1 * idle, 5)
    figures = f"idle {idle:.0f} MB, peak {peak[0]:.0f} MB, then {after:.0f} MB; statuses {sorted(set(statuses))}"
    print(figures)
    assert peak[0] <= 2 * idle, figures
    assert after <= 1.1 * idle, figures
    assert statuses and all(s == 400 for s in statuses), figures  # refused as malformed (too many elements)
    assert not probe.stalled(), report
    d.reconcile()


# ---------------------------------------------------------------------------------------------- the bounds

def _closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the server closed ``sock`` (None: still open after ``seconds``)."""
    began = time.monotonic()
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except socket.timeout:
        return None
    except OSError:
        pass
    return time.monotonic() - began


def test_deadlines_and_the_per_address_cap(deploy):
    """The bounds the attacks above meet, with small settings: a TLS handshake that never starts is dropped
    after http_handshake_timeout, a request trickled one byte a second after http_request_timeout even
    though it never stops sending, and one address gets max_connections_per_address connections, no more."""
    d = deploy(tls=True, limits="http_handshake_timeout = 2\nhttp_request_timeout = 3\n"
                                "max_connections_per_address = 8\n")
    silent = _connect(d.port, ATTACK_FROM, 5)
    took = _closed_within(silent, 6)
    assert took is not None and took < 4, f"a silent TLS socket was closed after {took} s (handshake deadline 2 s)"

    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    slow = context.wrap_socket(_connect(d.port, ATTACK_FROM, 5))
    began = time.monotonic()
    closed = None
    for byte in b"POST /rm HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 20:
        try:
            slow.send(bytes([byte]))
        except OSError:
            closed = time.monotonic() - began
            break
        if _closed_within(slow, 1.0) is not None:
            closed = time.monotonic() - began
            break
    assert closed is not None and closed < 6, f"a trickled request head was still open after {closed} s (3 s deadline)"

    held = [_connect(d.port, ATTACK_FROM, 5) for _ in range(12)]
    time.sleep(0.5)
    refused = [s for s in held if _closed_within(s, 0.05) is not None]
    for sock in held:
        sock.close()
    assert len(refused) == 4, f"{12 - len(refused)} of 12 connections from one address kept (cap 8)"
    assert _health(d.port, tls=True, timeout=2.0) is not None
    metrics = requests.get(f"https://127.0.0.1:{d.port}/metrics", verify=False, timeout=5).text
    counted = {reason: sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                           if line.startswith("qtp_requests_refused_total{") and f'reason="{reason}"' in line)
               for reason in ("connections", "deadline")}
    assert counted["connections"] >= 4 and counted["deadline"] >= 2, counted
    d.reconcile()


def test_a_body_budget_smaller_than_a_request_is_a_configuration_error(tmp_path):
    from qtp.errors import ConfigurationError
    from qtp.wsrm.runtime._settings import Limits, NodeSettings, check

    with pytest.raises(ConfigurationError, match="max_body_memory"):
        check(NodeSettings(limits=Limits(max_request_bytes=4 << 20, max_body_memory=1 << 20)))


# ---------------------------------------------------------------------------------------------- parsing

def test_decode_refuses_more_elements_than_the_limit_while_parsing():
    """The codec's element limit: a body of a million empty elements is refused (before: parsed, 122 MB of
    tree per body), and quickly, without building its tree; a document whose bytes only look crowded (a
    CDATA section full of '<') is counted, found within the limit and parsed."""
    from qtp.wsrm.codec import InvalidMessage, decode

    began = time.monotonic()
    with pytest.raises(InvalidMessage, match="more than 100000 elements"):
        decode(_bomb(), max_elements=100_000)
    assert time.monotonic() - began < 5
    head = b"<s:Envelope xmlns:s='http://www.w3.org/2003/05/soap-envelope'><s:Body><x xmlns='urn:t'>"
    crowded = head + b"<![CDATA[" + b"<" * 5000 + b"]]></x></s:Body></s:Envelope>"
    assert decode(crowded, max_elements=1000).payload.count(b"&lt;") == 5000
    with pytest.raises(InvalidMessage, match="more than 10 elements"):
        decode(head + b"<![CDATA[<<]]>" + b"<y/>" * 11 + b"</x></s:Body></s:Envelope>", max_elements=10)


def test_a_fault_says_what_not_how():
    """A parse error's fault reason is qtp's own words; the parser's text (libxml2's, naming its options and
    positions) goes to the log only. Before (main cc276df): "the envelope is not well-formed XML: Excessive
    depth in document: 256, use XML_PARSE_HUGE option, line 1, column 1275 (<string>, line 1)"."""
    from qtp.wsrm.codec import InvalidMessage, decode

    deep = b"<s:Envelope xmlns:s='http://www.w3.org/2003/05/soap-envelope'><s:Body>" + b"<a>" * 300
    with pytest.raises(InvalidMessage) as deep_error:
        decode(deep + b"</a>" * 300 + b"</s:Body></s:Envelope>")
    assert deep_error.value.reason == "the envelope is nested deeper than 100 elements", deep_error.value.reason
    with pytest.raises(InvalidMessage) as broken:
        decode(b"<s:Envelope xmlns:s='http://www.w3.org/2003/05/soap-envelope'><s:Body></s:Envelope>")
    assert broken.value.reason == "the envelope is not well-formed XML", broken.value.reason
    assert "line" in str(broken.value.__cause__)  # the parser's own text, for the log


# ---------------------------------------------------------------------------------------------- fairness

def test_pipelined_requests_do_not_stall_the_server(deploy):
    """Each of 20 connections (4 addresses x 5) writes 20,000 ``GET /health`` requests at once and never reads
    the answers. Before (main cc276df): a connection's buffered requests were answered back to back on the
    event loop, /health from another address failed 5 of 21 times (over 18 s). After: the loop
    is yielded between requests and an answer must have left the process before the connection's next
    request is read; 0 failed. Now for ATTACK_S (15 s)."""
    d = deploy()
    sockets = [_connect(d.port, f"127.0.0.{3 + n // 5}", 5) for n in range(20)]
    burst = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" * 20_000

    def write(sock: socket.socket) -> None:
        try:
            sock.sendall(burst)
        except OSError:
            pass  # the server stopped reading (its answers are not read) and the socket timed out

    def attack() -> None:
        writers = [threading.Thread(target=write, args=(sock,), daemon=True) for sock in sockets]
        for thread in writers:
            thread.start()
        time.sleep(ATTACK_S)

    _withstood(d, sockets, attack)


# ---------------------------------------------------------------------------------------------- the body budget

def test_a_large_body_waiting_for_the_budget_is_timed_too(deploy):
    """Bodies over 64 KiB wait for room in max_body_memory; that wait is bounded by http_request_timeout too.
    Ten connections announce a 150,000-byte body (the budget holds one) and send none of it. Before (main
    cc276df): each waited for the one before it to time out, 3 of 10 were closed within 8 s (the last one
    after 20 s). After: all ten within 8 s (the queued ones answered 503)."""
    d = deploy(limits="http_request_timeout = 2\nmax_request_bytes = 200000\nmax_body_memory = 200000\n")
    head = (b"POST /rm HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/soap+xml\r\n"
            b"Content-Length: 150000\r\n\r\n")
    sockets = [_connect(d.port, ATTACK_FROM, 5) for _ in range(10)]
    for sock in sockets:
        sock.sendall(head)
    began = time.monotonic()
    closed = 0
    for sock in sockets:
        if _closed_within(sock, max(0.05, began + 8 - time.monotonic())) is not None:
            closed += 1
    for sock in sockets:
        sock.close()
    assert closed == 10, f"{closed} of 10 connections waiting for the body budget closed within 8 s (deadline 2 s)"
    assert _health(d.port, tls=False, timeout=2.0) is not None
    d.reconcile()



# ---------------------------------------------------------------------------------------------- what a connection costs

HALF_HELLO = bytes([0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03, 0x03]) + b"\x00" * 20


def test_tls_connections_are_cheap_and_their_memory_is_given_back(deploy):
    """640 connections (10 addresses x 64) each send the start of a TLS ClientHello and stall for 5 s (8 s
    when the figures below were measured; the peak comes once all are open). Before (main cc276df): asyncio
    gave each a 256 KiB read buffer: RSS idle 74 MB, peak 271 MB, 7 s after the sockets closed still 272 MB.
    After: a 16 KiB buffer, and the heap is collected and trimmed once a burst of connections is over: idle
    73 MB, peak 118 MB, 7 s after 78 MB. The test waits up to 7 s for RSS to be back within 15 MB of idle,
    and asks /health for at least 2 s after the sockets closed (the trim comes 0.5 s after)."""
    d = deploy(tls=True)
    pid = d.server.proc.pid
    wait_until(lambda: rows(d.pair.server_app, "SELECT COUNT(*) FROM applied")[0][0] >= 3, 60, "orders flowing")
    for _ in range(5):
        _health(d.port, tls=True, timeout=2.0)
    time.sleep(1)
    idle = _rss_mb(pid)
    peak = [idle]
    sockets: list[socket.socket] = []
    after = [0.0]

    def attack() -> None:
        for n in range(640):
            try:
                sock = _connect(d.port, f"127.0.0.{10 + n // 64}", 5)
                sock.sendall(HALF_HELLO)
                sockets.append(sock)
            except OSError:
                pass
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            peak[0] = max(peak[0], _rss_mb(pid))
            time.sleep(0.1)
        for sock in sockets:
            sock.close()
        closed = time.monotonic()
        after[0] = _rss_back_to(pid, idle + 15, 7)  # /health is still asked while the heap is trimmed
        time.sleep(max(0.0, closed + 2 - time.monotonic()))

    probe = Prober(d.port, True)
    try:
        attack()
    finally:
        report = probe.stop()
    figures = f"idle {idle:.0f} MB, peak {peak[0]:.0f} MB, after {after[0]:.0f} MB ({len(sockets)} connections)"
    print(figures)
    assert len(sockets) == 640, figures
    assert peak[0] <= idle + 60, figures
    assert after[0] <= idle + 15, figures
    assert not probe.stalled(), report
    d.reconcile()


def _sockets_open(pid: int) -> int:
    """Sockets the process holds (a descriptor closed while they are counted is not one)."""
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            count += fd.readlink().name.startswith("socket:")
        except FileNotFoundError:
            pass
    return count


def test_many_addresses_cannot_hold_more_than_max_connections(deploy):
    """200 connections (10 addresses x 20, each under the per-address cap) send half a ClientHello and stall,
    with max_connections = 50. Before (main cc276df, no node-wide bound): all 200 held open by the server.
    After: at most 50 more sockets than idle (each newcomer closes the longest-quiet connection), and
    /health, itself a newcomer at the bound, answered 34 of 34 times (over 17 s; now ATTACK_S, 15 s)."""
    d = deploy(tls=True, limits="max_connections = 50\n")
    pid = d.server.proc.pid
    wait_until(lambda: rows(d.pair.server_app, "SELECT COUNT(*) FROM applied")[0][0] >= 3, 60, "orders flowing")
    idle = _sockets_open(pid)
    sockets: list[socket.socket] = []
    most = [0]

    def attack() -> None:
        for n in range(200):
            try:
                sock = _connect(d.port, f"127.0.0.{10 + n // 20}", 5)
                sock.sendall(HALF_HELLO)
                sockets.append(sock)
            except OSError:
                pass  # closed at once: the server found no connection to close in its place
        deadline = time.monotonic() + ATTACK_S
        while time.monotonic() < deadline:
            most[0] = max(most[0], _sockets_open(pid) - idle)
            time.sleep(0.2)

    _withstood(d, sockets, attack)
    print(f"the server held at most {most[0]} sockets more than idle")
    assert most[0] <= 50 + 5, f"the server held {most[0]} more sockets than idle under the attack (max_connections 50)"
