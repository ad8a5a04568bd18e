"""Prometheus metrics of one node, served at ``/metrics`` by its endpoint (``prometheus-client``)."""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class Metrics:
    def __init__(self, node_id: str, open_sequences: Callable[[], float], backlog: Callable[[], float]):
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"node": node_id}

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"qtp_messages_{name}", doc, labelnames=["node"], registry=self.registry).labels(**labels)

        self.sent = counter("sent", "Application messages transmitted (first sends and retransmissions)")
        self.retransmitted = counter("retransmitted", "Application messages transmitted again")
        self.acknowledged = counter("acknowledged", "Outbound messages acknowledged by the peer")
        self.received = counter("received", "Inbound messages stored (first receipt)")
        self.delivered = counter("delivered", "Inbound messages applied by a handler's committed transaction")
        self.dead_lettered = counter("dead_lettered", "Inbound messages moved to the dead letters")
        sequences = Gauge("qtp_sequences_open", "Inbound sequences open", labelnames=["node"], registry=self.registry)
        sequences.labels(**labels).set_function(open_sequences)
        waiting = Gauge("qtp_invoker_backlog", "Inbound messages stored, not yet applied", labelnames=["node"],
                        registry=self.registry)
        waiting.labels(**labels).set_function(backlog)
        self.latency = Histogram("qtp_enqueue_to_apply_seconds",
                                 "From the sender's enqueue (qtp peers) or the receipt to the committed apply",
                                 labelnames=["node"], buckets=LATENCY_BUCKETS, registry=self.registry).labels(**labels)

        self.batch = Histogram("qtp_request_messages", "Application messages per request sent (batches)",
                               labelnames=["node"], buckets=BATCH_BUCKETS, registry=self.registry).labels(**labels)
        self.stored_batch = Histogram("qtp_store_messages", "Inbound messages stored per local commit",
                                      labelnames=["node"], buckets=BATCH_BUCKETS,
                                      registry=self.registry).labels(**labels)

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
