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

Read top to bottom: the config, seeds, data checks, :func:`evaluate`, the one training
loop (:func:`train_one_epoch`, :func:`fit`), the first site's :func:`warm_up`, and
:func:`run_site`, which warms up and hands the visit to the strategy named by
``cfg.strategy`` in :mod:`fedrelay.registry`:

* ``"fedelmy"`` (:mod:`fedrelay.peer.strategies.fedelmy`): each site builds a model pool
  ``[m0, b1, ..., bS]``.  Model ``bj`` starts from the uniform average of the pool so far,
  trains ``E`` epochs with ``L - alpha*d1/a + beta*d2/a`` (``L`` the task's loss, cross-entropy
  by default) and keeps its best-validation
  epoch; the site sends the average of the pool (``train_pool``).
* ``"fedseq"`` (:mod:`fedrelay.peer.strategies.fedseq`): the baseline; one model trained
  from ``m0`` with plain CE for ``S*E`` epochs (``train_fedseq``), which is the model sent on.

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

import dataclasses
import hashlib
import math
import numbers
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from fedrelay import params, registry, tasks
from fedrelay.task import Task

from . import privacy as dp
from fedrelay.models import ModelSpec, build_seeded, expected_signature
from .states import State, build_loaded, check_signature, clone_state

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

Dataset = tuple[Tensor, Tensor]
EpochCallback = Callable[[dict], None]
ModelCallback = Callable[[int, State], None]
# A strategy's per-batch loss: ``regulariser(loss, params) -> loss``, from the task's loss of the
# batch (0-d, with gradient) and the model's parameters in ``model.parameters()`` order.
Regulariser = Callable[[Tensor, list[Tensor]], Tensor]


# --------------------------------------------------------------------------- config


