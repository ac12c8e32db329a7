"""``peer serve``: check the site's data once per task, listen, register with the coordinator,
heartbeat.

The daemon never imports torch nor any task's code (a light daemon; an idle one holds about
60 MB): it finds the tasks installed here and their code's digests from files alone
(``fedrelay.tasks``), and its training, evaluation and payload schemas run in worker processes
(``peer/worker_pool.py``) that load the run's task and exit after their job. At start, one such
worker has every offered task describe and read the site's folder once (a corrupt file is named
now, not at the first run) and resolves ``--device auto``; the site registers each task with
what it found (``fedrelay.tasks.offers.Offer``).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from pathlib import Path

import grpc

from fedrelay import __version__, names, revocation, tasks as task_registry
from fedrelay.addresses import split_hostport, with_port
from fedrelay.calls import CONTROL_TIMEOUT, backoff_delays, status_message
from fedrelay.server import make_server
from fedrelay.transport import Transport, transport_mismatch
from fedrelay.guard import Guard
from fedrelay.health import PEER_SERVICE, Health
from fedrelay.peer.tunnel_client import ControlLink
from fedrelay.peer.policy import SitePolicy
from fedrelay.peer.node import DEFAULT_STALL_TIMEOUT, PeerNode
from fedrelay.peer.site import DEFAULT_RELAY_AFTER
from fedrelay.task import DataError
from fedrelay.tasks.offers import Offer
from fedrelay.peer.slots import DEFAULT_SLOTS, HostSlots
from fedrelay.peer.worker_pool import WorkerDied, WorkerError, WorkerPool
from fedrelay.peer.reporting import CoordinatorLink
from fedrelay.peer.servicer import PeerServicer
from fedrelay.peer.transfer import add_peer_servicer
from fedrelay.v1 import coordinator_pb2 as cpb

log = logging.getLogger("fedrelay.peer")


def check_state_dir(state_dir: Path) -> None:
    """Make ``state_dir`` if needed and prove it writable (a probe file is written, synced and
    removed), so that a read-only --state-dir is refused at start, not at the first assignment.
    Raises ``ValueError`` naming the folder."""
    import os
    import tempfile

    try:
        state_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=state_dir, prefix=".write-probe-") as f:
            f.write(b"fedrelay")
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise ValueError(f"--state-dir {state_dir} is not a writable folder ({exc.strerror or exc}); the daemon keeps "
                         "every run's models there: pass a folder this user can write") from None


def check_outbound(outbound_only: bool, advertise: str | None, transport: Transport, relay_after: float) -> None:
    """The options of a site that connects out only, and ``--relay-after``. Raises ``ValueError``."""
    if relay_after < 0:
        raise ValueError("--relay-after must be >= 0 seconds (0: never fall back to the relay)")
    if not outbound_only:
        return
    if advertise:
        raise ValueError("--outbound-only registers no address: drop --advertise")
    if not transport.secure:
        raise ValueError("--outbound-only needs mutual TLS (--tls): models reach this site through the relay, "
                         "sealed to its certificate key")


def check_site(pool: WorkerPool, offered: dict) -> tuple[list[Offer], str, float]:
    """Have every offered task read the site's folder once, in a short-lived worker of ``pool``
    (``describe``), and resolve the device: ``(offers, device, seconds)``. ``offered``:
    ``fedrelay.tasks.installed()``'s result (a task that is not installed becomes an offer with
    its error). Raises ``ValueError`` (the device) or ``RuntimeError`` (the worker failed)."""
    usable = {n: i.sha256 for n, i in offered.items() if isinstance(i, task_registry.Installed)}
    try:
        answer = pool.check(usable) if usable else {"device": pool.device, "seconds": 0.0, "tasks": {}}
    except WorkerDied as exc:
        raise RuntimeError(f"the worker that checks the site's data died: {exc}") from None
    except WorkerError as exc:
        kind, _, message = str(exc).partition(": ")
        if kind == "ValueError":
            raise ValueError(message) from None
        raise RuntimeError(f"the worker that checks the site's data failed: {exc}") from None
    offers = []
    for name, inst in offered.items():
        if not isinstance(inst, task_registry.Installed):
            offers.append(Offer(name=name, version="", sha256="", error=f"{type(inst).__name__}: {inst}"))
            continue
        found = answer["tasks"].get(name) or {"error": "the worker did not describe it"}
        if "error" in found:
            offers.append(Offer(name=name, version=inst.version, sha256=inst.sha256, error=found["error"]))
            continue
        from fedrelay.task import DataSummary

        offers.append(Offer(name=name, version=inst.version, sha256=inst.sha256, models=tuple(found["models"]),
                            summary=DataSummary.from_dict(found["summary"]),
                            positive_class=found.get("positive_class") or "",
                            augmentations=tuple(found.get("augmentations") or ())))
    return offers, answer["device"], answer["seconds"]


def registration(name: str, address: str, offers: list[Offer], device: str, instance: str = "") -> cpb.RegisterRequest:
    """The site's ``RegisterRequest``; ``address`` "" registers a site that only connects out."""
    return cpb.RegisterRequest(name=name, address=address, device=device, version=__version__, instance=instance,
                               outbound_only=not address, tasks=[o.to_pb() for o in offers])


