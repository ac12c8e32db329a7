"""A run's later life at a site: a new part of the plan from the coordinator (``Peer.Reroute``),
the coordinator's end of the run (``Peer.EndRun``: the run stops here, partial transfers go),
and the final model held here and its evaluation on the site's test split (``Peer.Evaluate``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

from fedrelay import params as run_params, privacy, signing
from fedrelay.files import sha256_file
from fedrelay.peer.assignment import check_part, job_spec
from fedrelay.peer.refusals import RefusedStreams
from fedrelay.peer.runs import ACTIVE, Run
from fedrelay.peer.site import Site
from fedrelay.receiving import remove_partials
from fedrelay.peer.worker_protocol import EvaluateJob
from fedrelay.v1 import common_pb2, peer_pb2

log = logging.getLogger("fedrelay.peer")


class RunLife:
    """Reroutes, ends and evaluates one site's runs (``start_worker``: starts a run's visits
    again; ``refused_streams``: the failed streams counted per run and sender)."""

    def __init__(self, site: Site, start_worker: Callable[[Run], None], refused_streams: RefusedStreams):
        self.site = site
        self.start_worker = start_worker
        self.refused_streams = refused_streams

    def reroute(self, r: peer_pb2.RerouteRequest) -> str:
        """Take a new part of the run's plan from the coordinator (idempotent per route version).

        The assignment's transfers, peers and visits are replaced and persisted. A site that had
        finished (its model delivered to a site that then stayed down) starts again from its
        outgoing model, which it still holds. Raises ``LookupError`` (unknown run) or
        ``ValueError`` (a stale or inconsistent route).
        """
        run = self.site.runs.get(r.run_id)
        if run is None:
            raise LookupError(f"unknown run {r.run_id!r}")
        with self.site.route_lock:
            a = run.assignment
            if r.route_version <= a.route_version:
                return run.state  # already applied
            check_part(self.site.name, a.order, a.rounds or 1, r.transfers, r.peers, r.visits)
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
            self.start_worker(run)
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
        run = self.site.runs.get(run_id)
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
        self.site.jobs.drop(run_id)  # a worker started ahead for the run is not needed any more
        self.refused_streams.forget(run_id)
        removed = sum(remove_partials(folder) for folder in
                      {run.folder, run.path("uploads"), run.path("relay-in"),
                       *(run.visit_dir(v) for v in range(1, (run.assignment.rounds or 1) + 1))}
                      if folder.is_dir())
        if removed:
            log.info("run %s: removed %d bytes of partial transfers", run_id, removed)
        return run.state, removed

    def final_model_path(self, run_id: str, sha256: str) -> Path:
        """The run's final model held here. Raises ``LookupError`` when there is none (or another)."""
        run = self.site.runs.get(run_id)
        if run is None:
            raise LookupError(f"unknown run {run_id!r}")
        path = run.final_model
        if not path.exists():
            raise LookupError(f"this site holds no final model of run {run_id}")
        have = sha256_file(path)
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
        sha256 = sha256 or sha256_file(path)
        a = self.site.runs[run_id].assignment
        started = time.time()
        req = {"op": "evaluate", "model": str(path), "spec": job_spec(a), "class_index": list(a.class_index)}
        if privacy.enabled(a.params):  # the site's spent (epsilon, delta), from every visit's book
            req.update(params=run_params.to_dict(a.params), privacy_books=[
                str(p) for p in sorted(self.site.runs[run_id].folder.glob(f"**/{privacy.BOOK}"))])
        answer = self.site.jobs.run(EvaluateJob.from_dict(req), cancelled=self.site.stop.is_set)
        correct, total = answer["correct"], answer["total"]
        reply = peer_pb2.EvaluateReply(site=self.site.name, correct=correct, test_samples=total, run_id=run_id,
                                       sha256=sha256, accuracy=correct / total if total else 0.0,
                                       seconds=time.time() - started, metrics=answer.get("metrics") or {},
                                       stats_json=json.dumps(answer.get("stats") or {}, separators=(",", ":")))
        signer = signing.signer_for(self.site.transport)  # TLS: signed with this site's key for the ledger
        return signer.sign(reply) if signer is not None else reply
