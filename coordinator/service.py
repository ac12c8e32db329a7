"""The coordinator daemon's gRPC servicer: it authorizes each call, translates the request, asks
the module that owns the behaviour, and translates the answer (a ``Refused`` becomes the gRPC
status it names). The coordinator assigns roles and records; it never sits on the chain's path.

Where the behaviour lives (``coordinator/``): ``registration`` (Register, heartbeats, name
claims, ResolveSite, control streams, ForgetPeer, Revoke), ``lifecycle`` (StartChain, StopRun,
failing a run, picking runs up after a restart), ``reports`` (the five report handlers),
``routing`` (routing around sites that stayed down, reroutes, the monitor thread), ``notices``
(end and relay notices), ``evaluation`` (the end-of-run evaluation), ``summary`` (GetRun,
ListRuns, ListPeers, GetMetrics), ``fetching`` (FetchModel), ``relay_permits`` (the relay's
permits and grants), ``events`` (WatchRun); shared: ``run_plans`` (the runs' parsed plans),
``site_channels`` (the channels to the sites), ``owed`` (what the sites are owed).

Authorization (mutual TLS; identity = the caller's certificate name, never a message field):
peers' calls (Register, Report*) only from site identities, each only as itself (``name``,
``sender`` or ``site`` must equal the certificate name); operator calls (StartChain, WatchRun,
GetRun, ListRuns, ListPeers, FetchModel, GetMetrics, StopRun, ForgetPeer) only from an operator
identity (``operator``, or ``operator.NAME`` from ``coordinator enroll --operator NAME``) or the
``coordinator`` identity; the ledger records which operator started (``started_by``) or stopped
(``cancelled_by``) each run.
Refusals are PERMISSION_DENIED. Under TLS every report and evaluation must also be signed by the
reporting site's key (``coordinator/signatures.py``; the ledger keeps the signed records for
``coordinator audit``). On an insecure (plaintext) coordinator there are no identities
and only the ledger's name checks apply. After the last
site reports the final model (which it has already copied to every site), the coordinator asks
each site to evaluate it on its own test split, and records per-site and global accuracy.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from contextlib import contextmanager
from pathlib import Path

import grpc

from fedrelay import __version__, checks, names, signing
from fedrelay.addresses import split_hostport, with_port
from fedrelay.callers import COORDINATOR_IDENTITY, caller_identity, is_operator
from fedrelay.server import check_bindable, make_server
from fedrelay.transport import INSECURE, Transport
from fedrelay.coordinator import fetching, lifecycle, monitoring, relay_bounds, replies
from fedrelay.coordinator.evaluation import Evaluator
from fedrelay.coordinator.events import EventHub
from fedrelay.coordinator.ledger import TERMINAL, Ledger
from fedrelay.coordinator.lifecycle import INSECURE_OPERATOR, Runs
from fedrelay.coordinator.live import LiveState
from fedrelay.coordinator.monitoring import CoordinatorMonitor
from fedrelay.coordinator.notices import Notices
from fedrelay.coordinator.owed import Owed
from fedrelay.coordinator.refusal import Refused
from fedrelay.coordinator.registration import Registrar
from fedrelay.coordinator.relay_server import RelayService
from fedrelay.coordinator.relay_permits import RelayPermits
from fedrelay.coordinator.reports import Reports
from fedrelay.coordinator.revocations import Revocations
from fedrelay.coordinator.routing import Routing, start_monitor
from fedrelay.coordinator.run_plans import RunPlans
from fedrelay.coordinator.signatures import Signatures
from fedrelay.coordinator.site_channels import SiteChannels
from fedrelay.coordinator.summary import Summaries
from fedrelay.coordinator.tunnel_server import Tunnels
from fedrelay.final_model import MODEL_SPEC_METADATA
from fedrelay.health import COORDINATOR_SERVICE, Health
from fedrelay.v1 import common_pb2, coordinator_pb2 as cpb, coordinator_pb2_grpc, peer_pb2, relay_pb2_grpc

log = logging.getLogger("fedrelay.coordinator")

DEFAULT_PEER_TIMEOUT = 120.0  # seconds a site may go without a heartbeat before it is routed around


@contextmanager
def _answering(context):
    """Abort the call with the status of a ``Refused`` raised inside."""
    try:
        yield
    except Refused as exc:
        context.abort(exc.code, exc.message)


class _Part:
    """An attribute of the servicer that is the attribute ``name`` of its part ``part``."""

    def __init__(self, part: str, name: str):
        self.part, self.name = part, name

    def __get__(self, service, owner=None):
        return self if service is None else getattr(getattr(service, self.part), self.name)

    def __set__(self, service, value) -> None:
        setattr(getattr(service, self.part), self.name, value)


class CoordinatorService(coordinator_pb2_grpc.CoordinatorServicer):
    """The Coordinator servicer over ``ledger``: mutual TLS unless ``transport`` is insecure;
    ``peer_timeout``: seconds without a heartbeat before a site is routed around (> 0, else
    ``ValueError``); ``probe_timeout``: seconds a chosen site has to answer at StartChain;
    ``relay_dir``: the folder of this coordinator's own relay (None: none); ``relay``: the
    operator's relay (HOST:PORT) that ``RegisterReply`` names to the sites instead.

    Its parts, each a module of ``coordinator/``: ``registrar``, ``runs``, ``reports``,
    ``routing``, ``notices``, ``evaluator``, ``summaries``, ``relay_permits``, over the shared
    ``plans`` (``RunPlans``), ``channels`` (``SiteChannels``) and ``owed`` (``Owed``)."""

    def __init__(self, ledger: Ledger, *, transport: Transport = INSECURE,
                 peer_timeout: float = DEFAULT_PEER_TIMEOUT, probe_timeout: float = 10.0,
                 relay_dir: str | Path | None = None, relay: str = ""):
        self.ledger = ledger
        self.transport = transport
        self.insecure = not transport.secure
        # Signed records (coordinator/signatures.py): the sites' reports and evaluations are
        # verified before the ledger keeps them; each ended run's seal is signed with our key.
        self.signatures = Signatures(transport)
        # Revoked sites and the revocation list this coordinator publishes (coordinator/revocations.py).
        self.revocations = Revocations(ledger, transport)
        ledger.sealer = self.signatures.seal
        if peer_timeout <= 0:
            raise ValueError("--peer-timeout must be > 0 seconds")
        self.peer_timeout = peer_timeout  # seconds without a heartbeat before a site is routed around
        self.probe_timeout = probe_timeout
        self.owed = Owed()
        self.monitor = CoordinatorMonitor(self)  # metrics and the event log (coordinator/monitoring.py)
        self.events = EventHub(ledger)  # recent events in memory, pushed to watchers (coordinator/events.py)
        self.live = LiveState(self.events)  # each site's live state in running runs (show while running)
        # A heartbeat's time stays in memory for at most a quarter of --peer-timeout (at most 30 s).
        ledger.last_seen_flush = min(ledger.last_seen_flush, peer_timeout / 4)
        self.plans = RunPlans(ledger)
        # Sites that only connect out: their control streams (coordinator/tunnel_server.py).
        self.tunnels = Tunnels()
        self.tunnels.on_open.append(self.owed.tunnel_opened)
        self.channels = SiteChannels(ledger, transport, self.tunnels)
        stub, fail = self.channels.stub, functools.partial(lifecycle.fail, ledger)
        self.registrar = Registrar(ledger, self.tunnels, self.revocations, self.monitor, stub, peer_timeout)
        revoked = self.registrar.revoked_sites
        # The relay: this coordinator's own (``relay_dir``; None: none), or the operator's at
        # ``relay`` (HOST:PORT), which RegisterReply names to the sites.
        self.relay_address = relay
        self.relay_permits = RelayPermits(ledger, self.plans.planned, self.plans.current, stub)
        self.relay = RelayService(relay_dir, authorize=self.relay_permits.permit) if relay_dir is not None and not relay else None
        self.routing = Routing(ledger, self.plans, self.owed, stub, self.channels.address, revoked, peer_timeout)
        self.notices = Notices(ledger, self.owed, stub, self.routing.dead, self.plans.skipped,
                               relay_address=relay, relay_permits=self.relay_permits, relay=self.relay)
        self.evaluator = Evaluator(ledger, self.signatures, stub, self.plans.live_order, fail, self.owed.receipts)
        self.reports = Reports(ledger, self.plans, self.owed, self.monitor, self.notices, self.tunnels,
                               self.channels.address, self.evaluator.submit)
        self.runs = Runs(ledger, stub, revoked, self.monitor, insecure=self.insecure, peer_timeout=peer_timeout,
                         probe_timeout=probe_timeout)
        self.summaries = Summaries(ledger, self.live, self.revocations, self.plans.skipped, revoked, self.tunnels,
                                   peer_timeout)
        # Progress reports per run member, rate-limited (a token bucket each).
        ledger.on_run_ended.append(lambda run_id, status, error: self.progress_limit.forget(run_id))

    # The progress reports' rate limit (a ``ProgressLimit``) and the seconds an evaluation waits
    # for an unreachable site, read and set on the parts that use them.
    progress_limit = _Part("reports", "progress_limit")
    eval_retry = _Part("evaluator", "eval_retry")

    # -- authorization ---------------------------------------------------------------------------
    def _as_site(self, context, claimed: str) -> None:
        """Abort with PERMISSION_DENIED unless the caller is the site ``claimed`` (TLS only)."""
        who = caller_identity(context)
        if who is None:
            return
        if who == COORDINATOR_IDENTITY or is_operator(who):
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"the {who} identity cannot act as a site")
        if who != claimed:
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"certificate identity {who!r} cannot register or report as {claimed!r}")

    def _as_operator(self, context) -> None:
        """Abort with PERMISSION_DENIED unless the caller is an operator (``operator`` or
        ``operator.NAME``) or the coordinator (TLS only)."""
        who = caller_identity(context)
        if who is not None and who != COORDINATOR_IDENTITY and not is_operator(who):
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"{who!r} is a site identity; only the operator may call this")

    def _known_run(self, run_id: str, context) -> dict:
        """The run's ledger row; aborts NOT_FOUND for an unknown run."""
        run = self.ledger.run(run_id)
        if run is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown run {run_id!r}")
        return run

    # -- the daemon's life -----------------------------------------------------------------------
    def close(self) -> None:
        """Close the channels to the sites and the metrics endpoint (the daemon is stopping)."""
        self.monitor.close()
        self.tunnels.close()
        self.channels.close()

    def recover(self) -> list[str]:
        """After a restart: pick up the running runs from the ledger (``Runs.recover``)."""
        return self.runs.recover(self.notices.owe_relay_notice, self.evaluator.submit, self.routing.queue_reroutes)

    def start_monitor(self, stop: threading.Event, interval: float = 1.0) -> None:
        """Watch running runs every ``interval`` seconds until ``stop``: route around sites that
        stayed down, deliver reroutes, end and relay notices, drop what ended runs left at the
        relay (``routing.start_monitor``)."""
        start_monitor(self.ledger, self.routing.check_route,
                      [self.routing.send_reroutes, self.notices.send_end_notices, self.notices.send_relay_notices,
                       self.notices.drop_ended_relayed], stop, interval)

    def summary(self, run_id: str) -> cpb.RunSummary | None:
        """The run's summary, None for an unknown run (``Summaries.run``)."""
        return self.summaries.run(run_id)

    # -- peers' calls ----------------------------------------------------------------------------
    def Register(self, request: cpb.RegisterRequest, context) -> cpb.RegisterReply:
        names.check_registration(request)
        self._as_site(context, request.name)
        pem = (context.auth_context() or {}).get("x509_pem_cert") or []
        with _answering(context):
            self.registrar.register(request, pem[0] if pem else None)
        return cpb.RegisterReply(version=__version__, heartbeat_seconds=self.registrar.heartbeat_period(),
                                 relay=self.relay_address, crl_number=self.revocations.list.number,
                                 revoked_sites=len(self.registrar.revoked_sites()))

    def ResolveSite(self, request: cpb.ResolveSiteRequest, context) -> common_pb2.SiteRef:
        """The address a site last registered with. Any authenticated caller (under TLS every
        certificate is this trial's) may ask: a sender re-resolves a receiver that stopped
        answering, in case it came back elsewhere."""
        names.check_resolve(request)
        with _answering(context):
            return self.registrar.resolve(request.name)

    def Connect(self, request_iterator, context):
        """The control stream of a site that only connects out (``Registrar.control_stream``):
        the site's hello names it (its certificate must too) and the daemon instance it
        registered with; then the coordinator's calls for it go down this stream until it ends."""
        hello = next(request_iterator, None)
        if hello is None:
            return
        names.check_site_name(hello.site, "site")
        names.check_label(hello.instance, "instance")
        self._as_site(context, hello.site)
        with _answering(context):
            yield from self.registrar.control_stream(hello.site, hello.instance, request_iterator,
                                                     context.is_active)

    def GrantRelay(self, request: cpb.RelayGrantRequest, context) -> common_pb2.RelayGrant:
        """A planned sender's leave to send a transfer through the operator's relay: the
        coordinator's signed grant (``coordinator/relay_bounds.py``). Mutual TLS only."""
        names.check_run_id(request.run_id)
        names.check_site_name(request.receiver, "receiver")
        names.check_hop(request.index, "index")
        who = caller_identity(context)
        if who is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "relay grants need mutual TLS")
        self._as_site(context, who)
        try:
            return self.relay_permits.grant(signing.signer_for(self.transport), request.run_id, request.purpose,
                                            request.index, who, request.receiver)
        except PermissionError as exc:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        except relay_bounds.CapUnknown as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

    # -- the sites' reports (coordinator/reports.py) ----------------------------------------------
    def _signed_report(self, request, context, site: str, admit, record) -> cpb.ReportReply:
        """A report signed by ``site``, the caller: ``admit(request)`` (None: nothing more is
        recorded, answered as a duplicate), the site's signature checked
        (``coordinator/signatures.py``), then ``record(admitted, signed record)`` (False: a repeated
        report)."""
        self._as_site(context, site)
        with _answering(context):
            admitted = admit(request)
            if admitted is None:
                return cpb.ReportReply(duplicate=True)
            new = record(admitted, self.signatures.report(request, context, site))
        return cpb.ReportReply(duplicate=not new)

    def ReportHop(self, request: cpb.HopReport, context) -> cpb.ReportReply:
        checks.check_hop_report(request)
        return self._signed_report(request, context, request.sender, self.reports.admit_hop,
                                   lambda admitted, signed: self.reports.record_hop(request, *admitted, signed))

    def ReportReceipt(self, request: cpb.ReceiptReport, context) -> cpb.ReportReply:
        """The receiver's side of a transfer: what it verified and kept (``Reports.settle``)."""
        checks.check_receipt(request)
        return self._signed_report(request, context, request.receiver, self.reports.admit_receipt,
                                   lambda admitted, signed: self.reports.record_receipt(request, *admitted[:2], signed))

    def ReportProgress(self, request: cpb.ProgressReport, context) -> cpb.ReportReply:
        checks.check_progress(request)
        self._as_site(context, request.site)
        with _answering(context):
            return cpb.ReportReply(duplicate=not self.reports.progress(request))

    def ReportFinal(self, request: cpb.FinalReport, context) -> cpb.ReportReply:
        checks.check_final(request)
        return self._signed_report(request, context, request.site, self.reports.admit_final,
                                   lambda run, signed: self.reports.record_final(request, run, signed) or True)

    def ReportFailure(self, request: cpb.FailureReport, context) -> cpb.ReportReply:
        checks.check_failure(request)
        return self._signed_report(request, context, request.site, self.reports.admit_failure,
                                   lambda run, signed: self.reports.record_failure(request, signed) or True)

    # -- operator calls ---------------------------------------------------------------------------
    def StartChain(self, request: cpb.StartChainRequest, context) -> cpb.StartChainReply:
        names.check_start_chain(request)
        self._as_operator(context)
        with _answering(context):
            return self.runs.start_chain(request, caller_identity(context) or "", lambda: monitoring.caller(context))

    def WatchRun(self, request: cpb.WatchRunRequest, context):
        names.check_run_request(request)
        self._as_operator(context)
        run = self._known_run(request.run_id, context)
        for e in self.events.watch(request.run_id, request.after_seq, run["status"] in TERMINAL, context.is_active):
            yield cpb.RunEvent(run_id=e["run_id"], seq=e["seq"], time=e["time"], kind=e["kind"],
                               site=e["site"], message=e["message"], data_json=e["data"])

    def GetRun(self, request: cpb.GetRunRequest, context) -> cpb.RunSummary:
        names.check_run_request(request)
        self._as_operator(context)
        summary = self.summary(request.run_id)
        if summary is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown run {request.run_id!r}")
        return replies.bounded_summary(summary)

    def ListRuns(self, request: cpb.ListRunsRequest, context) -> cpb.ListRunsReply:
        """The runs in the order they were created, in pages under the message cap
        (``coordinator/replies.py``): from the run after ``request.after``."""
        self._as_operator(context)
        if request.after:
            names.check_run_id(request.after, "after")
        with _answering(context):
            runs, more = self.summaries.runs_after(request.after)
        return cpb.ListRunsReply(runs=runs, next_after=runs[-1].run_id if more else "")

    def ListPeers(self, request: cpb.ListPeersRequest, context) -> cpb.ListPeersReply:
        """The registered peers by name, in pages under the message cap: from the peer after
        ``request.after``."""
        self._as_operator(context)
        if request.after:
            names.check_site_name(request.after, "after")
        peers, more = self.summaries.peers_after(request.after)
        return cpb.ListPeersReply(peers=peers, next_after=peers[-1].name if more else "")

    def GetMetrics(self, request: cpb.GetRunRequest, context) -> cpb.MetricsReply:
        """The run's per-epoch training metrics (the ledger's ``metrics`` table), in the order
        the coordinator recorded them, in pages under the message cap from row
        ``request.offset`` (``next_offset``: where the next page starts). NOT_FOUND for an
        unknown run."""
        names.check_run_request(request)
        self._as_operator(context)
        self._known_run(request.run_id, context)
        kept, more = self.summaries.metrics(request.run_id, request.offset)
        return cpb.MetricsReply(run_id=request.run_id, rows=kept,
                                next_offset=request.offset + len(kept) if more else 0)

    def FetchModel(self, request: peer_pb2.FetchModelRequest, context):
        """The run's final model, streamed from a site that holds it (``coordinator/fetching.py``)."""
        names.check_run_request(request)
        self._as_operator(context)
        with _answering(context):
            run, holders = fetching.final_model(self.ledger, request.run_id)
            # What the operator's client writes into the fetched file's metadata (fedrelay/final_model.py).
            context.send_initial_metadata(((MODEL_SPEC_METADATA, json.dumps(run["model"])),))
            yield from fetching.stream(run, holders, self.channels.stub, self.channels.address)

    # -- run control ------------------------------------------------------------------------------
    def StopRun(self, request: cpb.StopRunRequest, context) -> cpb.RunSummary:
        """Cancel a running run (``Runs.stop_run``). Aborts NOT_FOUND (unknown run) or
        FAILED_PRECONDITION (already ended)."""
        names.check_run_id(request.run_id)
        names.check_text(request.reason, "reason", max_chars=1000)
        self._as_operator(context)
        with _answering(context):
            self.runs.stop_run(request.run_id, caller_identity(context) or INSECURE_OPERATOR, request.reason)
        return self.summary(request.run_id)

    def ForgetPeer(self, request: cpb.ForgetPeerRequest, context) -> cpb.ForgetPeerReply:
        """Remove a peer's registration (``Registrar.forget``). Aborts NOT_FOUND (unknown name)
        or FAILED_PRECONDITION (a site of a running run, not routed around)."""
        names.check_site_name(request.name, "name")
        self._as_operator(context)
        with _answering(context):
            return self.registrar.forget(request.name, self.plans.skipped)

    # -- revocation -------------------------------------------------------------------------------
    def Revoke(self, request: cpb.RevocationRequest, context) -> cpb.RevocationReply:
        """Record and publish a site's revocation, then route its running runs around it
        (``Registrar.revoke``). Aborts INVALID_ARGUMENT for a list that is not usable,
        FAILED_PRECONDITION on a plaintext coordinator."""
        names.check_site_name(request.name, "name")
        names.check_text(request.reason, "reason", max_chars=1000)
        self._as_operator(context)
        with _answering(context):
            return self.registrar.revoke(request, caller_identity(context) or INSECURE_OPERATOR,
                                         self.plans.skipped, self.routing.check_route, self.insecure)

    def GetCrl(self, request: cpb.CrlRequest, context) -> cpb.CrlReply:
        """The newest revocation list and the revoked sites (any authenticated caller)."""
        return self.revocations.reply(self.registrar.certificates)


