"""OFASD's transfer data: what the coefficients are distilled on (internal to :mod:`.ofasd`).

OFASD (Koshibuchi, Kera, Kawamoto, Algorithm 1) distils the ensemble into the coefficients on
"training dataset D"; in the paper's experiments D is DENSE's generator data (Zhang et al.,
NeurIPS 2022), an endless stream of synthetic images made to cover what the local models
know.  We have no generator: the aggregating site's own train split stands in for D.  Under
label skew that split holds few classes and few images, so, as a documented choice of ours,
the default transfer set is **mixup** of the site's images (Zhang et al., "mixup: Beyond
Empirical Risk Minimization", ICLR 2018, Eq. 1), drawn afresh every epoch::

    x'_i = λ_i x_a(i) + (1 − λ_i) x_b(i),     λ_i ~ Beta(α, α),   i = 1..M

with ``a`` and ``b`` two independent random sequences of indices into the site's N train
images (each a run of random permutations of the N, cut to M; an image may meet itself) and
M = max(N, ``ofasd_transfer_size``) images per epoch (default M = N) (a small site still gives a transfer
set of a useful size: DENSE's generator has no size limit), the pairs taken in the order
``i`` (the epoch's batch order), ``x`` the model inputs ``task.batch(images, train=False)`` (mixing after the task's
affine normalisation equals normalising the mixed image).  Only the images are mixed: the
teacher's targets are the ensemble's outputs on ``x'`` (no label mixing).  Mixed images lie
between the site's images, where the sites' models disagree more than on the images
themselves, so the ensemble has more to teach there.  ``"plain"`` uses the site's images
themselves, in a fresh random order every epoch (the earlier behaviour).

Measured so far only in a probe (own harness outside the daemons, not a result: 10 sites of 600
Fashion-MNIST images, the small CNN, E = 5, 20 epochs, one seed each at Dirichlet 0.5 and three
at 0.1): mixup was up to 3 points below plain and never clearly above (74.6 vs 74.9 %; 46.1
vs 49.2, 42.8 vs 44.5, 38.5 vs 38.4 %); both were well above the earlier 2-epoch default where
the ensemble is far above the weight average.  Mixup stays the default as the issue asks (#25: a transfer set that stands
in for the paper's generator data); the full-data grid is to measure both.

Every random draw comes from one ``numpy.random.Generator`` (PCG64) seeded by the caller:
``a`` (``ceil(M / N)`` calls of ``rng.permutation(N)``), then ``b`` (as many), then
``λ = rng.beta(α, α, M)`` per epoch, in that order, so the transfer set is a function of
the seed (and the same on every device).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

__all__ = ["TRANSFERS", "generator", "MixupDraw", "draw", "mix"]

TRANSFERS = ("plain", "mixup")


def generator(seed: int) -> np.random.Generator:
    """The transfer set's random source: ``numpy.random.Generator(PCG64(seed))``, ``seed`` an int
    in ``[0, 2**63)`` (``derive_seed``)."""
    return np.random.Generator(np.random.PCG64(int(seed)))


class MixupDraw:
    """One epoch's mixup pairs: ``a``, ``b`` (int64 ``(N,)`` CPU tensors, permutations of
    ``range(N)``) and ``lam`` (float32 ``(N,)``, each in [0, 1])."""

    def __init__(self, a: Tensor, b: Tensor, lam: Tensor):
        self.a, self.b, self.lam = a, b, lam

    def __len__(self) -> int:
        return int(self.a.shape[0])


def draw(rng: np.random.Generator, n: int, alpha: float, size: int | None = None) -> MixupDraw:
    """The next epoch's ``size`` pairs (default ``n``) over ``n`` images from ``rng``: ``a`` then
    ``b``, each the concatenation of ``ceil(size / n)`` permutations of ``range(n)`` cut to
    ``size`` (every image is used once per ``n`` pairs), then ``size`` draws of
    Beta(``alpha``, ``alpha``), in that order.  Raises ``ValueError`` for ``n`` < 1, ``size``
    < 1 or ``alpha`` <= 0."""
    size = n if size is None else int(size)
    if n < 1 or size < 1:
        raise ValueError(f"mixup needs at least one image and one pair, got {n} images for {size} pairs")
    if not alpha > 0:
        raise ValueError(f"ofasd_mixup_alpha must be > 0, got {alpha!r}")
    rounds = -(-size // n)

    def indices() -> Tensor:
        return torch.from_numpy(np.concatenate([rng.permutation(n) for _ in range(rounds)])[:size].astype(np.int64))

    a = indices()
    b = indices()
    lam = torch.from_numpy(rng.beta(alpha, alpha, size).astype(np.float32))
    return MixupDraw(a, b, lam)


def mix(xa: Tensor, xb: Tensor, lam: Tensor) -> Tensor:
    """``lam * xa + (1 − lam) * xb`` per row: ``xa``, ``xb`` floating ``(B, ...)`` model inputs,
    ``lam`` ``(B,)`` (moved to their device and dtype).  Raises ``ValueError`` for inputs that are
    not floating point (mixup needs a vector space: use ``ofasd_transfer="plain"``)."""
    if not xa.is_floating_point():
        raise ValueError(f"ofasd_transfer=mixup needs floating-point model inputs, the task gives {xa.dtype}; "
                         "use --ofasd-transfer plain")
    w = lam.to(device=xa.device, dtype=xa.dtype).reshape((-1,) + (1,) * (xa.dim() - 1))
    return w * xa + (1 - w) * xb
