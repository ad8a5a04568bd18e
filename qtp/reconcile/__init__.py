"""Spark reconciliation: prove that every message the client committed was applied exactly once.

``reconcile(client, server)`` reads a client table and a server table over JDBC (PostgreSQL, MySQL/MariaDB),
classifies every key as ok, lost, duplicated, unexpected, mismatched, applied-but-aborted or in-doubt, and
returns a ``ReconcileResult`` whose verdict is ``exactly-once`` only when no key is lost, duplicated,
unexpected, mismatched or applied-but-aborted. ``qtp reconcile`` and ``python -m qtp.reconcile`` (also
``spark-submit qtp/reconcile/__main__.py``) run the same job from the command line and write the reports.
"""

from __future__ import annotations

import importlib
from typing import Any

from qtp.errors import ConfigurationError

_EXPORTS = {
    "CLASSES": "qtp.reconcile._classify", "VIOLATIONS": "qtp.reconcile._classify",
    "ReconcileError": "qtp.errors", "ReconcileResult": "qtp.reconcile._job", "reconcile": "qtp.reconcile._job",
    "spark_session": "qtp.reconcile._job", "TableSpec": "qtp.reconcile._sources",
}
__all__ = sorted(_EXPORTS)


def require_spark() -> None:
    """PySpark is an optional part of qtp (the transaction manager and messaging do without it)."""
    try:
        import pyspark  # noqa: F401
    except ImportError as exc:
        raise ConfigurationError("qtp reconcile needs PySpark, an optional part of qtp: "
                                 "pip install 'qtp-queued[spark]'") from exc


def __getattr__(name: str) -> Any:
    """The job's names load on first use, so that ``qtp`` commands other than reconcile never import Spark."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'qtp.reconcile' has no attribute {name!r}")
    require_spark()
    return getattr(importlib.import_module(_EXPORTS[name]), name)
