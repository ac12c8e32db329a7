"""The worker process: ``python -m fedrelay.peer.worker``, the process that imports torch and
the run's task and holds a site's samples, so that the daemon need not. Started by the daemon with
``subprocess`` (``peer/workers.py``: never fork, the daemon has gRPC threads), it runs one job at a
time (``peer/jobs.py``) and exits when its stdin closes, at once, even in the middle of a job (the
daemon ended it, or died: its files are written atomically, so a restarted daemon resumes from the
last persisted step). Its memory, GPU memory included, goes with it.

Protocol: one JSON object per line. Requests on stdin, answers on stdout (stderr: log lines):

* ``{"op": "prepare", "data": DIR, "device": "cpu"|"cuda:N", "deterministic": bool, "task": NAME,
  "task_sha256": HEX, "extra_tasks": [module:attr ...]}`` first: sets the device's kernels as the
  daemon's settings say (``training.use_deterministic_kernels``; torch's thread settings are left
  at their defaults), loads the task (its digest checked against ``task_sha256`` when given) and
  reads the site folder with it (``Task.load``: e.g. a corrupt image is an error naming the file),
  pays the first optimiser's one-time cost; answers ``{"event": "ready", "seconds": S, "train": N,
  "test": N, "device": D}`` (``device``: ``auto`` resolved).
* ``{"op": "describe", "data": DIR, "device": ..., "tasks": {NAME: SHA256}, "extra_tasks": [...]}``:
  the daemon's start-up check: for each task, load it, ``describe`` the folder and ``load`` it
  (every sample read once), answering ``{"event": "described", "device": D, "seconds": S,
  "tasks": {NAME: {"summary": DataSummary dict, "models": [...], "positive_class": str|None}
  or {"error": "Type: message"}}}``.
* a job: ``{"op": "schema" | "train" | "aggregate" | "evaluate", ...}`` (``peer/jobs.py``); while it
  runs, progress lines ``{"event": "epoch", ...}``; then its answer.

A request that fails answers ``{"event": "error", "error": "Type: message"}`` and the worker goes
on; an unreadable line ends it with exit code 2.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
from pathlib import Path


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
    ``peer.workers.InlineRunner``, with data already decoded)."""

    def __init__(self, data=None, device: str = "cpu") -> None:
        self.data = data
        self.device = device

    def prepare(self, req: dict) -> dict:
        started = time.time()
        import torch

        from fedrelay import tasks
        from fedrelay.peer.training import use_deterministic_kernels

        self.device = resolve_device(req.get("device", "cpu"))
        if req.get("deterministic", True):
            use_deterministic_kernels(self.device)
        task = tasks.load(req.get("task") or tasks.DEFAULT, req.get("task_sha256", ""), req.get("extra_tasks", ()))
        self.data = _checked(task.load(Path(req["data"])))
        torch.optim.Adam([torch.zeros(1, requires_grad=True)])  # torch._dynamo's import, paid now
        return {"event": "ready", "seconds": time.time() - started, "device": self.device,
                "train": self.data.num_samples("train"), "test": self.data.num_samples("test")}

    def describe(self, req: dict) -> dict:
        """The daemon's start-up check of every task it offers (see the module docstring)."""
        started = time.time()
        from fedrelay import tasks

        self.device = resolve_device(req.get("device", "cpu"))
        root, found = Path(req["data"]), {}
        for name, sha256 in req["tasks"].items():
            try:
                task = tasks.load(name, sha256, req.get("extra_tasks", ()))
                summary = task.describe(root).check()
                data = _checked(task.load(root))
                if data.summary().to_dict()["classes"] != summary.to_dict()["classes"]:
                    raise ValueError(f"describe() and load() disagree on the classes and counts of {root}: "
                                     "fix the task's describe()")
                found[name] = {"summary": summary.to_dict(), "models": list(task.models),
                               "positive_class": task.positive_class}
                del data
            except Exception as exc:  # noqa: BLE001 - a task that cannot read the folder is reported, not fatal
                found[name] = {"error": f"{type(exc).__name__}: {exc}"}
        return {"event": "described", "device": self.device, "seconds": time.time() - started, "tasks": found}

    def handle(self, req: dict, emit) -> dict:
        """Answer one request (``prepare`` or a job). Raises what the job raises."""
        if req["op"] == "prepare":
            return self.prepare(req)
        if req["op"] == "describe":
            return self.describe(req)
        from fedrelay.peer import jobs

        if self.data is None and req["op"] != "schema":
            raise RuntimeError(f"{req['op']} before prepare")
        return jobs.run(req, self.data, self.device, emit)


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

    def emit(event: dict) -> None:
        sys.stdout.write(json.dumps(event) + "\n")
        sys.stdout.flush()

    while True:
        line = lines.get()
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            req["op"]
        except (ValueError, KeyError, TypeError) as exc:
            print(f"worker: unreadable request: {exc}", file=sys.stderr, flush=True)
            return 2
        try:
            answer = worker.handle(req, emit)
        except Exception as exc:  # noqa: BLE001 - the daemon gets every failure as an answer
            import traceback

            traceback.print_exc(file=sys.stderr)
            answer = {"event": "error", "error": f"{type(exc).__name__}: {exc}"}
        emit(answer)


if __name__ == "__main__":
    sys.exit(main())
