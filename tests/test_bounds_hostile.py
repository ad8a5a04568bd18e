"""State a peer can make a node hold, bounded per peer (issue 28): real node processes, the deployed
configuration of tests/test_security_hostile.py (secrets, no anonymous requests), mallory an authenticated
peer that offers reply sequences at WS-MakeConnection addresses and never polls. The honest pair keeps
sending (with replies) through each attack and is reconciled exactly once at the end.
"""

from __future__ import annotations

import json
import time
import uuid

import pytest
import sqlalchemy

from qtp.testing.nodes import Pair, request, rows, wait_until
from qtp.wsrm.codec import mc_anonymous
from qtp.wsrm.protocol import CreateSequence, CreateSequenceResponse, Offer, Sequence, SequenceFault, TerminateSequence
from test_security_hostile import ACTION, ANON, _answer, _finish, _post, _url, hostile, trap  # noqa: F401
from zygote import qtp_command

MALLORY_ORDERS = 7_000_000  # mallory's order numbers start above this: out of the honest tally


def _offer() -> Offer:
    """An Offer for replies at a WS-MC address that nobody will ever poll."""
    return Offer(f"urn:uuid:{uuid.uuid4()}", endpoint=mc_anonymous(f"urn:mallory:{uuid.uuid4()}"))


def _mallory_offers(pair: Pair) -> list[dict]:
    """The server's offered (reply) sequences owned by mallory: {route, state}."""
    found = []
    for info, record in rows(pair.server_app, "SELECT info, record FROM qtp_rm_source"):
        info = json.loads(info)
        if info["route"].startswith("offer:") and info.get("owner") == "mallory":
            found.append({"route": info["route"], "state": json.loads(record)["state"]})
    return found


def _reply_rows(pair: Pair, routes: set[str]) -> int:
    """Replies (numbered or not) in the server's outgoing table on ``routes``."""
    if not routes:
        return 0
    names = ", ".join(f"'{r}'" for r in routes)
    return rows(pair.server_app, f"SELECT COUNT(*) FROM qtp_rm_outgoing WHERE route IN ({names})")[0][0]


def _forget_mallorys_orders(pair: Pair) -> None:
    engine = sqlalchemy.create_engine(pair.server_app, poolclass=sqlalchemy.pool.NullPool)
    with engine.begin() as conn:
        conn.execute(sqlalchemy.text(f"DELETE FROM applied WHERE k > {MALLORY_ORDERS}"))
    engine.dispose()


def _commits(pair: Pair) -> int:
    """COMMITs the server's MariaDB has run (only the server node of this test uses it)."""
    engine = sqlalchemy.create_engine(pair.server_app, poolclass=sqlalchemy.pool.NullPool)
    with engine.connect() as conn:
        value = int(conn.execute(sqlalchemy.text("SHOW GLOBAL STATUS LIKE 'Com_commit'")).fetchone()[1])
    engine.dispose()
    return value


def _queued_in_status(config, routes: set[str]) -> int:
    """The messages ``qtp status`` shows an operator as QUEUED on ``routes``."""
    done = qtp_command("status", "--json", "--config", config)
    assert done.returncode == 0, done.stdout + done.stderr
    found, todo = 0, [json.loads(done.stdout)]
    while todo:
        item = todo.pop()
        if isinstance(item, dict):
            if item.get("route") in routes and item.get("state") == "QUEUED":
                found += item["unacknowledged"]
            todo.extend(item.values())
        elif isinstance(item, list):
            todo.extend(item)
    return found


