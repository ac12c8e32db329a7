"""The relay: where a sender leaves a sealed payload for a site it cannot reach directly.

A site that only connects out (``peer serve --outbound-only``), or one its sender could not reach
for a while, gets its models through a relay: the sender seals the payload to the receiver's
certificate key and signs it (``fedrelay/sealing.py``), streams the envelope here
(``Relay.Put``, resumable with ``Relay.Offset``), and the receiver, told by the coordinator
(``Peer.RelayReady``), streams it back (``Relay.Get``, from the bytes it holds) and asks the relay
to delete it (``Relay.Discard``). The relay never holds plaintext: it can read the envelope's
header (who sends what to whom) but not the model.

The coordinator serves this service itself (``coordinator serve``: envelopes under
``--relay-dir``, by default the folder ``relay`` beside the ledger, and only for transfers of a
run's plan), or the operator runs it alone (``coordinator relay``; then any two sites of the
federation's CA may use it) and points the sites to it (``coordinator serve --relay HOST:PORT``).

Rules (mutual TLS only: a plaintext relay refuses every call, FAILED_PRECONDITION): a Put's
``header.sender`` must be the caller's certificate name; Get and Discard only by the receiver the
envelope is for. A second envelope for the same transfer from the same sender replaces the first
(a resealed payload); from another sender it is refused (ALREADY_EXISTS). The bounds (only
planned transfers, the run's payload cap per envelope, per-run and per-sender quotas, the stall
timeout, expiry of what is never fetched) are ``coordinator/relay_bounds.py``'s; the operator's
relay takes only transfers the coordinator granted (``TransferHeader.relay_grant``). Envelopes
live at ``DIR/<run>/<purpose>-<index>-<receiver>.sealed`` with a meta file ``.json`` beside;
:meth:`RelayService.drop_run` removes a run's folder once the run has ended.
"""

from __future__ import annotations

import logging
import shutil
import threading
from pathlib import Path
from typing import Callable

import grpc

from fedrelay import purpose as purposes
from fedrelay import names, signing
from fedrelay.addresses import with_port
from fedrelay.callers import COORDINATOR_IDENTITY, caller_identity
from fedrelay.files import iter_file_chunks
from fedrelay.server import make_server
from fedrelay.transport import Transport
from fedrelay.coordinator.relay_bounds import CapUnknown, Permit, RelayLimits, Reservations, check_grant
from fedrelay.inbound import InboundStreams, Stream
from fedrelay.receiving import TransferError, check_header_fields, held_bytes, receive_model
from fedrelay.v1 import common_pb2, peer_pb2, relay_pb2, relay_pb2_grpc

log = logging.getLogger("fedrelay.relay")

DEFAULT_MAX_BYTES = RelayLimits.max_bytes  # 2 GiB per envelope, whatever a permit says


class _Held(Exception):
    """This exact envelope is already held."""


