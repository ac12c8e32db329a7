"""What every part of a site daemon's work shares: the site's name and address, its state dir,
its transport, its coordinator link and reporter, its job runner, its runs table and lock, and
the run states it reports.

One :class:`Site` per daemon, built by ``PeerNode``; the modules that do the work (assignment,
receiving, sending, the chain and star visits, the run's end) each take it and nothing bigger.
The run state machine itself (assigned -> receiving -> training -> sending ...) is described in
``peer/node.py``.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import grpc

from fedrelay.calls import status_message
from fedrelay.transport import Transport
from fedrelay.peer.reporting import CoordinatorLink, Reporter
from fedrelay.peer.runs import Run
from fedrelay.v1 import coordinator_pb2 as cpb

log = logging.getLogger("fedrelay.peer")

DEFAULT_RELAY_AFTER = 60.0  # seconds a receiver with an address may stay unreachable before the relay is used


class Site:
    """The shared context of one site daemon. The daemon may replace ``stop`` (its own event),
    ``revocations`` (the federation's revocation list: nothing goes to a revoked site) and
    ``relay_after`` (seconds without reaching a receiver directly before the relay; 0: never)
    after construction; tests replace ``reporter``."""

    def __init__(self, name: str, address: str, state_dir: Path, transport: Transport,
                 coordinator: CoordinatorLink | None, jobs, *, send_deadline: float, start_workers: bool):
        self.name = name
        self.address = address
        self.state_dir = Path(state_dir)
        self.transport = transport
        self.coordinator = coordinator
        self.jobs = jobs
        self.send_deadline = send_deadline  # seconds a delivery may retry
        self.start_workers = start_workers  # False: accept and store, but train nothing (tests)
        self.runs: dict[str, Run] = {}
        self.lock = threading.Lock()
        self.train_lock = threading.Lock()  # one training at a time on this site's hardware
        self.route_lock = threading.Lock()
        self.relay_after = DEFAULT_RELAY_AFTER
        self.revocations = None
        self.metrics = None  # peer.monitoring.PeerMetrics, set by PeerNode
        self.reporter = Reporter(coordinator, lambda: self.stop)
        self.stop = threading.Event()

    @property
    def relay_address(self) -> str:
        """The relay this site sends sealed payloads to: the one the coordinator names in its
        registration reply, else the coordinator itself."""
        if self.coordinator is None:
            return ""
        return self.coordinator.relay or self.coordinator.address

    def set_state(self, run: Run, state: str, detail: str, persist: bool = True, force: bool = False,
                  report: bool = True, quiet: bool = False) -> None:
        """Set the run's state (``persist``: and save it); log it and report it to the
        coordinator unless ``quiet`` (``report`` False: log only)."""
        if run.ended.is_set() and not force:
            return  # the coordinator ended the run: its state stays "ended"
        run.state, run.detail = state, detail
        if persist:
            run.save()
        if quiet:
            return
        log.info("run %s: %s%s", run.run_id, state, f" ({detail})" if detail else "")
        if report:
            self.report_state(run)

    def report_state(self, run: Run) -> None:
        self.reporter.progress(cpb.ProgressReport(run_id=run.run_id, site=self.name, kind="state",
                                                  state=run.state, detail=run.detail))

    def report(self, method: str, request) -> None:
        """Reports that the ledger must have are retried for up to 10 minutes."""
        if self.coordinator is not None:
            self.coordinator.call(method, request, retry_for=600, stop=self.stop)

    def fail(self, run: Run, error: str) -> None:
        """This site's work on ``run`` failed: the state turns "failed" (``error`` its detail) and
        the coordinator is told (``ReportFailure``, retried for up to 5 minutes; a report that
        never arrives is logged)."""
        self.set_state(run, "failed", error)
        if self.coordinator is not None:
            try:
                self.coordinator.call("ReportFailure", cpb.FailureReport(run_id=run.run_id, site=self.name, error=error),
                                      retry_for=300, stop=self.stop)
            except grpc.RpcError as rpc_exc:
                log.error("could not report the failure: %s", status_message(rpc_exc))
