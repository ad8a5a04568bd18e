"""Prometheus metrics of one node, served at ``/metrics`` by its endpoint (``prometheus-client``)."""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from qtp._version import __version__

# Per channel, read when /metrics is scraped: name -> help text. The values come from the node's
# ``channel_stats()``: {channel: {name: value}}.
CHANNEL_GAUGES = {
    "in_flight": "Messages of the channel sent and not yet acknowledged",
    "round_trip_seconds": "Smoothed round-trip time of the channel's current sequence (RFC 6298)",
    "retransmission_timeout_seconds": "Retransmission timeout of the channel's current sequence",
    "backlog": "Messages of the channel enqueued and not yet acknowledged (numbered or not)",
    "oldest_message_age_seconds": "Age of the channel's oldest unacknowledged message",
}

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class _Channels(Collector):
    """The per-channel gauges, computed at scrape time."""

    def __init__(self, node_id: str, stats: Callable[[], dict[str, dict[str, float]]]):
        self.node_id = node_id
        self.stats = stats

    def describe(self) -> Iterator[GaugeMetricFamily]:
        """The names alone (so registering reads nothing)."""
        for name, doc in CHANNEL_GAUGES.items():
            yield GaugeMetricFamily(f"qtp_channel_{name}", doc, labels=["node", "channel"])

    def collect(self) -> Iterator[GaugeMetricFamily]:
        values = self.stats()
        for name, doc in CHANNEL_GAUGES.items():
            family = GaugeMetricFamily(f"qtp_channel_{name}", doc, labels=["node", "channel"])
            for channel, stats in sorted(values.items()):
                if stats.get(name) is not None:
                    family.add_metric([self.node_id, channel], stats[name])
            yield family


class _Polling:
    def __init__(self, node_id: str, waiting: Callable[[], dict[tuple[str | None, str], int]]):
        self.node_id, self.waiting = node_id, waiting

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("qtp_polling_client_messages", "Messages held for a client that polls with "
                                   "WS-MakeConnection (peer: its name, or anonymous)", labels=["node", "peer", "client"])
        for (peer, client), count in sorted(self.waiting().items(), key=lambda kv: (kv[0][0] or "", kv[0][1])):
            family.add_metric([self.node_id, peer or "anonymous", client[:200]], count)
        yield family


class _Lease:
    """The node's lease ([lease], replicas), read at scrape time from the process's own view of it."""

    def __init__(self, node_id: str, lease: Callable[[], Any]):
        self.node_id, self.lease = node_id, lease

    def collect(self) -> Iterator[GaugeMetricFamily]:
        lease = self.lease()
        if lease is None:
            return
        now = time.monotonic()
        held = GaugeMetricFamily("qtp_lease_held", "1 while this process owns the node (its lease is valid by its "
                                 "own clock), else 0", labels=["node", "member"])
        held.add_metric([self.node_id, lease.member], 1.0 if lease.valid() else 0.0)
        yield held
        epoch = GaugeMetricFamily("qtp_lease_epoch", "The node's ownership epoch this process took (one more at "
                                  "every takeover)", labels=["node"])
        epoch.add_metric([self.node_id], float(lease.epoch))
        yield epoch
        if lease.renewed_at is not None:
            age = GaugeMetricFamily("qtp_lease_renewed_seconds_ago", "Seconds since this process sent its last "
                                    "successful lease renewal (a standby takes over after [lease] ttl)",
                                    labels=["node"])
            age.add_metric([self.node_id], now - lease.renewed_at)
            yield age


class _Bound:
    """A labelled counter with the node's label filled in: ``refused.labels(reason=...).inc()``."""

    def __init__(self, counter: Counter, node_id: str):
        self._counter, self._node = counter, node_id

    def labels(self, **labels: str) -> Any:
        return self._counter.labels(node=self._node, **labels)


class Metrics:
    def __init__(self, node_id: str, open_sequences: Callable[[], float], backlog: Callable[[], float],
                 channel_stats: Callable[[], dict[str, dict[str, float]]] | None = None):
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"node": node_id}
        self.node_id = node_id
        Info("qtp_build", "The qtp release this node runs (qtp_build_info{version} 1)", labelnames=["node"],
             registry=self.registry).labels(**labels).info({"version": __version__})

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"qtp_messages_{name}", doc, labelnames=["node"], registry=self.registry).labels(**labels)

        self.sent = counter("sent", "Application messages transmitted (first sends and retransmissions)")
        self.retransmitted = counter("retransmitted", "Application messages transmitted again")
        self.acknowledged = counter("acknowledged", "Outbound messages acknowledged by the peer")
        self.received = counter("received", "Inbound messages stored (first receipt)")
        self.delivered = counter("delivered", "Inbound messages applied by a handler's committed transaction")
        self.on_receipt = counter("applied_on_receipt", "Of the applied messages, those applied in the commit "
                                  "that stored them ([limits] apply_on_receipt)")
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

        self.poll_batch = Histogram("qtp_poll_messages", "Messages given per poll answered with messages (more "
                                    "than one only to qtp pollers, which take a batch)", labelnames=["node"],
                                    buckets=BATCH_BUCKETS, registry=self.registry).labels(**labels)

        self._retransmissions = Counter("qtp_channel_retransmissions", "Application messages transmitted again",
                                        labelnames=["node", "channel"], registry=self.registry)
        self._requests = Histogram("qtp_channel_request_messages", "Application messages per request sent",
                                   labelnames=["node", "channel"], buckets=BATCH_BUCKETS, registry=self.registry)
        refused = Counter("qtp_requests_refused", "Requests or parts refused: reason = unauthenticated, boot (signed "
                          "for another start of this node: a few per signing peer after a start, more are replays), "
                          "not_owner (another peer's sequence), create (CreateSequence refused), unknown_action, gap, "
                          "peer_backlog, peer_replies", labelnames=["node", "reason"], registry=self.registry)
        self.refused = _Bound(refused, node_id)
        polls = Counter("qtp_polls", "WS-MakeConnection polls: sent (by a node without an endpoint); answered "
                        "with a message, empty or fault, and too_large (a held message larger than the qtp poller "
                        "reads), by a serving node", labelnames=["node", "result"], registry=self.registry)
        self.polls = _Bound(polls, node_id)
        self.ignored_headers = Counter("qtp_answer_headers_ignored", "Headers of answers set aside because they "
                                       "break the schema (a Sequence with MessageNumber 0 on an empty-body answer, "
                                       "as gSOAP writes), the acknowledgements next to them taken",
                                       labelnames=["node"], registry=self.registry).labels(**labels)
        if channel_stats is not None:
            self.registry.register(_Channels(node_id, channel_stats))

    def watch_lease(self, lease: Callable[[], Any]) -> None:
        """``qtp_lease_held``, ``qtp_lease_epoch``, ``qtp_lease_renewed_seconds_ago`` (a node with [lease])."""
        self.registry.register(_Lease(self.node_id, lease))

    def watch_polling_clients(self, waiting: Callable[[], dict[tuple[str | None, str], int]]) -> None:
        """``qtp_polling_client_messages{peer, client}``: messages held for each client that polls."""
        self.registry.register(_Polling(self.node_id, waiting))

    def transmitted(self, channel: str, messages: int, retransmitted: int) -> None:
        """One request of ``channel`` carried ``messages`` application messages, ``retransmitted`` of them again."""
        self.sent.inc(messages)
        self.batch.observe(messages)
        self._requests.labels(self.node_id, channel).observe(messages)
        if retransmitted:
            self.retransmitted.inc(retransmitted)
            self._retransmissions.labels(self.node_id, channel).inc(retransmitted)

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
