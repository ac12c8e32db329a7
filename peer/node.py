"""The peer's run state machine: assigned (waiting) -> receiving -> training -> sending
(-> distributing at the final site) -> done (a star plan: training -> sending the upload -> done;
the aggregator: training -> receiving the uploads -> training (aggregating) -> distributing); "failed" when this site's work failed, "ended"
when the coordinator ended the run while this site was still working on it (``end_run``).
A run of T rounds goes through receiving -> training -> sending once per visit (round).

One ``PeerNode`` per daemon holds the site's data (decoded once) and its runs
(``fedrelay.peer.runs``: files, the site's part of the plan). Every file is written atomically,
and the worker skips the steps whose results are on disk, so a restarted daemon carries on with
the same command (received models are not asked for again, finished pool models are not
trained again, an unsent model is sent, an unreported receipt is reported).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import grpc

from fedrelay import purpose as purposes
from fedrelay import (__version__, params as run_params, payload, privacy, registry, signing, tasks as task_registry,
                      transfer_bounds)
from fedrelay.callers import COORDINATOR_IDENTITY
from fedrelay.calls import CONTROL_TIMEOUT, backoff_delays, status_message
from fedrelay.files import atomic_write, sha256_file
from fedrelay.tensors import schema_digest
from fedrelay.transport import INSECURE, Transport
from fedrelay.task import ModelSpec, SiteData, canonical_json
from fedrelay.tasks.offers import Offer
from fedrelay.inbound import InboundStreams, Stream
from fedrelay.peer.refusals import RefusedStreams
from fedrelay.peer.policy import POLICY_FILE, SitePolicy
from fedrelay.peer.monitoring import PeerMetrics
from fedrelay.peer.reporting import RETRYABLE, CoordinatorLink, Reporter
from fedrelay.peer.runs import ACTIVE, Run, sent_key
from fedrelay.peer import relaying
from fedrelay.peer.relaying import RelayUnavailable
from fedrelay.peer.transfer import SendCancelled, Sent, send_model
from fedrelay.receiving import TransferError, check_header_fields, held_bytes, receive_model, remove_partials
from fedrelay.sealing import SealError
from fedrelay.peer.workers import InlineRunner, JobCancelled
from fedrelay.peer.worker_protocol import AggregateJob, EvaluateJob, SchemaJob, TrainJob
from fedrelay.v1 import common_pb2, coordinator_pb2 as cpb, peer_pb2, relay_pb2

log = logging.getLogger("fedrelay.peer")

DEFAULT_STALL_TIMEOUT = transfer_bounds.STALL_TIMEOUT  # seconds
SEAL_OVERHEAD = transfer_bounds.SEAL_OVERHEAD  # bytes a sealed envelope may add to its payload (header, certificate, GCM tags)
DEFAULT_RELAY_AFTER = 60.0  # seconds a receiver with an address may stay unreachable before the relay is used
REROUTE_GRACE = 120.0  # seconds a final-model copy retries a refusal after a reroute (see _deliver)


class PeerNode:
    """A site's daemon logic, independent of gRPC plumbing (the servicer is a thin shell).

    The node never imports torch nor task code: its training, aggregation, evaluation and
    payload schemas are jobs (``peer/jobs.py``) run by ``jobs``, a ``peer.workers.WorkerPool`` in
    the daemon (worker processes) or, by default, an ``InlineRunner`` on ``data`` in this process
    (tests). ``data``: the site's task offers (``fedrelay.tasks.offers.Offer`` list, as the daemon
    registered them), or a loaded ``fedrelay.SiteData`` of the default task (tests; also what
    the inline runner trains on). ``extra_tasks``: ``module:attr`` tasks offered
    (``peer serve --task``).
    """

    def __init__(self, name: str, address: str, data, state_dir: Path, device: str,
                 coordinator: CoordinatorLink | None, *, send_deadline: float = 1800.0,
                 start_workers: bool = True, transport: Transport = INSECURE,
                 stall_timeout: float = DEFAULT_STALL_TIMEOUT, weights_dir: Path | None = None, jobs=None,
                 extra_tasks: list[str] | tuple = (), policy: SitePolicy | None = None):
        self.transport = transport
        # Initial-weights files this site holds (``--init file``), found by their SHA-256.
        self.weights_dir = Path(weights_dir) if weights_dir is not None else Path(state_dir) / "weights"
        self.name = name
        self.address = address
        self.extra_tasks = list(extra_tasks)
        self.offers: dict[str, Offer] = {o.name: o for o in _offers(data)}
        self.state_dir = Path(state_dir)
        # The site's own policy (peer/policy.py): --policy FILE, else STATE_DIR/policy.toml if present.
        self.policy = policy if policy is not None else SitePolicy(self.state_dir / POLICY_FILE)
        self.device = device
        self.coordinator = coordinator
        self.send_deadline = send_deadline
        self.start_workers = start_workers  # False: accept and store, but train nothing (tests)
        self.runs: dict[str, Run] = {}
        self._lock = threading.Lock()
        self._train_lock = threading.Lock()  # one training at a time on this site's hardware
        self._route_lock = threading.Lock()
        self.streams = InboundStreams(stall_timeout)  # the Handoff streams open here
        self.refused_streams = RefusedStreams()  # failed streams per (run, sender): logged a few, then counted
        self.jobs = jobs if jobs is not None else InlineRunner(data, device)
        self._schemas: dict[str, dict] = {}  # run's schema key -> payload schemas (see _schemas_of)
        self._schema_waits: dict[str, threading.Event] = {}  # schema keys a warm worker is asked for
        self._digests: dict[tuple, str] = {}
        self.relay_after = DEFAULT_RELAY_AFTER  # seconds without reaching a receiver directly before the relay (0: never)
        self._fetching: set[tuple[str, str]] = set()  # (run, transfer) downloads from a relay under way
        self.reporter = Reporter(coordinator, lambda: self.stop)
        self.stop = threading.Event()
        self.metrics = PeerMetrics(self)  # Prometheus metrics (peer/monitoring.py)
        self.started = time.time()
        self.instance = ""  # the daemon process's random id (RegisterRequest.instance), set by serve()
        # The federation's revocation list (fedrelay/revocation.py), set by serve(): nothing goes
        # to a site the coordinator says is revoked.
        self.revocations = None
        self._load_runs()

    # -- persistence -----------------------------------------------------------------------------
    def _load_runs(self) -> None:
        for folder in sorted((self.state_dir / "runs").glob("*")):
            try:
                run = Run.load(folder)
            except (OSError, ValueError) as exc:
                log.warning("ignoring unreadable run folder %s: %s", folder, exc)
                continue
            self.runs[run.run_id] = run

    def resume(self) -> None:
        """Restart the workers of runs that were active when the daemon stopped, and report the
        receipts the coordinator had not taken yet."""
        for run in self.runs.values():
            for key, r in run.receipts.items():
                if not r["reported"]:
                    self._send_receipt(run, key)
            if run.state in ACTIVE:
                log.info("resuming run %s (was %s)", run.run_id, run.state)
                self._start_worker(run)

    # -- coordinator calls -----------------------------------------------------------------------
    def assign(self, a: peer_pb2.Assignment) -> str:
        """Accept an assignment (idempotent). Raises ``ValueError`` when it cannot be run here,
        ``PolicyRefusal`` (a ``ValueError``) when a new run is outside the site's policy."""
        if a.site != self.name:
            raise ValueError(f"assignment is for {a.site!r}, this peer is {self.name!r}")
        if not a.run_id or "/" in a.run_id or a.run_id.startswith("."):
            raise ValueError(f"invalid run id {a.run_id!r}")
        if a.chain_length < 2 or a.position >= a.chain_length or len(a.order) != a.chain_length:
            raise ValueError("inconsistent position, chain length and order")
        if a.order[a.position] != self.name:
            raise ValueError(f"order[{a.position}] is {a.order[a.position]!r}, not {self.name!r}")
        run_params.check_rounds(a.rounds or 1)
        star = registry.strategy(a.params.strategy).plan == registry.STAR
        if star != bool(a.aggregator) or (a.aggregator and a.aggregator not in a.order):
            raise ValueError(f"strategy {a.params.strategy!r} and aggregator {a.aggregator!r} do not make a plan")
        self._check_part(a.order, a.rounds or 1, a.transfers, a.peers, a.visits)
        self.check_task(ModelSpec.from_pb(a.model), list(a.class_index))
        params = run_params.to_dict(a.params)
        run_params.check(params)
        if a.run_id not in self.runs:  # a new run: within this site's policy (raises PolicyRefusal)
            self.policy.check(a)
        opts = run_params.options(params)
        if opts["init"] == "file":
            self.initial_weights(opts["init_sha256"])  # refuse now, not at the first epoch
        if star and a.aggregator == self.name and a.run_id not in self.runs:
            # The aggregating site is assigned first: its aggregator must handle the task's model
            # (e.g. MA-Echo's layer types) before any site trains. A worker builds the model's
            # schema on the meta device (seconds; cached per model and options).
            self._schemas_of(a)
        with self._lock:
            run = self.runs.get(a.run_id)
            if run is not None:
                if run.assignment.route_version == 0 and run.assignment != a:
                    raise ValueError(f"run {a.run_id} was already assigned differently")
                return run.state
            folder = self.state_dir / "runs" / a.run_id
            folder.mkdir(parents=True, exist_ok=True)
            run = Run(a, folder)
            run.save_assignment(a)
            run.save()
            self.runs[a.run_id] = run
        self._report_state(run)
        self._start_worker(run)
        return run.state

    def _check_part(self, order, rounds: int, transfers, peers, visits) -> None:
        """A part of a plan this site can carry out. Raises ``ValueError``."""
        sites = set(order)
        named = {ref.name for ref in peers}
        if any(not 1 <= r <= rounds for r in visits) or list(visits) != sorted(set(visits)):
            raise ValueError(f"visits {list(visits)} are not distinct rounds in 1..{rounds}")
        for t in transfers:
            if t.purpose not in purposes.BY_WIRE:
                raise ValueError(f"planned transfer with unknown purpose {t.purpose}")
            if self.name not in (t.sender, t.receiver) or t.sender == t.receiver:
                raise ValueError(f"planned transfer {t.sender} -> {t.receiver} is not this site's")
            other = t.receiver if t.sender == self.name else t.sender
            if other not in sites or other not in named:
                raise ValueError(f"planned transfer names {other!r}, which is not a site of the run with an address")
            if t.purpose == common_pb2.CHAIN_HOP and not 1 <= t.index < rounds * len(order):
                raise ValueError(f"hop {t.index} is outside the plan's {rounds * len(order) - 1} hops")
            if t.purpose == common_pb2.UPLOAD and not (1 <= t.index <= len(order) and order[t.index - 1] == t.sender):
                raise ValueError(f"upload {t.index} does not come from the site at position {t.index - 1}")

    def initial_weights(self, sha256: str) -> Path:
        """The initial-weights file (``--init file``) with this SHA-256 in ``weights_dir``: any
        ``*.safetensors`` file there whose digest is ``sha256`` (digests are cached by size and
        modification time). Raises ``ValueError`` saying where to place it."""
        folder = self.weights_dir
        for path in sorted(folder.glob("*.safetensors")) if folder.is_dir() else ():
            st = path.stat()
            key = (str(path), st.st_size, st.st_mtime_ns)
            if key not in self._digests:
                self._digests[key] = sha256_file(path)
            if self._digests[key] == sha256:
                return path
        raise ValueError(f"this site holds no initial-weights file with SHA-256 {sha256}: copy it into {folder} "
                         "(any name ending in .safetensors; `sha256sum FILE` shows its digest)")

    def check_task(self, spec: ModelSpec, class_index: list[str]) -> None:
        """The run's task must be offered here and read this site's folder, its code here must
        have the digest the run pins (recomputed now: a copy changed since the daemon started
        counts), the site's input description must be the run's, and the site's classes must be
        in the run's class index. Raises ``ValueError`` naming the task and, for a digest, both."""
        offer = self.offers.get(spec.task)
        if offer is None:
            raise ValueError(f"task {spec.task!r} is not installed at this site (installed: "
                             f"{', '.join(sorted(self.offers)) or 'none'}): install it, or leave this site out")
        if not offer.usable:
            raise ValueError(f"task {spec.task!r} cannot read this site's data: {offer.error}")
        try:
            here = task_registry.find(spec.task, self.extra_tasks).sha256
        except task_registry.TaskNotInstalled as exc:
            raise ValueError(f"task {spec.task!r}: {exc}") from None
        if spec.task_sha256 and here != spec.task_sha256:
            raise ValueError(f"task {spec.task!r} at this site has code SHA-256 {here}, the run pins "
                             f"{spec.task_sha256}: this site's copy of the task differs from the one the run was "
                             "started with (install the agreed release)")
        mine = canonical_json(offer.summary.input)
        want = canonical_json({k: v for k, v in spec.input.items() if k != "stats"})
        if mine != want:
            raise ValueError(f"task {spec.task!r}: the run's model expects input {want}, this site's data are {mine}")
        if spec.model not in offer.models:
            raise ValueError(f"task {spec.task!r} has no model {spec.model!r} here (models: {', '.join(offer.models)})")
        missing = [c for c in offer.summary.classes if c not in set(class_index)]
        if missing:
            raise ValueError(f"this site's classes {missing} are not in the run's class index")

    @staticmethod
    def _spec(a: peer_pb2.Assignment) -> dict:
        """The run's model as a job's ``SPEC`` (``peer/jobs.py``)."""
        return ModelSpec.from_pb(a.model).to_dict()

    def _job_base(self, run: Run) -> dict:
        """What every training job of ``run`` is told: model, parameters, seed, classes, site."""
        a = run.assignment
        params = run_params.to_dict(a.params)
        strategy = registry.strategy(a.params.strategy)
        return {"spec": self._spec(a), "params": params, "seed": a.seed, "class_index": list(a.class_index),
                "site": self.name, "aggregator": strategy.aggregator, "options": run_params.options(params)}

    # -- receiving --------------------------------------------------------------------------------
    def handoff(self, chunks, caller: str | None = None) -> peer_pb2.HandoffReceipt:
        """Receive a model stream from the peer whose certificate names ``caller`` (``None`` on a
        plaintext daemon: then only the header's ``sender`` is checked).

        Accepted only for a transfer of this site's part of the run's plan (a hop whose index is
        ``header.hop``, or a final copy), from the sender the plan names, whose certificate name
        must also be the header's ``sender``. A stream that sends nothing for ``stall_timeout``
        seconds, or runs past ``calls.transfer_timeout`` of its declared size, is dropped
        (DEADLINE_EXCEEDED).

        Resume (issue #5): the bytes of a stream from that legitimate sender that broke, stalled
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
                run, t, dest = self._check_transfer(h, caller)
            except _Duplicate as dup:
                holder["duplicate"] = dup.args
                raise
            self.streams.claim(dest, mine)
            holder.update(dest=dest, run=run, transfer=t)
            if h.purpose == common_pb2.CHAIN_HOP:
                # In memory only: a refused stream leaves nothing changed on disk. A sender
                # whose streams keep failing changes the state without a log line or report.
                holder["was"] = (run.state, run.detail)
                holder["quiet"] = not self.refused_streams.loud(run.run_id, h.sender)
                self._set_state(run, "receiving", f"hop {h.hop} from {h.sender}", persist=False,
                                quiet=holder["quiet"])
            return dest

        def check_payload(data: bytes) -> None:
            self._check_model_bytes(holder["run"].assignment, data, holder["transfer"].purpose)

        watched = self.streams.watched(chunks, mine.cancel)
        try:
            got = receive_model(watched, Path("/nonexistent"), check_header, check_payload, resumable=True)
        except _Duplicate:
            run, dest, sha, hop = holder["duplicate"]
            return peer_pb2.HandoffReceipt(run_id=run.run_id, hop=hop, receiver=self.name,
                                           received_bytes=dest.stat().st_size, sha256=sha, duplicate=True)
        except BaseException:
            run = holder.get("run")
            if run is not None and run.state == "receiving" and "was" in holder:
                self._set_state(run, *holder["was"], persist=False, quiet=holder["quiet"])
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
        self._kept(run, t, got.path, got.size, got.sha256)
        return peer_pb2.HandoffReceipt(run_id=run.run_id, hop=h.hop, receiver=self.name,
                                       received_bytes=got.size, sha256=got.sha256)

    def _kept(self, run: Run, t: common_pb2.PlannedTransfer, path: Path, size: int, sha: str,
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
            "run_id": run.run_id, "purpose": int(t.purpose), "hop": t.index, "sender": t.sender, "receiver": self.name,
            "payload_bytes": size, "sha256": sha, "schema_sha256": schema_digest(path),
            "received": time.time(), "route": route, "relay_wire_bytes": relay_wire_bytes}}
        run.save()
        self.metrics.kept(t.purpose, size)
        self._send_receipt(run, key)
        run.wake.set()

    def _send_receipt(self, run: Run, key: str) -> None:
        def delivered() -> None:
            run.receipts[key]["reported"] = True
            run.save()

        self.reporter.receipt(cpb.ReceiptReport(**run.receipts[key]["report"]), delivered)

    def _check_transfer(self, h: common_pb2.TransferHeader, caller: str | None, check_cap: bool = True):
        """The checks of a transfer's header against the run's plan (see ``handoff``; its fields
        were checked by ``transfer.check_header_fields``): returns (run, planned transfer,
        destination). ``check_cap``: also the declared size against the run's cap (which may ask
        a worker for the run's payload schemas: seconds the first time). Raises
        ``TransferError``, or ``_Duplicate(run, dest, sha256, hop)`` when this exact payload was
        already accepted."""
        run = self.runs.get(h.run_id)
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
            self._check_cap(run, h.total_bytes)
        dest = run.destination(t)
        if dest.exists():
            have = sha256_file(dest)
            if have == h.sha256:
                raise _Duplicate(run, dest, have, h.hop)
            raise TransferError(grpc.StatusCode.ALREADY_EXISTS,
                                f"a different model was already accepted for this transfer (sha256 {have})")
        return run, t, dest

    def _check_cap(self, run: Run, size: int) -> None:
        """Raises ``TransferError`` (RESOURCE_EXHAUSTED) when ``size`` bytes exceed the run's cap."""
        cap = self._payload_cap(run.assignment)
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
            _, _, dest = self._check_transfer(h, caller)
        except _Duplicate:
            return peer_pb2.TransferOffsetReply(offset=h.total_bytes, complete=True)
        self.streams.end(dest)
        return peer_pb2.TransferOffsetReply(offset=min(held_bytes(dest, h.sha256), h.total_bytes))


    def _schema_request(self, a: peer_pb2.Assignment) -> tuple[dict, str]:
        """The schema job for run ``a`` (``peer/jobs.py``) and its cache key."""
        import hashlib
        import json

        strategy = registry.strategy(a.params.strategy)
        opts = run_params.options(run_params.to_dict(a.params)) if strategy.aggregator else {}
        req = {"op": "schema", "spec": self._spec(a), "strategy": strategy.name, "aggregator": strategy.aggregator,
               "options": opts}
        return SchemaJob.from_dict(req), hashlib.sha256(json.dumps(req, sort_keys=True).encode()).hexdigest()[:32]

    def _keep_schemas(self, key: str, answer: dict) -> dict:
        import json

        found = {k: answer[k] for k in ("hop", "model", "extras")}
        path = self.state_dir / "schemas" / f"{key}.json"
        if not path.exists():
            atomic_write(path, json.dumps(found, sort_keys=True).encode())
        self._schemas[key] = {k: {n: (tuple(sd[0]), sd[1]) for n, sd in v.items()} for k, v in found.items()}
        return self._schemas[key]

    def _schemas_of(self, a: peer_pb2.Assignment) -> dict:
        """The run's payload schemas (``fedrelay.payload``): ``{"hop", "model", "extras"}`` (see
        ``peer/jobs.py``'s ``schema``), asked of a worker once per model, strategy and
        aggregator options (a warm worker asks ahead) and kept in memory and in
        ``state_dir/schemas/`` (a restarted daemon asks no worker again). Raises ``ValueError``
        when no worker can say."""
        import json

        req, key = self._schema_request(a)
        if key in self._schemas:
            return self._schemas[key]
        try:
            return self._keep_schemas(key, json.loads((self.state_dir / "schemas" / f"{key}.json").read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            pass
        asked = self._schema_waits.get(key)
        if asked is not None:  # a warm worker is being asked: its answer comes within seconds
            asked.wait(120.0)
            if key in self._schemas:
                return self._schemas[key]
        try:
            answer = self.jobs.run(req)
        except Exception as exc:  # noqa: BLE001 - any failure: the payload cannot be checked
            kind, _, message = str(exc).partition(": ")
            raise ValueError(f"the run's model cannot be used here: {message or exc}") from exc
        return self._keep_schemas(key, answer)

    def prepare(self, run_id: str, sender: str, caller: str | None = None) -> bool:
        """``Peer.Prepare``: the planned sender ``sender`` of a transfer into this site started
        training; start a worker ahead for the run (and ask it the run's payload schemas) if a
        host slot is free. The caller is the sender, or the coordinator on its behalf when this
        site connects out only. True when one was started. Raises ``LookupError`` (unknown run)
        or ``PermissionError`` (``sender``, or the caller's certificate name, is not a planned
        sender into this site)."""
        run = self.runs.get(run_id)
        if run is None:
            raise LookupError(f"unknown run {run_id!r}")
        if caller is not None and caller not in (sender, COORDINATOR_IDENTITY):
            raise PermissionError(f"certificate identity {caller!r} is not {sender!r}")
        planned = [t for t in run.assignment.transfers if t.receiver == self.name and t.sender == sender]
        if not planned:
            raise PermissionError(f"{sender!r} sends nothing to this site in run {run_id}")
        if run.ended.is_set() or not self.start_workers or all(run.destination(t).exists() for t in planned):
            return False  # nothing more to receive from that sender: no worker is held for it
        req, key = self._schema_request(run.assignment)
        prefetch, asked = [], None
        if key not in self._schemas and key not in self._schema_waits:
            asked = self._schema_waits[key] = threading.Event()

            def keep(answer: dict | None) -> None:
                try:
                    if answer is not None:
                        self._keep_schemas(key, answer)
                finally:
                    self._schema_waits.pop(key, None)
                    asked.set()
            prefetch = [(req, keep)]
        started = self.jobs.warm(run_id, prefetch, spec=self._spec(run.assignment), sender=sender)
        if not started and asked is not None:
            self._schema_waits.pop(key, None)
            asked.set()
        return started

    def relay_quota(self, run_id: str) -> int:
        """``Peer.RelayQuota``: the largest payload (bytes) this site accepts in run ``run_id``
        (the relay stores no larger envelope for it). Raises ``LookupError`` (unknown run) or
        ``ValueError`` (no worker can tell the run's payload schemas)."""
        run = self.runs.get(run_id)
        if run is None:
            raise LookupError(f"unknown run {run_id!r}")
        return self._payload_cap(run.assignment)

    def _payload_cap(self, a: peer_pb2.Assignment) -> int:
        """Largest payload accepted for a run: 4 x (the model's tensor bytes + the aggregator's
        extra tensors' bytes) + 1 MiB of header (``fedrelay.limits.payload_cap``)."""
        schemas = self._schemas_of(a)
        return transfer_bounds.payload_cap(payload.payload_bytes(schemas["model"]) + payload.payload_bytes(schemas["extras"]))

    def _check_model_bytes(self, a: peer_pb2.Assignment, data: bytes, purpose: int) -> None:
        """Parse a payload with safetensors' numpy API and check it against its schema before
        anything is kept (``fedrelay.payload.check_payload``, no torch): a hop's against the
        strategy's ``payload_schema`` (default: the run's model), an upload's against the model
        plus its aggregator's extra tensors (names, shapes, dtypes), a final copy's against the
        run's model. No NaN or Inf anywhere. Raises ``ValueError``."""
        schemas = self._schemas_of(a)
        if purpose == common_pb2.CHAIN_HOP:
            expected = schemas["hop"]
        elif purpose == common_pb2.UPLOAD:
            expected = {**schemas["model"], **schemas["extras"]}
        else:
            expected = schemas["model"]
        payload.check_payload(data, expected)

    # -- the worker ---------------------------------------------------------------------------------
    def _start_worker(self, run: Run) -> None:
        if not self.start_workers:
            return
        threading.Thread(target=self._work, args=(run,), name=f"run-{run.run_id}", daemon=True).start()

    def _work(self, run: Run) -> None:
        try:
            if not run.lock.acquire(blocking=False):
                return  # a worker is already on this run
            try:
                self._work_steps(run)
            finally:
                run.lock.release()
        except RunEnded:
            log.info("run %s: ended by the coordinator; this site stopped working on it", run.run_id)
        except Exception as exc:  # noqa: BLE001 - every failure is reported, the daemon goes on
            log.exception("run %s failed", run.run_id)
            self._set_state(run, "failed", f"{type(exc).__name__}: {exc}")
            if self.coordinator is not None:
                try:
                    self.coordinator.call("ReportFailure", cpb.FailureReport(
                        run_id=run.run_id, site=self.name, error=f"{type(exc).__name__}: {exc}"),
                        retry_for=300, stop=self.stop)
                except grpc.RpcError as rpc_exc:
                    log.error("could not report the failure: %s", status_message(rpc_exc))

    def _work_steps(self, run: Run) -> None:
        """Every visit of this site, in round order: wait for its hop (none at the chain's first
        visit), train, send the model on; the final site then copies the final model to every
        other site. The route may change meanwhile (``reroute``): each step reads the current
        part of the plan, so a visit that lost its hop is dropped, and one that became the
        chain's first starts afresh. A star plan: ``_work_star``."""
        if run.is_star:
            self._work_star(run)
            return
        r = 0
        while True:
            later = [v for v in run.visits if v > r]
            if not later:
                break
            r = later[0]
            outgoing = run.visit_dir(r) / "outgoing.safetensors"
            if not outgoing.exists():
                if not self._wait_for_hop(run, r):
                    if self.stop.is_set():
                        return
                    r = 0  # the route changed: look at the visits again from the start
                    continue
                self._train(run, r, outgoing)
            if not self._send_on(run, r, outgoing):
                if self.stop.is_set():
                    return
                r = 0
                continue
        self._set_state(run, "done", "")

    def _work_star(self, run: Run) -> None:
        """A star plan (a parallel one-shot method): train once from the run's initial model and
        write the upload (model + the aggregator's extra tensors); a site uploads it to the
        aggregator and is done (the final copy arrives later, by ``handoff``). The aggregator
        waits for the planned uploads (``_wait_for_uploads``), combines them with its own
        (``_aggregate``), copies the final model to every site whose upload it used and reports
        it, naming the sites whose upload never came."""
        outgoing = run.visit_dir(1) / "outgoing.safetensors"
        if not outgoing.exists():
            self._train(run, 1, outgoing)
        if not run.is_final_site:
            t = run.upload
            if t is not None:
                self._set_state(run, "sending", f"upload {t.index} to {t.receiver}")
                self._deliver(run, t, outgoing, sha256_file(outgoing), outgoing.stat().st_size)
            self._set_state(run, "done", "")
            return
        final = run.final_model
        if not final.exists():
            arrived, missing = self._wait_for_uploads(run)
            if arrived is None:
                return  # the daemon stops; a restart carries on
            self._aggregate(run, outgoing, arrived, final)
            run.missing = missing
            run.save()
        sha, size = sha256_file(final), final.stat().st_size
        run.final_sha256 = sha
        run.save()
        self._set_state(run, "distributing", "final model to every site")
        for c in run.final_copies:
            if c.receiver not in run.missing:
                self._deliver(run, c, final, sha, size)  # False: a reroute took the copy away
        self._report("ReportFinal", cpb.FinalReport(run_id=run.run_id, site=self.name, sha256=sha, model_bytes=size,
                                                    missing=run.missing))
        self._set_state(run, "done", "")

    def _wait_for_uploads(self, run: Run):
        """Wait, at a star plan's aggregator, until every planned upload has arrived, or
        ``--upload-timeout`` seconds (counted from now: after this site's own training, again
        after a restart) have passed. The plan may shrink meanwhile (the coordinator routed
        around a site that stayed down). Returns ``(arrived, missing)``: the planned uploads held
        (PlannedTransfer) and the senders not heard from; ``(None, [])`` when the daemon stops.
        Raises ``RunEnded``."""
        timeout = run_params.options(run_params.to_dict(run.assignment.params))["upload_timeout"]
        deadline = time.monotonic() + timeout
        while True:
            run.wake.clear()
            planned = run.uploads_in
            arrived = [t for t in planned if run.destination(t).exists()]
            missing = [t.sender for t in planned if t not in arrived]
            if not missing:
                return arrived, []
            if time.monotonic() >= deadline:
                log.warning("run %s: no upload from %s within %.0f s; combining the %d that arrived", run.run_id,
                            ", ".join(missing), timeout, len(arrived))
                return arrived, missing
            if self.stop.is_set():
                return None, []
            if run.ended.is_set():
                raise RunEnded(run.run_id)
            detail = f"{len(arrived)} of {len(planned)} uploads"
            if run.state != "receiving" or run.detail != detail:
                self._set_state(run, "receiving", detail)
            run.wake.wait(min(1.0, max(0.0, deadline - time.monotonic())))

    def _aggregate(self, run: Run, own: Path, arrived: list, final: Path) -> None:
        """Combine this site's own upload and the ``arrived`` ones with the run's aggregator and
        write the final model to ``final``: the ``aggregate`` job (``peer/jobs.py``) on a worker,
        with the site's train/validation split and the run's initial model."""
        a = run.assignment
        strategy = registry.strategy(a.params.strategy)
        uploads = {self.name: str(own), **{t.sender: str(run.destination(t)) for t in arrived}}
        req = {**self._job_base(run), "op": "aggregate", "uploads": uploads, "final": str(final),
               "initial": self._initial(run)}
        with self._train_lock:
            answer = self._run_job(run, AggregateJob.from_dict(req),
                                   f"aggregating {len(uploads)} models ({strategy.aggregator})")
        log.info("run %s: aggregated %d models with %s in %.1f s", run.run_id, len(uploads), strategy.aggregator,
                 answer["seconds"])

    def _initial(self, run: Run) -> dict | None:
        """The run's initial model, as a job's ``initial`` (``peer.jobs.initial_state``):
        ``--init file`` (the weights file found here by its SHA-256; the job checks the digest
        again as it reads it, and its tensors against the run's model), ``--init shared`` in a
        star plan (built from ``derive_seed(seed, "init")``, the same at every site). None
        otherwise: each site draws its own seeded init, and a chain's first site keeps the draw
        it always made (``derive_seed(seed, "site", 0, "init")``), so chain runs keep their
        digests. Raises ``ValueError`` (no such weights file here)."""
        opts = run_params.options(run_params.to_dict(run.assignment.params))
        if opts["init"] == "file":
            return {"kind": "file", "path": str(self.initial_weights(opts["init_sha256"])),
                    "sha256": opts["init_sha256"]}
        if opts["init"] == "shared" and run.is_star:
            return {"kind": "shared"}
        return None

    def _run_job(self, run: Run, req: dict, detail: str, images: int = 0) -> dict:
        """Run a training or aggregation job for ``run`` (under ``_train_lock``): the state turns
        "training" (``detail``) once its worker is ready; epochs are reported as they end; the
        coordinator's end of the run stops the job (``RunEnded``). Raises ``RunEnded`` and what
        the job raises (``peer.workers.WorkerDied`` / ``WorkerError``)."""
        if run.ended.is_set():  # ended while waiting for the site's hardware
            raise RunEnded(run.run_id)
        try:
            return self.jobs.run(req, run_id=run.run_id, on_event=self._epoch_reporter(run, images),
                                 cancelled=lambda: run.ended.is_set() or self.stop.is_set(),
                                 on_wait=lambda why: self._set_state(run, "assigned", why),
                                 on_start=lambda: self._set_state(run, "training", detail))
        except JobCancelled:
            raise RunEnded(run.run_id) from None

    def _epoch_reporter(self, run: Run, images: int = 0):
        def on_epoch(info: dict) -> None:
            self.metrics.epoch(run.run_id, info, info.get("images") or images)
            val_acc = info.get("val_accuracy")
            self.reporter.progress(cpb.ProgressReport(
                run_id=run.run_id, site=self.name, kind="epoch", stage=info["stage"], model=info["model"],
                epoch=info["epoch"], epochs=info["epochs"], train_loss=info["train_loss"],
                val_accuracy=-1.0 if val_acc is None else val_acc, seconds=info["seconds"]))
        return on_epoch

    def _wait_for_hop(self, run: Run, r: int) -> bool:
        """Wait until visit ``r``'s hop has arrived (True at once at the chain's first visit).
        False when the daemon stops or a reroute took the visit away. Raises ``RunEnded``."""
        while True:
            run.wake.clear()
            if r not in run.visits:
                return False
            t = run.inbound(r)
            if t is None or run.destination(t).exists():
                return True
            if run.state not in ("assigned", "receiving"):
                self._set_state(run, "assigned", f"waiting for hop {t.index} from {t.sender}")
            if self.stop.is_set():
                return False
            if run.ended.is_set():
                raise RunEnded(run.run_id)
            run.wake.wait(1.0)

    def _send_on(self, run: Run, r: int, outgoing: Path) -> bool:
        """Send visit ``r``'s model to the next visit, or, at the chain's last visit, copy the
        final model to every other site and report it. False when a reroute changed this
        visit's route meanwhile (the caller looks again) or the daemon stops."""
        sha = sha256_file(outgoing)
        size = outgoing.stat().st_size
        while True:
            if r not in run.visits or self.stop.is_set():
                return False
            t = run.outbound(r)
            if t is None:  # the chain's last visit: this is the final model
                run.final_sha256 = sha
                run.save()
                self._set_state(run, "distributing", "final model to every site")
                if all(self._deliver(run, c, outgoing, sha, size) for c in run.final_copies) and run.is_final_site:
                    self._report("ReportFinal", cpb.FinalReport(run_id=run.run_id, site=self.name, sha256=sha,
                                                                model_bytes=size))
                    return True
                continue
            self._set_state(run, "sending", f"hop {t.index} to {t.receiver}")
            if self._deliver(run, t, outgoing, sha, size):
                return True

    def _train(self, run: Run, r: int, outgoing: Path) -> None:
        """Visit ``r``'s local training (the run's strategy, from the registry): the ``train``
        job (``peer/jobs.py``) on a worker. Round 1 seeds are ``derive_seed(seed, "site",
        position)`` (a one-shot run's); round r > 1 adds ``("round", r)``. The warm-up happens
        only at the chain's first visit (no hop in). The receiver of this visit's model is told
        first (``Peer.Prepare``), so that its worker starts while this site trains."""
        a = run.assignment
        folder = run.visit_dir(r)
        t = run.inbound(r)
        req = {**self._job_base(run), "op": "train", "position": a.position, "round": r, "folder": str(folder),
               "received": str(run.destination(t)) if t is not None else None, "outgoing": str(outgoing),
               "initial": None}
        if t is None and not (folder / "warmup.safetensors").exists():
            req["initial"] = self._initial(run)
        if not run.is_star:
            req["aggregator"] = ""  # a chain's hop carries the model only
        if privacy.enabled(a.params):  # DP-SGD: a target epsilon is spread over the site's epochs of the run
            req["privacy_epochs"] = privacy.planned_epochs_of(req["params"], len(run.visits),
                                                              run.inbound(min(run.visits)) is None)
        with self._train_lock:
            self._tell_receiver(run, r)
            answer = self._run_job(run, TrainJob.from_dict(req), f"round {r}" if (a.rounds or 1) > 1 else "")
        log.info("run %s: round %d: trained %d pool models in %.1f s", run.run_id, r, answer["pool"],
                 answer["seconds"])

    def _tell_receiver(self, run: Run, r: int) -> None:
        """``Peer.Prepare`` to the receiver of visit ``r``'s model (a chain's next visit), in the
        background; a hint only: failures are logged at debug level."""
        t = None if run.is_star else run.outbound(r)
        if t is None or t.receiver == self.name:
            return
        to = run.peer(t.receiver)

        def tell() -> None:
            from fedrelay.v1 import peer_pb2_grpc

            try:
                channel = self.transport.channel(to.address, expect=to.name)
                try:
                    peer_pb2_grpc.PeerStub(channel).Prepare(peer_pb2.PrepareRequest(run_id=run.run_id, sender=self.name),
                                                            timeout=CONTROL_TIMEOUT)
                finally:
                    channel.close()
            except Exception as exc:  # noqa: BLE001 - a hint
                log.debug("run %s: could not tell %s to prepare: %s", run.run_id, to.name, exc)

        if to.address:
            threading.Thread(target=tell, daemon=True, name=f"prepare-{to.name}").start()

    def _deliver(self, run: Run, t: common_pb2.PlannedTransfer, path: Path, sha: str, size: int) -> bool:
        """Send ``path`` for the planned transfer ``t`` with retries (exponential backoff and
        jitter), then report it to the coordinator.

        Direct first: the stream goes to the receiver's address. A receiver that only connects
        out (no address), or one not reached directly for ``relay_after`` seconds (0: never),
        gets the payload through the relay instead, sealed to its certificate key
        (``peer/relaying.py``); the report then says ``route = "relayed"``.

        Returns False, having sent nothing, when a reroute took ``t`` off this site's part of the
        plan meanwhile; True once delivered (or delivered before)."""
        key = sent_key(t)
        if key in run.sent:
            return True
        header = common_pb2.TransferHeader(run_id=run.run_id, hop=t.index, sender=self.name, total_bytes=size,
                                           sha256=sha, purpose=t.purpose)
        to = run.peer(t.receiver)
        version = run.assignment.route_version
        started = time.monotonic()
        deadline = started + self.send_deadline
        counter, attempts = [0], 0  # bytes put on the wire by every attempt; streams begun
        relayed = not to.address
        for delay in backoff_delays():
            if run.ended.is_set():
                raise RunEnded(run.run_id)
            if run.assignment.route_version != version and not self._still_planned(run, t):
                log.info("run %s: %s to %s is no longer in this site's plan; not sending it", run.run_id,
                         purposes.said(t.purpose), t.receiver)
                return False
            if self._revoked(to.name, run, t, deadline, delay):  # wait for the coordinator's reroute
                continue
            try:
                attempts += 1
                if relayed:
                    sent = self._send_relayed(run, t, path, counter)
                else:  # under TLS the receiver's certificate must name the site we mean to reach
                    sent = send_model(to.address, header, path, transport=self.transport, expect=to.name,
                                      counter=counter,
                                      cancelled=lambda: run.ended.is_set() or self._is_revoked(to.name))
                break
            except SendCancelled:  # the coordinator ended the run mid-stream, or revoked the receiver
                if run.ended.is_set():
                    raise RunEnded(run.run_id) from None
                log.warning("run %s: stopped sending %s %d to %s mid-stream: its certificate was revoked", run.run_id,
                            purposes.said(t.purpose), t.index, to.name)
            except (RelayUnavailable, SealError) as exc:
                raise RuntimeError(f"cannot send {purposes.said(t.purpose)} {t.index} to {to.name} through the "
                                   f"relay: {exc}") from exc
            except relaying.NoCertificateYet as exc:  # the coordinator restarted: the receiver registers again soon
                if time.monotonic() + delay > deadline:
                    raise RuntimeError(f"cannot send to {to.name} through the relay: {exc}") from exc
                log.warning("run %s: %s; retrying in %.1f s", run.run_id, exc, delay)
                self._pause(run, delay)
                if self.stop.is_set():
                    raise RuntimeError("daemon stopping") from exc
            except grpc.RpcError as exc:
                if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and not relayed:
                    to = self._resolve(to)
                    waited = time.monotonic() - started
                    if not to.address or (self.relay_after and waited >= self.relay_after and self.transport.secure):
                        relayed = True
                        log.warning("run %s: %s not reached directly%s; sending through the relay at %s", run.run_id,
                                    to.name, f" for {waited:.0f} s" if to.address else " (it connects out only)",
                                    self.relay_address)
                # A receiver may not know yet that a reroute changed its plan (a final copy from a
                # new final site, a hop from a new sender): its refusal is retried for a while (the
                # route reaches it within seconds).
                rerouting = (exc.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT)
                             and run.assignment.route_version > 0 and time.monotonic() - started < REROUTE_GRACE)
                where = f"the relay at {self.relay_address}" if relayed else f"{to.name} at {to.address}"
                if (exc.code() not in RETRYABLE and not rerouting) or time.monotonic() + delay > deadline:
                    raise RuntimeError(f"cannot deliver to {where}: {status_message(exc)}") from exc
                log.warning("run %s: delivery to %s failed (%s); retrying in %.1f s", run.run_id, where,
                            status_message(exc), delay)
                self._pause(run, delay)
                if self.stop.is_set():
                    raise RuntimeError("daemon stopping") from exc
                run.rerouted.clear()
        if run.run_status == "cancelled":  # stopped while the last chunks went out: report nothing more
            raise RunEnded(run.run_id)
        if sent.receipt.duplicate:  # a retry of a transfer that had arrived: acknowledged, no effect
            log.info("run %s: %s already held this model (sha256 %s)", run.run_id,
                     "the relay" if relayed else to.name, sha[:12])
        if sent.resumed_from:
            log.info("run %s: resumed the transfer to %s at byte %d of %d", run.run_id,
                     "the relay" if relayed else to.name, sent.resumed_from, sent.payload_bytes)
        self._report("ReportHop", cpb.HopReport(
            run_id=run.run_id, hop=t.index, purpose=t.purpose, sender=self.name, receiver=to.name,
            payload_bytes=size, wire_bytes=counter[0], sha256=sha, started=sent.started,
            ended=sent.ended, attempts=attempts, resumed_from=sent.resumed_from, round=t.round,
            schema_sha256=schema_digest(path), route=sent.route, sealed_bytes=sent.sealed_bytes,
            relay=sent.relay, sealed_sha256=sent.sealed_sha256))
        self.metrics.delivered(t.purpose, size, counter[0], attempts, sent.resumed_from)
        run.sent.append(key)
        run.save()
        if relayed:  # the relay holds the envelope now: this site needs its copy no more
            for envelope in run.path("sealed").glob(f"{purposes.BY_WIRE[t.purpose]}-{t.index}-{t.receiver}-*.sealed"):
                envelope.unlink(missing_ok=True)
        return True

    def _send_relayed(self, run: Run, t: common_pb2.PlannedTransfer, path: Path, counter: list[int]) -> Sent:
        """One attempt at sending ``path`` through the relay: sealed to the receiver's
        certificate (asked of the coordinator), then streamed to the relay from the bytes it
        holds. Raises ``grpc.RpcError``, ``RelayUnavailable`` or ``SealError``."""
        if self.coordinator is None:
            raise RelayUnavailable("no coordinator to ask for the receiver's certificate")
        ref = self.coordinator.stub.ResolveSite(cpb.ResolveSiteRequest(name=t.receiver), timeout=CONTROL_TIMEOUT)
        sealed, sealed_bytes, sealed_sha = relaying.seal(self.transport, run.run_id, t, path, ref.certificate,
                                                         run.path("sealed"))
        relay = self.relay_address
        grant = None
        if self.coordinator.relay:  # the operator's relay carries only what the coordinator granted
            grant = self.coordinator.stub.GrantRelay(cpb.RelayGrantRequest(
                run_id=run.run_id, purpose=t.purpose, index=t.index, receiver=t.receiver), timeout=CONTROL_TIMEOUT)
        sent = relaying.put(relay, self.transport, run.run_id, t, sealed, counter, cancelled=run.ended.is_set,
                            grant=grant)
        sent.route, sent.relay, sent.sealed_bytes, sent.sealed_sha256 = "relayed", relay, sealed_bytes, sealed_sha
        return sent

    @property
    def relay_address(self) -> str:
        """The relay this site sends sealed payloads to: the one the coordinator names in its
        registration reply, else the coordinator itself."""
        if self.coordinator is None:
            return ""
        return self.coordinator.relay or self.coordinator.address

    # -- receiving through the relay ---------------------------------------------------------------
    def relay_ready(self, notice: peer_pb2.RelayNotice) -> str:
        """``Peer.RelayReady``: the envelope of a transfer into this site waits at a relay. Starts
        fetching it in the background (once: a second notice while it runs, or after the payload
        was kept, has no effect). Returns "fetching" or "held". Raises ``TransferError`` (no such
        run, a transfer not planned into this site from that sender)."""
        h = common_pb2.TransferHeader(run_id=notice.run_id, hop=notice.index, sender=notice.sender,
                                      purpose=notice.purpose, total_bytes=max(1, notice.sealed_bytes),
                                      sha256=notice.sealed_sha256)
        check_header_fields(h)
        try:  # answered at once: the size is checked against the run's cap in the fetch's thread
            run, t, dest = self._check_transfer(h, None, check_cap=False)
        except _Duplicate:
            return "held"
        key = (run.run_id, sent_key(t))
        with self._lock:
            if key in self._fetching:
                return "fetching"
            self._fetching.add(key)
        threading.Thread(target=self._fetch_relayed, args=(run, t, notice, key), daemon=True,
                         name=f"fetch-{run.run_id}-{sent_key(t)}").start()
        return "fetching"

    def _fetch_relayed(self, run: Run, t: common_pb2.PlannedTransfer, notice: peer_pb2.RelayNotice, key) -> None:
        """Download, open and keep a relayed payload; retried (the daemons' backoff) while the
        relay cannot be reached, until the run ends or the daemon stops. A payload that fails
        its checks (signature, decryption, digest, schema) is refused: logged, reported as the
        run's failure at this site, and its envelope left at the relay."""
        relay = notice.relay or self.relay_address
        rkey = relay_pb2.RelayKey(run_id=run.run_id, purpose=t.purpose, index=t.index, receiver=self.name)
        sealed = run.path("relay-in") / f"{sent_key(t).replace(':', '-')}.sealed"
        dest = run.destination(t)
        counter = [0]
        try:
            self._check_cap(run, notice.sealed_bytes - SEAL_OVERHEAD)
            for delay in backoff_delays():
                if run.ended.is_set() or self.stop.is_set() or dest.exists():
                    return
                try:
                    if not (sealed.exists() and sha256_file(sealed) == notice.sealed_sha256):
                        relaying.fetch(relay, self.transport, rkey, t.sender, sealed, notice.sealed_bytes,
                                       notice.sealed_sha256, counter)
                    break
                except (grpc.RpcError, TransferError) as exc:
                    msg = status_message(exc) if isinstance(exc, grpc.RpcError) else exc.message
                    log.warning("run %s: fetching %s %d from the relay at %s failed (%s); retrying in %.1f s",
                                run.run_id, purposes.said(t.purpose), t.index, relay, msg, delay)
                    self.stop.wait(delay)
            plain = dest.parent / f".{dest.name}.relayed.part"
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                relaying.open_envelope(self.transport, sealed, plain, run.run_id, t)
                size, sha = plain.stat().st_size, sha256_file(plain)
                self._check_model_bytes(run.assignment, plain.read_bytes(), t.purpose)
                if dest.exists():  # the same transfer arrived directly meanwhile
                    plain.unlink(missing_ok=True)
                    return
                plain.replace(dest)
            except (SealError, ValueError) as exc:
                plain.unlink(missing_ok=True)
                raise RuntimeError(f"refused the relayed {purposes.said(t.purpose)} {t.index} from {t.sender}: {exc}") from exc
            self._kept(run, t, dest, size, sha, route="relayed", relay_wire_bytes=counter[0])
            sealed.unlink(missing_ok=True)
            try:
                relaying.discard(relay, self.transport, rkey)
            except grpc.RpcError as exc:  # the relay drops the run's envelopes when it ends anyway
                log.info("run %s: the relay did not discard the envelope: %s", run.run_id, status_message(exc))
        except Exception as exc:  # noqa: BLE001 - a background thread says so and fails its run
            log.error("run %s: %s", run.run_id, exc)
            self._set_state(run, "failed", str(exc))
            if self.coordinator is not None:
                try:
                    self.coordinator.call("ReportFailure", cpb.FailureReport(run_id=run.run_id, site=self.name,
                                                                             error=str(exc)), retry_for=300, stop=self.stop)
                except grpc.RpcError as rpc_exc:
                    log.error("could not report the failure: %s", status_message(rpc_exc))
        finally:
            with self._lock:
                self._fetching.discard(key)

    def _pause(self, run: Run, seconds: float) -> None:
        """Wait up to ``seconds`` between delivery attempts; back early when the daemon stops,
        the run is rerouted or the coordinator ends it."""
        until = time.monotonic() + seconds
        while not (self.stop.is_set() or run.rerouted.is_set() or run.ended.is_set()):
            left = until - time.monotonic()
            if left <= 0:
                return
            self.stop.wait(min(left, 0.25))

    def _resolve(self, to: common_pb2.SiteRef) -> common_pb2.SiteRef:
        """``to`` at the address its daemon last registered with the coordinator (it may have
        come back elsewhere); ``to`` itself when the coordinator cannot say. Under TLS the
        receiver's certificate must still name ``to.name``: a wrong address cannot impersonate."""
        if self.coordinator is None:
            return to
        try:
            now = self.coordinator.stub.ResolveSite(cpb.ResolveSiteRequest(name=to.name), timeout=CONTROL_TIMEOUT)
        except grpc.RpcError as exc:
            log.debug("could not resolve %s: %s", to.name, status_message(exc))
            return to
        if now.address and now.address != to.address:
            log.info("%s moved from %s to %s", to.name, to.address, now.address)
            return common_pb2.SiteRef(name=to.name, address=now.address)
        return to

    def _is_revoked(self, name: str) -> bool:
        return self.revocations is not None and self.revocations.revoked_name(name) is not None

    def _revoked(self, name: str, run: Run, t: common_pb2.PlannedTransfer, deadline: float, delay: float) -> bool:
        """True (after a pause) when ``name`` is revoked: nothing is sent to it; the coordinator
        routes the run around it, and the reroute ends the wait (``_deliver`` finds ``t`` off
        the plan). Raises ``RuntimeError`` past ``deadline`` (monotonic seconds)."""
        if not self._is_revoked(name):
            return False
        if time.monotonic() + delay > deadline:
            raise RuntimeError(f"cannot deliver to {name}: its certificate was "
                               f"{self.revocations.revoked_name(name).describe()}")
        log.warning("run %s: not sending %s %d to %s: its certificate was revoked; waiting for the coordinator "
                    "to route around it", run.run_id, purposes.said(t.purpose), t.index, name)
        self._pause(run, delay)
        if self.stop.is_set():
            raise RuntimeError("daemon stopping")
        return True

    @staticmethod
    def _still_planned(run: Run, t: common_pb2.PlannedTransfer) -> bool:
        return any(p == t for p in run.assignment.transfers)

    # -- rerouting --------------------------------------------------------------------------------------
    def reroute(self, r: peer_pb2.RerouteRequest) -> str:
        """Take a new part of the run's plan from the coordinator (idempotent per route version).

        The assignment's transfers, peers and visits are replaced and persisted. A site that had
        finished (its model delivered to a site that then stayed down) starts again from its
        outgoing model, which it still holds. Raises ``LookupError`` (unknown run) or
        ``ValueError`` (a stale or inconsistent route).
        """
        run = self.runs.get(r.run_id)
        if run is None:
            raise LookupError(f"unknown run {r.run_id!r}")
        with self._route_lock:
            a = run.assignment
            if r.route_version <= a.route_version:
                return run.state  # already applied
            self._check_part(a.order, a.rounds or 1, r.transfers, r.peers, r.visits)
            new = peer_pb2.Assignment()
            new.CopyFrom(a)
            for name in ("transfers", "peers", "visits"):
                new.ClearField(name)
                getattr(new, name).extend(getattr(r, name))
            new.route_version = r.route_version
            run.save_assignment(new)
            hops = ", ".join(f"hop {t.index} {t.sender}->{t.receiver}" for t in r.transfers
                             if t.purpose == common_pb2.CHAIN_HOP) or "none"
            log.info("run %s: rerouted (v%d): visits %s, hops %s; skipped %s", r.run_id, r.route_version,
                     list(r.visits), hops, ", ".join(r.skipped) or "none")
            run.rerouted.set()
            run.wake.set()
            restart = run.state in ("done", "failed") and any(
                (run.visit_dir(v) / "outgoing.safetensors").exists() for v in run.visits)
        if restart:
            self._set_state(run, "sending", "rerouted")
            self._start_worker(run)
        return run.state

    def end_run(self, run_id: str, status: str, reason: str = "", cancelled_by: str = "") -> tuple[str, int]:
        """The coordinator says the run is over (``status`` "finished", "failed" or "cancelled"
        (stopped by ``cancelled_by``); idempotent).

        A run still active here (this site was routed around, or the run failed elsewhere)
        moves to the terminal state "ended": a worker waiting for a model stops waiting, a
        training stops at the end of its epoch, a delivery stops retrying, and a Handoff for the
        run is refused. A run that is done or failed here keeps its state. Either way the
        partial files of transfers that will never complete (``transfer.partial_path``) are
        removed; the models held (received, outgoing, final) stay. The first notice is persisted
        (``Run.run_status``, ``run_ended``: what ``peer prune`` goes by). After a cancellation the
        site reports nothing more for the run (not even its state "ended").

        Returns ``(state, removed_bytes)``. Raises ``LookupError`` for an unknown run.
        """
        run = self.runs.get(run_id)
        if run is None:
            raise LookupError(f"unknown run {run_id!r}")
        with self._route_lock:
            newly = run.state in ACTIVE and not run.ended.is_set()
            if newly:
                run.ended.set()
                run.wake.set()
            first_notice = not run.run_status
            if first_notice:
                run.run_status, run.run_ended = status, time.time()
        why = f"cancelled by {cancelled_by or 'the operator'}" if status == "cancelled" else f"run {status} at the coordinator"
        if newly:
            self._set_state(run, "ended", why + (f": {reason}" if reason else ""), force=True,
                            report=status != "cancelled")
        elif first_notice and run.folder.is_dir():
            run.save()
        self.jobs.drop(run_id)  # a worker started ahead for the run is not needed any more
        self.refused_streams.forget(run_id)
        removed = sum(remove_partials(folder) for folder in
                      {run.folder, run.path("uploads"), run.path("relay-in"),
                       *(run.visit_dir(v) for v in range(1, (run.assignment.rounds or 1) + 1))}
                      if folder.is_dir())
        if removed:
            log.info("run %s: removed %d bytes of partial transfers", run_id, removed)
        return run.state, removed

    # -- evaluation and status ------------------------------------------------------------------------
    def final_model_path(self, run_id: str, sha256: str) -> Path:
        """The run's final model held here. Raises ``LookupError`` when there is none (or another)."""
        run = self.runs.get(run_id)
        if run is None:
            raise LookupError(f"unknown run {run_id!r}")
        path = run.final_model
        if not path.exists():
            raise LookupError(f"this site holds no final model of run {run_id}")
        have = sha256_file(path)
        if sha256 and have != sha256:
            raise LookupError(f"the final model held here has sha256 {have}, not {sha256}")
        return path

    def evaluate(self, run_id: str, sha256: str) -> peer_pb2.EvaluateReply:
        """Accuracy, metrics and aggregate statistics of the run's final model on this site's test
        split (``fedrelay.scoring``): the ``evaluate`` job on a worker (waiting for a host slot like
        any job: at most that many evaluations at once on one machine). The reply names the run
        and the model's SHA-256 and, under TLS, is signed with this site's key
        (``fedrelay/signing.py``): the coordinator records only a verified one. Raises
        ``LookupError`` (no such final model here) or what the job raises."""
        path = self.final_model_path(run_id, sha256)
        sha256 = sha256 or sha256_file(path)
        a = self.runs[run_id].assignment
        started = time.time()
        req = {"op": "evaluate", "model": str(path), "spec": self._spec(a), "class_index": list(a.class_index)}
        if privacy.enabled(a.params):  # the site's spent (epsilon, delta), from every visit's book
            req.update(params=run_params.to_dict(a.params), privacy_books=[
                str(p) for p in sorted(self.runs[run_id].folder.glob(f"**/{privacy.BOOK}"))])
        answer = self.jobs.run(EvaluateJob.from_dict(req), cancelled=self.stop.is_set)
        correct, total = answer["correct"], answer["total"]
        reply = peer_pb2.EvaluateReply(site=self.name, correct=correct, test_samples=total, run_id=run_id,
                                       sha256=sha256, accuracy=correct / total if total else 0.0,
                                       seconds=time.time() - started, metrics=answer.get("metrics") or {},
                                       stats_json=json.dumps(answer.get("stats") or {}, separators=(",", ":")))
        signer = signing.signer_for(self.transport)  # TLS: signed with this site's key for the ledger
        return signer.sign(reply) if signer is not None else reply

    def status(self) -> peer_pb2.PeerStatus:
        st = peer_pb2.PeerStatus(name=self.name, address=self.address, device=self.device, version=__version__,
                                 instance=self.instance)
        st.started = self.started
        if self.coordinator is not None:
            st.coordinator = self.coordinator.address
            st.last_registered = self.coordinator.last_registered
            st.registration_error = self.coordinator.registration_error
        for run in list(self.runs.values()):
            if run.state not in ACTIVE and not run.folder.exists():
                self.runs.pop(run.run_id, None)  # its files were pruned (`peer prune`) while the daemon ran
                continue
            st.runs.add(run_id=run.run_id, state=run.state, detail=run.detail)
        return st

    # -- helpers ----------------------------------------------------------------------------------------
    def _set_state(self, run: Run, state: str, detail: str, persist: bool = True, force: bool = False,
                   report: bool = True, quiet: bool = False) -> None:
        """Set the run's state (``persist``: and save it); log it and report it to the
        coordinator unless ``quiet`` (``report`` False: log only)."""
        if run.ended.is_set() and not force:
            return  # the coordinator ended the run: its state stays "ended"
        run.state, run.detail = state, detail
        if persist:
            run.save()
        if quiet:
            return
        log.info("run %s: %s%s", run.run_id, state, f" ({detail})" if detail else "")
        if report:
            self._report_state(run)

    def _report_state(self, run: Run) -> None:
        self.reporter.progress(cpb.ProgressReport(run_id=run.run_id, site=self.name, kind="state",
                                                  state=run.state, detail=run.detail))

    def _report(self, method: str, request) -> None:
        """Reports that the ledger must have are retried for up to 10 minutes."""
        if self.coordinator is not None:
            self.coordinator.call(method, request, retry_for=600, stop=self.stop)


def _offers(data) -> list[Offer]:
    """The site's offers: ``data`` as given (a list of ``Offer``), or, for a loaded
    ``fedrelay.SiteData`` (tests, the inline runner), an offer of the default task with its code's
    digest."""
    if isinstance(data, SiteData):
        inst = task_registry.find(task_registry.DEFAULT)
        from fedrelay.tasks.image_folder import ImageFolderTask

        return [Offer(name=inst.name, version=inst.version, sha256=inst.sha256, models=ImageFolderTask.models,
                      summary=data.summary())]
    return list(data)


class RunEnded(Exception):
    """The coordinator ended this run (``PeerNode.end_run``): its worker stops."""


class _Duplicate(Exception):
    """This exact payload was already accepted: args are (run, dest, sha256, hop)."""
