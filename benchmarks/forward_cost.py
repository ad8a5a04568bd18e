"""What one forward between replicas costs: the CPU of both processes per request, direct and forwarded.

A replica that shares a node's work (``[lease] slots``) and receives a request for a slot another replica
holds passes it on (docs/operations.md). This measures that passing on alone, with qtp's own HTTP server and
forwarding code and no database: process B answers every POST (3 KB in, 300 bytes out) as a slot's replica
would; process A is a replica holding no slot, which forwards each request to B the way ``SharedNode`` does.
This process sends ``--requests`` POSTs on a fresh connection each (as the test proxy and many balancers do),
from ``--threads`` threads, first straight to B, then to A, and reads both processes' CPU from /proc:

    extra CPU per forward = (A + B, through A) - (B, direct)

Usage: ``python benchmarks/forward_cost.py [--requests 3000] [--threads 2] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from _cpu import CpuMeter  # noqa: E402

BODY = b"<e>" + b"x" * 3000 + b"</e>"
ANSWER = b"<a>" + b"y" * 300 + b"</a>"


def _serve(role: str, port: int, target_port: int) -> None:
    """Run in a child: B answers, A forwards to B (qtp's code for both), until stdin closes."""
    from qtp.wsrm.runtime._http import HttpServer
    from qtp.wsrm.runtime._settings import Limits
    from qtp.wsrm.runtime._shared import SharedNode, _Links

    limits = Limits()
    if role == "B":
        def app(environ, start_response):
            environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
            start_response("200 OK", [("Content-Type", "text/xml")])
            return [ANSWER]
    else:  # a replica holding no slot: only what SharedNode's forward uses
        replica = SharedNode.__new__(SharedNode)
        replica.node_id, replica.member, replica._unanswered = "bench", "a", {}
        replica._forwarding = threading.BoundedSemaphore(limits.http_threads // 2)
        replica._links = _Links(limits.http_timeout, keep=limits.http_threads // 2)
        address = f"http://127.0.0.1:{target_port}/"

        def app(environ, start_response):
            body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
            return replica._forward(address, 1, environ, body, start_response)
    server = HttpServer(app, "127.0.0.1", port, limits)
    server.start()
    print("ready", flush=True)
    sys.stdin.read()
    server.stop()


def _post(port: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("POST", "/", body=BODY, headers={"Content-Type": "text/xml"})
    answer = conn.getresponse()
    content = answer.read()
    conn.close()
    if answer.status != 200 or content != ANSWER:
        raise RuntimeError(f"answered {answer.status}: {content[:200]!r}")


def _drive(port: int, requests: int, threads: int) -> float:
    began = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda _: _post(port), range(requests)))
    return time.monotonic() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--serve", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        _serve(args.serve[0], int(args.serve[1]), int(args.serve[2]))
        return
    from qtp.embedded import free_port

    pb, pa = free_port(), free_port()
    procs = {}
    for role, port, target in (("B", pb, 0), ("A", pa, pb)):
        procs[role] = subprocess.Popen([sys.executable, __file__, "--serve", role, str(port), str(target)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if procs[role].stdout.readline().strip() != "ready":
            raise SystemExit(f"{role} did not start")
    rows = []
    try:
        _drive(pb, 300, args.threads)  # warm both paths
        _drive(pa, 300, args.threads)
        for r in range(args.rounds):
            for path, port in (("direct", pb), ("forwarded", pa)):
                cpu = CpuMeter({"A": procs["A"].pid, "B": procs["B"].pid})
                wall = _drive(port, args.requests, args.threads)
                used = cpu.per_message(args.requests)
                rows.append({"round": r, "path": path, "wall_ms": round(1000 * wall / args.requests, 3), **used})
                print(json.dumps(rows[-1]), flush=True)
    finally:
        for p in procs.values():
            p.stdin.close()
            p.wait(10)
    med = {path: {k: statistics.median(x[k] for x in rows if x["path"] == path) for k in ("A", "B", "wall_ms")}
           for path in ("direct", "forwarded")}
    extra = med["forwarded"]["A"] + med["forwarded"]["B"] - med["direct"]["A"] - med["direct"]["B"]
    print(f"medians of {args.rounds} rounds, {args.requests} requests from {args.threads} threads, ms per request: "
          f"direct B {med['direct']['B']:.3f} (wall {med['direct']['wall_ms']:.3f}); forwarded A "
          f"{med['forwarded']['A']:.3f} + B {med['forwarded']['B']:.3f} (wall {med['forwarded']['wall_ms']:.3f}); "
          f"extra CPU per forward {extra:.3f}")


if __name__ == "__main__":
    main()
