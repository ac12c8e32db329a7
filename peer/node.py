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
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import grpc

from fedrelay import purpose as purposes
from fedrelay import (__version__, params as run_params, privacy, registry, signing, tasks as task_registry,
                      transfer_bounds, wire)
from fedrelay.task import ModelSpec, SiteData
from fedrelay.tasks.offers import Offer
from fedrelay.peer.assignment import Assignments, InitialWeights, check_part, job_base, job_spec
from fedrelay.peer.receiving import Duplicate, Receiving
from fedrelay.peer.policy import POLICY_FILE, SitePolicy
from fedrelay.peer.monitoring import PeerMetrics
from fedrelay.peer.reporting import RETRYABLE, CoordinatorLink
from fedrelay.wire import backoff_delays
from fedrelay.peer.schemas import PayloadSchemas
from fedrelay.peer.runs import ACTIVE, Run, RunEnded, sent_key
from fedrelay.peer.site import Site
from fedrelay.peer import relaying
from fedrelay.peer.relaying import RelayUnavailable
from fedrelay.peer.transfer import Sent, SendCancelled, TransferError, check_header_fields, remove_partials, send_model
from fedrelay.sealing import SealError
from fedrelay.peer.workers import InlineRunner, JobCancelled
from fedrelay.v1 import common_pb2, coordinator_pb2 as cpb, peer_pb2, relay_pb2

log = logging.getLogger("fedrelay.peer")

DEFAULT_STALL_TIMEOUT = transfer_bounds.STALL_TIMEOUT  # seconds
SEAL_OVERHEAD = transfer_bounds.SEAL_OVERHEAD  # bytes a sealed envelope may add to its payload (header, certificate, GCM tags)
REROUTE_GRACE = 120.0  # seconds a final-model copy retries a refusal after a reroute (see _deliver)


def _shared(name: str) -> property:
    """An attribute of the node that is its ``Site``'s (``peer/site.py``)."""
    return property(lambda self: getattr(self.site, name), lambda self, value: setattr(self.site, name, value),
                    doc=f"The site's ``{name}`` (``peer.site.Site``).")


