"""A chain plan's visits at one site: for each visit, in round order, wait for its hop (none at
the chain's first visit), train, and send the model on to the next visit; at the chain's last
visit, copy the final model to every other site and report it. A reroute may change the visits
meanwhile: each step reads the current part of the plan.
"""

from __future__ import annotations

from pathlib import Path

from fedrelay.files import sha256_file
from fedrelay.peer.local_work import LocalWork
from fedrelay.peer.runs import Run, RunEnded
from fedrelay.peer.sending import Sending
from fedrelay.peer.site import Site
from fedrelay.v1 import coordinator_pb2 as cpb


class ChainVisit:
    """Carries out a site's part of a chain plan (``work``: its training; ``sending``: its deliveries)."""

    def __init__(self, site: Site, work: LocalWork, sending: Sending):
        self.site = site
        self.work = work
        self.sending = sending

    def steps(self, run: Run) -> None:
        """Every visit of this site, in round order: wait for its hop (none at the chain's first
        visit), train, send the model on; the final site then copies the final model to every
        other site. The route may change meanwhile (``reroute``): each step reads the current
        part of the plan, so a visit that lost its hop is dropped, and one that became the
        chain's first starts afresh (a star plan's visit: ``peer.star_visit.StarVisit``)."""
        r = 0
        while True:
            later = [v for v in run.visits if v > r]
            if not later:
                break
            r = later[0]
            outgoing = run.visit_dir(r) / "outgoing.safetensors"
            if not outgoing.exists():
                if not self.wait_for_hop(run, r):
                    if self.site.stop.is_set():
                        return
                    r = 0  # the route changed: look at the visits again from the start
                    continue
                self.work.train(run, r, outgoing)
            if not self.send_on(run, r, outgoing):
                if self.site.stop.is_set():
                    return
                r = 0
                continue
        self.site.set_state(run, "done", "")

    def wait_for_hop(self, run: Run, r: int) -> bool:
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
            if self.site.stop.is_set():
                return False
            if run.ended.is_set():
                raise RunEnded(run.run_id)
            run.wake.wait(1.0)

    def send_on(self, run: Run, r: int, outgoing: Path) -> bool:
        """Send visit ``r``'s model to the next visit, or, at the chain's last visit, copy the
        final model to every other site and report it. False when a reroute changed this
        visit's route meanwhile (the caller looks again) or the daemon stops."""
        sha = sha256_file(outgoing)
        size = outgoing.stat().st_size
        while True:
            if r not in run.visits or self.site.stop.is_set():
                return False
            t = run.outbound(r)
            if t is None:  # the chain's last visit: this is the final model
                run.final_sha256 = sha
                run.save()
                self.site.set_state(run, "distributing", "final model to every site")
                if all(self.sending.deliver(run, c, outgoing, sha, size) for c in run.final_copies) and run.is_final_site:
                    self.site.report("ReportFinal", cpb.FinalReport(run_id=run.run_id, site=self.site.name, sha256=sha,
                                                                model_bytes=size))
                    return True
                continue
            self.site.set_state(run, "sending", f"hop {t.index} to {t.receiver}")
            if self.sending.deliver(run, t, outgoing, sha, size):
                return True
