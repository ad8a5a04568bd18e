"""Coupled messaging on a qtp node: the sender's sphere (conditions, decision, compensation) and the
recipient's couplings (shared, compensatable, queued). docs/coupled.md explains the model; this module
follows it step by step.

Sender (``Coupled.send`` inside ``with manager.transaction() as tx``):

1. *pre-commit delivery*: the original and its row in ``qtp_coupled_out`` (state "active") are written in a
   local transaction of the channel's store, outside ``tx``, so the original leaves at once;
2. *Phase 0* (``tx.before_commit``): wait until every condition of the transaction is met, or fails, or its
   deadline passes; the recipients' Notify messages move the rows on. A shared recipient that joined (said
   "delivered") must also have voted ("prepared") before the sender can commit;
3. met: inside ``tx``, the rows go to "committed" and a Commit is enqueued for every recipient: the
   sender's own commit *is* the decision of the whole coupled transaction (presumed abort, like a logging
   last resource: the Commit messages exist if and only if the sender committed);
4. anything else (a condition failed, the application raised, a branch voted no): ``tx`` rolls back and,
   in a local transaction, the rows go to "aborted" and an Abort (with the compensation) is enqueued for
   every recipient. A sender killed before 3 or 4 leaves rows "active": at its next start (and every few
   seconds for rows past their deadline whose transaction is no longer running) they are aborted the same
   way: presumed abort.

Recipient (its Message handler runs in the invoker's transaction; the rest in the coupling worker):

- the original is stored in ``qtp_coupled_in`` ("received") and "delivered" is notified, atomically with
  the dequeue;
- queued / compensatable: the handler runs in a transaction of its own that also moves the row to
  "processed" and notifies it; on Abort the compensator runs (or, if the original was still "received",
  it is cancelled and never runs);
- shared: the handler runs in a *subordinate* transaction (gtrid ``<node>~c/...``, which the node's own
  recovery never touches) that is prepared, not committed; the prepared branches are recorded and
  "prepared" notified; Commit / Abort from the sender commit or roll them back by xid. A recipient
  restarted with a subordinate prepared but not recorded rolls it back (it never voted); one with a
  recorded vote waits for the decision, and asks for it (Status) once past the deadline.

Every control message is an ordinary reliable message on the channels between the two nodes, sent with
the coupling id as its key, so the messages of one original travel in one lane, in order.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import sqlalchemy as sa

from qtp.coordinator.failpoints import failpoint
from qtp.coupled import _tables as tables
from qtp.coupled._conditions import Condition, processed
from qtp.coupled._wire import ACTION, COUPLINGS, Control, decode, encode
from qtp.errors import ConfigurationError, CoupledWireError, RollbackError
from qtp.wsrm.store import Outgoing
from qtp.xa import Xid

log = logging.getLogger("qtp.coupled")

ACTIVE, COMMITTED, ABORTED = "active", "committed", "aborted"
# how far each report goes; a later report never moves a row back
_RANK = {"sent": 0, "delivered": 1, "processed": 2, "prepared": 2, "failed": 3, "committed": 4, "cancelled": 4,
         "rolled-back": 4, "compensated": 4, "compensation-failed": 4}
SETTLED = frozenset({"committed", "cancelled", "rolled-back", "compensated", "failed"})  # nothing left to undo
SUB_MARK = "~c"


@dataclass(frozen=True)
class CoupledMessage:
    """What a coupled handler (and a compensator) receives."""

    id: str                    # the coupling id: one original to one recipient
    action: str
    payload: bytes             # the original's payload; for a compensator, the compensation
    coordinator: str           # the sender's node
    transaction: str           # the sender's transaction
    coupling: str
    original: bytes | None = None  # for a compensator: the original's payload


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


class Coupled:
    """Coupled messaging for ``node`` (both roles). ``replies``: sender node id -> the channel this node
    answers it on (default: a channel named like the sender's node, else the node's only channel).
    Coupled handlers and compensators run on ``workers`` threads, with the node's ``max_attempts`` and
    ``retry_backoff`` limits; ``sweep_interval``: seconds between the sender's presumed-abort sweeps.
    """

    def __init__(self, node: Any, replies: dict[str, str] | None = None, sweep_interval: float = 1.0,
                 workers: int = 4):
        self.node = node
        self.manager = node.manager
        self.replies = dict(replies or {})
        self.sweep_interval = sweep_interval
        self._handlers: dict[str, tuple[Callable[..., Any], str]] = {}
        self._compensators: dict[str, Callable[..., Any]] = {}
        self._spheres: dict[str, _Sphere] = {}
        self._states: dict[str, tuple[str, str | None, str | None]] = {}  # id -> (report, coupling, reason)
        self._changed = threading.Condition()
        self._wake = threading.Event()
        self._asked: dict[str, float] = {}
        self._counter = 0
        self._lock = threading.Lock()
        if not isinstance(workers, int) or workers < 1:
            raise ConfigurationError(f"workers must be a positive number of threads, got {workers!r}")
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="qtp-coupled-worker")
        self._claimed: set[str] = set()
        for channel in self.replies.values():
            self._channel(channel)
        inbound = node.inbound_store
        if node.inbound_mode != "xa" or not hasattr(inbound, "engine"):
            raise ConfigurationError("coupled messaging needs the node's store in mode \"xa\" on a SQL database: "
                                     "its state joins the transactions it couples")
        for store in {id(s): s for s in [inbound, *self._coupled_stores()]}.values():
            tables.create(store.engine)
        node.handler(ACTION["Message"])(self._on_message)
        node.handler(ACTION["Commit"])(self._on_decision)
        node.handler(ACTION["Abort"])(self._on_decision)
        node.handler(ACTION["Notify"])(self._on_notify)
        node.handler(ACTION["Status"])(self._on_status)
        node.coupled = self
        self._recover_recipient()
        self._sweep(startup=True)
        node.add_worker(self._work, "qtp-coupled")

    # ================================================================== sender

    def send(self, tx: Any, channels: str | list[str], payload: bytes | str, action: str,
             condition: Condition | None = None, compensation: bytes | str | None = None) -> dict[str, str]:
        """Send ``payload`` to the recipients at ``channels`` as one conditional message of ``tx``: delivered
        now (before ``tx`` commits); ``tx`` commits only if ``condition`` (default: processed by every
        recipient within 30 s) is met by then; if ``tx`` rolls back, every recipient is told and undoes it
        (cancel, roll back, or run its compensator with ``compensation``, default the original payload).
        Returns channel -> coupling id."""
        if tx is None or tx.outcome is not None:
            raise ConfigurationError("coupled.send needs the running transaction (with manager.transaction() as tx)")
        names = [channels] if isinstance(channels, str) else list(channels)
        if not names or len(set(names)) != len(names):
            raise ConfigurationError(f"coupled.send needs distinct channels, got {names!r}")
        condition = condition or processed()
        condition.check(names)
        if not isinstance(action, str) or not action.strip():
            raise ConfigurationError("coupled.send needs action=\"...\": the recipient's handler is chosen by it")
        left = tx.deadline - time.monotonic()
        if condition.within >= left:
            raise ConfigurationError(
                f"the condition's deadline ({condition.within:g} s) does not fit in what is left of transaction "
                f"{tx.xid}'s timeout ({left:.1f} s): raise the timeout (manager.transaction(timeout=...)) or "
                "shorten within=")
        payload = payload.encode() if isinstance(payload, str) else payload
        compensation = compensation.encode() if isinstance(compensation, str) else compensation
        targets = {name: self._channel(name) for name in names}  # every channel checked before anything leaves
        sphere = self._sphere(tx)
        # the census (HTS): who joined matters for "delivered" conditions, and for a fan-out that does not need
        # everyone (a shared recipient that joined must then vote before the sender decides); otherwise the
        # recipients report only what became of the original, one message less on the way to the commit
        census = condition.level == "delivered" or (len(names) > 1 and condition.at_least is not None
                                                    and condition.at_least < len(names))
        now = time.time()
        deadline = now + condition.within
        ids: dict[str, str] = {}
        # registered before the first original leaves: if a later one fails and the application commits
        # anyway, the condition still covers (and the decision still reaches) every original that left
        sphere.sent.append(_Sent(condition, deadline, ids))
        for name in names:
            settings, store = targets[name]
            with self._lock:
                self._counter += 1
                coupling_id = f"{tx.xid}:{self._counter}"
            body = encode(Control("Message", coupling_id, transaction=tx.xid, coordinator=self.manager.node_id,
                                  action=action, deadline=deadline, body=payload, census=census))
            if compensation is not None:
                encode(Control("Abort", coupling_id, body=compensation))  # refuse bad XML now, not at abort
            with self._changed:  # before the original can leave: its first report must find it
                self._states[coupling_id] = ("sent", None, None)
            with store.local() as conn:
                conn.execute(tables.outbound.insert(), {
                    "id": coupling_id, "gtrid": tx.xid, "channel": name, "action": action,
                    "compensation": compensation if compensation is not None else payload, "state": ACTIVE,
                    "recipient": "sent", "deadline": deadline, "created_at": now, "updated_at": now})
                store.enqueue(conn, self._outgoing(settings, coupling_id, "Message", body))
            sphere.stores[settings.store] = store
            ids[name] = coupling_id
        self.node.sender.wake.set()
        failpoint("coupled_after_send")  # the originals are on their way, the sender has not decided
        return ids

    def _sphere(self, tx: Any) -> _Sphere:
        sphere = self._spheres.get(tx.xid)
        if sphere is None:
            sphere = self._spheres[tx.xid] = _Sphere()
            tx.before_commit(self._phase_zero)
            tx.on_rollback(lambda: self._aborted(tx.xid))
        return sphere

    def _outgoing(self, settings: Any, coupling_id: str, kind: str, body: bytes) -> Outgoing:
        now = time.time()
        return Outgoing(route=settings.route_for(coupling_id), message_id=f"urn:uuid:{uuid.uuid4()}",
                        action=ACTION[kind], payload=body, enqueued_at=now)

    def _channel(self, name: str) -> tuple[Any, Any]:
        settings = self.node.channels.get(name)
        if settings is None:
            known = ", ".join(sorted(self.node.channels)) or "none"
            raise ConfigurationError(f"unknown channel {name!r} on node {self.manager.node_id!r} (known: {known})")
        if settings.mode != "xa" or settings.store is None:
            raise ConfigurationError(f"channel {name!r}: coupled messages need mode \"xa\" with a SQL store")
        return settings, self.node.store_for(settings.store, settings.mode)

    def _coupled_stores(self) -> list[Any]:
        return [self.node.store_for(c.store, c.mode) for c in self.node.channels.values()
                if c.mode == "xa" and c.store is not None]

    def _phase_zero(self, tx: Any) -> None:
        """Wait for the conditions; then write the decision (the Commit messages) into ``tx`` itself."""
        sphere = self._spheres.get(tx.xid)
        if sphere is None:
            return
        while True:
            verdicts, waiting = [], False
            with self._changed:
                for sent in sphere.sent:
                    states = {ch: self._states.get(cid, ("sent", None, None))[0] for ch, cid in sent.ids.items()}
                    verdict = sent.condition.verdict(states)
                    # a shared recipient that joined must vote before the sender may decide
                    unvoted = [ch for ch, cid in sent.ids.items() if self._states.get(cid, ("",))[0] == "delivered"
                               and self._states[cid][1] == "shared"]
                    if verdict is True and unvoted:
                        verdict = None
                    verdicts.append((sent, verdict, states, unvoted))
                now = time.time()
                failed = [(s, st) for s, v, st, _ in verdicts if v is False or (v is None and now >= s.deadline)]
                if failed:
                    sent, states = failed[0]
                    unvoted = next(u for s, _, _, u in verdicts if s is sent)
                    why = "; a shared recipient did not vote: " + ", ".join(unvoted) if unvoted else ""
                    raise RollbackError(
                        f"transaction {tx.xid} rolled back: its coupled message was not "
                        f"{sent.condition.describe(len(states))} (recipients: "
                        + ", ".join(f"{ch} {st}" for ch, st in sorted(states.items())) + why + ")")
                waiting = any(v is not True for _, v, _, _ in verdicts)
                told = False
                if waiting:
                    due = min(s.deadline for s, v, _, _ in verdicts if v is not True)
                    told = self._changed.wait(max(0.0, min(1.0, due - now)))
            if not waiting:
                break
            if not told:  # a second without news: ask the sphere log itself
                self._reread(sphere)
        count = 0
        for resource, store in sphere.stores.items():
            conn = tx.connection(resource)
            ids = [cid for sent in sphere.sent for ch, cid in sent.ids.items()
                   if self.node.channels[ch].store == resource]
            moved = conn.execute(tables.outbound.update().where(
                tables.outbound.c.id.in_(ids), tables.outbound.c.state == ACTIVE).values(
                state=COMMITTED, updated_at=time.time())).rowcount
            if moved != len(ids):
                raise RollbackError(f"transaction {tx.xid} rolled back: its coupled messages were aborted meanwhile "
                                    "(the sender's sweep presumed it dead)")
            for sent in sphere.sent:
                for ch, cid in sent.ids.items():
                    if self.node.channels[ch].store == resource:
                        store.enqueue(conn, self._outgoing(self.node.channels[ch], cid, "Commit",
                                                           encode(Control("Commit", cid))))
                        count += 1
        failpoint("coupled_before_commit")  # conditions met, Commit messages written, the sender not committed
        tx.on_commit(lambda: self._committed(tx.xid))
        log.debug("transaction %s: coupled conditions met, %d Commit message(s) enqueued", tx.xid, count)

    def _reread(self, sphere: _Sphere) -> None:
        """What the sphere log says of the recipients: the reports are applied to it by the invoker, and
        normally reach the waiting sender in memory; this makes the wait independent of that."""
        ids = [cid for sent in sphere.sent for cid in sent.ids.values()]
        for store in sphere.stores.values():
            with store.local() as conn:
                found = conn.execute(sa.select(tables.outbound.c.id, tables.outbound.c.recipient,
                                               tables.outbound.c.coupling, tables.outbound.c.reason)
                                     .where(tables.outbound.c.id.in_(ids))).all()
            with self._changed:
                for row in found:
                    known = self._states.get(row.id)
                    if known is not None and _RANK.get(row.recipient, 0) > _RANK.get(known[0], 0):
                        self._states[row.id] = (row.recipient, row.coupling, row.reason)

    def _committed(self, gtrid: str) -> None:
        self._forget_sphere(gtrid)
        self.node.sender.wake.set()

    def _forget_sphere(self, gtrid: str) -> None:
        sphere = self._spheres.pop(gtrid, None)
        if sphere is not None:
            with self._changed:
                for sent in sphere.sent:
                    for cid in sent.ids.values():
                        self._states.pop(cid, None)

    def _aborted(self, gtrid: str) -> None:
        """``gtrid`` rolled back: abort its coupled messages (compensation or cancellation at each recipient)."""
        sphere = self._spheres.get(gtrid)
        try:
            for store in (sphere.stores.values() if sphere is not None else []):
                self._abort_rows(store, [tables.outbound.c.gtrid == gtrid])
        except Exception:  # left "active": the sweep aborts them shortly
            log.exception("aborting the coupled messages of %s failed; the sweep will", gtrid)
        finally:
            self._forget_sphere(gtrid)

    def _abort_rows(self, store: Any, where: list[Any], skip_locked: bool = False) -> int:
        """Abort the active rows matching ``where``. The sweep skips rows locked by someone else (a prepared
        branch of the sender's own transaction, in doubt: recovery settles it first); the sender's own
        rollback waits for a lock held a moment by the invoker applying a report."""
        with store.local() as conn:
            rows = conn.execute(sa.select(tables.outbound.c.id, tables.outbound.c.channel,
                                          tables.outbound.c.compensation)
                                .where(tables.outbound.c.state == ACTIVE, *where)
                                .with_for_update(skip_locked=skip_locked)).all()
            if not rows:
                return 0
            conn.execute(tables.outbound.update().where(tables.outbound.c.id.in_([r.id for r in rows]))
                         .values(state=ABORTED, updated_at=time.time()))
            for row in rows:
                store.enqueue(conn, self._outgoing(self.node.channels[row.channel], row.id, "Abort",
                                                   encode(Control("Abort", row.id, body=row.compensation))))
        log.info("aborted %d coupled message(s): their recipients cancel or compensate them", len(rows))
        self.node.sender.wake.set()
        return len(rows)

    def _sweep(self, startup: bool = False) -> None:
        """Presumed abort, and the deadline kept. At start-up every row still "active" is aborted (its
        sender died before deciding). Later, every row past its deadline: a transaction of this node that
        has not decided by then can no longer meet its condition (Phase 0 would fail), so its recipients are
        told now, and a shared recipient holds its prepared branch, and its locks, no longer than the
        deadline even while the application keeps the transaction open. A Phase 0 that met its conditions
        and is committing holds the rows' locks: they are skipped, and whichever commits first wins (the
        other finds the rows moved and rolls back, or finds nothing to abort)."""
        for store in {id(s): s for s in self._coupled_stores()}.values():
            where = [] if startup else [tables.outbound.c.deadline < time.time() - 0.5]
            with store.local() as conn:
                gtrids = {g for (g,) in conn.execute(sa.select(tables.outbound.c.gtrid).distinct().where(
                    tables.outbound.c.state == ACTIVE, *where))}
            for gtrid in gtrids:
                self._abort_rows(store, [tables.outbound.c.gtrid == gtrid, *where], skip_locked=True)

    def _on_notify(self, tx: Any, message: Any) -> None:
        control = self._control(message)
        store = self._store_of(tx, control.id)
        if store is None:
            log.warning("a coupled notification for %s, which this node did not send: ignored", control.id)
            return
        conn, row = store
        if not self._from_recipient(message, row.channel):
            return
        if _RANK[control.state] < _RANK.get(row.recipient, 0) or control.state == row.recipient:
            return
        conn.execute(tables.outbound.update().where(tables.outbound.c.id == control.id).values(
            recipient=control.state, coupling=control.coupling, reason=control.reason, updated_at=time.time()))
        tx.on_commit(lambda: self._note(control))

    def _note(self, control: Control) -> None:
        with self._changed:
            known = self._states.get(control.id)
            if known is not None and _RANK[control.state] >= _RANK.get(known[0], 0):
                self._states[control.id] = (control.state, control.coupling, control.reason)
                self._changed.notify_all()

    def _store_of(self, tx: Any, coupling_id: str) -> tuple[Any, Any] | None:
        """The connection (in ``tx``) to the store holding the sender row ``coupling_id``, and the row."""
        for resource in sorted({c.store for c in self.node.channels.values() if c.mode == "xa" and c.store}):
            conn = tx.connection(resource)
            row = conn.execute(sa.select(tables.outbound).where(tables.outbound.c.id == coupling_id)
                               .with_for_update()).first()
            if row is not None:
                return conn, row
        return None

    def _on_status(self, tx: Any, message: Any) -> None:
        """A prepared recipient asks for the decision: send it again (none yet while the sender decides)."""
        control = self._control(message)
        found = self._store_of(tx, control.id)
        if found is None:  # this node never sent it (its store was replaced?): nothing it could answer
            log.warning("a recipient asks about coupled message %s, unknown here", control.id)
            return
        conn, row = found
        if not self._from_recipient(message, row.channel) or row.state == ACTIVE:
            return
        kind = "Commit" if row.state == COMMITTED else "Abort"
        body = encode(Control("Commit", row.id) if kind == "Commit" else Control("Abort", row.id, body=row.compensation))
        self.node.store_for(self.node.channels[row.channel].store, "xa").enqueue(
            conn, self._outgoing(self.node.channels[row.channel], row.id, kind, body))
        tx.on_commit(self.node.sender.wake.set)

    def _from_recipient(self, message: Any, channel: str) -> bool:
        """On authenticated nodes a notification about an original is taken only from that original's peer."""
        owner = self._owner(message)
        expected = self._peer_name(self.node.channels[channel].peer)
        if owner is not None and expected is not None and owner != expected:
            log.warning("peer %s sent a coupled message about an original sent to %s: refused", owner, expected)
            return False
        return True

    def _peer_name(self, endpoint: str) -> str | None:
        for name, peer in getattr(self.node.settings.security, "peers", {}).items():
            if getattr(peer, "endpoint", None) == endpoint:
                return name
        return None

    def _owner(self, message: Any) -> str | None:
        info = self.node.receiver.info(message.identifier)
        return None if info is None else info.owner

    # ================================================================== recipient

    def handler(self, action: str, coupling: str = "compensatable") -> Callable[[Callable[..., Any]], Any]:
        """Register ``fn(tx, message)`` for coupled originals whose action is ``action``, with ``coupling``:
        "shared" (its transaction is prepared and joins the sender's), "compensatable" (commits on its own;
        the compensator undoes it if the sender aborts) or "queued" (commits on its own; nothing undoes it)."""
        if coupling not in COUPLINGS:
            raise ConfigurationError(f"coupling is one of {', '.join(COUPLINGS)}, not {coupling!r}")

        def register(fn: Callable[..., Any]) -> Callable[..., Any]:
            if action in self._handlers:
                raise ConfigurationError(f"a coupled handler for {action!r} is already registered")
            self._handlers[action] = (fn, coupling)
            return fn
        return register

    def compensator(self, action: str) -> Callable[[Callable[..., Any]], Any]:
        """Register ``fn(tx, message)`` that undoes a processed original of ``action`` when its sender aborts;
        ``message.payload`` is the compensation the sender gave (default: the original)."""
        def register(fn: Callable[..., Any]) -> Callable[..., Any]:
            self._compensators[action] = fn
            return fn
        return register

    def _control(self, message: Any) -> Control:
        try:
            return decode(message.action, message.payload)
        except CoupledWireError as exc:
            raise ConfigurationError(f"malformed coupled message {message.message_id}: {exc}") from None

    def _conn(self, tx: Any) -> Any:
        return tx.connection(self.node.settings.store)

    def _on_message(self, tx: Any, message: Any) -> None:
        """An original arrived (in the invoker's transaction): store it and say "delivered"."""
        control = self._control(message)
        registered = self._handlers.get(control.action or "")
        coupling = registered[1] if registered else "queued"
        known = registered is not None or control.action in self.node.handlers
        now = time.time()
        conn = self._conn(tx)
        if conn.execute(sa.select(tables.inbound.c.id).where(tables.inbound.c.id == control.id)).first():
            return
        state = "received" if known else "failed"
        conn.execute(tables.inbound.insert(), {
            "id": control.id, "coordinator": control.coordinator, "owner": self._owner(message),
            "gtrid": control.transaction, "action": control.action, "coupling": coupling, "payload": control.body,
            "state": state, "attempts": 0, "next_at": 0.0, "deadline": control.deadline, "received_at": now,
            "updated_at": now, "error": None if known else f"no handler for action {control.action!r}"})
        if control.census or not known:
            self._notify(tx, control.coordinator or "", control.id, "delivered" if known else "failed", coupling,
                         None if known else f"no handler for {control.action}", message)
        tx.on_commit(self._wake.set)

    def _notify(self, tx: Any, coordinator: str, coupling_id: str, state: str, coupling: str,
                reason: str | None = None, message: Any = None) -> None:
        channel = self._reply_channel(coordinator, message)
        self.node.send(tx, channel, encode(Control("Notify", coupling_id, state=state, coupling=coupling,
                                                   reason=reason)), action=ACTION["Notify"], key=coupling_id)

    def _reply_channel(self, coordinator: str, message: Any = None) -> str:
        name = self.replies.get(coordinator)
        if name is None and coordinator in self.node.channels:
            name = coordinator
        if name is None and len(self.node.channels) == 1:
            name = next(iter(self.node.channels))
        if name is None:
            raise ConfigurationError(
                f"node {self.manager.node_id!r} has no channel back to coupled sender {coordinator!r}: name one in "
                f"Coupled(node, replies={{{coordinator!r}: 'CHANNEL'}}) or call the channel {coordinator!r}")
        return name

    def _on_decision(self, tx: Any, message: Any) -> None:
        """Commit or Abort from the sender (in the invoker's transaction)."""
        control = self._control(message)
        conn = self._conn(tx)
        row = conn.execute(sa.select(tables.inbound).where(tables.inbound.c.id == control.id)
                           .with_for_update()).first()
        if row is None:
            log.warning("coupled %s for %s, which never arrived here: nothing to do", control.kind, control.id)
            return
        if row.owner is not None and self._owner(message) != row.owner:
            log.warning("peer %s sent a decision about an original of %s: refused", self._owner(message), row.owner)
            return
        commit = control.kind == "Commit"
        update = tables.inbound.update().where(tables.inbound.c.id == row.id)
        now = time.time()
        settled: str | None = None
        if row.state == "prepared":
            self._resolve(row.sub_gtrid, (row.branches or "").split(","), commit)
            settled = "committed" if commit else "rolled-back"
        elif row.state == "received":
            if commit:
                conn.execute(update.values(decision="commit", updated_at=now))
                tx.on_commit(self._wake.set)
            else:
                settled = "cancelled"
        elif row.state == "processed":
            if commit:
                settled = "committed"
            else:
                conn.execute(update.values(decision="abort", compensation=control.body, attempts=0, next_at=0.0,
                                           updated_at=now))
                tx.on_commit(self._wake.set)
        elif row.state == "compensation-failed" and not commit:  # sent again by an operator: try again
            conn.execute(update.values(state="processed", decision="abort", attempts=0, next_at=0.0, error=None,
                                       compensation=control.body or row.compensation, updated_at=now))
            tx.on_commit(self._wake.set)
        if settled is not None:
            conn.execute(update.values(state=settled, decision="commit" if commit else "abort", updated_at=now))
            self._notify(tx, row.coordinator, row.id, settled, row.coupling, message=message)

    def _resolve(self, sub_gtrid: str | None, branches: list[str], commit: bool) -> None:
        """Commit or roll back the prepared branches of a subordinate transaction (idempotent)."""
        if not sub_gtrid:
            return
        for name in [b for b in branches if b]:
            resource = self.manager.resource(name)
            xid = Xid.of(sub_gtrid.encode(), name)
            if commit:
                resource.commit(xid)
            else:
                resource.rollback(xid)

    def _sub_gtrid(self) -> str:
        return f"{self.manager.node_id}{SUB_MARK}/{os.urandom(15).hex()}"

    def _recover_recipient(self) -> None:
        """At start: a subordinate prepared but never recorded as voted is rolled back (the sender cannot
        have counted on it); the original is tried again."""
        store = self.node.inbound_store
        with store.local() as conn:
            rows = conn.execute(sa.select(tables.inbound.c.id, tables.inbound.c.sub_gtrid).where(
                tables.inbound.c.state == "received", tables.inbound.c.sub_gtrid.is_not(None))).all()
        for row in rows:
            self._resolve(row.sub_gtrid, list(self.manager.resources), commit=False)
            with store.local() as conn:
                conn.execute(tables.inbound.update().where(tables.inbound.c.id == row.id).values(sub_gtrid=None))
            log.info("coupled %s: its unvoted prepared work was rolled back; it is processed again", row.id)

    # ------------------------------------------------------------------ the worker

    def _work(self) -> None:
        last_sweep = 0.0
        while not self.node.stopping.is_set():
            self._wake.clear()
            try:
                busy = self._work_once()
                if time.time() - last_sweep > self.sweep_interval:
                    last_sweep = time.time()
                    self._sweep()
                    self._ask_prepared()
            except Exception:
                log.exception("coupled worker failed; retrying")
                busy = False
            if not busy:
                self._wake.wait(0.25)
        self._pool.shutdown(wait=True)

    def _work_once(self) -> bool:
        """Hand the rows that have work to the pool (each original to one thread at a time); True when
        anything new was handed out."""
        store = self.node.inbound_store
        now = time.time()
        c = tables.inbound.c
        with store.local() as conn:
            # an original still undecided past its deadline waits for the decision (the sender has made it or
            # makes it now): processing it could only be undone again
            rows = conn.execute(sa.select(tables.inbound).where(c.next_at <= now, sa.or_(
                sa.and_(c.state == "received", sa.or_(sa.and_(c.decision.is_(None), c.deadline > now),
                                                      c.decision == "commit")),
                sa.and_(c.state == "processed", c.decision == "abort"))).order_by(c.received_at).limit(32)).all()
        fresh = 0
        for row in rows:
            with self._lock:
                if row.id in self._claimed:
                    continue
                self._claimed.add(row.id)
            fresh += 1
            self._pool.submit(self._run_one, row)
        return fresh > 0

    def _run_one(self, row: Any) -> None:
        """One step for one original (its state guards each step, so a row read before an earlier step of
        the same original finished does nothing)."""
        try:
            if self.node.stopping.is_set():
                return
            if row.state == "processed":
                self._compensate(row)
            elif row.coupling == "shared" and row.decision is None:
                self._prepare(row)
            else:
                self._process(row)
        except Exception:
            log.exception("coupled %s: step failed; retried shortly", row.id)
        finally:
            with self._lock:
                self._claimed.discard(row.id)
            self._wake.set()

    def _message(self, row: Any, compensation: bool = False) -> CoupledMessage:
        payload = row.compensation if compensation and row.compensation is not None else row.payload
        return CoupledMessage(row.id, row.action, payload, row.coordinator, row.gtrid, row.coupling,
                              row.payload if compensation else None)

    def _fn(self, action: str) -> Callable[..., Any] | None:
        registered = self._handlers.get(action)
        return registered[0] if registered else self.node.handlers.get(action)

    def _process(self, row: Any) -> None:
        """Queued, compensatable, or shared once the sender committed: the handler commits on its own."""
        fn = self._fn(row.action)
        try:
            with self.manager.transaction() as tx:
                conn = self._conn(tx)
                # locked and read again: the decision may have arrived since the row was read
                current = conn.execute(sa.select(tables.inbound.c.decision).where(
                    tables.inbound.c.id == row.id, tables.inbound.c.state == "received").with_for_update()).first()
                if current is None or current.decision == "abort":
                    tx.rollback()
                    return
                done = "committed" if current.decision == "commit" else "processed"
                conn.execute(tables.inbound.update().where(tables.inbound.c.id == row.id)
                             .values(state=done, updated_at=time.time()))
                if fn is None:
                    raise ConfigurationError(f"no handler for action {row.action!r}")
                fn(tx, self._message(row))
                self._notify(tx, row.coordinator, row.id, done, row.coupling)
        except Exception as exc:
            self._failed(row, exc, "failed")

    def _prepare(self, row: Any) -> None:
        """Shared: the handler's work is prepared as a subordinate of the sender's transaction; the prepared
        branches are recorded, then "prepared" is notified (the vote)."""
        fn = self._fn(row.action)
        store = self.node.inbound_store
        if row.sub_gtrid:  # an earlier attempt prepared it and could not record or undo that: undo it first
            self._resolve(row.sub_gtrid, list(self.manager.resources), commit=False)
        sub = self._sub_gtrid()
        with store.local() as conn:  # recorded first: a crash after the prepare rolls it back at restart
            if not conn.execute(tables.inbound.update().where(tables.inbound.c.id == row.id,
                                                              tables.inbound.c.state == "received",
                                                              tables.inbound.c.decision.is_(None))
                                .values(sub_gtrid=sub)).rowcount:
                return
        branches: list[str] | None = None
        try:
            tx = self.manager.begin(gtrid=sub.encode())
            try:
                if fn is None:
                    raise ConfigurationError(f"no handler for action {row.action!r}")
                fn(tx, self._message(row))
                branches = tx.prepare_subordinate()
                failpoint("coupled_after_prepare")  # prepared, the vote not yet recorded
            except BaseException:
                if tx.outcome is None:
                    tx.rollback()
                raise
        except Exception as exc:
            try:
                if branches is not None:  # prepared but not voted: nobody counts on it, undo it now
                    self._resolve(sub, branches, commit=False)
                with store.local() as conn:
                    conn.execute(tables.inbound.update().where(tables.inbound.c.id == row.id).values(sub_gtrid=None))
            except Exception as undo:  # the gtrid stays recorded: the next attempt, or the restart, undoes it
                log.warning("coupled %s: the prepared work of a failed attempt is not undone yet: %s", row.id, undo)
            self._failed(row, exc, "failed")
            return
        try:
            with self.manager.transaction() as vote:
                moved = self._conn(vote).execute(tables.inbound.update().where(
                    tables.inbound.c.id == row.id, tables.inbound.c.state == "received",
                    tables.inbound.c.decision.is_(None)).values(
                    state="prepared", branches=",".join(branches), updated_at=time.time())).rowcount
                if moved:
                    self._notify(vote, row.coordinator, row.id, "prepared", "shared")
                else:
                    vote.rollback()
        except Exception:
            self._resolve(sub, branches, commit=False)
            raise
        if not moved:  # the sender decided meanwhile (abort): nothing of it may stay prepared
            self._resolve(sub, branches, commit=False)

    def _compensate(self, row: Any) -> None:
        fn = self._compensators.get(row.action)
        try:
            with self.manager.transaction() as tx:
                moved = self._conn(tx).execute(tables.inbound.update().where(
                    tables.inbound.c.id == row.id, tables.inbound.c.state == "processed",
                    tables.inbound.c.decision == "abort").values(state="compensated", updated_at=time.time())).rowcount
                if not moved:
                    tx.rollback()
                    return
                if fn is None:
                    raise ConfigurationError(f"no compensator for action {row.action!r} (coupling {row.coupling}): "
                                             "its effect stays")
                fn(tx, self._message(row, compensation=True))
                self._notify(tx, row.coordinator, row.id, "compensated", row.coupling)
        except Exception as exc:
            self._failed(row, exc, "compensation-failed", last=self._compensators.get(row.action) is None)

    def _failed(self, row: Any, exc: BaseException, final: str, last: bool = False) -> None:
        limits = self.node.limits
        error = "".join(traceback.format_exception_only(type(exc), exc)).strip()[:2000]
        attempts = row.attempts + 1
        now = time.time()
        if attempts < limits.max_attempts and not last:
            delay = min(limits.retry_backoff * 2 ** (attempts - 1), limits.retry_backoff_max)
            log.warning("coupled %s (%s): attempt %d of %d failed, next in %.1f s: %s", row.id, row.action, attempts,
                        limits.max_attempts, delay, error)
            with self.node.inbound_store.local() as conn:
                conn.execute(tables.inbound.update().where(tables.inbound.c.id == row.id).values(
                    attempts=attempts, next_at=now + delay, error=error, updated_at=now))
            return
        log.error("coupled %s (%s) is %s after %d attempt(s): %s", row.id, row.action, final, attempts, error)
        with self.manager.transaction() as tx:
            self._conn(tx).execute(tables.inbound.update().where(tables.inbound.c.id == row.id).values(
                state=final, attempts=attempts, error=error, updated_at=now))
            self._notify(tx, row.coordinator, row.id, final, row.coupling,
                         f"failed {attempts} time(s); kept at the recipient")

    def _ask_prepared(self) -> None:
        """A shared recipient prepared past the deadline asks its sender for the decision (every 5 s)."""
        now = time.time()
        with self.node.inbound_store.local() as conn:
            rows = conn.execute(sa.select(tables.inbound.c.id, tables.inbound.c.coordinator).where(
                tables.inbound.c.state == "prepared", tables.inbound.c.deadline < now)).all()
        for row in rows:
            if now - self._asked.get(row.id, 0.0) < 5.0:
                continue
            self._asked[row.id] = now
            with self.manager.transaction() as tx:
                self.node.send(tx, self._reply_channel(row.coordinator), encode(Control("Status", row.id)),
                               action=ACTION["Status"], key=row.id)
            log.info("coupled %s is prepared past its deadline: asked %s for the decision", row.id, row.coordinator)

    # ================================================================== operators

    def open_compensations(self) -> list[dict[str, Any]]:
        """The compensation log's open entries: aborted originals whose recipient has not settled them."""
        found = []
        for store in {id(s): s for s in self._coupled_stores()}.values():
            with store.local() as conn:
                found += [dict(r._mapping) for r in conn.execute(sa.select(tables.outbound).where(
                    tables.outbound.c.state == ABORTED, tables.outbound.c.recipient.not_in(SETTLED)))]
        return found

