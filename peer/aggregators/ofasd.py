"""OFASD: one-shot federated anisotropic scaling distillation.

Paper: Koshibuchi, Kera, Kawamoto, "OFASD: One-Shot Federated Anisotropic Scaling
Distillation", Algorithm 1.  No code has been published (reference-code §3.1);
details the paper leaves open follow aTLAS (``fredzzhang/atlas``, reference-code §3.2),
the code OFASD builds on, and every difference from it is listed below.

Algorithm (:func:`aggregate`)
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
    ``ofasd_epochs`` epochs over the aggregating site's own train split (``ctx.train``) in
    batches of ``ctx.cfg.batch_size`` (last partial batch included), the batch order drawn from
    ``seeded_generator(derive_seed(ctx.seed, "ofasd"))`` (``torch.randperm`` per epoch, as
    :func:`fedrelay.peer.training.fit`).  After every epoch the composed model is evaluated on
    ``ctx.val`` and the coefficients of the epoch with the strictly best accuracy are kept; the
    starting best is the initial composition (the weight average) with its own accuracy.  With
    an empty ``ctx.val`` the last epoch's coefficients are kept.  The teacher's probabilities
    are computed once, before the first epoch (eval mode: the same for every epoch).

Any model: the blocks are the model's floating-point parameter tensors (``named_parameters``),
whatever their layers; buffers are averaged.  The inputs are the task's (``Task.batch`` with
``train=False``: no train-time transforms while distilling).

Returned model: the parameters of θ_g for the kept λ (composed in float64, cast to float32),
and the uniform mean of the uploads' buffers (running statistics and ``num_batches_tracked``,
truncated like :func:`fedrelay.peer.states.average_states`).

Options: ``ofasd_mode`` ("block"), ``ofasd_epochs`` (2), ``ofasd_lr`` (0.01).  No extras.

Differences from aTLAS, and choices the paper leaves open
    * Initialisation: ``λ_k^(b) = ‖τ_k^(b)‖ / K``, so the composed model starts at the plain
      weight average of the uploads (Eq. 2's first-order ensemble approximation).  aTLAS starts
      at λ = 0, i.e. at θ0, which is a sensible model there because θ0 is *pretrained*; ours may
      be a random initialisation (the sites share it, they need not pretrain it), whose
      predictions are meaningless, so starting the search there would waste the epochs.
    * BatchNorm buffers: the uniform mean of the uploads' buffers.  aTLAS keeps θ0's, but a
      random θ0's running statistics (mean 0, variance 1) describe no data; the uploads' mean is
      what the weight average (FedAvg) uses.
    * Plain Adam without weight decay, gradient clipping or mixed precision (aTLAS: AdamW, wd 0.1,
      clip 1.0, fp16); the paper says only "learning rate η".  Task vectors stay float32 (aTLAS
      stores fp16).  The head is a block like any other (aTLAS freezes CLIP's head).
    * aTLAS×K's random partition of each tensor is not used: one coefficient per tensor.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call
from torch.nn import functional as F

from fedrelay import registry, tasks

from fedrelay.models import ModelSpec, build_model, check_state
from ..states import State, build_loaded
from ..training import check_site_data, derive_seed, seeded_generator
from . import Context, Upload
from ._common import Schema, check_uploads, expected_keys, uniform_state

__all__ = ["extras_schema", "site_extras", "aggregate", "blocks", "MODES"]

MODES = ("block", "client")
_EVAL_BATCH = 512


def _options(options: dict) -> tuple[str, int, float]:
    options = registry.with_defaults("ofasd", options)  # the defaults: its registry entry
    mode, epochs, lr = options["ofasd_mode"], options["ofasd_epochs"], options["ofasd_lr"]
    if mode not in MODES:
        raise ValueError(f"ofasd_mode must be one of {MODES}, got {mode!r}")
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 0:
        raise ValueError(f"ofasd_epochs must be an int >= 0, got {epochs!r}")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (lr > 0 and math.isfinite(lr)):
        raise ValueError(f"ofasd_lr must be a number > 0, got {lr!r}")
    return mode, epochs, float(lr)


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


def _teacher(spec: ModelSpec, states: Sequence[State], images: Tensor, device) -> Tensor:
    """Mean over the uploaded models (eval mode) of their softmax outputs: ``(N, classes)``."""
    task = tasks.resolve(spec)
    models = [build_loaded(spec, s).to(device).eval() for s in states]
    out = []
    with torch.no_grad():  # not inference_mode: the result is a KL target, saved for backward
        for start in range(0, int(images.shape[0]), _EVAL_BATCH):
            x = task.batch(images[start:start + _EVAL_BATCH].to(device), train=False)
            total = F.softmax(models[0](x), dim=1)
            for model in models[1:]:
                total += F.softmax(model(x), dim=1)
            out.append(total / len(models))
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


def aggregate(uploads: Sequence[Upload], ctx: Context) -> State:
    """OFASD over the uploads (module docstring), in the order given.

    Uses ``ctx.initial`` (θ0), ``ctx.train``, ``ctx.val``, ``ctx.cfg.batch_size``, ``ctx.seed``,
    ``ctx.device`` and ``ctx.options``.  ``ctx.on_epoch`` is called after each epoch with
    ``{"stage": "aggregate", "model": 0, "epoch": 1-based, "epochs", "train_loss": the mean KL
    over the epoch's samples, "val_accuracy": float in [0, 1] or None (empty val), "seconds"}``.

    Raises:
        ValueError: no uploads, ``ctx.initial`` is None, a state (or θ0) that does not fit
            ``ctx.spec``, extras attached, bad data or options.
    """
    mode, epochs, lr = _options(ctx.options)
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
    block_list = blocks(spec, mode)
    param_set = {n for block in block_list for n in block}
    buffers_cpu = uniform_state(states, [k for k in keys if k not in param_set])
    buffers = {k: v.to(device) for k, v in buffers_cpu.items()}
    composer = _Composer(ctx.initial, states, block_list, device)
    teacher = _teacher(spec, states, train_x, device)
    student = build_loaded(spec, states[0]).to(device).eval()
    for p in student.parameters():
        p.requires_grad_(False)

    coef = composer.initial().to(device).requires_grad_(True)
    optimizer = torch.optim.Adam([coef], lr=lr)
    use_val = int(val_y.shape[0]) > 0
    best = coef.detach().clone()
    best_accuracy = -1.0
    if use_val:
        with torch.no_grad():
            best_accuracy = _accuracy(student, composer(coef), buffers, val_x, val_y, device, task)
    generator = seeded_generator(derive_seed(ctx.seed, "ofasd"))
    n = int(train_y.shape[0])
    train_x_dev = train_x.to(device)
    for epoch in range(1, epochs + 1):
        started = time.perf_counter()
        order = torch.randperm(n, generator=generator).to(device)
        kl_sum = torch.zeros((), dtype=torch.float64, device=device)
        for start in range(0, n, batch_size):
            idx = order[start:start + batch_size]
            x = task.batch(train_x_dev[idx], train=False)  # distillation inputs: no train-time transforms
            logits = functional_call(student, {**composer(coef), **buffers}, (x,))
            loss = F.kl_div(F.log_softmax(logits, dim=1), teacher[idx], reduction="batchmean")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            kl_sum += loss.detach().to(torch.float64) * int(idx.shape[0])
        accuracy = None
        if use_val:
            with torch.no_grad():
                accuracy = _accuracy(student, composer(coef), buffers, val_x, val_y, device, task)
            if accuracy > best_accuracy:  # strictly better; the weight average is the first best
                best_accuracy, best = accuracy, coef.detach().clone()
        else:
            best = coef.detach().clone()
        if ctx.on_epoch is not None:
            ctx.on_epoch({
                "stage": "aggregate",
                "model": 0,
                "epoch": epoch,
                "epochs": epochs,
                "train_loss": float(kl_sum) / n,
                "val_accuracy": accuracy,
                "seconds": time.perf_counter() - started,
            })
    params = composer.final(best)
    result = {**params, **buffers_cpu}
    return {k: result[k] for k in keys}
