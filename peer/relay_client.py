"""Transfers through a relay, for a receiver that cannot be reached directly.

Direct transfer (``peer/transfer.py``) is the default and is tried first. A sender goes through
the relay (``coordinator/relay_server.py``) when the receiver only connects out (it registered no
address), or when it could not reach the receiver directly for ``--relay-after`` seconds. Then:

1. :func:`seal`: the payload is sealed to the receiver's certificate key and signed with this
   site's (``fedrelay.sealing``: ECDH P-256 + HKDF-SHA256 + AES-256-GCM, ECDSA P-256 signature),
   once: the envelope is kept in the run folder (``sealed/``), so a resumed upload sends the
   same bytes. The receiver's certificate comes from the coordinator (``ResolveSite``) and must
   be signed by the federation's CA for the receiver's name: the coordinator cannot substitute
   a key of its own making without the CA's.
2. :func:`put`: the envelope is streamed to the relay (``Relay.Put``), resuming at the bytes the
   relay holds (``Relay.Offset``), exactly as a direct stream resumes at the receiver's.
3. The sender reports the transfer with ``route = "relayed"``; the coordinator tells the
   receiver (``Peer.RelayReady``), which :func:`fetch` es the envelope (``Relay.Get`` from the
   bytes it already holds; a broken download resumes), opens it (signature, decryption, digest),
   and keeps the model after the same checks as a direct Handoff.

Needs mutual TLS: without certificates there is no key to seal to (``RelayUnavailable``).

:class:`RelayFetches` is the receiving site's side of step 3 (``Peer.RelayReady``).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import grpc

from fedrelay import purpose as purposes
from fedrelay import sealing, transfer_bounds
from fedrelay.callers import COORDINATOR_IDENTITY
from fedrelay.calls import CONTROL_TIMEOUT, backoff_delays, status_message, transfer_timeout
from fedrelay.files import sha256_file
from fedrelay.transport import Transport
from fedrelay.peer.receiving import Duplicate, Receiving
from fedrelay.peer.runs import Run, sent_key
from fedrelay.peer.site import Site
from fedrelay.peer.transfer import Sent, send_model
from fedrelay.receiving import Received, TransferError, check_header_fields, held_bytes, receive_model
from fedrelay.sealing import SealError
from fedrelay.v1 import common_pb2, peer_pb2, relay_pb2

log = logging.getLogger("fedrelay.peer")

RELAY_METHODS = ("/fedrelay.v1.Relay/Offset", "/fedrelay.v1.Relay/Put", relay_pb2.RelayReceipt.FromString)
GET_METHOD = "/fedrelay.v1.Relay/Get"
DISCARD_METHOD = "/fedrelay.v1.Relay/Discard"


class RelayUnavailable(RuntimeError):
    """The relay cannot be used for this transfer (a plaintext daemon: nothing to seal to)."""


class NoCertificateYet(RuntimeError):
    """The coordinator holds no certificate of the receiver yet (it restarted, and the receiver
    has not registered again): try again later."""


def envelope_header(run_id: str, t: common_pb2.PlannedTransfer) -> dict:
    """The transfer's identity as the envelope states it (signed by the sender)."""
    return {"run_id": run_id, "purpose": purposes.BY_WIRE[t.purpose], "index": int(t.index), "round": int(t.round),
            "sender": t.sender, "receiver": t.receiver}


def seal(transport: Transport, run_id: str, t: common_pb2.PlannedTransfer, payload: Path,
         receiver_cert: bytes, folder: Path) -> tuple[Path, int, str]:
    """The sealed envelope of ``payload`` for the planned transfer ``t``, written once to
    ``folder`` and reused afterwards. Returns (path, envelope bytes, envelope SHA-256). Raises
    ``RelayUnavailable`` (plaintext daemon), ``NoCertificateYet`` (empty ``receiver_cert``) or
    ``sealing.SealError`` (the certificate is not the CA's for ``t.receiver``)."""
    if not transport.secure:
        raise RelayUnavailable("a relayed transfer needs mutual TLS (--tls): the payload is sealed to the "
                               "receiver's certificate key")
    if not receiver_cert:
        raise NoCertificateYet(f"the coordinator has no certificate of {t.receiver} yet (it has not registered "
                               "over mutual TLS since the coordinator started)")
    word = purposes.BY_WIRE[t.purpose]
    path = folder / f"{word}-{t.index}-{t.receiver}-{sha256_file(payload)[:16]}.sealed"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        sealing.seal_file(payload, path, header=envelope_header(run_id, t), recipient_cert_pem=receiver_cert,
                          sender_key_pem=transport.key, sender_cert_pem=transport.cert, ca_pem=transport.ca)
    return path, path.stat().st_size, sha256_file(path)


