"""What every strategy shares: one site's local training, as plain functions.

No networking and no files: inputs are tensors, modules and states; outputs are
states (:mod:`fedrelay.peer.states`: a ``dict[str, torch.Tensor]`` as returned by
``nn.Module.state_dict()``, parameters, BatchNorm running statistics and the int64
``num_batches_tracked`` counters).  Every state returned here and by the strategies holds
new, contiguous CPU tensors, whatever ``device`` the training ran on.

Data: ``train`` and ``val`` are ``(inputs, labels)`` tuples: ``inputs`` a tensor ``N x ...``
(one row per sample, any dtype: uint8 pixels for the image-folder task), ``labels`` an int64
tensor ``N`` of class indices.  What the model sees, the loss and the optimiser are the run's
**task**'s (:class:`fedrelay.Task`: ``batch``, ``loss``, ``optimizer``); nothing here knows the
model's layers or the data's format.  The image-folder task converts each batch to float32
``/ 255`` with no normalisation and no augmentation; this differs from the reference code, which
trains CIFAR-10 with RandomCrop(32, pad 4) + HorizontalFlip.

This module holds the first site's :func:`warm_up` and :func:`run_site`, which warms up and
hands the visit to the strategy named by ``cfg.strategy`` in :mod:`fedrelay.registry`; the
pieces live in modules of their own, and are importable from here too: the config
(:mod:`fedrelay.peer.train_config`), seeds (:mod:`fedrelay.peer.determinism`), data checks
(:mod:`fedrelay.peer.site_data`), :func:`evaluate` (:mod:`fedrelay.peer.evaluation`), the one
training loop (:func:`train_one_epoch`, :func:`fit`: :mod:`fedrelay.peer.training_loop`) and a
visit's model pool (:func:`fill_pool`: :mod:`fedrelay.peer.model_pool`).  The strategies:

* ``"fedelmy"`` (:mod:`fedrelay.peer.strategies.fedelmy`): each site builds a model pool
  ``[m0, b1, ..., bS]``.  Model ``bj`` starts from the uniform average of the pool so far,
  trains ``E`` epochs with ``L - alpha*d1/a + beta*d2/a`` (``L`` the task's loss, cross-entropy
  by default) and keeps its best-validation
  epoch; the site sends the average of the pool (``train_pool``).
* ``"fedseq"`` (:mod:`fedrelay.peer.strategies.fedseq`): the baseline; one model trained
  from ``m0`` with plain CE for ``S*E`` epochs (``train_fedseq``), which is the model sent on.
* ``"fedelmy-kd"`` and ``"fedseq-kd"`` (fedrelay's extension, not the papers':
  :mod:`fedrelay.peer.strategies.fedelmy_kd`, :mod:`fedrelay.peer.strategies.fedseq_kd`):
  FedELMY's pool, or FedSeq's one model, trained with distillation towards the received model.

Determinism: given the same inputs, config and seed, every function here and in the
strategies returns bit-identical states on the CPU, and on a CUDA GPU once
:func:`use_deterministic_kernels` has been called (the peer daemon does so unless started
with ``--no-deterministic``; by default cuDNN and cuBLAS pick kernels whose float sums vary
from run to run).  A CPU and a GPU, or two GPU models, give different bits for the same run.
Batch order comes from ``torch.Generator`` objects seeded with :func:`derive_seed`.  The
global torch RNG is seeded only by :func:`run_site`, with
``torch.manual_seed(derive_seed(seed, "init"))`` immediately before the first site's model
is built (atomically with respect to ``build_model`` in other threads).  Every model
construction runs inside ``torch.random.fork_rng``, so the functions leave the caller's
global RNG state as they found it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence

from torch import Tensor, nn

from fedrelay import registry, tasks
from fedrelay.task import Task

from . import privacy as dp
from fedrelay.models import ModelSpec, build_seeded, expected_signature
from .determinism import derive_seed, seeded_generator, use_deterministic_kernels
from .evaluation import evaluate
from .model_pool import ModelCallback, fill_pool
from .site_data import check_data, check_outputs, check_site_data, train_val_split
from .states import State, build_loaded, check_signature, clone_state
from .train_config import TrainConfig
from .training_loop import EpochCallback, fit, train_one_epoch


__all__ = [
    "State",
    "TrainConfig",
    "derive_seed",
    "use_deterministic_kernels",
    "seeded_generator",
    "train_val_split",
    "check_data",
    "check_site_data",
    "check_outputs",
    "evaluate",
    "train_one_epoch",
    "fit",
    "warm_up",
    "fill_pool",
    "run_site",
]


def warm_up(model: nn.Module, train, val, cfg: TrainConfig, seed: int, device, on_epoch: EpochCallback | None = None,
            *, task: Task) -> State:
    """Warm up the first site's freshly built model (paper Algorithm 1 line 1).

    The task's plain loss (cross-entropy by default) for ``cfg.warmup_epochs`` epochs with the same optimiser, batching and
    selection as every strategy (:func:`fit`; reference-code §1.4); batch
    order from ``derive_seed(seed, "warmup")``.  ``model`` is built and seeded by the
    caller.  With ``warmup_epochs == 0`` it returns a copy of the model's state
    untouched.  ``on_epoch`` gets ``stage="warmup"``, ``model=0``.

    Returns:
        The selected state (new CPU tensors).

    Raises:
        ValueError: bad config or data.
    """
    cfg.validate()
    if cfg.warmup_epochs == 0:
        check_data(train, "train", allow_empty=False)
        return clone_state(model.state_dict())
    return fit(
        model, train, val, cfg, seeded_generator(derive_seed(seed, "warmup")), device,
        epochs=cfg.warmup_epochs, stage="warmup", index=0, on_epoch=on_epoch, task=task,
    )


# --------------------------------------------------------------------------- one site


def run_site(
    m0: Mapping[str, Tensor] | None,
    spec: ModelSpec,
    train,
    val,
    cfg: TrainConfig,
    seed: int,
    device,
    *,
    finished: Sequence[Mapping[str, Tensor]] = (),
    on_epoch: EpochCallback | None = None,
    on_model: ModelCallback | None = None,
    on_warmup: Callable[[State], None] | None = None,
    initial: Mapping[str, Tensor] | None = None,
    options: Mapping[str, object] | None = None,
) -> tuple[State, list[State]]:
    """Everything one site does (paper Algorithm 1, one iteration of the client loop).

    ``on_warmup(m0)`` is called with the first site's warm-up state as soon as it exists, so a
    daemon can persist it and, after a restart, pass it back as ``m0`` (same result).

    If ``m0`` is None (the first site): the model starts from ``initial`` when given (the
    run's shared initial model or a weights file, ``fedrelay.params.INITS``), else
    ``torch.manual_seed(derive_seed(seed, "init"))`` and build it; then :func:`warm_up` it;
    the warm-up state is m0.  The
    seeding and construction happen inside ``torch.random.fork_rng`` (the caller's
    global RNG state is restored) and under the model zoo's construction lock, so a
    concurrent ``build_model`` in another thread cannot change the initialisation.
    Both strategies get the warm-up so that they spend the same local epochs (the
    reference repository has no FedSeq; reference-code §1.7).  A resumed
    first site re-runs the warm-up, which is deterministic; passing the warm-up state
    as ``m0`` instead gives the identical result.

    Then the strategy's ``train`` (:func:`fedrelay.registry.load`): ``"fedelmy"``:
    ``train_pool``, sending the pool average.  ``"fedseq"``: ``train_fedseq``, sending the
    trained model; its pool is ``[m0, trained]``.  For FedSeq ``on_model(1, trained)`` is
    called too, and ``finished`` may hold that one state to skip the training on resume.

    Args:
        seed: the site's seed, e.g. ``derive_seed(run_seed, "site", i)``.
        finished, on_epoch, on_model: see ``train_pool``
            (:mod:`fedrelay.peer.strategies.fedelmy`).
        options: the run's method options (``fedrelay.params.options``: typed, defaults
            filled), handed to a strategy whose registry entry declares options of its own as
            ``train(..., options=...)``; the built-in strategies declare none.

    A strategy whose ``train`` takes a ``received`` keyword gets ``received=True`` when ``m0``
    came from a predecessor and ``False`` at the first site (``m0`` is then the warm-up):
    ``fedelmy-kd`` and ``fedseq-kd`` distil towards a received model only.

    Returns:
        ``(model to send, pool)``: the final model of the chain when this is the last
        site.

    The run's task (``fedrelay.tasks.resolve(spec)``) gives the model, the batches, the loss
    and the optimiser; before any training its model is checked to map the site's inputs to
    ``K`` logits (:func:`check_outputs`).

    Raises:
        ValueError: bad config, data that do not fit ``spec``, states that do not fit
            ``spec``, a task model whose outputs do not fit the run's classes, a loss that is
            not a finite scalar.
    """
    cfg.validate()
    train, val = check_site_data(spec, train, val)
    task = tasks.resolve(spec)
    from_predecessor = m0 is not None  # before m0 is the warm-up's
    if m0 is None:
        if initial is not None:
            model = build_loaded(spec, initial)
        else:
            model = build_seeded(spec, derive_seed(seed, "init"))
        check_outputs(model, task, spec, train[0])
        if dp.current() is not None:
            dp.check_model(model, f"the model {spec.model!r} of task {spec.task!r}")
        m0 = warm_up(model, train, val, cfg, seed, device, on_epoch=on_epoch, task=task)
        del model
        if on_warmup is not None:
            on_warmup(m0)
    else:
        check_signature(m0, expected_signature(spec), "the received model")
        received = build_loaded(spec, m0)
        check_outputs(received, task, spec, train[0])
        if dp.current() is not None:
            dp.check_model(received, f"the model {spec.model!r} of task {spec.task!r}")
    mine = {"options": dict(options or {})} if registry.strategy(cfg.strategy).options else {}
    strategy_train = registry.load(cfg.strategy).train
    if "received" in inspect.signature(strategy_train).parameters:
        mine["received"] = from_predecessor
    return strategy_train(m0, spec, train, val, cfg, seed, device,
                          finished=finished, on_epoch=on_epoch, on_model=on_model, **mine)