def _heartbeat(link: CoordinatorLink, request: cpb.RegisterRequest, stop: threading.Event,
               refused: list[str] | None = None, revocations: revocation.RevocationList | None = None) -> None:
    """Register until the coordinator answers, then re-register every heartbeat (this also
    re-registers after a coordinator restart). An unexpected error is logged with its traceback
    and the heartbeat goes on (a silent end would get the site routed around). ALREADY_EXISTS
    (another live daemon serves this site's name) appends the coordinator's message to
    ``refused`` and sets ``stop``: this daemon must not serve. A reply naming a revocation list
    newer than ``revocations``' is fetched and taken (``fedrelay.revocation.follow``)."""
    period = None
    delays = backoff_delays(cap=10.0)
    while not stop.is_set():
        try:
            reply = link.stub.Register(request, timeout=CONTROL_TIMEOUT)
            link.last_registered, link.registration_error = time.time(), ""
            link.relay = reply.relay
            if period is None:
                log.info("registered with the coordinator at %s as %s (%s)", link.address, request.name,
                         request.address or "connects out only")
            period = reply.heartbeat_seconds or 10
            delays = backoff_delays(cap=10.0)
            if revocations is not None:
                _follow_crl(link, revocations, reply.crl_number, reply.revoked_sites)
            stop.wait(period)
        except grpc.RpcError as exc:
            link.registration_error = status_message(exc)
            if exc.code() == grpc.StatusCode.ALREADY_EXISTS:
                log.error("the coordinator refused the registration: %s", exc.details())
                if refused is not None:
                    refused.append(exc.details() or "another daemon serves this site's name")
                stop.set()
                return
            if exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED):
                log.error("the coordinator refused the registration: %s", exc.details())
            else:
                hint = transport_mismatch(exc, link.address, link.transport.secure, what="coordinator")
                log.warning("coordinator %s not reachable (%s); retrying", link.address,
                            hint or status_message(exc))
            period = None
            stop.wait(next(delays))
        except Exception:  # noqa: BLE001 - say so, and keep heartbeating
            log.exception("heartbeat failed; retrying")
            period = None
            stop.wait(next(delays))


def _follow_crl(link: CoordinatorLink, revocations: revocation.RevocationList, number: int,
                revoked_sites: int | None = None) -> None:
    """Take the coordinator's newest revocation list when it is newer than ours (or revokes
    another number of sites); a failure is logged and tried again at the next heartbeat."""
    if not number:
        return
    try:
        revocation.follow(link.stub, revocations, number, revoked_sites, timeout=CONTROL_TIMEOUT)
    except grpc.RpcError as exc:
        log.warning("could not fetch the coordinator's revocation list %d: %s", number, status_message(exc))
    except revocation.CrlError as exc:
        log.error("the coordinator's revocation list %d was refused: %s", number, exc)


def _claim_name(link: CoordinatorLink, request: cpb.RegisterRequest) -> str | None:
    """One registration before the daemon resumes any run: the coordinator's message when it
    refuses the name because another live daemon serves it (ALREADY_EXISTS), else None (also
    when the coordinator cannot be reached now: the heartbeat keeps trying)."""
    try:
        link.stub.Register(request, timeout=10.0)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.ALREADY_EXISTS:
            log.error("the coordinator refused the registration: %s", exc.details())
            return exc.details() or "another daemon serves this site's name"
    return None


