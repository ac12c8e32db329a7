"""The relay's bounds (docs/relay-bounds.md): what one sender, one run and one envelope may make a relay
hold, and for how long. ``coordinator/relay_server.py`` asks this module; it decides nothing itself.

- **Only planned transfers.** A relayed transfer needs a :class:`Permit`: the coordinator's own
  relay asks the ledger (the transfer must be in a running run's plan); an operator's relay
  (``coordinator relay``), which has no ledger, takes a :class:`Permit` only from a grant the
  coordinator signed with its certificate key (:func:`issue_grant`, checked by
  :func:`check_grant` against the coordinator's certificate, which the relay holds since it
  runs with the coordinator's identity). A grant names the run, purpose, index, sender and
  receiver and expires after ``GRANT_SECONDS``; made-up run ids get none.
- **Per envelope**: at most the run's payload cap plus the sealing overhead
  (``Permit.max_bytes``, ``fedrelay.transfer_bounds.sealed_cap``), and never more than
  ``RelayLimits.max_bytes``.
- **Per run**: the bytes and envelopes its plan can need (``Permit.run_bytes``,
  ``Permit.run_envelopes``). **Per identity** (the sender's certificate name, over all runs):
  ``RelayLimits.identity_bytes`` and ``identity_envelopes``. What counts is what is reserved:
  the declared size of every envelope held or being uploaded (:class:`Reservations`).
- **No stall**: a Put that sends nothing for ``RelayLimits.stall_timeout`` seconds is dropped
  (the stall timeout of a peer's Handoff, ``fedrelay.transfer_bounds.STALL_TIMEOUT``).
- **No compression amplification**: servers accept no compressed request
  (``fedrelay.server``'s server options); the bytes counted are the bytes written.
- **Expiry**: an envelope nobody fetched and discarded within ``RelayLimits.lifetime`` seconds
  of its upload is removed, with its partial upload (:meth:`Reservations.sweep`).

Refusals raise ``fedrelay.receiving.TransferError`` with the gRPC status to answer:
PERMISSION_DENIED (no permit), RESOURCE_EXHAUSTED (a cap or quota).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from fedrelay import signing, transfer_bounds
from fedrelay.files import atomic_write
from fedrelay.receiving import TransferError
from fedrelay.v1 import common_pb2

log = logging.getLogger("fedrelay.relay")

GRANT_SECONDS = 900.0  # a grant is valid this long after it was issued (the upload must begin by then)
MAX_GRANT_BYTES = 2048  # bound on a presented grant's body


class CapUnknown(LookupError):
    """A transfer's payload cap cannot be learnt now (its receiver cannot be asked): the relay
    answers UNAVAILABLE and the sender retries."""


@dataclass(frozen=True)
class RelayLimits:
    """A relay's own bounds (``coordinator relay`` / ``coordinator serve`` options).

    Attributes:
        max_bytes: bytes of one envelope, whatever a permit says (default 2 GiB).
        stall_timeout: seconds a Put may send nothing before it is dropped.
        lifetime: seconds an envelope is kept after its upload began, unfetched (default 24 h).
        identity_bytes: bytes reserved by one sender over all runs (default 8 GiB).
        identity_envelopes: envelopes (held or being uploaded) of one sender (default 256).
        sweep_every: seconds between two looks for expired envelopes.
    """

    max_bytes: int = 2 << 30
    stall_timeout: float = transfer_bounds.STALL_TIMEOUT
    lifetime: float = 24 * 3600.0
    identity_bytes: int = 8 << 30
    identity_envelopes: int = 256
    sweep_every: float = 60.0

    def __post_init__(self):
        for name in ("max_bytes", "stall_timeout", "lifetime", "identity_bytes", "identity_envelopes", "sweep_every"):
            if not getattr(self, name) > 0:
                raise ValueError(f"relay limit {name} must be > 0, not {getattr(self, name)!r}")


@dataclass(frozen=True)
class Permit:
    """What the coordinator allows one relayed transfer: ``max_bytes`` of envelope (the run's
    payload cap + ``fedrelay.transfer_bounds.SEAL_OVERHEAD``), and for the whole run at this relay
    ``run_bytes`` bytes in ``run_envelopes`` envelopes."""

    max_bytes: int
    run_bytes: int
    run_envelopes: int

    @classmethod
    def for_plan(cls, payload_cap: int, planned_transfers: int) -> "Permit":
        """The permit of one transfer of a run whose payloads are at most ``payload_cap``
        bytes and whose plan has ``planned_transfers`` transfers (every one could be relayed)."""
        envelope = transfer_bounds.sealed_cap(payload_cap)
        n = max(1, int(planned_transfers))
        return cls(max_bytes=envelope, run_bytes=n * envelope, run_envelopes=n)


# -- grants ------------------------------------------------------------------------------------------
def _transfer_fields(run_id: str, purpose: int, index: int, sender: str, receiver: str) -> dict:
    return {"run_id": run_id, "purpose": int(purpose), "index": int(index), "sender": sender, "receiver": receiver}


def issue_grant(signer: signing.Signer, run_id: str, purpose: int, index: int, sender: str, receiver: str,
                permit: Permit, now: float | None = None) -> common_pb2.RelayGrant:
    """The coordinator's signed grant of ``permit`` for one planned transfer, valid for
    ``GRANT_SECONDS`` from ``now`` (unix seconds; default: now)."""
    now = time.time() if now is None else now
    body = dict(_transfer_fields(run_id, purpose, index, sender, receiver), max_bytes=permit.max_bytes,
                run_bytes=permit.run_bytes, run_envelopes=permit.run_envelopes, expires=now + GRANT_SECONDS)
    raw = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return common_pb2.RelayGrant(body=raw, signature=signer.sign_bytes(raw))


def check_grant(header: common_pb2.TransferHeader, coordinator_cert, now: float | None = None) -> Permit:
    """The permit of the grant ``header.relay_grant``: signed by the key of ``coordinator_cert``
    (an ``x509.Certificate``), not expired, for exactly the header's run, purpose, index, sender
    and receiver. Raises ``TransferError`` (PERMISSION_DENIED)."""
    grant = header.relay_grant
    if not header.HasField("relay_grant") or not grant.body:
        raise TransferError(grpc.StatusCode.PERMISSION_DENIED,
                            "this relay carries only transfers the coordinator granted (header.relay_grant is empty)")
    if len(grant.body) > MAX_GRANT_BYTES:
        raise TransferError(grpc.StatusCode.PERMISSION_DENIED, f"header.relay_grant is over {MAX_GRANT_BYTES} bytes")
    try:
        signing.verify(grant.body, grant.signature, coordinator_cert)
        body = json.loads(grant.body)
        permit = Permit(max_bytes=int(body["max_bytes"]), run_bytes=int(body["run_bytes"]),
                        run_envelopes=int(body["run_envelopes"]))
        expires = float(body["expires"])
        named = {k: body[k] for k in ("run_id", "purpose", "index", "sender", "receiver")}
    except signing.SignatureError as exc:
        raise TransferError(grpc.StatusCode.PERMISSION_DENIED, f"header.relay_grant is not the coordinator's: {exc}") from None
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise TransferError(grpc.StatusCode.PERMISSION_DENIED, f"header.relay_grant is malformed: {exc}") from None
    if named != _transfer_fields(header.run_id, header.purpose, header.hop, header.sender, header.receiver):
        raise TransferError(grpc.StatusCode.PERMISSION_DENIED, "header.relay_grant is for another transfer")
    if (time.time() if now is None else now) > expires:
        raise TransferError(grpc.StatusCode.PERMISSION_DENIED, "header.relay_grant has expired: ask the coordinator again")
    return permit


# -- what is held ------------------------------------------------------------------------------------
class Reservations:
    """The envelopes a relay folder holds or is receiving, from their meta files
    (``<envelope>.json``: sender, receiver, declared ``bytes``, ``sha256``, ``created`` unix
    seconds, ``complete``). A meta file is written when an upload is accepted (the reservation)
    and completed when the envelope is; quotas count every reservation. Callers hold their
    own lock around :meth:`reserve` (check and write together)."""

    def __init__(self, folder: Path, relay_limits: RelayLimits):
        self.folder = folder
        self.limits = relay_limits
        self._last_sweep = 0.0

    @staticmethod
    def meta_path(dest: Path) -> Path:
        return dest.with_suffix(".json")

    @staticmethod
    def read(meta: Path) -> dict | None:
        try:
            m = json.loads(meta.read_text())
            return m if isinstance(m, dict) else None
        except (OSError, ValueError):
            return None

    def _metas(self):
        for meta in self.folder.glob("*/*.json"):
            m = self.read(meta)
            if m is not None:
                yield meta, m

    def reserve(self, dest: Path, header: common_pb2.TransferHeader, permit: Permit) -> None:
        """Check the envelope of ``header`` (into ``dest``) against ``permit`` and the
        identity quotas, and record its reservation (replacing one for the same ``dest``).
        Raises ``TransferError`` (RESOURCE_EXHAUSTED)."""
        if header.total_bytes > min(permit.max_bytes, self.limits.max_bytes):
            raise TransferError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"an envelope of {header.total_bytes} bytes exceeds this transfer's cap of "
                                f"{min(permit.max_bytes, self.limits.max_bytes)} bytes (the run's payload cap and "
                                "the sealing overhead)")
        own = self.meta_path(dest)
        run_bytes = run_n = who_bytes = who_n = 0
        for meta, m in self._metas():
            if meta == own:
                continue
            size = int(m.get("bytes") or 0)
            if meta.parent.name == header.run_id:
                run_bytes, run_n = run_bytes + size, run_n + 1
            if m.get("sender") == header.sender:
                who_bytes, who_n = who_bytes + size, who_n + 1
        total = header.total_bytes
        for used, count, cap, n_cap, whose in ((run_bytes, run_n, permit.run_bytes, permit.run_envelopes,
                                                f"run {header.run_id}"),
                                               (who_bytes, who_n, self.limits.identity_bytes,
                                                self.limits.identity_envelopes, header.sender)):
            if count + 1 > n_cap or used + total > cap:
                raise TransferError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"the relay's quota of {whose} is spent: {count} envelopes, {used} bytes held "
                                    f"(at most {n_cap} envelopes, {cap} bytes)")
        old = self.read(own) if own.exists() else None
        created = old["created"] if old and old.get("sha256") == header.sha256 and "created" in old else time.time()
        if old and old.get("sha256") != header.sha256:
            dest.unlink(missing_ok=True)  # a resealed envelope replaces the one held (same sender, checked before)
        dest.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(own, json.dumps({"sender": header.sender, "receiver": header.receiver,
                                      "sha256": header.sha256, "bytes": total, "created": created,
                                      "complete": False}).encode())

    def complete(self, dest: Path, sha256: str, size: int) -> None:
        """The envelope ``dest`` is stored whole."""
        own = self.meta_path(dest)
        m = self.read(own) or {}
        m.update(sha256=sha256, bytes=size, complete=True)
        m.setdefault("created", time.time())
        atomic_write(own, json.dumps(m).encode())

    def release(self, dest: Path) -> None:
        """Drop the reservation of ``dest`` unless its envelope or a partial upload is held."""
        if dest.exists() or any(dest.parent.glob(f".{dest.name}.*.part")):
            return
        self.meta_path(dest).unlink(missing_ok=True)

    def sweep(self, now: float | None = None, force: bool = False) -> int:
        """Remove the envelopes (and partial uploads) older than ``limits.lifetime``; at most
        once per ``limits.sweep_every`` seconds unless ``force``. Returns the bytes removed."""
        now = time.time() if now is None else now
        if not force and now - self._last_sweep < self.limits.sweep_every:
            return 0
        self._last_sweep = now
        removed = 0
        for meta, m in list(self._metas()):
            try:
                created = float(m.get("created", meta.stat().st_mtime))
            except (OSError, TypeError, ValueError):
                created = 0.0
            if now - created <= self.limits.lifetime:
                continue
            dest = meta.with_suffix(".sealed")
            for f in [dest, *dest.parent.glob(f".{dest.name}.*.part"), meta]:
                try:
                    removed += f.stat().st_size if f != meta else 0
                    f.unlink()
                except FileNotFoundError:
                    pass
            log.info("relay: removed the %s envelope of run %s for %s from %s (%s after its upload began, "
                     "never fetched)", "whole" if m.get("complete") else "partial", meta.parent.name,
                     m.get("receiver"), m.get("sender"), f"{now - created:.0f} s")
        for part in self.folder.glob("*/.*.part"):  # partial uploads without a reservation (older relays)
            try:
                if now - part.stat().st_mtime > self.limits.lifetime:
                    removed += part.stat().st_size
                    part.unlink()
            except FileNotFoundError:
                pass
        for run in self.folder.iterdir() if self.folder.is_dir() else []:
            if run.is_dir() and not any(run.iterdir()):
                run.rmdir()
        return removed
