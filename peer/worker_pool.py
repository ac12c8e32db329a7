"""The daemon's side of its worker processes (``peer/worker_main.py``), without torch.

``WorkerProcess`` is one ``python -m fedrelay.peer.worker_main`` child, started with ``subprocess``
(not fork: the daemon has gRPC threads), or forked from a template process that has imported
torch (``peer/forking.py``, ``peer serve --fork-workers``), and spoken to in the typed messages of
``peer/worker_protocol.py`` (one JSON object per line). A worker that exits or is
killed mid-request (a crash, SIGKILL, the kernel's out-of-memory killer: return code -9) raises
``WorkerDied``, whose message names the exit code or signal and the last lines the worker wrote
to stderr.

``WorkerPool`` is what ``PeerNode`` runs its jobs with (``peer/jobs.py``): each job gets a worker
that holds one of the host's worker slots (``peer/slots.py``: at most N workers at once on a
machine, shared by every site daemon there) and that exits after the job, its memory (GPU
memory too) going with it. A worker's start (Python, torch, the site's pixels decoded: seconds)
is hidden where the daemon knows work is coming: ``warm(run_id)`` starts the run's next worker
ahead (the predecessor asks for it as it starts training, ``Peer.Prepare``) if a slot is free
now, so a warm worker never waits for a slot and never blocks a job that needs one: a job that
finds no free slot closes the oldest warm worker of another run and takes its slot. A warm
worker is held for one (run, sender) (``Peer.Prepare`` comes from the run's planned sender), a
sender holds at most one at a time across runs, and one left unused for ``warm_timeout``
seconds (a timer), or whose run ends (``drop``), is closed. A job whose worker
dies is run once more on a new worker (its persisted steps are kept, so a training resumes);
a second death raises ``WorkerDied``.

``InlineRunner`` runs the same jobs in the calling process (it imports torch): for tests and
embedded use, where a ``PeerNode`` is built with the site's decoded data.
"""

from __future__ import annotations

import collections
import json
import logging
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from fedrelay.peer.worker_protocol import (Describe, Epoch, Error, Job, Prepare, ProtocolError, Request, SchemaJob,
                                           answer_from_dict, as_request)

__all__ = ["WorkerDied", "WorkerError", "JobCancelled", "WorkerProcess", "WorkerPool", "InlineRunner"]

log = logging.getLogger("fedrelay.peer")

EventCallback = Callable[[dict], None]
DEFAULT_WARM_TIMEOUT = 300.0  # seconds a warm worker waits for its job before it is closed


class WorkerDied(RuntimeError):
    """The worker process ended before answering; the message says how (code, signal, stderr)."""


class WorkerError(RuntimeError):
    """The worker answered a request with an error (``"Type: message"``), or with a line that is
    not the request's answer (``"ProtocolError: ..."``)."""


class JobCancelled(Exception):
    """``cancelled()`` turned true while a job ran: its worker was ended."""


