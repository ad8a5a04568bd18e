"""Stopping the tests' throw-away database servers at once.

``discard`` stops a server without the work a clean stop does for data about to be deleted (PostgreSQL's
checkpoint, MariaDB's buffer-pool flush) and deletes it. A PostgreSQL postmaster is nobody's child once
``pg_ctl`` has returned, and this machine's init reaps it 1.6-1.9 s after it exits; ``qtp.embedded`` counts an
exited, unreaped process as gone (it holds nothing by then), so the stop does not wait for init
(teardowns of 12-20 s in full runs of the suite before).
"""

from __future__ import annotations

from qtp.embedded import EmbeddedMariaDB, EmbeddedPostgres


def discard(server: EmbeddedPostgres | EmbeddedMariaDB) -> None:
    """Stop a throw-away server at once and delete it."""
    if isinstance(server, EmbeddedMariaDB):
        server.kill()  # (PostgreSQL's destroy is already an immediate shutdown)
    server.destroy()