def serve(*, data_dir: Path, name: str, listen: str, coordinator: str, state_dir: Path, device: str,
          transport: Transport, advertise: str | None = None, stop: threading.Event | None = None,
          ready: threading.Event | None = None, stall_timeout: float = DEFAULT_STALL_TIMEOUT,
          deterministic: bool = True, weights_dir: Path | None = None, metrics_listen: str | None = None,
          worker_slots: int = DEFAULT_SLOTS, slots_dir: Path | None = None, outbound_only: bool = False,
          relay_after: float = DEFAULT_RELAY_AFTER, fork_workers: bool = False,
          tasks: list[str] | None = None, crl: Path | None = None, policy: Path | None = None) -> None:
    """Run a peer daemon until ``stop`` is set (or forever), with mutual TLS on every channel
    unless ``transport`` is insecure. ``stall_timeout``: seconds a handoff may send nothing
    before it is dropped. ``deterministic``: on a CUDA device, use deterministic kernels
    (:func:`fedrelay.peer.training.use_deterministic_kernels`) so that a run's model digests
    repeat; False trains faster on a GPU but the same seed then gives different models.
    ``weights_dir``: where the site keeps initial-weights files (``start-chain --init file``)
    [default: ``state_dir/weights``]. ``worker_slots``: at most this many worker processes at
    once on this host, shared by every daemon that uses the same ``slots_dir`` (default
    ``peer.slots.default_folder()``). Serves the gRPC health service (``fedrelay.health``) and,
    with ``metrics_listen`` (``HOST:PORT``), Prometheus metrics over HTTP (``peer/monitoring.py``).

    ``outbound_only``: the site accepts no inbound connection from other sites or the
    coordinator (a hospital network's usual rule). It registers no address and keeps a control
    stream open to the coordinator (``peer/tunnel_client.py``), over which it gets its assignments,
    reroutes, end notices, evaluation requests and relay notices; its models come through the
    relay, sealed to its certificate key (``peer/relay_client.py``). It still listens on ``listen``
    for its own administrator (``peer status``, ``peer health``): bind that to 127.0.0.1. Needs
    mutual TLS. ``relay_after``: seconds a receiver with an address may stay unreachable before
    this site sends to it through the relay (0: never; TLS only).

    ``crl``: a certificate revocation list file the operator copied here, reloaded when it
    changes (``fedrelay.revocation``); the coordinator's newest list comes with the heartbeats
    anyway, and the list taken last is kept in ``state_dir/crl.der``. Calls from revoked sites
    are refused and their calls in flight cancelled; nothing is sent to a revoked site.

    ``tasks``: offer only these tasks (names, or ``module:attr`` for a task module on the
    daemon's path); None: every task installed here (``fedrelay.tasks``).

    ``policy``: the site's policy file (``peer/policy.py``; docs/site-policy.md) [default:
    ``state_dir/policy.toml`` when it exists]; it must parse at start-up, and it is read again
    whenever it changes, at each new assignment.

    ``fork_workers``: fork each worker from a template process that imported torch once
    (``peer/forking.py``): a job starts in milliseconds instead of ~3 s of CPU, and the daemon's
    host holds ~680 MB more while idle (the template: torch imported).

    Raises ``DataError`` (no offered task can read the data folder: each task's reason),
    ``ValueError`` (bad device, address or task name, a name or class name that breaks its
    ``fedrelay.names`` rule, or a TLS identity that is not ``name``)
    or ``RuntimeError`` (cannot listen) before serving anything; ``RuntimeError`` also when the
    coordinator refuses the site's name because another live daemon serves it (ALREADY_EXISTS).
    """
    names.check_site_name(name, "--name")
    advertise = advertise or None  # "" (an empty FEDRELAY_ADVERTISE): not given
    if transport.secure and transport.identity != name:
        raise ValueError(f"--tls {transport.source} holds the identity {transport.identity!r}, not --name {name!r}")
    if stall_timeout <= 0:
        raise ValueError("--stall-timeout must be > 0 seconds")
    check_outbound(outbound_only, advertise, transport, relay_after)
    check_state_dir(Path(state_dir))
    site_policy = SitePolicy.at(policy, state_dir)  # PolicyError (a ValueError) names the file and key
    if device not in ("auto", "cpu") and not device.startswith("cuda"):
        raise ValueError(f"--device must be auto, cpu or cuda:N, not {device!r}")
    for t in tasks or ():
        task_registry.check_name(t)
    if not Path(data_dir).exists():  # said at once, before a worker (seconds of imports) is started to read it
        raise ValueError(f"--data {data_dir}: no such file or folder; pass the site's data folder (image-folder: "
                         "the folder that holds train/<class>/ and optionally test/<class>/)")
    offered = task_registry.installed(extra=[t for t in tasks or () if ":" in t], only=tasks)
    log.info("reading site data from %s with %d task(s): %s", data_dir, len(offered), ", ".join(offered))
    stop = stop or threading.Event()
    pool = WorkerPool(data_dir, device, HostSlots(worker_slots, slots_dir), deterministic=deterministic, stop=stop,
                      fork=fork_workers, extra_tasks=[t for t in tasks or () if ":" in t])
    offers, device, seconds = check_site(pool, offered)
    pool.device = device
    if not deterministic and device.startswith("cuda"):
        log.warning("--no-deterministic: CUDA kernels may differ from run to run; the same seed will "
                    "not give the same model digests")
    served = any(o.usable for o in offers)
    for o in offers:
        if not o.usable:  # normal when the folder is another task's format: worth a warning only if none can read it
            (log.info if served else log.warning)("task %s cannot read %s: %s", o.name, data_dir, o.error)
            continue
        names.check_class_names(sorted(o.summary.classes), f"the classes task {o.name} reads in {data_dir}")
        for note in o.summary.notes:
            log.warning("%s (task %s): %s", data_dir, o.name, note)
        log.info("task %s %s (code SHA-256 %s…): %d classes, input %s, train %d, test %d", o.name, o.version or "",
                 o.sha256[:12], len(o.summary.classes), o.to_pb().input_json,
                 sum(a for a, _ in o.summary.classes.values()), sum(b for _, b in o.summary.classes.values()))
    if not any(o.usable for o in offers):
        raise DataError(f"no task installed at this site can read {data_dir}: " + "; ".join(
            f"{o.name}: {o.error.removeprefix('DataError: ')}" for o in offers))
    log.info("site data checked by a worker in %.1f s (every sample read once); device %s", seconds, device)
    try:
        revocations = revocation.for_daemon(transport, keep=Path(state_dir) / "crl.der" if transport.secure else None,
                                            crl_file=crl, stop=stop)
    except revocation.CrlError as exc:
        raise ValueError(str(exc)) from None
    guard = Guard(revocations=revocations)
    server, port = make_server(listen, transport=transport, guard=guard)
    address = "" if outbound_only else advertise or with_port(listen, port)
    if address:
        names.check_address(address, "--advertise" if advertise else "--listen")
        host, _ = split_hostport(address)
        if host in ("0.0.0.0", "::"):
            raise ValueError(f"listening on {listen}: pass --advertise HOST:PORT, the address other sites can reach")
    link = CoordinatorLink(coordinator, transport)
    node = PeerNode(name, address, offers, Path(state_dir), device, link, transport=transport,
                    stall_timeout=stall_timeout, weights_dir=weights_dir, jobs=pool,
                    extra_tasks=[t for t in tasks or () if ":" in t], policy=site_policy)
    node.revocations = revocations
    node.instance = secrets.token_hex(8)  # this process's id: a second daemon under the same name is refused
    node.relay_after = relay_after
    refused: list[str] = []
    servicer = PeerServicer(node)
    add_peer_servicer(servicer, server)
    node.metrics.watch(guard)
    health = Health(server, PEER_SERVICE)
    if metrics_listen:
        node.metrics.serve_http(metrics_listen)
    server.start()
    log.info("peer %s (%s) listening on %s (%s)%s, state dir %s, device %s", name, __version__,
             with_port(listen, port), "mutual TLS" if transport.secure else "INSECURE plaintext",
             ", connects out only: no address registered" if outbound_only else f", dialled at {address}",
             state_dir, device)
    node.stop = stop
    request = registration(name, address, offers, device, node.instance)
    claim = _claim_name(link, request)
    if claim is not None:  # another live daemon serves this name: resume nothing of its state
        server.stop(grace=None).wait()
        link.close()
        raise RuntimeError(f"not serving: {claim}")
    node.resume()
    hb = threading.Thread(target=_heartbeat, args=(link, request, stop, refused, revocations),
                          name="heartbeat", daemon=True)
    hb.start()
    control = ControlLink(link, servicer, name, node.instance, stop).start() if outbound_only else None
    health.serving()
    if ready is not None:
        ready.set()
    try:
        while not stop.wait(1.0):
            pass
    finally:
        health.stopping()
        server.stop(grace=2).wait()
        if control is not None:
            control.close()
        pool.close()
        node.metrics.close()
        link.close()
    if refused:
        raise RuntimeError(f"not serving: {refused[0]}")
