"""What a sequence with thousands of gaps costs the receiving node (issue 21, attack 4d).

A peer sends only even message numbers (2, 4, 6, ...), so every message leaves a gap below it. The node
(in this process, xa mode, its store in the private PostgreSQL server) stores each one; we time each
request, then restart the node and time its start (loading the record with all its ranges).

    .venv/bin/python benchmarks/gaps.py --gaps 6000 [--json out.json]
    .venv/bin/python benchmarks/gaps.py --compare /path/to/old/checkout --gaps 6000

``--compare`` runs the same measurement with another checkout's qtp (a subprocess with its PYTHONPATH)
right after this one, for figures from the same run. The value is used as PYTHONPATH, so it may name
several folders: a checkout from before cheroot also needs waitress, e.g.
``--compare /tmp/old:/tmp/oldlib`` after ``pip install --target /tmp/oldlib waitress``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import requests

import qtp
from qtp.embedded import DEFAULT_ROOT, EmbeddedPostgres, free_port
from qtp.wsrm.codec import Addressing, Envelope, SoapVersion, WsaVersion, anonymous, default_action, encode
from qtp.wsrm.protocol import CreateSequence, RMVersion, Sequence
from qtp.wsrm.runtime import Limits, Node, NodeSettings
from qtp.wsrm.runtime._transport import content_type

WSA = WsaVersion.WSA200508


def _env(body=None, **kw) -> Envelope:
    env = Envelope(soap=SoapVersion.SOAP12, rm=RMVersion.WSRM11, wsa=WSA, body=body,
                   addressing=Addressing(action=kw.pop("action", None), to="http://x/rm",
                                         message_id=f"urn:uuid:{uuid.uuid4()}", reply_to=anonymous(WSA)), **kw)
    if env.addressing.action is None:
        import dataclasses
        env = dataclasses.replace(env, addressing=dataclasses.replace(env.addressing, action=default_action(env)))
    return env


def _node(url: str, folder: Path, node_id: str, port: int) -> Node:
    tm = qtp.TransactionManager(node_id, folder / "logs", recovery_interval=None)
    tm.add_resource("app", url)
    limits = {"max_invoker_backlog": 1_000_000}
    if "max_gap" in {f for f in Limits.__dataclass_fields__}:
        limits["max_gap"] = 1 << 40  # measure the bookkeeping, not the quota that now bounds it
    settings = NodeSettings(endpoint=f"http://127.0.0.1:{port}/rm", store="app", limits=Limits(**limits))
    return Node(tm, settings).start()


def measure(url: str, gaps: int) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="qtp-gaps-"))
    port, node_id = free_port(), f"gaps-{uuid.uuid4().hex[:6]}"
    node = _node(url, folder, node_id, port)
    session = requests.Session()
    headers = {"Content-Type": content_type(SoapVersion.SOAP12, None)}

    def post(env: Envelope) -> requests.Response:
        return session.post(node.endpoint, data=encode(env), headers=headers, timeout=60)

    from qtp.wsrm.codec import decode
    identifier = decode(post(_env(CreateSequence(anonymous(WSA)))).content).body.identifier
    times = []
    for i in range(1, gaps + 1):
        env = _env(sequence=Sequence(identifier, 2 * i), payload=b"<o xmlns='urn:gaps'/>", action="urn:gaps:none")
        began = time.perf_counter()
        answer = post(env)
        times.append(time.perf_counter() - began)
        assert answer.status_code in (200, 202), answer.text[:300]
        if i % 1000 == 0:
            print(f"  {i} gaps: {statistics.median(times[-100:]) * 1000:.1f} ms per message", flush=True)
    node.close()
    began = time.perf_counter()
    node = _node(url, folder, node_id, port)
    restart = time.perf_counter() - began
    node.close()

    def window(at: int) -> float:
        return round(statistics.median(times[max(0, at - 100):at]) * 1000, 2)

    return {"gaps": gaps, "ms_per_message_first_100": window(100),
            **{f"ms_per_message_at_{n}": window(n) for n in (1000, 2000, 4000, 6000) if n <= gaps},
            "restart_seconds": round(restart, 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gaps", type=int, default=6000)
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT)
    parser.add_argument("--compare", type=Path, help="another checkout to measure right after this one")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    pg = EmbeddedPostgres(args.root / "pg")
    pg.start()
    url = pg.create_database(f"gaps_{uuid.uuid4().hex[:6]}")
    print(f"this checkout ({Path(qtp.__file__).parent.parent}):", flush=True)
    result = {"this": measure(url, args.gaps)}
    print(json.dumps(result["this"]), flush=True)
    if args.compare is not None:
        print(f"compared checkout ({args.compare}):", flush=True)
        done = subprocess.run([sys.executable, __file__, "--gaps", str(args.gaps), "--root", str(args.root)],
                              env=dict(os.environ, PYTHONPATH=str(args.compare)), capture_output=True, text=True)
        print(done.stdout[-2000:], done.stderr[-2000:])
        result["compared"] = json.loads(done.stdout.strip().splitlines()[-1])
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
