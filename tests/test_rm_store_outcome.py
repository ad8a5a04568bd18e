"""A store transaction of the receiver whose COMMIT landed but whose caller saw an error (the connection broke
after the COMMIT, the database was killed just then) must still hand the stored messages to the invoker.

Found by the coupled-messaging campaign (a MariaDB kill): the receiver reloaded the sequence from the store,
so the retransmitted messages were duplicates there and were never handed to the invoker; they stayed
stored and unapplied until the node restarted, and the sequence behind them stalled."""

from __future__ import annotations

from qtp.testing.nodes import Pair, check_exactly_once, client_schema, rows, server_schema, wait_until


def test_messages_whose_store_commit_raised_afterwards_are_still_applied(pg_db, maria_db, run_pair):
    client_app, server_app = pg_db("client"), maria_db("server")
    client_schema(client_app)
    server_schema(server_app)
    pair = Pair(client_app, server_app, reply=False)
    # the 3rd and 6th store transactions of the server raise right after their COMMIT
    run_pair(pair, send=30, server_env={"QTP_FAILPOINTS": "after_store_before_ack=error@3"})
    wait_until(lambda: rows(server_app, "SELECT COUNT(*) FROM applied")[0][0] >= 30, 60, "every order applied")
    check_exactly_once(client_app, server_app, reply=False)
