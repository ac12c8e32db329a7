"""The operator's side of the Coordinator service: what ``coordinator start-chain``, ``show``,
``runs``, ``peers``, ``fetch-model``, ``stop`` and ``forget-peer`` call, and the run summary as a plain dict (the
``--json`` shape)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Iterator

from fedrelay import params as run_params, wire
from fedrelay.v1 import common_pb2, coordinator_pb2 as cpb, coordinator_pb2_grpc, peer_pb2

PURPOSE_NAMES = {common_pb2.CHAIN_HOP: "hop", common_pb2.FINAL_MODEL: "final", common_pb2.UPLOAD: "upload"}


def summary_dict(s: cpb.RunSummary) -> dict:
    """A run summary as the JSON object of ``show --json`` / ``start-chain --wait --json``.

    Keys: run_id, strategy, status (running|finished|failed|cancelled), order (site names), rounds (T),
    model_bytes (M, bytes; null before the first transfer both ends agree on), hops (chain
    transfers: hop, round, sender, receiver, payload_bytes, wire_bytes (every attempt's), sha256,
    seconds, attempts, resumed_from (bytes the receiver already held when the last attempt
    began), status (done: sender and receiver agree; sent / received: one end has reported so
    far; disputed: they disagree), receiver_sha256 and receiver_bytes (what the receiver
    attests it kept)), total_bytes (sum of the hops' payload bytes as their senders reported),
    planned_hops (hops of the run's plan, with hops made before a reroute dropped them),
    expected_total_bytes (planned_hops * M), plan (the current plan: purpose, index, round,
    sender, receiver), final_site, final (null until the run has finished: sha256, accuracy,
    per_site: site -> {accuracy, test_samples}), final_transfers, params, seed, arch,
    class_index, warnings, error, insecure, created, ended (unix seconds), skipped (sites routed
    around because they stayed down) and contributors (the sites whose training is in the final
    model, in chain order), cancelled_by and cancel_reason (status cancelled: who stopped the run
    — the operator's certificate name, or "insecure operator" — and the reason given; null
    otherwise; ``ended`` is when).

    Star plans (the parallel one-shot methods) add: aggregator (the aggregating site), uploads
    (the sites' payloads to it, records like ``hops``, ``hop`` = the upload's index),
    upload_bytes (one upload: M + the aggregator's extra tensors), planned_uploads,
    upload_total_bytes, final_total_bytes, planned_final_copies (of the current plan) and
    expected_total_bytes = planned_uploads × upload_bytes + planned_final_copies × M (a chain:
    planned_hops × M, its final copies not counted, as before).
    """
    def hop(h):
        return {"hop": h.hop, "round": h.round, "sender": h.sender, "receiver": h.receiver,
                "payload_bytes": h.payload_bytes, "wire_bytes": h.wire_bytes, "sha256": h.sha256,
                "seconds": round(h.ended - h.started, 6), "started": h.started, "ended": h.ended,
                "attempts": h.attempts, "resumed_from": h.resumed_from, "status": h.status,
                "receiver_sha256": h.receiver_sha256, "receiver_bytes": h.receiver_bytes}

    finals = sum(1 for t in s.plan if t.purpose == common_pb2.FINAL_MODEL)
    out = {
        "run_id": s.run_id, "strategy": s.strategy, "status": s.status, "order": list(s.order),
        "rounds": s.rounds or 1,
        "model_bytes": s.model_bytes or None,
        "hops": [hop(h) for h in s.hops],
        "total_bytes": sum(h.payload_bytes for h in s.hops),
        "planned_hops": s.planned_hops,
        "expected_total_bytes": s.planned_hops * s.model_bytes if s.model_bytes else None,
        "plan": [{"purpose": PURPOSE_NAMES.get(t.purpose, "?"), "index": t.index, "round": t.round,
                  "sender": t.sender, "receiver": t.receiver} for t in s.plan],
        "final_site": s.final_site or None,
        "final": None,
        "final_transfers": [hop(h) for h in s.final_transfers],
        "params": run_params.to_dict(s.params),
        "seed": s.seed, "arch": s.arch, "class_index": list(s.class_index), "warnings": list(s.warnings),
        "error": s.error or None, "insecure": s.insecure, "created": s.created, "ended": s.ended or None,
        "skipped": list(s.skipped), "contributors": list(s.contributors),
        "cancelled_by": s.cancelled_by or None, "cancel_reason": s.cancel_reason or None,
    }
    if s.aggregator:
        out.update({
            "aggregator": s.aggregator, "uploads": [hop(h) for h in s.uploads], "upload_bytes": s.upload_bytes or None,
            "planned_uploads": s.planned_uploads, "upload_total_bytes": sum(h.payload_bytes for h in s.uploads),
            "final_total_bytes": sum(h.payload_bytes for h in s.final_transfers), "planned_final_copies": finals,
            "expected_total_bytes": (s.planned_uploads * s.upload_bytes + finals * s.model_bytes
                                     if s.upload_bytes and s.model_bytes else None),
        })
    if s.HasField("final"):
        out["final"] = {
            "sha256": s.final.sha256, "accuracy": s.final.accuracy,
            "per_site": {k: {"accuracy": v.accuracy, "test_samples": v.test_samples}
                         for k, v in sorted(s.final.per_site.items())},
        }
    return out


class OperatorClient:
    """Calls to a coordinator at ``address`` over ``transport`` (mutual TLS with the operator's
    identity, or insecure). Methods raise ``grpc.RpcError`` on refusal."""

    def __init__(self, address: str, transport: wire.Transport = wire.INSECURE):
        self.address = address
        self._channel = transport.channel(address, expect=wire.COORDINATOR_IDENTITY)
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def start_chain(self, *, peers: list[str], order: str, seed: int, arch: str,
                    params: common_pb2.TrainingParams, rounds: int = 1, aggregator: str = "") -> cpb.StartChainReply:
        return self.stub.StartChain(cpb.StartChainRequest(peers=peers, order=order, seed=seed, arch=arch,
                                                          params=params, rounds=rounds, aggregator=aggregator),
                                    timeout=120.0)

    def watch(self, run_id: str, after_seq: int = 0) -> Iterator[cpb.RunEvent]:
        return self.stub.WatchRun(cpb.WatchRunRequest(run_id=run_id, after_seq=after_seq))

    def run(self, run_id: str) -> dict:
        return summary_dict(self.stub.GetRun(cpb.GetRunRequest(run_id=run_id), timeout=wire.CONTROL_TIMEOUT))

    def runs(self) -> list[dict]:
        return [summary_dict(s) for s in self.stub.ListRuns(cpb.ListRunsRequest(), timeout=wire.CONTROL_TIMEOUT).runs]

    def peers(self) -> list[cpb.PeerRecord]:
        return list(self.stub.ListPeers(cpb.ListPeersRequest(), timeout=wire.CONTROL_TIMEOUT).peers)

    def stop(self, run_id: str, reason: str = "") -> dict:
        """Cancel the running run ``run_id``: it ends with status ``cancelled``, recording who
        (this client's certificate name, or "insecure operator") and when; every site stops at its
        next epoch or transfer boundary and removes its partial files (within seconds: the
        coordinator delivers the end notices). ``reason``: free text (at most 1,000 characters)
        recorded with it. Returns the run summary (:func:`summary_dict`). Raises
        ``grpc.RpcError``: NOT_FOUND (unknown run), FAILED_PRECONDITION (the run already ended)."""
        return summary_dict(self.stub.StopRun(cpb.StopRunRequest(run_id=run_id, reason=reason),
                                              timeout=wire.CONTROL_TIMEOUT))

    def forget_peer(self, name: str) -> cpb.ForgetPeerReply:
        """Remove the registered peer ``name`` from the ledger; the reply holds its name and the
        address it was registered with. A daemon still running under that name registers again
        at its next heartbeat. Raises ``grpc.RpcError``: NOT_FOUND (no such peer),
        FAILED_PRECONDITION (it is a site of a running run)."""
        return self.stub.ForgetPeer(cpb.ForgetPeerRequest(name=name), timeout=wire.CONTROL_TIMEOUT)

    def fetch_model(self, run_id: str, out: Path) -> tuple[str, int]:
        """Download the run's final model to ``out`` (atomically), verifying size and SHA-256.

        Returns (sha256, bytes). Raises ``ValueError`` when the stream does not match its header.
        """
        out = Path(out)
        stream = self.stub.FetchModel(peer_pb2.FetchModelRequest(run_id=run_id), timeout=3600)
        first = next(stream)
        if first.WhichOneof("kind") != "header":
            raise ValueError("the coordinator's stream did not start with a header")
        h = first.header
        digest, parts = hashlib.sha256(), []
        for msg in stream:
            digest.update(msg.data)
            parts.append(msg.data)
        data = b"".join(parts)
        if len(data) != h.total_bytes or digest.hexdigest() != h.sha256:
            raise ValueError(f"model stream damaged: {len(data)} of {h.total_bytes} bytes, "
                             f"sha256 {digest.hexdigest()} instead of {h.sha256}")
        wire.atomic_write(out, data)
        os.chmod(out, 0o644)
        return h.sha256, len(data)
