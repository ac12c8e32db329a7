"""The worker process (issue 13, item 2): ``python -m fedrelay.peer.worker``, the process that
imports torch and holds a site's pixels, so that the daemon need not. Started by the daemon with
``subprocess`` (``peer/workers.py``: never fork, the daemon has gRPC threads); it exits when its
stdin closes (the daemon ended it, or died), its memory (GPU memory too) going with it.

Protocol: one JSON object per line. Requests on stdin, answers on stdout (stderr: log lines):

* ``{"op": "prepare", "data": DIR, "device": "cpu"|"cuda:N", "deterministic": bool}`` first:
  imports torch and the training code, sets the device's kernels as the daemon did
  (``training.use_deterministic_kernels``; torch's thread settings are left at their defaults,
  as in the daemon), decodes the site folder, pays the first optimiser's one-time cost;
  answers ``{"event": "ready", "seconds": S, "train": N, "test": N}``.
* ``{"op": "schema", "spec": SPEC, "strategy": NAME}``: a chain hop's payload schema
  (the strategy's ``payload_schema`` or the run's model) as ``fedrelay.payload`` names it;
  answers ``{"event": "schema", "schema": {name: [shape, dtype]}, "bytes": B}``.
* ``{"op": "evaluate", "model": PATH, "spec": SPEC, "class_index": [...]}``: accuracy of a
  safetensors model on the site's test split; answers ``{"event": "evaluated", "correct": C,
  "total": T, "seconds": S}``.

``SPEC`` is ``{"arch", "in_channels", "height", "width", "num_classes"}``. A request that fails
answers ``{"event": "error", "error": "Type: message"}`` and the worker goes on; an unreadable
line ends it with exit code 2.

Not built yet: the training job (``peer/node.py`` still trains in the daemon).
"""

from __future__ import annotations

import json
import sys
import time


def _spec(d: dict):
    from fedrelay.peer.models import ModelSpec

    return ModelSpec(arch=d["arch"], in_channels=int(d["in_channels"]),
                     image_size=(int(d["height"]), int(d["width"])), num_classes=int(d["num_classes"]))


class _Worker:
    def __init__(self) -> None:
        self.data = None
        self.device = "cpu"

    def prepare(self, req: dict) -> dict:
        started = time.time()
        import torch

        from fedrelay.peer.data import load_site
        from fedrelay.peer.training import use_deterministic_kernels

        self.device = req.get("device", "cpu")
        if req.get("deterministic", True):
            use_deterministic_kernels(self.device)
        self.data = load_site(req["data"])
        torch.optim.Adam([torch.zeros(1, requires_grad=True)])  # as the daemon's _warm_up_imports
        return {"event": "ready", "seconds": time.time() - started,
                "train": self.data.num_samples("train"), "test": self.data.num_samples("test")}

    def schema(self, req: dict) -> dict:
        from fedrelay import payload, registry
        from fedrelay.peer.models import expected_signature

        spec = _spec(req["spec"])
        module = registry.load(req["strategy"]) if req.get("strategy") else None
        custom = getattr(module, "payload_schema", None)
        schema = payload.schema_from_torch(custom(spec) if custom is not None else expected_signature(spec))
        return {"event": "schema", "schema": {k: [list(s), d] for k, (s, d) in schema.items()},
                "bytes": payload.payload_bytes(schema)}

    def evaluate(self, req: dict) -> dict:
        from pathlib import Path

        from fedrelay import wire
        from fedrelay.peer.models import build_model
        from fedrelay.peer.training import evaluate

        if self.data is None:
            raise RuntimeError("evaluate before prepare")
        started = time.time()
        model = build_model(_spec(req["spec"]))
        model.load_state_dict(wire.decode_state(Path(req["model"]).read_bytes()))
        images, labels = self.data.tensors("test", req["class_index"])
        correct, total = (evaluate(model.to(self.device), images, labels, device=self.device)
                          if len(labels) else (0, 0))
        return {"event": "evaluated", "correct": int(correct), "total": int(total), "seconds": time.time() - started}


def main() -> int:
    worker = _Worker()
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            op = req["op"]
        except (ValueError, KeyError, TypeError) as exc:
            print(f"worker: unreadable request: {exc}", file=sys.stderr, flush=True)
            return 2
        try:
            if op not in ("prepare", "schema", "evaluate"):
                raise ValueError(f"unknown op {op!r}")
            answer = getattr(worker, op)(req)
        except Exception as exc:  # noqa: BLE001 - the daemon gets every failure as an answer
            answer = {"event": "error", "error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
