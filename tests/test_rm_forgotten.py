"""xa mode never applies a message twice, even when the server forgot the sequence that carried it.

The hole (issue 20, found on main): the server stored messages and acknowledged them; the client was
SIGKILLed before it applied the acknowledgements (its rows stayed); the server then ended the sequence for
inactivity and, after ``ended_retention``, forgot it. The restarted client retransmitted, got
UnknownSequence, and sent the same messages again in a new sequence: the server, which could not tell them
from new ones by (sequence, number), applied them a second time. Here 5 s of inactivity and 1 s of
retention stand in for 24 h and 1 h.
"""

from __future__ import annotations

import pytest

from qtp.testing.nodes import NodeProcess, Pair, client_schema, rows, server_schema, wait_until


@pytest.mark.parametrize("secret", [None, "forgotten-pair-secret-0123456789abcdef"], ids=["anonymous", "peers"])
def test_messages_sent_again_after_the_server_forgot_their_sequence_are_not_applied_twice(pg_db, maria_db,
                                                                                          tmp_path, secret):
    """Anonymous senders and named peers alike (a peer's MessageIDs are remembered within its scope)."""
    client_app, server_app = pg_db("client"), maria_db("server")
    client_schema(client_app)
    server_schema(server_app)
    pair = Pair(client_app, server_app, reply=False, limits="inactivity_timeout = 3\nended_retention = 1",
                secret=secret)
    client_config, server_config = pair.write(tmp_path)
    server = NodeProcess(server_config, tmp_path / "server.log").start()
    client = NodeProcess(client_config, tmp_path / "client.log",
                         {"QTP_TEST_SEND": "10", "QTP_FAILPOINTS": "before_acks_applied=crash"})
    try:
        try:
            client.start()
        except RuntimeError:  # it may die before it answers /health: the failpoint fires at once
            pass
        wait_until(lambda: not client.alive(), 60, "the client killed where it applies acknowledgements")
        wait_until(lambda: rows(server_app, "SELECT COUNT(*) FROM applied")[0][0] >= 1, 30, "applies")
        sent = rows(client_app, "SELECT COUNT(*) FROM orders")[0][0]
        unacknowledged = rows(client_app, "SELECT COUNT(*) FROM qtp_rm_outgoing")[0][0]
        assert unacknowledged >= 1  # acknowledged at the server, still queued at the client
        wait_until(lambda: rows(server_app, "SELECT COUNT(*) FROM qtp_rm_destination")[0][0] == 0, 60,
                   "the server forgot the sequence")
        client = NodeProcess(client_config, tmp_path / "client.log", {"QTP_TEST_SEND": "10"})
        client.start()
        wait_until(lambda: rows(client_app, "SELECT COUNT(*) FROM qtp_rm_outgoing")[0][0] == 0, 60,
                   "everything acknowledged again")
        wait_until(lambda: rows(server_app, "SELECT COUNT(*) FROM qtp_rm_incoming")[0][0] == 0, 30,
                   "nothing left to apply")
        applied = rows(server_app, "SELECT k, COUNT(*) FROM applied GROUP BY k ORDER BY k")
        committed = rows(client_app, "SELECT COUNT(*) FROM orders WHERE status = 'committed'")[0][0]
        assert [count for _, count in applied if count > 1] == [], applied
        assert len(applied) == committed == rows(client_app, "SELECT COUNT(*) FROM orders")[0][0] >= sent
    finally:
        client.stop()
        server.stop()
