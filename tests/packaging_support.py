"""Shared by the packaging tests: what setup.cfg declares, and virtualenvs made apart from the test's own.

A virtualenv is made without pip (``venv --without-pip``, no ensurepip: seconds saved) and filled by the
running interpreter's pip through ``pip --python``, from pip's own download cache.
"""

from __future__ import annotations

import configparser
import os
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
DISTRIBUTION = "qtp-queued"


def _setup_cfg() -> configparser.ConfigParser:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    return config


def _lines(value: str) -> list[str]:
    return [line.strip() for line in value.splitlines() if line.strip()]


def declared() -> dict[str, list[Requirement]]:
    """setup.cfg's requirements by extra ("" for install_requires)."""
    config = _setup_cfg()
    found = {"": [Requirement(line) for line in _lines(config["options"]["install_requires"])]}
    for extra, value in config["options.extras_require"].items():
        found[extra] = [Requirement(line) for line in _lines(value)]
    return found


def lower_bound(req: Requirement) -> str:
    """The version of ``req``'s ``>=`` clause: the lowest version qtp says it supports."""
    bounds = [spec.version for spec in req.specifier if spec.operator == ">="]
    assert len(bounds) == 1, f"{req} has no single lower bound"
    return bounds[0]


def locked() -> dict[str, str]:
    """requirements.lock: canonical distribution name -> the exact version ``make`` installs."""
    pins = {}
    for line in _lines((ROOT / "requirements.lock").read_text()):
        req = Requirement(line)
        pins[canonical(req.name)] = next(iter(req.specifier)).version
    return pins


def canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without anything that points Python at this checkout or the test's own virtualenv."""
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"}}
    return {**env, **extra}


def make_venv(path: Path) -> Path:
    """A new virtualenv at ``path`` without pip; returns its interpreter."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    return path / "bin" / "python"


def pip_install(python: Path, *args: str) -> None:
    """``pip install args`` into the virtualenv of ``python``; fails with pip's output."""
    run = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                          "--disable-pip-version-check", *args], capture_output=True, text=True, timeout=600,
                         env=clean_env())
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
