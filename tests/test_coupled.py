"""Coupled messaging (qtp.coupled) between real nodes over HTTP, each with its own database.

The Dependency-Spheres example (seed 001, section 5): an account is opened in the sender's database
directly and in another database through a message that must be processed; whatever fails, the end is
both accounts or neither (shared coupling), or the recipient's account closed by its compensator
(compensatable). Then fan-out with "processed by at least 2 of 3", a mixed transaction, and the wire format
against its schema.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest
import sqlalchemy as sa
from lxml import etree

import qtp
from qtp.coupled import Coupled, processed
from qtp.coupled import _wire as wire
from qtp.errors import ConfigurationError, RollbackError
from qtp.testing.coupled_nodes import accounts, accounts_schema, node_ids, write_configs
from qtp.testing.nodes import rows, wait_until

from coupled_support import OPEN, Bank
from zygote import qtp_command

SCHEMA = Path(qtp.__file__).parent / "coupled" / "coupled.xsd"


def _outbound(url: str) -> dict[str, tuple[str, str]]:
    return {r[0]: (r[1], r[2]) for r in rows(url, "SELECT id, state, recipient FROM qtp_coupled_out")}


def _inbound(url: str) -> dict[str, str]:
    return dict(rows(url, "SELECT id, state FROM qtp_coupled_in"))


def test_shared_coupling_opens_both_accounts_or_neither(banks):
    b = banks({"a": ("pg", "queued"), "b": ("maria", "shared")})
    a, bb = b["a"], b["b"]
    bb.refuse.add("acc-2")
    with a.node.manager.transaction() as tx:
        a.open_here(tx, "acc-1")
        a.coupled.send(tx, bb.id, b"<open id='acc-1'/>", action=OPEN, condition=processed(within=10))
    assert accounts(a.url) == {"acc-1": "open"}
    wait_until(lambda: accounts(bb.url) == {"acc-1": "open"}, 20, "the account at b committed")
    # the recipient's handler fails: the sender's transaction rolls back, and b keeps nothing
    with pytest.raises(RollbackError, match="not processed by every recipient"):
        with a.node.manager.transaction() as tx:
            a.open_here(tx, "acc-2")
            a.coupled.send(tx, bb.id, b"<open id='acc-2'/>", action=OPEN, condition=processed(within=10))
    assert "acc-2" not in accounts(a.url)
    wait_until(lambda: "failed" in _inbound(bb.url).values(), 10, "b's row failed")
    assert "acc-2" not in accounts(bb.url)
    wait_until(lambda: sorted(_outbound(a.url).values()) == [("aborted", "failed"), ("committed", "committed")],
               10, "a's sphere log: one committed, one aborted")


def test_the_sender_application_failing_after_the_recipient_prepared_rolls_the_recipient_back(banks):
    b = banks({"a": ("maria", "queued"), "b": ("pg", "shared")})
    a, bb = b["a"], b["b"]
    with pytest.raises(RuntimeError, match="after the send"):
        with a.node.manager.transaction() as tx:
            a.open_here(tx, "acc-9")
            ids = a.coupled.send(tx, bb.id, b"<open id='acc-9'/>", action=OPEN, condition=processed(within=10))
            wait_until(lambda: _inbound(bb.url).get(ids[bb.id]) == "prepared", 15, "b prepared")
            raise RuntimeError("the application fails after the send")
    wait_until(lambda: _inbound(bb.url).get(ids[bb.id]) == "rolled-back", 15, "b rolled back")
    wait_until(lambda: _outbound(a.url)[ids[bb.id]] == ("aborted", "rolled-back"), 15, "a told")
    assert accounts(a.url) == {} and accounts(bb.url) == {}
    assert rows(bb.url, "SELECT COUNT(*) FROM pg_prepared_xacts")[0][0] == 0


def test_a_recipient_down_past_the_deadline_ends_with_neither_account(banks):
    b = banks({"a": ("pg", "queued"), "b": ("maria", "shared")})
    a, bb = b["a"], b["b"]
    bb.close()
    started = time.monotonic()
    with pytest.raises(RollbackError, match="not processed"):
        with a.node.manager.transaction() as tx:
            a.open_here(tx, "acc-3")
            ids = a.coupled.send(tx, bb.id, b"<open id='acc-3'/>", action=OPEN, condition=processed(within=2))
    assert 1.5 < time.monotonic() - started < 8
    assert accounts(a.url) == {}
    bb.start()  # the original is still delivered, then its Abort: it is cancelled, never processed
    wait_until(lambda: _inbound(bb.url).get(ids[bb.id]) == "cancelled", 30, "b cancelled the original")
    wait_until(lambda: _outbound(a.url)[ids[bb.id]] == ("aborted", "cancelled"), 15, "a's log settled")
    assert accounts(bb.url) == {}


def test_compensatable_recipient_is_compensated_when_the_sender_aborts(banks):
    b = banks({"a": ("pg", "queued"), "b": ("maria", "compensatable")})
    a, bb = b["a"], b["b"]
    with pytest.raises(RuntimeError):
        with a.node.manager.transaction() as tx:
            a.open_here(tx, "acc-4")
            ids = a.coupled.send(tx, bb.id, b"<open id='acc-4'/>", action=OPEN, condition=processed(within=10),
                                 compensation=b"<close id='acc-4'/>")
            wait_until(lambda: accounts(bb.url) == {"acc-4": "open"}, 15, "b committed on its own")
            raise RuntimeError("the application fails after the recipient committed")
    wait_until(lambda: accounts(bb.url) == {"acc-4": "closed"}, 15, "b's compensator ran")
    wait_until(lambda: _outbound(a.url)[ids[bb.id]] == ("aborted", "compensated"), 15, "a's log settled")
    assert accounts(a.url) == {}


def test_fan_out_processed_by_at_least_two_of_three(banks):
    b = banks({"a": ("pg", "queued"), "b": ("maria", "compensatable"), "c": ("pg", "compensatable"),
               "d": ("maria", "compensatable")})
    a, recipients = b["a"], [b["b"], b["c"], b["d"]]
    b["d"].close()
    with a.node.manager.transaction() as tx:
        a.open_here(tx, "acc-5")
        a.coupled.send(tx, [r.id for r in recipients], b"<open id='acc-5'/>", action=OPEN,
                       condition=processed(at_least=2, within=5))
    assert accounts(b["b"].url) == {"acc-5": "open"} and accounts(b["c"].url) == {"acc-5": "open"}
    # two of three down: the condition fails, the one that processed it is compensated
    b["c"].close()
    with pytest.raises(RollbackError, match="at least 2 of 3"):
        with a.node.manager.transaction() as tx:
            a.open_here(tx, "acc-6")
            a.coupled.send(tx, [r.id for r in recipients], b"<open id='acc-6'/>", action=OPEN,
                           condition=processed(at_least=2, within=3))
    wait_until(lambda: accounts(b["b"].url).get("acc-6") == "closed", 15, "b compensated acc-6")
    # the ones that were down learn both outcomes when they return: acc-5 committed, acc-6 cancelled
    b["c"].start()
    b["d"].start()
    for r in (b["c"], b["d"]):
        try:
            wait_until(lambda r=r: accounts(r.url) == {"acc-5": "open"} and
                       sorted(_inbound(r.url).values()) == ["cancelled", "committed"], 30, f"{r.id} caught up")
        except AssertionError:
            raise AssertionError(f"{r.id}: accounts {accounts(r.url)}, coupled {_inbound(r.url)}") from None
    assert accounts(a.url) == {"acc-5": "open"}


def test_mixed_transaction_shared_and_compensatable(banks):
    b = banks({"a": ("pg", "queued"), "b": ("maria", "shared"), "c": ("pg", "compensatable")})
    a, shared, comp = b["a"], b["b"], b["c"]
    with a.node.manager.transaction() as tx:
        a.open_here(tx, "acc-7")
        a.coupled.send(tx, [shared.id, comp.id], b"<open id='acc-7'/>", action=OPEN, condition=processed(within=10))
    wait_until(lambda: accounts(shared.url) == {"acc-7": "open"}, 15, "shared committed")
    assert accounts(comp.url) == {"acc-7": "open"}
    with pytest.raises(RuntimeError):
        with a.node.manager.transaction() as tx:
            a.open_here(tx, "acc-8")
            ids = a.coupled.send(tx, [shared.id, comp.id], b"<open id='acc-8'/>", action=OPEN,
                                 condition=processed(within=10))
            wait_until(lambda: _inbound(shared.url).get(ids[shared.id]) == "prepared"
                       and accounts(comp.url).get("acc-8") == "open", 15, "both processed")
            raise RuntimeError("abort after both processed")
    wait_until(lambda: accounts(comp.url).get("acc-8") == "closed", 15, "compensatable compensated")
    try:
        wait_until(lambda: _inbound(shared.url).get(ids[shared.id]) == "rolled-back", 15, "shared rolled back")
    except AssertionError:
        raise AssertionError(f"shared: {rows(shared.url, 'SELECT id, state, decision FROM qtp_coupled_in')}, "
                             f"sender: {_outbound(a.url)}") from None
    assert "acc-8" not in accounts(shared.url) and "acc-8" not in accounts(a.url)


def _c14n(xml: bytes | None) -> bytes | None:
    return None if xml is None else etree.tostring(etree.fromstring(xml), method="c14n")


def test_every_control_message_follows_the_schema_and_bad_ones_are_refused():
    schema = etree.XMLSchema(etree.parse(str(SCHEMA)))
    t = wire.new_token()
    made = [
        wire.Control("Message", "n/1:1", transaction="n/1", coordinator="n", action="urn:x", deadline=12.5,
                     body=b"<x:a xmlns:x='urn:x'>1</x:a>", token=t),
        wire.Control("Message", "n/1:2", transaction="n/1", coordinator="n", action="urn:x", deadline=1.0,
                     body=b"<a/>", census=True, token=t, require="shared"),
        wire.Control("Commit", "n/1:1", token=t), wire.Control("Commit", "n/1:1", token=t, coordinator="n"),
        wire.Control("Abort", "n/1:1", token=t), wire.Control("Status", "n/1:1", token=t),
        wire.Control("Abort", "n/1:1", body=b"<undo/>", token=t, coordinator="n"),
        *[wire.Control("Notify", "n/1:1", state=s, coupling=c, reason="r" if s == "failed" else None, token=t)
          for s in wire.STATES for c in wire.COUPLINGS],
    ]
    for control in made:
        payload = wire.encode(control)
        schema.assertValid(etree.fromstring(payload))
        decoded = wire.decode(wire.ACTION[control.kind], payload)
        assert replace(decoded, body=_c14n(decoded.body)) == replace(control, body=_c14n(control.body))
    for bad in (replace(made[2], token=""), replace(made[0], require="loose")):
        with pytest.raises(wire.CoupledWireError):
            wire.encode(bad)
    for action, payload in [
        (wire.ACTION["Commit"], b"<Commit xmlns='urn:other'><Id>x</Id></Commit>"),
        (wire.ACTION["Notify"], f"<qc:Notify xmlns:qc='{wire.NS}'><qc:Id>x</qc:Id><qc:State>won</qc:State>"
                                f"<qc:Coupling>shared</qc:Coupling></qc:Notify>".encode()),
        (wire.ACTION["Commit"], f"<qc:Commit xmlns:qc='{wire.NS}'><qc:Id>{'x' * 300}</qc:Id></qc:Commit>".encode()),
        (wire.ACTION["Message"], f"<qc:Message xmlns:qc='{wire.NS}'><qc:Id>x</qc:Id></qc:Message>".encode()),
        (wire.ACTION["Message"], f"<qc:Message xmlns:qc='{wire.NS}'><qc:Id>x</qc:Id><qc:Transaction>t</qc:Transaction>"
                                 "<qc:Coordinator>n</qc:Coordinator><qc:Action>urn:x</qc:Action><qc:Deadline>1"
                                 "</qc:Deadline><qc:Census>maybe</qc:Census><qc:Body><a/></qc:Body></qc:Message>"
                                 .encode()),
        ("urn:not-coupled", b"<a/>"),
        (wire.ACTION["Commit"], f"<qc:Commit xmlns:qc='{wire.NS}'><qc:Id>x</qc:Id></qc:Commit>".encode()),  # no token
        (wire.ACTION["Commit"], f"<qc:Commit xmlns:qc='{wire.NS}'><qc:Id>x</qc:Id><qc:Token>{'A' * 32}</qc:Token>"
                                "</qc:Commit>".encode()),
        (wire.ACTION["Commit"], b"<!DOCTYPE x [<!ENTITY e SYSTEM 'file:///etc/passwd'>]><x>&e;</x>"),
    ]:
        with pytest.raises(wire.CoupledWireError):
            wire.decode(action, payload)


def test_bad_use_is_refused_with_clear_errors(banks):
    b = banks({"a": ("pg", "queued"), "b": ("pg", "shared")})
    a, bb = b["a"], b["b"]
    with a.node.manager.transaction() as tx:
        with pytest.raises(ConfigurationError, match="unknown channel"):
            a.coupled.send(tx, "nowhere", b"<x/>", action=OPEN)
        with pytest.raises(ConfigurationError, match="names nowhere"):
            a.coupled.send(tx, bb.id, b"<x/>", action=OPEN, condition=processed(by=["nowhere"]))
        with pytest.raises(ConfigurationError, match="asks for 2 recipients of 1"):
            a.coupled.send(tx, bb.id, b"<x/>", action=OPEN, condition=processed(at_least=2))
    with a.node.manager.transaction(timeout=5) as tx:
        with pytest.raises(ConfigurationError, match="does not fit"):
            a.coupled.send(tx, bb.id, b"<x/>", action=OPEN, condition=processed(within=10))
    with pytest.raises(ConfigurationError, match="positive"):
        processed(within=0)
    with pytest.raises(ConfigurationError, match="coupling is one of"):
        bb.coupled.handler("urn:x", coupling="loose")


def _process_pair(request, tmp_path, count: int, recipient_env: dict, sender_env: dict):
    """A sender (PostgreSQL) and a recipient (MariaDB) as ``qtp serve`` processes of the coupled test app; the
    sender opens ``count`` accounts at the recipient, each as a coupled transaction."""
    from qtp.testing.nodes import NodeProcess

    urls = {"a": request.getfixturevalue("pg_db")("a"), "b": request.getfixturevalue("maria_db")("b")}
    for url in urls.values():
        accounts_schema(url)
    ids = node_ids(list(urls))
    configs = write_configs(tmp_path, urls, ids)
    app = "qtp.testing.coupled_app:node"
    recipient = NodeProcess(configs["b"], tmp_path / "b.log", recipient_env, app=app)
    sender = NodeProcess(configs["a"], tmp_path / "a.log", {"QTP_COUPLED_SEND": str(count),
                                                            "QTP_COUPLED_TO": ids["b"], **sender_env}, app=app)
    return urls, ids, sender, recipient


@pytest.mark.slow
@pytest.mark.parametrize("coupling", ["shared", "compensatable"])
def test_sender_and_recipient_killed_again_and_again_every_transaction_stays_atomic(request, tmp_path, coupling):
    """Processes: the sender opens 50 accounts (every 7th aborted by the application) as coupled transactions
    with a recipient whose handler takes 0.3 s, so the sender spends most of its time in Phase 0 and the
    recipient holds prepared (shared) or committed (compensatable) work. Each is SIGKILLed three times,
    in turn; at the end every transaction is atomic by its coupling (judged from the databases alone)."""
    from qtp.testing.coupled_nodes import judge, settled

    count = 50
    urls, ids, sender, recipient = _process_pair(
        request, tmp_path, count, {"QTP_COUPLED_COUPLING": coupling, "QTP_COUPLED_SLOW": "0.3"},
        {"QTP_COUPLED_WITHIN": "4", "QTP_COUPLED_ABORT_EVERY": "7"})
    try:
        recipient.start()
        sender.start()
        for i, victim in enumerate([sender, recipient] * 3):
            at = 5 + 7 * i
            wait_until(lambda: rows(urls["a"], "SELECT COALESCE(MAX(k), 0) FROM attempts")[0][0] >= at, 90,
                       f"{at} transactions tried")
            time.sleep(0.2 * (i % 3))
            victim.kill()
            victim.start()
        wait_until(lambda: settled(urls["a"], [urls["b"]], count), 180, "every coupled message settled")
        result = judge(urls["a"], [(urls["b"], coupling)])
    finally:
        sender.kill()
        recipient.kill()
    assert result["tried"] == count
    assert 0 < result["committed"] < count  # both outcomes happened
    assert rows(urls["b"], "SELECT COUNT(*) FROM qtp_coupled_in WHERE state = 'prepared'")[0][0] == 0


@pytest.mark.slow
def test_small_campaign_kills_of_nodes_and_databases_under_loss_judged_by_spark(tmp_path):
    """benchmarks/coupled_campaign.py in a small form: 40 coupled transactions from a sender to a shared and a
    compensatable recipient, 10 % HTTP loss, the three nodes and both database servers each SIGKILLed;
    every transaction atomic by its coupling (the judge) and Spark's reconciliation exactly-once, with the
    compensated accounts in their own class."""
    import json
    import subprocess
    import sys

    out = tmp_path / "campaign"
    done = subprocess.run([sys.executable, "benchmarks/coupled_campaign.py", "--transactions", "40", "--kills", "5",
                           "--loss", "0.1", "--seed", "7", "--root", str(tmp_path / "db"), "--out", str(out),
                           "--stop-databases", "--drain-s", "240"],
                          cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    assert result["verdict"] == "atomic" and result["settled"]
    assert set(result["victims"]) == {"sender", "b", "c", "postgresql", "mariadb"}
    assert all(result["victims"].values())
    assert result["judge"]["tried"] == 40 and 0 < result["judge"]["committed"] < 40
    assert result["spark"]["c"]["counts"]["compensated"] == result["judge"]["compensated"]
    assert result["spark"]["b"]["counts"]["ok"] == 40


@pytest.mark.slow
def test_small_mixed_campaign_four_recipients_with_refusals_and_one_attempt_under_kills_and_loss(tmp_path):
    """benchmarks/coupled_campaign.py --fanout mixed in a small form: 40 transactions, each one coupled send to
    two shared recipients (MariaDB, PostgreSQL) and two compensatable ones (PostgreSQL, MariaDB), "processed by
    3 of them, s among them", each recipient refusing some accounts by its rule, max_attempts = 1, 10 % HTTP
    loss, every node and both database servers SIGKILLed once. The mixed judge (every row final and in
    agreement at both ends, refusals only where the rule refuses, no prepared transaction left) and Spark at
    one shared and one compensatable recipient."""
    import json
    import subprocess
    import sys

    out = tmp_path / "campaign"
    done = subprocess.run([sys.executable, "benchmarks/coupled_campaign.py", "--fanout", "mixed", "--transactions",
                           "40", "--kills", "7", "--loss", "0.1", "--seed", "7", "--root", str(tmp_path / "db"),
                           "--out", str(out), "--stop-databases", "--drain-s", "240", "--spark-only", "s,c1"],
                          cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    assert result["verdict"] == "atomic" and result["settled"] and result["max_attempts"] == 1
    assert result["victims"] == {v: 1 for v in ("sender", "s", "c1", "c2", "s2", "postgresql", "mariadb")}
    judged = result["judge"]
    assert judged["tried"] == 40 and 0 < judged["committed"] < 40 and judged["prepared_left"] == 0
    assert sum(judged["refused"].values()) > 0
    assert result["spark"]["s"]["counts"]["ok"] == 40
    assert result["spark"]["c1"]["counts"]["compensated"] == judged["compensated"]["c1"]


def _qtp(*args: str) -> tuple[int, str]:
    done = qtp_command(*args)
    return done.returncode, done.stdout + done.stderr


def test_a_compensation_that_keeps_failing_is_kept_in_the_log_shown_and_retried_by_the_operator(banks):
    import json

    b = banks({"a": ("pg", "queued"), "b": ("maria", "compensatable")})
    a, bb = b["a"], b["b"]
    broken = {"yes": True}
    original = bb.coupled.recipient.compensators[OPEN]

    def flaky(tx, message):
        if broken["yes"]:
            raise RuntimeError("the compensator's service is down")
        original(tx, message)

    bb.coupled.recipient.compensators[OPEN] = flaky
    with pytest.raises(RuntimeError, match="app"):
        with a.node.manager.transaction() as tx:
            a.open_here(tx, "acc-10")
            ids = a.coupled.send(tx, bb.id, b"<open id='acc-10'/>", action=OPEN, condition=processed(within=10))
            wait_until(lambda: accounts(bb.url) == {"acc-10": "open"}, 15, "b committed on its own")
            raise RuntimeError("app")
    cid = ids[bb.id]
    wait_until(lambda: _outbound(a.url)[cid] == ("aborted", "compensation-failed"), 15, "the failure reported")
    assert accounts(bb.url) == {"acc-10": "open"}
    code, text = _qtp("coupled", "list", "--json", "--config", str(a.config))
    assert code == 0 and [e["id"] for e in json.loads(text)] == [cid]
    code, text = _qtp("status", "--config", str(a.config))
    assert code == 1 and "not yet undone by their recipient" in text and cid in text
    code, text = _qtp("status", "--config", str(bb.config))
    assert "compensation-failed" in text
    broken["yes"] = False
    code, text = _qtp("coupled", "retry", "--all", "--config", str(a.config))
    assert code == 0 and "1 coupled message(s)" in text
    wait_until(lambda: accounts(bb.url) == {"acc-10": "closed"}, 20, "compensated after the retry")
    wait_until(lambda: _outbound(a.url)[cid] == ("aborted", "compensated"), 15, "the log entry closed")
    code, text = _qtp("coupled", "list", "--config", str(a.config))
    assert code == 0 and "no open compensation-log entries" in text
    code, text = _qtp("coupled", "retry", "nosuch", "--config", str(a.config))
    assert code != 0 and "nosuch" in text


def test_a_shared_recipient_that_could_not_record_its_vote_undoes_its_prepared_work_and_tries_again(banks):
    """The vote's transaction fails right after the subordinate prepared (failpoint): the prepared branch
    must not stay behind holding the account's lock; the next attempt undoes it and processes again."""
    from qtp.coordinator import failpoints

    b = banks({"a": ("pg", "queued"), "b": ("maria", "shared")})
    a, bb = b["a"], b["b"]
    failpoints.configure("coupled_after_prepare=error@1")
    try:
        with a.node.manager.transaction() as tx:
            a.open_here(tx, "acc-11")
            a.coupled.send(tx, bb.id, b"<open id='acc-11'/>", action=OPEN, condition=processed(within=20))
    finally:
        failpoints.configure(None)
    wait_until(lambda: accounts(bb.url) == {"acc-11": "open"}, 20, "b committed")
    assert accounts(a.url) == {"acc-11": "open"}
    assert [r for r in rows(bb.url, "XA RECOVER") if bb.id.encode() in bytes(r[3])] == []


