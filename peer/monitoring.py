"""A site daemon's Prometheus metrics.

:class:`PeerMetrics` is built by ``PeerNode`` and called from it with one-line hooks. Its
registry (one per daemon, not ``prometheus_client``'s global one) is served by ``peer serve
--metrics-listen HOST:PORT`` (``fedrelay.metrics.MetricsServer``). Counters start at 0 when
the daemon starts. ``purpose`` is chain | upload | final (the ledger's names).

- ``fedrelay_peer_transfers_sent_total{purpose}``, ``fedrelay_peer_sent_bytes_total{purpose}``
  (payload bytes), ``fedrelay_peer_sent_wire_bytes_total{purpose}`` (every attempt's bytes on
  the wire): transfers this site delivered (the receiver acknowledged them).
- ``fedrelay_peer_transfers_received_total{purpose}``, ``fedrelay_peer_received_bytes_total{purpose}``:
  payloads this site verified and kept.
- ``fedrelay_peer_transfer_retries_total{purpose}``: streams beyond the first of delivered
  transfers; ``fedrelay_peer_resumed_bytes_total{purpose}``: bytes a resumed delivery did not
  send again.
- ``fedrelay_peer_refusals_total{method,code}``: calls this daemon refused with a gRPC status
  (``method`` ``Peer.Handoff``: handoffs refused), counted by the guard.
- ``fedrelay_peer_training_images_per_second``: training images / seconds of the latest local
  training epoch (the epoch's wall time, validation included);
  ``fedrelay_peer_epochs_trained_total``: epochs reported (training and aggregation).
- ``fedrelay_peer_epoch{run_id,stage,model}``, ``fedrelay_peer_epochs{run_id,stage,model}``:
  the latest epoch (1-based) and the epochs of its stage, for the run that reported it last.
- ``fedrelay_peer_run_state{run_id,state}``: 1 for each run this site holds, labelled with its
  state (assigned, receiving, training, sending, distributing, done, failed, ended);
  ``fedrelay_peer_runs{state}``: runs by state.
"""

from __future__ import annotations

import threading

from prometheus_client import Counter, Gauge
from prometheus_client.core import GaugeMetricFamily

from fedrelay.guard import Guard
from fedrelay.metrics import PURPOSES, DaemonMetrics


class PeerMetrics(DaemonMetrics):
    """The metrics of one site daemon (``node``: its ``PeerNode``, whose runs are read at scrape
    time)."""

    def __init__(self, node):
        super().__init__("peer")
        self.node = node
        r = self.registry
        self.sent = Counter("fedrelay_peer_transfers_sent", "Transfers this site delivered.", ["purpose"],
                            registry=r)
        self.sent_bytes = Counter("fedrelay_peer_sent_bytes", "Payload bytes of the delivered transfers.",
                                  ["purpose"], registry=r)
        self.sent_wire = Counter("fedrelay_peer_sent_wire_bytes", "Bytes every attempt of the delivered "
                                 "transfers put on the wire.", ["purpose"], registry=r)
        self.received = Counter("fedrelay_peer_transfers_received", "Payloads this site verified and kept.",
                                ["purpose"], registry=r)
        self.received_bytes = Counter("fedrelay_peer_received_bytes", "Bytes of the payloads kept.", ["purpose"],
                                      registry=r)
        self.retries = Counter("fedrelay_peer_transfer_retries", "Streams beyond the first of delivered "
                               "transfers.", ["purpose"], registry=r)
        self.resumed = Counter("fedrelay_peer_resumed_bytes", "Bytes resumed deliveries did not send again.",
                               ["purpose"], registry=r)
        self.images_per_second = Gauge("fedrelay_peer_training_images_per_second", "Training images / seconds "
                                       "of the latest local training epoch.", registry=r)
        self.epochs_trained = Counter("fedrelay_peer_epochs_trained", "Epochs reported (training and "
                                      "aggregation).", registry=r)
        for purpose in PURPOSES.values():  # every series from the start, at 0
            for c in (self.sent, self.sent_bytes, self.sent_wire, self.received, self.received_bytes,
                      self.retries, self.resumed):
                c.labels(purpose)
        self._latest: tuple | None = None  # (run, stage, model, epoch, epochs) of the latest epoch
        self._lock = threading.Lock()
        r.register(_RunCollector(self))

    # -- wiring ----------------------------------------------------------------------------------
    def watch(self, guard: Guard) -> None:
        """Count the refusals of the daemon's server ``guard``."""
        guard.on_refusal = self.refused

    # -- hooks (and DaemonMetrics.refused) -------------------------------------------------------
    def delivered(self, purpose: int, payload_bytes: int, wire_bytes: int, attempts: int, resumed_from: int) -> None:
        """A transfer (wire ``purpose``) this site sent and the receiver acknowledged."""
        p = PURPOSES.get(purpose, "other")
        self.sent.labels(p).inc()
        self.sent_bytes.labels(p).inc(payload_bytes)
        self.sent_wire.labels(p).inc(wire_bytes)
        self.retries.labels(p).inc(max(attempts, 1) - 1)
        self.resumed.labels(p).inc(resumed_from)

    def kept(self, purpose: int, payload_bytes: int) -> None:
        """A payload (wire ``purpose``) this site received, verified and kept."""
        p = PURPOSES.get(purpose, "other")
        self.received.labels(p).inc()
        self.received_bytes.labels(p).inc(payload_bytes)

    def epoch(self, run_id: str, info: dict, images: int = 0) -> None:
        """After an epoch (``info``: ``fedrelay.peer.training.fit``'s ``on_epoch`` dict);
        ``images``: training images in the epoch (0: not a local training epoch, e.g. an
        aggregator's step, which leaves images per second as it was)."""
        self.epochs_trained.inc()
        if images and info.get("seconds", 0) > 0:
            self.images_per_second.set(images / info["seconds"])
        with self._lock:
            self._latest = (run_id, str(info.get("stage", "")), str(info.get("model", 0)), info["epoch"],
                            info["epochs"])


class _RunCollector:
    """Read at scrape time: the node's runs and their states, and the latest epoch."""

    def __init__(self, metrics: PeerMetrics):
        self.metrics = metrics

    def describe(self):
        return []  # unchecked: the families are made at scrape time

    def collect(self):
        runs = list(self.metrics.node.runs.values())
        state = GaugeMetricFamily("fedrelay_peer_run_state", "1 for each run this site holds, labelled with its "
                                  "state.", labels=["run_id", "state"])
        by_state: dict[str, int] = {}
        for run in runs:
            state.add_metric([run.run_id, run.state], 1)
            by_state[run.state] = by_state.get(run.state, 0) + 1
        yield state
        count = GaugeMetricFamily("fedrelay_peer_runs", "Runs this site holds, by state.", labels=["state"])
        for s, n in sorted(by_state.items()):
            count.add_metric([s], n)
        yield count
        epoch = GaugeMetricFamily("fedrelay_peer_epoch", "The latest epoch (1-based) this site reported.",
                                  labels=["run_id", "stage", "model"])
        epochs = GaugeMetricFamily("fedrelay_peer_epochs", "Epochs of the stage of the latest epoch.",
                                   labels=["run_id", "stage", "model"])
        with self.metrics._lock:
            latest = self.metrics._latest
        if latest is not None:
            epoch.add_metric(list(latest[:3]), latest[3])
            epochs.add_metric(list(latest[:3]), latest[4])
        yield epoch
        yield epochs
