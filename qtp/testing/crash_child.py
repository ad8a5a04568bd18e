"""The process that crashes: runs transfers under a TransactionManager until a failpoint or a SIGKILL ends it.

Run as ``python -m qtp.testing.crash_child --config qtp.toml [--transfers N] [--wait-go]`` (failpoints
from ``QTP_FAILPOINTS``), or forked by the campaign driver (``child_main``). It speaks one line at a time on
its output: ``READY <json>`` once the manager has started (the JSON is the start-up recovery's report),
then ``T <tid>`` before each transfer, ``D <tid>`` once its commit returned, ``F <tid> <error>`` when it
failed. With ``--wait-go`` it waits for ``go`` on its input before transferring (``recover`` runs another
recovery pass and answers ``READY`` again; ``exit`` stops it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import uuid

from qtp.coordinator import TransactionManager, failpoints
from qtp.testing.crash_workload import ACCOUNTS, transfer


def _emit(fd: int, line: str) -> None:
    os.write(fd, (line + "\n").encode())


def _report_json(report) -> str:
    if report is None:
        return json.dumps({"ok": False, "error": "start-up recovery did not run"})
    return json.dumps({"ok": report.ok, "committed": report.committed, "rolled_back": report.rolled_back,
                       "ended": len(report.ended), "reasons": report.reasons(),
                       "duration_s": report.duration_s})


def _readline(fd: int) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 1)
        if not chunk:
            return ""
        data += chunk
    return data.decode().strip()


def child_main(config: str, out_fd: int, in_fd: int | None, transfers: int | None, seed: int,
               spec: str | None = None) -> int:
    """Start a manager (recovering at start), report, then transfer until ``transfers`` or death."""
    if spec is not None:
        failpoints.configure(spec)
    manager = TransactionManager.from_config(config)
    if manager.node is not None:
        manager.node.start()
    report = getattr(manager._recovery, "last_report", None)
    _emit(out_fd, "READY " + _report_json(report))
    while in_fd is not None:
        command = _readline(in_fd)
        if command == "recover":
            _emit(out_fd, "READY " + _report_json(manager.recover()))
        elif command == "go":
            break
        else:
            manager.close()
            return 0
    rng = random.Random(seed)
    count = 0
    while transfers is None or count < transfers:
        tid = uuid.uuid4().hex
        _emit(out_fd, f"T {tid}")
        try:
            transfer(manager, tid, rng.randrange(ACCOUNTS), rng.randint(1, 100))
            _emit(out_fd, f"D {tid}")
        except Exception as exc:  # reported to the driver, which decides whether that is expected
            _emit(out_fd, f"F {tid} {type(exc).__name__}: {str(exc)[:300]!r}")
        count += 1
    manager.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qtp.testing.crash_child")
    parser.add_argument("--config", required=True)
    parser.add_argument("--transfers", type=int, default=None, help="stop after N transfers (default: never)")
    parser.add_argument("--wait-go", action="store_true", help="wait for 'go' on stdin before transferring")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    return child_main(args.config, sys.stdout.fileno(), sys.stdin.fileno() if args.wait_go else None,
                      args.transfers, args.seed)


if __name__ == "__main__":
    sys.exit(main())