@pytest.mark.parametrize("point,victim,level", [
    ("coupled_after_prepare", "recipient", "processed"), ("coupled_after_send", "sender", "processed"),
    ("coupled_after_send", "sender", "delivered"), ("coupled_before_commit", "sender", "processed")])
def test_a_node_killed_at_each_coupled_failpoint_leaves_every_transaction_atomic(request, tmp_path, point, victim,
                                                                                 level):
    """Processes; the named node kills itself (SIGKILL) at the failpoint on its 3rd pass, is restarted without
    it, and the 8 transactions end atomic; nothing stays prepared. ``delivered``: the sender waits for the
    census (the shared recipient joins, then must vote), so the kill falls in the census."""
    from qtp.testing.coupled_nodes import judge, settled

    count = 8
    fail = {"QTP_FAILPOINTS": f"{point}=crash@3"}
    urls, ids, sender, recipient = _process_pair(
        request, tmp_path, count, {"QTP_COUPLED_COUPLING": "shared", **(fail if victim == "recipient" else {})},
        {"QTP_COUPLED_WITHIN": "4", "QTP_COUPLED_LEVEL": level, **(fail if victim == "sender" else {})})
    dying = recipient if victim == "recipient" else sender
    try:
        recipient.start()
        sender.start()
        wait_until(lambda: not dying.alive(), 60, f"the {victim} killed by {point}")
        dying.env.pop("QTP_FAILPOINTS")
        dying.start()
        wait_until(lambda: settled(urls["a"], [urls["b"]], count), 120, "every coupled message settled")
        result = judge(urls["a"], [(urls["b"], "shared")])
    finally:
        sender.kill()
        recipient.kill()
    assert result["tried"] == count and result["committed"] >= count - 2
    assert [r for r in rows(urls["b"], "XA RECOVER") if ids["b"].encode() in bytes(r[3])] == []


