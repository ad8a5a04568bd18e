"""``qtp serve`` (run a node) and ``qtp dead-letters list|retry|drop`` (``qtp status`` shows sequences too).

``qtp serve --config server.toml`` runs the node the file describes: transaction recovery, the stores, the
sender, the invoker and the HTTP endpoint (``qtp.wsrm.runtime._http``), until SIGTERM or Ctrl-C. The
application's handlers are registered by the module named with ``--app module:attribute`` (imported first;
the attribute is the ``qtp.Node`` it built), e.g. ``qtp serve --app shop.server:node``.

Why qtp's own HTTP server (connections on an asyncio event loop, complete requests to a thread pool running
the endpoint's WSGI application): a node must be one process (its decision log is locked by one transaction
manager, and the runtime keeps its sequences' machines in memory), which rules out gunicorn's pre-fork
workers, and it must keep answering whatever a client does with its sockets. waitress, used first, has no
TLS, and its fixed connection limit let idle sockets lock out peers. cheroot, used next, ran the TLS
handshake in its accepting thread (one silent socket stalled every new connection for 30 s) and gave a
worker thread to any request whose head had begun (24 slow or 110 half-sent requests left /health
unanswered), with no per-address limit. The standard library's asyncio does TLS handshakes without
blocking and with a timeout, and lets every deadline be one ``asyncio.timeout``; the HTTP/1.1 it needs
(``Content-Length`` bodies, keep-alive) is a hundred lines, so no new dependency. ASGI servers (uvicorn,
hypercorn) would need the endpoint rewritten or wrapped, and bring their own.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import io
import json
import signal
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import sqlalchemy

from qtp._failures import first_line
from qtp._render import table
from qtp.config import load_config, slot_configs
from qtp.coordinator import install
from qtp.errors import ConfigurationError
from qtp.wsrm.runtime._http import single_malloc_arena
from qtp.wsrm.runtime._invoker import REDELIVERY
from qtp.wsrm.runtime._node import Node
from qtp.wsrm.runtime._status import stores


LEASE_LOST_EXIT = 75  # EX_TEMPFAIL: `qtp serve` lost its node's lease to another process ([lease])
UNAVAILABLE_EXIT = 69  # EX_UNAVAILABLE: a database of the node could not be reached while starting


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run a node: recovery, HTTP endpoint, sender and invoker")
    p.add_argument("--config", default=None, help="the node's qtp.toml (default ./qtp.toml)")
    p.add_argument("--app", default=None, metavar="MODULE:ATTR",
                   help="import MODULE, which registers the handlers on the qtp.Node it names ATTR")
    p.set_defaults(func=run_serve)
    d = sub.add_parser("dead-letters", help="list, retry or drop messages whose handler kept failing")
    d.add_argument("action", choices=["list", "retry", "drop"])
    d.add_argument("ids", nargs="*", type=int, help="dead letter ids (retry/drop); none: every one")
    d.add_argument("--config", default="qtp.toml", help="the node's qtp.toml (default ./qtp.toml)")
    d.add_argument("--json", action="store_true", help="print JSON (list)")
    d.add_argument("--slot", type=int, default=None,
                   help="with [lease] slots: the slot whose dead letters (each slot keeps its own; list: every slot)")
    d.set_defaults(func=run_dead_letters)


# ---------------------------------------------------------------------------------------------- serve


def run_serve(args: argparse.Namespace) -> int:
    single_malloc_arena()  # before any thread: see its docstring
    # A standby waits for its node's lease inside from_config (or the application's import of it): SIGTERM
    # there ends the wait as an exception, so that it is marked gone rather than killed where it stands.
    signal.signal(signal.SIGTERM, _exit_now)
    try:
        node = _load_app(args.app) if args.app else Node.from_config(args.config or "qtp.toml")
        node.start()  # after the application registered its handlers
    except (sqlalchemy.exc.OperationalError, sqlalchemy.exc.InterfaceError) as exc:
        if _refused_login(exc):  # the configuration's fault: starting again would not help
            print(f"qtp serve: a database of the node refused the connection's login or database name, not "
                  f"started ({first_line(exc)}); fix the resource's URL", file=sys.stderr, flush=True)
            return 2
        # a database out of reach at the start: one line, and the status a supervisor restarts on
        print(f"qtp serve: a database of the node is out of reach, not started ({first_line(exc)}); exiting "
              f"with status {UNAVAILABLE_EXIT}", file=sys.stderr, flush=True)
        return UNAVAILABLE_EXIT
    install(node.manager)
    # what the start made (modules, configuration, pools: ~80,000 objects) stays for the life of the process:
    # out of the collector's sight, a full collection (the HTTP server's after bursts of closed connections,
    # Python's own) costs ~1.5 ms of CPU instead of ~30 ms (measured in a node holding two slots)
    gc.collect()
    gc.freeze()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    polls = any(c.reply or c.acks_to == "poll" for c in node.channels.values())
    where = node.endpoint or (f"no endpoint, polls for replies as {node.mc_address}" if polls
                              else "no endpoint: sending only")
    print(f"qtp serve: node {node.manager.node_id} at {where}; "
          f"channels {', '.join(sorted(node.channels)) or 'none'}; handlers {len(node.handlers)}", flush=True)
    lease = node.manager.lease
    while not stop.wait(0.2):
        fatal = getattr(node, "fatal", None)  # a replica sharing the work in slots that cannot work
        if fatal is not None:
            print(f"qtp serve: node {node.manager.node_id}: {fatal}", file=sys.stderr, flush=True)
            node.close()
            return 2
        if lease is not None and lease.lost.is_set():
            # another process owns the node now: stop at once (nothing here commits any more; the manager's
            # close stops the node first), and say so with status 75 (EX_TEMPFAIL), so that a supervisor
            # starts this process again, as a standby
            node.manager.close(drain_s=1.0)
            print(f"qtp serve: node {node.manager.node_id}: this process lost the node's lease "
                  f"({lease.lost_reason}); exiting with status {LEASE_LOST_EXIT}", file=sys.stderr, flush=True)
            return LEASE_LOST_EXIT
    node.close()
    return 0


_LOGIN_REFUSED_MYSQL = {1044, 1045, 1049, 1698}  # access denied (database, user), unknown database
_LOGIN_REFUSED_PG = ("password authentication failed", "does not exist", "no pg_hba.conf entry")


def _refused_login(exc: BaseException) -> bool:
    """Whether a database answered but refused the login or the database name (a configuration error), as
    opposed to being out of reach."""
    orig = getattr(exc, "orig", None)
    args = getattr(orig, "args", ())
    if args and isinstance(args[0], int):
        return args[0] in _LOGIN_REFUSED_MYSQL
    return any(text in str(orig) for text in _LOGIN_REFUSED_PG)


def _exit_now(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def _load_app(spec: str) -> Any:
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ConfigurationError(f"--app takes MODULE:ATTRIBUTE (e.g. shop.server:node), got {spec!r}")
    sys.path.insert(0, str(Path.cwd()))
    module = importlib.import_module(module_name)
    node = getattr(module, attribute, None)
    node = getattr(node, "node", None) if node is not None and not hasattr(node, "handlers") else node
    if node is None or not hasattr(node, "handlers"):
        raise ConfigurationError(f"{spec}: {module_name}.{attribute} is not a qtp.Node")
    return node


# ---------------------------------------------------------------------------------------------- dead letters


def run_dead_letters(args: argparse.Namespace) -> int:
    slots = slot_configs(load_config(args.config))
    if args.slot is None and len(slots) > 1:
        if args.action != "list":
            raise ConfigurationError(f"the node shares its work in {len(slots)} slots, each with its own dead letters: "
                                     f"say which: qtp dead-letters --slot K {args.action} [ID ...] (`qtp dead-letters list` "
                                     "shows every slot's)")
        every = []
        for k in range(len(slots)):
            if args.json:  # one JSON list for scripts, each letter naming its slot
                with contextlib.redirect_stdout(io.StringIO()) as out:
                    _dead_letters(slots[k], args)
                every += [dict(letter, slot=k) for letter in json.loads(out.getvalue())]
            else:
                print(f"slot {k}:")
                _dead_letters(slots[k], args)
        if args.json:
            print(json.dumps(every, indent=2))
        return 0
    slot = args.slot or 0
    if not 0 <= slot < len(slots):
        raise ConfigurationError(f"--slot {slot}: the node has {len(slots)} slot(s) (0 to {len(slots) - 1})")
    return _dead_letters(slots[slot], args)


def _dead_letters(config: Any, args: argparse.Namespace) -> int:
    opened = stores(config)
    if not opened:
        raise ConfigurationError(f"{args.config}: no SQL store ([node] store or [channels.*] store)")
    name, store, engine = opened[0]
    try:
        with store.local() as s:
            letters = store.dead_letters(s)
            chosen = [x for x in letters if not args.ids or x.id in args.ids]
            missing = set(args.ids) - {x.id for x in letters}
            if missing:
                raise ConfigurationError(f"no dead letter with id {sorted(missing)} in store {name!r}")
            if args.action == "list":
                _print_letters(chosen, args.json)
                return 0
            for letter in chosen:
                store.take_dead_letter(s, letter.id)
                if args.action == "retry":
                    store.store_incoming(s, replace(letter.message, identifier=REDELIVERY, number=letter.id,
                                                    attempts=0, not_before=0.0, last_error=None))
    finally:
        engine.dispose()
    verb = "queued again for its handler" if args.action == "retry" else "dropped"
    print(f"{len(chosen)} dead letter(s) {verb}")
    return 0


def _print_letters(letters: list[Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps([{"id": x.id, "peer": x.peer, "sequence": x.message.identifier,
                           "number": x.message.number,
                           "message_id": x.message.message_id, "action": x.message.action,
                           "attempts": x.message.attempts, "error": x.error, "failed_at": x.failed_at,
                           "payload": (x.message.payload or b"").decode("utf-8", "replace")} for x in letters],
                         indent=2))
        return
    print(table(["id", "peer", "sequence", "#", "action", "failed", "error"],
                 [[x.id, x.peer or "-", x.message.identifier, x.message.number, x.message.action,
                   time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(x.failed_at)),
                   x.error.splitlines()[-1][:60] if x.error else ""] for x in letters]))
