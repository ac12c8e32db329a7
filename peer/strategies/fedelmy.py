"""FedELMY: a model pool per site, diversity-regularised.

Paper: Wang et al., "One-Shot Sequential Federated Learning for Non-IID Data by Enhancing
Local Model Diversity", ACM MM 2024, Algorithm 1 and Eq. 5-9; behaviour follows the
authors' code as docs/explanation/reference-code.md section 1 describes it.

Each site builds a model pool ``[m0, b1, ..., bS]``.  Model ``bj`` starts from the uniform
average of the pool so far, trains ``E`` epochs with ``CE - alpha*d1/a + beta*d2/a`` and
keeps its best-validation epoch; the site sends the average of the pool.

Read top to bottom like Algorithm 1, from the client's loop down to the equations:

* :func:`train_pool`: lines 5-16, one site's pool (Eq. 6 start points, Eq. 5 the average
  sent on); :func:`train` and :func:`models_to_keep` are its entry in
  :mod:`fedrelay.registry`.  The first site's warm-up (line 1) is
  :func:`fedrelay.peer.training.warm_up`, shared with every strategy.
* :func:`train_one_model`: lines 9-13, one pool model's local training.
* :class:`_Regulariser`: the loss of line 11 (Eq. 9) per batch, with the divisor
  :func:`magnitude_scale`.
* :func:`d1` (Eq. 7), :func:`d2` (Eq. 8) and :func:`model_parameters_distance_sq`: the
  distances, literally; the regulariser computes the same values faster.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from fedrelay import tasks
from fedrelay.task import Task

from fedrelay.models import ModelSpec, build_model, state_signature
from ..states import State, average_states, build_loaded, flatten, param_names
from ..determinism import derive_seed, seeded_generator
from ..model_pool import ModelCallback, fill_pool
from ..site_data import check_site_data
from ..train_config import TrainConfig
from ..training_loop import BatchLoss, EpochCallback, fit

__all__ = [
    "train_pool",
    "train",
    "models_to_keep",
    "train_one_model",
    "magnitude_scale",
    "d1",
    "d2",
    "model_parameters_distance_sq",
]


# --------------------------------------------------------------------------- the pool (lines 5-16)


def train_pool(m0: Mapping[str, Tensor], spec: ModelSpec, train, val, cfg: TrainConfig, seed: int, device, *,
               finished: Sequence[Mapping[str, Tensor]] = (), on_epoch: EpochCallback | None = None,
               on_model: ModelCallback | None = None, batch_loss: BatchLoss | None = None,
               ) -> tuple[State, list[State]]:
    """Build one site's FedELMY model pool (paper Algorithm 1 lines 5-16, Eq. 6-9).

    ``pool = [m0] + list(finished)``; then for ``j = len(finished)+1 .. S``: build the
    model (global RNG untouched), load ``average_states(pool)``, train it with
    :func:`train_one_model` (batch order ``derive_seed(seed, "pool", j)``,
    d2 to ``pool[0]``, d1 to the pool members + the frozen start point, as the
    reference code does; reference-code §1.1/§1.2), append the selected
    state and call ``on_model(j, state)`` so that the caller can persist it.

    Resume: pass the states already trained (in order) as ``finished``; since each
    model depends only on the pool before it and its own derived seed, the result is
    bit-identical to an uninterrupted run.  ``on_model`` is called only for newly
    trained models.  ``on_epoch`` gets ``stage="pool"``, ``model=j``.

    ``batch_loss`` (an extension's hook, not the paper's: ``fedelmy-kd``,
    :mod:`fedrelay.peer.strategies.fedelmy_kd`) replaces the task's loss of every batch of
    every pool model (:func:`fedrelay.peer.training_loop.train_one_epoch`); d1 and d2 are
    added to it as to CE.  None (the default): the paper's loss, arithmetic unchanged.

    Returns:
        ``(average_states(pool), pool)`` with ``len(pool) == S + 1``; ``pool[0]`` is
        ``m0`` and ``pool[1:len(finished)+1]`` the ``finished`` states as given.

    Raises:
        ValueError: bad config or data, more than S ``finished`` states, or a state
            that does not fit ``spec``.
    """
    cfg.validate()
    train, val = check_site_data(spec, train, val)
    task = tasks.resolve(spec)
    with torch.random.fork_rng(devices=[]):
        reference = build_model(spec)
    names = param_names(reference)

    def pool_model(j: int, pool: list[State]) -> State:  # lines 7-13 for model j of the pool so far
        start = average_states(pool)  # line 8, Eq. 6
        model = build_loaded(spec, start)
        m0_params = [m0[name] for name in names]
        pool_params = [[member[name] for name in names] for member in (*pool, start)]
        return train_one_model(  # lines 9-13
            model, train, val, cfg, seeded_generator(derive_seed(seed, "pool", j)), device,
            index=j, m0_params=m0_params, pool_params=pool_params, on_epoch=on_epoch, task=task,
            batch_loss=batch_loss,
        )

    # line 5: M = {m0}, plus the models a resumed site already has; line 14 appends each new one
    pool = fill_pool(m0, state_signature(reference), cfg.models_per_site, finished, pool_model, on_model)
    return average_states(pool), pool  # line 16, Eq. 5


# The registry's entry points (fedrelay.registry): a FedELMY visit is the pool, and a resumed
# site needs every pool model it has trained.
train = train_pool


def models_to_keep(cfg: TrainConfig) -> int:
    """How many models :func:`train` hands to ``on_model`` (and takes back as ``finished``): S."""
    return cfg.models_per_site


# --------------------------------------------------------------------------- one pool model (lines 9-13)


def train_one_model(model: nn.Module, train, val, cfg: TrainConfig, generator: torch.Generator, device, *,
                    index: int = 0, m0_params: Sequence[Tensor] | None = None,
                    pool_params: Sequence[Sequence[Tensor]] | None = None, on_epoch: EpochCallback | None = None,
                    task: Task, batch_loss: BatchLoss | None = None) -> State:
    """Train ``model`` for ``cfg.local_epochs`` epochs and return the selected state.

    Paper Algorithm 1 lines 9-13 (Eq. 9); reference-code §1.2/§1.4.  A
    fresh optimiser (the task's: ``torch.optim.Adam(lr=cfg.lr, weight_decay=cfg.weight_decay)``
    by default); batches are slices of ``torch.randperm(N, generator=generator)`` of
    ``cfg.batch_size`` (last partial batch included; the loop is
    :func:`fedrelay.peer.training.fit`).  Per batch the loss is

        ``CE - alpha * d1 / a + beta * d2 / a``, ``a = magnitude_scale(CE, d2)``

    where ``CE`` is the task's loss of the batch (the paper's cross-entropy by default).

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
        model, train, val, generator, device, task: as :func:`fedrelay.peer.training.fit`
            takes them (the model is moved to ``device`` in place; ``train`` non-empty).
        index: the ``"model"`` reported to ``on_epoch`` (:func:`train_pool` passes the
            real 1-based model index).
        batch_loss: replaces ``CE`` above by ``batch_loss(outputs, inputs, labels)``
            (:data:`fedrelay.peer.training_loop.BatchLoss`; ``fedelmy-kd``); None: CE.
        on_epoch: called after each epoch with ``{"stage": "pool", "model": index,
            "epoch": 1-based, "epochs", "train_loss": mean CE over the epoch's
            samples, "val_accuracy": float in [0, 1], or None when not validated (an empty
            val, or an epoch before the last under last-epoch selection), "seconds": wall time of
            the epoch including evaluation}``.

    Returns:
        The selected state (new CPU tensors).

    Raises:
        ValueError: bad config or data, ``pool_params`` without ``m0_params``,
            misaligned parameter lists.
    """
    cfg.validate()
    if pool_params is not None and m0_params is None:
        raise ValueError("pool_params needs m0_params (d2 sets the magnitude scale)")
    regulariser = _Regulariser(m0_params, pool_params, cfg.alpha, cfg.beta, device)
    return fit(
        model, train, val, cfg, generator, device,
        epochs=cfg.local_epochs, stage="pool", index=index,
        regulariser=regulariser if regulariser.active else None, on_epoch=on_epoch, task=task,
        batch_loss=batch_loss,
    )


# --------------------------------------------------------------------------- the loss (line 11, Eq. 9)


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

    def __call__(self, ce: Tensor, params: Sequence[Tensor]) -> Tensor:
        """The batch loss ``CE - alpha * d1 / a + beta * d2 / a`` (paper Eq. 9), ``a =
        magnitude_scale(CE, d2)``: d1 only when used, d2 only when ``beta != 0``."""
        dist1, dist2 = self.distances(params)
        # a needs CE and d2 on the host (the reference's arithmetic): one read, not two.
        # Computing it on the GPU instead was no faster on an H100 (more, tiny kernels).
        a = magnitude_scale(*torch.stack([ce.detach(), dist2.detach()]).tolist())
        loss = ce
        if dist1 is not None:
            loss = loss - self.alpha * dist1 / a
        if self.beta != 0.0:
            loss = loss + self.beta * dist2 / a
        return loss


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

# --------------------------------------------------------------------------- the distances (Eq. 7, 8)


def d1(params: Sequence[Tensor], pool_params: Sequence[Sequence[Tensor]]) -> Tensor:
    """The diversity distance d1 (paper Eq. 7, squared as in the reference code).

    ``mean_j ||params - pool_params[j]||^2`` over the members of ``pool_params``.

    As in the reference code (reference-code §1.2) the caller passes the
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
