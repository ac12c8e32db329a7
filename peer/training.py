"""The federated-learning algorithms of one site, as plain functions.

No networking and no files: inputs are tensors, modules and states; outputs are
states.  A *state* is a ``dict[str, torch.Tensor]`` as returned by
``nn.Module.state_dict()`` (parameters, BatchNorm running statistics and the int64
``num_batches_tracked`` counters).  Every state this module returns holds new,
contiguous CPU tensors, whatever ``device`` the training ran on.

Data: ``train`` and ``val`` are ``(images, labels)`` tuples: ``images`` a uint8
tensor ``N x C x H x W``, ``labels`` an int64 tensor ``N`` of class indices.  Each
batch is converted to float32 ``/ 255`` on ``device``.  There is no normalisation
and no augmentation; this differs from the reference code, which trains CIFAR-10
with RandomCrop(32, pad 4) + HorizontalFlip (implementation-notes section 1.5).

Algorithms (paper: Wang et al., "One-Shot Sequential Federated Learning for Non-IID
Data by Enhancing Local Model Diversity", ACM MM 2024, Algorithm 1 and Eq. 5-9;
behaviour follows the authors' code as described in implementation-notes section 1):

* ``"fedelmy"``: each site builds a model pool ``[m0, b1, ..., bS]``.  Model ``bj``
  starts from the uniform average of the pool so far, trains ``E`` epochs with
  ``CE - alpha*d1/a + beta*d2/a`` and keeps its best-validation epoch; the site
  sends the average of the pool (:func:`train_pool`).
* ``"fedseq"``: the baseline; one model trained from ``m0`` with plain CE for
  ``S*E`` epochs (:func:`train_fedseq`), which is the model sent on.

Determinism: given the same inputs, config and seed, every function here returns
bit-identical states on the CPU, and on a CUDA GPU once :func:`use_deterministic_kernels`
has been called (the peer daemon does so unless started with ``--no-deterministic``; by
default cuDNN and cuBLAS pick kernels whose float sums vary from run to run).  A CPU and a
GPU, or two GPU models, give different bits for the same run.  Batch order comes from ``torch.Generator`` objects
seeded with :func:`derive_seed`.  The global torch RNG is seeded only by
:func:`run_site`, with ``torch.manual_seed(derive_seed(seed, "init"))`` immediately
before the first site's model is built (atomically with respect to ``build_model``
in other threads).  Every model construction here runs inside
``torch.random.fork_rng``, so the functions leave the caller's global RNG state as
they found it.
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
from torch.nn import functional as F

from fedrelay import params

from .models import ModelSpec, _build_seeded, build_model, expected_signature, state_signature
from .states import State, average_states, build_loaded, check_signature, clone_state, flatten, param_names

__all__ = [
    "State",
    "TrainConfig",
    "derive_seed",
    "average_states",
    "model_parameters_distance_sq",
    "d1",
    "d2",
    "magnitude_scale",
    "evaluate",
    "train_one_model",
    "warm_up",
    "train_pool",
    "train_fedseq",
    "run_site",
]

Dataset = tuple[Tensor, Tensor]
EpochCallback = Callable[[dict], None]
ModelCallback = Callable[[int, State], None]

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


# --------------------------------------------------------------------------- distances


def model_parameters_distance_sq(params: Sequence[Tensor], others: Sequence[Tensor]) -> Tensor:
    """Squared L2 distance between two aligned parameter lists.

    ``sum_i ||params[i] - others[i]||_F^2``, i.e. the squared L2 norm of the
    difference of the flattened concatenations.  No square root, no per-layer
    normalisation (reference ``loop_df_fl.py``: ``torch.pow(torch.norm(p - q), 2)``).
    ``others`` is detached: gradients flow to ``params`` only.

    Returns:
        A 0-d tensor (dtype of the parameters) on the parameters' device.

    Raises:
        ValueError: empty lists, or different lengths or shapes.
    """
    params = list(params)
    others = list(others)
    if not params:
        raise ValueError("no parameters given")
    if len(params) != len(others):
        raise ValueError(f"parameter lists differ in length: {len(params)} vs {len(others)}")
    total = None
    for index, (p, q) in enumerate(zip(params, others)):
        if p.shape != q.shape:
            raise ValueError(f"parameter {index}: shape {tuple(p.shape)} vs {tuple(q.shape)}")
        term = (p - q.detach().to(p.device)).pow(2).sum()
        total = term if total is None else total + term
    return total


def d1(params: Sequence[Tensor], pool_params: Sequence[Sequence[Tensor]]) -> Tensor:
    """The diversity distance d1 (paper Eq. 7, squared as in the reference code).

    ``mean_j ||params - pool_params[j]||^2`` over the members of ``pool_params``.

    As in the reference code (implementation-notes section 1.2) the caller passes the
    pool *plus a frozen copy of the current model's start point* (the pool average),
    i.e. |M|+1 members, not the |M| of Eq. 7.  Consequently, for the first model of
    a site (pool ``[m0]``, start point ``m0``) d1 equals d2, and with alpha == beta
    the regulariser cancels for that model.  Since the start point is the mean of the
    pool, including it changes d1 only by a constant, never its gradient.  Pool
    tensors are detached.

    Raises:
        ValueError: empty pool, or a member misaligned with ``params``.
    """
    pool_params = list(pool_params)
    if not pool_params:
        raise ValueError("d1 needs at least one pool member")
    total = None
    for member in pool_params:
        term = model_parameters_distance_sq(params, member)
        total = term if total is None else total + term
    return total / len(pool_params)


def d2(params: Sequence[Tensor], m0_params: Sequence[Tensor]) -> Tensor:
    """The drift distance d2 (paper Eq. 8, squared as in the reference code).

    ``||params - m0||^2`` where m0 = pool[0]: the received model, or the warm-up model
    at the first site.  ``m0_params`` is detached.

    Raises:
        ValueError: misaligned parameter lists.
    """
    return model_parameters_distance_sq(params, m0_params)


def magnitude_scale(ce: float, d2: float) -> float:
    """The divisor ``a`` of the regulariser (reference ``scale_to_order_of_magnitude``).

    With ``oa = floor(log10(ce))`` and ``ob = floor(log10(d2))`` returns
    ``10 ** (ob - oa + 1)`` if ``ob > oa - 1`` else ``1.0``, so that ``d2 / a`` sits
    about one order of magnitude below the CE loss; it only ever shrinks.  Example
    (supplementary): CE 6.02, d = 45 gives a = 100, d / a = 0.45.  Returns 1.0 when
    ``d2 <= 0``, ``ce <= 0`` or either is not finite (the reference code would crash
    in ``log10`` for CE = 0).  Recomputed every batch from ``.item()`` values, so it is
    a constant without gradient.
    """
    ce = float(ce)
    d2 = float(d2)
    if not (math.isfinite(ce) and math.isfinite(d2)) or ce <= 0.0 or d2 <= 0.0:
        return 1.0
    oa = math.floor(math.log10(ce))
    ob = math.floor(math.log10(d2))
    if ob > oa - 1:
        return float(10 ** (ob - oa + 1))
    return 1.0


class _Regulariser:
    """Cheap per-batch d1/d2 for one pool model.

    Built once per model from detached flat copies of the pool.  d2 is computed
    literally.  d1 uses the identity ``mean_j ||x - p_j||^2 = ||x - c||^2 +
    mean_j ||p_j - c||^2`` with the centroid ``c = mean_j p_j``: the value equals the
    reference's up to rounding and the gradient ``2 (x - c)`` is the same, but it
    costs one subtraction per batch instead of |M|+1.
    """

    def __init__(self, m0_params, pool_params, alpha: float, beta: float, device):
        self.alpha = float(alpha)
        self.beta = float(beta)
        self.active = m0_params is not None and (self.alpha != 0.0 or self.beta != 0.0)
        self.use_d1 = self.active and self.alpha != 0.0 and pool_params is not None
        if not self.active:
            return
        with torch.no_grad():
            self.m0 = flatten(m0_params).to(device)
            if self.use_d1:
                pool_params = list(pool_params)
                if not pool_params:
                    raise ValueError("pool_params is empty")
                # Two streaming passes in float64 on the CPU: one flat member at a time.
                total = torch.zeros(self.m0.numel(), dtype=torch.float64)
                for member in pool_params:
                    flat = flatten(member)
                    if flat.numel() != self.m0.numel():
                        raise ValueError("pool_params members do not match m0_params")
                    total += flat.to(device="cpu", dtype=torch.float64)
                centroid = total / len(pool_params)
                spread = 0.0
                for member in pool_params:
                    spread += float((flatten(member).to(device="cpu", dtype=torch.float64) - centroid).pow(2).sum())
                self.centroid = centroid.to(dtype=self.m0.dtype, device=device)
                self.spread = spread / len(pool_params)

    def distances(self, params: Sequence[Tensor]) -> tuple[Tensor | None, Tensor | None]:
        """(d1, d2) for the current parameters; d1 None when unused, d2 without grad if beta == 0."""
        flat = torch.cat([p.reshape(-1) for p in params])
        if flat.numel() != self.m0.numel():
            raise ValueError("model parameters do not match m0_params")
        if self.beta != 0.0:
            diff = flat - self.m0
            dist2 = torch.dot(diff, diff)
        else:  # only needed for the magnitude scale
            with torch.no_grad():
                diff = flat.detach() - self.m0
                dist2 = torch.dot(diff, diff)
        dist1 = None
        if self.use_d1:
            diff = flat - self.centroid
            dist1 = torch.dot(diff, diff) + self.spread
        return dist1, dist2


# --------------------------------------------------------------------------- training


def _check_data(data, what: str, allow_empty: bool) -> tuple[Tensor, Tensor]:
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


def _check_data_fits(spec: ModelSpec, data: tuple[Tensor, Tensor], what: str) -> None:
    images, labels = data
    expected = (spec.in_channels, *tuple(spec.image_size))
    if tuple(images.shape[1:]) != expected and images.shape[0] > 0:
        raise ValueError(f"{what} images are {tuple(images.shape[1:])}, the model expects {expected}")
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= spec.num_classes):
        raise ValueError(f"{what} labels must lie in [0, {spec.num_classes})")


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
    images, labels = _check_data((images, labels), "evaluation data", allow_empty=True)
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


def _fit(
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
    m0_params=None,
    pool_params=None,
    on_epoch: EpochCallback | None = None,
) -> State:
    """The training loop shared by warm-up, pool models and FedSeq."""
    train_x, train_y = _check_data(train, "train", allow_empty=False)
    val_x, val_y = _check_data(val, "val", allow_empty=True)
    if pool_params is not None and m0_params is None:
        raise ValueError("pool_params needs m0_params (d2 sets the magnitude scale)")
    model.to(device)
    train_x, train_y = train_x.to(device), train_y.to(device)
    params = list(model.parameters())
    regulariser = _Regulariser(m0_params, pool_params, cfg.alpha, cfg.beta, device)
    optimizer = torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    use_best = cfg.selection == "best-val" and val_y.shape[0] > 0
    n = int(train_y.shape[0])
    best_state: State | None = None
    best_accuracy = -1.0
    for epoch in range(1, epochs + 1):
        started = time.perf_counter()
        model.train()
        # The batch order is drawn on the CPU (same order on every device) and moved once per
        # epoch: a host-to-device copy per batch made a GPU wait for its queue every step.
        order = torch.randperm(n, generator=generator).to(train_x.device)
        # Summed on the device, read once per epoch: a read per batch would make a GPU wait for
        # every step (float64, so the figure equals the sum of the batches' float values).
        ce_sum = torch.zeros((), dtype=torch.float64, device=train_x.device)
        for start in range(0, n, cfg.batch_size):
            idx = order[start:start + cfg.batch_size]
            x = train_x[idx].to(torch.float32).div_(255.0)
            y = train_y[idx]
            ce = F.cross_entropy(model(x), y)
            loss = ce
            if regulariser.active:
                dist1, dist2 = regulariser.distances(params)
                # a needs CE and d2 on the host (the reference's arithmetic): one read, not two.
                # Computing it on the GPU instead was no faster on an H100 (more, tiny kernels).
                a = magnitude_scale(*torch.stack([ce.detach(), dist2.detach()]).tolist())
                if dist1 is not None:
                    loss = loss - cfg.alpha * dist1 / a
                if cfg.beta != 0.0:
                    loss = loss + cfg.beta * dist2 / a
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            ce_sum += ce.detach().to(torch.float64) * int(y.shape[0])
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


def train_one_model(
    model: nn.Module,
    train,
    val,
    cfg: TrainConfig,
    generator: torch.Generator,
    device,
    *,
    m0_params: Sequence[Tensor] | None = None,
    pool_params: Sequence[Sequence[Tensor]] | None = None,
    on_epoch: EpochCallback | None = None,
) -> State:
    """Train ``model`` for ``cfg.local_epochs`` epochs and return the selected state.

    Paper Algorithm 1 lines 9-13 (Eq. 9); implementation-notes section 1.2/1.4.  A
    fresh ``torch.optim.Adam(lr=cfg.lr, weight_decay=cfg.weight_decay)``; batches
    are slices of ``torch.randperm(N, generator=generator)`` of ``cfg.batch_size``
    (last partial batch included).  Per batch the loss is

        ``CE - alpha * d1 / a + beta * d2 / a``, ``a = magnitude_scale(CE, d2)``

    when ``m0_params`` is given (parameter tensors aligned with
    ``model.parameters()``); ``pool_params`` (pool members + the frozen start point,
    see :func:`d1`) adds d1.  d1 is skipped when ``alpha == 0`` or ``pool_params`` is
    None, d2 enters the loss only when ``beta != 0`` (it is still computed, without
    gradient, for ``a``).  Without ``m0_params`` the loss is plain CE.

    After every epoch the model is evaluated on ``val``.  ``cfg.selection ==
    "best-val"`` returns a copy of the state of the epoch with the *strictly* best
    validation accuracy (the first epoch is always kept); ``"last-epoch"`` returns
    the last.  With an empty ``val`` the last epoch is returned (the reference code
    always has a validation split).  The module itself is left on ``device`` with its
    last-epoch weights.

    Args:
        model: moved to ``device`` in place.
        train: ``(uint8 N x C x H x W, int64 N)``, non-empty.
        val: same layout, may be empty.
        generator: CPU ``torch.Generator`` for the batch order (consumed).
        device: ``"cpu"``, ``"cuda"``, a ``torch.device``...
        on_epoch: called after each epoch with ``{"stage": "pool", "model": 0,
            "epoch": 1-based, "epochs", "train_loss": mean CE over the epoch's
            samples, "val_accuracy": float in [0, 1], or None when not validated (an empty
            val, or an epoch before the last under last-epoch selection), "seconds": wall time of
            the epoch including evaluation}`` (:func:`train_pool` passes the real
            1-based model index).

    Returns:
        The selected state (new CPU tensors).

    Raises:
        ValueError: bad config or data, ``pool_params`` without ``m0_params``,
            misaligned parameter lists.
    """
    cfg.validate()
    return _fit(
        model, train, val, cfg, generator, device,
        epochs=cfg.local_epochs, stage="pool", index=0,
        m0_params=m0_params, pool_params=pool_params, on_epoch=on_epoch,
    )


def _generator(seed: int) -> torch.Generator:
    generator = torch.Generator(device="cpu")
    generator.manual_seed(seed)
    return generator


def warm_up(model: nn.Module, train, val, cfg: TrainConfig, seed: int, device, on_epoch: EpochCallback | None = None) -> State:
    """Warm up the first site's freshly built model (paper Algorithm 1 line 1).

    Plain CE for ``cfg.warmup_epochs`` epochs with the same optimiser, batching and
    selection as :func:`train_one_model` (implementation-notes section 1.4); batch
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
        _check_data(train, "train", allow_empty=False)
        return clone_state(model.state_dict())
    return _fit(
        model, train, val, cfg, _generator(derive_seed(seed, "warmup")), device,
        epochs=cfg.warmup_epochs, stage="warmup", index=0, on_epoch=on_epoch,
    )


