"""A site's runs: what the coordinator assigned, where the files are, what was done.

One :class:`Run` per run the site takes part in, persisted in its folder of the state dir::

    runs/<run_id>/assignment.pb        the coordinator's Assignment (protobuf; replaced by a Reroute)
    runs/<run_id>/state.json           state, detail, transfers sent, receipts, final digest, and the
                                       run's status at the coordinator once it ended (``peer prune``)
    runs/<run_id>/final.safetensors    the final model, copied here for evaluation (not at a chain's
                                       final site); a star plan's aggregator writes it here
    runs/<run_id>/uploads/<site>.safetensors   a star plan's aggregator: each site's upload

and, for each visit (round r in which the site trains; round 1 in the run folder itself, round
r > 1 in ``runs/<run_id>/round-<r>/``)::

    received.safetensors     the model the visit's hop brought, once verified
    warmup.safetensors       the chain's first visit: its warm-up model (its m0)
    pool/model-<j>.safetensors  each finished model of the visit's pool
    outgoing.safetensors     what the visit sends on (at the chain's last visit: the final model;
                             in a star plan: the site's upload, model + the aggregator's extras)

A site's part of the plan (``Assignment.transfers``, ``visits``; coordinator/plan.py) says
everything else: visit r starts with the hop that ends at the site in round r (none: the
chain's first visit, a warm-up), and ends with the next hop the site sends, or, when it sends no
later hop, with the final copies. In a star plan (``Assignment.aggregator`` set) a site trains
once from the run's initial model and uploads to the aggregator, which copies the final model
to every other site.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from pathlib import Path

from fedrelay.files import atomic_write
from fedrelay.v1 import common_pb2, peer_pb2

ACTIVE = ("assigned", "receiving", "training", "sending", "distributing")


@dataclass
class Run:
    assignment: peer_pb2.Assignment
    folder: Path
    state: str = "assigned"
    detail: str = ""
    sent: list[str] = field(default_factory=list)   # keys (``sent_key``) of transfers delivered
    final_sha256: str = ""
    receipts: dict = field(default_factory=dict)     # key -> {"report": ReceiptReport fields, "reported": bool}
    missing: list[str] = field(default_factory=list)  # star aggregator: sites whose upload never came
    # The run's status at the coordinator once its end notice arrived (Peer.EndRun): finished,
    # failed or cancelled, and when (unix seconds); "" / 0 while the run may still be running.
    run_status: str = ""
    run_ended: float = 0.0
    wake: threading.Event = field(default_factory=threading.Event)  # a model arrived, or the route changed
    rerouted: threading.Event = field(default_factory=threading.Event)
    ended: threading.Event = field(default_factory=threading.Event)  # the coordinator ended the run (EndRun)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # Serializes save(): two threads' snapshots reach state.json in the order they were taken (a
    # receipt's save racing the worker's "training" could otherwise leave the older state on disk).
    _save_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    # -- persistence ---------------------------------------------------------------------------
    @classmethod
    def load(cls, folder: Path) -> "Run":
        """The run persisted in ``folder``. Raises ``OSError`` or ``ValueError`` when unreadable."""
        a = peer_pb2.Assignment.FromString((folder / "assignment.pb").read_bytes())
        doc = json.loads((folder / "state.json").read_text())
        run = cls(a, folder, doc.get("state", "assigned"), doc.get("detail", ""), doc.get("sent", []),
                  doc.get("final_sha256", ""), doc.get("receipts", {}), doc.get("missing", []),
                  doc.get("run_status", ""), doc.get("run_ended", 0.0))
        if run.state == "ended":
            run.ended.set()
        return run

    def save(self) -> None:
        """Persist the run's state to ``state.json`` (atomically; thread-safe: the last save's
        snapshot is the one on disk). Raises ``OSError``."""
        with self._save_lock:
            doc = {"state": self.state, "detail": self.detail, "sent": self.sent, "final_sha256": self.final_sha256,
                   "receipts": self.receipts, "missing": self.missing, "run_status": self.run_status,
                   "run_ended": self.run_ended}
            atomic_write(self.path("state.json"), json.dumps(doc, indent=1).encode())

    def save_assignment(self, a: peer_pb2.Assignment) -> None:
        atomic_write(self.path("assignment.pb"), a.SerializeToString())
        self.assignment = a

    # -- the site's part of the plan -----------------------------------------------------------
    @property
    def run_id(self) -> str:
        return self.assignment.run_id

    @property
    def site(self) -> str:
        return self.assignment.site

    @property
    def visits(self) -> list[int]:
        """The rounds in which this site trains, ascending."""
        return list(self.assignment.visits)

    def visit_index(self, round: int) -> int:
        """The chain-wide index of this site's visit in ``round`` (hop h ends at visit h)."""
        a = self.assignment
        return (round - 1) * a.chain_length + a.position

    def _hops(self, **match) -> list[common_pb2.PlannedTransfer]:
        return sorted((t for t in self.assignment.transfers if t.purpose == common_pb2.CHAIN_HOP
                       and all(getattr(t, k) == v for k, v in match.items())), key=lambda t: t.index)

    def inbound(self, round: int) -> common_pb2.PlannedTransfer | None:
        """The hop that starts this site's visit in ``round``; None at the chain's first visit."""
        found = self._hops(receiver=self.site, index=self.visit_index(round))
        return found[0] if found else None

    def outbound(self, round: int) -> common_pb2.PlannedTransfer | None:
        """The hop that ends this site's visit in ``round``; None when the visit is the chain's
        last (it makes the final model)."""
        later = [r for r in self.visits if r > round]
        until = self.visit_index(later[0]) if later else None
        for t in self._hops(sender=self.site):
            if t.index > self.visit_index(round) and (until is None or t.index < until):
                return t
        return None

    @property
    def final_copies(self) -> list[common_pb2.PlannedTransfer]:
        """The final copies this site sends (it makes the final model)."""
        return [t for t in self.assignment.transfers if t.purpose == common_pb2.FINAL_MODEL and t.sender == self.site]

    @property
    def is_star(self) -> bool:
        """A star plan (a parallel one-shot method): ``Assignment.aggregator`` names its aggregator."""
        return bool(self.assignment.aggregator)

    @property
    def is_final_site(self) -> bool:
        """This site makes the final model: a chain's last visit, or a star's aggregator."""
        if self.is_star:
            return self.assignment.aggregator == self.site
        return bool(self.visits) and self.outbound(self.visits[-1]) is None

    @property
    def upload(self) -> common_pb2.PlannedTransfer | None:
        """Star plans: this site's upload to the aggregator (None at the aggregator, or once a
        reroute took it away)."""
        return next((t for t in self.assignment.transfers if t.purpose == common_pb2.UPLOAD and t.sender == self.site),
                    None)

    @property
    def uploads_in(self) -> list[common_pb2.PlannedTransfer]:
        """Star plans, at the aggregator: the uploads planned to it, by index."""
        return sorted((t for t in self.assignment.transfers if t.purpose == common_pb2.UPLOAD and t.receiver == self.site),
                      key=lambda t: t.index)

    def planned_into(self, purpose: int, index: int) -> common_pb2.PlannedTransfer | None:
        """The planned transfer of ``purpose`` and ``index`` that ends at this site, if any."""
        for t in self.assignment.transfers:
            if t.purpose == purpose and t.receiver == self.site and (purpose == common_pb2.FINAL_MODEL or t.index == index):
                return t
        return None

    def peer(self, name: str) -> common_pb2.SiteRef:
        """Where the site ``name`` of this run listens. Raises ``LookupError``."""
        for ref in self.assignment.peers:
            if ref.name == name:
                return ref
        raise LookupError(f"run {self.run_id}: no address for {name!r} in this site's part of the plan")

    # -- files ---------------------------------------------------------------------------------
    def path(self, name: str) -> Path:
        return self.folder / name

    def visit_dir(self, round: int) -> Path:
        return self.folder if round == 1 else self.folder / f"round-{round}"

    def destination(self, t: common_pb2.PlannedTransfer) -> Path:
        """Where a received transfer is kept."""
        if t.purpose == common_pb2.CHAIN_HOP:
            return self.visit_dir(t.round) / "received.safetensors"
        if t.purpose == common_pb2.UPLOAD:
            return self.path("uploads") / f"{t.sender}.safetensors"
        return self.path("final.safetensors")

    @property
    def final_model(self) -> Path:
        """Where this site holds the run's final model (if it does)."""
        if self.is_final_site and not self.is_star:
            return self.visit_dir(self.visits[-1]) / "outgoing.safetensors"
        return self.path("final.safetensors")


def sent_key(t: common_pb2.PlannedTransfer) -> str:
    """How ``Run.sent`` names a delivered transfer: ``hop:<index>``, ``upload:<index>`` or
    ``final:<receiver>``."""
    if t.purpose == common_pb2.CHAIN_HOP:
        return f"hop:{t.index}"
    if t.purpose == common_pb2.UPLOAD:
        return f"upload:{t.index}"
    return f"final:{t.receiver}"


class RunEnded(Exception):
    """The coordinator ended this run (``Peer.EndRun``: ``peer.ending.RunLife.end_run``): its worker stops."""
