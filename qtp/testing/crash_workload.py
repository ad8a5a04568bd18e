"""The crash tests' workload: money transfers between two databases, and the checks run after each crash.

Each database holds ``accounts(id, balance)`` and ``ledger(tid, amount)``. A transfer moves ``amount``
from an account of database A to one of database B and writes the same ``tid`` into both ledgers, in one
global transaction. After any crash and recovery:

- the money is conserved: sum(A.balance) + sum(B.balance) is the initial total;
- each database is consistent with its own ledger (A lost exactly what its ledger says, B gained it);
- the two ledgers hold the same tids (no transfer is half-applied);
- every transfer whose commit returned is in both ledgers (nothing acknowledged is lost);
- no branch of the node is still prepared, and updating every row succeeds at once (no lock left behind).

Checks use fresh connections (NullPool) so that waiting for the dead process's database sessions to end
(``drain``) sees only those sessions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import sqlalchemy
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from qtp.xa import FORMAT_ID, normalize_url

ACCOUNTS = 8
INITIAL = 1_000_000


def engine(url: str) -> sqlalchemy.Engine:
    options = {"connect_args": {"autocommit": False}} if _family(url) == "mysql" else {}
    return sqlalchemy.create_engine(normalize_url(url), poolclass=NullPool, **options)


def _family(url: str) -> str:
    return "postgresql" if make_url(url).get_backend_name() == "postgresql" else "mysql"


def setup_database(url: str) -> None:
    """(Re)create the tables, outside any qtp transaction (MariaDB allows no DDL inside XA)."""
    eng = engine(url)
    with eng.begin() as conn:
        conn.execute(text("DROP TABLE IF EXISTS accounts"))
        conn.execute(text("DROP TABLE IF EXISTS ledger"))
        conn.execute(text("CREATE TABLE accounts (id INT PRIMARY KEY, balance BIGINT NOT NULL)"))
        conn.execute(text("CREATE TABLE ledger (tid VARCHAR(40) PRIMARY KEY, amount BIGINT NOT NULL)"))
        conn.execute(text("INSERT INTO accounts VALUES (:id, :b)"),
                     [{"id": i, "b": INITIAL} for i in range(ACCOUNTS)])
    eng.dispose()


def write_config(path: Path, node_id: str, log_dir: Path, url_a: str, url_b: str, interval: float = 0,
                 llr: bool = False) -> Path:
    """The node's qtp.toml; ``llr`` turns Logging Last Resource on (the file decision log otherwise)."""
    path.write_text(
        f'[node]\nid = "{node_id}"\nlog_dir = "{log_dir}"\ntimeout = 30\nllr = {str(llr).lower()}\n\n'
        f'[resources.a]\nurl = "{url_a}"\n\n[resources.b]\nurl = "{url_b}"\n\n'
        f"[recovery]\ninterval = {interval}\n"
    )
    return path


def transfer(manager, tid: str, account: int, amount: int) -> None:
    """One global transaction over resources ``a`` and ``b``."""
    with manager.transaction() as tx:
        a, b = tx.connection("a"), tx.connection("b")
        a.execute(text("UPDATE accounts SET balance = balance - :x WHERE id = :k"), {"x": amount, "k": account})
        a.execute(text("INSERT INTO ledger VALUES (:t, :x)"), {"t": tid, "x": amount})
        b.execute(text("UPDATE accounts SET balance = balance + :x WHERE id = :k"), {"x": amount, "k": account})
        b.execute(text("INSERT INTO ledger VALUES (:t, :x)"), {"t": tid, "x": amount})


# ---------------------------------------------------------------------------------------------- checks


@dataclass
class Check:
    """The state of a pair after recovery; ``violations`` is empty when every property holds."""

    total: int = 0
    ledger_a: set[str] = field(default_factory=set)
    ledger_b: set[str] = field(default_factory=set)
    prepared: list[str] = field(default_factory=list)  # this node's (or any, on PostgreSQL's database) branches
    update_s: float = 0.0
    violations: list[str] = field(default_factory=list)

    def committed(self, tid: str) -> bool:
        return tid in self.ledger_a and tid in self.ledger_b