def train_pool(
    m0: Mapping[str, Tensor],
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
) -> tuple[State, list[State]]:
    """Build one site's FedELMY model pool (paper Algorithm 1 lines 5-16, Eq. 6-9).

    ``pool = [m0] + list(finished)``; then for ``j = len(finished)+1 .. S``: build the
    model (global RNG untouched), load ``average_states(pool)``, train it with
    :func:`train_one_model` semantics (batch order ``derive_seed(seed, "pool", j)``,
    d2 to ``pool[0]``, d1 to the pool members + the frozen start point, as the
    reference code does; implementation-notes section 1.1/1.2), append the selected
    state and call ``on_model(j, state)`` so that the caller can persist it.

    Resume: pass the states already trained (in order) as ``finished``; since each
    model depends only on the pool before it and its own derived seed, the result is
    bit-identical to an uninterrupted run.  ``on_model`` is called only for newly
    trained models.  ``on_epoch`` gets ``stage="pool"``, ``model=j``.

    Returns:
        ``(average_states(pool), pool)`` with ``len(pool) == S + 1``; ``pool[0]`` is
        ``m0`` and ``pool[1:len(finished)+1]`` the ``finished`` states as given.

    Raises:
        ValueError: bad config or data, more than S ``finished`` states, or a state
            that does not fit ``spec``.
    """
    cfg.validate()
    train = _check_data(train, "train", allow_empty=False)
    val = _check_data(val, "val", allow_empty=True)
    _check_data_fits(spec, train, "train")
    _check_data_fits(spec, val, "val")
    with torch.random.fork_rng(devices=[]):
        reference = build_model(spec)
    expected = state_signature(reference)
    names = param_names(reference)
    check_signature(m0, expected, "m0")
    finished = list(finished)
    if len(finished) > cfg.models_per_site:
        raise ValueError(f"{len(finished)} finished models but models_per_site is {cfg.models_per_site}")
    for j, state in enumerate(finished, start=1):
        check_signature(state, expected, f"finished model {j}")
    pool: list = [m0, *finished]
    m0_params = [m0[name] for name in names]
    for j in range(len(finished) + 1, cfg.models_per_site + 1):
        start = average_states(pool)
        model = build_loaded(spec, start)
        pool_params = [[member[name] for name in names] for member in (*pool, start)]
        state = _fit(
            model, train, val, cfg, _generator(derive_seed(seed, "pool", j)), device,
            epochs=cfg.local_epochs, stage="pool", index=j,
            m0_params=m0_params, pool_params=pool_params, on_epoch=on_epoch,
        )
        pool.append(state)
        if on_model is not None:
            on_model(j, state)
    return average_states(pool), pool


