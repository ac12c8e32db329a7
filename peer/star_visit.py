"""A star plan's visit at one site (a parallel one-shot method): train once from the run's
initial model and upload (model + the aggregator's extra tensors) to the aggregator; at the
aggregator, wait for the planned uploads, combine them with its own, copy the final model to
every site whose upload it used and report it.
"""

from __future__ import annotations

import logging
import time

from fedrelay import params as run_params
from fedrelay.files import sha256_file
from fedrelay.peer.local_work import LocalWork
from fedrelay.peer.runs import Run, RunEnded
from fedrelay.peer.sending import Sending
from fedrelay.peer.site import Site
from fedrelay.v1 import coordinator_pb2 as cpb

log = logging.getLogger("fedrelay.peer")


class StarVisit:
    """Carries out a site's part of a star plan (``work``: its training and aggregation;
    ``sending``: its deliveries)."""

    def __init__(self, site: Site, work: LocalWork, sending: Sending):
        self.site = site
        self.work = work
        self.sending = sending

    def steps(self, run: Run) -> None:
        """A star plan (a parallel one-shot method): train once from the run's initial model and
        write the upload (model + the aggregator's extra tensors); a site uploads it to the
        aggregator and is done (the final copy arrives later, by ``handoff``). The aggregator
        waits for the planned uploads (``wait_for_uploads``), combines them with its own
        (``LocalWork.aggregate``), copies the final model to every site whose upload it used and reports
        it, naming the sites whose upload never came."""
        outgoing = run.visit_dir(1) / "outgoing.safetensors"
        if not outgoing.exists():
            self.work.train(run, 1, outgoing)
        if not run.is_final_site:
            t = run.upload
            if t is not None:
                self.site.set_state(run, "sending", f"upload {t.index} to {t.receiver}")
                self.sending.deliver(run, t, outgoing, sha256_file(outgoing), outgoing.stat().st_size)
            self.site.set_state(run, "done", "")
            return
        final = run.final_model
        if not final.exists():
            arrived, missing = self.wait_for_uploads(run)
            if arrived is None:
                return  # the daemon stops; a restart carries on
            self.work.aggregate(run, outgoing, arrived, final)
            run.missing = missing
            run.save()
        sha, size = sha256_file(final), final.stat().st_size
        run.final_sha256 = sha
        run.save()
        self.site.set_state(run, "distributing", "final model to every site")
        for c in run.final_copies:
            if c.receiver not in run.missing:
                self.sending.deliver(run, c, final, sha, size)  # False: a reroute took the copy away
        self.site.report("ReportFinal", cpb.FinalReport(run_id=run.run_id, site=self.site.name, sha256=sha, model_bytes=size,
                                                    missing=run.missing))
        self.site.set_state(run, "done", "")

    def wait_for_uploads(self, run: Run):
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
            if self.site.stop.is_set():
                return None, []
            if run.ended.is_set():
                raise RunEnded(run.run_id)
            detail = f"{len(arrived)} of {len(planned)} uploads"
            if run.state != "receiving" or run.detail != detail:
                self.site.set_state(run, "receiving", detail)
            run.wake.wait(min(1.0, max(0.0, deadline - time.monotonic())))