class RelayService(relay_pb2_grpc.RelayServicer):
    """Store-and-forward of sealed envelopes in ``folder``, within ``limits``
    (``coordinator/relay_bounds.py``).

    Which transfers it carries: ``authorize(run_id, purpose, index, sender, receiver)``, when
    given (the coordinator's own relay), returns the transfer's ``Permit`` or raises
    ``PermissionError`` (not in a running run's plan) or ``relay_bounds.CapUnknown`` (the run's
    payload cap cannot be learnt now: UNAVAILABLE, retry). Otherwise ``coordinator_cert`` (PEM; the
    operator's relay) checks the grant each Put and Offset header carries; with neither, nothing
    is carried. ``on_stored(path)``, when given, is called with each envelope once it is complete
    (tests look at what the relay holds)."""

    def __init__(self, folder: str | Path, *, authorize: Callable | None = None, coordinator_cert: bytes | None = None,
                 max_bytes: int = DEFAULT_MAX_BYTES, limits: RelayLimits | None = None,
                 on_stored: Callable[[Path], None] | None = None):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.authorize = authorize
        self.coordinator_cert = signing.load_certificate(coordinator_cert) if coordinator_cert else None
        self.limits = limits if limits is not None else RelayLimits(max_bytes=max_bytes)
        self.max_bytes = self.limits.max_bytes
        self.on_stored = on_stored
        self.reservations = Reservations(self.folder, self.limits)
        self.streams = InboundStreams(self.limits.stall_timeout)
        self._lock = threading.Lock()

    # -- where things are -------------------------------------------------------------------------
    def path(self, run_id: str, purpose: int, index: int, receiver: str) -> Path:
        return self.folder / run_id / f"{purposes.BY_WIRE[purpose]}-{index}-{receiver}.sealed"

    @staticmethod
    def _meta(path: Path) -> dict | None:
        """The meta file of the envelope ``path`` once it is whole, else None."""
        m = Reservations.read(path.with_suffix(".json"))
        return m if m is not None and m.get("complete", True) and path.exists() else None

    def _caller(self, context) -> str:
        who = caller_identity(context)
        if who is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          "the relay needs mutual TLS: payloads are sealed to the receiver's certificate key")
        return who

    def _check(self, h: common_pb2.TransferHeader, caller: str, reserve: bool = False) -> Path:
        """The checks of a Put or Offset header; ``reserve``: also the quotas, and record the
        upload's reservation (a Put). Raises ``TransferError``."""
        check_header_fields(h)
        try:
            names.check_site_name(h.receiver, "header.receiver")
        except names.InvalidName as exc:
            raise TransferError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        if h.purpose not in purposes.BY_WIRE:
            raise TransferError(grpc.StatusCode.INVALID_ARGUMENT, "unknown transfer purpose")
        if h.sender != caller:
            raise TransferError(grpc.StatusCode.PERMISSION_DENIED,
                                f"header.sender {h.sender!r} is not the certificate identity {caller!r}")
        if h.total_bytes > self.max_bytes:
            raise TransferError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"an envelope of {h.total_bytes} bytes exceeds this relay's cap of {self.max_bytes} bytes")
        permit = self._permit(h)
        dest = self.path(h.run_id, h.purpose, h.hop, h.receiver)
        meta = self._meta(dest) if dest.exists() else None
        if meta is not None:
            if meta["sender"] != h.sender:
                raise TransferError(grpc.StatusCode.ALREADY_EXISTS,
                                    f"the relay holds this transfer's envelope from {meta['sender']!r}")
            if meta["sha256"] == h.sha256:
                raise _Held()
        if reserve:
            with self._lock:
                self.reservations.reserve(dest, h, permit)
        elif h.total_bytes > permit.max_bytes:
            raise TransferError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"an envelope of {h.total_bytes} bytes exceeds "
                                f"this transfer's cap of {permit.max_bytes} bytes")
        return dest

    def _permit(self, h: common_pb2.TransferHeader) -> Permit:
        """The transfer's permit: the coordinator's word (``authorize``) or its signed grant."""
        if self.authorize is not None:
            try:
                permit = self.authorize(h.run_id, h.purpose, h.hop, h.sender, h.receiver)
            except PermissionError as exc:
                raise TransferError(grpc.StatusCode.PERMISSION_DENIED, str(exc)) from None
            except CapUnknown as exc:
                raise TransferError(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
            if not isinstance(permit, Permit):
                raise TransferError(grpc.StatusCode.PERMISSION_DENIED, "the coordinator gave this transfer no permit")
            return permit
        if self.coordinator_cert is None:
            raise TransferError(grpc.StatusCode.PERMISSION_DENIED, "this relay carries no transfer: it knows no "
                                "coordinator to grant one")
        return check_grant(h, self.coordinator_cert)

    # -- the calls --------------------------------------------------------------------------------
    def Put(self, request_iterator, context) -> relay_pb2.RelayReceipt:
        caller = self._caller(context)
        try:
            self.sweep()
        except OSError as exc:  # a broken disk: the upload below says so if it cannot be stored either
            log.error("relay: cannot remove expired envelopes: %s", exc)
        holder: dict = {}
        mine = Stream()

        def check_header(h: common_pb2.TransferHeader) -> Path:
            holder["dest"] = self._check(h, caller, reserve=True)
            self.streams.claim(holder["dest"], mine)  # one stream writes into an envelope: an older one ends
            return holder["dest"]

        # Dropped when it stalls, runs past its deadline, or a newer stream of the transfer takes over.
        watched = self.streams.watched(request_iterator, mine.cancel)
        try:
            got = receive_model(watched, Path("/nonexistent"), check_header, lambda data: None, resumable=True)
        except _Held:
            return relay_pb2.RelayReceipt(duplicate=True)
        except TransferError as exc:
            self._release(holder)
            context.abort(exc.code, exc.message)
        except OSError as exc:
            self._release(holder)
            log.error("relay: cannot store an envelope: %s", exc)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the relay cannot store the envelope: {exc}")
        except BaseException:
            self._release(holder)
            raise
        finally:
            watched.close()
            self.streams.release(mine)
        h = got.header
        self.reservations.complete(got.path, got.sha256, got.size)
        log.info("relay: holds run %s %s %d for %s from %s (%d sealed bytes)", h.run_id, purposes.BY_WIRE[h.purpose],
                 h.hop, h.receiver, h.sender, got.size)
        if self.on_stored is not None:
            self.on_stored(got.path)
        return relay_pb2.RelayReceipt(stored_bytes=got.size, sha256=got.sha256)

    def _release(self, holder: dict) -> None:
        if "dest" in holder:
            with self._lock:
                self.reservations.release(holder["dest"])

    def sweep(self, force: bool = False) -> int:
        """Remove what has waited unfetched past the relay's lifetime (at most once per
        ``limits.sweep_every`` seconds unless ``force``). Returns the bytes removed."""
        with self._lock:
            return self.reservations.sweep(force=force)

    def Offset(self, request: common_pb2.TransferHeader, context) -> peer_pb2.TransferOffsetReply:
        caller = self._caller(context)
        try:
            dest = self._check(request, caller)
        except _Held:
            return peer_pb2.TransferOffsetReply(offset=request.total_bytes, complete=True)
        except TransferError as exc:
            context.abort(exc.code, exc.message)
        try:
            self.streams.end(dest)  # the sender gave up on an older stream: the answer is final
        except TransferError as exc:
            context.abort(exc.code, exc.message)
        return peer_pb2.TransferOffsetReply(offset=min(held_bytes(dest, request.sha256), request.total_bytes))

    def _held(self, key: relay_pb2.RelayKey, context, missing_ok: bool = False) -> tuple[Path, dict | None]:
        caller = self._caller(context)
        names.check_run_id(key.run_id)
        names.check_site_name(key.receiver, "key.receiver")
        if key.purpose not in purposes.BY_WIRE:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "unknown transfer purpose")
        if caller != key.receiver:
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"only {key.receiver!r} may fetch its envelopes; the caller's certificate names {caller!r}")
        path = self.path(key.run_id, key.purpose, key.index, key.receiver)
        meta = self._meta(path) if path.exists() else None
        if meta is None and not missing_ok:
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"the relay holds no envelope of run {key.run_id} {purposes.BY_WIRE[key.purpose]} {key.index} "
                          f"for {key.receiver}")
        return path, meta

    def Get(self, request: relay_pb2.RelayGetRequest, context):
        path, meta = self._held(request.key, context)
        if request.offset > meta["bytes"]:
            context.abort(grpc.StatusCode.OUT_OF_RANGE, f"offset {request.offset} is beyond the envelope's "
                          f"{meta['bytes']} bytes")
        k = request.key
        yield common_pb2.ModelChunk(header=common_pb2.TransferHeader(
            run_id=k.run_id, hop=k.index, purpose=k.purpose, sender=meta["sender"], receiver=k.receiver,
            total_bytes=meta["bytes"], sha256=meta["sha256"], offset=request.offset))
        for block in iter_file_chunks(path, start=request.offset):
            yield common_pb2.ModelChunk(data=block)

    def Discard(self, request: relay_pb2.RelayKey, context) -> relay_pb2.RelayDiscardReply:
        path, meta = self._held(request, context, missing_ok=True)
        path.unlink(missing_ok=True)
        path.with_suffix(".json").unlink(missing_ok=True)
        return relay_pb2.RelayDiscardReply(removed_bytes=meta["bytes"] if meta else 0)

    def drop_run(self, run_id: str) -> int:
        """Remove every envelope and partial upload of ``run_id`` (the run has ended). Returns
        the bytes removed."""
        folder = self.folder / run_id
        if not folder.is_dir():
            return 0
        size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
        shutil.rmtree(folder, ignore_errors=True)
        return size

    def runs(self) -> list[str]:
        """The runs the relay holds anything of."""
        return sorted(p.name for p in self.folder.iterdir() if p.is_dir()) if self.folder.is_dir() else []