def drain(url: str, timeout: float = 20.0) -> None:
    """Wait until no other session is connected to ``url``'s database (a killed client's server-side
    session may still be finishing its last statement, e.g. a PREPARE being flushed)."""
    eng = engine(url)
    database = make_url(url).database
    if _family(url) == "postgresql":
        query = ("SELECT count(*) FROM pg_stat_activity WHERE datname = :d AND pid <> pg_backend_pid() "
                 "AND backend_type = 'client backend'")
    else:
        query = "SELECT count(*) FROM information_schema.PROCESSLIST WHERE DB = :d AND ID <> CONNECTION_ID()"
    deadline = time.monotonic() + timeout
    try:
        with eng.connect() as conn:
            while conn.execute(text(query), {"d": database}).scalar() and time.monotonic() < deadline:
                conn.rollback()
                time.sleep(0.01)
            conn.rollback()
    finally:
        eng.dispose()


def check_pair(url_a: str, url_b: str, node_id: str, done: set[str] = frozenset(),
               started: set[str] | None = None, update: bool = True) -> Check:
    """Measure the properties listed in the module docstring (``update=False``: skip the row update,
    which waits for the locks of branches that are known to be still prepared)."""
    result = Check()
    balances = {}
    amounts = {}
    for name, url in (("a", url_a), ("b", url_b)):
        eng = engine(url)
        try:
            with eng.connect() as conn:
                balances[name] = int(conn.execute(text("SELECT COALESCE(SUM(balance), 0) FROM accounts")).scalar())
                rows = conn.execute(text("SELECT tid, amount FROM ledger")).all()
                amounts[name] = sum(int(r[1]) for r in rows)
                setattr(result, f"ledger_{name}", {r[0] for r in rows})
                result.prepared += [x for x in prepared_branches(conn, url, node_id) if x not in result.prepared]
                conn.rollback()
            try:
                if update:
                    result.update_s = max(result.update_s, _update_all(eng, url))
            except sqlalchemy.exc.DBAPIError as exc:
                result.violations.append(f"updating every row of {name} failed (a lock left behind?): {exc.orig}")
        finally:
            eng.dispose()
    result.total = balances["a"] + balances["b"]
    v = result.violations
    if result.total != 2 * ACCOUNTS * INITIAL:
        v.append(f"money not conserved: total {result.total} != {2 * ACCOUNTS * INITIAL}")
    if balances["a"] != ACCOUNTS * INITIAL - amounts["a"] or balances["b"] != ACCOUNTS * INITIAL + amounts["b"]:
        v.append("a database disagrees with its own ledger")
    if result.ledger_a != result.ledger_b:
        half = sorted(result.ledger_a ^ result.ledger_b)
        v.append(f"{len(half)} transfer(s) half-applied: {half[:3]}")
    lost = sorted(t for t in done if not result.committed(t))
    if lost:
        v.append(f"{len(lost)} acknowledged transfer(s) lost: {lost[:3]}")
    if started is not None:
        unknown = sorted(result.ledger_a - started)
        if unknown:
            v.append(f"{len(unknown)} ledger row(s) of transfers never started: {unknown[:3]}")
    if result.prepared:
        v.append(f"{len(result.prepared)} branch(es) still prepared: {result.prepared[:3]}")
    return result


def prepared_branches(conn, url: str, node_id: str | None) -> list[str]:
    """Prepared branches: on PostgreSQL every one in this database; on MariaDB (server-wide) this node's, or
    every one when ``node_id`` is None."""
    if _family(url) == "postgresql":
        return [r[0] for r in conn.execute(text(
            "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()")).all()]
    rows = conn.execute(text("XA RECOVER")).all()
    prefix = f"{node_id}/".encode() if node_id else b""
    out = []
    for fmt, glen, _blen, data in rows:
        data = data if isinstance(data, bytes) else str(data).encode()
        if node_id is None or (int(fmt) == FORMAT_ID and data[:glen].startswith(prefix)):
            out.append(f"{data[:glen].decode(errors='replace')}#{data[glen:].decode(errors='replace')}")
    return out


def _update_all(eng: sqlalchemy.Engine, url: str) -> float:
    """Update every row with a 2 s lock timeout; a lock left behind by a prepared branch makes it fail."""
    started = time.monotonic()
    with eng.connect() as conn:
        if _family(url) == "postgresql":
            conn.execute(text("SET lock_timeout = '2s'"))
        else:
            conn.execute(text("SET SESSION innodb_lock_wait_timeout = 2"))
        conn.execute(text("UPDATE accounts SET balance = balance"))
        conn.execute(text("UPDATE ledger SET amount = amount"))
        conn.commit()
    return time.monotonic() - started
