"""Attacks on coupled messaging by an independent tester (h-attack). Each test is a minimal reproduction of
a finding and fails because of it; judged from the databases (accounts, qtp_coupled_in / qtp_coupled_out,
prepared transactions) and from what docs/coupled.md promises."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from qtp.coupled import processed
from qtp.errors import RollbackError
from qtp.testing.coupled_nodes import accounts
from qtp.testing.nodes import rows, wait_until
from coupled_support import OPEN, Bank

ROOT = Path(__file__).resolve().parent.parent


def _outbound(url: str) -> dict[str, tuple[str, str]]:
    return {r[0]: (r[1], r[2]) for r in rows(url, "SELECT id, state, recipient FROM qtp_coupled_out")}


def _inbound(url: str) -> dict[str, str]:
    return dict(rows(url, "SELECT id, state FROM qtp_coupled_in"))


def _qtp(*args: str) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-m", "qtp", *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    return done.returncode, done.stdout + done.stderr


# ---------------------------------------------------------------------------------------------- sizes

SMALL = "max_request_bytes = 100000"


def _one_more(a: Bank, to: Bank, account: str, within: float = 4.0) -> tuple[str, str]:
    """An ordinary coupled transaction after the attack; (outcome, coupling id)."""
    cid = ""
    try:
        with a.node.manager.transaction() as tx:
            a.open_here(tx, account)
            cid = a.coupled.send(tx, to.id, f"<open id='{account}'/>".encode(), action=OPEN,
                                 condition=processed(within=within))[to.id]
        return "committed", cid
    except RollbackError as exc:
        return f"rolled back: {exc}", cid


def test_an_original_too_large_for_a_request_is_refused_at_send_not_stored_to_block_the_channel(banks):
    """messaging.md: "max_request_bytes ... tx.send refuses payloads that would not fit". coupled.send takes
    a payload of 120 kB with max_request_bytes = 100 kB (tx.send refuses it), stores it, and the peer answers
    every transmission with 413 for ever: the channel's sequence is blocked behind it, so every later coupled
    transaction on that channel rolls back and its row stays (aborted, sent) in the compensation log."""
    b = banks({"a": ("pg", "queued"), "b": ("pg", "compensatable")}, limits=SMALL)
    a, bb = b["a"], b["b"]
    payload = f"<open id='acc-big' pad='{'x' * 120_000}'/>".encode()
    with a.node.manager.transaction() as tx:
        with pytest.raises(Exception):
            a.node.enqueue(tx, bb.id, payload, action=OPEN)  # the plain send refuses it
    refused = None
    try:
        with a.node.manager.transaction() as tx:
            a.coupled.send(tx, bb.id, payload, action=OPEN, condition=processed(within=3))
    except RollbackError as exc:
        refused = f"accepted at send, then rolled back: {exc}"
    except Exception as exc:  # noqa: BLE001 - the expected refusal
        refused = None if "fit" in str(exc) or "bytes" in str(exc) else f"{type(exc).__name__}: {exc}"
    outcome, cid = _one_more(a, bb, "acc-1")
    time.sleep(2)
    assert outcome == "committed" and refused is None, (
        f"a 120 kB coupled original with max_request_bytes = 100000: {refused}; the next ordinary coupled "
        f"transaction on the channel: {outcome}; sender rows {_outbound(a.url)}, recipient rows "
        f"{_inbound(bb.url)}, messages waiting at the sender {rows(a.url, 'SELECT COUNT(*) FROM qtp_rm_outgoing')}")


def test_a_compensation_too_large_for_a_request_is_refused_at_send_not_left_to_block_the_abort(banks):
    """The original fits, its compensation (120 kB, max_request_bytes = 100 kB) does not: coupled.send takes
    it; the application then aborts, and the Abort carrying it is answered 413 for ever. The recipient keeps
    its compensatable effect (the account stays open though the sender rolled back), the compensation log
    never closes, and the channel is blocked behind the Abort."""
    b = banks({"a": ("pg", "queued"), "b": ("pg", "compensatable")}, limits=SMALL)
    a, bb = b["a"], b["b"]
    accepted = False
    try:
        with a.node.manager.transaction() as tx:
            a.open_here(tx, "acc-9")
            ids = a.coupled.send(tx, bb.id, b"<open id='acc-9'/>", action=OPEN, condition=processed(within=5),
                                 compensation=f"<close id='acc-9' pad='{'x' * 120_000}'/>".encode())
            accepted = True
            wait_until(lambda: accounts(bb.url).get("acc-9") == "open", 10, "b processed acc-9")
            raise RuntimeError("the application aborts")
    except RuntimeError as exc:
        assert "aborts" in str(exc)
    except Exception:  # noqa: BLE001 - refused at send: the safe outcome
        pass
    if not accepted:
        return
    settled = True
    try:
        wait_until(lambda: _outbound(a.url)[ids[bb.id]][1] in ("compensated", "cancelled"), 15, "compensated")
    except AssertionError:
        settled = False
    outcome, _ = _one_more(a, bb, "acc-1")
    assert settled and outcome == "committed", (
        f"a 120 kB compensation with max_request_bytes = 100000 was accepted by coupled.send; after the abort: "
        f"acc-9 at b {accounts(bb.url).get('acc-9')!r} (rolled back at the sender), sender row "
        f"{_outbound(a.url)[ids[bb.id]]}, recipient row {_inbound(bb.url).get(ids[bb.id])}; the next coupled "
        f"transaction on the channel: {outcome}")


# ---------------------------------------------------------------------------------------------- id squatting

@pytest.mark.slow
def test_a_known_peer_that_saw_an_original_on_the_wire_cannot_take_over_its_coupling_id(tmp_path, pg_db):
    """docs/security.md: the attacker may be a known peer that reads plain-HTTP traffic; docs/coupled.md: a
    recipient binds each coupling to the party that started it. The honest sender a's first transmission of
    its original to the shared recipient r is lost (a lossy proxy); mallory, a known peer of r, saw it and
    sends r an original with the same coupling id, transaction and token (naming itself as the sender, which
    r accepts). r keeps mallory's row and drops a's real original as a duplicate: a's transaction rolls back
    ("sent"), its Abort is never answered (the compensation log stays open, also after `qtp coupled retry`),
    and mallory then commits the work, which r's application stores under a's rolled-back transaction id
    (message.transaction). Expected: a coupling id (whose transaction starts with another node's id) is
    never given to another peer; a's original is processed as its own."""
    from qtp.coupled import _wire as wire
    from qtp.testing.lossy_proxy import LossyProxy
    from test_coupled_hostile import Deployment

    d = Deployment(tmp_path, {"a": pg_db("a"), "r": pg_db("r"), "m": pg_db("m")})
    proxy = LossyProxy(f"http://127.0.0.1:{d.ports['r']}").start()
    text = d.configs["a"].read_text()  # a reaches r through the proxy
    d.configs["a"].write_text(text.replace(f"127.0.0.1:{d.ports['r']}/rm", f"127.0.0.1:{proxy.port}/rm"))
    try:
        a, r = d.bank("a"), d.bank("r")
        m = d.start_mallory()
        outcome, _ = _one_more(a, r, "acc-0", 8)
        assert outcome == "committed", f"set-up: {outcome}"
        wait_until(lambda: rows(a.url, "SELECT COUNT(*) FROM qtp_rm_outgoing")[0][0] == 0, 10, "a idle")
        proxy.set_faults(drop_request=1.0)
        seen = {}

        def sniff_and_squat(cid):
            token, gtrid, deadline = rows(a.url, f"SELECT token, gtrid, deadline FROM qtp_coupled_out "
                                                 f"WHERE id = '{cid}'")[0]  # what crossed the wire
            seen.update(cid=cid, token=token, gtrid=gtrid)
            m.send(r.id, wire.Control("Message", cid, transaction=gtrid, coordinator=m.id, action=OPEN,
                                      deadline=deadline, body=b"<open id='acc-1'/>", token=token))
            try:  # stored at r (the attack works) or refused (a dead letter): either way, go on after it
                wait_until(lambda: cid in _inbound(r.url), 5, "mallory's original stored at r")
            except AssertionError:
                pass
            proxy.set_faults(drop_request=0.0)  # a's retransmission gets through now

        try:
            with a.node.manager.transaction(timeout=30) as tx:
                a.open_here(tx, "acc-1")
                cid = a.coupled.send(tx, r.id, b"<open id='acc-1'/>", action=OPEN, condition=processed(within=6))[r.id]
                sniff_and_squat(cid)
            honest = "committed"
        except RollbackError as exc:
            honest = f"rolled back: {exc}"
        cid = seen["cid"]
        owner = rows(r.url, f"SELECT owner FROM qtp_coupled_in WHERE id = '{cid}'")
        _qtp("coupled", "retry", "--all", "--config", str(d.configs["a"]))
        time.sleep(3)
        m.send(r.id, wire.Control("Commit", cid, token=seen["token"]))
        time.sleep(3)
        at_r = rows(r.url, "SELECT id, status, opened_by FROM accounts WHERE id = 'acc-1'")
        row_r = rows(r.url, f"SELECT state, owner FROM qtp_coupled_in WHERE id = '{cid}'")
        row_a = _outbound(a.url).get(cid)
        assert honest == "committed" or (not at_r and row_a[1] in ("cancelled", "rolled-back", "failed")), (
            f"a's coupling {cid}: a {honest}; its row at a {row_a} (compensation log open after `qtp coupled retry`); "
            f"r's row for that id owned by {owner} -> {row_r}; at r, acc-1 {at_r} (opened_by a's rolled-back "
            f"transaction {seen['gtrid']})")
    finally:
        d.close()
        proxy.stop()


# ---------------------------------------------------------------------------------------------- docs, bad input

def test_the_coupled_table_of_qtp_toml_is_documented():
    """Commit f5e5c87 added a [coupled] table to qtp.toml (workers, sweep_interval, replies: Coupled(node)'s
    defaults, checked at load), but neither README.md nor docs/ say it exists: a user of `qtp serve` cannot
    find how to set the reply channel of a sender or the sweep interval without code."""
    texts = {p.name: p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}
    found = {name: [k for k in ("[coupled]", "sweep_interval") if k in text] for name, text in texts.items()}
    assert any("[coupled]" in f for f in found.values()), f"no page documents the [coupled] table: {found}"


def test_a_payload_that_is_not_xml_is_refused_with_a_clear_error(banks):
    """docs/coupled.md never says a coupled payload or compensation must be one XML element; coupled.send
    given b"not xml" raises lxml's raw XMLSyntaxError ("Start tag expected, '<' not found, line 1, column
    1"), naming neither the argument (payload or compensation) nor the rule, unlike every other bad input of
    coupled.send (ConfigurationError with a sentence)."""
    b = banks({"a": ("pg", "queued"), "b": ("pg", "compensatable")})
    a, bb = b["a"], b["b"]
    seen = {}
    for what, kwargs in [("payload", {"payload": b"not xml"}),
                         ("compensation", {"payload": b"<open id='x'/>", "compensation": b"not xml"})]:
        try:
            with a.node.manager.transaction() as tx:
                a.coupled.send(tx, bb.id, kwargs.pop("payload"), action=OPEN, condition=processed(within=3),
                               **kwargs)
                raise RuntimeError("not refused")
        except Exception as exc:  # noqa: BLE001 - what the user sees
            seen[what] = (type(exc).__name__, str(exc))
    assert all(t == "ConfigurationError" and w in m for w, (t, m) in seen.items()), seen
