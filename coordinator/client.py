"""The operator's side of the Coordinator service: what ``coordinator start-chain``, ``watch``,
``show``, ``metrics``, ``runs``, ``peers``, ``fetch-model``, ``stop`` and ``forget-peer`` call, and the
run summary, a peer's record and a metrics row as plain dicts (the ``--json`` shapes)."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Callable, Iterator

import grpc

from fedrelay import purpose as purposes
from fedrelay import params as run_params, privacy
from fedrelay.callers import COORDINATOR_IDENTITY
from fedrelay.calls import CONTROL_TIMEOUT
from fedrelay.files import atomic_write
from fedrelay.transport import INSECURE, Transport
from fedrelay.coordinator.live import BUSY
from fedrelay.v1 import common_pb2, coordinator_pb2 as cpb, coordinator_pb2_grpc, peer_pb2


def summary_dict(s: cpb.RunSummary) -> dict:
    """A run summary as the JSON object of ``show --json`` / ``start-chain --wait --json``.

    Keys: run_id, strategy, status (running|finished|failed|cancelled), order (site names), rounds (T),
    model_bytes (M, bytes; null before the first transfer both ends agree on), hops (chain
    transfers: hop, round, sender, receiver, payload_bytes, wire_bytes (every attempt's), sha256,
    seconds, attempts, resumed_from (bytes the receiver already held when the last attempt
    began), status (done: sender and receiver agree; sent / received: one end has reported so
    far; disputed: they disagree), receiver_sha256 and receiver_bytes (what the receiver
    attests it kept), route ("direct", or "relayed": sealed and left at the relay, then
    wire_bytes are the sender -> relay leg's), relay (its address; "" = the coordinator's own),
    sealed_bytes (the envelope's size) and relay_wire_bytes (the relay -> receiver leg, as the
    receiver counted it); null where they do not apply), total_bytes (sum of the hops' payload bytes as their senders reported),
    planned_hops (hops of the run's plan, with hops made before a reroute dropped them),
    expected_total_bytes (planned_hops * M), plan (the current plan: purpose, index, round,
    sender, receiver), final_site, final (null until the run has finished: sha256, accuracy,
    metrics (the global metrics from the sites' pooled statistics: accuracy, balanced_accuracy,
    macro_f1, auroc, for two classes sensitivity and specificity, and the task's own),
    per_site: site -> {accuracy, test_samples, metrics (the site's exact metrics), privacy (a run
    with differential privacy: the site's spent epsilon, delta, noise_multiplier, max_grad_norm,
    steps, sample_rate, accountant, as it signed them; ``fedrelay.privacy``; null otherwise)}),
    final_transfers, params, seed, arch (the task's model), task, task_version, task_sha256
    (the digest of the task's code every site ran), model_spec (fedrelay.ModelSpec.to_dict()),
    class_index, warnings, error, insecure, created, ended (unix seconds), skipped (sites routed
    around because they stayed down) and contributors (the sites whose training is in the final
    model, in chain order), live (while the run is running, each site that has reported, in
    the run's order: site, state (its run state: assigned, receiving, training, sending,
    distributing, done, ...), detail, activity (in words: waiting, receiving, training,
    aggregating, waiting for uploads, sending, ...), stage (warmup|pool|fedseq|aggregate while
    training), model and models (pool model j of S; 0 outside the pool), epoch and epochs (the
    latest finished epoch, 1-based, of how many), updated (unix seconds of its latest report),
    age_seconds (since then, by the coordinator's clock), line (e.g. "site-03 training, model 2/5, epoch 3/10"), busy (receiving, training or
    sending); ``[]`` once the run has ended), cancelled_by and cancel_reason (status cancelled: who stopped the run
    — the operator's certificate name, or "insecure operator" — and the reason given; null
    otherwise; ``ended`` is when), started_by (the operator who started the run: its
    certificate name, or "insecure operator"; null in older ledgers), refused_by, refusal and
    refused_by_policy (a site refused its assignment, so the run failed before any model moved:
    which site, its reason, and whether its own site policy refused it; docs/site-policy.md).

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
                "receiver_sha256": h.receiver_sha256, "receiver_bytes": h.receiver_bytes,
                "route": h.route or None, "relay": h.relay or None, "sealed_bytes": h.sealed_bytes or None,
                "relay_wire_bytes": h.relay_wire_bytes or None}

    finals = sum(1 for t in s.plan if t.purpose == common_pb2.FINAL_MODEL)
    out = {
        "run_id": s.run_id, "strategy": s.strategy, "status": s.status, "order": list(s.order),
        "rounds": s.rounds or 1,
        "model_bytes": s.model_bytes or None,
        "hops": [hop(h) for h in s.hops],
        "total_bytes": sum(h.payload_bytes for h in s.hops),
        "planned_hops": s.planned_hops,
        "expected_total_bytes": s.planned_hops * s.model_bytes if s.model_bytes else None,
        "plan": [{"purpose": purposes.BY_WIRE.get(t.purpose, "?"), "index": t.index, "round": t.round,
                  "sender": t.sender, "receiver": t.receiver} for t in s.plan],
        "final_site": s.final_site or None,
        "final": None,
        "final_transfers": [hop(h) for h in s.final_transfers],
        "params": run_params.to_dict(s.params),
        "seed": s.seed, "arch": s.arch, "task": s.task or None, "task_version": s.task_version or None,
        "task_sha256": s.task_sha256 or None,
        "model_spec": json.loads(s.model_spec_json) if s.model_spec_json else None,
        "class_index": list(s.class_index), "warnings": list(s.warnings),
        "error": s.error or None, "insecure": s.insecure, "created": s.created, "ended": s.ended or None,
        "skipped": list(s.skipped), "contributors": list(s.contributors),
        "live": [{"site": v.site, "state": v.state, "detail": v.detail, "activity": v.activity, "stage": v.stage,
                  "model": v.model, "models": v.models, "epoch": v.epoch, "epochs": v.epochs,
                  "updated": v.updated, "age_seconds": round(v.age_seconds, 3), "line": v.line,
                  "busy": v.state in BUSY} for v in s.live],
        "cancelled_by": s.cancelled_by or None, "cancel_reason": s.cancel_reason or None,
        "revoked": [revocation_dict(e) for e in s.revoked],
        "started_by": s.started_by or None,
        "refused_by": s.refused_by or None, "refusal": s.refusal or None,
        "refused_by_policy": s.refused_by_policy,
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
            "metrics": dict(sorted(s.final.metrics.items())),
            "per_site": {k: {"accuracy": v.accuracy, "test_samples": v.test_samples,
                             "metrics": dict(sorted(v.metrics.items())), "privacy": privacy.from_pb(v.privacy)}
                         for k, v in sorted(s.final.per_site.items())},
        }
    return out


def planned_epochs(summary: dict) -> int:
    """The epochs a run trains in all, from its summary (``summary_dict``: strategy, params,
    order, rounds), for a progress bar: a chain warms up once (Ew) and trains S*E epochs per
    visit, T*N visits; a star plan's every site warms up and trains S*E epochs, and OFASD's
    aggregator may train for more epochs (its registry entry's ``epochs_option``: OFASD's
    ``ofasd_epochs``)."""
    from fedrelay import registry

    p, n, rounds = summary["params"], len(summary["order"]), summary.get("rounds") or 1
    per_site = (p.get("models_per_site") or 0) * (p.get("local_epochs") or 0)
    warmup = p.get("warmup_epochs") or 0
    strategy = registry.strategy(summary["strategy"])
    if strategy.plan == registry.STAR:
        more = registry.aggregator(strategy.aggregator).epochs_option
        return (warmup + per_site) * n + ((p.get(more) or 0) if more else 0)
    return warmup + per_site * n * rounds


def revocation_dict(e: cpb.CrlEntry) -> dict:
    """A revoked site certificate: name, serial (hex), revoked_at (unix seconds), revoked_by
    (the operator's certificate name), reason."""
    return {"name": e.name, "serial": e.serial, "revoked_at": e.revoked_at, "revoked_by": e.revoked_by,
            "reason": e.reason}


def peer_dict(p: cpb.PeerRecord) -> dict:
    """A registered peer as the JSON object of ``peers --json``: name, address, device, tasks
    [{name, version, sha256, models, classes [{name, train, test}], train_samples, test_samples,
    input (the task's input description), error}], last_seen (unix seconds of its latest
    registration or heartbeat),
    age_seconds (since then, by the coordinator's clock), live (heard from within the
    coordinator's --peer-timeout), peer_timeout (that timeout, seconds), outbound_only (it
    registered no address: it connects out only), connected (its control stream is open) and
    classes_omitted (classes the coordinator left out of the tasks' ``classes`` to keep its reply
    under the message cap; 0 normally) and revoked (:func:`revocation_dict` when the site's
    certificate was revoked, else null)."""
    return {"name": p.name, "address": p.address, "device": p.device, "tasks": [_offer_dict(t) for t in p.tasks],
            "last_seen": p.last_seen, "age_seconds": round(p.age_seconds, 3), "live": p.live,
            "peer_timeout": p.peer_timeout, "outbound_only": p.outbound_only, "connected": p.connected,
            "classes_omitted": p.classes_omitted,
            "revoked": revocation_dict(p.revocation) if p.HasField("revocation") else None}


def _offer_dict(t: cpb.TaskOffer) -> dict:
    return {"name": t.name, "version": t.version, "sha256": t.sha256, "models": list(t.models),
            "classes": [{"name": c.name, "train": c.train, "test": c.test} for c in t.classes],
            "train_samples": sum(c.train for c in t.classes), "test_samples": sum(c.test for c in t.classes),
            "input": json.loads(t.input_json) if t.input_json else {}, "error": t.error}


METRIC_FIELDS = ("site", "stage", "model", "epoch", "epochs", "train_loss", "val_accuracy", "seconds", "time")


def metric_dict(m: cpb.MetricRow) -> dict:
    """One epoch of training as a row of ``metrics --json`` / ``--csv`` (keys ``METRIC_FIELDS``):
    site, stage (warmup|pool|fedseq|aggregate), model (pool model, 1-based; 0 outside the pool),
    epoch (1-based) of epochs, train_loss (the epoch's mean), val_accuracy (null without a
    validation split), seconds (the epoch's wall time at the site), time (unix seconds the
    coordinator recorded it)."""
    return {"site": m.site, "stage": m.stage, "model": m.model, "epoch": m.epoch, "epochs": m.epochs,
            "train_loss": m.train_loss, "val_accuracy": m.val_accuracy if m.HasField("val_accuracy") else None,
            "seconds": m.seconds, "time": m.time}


class OperatorClient:
    """The operator's Python API: what the ``coordinator`` commands call (start-chain, show,
    runs, peers, fetch-model, the live view of ``--wait``).

    ``address``: the coordinator's ``HOST:PORT``. ``transport``: mutual TLS with the operator's
    identity (``transport.Transport.from_dir("pki/operator")``; the coordinator answers only the
    ``operator`` and ``coordinator`` identities), or ``transport.Transport.insecure()`` for a
    coordinator started with ``--insecure``. A context manager: ``with OperatorClient(...) as
    client:`` closes its channel at the end.

    Every method raises ``grpc.RpcError`` when the coordinator refuses or cannot be reached:
    ``exc.code()`` is e.g. ``INVALID_ARGUMENT`` (a bad parameter; ``exc.details()`` names it),
    ``NOT_FOUND`` (an unknown run), ``FAILED_PRECONDITION``, ``PERMISSION_DENIED`` (a wrong
    identity) or ``UNAVAILABLE`` (not reachable; ``fedrelay.transport.transport_mismatch`` tells a
    TLS/plaintext mismatch).

    Example::

        from fedrelay import params
        from fedrelay.transport import Transport
        from fedrelay.coordinator.client import OperatorClient

        with OperatorClient("127.0.0.1:50070", Transport.from_dir("pki/operator")) as client:
            chosen = dict(strategy="fedelmy", models_per_site=5, local_epochs=2, warmup_epochs=2, alpha=1.0,
                          beta=1.0, lr=1e-3, batch_size=128, weight_decay=1e-4, selection="best-val")
            params.check(chosen)
            reply = client.start_chain(peers=[], order="random", seed=0, params=params.to_pb(chosen))
            for event in client.watch(reply.run_id):
                print(event.kind, event.message)
            summary = client.run(reply.run_id)      # the dict of `coordinator show --json`
            client.fetch_model(reply.run_id, "final.safetensors")
    """

    def __init__(self, address: str, transport: Transport = INSECURE):
        self.address = address
        self._channel = transport.channel(address, expect=COORDINATOR_IDENTITY)
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)

    def close(self) -> None:
        """Close the channel to the coordinator (the client is unusable afterwards)."""
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def start_chain(self, *, peers: list[str], order: str, seed: int, model: str = "",
                    params: common_pb2.TrainingParams, rounds: int = 1, aggregator: str = "", task: str = "",
                    task_sha256: str = "") -> cpb.StartChainReply:
        """Start a run; returns at once (``reply.run_id``, ``reply.order``: the site names in chain
        order, or the star's sites; ``reply.warnings``).

        ``peers``: site names (empty: every registered peer). ``order``: ``"random"`` (shuffled by
        ``seed``) or ``"given"`` (as ``peers`` lists them). ``seed``: 0 .. 2**64 - 1. ``task``: the
        task ("" = ``image-folder``), pinned to ``task_sha256`` when given (else the digest every
        site reports). ``model``: one of the task's models ("" = its first).
        ``params``: ``fedrelay.params.to_pb(d)`` of a dict
        checked with ``fedrelay.params.check(d)`` (the coordinator checks it again). ``rounds``:
        T, 1 .. 100. ``aggregator``: the star plans' aggregating site ("" = chosen by the seed).
        Waits up to 120 s (the coordinator asks every chosen peer first)."""
        return self.stub.StartChain(cpb.StartChainRequest(peers=peers, order=order, seed=seed, model=model,
                                                          params=params, rounds=rounds, aggregator=aggregator,
                                                          task=task, task_sha256=task_sha256),
                                    timeout=120.0)

    def watch(self, run_id: str, after_seq: int = 0) -> Iterator[cpb.RunEvent]:
        """The run's events, from the first one after ``after_seq`` on, as they happen; the
        iterator ends when the run has ended (after its ``finished`` or ``failed`` event).

        Each ``RunEvent`` has ``seq`` (pass the last one seen as ``after_seq`` to resume after a
        broken stream), ``kind`` (``started``, ``state``, ``epoch``, ``hop``, ``upload``, ``final_copy``,
        ``final``, ``evaluated``, ``warning``, ``skip``, ``finished``, ``failed``), ``site`` and a readable
        ``message``. No timeout: break out of the loop to stop watching (the run goes on)."""
        return self.stub.WatchRun(cpb.WatchRunRequest(run_id=run_id, after_seq=after_seq))

    def follow(self, run_id: str, after_seq: int = 0, *, reconnect_for: float = 600.0, retry_every: float = 2.0,
               on_reconnect: Callable[[grpc.RpcError], None] | None = None) -> Iterator[cpb.RunEvent]:
        """The run's events like ``watch``, until the run has ended (its ``finished`` or
        ``failed`` event is the last one yielded), across coordinator restarts and dropped
        links: while the coordinator is unreachable (UNAVAILABLE, CANCELLED) it tries again
        every ``retry_every`` seconds from the last event seen, calling ``on_reconnect(error)``
        before each try, for up to ``reconnect_for`` seconds, then raises that
        ``grpc.RpcError`` (as it does any other error at once). This is what ``coordinator
        watch`` and ``start-chain --wait`` show."""
        seq, lost_since = after_seq, None
        while True:
            try:
                for ev in self.watch(run_id, after_seq=seq):
                    seq, lost_since = ev.seq, None
                    yield ev
                    if ev.kind in ("finished", "failed", "cancelled"):
                        return
                return  # the stream ended: the run is over
            except grpc.RpcError as exc:
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    raise
                lost_since = lost_since or time.monotonic()
                if time.monotonic() - lost_since > reconnect_for:
                    raise
                if on_reconnect is not None:
                    on_reconnect(exc)
                time.sleep(retry_every)

    def run(self, run_id: str) -> dict:
        """One run's summary as a dict (:func:`summary_dict`: the JSON of ``coordinator show
        --json``); works while the run is in progress. ``NOT_FOUND`` for an unknown run."""
        return summary_dict(self.stub.GetRun(cpb.GetRunRequest(run_id=run_id), timeout=CONTROL_TIMEOUT))

    def runs(self) -> list[dict]:
        """Every run in the ledger, as :func:`summary_dict` dicts, in the order they were
        created (asked for page by page: ``ListRunsReply.next_after``)."""
        out, after = [], ""
        while True:
            reply = self.stub.ListRuns(cpb.ListRunsRequest(after=after), timeout=CONTROL_TIMEOUT)
            out.extend(summary_dict(s) for s in reply.runs)
            if not reply.next_after or reply.next_after == after:
                return out
            after = reply.next_after

    def peers(self) -> list[cpb.PeerRecord]:
        """The registered peers (``PeerRecord``; ``peer_dict`` for a plain dict), by name, each
        with ``live`` and ``age_seconds`` as the coordinator judges them (its --peer-timeout);
        asked for page by page (``ListPeersReply.next_after``)."""
        out, after = [], ""
        while True:
            reply = self.stub.ListPeers(cpb.ListPeersRequest(after=after), timeout=CONTROL_TIMEOUT)
            out.extend(reply.peers)
            if not reply.next_after or reply.next_after == after:
                return out
            after = reply.next_after

    def metrics(self, run_id: str) -> list[dict]:
        """The run's per-epoch training metrics (``metric_dict`` rows: site, stage, model, epoch,
        epochs, train_loss, val_accuracy, seconds, time), in the order they were recorded
        (asked for page by page: ``MetricsReply.next_offset``). Raises ``grpc.RpcError``
        (NOT_FOUND: unknown run)."""
        out, offset = [], 0
        while True:
            reply = self.stub.GetMetrics(cpb.GetRunRequest(run_id=run_id, offset=offset), timeout=CONTROL_TIMEOUT)
            out.extend(metric_dict(m) for m in reply.rows)
            if reply.next_offset <= offset:
                return out
            offset = reply.next_offset

    def stop(self, run_id: str, reason: str = "") -> dict:
        """Cancel the running run ``run_id``: it ends with status ``cancelled``, recording who
        (this client's certificate name, or "insecure operator") and when; every site stops at its
        next epoch or transfer boundary and removes its partial files (within seconds: the
        coordinator delivers the end notices). ``reason``: free text (at most 1,000 characters)
        recorded with it. Returns the run summary (:func:`summary_dict`). Raises
        ``grpc.RpcError``: NOT_FOUND (unknown run), FAILED_PRECONDITION (the run already ended)."""
        return summary_dict(self.stub.StopRun(cpb.StopRunRequest(run_id=run_id, reason=reason),
                                              timeout=CONTROL_TIMEOUT))

    def forget_peer(self, name: str) -> cpb.ForgetPeerReply:
        """Remove the registered peer ``name`` from the ledger; the reply holds its name and the
        address it was registered with. The daemon registered under that name is refused from
        then on; a daemon started there afterwards registers anew. Raises ``grpc.RpcError``: NOT_FOUND (no such peer),
        FAILED_PRECONDITION (it is a site of a running run)."""
        return self.stub.ForgetPeer(cpb.ForgetPeerRequest(name=name), timeout=CONTROL_TIMEOUT)

    def revoke(self, name: str, serials: list[int], crl_der: bytes, reason: str = "") -> cpb.RevocationReply:
        """Publish the CA-signed revocation list ``crl_der`` that revokes site ``name``'s
        certificates ``serials`` (``fedrelay.coordinator.pki.revoke`` makes it); the coordinator
        records who (this client's certificate name), when and ``reason``. Raises
        ``grpc.RpcError``: INVALID_ARGUMENT (a list that is not the CA's, older than the one
        published, or without the serials), PERMISSION_DENIED (not the operator)."""
        return self.stub.Revoke(cpb.RevocationRequest(name=name, reason=reason, crl=crl_der,
                                                      serials=[f"{s:x}" for s in serials]),
                                timeout=CONTROL_TIMEOUT)

    def fetch_model(self, run_id: str, out: Path) -> tuple[str, int]:
        """Download the run's final model to ``out`` (a file path; written atomically, mode
        0644), verifying its size and SHA-256 against the ledger's digest, and add fedrelay's
        metadata to the file's header (architecture, input shape, class names, run id, strategy,
        the ledger's digest: ``fedrelay/final_model.py``); the tensors are written unchanged.

        Returns ``(sha256, bytes)`` of the model as the ledger records it (the written file is
        a few hundred bytes larger, and its own SHA-256 differs, because of the metadata).
        Raises ``grpc.RpcError`` (unknown run, no final model yet, no site holds it),
        ``ValueError`` when the stream does not match its header, ``OSError`` when ``out``
        cannot be written. Load the file with ``fedrelay.load_model(out)``.
        """
        import json

        from fedrelay import final_model

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
        spec_json = dict(stream.initial_metadata() or ()).get(final_model.MODEL_SPEC_METADATA)
        if spec_json is None:
            raise ValueError("the coordinator did not say the model's architecture and input shape "
                             "(a coordinator older than this client?)")
        spec, run = json.loads(spec_json), self.run(run_id)
        data = final_model.with_metadata(data, final_model.describe(
            spec=spec, class_names=run["class_index"], run_id=run_id, strategy=run["strategy"], final_sha256=h.sha256))
        atomic_write(out, data)
        os.chmod(out, 0o644)
        return h.sha256, h.total_bytes