def test_locks_of_a_prepared_recipient_are_released_at_the_deadline_while_the_sender_still_runs(banks):
    """The application keeps its transaction open long after its coupled send: the shared recipient's
    prepared branch (and its lock on the account) is rolled back a moment after the deadline, not when the
    application finally ends; its commit then fails."""
    b = banks({"a": ("pg", "queued"), "b": ("pg", "shared")})
    a, bb = b["a"], b["b"]
    with pytest.raises(RollbackError):
        with a.node.manager.transaction() as tx:
            a.open_here(tx, "acc-12")
            sent = time.monotonic()
            ids = a.coupled.send(tx, bb.id, b"<open id='acc-12'/>", action=OPEN, condition=processed(within=2))
            wait_until(lambda: _inbound(bb.url).get(ids[bb.id]) == "prepared", 10, "b prepared (locks held)")
            assert rows(bb.url, "SELECT COUNT(*) FROM pg_prepared_xacts WHERE database = current_database()")[0][0] == 1
            wait_until(lambda: _inbound(bb.url).get(ids[bb.id]) == "rolled-back", 10, "b rolled back")
            released = time.monotonic() - sent
            assert rows(bb.url, "SELECT COUNT(*) FROM pg_prepared_xacts WHERE database = current_database()")[0][0] == 0
            time.sleep(1.0)  # the application is still in its block
    assert 2.0 <= released < 6.0
    assert accounts(a.url) == {} and accounts(bb.url) == {}


