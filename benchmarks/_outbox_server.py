"""The hand-written baselines' server side (benchmarks/e2e_throughput.py variants s and c), in cheroot
(a production WSGI server with a thread pool, what such a user would pick; qtp nodes ran in it until issue 28).

What a user writes without qtp. ``POST /`` (serial baseline, c): one message per request (id and enqueue
time in headers); one local transaction inserts the id into an ``inbox`` table (its primary key makes a
duplicate a no-op) and, when it was new, the application row. ``POST /batch`` (strong baseline, s): a JSON
list of messages; one local transaction finds which ids the inbox has already, then inserts the new ones
into ``inbox`` and ``applied`` with ``executemany``. Run as ``python benchmarks/_outbox_server.py URL PORT``.
"""

from __future__ import annotations

import json
import re
import sys
import time

import sqlalchemy as sa
from sqlalchemy import bindparam, text

_ORDER = re.compile(r'k="(\d+)"')


def app_for(url: str):
    engine = sa.create_engine(url, pool_size=16, max_overflow=16)
    first = text("INSERT IGNORE INTO inbox (msg_id) VALUES (:id)") if url.startswith("mysql") else \
        text("INSERT INTO inbox (msg_id) VALUES (:id) ON CONFLICT DO NOTHING")
    apply = text("INSERT INTO applied (k, seq, num, lat_ms) VALUES (:k, 'outbox', 0, :l)")
    known = text("SELECT msg_id FROM inbox WHERE msg_id IN :ids").bindparams(bindparam("ids", expanding=True))
    remember = text("INSERT INTO inbox (msg_id) VALUES (:id)")

    def one(environ: dict) -> None:
        body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
        k = int(_ORDER.search(body.decode()).group(1))
        enqueued = float(environ["HTTP_X_ENQUEUED"])
        with engine.begin() as conn:
            if conn.execute(first, {"id": environ["HTTP_X_MESSAGE_ID"]}).rowcount == 1:
                conn.execute(apply, {"k": k, "l": (time.time() - enqueued) * 1000})

    def batch(environ: dict) -> None:
        messages = json.loads(environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0)))
        with engine.begin() as conn:
            seen = {row[0] for row in conn.execute(known, {"ids": [m["id"] for m in messages]})}
            fresh = [m for m in messages if m["id"] not in seen]
            if fresh:
                now = time.time()
                conn.execute(remember, [{"id": m["id"]} for m in fresh])
                conn.execute(apply, [{"k": int(_ORDER.search(m["payload"]).group(1)),
                                      "l": (now - m["enqueued"]) * 1000} for m in fresh])

    def app(environ, start_response):
        if not environ.get("CONTENT_LENGTH") or environ["CONTENT_LENGTH"] == "0":  # the readiness probe
            start_response("400 Bad Request", [("Content-Length", "0")])
            return [b""]
        (batch if environ.get("PATH_INFO") == "/batch" else one)(environ)
        start_response("200 OK", [("Content-Length", "0")])
        return [b""]

    return app


if __name__ == "__main__":
    from cheroot import wsgi

    wsgi.Server(("127.0.0.1", int(sys.argv[2])), app_for(sys.argv[1]), numthreads=16).safe_start()
