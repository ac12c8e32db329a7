"""The coordinator daemon: gRPC servicer over the ledger, chain start-up, final evaluation.

The coordinator assigns roles and records; it never sits on the chain's path.

Authorization (mutual TLS; identity = the caller's certificate name, never a message field):
peers' calls (Register, Report*) only from site identities, each only as itself (``name``,
``sender`` or ``site`` must equal the certificate name); operator calls (StartChain, WatchRun,
GetRun, ListRuns, ListPeers, FetchModel) only from the ``operator`` or ``coordinator`` identity.
Refusals are PERMISSION_DENIED. On an insecure (plaintext) coordinator there are no identities
and only the ledger's name checks apply. After the last
site reports the final model (which it has already copied to every site), the coordinator asks
each site to evaluate it on its own test split, and records per-site and global accuracy.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from fedrelay import __version__, names, wire
from fedrelay.coordinator.ledger import TERMINAL, Ledger
from fedrelay.coordinator.planner import PeerInfo, PlanError, plan_chain
from fedrelay.v1 import common_pb2, coordinator_pb2 as cpb, coordinator_pb2_grpc, peer_pb2, peer_pb2_grpc

log = logging.getLogger("fedrelay.coordinator")

HEARTBEAT_SECONDS = 10
END_NOTICE_RETRY = 10.0  # seconds before an end notice a live site did not take is sent again
DEFAULT_PEER_TIMEOUT = 120.0  # seconds a site may go without a heartbeat before it is routed around
PURPOSES = {common_pb2.CHAIN_HOP: "chain", common_pb2.FINAL_MODEL: "final"}
STRATEGIES = ("fedelmy", "fedseq")
SELECTIONS = ("best-val", "last-epoch")


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def params_dict(p: common_pb2.TrainingParams) -> dict:
    return {
        "strategy": p.strategy, "models_per_site": p.models_per_site, "local_epochs": p.local_epochs,
        "warmup_epochs": p.warmup_epochs, "alpha": p.alpha, "beta": p.beta, "lr": p.lr,
        "batch_size": p.batch_size, "weight_decay": p.weight_decay, "selection": p.selection,
    }


def check_params(p: common_pb2.TrainingParams) -> None:
    """Raise ``PlanError`` for hyperparameters no peer could run."""
    if p.strategy not in STRATEGIES:
        raise PlanError(f"unknown strategy {p.strategy!r}: choose one of {', '.join(STRATEGIES)}")
    if p.selection not in SELECTIONS:
        raise PlanError(f"unknown selection {p.selection!r}: choose one of {', '.join(SELECTIONS)}")
    if p.models_per_site < 1 or p.local_epochs < 1:
        raise PlanError("--models-per-site and --local-epochs must be >= 1")
    if p.lr <= 0 or p.batch_size < 1 or p.weight_decay < 0 or p.alpha < 0 or p.beta < 0:
        raise PlanError("--lr and --batch-size must be > 0; --alpha, --beta, weight decay >= 0")


class CoordinatorService(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, ledger: Ledger, *, transport: wire.Transport = wire.INSECURE,
                 peer_timeout: float = DEFAULT_PEER_TIMEOUT, probe_timeout: float = 10.0):
        self.ledger = ledger
        self.transport = transport
        self.insecure = not transport.secure
        if peer_timeout <= 0:
            raise ValueError("--peer-timeout must be > 0 seconds")
        self.peer_timeout = peer_timeout  # seconds without a heartbeat before a site is routed around
        self.probe_timeout = probe_timeout
        self.heartbeat_seconds = max(1, min(HEARTBEAT_SECONDS, int(peer_timeout / 4)))
        self._pending: dict[tuple[str, str], peer_pb2.RerouteRequest] = {}
        self._end_retry: dict[tuple[str, str], float] = {}  # (run, site) -> monotonic time of the next try
        self.eval_retry = 300.0  # seconds an evaluation waits for an unreachable site
        self._eval_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="evaluate")

    # -- authorization ---------------------------------------------------------------------------
    def _as_site(self, context, claimed: str) -> None:
        """Abort with PERMISSION_DENIED unless the caller is the site ``claimed`` (TLS only)."""
        who = wire.caller_identity(context)
        if who is None:
            return
        if who in (wire.COORDINATOR_IDENTITY, wire.OPERATOR_IDENTITY):
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"the {who} identity cannot act as a site")
        if who != claimed:
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"certificate identity {who!r} cannot register or report as {claimed!r}")

    def _as_operator(self, context) -> None:
        """Abort with PERMISSION_DENIED unless the caller is the operator or coordinator (TLS only)."""
        who = wire.caller_identity(context)
        if who is not None and who not in (wire.OPERATOR_IDENTITY, wire.COORDINATOR_IDENTITY):
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"{who!r} is a site identity; only the operator may call this")

    def _peer_channel(self, site: dict | PeerInfo | common_pb2.SiteRef) -> grpc.Channel:
        """A channel to a site's daemon at its latest registered address (a daemon restarted
        elsewhere re-registers), else the address given."""
        name, address = (site["name"], site["address"]) if isinstance(site, dict) else (site.name, site.address)
        return self.transport.channel(self._address(name, address), expect=name)

    def _address(self, name: str, fallback: str = "") -> str:
        """The address ``name`` last registered with, else ``fallback``."""
        peer = self.ledger.peer(name)
        return peer["address"] if peer else fallback

    # -- peers' calls ----------------------------------------------------------------------------
    def Register(self, request: cpb.RegisterRequest, context) -> cpb.RegisterReply:
        names.check_registration(request)
        self._as_site(context, request.name)
        if not request.name or not request.address:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "name and address are required")
        try:
            wire.split_hostport(request.address)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        classes = [{"name": c.name, "train": c.train, "test": c.test} for c in request.classes]
        self.ledger.upsert_peer(request.name, request.address, classes,
                                (request.channels, request.height, request.width),
                                request.device, request.version)
        return cpb.RegisterReply(version=__version__, heartbeat_seconds=self.heartbeat_seconds)

    def ResolveSite(self, request: cpb.ResolveSiteRequest, context) -> common_pb2.SiteRef:
        """The address a site last registered with. Any authenticated caller (under TLS every
        certificate is this trial's) may ask: a sender re-resolves a receiver that stopped
        answering, in case it came back elsewhere."""
        names.check_resolve(request)
        peer = self.ledger.peer(request.name)
        if peer is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no site {request.name!r} has registered")
        return common_pb2.SiteRef(name=peer["name"], address=peer["address"])

    def _running_run(self, run_id: str, context) -> dict:
        run = self.ledger.run(run_id)
        if run is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown run {run_id!r}")
        return run

    def _site_in_run(self, run: dict, site: str, context) -> None:
        if site not in [s["name"] for s in run["chain"]]:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"{site!r} is not a site of run {run['run_id']}")

    def _skipped(self, run_id: str) -> set[str]:
        return {k["site"] for k in self.ledger.skips(run_id)}

    def _live_order(self, run: dict) -> list[dict]:
        """The run's sites in chain order, without those routed around."""
        skipped = self._skipped(run["run_id"])
        return [c for c in run["chain"] if c["name"] not in skipped]

    def ReportHop(self, request: cpb.HopReport, context) -> cpb.ReportReply:
        names.check_hop_report(request)
        self._as_site(context, request.sender)
        run = self._running_run(request.run_id, context)
        self._site_in_run(run, request.sender, context)
        if request.sender in self._skipped(request.run_id):  # a site routed around, back too late
            self.ledger.add_event(request.run_id, "state", f"ignored a hop report from {request.sender} "
                                  "(routed around)", site=request.sender)
            return cpb.ReportReply(duplicate=True)
        purpose = PURPOSES.get(request.purpose)
        if purpose is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "purpose must be CHAIN_HOP or FINAL_MODEL")
        new = self.ledger.record_hop(request.run_id, purpose, request.hop, request.sender, request.receiver,
                                     request.payload_bytes, request.wire_bytes, request.sha256,
                                     request.started, request.ended, request.attempts, request.resumed_from)
        if new:
            if purpose == "chain" and not run["model_bytes"]:
                self.ledger.update_run(request.run_id, model_bytes=request.payload_bytes)
            seconds = request.ended - request.started
            what = f"hop {request.hop}" if purpose == "chain" else "final model"
            retried = (f", {request.attempts} attempts" if request.attempts > 1 else "") + (
                f", resumed at byte {request.resumed_from}" if request.resumed_from else "")
            self.ledger.add_event(
                request.run_id, "hop" if purpose == "chain" else "final_copy",
                f"{what}: {request.sender} -> {request.receiver}, {request.payload_bytes} bytes, "
                f"sha256 {request.sha256[:12]}, {seconds:.2f} s{retried}",
                site=request.sender, hop=request.hop, sender=request.sender, receiver=request.receiver,
                payload_bytes=request.payload_bytes, wire_bytes=request.wire_bytes,
                sha256=request.sha256, seconds=seconds, attempts=max(1, request.attempts),
                resumed_from=request.resumed_from,
            )
        return cpb.ReportReply(duplicate=not new)

    def ReportProgress(self, request: cpb.ProgressReport, context) -> cpb.ReportReply:
        names.check_progress(request)
        self._as_site(context, request.site)
        run = self._running_run(request.run_id, context)
        self._site_in_run(run, request.site, context)
        if request.kind == "epoch":
            val = request.val_accuracy if request.val_accuracy >= 0 else None
            self.ledger.record_metric(request.run_id, request.site, request.stage, request.model,
                                      request.epoch, request.epochs, request.train_loss, val, request.seconds)
            what = request.stage if request.stage != "pool" else f"pool model {request.model}"
            val_s = f", val acc {val:.4f}" if val is not None else ""
            self.ledger.add_event(
                request.run_id, "epoch",
                f"{request.site}: {what}, epoch {request.epoch}/{request.epochs}, "
                f"loss {request.train_loss:.4f}{val_s}, {request.seconds:.1f} s",
                site=request.site, stage=request.stage, model=request.model, epoch=request.epoch,
                epochs=request.epochs, train_loss=request.train_loss, val_accuracy=val,
                seconds=request.seconds,
            )
        else:
            self.ledger.add_event(request.run_id, "state",
                                  f"{request.site}: {request.state}"
                                  + (f" ({request.detail})" if request.detail else ""),
                                  site=request.site, state=request.state, detail=request.detail)
        return cpb.ReportReply()

    def ReportFinal(self, request: cpb.FinalReport, context) -> cpb.ReportReply:
        names.check_final(request)
        self._as_site(context, request.site)
        run = self._running_run(request.run_id, context)
        last = self._live_order(run)[-1]["name"]
        if request.site != last:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"only the last site ({last}) reports the final model")
        if run["final_sha256"]:
            return cpb.ReportReply(duplicate=True)
        self.ledger.update_run(request.run_id, final_sha256=request.sha256, final_site=request.site,
                               model_bytes=run["model_bytes"] or request.model_bytes)
        self.ledger.add_event(request.run_id, "final",
                              f"final model from {request.site}: sha256 {request.sha256}, "
                              f"{request.model_bytes} bytes", site=request.site,
                              sha256=request.sha256, model_bytes=request.model_bytes)
        self._eval_pool.submit(self._evaluate_run, request.run_id)
        return cpb.ReportReply()

    def ReportFailure(self, request: cpb.FailureReport, context) -> cpb.ReportReply:
        names.check_failure(request)
        self._as_site(context, request.site)
        run = self._running_run(request.run_id, context)
        self._site_in_run(run, request.site, context)
        if request.site in self._skipped(request.run_id):
            self.ledger.add_event(request.run_id, "state", f"ignored a failure of {request.site} (routed around): "
                                  f"{request.error}", site=request.site)
            return cpb.ReportReply(duplicate=True)
        self._fail(request.run_id, f"{request.site}: {request.error}", site=request.site)
        return cpb.ReportReply()

    def _fail(self, run_id: str, error: str, site: str = "") -> None:
        self.ledger.finish_run(run_id, "failed", error=error, message=f"run failed: {error}", site=site)

    # -- routing around a site that stayed down ---------------------------------------------------
    def start_monitor(self, stop: threading.Event, interval: float = 1.0) -> None:
        """Watch running chains every ``interval`` seconds and route around sites whose last
        heartbeat is older than ``peer_timeout`` (see ``check_route``)."""
        def loop() -> None:
            while not stop.wait(interval):
                for run_id in self.ledger.running_run_ids():
                    try:
                        self.check_route(run_id)
                    except Exception:  # noqa: BLE001 - one bad run must not stop the monitor
                        log.exception("route check of run %s failed", run_id)
                self._send_reroutes()
                try:
                    self._send_end_notices()
                except Exception:  # noqa: BLE001 - the monitor goes on
                    log.exception("sending end notices failed")

        threading.Thread(target=loop, name="route-monitor", daemon=True).start()

    def _dead(self, names: list[str]) -> set[str]:
        now = time.time()
        seen = {p["name"]: p["last_seen"] or 0 for p in self.ledger.peers()}
        return {n for n in names if now - seen.get(n, 0) > self.peer_timeout}

    def check_route(self, run_id: str) -> list[str]:
        """Route a running chain around sites that stayed down; returns the sites newly skipped.

        The model of a one-shot chain sits at one site at a time: the receiver of the latest
        hop (or the first site). If that site is down past ``peer_timeout``, its model is lost
        with it: the latest live site that sent a model before it sends its model again, to
        the next live site, and every site in between is skipped (their training is not in the
        final model). If the site that should receive next is down, it is skipped and the
        holder sends past it. A first site that dies before sending makes the next live site
        the first (it warms up a fresh model). Skips are recorded in the ledger and shown in the
        run's summary (``skipped``, ``contributors``); every site whose neighbours change gets a
        ``Peer.Reroute``.
        """
        run = self.ledger.run(run_id)
        if run is None or run["status"] != "running" or run["final_sha256"]:
            return []
        live = [c["name"] for c in self._live_order(run)]
        dead = self._dead(live)
        if not dead:
            return []
        hops = [h for h in self.ledger.hops(run_id) if h["receiver"] in live]
        holder = hops[-1]["receiver"] if hops else live[0]
        skip: list[str] = []
        if holder in dead:
            senders = [h["sender"] for h in hops if h["sender"] in live and h["sender"] not in dead]
            source = senders[-1] if senders else None
            start = live.index(source) + 1 if source else 0
            skip = [n for n in live[start:live.index(holder) + 1]]
        else:
            after = live[live.index(holder) + 1:]
            if after and after[0] in dead:
                skip = [after[0]]
        if not skip:
            return []
        if len(skip) >= len(live):
            self._fail(run_id, "every site of the chain is unreachable")
            return []
        for name in skip:
            if self.ledger.add_skip(run_id, name, f"no heartbeat for more than {self.peer_timeout:.0f} s"):
                self.ledger.add_event(run_id, "skip", f"{name} unreachable for more than {self.peer_timeout:.0f} s: "
                                      "routed around it", site=name)
        self._plan_reroutes(run, live)
        return skip

    @staticmethod
    def _route(names: list[str]) -> tuple[dict[str, tuple[str | None, str | None]], str, tuple[str, ...]]:
        """(site -> (predecessor, successor), last site, final recipients) of a chain order."""
        neighbours = {n: (names[i - 1] if i else None, names[i + 1] if i + 1 < len(names) else None)
                      for i, n in enumerate(names)}
        return neighbours, names[-1], tuple(names[:-1])

    def _plan_reroutes(self, run: dict, old_live: list[str]) -> None:
        """Queue a Reroute for every live site whose neighbours (or, for the last, recipients) changed."""
        new_live = [c["name"] for c in self._live_order(run)]
        (old, old_last, old_rec), (new, last, rec) = self._route(old_live), self._route(new_live)
        address = {c["name"]: self._address(c["name"], c["address"]) for c in run["chain"]}
        version = len(self.ledger.skips(run["run_id"]))
        skipped = sorted(self._skipped(run["run_id"]))
        # The last site goes last, so that the others know it before it copies the final model.
        for n in sorted(new_live, key=lambda m: m == last):
            if old.get(n) == new[n] and old_last == last and not (n == last and old_rec != rec):
                continue
            pred, succ = new[n]
            r = peer_pb2.RerouteRequest(run_id=run["run_id"], last_site=last, skipped=skipped, route_version=version)
            if pred:
                r.predecessor.CopyFrom(common_pb2.SiteRef(name=pred, address=address[pred]))
            if succ:
                r.successor.CopyFrom(common_pb2.SiteRef(name=succ, address=address[succ]))
            else:
                r.final_recipients.extend(common_pb2.SiteRef(name=m, address=address[m]) for m in rec)
            self._pending[(run["run_id"], n)] = r

    def _send_reroutes(self) -> None:
        for (run_id, site), request in list(self._pending.items()):
            run = self.ledger.run(run_id)
            address = next(c["address"] for c in run["chain"] if c["name"] == site)
            try:
                with self._peer_channel({"name": site, "address": address}) as ch:
                    peer_pb2_grpc.PeerStub(ch).Reroute(request, timeout=wire.CONTROL_TIMEOUT)
                self._pending.pop((run_id, site), None)
                self.ledger.add_event(run_id, "state", f"{site}: rerouted (predecessor "
                                      f"{request.predecessor.name or 'none'}, successor {request.successor.name or 'none'})",
                                      site=site)
            except grpc.RpcError as exc:
                log.warning("reroute of %s in run %s not delivered yet: %s", site, run_id, wire.status_message(exc))

    def _send_end_notices(self) -> None:
        """Tell every site of an ended run that it is over (``Peer.EndRun``), so that a site
        routed around stops waiting for a model, a site of a failed run stops training or
        sending, and partial transfers are removed. Owed notices live in the ledger: a site
        that is down gets its notice once it heartbeats again (also after a coordinator
        restart); a site that failed to answer is tried again after ``END_NOTICE_RETRY`` s."""
        pending = self.ledger.pending_end_notices()
        if not pending:
            return
        dead = self._dead(sorted({n["site"] for n in pending}))
        now = time.monotonic()
        for n in pending:
            key = (n["run_id"], n["site"])
            if n["site"] in dead or self._end_retry.get(key, 0) > now:
                continue
            skipped = n["site"] in self._skipped(n["run_id"])
            reason = "this site was routed around" if skipped else (n["error"] or "")
            try:  # a live site has registered: _peer_channel dials its registered address
                with self._peer_channel({"name": n["site"], "address": ""}) as ch:
                    reply = peer_pb2_grpc.PeerStub(ch).EndRun(
                        peer_pb2.EndRunRequest(run_id=n["run_id"], status=n["status"], reason=reason), timeout=5.0)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:  # NOT_FOUND: the site never had the run
                    log.info("end of run %s not delivered to %s yet: %s", n["run_id"], n["site"],
                             wire.status_message(exc))
                    self._end_retry[key] = now + END_NOTICE_RETRY
                    continue
                reply = None
            self.ledger.end_notice_delivered(*key)
            self._end_retry.pop(key, None)
            if reply is not None and (reply.state == "ended" or reply.removed_bytes):
                self.ledger.add_event(n["run_id"], "state", f"{n['site']}: told the run is over; its state "
                                      f"{reply.state}, {reply.removed_bytes} bytes of partial transfers removed",
                                      site=n["site"])

    # -- final evaluation -----------------------------------------------------------------------
    def _call_peer(self, site: dict, method: str, request, *, timeout: float):
        """One call to a site's peer daemon, retried with backoff while the site is unreachable
        (a restarting daemon, a dropped link) for up to ``self.eval_retry`` seconds."""
        deadline = time.monotonic() + self.eval_retry
        delay = 0.5
        while True:
            try:
                with self._peer_channel(site) as ch:
                    return getattr(peer_pb2_grpc.PeerStub(ch), method)(request, timeout=timeout)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() + delay > deadline:
                    raise
                log.warning("%s unreachable for %s (%s); retrying", site["name"], method, wire.status_message(exc))
                time.sleep(delay)
                delay = min(15.0, delay * 2)

    def recover(self) -> list[str]:
        """After a restart: finish what the ledger says was under way. Runs whose final model was
        reported but not yet evaluated are evaluated now; the other running runs carry on by
        themselves (peers retry their reports until the coordinator answers). Reroutes are
        recomputed from the ledger's skips and sent again to every site whose route differs from
        the original order (peers apply a route version once: those that had it ignore it), so
        a restart between recording a skip and reaching the sites loses nothing. Returns the
        ids of the runs picked up."""
        picked = []
        for run_id in self.ledger.run_ids():
            run = self.ledger.run(run_id)
            if run["status"] == "running":
                picked.append(run_id)
                self.ledger.add_event(run_id, "state", "coordinator restarted: run picked up from the ledger")
                if run["final_sha256"]:
                    self._eval_pool.submit(self._evaluate_run, run_id)
                elif self.ledger.skips(run_id):
                    self._plan_reroutes(run, [c["name"] for c in run["chain"]])
        return picked

    def _evaluate_run(self, run_id: str) -> None:
        run = self.ledger.run(run_id)
        sha = run["final_sha256"]
        results, errors = {}, []

        def one(site: dict) -> None:
            try:
                reply = self._call_peer(site, "Evaluate", peer_pb2.EvaluateRequest(run_id=run_id, sha256=sha),
                                        timeout=wire.EVALUATE_TIMEOUT)
                results[site["name"]] = reply
                self.ledger.record_evaluation(run_id, site["name"], sha, reply.correct, reply.test_samples,
                                              reply.accuracy, reply.seconds)
                self.ledger.add_event(run_id, "evaluated",
                                      f"{site['name']}: accuracy {reply.accuracy:.4f} on "
                                      f"{reply.test_samples} test images", site=site["name"],
                                      accuracy=reply.accuracy, test_samples=reply.test_samples)
            except grpc.RpcError as exc:
                errors.append(f"{site['name']}: {wire.status_message(exc)}")

        with ThreadPoolExecutor(max_workers=4) as pool:
            list(pool.map(one, self._live_order(run)))
        if errors:
            self._fail(run_id, "evaluation failed at " + "; ".join(errors))
            return
        correct = sum(r.correct for r in results.values())
        total = sum(r.test_samples for r in results.values())
        accuracy = correct / total if total else 0.0
        self.ledger.finish_run(run_id, "finished", accuracy=accuracy,
                               message=f"run finished: global accuracy {accuracy:.4f} on {total} test images",
                               test_samples=total)

    # -- operator calls ---------------------------------------------------------------------------
    def StartChain(self, request: cpb.StartChainRequest, context) -> cpb.StartChainReply:
        names.check_start_chain(request)
        self._as_operator(context)
        peers = [
            PeerInfo(name=p["name"], address=p["address"],
                     classes={c["name"]: (c["train"], c["test"]) for c in p["classes"]},
                     shape=(p["channels"], p["height"], p["width"]), device=p["device"])
            for p in self.ledger.peers()
        ]
        try:
            check_params(request.params)
            plan = plan_chain(peers, names=list(request.peers) or None, order=request.order or "random",
                              seed=request.seed, arch=request.arch or "cnn")
        except PlanError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        unreachable = []
        for p in plan.order:
            try:
                with self._peer_channel(p) as ch:
                    st = peer_pb2_grpc.PeerStub(ch).GetStatus(peer_pb2.StatusRequest(), timeout=self.probe_timeout)
                if st.name != p.name:
                    unreachable.append(f"{p.name} at {p.address} answers as {st.name!r}")
            except grpc.RpcError as exc:
                unreachable.append(f"{p.name} at {p.address} ({wire.status_message(exc)})")
        if unreachable:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          "peers not reachable: " + "; ".join(unreachable))
        run_id = new_run_id()
        chain = [{"name": p.name, "address": p.address} for p in plan.order]
        params = params_dict(request.params)
        self.ledger.create_run(run_id, strategy=params["strategy"], arch=plan.model["arch"], seed=request.seed,
                               params=params, chain=chain, class_index=plan.class_index, model=plan.model,
                               warnings=plan.warnings, insecure=self.insecure)
        self.ledger.add_event(run_id, "started", f"run {run_id}: {params['strategy']} over "
                              f"{len(chain)} sites: {' -> '.join(plan.names)}", order=plan.names)
        for w in plan.warnings:
            self.ledger.add_event(run_id, "warning", w)
        spec = common_pb2.ModelSpec(arch=plan.model["arch"], in_channels=plan.model["in_channels"],
                                    height=plan.model["height"], width=plan.model["width"],
                                    num_classes=plan.model["num_classes"])
        refs = [common_pb2.SiteRef(name=p.name, address=p.address) for p in plan.order]
        n = len(refs)
        # Assign from the last site back to the first, so every successor knows the run before
        # its predecessor can finish; the first site starts training as soon as it is assigned.
        for pos in reversed(range(n)):
            a = peer_pb2.Assignment(
                run_id=run_id, position=pos, chain_length=n, seed=request.seed, params=request.params,
                model=spec, class_index=plan.class_index, site=refs[pos].name, order=plan.names)
            if pos > 0:
                a.predecessor.CopyFrom(refs[pos - 1])
            if pos < n - 1:
                a.successor.CopyFrom(refs[pos + 1])
            else:
                a.final_recipients.extend(refs[:-1])
            try:
                with self._peer_channel(refs[pos]) as ch:
                    peer_pb2_grpc.PeerStub(ch).Assign(a, timeout=wire.CONTROL_TIMEOUT)
            except grpc.RpcError as exc:
                error = f"assignment refused by {refs[pos].name}: {wire.status_message(exc)}"
                self._fail(run_id, error, site=refs[pos].name)
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, error)
        self.ledger.add_event(run_id, "assigned", "every site has its assignment")
        return cpb.StartChainReply(run_id=run_id, order=plan.names, warnings=plan.warnings)

    def WatchRun(self, request: cpb.WatchRunRequest, context):
        names.check_run_request(request)
        self._as_operator(context)
        if self.ledger.run(request.run_id) is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown run {request.run_id!r}")
        seq = request.after_seq
        while context.is_active():
            events = self.ledger.events_after(request.run_id, seq)
            for e in events:
                seq = e["seq"]
                yield cpb.RunEvent(run_id=e["run_id"], seq=e["seq"], time=e["time"], kind=e["kind"],
                                   site=e["site"], message=e["message"], data_json=e["data"])
            if not events:
                if self.ledger.run(request.run_id)["status"] in TERMINAL:
                    return
                self.ledger.wait_for_events(1.0)

    def GetRun(self, request: cpb.GetRunRequest, context) -> cpb.RunSummary:
        names.check_run_request(request)
        self._as_operator(context)
        summary = self.summary(request.run_id)
        if summary is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown run {request.run_id!r}")
        return summary

    def ListRuns(self, request, context) -> cpb.ListRunsReply:
        self._as_operator(context)
        return cpb.ListRunsReply(runs=[self.summary(r) for r in self.ledger.run_ids()])

    def ListPeers(self, request, context) -> cpb.ListPeersReply:
        self._as_operator(context)
        out = cpb.ListPeersReply()
        for p in self.ledger.peers():
            out.peers.add(name=p["name"], address=p["address"], channels=p["channels"] or 0,
                          height=p["height"] or 0, width=p["width"] or 0, device=p["device"] or "",
                          last_seen=p["last_seen"] or 0,
                          classes=[cpb.ClassCount(**c) for c in p["classes"]])
        return out

    def FetchModel(self, request: peer_pb2.FetchModelRequest, context):
        names.check_run_request(request)
        self._as_operator(context)
        run = self.ledger.run(request.run_id)
        if run is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown run {request.run_id!r}")
        if not run["final_sha256"]:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"run {request.run_id} has no final model yet")
        last = run["chain"][-1]
        try:
            with self._peer_channel(last) as ch:
                stream = peer_pb2_grpc.PeerStub(ch).FetchModel(
                    peer_pb2.FetchModelRequest(run_id=request.run_id, sha256=run["final_sha256"]),
                    timeout=wire.transfer_timeout(run["model_bytes"] or 0))
                yield from stream
        except grpc.RpcError as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"cannot fetch the final model from {last['name']}: {wire.status_message(exc)}")

    # -- summaries --------------------------------------------------------------------------------
    def summary(self, run_id: str) -> cpb.RunSummary | None:
        run = self.ledger.run(run_id)
        if run is None:
            return None
        s = cpb.RunSummary(
            run_id=run_id, strategy=run["strategy"], order=[c["name"] for c in run["chain"]],
            model_bytes=run["model_bytes"] or 0, status=run["status"], seed=run["seed"], arch=run["arch"],
            class_index=run["class_index"], warnings=run["warnings"], error=run["error"] or "",
            created=run["created"], ended=run["ended"] or 0, insecure=bool(run["insecure"]),
            params=common_pb2.TrainingParams(**run["params"]),
        )
        skipped = self._skipped(run_id)
        s.skipped.extend(c["name"] for c in run["chain"] if c["name"] in skipped)
        s.contributors.extend(c["name"] for c in run["chain"] if c["name"] not in skipped)
        for purpose, field in (("chain", s.hops), ("final", s.final_transfers)):
            for h in self.ledger.hops(run_id, purpose):
                field.add(hop=h["hop"], sender=h["sender"], receiver=h["receiver"],
                          payload_bytes=h["payload_bytes"], wire_bytes=h["wire_bytes"], sha256=h["sha256"],
                          started=h["started"], ended=h["ended"], attempts=h["attempts"],
                          resumed_from=h["resumed_from"])
        if run["status"] == "finished":
            s.final.sha256 = run["final_sha256"] or ""
            s.final.accuracy = run["accuracy"] or 0.0
            for e in self.ledger.evaluations(run_id):
                s.final.per_site[e["site"]].accuracy = e["accuracy"]
                s.final.per_site[e["site"]].test_samples = e["test_samples"]
        return s


