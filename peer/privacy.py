"""DP-SGD at a site, with Opacus: the training side of :mod:`fedrelay.privacy`.

:func:`fedrelay.peer.training.fit` trains with :class:`DPTraining` when the site's training runs
under :func:`engaged` (the ``train`` job does so for a run with DP options): every epoch of
every model the site trains for the run (the first site's warm-up, FedELMY's pool models,
FedSeq's and the star methods' one model, every round) is then DP-SGD (Abadi et al. 2016,
Alg. 1), as Opacus implements it:

* **Sampling**: each step draws its batch by Poisson sampling: every training sample joins
  with probability ``q = 1 / ceil(N / B)`` (``B = --batch-size``, ``N`` the site's training
  samples), ``ceil(N / B)`` steps per epoch (Opacus ``DPDataLoader``'s rate); an empty batch is
  a noise-only step.
* **Clipping and noise**: per-sample gradients (Opacus ``GradSampleModule``) of the task's loss
  are clipped to L2 norm ``C`` (``--dp-max-grad-norm``), summed, Gaussian noise of standard
  deviation ``sigma * C`` is added, and the sum divided by the expected batch size ``q * N``
  (Opacus ``DPOptimizer``) before the task's optimiser steps.
* **Regularisers**: FedELMY's d1/d2 terms depend on the parameters and the pool only (no
  sample): their gradient is added to the noised gradient after the noise (post-processing).
  Their magnitude scale ``a`` (``fedelmy.magnitude_scale``) would read the batch's loss, a
  statistic of the data without noise: under DP it reads ``log K`` instead (the loss of a
  uniform prediction over the ``K`` classes).
* **Accounting**: Opacus' RDP accountant (Mironov 2017; Mironov, Talwar, Zhang 2019) over the
  ``(sigma, q, steps)`` of every model the site trained for the run (:class:`Book`, one JSON
  file per visit, composed at evaluation time by :func:`spent`).
* **Randomness**: batches and noise come from a generator seeded from ``os.urandom`` at the
  site, never from the run's seed (which the operator and every site know: noise anybody can
  re-draw protects nothing). A DP run is therefore not reproducible bit for bit, by design.
  Opacus' ``secure_mode`` (against floating-point attacks on the noise) is off.

**Models with BatchNorm are refused**, with a message naming the layers (:func:`check_model`):
BatchNorm mixes the samples of a batch, so per-sample gradients do not exist, and its running
statistics are released without noise. Converting the layers (Opacus ``ModuleValidator.fix``:
BatchNorm -> GroupNorm) would change the model's architecture and its state's keys, which every
site of the run, the initial model and the aggregators must share: it is decided at the run
level, by choosing a model without BatchNorm (the image-folder task's ``cnn-gn``: its ``cnn``
with GroupNorm, as ``ModuleValidator.fix`` would make it).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import math
import os
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from torch import Tensor, nn

from fedrelay.privacy import BOOK

__all__ = ["BOOK", "DPTraining", "Book", "engaged", "current", "check_model", "noise_multiplier", "spent"]

ACCOUNTANT = "rdp"
# RDP orders: Opacus' defaults (up to 63) and higher ones, which give tighter bounds for few
# steps (Opacus warns "optimal order is the largest alpha" otherwise).
ALPHAS = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)) + list(range(64, 1025, 16))
# Opacus' hooks on a first layer whose input needs no gradient: harmless, said at every step.
_HOOK_WARNING = "Full backward hook is firing when gradients are computed with respect to module outputs"
_CURRENT: contextvars.ContextVar["Session | None"] = contextvars.ContextVar("fedrelay_dp", default=None)


class Session:
    """One site's DP options for one visit's training: ``options`` (:class:`fedrelay.privacy.Options`),
    ``planned_epochs`` (the site's DP epochs over the run, for a target epsilon) and the
    :class:`Book` its accounting goes into."""

    def __init__(self, options: Mapping, planned_epochs: int, book: "Book"):
        self.options = dict(options)
        self.planned_epochs = int(planned_epochs)
        self.book = book


@contextlib.contextmanager
def engaged(options: Mapping | None, planned_epochs: int, book: "Book") -> Iterator[None]:
    """Train under DP (``options`` from :func:`fedrelay.privacy.options`) inside the block: every
    :func:`fedrelay.peer.training.fit` call is DP-SGD and books its steps in ``book``. With
    ``options`` None nothing changes."""
    if options is None:
        yield
        return
    token = _CURRENT.set(Session(options, planned_epochs, book))
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current() -> Session | None:
    """The DP session of the running training, or None (DP off)."""
    return _CURRENT.get()


def check_model(model: nn.Module, what: str) -> None:
    """Raise ``ValueError`` unless Opacus can compute per-sample gradients of ``model``: no
    BatchNorm (see the module docstring), only layers Opacus supports. ``what`` names the model
    in the message (e.g. ``"the model 'cnn' of task 'image-folder'"``)."""
    from opacus.validators import ModuleValidator

    errors = ModuleValidator.validate(model, strict=False)
    if not errors:
        return
    batchnorm = [name for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if batchnorm:
        raise ValueError(f"differential privacy cannot train {what}: it has BatchNorm layers "
                         f"({', '.join(batchnorm[:4])}{', ...' if len(batchnorm) > 4 else ''}), which mix the samples "
                         "of a batch (no per-sample gradient) and keep running statistics without noise. Start the run "
                         "with a model without BatchNorm (image-folder: --model cnn-gn, the same CNN with GroupNorm)")
    raise ValueError(f"differential privacy cannot train {what}: "
                     + "; ".join(str(e).splitlines()[0] for e in errors[:3]))


def noise_multiplier(options: Mapping, sample_rate: float, steps: int) -> float:
    """Sigma for the site: ``options["noise_multiplier"]`` when given, else the sigma that spends
    ``options["epsilon"]`` at ``options["delta"]`` over ``steps`` steps at ``sample_rate``
    (Opacus ``get_noise_multiplier``, RDP, within 0.01 of the target). Raises ``ValueError``
    for a target Opacus cannot reach."""
    if options["noise_multiplier"] > 0:
        return float(options["noise_multiplier"])
    try:
        return _sigma_for(float(options["epsilon"]), float(options["delta"]), float(sample_rate), max(1, int(steps)))
    except ValueError as exc:
        raise ValueError(f"--dp-epsilon {options['epsilon']:g}: no noise multiplier reaches it at delta "
                         f"{options['delta']:g} over {steps} steps ({exc})") from None


@functools.lru_cache(maxsize=64)
def _sigma_for(epsilon: float, delta: float, sample_rate: float, steps: int) -> float:
    """Opacus' ``get_noise_multiplier`` (seconds of RDP search), once per (epsilon, delta, q,
    steps) in a process: every model of a site's pool asks for the same sigma."""
    from opacus.accountants.utils import get_noise_multiplier

    return float(get_noise_multiplier(target_epsilon=epsilon, target_delta=delta, sample_rate=sample_rate,
                                      steps=steps, accountant=ACCOUNTANT, alphas=ALPHAS))


