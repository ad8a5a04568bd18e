"""A hostile peer against coupled messaging (issue 27): each test mounts one attack and asserts the safe
outcome, judged from the databases (application tables, qtp_coupled_in / qtp_coupled_out, prepared
transactions) with bounded waits. Each failed on the code of 4e8babd, for the reason its docstring gives.

1. far deadlines: one peer's undecided shared originals must not take every prepared-transaction slot of the
   recipient (a per-peer cap, ``[limits] max_prepared_per_peer``, and a capped deadline);
2. originals the recipient cannot answer (their Coordinator names no channel) are refused once, not
   prepared and rolled back in an endless loop that starves the honest sender;
3. a trailing slash in ``[peers.R] endpoint`` must not switch off the check that a Notify comes from the
   original's recipient;
4. on a loopback node taking anonymous requests, an anonymous Commit must not decide an original.

The nodes are deployed as docs/security.md says unless the attack needs otherwise: every node knows the
others as ``[peers.NAME]`` with a secret of their own pair, and takes no anonymous requests. The honest
sender ``a`` and the shared recipient ``r`` are ``Bank`` nodes of tests/test_coupled.py (a shared handler
that opens accounts). ``mallory`` is a known, authenticated peer of both: a plain qtp node, so its requests
are signed and its control messages travel reliably; it sends coupled control messages it crafted itself
(``qtp.coupled._wire``), which is all a compromised or buggy peer needs. All nodes run in this process.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

import qtp
from qtp.config import load_config
from qtp.coupled import _wire as wire
from qtp.coupled import processed
from qtp.embedded import EmbeddedPostgres, free_port
from qtp.errors import ConfigurationError, RollbackError
from qtp.testing.coupled_nodes import accounts, accounts_schema, node_ids, write_configs
from qtp.testing.nodes import post_as, request, rows, wait_until
from qtp.wsrm.codec import WsaVersion, anonymous, decode
from qtp.wsrm.protocol import CreateSequence, Sequence
from qtp.wsrm.runtime._settings import node_settings
from coupled_support import OPEN, Bank
from embedded_support import discard


YEARS = 10 * 365 * 86400.0
SLOTS = 8             # max_prepared_transactions of the shared recipient's own PostgreSQL server (attack 1)
CAP = 4               # [limits] max_prepared_per_peer expected at the recipient (attack 1)
MAX_DEADLINE = 300.0  # the longest deadline a recipient is expected to keep by default (attack 1)
WSA = WsaVersion.WSA200508
SETTLED_IN = ("committed", "cancelled", "rolled-back", "compensated", "failed", "compensation-failed")


# ---------------------------------------------------------------------------------------------- set-up

def _secret(x: str, y: str) -> str:
    """The secret of the pair x, y (the same on both sides, different for every pair)."""
    a, b = sorted((x, y))
    return f"{a}-{b}-" + "s" * 32


class Mallory:
    """An authenticated peer that sends coupled control messages of its own making. It takes every coupled
    action, so whatever it is sent back is applied (and ignored)."""

    def __init__(self, config: Path, url: str):
        self.url = url
        self.node = qtp.Node.from_config(config)
        self.id = self.node.manager.node_id
        for action in wire.ACTION.values():
            self.node.handler(action)(lambda tx, message: None)
        self.node.start()

    def send(self, to: str, control: wire.Control) -> None:
        with self.node.manager.transaction() as tx:
            self.node.enqueue(tx, to, wire.encode(control), action=wire.ACTION[control.kind], key=control.id)

    def close(self) -> None:
        self.node.close()


class Deployment:
    """Nodes ``a`` (honest sender), ``r`` (shared recipient), ``m`` (mallory), each with its own database,
    a channel to each other named by the other's node id, and (``secure``) ``[peers.*]`` for each other with
    ``allow_anonymous = false``. ``slash``: role -> the peers whose endpoint it writes with a trailing
    slash."""

    def __init__(self, folder: Path, urls: dict[str, str], *, secure: bool = True,
                 slash: dict[str, set[str]] | None = None):
        for url in urls.values():
            accounts_schema(url)
        self.urls = urls
        self.ids = node_ids(list(urls))
        self.ports = {role: free_port() for role in urls}
        extra = {}
        for role in urls:
            text = ""
            if secure:
                for other in urls:
                    if other != role:
                        end = "/" if other in (slash or {}).get(role, set()) else ""
                        text += (f'\n[peers.{self.ids[other]}]\nendpoint = "http://127.0.0.1:{self.ports[other]}/rm'
                                 f'{end}"\nsecret = "{_secret(self.ids[role], self.ids[other])}"\n')
            extra[role] = text
        self.configs = write_configs(folder, urls, self.ids, extra=extra, ports=self.ports)
        if secure:
            for path in self.configs.values():
                path.write_text(path.read_text().replace("\n[node]\n", "\n[node]\nallow_anonymous = false\n", 1))
        self.banks: dict[str, Bank] = {}
        self.mallory: Mallory | None = None

    def bank(self, role: str) -> Bank:
        if role not in self.banks:
            self.banks[role] = Bank(self.configs[role], self.urls[role], "shared")
        bank = self.banks[role]
        if bank.node is None:
            bank.start()
        return bank

    def start_mallory(self, role: str = "m") -> Mallory:
        self.mallory = Mallory(self.configs[role], self.urls[role])
        return self.mallory

    def url(self, role: str) -> str:
        return f"http://127.0.0.1:{self.ports[role]}/rm"

    def close(self) -> None:
        for bank in self.banks.values():
            bank.close()
        if self.mallory is not None:
            self.mallory.close()


@pytest.fixture
def deploy(tmp_path):
    made: list[Deployment] = []

    def make(urls: dict[str, str], **options) -> Deployment:
        made.append(Deployment(tmp_path, urls, **options))
        return made[-1]

    yield make
    for deployment in made:
        deployment.close()


def _inbound(url: str, where: str = "1 = 1") -> dict[str, tuple]:
    return {r[0]: tuple(r[1:]) for r in rows(url, f"SELECT id, state, owner, attempts, deadline, received_at "
                                                  f"FROM qtp_coupled_in WHERE {where}")}


def _outbound(url: str) -> dict[str, tuple[str, str]]:
    return {r[0]: (r[1], r[2]) for r in rows(url, "SELECT id, state, recipient FROM qtp_coupled_out")}


def _prepared_pg(url: str) -> int:
    return rows(url, "SELECT COUNT(*) FROM pg_prepared_xacts WHERE database = current_database()")[0][0]


def _coupled(sender: Bank, recipient: Bank, account: str, within: float, hold=None) -> tuple[str, str | None]:
    """One honest coupled transaction: ``account`` opened at the sender and, shared, at the recipient.
    ("committed" or "rolled back: why", the coupling id). ``hold(cid)`` runs inside the transaction after
    the send."""
    cid = None
    try:
        with sender.node.manager.transaction(timeout=within + 20) as tx:
            sender.open_here(tx, account)
            cid = sender.coupled.send(tx, recipient.id, f"<open id='{account}'/>", action=OPEN,
                                      condition=processed(within=within))[recipient.id]
            if hold is not None:
                hold(cid)
        return "committed", cid
    except RollbackError as exc:
        return f"rolled back: {exc}", cid


def _honest(sender: Bank, recipient: Bank, account: str) -> None:
    """Set-up check: an honest coupled transaction commits at both ends."""
    outcome, cid = _coupled(sender, recipient, account, 8)
    assert outcome == "committed", f"set-up: an honest coupled transaction {sender.id} -> {recipient.id}: {outcome}"
    wait_until(lambda: _inbound(recipient.url).get(cid, ("",))[0] == "committed", 10,
               f"set-up: {recipient.id} committed {account}")


def _quiet(fetch, timeout: float, still: float = 2.0):
    """What ``fetch()`` returns once it stopped changing for ``still`` seconds (at most ``timeout``)."""
    end = time.monotonic() + timeout
    last, since = fetch(), time.monotonic()
    while time.monotonic() < end:
        time.sleep(0.2)
        now = fetch()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= still:
            break
    return last


def _until(condition, timeout: float) -> bool:
    """A bounded wait whose end is itself an observation (no failure when it does not come)."""
    try:
        wait_until(condition, timeout, "")
        return True
    except AssertionError:
        return False


def _originals(mallory: Mallory, to: str, count: int, coordinator: str, deadline: float) -> None:
    """``count`` coupled originals of a transaction mallory never decides, for the shared action OPEN."""
    gtrid = f"{coordinator}/{os.urandom(16).hex()}"
    for i in range(count):
        mallory.send(to, wire.Control("Message", f"{gtrid}:{i + 1}", transaction=gtrid, coordinator=coordinator,
                                      action=OPEN, deadline=deadline, body=f"<open id='mal-{i}'/>".encode(),
                                      token=wire.new_token()))
    wait_until(lambda: rows(mallory.url, "SELECT COUNT(*) FROM qtp_rm_outgoing")[0][0] == 0, 20,
               "mallory's originals acknowledged by the recipient")


def _post_anonymous(url: str, control: wire.Control) -> int:
    """An anonymous client: a new sequence at ``url`` carrying ``control`` as its message 1. The HTTP status
    of the message (or of the CreateSequence, when that is refused)."""
    answer = post_as(url, request(CreateSequence(anonymous(WSA))), None, "")
    if answer.status_code != 200:
        return answer.status_code
    identifier = decode(answer.content).body.identifier
    return post_as(url, request(sequence=Sequence(identifier, 1), payload=wire.encode(control),
                                action=wire.ACTION[control.kind]), None, "").status_code


# ---------------------------------------------------------------------------------------------- attack 1

@pytest.fixture(scope="module")
def few_slots_pg(tmp_path_factory):
    """A PostgreSQL server of the shared recipient alone, with SLOTS prepared transactions (the session's
    servers have 200, shared by every test)."""
    server = EmbeddedPostgres(tmp_path_factory.mktemp("pg-few-slots"), max_prepared_transactions=SLOTS)
    server.start()
    yield server
    discard(server)


def _with_limit(config: Path, line: str) -> bool:
    """Add ``line`` to the [limits] of ``config``; when the node refuses the key (today's code refuses
    unknown [limits] keys), leave it out and return False."""
    original = config.read_text()
    config.write_text(original.replace("\n[limits]\n", f"\n[limits]\n{line}\n", 1))
    loaded = load_config(config)
    try:
        node_settings(loaded.messaging, set(loaded.resources))
        return True
    except ConfigurationError as exc:
        if line.split("=")[0].strip() not in str(exc):
            raise
        config.write_text(original)
        return False


def test_far_deadlines_from_one_peer_do_not_hold_every_prepared_slot_of_a_shared_recipient(deploy, pg_db,
                                                                                          few_slots_pg):
    """Attack 1. Mallory, an authenticated peer, sends 12 coupled originals for a shared handler of R whose
    Deadline lies ten years ahead, and never decides them. R prepared each one and holds it (its sweep asks
    mallory for the decision, nobody else may decide), so its PostgreSQL's prepared-transaction slots (8 here)
    and the locks behind them are all mallory's, and the honest sender's next coupled transaction to R fails
    to prepare. Expected: at most ``[limits] max_prepared_per_peer`` (4 here) originals of one peer are
    prepared at a time, the deadline an original asks for is capped (at most 300 s by default), and the
    honest coupled transaction commits while mallory's originals are held."""
    d = deploy({"a": pg_db("a"), "r": few_slots_pg.create_database(f"r_{os.urandom(4).hex()}"), "m": pg_db("m")})
    capped = _with_limit(d.configs["r"], f"max_prepared_per_peer = {CAP}")
    a, r = d.bank("a"), d.bank("r")
    m = d.start_mallory()
    _honest(a, r, "acc-0")
    assert _prepared_pg(r.url) == 0
    _originals(m, r.id, 12, m.id, time.time() + YEARS)
    held = _quiet(lambda: sorted(_inbound(r.url, f"owner = '{m.id}'").items()), 20)
    states = [row[0] for _, row in held]
    by_mallory = states.count("prepared")
    honest, cid = _coupled(a, r, "acc-1", 8)
    why = _inbound(r.url).get(cid, (None,))[0], rows(r.url, f"SELECT error FROM qtp_coupled_in WHERE id = '{cid}'")
    assert honest == "committed" and by_mallory <= CAP, (
        f"mallory's 12 originals (deadline in 10 years): {by_mallory} prepared at r and held "
        f"({_prepared_pg(r.url)} of the server's {SLOTS} prepared transactions), states {states}; expected at most "
        f"{CAP} prepared per peer ([limits] max_prepared_per_peer = {CAP}, "
        f"{'accepted' if capped else 'refused as unknown by this code: left out'}). The honest coupled "
        f"transaction: {honest}; at r: {why}")
    wait_until(lambda: "acc-1" in accounts(r.url), 15, "the honest account committed at r (its Commit applied)")
    longest = max((row[3] - row[4] for _, row in held), default=0.0)
    assert longest <= MAX_DEADLINE + 5, (
        f"r keeps mallory's deadline {longest / 86400 / 365:.1f} years ahead: a recipient caps the deadline an "
        f"original asks for (at most {MAX_DEADLINE:g} s by default)")