def test_a_prepared_recipient_past_its_deadline_asks_the_sender_and_gets_the_decision_again(banks):
    """Recovery across nodes: a shared recipient that holds a prepared row past its deadline asks the
    sender (Status); the sender answers from its sphere log. Here the recipient's row is put back to
    "prepared" after the transaction committed, as a recipient would be that lost its decision; the answer
    (Commit, resolved idempotently) settles it."""
    b = banks({"a": ("pg", "queued"), "b": ("maria", "shared")})
    a, bb = b["a"], b["b"]
    with a.node.manager.transaction() as tx:
        a.open_here(tx, "acc-13")
        ids = a.coupled.send(tx, bb.id, b"<open id='acc-13'/>", action=OPEN, condition=processed(within=1.5))
    cid = ids[bb.id]
    wait_until(lambda: _inbound(bb.url).get(cid) == "committed", 15, "b committed")
    engine = sa.create_engine(bb.url)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE qtp_coupled_in SET state = 'prepared', decision = NULL WHERE id = :i"), {"i": cid})
    engine.dispose()
    wait_until(lambda: _inbound(bb.url).get(cid) == "committed", 20, "settled again by the sender's answer")
    assert accounts(bb.url) == {"acc-13": "open"}
    assert rows(a.url, "SELECT state, recipient FROM qtp_coupled_out WHERE id = :i".replace(":i", f"'{cid}'")) == \
        [("committed", "committed")]


