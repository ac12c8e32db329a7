"""The worker process (issue 13): ``python -m fedrelay.peer.worker``, the process that imports
torch and holds a site's pixels, so that the daemon need not. Started by the daemon with
``subprocess`` (``peer/workers.py``: never fork, the daemon has gRPC threads), it runs one job at a
time (``peer/jobs.py``) and exits when its stdin closes, at once, even in the middle of a job (the
daemon ended it, or died: its files are written atomically, so a restarted daemon resumes from the
last persisted step). Its memory, GPU memory included, goes with it.

Protocol: one JSON object per line. Requests on stdin, answers on stdout (stderr: log lines):

* ``{"op": "prepare", "data": DIR, "device": "cpu"|"cuda:N", "deterministic": bool}`` first:
  sets the device's kernels as the daemon's settings say (``training.use_deterministic_kernels``;
  torch's thread settings are left at their defaults), decodes the site folder (a corrupt image
  is an error naming the file), pays the first optimiser's one-time cost; answers ``{"event":
  "ready", "seconds": S, "train": N, "test": N, "device": D}`` (``device``: ``auto`` resolved).
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

        from fedrelay.peer.data import load_site
        from fedrelay.peer.training import use_deterministic_kernels

        self.device = resolve_device(req.get("device", "cpu"))
        if req.get("deterministic", True):
            use_deterministic_kernels(self.device)
        self.data = load_site(req["data"])
        torch.optim.Adam([torch.zeros(1, requires_grad=True)])  # torch._dynamo's import, paid now
        return {"event": "ready", "seconds": time.time() - started, "device": self.device,
                "train": self.data.num_samples("train"), "test": self.data.num_samples("test")}

    def handle(self, req: dict, emit) -> dict:
        """Answer one request (``prepare`` or a job). Raises what the job raises."""
        if req["op"] == "prepare":
            return self.prepare(req)
        from fedrelay.peer import jobs

        if self.data is None and req["op"] != "schema":
            raise RuntimeError(f"{req['op']} before prepare")
        return jobs.run(req, self.data, self.device, emit)


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
