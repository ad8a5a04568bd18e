"""Processes started as ``python -m <module> <args>`` without paying for the interpreter and qtp's imports each time.

The zygote is a real interpreter, started once per test session (``shared()``), that imports qtp and then
forks one process per ``run()``: each run is a fresh process with its own environment, failpoints
(``QTP_FAILPOINTS`` configured in the fork, as the module would read it at import), connections, random state
and exit status, and a SIGKILL (a failpoint's ``crash``) ends only it. The zygote itself opens no connection
and starts no thread, so a fork inherits nothing but imported modules. Its protocol: one JSON request per
line on its input, one JSON answer (``{"code": exit status}``) per line on its output.

``spawn()`` starts a long-running one (a node, ``qtp serve``: ``tests/conftest.py`` makes every
``NodeProcess`` of the session one) and answers at once with its pid (``{"pid": ...}``); the zygote reaps it
when it ends and leaves its exit status in a file for the ``Forked`` handle.
"""

from __future__ import annotations

import atexit
import json
import os
import random
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

PRELOAD = ("qtp", "qtp.cli", "qtp.testing.crash_child", "qtp.testing.crash_workload", "psycopg2", "pymysql",
           "sqlalchemy.dialects.postgresql.psycopg2", "sqlalchemy.dialects.mysql.pymysql")


@dataclass
class Run:
    """What ``subprocess.run(..., capture_output=True, text=True)`` would have returned."""

    returncode: int
    stdout: str
    stderr: str


class Zygote:
    """The client side: ``run(module, *args, env={...}, timeout=120) -> Run``, one run at a time (callers from
    several threads wait their turn); ``close()`` ends the zygote."""

    def __init__(self) -> None:
        env = {k: v for k, v in os.environ.items() if k != "QTP_FAILPOINTS"}
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, text=True, bufsize=1)
        self.folder = Path(tempfile.mkdtemp(prefix="qtp-zygote-"))
        self._turn = threading.Lock()

    def run(self, module: str, *args: str, env: dict[str, str] | None = None, timeout: float = 120.0) -> Run:
        """Run ``python -m module args`` as a fork of the zygote, with ``env`` (the test's environment
        without ``QTP_FAILPOINTS`` when not given) and a SIGKILL after ``timeout`` seconds."""
        out, err = self.folder / "out", self.folder / "err"
        base = {k: v for k, v in os.environ.items() if k != "QTP_FAILPOINTS"}
        request = {"module": module, "argv": list(args), "env": base if env is None else env,
                   "out": str(out), "err": str(err), "timeout": timeout}
        with self._turn:
            code = self._ask(request)["code"]
            return Run(code, out.read_text(errors="replace"), err.read_text(errors="replace"))

    def spawn(self, module: str, args: list[str], env: dict[str, str], log: Path) -> "Forked":
        """Start ``python -m module args`` as a fork of the zygote, in a session of its own, its output appended
        to ``log``, and return at once (a ``Forked``)."""
        request = {"spawn": True, "module": module, "argv": list(args), "env": env, "out": str(log),
                   "err": str(log), "status": str(self.folder)}
        with self._turn:  # (the pidfd is opened before the zygote may reap the process: see _reap)
            pid = self._ask(request)["pid"]
            return Forked(pid, os.pidfd_open(pid), self.folder / f"exit-{pid}")

    def _ask(self, request: dict) -> dict:
        """Send one request and read its answer (the caller holds ``_turn``)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        answer = self.proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"the zygote ended (exit {self.proc.poll()})")
        return json.loads(answer)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(30)
        for path in self.folder.iterdir():  # out, err, and the exit statuses nobody read
            path.unlink(missing_ok=True)
        self.folder.rmdir()


class Forked:
    """What ``subprocess.Popen`` gives ``NodeProcess`` (``pid``, ``returncode``, ``poll``, ``wait``,
    ``send_signal``, ``kill``) for a process the zygote forked. Its end is seen through a pidfd (readable
    once it exits; opened before the zygote may reap it, so the pid cannot be another process's); its exit
    status is the file the zygote writes when it reaps it (-1 until then)."""

    def __init__(self, pid: int, pidfd: int, status: Path):
        self.pid, self._pidfd, self._status = pid, pidfd, status
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._pidfd], [], [], 0)[0]:
            os.close(self._pidfd)
            self.returncode = -1
        if self.returncode == -1:
            try:
                self.returncode = int(self._status.read_text())
                self._status.unlink()
            except (OSError, ValueError):
                pass
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            select.select([self._pidfd], [], [], 0.05)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_shared: list[Zygote] = []


def shared() -> Zygote:
    """The test session's zygote, started at the first call and closed when the session's interpreter exits."""
    if not _shared:
        _shared.append(Zygote())
        atexit.register(_shared[0].close)
    return _shared[0]


def qtp_command(*args: object, env: dict[str, str] | None = None, timeout: float = 120.0) -> Run:
    """``python -m qtp args`` (``qtp_command("status", "--json", "--config", path)``), a fork of the shared zygote."""
    return shared().run("qtp", *map(str, args), env=env, timeout=timeout)


# ------------------------------------------------------------------------------------------ the zygote side

def _child(request: dict) -> None:
    """In the fork: become ``python -m module argv`` with the request's environment; never returns. A spawned
    one has a session of its own and appends to its log (``out`` and ``err`` are the same file)."""
    code = 1
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        if request.get("spawn"):
            os.setsid()
            out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            os.dup2(out, 1)
            os.dup2(out, 2)
        else:
            for fd, path in ((1, request["out"]), (2, request["err"])):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
        os.environ.clear()
        os.environ.update(request["env"])
        random.seed()
        from qtp.coordinator import failpoints

        failpoints.configure(os.environ.get("QTP_FAILPOINTS") or "")
        sys.argv = [request["module"], *request["argv"]]
        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported as the interpreter would, on stderr with exit 1
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - exiting anyway
                pass
        os._exit(code)


def _wait(pid: int, timeout: float) -> int:
    """The exit status of ``pid``; SIGKILLed after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        select.select([], [], [], 0.005)


def serve() -> None:
    for module in PRELOAD:
        __import__(module)
    sys.modules["qtp.cli"].build_parser()  # imports every command's module
    spawned: dict[int, tuple[float, Path]] = {}  # pid -> (when, where its exit status goes)
    while True:
        ready = select.select([sys.stdin], [], [], 0.2)[0]
        _reap(spawned)
        if not ready:
            continue
        line = sys.stdin.readline()
        if not line:
            break
        request = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _child(request)
        if request.get("spawn"):
            spawned[pid] = (time.monotonic(), Path(request["status"]) / f"exit-{pid}")
            print(json.dumps({"pid": pid}), flush=True)
        else:
            print(json.dumps({"code": _wait(pid, request["timeout"])}), flush=True)


def _reap(spawned: dict[int, tuple[float, Path]]) -> None:
    """Wait for the spawned processes that ended, writing each one's exit status where its ``Forked`` reads
    it. Not in their first second: the client opens its pidfd before the pid can be freed."""
    now = time.monotonic()
    for pid, (born, status) in list(spawned.items()):
        if now - born < 1.0:
            continue
        done, code = os.waitpid(pid, os.WNOHANG)
        if done:
            status.write_text(str(os.waitstatus_to_exitcode(code)))
            del spawned[pid]


if __name__ == "__main__":
    serve()
