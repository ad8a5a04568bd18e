"""The qtp application of the gSOAP interop tests, run as ``qtp serve --app interop.gsoap_app:node``
(PYTHONPATH=tests).

Environment:

- ``QTP_TEST_CONFIG``: the node's qtp.toml;
- ``QTP_TEST_SEND=N``: send ``qtp-1`` .. ``qtp-N`` on channel ``gsoap`` (to a gSOAP server) from a background
  thread, each in a transaction that also inserts the message's row in table ``sent`` (resource ``app``);
  every ``QTP_TEST_ABORT_EVERY``-th transaction raises after sending, so neither row nor message may exist.
  After a restart the thread resumes after the highest committed number.

Receiving side: the handler of the gSOAP client's action ``urn:qtp:interop:gsoap/deliver`` inserts the
message's text, sequence and number into table ``delivered`` (no unique key, so a second application of one
message would show as a second row), in the global transaction that also dequeues the message.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time

from sqlalchemy import text

import qtp

logging.basicConfig(level=os.environ.get("QTP_TEST_LOG", "WARNING"),
                    format="%(asctime)s %(process)d %(threadName)s %(name)s %(levelname)s %(message)s", force=True)

ACTION = "urn:qtp:interop:gsoap/deliver"   # what the gSOAP client sends and the gSOAP server serves
node = qtp.Node.from_config(os.environ["QTP_TEST_CONFIG"])
qtp.install(node.manager)

_TEXT = re.compile(rb"<text>([^<]*)</text>")


def payload(text_: str) -> bytes:
    """The body of the gSOAP service's one-way operation ``ns:deliver``."""
    return f'<ns:deliver xmlns:ns="urn:qtp:interop:gsoap"><text>{text_}</text></ns:deliver>'.encode()


@node.handler(ACTION)
def deliver(tx, message):
    found = _TEXT.search(message.payload)
    if found is None:
        raise ValueError(f"not a deliver message: {message.payload[:120]!r}")
    tx.connection("app").execute(text("INSERT INTO delivered (txt, seq, num) VALUES (:t, :s, :n)"),
                                 {"t": found.group(1).decode(), "s": message.identifier, "n": message.number})


class Abort(Exception):
    """The test's deliberate rollback."""


def _send(count: int, abort_every: int) -> None:
    engine = node.manager.resource("app").engine
    with engine.connect() as conn:
        start = conn.execute(text("SELECT COALESCE(MAX(k), 0) FROM sent")).scalar() + 1
    for k in range(start, count + 1):
        while True:
            try:
                with qtp.transaction() as tx:
                    tx.connection("app").execute(text("INSERT INTO sent (k) VALUES (:k)"), {"k": k})
                    tx.send("gsoap", payload(f"qtp-{k}"), action=ACTION)
                    if abort_every and k % abort_every == 0:
                        raise Abort()
                break
            except Abort:
                break
            except Exception as exc:
                logging.warning("sending %d failed (%s); retrying", k, exc)
                time.sleep(0.2)


_count = int(os.environ.get("QTP_TEST_SEND", "0"))
if _count:
    threading.Thread(target=_send, args=(_count, int(os.environ.get("QTP_TEST_ABORT_EVERY", "0"))),
                     name="test-sender", daemon=True).start()
