"""The torch side of a site's work, as jobs a worker process runs.

The daemon (``peer/node.py``) never imports torch nor task code: it describes each piece of work
as a typed request (``peer/worker_protocol.py``) and hands it to a worker (``peer/worker_main.py``, a
process started by ``peer/worker_pool.py``), which calls :func:`answer` here with the site's data as the run's task read it
(a :class:`fedrelay.SiteData`). Every file a job writes is written
atomically into the run's folder (the same files, names and contents the daemon wrote when it
trained in its own process), so that a daemon restarted after a crash carries on from the last
persisted step with the same final digest.

Jobs, their requests and answers (typed messages, ``peer/worker_protocol.py``):

* ``SchemaJob`` -> ``Schemas``: the torch-free payload schemas (``fedrelay.payload``: ``{name:
  [shape, dtype]}``) of a chain hop (the strategy's ``payload_schema``, else the model), of the
  run's model (a final copy) and of the extra tensors every upload of a star plan carries (names
  with the payload prefix; ``{}`` for a chain), see :func:`schema`.
* ``TrainJob`` -> ``Trained``: one visit's local training (``peer.training.run_site``), see :func:`train`.
* ``AggregateJob`` -> ``Aggregated``: a star plan's aggregation at the aggregating site, see :func:`aggregate`.
* ``EvaluateJob`` -> ``Evaluated``: a safetensors model on the site's test split, see :func:`evaluate`.

A job's ``spec`` is :meth:`fedrelay.ModelSpec.to_dict`; the task named there is loaded (its digest
checked against the pinned one) by ``fedrelay.tasks.resolve``. Progress goes through
``emit(event)``: an ``Epoch`` per finished epoch (the dict ``peer.training`` passes to
``on_epoch``). A job raises on failure (the worker answers it as an error; the daemon fails or
retries the run).

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

from fedrelay.peer.worker_protocol import (Aggregated, AggregateJob, Answer, Epoch, EvaluateJob, Evaluated, Job,
                                           ProtocolError, SchemaJob, Schemas, Trained, TrainJob, as_request)

Emit = Callable[[Epoch], None]


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


def schema(job: SchemaJob, data=None, device: str = "cpu", emit: Emit | None = None) -> Schemas:
    """The payload schemas of a run (see the module docstring). Raises ``ValueError`` for a
    spec the model zoo cannot build."""
    from fedrelay import registry
    from fedrelay.models import expected_signature

    spec = spec_from(job.spec)
    model = expected_signature(spec)
    custom = getattr(registry.load(job.strategy), "payload_schema", None)
    extras = {}
    if job.aggregator:
        from fedrelay.peer.aggregators import EXTRA

        found = registry.load_aggregator(job.aggregator).extras_schema(spec, job.options or {})
        extras = {EXTRA + k: v for k, v in found.items()}
    return Schemas(hop=_schema_json(custom(spec) if custom is not None else model), model=_schema_json(model),
                   extras=_schema_json(extras))


def _read_state(path: str | Path):
    from fedrelay.tensors import decode_state

    return decode_state(Path(path).read_bytes())


def initial_state(job: TrainJob | AggregateJob, spec):
    """The run's initial model as a state, where the run names one (``job.initial``):
    ``{"kind": "file", "path", "sha256"}`` (the weights file, its SHA-256 checked again as read,
    its tensors against the run's model), ``{"kind": "shared"}`` (built from
    ``derive_seed(job.seed, "init")``, the same at every site of a star plan). None otherwise (each site draws its own seeded init;
    a chain's first site keeps the draw it always made, so chain runs keep their digests).
    Raises ``ValueError``."""
    from fedrelay.tensors import decode_state
    from fedrelay.models import build_seeded, check_state

    init = job.initial or {}
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

        return build_seeded(spec, derive_seed(job.seed, "init")).state_dict()
    return None


def _config(job: TrainJob | AggregateJob):
    from fedrelay import params as run_params
    from fedrelay.peer.training import TrainConfig

    return TrainConfig(**run_params.train_config(job.params))


def _split(data, job: TrainJob | AggregateJob):
    from fedrelay.peer.training import derive_seed, train_val_split

    check_input(data, spec_from(job.spec))
    images, labels = data.tensors("train", job.class_index)
    return train_val_split(images, labels, seed=derive_seed(job.seed, "split", job.site))


def _on_epoch(emit: Emit | None, images: int = 0):
    def on_epoch(info: dict) -> None:
        if emit is not None:
            emit(Epoch(images=images, **{k: info.get(k) for k in ("stage", "model", "epoch", "epochs", "train_loss",
                                                                  "val_accuracy", "seconds")}))
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


def train(job: TrainJob, data, device: str, emit: Emit | None = None) -> Trained:
    """One visit's local training, as ``peer.training.run_site`` does it, files and all.

    ``job`` (``TrainJob``): ``spec``, ``params`` (``fedrelay.params`` dict), ``seed`` (the run's), ``site``
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

    Returns ``Trained`` (``pool``: the pool models trained). Raises what the training raises.
    """
    from fedrelay import privacy, registry
    from fedrelay.files import atomic_write
    from fedrelay.tensors import encode_state
    from fedrelay.peer import privacy as dp
    from fedrelay.peer.training import derive_seed, run_site

    spec, cfg = spec_from(job.spec), _config(job)
    folder = Path(job.folder)
    train_set, val = _split(data, job)
    m0 = None
    if job.received:
        m0 = _read_state(job.received)
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

    r, position = int(job.round), int(job.position)
    seed = derive_seed(job.seed, "site", position) if r == 1 else derive_seed(job.seed, "site", position,
                                                                                  "round", r)
    started = time.time()
    with dp.engaged(privacy.options(job.params), job.privacy_epochs, dp.Book(folder / dp.BOOK)):
        send, pool = run_site(m0, spec, train_set, val, cfg, seed, device, finished=finished,
                              on_epoch=_on_epoch(emit, len(train_set[1])), on_model=on_model,
                              on_warmup=on_warmup,
                              initial=initial_state(job, spec) if m0 is None else None, options=job.options)
    if job.aggregator:  # the upload: the model and what the aggregator needs besides
        from fedrelay.peer.aggregators import join_payload

        extras = registry.load_aggregator(job.aggregator).site_extras(send, spec, train_set, job.options, device)
        send = join_payload(send, extras)
    atomic_write(Path(job.outgoing), encode_state(send))
    return Trained(seconds=time.time() - started, pool=len(pool) - 1)


def aggregate(job: AggregateJob, data, device: str, emit: Emit | None = None) -> Aggregated:
    """A star plan's aggregation: ``job.uploads`` (``{site: payload path}``: this site's own
    upload and those that arrived) combined by ``job.aggregator`` (uploads in site-name order,
    so the result does not depend on arrival order), with this site's train/validation split
    (OFASD learns its coefficients there) and the run's initial model; the final model is
    checked against the run's model and written to ``job.final``.

    Returns ``Aggregated`` (``models``: the uploads combined). Raises what the aggregator
    raises, ``ValueError`` for a result that is not the run's model.
    """
    from fedrelay import registry
    from fedrelay.files import atomic_write
    from fedrelay.tensors import encode_state
    from fedrelay.peer.aggregators import Context, Upload, split_payload
    from fedrelay.models import check_state
    from fedrelay.peer.training import derive_seed

    spec, cfg = spec_from(job.spec), _config(job)
    module = registry.load_aggregator(job.aggregator)
    uploads = [Upload(site, *split_payload(_read_state(job.uploads[site]))) for site in sorted(job.uploads)]
    train_set, val = _split(data, job)
    ctx = Context(spec=spec, initial=initial_state(job, spec), train=train_set, val=val, cfg=cfg,
                  options=job.options, seed=derive_seed(job.seed, "aggregate"), device=device,
                  on_epoch=_on_epoch(emit))
    started = time.time()
    state = module.aggregate(uploads, ctx)
    check_state(state, spec)
    atomic_write(Path(job.final), encode_state(state))
    return Aggregated(seconds=time.time() - started, models=len(uploads))


def evaluate(job: EvaluateJob, data, device: str, emit: Emit | None = None) -> Evaluated:
    """The safetensors model ``job.model`` on the site's test split: ``Evaluated`` (top-1
    count; the site's exact metrics, built-in and the task's own; its aggregate statistics for
    the run's global figures: ``fedrelay.scoring``). In a DP run (``job.privacy_books``: the
    run's ``privacy.json`` files here; ``job.params``), ``stats["privacy"]`` is the (epsilon,
    delta) the site spent (``fedrelay.privacy``). A site without test samples answers 0 of 0,
    no metrics. Raises ``ValueError`` for a task
    metric that is not a finite number or takes a built-in metric's name."""
    import math

    import torch

    from fedrelay import scoring, tasks
    from fedrelay.models import build_model
    from fedrelay.peer.training import check_outputs

    started = time.time()
    spec = spec_from(job.spec)
    task = tasks.resolve(spec)
    check_input(data, spec)
    model = build_model(spec)
    model.load_state_dict(_read_state(job.model))
    model.to(device).eval()
    inputs, labels = data.tensors("test", job.class_index)
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
    positive = scoring.positive_index(list(job.class_index), task.positive_class)
    metrics, stats = scoring.site_metrics(scores_t.numpy(), labels.numpy(), k, positive, pred_t.numpy())
    if len(labels):
        own = task.metrics(scores_t.to(torch.float32), labels, list(job.class_index)) or {}
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
    if job.privacy_books:  # a DP run: what this site spent over all its training of the run
        from fedrelay import privacy
        from fedrelay.peer import privacy as dp

        spent = dp.spent(job.privacy_books, privacy.options(job.params)["delta"])
        if spent is not None:
            stats["privacy"] = spent
    return Evaluated(correct=correct, total=int(len(labels)), metrics=metrics, stats=stats,
                     seconds=time.time() - started)


JOBS: dict[type[Job], Callable] = {SchemaJob: schema, TrainJob: train, AggregateJob: aggregate,
                                   EvaluateJob: evaluate}


def answer(job: Job, data, device: str, emit: Emit | None = None) -> Answer:
    """Run ``job`` (one of :data:`JOBS`' types) on ``data`` (None for a ``SchemaJob``): its typed
    answer. Raises ``ProtocolError`` for a request that is no job, and what the job raises."""
    try:
        run_job = JOBS[type(job)]
    except KeyError:
        raise ProtocolError(f"{getattr(job, 'NAME', type(job).__name__)!r} is not a job") from None
    return run_job(job, data, device, emit)


def run(req: Job | dict, data, device: str, emit: Emit | None = None) -> dict:
    """:func:`answer` for a job or its JSON object (``peer/worker_protocol.py``): the answer's
    JSON object. Raises ``ProtocolError`` (a ``ValueError``) for an unknown op or a malformed
    request, and what the job raises."""
    return answer(as_request(req), data, device, emit).to_dict()
