"""The sites as the coordinator knows them: registration and heartbeats (with the claim check
of a name registered anew), the certificates sites presented, resolving a site's address, the
control streams of sites that only connect out, forgetting a site and revoking one."""

from __future__ import annotations

import logging
import math
import queue
import threading
from typing import Callable, Iterator

import grpc

from fedrelay.addresses import split_hostport
from fedrelay.coordinator import forgotten
from fedrelay.coordinator.refusal import Refused
from fedrelay.coordinator.revocations import RevocationRefused
from fedrelay.tasks.offers import Offer
from fedrelay.v1 import common_pb2, coordinator_pb2 as cpb, peer_pb2

log = logging.getLogger("fedrelay.coordinator")

HEARTBEAT_SECONDS = 10  # seconds between a site's heartbeats, with few sites (see heartbeat_period)
HEARTBEATS_PER_SECOND = 2.0  # with many sites, all of them together heartbeat about this often
CLAIM_PROBE_TIMEOUT = 3.0  # seconds the coordinator waits for the registered daemon of a name claimed anew


class Registrar:
    """The sites registered in ``ledger``. ``tunnels``: the control streams (``Tunnels``);
    ``revocations``: the ``Revocations``; ``monitor``: the ``CoordinatorMonitor``; ``stub(site
    dict)``: a site's Peer stub; ``peer_timeout``: seconds without a heartbeat before a site is
    routed around. ``certificates``: name -> the PEM certificate the site presented when it
    registered (a sender seals a relayed payload to it)."""

    def __init__(self, ledger, tunnels, revocations, monitor, stub: Callable, peer_timeout: float):
        self.ledger = ledger
        self.tunnels = tunnels
        self.revocations = revocations
        self.monitor = monitor
        self.stub = stub
        self.peer_timeout = peer_timeout
        self.heartbeat_seconds = max(1, min(HEARTBEAT_SECONDS, int(peer_timeout / 4)))
        self.certificates: dict[str, bytes] = {}

    # -- registration ------------------------------------------------------------------------------
    def register(self, request: cpb.RegisterRequest, certificate: bytes | None = None) -> None:
        """Record a site's registration or heartbeat (``certificate``: the PEM it presented).
        Raises ``Refused`` (INVALID_ARGUMENT: no name or address, a malformed address or task
        offer; PERMISSION_DENIED: a forgotten daemon; ALREADY_EXISTS: a live daemon serves the
        name)."""
        if not request.name or not (request.address or request.outbound_only):
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "name and address are required")
        if request.outbound_only and request.address:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, "a site that only connects out registers no address")
        if request.address:
            try:
                split_hostport(request.address)
            except ValueError as exc:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        refused = forgotten.refusal(self.ledger, request)  # forget-peer holds against that daemon
        if refused:
            raise Refused(grpc.StatusCode.PERMISSION_DENIED, refused)
        before = self._check_claim(request)
        if certificate:
            self.certificates[request.name] = certificate
        try:
            offers = [Offer.from_pb(t).to_dict() for t in request.tasks]
        except ValueError as exc:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        self.ledger.upsert_peer(request.name, request.address, offers, request.device, request.version)
        self.monitor.registered(request.name, request.address, before)
        if request.instance:
            self.ledger.set_peer_instance(request.name, request.instance)

    def heartbeat_period(self) -> int:
        """Seconds between a site's heartbeats, told in every ``RegisterReply``: 10 (at most a
        quarter of ``--peer-timeout``), longer when so many sites are registered that all of them
        together would heartbeat more than ``HEARTBEATS_PER_SECOND`` times a second, but never
        longer than a quarter of ``--peer-timeout`` (a site is routed around only after missing
        about four heartbeats). Each heartbeat is a gRPC call that costs the coordinator CPU; this
        keeps a hop's cost at the coordinator flat from 3 to 100 sites: at 100 sites and the
        default 120 s timeout, every 30 s."""
        many = math.ceil(self.ledger.registered_count() / HEARTBEATS_PER_SECOND)
        return max(self.heartbeat_seconds, min(many, int(self.peer_timeout / 4)))

    def _check_claim(self, request: cpb.RegisterRequest) -> dict | None:
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
                st = self.stub(old).GetStatus(peer_pb2.StatusRequest(), timeout=CLAIM_PROBE_TIMEOUT)
                alive = st.name == request.name and st.instance == old["instance"]
            except grpc.RpcError:
                pass
        if alive:
            log.warning("refused the registration of %s from %s: a live daemon serves that name at %s",
                        request.name, request.address, old["address"])
            raise Refused(grpc.StatusCode.ALREADY_EXISTS,
                          f"site {request.name!r} is already served by a live daemon at "
                          f"{old['address'] or 'a control stream'}; stop "
                          "that daemon first, or start this one with another --name")
        log.info("site %s: a new daemon at %s takes over the name from the one registered at %s "
                 "(it does not answer as that site any more)", request.name, request.address, old["address"])
        return old

    def resolve(self, name: str) -> common_pb2.SiteRef:
        """The address (and certificate) ``name`` last registered with. Raises ``Refused``
        (NOT_FOUND)."""
        peer = self.ledger.peer(name)
        if peer is None:
            raise Refused(grpc.StatusCode.NOT_FOUND, f"no site {name!r} has registered")
        return common_pb2.SiteRef(name=peer["name"], address=peer["address"],
                                  certificate=self.certificates.get(peer["name"], b""))

    # -- control streams ---------------------------------------------------------------------------
    def control_stream(self, site: str, instance: str, replies: Iterator, is_active: Callable[[], bool]):
        """The coordinator's side of the control stream of ``site`` (daemon ``instance``), a
        site that only connects out (``coordinator/tunnel_server.py``): yields the hello back, then
        the calls for the site (``ControlRequest``) until the stream ends; ``replies`` (the rest
        of the site's messages) is read in a thread of its own. A newer stream of the same site
        replaces this one. Raises ``Refused`` (FAILED_PRECONDITION: not registered as such;
        ALREADY_EXISTS: another daemon instance serves the site) before the first message."""
        peer = self.ledger.peer(site)
        if peer is None or peer["address"]:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{site} has not registered as a site that only connects out (register first)")
        if peer["instance"] and instance != peer["instance"]:
            raise Refused(grpc.StatusCode.ALREADY_EXISTS, f"another daemon instance serves {site}")
        tunnel = self.tunnels.open(site, instance)
        log.info("site %s: control stream open (it connects out only)", site)

        def read() -> None:
            try:
                for reply in replies:
                    tunnel.deliver(reply)
            except Exception:  # noqa: BLE001 - a broken stream: the calls waiting on it fail
                pass
            finally:
                tunnel.close()

        reader = threading.Thread(target=read, name=f"control-{site}", daemon=True)
        reader.start()
        try:
            yield cpb.ControlRequest(id=0)  # the hello back: the stream is open
            while is_active() and not tunnel.closed.is_set():
                try:
                    yield tunnel.outbox.get(timeout=1.0)
                except queue.Empty:
                    continue
        finally:
            self.tunnels.drop(tunnel)
            log.info("site %s: control stream closed", site)

    # -- forgetting and revoking -------------------------------------------------------------------
    def revoked_sites(self) -> dict:
        """The sites revoked now (``Revocations.current``: not enrolled anew since)."""
        return self.revocations.current(self.certificates)

    def _runs_of(self, name: str, skipped: Callable[[str], set]) -> list[str]:
        """The running runs of which ``name`` is a site not routed around."""
        return [r for r in self.ledger.running_run_ids()
                if name in [c["name"] for c in self.ledger.run(r)["chain"]] and name not in skipped(r)]

    def _close_stream(self, name: str) -> None:
        tunnel = self.tunnels.get(name)
        if tunnel is not None:
            self.tunnels.drop(tunnel)

    def forget(self, name: str, skipped: Callable[[str], set]) -> cpb.ForgetPeerReply:
        """Remove a peer's registration (``skipped(run_id)``: the sites a run routed around). The
        daemon registered under that name is refused from then on (``coordinator/forgotten.py``;
        its control stream is closed); a daemon started afterwards registers anew. Raises
        ``Refused`` (NOT_FOUND: unknown name; FAILED_PRECONDITION: a site of a running run)."""
        peer = self.ledger.peer(name)
        if peer is None:
            raise Refused(grpc.StatusCode.NOT_FOUND, f"no peer named {name!r} is registered")
        busy = self._runs_of(name, skipped)
        if busy:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{name} is a site of running run(s) {', '.join(busy)}; wait for them to end or "
                          "`coordinator stop RUN` first")
        self.ledger.forget_peer(name)
        self._close_stream(name)
        log.info("forgot peer %s (was registered at %s)", name, peer["address"])
        return cpb.ForgetPeerReply(name=name, address=peer["address"])

    def revoke(self, request: cpb.RevocationRequest, who: str, skipped: Callable[[str], set],
               check_route: Callable[[str], object], insecure: bool) -> cpb.RevocationReply:
        """Record and publish a site's revocation for ``who`` (``coordinator/revocations.py``),
        close its control stream, then route its running runs around it (``check_route``; each
        gets a ``revoked`` event). Raises ``Refused`` (INVALID_ARGUMENT: a list that is not
        usable; FAILED_PRECONDITION: on a plaintext coordinator, ``insecure``)."""
        try:
            entry = self.revocations.revoke(request.name, list(request.serials), request.crl, who, request.reason)
        except RevocationRefused as exc:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION if insecure else grpc.StatusCode.INVALID_ARGUMENT,
                          str(exc)) from None
        self._close_stream(request.name)
        runs = self._runs_of(request.name, skipped)
        for run_id in runs:
            self.ledger.add_event(run_id, "revoked", f"{request.name}: certificate {entry.describe()}",
                                  site=request.name, revoked_by=who, reason=request.reason)
            try:
                check_route(run_id)
            except Exception:  # noqa: BLE001 - the monitor tries again at its next tick
                log.exception("routing run %s around revoked %s failed", run_id, request.name)
        return cpb.RevocationReply(name=request.name, revoked_by=who, revoked_at=entry.revoked_at, runs=runs,
                                   crl_number=self.revocations.list.number)