def put(relay: str, transport: Transport, run_id: str, t: common_pb2.PlannedTransfer, sealed: Path,
        counter: list[int], cancelled=None, grant: common_pb2.RelayGrant | None = None) -> Sent:
    """Stream the envelope ``sealed`` to the relay at ``relay`` (whose certificate must name
    ``coordinator``), from the bytes it already holds. ``grant``: the coordinator's grant of
    this transfer (``Coordinator.GrantRelay``), which an operator's relay requires.
    ``counter[0]`` accumulates the wire bytes. Raises ``grpc.RpcError`` (and
    ``transfer.SendCancelled``) as ``send_model``."""
    header = common_pb2.TransferHeader(run_id=run_id, hop=t.index, purpose=t.purpose, sender=t.sender,
                                       receiver=t.receiver, total_bytes=sealed.stat().st_size,
                                       sha256=sha256_file(sealed))
    if grant is not None:
        header.relay_grant.CopyFrom(grant)
    return send_model(relay, header, sealed, transport=transport, expect=COORDINATOR_IDENTITY,
                      counter=counter, cancelled=cancelled, methods=RELAY_METHODS)


def fetch(relay: str, transport: Transport, key: relay_pb2.RelayKey, sender: str, sealed: Path,
          total: int, sha256: str, counter: list[int]) -> Received:
    """Download the envelope of ``key`` from the relay into ``sealed``, resuming at the bytes a
    broken earlier download left (``transfer.partial_path``); its size and SHA-256 must be
    ``total`` and ``sha256`` (what the sender reported) and its sender ``sender``.
    ``counter[0]`` accumulates the wire bytes (each message plus gRPC's framing). Raises
    ``grpc.RpcError`` or ``TransferError``."""
    offset = held_bytes(sealed, sha256)

    def check_header(h: common_pb2.TransferHeader) -> None:
        if (h.run_id, h.hop, h.purpose, h.receiver) != (key.run_id, key.index, key.purpose, key.receiver):
            raise TransferError(grpc.StatusCode.INVALID_ARGUMENT, "the relay sent another transfer's envelope")
        if h.sender != sender or h.total_bytes != total or h.sha256 != sha256:
            raise TransferError(grpc.StatusCode.FAILED_PRECONDITION,
                                f"the relay holds an envelope from {h.sender} of {h.total_bytes} bytes, sha256 "
                                f"{h.sha256[:12]}, not the one reported ({sender}, {total} bytes, {sha256[:12]})")

    def counted(stream):
        for msg in stream:
            counter[0] += msg.ByteSize() + 5
            yield msg

    with transport.channel(relay, expect=COORDINATOR_IDENTITY) as channel:
        get = channel.unary_stream(GET_METHOD, request_serializer=relay_pb2.RelayGetRequest.SerializeToString,
                                   response_deserializer=common_pb2.ModelChunk.FromString)
        stream = get(relay_pb2.RelayGetRequest(key=key, offset=offset), timeout=transfer_timeout(total))
        return receive_model(counted(stream), sealed, check_header, lambda data: None, resumable=True)


def discard(relay: str, transport: Transport, key: relay_pb2.RelayKey) -> None:
    """Ask the relay to delete the envelope of ``key`` (this site has kept the payload). Raises
    ``grpc.RpcError``."""
    with transport.channel(relay, expect=COORDINATOR_IDENTITY) as channel:
        channel.unary_unary(DISCARD_METHOD, request_serializer=relay_pb2.RelayKey.SerializeToString,
                            response_deserializer=relay_pb2.RelayDiscardReply.FromString)(key, timeout=CONTROL_TIMEOUT)


def open_envelope(transport: Transport, sealed: Path, out: Path, run_id: str,
                  t: common_pb2.PlannedTransfer) -> dict:
    """Verify and decrypt the envelope ``sealed`` of the planned transfer ``t`` (into this
    site) into ``out``: the sender's certificate must be the CA's for ``t.sender``, its signature
    must hold, and the plaintext's size and SHA-256 must be the signed ones
    (``sealing.open_file``). Returns the envelope's header. Raises ``sealing.SealError``."""
    return sealing.open_file(sealed, out, recipient_key_pem=transport.key, recipient_cert_pem=transport.cert,
                             ca_pem=transport.ca, expect=envelope_header(run_id, t))