def test_the_documented_state_diagrams_are_drawn_from_the_transition_tables():
    from qtp.coupled import _states as states

    text = (Path(qtp.__file__).parent.parent / "docs" / "coupled.md").read_text()
    drawn = text.split("<!-- states:begin -->\n", 1)[1].split("\n<!-- states:end -->", 1)[0]
    assert drawn == states.diagrams(), "docs/coupled.md: paste the output of python -m qtp.coupled._states"
    # every state the recipient can reach can still end: a final state is reachable from it
    reachable = {t for (_, _), t in states.RECIPIENT.items()}
    ends = set(states.FINAL)
    for _ in range(len(reachable)):
        ends |= {s for (s, _), t in states.RECIPIENT.items() if t in ends and s is not None}
    assert reachable <= ends, f"states with no way to a final state: {sorted(reachable - ends)}"
    assert set(states.FINAL) <= set(states.REPORT), "every final state is reported to the sender"
    with pytest.raises(Exception, match="not in its transition table"):
        states.next_state(states.RECIPIENT, "committed", "abort")  # a committed original is never undone


def test_the_coupled_table_of_qtp_toml_gives_coupled_its_defaults(pg_db, tmp_path):
    from qtp.config import load_config
    from qtp.wsrm.runtime._settings import node_settings

    urls = {"a": pg_db("a"), "b": pg_db("b")}
    ids = node_ids(list(urls))
    configs = write_configs(tmp_path, urls, ids)
    text = configs["a"].read_text()
    configs["a"].write_text(text + f'\n[coupled]\nworkers = 2\nsweep_interval = 0.25\nreplies = {{ "{ids["b"]}x" = '
                                   f'"{ids["b"]}" }}\n')
    configs["b"].write_text(configs["b"].read_text() + "\n[coupled]\nworkers = 2\n")
    node, other = qtp.Node.from_config(configs["a"]), qtp.Node.from_config(configs["b"])
    try:
        coupled = Coupled(node, start=False)
        assert (coupled.recipient._pool._max_workers, coupled.sweep_interval) == (2, 0.25)
        assert coupled.site.reply_channel(ids["b"] + "x", None) == ids["b"]  # from [coupled] replies
        assert Coupled(other, workers=3, start=False).recipient._pool._max_workers == 3  # arguments win
    finally:
        node.close()
        other.close()
    for bad, match in [("workers = 0", "workers must be"), ("sweep = 1", "takes workers"),
                       ('replies = { x = "nowhere" }', "unknown channel")]:
        configs["a"].write_text(text + f"\n[coupled]\n{bad}\n")
        config = load_config(configs["a"])
        with pytest.raises(ConfigurationError, match=match):
            node_settings(config.messaging, set(config.resources))


