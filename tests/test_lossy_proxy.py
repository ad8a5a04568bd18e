"""The lossy proxy does what it is told: forwards faithfully, loses, duplicates, delays, reorders, stays bounded
and on loopback, fails over between replicas, and spreads requests over them in turn (round-robin). Against
real HTTP echo servers (and a port that refuses, a listener that never answers); waits are on counts with
generous bounds, never on timing."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from qtp.errors import ConfigurationError
from qtp.testing.lossy_proxy import COUNTERS, DEFAULT_MAX_BODY, LossyProxy

from zygote import shared

SOAP = {"Content-Type": "text/xml; charset=utf-8", "SOAPAction": '"urn:qtp:test"'}


@dataclass
class Arrival:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Echo:
    """A loopback server that echoes each request and records what arrived, in arrival order. As a replica it
    may instead answer 503 (``mode`` "busy") or close the connection without answering ("hang up")."""

    url: str = ""
    arrivals: list[Arrival] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)   # lets requests to /slow finish
    mode: str = "echo"

    def bodies(self) -> list[bytes]:
        return [arrival.body for arrival in list(self.arrivals)]


def _echo_handler(echo: Echo) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _any(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            echo.arrivals.append(Arrival(self.command, self.path, dict(self.headers.items()), body))
            if echo.mode == "hang up":
                self.close_connection = True
                return
            if self.path.startswith("/slow"):
                echo.release.wait(30)
            self.send_response(503 if echo.mode == "busy" else int(self.headers.get("X-Reply-Status", "200")))
            self.send_header("Content-Type", self.headers.get("Content-Type", "text/plain"))
            self.send_header("X-Action", self.headers.get("SOAPAction", ""))
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = do_PUT = _any

    return Handler


class _EchoServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128


@contextmanager
def _serving() -> Iterator[Echo]:
    echo = Echo()
    server = _EchoServer(("127.0.0.1", 0), _echo_handler(echo))
    echo.url = f"http://127.0.0.1:{server.server_address[1]}"
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield echo
    echo.release.set()
    server.shutdown()
    server.server_close()


@pytest.fixture
def echo() -> Iterator[Echo]:
    with _serving() as echo:
        yield echo


@pytest.fixture
def replicas() -> Iterator[Callable[[int], list[Echo]]]:
    """Factory: ``replicas(2)`` starts two echo servers."""
    with ExitStack() as stack:
        yield lambda count: [stack.enter_context(_serving()) for _ in range(count)]


@pytest.fixture
def refusing() -> Iterator[str]:
    """The URL of a port that refuses connections (bound, never listening: no other process can take it)."""
    with socket.socket() as bound:
        bound.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{bound.getsockname()[1]}"


@pytest.fixture
def silent() -> Iterator[str]:
    """The URL of a listener that never accepts: the kernel completes the handshake and buffers the request,
    nobody reads it, as for a SIGSTOPped process."""
    with socket.create_server(("127.0.0.1", 0), backlog=16) as listener:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


def _wait_for(condition: Callable[[], bool], seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.001)


def _post(url: str, body: bytes, **kwargs: object) -> requests.Response:
    return requests.post(url, data=body, timeout=30, **kwargs)


def test_without_faults_everything_passes_unchanged(echo: Echo) -> None:
    with LossyProxy(echo.url) as proxy:
        headers = {**SOAP, "X-Custom": "kept", "Proxy-Authorization": "hop", "X-Reply-Status": "202"}
        reply = requests.put(proxy.url + "/rm/in?a=1&b=two", data=b"<a/>", headers=headers, timeout=30)
        chunked = _post(proxy.url + "/rm", iter([b"<b", b"/>"]), headers=SOAP)
        fetched = requests.get(proxy.url + "/status?q=1", timeout=30)
        assert proxy.stats()["forwarded"] == 3
    assert (reply.status_code, reply.content, reply.headers["Content-Type"], reply.headers["X-Action"]) == \
        (202, b"<a/>", SOAP["Content-Type"], SOAP["SOAPAction"])
    assert (chunked.status_code, chunked.content, fetched.status_code) == (200, b"<b/>", 200)
    put, post, get = echo.arrivals
    assert (put.method, put.path, put.body) == ("PUT", "/rm/in?a=1&b=two", b"<a/>")
    assert {key: put.headers.get(key) for key in ("Content-Type", "SOAPAction", "X-Custom", "Host")} == \
        {**SOAP, "X-Custom": "kept", "Host": echo.url.removeprefix("http://")}
    assert "Proxy-Authorization" not in put.headers
    assert (post.body, post.headers["Content-Length"]) == (b"<b/>", "4")
    assert (get.method, get.path, get.body) == ("GET", "/status?q=1", b"")


def test_a_dropped_request_never_arrives_and_the_client_sees_a_closed_connection(echo: Echo) -> None:
    with LossyProxy(echo.url, drop_request=1.0) as proxy:
        for body in (b"<a/>", b"<b/>"):
            with pytest.raises(requests.ConnectionError):
                _post(proxy.url + "/rm", body, headers=SOAP)
        counts = proxy.stats()
    assert echo.arrivals == []
    assert (counts["requests"], counts["dropped_requests"], counts["forwarded"]) == (2, 2, 0)


def test_a_dropped_response_was_processed_but_the_client_sees_a_closed_connection(echo: Echo) -> None:
    with LossyProxy(echo.url, drop_response=1.0) as proxy:
        with pytest.raises(requests.ConnectionError):
            _post(proxy.url + "/rm", b"<a/>", headers=SOAP)
        counts = proxy.stats()
    assert echo.bodies() == [b"<a/>"]
    assert (counts["forwarded"], counts["dropped_responses"]) == (1, 1)


def test_a_duplicated_request_arrives_twice_and_the_client_gets_one_answer(echo: Echo) -> None:
    bodies = [f"<m{i}/>".encode() for i in range(6)]
    with LossyProxy(echo.url, duplicate_request=1.0, seed=4) as proxy:
        answers = [_post(proxy.url + "/rm", body, headers=SOAP).content for body in bodies]
        counts = proxy.stats()
    assert answers == bodies
    assert sorted(echo.bodies()) == sorted(bodies * 2)
    assert (counts["duplicated"], counts["forwarded"]) == (6, 12)


@pytest.mark.parametrize("faults, counter, per_request", [
    (dict(reorder=1.0, reorder_max_ms=500), "reordered", 1),
    (dict(delay_ms=(0, 500)), "delayed", 2),
], ids=["reorder", "delay"])
def test_requests_held_for_random_times_arrive_out_of_order(echo: Echo, faults: dict, counter: str,
                                                            per_request: int) -> None:
    """Each request is sent once the proxy has the previous one, so the proxy receives them in order."""
    count = 20
    with LossyProxy(echo.url, seed=5, **faults) as proxy:
        senders = []
        for i in range(count):
            senders.append(threading.Thread(target=_post, args=(proxy.url + "/rm", str(i).encode())))
            senders[-1].start()
            _wait_for(lambda: proxy.stats()["requests"] > i)
        for sender in senders:
            sender.join(60)
        _wait_for(lambda: proxy.stats()[counter] == per_request * count)
    arrived = [int(body) for body in echo.bodies()]
    assert sorted(arrived) == list(range(count))
    assert arrived != sorted(arrived), "held-back requests should have been overtaken"


def test_an_oversized_body_gets_413_and_is_not_forwarded(echo: Echo) -> None:
    assert LossyProxy(echo.url).max_body == DEFAULT_MAX_BODY == 16 * 1024 * 1024
    with LossyProxy(echo.url, max_body=10) as proxy:
        assert _post(proxy.url + "/rm", b"x" * 100).status_code == 413
        assert _post(proxy.url + "/rm", iter([b"x" * 8, b"x" * 8])).status_code == 413
        assert _post(proxy.url + "/rm", b"x" * 10).status_code == 200
        counts = proxy.stats()
    assert echo.bodies() == [b"x" * 10]
    assert (counts["rejected"], counts["requests"]) == (2, 1)


@pytest.mark.parametrize("target, bind", [
    ("http://192.0.2.1:8000", "127.0.0.1"),
    ("http://example.com/rm", "127.0.0.1"),
    ("https://127.0.0.1:8000", "127.0.0.1"),
    ("http://127.0.0.1:8000", "0.0.0.0"),
    ("http://127.0.0.1:8000", "192.0.2.1"),
])
def test_only_loopback_is_accepted(target: str, bind: str) -> None:
    with pytest.raises(ConfigurationError, match="loopback only|127.0.0.1 only"):
        LossyProxy(target, host=bind)


def test_a_slow_target_times_out_and_the_client_connection_is_closed(echo: Echo) -> None:
    with LossyProxy(echo.url, timeout=0.5) as proxy:
        with pytest.raises(requests.ConnectionError):
            _post(proxy.url + "/slow", b"<a/>")
        echo.release.set()
        counts = proxy.stats()
    assert echo.bodies() == [b"<a/>"]
    assert (counts["errors"], counts["forwarded"]) == (1, 0)


def test_connections_beyond_the_limit_wait_for_a_free_one(echo: Echo) -> None:
    with LossyProxy(echo.url, max_connections=2) as proxy:
        holders = [socket.create_connection(("127.0.0.1", proxy.port)) for _ in range(2)]
        answers: list[int] = []
        clients = [threading.Thread(target=lambda: answers.append(_post(proxy.url + "/rm", b"<a/>").status_code))
                   for _ in range(40)]
        for client in clients:
            client.start()
        clients[0].join(0.5)
        assert clients[0].is_alive() and echo.arrivals == []    # whatever the timing: both slots are taken
        for holder in holders:
            holder.close()
        for client in clients:
            client.join(60)
    assert answers == [200] * 40


def test_stopping_closes_idle_connections_too(echo: Echo) -> None:
    with requests.Session() as session:
        with LossyProxy(echo.url) as proxy:
            assert session.post(proxy.url + "/rm", data=b"<a/>", timeout=30).ok    # the session keeps it open
        with pytest.raises(requests.ConnectionError):
            session.post(proxy.url + "/rm", data=b"<b/>", timeout=30)
    assert echo.bodies() == [b"<a/>"]


def test_stats_and_faults_over_the_control_paths(echo: Echo) -> None:
    with LossyProxy(echo.url) as proxy:
        control = proxy.url + "/__proxy__/"
        assert requests.get(control + "stats", timeout=30).json() == dict.fromkeys(COUNTERS, 0)
        changed = requests.post(control + "faults", json={"drop_request": 1, "delay_ms": [0, 1]}, timeout=30)
        assert (changed.status_code, changed.json()["drop_request"], changed.json()["delay_ms"]) == (200, 1.0, [0, 1])
        with pytest.raises(requests.ConnectionError):
            _post(proxy.url + "/rm", b"<lost/>")
        assert requests.post(control + "faults", json={"drop_request": 0}, timeout=30).ok
        assert _post(proxy.url + "/rm", b"<kept/>").content == b"<kept/>"
        for bad in ({"bogus": 1}, {"drop_request": 2}, {"delay_ms": [5, 1]}, [1]):
            assert requests.post(control + "faults", json=bad, timeout=30).status_code == 400
        assert requests.get(control + "nothing", timeout=30).status_code == 404
        assert requests.get(control + "faults", timeout=30).json() == {**proxy.faults(), "delay_ms": [0, 1]}
        counts = requests.get(control + "stats", timeout=30).json()
        assert counts == proxy.stats()
        proxy.set_faults(duplicate_request=1)
        _post(proxy.url + "/rm", b"<twice/>")
        with pytest.raises(ConfigurationError, match="unknown faults"):
            proxy.set_faults(lose_everything=1)
    assert echo.bodies() == [b"<kept/>", b"<twice/>", b"<twice/>"]
    assert {k: counts[k] for k in ("requests", "dropped_requests", "forwarded")} == \
        {"requests": 2, "dropped_requests": 1, "forwarded": 1}


def test_a_refused_connection_fails_over_to_the_next_target_which_stays_current(echo: Echo, refusing: str) -> None:
    with LossyProxy([refusing, echo.url]) as proxy:
        assert (proxy.targets, proxy.current) == ([refusing, echo.url], refusing)
        answers = [_post(proxy.url + "/rm", body).content for body in (b"<a/>", b"<b/>", b"<c/>")]
        counts, current = proxy.stats(), proxy.current
    assert answers == echo.bodies() == [b"<a/>", b"<b/>", b"<c/>"]
    assert current == echo.url
    assert {k: counts[k] for k in ("forwarded", "failovers", "failovers_refused", "switches", "errors")} == \
        {"forwarded": 3, "failovers": 1, "failovers_refused": 1, "switches": 1, "errors": 0}


@pytest.mark.parametrize("mode, cause", [("busy", "503"), ("hang up", "reset")])
def test_a_503_or_a_connection_closed_before_the_answer_fails_over(replicas: Callable[[int], list[Echo]],
                                                                   mode: str, cause: str) -> None:
    first, second = replicas(2)
    first.mode = mode
    with LossyProxy([first.url, second.url]) as proxy:
        reply = _post(proxy.url + "/rm", b"<a/>")
        counts = proxy.stats()
    assert (reply.status_code, reply.content) == (200, b"<a/>")
    assert first.bodies() == second.bodies() == [b"<a/>"]     # the first had it too: a duplicate for WS-RM
    assert (counts["failovers"], counts[f"failovers_{cause}"], counts["switches"]) == (1, 1, 1)


def test_a_target_silent_for_failover_s_is_passed_over(echo: Echo, silent: str) -> None:
    with LossyProxy([silent, echo.url], failover_s=0.3, timeout=30) as proxy:
        began = time.monotonic()
        assert _post(proxy.url + "/rm", b"<a/>").content == b"<a/>"
        waited = time.monotonic() - began
        assert _post(proxy.url + "/rm", b"<b/>").content == b"<b/>"   # straight to the current one
        counts = proxy.stats()
    assert echo.bodies() == [b"<a/>", b"<b/>"]
    assert waited < 20        # bounded by failover_s, not by the 30 s timeout
    assert (counts["failovers"], counts["failovers_silent"], counts["errors"]) == (1, 1, 0)


def test_the_target_that_answered_last_gets_the_next_request(replicas: Callable[[int], list[Echo]]) -> None:
    a, b = replicas(2)
    with LossyProxy([a.url, b.url]) as proxy:
        assert _post(proxy.url + "/rm", b"1").status_code == 200   # a: the first target is current
        a.mode = "busy"
        assert _post(proxy.url + "/rm", b"2").status_code == 200   # a answers 503, b answers: b is current
        a.mode = "echo"
        assert _post(proxy.url + "/rm", b"3").status_code == 200   # b, though a answers again
        b.mode = "hang up"
        assert _post(proxy.url + "/rm", b"4").status_code == 200   # b hangs up, a answers: a is current
        counts = proxy.stats()
    assert (a.bodies(), b.bodies()) == ([b"1", b"2", b"4"], [b"2", b"3", b"4"])
    assert (counts["switches"], counts["failovers"], counts["forwarded"]) == (2, 2, 4)


def test_each_target_is_tried_once_and_without_an_answer_the_client_sees_a_closed_connection(
        replicas: Callable[[int], list[Echo]], refusing: str, silent: str) -> None:
    (hanging_up,) = replicas(1)
    hanging_up.mode = "hang up"
    with LossyProxy([refusing, silent, hanging_up.url], failover_s=0.3) as proxy:
        with pytest.raises(requests.ConnectionError):
            _post(proxy.url + "/rm", b"<a/>")
        counts = proxy.stats()
    assert hanging_up.bodies() == [b"<a/>"]
    assert {k: counts[k] for k in ("failovers", "failovers_refused", "failovers_silent", "errors", "forwarded")} == \
        {"failovers": 2, "failovers_refused": 1, "failovers_silent": 1, "errors": 1, "forwarded": 0}


def test_when_every_target_answers_503_the_client_gets_the_503(replicas: Callable[[int], list[Echo]]) -> None:
    a, b = replicas(2)
    a.mode = b.mode = "busy"
    with LossyProxy([a.url, b.url]) as proxy:
        assert _post(proxy.url + "/rm", b"<a/>").status_code == 503
        counts, current = proxy.stats(), proxy.current
    assert a.bodies() == b.bodies() == [b"<a/>"]
    assert (counts["failovers_503"], counts["switches"], current) == (1, 0, a.url)


def test_the_command_line_prints_its_url_and_forwards(echo: Echo, refusing: str) -> None:
    command = [sys.executable, "-m", "qtp.testing.lossy_proxy", "--target", refusing, "--target", echo.url,
               "--failover-s", "5", "--duplicate-request", "1", "--delay-ms", "0", "5", "--seed", "9"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:")
        assert _post(url + "/rm", b"<e/>", headers=SOAP).content == b"<e/>"
        counts = requests.get(url + "/__proxy__/stats", timeout=30).json()
        assert counts["duplicated"] == 1 and counts["failovers_refused"] in (1, 2)  # 2: copies sent at once
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
    assert echo.bodies() == [b"<e/>", b"<e/>"]
    refused = shared().run(*command[2:5], "--host", "0.0.0.0")
    assert refused.returncode == 2 and "127.0.0.1 only" in refused.stderr


def test_round_robin_spreads_the_requests_over_every_target_in_turn(replicas: Callable[[int], list[Echo]]) -> None:
    a, b = replicas(2)
    with LossyProxy([a.url, b.url], balance="round-robin") as proxy:
        answers = [_post(proxy.url + "/rm", str(i).encode()).content for i in range(6)]
        counts = proxy.stats()
    assert answers == [str(i).encode() for i in range(6)]
    assert (a.bodies(), b.bodies()) == ([b"0", b"2", b"4"], [b"1", b"3", b"5"])
    assert counts["per_target"] == {a.url: 3, b.url: 3}
    assert (counts["forwarded"], counts["failovers"], counts["switches"], counts["errors"]) == (6, 0, 0, 0)


def test_round_robin_sends_the_copies_of_a_duplicated_request_to_two_targets(
        replicas: Callable[[int], list[Echo]]) -> None:
    a, b = replicas(2)
    bodies = [f"<m{i}/>".encode() for i in range(4)]
    with LossyProxy([a.url, b.url], balance="round-robin", duplicate_request=1.0, seed=3) as proxy:
        answers = [_post(proxy.url + "/rm", body).content for body in bodies]
        counts = proxy.stats()
    assert answers == bodies
    assert sorted(a.bodies()) == sorted(b.bodies()) == sorted(bodies)
    assert counts["per_target"] == {a.url: 4, b.url: 4}


@pytest.mark.parametrize("dead", ["refusing", "silent"])
def test_round_robin_skips_a_dead_target_for_down_s_then_tries_it_again(echo: Echo, dead: str,
                                                                       request: pytest.FixtureRequest) -> None:
    gone = request.getfixturevalue(dead)
    cause = "refused" if dead == "refusing" else "silent"
    with LossyProxy([gone, echo.url], balance="round-robin", failover_s=0.3, down_s=3.0) as proxy:
        answers = [_post(proxy.url + "/rm", str(i).encode()).content for i in range(4)]  # turns: dead, echo, ...
        skipped = proxy.stats()
        time.sleep(3.2)                                       # no longer down: the 5th request's turn tries it
        assert _post(proxy.url + "/rm", b"4").content == b"4"
        counts = proxy.stats()
    assert answers == [b"0", b"1", b"2", b"3"] and echo.bodies() == [b"0", b"1", b"2", b"3", b"4"]
    # passed over on the first request; on the third (its turn again) skipped, as down
    assert (skipped["failovers"], skipped[f"failovers_{cause}"], skipped["errors"]) == (1, 1, 0)
    assert (counts["failovers"], counts[f"failovers_{cause}"]) == (2, 2)
    assert counts["per_target"] == {gone: 0, echo.url: 5}


def test_round_robin_with_every_target_dead_closes_the_connection_and_relays_a_503(
        replicas: Callable[[int], list[Echo]], refusing: str, silent: str) -> None:
    with LossyProxy([refusing, silent], balance="round-robin", failover_s=0.3, down_s=30) as proxy:
        for body in (b"<a/>", b"<b/>"):              # the second time both are down, and still tried
            with pytest.raises(requests.ConnectionError):
                _post(proxy.url + "/rm", body)
        counts = proxy.stats()
    assert {k: counts[k] for k in ("failovers", "failovers_refused", "failovers_silent", "errors", "forwarded")} == \
        {"failovers": 2, "failovers_refused": 1, "failovers_silent": 1, "errors": 2, "forwarded": 0}
    a, b = replicas(2)
    a.mode = b.mode = "busy"
    with LossyProxy([a.url, b.url], balance="round-robin") as proxy:
        assert _post(proxy.url + "/rm", b"<c/>").status_code == 503
        counts = proxy.stats()
    assert a.bodies() == b.bodies() == [b"<c/>"]
    assert (counts["failovers_503"], counts["forwarded"], counts["switches"]) == (1, 1, 0)
    assert sum(counts["per_target"].values()) == 1


def test_round_robin_is_checked_and_on_the_command_line(echo: Echo) -> None:
    with pytest.raises(ConfigurationError, match="balance"):
        LossyProxy(echo.url, balance="random")
    command = [sys.executable, "-m", "qtp.testing.lossy_proxy", "--target", echo.url, "--target", echo.url + "/",
               "--balance", "round-robin", "--down-s", "2"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().strip()
        for body in (b"<a/>", b"<b/>"):
            assert _post(url + "/rm", body).content == body
        counts = requests.get(url + "/__proxy__/stats", timeout=30).json()
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
    assert counts["forwarded"] == 2 and counts["switches"] == 0