class RelayFetches:
    """The relayed payloads a site fetches (``receiving``: where they are checked and kept)."""

    def __init__(self, site: Site, receiving: Receiving):
        self.site = site
        self.receiving = receiving
        self.fetching: set[tuple[str, str]] = set()  # (run, transfer) downloads from a relay under way

    def ready(self, notice: peer_pb2.RelayNotice) -> str:
        """``Peer.RelayReady``: the envelope of a transfer into this site waits at a relay. Starts
        fetching it in the background (once: a second notice while it runs, or after the payload
        was kept, has no effect). Returns "fetching" or "held". Raises ``TransferError`` (no such
        run, a transfer not planned into this site from that sender)."""
        h = common_pb2.TransferHeader(run_id=notice.run_id, hop=notice.index, sender=notice.sender,
                                      purpose=notice.purpose, total_bytes=max(1, notice.sealed_bytes),
                                      sha256=notice.sealed_sha256)
        check_header_fields(h)
        try:  # answered at once: the size is checked against the run's cap in the fetch's thread
            run, t, dest = self.receiving.check_transfer(h, None, check_cap=False)
        except Duplicate:
            return "held"
        key = (run.run_id, sent_key(t))
        with self.site.lock:
            if key in self.fetching:
                return "fetching"
            self.fetching.add(key)
        threading.Thread(target=self.fetch, args=(run, t, notice, key), daemon=True,
                         name=f"fetch-{run.run_id}-{sent_key(t)}").start()
        return "fetching"

    def fetch(self, run: Run, t: common_pb2.PlannedTransfer, notice: peer_pb2.RelayNotice, key) -> None:
        """Download, open and keep a relayed payload; retried (the daemons' backoff) while the
        relay cannot be reached, until the run ends or the daemon stops. A payload that fails
        its checks (signature, decryption, digest, schema) is refused: logged, reported as the
        run's failure at this site, and its envelope left at the relay."""
        relay = notice.relay or self.site.relay_address
        rkey = relay_pb2.RelayKey(run_id=run.run_id, purpose=t.purpose, index=t.index, receiver=self.site.name)
        sealed = run.path("relay-in") / f"{sent_key(t).replace(':', '-')}.sealed"
        dest = run.destination(t)
        counter = [0]
        try:
            self.receiving.check_cap(run, notice.sealed_bytes - transfer_bounds.SEAL_OVERHEAD)
            for delay in backoff_delays():
                if run.ended.is_set() or self.site.stop.is_set() or dest.exists():
                    return
                try:
                    if not (sealed.exists() and sha256_file(sealed) == notice.sealed_sha256):
                        fetch(relay, self.site.transport, rkey, t.sender, sealed, notice.sealed_bytes,
                                       notice.sealed_sha256, counter)
                    break
                except (grpc.RpcError, TransferError) as exc:
                    msg = status_message(exc) if isinstance(exc, grpc.RpcError) else exc.message
                    log.warning("run %s: fetching %s %d from the relay at %s failed (%s); retrying in %.1f s",
                                run.run_id, purposes.said(t.purpose), t.index, relay, msg, delay)
                    self.site.stop.wait(delay)
            plain = dest.parent / f".{dest.name}.relayed.part"
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                open_envelope(self.site.transport, sealed, plain, run.run_id, t)
                size, sha = plain.stat().st_size, sha256_file(plain)
                self.receiving.schemas.check_model_bytes(run.assignment, plain.read_bytes(), t.purpose)
                if dest.exists():  # the same transfer arrived directly meanwhile
                    plain.unlink(missing_ok=True)
                    return
                plain.replace(dest)
            except (SealError, ValueError) as exc:
                plain.unlink(missing_ok=True)
                raise RuntimeError(f"refused the relayed {purposes.said(t.purpose)} {t.index} from {t.sender}: {exc}") from exc
            self.receiving.kept(run, t, dest, size, sha, route="relayed", relay_wire_bytes=counter[0])
            sealed.unlink(missing_ok=True)
            try:
                discard(relay, self.site.transport, rkey)
            except grpc.RpcError as exc:  # the relay drops the run's envelopes when it ends anyway
                log.info("run %s: the relay did not discard the envelope: %s", run.run_id, status_message(exc))
        except Exception as exc:  # noqa: BLE001 - a background thread says so and fails its run
            log.error("run %s: %s", run.run_id, exc)
            self.site.fail(run, str(exc))
        finally:
            with self.site.lock:
                self.fetching.discard(key)