class PeerNode:
    """A site's daemon logic, independent of gRPC plumbing (the servicer is a thin shell).

    The node never imports torch nor task code: its training, aggregation, evaluation and
    payload schemas are jobs (``peer/jobs.py``) run by ``jobs``, a ``peer.workers.WorkerPool`` in
    the daemon (worker processes) or, by default, an ``InlineRunner`` on ``data`` in this process
    (tests). ``data``: the site's task offers (``fedrelay.tasks.offers.Offer`` list, as the daemon
    registered them), or a loaded ``fedrelay.SiteData`` of the default task (tests; also what
    the inline runner trains on). ``extra_tasks``: ``module:attr`` tasks offered
    (``peer serve --task``).
    """

    def __init__(self, name: str, address: str, data, state_dir: Path, device: str,
                 coordinator: CoordinatorLink | None, *, send_deadline: float = 1800.0,
                 start_workers: bool = True, transport: wire.Transport = wire.INSECURE,
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
        self.receiving = Receiving(self.site, self.schemas, stall_timeout)
        self.streams = self.receiving.streams  # the Handoff streams open here
        self.refused_streams = self.receiving.refused_streams
        self._fetching: set[tuple[str, str]] = set()  # (run, transfer) downloads from a relay under way
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

    # -- the worker ---------------------------------------------------------------------------------
    def _start_worker(self, run: Run) -> None:
        if not self.start_workers:
            return
        threading.Thread(target=self._work, args=(run,), name=f"run-{run.run_id}", daemon=True).start()

    def _work(self, run: Run) -> None:
        try:
            if not run.lock.acquire(blocking=False):
                return  # a worker is already on this run
            try:
                self._work_steps(run)
            finally:
                run.lock.release()
        except RunEnded:
            log.info("run %s: ended by the coordinator; this site stopped working on it", run.run_id)
        except Exception as exc:  # noqa: BLE001 - every failure is reported, the daemon goes on
            log.exception("run %s failed", run.run_id)
            self.site.fail(run, f"{type(exc).__name__}: {exc}")

    def _work_steps(self, run: Run) -> None:
        """Every visit of this site, in round order: wait for its hop (none at the chain's first
        visit), train, send the model on; the final site then copies the final model to every
        other site. The route may change meanwhile (``reroute``): each step reads the current
        part of the plan, so a visit that lost its hop is dropped, and one that became the
        chain's first starts afresh. A star plan: ``_work_star``."""
        if run.is_star:
            self._work_star(run)
            return
        r = 0
        while True:
            later = [v for v in run.visits if v > r]
            if not later:
                break
            r = later[0]
            outgoing = run.visit_dir(r) / "outgoing.safetensors"
            if not outgoing.exists():
                if not self._wait_for_hop(run, r):
                    if self.stop.is_set():
                        return
                    r = 0  # the route changed: look at the visits again from the start
                    continue
                self._train(run, r, outgoing)
            if not self._send_on(run, r, outgoing):
                if self.stop.is_set():
                    return
                r = 0
                continue
        self.site.set_state(run, "done", "")

    def _work_star(self, run: Run) -> None:
        """A star plan (a parallel one-shot method): train once from the run's initial model and
        write the upload (model + the aggregator's extra tensors); a site uploads it to the
        aggregator and is done (the final copy arrives later, by ``handoff``). The aggregator
        waits for the planned uploads (``_wait_for_uploads``), combines them with its own
        (``_aggregate``), copies the final model to every site whose upload it used and reports
        it, naming the sites whose upload never came."""
        outgoing = run.visit_dir(1) / "outgoing.safetensors"
        if not outgoing.exists():
            self._train(run, 1, outgoing)
        if not run.is_final_site:
            t = run.upload
            if t is not None:
                self.site.set_state(run, "sending", f"upload {t.index} to {t.receiver}")
                self._deliver(run, t, outgoing, wire.sha256_file(outgoing), outgoing.stat().st_size)
            self.site.set_state(run, "done", "")
            return
        final = run.final_model
        if not final.exists():
            arrived, missing = self._wait_for_uploads(run)
            if arrived is None:
                return  # the daemon stops; a restart carries on
            self._aggregate(run, outgoing, arrived, final)
            run.missing = missing
            run.save()
        sha, size = wire.sha256_file(final), final.stat().st_size
        run.final_sha256 = sha
        run.save()
        self.site.set_state(run, "distributing", "final model to every site")
        for c in run.final_copies:
            if c.receiver not in run.missing:
                self._deliver(run, c, final, sha, size)  # False: a reroute took the copy away
        self.site.report("ReportFinal", cpb.FinalReport(run_id=run.run_id, site=self.name, sha256=sha, model_bytes=size,
                                                    missing=run.missing))
        self.site.set_state(run, "done", "")

    def _wait_for_uploads(self, run: Run):
        """Wait, at a star plan's aggregator, until every planned upload has arrived, or
        ``--upload-timeout`` seconds (counted from now: after this site's own training, again
        after a restart) have passed. The plan may shrink meanwhile (the coordinator routed
        around a site that stayed down). Returns ``(arrived, missing)``: the planned uploads held
        (PlannedTransfer) and the senders not heard from; ``(None, [])`` when the daemon stops.
        Raises ``RunEnded``."""
        timeout = run_params.options(run_params.to_dict(run.assignment.params))["upload_timeout"]
        deadline = time.monotonic() + timeout
        while True:
            run.wake.clear()
            planned = run.uploads_in
            arrived = [t for t in planned if run.destination(t).exists()]
            missing = [t.sender for t in planned if t not in arrived]
            if not missing:
                return arrived, []
            if time.monotonic() >= deadline:
                log.warning("run %s: no upload from %s within %.0f s; combining the %d that arrived", run.run_id,
                            ", ".join(missing), timeout, len(arrived))
                return arrived, missing
            if self.stop.is_set():
                return None, []
            if run.ended.is_set():
                raise RunEnded(run.run_id)
            detail = f"{len(arrived)} of {len(planned)} uploads"
            if run.state != "receiving" or run.detail != detail:
                self.site.set_state(run, "receiving", detail)
            run.wake.wait(min(1.0, max(0.0, deadline - time.monotonic())))

    def _aggregate(self, run: Run, own: Path, arrived: list, final: Path) -> None:
        """Combine this site's own upload and the ``arrived`` ones with the run's aggregator and
        write the final model to ``final``: the ``aggregate`` job (``peer/jobs.py``) on a worker,
        with the site's train/validation split and the run's initial model."""
        a = run.assignment
        strategy = registry.strategy(a.params.strategy)
        uploads = {self.name: str(own), **{t.sender: str(run.destination(t)) for t in arrived}}
        req = {**job_base(self.name, run), "op": "aggregate", "uploads": uploads, "final": str(final),
               "initial": self.weights.initial_state(run)}
        with self.site.train_lock:
            answer = self._run_job(run, req, f"aggregating {len(uploads)} models ({strategy.aggregator})")
        log.info("run %s: aggregated %d models with %s in %.1f s", run.run_id, len(uploads), strategy.aggregator,
                 answer["seconds"])

    def _run_job(self, run: Run, req: dict, detail: str, images: int = 0) -> dict:
        """Run a training or aggregation job for ``run`` (under ``_train_lock``): the state turns
        "training" (``detail``) once its worker is ready; epochs are reported as they end; the
        coordinator's end of the run stops the job (``RunEnded``). Raises ``RunEnded`` and what
        the job raises (``peer.workers.WorkerDied`` / ``WorkerError``)."""
        if run.ended.is_set():  # ended while waiting for the site's hardware
            raise RunEnded(run.run_id)
        try:
            return self.jobs.run(req, run_id=run.run_id, on_event=self._epoch_reporter(run, images),
                                 cancelled=lambda: run.ended.is_set() or self.stop.is_set(),
                                 on_wait=lambda why: self.site.set_state(run, "assigned", why),
                                 on_start=lambda: self.site.set_state(run, "training", detail))
        except JobCancelled:
            raise RunEnded(run.run_id) from None

    def _epoch_reporter(self, run: Run, images: int = 0):
        def on_epoch(info: dict) -> None:
            self.metrics.epoch(run.run_id, info, info.get("images") or images)
            val_acc = info.get("val_accuracy")
            self.reporter.progress(cpb.ProgressReport(
                run_id=run.run_id, site=self.name, kind="epoch", stage=info["stage"], model=info["model"],
                epoch=info["epoch"], epochs=info["epochs"], train_loss=info["train_loss"],
                val_accuracy=-1.0 if val_acc is None else val_acc, seconds=info["seconds"]))
        return on_epoch

    def _wait_for_hop(self, run: Run, r: int) -> bool:
        """Wait until visit ``r``'s hop has arrived (True at once at the chain's first visit).
        False when the daemon stops or a reroute took the visit away. Raises ``RunEnded``."""
        while True:
            run.wake.clear()
            if r not in run.visits:
                return False
            t = run.inbound(r)
            if t is None or run.destination(t).exists():
                return True
            if run.state not in ("assigned", "receiving"):
                self.site.set_state(run, "assigned", f"waiting for hop {t.index} from {t.sender}")
            if self.stop.is_set():
                return False
            if run.ended.is_set():
                raise RunEnded(run.run_id)
            run.wake.wait(1.0)

    def _send_on(self, run: Run, r: int, outgoing: Path) -> bool:
        """Send visit ``r``'s model to the next visit, or, at the chain's last visit, copy the
        final model to every other site and report it. False when a reroute changed this
        visit's route meanwhile (the caller looks again) or the daemon stops."""
        sha = wire.sha256_file(outgoing)
        size = outgoing.stat().st_size
        while True:
            if r not in run.visits or self.stop.is_set():
                return False
            t = run.outbound(r)
            if t is None:  # the chain's last visit: this is the final model
                run.final_sha256 = sha
                run.save()
                self.site.set_state(run, "distributing", "final model to every site")
                if all(self._deliver(run, c, outgoing, sha, size) for c in run.final_copies) and run.is_final_site:
                    self.site.report("ReportFinal", cpb.FinalReport(run_id=run.run_id, site=self.name, sha256=sha,
                                                                model_bytes=size))
                    return True
                continue
            self.site.set_state(run, "sending", f"hop {t.index} to {t.receiver}")
            if self._deliver(run, t, outgoing, sha, size):
                return True

    def _train(self, run: Run, r: int, outgoing: Path) -> None:
        """Visit ``r``'s local training (the run's strategy, from the registry): the ``train``
        job (``peer/jobs.py``) on a worker. Round 1 seeds are ``derive_seed(seed, "site",
        position)`` (a one-shot run's); round r > 1 adds ``("round", r)``. The warm-up happens
        only at the chain's first visit (no hop in). The receiver of this visit's model is told
        first (``Peer.Prepare``), so that its worker starts while this site trains."""
        a = run.assignment
        folder = run.visit_dir(r)
        t = run.inbound(r)
        req = {**job_base(self.name, run), "op": "train", "position": a.position, "round": r, "folder": str(folder),
               "received": str(run.destination(t)) if t is not None else None, "outgoing": str(outgoing),
               "initial": None}
        if t is None and not (folder / "warmup.safetensors").exists():
            req["initial"] = self.weights.initial_state(run)
        if not run.is_star:
            req["aggregator"] = ""  # a chain's hop carries the model only
        if privacy.enabled(a.params):  # DP-SGD: a target epsilon is spread over the site's epochs of the run
            req["privacy_epochs"] = privacy.planned_epochs_of(req["params"], len(run.visits),
                                                              run.inbound(min(run.visits)) is None)
        with self.site.train_lock:
            self._tell_receiver(run, r)
            answer = self._run_job(run, req, f"round {r}" if (a.rounds or 1) > 1 else "")
        log.info("run %s: round %d: trained %d pool models in %.1f s", run.run_id, r, answer["pool"],
                 answer["seconds"])

    def _tell_receiver(self, run: Run, r: int) -> None:
        """``Peer.Prepare`` to the receiver of visit ``r``'s model (a chain's next visit), in the
        background; a hint only: failures are logged at debug level."""
        t = None if run.is_star else run.outbound(r)
        if t is None or t.receiver == self.name:
            return
        to = run.peer(t.receiver)

        def tell() -> None:
            from fedrelay.v1 import peer_pb2_grpc

            try:
                channel = self.transport.channel(to.address, expect=to.name)
                try:
                    peer_pb2_grpc.PeerStub(channel).Prepare(peer_pb2.PrepareRequest(run_id=run.run_id, sender=self.name),
                                                            timeout=wire.CONTROL_TIMEOUT)
                finally:
                    channel.close()
            except Exception as exc:  # noqa: BLE001 - a hint
                log.debug("run %s: could not tell %s to prepare: %s", run.run_id, to.name, exc)

        if to.address:
            threading.Thread(target=tell, daemon=True, name=f"prepare-{to.name}").start()

    def _deliver(self, run: Run, t: common_pb2.PlannedTransfer, path: Path, sha: str, size: int) -> bool:
        """Send ``path`` for the planned transfer ``t`` with retries (exponential backoff and
        jitter), then report it to the coordinator.

        Direct first: the stream goes to the receiver's address. A receiver that only connects
        out (no address), or one not reached directly for ``relay_after`` seconds (0: never),
        gets the payload through the relay instead, sealed to its certificate key
        (``peer/relaying.py``); the report then says ``route = "relayed"``.

        Returns False, having sent nothing, when a reroute took ``t`` off this site's part of the
        plan meanwhile; True once delivered (or delivered before)."""
        key = sent_key(t)
        if key in run.sent:
            return True
        header = common_pb2.TransferHeader(run_id=run.run_id, hop=t.index, sender=self.name, total_bytes=size,
                                           sha256=sha, purpose=t.purpose)
        to = run.peer(t.receiver)
        version = run.assignment.route_version
        started = time.monotonic()
        deadline = started + self.send_deadline
        counter, attempts = [0], 0  # bytes put on the wire by every attempt; streams begun
        relayed = not to.address
        for delay in backoff_delays():
            if run.ended.is_set():
                raise RunEnded(run.run_id)
            if run.assignment.route_version != version and not self._still_planned(run, t):
                log.info("run %s: %s to %s is no longer in this site's plan; not sending it", run.run_id,
                         purposes.said(t.purpose), t.receiver)
                return False
            if self._revoked(to.name, run, t, deadline, delay):  # wait for the coordinator's reroute
                continue
            try:
                attempts += 1
                if relayed:
                    sent = self._send_relayed(run, t, path, counter)
                else:  # under TLS the receiver's certificate must name the site we mean to reach
                    sent = send_model(to.address, header, path, transport=self.transport, expect=to.name,
                                      counter=counter,
                                      cancelled=lambda: run.ended.is_set() or self._is_revoked(to.name))
                break
            except SendCancelled:  # the coordinator ended the run mid-stream, or revoked the receiver
                if run.ended.is_set():
                    raise RunEnded(run.run_id) from None
                log.warning("run %s: stopped sending %s %d to %s mid-stream: its certificate was revoked", run.run_id,
                            purposes.said(t.purpose), t.index, to.name)
            except (RelayUnavailable, SealError) as exc:
                raise RuntimeError(f"cannot send {purposes.said(t.purpose)} {t.index} to {to.name} through the "
                                   f"relay: {exc}") from exc
            except relaying.NoCertificateYet as exc:  # the coordinator restarted: the receiver registers again soon
                if time.monotonic() + delay > deadline:
                    raise RuntimeError(f"cannot send to {to.name} through the relay: {exc}") from exc
                log.warning("run %s: %s; retrying in %.1f s", run.run_id, exc, delay)
                self._pause(run, delay)
                if self.stop.is_set():
                    raise RuntimeError("daemon stopping") from exc
            except grpc.RpcError as exc:
                if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and not relayed:
                    to = self._resolve(to)
                    waited = time.monotonic() - started
                    if not to.address or (self.relay_after and waited >= self.relay_after and self.transport.secure):
                        relayed = True
                        log.warning("run %s: %s not reached directly%s; sending through the relay at %s", run.run_id,
                                    to.name, f" for {waited:.0f} s" if to.address else " (it connects out only)",
                                    self.site.relay_address)
                # A receiver may not know yet that a reroute changed its plan (a final copy from a
                # new final site, a hop from a new sender): its refusal is retried for a while (the
                # route reaches it within seconds).
                rerouting = (exc.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT)
                             and run.assignment.route_version > 0 and time.monotonic() - started < REROUTE_GRACE)
                where = f"the relay at {self.site.relay_address}" if relayed else f"{to.name} at {to.address}"
                if (exc.code() not in RETRYABLE and not rerouting) or time.monotonic() + delay > deadline:
                    raise RuntimeError(f"cannot deliver to {where}: {wire.status_message(exc)}") from exc
                log.warning("run %s: delivery to %s failed (%s); retrying in %.1f s", run.run_id, where,
                            wire.status_message(exc), delay)
                self._pause(run, delay)
                if self.stop.is_set():
                    raise RuntimeError("daemon stopping") from exc
                run.rerouted.clear()
        if run.run_status == "cancelled":  # stopped while the last chunks went out: report nothing more
            raise RunEnded(run.run_id)
        if sent.receipt.duplicate:  # a retry of a transfer that had arrived: acknowledged, no effect
            log.info("run %s: %s already held this model (sha256 %s)", run.run_id,
                     "the relay" if relayed else to.name, sha[:12])
        if sent.resumed_from:
            log.info("run %s: resumed the transfer to %s at byte %d of %d", run.run_id,
                     "the relay" if relayed else to.name, sent.resumed_from, sent.payload_bytes)
        self.site.report("ReportHop", cpb.HopReport(
            run_id=run.run_id, hop=t.index, purpose=t.purpose, sender=self.name, receiver=to.name,
            payload_bytes=size, wire_bytes=counter[0], sha256=sha, started=sent.started,
            ended=sent.ended, attempts=attempts, resumed_from=sent.resumed_from, round=t.round,
            schema_sha256=wire.schema_digest(path), route=sent.route, sealed_bytes=sent.sealed_bytes,
            relay=sent.relay, sealed_sha256=sent.sealed_sha256))
        self.metrics.delivered(t.purpose, size, counter[0], attempts, sent.resumed_from)
        run.sent.append(key)
        run.save()
        if relayed:  # the relay holds the envelope now: this site needs its copy no more
            for envelope in run.path("sealed").glob(f"{purposes.BY_WIRE[t.purpose]}-{t.index}-{t.receiver}-*.sealed"):
                envelope.unlink(missing_ok=True)
        return True

    def _send_relayed(self, run: Run, t: common_pb2.PlannedTransfer, path: Path, counter: list[int]) -> Sent:
        """One attempt at sending ``path`` through the relay: sealed to the receiver's
        certificate (asked of the coordinator), then streamed to the relay from the bytes it
        holds. Raises ``grpc.RpcError``, ``RelayUnavailable`` or ``SealError``."""
        if self.coordinator is None:
            raise RelayUnavailable("no coordinator to ask for the receiver's certificate")
        ref = self.coordinator.stub.ResolveSite(cpb.ResolveSiteRequest(name=t.receiver), timeout=wire.CONTROL_TIMEOUT)
        sealed, sealed_bytes, sealed_sha = relaying.seal(self.transport, run.run_id, t, path, ref.certificate,
                                                         run.path("sealed"))
        relay = self.site.relay_address
        grant = None
        if self.coordinator.relay:  # the operator's relay carries only what the coordinator granted
            grant = self.coordinator.stub.GrantRelay(cpb.RelayGrantRequest(
                run_id=run.run_id, purpose=t.purpose, index=t.index, receiver=t.receiver), timeout=wire.CONTROL_TIMEOUT)
        sent = relaying.put(relay, self.transport, run.run_id, t, sealed, counter, cancelled=run.ended.is_set,
                            grant=grant)
        sent.route, sent.relay, sent.sealed_bytes, sent.sealed_sha256 = "relayed", relay, sealed_bytes, sealed_sha
        return sent

    # -- receiving through the relay ---------------------------------------------------------------
    def relay_ready(self, notice: peer_pb2.RelayNotice) -> str:
        """``Peer.RelayReady``: the envelope of a transfer into this site waits at a relay. Starts
        fetching it in the background (once: a second notice while it runs, or after the payload
        was kept, has no effect). Returns "fetching" or "held". Raises ``TransferError`` (no such
        run, a transfer not planned into this site from that sender)."""
        h = common_pb2.TransferHeader(run_id=notice.run_id, hop=notice.index, sender=notice.sender,
                                      purpose=notice.purpose, total_bytes=max(1, notice.sealed_bytes),
                                      sha256=notice.sealed_sha256)
        check_header_fields(h)
        try:  # answered at once: the size is checked against the run's cap in the fetch's thread
            run, t, dest = self.receiving.check_transfer(h, None, check_cap=False)
        except Duplicate:
            return "held"
        key = (run.run_id, sent_key(t))
        with self.site.lock:
            if key in self._fetching:
                return "fetching"
            self._fetching.add(key)
        threading.Thread(target=self._fetch_relayed, args=(run, t, notice, key), daemon=True,
                         name=f"fetch-{run.run_id}-{sent_key(t)}").start()
        return "fetching"

    def _fetch_relayed(self, run: Run, t: common_pb2.PlannedTransfer, notice: peer_pb2.RelayNotice, key) -> None:
        """Download, open and keep a relayed payload; retried (the daemons' backoff) while the
        relay cannot be reached, until the run ends or the daemon stops. A payload that fails
        its checks (signature, decryption, digest, schema) is refused: logged, reported as the
        run's failure at this site, and its envelope left at the relay."""
        relay = notice.relay or self.site.relay_address
        rkey = relay_pb2.RelayKey(run_id=run.run_id, purpose=t.purpose, index=t.index, receiver=self.name)
        sealed = run.path("relay-in") / f"{sent_key(t).replace(':', '-')}.sealed"
        dest = run.destination(t)
        counter = [0]
        try:
            self.receiving.check_cap(run, notice.sealed_bytes - SEAL_OVERHEAD)
            for delay in backoff_delays():
                if run.ended.is_set() or self.stop.is_set() or dest.exists():
                    return
                try:
                    if not (sealed.exists() and wire.sha256_file(sealed) == notice.sealed_sha256):
                        relaying.fetch(relay, self.transport, rkey, t.sender, sealed, notice.sealed_bytes,
                                       notice.sealed_sha256, counter)
                    break
                except (grpc.RpcError, TransferError) as exc:
                    msg = wire.status_message(exc) if isinstance(exc, grpc.RpcError) else exc.message
                    log.warning("run %s: fetching %s %d from the relay at %s failed (%s); retrying in %.1f s",
                                run.run_id, purposes.said(t.purpose), t.index, relay, msg, delay)
                    self.stop.wait(delay)
            plain = dest.parent / f".{dest.name}.relayed.part"
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                relaying.open_envelope(self.transport, sealed, plain, run.run_id, t)
                size, sha = plain.stat().st_size, wire.sha256_file(plain)
                self.schemas.check_model_bytes(run.assignment, plain.read_bytes(), t.purpose)
                if dest.exists():  # the same transfer arrived directly meanwhile
                    plain.unlink(missing_ok=True)
                    return
                plain.replace(dest)
            except (SealError, ValueError) as exc:
                plain.unlink(missing_ok=True)
                raise RuntimeError(f"refused the relayed {purposes.said(t.purpose)} {t.index} from {t.sender}: {exc}") from exc
            self.receiving.kept(run, t, dest, size, sha, route="relayed", relay_wire_bytes=counter[0])
            sealed.unlink(missing_ok=True)
            try:
                relaying.discard(relay, self.transport, rkey)
            except grpc.RpcError as exc:  # the relay drops the run's envelopes when it ends anyway
                log.info("run %s: the relay did not discard the envelope: %s", run.run_id, wire.status_message(exc))
        except Exception as exc:  # noqa: BLE001 - a background thread says so and fails its run
            log.error("run %s: %s", run.run_id, exc)
            self.site.fail(run, str(exc))
        finally:
            with self.site.lock:
                self._fetching.discard(key)

    def _pause(self, run: Run, seconds: float) -> None:
        """Wait up to ``seconds`` between delivery attempts; back early when the daemon stops,
        the run is rerouted or the coordinator ends it."""
        until = time.monotonic() + seconds
        while not (self.stop.is_set() or run.rerouted.is_set() or run.ended.is_set()):
            left = until - time.monotonic()
            if left <= 0:
                return
            self.stop.wait(min(left, 0.25))

    def _resolve(self, to: common_pb2.SiteRef) -> common_pb2.SiteRef:
        """``to`` at the address its daemon last registered with the coordinator (it may have
        come back elsewhere); ``to`` itself when the coordinator cannot say. Under TLS the
        receiver's certificate must still name ``to.name``: a wrong address cannot impersonate."""
        if self.coordinator is None:
            return to
        try:
            now = self.coordinator.stub.ResolveSite(cpb.ResolveSiteRequest(name=to.name), timeout=wire.CONTROL_TIMEOUT)
        except grpc.RpcError as exc:
            log.debug("could not resolve %s: %s", to.name, wire.status_message(exc))
            return to
        if now.address and now.address != to.address:
            log.info("%s moved from %s to %s", to.name, to.address, now.address)
            return common_pb2.SiteRef(name=to.name, address=now.address)
        return to

    def _is_revoked(self, name: str) -> bool:
        return self.revocations is not None and self.revocations.revoked_name(name) is not None

    def _revoked(self, name: str, run: Run, t: common_pb2.PlannedTransfer, deadline: float, delay: float) -> bool:
        """True (after a pause) when ``name`` is revoked: nothing is sent to it; the coordinator
        routes the run around it, and the reroute ends the wait (``_deliver`` finds ``t`` off
        the plan). Raises ``RuntimeError`` past ``deadline`` (monotonic seconds)."""
        if not self._is_revoked(name):
            return False
        if time.monotonic() + delay > deadline:
            raise RuntimeError(f"cannot deliver to {name}: its certificate was "
                               f"{self.revocations.revoked_name(name).describe()}")
        log.warning("run %s: not sending %s %d to %s: its certificate was revoked; waiting for the coordinator "
                    "to route around it", run.run_id, purposes.said(t.purpose), t.index, name)
        self._pause(run, delay)
        if self.stop.is_set():
            raise RuntimeError("daemon stopping")
        return True

    @staticmethod
    def _still_planned(run: Run, t: common_pb2.PlannedTransfer) -> bool:
        return any(p == t for p in run.assignment.transfers)

    # -- rerouting --------------------------------------------------------------------------------------
    def reroute(self, r: peer_pb2.RerouteRequest) -> str:
        """Take a new part of the run's plan from the coordinator (idempotent per route version).

        The assignment's transfers, peers and visits are replaced and persisted. A site that had
        finished (its model delivered to a site that then stayed down) starts again from its
        outgoing model, which it still holds. Raises ``LookupError`` (unknown run) or
        ``ValueError`` (a stale or inconsistent route).
        """
        run = self.runs.get(r.run_id)
        if run is None:
            raise LookupError(f"unknown run {r.run_id!r}")
        with self.site.route_lock:
            a = run.assignment
            if r.route_version <= a.route_version:
                return run.state  # already applied
            check_part(self.name, a.order, a.rounds or 1, r.transfers, r.peers, r.visits)
            new = peer_pb2.Assignment()
            new.CopyFrom(a)
            for name in ("transfers", "peers", "visits"):
                new.ClearField(name)
                getattr(new, name).extend(getattr(r, name))
            new.route_version = r.route_version
            run.save_assignment(new)
            hops = ", ".join(f"hop {t.index} {t.sender}->{t.receiver}" for t in r.transfers
                             if t.purpose == common_pb2.CHAIN_HOP) or "none"
            log.info("run %s: rerouted (v%d): visits %s, hops %s; skipped %s", r.run_id, r.route_version,
                     list(r.visits), hops, ", ".join(r.skipped) or "none")
            run.rerouted.set()
            run.wake.set()
            restart = run.state in ("done", "failed") and any(
                (run.visit_dir(v) / "outgoing.safetensors").exists() for v in run.visits)
        if restart:
            self.site.set_state(run, "sending", "rerouted")
            self._start_worker(run)
        return run.state

    def end_run(self, run_id: str, status: str, reason: str = "", cancelled_by: str = "") -> tuple[str, int]:
        """The coordinator says the run is over (``status`` "finished", "failed" or "cancelled"
        (stopped by ``cancelled_by``); idempotent).

        A run still active here (this site was routed around, or the run failed elsewhere)
        moves to the terminal state "ended": a worker waiting for a model stops waiting, a
        training stops at the end of its epoch, a delivery stops retrying, and a Handoff for the
        run is refused. A run that is done or failed here keeps its state. Either way the
        partial files of transfers that will never complete (``transfer.partial_path``) are
        removed; the models held (received, outgoing, final) stay. The first notice is persisted
        (``Run.run_status``, ``run_ended``: what ``peer prune`` goes by). After a cancellation the
        site reports nothing more for the run (not even its state "ended").

        Returns ``(state, removed_bytes)``. Raises ``LookupError`` for an unknown run.
        """
        run = self.runs.get(run_id)
        if run is None:
            raise LookupError(f"unknown run {run_id!r}")
        with self.site.route_lock:
            newly = run.state in ACTIVE and not run.ended.is_set()
            if newly:
                run.ended.set()
                run.wake.set()
            first_notice = not run.run_status
            if first_notice:
                run.run_status, run.run_ended = status, time.time()
        why = f"cancelled by {cancelled_by or 'the operator'}" if status == "cancelled" else f"run {status} at the coordinator"
        if newly:
            self.site.set_state(run, "ended", why + (f": {reason}" if reason else ""), force=True,
                            report=status != "cancelled")
        elif first_notice and run.folder.is_dir():
            run.save()
        self.jobs.drop(run_id)  # a worker started ahead for the run is not needed any more
        self.refused_streams.forget(run_id)
        removed = sum(remove_partials(folder) for folder in
                      {run.folder, run.path("uploads"), run.path("relay-in"),
                       *(run.visit_dir(v) for v in range(1, (run.assignment.rounds or 1) + 1))}
                      if folder.is_dir())
        if removed:
            log.info("run %s: removed %d bytes of partial transfers", run_id, removed)
        return run.state, removed

    # -- evaluation and status ------------------------------------------------------------------------
    def final_model_path(self, run_id: str, sha256: str) -> Path:
        """The run's final model held here. Raises ``LookupError`` when there is none (or another)."""
        run = self.runs.get(run_id)
        if run is None:
            raise LookupError(f"unknown run {run_id!r}")
        path = run.final_model
        if not path.exists():
            raise LookupError(f"this site holds no final model of run {run_id}")
        have = wire.sha256_file(path)
        if sha256 and have != sha256:
            raise LookupError(f"the final model held here has sha256 {have}, not {sha256}")
        return path

    def evaluate(self, run_id: str, sha256: str) -> peer_pb2.EvaluateReply:
        """Accuracy, metrics and aggregate statistics of the run's final model on this site's test
        split (``fedrelay.scoring``): the ``evaluate`` job on a worker (waiting for a host slot like
        any job: at most that many evaluations at once on one machine). The reply names the run
        and the model's SHA-256 and, under TLS, is signed with this site's key
        (``fedrelay/signing.py``): the coordinator records only a verified one. Raises
        ``LookupError`` (no such final model here) or what the job raises."""
        path = self.final_model_path(run_id, sha256)
        sha256 = sha256 or wire.sha256_file(path)
        a = self.runs[run_id].assignment
        started = time.time()
        req = {"op": "evaluate", "model": str(path), "spec": job_spec(a), "class_index": list(a.class_index)}
        if privacy.enabled(a.params):  # the site's spent (epsilon, delta), from every visit's book
            req.update(params=run_params.to_dict(a.params), privacy_books=[
                str(p) for p in sorted(self.runs[run_id].folder.glob(f"**/{privacy.BOOK}"))])
        answer = self.jobs.run(req, cancelled=self.stop.is_set)
        correct, total = answer["correct"], answer["total"]
        reply = peer_pb2.EvaluateReply(site=self.name, correct=correct, test_samples=total, run_id=run_id,
                                       sha256=sha256, accuracy=correct / total if total else 0.0,
                                       seconds=time.time() - started, metrics=answer.get("metrics") or {},
                                       stats_json=json.dumps(answer.get("stats") or {}, separators=(",", ":")))
        signer = signing.signer_for(self.transport)  # TLS: signed with this site's key for the ledger
        return signer.sign(reply) if signer is not None else reply

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
                      summary=data.summary())]
    return list(data)
