"""The lowest versions qtp declares are versions it works with. A virtualenv holds exactly the lower bounds of
install_requires (SQLAlchemy, psycopg2-binary, PyMySQL, lxml, requests, tenacity, prometheus-client) and
requirements.lock's versions of everything else; the transaction-manager and messaging quick tests of this
checkout run there, against their own PostgreSQL and MariaDB.

The virtualenv is kept in ``.qtp/venv-lowest/`` and made again only when those versions (or Python) change.
"""

from __future__ import annotations

import fcntl
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging_support import ROOT, canonical, clean_env, declared, locked, lower_bound, make_venv, pip_install


# The resource contract on both drivers, the transaction manager's paths through them (ORM sessions, driver
# errors translated, lock waits interrupted, a connection broken during COMMIT), the README's messaging example
# (codec, HTTP, both stores) and /metrics, with their own PostgreSQL and MariaDB: 51 tests in about 21 s, where
# the whole of test_coordinator.py would take 35 s.
COORDINATOR = [f"tests/test_coordinator.py::test_{name}" for name in (
    "transfer_commits_on_both_databases", "exception_rolls_back_both_databases", "no_vote_rolls_back_every_branch",
    "orm_session_is_bound_to_the_branch", "temporary_tables_cannot_be_prepared",
    "timeout_interrupts_a_transaction_blocked_on_a_lock", "an_error_inside_the_commit_path_settles_the_transaction",
    "one_phase_commit_whose_connection_breaks_is_reported_unknown")]
QUICK = ["tests/test_xa_contract.py", *COORDINATOR, "tests/test_readme_messaging.py",
         "tests/test_packaging.py::test_metrics_serve_the_build_info"]


def lowest() -> dict[str, str]:
    """Core dependency -> its lower bound."""
    return {canonical(req.name): lower_bound(req) for req in declared()[""]}


def constraints() -> str:
    pins = {**locked(), **lowest()}
    lines = [f"# Python {sys.version.split()[0]}"] + [f"{name}=={version}" for name, version in sorted(pins.items())]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def lowest_python() -> Path:
    """The virtualenv, made under a lock: make test's xdist workers may both need it, each once."""
    venv = ROOT / ".qtp" / "venv-lowest"
    python, stamp, wanted = venv / "bin" / "python", venv / "installed.txt", constraints()
    venv.parent.mkdir(exist_ok=True)
    with open(venv.parent / "venv-lowest.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (python.exists() and stamp.is_file() and stamp.read_text() == wanted):
            shutil.rmtree(venv, ignore_errors=True)
            make_venv(venv)
            (venv / "constraints.txt").write_text(wanted)
            pip_install(python, "-c", str(venv / "constraints.txt"), *lowest(), "pytest")
            stamp.write_text(wanted)  # last: a virtualenv whose install failed is made again
    return python


VERSIONS = "import importlib.metadata as m, json, sys; print(json.dumps({n: m.version(n) for n in sys.argv[1:]}))"


def test_the_lowest_virtualenv_holds_the_lower_bounds(lowest_python):
    run = subprocess.run([str(lowest_python), "-c", VERSIONS, *lowest()], capture_output=True, text=True,
                         timeout=60, env=clean_env())
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout) == lowest()


def test_transaction_manager_and_messaging_quick_tests_pass_with_the_lowest_versions(lowest_python, tmp_path):
    run = subprocess.run([str(lowest_python), "-m", "pytest", "-p", "no:cacheprovider", "-q", "--basetemp",
                          str(tmp_path / "inner"), *QUICK], cwd=ROOT, capture_output=True, text=True, timeout=900,
                         env=clean_env(PYTHONPATH=str(ROOT)))
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    assert run.returncode == 0 and re.search(r"\d+ passed", summary), run.stdout[-5000:] + run.stderr[-2000:]
