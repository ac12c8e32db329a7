"""Receiving at a site: a model stream into this site (``Peer.Handoff``) checked against the
run's plan before and after its bytes (header, sender, size cap, payload schema), where a broken
stream resumes (``Peer.TransferOffset``), the receipts the coordinator is owed for what was kept,
and the worker started ahead for a transfer about to come (``Peer.Prepare``) and the size the relay
may hold for the run (``Peer.RelayQuota``).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import grpc

from fedrelay import purpose as purposes
from fedrelay.callers import COORDINATOR_IDENTITY
from fedrelay.files import sha256_file
from fedrelay.tensors import schema_digest
from fedrelay.peer.assignment import job_spec
from fedrelay.inbound import InboundStreams, Stream
from fedrelay.peer.refusals import RefusedStreams
from fedrelay.peer.runs import Run, sent_key
from fedrelay.peer.schemas import PayloadSchemas
from fedrelay.peer.site import Site
from fedrelay.receiving import TransferError, check_header_fields, held_bytes, receive_model, remove_partials
from fedrelay.v1 import common_pb2, coordinator_pb2 as cpb, peer_pb2

log = logging.getLogger("fedrelay.peer")


class Duplicate(Exception):
    """This exact payload was already accepted: args are (run, dest, sha256, hop)."""


class Receiving:
    """What comes into one site: ``schemas`` (the runs' payload schemas), ``stall_timeout``
    (seconds a stream may send nothing)."""

    def __init__(self, site: Site, schemas: PayloadSchemas, stall_timeout: float):
        self.site = site
        self.schemas = schemas
        self.streams = InboundStreams(stall_timeout)  # the Handoff streams open here
        self.refused_streams = RefusedStreams()  # failed streams per (run, sender): logged a few, then counted

    def handoff(self, chunks, caller: str | None = None) -> peer_pb2.HandoffReceipt:
        """Receive a model stream from the peer whose certificate names ``caller`` (``None`` on a
        plaintext daemon: then only the header's ``sender`` is checked).

        Accepted only for a transfer of this site's part of the run's plan (a hop whose index is
        ``header.hop``, or a final copy), from the sender the plan names, whose certificate name
        must also be the header's ``sender``. A stream that sends nothing for ``stall_timeout``
        seconds, or runs past ``calls.transfer_timeout`` of its declared size, is dropped
        (DEADLINE_EXCEEDED).

        Resume: the bytes of a stream from that legitimate sender that broke, stalled
        or was superseded stay in the run folder (``transfer.partial_path``, one per
        destination), and a later stream with ``header.offset`` carries on from them
        (``transfer_offset`` tells the sender where); a refused stream leaves nothing.

        Replays: a transfer is taken once per (run, transfer, SHA-256). The same transfer again
        (a retry by the legitimate sender, whose first receipt was lost) has no effect: nothing
        is read past the header, nothing is written, the run's state is unchanged, and the
        answer is the first receipt marked ``duplicate=True``, so the sender knows its model
        arrived. A different model for a transfer already taken is refused (ALREADY_EXISTS); the
        same bytes from anyone else are refused (PERMISSION_DENIED) before any check on the
        content.

        Once a payload is kept, the site attests it to the coordinator
        (``Coordinator.ReportReceipt``: sender, bytes, SHA-256, schema digest), in the background
        and again after a restart until the coordinator took it.

        Raises ``TransferError`` (with the status to answer).
        """
        holder: dict = {}
        mine = Stream()

        def check_header(h: common_pb2.TransferHeader) -> Path:
            try:
                run, t, dest = self.check_transfer(h, caller)
            except Duplicate as dup:
                holder["duplicate"] = dup.args
                raise
            self.streams.claim(dest, mine)
            holder.update(dest=dest, run=run, transfer=t)
            if h.purpose == common_pb2.CHAIN_HOP:
                # In memory only: a refused stream leaves nothing changed on disk. A sender
                # whose streams keep failing changes the state without a log line or report.
                holder["was"] = (run.state, run.detail)
                holder["quiet"] = not self.refused_streams.loud(run.run_id, h.sender)
                self.site.set_state(run, "receiving", f"hop {h.hop} from {h.sender}", persist=False,
                                quiet=holder["quiet"])
            return dest

        def check_payload(data: bytes) -> None:
            self.schemas.check_model_bytes(holder["run"].assignment, data, holder["transfer"].purpose)

        watched = self.streams.watched(chunks, mine.cancel)
        try:
            got = receive_model(watched, Path("/nonexistent"), check_header, check_payload, resumable=True)
        except Duplicate:
            run, dest, sha, hop = holder["duplicate"]
            return peer_pb2.HandoffReceipt(run_id=run.run_id, hop=hop, receiver=self.site.name,
                                           received_bytes=dest.stat().st_size, sha256=sha, duplicate=True)
        except BaseException:
            run = holder.get("run")
            if run is not None and run.state == "receiving" and "was" in holder:
                self.site.set_state(run, *holder["was"], persist=False, quiet=holder["quiet"])
            if run is not None and "was" in holder:
                self.refused_streams.failed(run.run_id, holder["transfer"].sender)
            if run is not None and run.ended.is_set() and "dest" in holder:
                remove_partials(holder["dest"].parent)  # the run is over: this transfer never completes
            raise
        finally:
            watched.close()
            self.streams.release(mine)
        run, t, h = holder["run"], holder["transfer"], got.header
        self.refused_streams.accepted(run.run_id, t.sender)
        self.kept(run, t, got.path, got.size, got.sha256)
        return peer_pb2.HandoffReceipt(run_id=run.run_id, hop=h.hop, receiver=self.site.name,
                                       received_bytes=got.size, sha256=got.sha256)

    def kept(self, run: Run, t: common_pb2.PlannedTransfer, path: Path, size: int, sha: str,
              route: str = "direct", relay_wire_bytes: int = 0) -> None:
        """A payload of the planned transfer ``t`` is kept at ``path`` (checked): record the
        receipt the ledger is owed, report it, and wake the run's worker."""
        if t.purpose == common_pb2.CHAIN_HOP:
            log.info("run %s: received hop %d (round %d) from %s (%d bytes, sha256 %s%s)", run.run_id, t.index,
                     t.round, t.sender, size, sha[:12], ", through the relay" if route == "relayed" else "")
        else:
            run.final_sha256 = sha
        key = sent_key(t)
        run.receipts[key] = {"reported": False, "report": {
            "run_id": run.run_id, "purpose": int(t.purpose), "hop": t.index, "sender": t.sender, "receiver": self.site.name,
            "payload_bytes": size, "sha256": sha, "schema_sha256": schema_digest(path),
            "received": time.time(), "route": route, "relay_wire_bytes": relay_wire_bytes}}
        run.save()
        self.site.metrics.kept(t.purpose, size)
        self.send_receipt(run, key)
        run.wake.set()

    def send_receipt(self, run: Run, key: str) -> None:
        def delivered() -> None:
            run.receipts[key]["reported"] = True
            run.save()

        self.site.reporter.receipt(cpb.ReceiptReport(**run.receipts[key]["report"]), delivered)

    def check_transfer(self, h: common_pb2.TransferHeader, caller: str | None, check_cap: bool = True):
        """The checks of a transfer's header against the run's plan (see ``handoff``; its fields
        were checked by ``transfer.check_header_fields``): returns (run, planned transfer,
        destination). ``check_cap``: also the declared size against the run's cap (which may ask
        a worker for the run's payload schemas: seconds the first time). Raises
        ``TransferError``, or ``Duplicate(run, dest, sha256, hop)`` when this exact payload was
        already accepted."""
        run = self.site.runs.get(h.run_id)
        if run is None:
            raise TransferError(grpc.StatusCode.FAILED_PRECONDITION, f"no assignment for run {h.run_id!r} (yet)")
        if run.ended.is_set():
            raise TransferError(grpc.StatusCode.FAILED_PRECONDITION, f"run {h.run_id} was ended by the coordinator")
        if h.purpose not in purposes.BY_WIRE:
            raise TransferError(grpc.StatusCode.INVALID_ARGUMENT, "unknown transfer purpose")
        if h.purpose == common_pb2.FINAL_MODEL and h.hop != 0:
            raise TransferError(grpc.StatusCode.INVALID_ARGUMENT, "a final-model copy has hop 0")
        t = run.planned_into(h.purpose, h.hop)
        if t is None:
            if h.purpose == common_pb2.CHAIN_HOP:
                raise TransferError(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"hop {h.hop} does not end at this site in run {h.run_id}'s plan")
            if h.purpose == common_pb2.UPLOAD:
                raise TransferError(grpc.StatusCode.PERMISSION_DENIED,
                                    f"upload {h.hop} from {h.sender!r} is not planned to this site in run {h.run_id}")
            raise TransferError(grpc.StatusCode.PERMISSION_DENIED,
                                f"{h.sender!r} is not the last site of run {h.run_id} (no final copy is planned here)")
        what = {common_pb2.CHAIN_HOP: "predecessor", common_pb2.UPLOAD: "uploading site"}.get(h.purpose, "last site")
        if caller is not None and caller != t.sender:
            raise TransferError(grpc.StatusCode.PERMISSION_DENIED,
                                f"certificate identity {caller!r} is not this site's {what} in run {h.run_id} "
                                f"(the plan names {t.sender!r})")
        if caller is not None and h.sender != caller:
            raise TransferError(grpc.StatusCode.PERMISSION_DENIED,
                                f"header.sender {h.sender!r} is not the certificate identity {caller!r}")
        if h.sender != t.sender:
            raise TransferError(grpc.StatusCode.PERMISSION_DENIED,
                                f"{h.sender!r} is not this site's {what} in run {h.run_id} (the plan names {t.sender!r})")
        if check_cap:
            self.check_cap(run, h.total_bytes)
        dest = run.destination(t)
        if dest.exists():
            have = sha256_file(dest)
            if have == h.sha256:
                raise Duplicate(run, dest, have, h.hop)
            raise TransferError(grpc.StatusCode.ALREADY_EXISTS,
                                f"a different model was already accepted for this transfer (sha256 {have})")
        return run, t, dest

    def check_cap(self, run: Run, size: int) -> None:
        """Raises ``TransferError`` (RESOURCE_EXHAUSTED) when ``size`` bytes exceed the run's cap."""
        cap = self.schemas.payload_cap(run.assignment)
        if size > cap:
            raise TransferError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"declared size {size} bytes exceeds this run's cap of {cap} bytes")

    def transfer_offset(self, h: common_pb2.TransferHeader, caller: str | None = None) -> peer_pb2.TransferOffsetReply:
        """How many bytes of the payload ``h`` describes this site holds from a broken stream.

        The same checks as ``handoff`` (only the legitimate sender gets an answer). Asking ends
        an older stream of the same transfer still open here (its sender has given up on it),
        so that the answer is final. Raises ``TransferError``.
        """
        check_header_fields(h)  # what receive_model checks first on a Handoff
        try:
            _, _, dest = self.check_transfer(h, caller)
        except Duplicate:
            return peer_pb2.TransferOffsetReply(offset=h.total_bytes, complete=True)
        self.streams.end(dest)
        return peer_pb2.TransferOffsetReply(offset=min(held_bytes(dest, h.sha256), h.total_bytes))

    def prepare(self, run_id: str, sender: str, caller: str | None = None) -> bool:
        """``Peer.Prepare``: the planned sender ``sender`` of a transfer into this site started
        training; start a worker ahead for the run (and ask it the run's payload schemas) if a
        host slot is free. The caller is the sender, or the coordinator on its behalf when this
        site connects out only. True when one was started. Raises ``LookupError`` (unknown run)
        or ``PermissionError`` (``sender``, or the caller's certificate name, is not a planned
        sender into this site)."""
        run = self.site.runs.get(run_id)
        if run is None:
            raise LookupError(f"unknown run {run_id!r}")
        if caller is not None and caller not in (sender, COORDINATOR_IDENTITY):
            raise PermissionError(f"certificate identity {caller!r} is not {sender!r}")
        planned = [t for t in run.assignment.transfers if t.receiver == self.site.name and t.sender == sender]
        if not planned:
            raise PermissionError(f"{sender!r} sends nothing to this site in run {run_id}")
        if run.ended.is_set() or not self.site.start_workers or all(run.destination(t).exists() for t in planned):
            return False  # nothing more to receive from that sender: no worker is held for it
        prefetch, not_started = self.schemas.ask_ahead(run.assignment)
        started = self.site.jobs.warm(run_id, prefetch, spec=job_spec(run.assignment), sender=sender)
        if not started:
            not_started()
        return started

    def relay_quota(self, run_id: str) -> int:
        """``Peer.RelayQuota``: the largest payload (bytes) this site accepts in run ``run_id``
        (the relay stores no larger envelope for it). Raises ``LookupError`` (unknown run) or
        ``ValueError`` (no worker can tell the run's payload schemas)."""
        run = self.site.runs.get(run_id)
        if run is None:
            raise LookupError(f"unknown run {run_id!r}")
        return self.schemas.payload_cap(run.assignment)
