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
from fedrelay import (__version__, params as run_params, privacy, signing, tasks as task_registry,
                      transfer_bounds, wire)
from fedrelay.task import ModelSpec, SiteData
from fedrelay.tasks.offers import Offer
from fedrelay.peer.assignment import Assignments, InitialWeights, check_part, job_spec
from fedrelay.peer.receiving import Duplicate, Receiving
from fedrelay.peer.sending import Sending
from fedrelay.peer.chain_visit import ChainVisit
from fedrelay.peer.local_work import LocalWork
from fedrelay.peer.star_visit import StarVisit
from fedrelay.peer.policy import POLICY_FILE, SitePolicy
from fedrelay.peer.monitoring import PeerMetrics
from fedrelay.peer.reporting import CoordinatorLink
from fedrelay.wire import backoff_delays
from fedrelay.peer.schemas import PayloadSchemas
from fedrelay.peer.runs import ACTIVE, Run, RunEnded, sent_key
from fedrelay.peer.site import Site
from fedrelay.peer import relaying
from fedrelay.peer.transfer import TransferError, check_header_fields, remove_partials
from fedrelay.sealing import SealError
from fedrelay.peer.workers import InlineRunner
from fedrelay.v1 import common_pb2, peer_pb2, relay_pb2

log = logging.getLogger("fedrelay.peer")

DEFAULT_STALL_TIMEOUT = transfer_bounds.STALL_TIMEOUT  # seconds
SEAL_OVERHEAD = transfer_bounds.SEAL_OVERHEAD  # bytes a sealed envelope may add to its payload (header, certificate, GCM tags)


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
        self.sending = Sending(self.site)
        self.work = LocalWork(self.site, self.weights)
        self.chain = ChainVisit(self.site, self.work, self.sending)
        self.star = StarVisit(self.site, self.work, self.sending)
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
