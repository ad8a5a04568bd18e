"""A peer whose messages the server's handler refuses fills the dead letters (issue 28, F3). The cap on them
([limits] max_dead_letters) counts per peer: before, it was node-wide, so mallory's 10 refused messages at a
cap of 10 left the honest client's next refused order queued for ever, and every order behind it stuck (71 of
71 in the tester's run; here 10 of 10), with no fault back."""

from __future__ import annotations

import json

import pytest

from qtp.testing.nodes import check_exactly_once, rows, wait_until
from qtp.wsrm.protocol import CreateSequence, CreateSequenceResponse, Sequence
from qtp.wsrm.codec import decode
from qtp.testing.nodes import request

from test_security_hostile import ACTION, ANON, _applied, _post, _url, hostile, trap  # noqa: F401 (fixtures)
from zygote import qtp_command

FAILS = 30  # the honest client's order that the server's handler refuses


@pytest.mark.slow
def test_one_peers_dead_letters_do_not_hold_another_peers_sequence(hostile):
    limits = "max_dead_letters = 10\nmax_attempts = 1"
    pair, client, server = hostile(send=40, reply=True, rate=3, limits=limits,
                                   server_env={"QTP_TEST_FAIL": str(FAILS)})
    _, body = _post(_url(server), request(CreateSequence(ANON)))
    identifier = decode(body).body
    assert isinstance(identifier, CreateSequenceResponse)
    for n in range(1, 13):  # 12 messages the handler refuses ("not an order")
        _post(_url(server), request(sequence=Sequence(identifier.identifier, n), payload=b"<junk xmlns='urn:x'/>",
                                    action=ACTION))
    wait_until(lambda: rows(pair.server_app, "SELECT COUNT(*) FROM qtp_rm_dead_letter")[0][0] >= 10, 60,
               "mallory's dead letters")
    assert _applied(pair) < FAILS - 1, "mallory filled the cap too late to test anything"
    try:
        wait_until(lambda: _applied(pair) >= 39, 120, "the honest orders other than the refused one applied")
    except AssertionError:
        raise AssertionError(f"{_applied(pair)} of 39 honest orders applied: the sequence waits behind order "
                             f"{FAILS}") from None
    wait_until(lambda: rows(pair.client_app, "SELECT COUNT(*) FROM replies")[0][0] >= 40, 120,
               "39 replies and a fault")
    result = check_exactly_once(pair.client_app, pair.server_app, reply=True, failed={FAILS})
    assert result["committed"] == 40 and result["applied"] == 39
    listed = json.loads(_qtp("dead-letters", "list", "--json", "--config", server.config))
    by_peer = {}
    for letter in listed:
        by_peer[letter["peer"]] = by_peer.get(letter["peer"], 0) + 1
    honest = next(p for p in by_peer if p != "mallory")
    assert by_peer == {"mallory": 10, honest: 1}, by_peer
    status = json.loads(_qtp("status", "--json", "--config", server.config))
    assert status["messaging"]["dead_letters_per_peer"] == {"mallory": 10, honest: 1}
    assert any("mallory reached the cap of 10 per peer" in w for w in status["warnings"]), status["warnings"]


def _qtp(*args) -> str:
    done = qtp_command(*args)
    assert done.returncode in (0, 1), done.stderr
    return done.stdout
