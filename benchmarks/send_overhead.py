"""What a sending transaction costs in the application's process: qtp against the same statements by hand.

One transaction = one INSERT of an order row + one message of about 1 KB on channel ``orders``, on one
PostgreSQL database (the node's queue co-located with the application's tables), one thread:

  (plain) a SQLAlchemy ``engine.begin()`` that inserts the order and an ``outbox`` row: what an application
          writing its own outbox pays;
  (qtp)   ``with qtp.transaction() as tx: tx.connection("app").execute(INSERT); tx.send(...)``.

The node is built but not started (no pump, no endpoint): only the sending transaction itself is measured,
not the transfer. Variants alternate in short rounds so that the machine's noise hits both; the figure is
the median of the rounds' milliseconds per transaction, and the ratio is qtp / plain (target of issue 30:
<= 1.2). ``--profile FILE`` also writes a cProfile of the qtp variant (``python -m pstats FILE``) and prints
its top functions, and ``--statements`` counts the SQL statements each variant sends per transaction.

    .venv/bin/python benchmarks/send_overhead.py [--seconds 1] [--rounds 10] [--root /tmp/x/send]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import logging
import platform
import pstats
import statistics
import time
import uuid
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy import event, text

import qtp
from qtp.embedded import EmbeddedPostgres

PAYLOAD_PAD = "x" * 960
ACTION = "urn:test:order"


def _config(folder: Path, url: str) -> Path:
    path = folder / "qtp.toml"
    path.write_text(f'''
[node]
id = "send-bench"
log_dir = "{folder / 'logs'}"
store = "app"
mode = "xa"

[resources.app]
url = "{url}"

[channels.orders]
peer = "http://127.0.0.1:9/rm"
store = "app"
''')
    return path


class Counter:
    """SQL statements executed on an engine (``before_cursor_execute``)."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, *args) -> None:
        self.count += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=1.0, help="length of each variant's turn in a round")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--root", type=Path, default=Path("/tmp/qtp-send-bench"))
    parser.add_argument("--profile", type=Path, help="write a cProfile of the qtp variant here")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)

    args.root.mkdir(parents=True, exist_ok=True)
    pg = EmbeddedPostgres(args.root / "pg")
    pg.start()
    try:
        url = pg.create_database(f"send_{uuid.uuid4().hex[:8]}")
        engine = sa.create_engine(url, pool_size=2)
        with engine.begin() as conn:
            conn.execute(text("CREATE TABLE orders (k bigint PRIMARY KEY)"))
            conn.execute(text("CREATE TABLE outbox (id bigserial PRIMARY KEY, msg_id varchar(64) NOT NULL, "
                              "payload bytea NOT NULL, enqueued_at double precision NOT NULL)"))
        node = qtp.Node.from_config(_config(args.root, url))
        qtp.install(node.manager)
        node.create_tables()
        keys = iter(range(1, 10**9))

        def plain() -> None:
            k = next(keys)
            with engine.begin() as conn:
                conn.execute(text("INSERT INTO orders (k) VALUES (:k)"), {"k": k})
                conn.execute(text("INSERT INTO outbox (msg_id, payload, enqueued_at) VALUES (:m, :p, :t)"),
                             {"m": f"m-{k}", "p": f'<order xmlns="urn:test" k="{k}">{PAYLOAD_PAD}</order>'.encode(),
                              "t": time.time()})

        def with_qtp() -> None:
            k = next(keys)
            with qtp.transaction() as tx:
                tx.connection("app").execute(text("INSERT INTO orders (k) VALUES (:k)"), {"k": k})
                tx.send("orders", f'<order xmlns="urn:test" k="{k}">{PAYLOAD_PAD}</order>'.encode(), action=ACTION)

        variants = {"plain": plain, "qtp": with_qtp}
        for fn in variants.values():  # warm up: connections, statement caches, the node's tables
            for _ in range(50):
                fn()

        counts = {}
        for name, fn in variants.items():
            counter = Counter()
            engines = [engine, *(r.engine for r in _sql_resources(node))]
            for e in engines:
                event.listen(e, "before_cursor_execute", counter)
            for _ in range(100):
                fn()
            for e in engines:
                event.remove(e, "before_cursor_execute", counter)
            counts[name] = counter.count / 100

        per_round: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, fn in variants.items():
                n, began = 0, time.perf_counter()
                while time.perf_counter() - began < args.seconds:
                    fn()
                    n += 1
                per_round[name].append((time.perf_counter() - began) * 1000 / n)
        medians = {name: statistics.median(v) for name, v in per_round.items()}
        ratio = medians["qtp"] / medians["plain"]
        print(f"{'variant':8} {'ms/tx':>8} {'statements/tx':>14}")
        for name in variants:
            print(f"{name:8} {medians[name]:8.3f} {counts[name]:14.1f}")
        print(f"qtp / plain = {ratio:.2f}x (target <= 1.2x)")

        if args.profile:
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(2000):
                with_qtp()
            profiler.disable()
            profiler.dump_stats(str(args.profile))
            pstats.Stats(str(args.profile)).sort_stats("tottime").print_stats(25)
        if args.json:
            args.json.write_text(json.dumps({"machine": platform.platform(), "python": platform.python_version(),
                                             "ms_per_tx": medians, "statements_per_tx": counts,
                                             "ratio": round(ratio, 3), "rounds": per_round}, indent=2))
        node.close()
        engine.dispose()
    finally:
        pg.stop()


def _sql_resources(node):
    return [r for r in node.manager.distinct_resources() if getattr(r, "engine", None) is not None]


if __name__ == "__main__":
    main()
