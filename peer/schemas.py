"""A run's payload schemas: what a hop, an upload and a final model of the run must hold
(``fedrelay.payload``), asked of a worker once per model, strategy and aggregator options, and
kept in memory and in ``state_dir/schemas/``; the payload cap they give, and the check of a
payload against them before anything is kept.
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

from fedrelay import params as run_params, payload, registry, transfer_bounds
from fedrelay.files import atomic_write
from fedrelay.peer.assignment import job_spec
from fedrelay.peer.worker_protocol import SchemaJob
from fedrelay.v1 import common_pb2, peer_pb2


class PayloadSchemas:
    """The payload schemas of the runs of one site (``state_dir``: the site's state dir; ``jobs``:
    its job runner, ``peer/worker_pool.py``)."""

    def __init__(self, state_dir: Path, jobs):
        self.state_dir = Path(state_dir)
        self.jobs = jobs
        self.known: dict[str, dict] = {}  # run's schema key -> payload schemas (see of)
        self.waits: dict[str, threading.Event] = {}  # schema keys a warm worker is asked for

    @staticmethod
    def request(a: peer_pb2.Assignment) -> tuple[SchemaJob, str]:
        """The schema job for run ``a`` (``peer/jobs.py``) and its cache key."""
        strategy = registry.strategy(a.params.strategy)
        opts = run_params.options(run_params.to_dict(a.params)) if strategy.aggregator else {}
        req = {"op": "schema", "spec": job_spec(a), "strategy": strategy.name, "aggregator": strategy.aggregator,
               "options": opts}
        return SchemaJob.from_dict(req), hashlib.sha256(json.dumps(req, sort_keys=True).encode()).hexdigest()[:32]

    def keep(self, key: str, answer: dict) -> dict:
        """Keep a schema job's ``answer`` under ``key`` (in memory, and on disk once)."""
        found = {k: answer[k] for k in ("hop", "model", "extras")}
        path = self.state_dir / "schemas" / f"{key}.json"
        if not path.exists():
            atomic_write(path, json.dumps(found, sort_keys=True).encode())
        self.known[key] = {k: {n: (tuple(sd[0]), sd[1]) for n, sd in v.items()} for k, v in found.items()}
        return self.known[key]

    def of(self, a: peer_pb2.Assignment) -> dict:
        """The run's payload schemas (``fedrelay.payload``): ``{"hop", "model", "extras"}`` (see
        ``peer/jobs.py``'s ``schema``), asked of a worker once per model, strategy and
        aggregator options (a warm worker asks ahead) and kept in memory and in
        ``state_dir/schemas/`` (a restarted daemon asks no worker again). Raises ``ValueError``
        when no worker can say."""
        req, key = self.request(a)
        if key in self.known:
            return self.known[key]
        try:
            return self.keep(key, json.loads((self.state_dir / "schemas" / f"{key}.json").read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            pass
        asked = self.waits.get(key)
        if asked is not None:  # a warm worker is being asked: its answer comes within seconds
            asked.wait(120.0)
            if key in self.known:
                return self.known[key]
        try:
            answer = self.jobs.run(req)
        except Exception as exc:  # noqa: BLE001 - any failure: the payload cannot be checked
            kind, _, message = str(exc).partition(": ")
            raise ValueError(f"the run's model cannot be used here: {message or exc}") from exc
        return self.keep(key, answer)

    def ask_ahead(self, a: peer_pb2.Assignment):
        """What a worker started ahead for run ``a`` should be asked (``jobs.warm``'s prefetch:
        the schema job, unless known or already asked), and a function to call when no worker
        was started after all (it releases whoever waits for the answer)."""
        req, key = self.request(a)
        prefetch, asked = [], None
        if key not in self.known and key not in self.waits:
            asked = self.waits[key] = threading.Event()

            def keep(answer: dict | None) -> None:
                try:
                    if answer is not None:
                        self.keep(key, answer)
                finally:
                    self.waits.pop(key, None)
                    asked.set()
            prefetch = [(req, keep)]

        def not_started() -> None:
            if asked is not None:
                self.waits.pop(key, None)
                asked.set()
        return prefetch, not_started

    def payload_cap(self, a: peer_pb2.Assignment) -> int:
        """Largest payload accepted for a run: 4 x (the model's tensor bytes + the aggregator's
        extra tensors' bytes) + 1 MiB of header (``fedrelay.limits.payload_cap``)."""
        schemas = self.of(a)
        return transfer_bounds.payload_cap(payload.payload_bytes(schemas["model"]) + payload.payload_bytes(schemas["extras"]))

    def check_model_bytes(self, a: peer_pb2.Assignment, data: bytes, purpose: int) -> None:
        """Parse a payload with safetensors' numpy API and check it against its schema before
        anything is kept (``fedrelay.payload.check_payload``, no torch): a hop's against the
        strategy's ``payload_schema`` (default: the run's model), an upload's against the model
        plus its aggregator's extra tensors (names, shapes, dtypes), a final copy's against the
        run's model. No NaN or Inf anywhere. Raises ``ValueError``."""
        schemas = self.of(a)
        if purpose == common_pb2.CHAIN_HOP:
            expected = schemas["hop"]
        elif purpose == common_pb2.UPLOAD:
            expected = {**schemas["model"], **schemas["extras"]}
        else:
            expected = schemas["model"]
        payload.check_payload(data, expected)
