"""The peer's run state machine: assigned (waiting) -> receiving -> training -> sending
(-> distributing at the final site) -> done (a star plan: training -> sending the upload -> done;
the aggregator: training -> receiving the uploads -> training (aggregating) -> distributing); "failed" when this site's work failed, "ended"
when the coordinator ended the run while this site was still working on it (``end_run``).
A run of T rounds goes through receiving -> training -> sending once per visit (round).

One ``PeerNode`` per daemon holds the site's data (decoded once) and its runs
(``fedrelay.peer.runs``: files, the site's part of the plan). Every file is written atomically,
and the worker skips the steps whose results are on disk, so a restarted daemon carries on with
the same command (received models are not asked for again, finished pool models are not
trained again, an unsent model is sent, an unreported receipt is reported).

``PeerNode`` builds the site's parts and delegates to them; each owns one concern and takes the
shared ``peer.site.Site`` (name, state dir, transport, coordinator link, jobs, runs, states):

- ``peer/assignment.py``: the checks an assignment must pass, its run, what every job is told;
- ``peer/schemas.py``: a run's payload schemas, its payload cap, the payload check;
- ``peer/receiving.py``: Handoff, TransferOffset, Prepare, RelayQuota, receipts;
- ``peer/relay_client.py`` (``RelayFetches``): payloads fetched from the relay;
- ``peer/local_work.py``: the train and aggregate jobs;
- ``peer/chain_visit.py`` / ``peer/star_visit.py``: a chain plan's visits, a star plan's visit;
- ``peer/sending.py``: deliveries with retry, relay fallback and revocation checks;
- ``peer/ending.py``: reroute, the run's end, the final model and its evaluation.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from fedrelay import __version__, tasks as task_registry, transfer_bounds
from fedrelay.transport import INSECURE, Transport
from fedrelay.peer.assignment import Assignments, InitialWeights
from fedrelay.peer.chain_visit import ChainVisit
from fedrelay.peer.ending import RunLife
from fedrelay.peer.local_work import LocalWork
from fedrelay.peer.monitoring import PeerMetrics
from fedrelay.peer.policy import POLICY_FILE, SitePolicy
from fedrelay.peer.receiving import Receiving
from fedrelay.peer.relay_client import RelayFetches
from fedrelay.peer.reporting import CoordinatorLink
from fedrelay.peer.runs import ACTIVE, Run, RunEnded
from fedrelay.peer.schemas import PayloadSchemas
from fedrelay.peer.sending import Sending
from fedrelay.peer.site import Site
from fedrelay.peer.star_visit import StarVisit
from fedrelay.peer.worker_pool import InlineRunner
from fedrelay.task import ModelSpec, SiteData
from fedrelay.tasks.offers import Offer
from fedrelay.v1 import common_pb2, peer_pb2

log = logging.getLogger("fedrelay.peer")

DEFAULT_STALL_TIMEOUT = transfer_bounds.STALL_TIMEOUT  # seconds


def _shared(name: str) -> property:
    """An attribute of the node that is its ``Site``'s (``peer/site.py``)."""
    return property(lambda self: getattr(self.site, name), lambda self, value: setattr(self.site, name, value),
                    doc=f"The site's ``{name}`` (``peer.site.Site``).")


