"""The ``qtp`` command. Each subcommand lives in its own module, which exposes ``register(subparsers)``.

Subcommands set ``func(args) -> int`` (the exit code). ``qtp --version`` prints the version of
``qtp/_version.py`` and exits 0. qtp errors are printed as one line naming the cause
and the fix, with exit code 2; ``--traceback`` shows the whole stack instead.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from qtp._version import __version__
from qtp.errors import QtpError

# One line per subcommand module; a module registers one or more subcommands.
COMMAND_MODULES = [
    "qtp.coupled.cli",
    "qtp.db_cli",
    "qtp.reconcile.cli",
    "qtp.recovery.cli",
    "qtp.status_cli",
    "qtp.wsrm.runtime.cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qtp", description="qtp: queued transaction processing")
    parser.add_argument("--traceback", action="store_true", help="show the full stack on errors")
    parser.add_argument("--version", action="version", version=f"qtp {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except QtpError as exc:
        if args.traceback:
            raise
        print(f"qtp {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