def serve(listen: str, db: str | Path, *, transport: Transport, ready: threading.Event | None = None,
          stop: threading.Event | None = None, peer_timeout: float = DEFAULT_PEER_TIMEOUT,
          web: str | None = None, metrics_listen: str | None = None, relay_dir: str | Path | None = None,
          relay: str = "", web_hosts: list[str] | tuple[str, ...] = (), operator_listen: str | None = None) -> None:
    """Run the coordinator until ``stop`` is set (or forever), with mutual TLS unless ``transport``
    is insecure (then every run it starts is recorded as insecure), the gRPC health service
    (``fedrelay.health``) and, with ``metrics_listen`` (``HOST:PORT``), Prometheus metrics over
    HTTP (``coordinator/monitoring.py``). ``web``: PORT or HOST:PORT of the live run page
    (``coordinator.web``; off when None); ``web_hosts``: extra names its ``Host:`` may carry
    (``coordinator/http_limits.py``). ``operator_listen``: a second HOST:PORT for the operator's
    commands, with a connection quota of its own (``docs/limits.md``; best on loopback).
    Raises ``RuntimeError`` if it cannot bind,
    ``ValueError`` if a TLS identity is not the coordinator's or ``web``, ``metrics_listen``,
    ``operator_listen`` or a ``web_hosts`` name is malformed.

    The relay (``coordinator/relay_server.py``) for sites that cannot be reached directly: under mutual
    TLS the coordinator serves it, keeping envelopes in ``relay_dir`` (default: the folder
    ``relay`` beside the ledger), unless ``relay`` names the operator's own relay (HOST:PORT,
    told to every site at registration). A plaintext coordinator serves none (sealing needs
    certificates)."""
    if transport.secure and transport.identity != COORDINATOR_IDENTITY:
        raise ValueError(f"--tls {transport.source}: this is the identity {transport.identity!r}, "
                         f"not {COORDINATOR_IDENTITY!r} (use PKI/coordinator from `coordinator init-ca`)")
    if relay:
        names.check_address(relay, "--relay")
    check_bindable(listen)  # before the ledger file is created
    if operator_listen:
        try:
            split_hostport(operator_listen)
        except ValueError as exc:
            raise ValueError(f"--operator-listen: {exc}") from None
    ledger = Ledger(db)
    if transport.secure and not relay and relay_dir is None:
        relay_dir = Path(db).resolve().parent / "relay"
    service = CoordinatorService(ledger, transport=transport, peer_timeout=peer_timeout,
                                 relay_dir=relay_dir if transport.secure else None, relay=relay)
    guard = service.monitor.guard()
    guard.watch(service.revocations.list)  # revoked sites' calls refused, those in flight cancelled
    server, port = make_server(listen, transport=transport, guard=guard,
                               also=[operator_listen] if operator_listen else [])
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(service, server)
    if service.relay is not None:
        relay_pb2_grpc.add_RelayServicer_to_server(service.relay, server)
    health = Health(server, COORDINATOR_SERVICE)
    if metrics_listen:
        service.monitor.serve_http(metrics_listen)
    server.start()
    log.info("coordinator %s listening on %s (%s), ledger %s", __version__, with_port(listen, port),
             "mutual TLS" if transport.secure else "INSECURE plaintext", db)
    if operator_listen:
        log.info("operator listener on %s (connections of its own)",
                 with_port(operator_listen, server.also_ports[0]))
    page = _start_web(web, service, server, ledger, web_hosts) if web else None
    picked = service.recover()
    if picked:
        log.info("picked up %d running run(s) from the ledger: %s", len(picked), ", ".join(picked))
    health.serving()
    if ready is not None:
        ready.set()
    stop = stop or threading.Event()
    service.start_monitor(stop)
    try:
        while not stop.wait(1.0):
            pass
    finally:
        log.info("coordinator shutting down")
        health.stopping()
        if page is not None:
            page.stop()
        server.stop(grace=2).wait()
        service.close()
        ledger.close()


def _start_web(web: str, service: CoordinatorService, server: grpc.Server, ledger: Ledger, hosts=()):
    """The live run page on ``web``; when it cannot start, the gRPC server and ledger are closed
    before the error propagates."""
    from fedrelay.coordinator.web import start_web

    try:
        return start_web(web, service, hosts=hosts)
    except BaseException:
        server.stop(grace=0).wait()
        service.close()
        ledger.close()
        raise
