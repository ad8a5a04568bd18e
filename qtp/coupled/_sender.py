"""The sender's side of coupled messaging: the sphere of one transaction (its conditional messages), Phase 0,
the decision, presumed abort, and the recipients' reports.

1. *pre-commit delivery* (``send``): the original and its sphere-log row ("active") are written in a local
   transaction of the channel's store, outside the sender's transaction, so the original leaves at once;
2. *Phase 0* (``tx.before_commit``): wait until every condition of the transaction is met, or fails, or its
   deadline passes; the recipients' Notify messages move the rows on. A shared recipient that joined (said
   "delivered") must also have voted ("prepared") before the sender can commit;
3. met: inside the sender's transaction the rows go to "committed" and a Commit is enqueued for every
   recipient: the sender's own commit *is* the decision (presumed abort, like a logging last resource);
4. anything else: the transaction rolls back, and in a local transaction the rows go to "aborted" with an
   Abort (carrying the compensation) for every recipient. Rows left "active" by a sender that died are
   aborted at its next start; rows past their deadline are aborted within a second even while their
   transaction stays open (``sweep``).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from lxml import etree

from qtp.coordinator.failpoints import failpoint
from qtp.coupled import _log as log_
from qtp.coupled import _states as states
from qtp.coupled._conditions import Condition, processed
from qtp.coupled._recipient import control_of
from qtp.coupled._site import Site
from qtp.coupled._wire import COUPLINGS, Control, encode, new_token
from qtp.errors import ConfigurationError, RollbackError

log = logging.getLogger("qtp.coupled")

OFFERS_KEPT = 300.0  # seconds a recipient's word on the coupling it offers is believed


@dataclass
class _Sent:
    condition: Condition
    deadline: float
    ids: dict[str, str]        # channel -> coupling id


@dataclass
class _Sphere:
    """The coupled part of one transaction at its sender."""

    sent: list[_Sent] = field(default_factory=list)
    stores: dict[str, Any] = field(default_factory=dict)   # store resource -> store


def _per_channel(value: Any, names: list[str], what: str) -> dict[str, Any]:
    """``value`` for each channel: one value for all, or a mapping that names only channels of the send."""
    if not isinstance(value, dict):
        return {name: value for name in names}
    unknown = sorted(set(value) - set(names))
    if unknown:
        raise ConfigurationError(f"{what} names {', '.join(unknown)}, which this message is not sent to")
    return {name: value.get(name) for name in names}


class Sender:
    def __init__(self, site: Site):
        self.site = site
        self.manager = site.manager
        self._spheres: dict[str, _Sphere] = {}
        self._reports: dict[str, tuple[str, str | None, str | None]] = {}  # id -> (report, coupling, reason)
        self._changed = threading.Condition()
        self._counter = 0
        # (channel, action) -> (the coupling its recipient last said it offers, when): a require= that the
        # recipient is known not to offer is refused before anything leaves
        self._offers: dict[tuple[str, str], tuple[str, float]] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ sending

    def send(self, tx: Any, channels: str | list[str], payload: bytes | str, action: str,
             condition: Condition | None = None, compensation: Any = None, require: Any = None) -> dict[str, str]:
        if tx is None or tx.outcome is not None:
            raise ConfigurationError("coupled.send needs the running transaction (with manager.transaction() as tx)")
        names = [channels] if isinstance(channels, str) else list(channels)
        if not names or len(set(names)) != len(names):
            raise ConfigurationError(f"coupled.send needs distinct channels, got {names!r}")
        condition = condition or processed()
        condition.check(names)
        if not isinstance(action, str) or not action.strip():
            raise ConfigurationError("coupled.send needs action=\"...\": the recipient's handler is chosen by it")
        ceiling = self.site.limits.max_coupled_deadline
        if condition.within > ceiling:
            raise ConfigurationError(f"the condition's deadline ({condition.within:g} s) is over the node's "
                                     f"[limits] max_coupled_deadline ({ceiling:g} s)")
        left = tx.deadline - time.monotonic()
        if condition.within >= left:
            raise ConfigurationError(
                f"the condition's deadline ({condition.within:g} s) does not fit in what is left of transaction "
                f"{tx.xid}'s timeout ({left:.1f} s): raise the timeout (manager.transaction(timeout=...)) or "
                "shorten within=")
        payload = _bytes(payload)
        compensations = {k: _bytes(v) for k, v in _per_channel(compensation, names, "compensation").items()}
        required = _per_channel(require, names, "require")
        for name, coupling in required.items():
            if coupling is not None and coupling not in COUPLINGS:
                raise ConfigurationError(f"require= names a coupling of {', '.join(COUPLINGS)}, not {coupling!r}")
        targets = {name: self.site.channel(name) for name in names}  # every channel checked before anything leaves
        self._check_offers(action, required)
        # the census (HTS): who joined matters for "delivered" conditions, and for a fan-out that does not need
        # everyone (a shared recipient that joined must then vote before the sender decides)
        census = condition.level == "delivered" or (len(names) > 1 and condition.at_least is not None
                                                    and condition.at_least < len(names))
        deadline = time.time() + condition.within
        originals = []  # every original encoded, and every Abort it may need checked, before anything leaves
        for name in names:
            with self._lock:
                self._counter += 1
                coupling_id = f"{tx.xid}:{self._counter}"
            token = new_token()
            undo = compensations[name] if compensations[name] is not None else payload
            body = self._encoded(name, "payload", Control(
                "Message", coupling_id, transaction=tx.xid, coordinator=self.site.node_id, action=action,
                deadline=deadline, body=payload, census=census, token=token, require=required[name]))
            self._encoded(name, "compensation", Control("Abort", coupling_id, body=undo, token=token,
                                                        coordinator=self.site.node_id))
            originals.append((name, coupling_id, token, undo, body))
        sphere = self._sphere(tx)
        ids: dict[str, str] = {}
        # registered before the first original leaves: if a later one fails and the application commits
        # anyway, the condition still covers (and the decision still reaches) every original that left
        sphere.sent.append(_Sent(condition, deadline, ids))
        for name, coupling_id, token, undo, body in originals:
            settings, store = targets[name]
            with self._changed:  # before the original can leave: its first report must find it
                self._reports[coupling_id] = ("sent", None, None)
            with store.local() as conn:
                log_.record_sent(conn, id=coupling_id, gtrid=tx.xid, channel=name, action=action, compensation=undo,
                                 token=token, deadline=deadline)
                store.enqueue(conn, self.site.outgoing(name, coupling_id, "Message", body))
            sphere.stores[settings.store] = store
            ids[name] = coupling_id
        self.site.wake_sender()
        failpoint("coupled_after_send")  # the originals are on their way, the sender has not decided
        return ids

    def _check_offers(self, action: str, required: dict[str, Any]) -> None:
        """A recipient that said, within ``OFFERS_KEPT`` seconds, that its handler of ``action`` has another
        coupling than the one required is refused now (the recipient refuses it too, whatever the sender
        knew: this only spares the exchange)."""
        now = time.time()
        for name, coupling in required.items():
            offered, seen = self._offers.get((name, action), (None, 0.0))
            if coupling is not None and offered is not None and offered != coupling and now - seen < OFFERS_KEPT:
                raise ConfigurationError(f"coupled.send requires a {coupling} coupling of channel {name!r}, whose "
                                         f"recipient handles {action} as {offered} (it said so "
                                         f"{now - seen:.0f} s ago)")

    def _encoded(self, channel: str, what: str, control: Control) -> bytes:
        """``control`` encoded, refused now if its body is not one XML element or it would not fit in a request
        to the peer (one that did not would be refused by the peer for ever, blocking the channel)."""
        try:
            body = encode(control)
        except etree.XMLSyntaxError as exc:
            raise ConfigurationError(f"coupled.send: the {what} for channel {channel!r} is not one XML element "
                                     f"({exc})") from None
        self.site.node.check_size(body)
        return body

    def _sphere(self, tx: Any) -> _Sphere:
        sphere = self._spheres.get(tx.xid)
        if sphere is None:
            sphere = self._spheres[tx.xid] = _Sphere()
            tx.before_commit(self._phase_zero)
            tx.on_rollback(lambda: self._aborted(tx.xid))
        return sphere

    # ------------------------------------------------------------------ Phase 0 and the decision

    def _verdicts(self, sphere: _Sphere) -> list[tuple[_Sent, bool | None, dict[str, str], list[str]]]:
        """Per conditional message: (it, met / failed / not yet, channel -> report, shared recipients that
        joined and have not voted). Called with ``_changed`` held."""
        found = []
        for sent in sphere.sent:
            reports = {ch: self._reports.get(cid, ("sent", None, None)) for ch, cid in sent.ids.items()}
            states_ = {ch: r[0] for ch, r in reports.items()}
            verdict = sent.condition.verdict(states_)
            unvoted = [ch for ch, r in reports.items() if r[0] == "delivered" and r[1] == "shared"]
            if verdict is True and unvoted:
                verdict = None
            found.append((sent, verdict, states_, unvoted))
        return found

    def _phase_zero(self, tx: Any) -> None:
        """Wait for the conditions; then write the decision (the Commit messages) into ``tx`` itself."""
        sphere = self._spheres.get(tx.xid)
        if sphere is None:
            return
        while True:
            with self._changed:
                verdicts = self._verdicts(sphere)
                now = time.time()
                for sent, verdict, reports, unvoted in verdicts:
                    if verdict is False or (verdict is None and now >= sent.deadline):
                        why = "; a shared recipient did not vote: " + ", ".join(unvoted) if unvoted else ""
                        raise RollbackError(
                            f"transaction {tx.xid} rolled back: its coupled message was not "
                            f"{sent.condition.describe(len(reports))} (recipients: "
                            + ", ".join(f"{ch} {st}" for ch, st in sorted(reports.items())) + why + ")")
                pending = [s.deadline for s, v, _, _ in verdicts if v is not True]
                if not pending:
                    break
                told = self._changed.wait(max(0.0, min(1.0, min(pending) - now)))
            if not told:  # a second without news: ask the sphere log itself
                self._reread(sphere)
        count = 0
        for resource in sphere.stores:
            conn = tx.connection(resource)
            mine = [(ch, cid) for sent in sphere.sent for ch, cid in sent.ids.items()
                    if self.site.node.channels[ch].store == resource]
            if log_.decide(conn, [cid for _, cid in mine], "commit") != len(mine):
                raise RollbackError(f"transaction {tx.xid} rolled back: its coupled messages were aborted meanwhile "
                                    "(the sender's sweep presumed it dead)")
            tokens = {r.id: r.token for r in log_.sent_rows(conn, ids=[cid for _, cid in mine])}
            for ch, cid in mine:
                self.site.enqueue(conn, ch, Control("Commit", cid, token=tokens[cid], coordinator=self.site.node_id))
                count += 1
        failpoint("coupled_before_commit")  # conditions met, Commit messages written, the sender not committed
        tx.on_commit(lambda: self._committed(tx.xid))
        log.debug("transaction %s: coupled conditions met, %d Commit message(s) enqueued", tx.xid, count)

    def _reread(self, sphere: _Sphere) -> None:
        """What the sphere log says of the recipients (the reports reach a waiting sender in memory; this
        makes the wait independent of that)."""
        ids = [cid for sent in sphere.sent for cid in sent.ids.values()]
        for store in sphere.stores.values():
            with store.local() as conn:
                found = log_.reports(conn, ids)
            with self._changed:
                for row in found:
                    self._learn(row.id, row.recipient, row.coupling, row.reason)

    def _learn(self, coupling_id: str, report: str, coupling: str | None, reason: str | None) -> bool:
        """Take a report into memory if it goes further than the one known. Called with ``_changed`` held."""
        known = self._reports.get(coupling_id)
        if known is None or not states.goes_further(report, known[0]):
            return False
        self._reports[coupling_id] = (report, coupling, reason)
        return True

    def _committed(self, gtrid: str) -> None:
        self._forget(gtrid)
        self.site.wake_sender()

    def _forget(self, gtrid: str) -> None:
        sphere = self._spheres.pop(gtrid, None)
        if sphere is not None:
            with self._changed:
                for sent in sphere.sent:
                    for cid in sent.ids.values():
                        self._reports.pop(cid, None)

    def _aborted(self, gtrid: str) -> None:
        """``gtrid`` rolled back: abort its coupled messages (compensation or cancellation at each recipient)."""
        sphere = self._spheres.get(gtrid)
        try:
            for store in (sphere.stores.values() if sphere is not None else []):
                self._abort_rows(store, gtrid)
        except Exception:  # left "active": the sweep aborts them shortly
            log.exception("aborting the coupled messages of %s failed; the sweep will", gtrid)
        finally:
            self._forget(gtrid)

    def _abort_rows(self, store: Any, gtrid: str, deadline_before: float | None = None,
                    skip_locked: bool = False) -> int:
        """Abort the active rows of ``gtrid`` (past ``deadline_before`` if given). The sweep skips rows locked by someone else (a prepared
        branch of the sender's own transaction, in doubt: recovery settles it first); the sender's own
        rollback waits for a lock held a moment by the invoker applying a report."""
        with store.local() as conn:
            rows = log_.lock_active(conn, gtrid, deadline_before, skip_locked=skip_locked)
            if not rows:
                return 0
            log_.decide(conn, [r.id for r in rows], "abort")
            for row in rows:
                self.site.enqueue(conn, row.channel, Control("Abort", row.id, body=row.compensation,
                                                             token=row.token or "", coordinator=self.site.node_id))
        log.info("aborted %d coupled message(s): their recipients cancel or compensate them", len(rows))
        self.site.wake_sender()
        return len(rows)

    def sweep(self, startup: bool = False) -> None:
        """Presumed abort, and the deadline kept. At start-up every row still "active" is aborted (its
        sender died before deciding). Later, every row past its deadline: a transaction of this node that
        has not decided by then can no longer meet its condition, so its recipients are told now, and a
        shared recipient holds its prepared branch, and its locks, no longer than the deadline even while the
        application keeps the transaction open. A Phase 0 that met its conditions and is committing holds
        the rows' locks: they are skipped, and whichever commits first wins."""
        for store in self.site.coupled_stores():
            before = None if startup else time.time() - 0.5
            with store.local() as conn:
                gtrids = log_.active_gtrids(conn, before)
            for gtrid in gtrids:
                self._abort_rows(store, gtrid, before, skip_locked=True)

    def prune(self, before: float) -> int:
        pruned = 0
        for store in self.site.coupled_stores():
            with store.local() as conn:
                pruned += log_.prune_sent(conn, before)
        return pruned

    # ------------------------------------------------------------------ in the invoker's transaction

    def _row(self, tx: Any, control: Control, owner: str | None) -> tuple[Any, Any] | None:
        """The sphere-log row ``control`` is about, locked in ``tx``, if ``owner`` may speak of it (the
        recipient's identity, and the coupling's token)."""
        for resource in self.site.store_resources():
            conn = tx.connection(resource)
            row = log_.sent_row(conn, control.id)
            if row is None:
                continue
            if row.token is not None and row.token != control.token:
                log.warning("a coupled %s about %s with a token that is not the coupling's: refused", control.kind,
                            control.id)
                return None
            return (conn, row) if self.site.from_recipient(owner, row.channel) else None
        log.warning("a coupled %s about %s, which this node did not send: ignored", control.kind, control.id)
        return None

    def on_notify(self, tx: Any, message: Any) -> None:
        control = control_of(message)
        found = self._row(tx, control, self.site.owner(message))
        if found is None:
            return
        conn, row = found
        if not states.goes_further(control.state or "", row.recipient):
            return
        log_.report(conn, control.id, control.state, control.coupling, control.reason)
        tx.on_commit(lambda: self._note(control))
        if control.coupling is not None:  # what this recipient offers for the action (see _check_offers)
            offer = (row.channel, row.action)
            tx.on_commit(lambda: self._offers.update({offer: (control.coupling, time.time())}))

    def _note(self, control: Control) -> None:
        with self._changed:
            if self._learn(control.id, control.state or "", control.coupling, control.reason):
                self._changed.notify_all()

    def on_status(self, tx: Any, message: Any) -> None:
        """A recipient asks for the decision: send it again (none yet while the sender decides)."""
        control = control_of(message)
        found = self._row(tx, control, self.site.owner(message))
        if found is None:
            return
        conn, row = found
        if row.state == states.ACTIVE:
            return
        states.next_state(states.SENDER, row.state, "status")
        kind = "Commit" if row.state == states.COMMITTED else "Abort"
        self.site.enqueue(conn, row.channel, Control(kind, row.id, token=row.token or "",
                                                     coordinator=self.site.node_id,
                                                     body=row.compensation if kind == "Abort" else None))
        tx.on_commit(self.site.wake_sender)

    # ------------------------------------------------------------------ reading the log

    def outcomes(self, ids: list[str] | None = None, gtrid: str | None = None) -> dict[str, dict[str, Any]]:
        """What the sphere log says of coupled messages (by coupling id, or every one of transaction ``gtrid``):
        id -> {channel, action, decision (active / committed / aborted), recipient (its last report),
        coupling, reason}."""
        found: dict[str, dict[str, Any]] = {}
        for store in self.site.coupled_stores():
            with store.local() as conn:
                for row in log_.sent_rows(conn, ids=ids, gtrid=gtrid):
                    found[row.id] = {"channel": row.channel, "action": row.action, "transaction": row.gtrid,
                                     "decision": row.state, "recipient": row.recipient, "coupling": row.coupling,
                                     "reason": row.reason}
        return found

    def open_compensations(self) -> list[dict[str, Any]]:
        found = []
        for store in self.site.coupled_stores():
            with store.local() as conn:
                found += [dict(r._mapping) for r in log_.open_compensations(conn)]
        return found


def _bytes(value: bytes | str | None) -> bytes | None:
    return value.encode() if isinstance(value, str) else value

