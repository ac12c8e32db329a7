"""The worker process: ``python -m fedrelay.peer.worker_main``, the process that imports torch and
the run's task and holds a site's samples, so that the daemon need not. Started by the daemon with
``subprocess`` (``peer/worker_pool.py``: never fork, the daemon has gRPC threads), it runs one job at a
time (``peer/jobs.py``) and exits when its stdin closes, at once, even in the middle of a job (the
daemon ended it, or died: its files are written atomically, so a restarted daemon resumes from the
last persisted step). Its memory, GPU memory included, goes with it.

The protocol, its requests and answers, is described once, as typed messages, in
``peer/worker_protocol.py``: one JSON object per line, requests on stdin, answers on stdout
(stderr: log lines). ``Prepare`` first: sets the device's kernels as the daemon's settings say
(``training.use_deterministic_kernels``; torch's thread settings are left at their defaults),
loads the task (its digest checked against ``task_sha256`` when given) and reads the site folder
with it (``Task.load``: e.g. a corrupt image is an error naming the file; whatever the loader
raises becomes a ``DataError`` naming the task, the folder and that error), pays the first
optimiser's one-time cost; answers ``Ready``. ``Describe`` is the daemon's start-up check: for
each task, load it, ``describe`` the folder and ``load`` it (every sample read once), answering
``Described``. A job (``peer/jobs.py``) writes ``Epoch`` lines while it runs, then its answer.
A request that fails (a malformed one included) is answered ``Error`` and the worker goes on
(exit code 2: see ``peer/worker_protocol.py``).
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
from pathlib import Path

from fedrelay.peer.worker_protocol import (Answer, Describe, Described, Error, Prepare, Ready, Request, SchemaJob,
                                           as_request, request_from_dict)


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda:0`` when a GPU is usable, else ``cpu``. Raises ``ValueError`` for a
    device that does not exist here. (Imports torch: it runs in a worker, never the daemon.)"""
    import torch

    if device == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return device
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: no CUDA GPU is usable on this machine (use --device cpu)")
        index = int(device.split(":", 1)[1]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} GPU(s)")
        return f"cuda:{index}"
    raise ValueError(f"--device must be auto, cpu or cuda:N, not {device!r}")


class Worker:
    """A site's data and device, and the jobs run on them (also used in-process by
    ``peer.worker_pool.InlineRunner``, with data already decoded).

    :meth:`answer` takes and gives typed messages (``peer/worker_protocol.py``); :meth:`handle`,
    :meth:`prepare` and :meth:`describe` take a message or its JSON object and give the answer's
    JSON object (what the worker process writes)."""

    def __init__(self, data=None, device: str = "cpu") -> None:
        self.data = data
        self.device = device

    def prepare(self, req: Prepare | dict) -> dict:
        """``Prepare`` (see the module docstring): the ``Ready`` answer's JSON object."""
        return self.answer(req if isinstance(req, Prepare) else Prepare.from_dict(req)).to_dict()

    def describe(self, req: Describe | dict) -> dict:
        """The daemon's start-up check of every task it offers (see the module docstring): the
        ``Described`` answer's JSON object."""
        return self.answer(req if isinstance(req, Describe) else Describe.from_dict(req)).to_dict()

    def handle(self, req: Request | dict, emit=None) -> dict:
        """Answer one request (``Prepare``, ``Describe`` or a job): the answer's JSON object.
        Raises ``ProtocolError`` for a malformed request and what the job raises."""
        return self.answer(as_request(req), emit).to_dict()

    def answer(self, req: Request, emit=None) -> Answer:
        """Answer one typed request; ``emit(Epoch)`` is told a job's progress. Raises what the
        job raises, ``RuntimeError`` for a job (other than a schema) before ``Prepare``."""
        if isinstance(req, Prepare):
            return self._prepare(req)
        if isinstance(req, Describe):
            return self._describe(req)
        from fedrelay.peer import jobs

        if self.data is None and not isinstance(req, SchemaJob):
            raise RuntimeError(f"{req.NAME} before prepare")
        return jobs.answer(req, self.data, self.device, emit)

    def _prepare(self, req: Prepare) -> Ready:
        started = time.time()
        import torch

        from fedrelay import tasks
        from fedrelay.peer.training import use_deterministic_kernels
        from fedrelay.task import DataError

        self.device = resolve_device(req.device)
        if req.deterministic:
            use_deterministic_kernels(self.device)
        name, root = req.task or tasks.DEFAULT, Path(req.data)
        task = tasks.load(name, req.task_sha256, req.extra_tasks)
        try:
            self.data = _checked(task.load(root))
        except Exception as exc:  # noqa: BLE001 - the task's own code: say whose it is and what it raised
            raise DataError(f"task {name!r} cannot read {root}: {type(exc).__name__}: {exc}") from exc
        torch.optim.Adam([torch.zeros(1, requires_grad=True)])  # torch._dynamo's import, paid now
        return Ready(seconds=time.time() - started, device=self.device, train=self.data.num_samples("train"),
                     test=self.data.num_samples("test"))

    def _describe(self, req: Describe) -> Described:
        started = time.time()
        from fedrelay import tasks

        self.device = resolve_device(req.device)
        root, found = Path(req.data), {}
        for name, sha256 in req.tasks.items():
            try:
                task = tasks.load(name, sha256, req.extra_tasks)
                summary = task.describe(root).check()
                data = _checked(task.load(root))
                if data.summary().to_dict()["classes"] != summary.to_dict()["classes"]:
                    raise ValueError(f"describe() and load() disagree on the classes and counts of {root}: "
                                     "fix the task's describe()")
                found[name] = {"summary": summary.to_dict(), "models": list(task.models),
                               "positive_class": task.positive_class,
                               "augmentations": list(getattr(task, "augmentations", ()))}
                del data
            except Exception as exc:  # noqa: BLE001 - a task that cannot read the folder is reported, not fatal
                found[name] = {"error": f"{type(exc).__name__}: {exc}"}
        return Described(device=self.device, seconds=time.time() - started, tasks=found)


def _checked(data):
    """A task's ``load`` result, checked (it is the user's code): a ``fedrelay.SiteData``."""
    from fedrelay.task import DataError, SiteData

    if not isinstance(data, SiteData):
        raise DataError(f"the task's load() returned {type(data).__name__}, not a fedrelay.SiteData")
    if data.num_samples("train") == 0:
        raise DataError("the task's load() found no training sample")
    return data


def _read_stdin(lines: queue.Queue) -> None:
    for line in sys.stdin:
        lines.put(line)
    # stdin closed: the daemon ended this worker or died. Nothing is half-written (every file is
    # written atomically), so stop now, even in the middle of a job.
    os._exit(0)


def main() -> int:
    worker = Worker()
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_read_stdin, args=(lines,), daemon=True, name="stdin").start()

    def emit(event: Answer) -> None:
        sys.stdout.write(event.to_json() + "\n")
        sys.stdout.flush()

    while True:
        line = lines.get()
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            if not isinstance(obj["op"], str):
                raise TypeError(f"op is {obj['op']!r}")
        except (ValueError, KeyError, TypeError) as exc:
            print(f"worker: unreadable request: {exc}", file=sys.stderr, flush=True)
            return 2
        try:
            answer = worker.answer(request_from_dict(obj), emit)
        except Exception as exc:  # noqa: BLE001 - the daemon gets every failure (a malformed request too) as an answer
            import traceback

            traceback.print_exc(file=sys.stderr)
            answer = Error(error=f"{type(exc).__name__}: {exc}")
        emit(answer)


if __name__ == "__main__":
    sys.exit(main())
