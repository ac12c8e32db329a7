"""The peer's run state machine: assigned (waiting) -> receiving -> training -> sending
(-> distributing at the last site) -> done; "failed" when this site's work failed, "ended"
when the coordinator ended the run while this site was still working on it (``end_run``).

One ``PeerNode`` per daemon holds the site's data (decoded once) and its runs. Each run has a
folder in the state dir::

    runs/<run_id>/assignment.pb        the coordinator's Assignment (protobuf, our own message)
    runs/<run_id>/state.json           state, detail, transfers done, final digest
    runs/<run_id>/received.safetensors the predecessor's pool average (m0), once verified
    runs/<run_id>/warmup.safetensors   the first site's warm-up model (its m0)
    runs/<run_id>/pool/model-<j>.safetensors  each finished pool model
    runs/<run_id>/outgoing.safetensors the pool average to send (the final model at the last site)

Every file is written atomically, and the worker skips the steps whose results are on disk, so
a restarted daemon carries on with the same command (received models are not asked for again,
finished pool models are not trained again, an unsent model is sent).
"""

from __future__ import annotations

import json
import logging
import queue
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from fedrelay import __version__, wire
from fedrelay.peer.data import SiteData
from fedrelay.peer.transfer import (TransferError, check_header_fields, held_bytes, receive_model,
                                    remove_partials, send_model)
from fedrelay.v1 import common_pb2, coordinator_pb2 as cpb, coordinator_pb2_grpc, peer_pb2

log = logging.getLogger("fedrelay.peer")

DEFAULT_STALL_TIMEOUT = 60.0  # seconds
REROUTE_GRACE = 120.0  # seconds a final-model copy retries a refusal after a reroute (see _deliver)
ACTIVE = ("assigned", "receiving", "training", "sending", "distributing")
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
             grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED,
             grpc.StatusCode.DATA_LOSS, grpc.StatusCode.ABORTED, grpc.StatusCode.INTERNAL,
             grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED}


def backoff_delays(first: float = 0.5, cap: float = 15.0):
    """Exponential backoff with full jitter: 0.5 s, 1 s, 2 s, ... capped at ``cap`` seconds."""
    delay = first
    while True:
        yield random.uniform(0.5 * delay, delay)
        delay = min(cap, delay * 2)


class CoordinatorLink:
    """The peer's calls to the coordinator (whose certificate must name ``coordinator`` under
    TLS). Reports are retried until ``retry_for`` seconds pass."""

    def __init__(self, address: str, transport: wire.Transport = wire.INSECURE):
        self.address = address
        self._channel = transport.channel(address, expect=wire.COORDINATOR_IDENTITY)
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self._channel)

    def call(self, method: str, request, *, retry_for: float = 0.0, stop: threading.Event | None = None):
        deadline = time.monotonic() + retry_for
        for delay in backoff_delays():
            try:
                return getattr(self.stub, method)(request, timeout=wire.CONTROL_TIMEOUT)
            except grpc.RpcError as exc:
                if exc.code() not in RETRYABLE or time.monotonic() + delay > deadline:
                    raise
                log.warning("coordinator %s: %s failed (%s); retrying", self.address, method, wire.status_message(exc))
                if stop is None:
                    time.sleep(delay)
                elif stop.wait(delay):
                    raise

    def close(self) -> None:
        self._channel.close()


@dataclass
class Run:
    assignment: peer_pb2.Assignment
    folder: Path
    state: str = "assigned"
    detail: str = ""
    sent: list[str] = field(default_factory=list)   # receivers already holding our model
    final_sha256: str = ""
    received: threading.Event = field(default_factory=threading.Event)
    rerouted: threading.Event = field(default_factory=threading.Event)
    ended: threading.Event = field(default_factory=threading.Event)  # the coordinator ended the run (EndRun)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def run_id(self) -> str:
        return self.assignment.run_id

    @property
    def is_first(self) -> bool:
        """No predecessor: this site warms up the chain's first model (also after a reroute)."""
        return not self.assignment.HasField("predecessor")

    @property
    def is_last(self) -> bool:
        """No successor: this site's pool average is the final model (also after a reroute)."""
        return not self.assignment.HasField("successor")

    @property
    def last_site(self) -> str:
        return self.assignment.last_site or self.assignment.order[-1]

    def path(self, name: str) -> Path:
        return self.folder / name

    def save(self) -> None:
        doc = {"state": self.state, "detail": self.detail, "sent": self.sent, "final_sha256": self.final_sha256}
        wire.atomic_write(self.path("state.json"), json.dumps(doc, indent=1).encode())


