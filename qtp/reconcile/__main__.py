"""``python -m qtp.reconcile ...`` and ``spark-submit qtp/reconcile/__main__.py ...`` (same options as
``qtp reconcile``). Under spark-submit, the master, ``--jars`` and ``--conf`` of spark-submit apply."""

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file by spark-submit: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from qtp.reconcile.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
