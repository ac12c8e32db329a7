"""What each site of a running run is doing now: its live state, for ``coordinator show``.

The coordinator keeps, in memory, one :class:`SiteNow` per site of each running run that
somebody has asked about, folded (:func:`apply`) from the run's events in the ledger: the
sites' state changes and epochs (``ReportProgress``), skips (routed around) and evaluations.
:class:`LiveState` reads only the events added since it last looked (from the coordinator's
in-memory event hub, ``coordinator/events.py``), so asking is cheap while a run goes on, and after a coordinator restart the first question rebuilds the state from the
ledger's events: nothing is lost with the process. A run that has ended is forgotten.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any

from fedrelay.v1 import coordinator_pb2 as cpb

# A site's run state (peer/node.py) in words, where the detail does not say more.
ACTIVITY = {"assigned": "waiting", "receiving": "receiving", "training": "training", "sending": "sending",
            "distributing": "sending the final model", "done": "done", "failed": "failed", "ended": "ended",
            "skipped": "routed around", "evaluated": "evaluated the final model"}
# States in which a site is working on the run (the "current" sites of ``show``).
BUSY = ("receiving", "training", "sending", "distributing")


@dataclass
class SiteNow:
    """One site's latest reported state in one run (epochs 1-based; ``updated`` in unix seconds)."""

    site: str
    state: str = ""
    detail: str = ""
    stage: str = ""
    model: int = 0
    models: int = 0
    epoch: int = 0
    epochs: int = 0
    updated: float = 0.0
    # The latest training's detail and progress (stage, model, models, epoch, epochs), kept
    # while another state interrupts it (an upload arriving during the training).
    trained: tuple | None = None

    @property
    def busy(self) -> bool:
        return self.state in BUSY

    @property
    def activity(self) -> str:
        """The state in words: waiting, receiving, training, aggregating, waiting for uploads,
        sending, sending the final model, done, routed around, ..."""
        if self.state == "training" and self.detail.startswith("aggregating"):
            return "aggregating"
        if self.state == "receiving" and self.detail.endswith("uploads"):
            return "waiting for uploads"
        return ACTIVITY.get(self.state, self.state or "unknown")

    @property
    def line(self) -> str:
        """One line, e.g. ``site-03 training, model 2/5, epoch 3/10`` or ``site-01 sending (hop 1
        to site-02)``."""
        what = self.activity
        if what == "aggregating":
            what = self.detail  # "aggregating 3 models (ofasd)"
        elif self.detail and not (what == "waiting for uploads" or self.state == "training"):
            if what == "waiting" and self.detail.startswith("waiting "):
                what = ""  # "waiting for hop 2 from site-01"
            what = f"{what} ({self.detail})" if what else self.detail
        elif self.state == "training" and self.detail:
            what += f", {self.detail}"  # "round 2"
        if self.state == "training" and self.epoch:
            if self.stage == "pool" and self.models:
                what += f", model {self.model}/{self.models}"
            elif self.stage == "pool":
                what += f", model {self.model}"
            elif self.stage == "warmup":
                what += ", warm-up"
            what += f", epoch {self.epoch}/{self.epochs}"
        elif what == "waiting for uploads":
            what += f" ({self.detail.removesuffix(' uploads')} arrived)"
        return f"{self.site} {what}"

    def to_pb(self) -> cpb.SiteLive:
        return cpb.SiteLive(site=self.site, state=self.state, detail=self.detail, activity=self.activity,
                            stage=self.stage, model=self.model, models=self.models, epoch=self.epoch,
                            epochs=self.epochs, updated=self.updated, line=self.line,
                            age_seconds=max(0.0, time.time() - self.updated))


def apply(sites: dict[str, SiteNow], event: dict[str, Any], models_per_site: int = 0) -> None:
    """Fold one ledger event (``{"kind", "site", "time", "data"}``, ``data`` a dict or its JSON)
    into ``sites`` (site name -> :class:`SiteNow`, changed in place). ``models_per_site`` (S)
    gives the pool's size for "model j/S". Kinds: ``state`` (a state change: the training
    progress is kept only when the same training resumes, e.g. after an upload arrived
    meanwhile), ``epoch`` (a finished epoch: the site is training), ``skip`` (routed around),
    ``evaluated``; other kinds change nothing."""
    kind, name = event["kind"], event.get("site") or ""
    if not name or kind not in ("state", "epoch", "skip", "evaluated"):
        return
    data = event.get("data") or {}
    if isinstance(data, str):
        data = json.loads(data or "{}")
    now = sites.setdefault(name, SiteNow(site=name))
    now.updated = float(event.get("time") or 0.0)
    if kind == "epoch":
        if now.state != "training":
            now.state, now.detail = "training", ""
        now.stage, now.model, now.epoch, now.epochs = (data.get("stage") or "", int(data.get("model") or 0),
                                                        int(data.get("epoch") or 0), int(data.get("epochs") or 0))
        now.models = models_per_site if now.stage == "pool" else 0
        now.trained = (now.detail, now.stage, now.model, now.models, now.epoch, now.epochs)
        return
    if kind == "skip":
        state, detail = "skipped", ""
    elif kind == "evaluated":
        state, detail = "evaluated", f"accuracy {data['accuracy']:.4f}" if "accuracy" in data else ""
    else:
        state, detail = data.get("state") or "", data.get("detail") or ""
        if not state:  # a coordinator's note about the site ("rerouted", "ignored a report"): no change
            return
    now.state, now.detail = state, detail
    if state == "training" and now.trained is not None and now.trained[0] == detail:  # the same training again
        now.stage, now.model, now.models, now.epoch, now.epochs = now.trained[1:]
        return
    now.stage, now.model, now.models, now.epoch, now.epochs = "", 0, 0, 0, 0
    if state not in ("receiving", "assigned"):  # not an interruption: a new training, or this one is over
        now.trained = None


class LiveState:
    """The live state of the sites of running runs, kept in memory and caught up from the
    run's events on each question (thread-safe). ``events``: where they are read, anything
    with ``events_after(run_id, seq)`` (the coordinator's ``EventHub``: memory, not SQLite;
    or a ``Ledger``)."""

    def __init__(self, events):
        self.ledger = events
        self._runs: dict[str, tuple[int, dict[str, SiteNow]]] = {}  # run id -> (last event seq, sites)
        self._lock = threading.Lock()

    def sites(self, run: dict) -> list[SiteNow]:
        """Each site's live state in the running ``run`` (a ledger row: ``run_id``, ``chain``,
        ``params``), in the run's order, sites that have reported nothing yet left out; ``[]``
        once the run has ended (and the run is forgotten)."""
        run_id = run["run_id"]
        if run["status"] != "running":
            self.forget(run_id)
            return []
        with self._lock:
            seq, sites = self._runs.get(run_id, (0, {}))
            for event in self.ledger.events_after(run_id, seq):
                apply(sites, event, int(run["params"].get("models_per_site") or 0))
                seq = event["seq"]
            self._runs[run_id] = (seq, sites)
            return [sites[c["name"]] for c in run["chain"] if c["name"] in sites]

    def forget(self, run_id: str) -> None:
        with self._lock:
            self._runs.pop(run_id, None)
