"""Routing a running run around sites that stayed down or were revoked: the route check (a new
plan version and the skips, recorded together), the reroutes it owes the sites and their
delivery (``Peer.Reroute``), and the monitor thread that does both every second."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterable

import grpc

from fedrelay.calls import CONTROL_TIMEOUT, status_message
from fedrelay.coordinator.lifecycle import fail
from fedrelay.coordinator.owed import Owed
from fedrelay.coordinator.plan import Plan, replan, star_plan
from fedrelay.coordinator.run_plans import RunPlans
from fedrelay.v1 import common_pb2, peer_pb2

log = logging.getLogger("fedrelay.coordinator")


def start_monitor(ledger, check_route: Callable[[str], object], steps: Iterable[Callable[[], None]],
                  stop: threading.Event, interval: float = 1.0) -> threading.Thread:
    """Start the monitor thread: every ``interval`` seconds until ``stop`` is set, run
    ``check_route(run_id)`` for each running run of ``ledger``, then each of ``steps`` (deliver
    reroutes, end notices, ...). A failing step is logged with its traceback and tried again at
    the next tick; it never ends the monitor (which would silently stop every reroute and end
    notice). Returns the (daemon) thread."""
    steps = list(steps)

    def tick() -> None:
        for run_id in ledger.running_run_ids():
            try:
                check_route(run_id)
            except Exception:  # noqa: BLE001 - one bad run must not stop the others
                log.exception("route check of run %s failed", run_id)
        for step in steps:
            try:
                step()
            except Exception:  # noqa: BLE001 - tried again next tick
                log.exception("monitor: %s failed", getattr(step, "__name__", step))

    def loop() -> None:
        while not stop.wait(interval):
            try:
                tick()
            except Exception:  # noqa: BLE001 - e.g. the ledger briefly unreadable
                log.exception("monitor tick failed")

    thread = threading.Thread(target=loop, name="route-monitor", daemon=True)
    thread.start()
    return thread


class Routing:
    """Route checks and reroutes of the runs in ``ledger``. ``plans``: the ``RunPlans``;
    ``owed``: the shared ``Owed`` (its queued reroutes); ``stub(site dict)``: a site's Peer stub;
    ``address(name, fallback)``: a site's registered address; ``revoked()``: the sites revoked
    now (name -> entry with ``describe()``); ``peer_timeout``: seconds without a heartbeat
    before a site is routed around."""

    def __init__(self, ledger, plans: RunPlans, owed: Owed, stub: Callable, address: Callable,
                 revoked: Callable[[], dict], peer_timeout: float):
        self.ledger = ledger
        self.plans = plans
        self.owed = owed
        self.stub = stub
        self.address = address
        self.revoked = revoked
        self.peer_timeout = peer_timeout

    def dead(self, names: list[str]) -> set[str]:
        """The sites of ``names`` to route around: no heartbeat for more than ``peer_timeout``,
        or revoked (``coordinator revoke``)."""
        now = time.time()
        seen = self.ledger.last_seen()
        revoked = self.revoked()
        return {n for n in names if now - seen.get(n, 0) > self.peer_timeout or n in revoked}

    def down_reason(self, name: str) -> str:
        """Why ``name`` is routed around (its revocation, else its silence)."""
        revoked = self.revoked().get(name)
        if revoked is not None:
            return f"certificate {revoked.describe()}"
        return f"no heartbeat for more than {self.peer_timeout:.0f} s"

    def check_route(self, run_id: str) -> list[str]:
        """Route a running run around sites that stayed down; returns the sites newly skipped.

        The model of a chain sits at one visit at a time: the latest visit of the plan that its
        hop has reached (or the first visit). If that visit's site is down past
        ``peer_timeout``, the model is lost with it: the latest earlier visit whose site is live
        sends its model again, to the next live visit, and the sites of the visits in between
        are skipped (for the rest of the run). If the site of the next visit is down, it is
        skipped and the holder sends past it. With no live earlier visit, the first live visit
        starts afresh (a warm-up). Skips and the new plan (``plan.replan``) are written to the
        ledger together; every site whose part of the plan changed gets a ``Peer.Reroute``.
        """
        run = self.ledger.run(run_id)
        if run is None or run["status"] != "running" or run["final_sha256"]:
            return []
        skipped = self.plans.skipped(run_id)
        order = [c["name"] for c in run["chain"]]
        dead = self.dead(order)
        if not dead - skipped:  # the common case, every second: nothing more to read
            return []
        _, plan = self.plans.current(run_id)
        if plan.aggregator:
            return self._check_star_route(run, plan, order, dead, skipped)
        visits = list(plan.visits)
        reached = {(h["hop"], h["receiver"]) for h in self.ledger.hops(run_id)}
        at = max(i for i, v in enumerate(visits) if i == 0 or (v.index, v.site) in reached)
        holder = visits[at]
        if holder.site in dead:
            earlier = [i for i in range(at - 1, -1, -1) if visits[i].site not in dead | skipped]
            src = earlier[0] if earlier else None
            resume = visits[src] if src is not None else None
            skip = {v.site for v in visits[(src + 1 if src is not None else 0):at + 1]} - {getattr(resume, "site", None)}
        elif at + 1 < len(visits) and visits[at + 1].site in dead:
            resume, skip = holder, {visits[at + 1].site}
        else:
            return []
        if not set(order) - skipped - skip:
            fail(self.ledger, run_id, "every site of the chain is unreachable")
            return []
        new = replan(order, run["rounds"], plan, skipped | skip, resume)
        return self._reroute(run, plan, new, skip, lambda name: f"{name}: {self.down_reason(name)}: routed around it")

    def _check_star_route(self, run: dict, plan: Plan, order: list[str], dead: set[str], skipped: set[str]) -> list[str]:
        """A star plan's rules: the aggregating site down past ``peer_timeout`` fails the run
        (it holds the uploads); any other site down is routed around: its upload is no longer
        waited for (one that arrived stays in the final model), it gets no final copy and is not
        evaluated. The aggregator gets the new part of the plan at once (``Peer.Reroute``)."""
        run_id = run["run_id"]
        if plan.aggregator in dead:
            fail(self.ledger, run_id, f"the aggregating site {plan.aggregator} is out of the run "
                                      f"({self.down_reason(plan.aggregator)})", site=plan.aggregator)
            return []
        skip = dead - skipped
        received = {h["sender"] for h in self.ledger.hops(run_id, "upload")}
        new = star_plan(order, plan.aggregator, skipped | skip, received)

        def line(name: str) -> str:
            held = " (its upload arrived and stays in the final model)" if name in received else ""
            return f"{name}: {self.down_reason(name)}: the aggregator no longer waits for it{held}"

        return self._reroute(run, plan, new, skip, line)

    def _reroute(self, run: dict, plan: Plan, new: Plan, skip: set[str], line: Callable[[str], str]) -> list[str]:
        """Record ``new`` with the skips of ``skip`` (a ``skip`` event each, its message
        ``line(name)``) and queue the reroutes; returns the sites newly skipped ([] when another
        check recorded this version first)."""
        run_id = run["run_id"]
        version = self.ledger.reroute(run_id, new.to_json(), [(n, self.down_reason(n)) for n in sorted(skip)])
        if version is None:
            return []
        for name in sorted(skip):
            self.ledger.add_event(run_id, "skip", line(name), site=name)
        self.queue_reroutes(run, plan, new, version)
        return sorted(skip)

    def queue_reroutes(self, run: dict, old: Plan, new: Plan, version: int) -> None:
        """Queue a Reroute for every live site whose part of the plan differs between ``old``
        and ``new``: its new transfers, the addresses of the sites they name and its visits."""
        skipped = self.plans.skipped(run["run_id"])
        address = {c["name"]: self.address(c["name"], c["address"]) for c in run["chain"]}
        live = [c["name"] for c in run["chain"] if c["name"] not in skipped]
        # The final site goes last, so that the others know it before it copies the final model.
        for n in sorted(live, key=lambda m: m == new.final_site):
            if old.part(n) == new.part(n):
                continue
            self.owed.reroutes[(run["run_id"], n)] = peer_pb2.RerouteRequest(
                run_id=run["run_id"], skipped=sorted(skipped), route_version=version, **new.part_pb(n, address))

    def send_reroutes(self) -> None:
        """Deliver the queued reroutes (``Peer.Reroute``); one not delivered is tried again at the
        next call."""
        for (run_id, site), request in list(self.owed.reroutes.items()):
            run = self.ledger.run(run_id)
            address = next(c["address"] for c in run["chain"] if c["name"] == site)
            try:
                self.stub({"name": site, "address": address}).Reroute(request, timeout=CONTROL_TIMEOUT)
                self.owed.reroutes.pop((run_id, site), None)
                hops = ", ".join(f"hop {t.index} {t.sender}->{t.receiver}" for t in request.transfers
                                 if t.purpose == common_pb2.CHAIN_HOP) or "no hops"
                self.ledger.add_event(run_id, "state", f"{site}: rerouted ({hops})", site=site)
            except grpc.RpcError as exc:
                log.warning("reroute of %s in run %s not delivered yet: %s", site, run_id, status_message(exc))