PROGRESS_QUEUE = 1000  # progress reports a peer holds while the coordinator is slow or unreachable


class PeerNode:
    """A site's daemon logic, independent of gRPC plumbing (the servicer is a thin shell).

    ``training`` is ``fedrelay.peer.training``; it is imported lazily so that the daemon can
    answer status calls while torch loads.
    """

    def __init__(self, name: str, address: str, data: SiteData, state_dir: Path, device: str,
                 coordinator: CoordinatorLink | None, *, send_deadline: float = 1800.0,
                 start_workers: bool = True, transport: wire.Transport = wire.INSECURE,
                 stall_timeout: float = DEFAULT_STALL_TIMEOUT):
        if stall_timeout <= 0:
            raise ValueError("the stall timeout must be > 0 seconds")
        self.transport = transport
        self.stall_timeout = stall_timeout  # seconds without a message before a stream is dropped
        self.name = name
        self.address = address
        self.data = data
        self.state_dir = Path(state_dir)
        self.device = device
        self.coordinator = coordinator
        self.send_deadline = send_deadline
        self.start_workers = start_workers  # False: accept and store, but train nothing (tests)
        self.runs: dict[str, Run] = {}
        self._lock = threading.Lock()
        self._train_lock = threading.Lock()  # one training at a time on this site's hardware
        self._route_lock = threading.Lock()
        self._streams: dict[Path, _Stream] = {}  # destination -> the Handoff stream writing it
        self._tensors: dict[tuple, tuple] = {}
        self._progress: queue.Queue = queue.Queue(maxsize=PROGRESS_QUEUE)  # reports not yet sent
        self._progress_thread: threading.Thread | None = None
        self._progress_lock = threading.Lock()
        self.stop = threading.Event()
        self._load_runs()

    # -- persistence -----------------------------------------------------------------------------
    def _load_runs(self) -> None:
        for folder in sorted((self.state_dir / "runs").glob("*")):
            try:
                a = peer_pb2.Assignment.FromString((folder / "assignment.pb").read_bytes())
                doc = json.loads((folder / "state.json").read_text())
            except (OSError, ValueError) as exc:
                log.warning("ignoring unreadable run folder %s: %s", folder, exc)
                continue
            run = Run(a, folder, doc.get("state", "assigned"), doc.get("detail", ""),
                      doc.get("sent", []), doc.get("final_sha256", ""))
            if run.path("received.safetensors").exists() or run.is_first:
                run.received.set()
            if run.state == "ended":
                run.ended.set()
            self.runs[a.run_id] = run

    def resume(self) -> None:
        """Restart the workers of runs that were active when the daemon stopped."""
        for run in self.runs.values():
            if run.state in ACTIVE:
                log.info("resuming run %s (was %s)", run.run_id, run.state)
                self._start_worker(run)

    # -- coordinator calls -----------------------------------------------------------------------
    def assign(self, a: peer_pb2.Assignment) -> str:
        """Accept an assignment (idempotent). Raises ``ValueError`` when it cannot be run here."""
        if a.site != self.name:
            raise ValueError(f"assignment is for {a.site!r}, this peer is {self.name!r}")
        if not a.run_id or "/" in a.run_id or a.run_id.startswith("."):
            raise ValueError(f"invalid run id {a.run_id!r}")
        if a.chain_length < 2 or a.position >= a.chain_length or len(a.order) != a.chain_length:
            raise ValueError("inconsistent position, chain length and order")
        if a.order[a.position] != self.name:
            raise ValueError(f"order[{a.position}] is {a.order[a.position]!r}, not {self.name!r}")
        missing = [c for c in self.data.class_names if c not in set(a.class_index)]
        if missing:
            raise ValueError(f"this site's classes {missing} are not in the run's class index")
        shape = (a.model.in_channels, a.model.height, a.model.width)
        if shape != tuple(self.data.image_shape):
            raise ValueError(f"the run's images are {shape}, this site's are {tuple(self.data.image_shape)}")
        self._train_config(a).validate()
        with self._lock:
            run = self.runs.get(a.run_id)
            if run is not None:
                if run.assignment.route_version == 0 and run.assignment != a:
                    raise ValueError(f"run {a.run_id} was already assigned differently")
                return run.state
            folder = self.state_dir / "runs" / a.run_id
            folder.mkdir(parents=True, exist_ok=True)
            wire.atomic_write(folder / "assignment.pb", a.SerializeToString())
            run = Run(a, folder)
            if run.is_first:
                run.received.set()
            run.save()
            self.runs[a.run_id] = run
        self._report_state(run)
        self._start_worker(run)
        return run.state

    @staticmethod
    def _train_config(a: peer_pb2.Assignment):
        from fedrelay.peer.training import TrainConfig

        p = a.params
        return TrainConfig(strategy=p.strategy, models_per_site=p.models_per_site, local_epochs=p.local_epochs,
                           warmup_epochs=p.warmup_epochs, alpha=p.alpha, beta=p.beta, lr=p.lr,
                           batch_size=p.batch_size, weight_decay=p.weight_decay, selection=p.selection)

    @staticmethod
    def _spec(a: peer_pb2.Assignment):
        from fedrelay.peer.models import ModelSpec

        m = a.model
        return ModelSpec(arch=m.arch, in_channels=m.in_channels, image_size=(m.height, m.width),
                         num_classes=m.num_classes)

    # -- receiving --------------------------------------------------------------------------------
    def handoff(self, chunks, caller: str | None = None) -> peer_pb2.HandoffReceipt:
        """Receive a model stream from the peer whose certificate names ``caller`` (``None`` on a
        plaintext daemon: then only the header's ``sender`` is checked).

        Accepted only from the run's assigned predecessor (CHAIN_HOP, hop = this site's
        position) or its last site (FINAL_MODEL), whose certificate name must also be the
        header's ``sender``. A stream that sends nothing for ``stall_timeout`` seconds, or runs
        past ``wire.transfer_timeout`` of its declared size, is dropped (DEADLINE_EXCEEDED).

        Resume (issue #5): the bytes of a stream from that legitimate sender that broke, stalled
        or was superseded stay in the run folder (``transfer.partial_path``, one per
        destination), and a later stream with ``header.offset`` carries on from them
        (``transfer_offset`` tells the sender where); a refused stream leaves nothing.

        Replays: a transfer is taken once per (run, hop, SHA-256). The same transfer again (a
        retry by the legitimate sender, whose first receipt was lost) has no effect: nothing is
        read past the header, nothing is written, the run's state is unchanged, and the answer
        is the first receipt marked ``duplicate=True``, so the sender knows its model arrived. A
        different model for a transfer already taken is refused (ALREADY_EXISTS); the same bytes
        from anyone else are refused (PERMISSION_DENIED) before any check on the content.

        Raises ``TransferError`` (with the status to answer).
        """
        holder: dict = {}
        mine = _Stream()

        def check_header(h: common_pb2.TransferHeader) -> Path:
            try:
                run, dest = self._check_transfer(h, caller)
            except _Duplicate as dup:
                holder["duplicate"] = dup.args
                raise
            self._claim(dest, mine)
            holder["dest"] = dest
            holder["run"] = run
            if h.purpose == common_pb2.CHAIN_HOP:
                # In memory only: a refused stream leaves nothing changed on disk.
                holder["was"] = (run.state, run.detail)
                self._set_state(run, "receiving", f"from {h.sender}", persist=False)
            return dest

        def check_payload(data: bytes) -> None:
            self._check_model_bytes(holder["run"].assignment, data)

        watched = self._watched(chunks, mine.cancel)
        try:
            got = receive_model(watched, Path("/nonexistent"), check_header, check_payload, resumable=True)
        except _Duplicate:
            run, dest, sha, hop = holder["duplicate"]
            return peer_pb2.HandoffReceipt(run_id=run.run_id, hop=hop, receiver=self.name,
                                           received_bytes=dest.stat().st_size, sha256=sha, duplicate=True)
        except BaseException:
            run = holder.get("run")
            if run is not None and run.state == "receiving" and "was" in holder:
                self._set_state(run, *holder["was"], persist=False)
            raise
        finally:
            watched.close()
            self._release(mine)
        run = holder["run"]
        h = got.header
        if h.purpose == common_pb2.CHAIN_HOP:
            log.info("run %s: received hop %d from %s (%d bytes, sha256 %s)", run.run_id, h.hop, h.sender,
                     got.size, got.sha256[:12])
            run.received.set()
        else:
            run.final_sha256 = got.sha256
            run.save()
        return peer_pb2.HandoffReceipt(run_id=run.run_id, hop=h.hop, receiver=self.name,
                                       received_bytes=got.size, sha256=got.sha256)

    def _check_transfer(self, h: common_pb2.TransferHeader, caller: str | None) -> tuple[Run, Path]:
        """The checks of a transfer's header against the run (see ``handoff``; its fields were
        checked by ``transfer.check_header_fields``): returns (run, destination).
        Raises ``TransferError``, or ``_Duplicate(run, dest, sha256, hop)`` when this exact
        payload was already accepted."""
        run = self.runs.get(h.run_id)
        if run is None:
            raise TransferError(grpc.StatusCode.FAILED_PRECONDITION, f"no assignment for run {h.run_id!r} (yet)")
        if run.ended.is_set():
            raise TransferError(grpc.StatusCode.FAILED_PRECONDITION, f"run {h.run_id} was ended by the coordinator")
        a = run.assignment
        if caller is not None:
            expected = a.predecessor.name if h.purpose == common_pb2.CHAIN_HOP else run.last_site
            if h.purpose == common_pb2.CHAIN_HOP and run.is_first:
                expected = None
            if caller != expected:
                what = "predecessor" if h.purpose == common_pb2.CHAIN_HOP else "last site"
                raise TransferError(grpc.StatusCode.PERMISSION_DENIED,
                                    f"certificate identity {caller!r} is not this site's {what} in run {h.run_id}")
            if h.sender != caller:
                raise TransferError(grpc.StatusCode.PERMISSION_DENIED,
                                    f"header.sender {h.sender!r} is not the certificate identity {caller!r}")
        if h.purpose == common_pb2.CHAIN_HOP:
            if run.is_first or h.sender != a.predecessor.name:
                raise TransferError(grpc.StatusCode.PERMISSION_DENIED,
                                    f"{h.sender!r} is not this site's predecessor in run {h.run_id}")
            if h.hop != a.position:
                raise TransferError(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"hop {h.hop} does not end at this site (expected hop {a.position})")
            dest = run.path("received.safetensors")
        elif h.purpose == common_pb2.FINAL_MODEL:
            if h.sender != run.last_site or h.hop != 0:
                raise TransferError(grpc.StatusCode.PERMISSION_DENIED,
                                    f"{h.sender!r} is not the last site of run {h.run_id}")
            dest = run.path("final.safetensors")
        else:
            raise TransferError(grpc.StatusCode.INVALID_ARGUMENT, "unknown transfer purpose")
        cap = self._payload_cap(a)
        if h.total_bytes > cap:
            raise TransferError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"declared size {h.total_bytes} bytes exceeds this run's cap of {cap} bytes")
        if dest.exists():
            have = wire.sha256_file(dest)
            if have == h.sha256:
                raise _Duplicate(run, dest, have, h.hop)
            raise TransferError(grpc.StatusCode.ALREADY_EXISTS,
                                f"a different model was already accepted for this transfer (sha256 {have})")
        return run, dest

    def transfer_offset(self, h: common_pb2.TransferHeader, caller: str | None = None) -> peer_pb2.TransferOffsetReply:
        """How many bytes of the payload ``h`` describes this site holds from a broken stream.

        The same checks as ``handoff`` (only the legitimate sender gets an answer). Asking ends
        an older stream of the same transfer still open here (its sender has given up on it),
        so that the answer is final. Raises ``TransferError``.
        """
        check_header_fields(h)  # what receive_model checks first on a Handoff
        try:
            _, dest = self._check_transfer(h, caller)
        except _Duplicate:
            return peer_pb2.TransferOffsetReply(offset=h.total_bytes, complete=True)
        self._end_stream(dest)
        return peer_pb2.TransferOffsetReply(offset=min(held_bytes(dest, h.sha256), h.total_bytes))

    def _end_stream(self, dest: Path, wait: float = 10.0) -> None:
        """Close the stream into ``dest`` still open here, if any; its bytes are kept. Raises
        ``TransferError`` (ABORTED: retry) when it does not close within ``wait`` seconds."""
        with self._lock:
            old = self._streams.get(dest)
        if old is not None:
            old.cancel.set()
            if not old.done.wait(wait):
                raise TransferError(grpc.StatusCode.ABORTED, "an older stream of this transfer is still closing; retry")

    def _claim(self, dest: Path, mine: "_Stream") -> None:
        """Make ``mine`` the one stream writing into ``dest``: an older one (its sender gave up on
        it, e.g. after a link dropped) is ended first, keeping its bytes."""
        while True:
            self._end_stream(dest)
            with self._lock:
                if dest not in self._streams:
                    self._streams[dest] = mine
                    mine.dest = dest
                    return

    def _release(self, mine: "_Stream") -> None:
        with self._lock:
            if mine.dest is not None and self._streams.get(mine.dest) is mine:
                del self._streams[mine.dest]
        mine.done.set()

    def _watched(self, chunks, cancel: threading.Event | None = None):
        """``chunks``, read by a helper thread, with a watchdog: raises ``TransferError``
        (DEADLINE_EXCEEDED) when no message comes for ``stall_timeout`` seconds, or when the
        stream runs past ``wire.transfer_timeout`` of its declared size; ABORTED soon after
        ``cancel`` is set (a newer stream of the same transfer took over)."""
        q: queue.Queue = queue.Queue(maxsize=4)
        done = threading.Event()
        end = object()

        def pump() -> None:
            item = end
            try:
                for msg in chunks:
                    while not done.is_set():
                        try:
                            q.put(msg, timeout=0.5)
                            break
                        except queue.Full:
                            continue
                    if done.is_set():
                        return
            except BaseException as exc:  # noqa: BLE001 - the call ended (cancelled, broken)
                item = exc
            while not done.is_set():
                try:
                    q.put(item, timeout=0.5)
                    return
                except queue.Full:
                    continue

        threading.Thread(target=pump, name="handoff-reader", daemon=True).start()
        deadline = None
        last = time.monotonic()
        try:
            while True:
                if cancel is not None and cancel.is_set():
                    raise TransferError(grpc.StatusCode.ABORTED, "stream ended: a newer stream of this transfer took over")
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise TransferError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                        "stream dropped: slower than the transfer deadline")
                if now >= last + self.stall_timeout:
                    raise TransferError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                        f"stream dropped: the sender stalled (nothing for {self.stall_timeout:g} s)")
                limit = last + self.stall_timeout if deadline is None else min(deadline, last + self.stall_timeout)
                try:
                    item = q.get(timeout=max(0.0, min(0.25, limit - now)))
                except queue.Empty:
                    continue
                last = time.monotonic()
                if item is end:
                    return
                if isinstance(item, BaseException):
                    raise item
                if deadline is None and item.WhichOneof("kind") == "header":
                    deadline = time.monotonic() + wire.transfer_timeout(item.header.total_bytes)
                yield item
        finally:
            done.set()

    @staticmethod
    def _payload_cap(a: peer_pb2.Assignment) -> int:
        """Largest payload accepted for a run: 4 x the model's tensor bytes + 1 MiB of header."""
        from fedrelay.peer.models import state_bytes

        return 4 * state_bytes(PeerNode._spec(a)) + (1 << 20)

    def _check_model_bytes(self, a: peer_pb2.Assignment, data: bytes) -> None:
        """Parse a payload with safetensors and check it is the run's model. Raises ``ValueError``."""
        from fedrelay.peer.models import check_state

        check_state(wire.decode_state(data), self._spec(a))

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
                    log.error("could not report the failure: %s", wire.status_message(rpc_exc))

    def _work_steps(self, run: Run) -> None:
        outgoing = run.path("outgoing.safetensors")
        if not outgoing.exists():
            if not run.is_first and not run.received.is_set():
                self._set_state(run, "assigned", f"waiting for the model from {run.assignment.predecessor.name}")
                # A reroute may make this site the first (its predecessors stayed down).
                while not run.received.wait(1.0) and not run.is_first:
                    if self.stop.is_set():
                        return
                    if run.ended.is_set():
                        raise RunEnded(run.run_id)
            self._train(run, outgoing)
        sha = wire.sha256_file(outgoing)
        size = outgoing.stat().st_size
        while True:  # a reroute while delivering changes the successor, or makes this site the last
            a = run.assignment
            if run.is_last:
                run.final_sha256 = sha
                run.save()
                if not self._distribute(run, outgoing, sha, size):
                    continue
                self._report("ReportFinal", cpb.FinalReport(run_id=run.run_id, site=self.name, sha256=sha,
                                                            model_bytes=size))
                break
            # Hop h ends at the site in position h of the order (skipped positions have no hop).
            hop = list(a.order).index(a.successor.name)
            header = common_pb2.TransferHeader(run_id=run.run_id, hop=hop, sender=self.name,
                                               total_bytes=size, sha256=sha, purpose=common_pb2.CHAIN_HOP)
            self._set_state(run, "sending", f"hop {hop} to {a.successor.name}")
            if self._deliver(run, a.successor, header, outgoing):
                break
        self._set_state(run, "done", "")

    def _train(self, run: Run, outgoing: Path) -> None:
        from fedrelay.peer.data import train_val_split
        from fedrelay.peer.training import derive_seed, run_site

        a = run.assignment
        with self._train_lock:
            self._set_state(run, "training", "")
            spec, cfg = self._spec(a), self._train_config(a)
            images, labels = self._site_tensors("train", a.class_index)
            train, val = train_val_split(images, labels, seed=derive_seed(a.seed, "split", self.name))
            m0 = None
            if run.path("received.safetensors").exists():
                m0 = wire.decode_state(run.path("received.safetensors").read_bytes())
            elif run.path("warmup.safetensors").exists():  # a restarted first site: no second warm-up
                m0 = wire.decode_state(run.path("warmup.safetensors").read_bytes())
            pool_dir = run.path("pool")
            finished = []
            n_models = cfg.models_per_site if cfg.strategy == "fedelmy" else 1
            for j in range(1, n_models + 1):
                p = pool_dir / f"model-{j}.safetensors"
                if not p.exists():
                    break
                finished.append(wire.decode_state(p.read_bytes()))

            def on_model(j: int, state) -> None:
                wire.atomic_write(pool_dir / f"model-{j}.safetensors", wire.encode_state(state))

            def on_epoch(info: dict) -> None:
                if run.ended.is_set():  # stops the training at the end of this epoch
                    raise RunEnded(run.run_id)
                val_acc = info.get("val_accuracy")
                self._report_progress(cpb.ProgressReport(
                    run_id=run.run_id, site=self.name, kind="epoch", stage=info["stage"], model=info["model"],
                    epoch=info["epoch"], epochs=info["epochs"], train_loss=info["train_loss"],
                    val_accuracy=-1.0 if val_acc is None else val_acc, seconds=info["seconds"]))

            seed = derive_seed(a.seed, "site", a.position)
            started = time.time()
            send, pool = run_site(m0, spec, train, val, cfg, seed, self.device, finished=finished,
                                  on_epoch=on_epoch, on_model=on_model,
                                  on_warmup=lambda state: wire.atomic_write(run.path("warmup.safetensors"),
                                                                            wire.encode_state(state)))
            wire.atomic_write(outgoing, wire.encode_state(send))
            log.info("run %s: trained %d pool models in %.1f s", run.run_id, len(pool) - 1, time.time() - started)

    def _deliver(self, run: Run, to: common_pb2.SiteRef, header: common_pb2.TransferHeader, path: Path) -> bool:
        """Send ``path`` to ``to`` with retries (exponential backoff and jitter), then report it.

        Returns False, having sent nothing, when a reroute took ``to`` off this site's route
        meanwhile; True once delivered (or delivered before)."""
        key = to.name if header.purpose == common_pb2.CHAIN_HOP else f"final:{to.name}"
        if key in run.sent:
            return True
        version = run.assignment.route_version
        started = time.monotonic()
        deadline = started + self.send_deadline
        counter, attempts = [0], 0  # bytes put on the wire by every attempt; streams begun
        for delay in backoff_delays():
            if run.ended.is_set():
                raise RunEnded(run.run_id)
            if run.assignment.route_version != version and not self._still_routed(run, to, header):
                log.info("run %s: %s is no longer on this site's route; not sending to it", run.run_id, to.name)
                return False
            try:
                # Under TLS the receiver's certificate must name the site we mean to reach.
                attempts += 1
                sent = send_model(to.address, header, path, transport=self.transport, expect=to.name,
                                  counter=counter)
                break
            except grpc.RpcError as exc:
                if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    to = self._resolve(to)
                # A recipient of the final model may not know yet that a reroute made this site the
                # last: its refusal is retried for a while (the route reaches it within seconds).
                rerouting = (exc.code() == grpc.StatusCode.PERMISSION_DENIED and run.assignment.route_version > 0
                             and time.monotonic() - started < REROUTE_GRACE)
                if (exc.code() not in RETRYABLE and not rerouting) or time.monotonic() + delay > deadline:
                    raise RuntimeError(f"cannot deliver to {to.name} at {to.address}: {wire.status_message(exc)}") from exc
                log.warning("run %s: delivery to %s failed (%s); retrying in %.1f s", run.run_id, to.name,
                            wire.status_message(exc), delay)
                self._pause(run, delay)
                if self.stop.is_set():
                    raise RuntimeError("daemon stopping") from exc
                run.rerouted.clear()
        if sent.receipt.duplicate:  # a retry of a transfer that had arrived: acknowledged, no effect
            log.info("run %s: %s already held this model (sha256 %s)", run.run_id, to.name, header.sha256[:12])
        if sent.resumed_from:
            log.info("run %s: resumed the transfer to %s at byte %d of %d", run.run_id, to.name,
                     sent.resumed_from, sent.payload_bytes)
        purpose = header.purpose
        self._report("ReportHop", cpb.HopReport(
            run_id=run.run_id, hop=header.hop, purpose=purpose, sender=self.name, receiver=to.name,
            payload_bytes=sent.payload_bytes, wire_bytes=counter[0], sha256=header.sha256,
            started=sent.started, ended=sent.ended, attempts=attempts, resumed_from=sent.resumed_from))
        run.sent.append(key)
        run.save()
        return True

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
            now = self.coordinator.stub.ResolveSite(cpb.ResolveSiteRequest(name=to.name), timeout=wire.CONTROL_TIMEOUT)
        except grpc.RpcError as exc:
            log.debug("could not resolve %s: %s", to.name, wire.status_message(exc))
            return to
        if now.address and now.address != to.address:
            log.info("%s moved from %s to %s", to.name, to.address, now.address)
            return common_pb2.SiteRef(name=to.name, address=now.address)
        return to

    @staticmethod
    def _still_routed(run: Run, to: common_pb2.SiteRef, header: common_pb2.TransferHeader) -> bool:
        a = run.assignment
        if header.purpose == common_pb2.CHAIN_HOP:
            return a.HasField("successor") and a.successor.name == to.name
        return run.is_last and any(r.name == to.name for r in a.final_recipients)

    def _distribute(self, run: Run, path: Path, sha: str, size: int) -> bool:
        """Last site: copy the final model to every other site of the chain, for evaluation.
        False when a reroute changed the route meanwhile (the caller looks again)."""
        self._set_state(run, "distributing", "final model to every site")
        header = common_pb2.TransferHeader(run_id=run.run_id, hop=0, sender=self.name, total_bytes=size,
                                           sha256=sha, purpose=common_pb2.FINAL_MODEL)
        for ref in list(run.assignment.final_recipients):
            if not self._deliver(run, ref, header, path) and not run.is_last:
                return False
        return run.is_last

    # -- rerouting --------------------------------------------------------------------------------------
    def reroute(self, r: peer_pb2.RerouteRequest) -> str:
        """Take a new route for a run from the coordinator (idempotent per route version).

        The assignment's predecessor, successor, final recipients and last site are replaced
        and persisted. A site that had finished (its model delivered to a site that then stayed
        down) starts again from its outgoing model, which it still holds. Raises
        ``LookupError`` (unknown run) or ``ValueError`` (a stale or inconsistent route).
        """
        run = self.runs.get(r.run_id)
        if run is None:
            raise LookupError(f"unknown run {r.run_id!r}")
        with self._route_lock:
            a = run.assignment
            if r.route_version <= a.route_version:
                return run.state  # already applied
            order = set(a.order)
            for ref in [*([r.predecessor] if r.HasField("predecessor") else []),
                        *([r.successor] if r.HasField("successor") else []), *r.final_recipients]:
                if ref.name not in order or ref.name == self.name:
                    raise ValueError(f"{ref.name!r} cannot be a neighbour of {self.name} in run {r.run_id}")
            new = peer_pb2.Assignment()
            new.CopyFrom(a)
            new.ClearField("predecessor")
            new.ClearField("successor")
            del new.final_recipients[:]
            if r.HasField("predecessor"):
                new.predecessor.CopyFrom(r.predecessor)
            if r.HasField("successor"):
                new.successor.CopyFrom(r.successor)
            new.final_recipients.extend(r.final_recipients)
            new.last_site = r.last_site
            new.route_version = r.route_version
            wire.atomic_write(run.path("assignment.pb"), new.SerializeToString())
            run.assignment = new
            log.info("run %s: rerouted (v%d): predecessor %s, successor %s; skipped %s", r.run_id, r.route_version,
                     new.predecessor.name or "none (first)", new.successor.name or "none (last)",
                     ", ".join(r.skipped) or "none")
            run.rerouted.set()
            if run.is_first:
                run.received.set()
            restart = run.state in ("done", "failed") and run.path("outgoing.safetensors").exists()
        if restart:
            self._set_state(run, "sending", "rerouted")
            self._start_worker(run)
        return run.state

    def end_run(self, run_id: str, status: str, reason: str = "") -> tuple[str, int]:
        """The coordinator says the run is over (``status`` "finished" or "failed"; idempotent).

        A run still active here (this site was routed around, or the run failed elsewhere)
        moves to the terminal state "ended": a worker waiting for a model stops waiting, a
        training stops at the end of its epoch, a delivery stops retrying, and a Handoff for the
        run is refused. A run that is done or failed here keeps its state. Either way the
        partial files of transfers that will never complete (``transfer.partial_path``) are
        removed; the models held (received, outgoing, final) stay.

        Returns ``(state, removed_bytes)``. Raises ``LookupError`` for an unknown run.
        """
        run = self.runs.get(run_id)
        if run is None:
            raise LookupError(f"unknown run {run_id!r}")
        with self._route_lock:
            newly = run.state in ACTIVE and not run.ended.is_set()
            if newly:
                run.ended.set()
        if newly:
            self._set_state(run, "ended", f"run {status} at the coordinator" + (f": {reason}" if reason else ""),
                            force=True)
        removed = remove_partials(run.folder)
        if removed:
            log.info("run %s: removed %d bytes of partial transfers", run_id, removed)
        return run.state, removed

    # -- evaluation and status ------------------------------------------------------------------------
    def final_model_path(self, run_id: str, sha256: str) -> Path:
        """The run's final model held here. Raises ``LookupError`` when there is none (or another)."""
        run = self.runs.get(run_id)
        if run is None:
            raise LookupError(f"unknown run {run_id!r}")
        path = run.path("outgoing.safetensors" if run.is_last else "final.safetensors")
        if not path.exists():
            raise LookupError(f"this site holds no final model of run {run_id}")
        have = wire.sha256_file(path)
        if sha256 and have != sha256:
            raise LookupError(f"the final model held here has sha256 {have}, not {sha256}")
        return path

    def evaluate(self, run_id: str, sha256: str) -> peer_pb2.EvaluateReply:
        """Accuracy of the run's final model on this site's test split."""
        from fedrelay.peer.models import build_model
        from fedrelay.peer.training import evaluate

        path = self.final_model_path(run_id, sha256)
        a = self.runs[run_id].assignment
        started = time.time()
        model = build_model(self._spec(a))
        model.load_state_dict(wire.decode_state(path.read_bytes()))
        images, labels = self._site_tensors("test", a.class_index)
        correct, total = evaluate(model.to(self.device), images, labels, device=self.device) if len(labels) else (0, 0)
        return peer_pb2.EvaluateReply(site=self.name, correct=correct, test_samples=total,
                                      accuracy=correct / total if total else 0.0, seconds=time.time() - started)

    def status(self) -> peer_pb2.PeerStatus:
        st = peer_pb2.PeerStatus(name=self.name, address=self.address, device=self.device, version=__version__)
        for run in self.runs.values():
            st.runs.add(run_id=run.run_id, state=run.state, detail=run.detail)
        return st

    # -- helpers ----------------------------------------------------------------------------------------
    def _site_tensors(self, split: str, class_index) -> tuple:
        key = (split, tuple(class_index))
        if key not in self._tensors:
            self._tensors[key] = self.data.tensors(split, list(class_index))
        return self._tensors[key]

    def _set_state(self, run: Run, state: str, detail: str, persist: bool = True, force: bool = False) -> None:
        if run.ended.is_set() and not force:
            return  # the coordinator ended the run: its state stays "ended"
        run.state, run.detail = state, detail
        if persist:
            run.save()
        log.info("run %s: %s%s", run.run_id, state, f" ({detail})" if detail else "")
        self._report_state(run)

    def _report_state(self, run: Run) -> None:
        self._report_progress(cpb.ProgressReport(run_id=run.run_id, site=self.name, kind="state",
                                                 state=run.state, detail=run.detail))

    def _report_progress(self, report: cpb.ProgressReport) -> None:
        """Progress (epochs, state changes) is best effort and never blocks the caller: it is
        queued for one reporter thread, which gives each report one try of up to 5 s. A link to
        the coordinator that drops packets used to hold the training thread 5 s per epoch and a
        Handoff handler 5 s when a stream broke. When :data:`PROGRESS_QUEUE` reports are
        waiting, a new one is dropped (logged at debug level)."""
        if self.coordinator is None:
            return
        try:
            self._progress.put_nowait(report)
        except queue.Full:
            log.debug("progress report dropped: %d reports are waiting", PROGRESS_QUEUE)
            return
        with self._progress_lock:
            if self._progress_thread is None:
                self._progress_thread = threading.Thread(target=self._progress_loop, name="progress", daemon=True)
                self._progress_thread.start()

    def _progress_loop(self) -> None:
        while True:
            report = self._progress.get()
            try:
                self.coordinator.stub.ReportProgress(report, timeout=5.0)
            except grpc.RpcError as exc:
                log.debug("progress report lost: %s", wire.status_message(exc))
            finally:
                self._progress.task_done()

    def _report(self, method: str, request) -> None:
        """Reports that the ledger must have are retried for up to 10 minutes."""
        if self.coordinator is not None:
            self.coordinator.call(method, request, retry_for=600, stop=self.stop)


class RunEnded(Exception):
    """The coordinator ended this run (``PeerNode.end_run``): its worker stops."""


class _Duplicate(Exception):
    """This exact payload was already accepted: args are (run, dest, sha256, hop)."""


class _Stream:
    """One open Handoff stream into a destination: ``cancel`` asks it to end (keeping its
    bytes); ``done`` is set once it has."""

    def __init__(self):
        self.cancel = threading.Event()
        self.done = threading.Event()
        self.dest: Path | None = None

