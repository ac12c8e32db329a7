"""The coordinator's Prometheus metrics and its one-line-per-event log.

:class:`CoordinatorMonitor` is built by ``CoordinatorService`` and called from it with one-line
hooks. Its registry (one per daemon, not ``prometheus_client``'s global one) is served by
``coordinator serve --metrics-listen HOST:PORT`` (``fedrelay.metrics.MetricsServer``).

Metrics (read from the ledger at scrape time unless marked *in process*; those start at 0
when the daemon starts):

- ``fedrelay_coordinator_runs{state}``: runs by status (running, finished, failed, ...).
- ``fedrelay_coordinator_transfers_total{purpose}``: transfers (purpose chain|upload|final)
  their senders reported; ``fedrelay_coordinator_transfer_payload_bytes_total{purpose}`` and
  ``..._transfer_wire_bytes_total{purpose}``: their payload bytes, and the bytes every attempt
  put on the wire; ``fedrelay_coordinator_transfer_retries_total{purpose}``: streams beyond
  the first; ``fedrelay_coordinator_resumed_bytes_total{purpose}``: bytes a resumed stream did
  not send again (the receiver held them).
- ``fedrelay_coordinator_refusals_total{method,code}`` (*in process*): calls refused with a
  gRPC status (``code`` e.g. ``permission_denied``, ``invalid_argument``,
  ``resource_exhausted``, ``already_exists``, ``not_found``), counted by the guard.
- ``fedrelay_coordinator_peer_up{site}``: 1 while the site's last heartbeat is at most
  ``--peer-timeout`` seconds old, else 0; ``fedrelay_coordinator_peer_last_seen_age_seconds{site}``.
- ``fedrelay_coordinator_site_epoch{run_id,site,stage,model}`` and ``..._site_epochs{...}``
  (*in process*, running runs only): the latest epoch a site reported (``ReportProgress``) and
  the epochs of that stage (``warmup``, ``pool`` model j, ``train``, ``aggregate``...);
  ``fedrelay_coordinator_site_epoch_progress_ratio{run_id,site}``: epoch / epochs.
- ``fedrelay_coordinator_final_metric{run_id,task,site,metric}``: the final model's metrics of the
  ``RECENT_RESULTS`` most recently finished runs, per site (its exact figures on its own test
  split) and with ``site="global"`` (from the sites' pooled statistics): ``accuracy``,
  ``balanced_accuracy``, ``macro_f1``, ``auroc``, two classes ``sensitivity`` and
  ``specificity``, and the task's own metrics (``fedrelay.scoring``).

Log lines (logger ``fedrelay.coordinator``), one per event: a site's first registration and a
change of its address (INFO; a heartbeat that changes nothing is DEBUG), a run started (id,
strategy, sites, the caller's identity and address), a transfer reported, a run ended. Refused
calls are logged by the guard (``fedrelay.guard``: method, caller, reason, address).
"""

from __future__ import annotations

import logging
import threading
import time

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from fedrelay import purpose as purposes
from fedrelay.callers import caller_identity
from fedrelay.guard import Guard, Limits
from fedrelay.metrics import DaemonMetrics

CONNECT_METHOD = "/fedrelay.v1.Coordinator/Connect"
MAX_CONTROL_STREAMS = 256  # sites that connect out only, per coordinator (a worker thread each)

log = logging.getLogger("fedrelay.coordinator")

RECENT_RESULTS = 20  # finished runs whose final metrics are exported (older ones stay in the ledger)
RUN_STATES = ("running", "finished", "failed", "cancelled")  # always exported, 0 when no run has them


def caller(context) -> str:
    """``'operator' (ipv4:10.0.0.7:5312)`` for a log line; a plaintext server has no identities."""
    who = caller_identity(context)
    return f"{who!r} ({context.peer()})" if who is not None else f"{context.peer()} (no identity: plaintext)"


class CoordinatorMonitor(DaemonMetrics):
    """Metrics and event log of one coordinator (``service``: its ``CoordinatorService``, for
    the ledger and ``peer_timeout``)."""

    def __init__(self, service):
        super().__init__("coordinator")
        self.service = service
        self._progress: dict[tuple[str, str], tuple] = {}  # (run, site) -> (stage, model, epoch, epochs)
        self._lock = threading.Lock()
        self.registry.register(_LedgerCollector(self))
        service.ledger.on_run_ended.append(self.run_ended)

    # -- wiring ----------------------------------------------------------------------------------
    def guard(self) -> Guard:
        """The coordinator server's guard, counting every refused call here. The control streams of
        sites that connect out only (``Coordinator.Connect``, one per such site) are long-lived:
        they do not count against the sites' shared bound, and the server has a worker thread for
        each of up to ``MAX_CONTROL_STREAMS`` of them on top of the usual 128."""
        limits = Limits(max_workers=Limits.max_workers + MAX_CONTROL_STREAMS, long_lived=frozenset({CONNECT_METHOD}))
        return Guard(limits, on_refusal=self.refused)

    # -- hooks (and DaemonMetrics.refused) -------------------------------------------------------
    def registered(self, name: str, address: str, before: dict | None) -> None:
        """After ``Register``: ``before`` is the site's ledger row before it (None: first time)."""
        if before is None:
            log.info("site %s registered at %s", name, address)
        elif before["address"] != address:
            log.info("site %s moved from %s to %s", name, before["address"], address)
        elif time.time() - (before["last_seen"] or 0) > self.service.peer_timeout:
            log.info("site %s is back at %s (silent for %.0f s)", name, address,
                     time.time() - (before["last_seen"] or 0))
        else:
            log.debug("heartbeat from %s at %s", name, address)

    def run_started(self, run_id: str, strategy: str, sites: list[str], aggregator: str, by: str) -> None:
        """A run started; ``by``: who asked, as :func:`caller` words it."""
        shape = f"star around {aggregator}" if aggregator else "chain"
        log.info("run %s started by %s: %s, %s over %d sites: %s", run_id, by, strategy, shape,
                 len(sites), ", ".join(sites))

    def transfer_reported(self, request, purpose: str) -> None:
        """A sender's new ``HopReport`` (``purpose``: chain|upload|final)."""
        extra = (f", {request.attempts} attempts" if request.attempts > 1 else "") + (
            f", resumed at byte {request.resumed_from}" if request.resumed_from else "")
        log.info("run %s: %s transfer %d %s -> %s, %d bytes (%d on the wire), %.2f s%s", request.run_id, purpose,
                 request.hop, request.sender, request.receiver, request.payload_bytes, request.wire_bytes,
                 request.ended - request.started, extra)

    def progress(self, request) -> None:
        """An epoch ``ProgressReport``."""
        with self._lock:
            self._progress[(request.run_id, request.site)] = (request.stage, request.model, request.epoch,
                                                              request.epochs)

    def run_ended(self, run_id: str, status: str, error: str | None) -> None:
        """A ledger listener: the run moved to ``status``."""
        log.info("run %s ended: %s%s", run_id, status, f" ({error})" if error else "")
        with self._lock:
            for key in [k for k in self._progress if k[0] == run_id]:
                del self._progress[key]


