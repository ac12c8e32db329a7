"""The torch side of a site's work, as jobs a worker process runs.

The daemon (``peer/node.py``) never imports torch nor task code: it describes each piece of work
as a JSON request and hands it to a worker (``peer/worker.py``, a process started by
``peer/workers.py``), which calls :func:`run` here with the site's data as the run's task read it
(a :class:`fedrelay.SiteData`). Every file a job writes is written
atomically into the run's folder (the same files, names and contents the daemon wrote when it
trained in its own process), so that a daemon restarted after a crash carries on from the last
persisted step with the same final digest.

Jobs (``req["op"]``), their requests and answers (JSON-able dicts):

* ``schema``: ``{spec, strategy, aggregator, options}`` -> ``{"hop": SCHEMA, "model": SCHEMA,
  "extras": SCHEMA}``, the torch-free payload schemas (``fedrelay.payload``: ``{name: [shape,
  dtype]}``) of a chain hop (the strategy's ``payload_schema``, else the model), of the run's model
  (a final copy) and of the extra tensors every upload of a star plan carries (names with the
  payload prefix; ``{}`` for a chain).
* ``train``: one visit's local training (``peer.training.run_site``), see :func:`train`.
* ``aggregate``: a star plan's aggregation at the aggregating site, see :func:`aggregate`.
* ``evaluate``: ``{model, spec, class_index}`` -> ``{"correct", "total", "metrics", "stats",
  "seconds"}``: a safetensors model on the site's test split, its top-1 count, its metrics and
  aggregate statistics (``fedrelay.scoring``, plus the task's own metrics); in a DP run
  (``privacy_books``: the run's ``privacy.json`` files here, ``params``), ``stats["privacy"]``:
  the (epsilon, delta) the site spent (``fedrelay.privacy``).

``SPEC`` is :meth:`fedrelay.ModelSpec.to_dict`; the task named there is loaded (its digest
checked against the pinned one) by ``fedrelay.tasks.resolve``. Progress goes through
``emit(event)``: ``{"event": "epoch", ...}`` per finished epoch (the dict
``peer.training`` passes to ``on_epoch``). A job raises on failure (the worker answers it as an
error; the daemon fails or retries the run).

A fault drill (or a test) can stop a ``train`` job at a known step instead of racing its
training: with ``FEDRELAY_HOLD_DIR`` set to a folder in the site daemon's environment, a job that
has persisted a step (``warmup``, then ``pool-1``, ``pool-2``, ...) and finds ``hold-<step>`` in
that folder writes ``held-<step>`` there and waits until ``hold-<step>`` is gone (see
:func:`hold_point`).
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Callable

Emit = Callable[[dict], None]


def spec_from(d: dict):
    """A :class:`fedrelay.ModelSpec` from a ``SPEC`` dict."""
    from fedrelay.task import ModelSpec

    return ModelSpec.from_dict(d)


def check_input(data, spec) -> None:
    """The site's data, as its task read it now, must have the input description the run's model
    was made for (the one the site registered). Raises ``ValueError``."""
    from fedrelay.task import canonical_json

    want = canonical_json({k: v for k, v in spec.input.items() if k != "stats"})
    have = canonical_json(data.input)
    if have != want:
        raise ValueError(f"this site's data for task {spec.task!r} are now described as {have}, the run's model "
                         f"expects {want}: the site's data changed since the daemon registered them; restart the "
                         "daemon")


def _schema_json(signature: dict) -> dict:
    from fedrelay import payload

    return {k: [list(s), d] for k, (s, d) in payload.schema_from_torch(signature).items()}


def schema(req: dict, data=None, device: str = "cpu", emit: Emit | None = None) -> dict:
    """The payload schemas of a run (see the module docstring). Raises ``ValueError`` for a
    spec the model zoo cannot build."""
    from fedrelay import registry
    from fedrelay.models import expected_signature

    spec = spec_from(req["spec"])
    model = expected_signature(spec)
    custom = getattr(registry.load(req["strategy"]), "payload_schema", None)
    extras = {}
    if req.get("aggregator"):
        from fedrelay.peer.aggregators import EXTRA

        found = registry.load_aggregator(req["aggregator"]).extras_schema(spec, req.get("options") or {})
        extras = {EXTRA + k: v for k, v in found.items()}
    return {"hop": _schema_json(custom(spec) if custom is not None else model), "model": _schema_json(model),
            "extras": _schema_json(extras)}


def _read_state(path: str | Path):
    from fedrelay.tensors import decode_state

    return decode_state(Path(path).read_bytes())


def initial_state(req: dict, spec):
    """The run's initial model as a state, where the run names one (``req["initial"]``):
    ``{"kind": "file", "path", "sha256"}`` (the weights file, its SHA-256 checked again as read,
    its tensors against the run's model), ``{"kind": "shared"}`` (built from
    ``derive_seed(req["seed"], "init")``, the same at every site of a star plan). None otherwise (each site draws its own seeded init;
    a chain's first site keeps the draw it always made, so chain runs keep their digests).
    Raises ``ValueError``."""
    from fedrelay.tensors import decode_state
    from fedrelay.models import build_seeded, check_state

    init = req.get("initial") or {}
    if init.get("kind") == "file":
        data = Path(init["path"]).read_bytes()
        if hashlib.sha256(data).hexdigest() != init["sha256"]:
            raise ValueError(f"the initial-weights file changed while being read (SHA-256 is not {init['sha256']})")
        state = decode_state(data)
        try:
            check_state(state, spec)
        except ValueError as exc:
            raise ValueError(f"the initial-weights file {init['sha256'][:12]}… does not fit the run's model: "
                             f"{exc}") from None
        return state
    if init.get("kind") == "shared":
        from fedrelay.peer.training import derive_seed

        return build_seeded(spec, derive_seed(req["seed"], "init")).state_dict()
    return None


def _config(req: dict):
    from fedrelay import params as run_params
    from fedrelay.peer.training import TrainConfig

    return TrainConfig(**run_params.train_config(req["params"]))


def _split(data, req: dict):
    from fedrelay.peer.training import derive_seed, train_val_split

    check_input(data, spec_from(req["spec"]))
    images, labels = data.tensors("train", req["class_index"])
    return train_val_split(images, labels, seed=derive_seed(req["seed"], "split", req["site"]))


def _on_epoch(emit: Emit | None, images: int = 0):
    def on_epoch(info: dict) -> None:
        if emit is not None:
            emit({"event": "epoch", "images": images, **{k: info.get(k) for k in
                  ("stage", "model", "epoch", "epochs", "train_loss", "val_accuracy", "seconds")}})
    return on_epoch


HOLD_ENV = "FEDRELAY_HOLD_DIR"


def hold_point(step: str) -> None:
    """Wait here while ``$FEDRELAY_HOLD_DIR/hold-<step>`` exists, having written ``held-<step>``
    beside it (a no-op when the variable is unset). ``step``: ``warmup`` or ``pool-<j>``, once
    that step's file is persisted, so that a site killed while held resumes after it. The
    worker ends as usual if its daemon ends it meanwhile."""
    root = os.environ.get(HOLD_ENV)
    if not root:
        return
    hold = Path(root) / f"hold-{step}"
    if hold.exists():
        (Path(root) / f"held-{step}").touch()
        while hold.exists():
            time.sleep(0.05)


def train(req: dict, data, device: str, emit: Emit | None = None) -> dict:
    """One visit's local training, as ``peer.training.run_site`` does it, files and all.

    ``req``: ``spec``, ``params`` (``fedrelay.params`` dict), ``seed`` (the run's), ``site``
    (this site's name: its train/validation split seed), ``class_index``, ``position`` and
    ``round`` (this visit's training seed is ``derive_seed(seed, "site", position)`` in round 1, a
    one-shot run's, and adds ``("round", r)`` in round r > 1), ``folder``
    (the visit's folder: ``warmup.safetensors``, ``pool/model-<j>.safetensors`` are persisted
    there as they are made and read back on a resumed visit), ``received`` (the hop's payload
    path, or None at the chain's first visit), ``outgoing`` (where the model to send is written),
    ``initial`` (:func:`initial_state`), and for a star plan ``aggregator`` and ``options`` (the
    upload then carries the aggregator's extra tensors, ``site_extras``). A run with DP options
    (``fedrelay.privacy``) trains with DP-SGD (``fedrelay.peer.privacy``): ``privacy_epochs`` is
    the site's DP epochs over the run (a target epsilon is spread over them), and the visit's
    steps are booked in the folder's ``privacy.json``.

    Returns ``{"event": "trained", "seconds": S, "pool": K}`` (K pool models trained). Raises
    what the training raises.
    """
    from fedrelay import privacy, registry
    from fedrelay.files import atomic_write
    from fedrelay.tensors import encode_state
    from fedrelay.peer import privacy as dp
    from fedrelay.peer.training import derive_seed, run_site

    spec, cfg = spec_from(req["spec"]), _config(req)
    folder = Path(req["folder"])
    train_set, val = _split(data, req)
    m0 = None
    if req.get("received"):
        m0 = _read_state(req["received"])
    elif (folder / "warmup.safetensors").exists():  # a restarted first site: no second warm-up
        m0 = _read_state(folder / "warmup.safetensors")
    pool_dir = folder / "pool"
    finished = []
    for j in range(1, registry.load(cfg.strategy).models_to_keep(cfg) + 1):
        p = pool_dir / f"model-{j}.safetensors"
        if not p.exists():
            break
        finished.append(_read_state(p))

    def on_model(j: int, state) -> None:
        atomic_write(pool_dir / f"model-{j}.safetensors", encode_state(state))
        hold_point(f"pool-{j}")

    def on_warmup(state) -> None:
        atomic_write(folder / "warmup.safetensors", encode_state(state))
        hold_point("warmup")

    r, position = int(req["round"]), int(req["position"])
    seed = derive_seed(req["seed"], "site", position) if r == 1 else derive_seed(req["seed"], "site", position,
                                                                                  "round", r)
    started = time.time()
    with dp.engaged(privacy.options(req["params"]), req.get("privacy_epochs", 0), dp.Book(folder / dp.BOOK)):
        send, pool = run_site(m0, spec, train_set, val, cfg, seed, device, finished=finished,
                              on_epoch=_on_epoch(emit, len(train_set[1])), on_model=on_model,
                              on_warmup=on_warmup,
                              initial=initial_state(req, spec) if m0 is None else None)
    if req.get("aggregator"):  # the upload: the model and what the aggregator needs besides
        from fedrelay.peer.aggregators import join_payload

        extras = registry.load_aggregator(req["aggregator"]).site_extras(send, spec, train_set, req["options"], device)
        send = join_payload(send, extras)
    atomic_write(Path(req["outgoing"]), encode_state(send))
    return {"event": "trained", "seconds": time.time() - started, "pool": len(pool) - 1}


def aggregate(req: dict, data, device: str, emit: Emit | None = None) -> dict:
    """A star plan's aggregation: ``req["uploads"]`` (``{site: payload path}``: this site's own
    upload and those that arrived) combined by ``req["aggregator"]`` (uploads in site-name order,
    so the result does not depend on arrival order), with this site's train/validation split
    (OFASD learns its coefficients there) and the run's initial model; the final model is
    checked against the run's model and written to ``req["final"]``.

    Returns ``{"event": "aggregated", "seconds": S, "models": N}``. Raises what the aggregator
    raises, ``ValueError`` for a result that is not the run's model.
    """
    from fedrelay import registry
    from fedrelay.files import atomic_write
    from fedrelay.tensors import encode_state
    from fedrelay.peer.aggregators import Context, Upload, split_payload
    from fedrelay.models import check_state
    from fedrelay.peer.training import derive_seed

    spec, cfg = spec_from(req["spec"]), _config(req)
    module = registry.load_aggregator(req["aggregator"])
    uploads = [Upload(site, *split_payload(_read_state(req["uploads"][site]))) for site in sorted(req["uploads"])]
    train_set, val = _split(data, req)
    ctx = Context(spec=spec, initial=initial_state(req, spec), train=train_set, val=val, cfg=cfg,
                  options=req["options"], seed=derive_seed(req["seed"], "aggregate"), device=device,
                  on_epoch=_on_epoch(emit))
    started = time.time()
    state = module.aggregate(uploads, ctx)
    check_state(state, spec)
    atomic_write(Path(req["final"]), encode_state(state))
    return {"event": "aggregated", "seconds": time.time() - started, "models": len(uploads)}


def evaluate(req: dict, data, device: str, emit: Emit | None = None) -> dict:
    """The safetensors model ``req["model"]`` on the site's test split: ``{"correct", "total",
    "metrics", "stats", "seconds"}`` (top-1 count; the site's exact metrics, built-in and the
    task's own; its aggregate statistics for the run's global figures: ``fedrelay.scoring``).
    A site without test samples answers 0 of 0, no metrics. Raises ``ValueError`` for a task
    metric that is not a finite number or takes a built-in metric's name."""
    import math

    import torch

    from fedrelay import scoring, tasks
    from fedrelay.models import build_model
    from fedrelay.peer.training import check_outputs

    started = time.time()
    spec = spec_from(req["spec"])
    task = tasks.resolve(spec)
    check_input(data, spec)
    model = build_model(spec)
    model.load_state_dict(_read_state(req["model"]))
    model.to(device).eval()
    inputs, labels = data.tensors("test", req["class_index"])
    scores, predictions = [], []
    if len(labels):
        check_outputs(model, task, spec, inputs)
        with torch.inference_mode():
            for start in range(0, int(labels.shape[0]), 512):
                logits = model(task.batch(inputs[start:start + 512].to(device), train=False))
                predictions.append(logits.argmax(dim=1).cpu())
                scores.append(torch.softmax(logits.to(torch.float64), dim=1).cpu())
    k = spec.num_classes
    scores_t = torch.cat(scores) if scores else torch.empty((0, k), dtype=torch.float64)
    pred_t = torch.cat(predictions) if predictions else torch.empty(0, dtype=torch.int64)
    positive = scoring.positive_index(list(req["class_index"]), task.positive_class)
    metrics, stats = scoring.site_metrics(scores_t.numpy(), labels.numpy(), k, positive, pred_t.numpy())
    if len(labels):
        own = task.metrics(scores_t.to(torch.float32), labels, list(req["class_index"])) or {}
        for name, value in own.items():
            if not isinstance(name, str) or not name or name in scoring.BUILTIN:
                raise ValueError(f"task {spec.task!r}: metrics() returned the name {name!r}: use a name of its own, "
                                 f"not one of {', '.join(scoring.BUILTIN)}")
            value = float(value)
            if not math.isfinite(value):
                raise ValueError(f"task {spec.task!r}: metric {name!r} is {value}, not a finite number")
            metrics[name] = value
    correct = int((pred_t == labels).sum()) if len(labels) else 0
    stats = stats.to_dict()
    if req.get("privacy_books"):  # a DP run: what this site spent over all its training of the run
        from fedrelay import privacy
        from fedrelay.peer import privacy as dp

        spent = dp.spent(req["privacy_books"], privacy.options(req["params"])["delta"])
        if spent is not None:
            stats["privacy"] = spent
    return {"event": "evaluated", "correct": correct, "total": int(len(labels)), "metrics": metrics,
            "stats": stats, "seconds": time.time() - started}


JOBS = {"schema": schema, "train": train, "aggregate": aggregate, "evaluate": evaluate}


def run(req: dict, data, device: str, emit: Emit | None = None) -> dict:
    """Run the job ``req["op"]`` (one of :data:`JOBS`). Raises ``ValueError`` for an unknown op,
    and what the job raises."""
    try:
        job = JOBS[req["op"]]
    except KeyError:
        raise ValueError(f"unknown job {req.get('op')!r}") from None
    return job(req, data, device, emit)
