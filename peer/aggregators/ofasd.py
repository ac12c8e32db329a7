"""OFASD: one-shot federated anisotropic scaling distillation.

Paper: Koshibuchi, Kera, Kawamoto, "OFASD: One-Shot Federated Anisotropic Scaling
Distillation", Algorithm 1.  No code has been published (reference-code §3.1);
details the paper leaves open follow aTLAS (``fredzzhang/atlas``, reference-code §3.2),
the code OFASD builds on, and every difference from the paper and from aTLAS is listed below.

Algorithm (:func:`distil`, :func:`aggregate`)
    Task vectors ``τ_k = θ_k − θ0`` of the K uploaded models against the run's common initial
    model θ0 (``ctx.initial``; OFASD needs one, so independent initialisations raise
    ``ValueError``).  Each τ_k is split into B blocks: ``ofasd_mode="block"`` (default) makes
    every floating *parameter* tensor its own block (weights and biases of conv, linear and
    BatchNorm layers, as aTLAS's ``make_functional_with_buffers`` grouping), matched by NAME,
    not by position (reference-code §3.2's pitfall: with BatchNorm buffers in the state a
    positional pairing misaligns); ``"client"`` makes the whole parameter vector one block.
    Each block is normalised to unit norm (a zero block stays zero) and the global model is::

        θ_g = θ0 + Σ_k Σ_b λ_k^(b) τ_k^(b) / ‖τ_k^(b)‖

    The coefficients λ (K x B) are trained to make the model's predictions match the ensemble's:
    the loss is ``KL(F_ens(x) ‖ f(x; θ_g))`` averaged over the batch, where the teacher ``F_ens``
    is the mean of the K uploaded models' softmax outputs (each in eval mode with its own
    BatchNorm statistics) and the student ``f(·; θ_g)`` is the model evaluated with
    ``torch.func.functional_call`` on θ_g's parameters, in eval mode, with the BatchNorm
    buffers set to the uniform mean of the uploads' buffers.  Adam (``lr=ofasd_lr``) on λ only,
    ``ofasd_epochs`` epochs over the transfer set in batches of ``ctx.cfg.batch_size`` (last
    partial batch included).

Transfer data (``ofasd_transfer``; :mod:`.ofasd_transfer`)
    ``"mixup"`` (default): every epoch a fresh mixup of the aggregating site's own train split
    (``ctx.train``, N images): M = max(N, ``ofasd_transfer_size``) images
    ``x'_i = λ_i x_a(i) + (1 − λ_i) x_b(i)``, ``λ_i ~ Beta(α, α)`` (α = ``ofasd_mixup_alpha``),
    a, b runs of random permutations of the N, drawn from
    ``numpy.random.Generator(PCG64(derive_seed(ctx.seed, "ofasd", "mixup")))``; the teacher's
    outputs are computed on each mixed batch.  ``"plain"``: the site's images in a fresh
    order every epoch, drawn from ``seeded_generator(derive_seed(ctx.seed, "ofasd"))``
    (``torch.randperm``), the teacher's outputs computed once before the first epoch.  Inputs
    are the task's ``Task.batch(..., train=False)`` (no train-time transforms).

Selection (``ofasd_select``)
    The run keeps the coefficients of one epoch, or the starting point (the weight average:
    epoch 0), judged on the site's validation split ``ctx.val`` (never trained on):

    * ``"kl"`` (default): the lowest ``KL(F_ens ‖ f(·; θ_g))`` (mean over images) on held-out
      transfer data: the validation images and, with ``"mixup"`` transfer, as many mixup
      images of them, drawn once from ``derive_seed(ctx.seed, "ofasd", "holdout")``.  This
      is the quantity OFASD minimises, measured where it was not fitted; strictly lower
      replaces, so a tie keeps the earlier (the weight average first).
    * ``"accuracy"``: the strictly best top-1 accuracy on the validation images (the earlier
      behaviour, as aTLAS keeps its best validation epoch).  On a skewed local validation
      split many epochs tie with the weight average, which then stays: OFASD returned FedAvg's
      (uniform) model in 2 of 10 cells of the 600-image grid.

    With an empty ``ctx.val`` the last epoch's coefficients are kept.  :func:`distil` returns
    which epoch was kept and whether it is the starting point (``at_start``: the result is the
    weight average, i.e. FedAvg with uniform weights); :func:`aggregate` logs it
    (``fedrelay.peer`` logger, INFO) and the progress events carry the scores.

Any model: the blocks are the model's floating-point parameter tensors (``named_parameters``),
whatever their layers; buffers are averaged.  Mixup needs floating-point model inputs
(``ValueError`` naming ``--ofasd-transfer plain`` otherwise).

Returned model: the parameters of θ_g for the kept λ (composed in float64, cast to float32),
and the uniform mean of the uploads' buffers (running statistics and ``num_batches_tracked``,
truncated like :func:`fedrelay.peer.states.average_states`).

Options (registry entry ``ofasd``): ``ofasd_mode`` ("block"), ``ofasd_epochs`` (20),
``ofasd_lr`` (0.01), ``ofasd_transfer`` ("mixup"), ``ofasd_mixup_alpha`` (1.0),
``ofasd_transfer_size`` (0: N), ``ofasd_select`` ("kl").  No extras.
``ofasd_transfer="plain", ofasd_select="accuracy", ofasd_epochs=2`` is the earlier default,
bit for bit.

Training budget
    The paper trains OFASD inside DENSE's server loop (Zhang et al., NeurIPS 2022): 200
    epochs of generator data (its Fig. 2, where OFASD passes 60 % on CIFAR-10 after one epoch
    and then keeps improving slowly); it gives no step count and no η.  aTLAS, the code it
    builds on, learns its coefficients for 20 epochs (task addition, lr 1e-3; few-shot: 10
    epochs at lr 1e-1, cosine).  We take aTLAS's 20 epochs over the transfer set (was 2): at
    batch 128 about 100 Adam steps on a 540-image site (was about 10), about 850 on a
    full-data Fashion-MNIST site of 5,400 images; lr stays 0.01.  ``ofasd_transfer_size``
    raises a small site's mixup epoch to that many images (default 0: the site's N); in a
    probe (one seed, Dirichlet 0.1, a 108-image aggregating site) 100 epochs did no better
    than 20, so the default does not pay for it.

Differences from the paper and aTLAS, and choices they leave open
    * Transfer data: the site's own train split (mixup by default), not DENSE's generator
      data (the paper) nor a labelled validation set (aTLAS).  Mixup is ours.
    * Initialisation: ``λ_k^(b) = ‖τ_k^(b)‖ / K``, so the composed model starts at the plain
      weight average of the uploads (Eq. 2's first-order ensemble approximation).  aTLAS starts
      at λ = 0, i.e. at θ0, which is a sensible model there because θ0 is *pretrained*; ours may
      be a random initialisation (the sites share it, they need not pretrain it), whose
      predictions are meaningless, so starting the search there would waste the epochs.
    * Selection by held-out KL to the ensemble (ours); aTLAS keeps the best validation
      accuracy (``ofasd_select="accuracy"``); the paper does not say.
    * BatchNorm buffers: the uniform mean of the uploads' buffers.  aTLAS keeps θ0's, but a
      random θ0's running statistics (mean 0, variance 1) describe no data; the uploads' mean is
      what the weight average (FedAvg) uses.
    * Plain Adam without weight decay, gradient clipping or mixed precision (aTLAS: AdamW, wd 0.1,
      clip 1.0, fp16); the paper says only "learning rate η" (Algorithm 1 writes plain gradient
      descent).  Task vectors stay float32 (aTLAS stores fp16).  The head is a block like any
      other (aTLAS freezes CLIP's head).
    * aTLAS×K's random partition of each tensor is not used: one coefficient per tensor.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.nn import functional as F

from fedrelay import registry, tasks

from fedrelay.models import ModelSpec, build_model, check_state
from ..states import State, build_loaded
from ..training import check_site_data, derive_seed, seeded_generator
from . import Context, Upload
from . import ofasd_transfer as transfer
from ._common import Schema, check_uploads, expected_keys, uniform_state

__all__ = ["extras_schema", "site_extras", "aggregate", "distil", "Distilled", "blocks", "MODES", "SELECTIONS",
           "TRANSFERS"]

log = logging.getLogger("fedrelay.peer")

MODES = ("block", "client")
SELECTIONS = ("kl", "accuracy")
TRANSFERS = transfer.TRANSFERS
_EVAL_BATCH = 512


@dataclass(frozen=True)
class _Options:
    mode: str
    epochs: int
    lr: float
    transfer: str
    alpha: float
    size: int
    select: str


def _options(options: dict) -> _Options:
    options = registry.with_defaults("ofasd", options)  # the defaults: its registry entry
    mode, epochs, lr = options["ofasd_mode"], options["ofasd_epochs"], options["ofasd_lr"]
    source, alpha, select = options["ofasd_transfer"], options["ofasd_mixup_alpha"], options["ofasd_select"]
    size = options["ofasd_transfer_size"]
    if mode not in MODES:
        raise ValueError(f"ofasd_mode must be one of {MODES}, got {mode!r}")
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 0:
        raise ValueError(f"ofasd_epochs must be an int >= 0, got {epochs!r}")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (lr > 0 and math.isfinite(lr)):
        raise ValueError(f"ofasd_lr must be a number > 0, got {lr!r}")
    if source not in TRANSFERS:
        raise ValueError(f"ofasd_transfer must be one of {TRANSFERS}, got {source!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (alpha > 0 and math.isfinite(alpha)):
        raise ValueError(f"ofasd_mixup_alpha must be a number > 0, got {alpha!r}")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"ofasd_transfer_size must be an int >= 0, got {size!r}")
    if select not in SELECTIONS:
        raise ValueError(f"ofasd_select must be one of {SELECTIONS}, got {select!r}")
    return _Options(mode, epochs, float(lr), source, float(alpha), size, select)


def extras_schema(spec: ModelSpec, options: dict) -> Schema:
    """No extras: ``{}``."""
    _options(options)
    return {}


def site_extras(state, spec: ModelSpec, train, options: dict, device="cpu") -> dict[str, Tensor]:
    """No extras: ``{}``."""
    _options(options)
    return {}


@functools.lru_cache(maxsize=32)
def _param_names(spec: ModelSpec) -> tuple[str, ...]:
    with torch.device("meta"):
        model = build_model(spec)
    return tuple(name for name, p in model.named_parameters() if p.is_floating_point())


def blocks(spec: ModelSpec, mode: str = "block") -> list[list[str]]:
    """The parameter blocks, by state name, in ``model.named_parameters()`` order: one block per
    parameter tensor (``"block"``) or one block of all parameters (``"client"``)."""
    if mode not in MODES:
        raise ValueError(f"ofasd_mode must be one of {MODES}, got {mode!r}")
    names = list(_param_names(spec))
    return [[n] for n in names] if mode == "block" else [names]


class _Composer:
    """θ_g(λ) = θ0 + Σ_k λ[k, b(n)] u_k[n] per parameter n, u_k the unit-norm blocks of τ_k."""

    def __init__(self, theta0: State, states: Sequence[State], block_list: list[list[str]], device):
        self.k = len(states)
        self.block_of = {n: b for b, block in enumerate(block_list) for n in block}
        self.names = [n for block in block_list for n in block]
        self.norms = torch.zeros((self.k, len(block_list)), dtype=torch.float64)
        for k, state in enumerate(states):
            for b, block in enumerate(block_list):
                squares = sum(float((state[n].double() - theta0[n].double()).pow(2).sum()) for n in block)
                self.norms[k, b] = math.sqrt(squares)
        self.theta0 = {n: theta0[n].detach().to(device=device, dtype=torch.float32) for n in self.names}
        self.units: dict[str, Tensor] = {}
        for n in self.names:
            b = self.block_of[n]
            rows = []
            for k, state in enumerate(states):
                tau = state[n].detach().double() - theta0[n].detach().double()
                norm = float(self.norms[k, b])
                rows.append(tau / norm if norm > 0 else torch.zeros_like(tau))
            self.units[n] = torch.stack(rows).to(device=device, dtype=torch.float32)
        self._theta0 = theta0
        self._states = list(states)

    def initial(self) -> Tensor:
        """λ at the start: ‖τ_k^(b)‖ / K (the weight average)."""
        return (self.norms / self.k).to(torch.float32)

    def __call__(self, coef: Tensor) -> dict[str, Tensor]:
        """The composed parameters (float32, differentiable in ``coef``)."""
        return {n: self.theta0[n] + torch.tensordot(coef[:, self.block_of[n]], self.units[n], dims=1)
                for n in self.names}

    def final(self, coef: Tensor) -> State:
        """The composed parameters in float64 from the raw task vectors, cast to float32 (CPU)."""
        coef = coef.detach().to(device="cpu", dtype=torch.float64)
        out = {}
        for n in self.names:
            b = self.block_of[n]
            start = self._theta0[n].detach().to(device="cpu", dtype=torch.float64)
            total = start.clone()
            for k, state in enumerate(self._states):
                norm = float(self.norms[k, b])
                if norm > 0:
                    tau = state[n].detach().to(device="cpu", dtype=torch.float64) - start
                    total += (float(coef[k, b]) / norm) * tau
            out[n] = total.to(torch.float32).contiguous()
        return out


def _ensemble(models: Sequence[nn.Module], x: Tensor) -> Tensor:
    """Mean over ``models`` (eval mode) of their softmax outputs on one batch: ``(B, classes)``."""
    with torch.no_grad():  # not inference_mode: the result is a KL target, saved for backward
        total = F.softmax(models[0](x), dim=1)
        for model in models[1:]:
            total += F.softmax(model(x), dim=1)
        return total / len(models)


def _teacher(models: Sequence[nn.Module], images: Tensor, device, task) -> Tensor:
    """:func:`_ensemble` over ``images`` (the task's stored inputs) in chunks: ``(N, classes)``."""
    out = []
    for start in range(0, int(images.shape[0]), _EVAL_BATCH):
        out.append(_ensemble(models, task.batch(images[start:start + _EVAL_BATCH].to(device), train=False)))
    return torch.cat(out)


def _accuracy(student: nn.Module, params: dict, buffers: dict, images: Tensor, labels: Tensor, device,
              task) -> float:
    correct = 0
    with torch.no_grad():
        for start in range(0, int(labels.shape[0]), _EVAL_BATCH):
            x = task.batch(images[start:start + _EVAL_BATCH].to(device), train=False)
            y = labels[start:start + _EVAL_BATCH].to(device)
            logits = functional_call(student, {**params, **buffers}, (x,))
            correct += int((logits.argmax(dim=1) == y).sum())
    return correct / int(labels.shape[0])


def _held_out(models, images: Tensor, opts: _Options, seed: int, device, task) -> list[tuple[Tensor, Tensor]]:
    """The held-out transfer data of ``ofasd_select="kl"``: ``[(inputs, teacher probabilities)]``
    chunks: the validation images, then (mixup transfer) one mixup draw of them."""
    chunks = []
    for start in range(0, int(images.shape[0]), _EVAL_BATCH):
        x = task.batch(images[start:start + _EVAL_BATCH].to(device), train=False)
        chunks.append((x, _ensemble(models, x)))
    if opts.transfer == "mixup":
        pairs = transfer.draw(transfer.generator(seed), int(images.shape[0]), opts.alpha)
        for start in range(0, len(pairs), _EVAL_BATCH):
            part = slice(start, start + _EVAL_BATCH)
            x = transfer.mix(task.batch(images[pairs.a[part]].to(device), train=False),
                             task.batch(images[pairs.b[part]].to(device), train=False), pairs.lam[part])
            chunks.append((x, _ensemble(models, x)))
    return chunks


def _held_out_kl(student: nn.Module, params: dict, buffers: dict, chunks) -> float:
    """``KL(F_ens ‖ f(·; θ_g))`` summed over the held-out images and divided by their count."""
    total, count = 0.0, 0
    with torch.no_grad():
        for x, target in chunks:
            logits = functional_call(student, {**params, **buffers}, (x,))
            total += float(F.kl_div(F.log_softmax(logits, dim=1), target, reduction="sum"))
            count += int(x.shape[0])
    return total / count


@dataclass
class Distilled:
    """What :func:`distil` returns.

    Attributes:
        state: the final model (the run model's keys, new contiguous CPU tensors).
        kept_epoch: the epoch whose coefficients were kept; 0 = the starting point.
        at_start: ``kept_epoch == 0``: the result is the weight average (FedAvg, uniform).
        criterion: ``"kl"``, ``"accuracy"`` or ``"last"`` (no validation images, or 0 epochs).
        scores: the criterion per epoch, index 0 the starting point (mean held-out KL in nats,
            or accuracy in [0, 1]); empty for ``"last"``.
    """

    state: State
    kept_epoch: int
    at_start: bool
    criterion: str
    scores: list[float] = field(default_factory=list)


def distil(uploads: Sequence[Upload], ctx: Context) -> Distilled:
    """OFASD over the uploads (module docstring), in the order given, with what was kept.

    Uses ``ctx.initial`` (θ0), ``ctx.train`` (the transfer data's source), ``ctx.val``
    (selection), ``ctx.cfg.batch_size``, ``ctx.seed``, ``ctx.device`` and ``ctx.options``.
    ``ctx.on_epoch`` is called after each epoch with ``{"stage": "aggregate", "model": 0,
    "epoch": 1-based, "epochs", "train_loss": the mean KL over the epoch's transfer images,
    "val_accuracy": float in [0, 1] or None (empty val), "holdout_kl": the mean held-out KL
    or None (not ``"kl"`` selection, or empty val), "seconds"}``.

    Raises:
        ValueError: no uploads, ``ctx.initial`` is None, a state (or θ0) that does not fit
            ``ctx.spec``, extras attached, bad data or options, mixup on non-float inputs.
    """
    opts = _options(ctx.options)
    spec = ctx.spec
    task = tasks.resolve(spec)
    uploads = check_uploads(uploads, spec, {}, "ofasd")
    if ctx.initial is None:
        raise ValueError("ofasd needs the sites' common initial model θ0 (ctx.initial is None: the sites "
                         "used independent initialisations, and task vectors θ_k − θ0 are then meaningless)")
    try:
        check_state(ctx.initial, spec)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"ofasd: the initial model θ0: {exc}") from None
    (train_x, train_y), (val_x, val_y) = check_site_data(spec, ctx.train, ctx.val)
    batch_size = int(ctx.cfg.batch_size)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    device = ctx.device
    states = [u.state for u in uploads]
    keys = expected_keys(spec)
    block_list = blocks(spec, opts.mode)
    param_set = {n for block in block_list for n in block}
    buffers_cpu = uniform_state(states, [k for k in keys if k not in param_set])
    buffers = {k: v.to(device) for k, v in buffers_cpu.items()}
    composer = _Composer(ctx.initial, states, block_list, device)
    models = [build_loaded(spec, s).to(device).eval() for s in states]
    mixup = opts.transfer == "mixup"
    teacher = None if mixup else _teacher(models, train_x, device, task)
    student = build_loaded(spec, states[0]).to(device).eval()
    for p in student.parameters():
        p.requires_grad_(False)

    coef = composer.initial().to(device).requires_grad_(True)
    optimizer = torch.optim.Adam([coef], lr=opts.lr)
    use_val = int(val_y.shape[0]) > 0
    criterion = opts.select if use_val and opts.epochs > 0 else "last"
    best, kept, scores = coef.detach().clone(), 0, []
    held_out = []
    if criterion == "kl":
        held_out = _held_out(models, val_x, opts, derive_seed(ctx.seed, "ofasd", "holdout"), device, task)
        with torch.no_grad():
            scores.append(_held_out_kl(student, composer(coef), buffers, held_out))
    elif criterion == "accuracy":
        with torch.no_grad():
            scores.append(_accuracy(student, composer(coef), buffers, val_x, val_y, device, task))
    generator = seeded_generator(derive_seed(ctx.seed, "ofasd"))
    rng = transfer.generator(derive_seed(ctx.seed, "ofasd", "mixup")) if mixup else None
    n = int(train_y.shape[0])
    m = max(n, opts.size) if mixup else n  # transfer images per epoch
    train_x_dev = train_x.to(device)
    for epoch in range(1, opts.epochs + 1):
        started = time.perf_counter()
        if mixup:
            pairs = transfer.draw(rng, n, opts.alpha, m)
            order = pairs.a.to(device)
        else:
            order = torch.randperm(n, generator=generator).to(device)
        kl_sum = torch.zeros((), dtype=torch.float64, device=device)
        for start in range(0, m, batch_size):
            idx = order[start:start + batch_size]
            x = task.batch(train_x_dev[idx], train=False)  # distillation inputs: no train-time transforms
            if mixup:
                part = slice(start, start + batch_size)
                x = transfer.mix(x, task.batch(train_x_dev[pairs.b[part].to(device)], train=False), pairs.lam[part])
                target = _ensemble(models, x)
            else:
                target = teacher[idx]
            logits = functional_call(student, {**composer(coef), **buffers}, (x,))
            loss = F.kl_div(F.log_softmax(logits, dim=1), target, reduction="batchmean")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            kl_sum += loss.detach().to(torch.float64) * int(idx.shape[0])
        accuracy = held_out_kl = None
        if use_val:
            with torch.no_grad():
                params = composer(coef)
                accuracy = _accuracy(student, params, buffers, val_x, val_y, device, task)
                if criterion == "kl":
                    held_out_kl = _held_out_kl(student, params, buffers, held_out)
        if criterion == "last":
            best, kept = coef.detach().clone(), epoch
        else:
            score = held_out_kl if criterion == "kl" else accuracy
            # strictly better (lower KL, higher accuracy); the weight average is the first best
            if (score < min(scores)) if criterion == "kl" else (score > max(scores)):
                best, kept = coef.detach().clone(), epoch
            scores.append(score)
        if ctx.on_epoch is not None:
            ctx.on_epoch({
                "stage": "aggregate",
                "model": 0,
                "epoch": epoch,
                "epochs": opts.epochs,
                "train_loss": float(kl_sum) / m,
                "val_accuracy": accuracy,
                "holdout_kl": held_out_kl,
                "seconds": time.perf_counter() - started,
            })
    params = composer.final(best)
    result = {**params, **buffers_cpu}
    return Distilled({k: result[k] for k in keys}, kept, kept == 0, criterion, scores)


def aggregate(uploads: Sequence[Upload], ctx: Context) -> State:
    """OFASD over the uploads (:func:`distil`'s model); logs (``fedrelay.peer``, INFO) the epoch
    kept and whether it is the weight average.  Raises what :func:`distil` raises."""
    result = distil(uploads, ctx)
    log.info("ofasd: kept the coefficients of epoch %d (criterion %s%s)%s", result.kept_epoch, result.criterion,
             f", score {result.scores[result.kept_epoch]:.6g}" if result.scores else "",
             ": the weight average (FedAvg, uniform), no epoch improved on it" if result.at_start else "")
    return result.state