class WorkerProcess:
    """One ``python -m fedrelay.peer.worker_main`` child. ``slot``: a ``peer.slots.Slot`` it holds
    (released by ``close``, or here if the worker cannot be started); ``stderr_lines``: how many
    of its last stderr lines to keep. ``fork``: fork it from the daemon's template process
    (``peer/forking.py``, ``peer serve --fork-workers``) instead of starting a new Python.
    Raises ``OSError`` when it cannot be started."""

    def __init__(self, slot=None, stderr_lines: int = 20, env: dict | None = None, fork: bool = False):
        self.slot = slot
        self._tail: collections.deque[str] = collections.deque(maxlen=stderr_lines)
        self._answers: queue.Queue = queue.Queue()
        self.prepared: dict | None = None  # the answer to Prepare (its JSON object), once given
        try:
            if fork:  # from the template that has imported torch (peer/forking.py)
                from fedrelay.peer.forking import ForkedProcess

                self.proc = ForkedProcess(env=env)
            else:
                self.proc = subprocess.Popen([sys.executable, "-m", "fedrelay.peer.worker_main"], stdin=subprocess.PIPE,
                                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
                                             env=env, close_fds=True)
        except BaseException:
            if slot is not None:
                slot.release()
            raise
        self._lock = threading.Lock()  # one request at a time
        threading.Thread(target=self._read_stdout, daemon=True, name=f"worker-{self.proc.pid}-out").start()
        threading.Thread(target=self._read_stderr, daemon=True, name=f"worker-{self.proc.pid}-err").start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read_stdout(self) -> None:
        """Answers into the queue: typed messages, a ``ProtocolError`` for a JSON object that is
        no answer; other lines (a library's print) go to the stderr tail."""
        for line in self.proc.stdout:
            try:
                obj = json.loads(line)
            except ValueError:
                obj = None
            if not isinstance(obj, dict):
                self._tail.append(f"(stdout) {line.rstrip()}")
                continue
            try:
                self._answers.put(answer_from_dict(obj))
            except ProtocolError as exc:
                self._answers.put(exc)
        self._answers.put(None)  # end of stream: the worker is gone

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:
            self._tail.append(line.rstrip())

    def reason(self) -> str:
        """How the worker ended: ``exit code N`` or ``killed by SIGNAME`` (``-9``: SIGKILL, e.g.
        the out-of-memory killer), and its last stderr lines."""
        code = self.proc.wait()
        if code < 0:
            name = signal.Signals(-code).name
            how = f"killed by {name}" + (" (out of memory?)" if code == -signal.SIGKILL else "")
        else:
            how = f"exit code {code}"
        tail = "; ".join(line for line in self._tail if line)[-1500:]
        return how + (f"; last stderr: {tail}" if tail else "")

    def request(self, req: Request | dict, timeout: float | None = None, on_event: EventCallback | None = None,
                cancelled: Callable[[], bool] | None = None, poll: float = 0.25) -> dict:
        """Send one request (``peer/worker_protocol.py``; a JSON object is checked as its
        message first) and wait for its answer: the answer's JSON object, checked against the
        message the request expects. Progress (``Epoch``) goes to ``on_event`` meanwhile, as its
        JSON object. Raises ``ProtocolError`` (a malformed request: nothing is sent),
        ``WorkerDied`` (the worker ended first), ``WorkerError`` (it answered an error, or not
        the request's answer), ``TimeoutError`` (no answer within ``timeout`` seconds) or
        ``JobCancelled`` (``cancelled()`` turned true: the worker is closed at once); what
        ``on_event`` raises ends the worker too and propagates."""
        req = as_request(req)
        until = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            try:
                self.proc.stdin.write(req.to_json() + "\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError):
                pass  # the answer queue says it ended
            while True:
                if cancelled is not None and cancelled():
                    self.close(grace=0)
                    raise JobCancelled(req.NAME)
                wait = poll if until is None else min(poll, until - time.monotonic())
                if wait <= 0:
                    raise TimeoutError(f"worker {self.pid} did not answer {req.NAME!r} in {timeout} s")
                try:
                    answer = self._answers.get(timeout=wait)
                except queue.Empty:
                    continue
                if isinstance(answer, Epoch):
                    if on_event is not None:
                        try:
                            on_event(answer.to_dict())
                        except BaseException:
                            self.close(grace=0)
                            raise
                    continue
                break
        if answer is None:
            self._answers.put(None)
            raise WorkerDied(f"worker process {self.pid} ended during {req.NAME!r}: {self.reason()}")
        if isinstance(answer, ProtocolError):
            raise WorkerError(f"ProtocolError: worker {self.pid}, asked {req.NAME!r}: {answer}")
        if isinstance(answer, Error):
            raise WorkerError(answer.error)
        if not isinstance(answer, req.ANSWER):
            raise WorkerError(f"ProtocolError: worker {self.pid} answered {answer.NAME!r} to {req.NAME!r}, not "
                              f"{req.ANSWER.NAME!r}")
        return answer.to_dict()

    def close(self, grace: float = 5.0) -> None:
        """End the worker (idempotent; stdin closed, then SIGTERM, then SIGKILL after ``grace``
        seconds each) and release its slot."""
        try:
            if self.proc.poll() is None:
                try:
                    self.proc.stdin.close()
                except OSError:
                    pass
                try:
                    self.proc.wait(timeout=max(grace, 0.5))
                except subprocess.TimeoutExpired:
                    self.proc.terminate()
                    try:
                        self.proc.wait(timeout=max(grace, 0.5))
                    except subprocess.TimeoutExpired:
                        self.proc.kill()
                        self.proc.wait()
        finally:
            if self.slot is not None:
                self.slot.release()


class _Warm:
    """A worker started ahead for a run, in a thread of its own: first asked the ``prefetch``
    requests (which need no data: they are answered as soon as torch is imported), then
    prepared. Each prefetch callback is called once, with the answer or None (failed)."""

    def __init__(self, worker: WorkerProcess, prepare: Prepare, prefetch: list[tuple[Job, Callable]],
                 sender: str = "", started: float | None = None):
        self.worker = worker
        self.sender = sender
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.started = time.monotonic() if started is None else started
        threading.Thread(target=self._prepare, args=(prepare, prefetch), daemon=True,
                         name=f"warm-{worker.pid}").start()

    def _prepare(self, prepare: Prepare, prefetch) -> None:
        pending = list(prefetch)
        try:
            while pending:
                req, on_result = pending[0]
                answer = self.worker.request(req)
                pending.pop(0)
                on_result(answer)
            self.worker.prepared = self.worker.request(prepare)
        except BaseException as exc:  # noqa: BLE001 - told to whoever takes the worker
            self.error = exc
        finally:
            for _, on_result in pending:
                on_result(None)
            self.done.set()


class WorkerPool:
    """Runs a site's jobs in worker processes (see the module docstring).

    ``data_dir``, ``device`` (``auto`` allowed), ``deterministic``: what each worker prepares.
    ``slots``: the host's ``peer.slots.HostSlots``. ``stop``: the daemon's stop event (a job
    waiting for a slot gives up when it is set). ``on_wait(message)``: told when a job waits for
    a slot (the site's state says so). ``fork``: fork workers from a template process that has
    imported torch once (``peer/forking.py``): milliseconds per worker instead of ~3 s of CPU,
    for ~680 MB more resident memory while the daemon runs.
    """

    def __init__(self, data_dir: str | Path, device: str, slots, *, deterministic: bool = True,
                 stop: threading.Event | None = None, warm_timeout: float = DEFAULT_WARM_TIMEOUT,
                 env: dict | None = None, fork: bool = False, extra_tasks: list[str] | tuple = (),
                 clock=time.monotonic, start_process: Callable[[object], WorkerProcess] | None = None):
        self.data_dir = str(Path(data_dir).resolve())
        self.device = device
        self.deterministic = deterministic
        self.slots = slots
        self.stop = stop or threading.Event()
        self.warm_timeout = warm_timeout
        self.env = env
        self.fork = fork
        self.extra_tasks = list(extra_tasks)  # module:attr tasks (peer serve --task), for the workers' lookups
        self.clock = clock
        # How a worker process is started on a host slot: a WorkerProcess, or a test's stand-in.
        self.start_process = start_process or (lambda slot: WorkerProcess(slot=slot, env=self.env, fork=self.fork))
        self._warm: dict[str, _Warm] = {}
        self._lock = threading.Lock()
        self.started = 0  # worker processes started (for tests and metrics)
        self.preempted = 0  # warm workers closed to give their slot to a job (for tests and the log)
        self._busy: set[WorkerProcess] = set()  # the workers running a job now (busy_pids)

    def _prepare_request(self, spec: dict | None = None) -> Prepare:
        """The worker's ``Prepare``: the site's data read by the task of ``spec`` (a job's
        ``spec``; the default task when None), its digest pinned to the run's."""
        task = {"task": spec["task"], "task_sha256": spec.get("task_sha256", "")} if spec else {}
        return Prepare(data=self.data_dir, device=self.device, deterministic=self.deterministic,
                       extra_tasks=list(self.extra_tasks), **task)

    def _new_worker(self, slot) -> WorkerProcess:
        self.started += 1
        return self.start_process(slot)

    def warm(self, run_id: str, prefetch: list[tuple[Job, Callable]] = (), spec: dict | None = None,
             sender: str = "") -> bool:
        """Start a worker ahead for ``run_id`` (whose model is ``spec``), asked for by its planned
        ``sender``, if the run has none, the sender holds none for another run, and a slot is
        free now; the ``prefetch`` jobs (e.g. the run's ``SchemaJob``) are asked first, their
        answers' JSON objects (None: failed) passed to their callbacks. The worker is closed after
        ``warm_timeout`` seconds unused. True when a worker was started (False: the callbacks
        are not called)."""
        self.expire()
        with self._lock:
            if run_id in self._warm or self.stop.is_set():
                return False
            if sender and any(w.sender == sender for w in self._warm.values()):
                log.info("run %s: %s already has a worker started ahead for another run here; not starting one",
                         run_id, sender)
                return False
            slot = self.slots.try_acquire()
            if slot is None:
                return False
            self._warm[run_id] = _Warm(self._new_worker(slot), self._prepare_request(spec), list(prefetch),
                                       sender=sender, started=self.clock())
        timer = threading.Timer(self.warm_timeout + 0.1, self.expire)
        timer.daemon = True
        timer.start()
        log.info("run %s: started a worker ahead of the model's arrival", run_id)
        return True

    def expire(self) -> None:
        """Close the workers started ahead that no job has used for ``warm_timeout`` seconds
        (``clock``'s); a timer calls it after each ``warm``."""
        now = self.clock()
        with self._lock:
            old = [k for k, w in self._warm.items() if now - w.started > self.warm_timeout]
            expired = [self._warm.pop(k) for k in old]
        for w in expired:
            log.info("closing a worker left unused for %.0f s", self.warm_timeout)
            w.worker.close()

    def _preempt(self, keep: str | None) -> bool:
        """Close the oldest warm worker of a run other than ``keep`` (its slot goes back to the
        host): a job never waits for a worker that was only started ahead. True when one was."""
        with self._lock:
            others = [(w.started, k) for k, w in self._warm.items() if k != keep]
            victim = self._warm.pop(min(others)[1]) if others else None
        if victim is None:
            return False
        self.preempted += 1
        log.info("closing a worker started ahead (for %s) to run a job now", victim.sender or "a run")
        victim.worker.close()
        return True

    def drop(self, run_id: str) -> None:
        """Close ``run_id``'s warm worker, if any (the run ended here)."""
        with self._lock:
            w = self._warm.pop(run_id, None)
        if w is not None:
            w.worker.close()

    def _take(self, run_id: str | None, on_wait: Callable[[str], None] | None) -> WorkerProcess:
        with self._lock:
            w = self._warm.pop(run_id, None) if run_id is not None else None
        if w is not None:
            w.done.wait()
            if w.error is None and w.worker.proc.poll() is None:
                return w.worker
            log.warning("the worker started ahead failed (%s); starting another", w.error)
            w.worker.close()
        slot = self.slots.try_acquire()
        while slot is None and self._preempt(run_id):
            slot = self.slots.try_acquire()
        if slot is None:
            if on_wait is not None:
                on_wait(f"waiting for a worker slot ({self.slots.count} on this host)")
            slot = self.slots.acquire(stop=self.stop)
            if slot is None:
                raise JobCancelled("the daemon is stopping")
        return self._new_worker(slot)

    def run(self, req: Job | dict, *, run_id: str | None = None, on_event: EventCallback | None = None,
            cancelled: Callable[[], bool] | None = None, on_wait: Callable[[str], None] | None = None,
            on_start: Callable[[], None] | None = None, retries: int = 1) -> dict:
        """Run the job ``req`` (``peer/jobs.py``; a typed job of ``peer/worker_protocol.py`` or
        its JSON object) on a worker (``run_id``'s warm one if any) that is closed afterwards:
        the answer's JSON object (``WorkerProcess.request``). ``on_start()`` is called once the
        worker is ready, as the job is sent; ``on_event`` gets each ``Epoch``'s JSON object. A
        worker that dies is replaced ``retries`` times. Raises ``ProtocolError`` (a malformed
        job), ``WorkerDied``, ``WorkerError`` (the job failed: its message), ``JobCancelled``
        (``cancelled()`` turned true, or the daemon stops while waiting for a slot), and what
        ``on_event`` raises."""
        job = as_request(req)
        if not isinstance(job, Job):
            raise ProtocolError(f"{job.NAME!r} is not a job")
        for attempt in range(retries + 1):
            worker = self._take(run_id, on_wait)
            with self._lock:
                self._busy.add(worker)
            try:
                if worker.prepared is None and not isinstance(job, SchemaJob):
                    worker.prepared = worker.request(self._prepare_request(job.spec), cancelled=cancelled)
                if on_start is not None:
                    on_start()
                return worker.request(job, on_event=on_event, cancelled=cancelled)
            except WorkerDied as exc:
                if attempt == retries:
                    raise
                log.warning("%s; running the %s job again on a new worker", exc, job.NAME)
            finally:
                with self._lock:
                    self._busy.discard(worker)
                worker.close()
        raise AssertionError("unreachable")

    def busy_pids(self) -> list[int]:
        """The process ids of the workers running this pool's jobs now (a fault drill or a test
        kills exactly those)."""
        with self._lock:
            return sorted(w.pid for w in self._busy)

    def check(self, tasks: dict[str, str]) -> dict:
        """The daemon's start-up check in one worker, closed afterwards: each of ``tasks``
        (name -> SHA-256 of its code) loaded, its ``describe`` of the site folder and a full
        ``load`` (every sample read once), and ``--device auto`` resolved: the worker's
        ``describe`` answer (``peer/worker_main.py``). Raises ``WorkerError``, ``WorkerDied`` or
        ``JobCancelled`` (the daemon stops while waiting for a slot)."""
        worker = self._take(None, None)
        try:
            return worker.request(Describe(data=self.data_dir, device=self.device, tasks=dict(tasks),
                                           extra_tasks=list(self.extra_tasks)))
        finally:
            worker.close()

    def close(self) -> None:
        """Close every warm worker (the daemon stops)."""
        with self._lock:
            warm, self._warm = list(self._warm.values()), {}
        for w in warm:
            w.worker.close(grace=1.0)


class InlineRunner:
    """``WorkerPool``'s interface, the jobs run in this process on ``data`` (a decoded
    ``peer.data.SiteData``). ``cancelled`` is checked at each progress event (the end of an
    epoch). Imports torch."""

    def __init__(self, data, device: str = "cpu"):
        from fedrelay.peer.worker_main import Worker

        self.worker = Worker(data, device)
        self.started = 0

    def warm(self, run_id: str, prefetch=(), spec: dict | None = None, sender: str = "") -> bool:
        for req, on_result in prefetch:
            on_result(self.run(req))
        return False

    def drop(self, run_id: str) -> None:
        pass

    def run(self, req: Job | dict, *, run_id: str | None = None, on_event: EventCallback | None = None,
            cancelled: Callable[[], bool] | None = None, on_wait=None, on_start=None, retries: int = 0) -> dict:
        job = as_request(req)
        if on_start is not None:
            on_start()

        def emit(event: Epoch) -> None:
            if cancelled is not None and cancelled():
                raise JobCancelled(job.NAME)
            if on_event is not None:
                on_event(json.loads(event.to_json()))  # as a worker's line would be

        try:
            return json.loads(self.worker.answer(job, emit).to_json())
        except JobCancelled:
            raise
        except Exception as exc:  # noqa: BLE001 - the same error a worker would answer
            raise WorkerError(f"{type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        pass
