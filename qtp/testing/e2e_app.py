"""The application of the two-node tests and the crash campaign: ``qtp serve --app qtp.testing.e2e_app:node``.

Environment:

- ``QTP_TEST_CONFIG``: the node's qtp.toml;
- ``QTP_TEST_SEND=N``: send orders 1..N on channel ``orders`` from a background thread, each in a
  transaction that also inserts the order's row in the client table ``orders`` (resource ``app``); every
  ``QTP_TEST_ABORT_EVERY``-th transaction raises after sending, so neither row nor message may exist (its
  row is then written with status ``aborted`` in a transaction of its own, for the reconciliation).
  After a restart the thread resumes after the highest order recorded.
- ``QTP_TEST_THREADS=T``: T sending threads (orders k with k mod T apart); ``QTP_TEST_PAD=BYTES`` pads each
  order's XML (payload size, for benchmarks); ``QTP_TEST_RATE=R`` paces them at R orders/s in all.
- ``QTP_TEST_FAIL=K,...``: the server's handler raises for these order numbers (dead letters / faults).
- ``QTP_TEST_KEYS=1``: each order is sent with its number as its key (``tx.send(key=...)``), so a channel
  with ``lanes`` spreads the orders over its lanes.
- ``QTP_TEST_BATCH_HANDLER=1``: the server applies with a batch handler (one ``executemany`` per
  transaction) instead of one INSERT per message.

Server side: the handler of ``urn:test:apply`` inserts a row into ``applied`` (no unique key, so a
duplicate apply would show as two rows; ``pid`` says which process of a replicated node wrote it) and, on a
request-reply channel, answers ``<done k="K"/>``. Client
side: the reply handler records each reply (and fault) as a row of ``replies``.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
import uuid

import sqlalchemy as sa
from sqlalchemy import text

import qtp

logging.basicConfig(level=os.environ.get("QTP_TEST_LOG", "WARNING"),
                    format="%(asctime)s %(process)d %(threadName)s %(name)s %(levelname)s %(message)s", force=True)

ACTION = "urn:test:apply"
node = qtp.Node.from_config(os.environ["QTP_TEST_CONFIG"])
qtp.install(node.manager)
_KEYED = os.environ.get("QTP_TEST_KEYS") == "1"
_FAIL = {int(k) for k in os.environ.get("QTP_TEST_FAIL", "").split(",") if k.strip()}


def _order(payload: bytes) -> int:
    found = re.search(rb'k="(\d+)"', payload)
    if found is None:
        raise ValueError(f"not an order: {payload[:80]!r}")
    return int(found.group(1))


_INSERT = text("INSERT INTO applied (k, seq, num, lat_ms, pid) VALUES (:k, :s, :n, :l, :p)")


def _row(message) -> dict:
    k = _order(message.payload)
    if k in _FAIL:
        raise RuntimeError(f"order {k} is refused by the test")
    latency = None if message.enqueued_at is None else (time.time() - message.enqueued_at) * 1000
    return {"k": k, "s": message.identifier, "n": message.number, "l": latency, "p": os.getpid()}


def apply(tx, message):
    row = _row(message)
    tx.connection("app").execute(_INSERT, row)
    return f'<done xmlns="urn:test" k="{row["k"]}"/>'.encode()


def apply_batch(tx, messages):
    rows = [_row(m) for m in messages]
    tx.connection("app").execute(_INSERT, rows)
    return [f'<done xmlns="urn:test" k="{row["k"]}"/>'.encode() for row in rows]


if os.environ.get("QTP_TEST_BATCH_HANDLER") == "1":
    node.batch_handler(ACTION)(apply_batch)
else:
    node.handler(ACTION)(apply)


if "orders" in node.channels and node.channels["orders"].reply:
    @node.reply_handler("orders")
    def replied(tx, reply):
        if reply.fault is not None:  # the fault says only that order was not processed: which, its RelatesTo says
            k, kind = int(re.search(r":order-(\d+)-", reply.relates_to).group(1)), "fault"
        else:
            k, kind = _order(reply.payload), "reply"
        tx.connection("app").execute(text("INSERT INTO replies (k, kind, pid) VALUES (:k, :kind, :p)"),
                                     {"k": k, "kind": kind, "p": os.getpid()})


class Abort(Exception):
    """The test's deliberate rollback."""


def _send(count: int, abort_every: int, lane: int, lanes: int, padding: str, rate: float) -> None:
    """Send orders lane, lane + lanes, ... up to ``count`` (one lane per thread), resuming after a restart."""
    engine = sa.create_engine(node.manager.resource("app").url, pool_size=2, pool_pre_ping=True)
    with engine.connect() as conn:
        done = conn.execute(text("SELECT COALESCE(MAX(k), 0) FROM orders WHERE MOD(k, :n) = :r"),
                            {"n": lanes, "r": lane % lanes}).scalar()
    start = done + lanes if done else lane
    began = time.monotonic()
    for i, k in enumerate(range(start, count + 1, lanes)):
        if rate:  # this thread's share of the total rate
            time.sleep(max(0.0, began + i * lanes / rate - time.monotonic()))
        while True:
            try:
                with qtp.transaction() as tx:
                    tx.connection("app").execute(text("INSERT INTO orders (k, pid) VALUES (:k, :p)"), {"k": k, "p": os.getpid()})
                    tx.send("orders", f'<order xmlns="urn:test" k="{k}">{padding}</order>'.encode(), action=ACTION,
                            message_id=f"urn:qtp:m:{int(time.time() * 1e6)}:order-{k}-{uuid.uuid4().hex}",
                            key=str(k) if _KEYED else None)
                    if abort_every and k % abort_every == 0:
                        raise Abort()
                break
            except Abort:
                _record_abort(engine, k)
                break
            except Exception as exc:  # a database restarting: try again unless it did commit
                logging.warning("sending order %d failed (%s); retrying", k, exc)
                time.sleep(0.2)
                if _committed(engine, k):
                    break


def _record_abort(engine: sa.Engine, k: int) -> None:
    while True:
        try:
            with engine.begin() as conn:
                conn.execute(text("INSERT INTO orders (k, status, pid) VALUES (:k, 'aborted', :p)"),
                             {"k": k, "p": os.getpid()})
            return
        except Exception as exc:  # the database is restarting
            logging.warning("recording aborted order %d failed (%s); retrying", k, exc)
            time.sleep(0.2)
            if _committed(engine, k):
                return


def _committed(engine: sa.Engine, k: int) -> bool:
    try:
        with engine.connect() as conn:
            return conn.execute(text("SELECT COUNT(*) FROM orders WHERE k = :k"), {"k": k}).scalar() == 1
    except Exception:
        return False


_count = int(os.environ.get("QTP_TEST_SEND", "0"))
if _count:
    _lanes = int(os.environ.get("QTP_TEST_THREADS", "1"))
    _padding = "x" * int(os.environ.get("QTP_TEST_PAD", "0"))
    for _lane in range(1, _lanes + 1):
        threading.Thread(target=_send, name=f"test-sender-{_lane}", daemon=True,
                         args=(_count, int(os.environ.get("QTP_TEST_ABORT_EVERY", "0")), _lane, _lanes, _padding,
                               float(os.environ.get("QTP_TEST_RATE", "0")))
                         ).start()