class Book:
    """The DP steps one visit's training took, kept in a JSON file (``privacy.json`` in the
    visit's folder) as they are made: ``{"entries": {"<stage>/<model>": [sigma, q, steps]},
    "max_grad_norm": C, "delta": delta}``. A model trained again after a restart replaces its
    entry (the same steps, not more)."""

    def __init__(self, path: Path | str):
        self.path = Path(path)
        try:
            self.data = json.loads(self.path.read_text())
        except FileNotFoundError:
            self.data = {"entries": {}}

    def record(self, key: str, sigma: float, sample_rate: float, steps: int, max_grad_norm: float,
               delta: float) -> None:
        from fedrelay.files import atomic_write

        self.data["entries"][key] = [float(sigma), float(sample_rate), int(steps)]
        self.data["max_grad_norm"], self.data["delta"] = float(max_grad_norm), float(delta)
        atomic_write(self.path, json.dumps(self.data, sort_keys=True).encode())


def spent(paths, delta: float) -> dict | None:
    """The (epsilon, delta) a site spent over the books at ``paths`` (every visit's
    ``privacy.json`` of the run; missing files are skipped), composed by Opacus' RDP
    accountant: ``{"epsilon", "delta", "noise_multiplier", "max_grad_norm", "steps",
    "sample_rate", "accountant"}`` (sigma and q of the latest entry; steps summed). None when
    no book holds an entry (the site trained nothing under DP)."""
    from opacus.accountants import RDPAccountant

    history, norm = [], 0.0
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            continue
        history.extend(tuple(e) for _, e in sorted(data["entries"].items()))
        norm = data.get("max_grad_norm", norm)
    if not history:
        return None
    accountant = RDPAccountant()
    accountant.history = [(float(s), float(q), int(n)) for s, q, n in history]
    eps = float(accountant.get_epsilon(delta=delta, alphas=ALPHAS))
    return {"epsilon": eps if math.isfinite(eps) else float("inf"), "delta": float(delta),
            "noise_multiplier": history[-1][0], "max_grad_norm": float(norm),
            "steps": sum(int(n) for _, _, n in history), "sample_rate": history[-1][1], "accountant": ACCOUNTANT}