# ---------------------------------------------------------------------------------------------- attack 2

class _Counter(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0
        self.tracebacks = 0
        self.last = ""

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1
        self.tracebacks += record.exc_info is not None
        self.last = record.getMessage()[:300]


def test_originals_the_recipient_cannot_answer_are_refused_once_not_retried_for_ever(deploy, pg_db):
    """Attack 2. Mallory sends 40 coupled originals whose Coordinator names no channel of R (R has two, to a
    and to mallory, so it cannot tell where to answer). R prepared each, failed to send its vote, rolled
    back, and started again at once: an endless prepare/rollback loop (hundreds of transactions and
    tracebacks a second, the attempts column never counting), which also kept every worker and the first 32
    rows of the queue for mallory, so the honest sender's coupled transaction rolled back. Expected: each such
    original is refused once (a failed row or a dead letter, not retried in a loop), the log stops growing
    (every node runs in this process; a and mallory are idle), and an honest coupled transaction commits
    meanwhile."""
    d = deploy({"a": pg_db("a"), "r": pg_db("r"), "m": pg_db("m")})
    a, r = d.bank("a"), d.bank("r")
    m = d.start_mallory()
    _honest(a, r, "acc-0")
    counter = _Counter()
    logging.getLogger("qtp").addHandler(counter)
    try:
        _originals(m, r.id, 40, "nowhere", time.time() + 60)
        honest, _ = _coupled(a, r, "acc-1", 8)
        # the log settles once every original was refused; then a window of 5 s
        _quiet(lambda: counter.count, 10, still=3.0)
        before, tracebacks, started = counter.count, counter.tracebacks, time.monotonic()
        time.sleep(5.0)
        grown, traced = counter.count - before, counter.tracebacks - tracebacks
        rate = grown / (time.monotonic() - started)
        last = counter.last
    finally:
        logging.getLogger("qtp").removeHandler(counter)
    left = _inbound(r.url, f"owner = '{m.id}'")
    pending = [(row[0], row[2]) for row in left.values() if row[0] in ("received", "prepared")]
    waiting = sorted(set(pending))
    assert honest == "committed" and grown <= 5 and not waiting, (
        f"mallory's 40 originals that r cannot answer: {len(pending)} of {len(left)} stored still waiting to be "
        f"processed again ((state, attempts): {waiting}); the log grew "
        f"by {grown} warnings ({traced} with tracebacks) in 5 s ({rate:.0f}/s), the last: {last!r}; expected each "
        f"refused once and a quiet log. The honest coupled transaction meanwhile: {honest}")
    assert "acc-1" in accounts(r.url)


def test_a_trailing_slash_in_a_peers_endpoint_does_not_let_another_peer_report_for_the_recipient(deploy, pg_db):
    """Attack 3. The sender's ``[peers.R] endpoint`` is written with a trailing slash (as a user might; the
    transport finds the peer all the same, so everything works). The check that a Notify about an original
    comes from that original's recipient compared the channel's URL with the peers' endpoints by ``==``, found
    no peer, and let anyone through: mallory, a known peer of the sender, reports "prepared" for an original
    sent to R while R is down, the sender commits on its word, and R, back, refuses the original. (Without
    the slash the same attack is refused.)"""
    d = deploy({"a": pg_db("a"), "r": pg_db("r"), "m": pg_db("m")}, slash={"a": {"r"}})
    a, r = d.bank("a"), d.bank("r")
    m = d.start_mallory()
    _honest(a, r, "acc-1")  # the slash is no set-up error: messages flow, signed, both ways
    r.close()  # R down: only mallory's word can move the sender's sphere log
    seen = {}

    def forge(cid):
        m.send(a.id, wire.Control("Notify", cid, state="prepared", coupling="shared", token=wire.new_token()))
        _until(lambda: _outbound(a.url)[cid][1] != "sent", 3)  # refused (the safe outcome): it stays "sent"
        seen["row"] = _outbound(a.url)[cid]

    outcome, cid = _coupled(a, r, "acc-2", 4, forge)
    r.refuse.add("acc-2")  # R, back, refuses the original: the sender must not have committed it
    r.start()
    _until(lambda: _inbound(r.url).get(cid, ("",))[0] in SETTLED_IN, 20)
    there = _inbound(r.url).get(cid, (None,))[0]
    assert seen["row"] == ("active", "sent") and outcome.startswith("rolled back"), (
        f"mallory ({m.id}) moved the sender's sphere log row of an original sent to {r.id} to {seen['row']} "
        f"with a forged Notify (a Notify must be taken only from the original's recipient); the sender's "
        f"transaction: {outcome}; {r.id}, back, ended the original {there!r}; acc-2 at the sender: "
        f"{accounts(a.url).get('acc-2')}, at r: {accounts(r.url).get('acc-2')}")
    assert "acc-2" not in accounts(a.url) and "acc-2" not in accounts(r.url)


def test_an_anonymous_commit_cannot_decide_a_coupling_on_a_loopback_node(deploy, pg_db):
    """Attack 4. Nodes on loopback take anonymous requests by default (docs/security.md: for local use), and
    here, as in a local deployment without ``[peers.*]``, the sender's original arrives anonymously too. An
    anonymous client (any local process) sends a Commit for that original while its sender has not decided;
    the sender then aborts. A decision is accepted only from the identity recorded for the original's sender,
    so the shared recipient must not commit on it: at the end neither node has the account. (An anonymous
    Commit for an original of an *authenticated* sender, and a Commit/Abort from another authenticated peer,
    are refused already: ``_on_decision``'s owner check.)"""
    d = deploy({"a": pg_db("a"), "r": pg_db("r")}, secure=False)
    a, r = d.bank("a"), d.bank("r")
    seen = {}

    def forge(cid):
        seen["cid"] = cid
        # r prepared (its locks held), the sender undecided; a recipient that refuses anonymous couplings
        # outright (the row failed, or never stored) is safe as well
        _until(lambda: _inbound(r.url).get(cid, ("received",))[0] != "received", 10)
        seen["before"] = _inbound(r.url).get(cid, (None,))[:2]
        seen["status"] = _post_anonymous(d.url("r"), wire.Control("Commit", cid, token=wire.new_token()))
        _until(lambda: _inbound(r.url).get(cid, ("",))[0] == "committed", 3)
        seen["after"] = _inbound(r.url).get(cid, (None,))[:2]
        seen["accounts"] = accounts(r.url)
        raise RuntimeError("the sender's application fails after the send: it aborts")

    with pytest.raises(RuntimeError, match="it aborts"):
        _coupled(a, r, "acc-1", 10, forge)
    cid = seen["cid"]
    _until(lambda: _inbound(r.url).get(cid, ("",))[0] in SETTLED_IN, 15)
    final = _inbound(r.url).get(cid, (None,))[:2]
    assert "acc-1" not in seen.get("accounts", {}) and "acc-1" not in accounts(r.url), (
        f"{r.id} committed its prepared work on an anonymous Commit (HTTP {seen['status']}) for an original of "
        f"{a.id}, which had not decided: row (state, owner) {seen['before']} -> {seen['after']}, then {final} after "
        f"the sender aborted; acc-1 at r: {accounts(r.url).get('acc-1')}, at the sender: "
        f"{accounts(a.url).get('acc-1')}")
    assert final[0] in (None, "rolled-back", "cancelled", "failed"), final
    assert _prepared_pg(r.url) == 0
