"""The private servers start, accept connections, survive kill -9 with their data, and restart."""

import psycopg2
import pymysql
from sqlalchemy.engine import make_url


def _pg_connect(url):
    u = make_url(url)
    return psycopg2.connect(host=u.host, port=u.port, user=u.username, dbname=u.database)


def test_postgres_has_prepared_transactions_enabled(pg_server, pg_db):
    conn = _pg_connect(pg_db())
    with conn.cursor() as cur:
        cur.execute("SHOW max_prepared_transactions")
        assert int(cur.fetchone()[0]) >= 100
    conn.close()


def test_mariadb_is_at_least_10_5(maria_server, maria_db):
    u = make_url(maria_db())
    conn = pymysql.connect(host=u.host, port=u.port, user=u.username, database=u.database)
    with conn.cursor() as cur:
        cur.execute("SELECT VERSION()")
        major, minor = (int(x) for x in cur.fetchone()[0].split(".")[:2])
    conn.close()
    assert (major, minor) >= (10, 5)


def test_postgres_survives_kill_9_with_committed_data(pg_server, pg_db):
    url = pg_db()
    conn = _pg_connect(url)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("CREATE TABLE t (x int)")
        cur.execute("INSERT INTO t VALUES (42)")
    conn.close()
    pg_server.kill()
    assert not pg_server.running()
    pg_server.start()
    conn = _pg_connect(url)
    with conn.cursor() as cur:
        cur.execute("SELECT x FROM t")
        assert cur.fetchall() == [(42,)]
    conn.close()


def test_printed_urls_work_as_printed(pg_server, maria_server):
    """The default URLs (what `qtp db url` prints) name databases that exist after start()."""
    import sqlalchemy

    for url in (pg_server.info.url(), maria_server.info.url()):
        engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool)
        with engine.connect() as conn:
            assert conn.execute(sqlalchemy.text("SELECT 1")).scalar() == 1
        engine.dispose()


def test_qtp_db_start_right_after_a_sigkill_of_the_postmaster_starts_it_again(tmp_path):
    """An operator's (or a campaign's) SIGKILL of the postmaster alone, then `qtp db start` at once. The
    crashed postmaster is reaped by this machine's init only 1.6-1.9 s later, and its backends, socket lock
    and postmaster.pid outlive it for a moment: before, the start took the unreaped process for a running
    server, said so and started nothing (an outside tester's F3). Now it clears what the crash left and
    starts the server, with the committed row."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from qtp.embedded import EmbeddedPostgres

    root = tmp_path / "servers"
    pg = EmbeddedPostgres(root / "pg")
    url = pg.start().url("postgres")
    conn = _pg_connect(url)
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("CREATE TABLE t (x int)")
        cur.execute("INSERT INTO t VALUES (7)")  # a backend stays connected through the kill
    crashed = pg.postmaster_pid()
    try:
        os.kill(crashed, signal.SIGKILL)
        began = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "qtp", "db", "start", "--root", str(root), "--only", "postgres"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        assert pg.postmaster_pid() not in (None, crashed)
        fresh = _pg_connect(url)
        with fresh.cursor() as cur:
            cur.execute("SELECT x FROM t")
            assert cur.fetchall() == [(7,)]
        fresh.close()
        assert time.monotonic() - began < 60
    finally:
        conn.close()
        pg.destroy()


def test_free_ports_are_chosen_below_the_ephemeral_range_and_differ() -> None:
    """A port in the ephemeral range could be taken by any connection or port-0 server (a Spark JVM's took one
    from a node under test) between free_port() and the bind."""
    from qtp.embedded import LOWEST_PORT, _ephemeral_low, free_port

    ports = [free_port() for _ in range(50)]
    assert all(LOWEST_PORT <= port < _ephemeral_low() for port in ports)
    assert len(set(ports)) > 40
