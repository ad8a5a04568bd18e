"""Does a ``mode = "memory"`` stream keep moving through node kills? A probe, not a verdict.

``memory`` keeps queues and sequences in the node's process, so every SIGKILL loses what that node held:
the question here is only liveness, whether messages committed after a kill are still sent and applied.
The e2e campaign's ``memory`` run once showed ``applied`` flat for 30 kills; this probe separates the cases.
It starts the campaign's pair (client on PostgreSQL, server on MariaDB, request-reply, no loss on the proxies),
lets the client send orders without pause, SIGKILLs and restarts the chosen nodes ``--kills`` times
``--gap`` seconds apart, then watches for ``--watch`` seconds with no kills. Every line is one sample:
orders committed at the client, rows applied at the server, and the nodes' message counters (since their
last start).

    python benchmarks/memory_probe.py --kills 8 --gap 2 --victims server,client
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from e2e_campaign import _count, _databases, _pair

from qtp.testing.lossy_proxy import LossyProxy
from qtp.testing.nodes import NodeProcess, counter


def _metric(node: NodeProcess, name: str) -> float | None:
    return counter(f"http://127.0.0.1:{node.port}/metrics", name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=8)
    parser.add_argument("--gap", type=float, default=2.0, help="seconds between a restart and the next kill")
    parser.add_argument("--victims", default="server,client", help="nodes killed in turn (server, client)")
    parser.add_argument("--watch", type=float, default=30.0, help="seconds watched after the last kill")
    parser.add_argument("--root", default=".qtp/memory-probe", help="databases and node files")
    args = parser.parse_args()
    victims = args.victims.split(",")
    if not victims or set(victims) - {"server", "client"}:
        parser.error("--victims takes server and/or client, comma-separated")
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    setup = argparse.Namespace(pair="pg-maria", store="colocated", reply=True, mode="memory", wsrm="1.1", soap="1.2")
    pg, maria = _databases(root)
    pair = _pair(setup, pg, maria, f"probe_{int(time.time())}")
    client_config, server_config = pair.write(root)
    proxies = [LossyProxy(f"http://127.0.0.1:{pair.server_port}", port=pair.proxy_port).start(),
               LossyProxy(f"http://127.0.0.1:{pair.client_port}", port=pair.back_proxy_port).start()]
    nodes = {"server": NodeProcess(server_config, root / "server.log"),
             "client": NodeProcess(client_config, root / "client.log",
                                   {"QTP_TEST_SEND": "1000000", "QTP_TEST_ABORT_EVERY": "13"})}
    began = time.monotonic()

    def sample(label: str) -> None:
        print(json.dumps({"at": label, "t_s": round(time.monotonic() - began, 1),
                          "orders": _count(pair.client_app, "SELECT COUNT(*) FROM orders"),
                          "applied": _count(pair.server_app, "SELECT COUNT(*) FROM applied"),
                          "client_sent": _metric(nodes["client"], "qtp_messages_sent_total"),
                          "client_acknowledged": _metric(nodes["client"], "qtp_messages_acknowledged_total"),
                          "server_received": _metric(nodes["server"], "qtp_messages_received_total")}), flush=True)

    try:
        nodes["server"].start()
        nodes["client"].start()
        time.sleep(args.gap)
        sample("start")
        for i in range(args.kills):
            victim = victims[i % len(victims)]
            nodes[victim].kill()
            nodes[victim].start()
            time.sleep(args.gap)
            sample(f"kill {i + 1} ({victim})")
        watched = time.monotonic()
        while time.monotonic() - watched < args.watch:
            time.sleep(2.0)
            sample("no kills")
    finally:
        for node in nodes.values():
            node.stop()
        for proxy in proxies:
            proxy.stop()
        pg.stop()
        maria.stop()


if __name__ == "__main__":
    main()