def test_a_handler_waits_for_a_lock_no_longer_than_coupled_lock_timeout(pg_db, tmp_path):
    """One coupling worker (``[coupled] workers = 1``); the handler of acc-1 needs a lock another transaction
    holds (an uncommitted insert of the same account: a peer's prepared work would hold it the same way).
    With ``[limits] coupled_lock_timeout = 1`` the attempt gives up after a second (a transient failure, not
    counted) and the worker serves acc-2 meanwhile; without a bound the one thread would wait for good."""
    import threading

    urls = {"a": pg_db("a"), "b": pg_db("b")}
    for url in urls.values():
        accounts_schema(url)
    ids = node_ids(list(urls))
    configs = write_configs(tmp_path, urls, ids, limits="coupled_lock_timeout = 1")
    configs["b"].write_text(configs["b"].read_text() + "\n[coupled]\nworkers = 1\n")
    a, b = Bank(configs["a"], urls["a"], "queued").start(), Bank(configs["b"], urls["b"], "compensatable").start()
    holder = sa.create_engine(urls["b"], poolclass=sa.pool.NullPool)
    blocker = holder.connect()
    blocker.exec_driver_sql("INSERT INTO accounts (id, status) VALUES ('acc-1', 'held')")  # uncommitted
    outcome = {}

    def first():
        try:
            with a.node.manager.transaction(timeout=30) as tx:
                a.open_here(tx, "acc-1")
                a.coupled.send(tx, b.id, b"<open id='acc-1'/>", action=OPEN, condition=processed(within=20))
            outcome["acc-1"] = "committed"
        except RollbackError as exc:
            outcome["acc-1"] = str(exc)

    thread = threading.Thread(target=first)
    try:
        thread.start()
        wait_until(lambda: len(rows(urls["b"], "SELECT id FROM qtp_coupled_in")) == 1, 10, "acc-1 arrived at b")
        wait_until(lambda: rows(urls["b"], "SELECT COUNT(*) FROM pg_stat_activity WHERE datname = current_database() "
                                           "AND wait_event_type = 'Lock'")[0][0] >= 1, 10,
                   "the one worker thread at acc-1's insert, behind the lock")
        started = time.monotonic()
        with a.node.manager.transaction() as tx:
            a.open_here(tx, "acc-2")
            a.coupled.send(tx, b.id, b"<open id='acc-2'/>", action=OPEN, condition=processed(within=8))
        assert time.monotonic() - started < 8
        assert accounts(b.url).get("acc-2") == "open"
        assert rows(urls["b"], "SELECT attempts FROM qtp_coupled_in WHERE state = 'received'") == [(0,)], \
            "waiting for a lock is not a refusal: acc-1 is not counted"
    finally:
        blocker.rollback()
        blocker.close()
        holder.dispose()
        thread.join(30)
        a.close()
        b.close()
    assert outcome["acc-1"] == "committed" and accounts(b.url).get("acc-1") == "open"


