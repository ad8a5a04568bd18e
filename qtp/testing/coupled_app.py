"""The application of the coupled-messaging crash tests and campaign:
``qtp serve --app qtp.testing.coupled_app:node``.

Every node opens accounts (table ``accounts``, ``qtp.testing.coupled_nodes.ACCOUNTS_DDL``). Environment:

- ``QTP_TEST_CONFIG``: the node's qtp.toml;
- ``QTP_COUPLED_COUPLING``: how this node's handler of ``urn:bank:open`` couples (shared, compensatable,
  queued; default shared); its compensator closes the account; ``QTP_COUPLED_SLOW``: seconds the handler
  sleeps (widens the window in which the sender waits in Phase 0 and the recipient holds a prepared branch);
- ``urn:bank:open-shared`` and ``urn:bank:open-compensatable``: the same handler with that coupling;
- ``urn:bank:open-plain`` and ``urn:bank:open-saga`` (plain handlers, for benchmarks/coupled_bench.py): open
  the account from an ordinary queued message; the saga's handler also answers on the channel named in the
  payload's ``reply`` attribute;
- ``QTP_COUPLED_REFUSE=M``: the handler refuses (raises ``Refused``, a business refusal that counts toward
  ``max_attempts``) every account acc-K with K % M == 0, after inserting it (its transaction rolls back);
  deterministic, so a judge knows which refusals to expect;
- ``QTP_COUPLED_SEND=N`` with ``QTP_COUPLED_TO=id,id,...``: open accounts acc-1..acc-N, each in a transaction
  that inserts it here and sends it as one conditional message to those nodes (processed by every recipient
  within ``QTP_COUPLED_WITHIN`` s, default 5; ``QTP_COUPLED_LEVEL=delivered``: delivered instead, a census;
  ``QTP_COUPLED_AT_LEAST=n``: by at least n of them instead of every one; ``QTP_COUPLED_BY=id,...``: these
  recipients among them, whatever the others do); every ``QTP_COUPLED_ABORT_EVERY``-th transaction raises
  after the send. ``QTP_COUPLED_THREADS=T`` (default 1): T application threads take the numbers in turn.
  Before each transaction its number is recorded in ``attempts`` (a local commit), so that after a restart
  the threads go on after the last one tried. The outcome the sender saw is not recorded: the judge reads
  the databases only.

The coupled handlers are registered before the coupled worker starts (``Coupled(start=False)``), so that an
original arriving right after a restart is never refused for want of its handler.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import sqlalchemy as sa
from lxml import etree

import qtp
from qtp.coupled import Coupled, delivered, processed

logging.basicConfig(level=os.environ.get("QTP_TEST_LOG", "WARNING"),
                    format="%(asctime)s %(process)d %(threadName)s %(name)s %(levelname)s %(message)s", force=True)

OPEN = "urn:bank:open"
node = qtp.Node.from_config(os.environ["QTP_TEST_CONFIG"])
coupled = Coupled(node, sweep_interval=0.5, start=False)
slow = float(os.environ.get("QTP_COUPLED_SLOW", "0"))
refuse = int(os.environ.get("QTP_COUPLED_REFUSE", "0"))


class Refused(Exception):
    """This recipient's business rule refuses the account (not transient: counts toward max_attempts)."""


@coupled.handler(OPEN, coupling=os.environ.get("QTP_COUPLED_COUPLING", "shared"))
def open_account(tx, message):
    account = etree.fromstring(message.payload).get("id")
    tx.connection("app").execute(sa.text("INSERT INTO accounts (id, k, status, opened_by) VALUES (:i, :k, 'open', "
                                         ":b)"), {"i": account, "k": int(account.split("-")[1]),
                                                  "b": message.transaction})
    if slow:
        time.sleep(slow)
    if refuse and int(account.split("-")[1]) % refuse == 0:
        raise Refused(f"{account} refused here: its number is a multiple of {refuse}")


for _coupling in ("shared", "compensatable"):  # the benchmark's couplings side by side, by action
    coupled.handler(f"{OPEN}-{_coupling}", coupling=_coupling)(open_account)


@coupled.compensator(OPEN)
def close_account(tx, message):
    account = etree.fromstring(message.payload).get("id")
    tx.connection("app").execute(sa.text("UPDATE accounts SET status = 'closed' WHERE id = :i"), {"i": account})


