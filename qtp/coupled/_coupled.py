"""``Coupled``: coupled messaging on a qtp node, both roles. docs/coupled.md explains the model; the sender's
side is ``_sender``, the recipient's ``_recipient``, the states ``_states``, every SQL statement ``_log``.

Every control message is an ordinary reliable message on the channels between the two nodes, sent with the
coupling id as its key, so the messages about one original travel in one lane, in order.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from qtp.coupled import _tables as tables
from qtp.coupled._conditions import Condition
from qtp.coupled._recipient import CoupledMessage, Recipient
from qtp.coupled._sender import Sender
from qtp.coupled._site import Site
from qtp.coupled._states import ABORTED, ACTIVE, COMMITTED, SETTLED
from qtp.coupled._wire import ACTION

log = logging.getLogger("qtp.coupled")

PRUNE_EVERY = 60.0

__all__ = ["ABORTED", "ACTIVE", "COMMITTED", "SETTLED", "Coupled", "CoupledMessage"]


class Coupled:
    """Coupled messaging for ``node`` (both roles). ``replies``: sender node id -> the channel this node
    answers it on (default: a channel named like the sender's node, else the node's only channel; for an
    authenticated sender it must lead to that peer). Coupled handlers and compensators run on
    ``workers`` threads, with the node's ``max_attempts`` and ``retry_backoff`` limits (only a handler's
    refusal counts as an attempt; an outage only delays); ``sweep_interval``: seconds between the sender's
    presumed-abort sweeps. Each defaults to the node's ``[coupled]`` table (``workers``, ``sweep_interval``,
    ``replies``), else 4 workers, 1 s, no replies.

    Build it before ``node.start()`` (the node takes no handler once it has started); its worker and its
    start-up sweep run from the node's start. ``start=False`` leaves them to an explicit ``start()``, for an
    application that registers its coupled handlers later: until then coupled control messages wait. For
    10 s after the start an original whose handler is missing waits for it; after that it is refused
    (reported "failed").
    """

    def __init__(self, node: Any, replies: dict[str, str] | None = None, sweep_interval: float | None = None,
                 workers: int | None = None, start: bool = True):
        configured = getattr(node.settings, "coupled", None) or {}
        replies = {**configured.get("replies", {}), **(replies or {})}
        sweep_interval = sweep_interval if sweep_interval is not None else configured.get("sweep_interval", 1.0)
        workers = workers if workers is not None else configured.get("workers", 4)
        self.site = Site(node, replies)
        self.node = node
        self.manager = node.manager
        self.sweep_interval = sweep_interval
        self.sender = Sender(self.site)
        self.recipient = Recipient(self.site, workers)
        for store in [self.site.store, *self.site.coupled_stores()]:
            tables.create(store.engine)
        node.create_tables()  # (originals are enqueued in their own commit, also before the node starts)
        node.coupled = self
        self._started = False
        # the node refuses handlers once it has started: Coupled(node) comes before node.start()
        self.node.handler(ACTION["Message"], on_receipt=False)(self.recipient.on_message)
        self.node.handler(ACTION["Commit"], on_receipt=False)(self.recipient.on_decision)
        self.node.handler(ACTION["Abort"], on_receipt=False)(self.recipient.on_decision)
        self.node.handler(ACTION["Notify"], on_receipt=False)(self.sender.on_notify)
        self.node.handler(ACTION["Status"], on_receipt=False)(self.sender.on_status)
        if start:
            self.start()

    def start(self) -> "Coupled":
        """Take coupled control messages, presume abort for what this node sent and never decided, and start
        the coupling worker."""
        if not self._started:
            self._started = True
            self.recipient.started = time.monotonic()
            # before any coupled transaction of this process can start: what it finds undecided is an earlier
            # run's (the node's queue tables are created by the first message it enqueues, if need be)
            self.sender.sweep(startup=True)
            self.node.add_worker(self._work, "qtp-coupled")  # from the node's start, at once if it has started
        return self

    # ------------------------------------------------------------------ the application's API

    def send(self, tx: Any, channels: str | list[str], payload: bytes | str, action: str,
             condition: Condition | None = None, compensation: Any = None,
             require: str | dict[str, str] | None = None) -> dict[str, str]:
        """Send ``payload`` to the recipients at ``channels`` as one conditional message of ``tx``: delivered
        now (before ``tx`` commits); ``tx`` commits only if ``condition`` (default: processed by every
        recipient within 30 s) is met by then; if ``tx`` rolls back, every recipient is told and undoes it
        (cancel, roll back, or run its compensator with ``compensation``, default the original payload).
        ``compensation`` and ``require`` may be one value for every recipient or a dict channel -> value.
        ``require``: the coupling ("shared", "compensatable", "queued") a recipient must offer; one whose
        handler offers another refuses the original (it reports "failed"), so the condition counts it out.
        Returns channel -> coupling id (see ``outcomes``)."""
        return self.sender.send(tx, channels, payload, action, condition, compensation, require)

    def outcomes(self, ids: list[str] | dict[str, str] | None = None,
                 transaction: str | None = None) -> dict[str, dict[str, Any]]:
        """Per coupling id (a list, or what ``send`` returned; or every one of ``transaction``): the
        sender's decision and what the recipient last reported (see docs/coupled.md)."""
        if isinstance(ids, dict):
            ids = list(ids.values())
        return self.sender.outcomes(ids, transaction)

    def handler(self, action: str, coupling: str = "compensatable") -> Callable[[Callable[..., Any]], Any]:
        """Register ``fn(tx, message)`` for coupled originals whose action is ``action``, with ``coupling``:
        "shared" (its transaction is prepared and joins the sender's), "compensatable" (commits on its own;
        the compensator undoes it if the sender aborts) or "queued" (commits on its own; nothing undoes it)."""
        return self.recipient.handler(action, coupling)

    def compensator(self, action: str) -> Callable[[Callable[..., Any]], Any]:
        """Register ``fn(tx, message)`` that undoes a processed original of ``action`` when its sender aborts;
        ``message.payload`` is the compensation the sender gave (default: the original)."""
        return self.recipient.compensator(action)

    def open_compensations(self) -> list[dict[str, Any]]:
        """The compensation log's open entries: aborted originals whose recipient has not settled them."""
        return self.sender.open_compensations()

    # ------------------------------------------------------------------ the worker

    def _work(self) -> None:
        last_sweep = last_prune = 0.0
        while not self.site.stopping.is_set():
            self.recipient.wake.clear()
            try:
                busy = self.recipient.work_once()
                now = time.time()
                if now - last_sweep > self.sweep_interval:
                    last_sweep = now
                    self.sender.sweep()
                    self.recipient.ask_overdue()
                if now - last_prune > PRUNE_EVERY:
                    last_prune = now
                    before = now - self.node.limits.dedup_retention
                    self.sender.prune(before)
                    self.recipient.prune(before)
            except Exception as exc:
                log.warning("coupled worker: %s: %s; retrying", type(exc).__name__, exc)
                busy = False
            if not busy:
                self.recipient.wake.wait(0.25)
        self.recipient.stop()
