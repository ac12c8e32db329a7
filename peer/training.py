"""What every strategy shares: one site's local training, as plain functions.

No networking and no files: inputs are tensors, modules and states; outputs are
states (:mod:`fedrelay.peer.states`: a ``dict[str, torch.Tensor]`` as returned by
``nn.Module.state_dict()``, parameters, BatchNorm running statistics and the int64
``num_batches_tracked`` counters).  Every state returned here and by the strategies holds
new, contiguous CPU tensors, whatever ``device`` the training ran on.

Data: ``train`` and ``val`` are ``(images, labels)`` tuples: ``images`` a uint8
tensor ``N x C x H x W``, ``labels`` an int64 tensor ``N`` of class indices.  Each
batch is converted to float32 ``/ 255`` on ``device``.  There is no normalisation
and no augmentation; this differs from the reference code, which trains CIFAR-10
with RandomCrop(32, pad 4) + HorizontalFlip (implementation-notes section 1.5).

Read top to bottom: the config, seeds, data checks, :func:`evaluate`, the one training
loop (:func:`train_one_epoch`, :func:`fit`), the first site's :func:`warm_up`, and
:func:`run_site`, which warms up and hands the visit to the strategy named by
``cfg.strategy`` in :mod:`fedrelay.registry`:

* ``"fedelmy"`` (:mod:`fedrelay.peer.strategies.fedelmy`): each site builds a model pool
  ``[m0, b1, ..., bS]``.  Model ``bj`` starts from the uniform average of the pool so far,
  trains ``E`` epochs with ``CE - alpha*d1/a + beta*d2/a`` and keeps its best-validation
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
import numbers
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fedrelay import params, registry

from .models import ModelSpec, _build_seeded
from .states import State, build_loaded, clone_state

__all__ = [
    "State",
    "TrainConfig",
    "derive_seed",
    "use_deterministic_kernels",
    "seeded_generator",
    "check_data",
    "check_site_data",
    "evaluate",
    "train_one_epoch",
    "fit",
    "warm_up",
    "run_site",
]

Dataset = tuple[Tensor, Tensor]
EpochCallback = Callable[[dict], None]
ModelCallback = Callable[[int, State], None]
# A strategy's per-batch loss: ``regulariser(ce, params) -> loss``, from the batch's mean
# cross-entropy (0-d, with gradient) and the model's parameters in ``model.parameters()`` order.
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


def check_data(data, what: str, allow_empty: bool) -> Dataset:
    """``data`` as ``(images, labels)``: uint8 ``N x C x H x W`` and int64 ``N``.

    Raises:
        ValueError: naming ``what``: not a pair, wrong dtypes or dimensions, different
            lengths, or empty when ``allow_empty`` is False.
    """
    try:
        images, labels = data
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be an (images, labels) tuple") from None
    if not isinstance(images, Tensor) or images.dtype != torch.uint8 or images.dim() != 4:
        raise ValueError(f"{what} images must be a uint8 tensor N x C x H x W")
    if not isinstance(labels, Tensor) or labels.dtype != torch.int64 or labels.dim() != 1:
        raise ValueError(f"{what} labels must be an int64 tensor N")
    if images.shape[0] != labels.shape[0]:
        raise ValueError(f"{what}: {images.shape[0]} images but {labels.shape[0]} labels")
    if images.shape[0] == 0 and not allow_empty:
        raise ValueError(f"{what} is empty")
    return images, labels


def _check_data_fits(spec: ModelSpec, data: Dataset, what: str) -> None:
    images, labels = data
    expected = (spec.in_channels, *tuple(spec.image_size))
    if tuple(images.shape[1:]) != expected and images.shape[0] > 0:
        raise ValueError(f"{what} images are {tuple(images.shape[1:])}, the model expects {expected}")
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= spec.num_classes):
        raise ValueError(f"{what} labels must lie in [0, {spec.num_classes})")


def check_site_data(spec: ModelSpec, train, val) -> tuple[Dataset, Dataset]:
    """A site's ``(train, val)`` checked with :func:`check_data` (train non-empty, val may be
    empty) and against ``spec``: images of ``spec``'s channels and size, labels in
    ``[0, spec.num_classes)``.  Raises ``ValueError``."""
    train = check_data(train, "train", allow_empty=False)
    val = check_data(val, "val", allow_empty=True)
    _check_data_fits(spec, train, "train")
    _check_data_fits(spec, val, "val")
    return train, val


# --------------------------------------------------------------------------- evaluation


def evaluate(model: nn.Module, images: Tensor, labels: Tensor, batch_size: int = 512, device="cpu") -> tuple[int, int]:
    """Count correct top-1 predictions.

    Args:
        model: already on ``device``; evaluated in ``eval()`` mode under
            ``torch.inference_mode``; its previous train/eval mode is restored.
        images: uint8 ``N x C x H x W`` (converted to float32 ``/ 255`` per batch).
        labels: int64 ``N``.
        batch_size: images per forward pass.
        device: where the batches go.

    Returns:
        ``(correct, total)``; ``(0, 0)`` for an empty set.
    """
    images, labels = check_data((images, labels), "evaluation data", allow_empty=True)
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
                x = images[start:start + batch_size].to(device).to(torch.float32).div_(255.0)
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
) -> Tensor:
    """One pass over ``train`` in ``order`` (a permutation on the data's device), in slices of
    ``batch_size`` (last partial batch included); per batch the loss is the mean CE, or
    ``regulariser(ce, params)`` when given, and one optimiser step.

    Returns:
        The sum over the epoch of each batch's CE times its size: a 0-d float64 tensor on
        the data's device (read it once per epoch).
    """
    model.train()
    params = list(model.parameters())
    # Summed on the device, read once per epoch: a read per batch would make a GPU wait for
    # every step (float64, so the figure equals the sum of the batches' float values).
    ce_sum = torch.zeros((), dtype=torch.float64, device=train_x.device)
    for start in range(0, int(order.shape[0]), batch_size):
        idx = order[start:start + batch_size]
        x = train_x[idx].to(torch.float32).div_(255.0)
        y = train_y[idx]
        ce = F.cross_entropy(model(x), y)
        loss = ce if regulariser is None else regulariser(ce, params)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        ce_sum += ce.detach().to(torch.float64) * int(y.shape[0])
    return ce_sum


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
) -> State:
    """The training loop shared by the warm-up and every strategy: train ``model`` for
    ``epochs`` epochs and return the selected state.

    A fresh ``torch.optim.Adam(lr=cfg.lr, weight_decay=cfg.weight_decay)``; batches are
    slices of ``torch.randperm(N, generator=generator)`` of ``cfg.batch_size`` (last
    partial batch included; :func:`train_one_epoch`).  The loss is plain CE, or what
    ``regulariser(ce, params)`` makes of it: the strategy's loss terms (FedELMY's d1 and
    d2), which this loop knows nothing about.

    ``cfg.selection == "best-val"`` evaluates after every epoch and returns a copy of the
    state of the epoch with the *strictly* best validation accuracy (the first epoch is
    always kept); ``"last-epoch"`` evaluates once, after the last epoch, and returns the
    last.  With an empty ``val`` the last epoch is returned (the reference code always has
    a validation split).  The module itself is left on ``device`` with its last-epoch
    weights.

    Args:
        model: moved to ``device`` in place.
        train: ``(uint8 N x C x H x W, int64 N)``, non-empty.
        val: same layout, may be empty.
        generator: CPU ``torch.Generator`` for the batch order (consumed).
        device: ``"cpu"``, ``"cuda"``, a ``torch.device``...
        epochs, stage, index: the length of the loop, and the ``"stage"`` and ``"model"``
            it reports.
        on_epoch: called after each epoch with ``{"stage", "model": index, "epoch":
            1-based, "epochs", "train_loss": mean CE over the epoch's samples,
            "val_accuracy": float in [0, 1], or None when not validated (an empty val, or
            an epoch before the last under last-epoch selection), "seconds": wall time of
            the epoch including evaluation}``.

    Returns:
        The selected state (new CPU tensors).

    Raises:
        ValueError: bad data.
    """
    train_x, train_y = check_data(train, "train", allow_empty=False)
    val_x, val_y = check_data(val, "val", allow_empty=True)
    model.to(device)
    train_x, train_y = train_x.to(device), train_y.to(device)
    optimizer = torch.optim.Adam(list(model.parameters()), lr=cfg.lr, weight_decay=cfg.weight_decay)
    use_best = cfg.selection == "best-val" and val_y.shape[0] > 0
    n = int(train_y.shape[0])
    best_state: State | None = None
    best_accuracy = -1.0
    for epoch in range(1, epochs + 1):
        started = time.perf_counter()
        # The batch order is drawn on the CPU (same order on every device) and moved once per
        # epoch: a host-to-device copy per batch made a GPU wait for its queue every step.
        order = torch.randperm(n, generator=generator).to(train_x.device)
        ce_sum = train_one_epoch(model, optimizer, train_x, train_y, order, cfg.batch_size, regulariser)
        # Best-validation selection needs every epoch validated; last-epoch selection only the
        # last (the accuracy of the model kept is still reported), so it costs what a plain loop does.
        if val_y.shape[0] > 0 and (use_best or epoch == epochs):
            correct, total = evaluate(model, val_x, val_y, device=device)
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
                    "train_loss": float(ce_sum) / n,
                    "val_accuracy": accuracy,
                    "seconds": time.perf_counter() - started,
                }
            )
    if best_state is None:  # last-epoch selection, empty val, or zero epochs
        best_state = clone_state(model.state_dict())
    return best_state


def warm_up(model: nn.Module, train, val, cfg: TrainConfig, seed: int, device, on_epoch: EpochCallback | None = None) -> State:
    """Warm up the first site's freshly built model (paper Algorithm 1 line 1).

    Plain CE for ``cfg.warmup_epochs`` epochs with the same optimiser, batching and
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
        epochs=cfg.warmup_epochs, stage="warmup", index=0, on_epoch=on_epoch,
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

    Raises:
        ValueError: bad config, data that do not fit ``spec``, or states that do not
            fit ``spec``.
    """
    cfg.validate()
    train, val = check_site_data(spec, train, val)
    if m0 is None:
        if initial is not None:
            model = build_loaded(spec, initial)
        else:
            model = _build_seeded(spec, derive_seed(seed, "init"))
        m0 = warm_up(model, train, val, cfg, seed, device, on_epoch=on_epoch)
        del model
        if on_warmup is not None:
            on_warmup(m0)
    return registry.load(cfg.strategy).train(m0, spec, train, val, cfg, seed, device,
                                             finished=finished, on_epoch=on_epoch, on_model=on_model)
