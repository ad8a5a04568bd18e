"""``python -m qtp.wsrm.protocol.diagrams [directory]``: regenerate the WS-RM state diagrams (default docs/wsrm)."""

from __future__ import annotations

import sys
from pathlib import Path

from qtp.wsrm.protocol._diagrams import render_all, write_all

__all__ = ["render_all", "write_all", "main"]


def main(argv: list[str]) -> int:
    directory = Path(argv[1]) if len(argv) > 1 else Path("docs/wsrm")
    for path in write_all(directory):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