@pytest.mark.slow
def test_replies_held_for_a_peer_that_never_polls_are_capped_and_expire_visible(hostile):
    """Before: per minute, mallory left 444 offered reply sequences that never end and 8,874 held replies
    (unbounded: each cycle made room for the next by terminating its inbound sequence), and the idle node
    committed 374 times a second afterwards (every retransmission timer wrote its unchanged record). Now
    the offered sequences count against max_sequences_per_peer, the replies waiting for mallory against
    max_replies_per_peer (503 before storing, refusal to create), the idle node writes nothing for them,
    and after offer_inactivity_timeout they end, their replies kept (visible, QUEUED) rather than deleted."""
    pair, client, server = hostile(send=40, reply=True, rate=4, limits="max_sequences_per_peer = 8\n"
                                   "max_replies_per_peer = 30\noffer_inactivity_timeout = 15")
    wait_until(lambda: rows(pair.client_app, "SELECT COUNT(*) FROM replies")[0][0] >= 3, 60, "the first replies")
    k, created, refused, statuses = MALLORY_ORDERS, 0, [], {}
    for _ in range(10):  # create with an Offer, 12 orders, terminate: the inbound sequence frees its place
        status, body = _post(_url(server), request(CreateSequence(ANON, offer=_offer())))
        answer = _answer(body).body
        if not isinstance(answer, CreateSequenceResponse):
            assert isinstance(answer, SequenceFault), body
            refused.append(answer.reason)
            continue
        created += 1
        for number in range(1, 13):
            k += 1
            status, body = _post(_url(server), request(sequence=Sequence(answer.identifier, number), action=ACTION,
                                                       payload=f'<order xmlns="urn:test" k="{k}"/>'.encode()))
            statuses[status] = statuses.get(status, 0) + 1
        _post(_url(server), request(TerminateSequence(answer.identifier)))
    offers = _mallory_offers(pair)
    routes = {o["route"] for o in offers}
    wait_until(lambda: _reply_rows(pair, routes) >= statuses.get(200, 0), 30, "mallory's replies held")
    held = _reply_rows(pair, routes)
    print(f"mallory: {created} created, {len(refused)} refused, statuses {statuses}, {len(offers)} offered "
          f"sequences, {held} replies held")
    assert created <= 4 and refused, refused  # (it had 10 of 10, 120 orders each got a reply held)
    assert held <= 30 + 12, held  # the cap (plus what was stored before its replies were numbered)
    assert statuses.get(503), statuses
    wait_until(lambda: rows(pair.server_app, f"SELECT COUNT(*) FROM applied WHERE k > {MALLORY_ORDERS}")[0][0]
               == statuses.get(200, 0), 30, "mallory's accepted orders applied")
    _forget_mallorys_orders(pair)
    _finish(pair, 40, reply=True)
    began, idle = _commits(pair), time.monotonic()  # the honest pair is done: the server is idle
    time.sleep(6)
    rate = (_commits(pair) - began) / (time.monotonic() - idle)
    print(f"idle server with replies held: {rate:.1f} commits/s")
    assert rate < 5, rate  # (before: ~20: timers wrote unchanged records, every route was read 5 times a second)
    wait_until(lambda: not [o for o in _mallory_offers(pair) if o["state"] not in ("TERMINATED", "FAILED")], 60,
               "mallory's offered sequences to expire")
    assert _reply_rows(pair, routes) == held  # not deleted: QUEUED on their offer: routes, for an operator
    assert _queued_in_status(server.config, routes) == held
    _finish(pair, 40, reply=True)


def test_create_and_terminate_cycles_leave_no_offered_sequence_and_offers_count_in_the_quota(hostile):
    """Before: 40 create + terminate cycles left 40 offered reply sequences that never end (each waited for a
    CloseSequenceResponse from a WS-MC address nobody polls); and with max_sequences_per_peer = 10, 15 of 15
    cycles of create + one order + terminate were accepted (the inbound sequence freed its place; the offered
    one, holding the reply, counted nowhere). Now an offered sequence that carried no reply ends with its
    inbound sequence, and one that outlives it counts in the quota."""
    pair, client, server = hostile(send=30, reply=True, rate=6, limits="max_sequences_per_peer = 10")
    for _ in range(40):
        status, body = _post(_url(server), request(CreateSequence(ANON, offer=_offer())))
        answer = _answer(body).body
        assert isinstance(answer, CreateSequenceResponse), body
        status, body = _post(_url(server), request(TerminateSequence(answer.identifier)))
        assert status == 200, body
    wait_until(lambda: not _mallory_offers(pair), 30, "no offered sequence of mallory left")
    answers = []
    for k in range(MALLORY_ORDERS + 1, MALLORY_ORDERS + 16):
        answer = _answer(_post(_url(server), request(CreateSequence(ANON, offer=_offer())))[1]).body
        answers.append(answer)
        if isinstance(answer, CreateSequenceResponse):
            status, body = _post(_url(server), request(sequence=Sequence(answer.identifier, 1), action=ACTION,
                                                       payload=f'<order xmlns="urn:test" k="{k}"/>'.encode()))
            assert status == 200, body
            _post(_url(server), request(TerminateSequence(answer.identifier, 1)))
            wait_until(lambda: rows(pair.server_app, f"SELECT COUNT(*) FROM applied WHERE k = {k}")[0][0], 30,
                       "mallory's order applied")  # (then its reply waits, and its inbound sequence ends)
    created = [a for a in answers if isinstance(a, CreateSequenceResponse)]
    assert len(created) == 10, answers
    assert all("max_sequences_per_peer" in a.reason for a in answers[10:]), answers
    _forget_mallorys_orders(pair)
    _finish(pair, 30, reply=True)
