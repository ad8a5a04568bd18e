"""``qtp db start|stop|url``: the private PostgreSQL and MariaDB servers under ``.qtp/`` (see qtp.embedded)."""

from __future__ import annotations

import argparse
from pathlib import Path

from qtp.embedded import DEFAULT_ROOT, EmbeddedMariaDB, EmbeddedPostgres


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("db", help="start, stop or locate qtp's private PostgreSQL and MariaDB servers")
    p.add_argument("action", choices=["start", "stop", "url"])
    p.add_argument("--root", type=Path, default=DEFAULT_ROOT, help="folder holding the servers (default .qtp)")
    p.add_argument("--only", choices=["postgres", "mariadb"], help="act on one server only")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    servers = []
    if args.only in (None, "postgres"):
        servers.append(("postgres", EmbeddedPostgres(args.root / "pg")))
    if args.only in (None, "mariadb"):
        servers.append(("mariadb", EmbeddedMariaDB(args.root / "mariadb")))
    for name, server in servers:
        if args.action == "stop":
            server.stop()
            print(f"{name}: stopped")
            continue
        info = server.start()
        print(f"{name}: {info.url()}  (data {info.datadir})")
    return 0