def serve_relay(listen: str, folder: str | Path, *, transport: Transport, stop: threading.Event | None = None,
                ready: threading.Event | None = None, max_bytes: int = DEFAULT_MAX_BYTES,
                limits: RelayLimits | None = None,
                on_stored: Callable[[Path], None] | None = None, bound: list | None = None,
                crl: Path | None = None) -> None:
    """``coordinator relay``: the Relay service alone, until ``stop`` is set (or forever). Needs
    mutual TLS (``transport`` secure; sites dial it expecting the certificate name
    ``coordinator``, so run it with the coordinator's identity folder, whose certificate also
    checks the coordinator's grants). ``limits``: its bounds (default ``RelayLimits`` with
    ``max_bytes``); expired envelopes are removed every ``limits.sweep_every`` seconds.
    ``on_stored``: see :class:`RelayService`; ``bound``, when given, gets the ``HOST:PORT``
    listened on appended (before ``ready`` is set). ``crl``: the federation's revocation list
    file (PKI/ca/crl.pem), reloaded when it changes: revoked sites' calls are refused
    (``fedrelay.revocation``). Raises ``ValueError`` (plaintext, another identity, a CRL not
    signed by the CA) or ``RuntimeError`` (cannot listen)."""
    if not transport.secure:
        raise ValueError("the relay needs mutual TLS (--tls PKI/coordinator): payloads are sealed to certificate keys")
    if transport.identity != COORDINATOR_IDENTITY:
        raise ValueError(f"--tls {transport.source}: the relay runs with the coordinator's identity (PKI/coordinator), "
                         f"not {transport.identity!r}")
    from fedrelay import revocation
    from fedrelay.guard import Guard

    stop = stop or threading.Event()
    try:
        guard = Guard(revocations=revocation.for_daemon(transport, crl_file=crl, stop=stop))
    except revocation.CrlError as exc:
        raise ValueError(str(exc)) from None
    service = RelayService(folder, coordinator_cert=transport.cert, on_stored=on_stored,
                           limits=limits if limits is not None else RelayLimits(max_bytes=max_bytes))
    server, port = make_server(listen, transport=transport, guard=guard)
    relay_pb2_grpc.add_RelayServicer_to_server(service, server)
    server.start()
    log.info("relay listening on %s (mutual TLS), envelopes in %s", with_port(listen, port), folder)
    if bound is not None:
        bound.append(with_port(listen, port))
    if ready is not None:
        ready.set()
    try:
        while not stop.wait(1.0):
            try:
                service.sweep()
            except OSError as exc:  # a full or broken disk: say so, keep serving
                log.error("relay: cannot remove expired envelopes: %s", exc)
    finally:
        server.stop(grace=2).wait()
