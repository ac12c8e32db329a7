"""A run's life cycle at the coordinator: StartChain's checks (fresh, unrevoked, reachable
sites; a plan), recording the run and assigning every site; stopping a run; failing it; and
picking running runs up from the ledger after a restart."""

from __future__ import annotations

import logging
import secrets
import time
from typing import Callable

import grpc

from fedrelay import params as run_params, purpose as purposes, registry
from fedrelay.calls import CONTROL_TIMEOUT, assignment_refusal, status_message
from fedrelay.coordinator import site_policy
from fedrelay.coordinator.plan import PeerInfo, Plan, PlanError, chain_plan, choose_sites, pick_aggregator, star_plan
from fedrelay.coordinator.refusal import Refused
from fedrelay.tasks.offers import Offer
from fedrelay.v1 import coordinator_pb2 as cpb, peer_pb2

log = logging.getLogger("fedrelay.coordinator")

INSECURE_OPERATOR = "insecure operator"  # who cancelled a run, on a plaintext coordinator


def new_run_id() -> str:
    """``YYYYmmdd-HHMMSS-`` and six random hex digits."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def fail(ledger, run_id: str, error: str, site: str = "", record=None) -> None:
    """End the run as failed with ``error`` (``record``: the site's signed failure report)."""
    ledger.finish_run(run_id, "failed", error=error, message=f"run failed: {error}", site=site, record=record)


def new_plan(strategy: str, order: list[str], rounds: int, aggregator: str, seed: int) -> Plan:
    """Version 0 of a run's plan: a chain, or a star for the parallel one-shot methods
    (``aggregator`` "" = chosen by the seed). Raises ``ValueError`` (``PlanError``)."""
    if registry.strategy(strategy).plan == registry.STAR:
        if rounds != 1:
            raise PlanError(f"--rounds {rounds}: {strategy} is a one-shot parallel method (one round)")
        return star_plan(order, aggregator or pick_aggregator(order, seed))
    if aggregator:
        raise PlanError(f"--aggregator: {strategy} runs a chain; only the parallel methods "
                        f"({', '.join(n for n, s in registry.STRATEGIES.items() if s.plan == registry.STAR)}) "
                        "have an aggregating site")
    return chain_plan(order, rounds)


class Runs:
    """Starting, stopping and recovering the runs of ``ledger``. ``stub(site)``: a site's Peer
    stub; ``revoked()``: the sites revoked now; ``monitor``: the ``CoordinatorMonitor``;
    ``insecure``: a plaintext coordinator (its runs are recorded as such); ``peer_timeout``
    (seconds without a heartbeat: stale) and ``probe_timeout`` (seconds a chosen site has to
    answer ``GetStatus``)."""

    def __init__(self, ledger, stub: Callable, revoked: Callable[[], dict], monitor, *, insecure: bool,
                 peer_timeout: float, probe_timeout: float):
        self.ledger = ledger
        self.stub = stub
        self.revoked = revoked
        self.monitor = monitor
        self.insecure = insecure
        self.peer_timeout = peer_timeout
        self.probe_timeout = probe_timeout

    def fresh_peers(self, named: list[str], warnings: list[str]) -> list[dict]:
        """The registered peers a run may use. A peer is stale when it has sent no heartbeat for
        more than ``peer_timeout`` seconds: without ``named`` (the default peer set) stale peers
        are left out, with a warning naming them appended to ``warnings``; a stale or revoked
        peer named explicitly is refused (``Refused``, FAILED_PRECONDITION)."""
        peers = self.ledger.peers()
        now = time.time()
        stale = {p["name"]: now - (p["last_seen"] or 0) for p in peers if now - (p["last_seen"] or 0) > self.peer_timeout}
        revoked = self.revoked()
        if revoked:
            bad = [n for n in named if n in revoked]
            if bad:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, "revoked sites cannot take part in a run: " + ", ".join(
                    f"{n} ({revoked[n].describe()})" for n in bad))
            left = sorted(p["name"] for p in peers if p["name"] in revoked)
            if left and not named:
                warnings.append(f"left out {len(left)} revoked site(s): {', '.join(left)}")
            peers = [p for p in peers if p["name"] not in revoked]
        if named:
            bad = [n for n in named if n in stale]
            if bad:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, "stale peers (no heartbeat for longer than "
                              f"--peer-timeout {self.peer_timeout:g} s): " + ", ".join(
                                  f"{n} (last seen {stale[n]:.0f} s ago)" for n in bad)
                              + "; start their daemons again, leave them out of --peers, or `coordinator "
                              "forget-peer NAME`")
            return peers
        if stale:
            warnings.append(f"left out {len(stale)} stale peer(s), no heartbeat for longer than --peer-timeout "
                            f"{self.peer_timeout:g} s: " + ", ".join(f"{n} (last seen {s:.0f} s ago)"
                                                                     for n, s in sorted(stale.items())))
        return [p for p in peers if p["name"] not in stale]

    def start_chain(self, request: cpb.StartChainRequest, operator: str, by: Callable[[], str]) -> cpb.StartChainReply:
        """Check the operator's ``request`` (sites, parameters, plan), probe the chosen sites,
        record the run and assign every site (each site's policy first). ``operator``: the
        caller's identity ("" on a plaintext coordinator), told to each site; ``by()``: the caller
        in words, for the log line. Raises ``Refused`` (INVALID_ARGUMENT, FAILED_PRECONDITION)."""
        stale_warnings: list[str] = []
        peers = [
            PeerInfo(name=p["name"], address=p["address"], device=p["device"],
                     offers={o["name"]: Offer.from_dict(o) for o in p["tasks"]})
            for p in self.fresh_peers(list(request.peers), stale_warnings)
        ]
        rounds = request.rounds or 1
        params = run_params.to_dict(request.params)
        try:
            run_params.check(params)  # once, completely, before anything is written
            run_params.check_rounds(rounds)
            chosen = choose_sites(peers, names=list(request.peers) or None, order=request.order or "random",
                                  seed=request.seed, task=request.task, model=request.model,
                                  task_sha256=request.task_sha256, augment=params.get("augment") or "none")
            plan = new_plan(params["strategy"], chosen.names, rounds, request.aggregator, request.seed)
        except ValueError as exc:  # PlanError too
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "; ".join([str(exc), *stale_warnings])) from None
        chosen.warnings[:0] = stale_warnings
        unreachable = []
        for p in chosen.order:
            try:
                st = self.stub(p).GetStatus(peer_pb2.StatusRequest(), timeout=self.probe_timeout)
                if st.name != p.name:
                    unreachable.append(f"{p.name} at {p.address} answers as {st.name!r}")
            except grpc.RpcError as exc:
                unreachable.append(f"{p.name} at {p.address} ({status_message(exc)})")
        if unreachable:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, "peers not reachable: " + "; ".join(unreachable))
        run_id = new_run_id()
        started_by = operator or INSECURE_OPERATOR
        chain = [{"name": p.name, "address": p.address} for p in chosen.order]
        self.ledger.create_run(run_id, strategy=params["strategy"], arch=chosen.model.model, seed=request.seed,
                               params=params, chain=chain, class_index=chosen.class_index,
                               model=chosen.model.to_dict(),
                               warnings=chosen.warnings, insecure=self.insecure, rounds=rounds, plan=plan.to_json(),
                               started_by=started_by)
        cycles = f", {rounds} rounds ({len(plan.hops)} hops)" if rounds > 1 else ""
        shape = (f"{len(chain)} sites in parallel, aggregated at {plan.aggregator}: {', '.join(chosen.names)}"
                 if plan.aggregator else f"{len(chain)} sites{cycles}: {' -> '.join(chosen.names)}")
        self.ledger.add_event(run_id, "started", f"run {run_id}: {params['strategy']} over {shape}; task "
                              f"{chosen.model.task} {chosen.model.task_version} (code SHA-256 "
                              f"{chosen.model.task_sha256[:12]}…), model {chosen.model.model}; started by {started_by}",
                              started_by=started_by,
                              order=chosen.names, rounds=rounds, aggregator=plan.aggregator, task=chosen.model.task,
                              task_version=chosen.model.task_version, task_sha256=chosen.model.task_sha256)
        self.monitor.run_started(run_id, params["strategy"], chosen.names, plan.aggregator, by())
        for w in chosen.warnings:
            self.ledger.add_event(run_id, "warning", w)
        self._assign(run_id, request, chosen, plan, operator)
        self.ledger.add_event(run_id, "assigned", "every site has its assignment")
        return cpb.StartChainReply(run_id=run_id, order=chosen.names, warnings=chosen.warnings)

    def _assign(self, run_id: str, request: cpb.StartChainRequest, chosen, plan: Plan, operator: str) -> None:
        """Give every chosen site its assignment, after every site's policy agreed; a refusal
        is recorded (``Ledger.refuse_run``) and raised (``Refused``, FAILED_PRECONDITION)."""
        spec = chosen.model.to_pb()
        chain = chosen.order
        address = {p.name: p.address for p in chain}
        n = len(chain)
        rounds = request.rounds or 1
        # Assign from the last site back to the first, so every receiver knows the run before its
        # sender can finish; the first site starts training as soon as it is assigned. A star plan
        # assigns its aggregating site first: it checks that its aggregator can handle the task's
        # model before any site trains.
        positions = list(reversed(range(n)))
        if plan.aggregator:
            positions.sort(key=lambda pos: chosen.names[pos] != plan.aggregator)
        assignments = {pos: peer_pb2.Assignment(
            run_id=run_id, position=pos, chain_length=n, seed=request.seed, params=request.params,
            model=spec, class_index=chosen.class_index, site=chosen.names[pos], order=chosen.names, rounds=rounds,
            aggregator=plan.aggregator, operator=operator, **plan.part_pb(chosen.names[pos], address))
            for pos in positions}
        # Every site's own policy first, before any site keeps or starts anything.
        refusal = site_policy.first_refusal(((chosen.names[pos], self.stub(chain[pos]), assignments[pos])
                                             for pos in positions), timeout=CONTROL_TIMEOUT)
        if refusal is not None:
            self.ledger.refuse_run(run_id, *refusal, policy=True)
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, self.ledger.run(run_id)["error"])
        for pos in positions:
            site, a = chosen.names[pos], assignments[pos]
            try:
                self.stub(chain[pos]).Assign(a, timeout=CONTROL_TIMEOUT)
            except grpc.RpcError as exc:
                reason, by_policy = assignment_refusal(exc)
                self.ledger.refuse_run(run_id, site, reason, policy=by_policy)
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, self.ledger.run(run_id)["error"]) from None

    def stop_run(self, run_id: str, who: str, reason: str) -> None:
        """Cancel a running run (see ``Ledger.cancel_run``) for ``who``: the monitor then delivers
        its end notices, and every site stops at its next epoch or transfer boundary and removes
        its partial files. Raises ``Refused`` (NOT_FOUND: unknown run; FAILED_PRECONDITION:
        already ended)."""
        run = self.ledger.run(run_id)
        if run is None:
            raise Refused(grpc.StatusCode.NOT_FOUND, f"unknown run {run_id!r}")
        if not self.ledger.cancel_run(run_id, who, reason):
            run = self.ledger.run(run_id)
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(run["ended"] or 0))
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          f"run {run_id} has already ended ({run['status']} at {when}); there is nothing to stop")
        log.info("run %s cancelled by %s%s", run["run_id"], who, f": {reason}" if reason else "")

    def recover(self, owe_relay_notice: Callable, submit_evaluation: Callable[[str], None],
                queue_reroutes: Callable) -> list[str]:
        """After a restart: finish what the ledger says was under way. Runs whose final model was
        reported but not yet evaluated are evaluated now (``submit_evaluation(run_id)``); the
        other running runs carry on by themselves (peers retry their reports until the
        coordinator answers). Relayed transfers not attested yet are owed their relay notice
        again (``owe_relay_notice``, as ``Notices.owe_relay_notice``). Reroutes are queued again
        (``queue_reroutes``, as ``Routing.queue_reroutes``) from the ledger's current plan for
        every site whose part differs from the plan as started (peers apply a route version
        once: those that had it ignore it), so a restart between recording a reroute and
        reaching the sites loses nothing. Returns the ids of the runs picked up."""
        picked = []
        for run_id in self.ledger.run_ids():
            run = self.ledger.run(run_id)
            if run["status"] == "running":
                picked.append(run_id)
                self.ledger.add_event(run_id, "state", "coordinator restarted: run picked up from the ledger")
                plans = self.ledger.plans(run_id)
                for purpose in ("chain", "upload", "final"):
                    for h in self.ledger.hops(run_id, purpose):
                        if h["route"] == "relayed" and h["receipt"] is None:
                            owe_relay_notice(run_id, purposes.wire_of_ledger(purpose), h["hop"], h["sender"],
                                             h["receiver"], h["relay"], h["sealed_bytes"], h["sealed_sha256"])
                if run["final_sha256"]:
                    submit_evaluation(run_id)
                elif len(plans) > 1:
                    queue_reroutes(run, Plan.from_json(plans[0]["plan"]), Plan.from_json(plans[-1]["plan"]),
                                   plans[-1]["version"])
        return picked
