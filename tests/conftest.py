"""Shared fixtures: private PostgreSQL and MariaDB servers for the whole test session.

Each server runs from a throw-away directory, so a test may kill -9 it and start it again
(``pg_server.kill(); pg_server.start()``). Databases are made per test by the factories ``pg_db`` and
``maria_db``, which return SQLAlchemy URLs. Nothing is mocked and nothing is skipped: when a server cannot
start, the tests that need it fail with the server's log.
"""

from __future__ import annotations

import itertools
import re

import pytest

from embedded_support import discard
from qtp.embedded import EmbeddedMariaDB, EmbeddedPostgres

_counter = itertools.count()


def pytest_configure(config):
    """Node processes (``qtp.testing.nodes.NodeProcess``, hundreds per run) are forks of the session's zygote
    (tests/zygote.py), an interpreter that imported qtp once, instead of new interpreters: each start saves
    the interpreter's start-up and qtp's imports (about 0.6 s of CPU)."""
    from qtp.testing import nodes
    from zygote import shared

    nodes.LAUNCH = lambda args, env, log: shared().spawn("qtp", args, env, log)


@pytest.fixture(scope="session")
def pg_server(tmp_path_factory):
    server = EmbeddedPostgres(tmp_path_factory.mktemp("pg"))
    server.start()
    yield server
    discard(server)  # immediate shutdown: no checkpoint of data that is deleted next


@pytest.fixture(scope="session")
def maria_server(tmp_path_factory):
    server = EmbeddedMariaDB(tmp_path_factory.mktemp("mariadb"))
    server.start()
    yield server
    discard(server)  # no flush of the buffer pool for data that is deleted next


def _throw_away(server):
    server.start()
    yield server
    discard(server)


@pytest.fixture
def own_pg(tmp_path):
    """A PostgreSQL server of the test's own, to kill without disturbing other tests."""
    yield from _throw_away(EmbeddedPostgres(tmp_path / "own-pg"))


@pytest.fixture
def own_maria(tmp_path):
    """A MariaDB server of the test's own, to kill without disturbing other tests."""
    yield from _throw_away(EmbeddedMariaDB(tmp_path / "own-maria"))


def _db_name(request, tag: str) -> str:
    base = re.sub(r"[^a-z0-9]+", "_", request.node.name.lower())[:40]
    return f"t{next(_counter)}_{tag}_{base}"


@pytest.fixture
def pg_db(pg_server, request):
    """Factory: ``pg_db("a")`` creates a fresh PostgreSQL database and returns its URL."""
    return lambda tag="db": pg_server.create_database(_db_name(request, tag))


@pytest.fixture
def maria_db(maria_server, request):
    """Factory: ``maria_db("a")`` creates a fresh MariaDB database and returns its URL."""
    return lambda tag="db": maria_server.create_database(_db_name(request, tag))


@pytest.fixture
def run_pair(tmp_path):
    """Factory: run_pair(pair, send, rate) -> (client, server) node processes, started (server first), the
    client sending orders 1..send; both killed when the test ends."""
    from qtp.testing.nodes import pair_processes

    started = []

    def start(pair, send: int, rate: float = 0.0, server_env: dict | None = None):
        client, server = pair_processes(pair, tmp_path, send, rate, server_env)
        started.extend([server, client])
        server.start()
        client.start()
        return client, server

    yield start
    for node in started:
        node.kill()


@pytest.fixture
def banks(request, tmp_path):
    """Factory of coupled-messaging nodes (tests/coupled_support.py ``make_banks``), closed when the test ends."""
    from coupled_support import make_banks

    made: list = []
    yield make_banks(request, tmp_path, made)
    for bank in made:
        bank.close()