class _LedgerCollector:
    """The metrics read at scrape time (from the ledger and the monitor's progress)."""

    def __init__(self, monitor: CoordinatorMonitor):
        self.monitor = monitor

    def describe(self):
        return []  # unchecked: the families are made at scrape time

    def collect(self):
        ledger = self.monitor.service.ledger
        counts = ledger.run_counts()
        runs = GaugeMetricFamily("fedrelay_coordinator_runs", "Runs in the ledger by status.", labels=["state"])
        for state in dict.fromkeys([*RUN_STATES, *sorted(counts)]):
            runs.add_metric([state], counts.get(state, 0))
        yield runs

        totals = ledger.transfer_totals()
        families = {
            "transfers": CounterMetricFamily("fedrelay_coordinator_transfers", "Transfers their senders reported, "
                                             "by purpose (chain, upload, final).", labels=["purpose"]),
            "payload_bytes": CounterMetricFamily("fedrelay_coordinator_transfer_payload_bytes",
                                                 "Payload bytes of the reported transfers.", labels=["purpose"]),
            "wire_bytes": CounterMetricFamily("fedrelay_coordinator_transfer_wire_bytes", "Bytes every attempt "
                                              "of the reported transfers put on the wire.", labels=["purpose"]),
            "retries": CounterMetricFamily("fedrelay_coordinator_transfer_retries", "Streams beyond the first "
                                           "that the reported transfers took.", labels=["purpose"]),
            "resumed_bytes": CounterMetricFamily("fedrelay_coordinator_resumed_bytes", "Bytes that resumed "
                                                 "transfers did not send again.", labels=["purpose"]),
        }
        for purpose in dict.fromkeys([*purposes.LEDGER_WORDS, *sorted(totals)]):
            row = totals.get(purpose, {})
            for key, family in families.items():
                family.add_metric([purpose], row.get(key) or 0)
        yield from families.values()

        now = time.time()
        up = GaugeMetricFamily("fedrelay_coordinator_peer_up", "1 while the site's last heartbeat is at most "
                               "--peer-timeout seconds old, else 0.", labels=["site"])
        age = GaugeMetricFamily("fedrelay_coordinator_peer_last_seen_age_seconds", "Seconds since the site's "
                                "last heartbeat.", labels=["site"])
        for p in ledger.peers():
            seconds = now - (p["last_seen"] or 0)
            up.add_metric([p["name"]], 1 if seconds <= self.monitor.service.peer_timeout else 0)
            age.add_metric([p["name"]], seconds)
        yield up
        yield age

        epoch = GaugeMetricFamily("fedrelay_coordinator_site_epoch", "The latest epoch a site of a running run "
                                  "reported (1-based, within its stage and model).",
                                  labels=["run_id", "site", "stage", "model"])
        epochs = GaugeMetricFamily("fedrelay_coordinator_site_epochs", "Epochs of the stage of that report.",
                                   labels=["run_id", "site", "stage", "model"])
        ratio = GaugeMetricFamily("fedrelay_coordinator_site_epoch_progress_ratio", "epoch / epochs of the latest "
                                  "report of a site of a running run.", labels=["run_id", "site"])
        with self.monitor._lock:
            progress = dict(self.monitor._progress)
        for (run_id, site), (stage, model, e, n) in sorted(progress.items()):
            epoch.add_metric([run_id, site, stage, str(model)], e)
            epochs.add_metric([run_id, site, stage, str(model)], n)
            ratio.add_metric([run_id, site], e / n if n else 0.0)
        yield epoch
        yield epochs
        yield ratio

        final = GaugeMetricFamily("fedrelay_coordinator_final_metric", "The final model's metrics of a recently "
                                  "finished run: per site on its own test split, and site=\"global\" from the "
                                  "sites' pooled statistics.", labels=["run_id", "task", "site", "metric"])
        for run in ledger.recent_results(RECENT_RESULTS):
            task = run["task"] or ""
            for name, value in {"accuracy": run["accuracy"] or 0.0, **run["metrics"]}.items():
                final.add_metric([run["run_id"], task, "global", name], value)
            for e in run["evaluations"]:
                for name, value in {"accuracy": e["accuracy"], **e["metrics"]}.items():
                    final.add_metric([run["run_id"], task, e["site"], name], value)
        yield final
