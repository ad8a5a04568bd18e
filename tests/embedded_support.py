"""Stopping the tests' throw-away database servers without waiting on the machine's init.

A PostgreSQL postmaster is started by ``pg_ctl`` and is nobody's child once ``pg_ctl`` has returned: when
it exits, init reaps it. Until then it is a zombie (it holds nothing: its memory, sockets and files are
gone, and after an immediate shutdown its ``postmaster.pid`` too), yet ``kill(pid, 0)`` still finds it, so
a wait for the pid to vanish waits for init. Some inits reap on a timer: measured here (a firecracker VM
whose init is ``process_api``) 1.6-1.9 s per postmaster on a quiet machine, and teardowns of 12-20 s in
full runs of the suite. ``discard`` waits for the exit itself.
"""

from __future__ import annotations

import os
import signal
import time

from qtp.embedded import EmbeddedMariaDB, EmbeddedPostgres


def exited(pid: int) -> bool:
    """The process has exited: gone, or a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
    except OSError:  # no /proc: ask the kernel whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False


def wait_exited(pid: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not exited(pid) and time.monotonic() < deadline:
        time.sleep(0.02)


def discard(server: EmbeddedPostgres | EmbeddedMariaDB) -> None:
    """Stop a throw-away server at once (no checkpoint, no flush of data that is deleted next) and delete it."""
    if isinstance(server, EmbeddedPostgres):
        pid = server.postmaster_pid()
        if pid is not None:  # immediate shutdown; the postmaster removes its postmaster.pid as it exits
            os.kill(pid, signal.SIGQUIT)
            wait_exited(pid)
    else:
        server.kill()  # the test's own child: reaped by the wait in kill()
    server.destroy()
