"""What the operator reads of the coordinator's record: a run's summary (``GetRun``,
``ListRuns``, ``StopRun``, the web page), a registered peer's record with its liveness
(``ListPeers``) and a run's metric rows (``GetMetrics``)."""

from __future__ import annotations

import json
import time
from typing import Callable

import grpc

from fedrelay import params as run_params, privacy
from fedrelay.coordinator import replies
from fedrelay.coordinator.plan import Plan
from fedrelay.coordinator.refusal import Refused
from fedrelay.coordinator.revocations import Revocations
from fedrelay.tasks.offers import Offer
from fedrelay.v1 import coordinator_pb2 as cpb


class Summaries:
    """Summaries and records of ``ledger``'s runs and peers. ``live``: the sites' live state
    (``LiveState``); ``revocations``: the ``Revocations``; ``skipped(run_id)``: the sites a run
    routed around; ``revoked()``: the sites revoked now; ``tunnels``: the control streams;
    ``peer_timeout``: seconds without a heartbeat before a site counts as not live."""

    def __init__(self, ledger, live, revocations, skipped: Callable[[str], set], revoked: Callable[[], dict],
                 tunnels, peer_timeout: float):
        self.ledger = ledger
        self.live = live
        self.revocations = revocations
        self.skipped = skipped
        self.revoked = revoked
        self.tunnels = tunnels
        self.peer_timeout = peer_timeout

    def run(self, run_id: str) -> cpb.RunSummary | None:
        """The run's summary, None for an unknown run."""
        run = self.ledger.run(run_id)
        if run is None:
            return None
        s = cpb.RunSummary(
            run_id=run_id, strategy=run["strategy"], order=[c["name"] for c in run["chain"]],
            model_bytes=run["model_bytes"] or 0, status=run["status"], seed=run["seed"], arch=run["arch"],
            class_index=run["class_index"], warnings=run["warnings"], error=run["error"] or "",
            created=run["created"], ended=run["ended"] or 0, insecure=bool(run["insecure"]),
            params=run_params.to_pb(run["params"]), rounds=run["rounds"], final_site=run["final_site"] or "",
            upload_bytes=run["upload_bytes"] or 0,
            cancelled_by=run["cancelled_by"] or "", cancel_reason=run["cancel_reason"] or "",
            task=run["task"] or "", task_version=run["task_version"] or "", task_sha256=run["task_sha256"] or "",
            model_spec_json=json.dumps(run["model"], sort_keys=True),
            started_by=run["started_by"] or "", refused_by=run["refused_by"] or "", refusal=run["refusal"] or "",
            refused_by_policy=bool(run["refused_by_policy"]),
        )
        s.live.extend(now.to_pb() for now in self.live.sites(run))
        plans = self.ledger.plans(run_id)
        plan = Plan.from_json(plans[-1]["plan"]) if plans else None
        skipped = self.skipped(run_id)
        s.skipped.extend(c["name"] for c in run["chain"] if c["name"] in skipped)
        revoked = self.revocations.names()
        s.revoked.extend(Revocations.entry_pb(revoked[c["name"]]) for c in run["chain"] if c["name"] in revoked)
        s.contributors.extend(c["name"] for c in run["chain"] if c["name"] not in skipped)
        reported = {}
        for purpose, field in (("chain", s.hops), ("upload", s.uploads), ("final", s.final_transfers)):
            for h in self.ledger.hops(run_id, purpose):
                got = h["receipt"] or {}
                reported[(purpose, h["hop"], h["receiver"])] = h
                field.add(hop=h["hop"], sender=h["sender"], receiver=h["receiver"],
                          payload_bytes=h["payload_bytes"] or 0, wire_bytes=h["wire_bytes"] or 0,
                          sha256=h["sha256"] or "", started=h["started"] or 0, ended=h["ended"] or 0,
                          attempts=h["attempts"], resumed_from=h["resumed_from"], round=h["round"] or 0,
                          status=h["status"], receiver_sha256=got.get("sha256", ""),
                          receiver_bytes=got.get("payload_bytes", 0),
                          route=h["route"] or got.get("route", ""), sealed_bytes=h["sealed_bytes"] or 0,
                          relay_wire_bytes=got.get("relay_wire_bytes", 0), relay=h["relay"] or "")
        if plan is not None:
            s.plan.extend(t.to_pb() for t in plan.transfers)
            kept = {("chain", t.index, t.receiver) for t in plan.hops}
            s.planned_hops = len(kept) + sum(1 for k in reported if k[0] == "chain" and k not in kept)
            s.aggregator = plan.aggregator
            # an upload routed around after it arrived stays in the plan (star_plan's `received`)
            s.planned_uploads = len(plan.uploads)
        if run["status"] == "finished":
            self._final(s, run)
        return s

    def _final(self, s: cpb.RunSummary, run: dict) -> None:
        """A finished run's final model: its digest and the global and per-site figures."""
        s.final.sha256 = run["final_sha256"] or ""
        s.final.accuracy = run["accuracy"] or 0.0
        s.final.metrics.update(run["metrics"] or {})
        for e in self.ledger.evaluations(run["run_id"]):
            s.final.per_site[e["site"]].accuracy = e["accuracy"]
            s.final.per_site[e["site"]].test_samples = e["test_samples"]
            s.final.per_site[e["site"]].metrics.update(e["metrics"])
            spent = privacy.spent_from_stats(e["stats"])  # a DP run: as the site signed it
            if spent is not None:
                s.final.per_site[e["site"]].privacy.CopyFrom(privacy.to_pb(spent))

    def runs_after(self, after: str) -> tuple[list[cpb.RunSummary], bool]:
        """The summaries of the runs created after run ``after`` ("": from the first), in the
        order they were created, each bounded, under the message cap (``coordinator/replies.py``);
        and whether more are left. Raises ``Refused`` (INVALID_ARGUMENT: unknown ``after``)."""
        ids = self.ledger.run_ids()
        if after:
            if after not in ids:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"after: unknown run {after!r}")
            ids = ids[ids.index(after) + 1:]
        return replies.page((replies.bounded_summary(s) for s in map(self.run, ids) if s is not None),
                            lambda s: s.ByteSize())

    def liveness(self, peer: dict) -> dict:
        """PeerRecord's liveness fields: live (heard from within --peer-timeout), age_seconds
        (since its last registration or heartbeat, by this coordinator's clock), peer_timeout."""
        age = max(0.0, time.time() - (peer["last_seen"] or 0))
        return {"live": age <= self.peer_timeout, "age_seconds": age, "peer_timeout": self.peer_timeout}

    def peer(self, p: dict) -> cpb.PeerRecord:
        """A registered peer's record (a row of ``Ledger.peers``), bounded under the message cap."""
        revoked = self.revoked().get(p["name"])
        return replies.bounded_peer(cpb.PeerRecord(
            name=p["name"], address=p["address"], device=p["device"] or "",
            last_seen=p["last_seen"] or 0,
            tasks=[Offer.from_dict(o).to_pb() for o in p["tasks"]], **self.liveness(p),
            outbound_only=not p["address"],
            connected=not p["address"] and self.tunnels.get(p["name"]) is not None,
            revocation=Revocations.entry_pb(revoked) if revoked is not None else None))

    def peers_after(self, after: str) -> tuple[list[cpb.PeerRecord], bool]:
        """The records of the peers named after ``after``, by name, under the message cap; and
        whether more are left."""
        return replies.page((self.peer(p) for p in self.ledger.peers() if p["name"] > after), lambda r: r.ByteSize())

    def metrics(self, run_id: str, offset: int) -> tuple[list[cpb.MetricRow], bool]:
        """The run's per-epoch training metrics (the ledger's ``metrics`` table) from row
        ``offset``, in the order the coordinator recorded them, under the message cap; and
        whether more are left."""
        rows = self.ledger.metrics(run_id)[offset:]
        return replies.page(map(metric_row, rows), lambda r: r.ByteSize() + 4)


def metric_row(m: dict) -> cpb.MetricRow:
    """A row of the ledger's ``metrics`` table as a ``MetricRow`` (``val_accuracy`` unset where the
    site has no validation split)."""
    r = cpb.MetricRow(site=m["site"], time=m["time"], stage=m["stage"] or "", model=m["model"] or 0,
                      epoch=m["epoch"] or 0, epochs=m["epochs"] or 0, train_loss=m["train_loss"] or 0.0,
                      seconds=m["seconds"] or 0.0)
    if m["val_accuracy"] is not None:
        r.val_accuracy = m["val_accuracy"]
    return r
