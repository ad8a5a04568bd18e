"""The distribution works outside the checkout: the wheel and sdist built by ``python -m build`` carry every
module, the schemas and ``py.typed``; the wheel, installed into a fresh virtualenv in a temporary directory
(core dependencies only, at requirements.lock's versions), runs ``qtp --version``, imports every public
module and runs the README's first ``with qtp.transaction()`` example against the test databases."""

from __future__ import annotations

import email
import fcntl
import json
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging_support import DISTRIBUTION, ROOT, clean_env, declared, make_venv, pip_install

import qtp
from qtp.testing.nodes import create, rows


DATA_FILES = {"qtp/py.typed", "qtp/coupled/coupled.xsd"}
# `qtp serve --app` modules: each builds its node when imported, from a config named by an environment variable
APPS = {"qtp.demo.shop", "qtp.testing.coupled_app", "qtp.testing.e2e_app"}


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> dict[str, Path]:
    """{"wheel": path, "sdist": path}, built from this checkout (the wheel from the sdist, as build does)."""
    out = tmp_path_factory.mktemp("dist")
    (ROOT / ".qtp").mkdir(exist_ok=True)
    with open(ROOT / ".qtp" / "dist.lock", "w") as lock:  # the sdist step writes qtp_queued.egg-info in ROOT:
        fcntl.flock(lock, fcntl.LOCK_EX)                   # one xdist worker at a time
        run = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)], capture_output=True,
                             text=True, timeout=600, env=clean_env())
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return {"wheel": next(out.glob("*.whl")), "sdist": next(out.glob("*.tar.gz"))}


@pytest.fixture(scope="module")
def venv(dist, tmp_path_factory) -> Path:
    """The bin/ directory of a fresh virtualenv holding the wheel and its core dependencies."""
    python = make_venv(tmp_path_factory.mktemp("fresh") / "venv")
    pip_install(python, str(dist["wheel"]), "-c", str(ROOT / "requirements.lock"))
    return python.parent


def _run(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300, env=clean_env())


def test_the_wheel_and_sdist_carry_every_module_the_schemas_and_py_typed(dist):
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "qtp").rglob("*.py")}
    wheel = zipfile.ZipFile(dist["wheel"])
    names = set(wheel.namelist())
    assert {n for n in names if n.startswith("qtp/")} == modules | DATA_FILES
    meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
    meta = email.message_from_bytes(wheel.read(meta_name))
    assert (meta["Name"], meta["Version"]) == (DISTRIBUTION, qtp.__version__)
    want = {str(req) for extra, reqs in declared().items() for req in reqs if not extra}
    assert {str(Requirement(r)) for r in meta.get_all("Requires-Dist") if "extra ==" not in r} == want
    prefix = f"{dist['sdist'].name.removesuffix('.tar.gz')}/"
    with tarfile.open(dist["sdist"]) as sdist:
        in_sdist = {n.removeprefix(prefix) for n in sdist.getnames()}
    assert modules | DATA_FILES | {"setup.cfg", "pyproject.toml", "README.md", "CHANGELOG.md"} <= in_sdist


def test_qtp_version_in_the_fresh_virtualenv(venv, tmp_path):
    run = _run([str(venv / "qtp"), "--version"], tmp_path)
    assert (run.returncode, run.stdout) == (0, f"qtp {qtp.__version__}\n"), run.stderr


IMPORT_ALL = """
import importlib, json, pkgutil, sys
import qtp
public = [m.name for m in pkgutil.walk_packages(qtp.__path__, "qtp.")
          if not any(part.startswith("_") for part in m.name.split("."))]
apps = set(json.loads(sys.argv[1]))
for name in public:
    if name not in apps:
        importlib.import_module(name)
print(json.dumps({"file": qtp.__file__, "public": public, "spark": importlib.util.find_spec("pyspark") is not None}))
"""


def test_every_public_module_imports_from_the_fresh_virtualenv(venv, tmp_path):
    """From site-packages, without the extras (no PySpark): the core needs nothing more."""
    run = _run([str(venv / "python"), "-c", IMPORT_ALL, json.dumps(sorted(APPS))], tmp_path)
    assert run.returncode == 0, run.stderr
    found = json.loads(run.stdout)
    assert Path(found["file"]).is_relative_to(venv.parent / "lib") and not found["spark"]
    in_checkout = {p.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".").removesuffix(".__init__")
                   for p in (ROOT / "qtp").rglob("*.py")}
    public = {name for name in in_checkout if not re.search(r"\._", name)} - {"qtp"}
    assert set(found["public"]) == public
    assert APPS <= set(found["public"])


ORM = '''
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class Entry(Base):  # the README's ledger entry, an ORM class of the application
    __tablename__ = "entries"
    id: Mapped[int] = mapped_column(primary_key=True)
    account: Mapped[int]
    amount: Mapped[int]
'''


def _first_transaction_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    return next(block for block in blocks if "with qtp.transaction()" in block)


def test_the_readmes_first_transaction_example_runs_from_the_fresh_virtualenv(venv, pg_db, maria_db, tmp_path):
    app, ledger = pg_db("app"), maria_db("ledger")
    create(app, "CREATE TABLE accounts (id int PRIMARY KEY, balance int NOT NULL)")
    create(app, "INSERT INTO accounts VALUES (1, 100)")
    create(ledger, "CREATE TABLE entries (id int AUTO_INCREMENT PRIMARY KEY, account int NOT NULL, "
                   "amount int NOT NULL)")
    example = _first_transaction_example()
    urls = {"postgresql://app@db1/app": app, "mysql+pymysql://qtp@db2/ledger": ledger}
    assert all(old in example for old in urls)
    for old, new in urls.items():
        example = example.replace(old, new)
    script = tmp_path / "example.py"
    script.write_text(ORM + example + "tm.close()\n")
    run = _run([str(venv / "python"), str(script)], tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[-1] == "committed", run.stdout
    assert rows(app, "SELECT balance FROM accounts") == [(90,)]
    assert rows(ledger, "SELECT account, amount FROM entries") == [(7, 10)]
    assert (tmp_path / "recovery_logs" / "orders-1").is_dir()
