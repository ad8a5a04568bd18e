"""``memory`` mode loses what a killed node held, and nothing more: the stream goes on after every restart.

The server node keeps its sequences in memory, so after a SIGKILL it knows none of them: the client's next
message (or AckRequested) gets UnknownSequence, and the client must end that sequence and start a new one,
for its requests and, with request-reply, the server for its replies (the client's offered sequence is
gone with the server's memory too). Losses of messages in flight at a kill are what the mode promises; a
stall is not. Issue 20 saw `applied` stay flat after the second server kill of the e2e campaign.
"""

from __future__ import annotations

import time

import pytest

from qtp.testing.nodes import NodeProcess, Pair, client_schema, rows, server_schema, wait_until

# long tests (a quick run leaves them out: -m 'not slow')
pytestmark = pytest.mark.slow


def _highest(url: str, query: str) -> int:
    return rows(url, query)[0][0] or 0


@pytest.mark.parametrize("reply", [False, True], ids=["one-way", "request-reply"])
def test_the_stream_goes_on_after_every_server_kill(pg_db, maria_db, tmp_path, reply):
    client_app, server_app = pg_db("client"), maria_db("server")
    client_schema(client_app)
    server_schema(server_app)
    pair = Pair(client_app, server_app, reply=reply, mode="memory")
    client_config, server_config = pair.write(tmp_path)
    server = NodeProcess(server_config, tmp_path / "server.log").start()
    client = NodeProcess(client_config, tmp_path / "client.log", {"QTP_TEST_SEND": "100000", "QTP_TEST_RATE": "150"})
    try:
        client.start()
        for kill in range(4):
            wait_until(lambda: _highest(server_app, "SELECT MAX(k) FROM applied") > 0, 30, "applies")
            time.sleep(1.0)
            server.kill()
            time.sleep(0.3 if kill % 2 else 0.0)  # killed and back at once, or after a moment
            server.start()
            committed = _highest(client_app, "SELECT MAX(k) FROM orders")
            wait_until(lambda: _highest(server_app, "SELECT MAX(k) FROM applied") > committed + 50, 30,
                       f"orders committed after server kill {kill + 1} applied")
            if reply:
                wait_until(lambda: _highest(client_app, "SELECT MAX(k) FROM replies") > committed + 50, 30,
                           f"replies to orders committed after server kill {kill + 1}")
    finally:
        client.stop()
        server.stop()


def test_an_idle_client_starts_a_new_sequence_when_the_server_forgot_the_old_one(pg_db, maria_db, tmp_path):
    client_app, server_app = pg_db("client"), maria_db("server")
    client_schema(client_app)
    server_schema(server_app)
    pair = Pair(client_app, server_app, reply=True, mode="memory")
    client_config, server_config = pair.write(tmp_path)
    server = NodeProcess(server_config, tmp_path / "server.log").start()
    client = NodeProcess(client_config, tmp_path / "client.log", {"QTP_TEST_SEND": "20"})
    try:
        client.start()
        wait_until(lambda: rows(client_app, "SELECT COUNT(*) FROM replies")[0][0] == 20, 30, "20 replies")
        server.kill()
        server.start()  # knows no sequence now; the client is idle
        client.stop()
        client = NodeProcess(client_config, tmp_path / "client.log", {"QTP_TEST_SEND": "40"})
        client.start()  # memory mode: the client forgot too; it resumes after order 20
        wait_until(lambda: rows(server_app, "SELECT COUNT(DISTINCT k) FROM applied")[0][0] == 40, 30, "40 applied")
        wait_until(lambda: rows(client_app, "SELECT COUNT(*) FROM replies")[0][0] == 40, 30, "40 replies")
    finally:
        client.stop()
        server.stop()
