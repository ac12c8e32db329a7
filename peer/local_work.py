"""A site's own work on a run's models: a visit's local training (the ``train`` job), a star
plan's aggregation (the ``aggregate`` job), run on a worker (``peer/jobs.py``) one at a time on
the site's hardware, with the epochs reported as they end; and the hint to the receiver of the
model being trained (``Peer.Prepare``) so that its worker starts meanwhile.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from fedrelay import privacy, registry
from fedrelay.calls import CONTROL_TIMEOUT
from fedrelay.peer.assignment import InitialWeights, job_base
from fedrelay.peer.runs import Run, RunEnded
from fedrelay.peer.site import Site
from fedrelay.peer.worker_protocol import AggregateJob, TrainJob
from fedrelay.peer.worker_pool import JobCancelled
from fedrelay.v1 import coordinator_pb2 as cpb, peer_pb2

log = logging.getLogger("fedrelay.peer")


class LocalWork:
    """Runs one site's training and aggregation jobs (``weights``: its initial-weights files)."""

    def __init__(self, site: Site, weights: InitialWeights):
        self.site = site
        self.weights = weights

    def train(self, run: Run, r: int, outgoing: Path) -> None:
        """Visit ``r``'s local training (the run's strategy, from the registry): the ``train``
        job (``peer/jobs.py``) on a worker. Round 1 seeds are ``derive_seed(seed, "site",
        position)`` (a one-shot run's); round r > 1 adds ``("round", r)``. The warm-up happens
        only at the chain's first visit (no hop in). The receiver of this visit's model is told
        (``Peer.Prepare``) as this site's worker starts the job, holding its slot, so that the
        receiver's worker starts while this site trains and never takes the slot it waits for."""
        a = run.assignment
        folder = run.visit_dir(r)
        t = run.inbound(r)
        req = {**job_base(self.site.name, run), "op": "train", "position": a.position, "round": r, "folder": str(folder),
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
            # The receiver is told once this site's worker holds its slot, not before: a worker
            # the receiver starts ahead on the same host must not take the slot this training
            # waits for (with --worker-slots 1 the chain then stalled until the warm worker's
            # timeout, 300 s).
            answer = self.run_job(run, TrainJob.from_dict(req), f"round {r}" if (a.rounds or 1) > 1 else "",
                                  on_start=lambda: self.tell_receiver(run, r))
        log.info("run %s: round %d: trained %d pool models in %.1f s", run.run_id, r, answer["pool"],
                 answer["seconds"])

    def tell_receiver(self, run: Run, r: int) -> None:
        """``Peer.Prepare`` to the receiver of visit ``r``'s model (a chain's next visit), in the
        background; a hint only: failures are logged at debug level."""
        t = None if run.is_star else run.outbound(r)
        if t is None or t.receiver == self.site.name:
            return
        to = run.peer(t.receiver)

        def tell() -> None:
            from fedrelay.v1 import peer_pb2_grpc

            try:
                channel = self.site.transport.channel(to.address, expect=to.name)
                try:
                    peer_pb2_grpc.PeerStub(channel).Prepare(peer_pb2.PrepareRequest(run_id=run.run_id, sender=self.site.name),
                                                            timeout=CONTROL_TIMEOUT)
                finally:
                    channel.close()
            except Exception as exc:  # noqa: BLE001 - a hint
                log.debug("run %s: could not tell %s to prepare: %s", run.run_id, to.name, exc)

        if to.address:
            threading.Thread(target=tell, daemon=True, name=f"prepare-{to.name}").start()

    def aggregate(self, run: Run, own: Path, arrived: list, final: Path) -> None:
        """Combine this site's own upload and the ``arrived`` ones with the run's aggregator and
        write the final model to ``final``: the ``aggregate`` job (``peer/jobs.py``) on a worker,
        with the site's train/validation split and the run's initial model."""
        a = run.assignment
        strategy = registry.strategy(a.params.strategy)
        uploads = {self.site.name: str(own), **{t.sender: str(run.destination(t)) for t in arrived}}
        req = {**job_base(self.site.name, run), "op": "aggregate", "uploads": uploads, "final": str(final),
               "initial": self.weights.initial_state(run)}
        with self.site.train_lock:
            answer = self.run_job(run, AggregateJob.from_dict(req), f"aggregating {len(uploads)} models ({strategy.aggregator})")
        log.info("run %s: aggregated %d models with %s in %.1f s", run.run_id, len(uploads), strategy.aggregator,
                 answer["seconds"])

    def run_job(self, run: Run, req: TrainJob | AggregateJob, detail: str, images: int = 0,
                on_start: Callable[[], None] | None = None) -> dict:
        """Run a training or aggregation job for ``run`` (under the site's ``train_lock``): the state turns
        "training" (``detail``) once its worker is ready (holding a worker slot), and ``on_start()``
        is called then; epochs are reported as they end; the coordinator's end of the run stops
        the job (``RunEnded``). Raises ``RunEnded`` and what the job raises
        (``peer.worker_pool.WorkerDied`` / ``WorkerError``)."""

        def started() -> None:
            self.site.set_state(run, "training", detail)
            if on_start is not None:
                on_start()

        if run.ended.is_set():  # ended while waiting for the site's hardware
            raise RunEnded(run.run_id)
        try:
            return self.site.jobs.run(req, run_id=run.run_id, on_event=self.epoch_reporter(run, images),
                                 cancelled=lambda: run.ended.is_set() or self.site.stop.is_set(),
                                 on_wait=lambda why: self.site.set_state(run, "assigned", why),
                                 on_start=started)
        except JobCancelled:
            raise RunEnded(run.run_id) from None

    def epoch_reporter(self, run: Run, images: int = 0):
        def on_epoch(info: dict) -> None:
            self.site.metrics.epoch(run.run_id, info, info.get("images") or images)
            val_acc = info.get("val_accuracy")
            self.site.reporter.progress(cpb.ProgressReport(
                run_id=run.run_id, site=self.site.name, kind="epoch", stage=info["stage"], model=info["model"],
                epoch=info["epoch"], epochs=info["epochs"], train_loss=info["train_loss"],
                val_accuracy=-1.0 if val_acc is None else val_acc, seconds=info["seconds"]))
        return on_epoch