class PeerNode:
    """A site's daemon logic, independent of gRPC plumbing (the servicer is a thin shell).

    The node never imports torch nor task code: its training, aggregation, evaluation and
    payload schemas are jobs (``peer/jobs.py``) run by ``jobs``, a ``peer.worker_pool.WorkerPool`` in
    the daemon (worker processes) or, by default, an ``InlineRunner`` on ``data`` in this process
    (tests). ``data``: the site's task offers (``fedrelay.tasks.offers.Offer`` list, as the daemon
    registered them), or a loaded ``fedrelay.SiteData`` of the default task (tests; also what
    the inline runner trains on). ``extra_tasks``: ``module:attr`` tasks offered
    (``peer serve --task``).
    """

    def __init__(self, name: str, address: str, data, state_dir: Path, device: str,
                 coordinator: CoordinatorLink | None, *, send_deadline: float = 1800.0,
                 start_workers: bool = True, transport: Transport = INSECURE,
                 stall_timeout: float = DEFAULT_STALL_TIMEOUT, weights_dir: Path | None = None, jobs=None,
                 extra_tasks: list[str] | tuple = (), policy: SitePolicy | None = None):
        self.site = Site(name, address, state_dir, transport, coordinator,
                         jobs if jobs is not None else InlineRunner(data, device),
                         send_deadline=send_deadline, start_workers=start_workers)
        # Initial-weights files this site holds (``--init file``), found by their SHA-256.
        self.weights = InitialWeights(Path(weights_dir) if weights_dir is not None else Path(state_dir) / "weights")
        self.offers: dict[str, Offer] = {o.name: o for o in _offers(data)}
        # The site's own policy (peer/policy.py): --policy FILE, else STATE_DIR/policy.toml if present.
        self.policy = policy if policy is not None else SitePolicy(self.state_dir / POLICY_FILE)
        self.schemas = PayloadSchemas(self.state_dir, self.jobs)
        self.assignments = Assignments(self.site, self.offers, list(extra_tasks), self.policy, self.weights,
                                       self.schemas)
        self.device = device
        self.sending = Sending(self.site)
        self.work = LocalWork(self.site, self.weights)
        self.chain = ChainVisit(self.site, self.work, self.sending)
        self.star = StarVisit(self.site, self.work, self.sending)
        self.receiving = Receiving(self.site, self.schemas, stall_timeout)
        self.streams = self.receiving.streams  # the Handoff streams open here
        self.refused_streams = self.receiving.refused_streams
        self.relay_fetches = RelayFetches(self.site, self.receiving)
        self.life = RunLife(self.site, self._start_worker, self.refused_streams)
        self.metrics = PeerMetrics(self)  # Prometheus metrics (peer/monitoring.py)
        self.started = time.time()
        self.instance = ""  # the daemon process's random id (RegisterRequest.instance), set by serve()
        self._load_runs()

    # What the site's modules share (peer/site.py), read and set through the node as before.
    name = _shared("name")
    address = _shared("address")
    state_dir = _shared("state_dir")
    transport = _shared("transport")
    coordinator = _shared("coordinator")
    jobs = _shared("jobs")
    runs = _shared("runs")
    stop = _shared("stop")
    reporter = _shared("reporter")
    metrics = _shared("metrics")
    revocations = _shared("revocations")
    relay_after = _shared("relay_after")
    send_deadline = _shared("send_deadline")
    start_workers = _shared("start_workers")

    # -- persistence -----------------------------------------------------------------------------
    def _load_runs(self) -> None:
        for folder in sorted((self.state_dir / "runs").glob("*")):
            try:
                run = Run.load(folder)
            except (OSError, ValueError) as exc:
                log.warning("ignoring unreadable run folder %s: %s", folder, exc)
                continue
            self.runs[run.run_id] = run

    def resume(self) -> None:
        """Restart the workers of runs that were active when the daemon stopped, and report the
        receipts the coordinator had not taken yet."""
        for run in self.runs.values():
            for key, r in run.receipts.items():
                if not r["reported"]:
                    self.receiving.send_receipt(run, key)
            if run.state in ACTIVE:
                log.info("resuming run %s (was %s)", run.run_id, run.state)
                self._start_worker(run)

    # -- coordinator calls -----------------------------------------------------------------------
    def assign(self, a: peer_pb2.Assignment) -> str:
        """Accept an assignment (idempotent; ``peer.assignment.Assignments.accept``). Raises
        ``ValueError`` when it cannot be run here, ``PolicyRefusal`` (a ``ValueError``) when a new
        run is outside the site's policy."""
        run, new = self.assignments.accept(a)
        if new:
            self.site.report_state(run)
            self._start_worker(run)
        return run.state

    def initial_weights(self, sha256: str) -> Path:
        """The initial-weights file with this SHA-256 (``peer.assignment.InitialWeights.find``)."""
        return self.weights.find(sha256)

    def check_task(self, spec: ModelSpec, class_index: list[str]) -> None:
        """Whether this site can run the task (``peer.assignment.Assignments.check_task``)."""
        self.assignments.check_task(spec, class_index)

    # -- receiving (peer/receiving.py) -------------------------------------------------------------------
    def handoff(self, chunks, caller: str | None = None) -> peer_pb2.HandoffReceipt:
        """``Peer.Handoff``: a model stream into this site (``peer.receiving.Receiving.handoff``).
        Raises ``TransferError``."""
        return self.receiving.handoff(chunks, caller)

    def transfer_offset(self, h: common_pb2.TransferHeader, caller: str | None = None) -> peer_pb2.TransferOffsetReply:
        """``Peer.TransferOffset`` (``peer.receiving.Receiving.transfer_offset``). Raises ``TransferError``."""
        return self.receiving.transfer_offset(h, caller)

    def prepare(self, run_id: str, sender: str, caller: str | None = None) -> bool:
        """``Peer.Prepare`` (``peer.receiving.Receiving.prepare``). Raises ``LookupError`` or ``PermissionError``."""
        return self.receiving.prepare(run_id, sender, caller)

    def relay_quota(self, run_id: str) -> int:
        """``Peer.RelayQuota`` (``peer.receiving.Receiving.relay_quota``). Raises ``LookupError`` or ``ValueError``."""
        return self.receiving.relay_quota(run_id)

    def relay_ready(self, notice: peer_pb2.RelayNotice) -> str:
        """``Peer.RelayReady`` (``peer.relay_client.RelayFetches.ready``). Raises ``TransferError``."""
        return self.relay_fetches.ready(notice)

    # -- the worker ---------------------------------------------------------------------------------
    def _start_worker(self, run: Run) -> None:
        if not self.start_workers:
            return
        threading.Thread(target=self._work, args=(run,), name=f"run-{run.run_id}", daemon=True).start()

    def _work(self, run: Run) -> None:
        """The run's visits at this site (``peer/chain_visit.py``, ``peer/star_visit.py``); a
        failure is reported and fails the run here."""
        try:
            if not run.lock.acquire(blocking=False):
                return  # a worker is already on this run
            try:
                (self.star if run.is_star else self.chain).steps(run)
            finally:
                run.lock.release()
        except RunEnded:
            log.info("run %s: ended by the coordinator; this site stopped working on it", run.run_id)
        except Exception as exc:  # noqa: BLE001 - every failure is reported, the daemon goes on
            log.exception("run %s failed", run.run_id)
            self.site.fail(run, f"{type(exc).__name__}: {exc}")

    # -- the run's later life (peer/ending.py) ----------------------------------------------------------
    def reroute(self, r: peer_pb2.RerouteRequest) -> str:
        """``Peer.Reroute`` (``peer.ending.RunLife.reroute``). Raises ``LookupError`` or ``ValueError``."""
        return self.life.reroute(r)

    def end_run(self, run_id: str, status: str, reason: str = "", cancelled_by: str = "") -> tuple[str, int]:
        """``Peer.EndRun`` (``peer.ending.RunLife.end_run``): ``(state, removed_bytes)``. Raises ``LookupError``."""
        return self.life.end_run(run_id, status, reason, cancelled_by)

    def final_model_path(self, run_id: str, sha256: str) -> Path:
        """The run's final model held here (``peer.ending.RunLife.final_model_path``). Raises ``LookupError``."""
        return self.life.final_model_path(run_id, sha256)

    def evaluate(self, run_id: str, sha256: str) -> peer_pb2.EvaluateReply:
        """``Peer.Evaluate`` (``peer.ending.RunLife.evaluate``). Raises ``LookupError`` or what the job raises."""
        return self.life.evaluate(run_id, sha256)

    def status(self) -> peer_pb2.PeerStatus:
        st = peer_pb2.PeerStatus(name=self.name, address=self.address, device=self.device, version=__version__,
                                 instance=self.instance)
        st.started = self.started
        if self.coordinator is not None:
            st.coordinator = self.coordinator.address
            st.last_registered = self.coordinator.last_registered
            st.registration_error = self.coordinator.registration_error
        for run in list(self.runs.values()):
            if run.state not in ACTIVE and not run.folder.exists():
                self.runs.pop(run.run_id, None)  # its files were pruned (`peer prune`) while the daemon ran
                continue
            st.runs.add(run_id=run.run_id, state=run.state, detail=run.detail)
        return st


def _offers(data) -> list[Offer]:
    """The site's offers: ``data`` as given (a list of ``Offer``), or, for a loaded
    ``fedrelay.SiteData`` (tests, the inline runner), an offer of the default task with its code's
    digest."""
    if isinstance(data, SiteData):
        inst = task_registry.find(task_registry.DEFAULT)
        from fedrelay.tasks.image_folder import ImageFolderTask

        return [Offer(name=inst.name, version=inst.version, sha256=inst.sha256, models=ImageFolderTask.models,
                      summary=data.summary(), augmentations=ImageFolderTask.augmentations)]
    return list(data)