def serve(listen: str, db: str | Path, *, transport: wire.Transport, ready: threading.Event | None = None,
          stop: threading.Event | None = None, peer_timeout: float = DEFAULT_PEER_TIMEOUT) -> None:
    """Run the coordinator until ``stop`` is set (or forever), with mutual TLS unless ``transport``
    is insecure (then every run it starts is recorded as insecure). Raises ``RuntimeError`` if it
    cannot bind, ``ValueError`` if a TLS identity is not the coordinator's."""
    if transport.secure and transport.identity != wire.COORDINATOR_IDENTITY:
        raise ValueError(f"--tls {transport.source}: this is the identity {transport.identity!r}, "
                         f"not {wire.COORDINATOR_IDENTITY!r} (use PKI/coordinator from `coordinator init-ca`)")
    ledger = Ledger(db)
    service = CoordinatorService(ledger, transport=transport, peer_timeout=peer_timeout)
    server, port = wire.make_server(listen, transport=transport)
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(service, server)
    server.start()
    log.info("coordinator %s listening on %s (%s), ledger %s", __version__, wire.with_port(listen, port),
             "mutual TLS" if transport.secure else "INSECURE plaintext", db)
    picked = service.recover()
    if picked:
        log.info("picked up %d running run(s) from the ledger: %s", len(picked), ", ".join(picked))
    if ready is not None:
        ready.set()
    stop = stop or threading.Event()
    service.start_monitor(stop)
    try:
        while not stop.wait(1.0):
            pass
    finally:
        server.stop(grace=2).wait()
        ledger.close()