def test_a_sender_that_requires_a_coupling_never_commits_on_a_weaker_one(banks):
    b = banks({"a": ("pg", "queued"), "b": ("pg", "compensatable"), "c": ("pg", "shared")})
    a, bb, cc = b["a"], b["b"], b["c"]
    with pytest.raises(RollbackError, match="not processed by every recipient"):
        with a.node.manager.transaction() as tx:
            a.open_here(tx, "acc-1")
            ids = a.coupled.send(tx, [bb.id, cc.id], b"<open id='acc-1'/>", action=OPEN, require="shared",
                                 condition=processed(within=10))
    outcome = a.coupled.outcomes(ids)[ids[bb.id]]
    assert outcome["recipient"] == "failed" and "requires a shared coupling" in outcome["reason"]
    wait_until(lambda: _inbound(cc.url).get(ids[cc.id]) in ("rolled-back", "cancelled"), 15, "c undid acc-1")
    assert "acc-1" not in accounts(bb.url) and "acc-1" not in accounts(cc.url)
    # required of c only: both process it, and the outcomes say how each joined
    with a.node.manager.transaction() as tx:
        a.open_here(tx, "acc-2")
        ids = a.coupled.send(tx, [bb.id, cc.id], b"<open id='acc-2'/>", action=OPEN, require={cc.id: "shared"},
                             condition=processed(within=10))
    wait_until(lambda: accounts(cc.url).get("acc-2") == "open", 15, "c committed acc-2")
    assert {o["coupling"] for o in a.coupled.outcomes(transaction=tx.xid).values()} == {"compensatable", "shared"}
    # b said it handles OPEN as compensatable: requiring shared of it is now refused before anything leaves
    before = len(rows(a.url, "SELECT id FROM qtp_coupled_out"))
    with a.node.manager.transaction() as tx:
        with pytest.raises(ConfigurationError, match="requires a shared coupling of channel"):
            a.coupled.send(tx, bb.id, b"<open id='acc-3'/>", action=OPEN, require="shared")
    assert len(rows(a.url, "SELECT id FROM qtp_coupled_out")) == before