@dataclass(frozen=True)
class TrainConfig:
    """Hyperparameters of one site's local training.

    Attributes:
        strategy: a name in :data:`fedrelay.registry.STRATEGIES`: ``"fedelmy"`` (model
            pool + distance regulariser) or ``"fedseq"`` (one model, plain CE).
        models_per_site: S, pool models trained per site (FedSeq trains one model for
            S*E epochs so that both spend the same number of epochs).
        local_epochs: E, epochs per pool model.
        warmup_epochs: E_w, plain-CE epochs at the first site only (0 = none).
        alpha: weight of d1 (>= 0).  Reference-code default 1.0.
        beta: weight of d2 (>= 0).  Reference-code default 1.0.
        lr: Adam learning rate.
        batch_size: samples per batch.
        weight_decay: ``torch.optim.Adam(weight_decay=...)``, i.e. coupled L2 (not
            AdamW), as in the reference code.
        selection: ``"best-val"`` keeps the epoch with the strictly best validation
            accuracy (the reference behaviour; a validation pass after every epoch);
            ``"last-epoch"`` keeps the last (validated once, after the last epoch).
    """

    strategy: str = "fedelmy"
    models_per_site: int = 5
    local_epochs: int = 2
    warmup_epochs: int = 2
    alpha: float = 1.0
    beta: float = 1.0
    lr: float = 1e-3
    batch_size: int = 128
    weight_decay: float = 1e-4
    selection: str = "best-val"

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad field, if any, by its start-chain flag
        (:func:`fedrelay.params.check`, the one check of a run's training parameters)."""
        params.check(dataclasses.asdict(self))


# --------------------------------------------------------------------------- seeds


def _canonical(part):
    """Normalise a seed part so that its ``repr`` is stable across versions."""
    if part is None or isinstance(part, (bool, str, bytes)):
        return part
    if isinstance(part, numbers.Integral):  # includes numpy ints (repr differs in numpy 2)
        return int(part)
    if isinstance(part, float):  # includes numpy.float64
        return float(part)
    if isinstance(part, (tuple, list)):
        return tuple(_canonical(p) for p in part)
    raise TypeError(
        f"derive_seed parts must be int, str, bytes, float, bool, None or tuples of them; "
        f"got {type(part).__name__}"
    )


def use_deterministic_kernels(device) -> bool:
    """Make CUDA training reproducible in this process: the same run on the same GPU model and
    software gives the same bits.  Sets ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (unless already
    set; cuBLAS reads it when its first handle is made, so call this before any CUDA work),
    ``torch.backends.cudnn.deterministic = True``, ``cudnn.benchmark = False`` and
    ``torch.use_deterministic_algorithms(True, warn_only=True)``: an op that has no deterministic
    CUDA kernel warns (in the peer's log) rather than failing the run; none does for the
    ``cnn`` and ``resnet18`` models (checked on an H100, torch 2.11).

    Cost, measured on an H100 with tiny data (one site, S = 2, E = 2): the small CNN's
    training took about 1.7x as long, ResNet-18's about 1.3x.

    Args:
        device: the training device, e.g. ``"cpu"`` or ``"cuda:0"``. On the CPU nothing is
            changed (the CPU kernels used here are already deterministic).

    Returns:
        True when the settings were applied (a CUDA device), else False.
    """
    if not str(device).startswith("cuda"):
        return False
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    return True


def derive_seed(*parts) -> int:
    """Deterministic 63-bit seed from ``parts``, e.g. ``(run_seed, "site", 3, "pool", 2)``.

    The first 8 bytes (big-endian) of ``sha256(repr(parts))``, masked to 63 bits, so
    the result is in ``[0, 2**63)`` and valid for ``torch.manual_seed`` and
    ``torch.Generator.manual_seed``.  Unlike Python's ``hash()`` it does not change
    between processes.  Integers (numpy ones too) and floats are normalised to the
    Python types first; lists count as tuples.

    Raises:
        TypeError: a part is not an int, str, bytes, float, bool, None or tuple/list.
    """
    canonical = tuple(_canonical(p) for p in parts)
    digest = hashlib.sha256(repr(canonical).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") & ((1 << 63) - 1)


def seeded_generator(seed: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with ``seed`` (a :func:`derive_seed` value), for a batch order."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    return generator


# --------------------------------------------------------------------------- data


def train_val_split(
    images: torch.Tensor, labels: torch.Tensor, seed: int, val_fraction: float = 0.1
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Split a site's training samples into train and validation parts (reference protocol).

    A permutation of the N samples is drawn with a ``torch.Generator`` seeded by ``seed``;
    validation gets the first ``int(val_fraction * N)`` permuted indices and training the
    rest (FedELMY implementation notes §1.5: "val = first int(0.1*len) indices"). With
    N < 1 / val_fraction the validation part is empty.

    Args:
        images: tensor ``(N, ...)`` (any dtype).
        labels: tensor ``(N,)``.
        seed: generator seed; the same seed gives the same split.
        val_fraction: share of samples for validation, in [0, 1).

    Returns:
        ``((train_images, train_labels), (val_images, val_labels))`` (new tensors).
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), not {val_fraction}")
    n = int(images.shape[0])
    if int(labels.shape[0]) != n:
        raise ValueError(f"images has {n} samples but labels has {int(labels.shape[0])}")
    gen = torch.Generator().manual_seed(int(seed))
    perm = torch.randperm(n, generator=gen)
    n_val = int(val_fraction * n)
    val_idx, train_idx = perm[:n_val], perm[n_val:]
    return (images[train_idx], labels[train_idx]), (images[val_idx], labels[val_idx])


def check_data(data, what: str, allow_empty: bool) -> Dataset:
    """``data`` as ``(inputs, labels)``: a tensor ``N x ...`` and int64 ``N``.

    Raises:
        ValueError: naming ``what``: not a pair, not tensors, labels not int64 ``N``, different
            lengths, or empty when ``allow_empty`` is False.
    """
    try:
        inputs, labels = data
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be an (inputs, labels) tuple") from None
    if not isinstance(inputs, Tensor) or inputs.dim() < 1:
        raise ValueError(f"{what} inputs must be a tensor with one row per sample")
    if not isinstance(labels, Tensor) or labels.dtype != torch.int64 or labels.dim() != 1:
        raise ValueError(f"{what} labels must be an int64 tensor N")
    if inputs.shape[0] != labels.shape[0]:
        raise ValueError(f"{what}: {inputs.shape[0]} input rows but {labels.shape[0]} labels")
    if inputs.shape[0] == 0 and not allow_empty:
        raise ValueError(f"{what} is empty")
    return inputs, labels


def _check_labels(spec: ModelSpec, data: Dataset, what: str) -> None:
    labels = data[1]
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= spec.num_classes):
        raise ValueError(f"{what} labels must lie in [0, {spec.num_classes})")


def check_site_data(spec: ModelSpec, train, val) -> tuple[Dataset, Dataset]:
    """A site's ``(train, val)`` checked with :func:`check_data` (train non-empty, val may be
    empty), labels in ``[0, spec.num_classes)``.  Raises ``ValueError``."""
    train = check_data(train, "train", allow_empty=False)
    val = check_data(val, "val", allow_empty=True)
    _check_labels(spec, train, "train")
    _check_labels(spec, val, "val")
    return train, val


def check_outputs(model: nn.Module, task: Task, spec: ModelSpec, inputs: Tensor) -> None:
    """Check, before training or evaluating, that the task's model maps a batch of the task's
    inputs to logits ``N x K`` (``K = spec.num_classes``): one forward pass over the first two
    rows in eval mode without gradient (no weight, buffer or random state changes; the model's
    train/eval mode is restored). Raises ``ValueError`` naming the task, the model and the shape."""
    if inputs.shape[0] == 0:
        return
    where = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(task.batch(inputs[:2].to(where), train=False))
    except (RuntimeError, TypeError, IndexError) as exc:  # e.g. a shape the model's first layer cannot take
        raise ValueError(f"the model {spec.model!r} of task {spec.task!r} cannot take this site's inputs "
                         f"{tuple(inputs.shape[1:])} ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
    finally:
        model.train(was_training)
    n = min(2, int(inputs.shape[0]))
    if not isinstance(out, Tensor) or tuple(out.shape) != (n, spec.num_classes) or not out.is_floating_point():
        got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        raise ValueError(f"the model {spec.model!r} of task {spec.task!r} returns {got} for a batch of {n} "
                         f"rows; the run needs float logits of shape ({n}, {spec.num_classes}): one per class of "
                         "the run's class index")


# --------------------------------------------------------------------------- evaluation


def evaluate(model: nn.Module, inputs: Tensor, labels: Tensor, batch_size: int = 512, device="cpu", *,
             task: Task) -> tuple[int, int]:
    """Count correct top-1 predictions.

    Args:
        model: already on ``device``; evaluated in ``eval()`` mode under
            ``torch.inference_mode``; its previous train/eval mode is restored.
        inputs: ``N x ...`` rows (``task.batch(rows, train=False)`` per batch).
        labels: int64 ``N``.
        batch_size: rows per forward pass.
        device: where the batches go.
        task: the run's task.

    Returns:
        ``(correct, total)``; ``(0, 0)`` for an empty set.
    """
    images, labels = check_data((inputs, labels), "evaluation data", allow_empty=True)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    total = int(labels.shape[0])
    if total == 0:
        return 0, 0
    was_training = model.training
    model.eval()
    correct = 0
    try:
        with torch.inference_mode():
            for start in range(0, total, batch_size):
                x = task.batch(images[start:start + batch_size].to(device), train=False)
                y = labels[start:start + batch_size].to(device)
                correct += int((model(x).argmax(dim=1) == y).sum())
    finally:
        model.train(was_training)
    return correct, total


# --------------------------------------------------------------------------- training


def train_one_epoch(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_x: Tensor,
    train_y: Tensor,
    order: Tensor,
    batch_size: int,
    regulariser: Regulariser | None = None,
    *,
    task: Task,
    generator: torch.Generator | None = None,
) -> Tensor:
    """One pass over ``train`` in ``order`` (a permutation on the data's device), in slices of
    ``batch_size`` (last partial batch included); per batch the model sees
    ``task.batch(rows, train=True, generator=generator)``, the loss is ``task.loss(outputs,
    labels)`` (the mean cross-entropy by default), or ``regulariser(loss, params)`` when given,
    and one optimiser step.

    Returns:
        The sum over the epoch of each batch's task loss times its size: a 0-d float64 tensor on
        the data's device (read it once per epoch).

    Raises:
        ValueError: the task's loss is not a 0-d tensor.
    """
    model.train()
    params = list(model.parameters())
    # Summed on the device, read once per epoch: a read per batch would make a GPU wait for
    # every step (float64, so the figure equals the sum of the batches' float values).
    ce_sum = torch.zeros((), dtype=torch.float64, device=train_x.device)
    for start in range(0, int(order.shape[0]), batch_size):
        idx = order[start:start + batch_size]
        x = task.batch(train_x[idx], train=True, generator=generator)
        y = train_y[idx]
        ce = task.loss(model(x), y)
        if not isinstance(ce, Tensor) or ce.dim() != 0:
            got = tuple(ce.shape) if isinstance(ce, Tensor) else type(ce).__name__
            raise ValueError(f"the loss of task {tasks.name_of(task)!r} returned {got}, not a scalar (a 0-d tensor)")
        loss = ce if regulariser is None else regulariser(ce, params)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        ce_sum += ce.detach().to(torch.float64) * int(y.shape[0])
    return ce_sum


def _num_logits(model: nn.Module, task: Task, inputs: Tensor) -> int:
    """K, the model's logits per row (one row through the model in eval mode, no gradient)."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            return int(model(task.batch(inputs[:1], train=False)).shape[1])
    finally:
        model.train(was_training)


def fit(
    model: nn.Module,
    train,
    val,
    cfg: TrainConfig,
    generator: torch.Generator,
    device,
    *,
    epochs: int,
    stage: str,
    index: int,
    regulariser: Regulariser | None = None,
    on_epoch: EpochCallback | None = None,
    task: Task,
) -> State:
    """The training loop shared by the warm-up and every strategy: train ``model`` for
    ``epochs`` epochs and return the selected state.

    A fresh optimiser, ``task.optimizer(params, lr=cfg.lr, weight_decay=cfg.weight_decay)``
    (Adam by default); batches are slices of ``torch.randperm(N, generator=generator)`` of
    ``cfg.batch_size`` (last partial batch included; :func:`train_one_epoch`).  The loss is the
    task's (cross-entropy by default), or what ``regulariser(loss, params)`` makes of it: the
    strategy's loss terms (FedELMY's d1 and d2), which this loop knows nothing about.  A task's
    train-time transforms draw from their own CPU generator, seeded from ``generator``'s
    initial seed (so they do not shift the batch order).

    ``cfg.selection == "best-val"`` evaluates after every epoch and returns a copy of the
    state of the epoch with the *strictly* best validation accuracy (the first epoch is
    always kept); ``"last-epoch"`` evaluates once, after the last epoch, and returns the
    last.  With an empty ``val`` the last epoch is returned (the reference code always has
    a validation split).  The module itself is left on ``device`` with its last-epoch
    weights.

    Under differential privacy (the call runs inside :func:`fedrelay.peer.privacy.engaged`, as
    the ``train`` job arranges for a run with DP options) the epochs are DP-SGD instead
    (:class:`fedrelay.peer.privacy.DPTraining`: Poisson-sampled batches, per-sample clipping,
    Gaussian noise, from a secret generator, so not reproducible; ``generator`` is not used for
    the batches), the last epoch is kept, and the steps are booked under ``"<stage>/<index>"``.

    Args:
        model: moved to ``device`` in place.
        train: ``(inputs N x ..., int64 N)``, non-empty.
        val: same layout, may be empty.
        generator: CPU ``torch.Generator`` for the batch order (consumed).
        device: ``"cpu"``, ``"cuda"``, a ``torch.device``...
        epochs, stage, index: the length of the loop, and the ``"stage"`` and ``"model"``
            it reports.
        task: the run's task (batches, loss, optimiser).
        on_epoch: called after each epoch with ``{"stage", "model": index, "epoch":
            1-based, "epochs", "train_loss": mean task loss over the epoch's samples,
            "val_accuracy": float in [0, 1], or None when not validated (an empty val, or
            an epoch before the last under last-epoch selection), "seconds": wall time of
            the epoch including evaluation}``.

    Returns:
        The selected state (new CPU tensors).

    Raises:
        ValueError: bad data; the task's loss is not a scalar, or not finite over an epoch.
    """
    train_x, train_y = check_data(train, "train", allow_empty=False)
    val_x, val_y = check_data(val, "val", allow_empty=True)
    model.to(device)
    train_x, train_y = train_x.to(device), train_y.to(device)
    optimizer = task.optimizer(list(model.parameters()), lr=cfg.lr, weight_decay=cfg.weight_decay)
    augment = seeded_generator(derive_seed(generator.initial_seed(), "augment"))
    use_best = cfg.selection == "best-val" and val_y.shape[0] > 0
    n = int(train_y.shape[0])
    session = dp.current()
    if session is not None:  # DP-SGD (fedrelay.peer.privacy); never under best-val (fedrelay.privacy.check)
        use_best = False
        private = dp.DPTraining(session, model, optimizer, n, cfg.batch_size, key=f"{stage}/{index}",
                                num_classes=_num_logits(model, task, train_x))
    try:
        best_state: State | None = None
        best_accuracy = -1.0
        for epoch in range(1, epochs + 1):
            started = time.perf_counter()
            if session is not None:
                ce_sum = float(private.epoch(train_x, train_y, task, regulariser, generator=augment))
            else:
                # The batch order is drawn on the CPU (same order on every device) and moved once per
                # epoch: a host-to-device copy per batch made a GPU wait for its queue every step.
                order = torch.randperm(n, generator=generator).to(train_x.device)
                ce_sum = float(train_one_epoch(model, optimizer, train_x, train_y, order, cfg.batch_size,
                                               regulariser, task=task, generator=augment))
            if not math.isfinite(ce_sum):
                raise ValueError(f"the loss of task {tasks.name_of(task)!r} is not finite ({ce_sum}) in epoch "
                                 f"{epoch} of {stage}: check the task's loss and inputs (or lower --lr)")
            # Best-validation selection needs every epoch validated; last-epoch selection only the
            # last (the accuracy of the model kept is still reported), so it costs what a plain loop does.
            if val_y.shape[0] > 0 and (use_best or epoch == epochs):
                correct, total = evaluate(model, val_x, val_y, device=device, task=task)
                accuracy = correct / total
            else:
                accuracy = None
            if use_best and accuracy > best_accuracy:  # strictly better; epoch 1 always kept
                best_accuracy = accuracy
                best_state = clone_state(model.state_dict())
            if on_epoch is not None:
                on_epoch(
                    {
                        "stage": stage,
                        "model": index,
                        "epoch": epoch,
                        "epochs": epochs,
                        "train_loss": ce_sum / n,
                        "val_accuracy": accuracy,
                        "seconds": time.perf_counter() - started,
                    }
                )
    finally:
        if session is not None:
            private.close()  # Opacus' hooks off the model; the steps taken booked
    if best_state is None:  # last-epoch selection, empty val, or zero epochs
        best_state = clone_state(model.state_dict())
    return best_state


def warm_up(model: nn.Module, train, val, cfg: TrainConfig, seed: int, device, on_epoch: EpochCallback | None = None,
            *, task: Task) -> State:
    """Warm up the first site's freshly built model (paper Algorithm 1 line 1).

    The task's plain loss (cross-entropy by default) for ``cfg.warmup_epochs`` epochs with the same optimiser, batching and
    selection as every strategy (:func:`fit`; implementation-notes section 1.4); batch
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


# --------------------------------------------------------------------------- a visit's model pool


def fill_pool(m0: Mapping[str, Tensor], expected: dict, count: int, finished: Sequence[Mapping[str, Tensor]],
              train_model: Callable[[int, list[State]], State], on_model: ModelCallback | None = None) -> list[State]:
    """A visit's model pool, fresh or resumed: what every strategy's ``train`` shares.

    ``pool = [m0, *finished]``; then, for ``j = len(finished)+1 .. count`` in order,
    ``state = train_model(j, pool)`` (the pool so far: ``pool[0]`` is ``m0``), appended to the
    pool and handed to ``on_model(j, state)`` so that the caller can persist it.  Since model
    ``j`` depends only on the pool before it (and the strategy's seed), passing the states
    already trained as ``finished`` gives the result of an uninterrupted visit;
    ``on_model`` is called only for the models trained here.

    Args:
        expected: the state signature (:func:`fedrelay.models.expected_signature` of the
            run's spec) that ``m0`` and every ``finished`` state must have.
        count: the models a visit trains (``models_to_keep(cfg)`` of the strategy).

    Returns:
        The pool, ``count + 1`` states: ``m0``, the ``finished`` states as given, the new ones.

    Raises:
        ValueError: ``m0`` or a ``finished`` state that does not fit ``expected``, more than
            ``count`` finished states, or what ``train_model`` raises.
    """
    check_signature(m0, expected, "m0")
    finished = list(finished)
    if len(finished) > count:
        raise ValueError(f"{len(finished)} finished models, but a visit of this strategy trains {count}")
    for j, state in enumerate(finished, start=1):
        check_signature(state, expected, f"finished model {j}")
    pool: list = [m0, *finished]
    for j in range(len(finished) + 1, count + 1):
        state = train_model(j, pool)
        pool.append(state)
        if on_model is not None:
            on_model(j, state)
    return pool


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
    reference repository has no FedSeq; implementation-notes section 1.7).  A resumed
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
    return registry.load(cfg.strategy).train(m0, spec, train, val, cfg, seed, device,
                                             finished=finished, on_epoch=on_epoch, on_model=on_model)