def train_fedseq(
    m0: Mapping[str, Tensor],
    spec: ModelSpec,
    train,
    val,
    cfg: TrainConfig,
    seed: int,
    device,
    on_epoch: EpochCallback | None = None,
) -> State:
    """The FedSeq baseline at one site: one model from ``m0``, plain CE, S*E epochs.

    Same optimiser, batching and selection as :func:`train_one_model`; batch order
    from ``derive_seed(seed, "fedseq")``.  Neither FedSeq nor its hyperparameters are
    in the reference repository (implementation-notes section 1.7); S*E epochs give
    it the same local compute as FedELMY (paper section 4.3.2).  ``on_epoch`` gets
    ``stage="fedseq"``, ``model=0``, ``epochs=S*E``.

    Returns:
        The selected state (new CPU tensors).

    Raises:
        ValueError: bad config or data, or an ``m0`` that does not fit ``spec``.
    """
    cfg.validate()
    train = _check_data(train, "train", allow_empty=False)
    val = _check_data(val, "val", allow_empty=True)
    _check_data_fits(spec, train, "train")
    _check_data_fits(spec, val, "val")
    check_signature(m0, expected_signature(spec), "m0")
    model = build_loaded(spec, m0)
    return _fit(
        model, train, val, cfg, _generator(derive_seed(seed, "fedseq")), device,
        epochs=cfg.models_per_site * cfg.local_epochs, stage="fedseq", index=0, on_epoch=on_epoch,
    )


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
) -> tuple[State, list[State]]:
    """Everything one site does (paper Algorithm 1, one iteration of the client loop).

    ``on_warmup(m0)`` is called with the first site's warm-up state as soon as it exists, so a
    daemon can persist it and, after a restart, pass it back as ``m0`` (same result).

    If ``m0`` is None (the first site): ``torch.manual_seed(derive_seed(seed,
    "init"))``, build the model and :func:`warm_up` it; the warm-up state is m0.  The
    seeding and construction happen inside ``torch.random.fork_rng`` (the caller's
    global RNG state is restored) and under the model zoo's construction lock, so a
    concurrent ``build_model`` in another thread cannot change the initialisation.
    Both strategies get the warm-up so that they spend the same local epochs (the
    reference repository has no FedSeq; implementation-notes section 1.7).  A resumed
    first site re-runs the warm-up, which is deterministic; passing the warm-up state
    as ``m0`` instead gives the identical result.

    Then ``"fedelmy"``: :func:`train_pool`, sending the pool average.  ``"fedseq"``:
    :func:`train_fedseq`, sending the trained model; its pool is ``[m0, trained]``.
    For FedSeq ``on_model(1, trained)`` is called too, and ``finished`` may hold that
    one state to skip the training on resume.

    Args:
        seed: the site's seed, e.g. ``derive_seed(run_seed, "site", i)``.
        finished, on_epoch, on_model: see :func:`train_pool`.

    Returns:
        ``(model to send, pool)``: the final model of the chain when this is the last
        site.

    Raises:
        ValueError: bad config, data that do not fit ``spec``, or states that do not
            fit ``spec``.
    """
    cfg.validate()
    train = _check_data(train, "train", allow_empty=False)
    val = _check_data(val, "val", allow_empty=True)
    _check_data_fits(spec, train, "train")
    _check_data_fits(spec, val, "val")
    if m0 is None:
        model = _build_seeded(spec, derive_seed(seed, "init"))
        m0 = warm_up(model, train, val, cfg, seed, device, on_epoch=on_epoch)
        del model
        if on_warmup is not None:
            on_warmup(m0)
    if cfg.strategy == "fedelmy":
        return train_pool(m0, spec, train, val, cfg, seed, device,
                          finished=finished, on_epoch=on_epoch, on_model=on_model)
    finished = list(finished)
    if len(finished) > 1:
        raise ValueError(f"fedseq trains one model per site; got {len(finished)} finished states")
    if finished:
        check_signature(finished[0], expected_signature(spec), "finished model 1")
        trained = finished[0]
    else:
        trained = train_fedseq(m0, spec, train, val, cfg, seed, device, on_epoch=on_epoch)
        if on_model is not None:
            on_model(1, trained)
    return trained, [m0, trained]