def test_an_original_that_arrives_before_its_handler_is_registered_waits_for_it(banks):
    """A recipient restarts (its node starts taking originals at once) and the application registers its
    shared coupled handler two seconds later: the original waits for it (a missing handler is not a refusal in
    the first seconds after start) and is processed with the handler's coupling, so the sender commits."""
    import threading

    b = banks({"a": ("pg", "queued"), "b": ("pg", "shared")})
    a, bb = b["a"], b["b"]
    bb.close()
    outcome = {}

    def send():
        try:
            with a.node.manager.transaction(timeout=40) as tx:
                a.open_here(tx, "acc-1")
                a.coupled.send(tx, bb.id, b"<open id='acc-1'/>", action=OPEN, condition=processed(within=30))
            outcome["acc-1"] = "committed"
        except RollbackError as exc:
            outcome["acc-1"] = str(exc)

    thread = threading.Thread(target=send)
    thread.start()
    node = qtp.Node.from_config(bb.config)
    try:
        coupled = Coupled(node, sweep_interval=0.5)
        node.start()  # (the node-level handlers of coupled messaging are registered: the coupled one is not)
        time.sleep(2.0)  # the original is delivered meanwhile: no handler for it yet

        @coupled.handler(OPEN, coupling="shared")
        def open_account(tx, message):
            tx.connection("app").execute(sa.text("INSERT INTO accounts (id, status) VALUES ('acc-1', 'open')"))

        thread.join(40)
        assert outcome == {"acc-1": "committed"}
        wait_until(lambda: accounts(bb.url) == {"acc-1": "open"}, 15, "b committed acc-1")
        assert rows(bb.url, "SELECT coupling, state FROM qtp_coupled_in") == [("shared", "committed")]
    finally:
        node.close()