coupled.start()  # every coupled handler and compensator is registered


@node.handler(OPEN + "-plain")
def open_plain(tx, message):
    """The benchmark's plain queued variant: the same account, opened by an ordinary message."""
    account = etree.fromstring(message.payload).get("id")
    tx.connection("app").execute(sa.text("INSERT INTO accounts (id, k, status) VALUES (:i, :k, 'open')"),
                                 {"i": account, "k": int(account.split("-")[1])})


@node.handler(OPEN + "-saga")
def open_saga(tx, message):
    """The benchmark's hand-built saga: open the account and tell the sender, by a message of its own."""
    open_plain(tx, message)
    root = etree.fromstring(message.payload)
    tx.send(root.get("reply"), f"<opened id='{root.get('id')}'/>", action=OPEN + "-saga-done")


def _until_done(step):
    """The database may be down (a crash test kills it): try again until it answers."""
    while True:
        try:
            return step()
        except sa.exc.SQLAlchemyError as exc:
            logging.getLogger("coupled_app").info("database not reachable (%s); retrying", exc.__class__.__name__)
            time.sleep(0.5)


def _last_tried(engine) -> int:
    with engine.begin() as conn:
        return conn.exec_driver_sql("SELECT MAX(k) FROM attempts").scalar() or 0


def _record_try(engine, k: int) -> None:
    with engine.begin() as conn:
        if not conn.exec_driver_sql(f"SELECT 1 FROM attempts WHERE k = {k}").first():
            conn.exec_driver_sql(f"INSERT INTO attempts (k) VALUES ({k})")


class _Numbers:
    """acc-1..acc-N in turn for the application threads, from the one after the last tried."""

    def __init__(self, start: int, count: int):
        self.next, self.count, self.lock = start, count, threading.Lock()

    def take(self) -> int | None:
        with self.lock:
            if self.next > self.count:
                return None
            self.next += 1
            return self.next - 1


def _condition(within: float):
    at_least = int(os.environ["QTP_COUPLED_AT_LEAST"]) if os.environ.get("QTP_COUPLED_AT_LEAST") else None
    by = [b for b in os.environ.get("QTP_COUPLED_BY", "").split(",") if b]
    level = delivered if os.environ.get("QTP_COUPLED_LEVEL") == "delivered" else processed
    return level(at_least=at_least, by=by, within=within)


def _send(engine, numbers: _Numbers, recipients: list[str], within: float, abort_every: int) -> None:
    while (k := numbers.take()) is not None:
        _until_done(lambda: _record_try(engine, k))
        try:
            with node.manager.transaction(timeout=within + 30) as tx:
                tx.connection("app").execute(sa.text("INSERT INTO accounts (id, k, status) VALUES (:i, :k, 'open')"),
                                             {"i": f"acc-{k}", "k": k})
                coupled.send(tx, recipients, f"<open id='acc-{k}'/>", action=OPEN, condition=_condition(within),
                             compensation=f"<close id='acc-{k}'/>")
                if abort_every and k % abort_every == 0:
                    raise RuntimeError("aborted by the test")
        except Exception as exc:
            logging.getLogger("coupled_app").info("acc-%d: %s", k, exc)


def _sender(count: int, recipients: list[str], within: float, abort_every: int, threads: int) -> None:
    engine = sa.create_engine(node.manager.resource("app").url)
    numbers = _Numbers(_until_done(lambda: _last_tried(engine)) + 1, count)
    workers = [threading.Thread(target=_send, name=f"coupled-sender-{i}", daemon=True,
                                args=(engine, numbers, recipients, within, abort_every)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    print("coupled_app: all sent", flush=True)


if os.environ.get("QTP_COUPLED_SEND"):
    threading.Thread(target=_sender, name="coupled-sender", daemon=True, args=(
        int(os.environ["QTP_COUPLED_SEND"]), os.environ["QTP_COUPLED_TO"].split(","),
        float(os.environ.get("QTP_COUPLED_WITHIN", "5")), int(os.environ.get("QTP_COUPLED_ABORT_EVERY", "0")),
        int(os.environ.get("QTP_COUPLED_THREADS", "1")))
    ).start()
