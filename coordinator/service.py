"""The coordinator daemon: gRPC servicer over the ledger, chain start-up, final evaluation.

The coordinator assigns roles and records; it never sits on the chain's path.

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

import json
import logging
import math
import queue
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from fedrelay import __version__, checks, names, params as run_params, privacy, registry, signing, text
from fedrelay.addresses import split_hostport, with_port
from fedrelay.callers import COORDINATOR_IDENTITY, caller_identity, is_operator
from fedrelay.calls import (assignment_refusal, backoff_delays, CONTROL_TIMEOUT, EVALUATE_TIMEOUT, status_message,
                            transfer_timeout)
from fedrelay.server import check_bindable, make_server
from fedrelay.transport import INSECURE, Transport
from fedrelay.coordinator.ledger import TERMINAL, Ledger, LedgerConflict
from fedrelay.coordinator import evaluation
from fedrelay.coordinator.events import EventHub
from fedrelay.coordinator.monitoring import CoordinatorMonitor
from fedrelay.health import COORDINATOR_SERVICE, Health
from fedrelay.coordinator.live import LiveState
from fedrelay.coordinator.plan import (PeerInfo, Plan, PlanError, Transfer, chain_plan, choose_sites,
                                       pick_aggregator, replan, star_plan)
from fedrelay.coordinator import relay_bounds
from fedrelay.coordinator.progress_limit import ProgressLimit
from fedrelay.coordinator.relay import RelayService
from fedrelay.coordinator.relay_bounds import Permit
from fedrelay.coordinator.relay_permits import RelayPermits
from fedrelay.coordinator.revocations import RevocationRefused, Revocations
from fedrelay.coordinator import forgotten, replies, site_policy
from fedrelay import purpose as purposes
from fedrelay.coordinator.signatures import Signatures
from fedrelay.coordinator.tunnel import Tunnels
from fedrelay.final_model import MODEL_SPEC_METADATA
from fedrelay.signing import SignatureError
from fedrelay.tasks.offers import Offer
from fedrelay.v1 import (common_pb2, coordinator_pb2 as cpb, coordinator_pb2_grpc, peer_pb2, peer_pb2_grpc,
                         relay_pb2_grpc)

log = logging.getLogger("fedrelay.coordinator")

HEARTBEAT_SECONDS = 10  # seconds between a site's heartbeats, with few sites (see heartbeat_period)
HEARTBEATS_PER_SECOND = 2.0  # with many sites, all of them together heartbeat about this often
END_NOTICE_RETRY = 10.0  # seconds before an end notice a live site did not take is sent again
RELAY_NOTICE_RETRY = 30.0  # seconds before a relay notice is sent again while the receipt has not come
DEFAULT_PEER_TIMEOUT = 120.0  # seconds a site may go without a heartbeat before it is routed around
CLAIM_PROBE_TIMEOUT = 3.0  # seconds the coordinator waits for the registered daemon of a name claimed anew
INSECURE_OPERATOR = "insecure operator"  # who cancelled a run, on a plaintext coordinator


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


class CoordinatorService(coordinator_pb2_grpc.CoordinatorServicer):
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
        self.heartbeat_seconds = max(1, min(HEARTBEAT_SECONDS, int(peer_timeout / 4)))
        self._pending: dict[tuple[str, str], peer_pb2.RerouteRequest] = {}
        self._end_retry: dict[tuple[str, str], float] = {}  # (run, site) -> monotonic time of the next try
        self.eval_retry = 300.0  # seconds an evaluation waits for an unreachable site
        self._eval_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="evaluate")
        self._channels: dict[tuple[str, str], tuple[grpc.Channel, peer_pb2_grpc.PeerStub]] = {}
        self._channels_lock = threading.Lock()
        self.monitor = CoordinatorMonitor(self)  # metrics and the event log (coordinator/monitoring.py)
        self.events = EventHub(ledger)  # recent events in memory, pushed to watchers (coordinator/events.py)
        self.live = LiveState(self.events)  # each site's live state in running runs (show while running)
        # A heartbeat's time stays in memory for at most a quarter of --peer-timeout (at most 30 s).
        ledger.last_seen_flush = min(ledger.last_seen_flush, peer_timeout / 4)
        self._plan_cache: dict[tuple[str, int], tuple[Plan, dict]] = {}  # (run, version) -> plan, transfer index
        # Sites that only connect out: their control streams (coordinator/tunnel.py), and the
        # certificates sites presented at registration (a sender seals a relayed payload to one).
        self.tunnels = Tunnels()
        self.tunnels.on_open.append(self._tunnel_opened)
        self._certificates: dict[str, bytes] = {}
        # The relay: this coordinator's own (``relay_dir``; None: none), or the operator's at
        # ``relay`` (HOST:PORT), which RegisterReply names to the sites.
        self.relay_address = relay
        self.relay_permits = RelayPermits(ledger, self._planned, self._plan, self._peer)  # coordinator/relay_permits.py
        self.relay = RelayService(relay_dir, authorize=self._relay_authorize) if relay_dir is not None and not relay else None
        # Relayed transfers whose receiver has not attested yet: key -> (notice, monotonic time of the next try).
        self._relay_notices: dict[tuple[str, str, int, str], list] = {}
        self._relay_lock = threading.Lock()
        self._receipts = threading.Condition()  # notified by every receipt (evaluation waits for relayed copies)
        # Chain hops whose outbound-only receiver was told to prepare on its sender's behalf: (run, hop).
        self._prepared: set[tuple[str, int]] = set()
        # Progress reports per run member, rate-limited (a token bucket each).
        self.progress_limit = ProgressLimit()
        ledger.on_run_ended.append(lambda run_id, status, error: self.progress_limit.forget(run_id))

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

    def _peer(self, site: dict | PeerInfo | common_pb2.SiteRef) -> peer_pb2_grpc.PeerStub:
        """The Peer stub of a site's daemon at its latest registered address (a daemon restarted
        elsewhere re-registers), else the address given. One channel per (site, address) is
        made once and reused by every call (gRPC reconnects it as needed); ``close`` closes them."""
        name, address = (site["name"], site["address"]) if isinstance(site, dict) else (site.name, site.address)
        key = (name, self._address(name, address))
        if not key[1]:  # a site that only connects out: over its control stream
            return self.tunnels.stub(name)
        with self._channels_lock:
            if key not in self._channels:
                channel = self.transport.channel(key[1], expect=name)
                self._channels[key] = (channel, peer_pb2_grpc.PeerStub(channel))
            return self._channels[key][1]

    def close(self) -> None:
        """Close the channels to the sites and the metrics endpoint (the daemon is stopping)."""
        self.monitor.close()
        self.tunnels.close()
        with self._channels_lock:
            for channel, _ in self._channels.values():
                channel.close()
            self._channels.clear()

    def _address(self, name: str, fallback: str = "") -> str:
        """The address ``name`` last registered with, else ``fallback``."""
        peer = self.ledger.peer(name)
        return peer["address"] if peer else fallback

    # -- peers' calls ----------------------------------------------------------------------------
    def Register(self, request: cpb.RegisterRequest, context) -> cpb.RegisterReply:
        names.check_registration(request)
        self._as_site(context, request.name)
        if not request.name or not (request.address or request.outbound_only):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "name and address are required")
        if request.outbound_only and request.address:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a site that only connects out registers no address")
        if request.address:
            try:
                split_hostport(request.address)
            except ValueError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        refused = forgotten.refusal(self.ledger, request)  # forget-peer holds against that daemon
        if refused:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, refused)
        before = self._check_claim(request, context)
        pem = (context.auth_context() or {}).get("x509_pem_cert") or []
        if pem:
            self._certificates[request.name] = pem[0]
        try:
            offers = [Offer.from_pb(t).to_dict() for t in request.tasks]
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self.ledger.upsert_peer(request.name, request.address, offers, request.device, request.version)
        self.monitor.registered(request.name, request.address, before)
        if request.instance:
            self.ledger.set_peer_instance(request.name, request.instance)
        return cpb.RegisterReply(version=__version__, heartbeat_seconds=self.heartbeat_period(),
                                 relay=self.relay_address, crl_number=self.revocations.list.number,
                                 revoked_sites=len(self._revoked_sites()))

    def heartbeat_period(self) -> int:
        """Seconds between a site's heartbeats, told in every ``RegisterReply``: 10 (at most a
        quarter of ``--peer-timeout``), longer when so many sites are registered that all of them
        together would heartbeat more than ``HEARTBEATS_PER_SECOND`` times a second, but never
        longer than a quarter of ``--peer-timeout`` (a site is routed around only after missing
        about four heartbeats). Each heartbeat is a gRPC call that costs the coordinator CPU; this
        keeps a hop's cost at the coordinator flat from 3 to 100 sites (issue 13): at 100 sites
        and the default 120 s timeout, every 30 s."""
        many = math.ceil(self.ledger.registered_count() / HEARTBEATS_PER_SECOND)
        return max(self.heartbeat_seconds, min(many, int(self.peer_timeout / 4)))

    def _check_claim(self, request: cpb.RegisterRequest, context) -> dict | None:
        """A second daemon claiming a live site's name is refused (ALREADY_EXISTS, logged).

        Each daemon process registers with a random ``instance`` id. A registration of a
        registered name from another instance is refused only when the registered daemon is
        proven alive: it answers ``GetStatus`` at the registered address within
        ``CLAIM_PROBE_TIMEOUT`` seconds with the same name and instance id. Returns the name's
        registration before this one (None: the first). Otherwise (a
        daemon restarted after a crash, maybe on another port) the new one takes the name
        over, and that is logged. Heartbeats of the same instance are re-registrations."""
        old = self.ledger.peer(request.name)
        if old is None or not old["instance"] or not request.instance or old["instance"] == request.instance:
            return old
        alive = False
        if not old["address"]:  # it only connects out: alive while its control stream is open
            tunnel = self.tunnels.get(request.name)
            alive = tunnel is not None and tunnel.instance == old["instance"]
        elif old["address"] != request.address:
            try:
                st = self._peer(old).GetStatus(peer_pb2.StatusRequest(), timeout=CLAIM_PROBE_TIMEOUT)
                alive = st.name == request.name and st.instance == old["instance"]
            except grpc.RpcError:
                pass
        if alive:
            log.warning("refused the registration of %s from %s: a live daemon serves that name at %s",
                        request.name, request.address, old["address"])
            context.abort(grpc.StatusCode.ALREADY_EXISTS,
                          f"site {request.name!r} is already served by a live daemon at "
                          f"{old['address'] or 'a control stream'}; stop "
                          "that daemon first, or start this one with another --name")
        log.info("site %s: a new daemon at %s takes over the name from the one registered at %s "
                 "(it does not answer as that site any more)", request.name, request.address, old["address"])
        return old

    def ResolveSite(self, request: cpb.ResolveSiteRequest, context) -> common_pb2.SiteRef:
        """The address a site last registered with. Any authenticated caller (under TLS every
        certificate is this trial's) may ask: a sender re-resolves a receiver that stopped
        answering, in case it came back elsewhere."""
        names.check_resolve(request)
        peer = self.ledger.peer(request.name)
        if peer is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no site {request.name!r} has registered")
        return common_pb2.SiteRef(name=peer["name"], address=peer["address"],
                                  certificate=self._certificates.get(peer["name"], b""))

    def Connect(self, request_iterator, context):
        """The control stream of a site that only connects out (``coordinator/tunnel.py``): the
        site's hello names it (its certificate must too) and the daemon instance it registered
        with; then the coordinator's calls for it go down this stream until it ends. A newer
        stream of the same site replaces this one."""
        hello = next(request_iterator, None)
        if hello is None:
            return
        names.check_site_name(hello.site, "site")
        names.check_label(hello.instance, "instance")
        self._as_site(context, hello.site)
        peer = self.ledger.peer(hello.site)
        if peer is None or peer["address"]:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{hello.site} has not registered as a site that only connects out (register first)")
        if peer["instance"] and hello.instance != peer["instance"]:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, f"another daemon instance serves {hello.site}")
        tunnel = self.tunnels.open(hello.site, hello.instance)
        log.info("site %s: control stream open (it connects out only)", hello.site)

        def read() -> None:
            try:
                for reply in request_iterator:
                    tunnel.deliver(reply)
            except Exception:  # noqa: BLE001 - a broken stream: the calls waiting on it fail
                pass
            finally:
                tunnel.close()

        reader = threading.Thread(target=read, name=f"control-{hello.site}", daemon=True)
        reader.start()
        try:
            yield cpb.ControlRequest(id=0)  # the hello back: the stream is open
            while context.is_active() and not tunnel.closed.is_set():
                try:
                    yield tunnel.outbox.get(timeout=1.0)
                except queue.Empty:
                    continue
        finally:
            self.tunnels.drop(tunnel)
            log.info("site %s: control stream closed", hello.site)

    def _tunnel_opened(self, site: str) -> None:
        """A site's control stream (re)opened: what it is owed goes out at the next tick."""
        with self._relay_lock:
            for key, entry in self._relay_notices.items():
                if key[3] == site:
                    entry[1] = 0.0
        for key in [k for k in list(self._end_retry) if k[1] == site]:
            self._end_retry.pop(key, None)

    # -- the relay --------------------------------------------------------------------------------
    def _relay_authorize(self, run_id: str, purpose: int, index: int, sender: str, receiver: str) -> Permit:
        """The coordinator's relay carries only transfers of a running run's plan (any version),
        within their permit (``coordinator/relay_permits.py``). Raises ``PermissionError`` or
        ``relay_bounds.CapUnknown``."""
        return self.relay_permits.permit(run_id, purpose, index, sender, receiver)

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
            permit = self.relay_permits.permit(request.run_id, request.purpose, request.index, who, request.receiver)
        except PermissionError as exc:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        except relay_bounds.CapUnknown as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return relay_bounds.issue_grant(signing.signer_for(self.transport), request.run_id, request.purpose,
                                        request.index, who, request.receiver, permit)

    def _owe_relay_notice(self, run_id: str, purpose: int, index: int, sender: str, receiver: str,
                          relay: str, sealed_bytes: int, sealed_sha256: str) -> None:
        # "" (this coordinator's relay): the receiver fetches from the coordinator as it dials it
        notice = peer_pb2.RelayNotice(run_id=run_id, purpose=purpose, index=index, sender=sender,
                                      relay=self.relay_address, sealed_bytes=sealed_bytes, sealed_sha256=sealed_sha256)
        with self._relay_lock:
            self._relay_notices[(run_id, purposes.ledger_of_wire(purpose), index, receiver)] = [notice, 0.0]

    def _send_relay_notices(self) -> None:
        """Tell the receivers of relayed transfers that their envelope waits (``Peer.RelayReady``),
        over their control stream or directly; again every ``RELAY_NOTICE_RETRY`` seconds (and at
        once when a control stream reopens) until the receiver attests the transfer."""
        now = time.monotonic()
        with self._relay_lock:
            due = [(k, e[0]) for k, e in self._relay_notices.items() if e[1] <= now]
            for k, _ in due:
                self._relay_notices[k][1] = now + RELAY_NOTICE_RETRY
        for (run_id, purpose, index, receiver), notice in due:
            run = self.ledger.run(run_id)
            if run is None or run["status"] != "running":
                with self._relay_lock:
                    self._relay_notices.pop((run_id, purpose, index, receiver), None)
                continue
            try:
                reply = self._peer({"name": receiver, "address": ""}).RelayReady(notice, timeout=5.0)
                log.info("run %s: told %s that %s %d waits at the relay (%s)", run_id, receiver, purpose, index,
                         reply.state)
            except grpc.RpcError as exc:
                log.info("run %s: relay notice not delivered to %s yet: %s", run_id, receiver, status_message(exc))

    def _drop_ended_relayed(self) -> None:
        """Remove the envelopes the coordinator's relay holds for runs that have ended (and
        forget which of their hops' receivers were told to prepare)."""
        with self._relay_lock:
            ended = {k for k in self._prepared if (r := self.ledger.run(k[0])) is None or r["status"] in TERMINAL}
            self._prepared -= ended
        for run_id in self.relay_permits.runs():
            if (r := self.ledger.run(run_id)) is None or r["status"] in TERMINAL:
                self.relay_permits.forget(run_id)
        if self.relay is None:
            return
        self.relay.sweep()  # what was never fetched expires
        for run_id in self.relay.runs():
            run = self.ledger.run(run_id)
            if run is None or run["status"] in TERMINAL:
                removed = self.relay.drop_run(run_id)
                if removed:
                    log.info("relay: removed %d bytes of run %s (ended)", removed, run_id)

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

    def _parsed(self, run_id: str, version: dict) -> tuple[Plan, dict]:
        """A plan version (a row of ``Ledger.plans``) parsed once per (run, version), with its
        transfers indexed by (purpose, index, sender, receiver)."""
        key = (run_id, version["version"])
        hit = self._plan_cache.get(key)
        if hit is None:
            plan = Plan.from_json(version["plan"])
            hit = self._plan_cache[key] = (plan, {(t.purpose, t.index, t.sender, t.receiver): t
                                                  for t in plan.transfers})
        return hit

    def _plan(self, run_id: str) -> tuple[int, Plan]:
        """(version, plan) of the run's current plan."""
        latest = self.ledger.plans(run_id)[-1]
        return latest["version"], self._parsed(run_id, latest)[0]

    def _planned(self, run_id: str, purpose: str, index: int, sender: str, receiver: str) -> Transfer | None:
        """The transfer of any version of the run's plan with these fields, else None. A
        transfer made before a reroute dropped it is still a planned one (its report may come
        after the reroute). A dict lookup per version, whatever the number of sites."""
        for version in reversed(self.ledger.plans(run_id)):
            t = self._parsed(run_id, version)[1].get((purposes.from_ledger(purpose), index, sender, receiver))
            if t is not None:
                return t
        return None

    def _check_report(self, run: dict, purpose: str, index: int, sender: str, receiver: str,
                      payload_bytes: int, context) -> Transfer:
        """The checks every transfer report gets: a planned transfer, of the run's model size (an
        upload: of the size of the run's uploads, model plus the aggregator's extra tensors)."""
        t = self._planned(run["run_id"], purpose, index, sender, receiver)
        if t is None:
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"{sender} -> {receiver} is not transfer {index} ({purpose}) of run {run['run_id']}'s plan")
        size, what = ((run["upload_bytes"], "uploads are") if purpose == "upload" else (run["model_bytes"], "model is"))
        if size and payload_bytes != size:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{payload_bytes} bytes reported; the run's {what} {size} bytes")
        return t

    def _settle(self, run: dict, purpose: str, index: int, receiver: str) -> None:
        """After either end reported: a transfer both ends agree on fixes the run's model size and
        schema (the first one) or must match them; a disagreement becomes a warning event."""
        row = self.ledger.transfer(run["run_id"], purpose, index, receiver)
        if row is None:
            return
        what = {"chain": f"hop {index}", "upload": f"upload {index}"}.get(purpose, f"final copy to {receiver}")
        if row["status"] == "done":
            got = row["receipt"]
            fresh = self.ledger.run(run["run_id"])
            size, schema = ("upload_bytes", "upload_schema_sha256") if purpose == "upload" else (
                "model_bytes", "schema_sha256")
            if not fresh[size]:
                self.ledger.update_run(run["run_id"], **{size: got["payload_bytes"], schema: got["schema_sha256"]})
            elif fresh[schema] and got["schema_sha256"] != fresh[schema]:
                self.ledger.add_event(run["run_id"], "warning", f"{what}: the payload's tensors differ from the "
                                      "run's model (schema digest)", site=receiver)
        elif row["status"] == "disputed":
            got = row["receipt"]
            self.ledger.add_event(
                run["run_id"], "warning",
                f"{what} disputed: {row['sender']} reported {row['payload_bytes']} bytes, sha256 "
                f"{(row['sha256'] or '')[:12]}; {receiver} attests {got['payload_bytes']} bytes, sha256 "
                f"{got['sha256'][:12]} from {got['sender']}", site=receiver)

    def ReportHop(self, request: cpb.HopReport, context) -> cpb.ReportReply:
        checks.check_hop_report(request)
        self._as_site(context, request.sender)
        run = self._running_run(request.run_id, context)
        self._site_in_run(run, request.sender, context)
        if run["status"] == "cancelled":
            return cpb.ReportReply(duplicate=True)  # the run was stopped: nothing more is recorded
        if request.sender in self._skipped(request.run_id):  # a site routed around, back too late
            self.ledger.add_event(request.run_id, "state", f"ignored a hop report from {request.sender} "
                                  "(routed around)", site=request.sender)
            return cpb.ReportReply(duplicate=True)
        purpose = purposes.ledger_of_wire(request.purpose)
        if purpose is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, purposes.WIRE_ERROR)
        t = self._check_report(run, purpose, request.hop, request.sender, request.receiver,
                               request.payload_bytes, context)
        record = self.signatures.report(request, context, request.sender)
        try:
            with self.ledger.batch():  # the report, its event and what it settles: one commit
                new = self._record_hop(request, run, purpose, t, record)
        except LedgerConflict as exc:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        if new:
            self.monitor.transfer_reported(request, purpose)
        return cpb.ReportReply(duplicate=not new)

    def _record_hop(self, request: cpb.HopReport, run: dict, purpose: str, t: Transfer, record=None) -> bool:
        """ReportHop's writes (inside a ledger batch), the signed ``record`` bound to its event;
        False for a repeated report."""
        new = self.ledger.record_hop(request.run_id, purpose, request.hop, request.sender, request.receiver,
                                     request.payload_bytes, request.wire_bytes, request.sha256,
                                     request.started, request.ended, request.attempts, request.resumed_from,
                                     round=t.round, schema_sha256=request.schema_sha256, route=request.route or "direct",
                                     sealed_bytes=request.sealed_bytes, sealed_sha256=request.sealed_sha256,
                                     relay=request.relay)
        if new:
            seconds = request.ended - request.started
            what = {"chain": f"hop {request.hop}" + (f" (round {t.round})" if run["rounds"] > 1 else ""),
                    "upload": f"upload {request.hop}"}.get(purpose, "final model")
            retried = (f", {request.attempts} attempts" if request.attempts > 1 else "") + (
                f", resumed at byte {request.resumed_from}" if request.resumed_from else "") + (
                f", through the relay ({request.sealed_bytes} sealed bytes)" if request.route == "relayed" else "")
            self.ledger.add_event(
                request.run_id, {"chain": "hop", "upload": "upload"}.get(purpose, "final_copy"),
                f"{what}: {request.sender} -> {request.receiver}, {request.payload_bytes} bytes, "
                f"sha256 {request.sha256[:12]}, {seconds:.2f} s{retried}",
                site=request.sender, hop=request.hop, round=t.round, sender=request.sender,
                receiver=request.receiver, payload_bytes=request.payload_bytes, wire_bytes=request.wire_bytes,
                sha256=request.sha256, seconds=seconds, attempts=max(1, request.attempts),
                resumed_from=request.resumed_from, route=request.route or "direct", record=record,
            )
            self._settle(run, purpose, request.hop, request.receiver)
            if request.route == "relayed" and self.ledger.transfer(request.run_id, purpose, request.hop,
                                                                    request.receiver)["receipt"] is None:
                self._owe_relay_notice(request.run_id, request.purpose, request.hop, request.sender, request.receiver,
                                       request.relay, request.sealed_bytes, request.sealed_sha256)
                # at once, not at the monitor's next tick (the receiver waits for it)
                threading.Thread(target=self._send_relay_notices, name="relay-notice", daemon=True).start()
        return new

    def ReportReceipt(self, request: cpb.ReceiptReport, context) -> cpb.ReportReply:
        """The receiver's side of a transfer: what it verified and kept (see ``_settle``)."""
        checks.check_receipt(request)
        self._as_site(context, request.receiver)
        run = self._running_run(request.run_id, context)
        self._site_in_run(run, request.receiver, context)
        if run["status"] == "cancelled":
            return cpb.ReportReply(duplicate=True)  # the run was stopped: nothing more is recorded
        purpose = purposes.ledger_of_wire(request.purpose)
        if purpose is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, purposes.WIRE_ERROR)
        self._check_report(run, purpose, request.hop, request.sender, request.receiver, request.payload_bytes, context)
        record = self.signatures.report(request, context, request.receiver)
        try:
            with self.ledger.batch():  # the receipt, its event and what it settles: one commit
                new = self.ledger.record_receipt(request.run_id, purpose, request.hop, request.sender,
                                                 request.receiver, request.payload_bytes, request.sha256,
                                                 request.schema_sha256, request.received,
                                                 route=request.route or "direct",
                                                 relay_wire_bytes=request.relay_wire_bytes)
                if new:
                    what = {"chain": f"hop {request.hop}", "upload": f"upload {request.hop}"}.get(purpose, "final model")
                    self.ledger.add_event(
                        request.run_id, "receipt", f"{request.receiver} attests {what} from {request.sender}: "
                        f"{request.payload_bytes} bytes, sha256 {request.sha256[:12]}", site=request.receiver,
                        hop=request.hop, purpose=purpose, sender=request.sender, receiver=request.receiver,
                        payload_bytes=request.payload_bytes, sha256=request.sha256, record=record)
                    self._settle(run, purpose, request.hop, request.receiver)
        except LedgerConflict as exc:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        with self._relay_lock:
            self._relay_notices.pop((request.run_id, purpose, request.hop, request.receiver), None)
        with self._receipts:
            self._receipts.notify_all()
        return cpb.ReportReply(duplicate=not new)

    def ReportProgress(self, request: cpb.ProgressReport, context) -> cpb.ReportReply:
        checks.check_progress(request)
        self._as_site(context, request.site)
        run = self._running_run(request.run_id, context)
        self._site_in_run(run, request.site, context)
        if run["status"] == "cancelled":
            return cpb.ReportReply(duplicate=True)  # the run was stopped: nothing more is recorded
        if not self.progress_limit.admit(request.run_id, request.site):
            return cpb.ReportReply(duplicate=True)  # over this member's rate (coordinator/progress_limit.py)
        if request.kind == "epoch":
            val = request.val_accuracy if request.val_accuracy >= 0 else None
            with self.ledger.batch():  # the metric and its event: one commit
                self._record_epoch(request, val)
            self.monitor.progress(request)
        else:
            self.ledger.add_event(request.run_id, "state",
                                  f"{request.site}: {request.state}"
                                  + (f" ({request.detail})" if request.detail else ""),
                                  site=request.site, state=request.state, detail=request.detail)
            if request.state == "training":
                try:
                    self._prepare_receiver(run, request.site)
                except Exception:  # noqa: BLE001 - a hint never fails the report it rides on
                    log.exception("run %s: could not pass on %s's prepare hint", request.run_id, request.site)
        return cpb.ReportReply()

    def _prepare_receiver(self, run: dict, sender: str) -> None:
        """``sender`` started training: when the receiver of its next chain hop connects out
        only, tell it to start its worker (``Peer.Prepare`` over its control stream, on the
        sender's behalf: the sender cannot reach it, ``peer/node.py`` ``_tell_receiver``), once
        per hop, in the background. A hint: a failure is logged at debug level."""
        run_id = run["run_id"]
        if not self.tunnels.any_open():
            return  # no site connects out only: every sender reaches its receiver (no ledger read)
        if not self.ledger.plans(run_id):
            return  # no plan recorded (a run made by hand in a test)
        received = {h["hop"] for h in self.ledger.hops(run_id) if h["receipt"]}
        hops = [t for t in self._plan(run_id)[1].hops if t.sender == sender and t.index not in received]
        if not hops:
            return
        t = min(hops, key=lambda t: t.index)
        if self._address(t.receiver) or self.tunnels.get(t.receiver) is None:
            return  # the sender reaches it directly (or the receiver is not connected now)
        with self._relay_lock:
            if (run_id, t.index) in self._prepared:
                return
            self._prepared.add((run_id, t.index))

        def tell() -> None:
            try:
                self.tunnels.stub(t.receiver).Prepare(peer_pb2.PrepareRequest(run_id=run_id, sender=sender),
                                                      timeout=CONTROL_TIMEOUT)
            except Exception as exc:  # noqa: BLE001 - a hint
                log.debug("run %s: could not tell %s to prepare: %s", run_id, t.receiver, exc)

        threading.Thread(target=tell, daemon=True, name=f"prepare-{t.receiver}").start()

    def _record_epoch(self, request: cpb.ProgressReport, val: float | None) -> None:
        """ReportProgress's writes for a finished epoch (inside a ledger batch)."""
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

    def ReportFinal(self, request: cpb.FinalReport, context) -> cpb.ReportReply:
        checks.check_final(request)
        self._as_site(context, request.site)
        run = self._running_run(request.run_id, context)
        if run["status"] == "cancelled":
            return cpb.ReportReply(duplicate=True)  # the run was stopped: nothing more is recorded
        last = self._plan(request.run_id)[1].final_site
        if request.site != last:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"only the final site ({last}) reports the final model")
        if run["final_sha256"]:
            if run["final_sha256"] == request.sha256:
                return cpb.ReportReply(duplicate=True)
            context.abort(grpc.StatusCode.ALREADY_EXISTS, f"the final model was already reported with sha256 "
                                                          f"{run['final_sha256']}")
        copies = {h["sha256"] for h in self.ledger.hops(request.run_id, "final") if h["sender"] == request.site}
        if copies - {request.sha256, None}:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the final model's sha256 differs from the copies "
                                                            f"{request.site} reported sending")
        record = self.signatures.report(request, context, request.site)
        if request.missing:
            self._record_missing(run, list(request.missing), context)
        with self.ledger.batch():  # the final model, its event and its signed report: one commit
            self.ledger.update_run(request.run_id, final_sha256=request.sha256, final_site=request.site,
                                   model_bytes=run["model_bytes"] or request.model_bytes)
            self.ledger.add_event(request.run_id, "final",
                                  f"final model from {request.site}: sha256 {request.sha256}, "
                                  f"{request.model_bytes} bytes", site=request.site,
                                  sha256=request.sha256, model_bytes=request.model_bytes, record=record)
        self._submit_evaluation(request.run_id)
        return cpb.ReportReply()

    def _record_missing(self, run: dict, missing: list[str], context) -> None:
        """A star plan's aggregator combined the uploads without those of ``missing`` (they had
        not arrived within its upload timeout): they are routed around (no final copy, no
        evaluation), with a plan version that says so."""
        version, plan = self._plan(run["run_id"])
        order = [c["name"] for c in run["chain"]]
        if not plan.aggregator or any(m not in order or m == plan.aggregator for m in missing):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "missing uploads name sites that upload to no aggregator "
                                                            f"in run {run['run_id']}")
        skipped = self._skipped(run["run_id"])
        received = {h["sender"] for h in self.ledger.hops(run["run_id"], "upload")}
        new = star_plan(order, plan.aggregator, skipped | set(missing), received - set(missing))
        reason = "its upload had not arrived when the aggregator combined the others (upload timeout)"
        if self.ledger.reroute(run["run_id"], new.to_json(), [(m, reason) for m in sorted(missing)]) is not None:
            self.ledger.add_event(run["run_id"], "warning", f"the aggregator combined the uploads without "
                                  f"{', '.join(sorted(missing))} (upload timeout): no final copy, no evaluation there",
                                  site=plan.aggregator, missing=sorted(missing))

    def ReportFailure(self, request: cpb.FailureReport, context) -> cpb.ReportReply:
        checks.check_failure(request)
        self._as_site(context, request.site)
        run = self._running_run(request.run_id, context)
        self._site_in_run(run, request.site, context)
        if run["status"] == "cancelled":
            return cpb.ReportReply(duplicate=True)  # the run was stopped: nothing more is recorded
        if request.site in self._skipped(request.run_id):
            self.ledger.add_event(request.run_id, "state", f"ignored a failure of {request.site} (routed around): "
                                  f"{request.error}", site=request.site)
            return cpb.ReportReply(duplicate=True)
        record = self.signatures.report(request, context, request.site)
        self._fail(request.run_id, f"{request.site}: {request.error}", site=request.site, record=record)
        return cpb.ReportReply()

    def _fail(self, run_id: str, error: str, site: str = "", record=None) -> None:
        """End the run as failed with ``error`` (``record``: the site's signed failure report)."""
        self.ledger.finish_run(run_id, "failed", error=error, message=f"run failed: {error}", site=site,
                               record=record)

    # -- routing around a site that stayed down ---------------------------------------------------
    def start_monitor(self, stop: threading.Event, interval: float = 1.0) -> None:
        """Watch running runs every ``interval`` seconds: route around sites whose last heartbeat
        is older than ``peer_timeout`` (``check_route``), deliver reroutes and end notices. A
        failing step is logged with its traceback and tried again at the next tick; it never
        ends the monitor (which would silently stop every reroute and end notice)."""
        def tick() -> None:
            for run_id in self.ledger.running_run_ids():
                try:
                    self.check_route(run_id)
                except Exception:  # noqa: BLE001 - one bad run must not stop the others
                    log.exception("route check of run %s failed", run_id)
            for step in (self._send_reroutes, self._send_end_notices, self._send_relay_notices,
                         self._drop_ended_relayed):
                try:
                    step()
                except Exception:  # noqa: BLE001 - tried again next tick
                    log.exception("monitor: %s failed", step.__name__)

        def loop() -> None:
            while not stop.wait(interval):
                try:
                    tick()
                except Exception:  # noqa: BLE001 - e.g. the ledger briefly unreadable
                    log.exception("monitor tick failed")

        threading.Thread(target=loop, name="route-monitor", daemon=True).start()

    def _dead(self, names: list[str]) -> set[str]:
        """The sites of ``names`` to route around: no heartbeat for more than ``peer_timeout``,
        or revoked (``coordinator revoke``)."""
        now = time.time()
        seen = self.ledger.last_seen()
        revoked = self._revoked_sites()
        return {n for n in names if now - seen.get(n, 0) > self.peer_timeout or n in revoked}

    def _revoked_sites(self) -> dict:
        """The sites revoked now (``Revocations.current``: not enrolled anew since)."""
        return self.revocations.current(self._certificates)

    def _down_reason(self, name: str) -> str:
        """Why ``name`` is routed around (its revocation, else its silence)."""
        revoked = self._revoked_sites().get(name)
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
        skipped = self._skipped(run_id)
        order = [c["name"] for c in run["chain"]]
        dead = self._dead(order)
        if not dead - skipped:  # the common case, every second: nothing more to read
            return []
        _, plan = self._plan(run_id)
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
            self._fail(run_id, "every site of the chain is unreachable")
            return []
        new = replan(order, run["rounds"], plan, skipped | skip, resume)
        version = self.ledger.reroute(run_id, new.to_json(), [(n, self._down_reason(n)) for n in sorted(skip)])
        if version is None:
            return []
        for name in sorted(skip):
            self.ledger.add_event(run_id, "skip", f"{name}: {self._down_reason(name)}: routed around it", site=name)
        self._queue_reroutes(run, plan, new, version)
        return sorted(skip)

    def _check_star_route(self, run: dict, plan: Plan, order: list[str], dead: set[str], skipped: set[str]) -> list[str]:
        """A star plan's rules: the aggregating site down past ``peer_timeout`` fails the run
        (it holds the uploads); any other site down is routed around: its upload is no longer
        waited for (one that arrived stays in the final model), it gets no final copy and is not
        evaluated. The aggregator gets the new part of the plan at once (``Peer.Reroute``)."""
        run_id = run["run_id"]
        if plan.aggregator in dead:
            self._fail(run_id, f"the aggregating site {plan.aggregator} is out of the run "
                               f"({self._down_reason(plan.aggregator)})", site=plan.aggregator)
            return []
        skip = dead - skipped
        received = {h["sender"] for h in self.ledger.hops(run_id, "upload")}
        new = star_plan(order, plan.aggregator, skipped | skip, received)
        version = self.ledger.reroute(run_id, new.to_json(), [(n, self._down_reason(n)) for n in sorted(skip)])
        if version is None:
            return []
        for name in sorted(skip):
            held = " (its upload arrived and stays in the final model)" if name in received else ""
            self.ledger.add_event(run_id, "skip", f"{name}: {self._down_reason(name)}: "
                                  f"the aggregator no longer waits for it{held}", site=name)
        self._queue_reroutes(run, plan, new, version)
        return sorted(skip)

    def _queue_reroutes(self, run: dict, old: Plan, new: Plan, version: int) -> None:
        """Queue a Reroute for every live site whose part of the plan differs between ``old``
        and ``new``: its new transfers, the addresses of the sites they name and its visits."""
        skipped = self._skipped(run["run_id"])
        address = {c["name"]: self._address(c["name"], c["address"]) for c in run["chain"]}
        live = [c["name"] for c in run["chain"] if c["name"] not in skipped]
        # The final site goes last, so that the others know it before it copies the final model.
        for n in sorted(live, key=lambda m: m == new.final_site):
            if old.part(n) == new.part(n):
                continue
            self._pending[(run["run_id"], n)] = peer_pb2.RerouteRequest(
                run_id=run["run_id"], skipped=sorted(skipped), route_version=version, **new.part_pb(n, address))

    def _send_reroutes(self) -> None:
        for (run_id, site), request in list(self._pending.items()):
            run = self.ledger.run(run_id)
            address = next(c["address"] for c in run["chain"] if c["name"] == site)
            try:
                self._peer({"name": site, "address": address}).Reroute(request, timeout=CONTROL_TIMEOUT)
                self._pending.pop((run_id, site), None)
                hops = ", ".join(f"hop {t.index} {t.sender}->{t.receiver}" for t in request.transfers
                                 if t.purpose == common_pb2.CHAIN_HOP) or "no hops"
                self.ledger.add_event(run_id, "state", f"{site}: rerouted ({hops})", site=site)
            except grpc.RpcError as exc:
                log.warning("reroute of %s in run %s not delivered yet: %s", site, run_id, status_message(exc))

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
            reason = "this site was routed around" if skipped else (n["error"] or n["cancel_reason"] or "")
            # The error may quote sites' words (any length, any character): what EndRun takes.
            reason = text.clean(reason)[:names.MAX_TEXT]
            try:  # a live site has registered: _peer dials its registered address
                reply = self._peer({"name": n["site"], "address": ""}).EndRun(
                    peer_pb2.EndRunRequest(run_id=n["run_id"], status=n["status"], reason=reason,
                                           cancelled_by=n["cancelled_by"] or ""), timeout=5.0)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:  # NOT_FOUND: the site never had the run
                    log.info("end of run %s not delivered to %s yet: %s", n["run_id"], n["site"],
                             status_message(exc))
                    self._end_retry[key] = now + END_NOTICE_RETRY
                    continue
                reply = None
            self.ledger.end_notice_delivered(*key)
            self._end_retry.pop(key, None)
            if reply is not None and (reply.state == "ended" or reply.removed_bytes) and n["status"] != "cancelled":
                self.ledger.add_event(n["run_id"], "state", f"{n['site']}: told the run is over; its state "
                                      f"{reply.state}, {reply.removed_bytes} bytes of partial transfers removed",
                                      site=n["site"])

    # -- final evaluation -----------------------------------------------------------------------
    def _call_peer(self, site: dict, method: str, request, *, timeout: float):
        """One call to a site's peer daemon, retried with backoff while the site is unreachable
        (a restarting daemon, a dropped link) for up to ``self.eval_retry`` seconds, with the
        daemons' one retry policy (``calls.backoff_delays``)."""
        deadline = time.monotonic() + self.eval_retry
        for delay in backoff_delays():
            try:
                return getattr(self._peer(site), method)(request, timeout=timeout)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() + delay > deadline:
                    raise
                log.warning("%s unreachable for %s (%s); retrying", site["name"], method, status_message(exc))
                time.sleep(delay)

    def recover(self) -> list[str]:
        """After a restart: finish what the ledger says was under way. Runs whose final model was
        reported but not yet evaluated are evaluated now; the other running runs carry on by
        themselves (peers retry their reports until the coordinator answers). Reroutes are
        sent again from the ledger's current plan to every site whose part differs from the
        plan as started (peers apply a route version once: those that had it ignore it), so a
        restart between recording a reroute and reaching the sites loses nothing. Returns the
        ids of the runs picked up."""
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
                            self._owe_relay_notice(run_id, purposes.wire_of_ledger(purpose), h["hop"], h["sender"],
                                                   h["receiver"], h["relay"], h["sealed_bytes"], h["sealed_sha256"])
                if run["final_sha256"]:
                    self._submit_evaluation(run_id)
                elif len(plans) > 1:
                    self._queue_reroutes(run, Plan.from_json(plans[0]["plan"]), Plan.from_json(plans[-1]["plan"]),
                                         plans[-1]["version"])
        return picked

    def _submit_evaluation(self, run_id: str) -> None:
        """Evaluate the run's final model in the background. An unexpected error there is logged
        and fails the run with its reason (it used to vanish with the dropped future, leaving the
        run 'running' for ever)."""
        def done(future) -> None:
            exc = future.exception()
            if exc is not None:
                log.error("evaluation of run %s failed", run_id, exc_info=exc)
                self._fail(run_id, f"evaluation failed at the coordinator: {type(exc).__name__}: {exc}")

        self._eval_pool.submit(self._evaluate_run, run_id).add_done_callback(done)

    def _wait_relayed_copy(self, run_id: str, site: str) -> None:
        """A final copy that went through the relay is kept at its site only once the site fetched
        and opened it: wait for its receipt (up to ``eval_retry`` seconds) before asking the site
        to evaluate. Direct copies were kept before they were reported."""
        deadline = time.monotonic() + self.eval_retry
        with self._receipts:
            while True:
                row = self.ledger.transfer(run_id, "final", 0, site)
                if row is None or row["route"] != "relayed" or row["receipt"] is not None:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    return  # Evaluate says why the site cannot
                self._receipts.wait(min(left, 5.0))

    def _evaluate_run(self, run_id: str) -> None:
        run = self.ledger.run(run_id)
        sha = run["final_sha256"]
        results, errors = {}, []

        def one(site: dict) -> None:
            try:
                self._wait_relayed_copy(run_id, site["name"])
                reply = self._call_peer(site, "Evaluate", peer_pb2.EvaluateRequest(run_id=run_id, sha256=sha),
                                        timeout=EVALUATE_TIMEOUT)
                checks.check_evaluation(reply, site["name"])  # counts, accuracy, seconds (InvalidName)
                record = self.signatures.evaluation(reply, site["name"], run_id, sha)
                stats = evaluation.site_stats(reply, len(run["class_index"]))
                results[site["name"]] = (reply, stats)
                with self.ledger.batch():  # the figures, their event and the signed reply: one commit
                    self.ledger.record_evaluation(run_id, site["name"], sha, reply.correct, reply.test_samples,
                                                  reply.accuracy, reply.seconds, dict(reply.metrics),
                                                  json.loads(reply.stats_json or "{}"))  # as the site signed them
                    self.ledger.add_event(run_id, "evaluated",
                                          f"{site['name']}: accuracy {reply.accuracy:.4f} on {reply.test_samples} "
                                          f"test samples{evaluation.metrics_line(reply.metrics)}",
                                          site=site["name"], accuracy=reply.accuracy,
                                          test_samples=reply.test_samples, metrics=dict(reply.metrics),
                                          record=record)
            except grpc.RpcError as exc:
                errors.append(f"{site['name']}: {status_message(exc)}")
            except SignatureError as exc:
                errors.append(f"{site['name']}: its evaluation was refused: {exc}")
            except ValueError as exc:
                errors.append(f"{site['name']}: its evaluation does not check: {exc}")

        with ThreadPoolExecutor(max_workers=4) as pool:
            list(pool.map(one, self._live_order(run)))
        if errors:
            self._fail(run_id, "evaluation failed at " + "; ".join(errors))
            return
        correct = sum(r.correct for r, _ in results.values())
        total = sum(r.test_samples for r, _ in results.values())
        accuracy = correct / total if total else 0.0
        try:
            metrics = evaluation.pooled(results.values())
        except ValueError as exc:
            self._fail(run_id, f"the sites' evaluations do not combine: {exc}")
            return
        self.ledger.finish_run(run_id, "finished", accuracy=accuracy, metrics=metrics,
                               message=f"run finished: global accuracy {accuracy:.4f} on {total} test samples"
                                       f"{evaluation.metrics_line(metrics)}",
                               test_samples=total)

    # -- operator calls ---------------------------------------------------------------------------
    def StartChain(self, request: cpb.StartChainRequest, context) -> cpb.StartChainReply:
        names.check_start_chain(request)
        self._as_operator(context)
        stale_warnings: list[str] = []
        peers = [
            PeerInfo(name=p["name"], address=p["address"], device=p["device"],
                     offers={o["name"]: Offer.from_dict(o) for o in p["tasks"]})
            for p in self._fresh_peers(list(request.peers), stale_warnings, context)
        ]
        rounds = request.rounds or 1
        params = run_params.to_dict(request.params)
        try:
            run_params.check(params)  # once, completely, before anything is written
            run_params.check_rounds(rounds)
            chosen = choose_sites(peers, names=list(request.peers) or None, order=request.order or "random",
                                seed=request.seed, task=request.task, model=request.model,
                                task_sha256=request.task_sha256)
            plan = self._new_plan(params["strategy"], chosen.names, rounds, request.aggregator, request.seed)
        except ValueError as exc:  # PlanError too
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "; ".join([str(exc), *stale_warnings]))
        chosen.warnings[:0] = stale_warnings
        unreachable = []
        for p in chosen.order:
            try:
                st = self._peer(p).GetStatus(peer_pb2.StatusRequest(), timeout=self.probe_timeout)
                if st.name != p.name:
                    unreachable.append(f"{p.name} at {p.address} answers as {st.name!r}")
            except grpc.RpcError as exc:
                unreachable.append(f"{p.name} at {p.address} ({status_message(exc)})")
        if unreachable:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          "peers not reachable: " + "; ".join(unreachable))
        run_id = new_run_id()
        operator = caller_identity(context) or ""  # told to each site: its policy may check it
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
        self.monitor.run_started(run_id, params["strategy"], chosen.names, plan.aggregator, context)
        for w in chosen.warnings:
            self.ledger.add_event(run_id, "warning", w)
        spec = chosen.model.to_pb()
        address = {c["name"]: c["address"] for c in chain}
        n = len(chain)
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
        refusal = site_policy.first_refusal(((chosen.names[pos], self._peer(chosen.order[pos]), assignments[pos])
                                             for pos in positions), timeout=CONTROL_TIMEOUT)
        if refusal is not None:
            self.ledger.refuse_run(run_id, *refusal, policy=True)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, self.ledger.run(run_id)["error"])
        for pos in positions:
            site, a = chosen.names[pos], assignments[pos]
            try:
                self._peer(chosen.order[pos]).Assign(a, timeout=CONTROL_TIMEOUT)
            except grpc.RpcError as exc:
                reason, by_policy = assignment_refusal(exc)
                self.ledger.refuse_run(run_id, site, reason, policy=by_policy)
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, self.ledger.run(run_id)["error"])
        self.ledger.add_event(run_id, "assigned", "every site has its assignment")
        return cpb.StartChainReply(run_id=run_id, order=chosen.names, warnings=chosen.warnings)

    def _fresh_peers(self, named: list[str], warnings: list[str], context) -> list[dict]:
        """The registered peers a run may use. A peer is stale when it has sent no heartbeat for
        more than ``peer_timeout`` seconds: without ``named`` (the default peer set) stale peers
        are left out, with a warning naming them appended to ``warnings``; a stale peer named
        explicitly aborts with FAILED_PRECONDITION."""
        peers = self.ledger.peers()
        now = time.time()
        stale = {p["name"]: now - (p["last_seen"] or 0) for p in peers if now - (p["last_seen"] or 0) > self.peer_timeout}
        revoked = self._revoked_sites()
        if revoked:
            bad = [n for n in named if n in revoked]
            if bad:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, "revoked sites cannot take part in a run: " + ", ".join(
                    f"{n} ({revoked[n].describe()})" for n in bad))
            left = sorted(p["name"] for p in peers if p["name"] in revoked)
            if left and not named:
                warnings.append(f"left out {len(left)} revoked site(s): {', '.join(left)}")
            peers = [p for p in peers if p["name"] not in revoked]
        if named:
            bad = [n for n in named if n in stale]
            if bad:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, "stale peers (no heartbeat for longer than "
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

    @staticmethod
    def _new_plan(strategy: str, order: list[str], rounds: int, aggregator: str, seed: int) -> Plan:
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

    def WatchRun(self, request: cpb.WatchRunRequest, context):
        names.check_run_request(request)
        self._as_operator(context)
        run = self.ledger.run(request.run_id)
        if run is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown run {request.run_id!r}")
        # Events come from the hub's memory once caught up (one ledger read at most, for what is
        # older than its tail); the hub wakes this watcher when its run has news.
        news = threading.Event()
        token = self.events.subscribe(request.run_id, news.set)
        ended = run["status"] in TERMINAL  # read after subscribing: an end after it wakes us
        try:
            seq = request.after_seq
            while context.is_active():
                news.clear()
                events = self.events.events_after(request.run_id, seq)
                for e in events:
                    seq = e["seq"]
                    yield cpb.RunEvent(run_id=e["run_id"], seq=e["seq"], time=e["time"], kind=e["kind"],
                                       site=e["site"], message=e["message"], data_json=e["data"])
                if not events:
                    if ended or self.events.ended(request.run_id):
                        return
                    news.wait(1.0)  # at most 1 s, to notice a watcher that went away
        finally:
            self.events.unsubscribe(request.run_id, token)

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
        ids = self.ledger.run_ids()
        if request.after:
            names.check_run_id(request.after, "after")
            if request.after not in ids:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"after: unknown run {request.after!r}")
            ids = ids[ids.index(request.after) + 1:]
        runs, more = replies.page((replies.bounded_summary(s) for s in map(self.summary, ids) if s is not None),
                                  lambda s: s.ByteSize())
        return cpb.ListRunsReply(runs=runs, next_after=runs[-1].run_id if more else "")

    def ListPeers(self, request: cpb.ListPeersRequest, context) -> cpb.ListPeersReply:
        """The registered peers by name, in pages under the message cap: from the peer after
        ``request.after``."""
        self._as_operator(context)
        if request.after:
            names.check_site_name(request.after, "after")

        def record(p: dict) -> cpb.PeerRecord:
            return replies.bounded_peer(cpb.PeerRecord(
                name=p["name"], address=p["address"], device=p["device"] or "",
                last_seen=p["last_seen"] or 0,
                tasks=[Offer.from_dict(o).to_pb() for o in p["tasks"]], **self._liveness(p),
                outbound_only=not p["address"],
                connected=not p["address"] and self.tunnels.get(p["name"]) is not None,
                revocation=self._revocation_pb(p["name"])))

        peers, more = replies.page((record(p) for p in self.ledger.peers() if p["name"] > request.after),
                                   lambda r: r.ByteSize())
        return cpb.ListPeersReply(peers=peers, next_after=peers[-1].name if more else "")

    def _revocation_pb(self, name: str) -> cpb.CrlEntry | None:
        revoked = self._revoked_sites().get(name)
        return Revocations.entry_pb(revoked) if revoked is not None else None

    def _liveness(self, peer: dict) -> dict:
        """PeerRecord's liveness fields: live (heard from within --peer-timeout), age_seconds
        (since its last registration or heartbeat, by this coordinator's clock), peer_timeout."""
        age = max(0.0, time.time() - (peer["last_seen"] or 0))
        return {"live": age <= self.peer_timeout, "age_seconds": age, "peer_timeout": self.peer_timeout}

    def GetMetrics(self, request: cpb.GetRunRequest, context) -> cpb.MetricsReply:
        """The run's per-epoch training metrics (the ledger's ``metrics`` table), in the order
        the coordinator recorded them, in pages under the message cap from row
        ``request.offset`` (``next_offset``: where the next page starts). NOT_FOUND for an
        unknown run."""
        names.check_run_request(request)
        self._as_operator(context)
        if self.ledger.run(request.run_id) is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown run {request.run_id!r}")

        def row(m: dict) -> cpb.MetricRow:
            r = cpb.MetricRow(site=m["site"], time=m["time"], stage=m["stage"] or "", model=m["model"] or 0,
                              epoch=m["epoch"] or 0, epochs=m["epochs"] or 0, train_loss=m["train_loss"] or 0.0,
                              seconds=m["seconds"] or 0.0)
            if m["val_accuracy"] is not None:
                r.val_accuracy = m["val_accuracy"]
            return r

        rows = self.ledger.metrics(request.run_id)[request.offset:]
        kept, more = replies.page(map(row, rows), lambda r: r.ByteSize() + 4)
        return cpb.MetricsReply(run_id=request.run_id, rows=kept,
                                next_offset=request.offset + len(kept) if more else 0)

    def FetchModel(self, request: peer_pb2.FetchModelRequest, context):
        names.check_run_request(request)
        self._as_operator(context)
        run = self.ledger.run(request.run_id)
        if run is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown run {request.run_id!r}")
        if not run["final_sha256"]:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"run {request.run_id} has no final model yet")
        # The site that produced the final model, then any site whose copy of it both ends attested.
        holders = [run["final_site"]] + [h["receiver"] for h in self.ledger.hops(request.run_id, "final")
                                         if h["status"] == "done" and h["sha256"] == run["final_sha256"]]
        # What the operator's client writes into the fetched file's metadata (fedrelay/final_model.py).
        context.send_initial_metadata(((MODEL_SPEC_METADATA, json.dumps(run["model"])),))
        errors = []
        for name in dict.fromkeys(h for h in holders if h):
            stream = self._peer({"name": name, "address": self._address(name)}).FetchModel(
                peer_pb2.FetchModelRequest(run_id=request.run_id, sha256=run["final_sha256"]),
                timeout=transfer_timeout(run["model_bytes"] or 0))
            try:
                first = next(stream)  # the header: this site holds the model
            except grpc.RpcError as exc:
                errors.append(f"{name}: {status_message(exc)}")
                continue
            yield first
            try:
                yield from stream
            except grpc.RpcError as exc:
                context.abort(grpc.StatusCode.UNAVAILABLE,
                              f"the final model's stream from {name} broke: {status_message(exc)}")
            return
        context.abort(grpc.StatusCode.UNAVAILABLE, "cannot fetch the final model: " + "; ".join(errors))

    # -- run control ------------------------------------------------------------------------------
    def StopRun(self, request: cpb.StopRunRequest, context) -> cpb.RunSummary:
        """Cancel a running run (see ``Ledger.cancel_run``): the monitor then delivers its end
        notices, and every site stops at its next epoch or transfer boundary and removes its
        partial files. Aborts NOT_FOUND (unknown run) or FAILED_PRECONDITION (already ended)."""
        names.check_run_id(request.run_id)
        names.check_text(request.reason, "reason", max_chars=1000)
        self._as_operator(context)
        who = caller_identity(context) or INSECURE_OPERATOR
        run = self._running_run(request.run_id, context)
        if not self.ledger.cancel_run(request.run_id, who, request.reason):
            run = self.ledger.run(request.run_id)
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(run["ended"] or 0))
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"run {request.run_id} has already ended ({run['status']} at {when}); there is nothing to stop")
        log.info("run %s cancelled by %s%s", run["run_id"], who, f": {request.reason}" if request.reason else "")
        return self.summary(request.run_id)

    def ForgetPeer(self, request: cpb.ForgetPeerRequest, context) -> cpb.ForgetPeerReply:
        """Remove a peer's registration. Aborts NOT_FOUND (unknown name) or FAILED_PRECONDITION
        (a site of a running run, not routed around). The daemon registered under that name is
        refused from then on (``coordinator/forgotten.py``; its control stream is closed); a
        daemon started afterwards registers anew."""
        names.check_site_name(request.name, "name")
        self._as_operator(context)
        peer = self.ledger.peer(request.name)
        if peer is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no peer named {request.name!r} is registered")
        busy = [r for r in self.ledger.running_run_ids()
                if request.name in [c["name"] for c in self.ledger.run(r)["chain"]] and request.name not in self._skipped(r)]
        if busy:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{request.name} is a site of running run(s) {', '.join(busy)}; wait for them to end or "
                          "`coordinator stop RUN` first")
        self.ledger.forget_peer(request.name)
        tunnel = self.tunnels.get(request.name)
        if tunnel is not None:
            self.tunnels.drop(tunnel)
        log.info("forgot peer %s (was registered at %s)", request.name, peer["address"])
        return cpb.ForgetPeerReply(name=request.name, address=peer["address"])

    # -- revocation -------------------------------------------------------------------------------
    def Revoke(self, request: cpb.RevocationRequest, context) -> cpb.RevocationReply:
        """Record and publish a site's revocation (``coordinator/revocations.py``), then route
        its running runs around it (each gets a ``revoked`` event). Aborts INVALID_ARGUMENT for
        a list that is not usable, FAILED_PRECONDITION on a plaintext coordinator."""
        names.check_site_name(request.name, "name")
        names.check_text(request.reason, "reason", max_chars=1000)
        self._as_operator(context)
        who = caller_identity(context) or INSECURE_OPERATOR
        try:
            entry = self.revocations.revoke(request.name, list(request.serials), request.crl, who, request.reason)
        except RevocationRefused as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION if self.insecure else grpc.StatusCode.INVALID_ARGUMENT,
                          str(exc))
        tunnel = self.tunnels.get(request.name)
        if tunnel is not None:
            self.tunnels.drop(tunnel)
        runs = [r for r in self.ledger.running_run_ids()
                if request.name in [c["name"] for c in self.ledger.run(r)["chain"]] and request.name not in self._skipped(r)]
        for run_id in runs:
            self.ledger.add_event(run_id, "revoked", f"{request.name}: certificate {entry.describe()}",
                                  site=request.name, revoked_by=who, reason=request.reason)
            try:
                self.check_route(run_id)
            except Exception:  # noqa: BLE001 - the monitor tries again at its next tick
                log.exception("routing run %s around revoked %s failed", run_id, request.name)
        return cpb.RevocationReply(name=request.name, revoked_by=who, revoked_at=entry.revoked_at, runs=runs,
                                   crl_number=self.revocations.list.number)

    def GetCrl(self, request: cpb.CrlRequest, context) -> cpb.CrlReply:
        """The newest revocation list and the revoked sites (any authenticated caller)."""
        return self.revocations.reply(self._certificates)

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
        skipped = self._skipped(run_id)
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
            s.final.sha256 = run["final_sha256"] or ""
            s.final.accuracy = run["accuracy"] or 0.0
            s.final.metrics.update(run["metrics"] or {})
            for e in self.ledger.evaluations(run_id):
                s.final.per_site[e["site"]].accuracy = e["accuracy"]
                s.final.per_site[e["site"]].test_samples = e["test_samples"]
                s.final.per_site[e["site"]].metrics.update(e["metrics"])
                spent = privacy.spent_from_stats(e["stats"])  # a DP run: as the site signed it
                if spent is not None:
                    s.final.per_site[e["site"]].privacy.CopyFrom(privacy.to_pb(spent))
        return s


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

    The relay (``coordinator/relay.py``) for sites that cannot be reached directly: under mutual
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
