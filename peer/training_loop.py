"""The one training loop shared by the warm-up and every strategy: :func:`fit` (epochs,
best-validation or last-epoch selection, DP-SGD when engaged) over :func:`train_one_epoch`.

Batch order from a ``torch.Generator`` (:func:`fedrelay.peer.determinism.derive_seed`); the
task (:class:`fedrelay.Task`) gives the batches, the loss and the optimiser.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
from torch import Tensor, nn

from fedrelay import tasks
from fedrelay.task import Task

from . import privacy as dp
from . import recipe
from .determinism import derive_seed, seeded_generator
from .evaluation import evaluate
from .site_data import check_data
from .states import State, clone_state
from .train_config import TrainConfig

__all__ = ["EpochCallback", "Regulariser", "BatchLoss", "train_one_epoch", "fit"]

EpochCallback = Callable[[dict], None]
# A strategy's per-batch loss: ``regulariser(loss, params) -> loss``, from the task's loss of the
# batch (0-d, with gradient) and the model's parameters in ``model.parameters()`` order.
Regulariser = Callable[[Tensor, list[Tensor]], Tensor]
# A strategy's own loss of a batch, in place of the task's: ``batch_loss(outputs, inputs, labels)
# -> loss`` (0-d, with gradient) from the model's outputs (N x K logits), the inputs the model saw
# (``task.batch``'s, on the device) and the labels (int64 N). The regulariser, when given, gets it.
BatchLoss = Callable[[Tensor, Tensor, Tensor], Tensor]


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
    batch_loss: BatchLoss | None = None,
) -> Tensor:
    """One pass over ``train`` in ``order`` (a permutation on the data's device), in slices of
    ``batch_size`` (last partial batch included); per batch the model sees
    ``task.batch(rows, train=True, generator=generator)``, the loss is ``task.loss(outputs,
    labels)`` (the mean cross-entropy by default), or ``batch_loss(outputs, inputs, labels)``
    instead when given (a strategy's own loss of the batch, e.g. ``fedelmy-kd``'s), then
    ``regulariser(loss, params)`` when given, and one optimiser step. Without ``batch_loss`` the
    arithmetic is the task loss's, unchanged.

    Returns:
        The sum over the epoch of each batch's loss (the task's, or ``batch_loss``'s) times its
        size: a 0-d float64 tensor on the data's device (read it once per epoch).

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
        outputs = model(x)
        ce = task.loss(outputs, y) if batch_loss is None else batch_loss(outputs, x, y)
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
    batch_loss: BatchLoss | None = None,
) -> State:
    """The training loop shared by the warm-up and every strategy: train ``model`` for
    ``epochs`` epochs and return the selected state.

    A fresh optimiser, ``task.optimizer(params, lr=cfg.lr, weight_decay=cfg.weight_decay)``
    (Adam by default); batches are slices of ``torch.randperm(N, generator=generator)`` of
    ``cfg.batch_size`` (last partial batch included; :func:`train_one_epoch`).  The loss is the
    task's (cross-entropy by default), or what ``regulariser(loss, params)`` makes of it: the
    strategy's loss terms (FedELMY's d1 and d2), which this loop knows nothing about; a strategy
    that needs the batch itself (``fedelmy-kd``'s distillation) replaces the task's loss by
    ``batch_loss(outputs, inputs, labels)`` (:func:`train_one_epoch`).  A task's
    train-time transforms draw from their own CPU generator, seeded from ``generator``'s
    initial seed (so they do not shift the batch order).

    The run's recipe (:mod:`fedrelay.peer.recipe`): ``cfg.lr_schedule == "cosine"`` anneals the
    learning rate per optimiser step from ``cfg.lr`` to 0 over this call's ``epochs x
    ceil(N / cfg.batch_size)`` steps (each call, a pool model or the warm-up, is one cosine
    cycle); ``cfg.augment != "none"`` passes every training batch through
    ``task.augment(..., method=cfg.augment)`` (:meth:`fedrelay.Task.augment`), drawing from the
    same transforms' generator (validation batches never). Both apply under DP-SGD too (the
    scheduler steps with each noised step). At ``"constant"`` and ``"none"`` the loop is exactly
    the plain one (no scheduler, no extra draw).

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
        batch_loss: the strategy's loss of a batch in place of the task's (:data:`BatchLoss`);
            None (the default): the task's loss, arithmetic unchanged. Not under DP-SGD.
        on_epoch: called after each epoch with ``{"stage", "model": index, "epoch":
            1-based, "epochs", "train_loss": mean task loss (or ``batch_loss``) over the epoch's samples,
            "val_accuracy": float in [0, 1], or None when not validated (an empty val, or
            an epoch before the last under last-epoch selection), "seconds": wall time of
            the epoch including evaluation}``.

    Returns:
        The selected state (new CPU tensors).

    Raises:
        ValueError: bad data; the task's loss is not a scalar, or not finite over an epoch;
            ``batch_loss`` under DP-SGD (its per-sample terms are not clipped and noised there);
            an augmentation the task does not offer (``--augment``), or one that changes the
            batch's shape or dtype.
    """
    train_x, train_y = check_data(train, "train", allow_empty=False)
    val_x, val_y = check_data(val, "val", allow_empty=True)
    model.to(device)
    train_x, train_y = train_x.to(device), train_y.to(device)
    optimizer = task.optimizer(list(model.parameters()), lr=cfg.lr, weight_decay=cfg.weight_decay)
    augment = seeded_generator(derive_seed(generator.initial_seed(), "augment"))
    use_best = cfg.selection == "best-val" and val_y.shape[0] > 0
    n = int(train_y.shape[0])
    # The run's recipe (peer/recipe.py): at its defaults, no scheduler and the task itself.
    recipe.schedule(optimizer, cfg.lr_schedule, epochs * math.ceil(n / cfg.batch_size))
    batches = recipe.augmenting(task, cfg.augment)
    session = dp.current()
    if session is not None and batch_loss is not None:
        raise ValueError(f"{stage}: a strategy's own batch loss (batch_loss) is not trained under differential "
                         "privacy; DP-SGD clips and noises the task's loss only")
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
                ce_sum = float(private.epoch(train_x, train_y, batches, regulariser, generator=augment))
            else:
                # The batch order is drawn on the CPU (same order on every device) and moved once per
                # epoch: a host-to-device copy per batch made a GPU wait for its queue every step.
                order = torch.randperm(n, generator=generator).to(train_x.device)
                ce_sum = float(train_one_epoch(model, optimizer, train_x, train_y, order, cfg.batch_size,
                                               regulariser, task=batches, generator=augment,
                                               batch_loss=batch_loss))
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
