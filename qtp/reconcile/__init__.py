"""Spark reconciliation: prove that every message the client committed was applied exactly once.

``reconcile(client, server)`` reads a client table and a server table over JDBC (PostgreSQL, MySQL/MariaDB),
classifies every key as ok, lost, duplicated, unexpected, mismatched, applied-but-aborted or in-doubt, and
returns a ``ReconcileResult`` whose verdict is ``exactly-once`` only when no key is lost, duplicated,
unexpected, mismatched or applied-but-aborted. ``qtp reconcile`` and ``python -m qtp.reconcile`` (also
``spark-submit qtp/reconcile/__main__.py``) run the same job from the command line and write the reports.
"""

from qtp.reconcile._classify import CLASSES, VIOLATIONS
from qtp.reconcile._job import ReconcileError, ReconcileResult, reconcile, spark_session
from qtp.reconcile._sources import TableSpec

__all__ = [
    "CLASSES",
    "VIOLATIONS",
    "ReconcileError",
    "ReconcileResult",
    "TableSpec",
    "reconcile",
    "spark_session",
]
