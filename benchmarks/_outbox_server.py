"""The hand-written baseline's server side (benchmarks/e2e_throughput.py variant c), as a WSGI app in waitress.

What a user writes without qtp: each POST carries one message (id and enqueue time in headers); one local
transaction inserts the id into an ``inbox`` table (its primary key makes a duplicate a no-op) and, when it
was new, the application row. Run as ``python benchmarks/_outbox_server.py URL PORT``.
"""

from __future__ import annotations

import re
import sys
import time

import sqlalchemy as sa
from sqlalchemy import text


def app_for(url: str):
    engine = sa.create_engine(url, pool_size=16, max_overflow=16)
    first = text("INSERT IGNORE INTO inbox (msg_id) VALUES (:id)") if url.startswith("mysql") else \
        text("INSERT INTO inbox (msg_id) VALUES (:id) ON CONFLICT DO NOTHING")
    apply = text("INSERT INTO applied (k, seq, num, lat_ms) VALUES (:k, 'outbox', 0, :l)")

    def app(environ, start_response):
        body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
        found = re.search(rb'k="(\d+)"', body)
        if found is None:  # the benchmark's readiness probe
            start_response("400 Bad Request", [("Content-Length", "0")])
            return [b""]
        k = int(found.group(1))
        enqueued = float(environ["HTTP_X_ENQUEUED"])
        with engine.begin() as conn:
            if conn.execute(first, {"id": environ["HTTP_X_MESSAGE_ID"]}).rowcount == 1:
                conn.execute(apply, {"k": k, "l": (time.time() - enqueued) * 1000})
        start_response("200 OK", [("Content-Length", "0")])
        return [b""]

    return app


if __name__ == "__main__":
    from waitress import serve

    serve(app_for(sys.argv[1]), host="127.0.0.1", port=int(sys.argv[2]), threads=16, _quiet=True)