class DPTraining:
    """DP-SGD for one model (see the module docstring): wraps ``model`` (Opacus
    ``GradSampleModule``) and ``optimizer`` (``DPOptimizer``) for ``epochs`` epochs over ``n``
    samples in batches of about ``batch_size``; :meth:`epoch` trains one; :meth:`close` removes
    Opacus' hooks from ``model`` (always call it) and books the steps under ``key``."""

    def __init__(self, session: Session, model: nn.Module, optimizer: torch.optim.Optimizer, n: int,
                 batch_size: int, key: str, num_classes: int):
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer

        opts = session.options
        check_model(model, "the model")  # run_site has named it already; a direct caller gets the same check
        if opts["noise_multiplier"] <= 0 and session.planned_epochs < 1:
            raise ValueError("a target epsilon (--dp-epsilon) needs the site's planned DP epochs of the run "
                             "(privacy.engaged(planned_epochs=...)), got 0")
        self.session, self.key, self.n = session, key, int(n)
        self.steps_per_epoch = max(1, math.ceil(self.n / batch_size))
        self.sample_rate = 1.0 / self.steps_per_epoch
        self.sigma = noise_multiplier(opts, self.sample_rate, session.planned_epochs * self.steps_per_epoch)
        self.steps = 0
        self.reference_loss = math.log(max(2, num_classes))
        # Secret randomness (the module docstring): batches and noise.
        self.random = torch.Generator(device="cpu").manual_seed(int.from_bytes(os.urandom(8), "big") >> 1)
        device = next(model.parameters()).device
        self.noise = self.random if device.type == "cpu" else \
            torch.Generator(device=device).manual_seed(int.from_bytes(os.urandom(8), "big") >> 1)
        self.model = model
        # In-place activations modify the outputs Opacus' backward hooks hold (torch refuses);
        # out of place they compute the same values. Restored by close().
        self.inplace = [m for m in model.modules() if getattr(m, "inplace", None) is True]
        for m in self.inplace:
            m.inplace = False
        self.wrapped = GradSampleModule(model, loss_reduction="mean")
        self.optimizer = DPOptimizer(optimizer, noise_multiplier=self.sigma, max_grad_norm=opts["max_grad_norm"],
                                     expected_batch_size=max(1, round(self.sample_rate * self.n)),
                                     loss_reduction="mean", generator=self.noise)
        self.params = [p for p in model.parameters() if p.requires_grad]

    def epoch(self, train_x: Tensor, train_y: Tensor, task, regulariser=None, generator=None) -> Tensor:
        """One epoch: ``steps_per_epoch`` Poisson-sampled steps. Returns the sum of each batch's
        task loss times its size (0-d float64, as ``training.train_one_epoch``)."""
        from fedrelay import tasks

        self.wrapped.train()
        ce_sum = torch.zeros((), dtype=torch.float64, device=train_x.device)
        for _ in range(self.steps_per_epoch):
            mask = torch.rand(self.n, generator=self.random) < self.sample_rate
            idx = mask.nonzero().squeeze(1).to(train_x.device)
            self.optimizer.zero_grad(set_to_none=True)
            if idx.numel():
                y = train_y[idx]
                ce = task.loss(self.wrapped(task.batch(train_x[idx], train=True, generator=generator)), y)
                if not isinstance(ce, Tensor) or ce.dim() != 0:
                    got = tuple(ce.shape) if isinstance(ce, Tensor) else type(ce).__name__
                    raise ValueError(f"the loss of task {tasks.name_of(task)!r} returned {got}, not a scalar "
                                     "(a 0-d tensor)")
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message=_HOOK_WARNING)
                    ce.backward()
                ce_sum += ce.detach().to(torch.float64) * int(y.shape[0])
            else:  # an empty Poisson batch: a noise-only step
                for p in self.params:
                    p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)
            if self.optimizer.pre_step():  # clip, sum, noise, scale: p.grad
                if regulariser is not None:
                    self._add_regulariser(regulariser)
                self.optimizer.original_optimizer.step()
            self.steps += 1
        return ce_sum

    def _add_regulariser(self, regulariser) -> None:
        """Add the gradient of ``regulariser(loss, params) - loss`` (its parameter-only terms, the
        loss a constant ``log K``) to the noised gradient."""
        ref = torch.full((), self.reference_loss, dtype=self.params[0].dtype, device=self.params[0].device)
        extra = regulariser(ref, list(self.model.parameters())) - ref
        if not extra.requires_grad:
            return
        grads = torch.autograd.grad(extra, self.params, allow_unused=True)
        for p, g in zip(self.params, grads):
            if g is not None:
                p.grad.add_(g)

    def close(self) -> None:
        """Remove Opacus' hooks and per-sample buffers from the model; book the steps taken."""
        self.wrapped._close()
        for m in self.inplace:
            m.inplace = True
        for p in self.model.parameters():
            for attr in ("grad_sample", "summed_grad", "_processed"):
                if hasattr(p, attr):
                    delattr(p, attr)
        if self.steps:
            opts = self.session.options
            self.session.book.record(self.key, self.sigma, self.sample_rate, self.steps, opts["max_grad_norm"],
                                     opts["delta"])
