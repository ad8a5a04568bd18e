"""``qtp coupled``: the compensation log of a node's coupled messaging (list, retry)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from qtp._render import age, table


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("coupled", help="coupled messaging: the compensation log (list, retry)")
    verbs = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    ls = verbs.add_parser("list", help="aborted coupled messages not yet undone by their recipient")
    ls.add_argument("--all", action="store_true", help="every coupled message this node sent")
    ls.add_argument("--json", action="store_true", help="print JSON for scripts")
    ls.add_argument("--config", default="qtp.toml", help="the node's qtp.toml (default ./qtp.toml)")
    ls.set_defaults(func=_list)
    rt = verbs.add_parser("retry", help="send the Abort (with its compensation) of aborted messages again")
    rt.add_argument("ids", nargs="*", metavar="ID", help="coupling ids (from `qtp coupled list`)")
    rt.add_argument("--all", action="store_true", help="every open entry of the compensation log")
    rt.add_argument("--config", default="qtp.toml", help="the node's qtp.toml (default ./qtp.toml)")
    rt.set_defaults(func=_retry)


def _config(args: argparse.Namespace) -> Any:
    from qtp.config import load_config

    return load_config(args.config)


def _list(args: argparse.Namespace) -> int:
    from qtp.coupled._status import entries

    found = entries(_config(args), everything=args.all)
    if args.json:
        print(json.dumps(found, indent=1, default=str))
        return 0
    if not found:
        print("no open compensation-log entries" if not args.all else "no coupled messages")
        return 0
    import time

    print(table(["id", "channel", "state", "recipient reported", "coupling", "updated"],
                [[e["id"], e["channel"], e["state"], e["recipient"], e["coupling"] or "?",
                  age(time.time() - e["updated_at"]) + " ago"] for e in found]))
    return 0


def _retry(args: argparse.Namespace) -> int:
    from qtp.coupled._status import retry
    from qtp.errors import ConfigurationError

    if not args.ids and not args.all:
        raise ConfigurationError("name the coupling ids to retry, or --all for every open entry")
    sent = retry(_config(args), None if args.all else args.ids)
    print(f"sent the Abort of {len(sent)} coupled message(s) again" + (": " + ", ".join(sent) if sent else ""))
    return 0
