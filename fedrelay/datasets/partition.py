"""How a data set's samples are shared over sites: :func:`dirichlet_label_split` (the NIID-Bench
Dirichlet label skew of a training set, as the FedELMY authors use it) and :func:`split_test`
(disjoint, near-equal test shares)."""

from __future__ import annotations

import math

import numpy as np

__all__ = ["dirichlet_label_split", "split_test"]


def dirichlet_label_split(
    labels: np.ndarray,
    n_sites: int,
    alpha: float,
    seed: int,
    min_size: int = 10,
    *,
    max_attempts: int = 10_000,
) -> list[np.ndarray]:
    """Dirichlet label-skew partition of sample indices over sites (NIID-Bench).

    The algorithm of NIID-Bench's ``partition_data`` as used by FedELMY
    (``helpers/datasets.py``; implementation notes §1.5). One attempt: for each class k
    (ascending), shuffle the indices of class k, draw ``p ~ Dir(alpha * 1_N)`` over the N
    sites, set ``p_j = 0`` for every site that already holds ``>= len(labels) / N`` samples
    (the balancing cap), renormalise, and split the shuffled indices at
    ``(cumsum(p) * n_k).astype(int)[:-1]``. Attempts are repeated (continuing the same
    random stream) until every site has ``>= min_size`` samples; then each site's list is
    shuffled.

    Randomness is ``np.random.default_rng(seed)``: the same (labels, n_sites, alpha, seed,
    min_size) always gives the same partition. Unlike the reference, nothing is cached.
    In the rare case (very small alpha) where all of a class's Dirichlet mass falls on
    capped sites (masked ``p`` sums to 0, which gives NaN in the reference), ``p`` is
    redrawn.

    Args:
        labels: int array ``(n,)`` of class labels (any integer values).
        n_sites: number of sites N >= 1.
        alpha: Dirichlet concentration (> 0; the paper's "beta"): small = strong skew,
            large = near-IID.
        seed: RNG seed.
        min_size: minimum number of samples per site.
        max_attempts: give up (ValueError) after this many attempts.

    Returns:
        N int64 arrays of indices into ``labels``: pairwise disjoint, covering
        ``range(n)``, each in random order.

    Raises:
        ValueError: bad ``n_sites``/``alpha``/``min_size``, ``n_sites * min_size > n``, or
            no partition with every site >= ``min_size`` within ``max_attempts``.
    """
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels must be 1-D, got shape {labels.shape}")
    if isinstance(n_sites, bool) or int(n_sites) != n_sites or n_sites < 1:
        raise ValueError(f"n_sites must be an integer >= 1, not {n_sites!r}")
    n_sites = int(n_sites)
    if not (isinstance(alpha, (int, float, np.floating)) and math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"alpha (the Dirichlet concentration) must be a finite number > 0, not {alpha!r}")
    if int(min_size) != min_size or min_size < 0:
        raise ValueError(f"min_size must be an integer >= 0, not {min_size!r}")
    n = len(labels)
    if n_sites * min_size > n:
        raise ValueError(
            f"cannot give each of {n_sites} sites at least {min_size} samples: only {n} samples; "
            f"use fewer sites or a smaller min_size"
        )
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    class_indices = [np.flatnonzero(labels == k) for k in classes]
    cap = n / n_sites

    for _ in range(max_attempts):
        batches: list[list[np.ndarray]] = [[] for _ in range(n_sites)]
        sizes = np.zeros(n_sites, dtype=np.int64)
        for idx_k in class_indices:
            idx_k = idx_k.copy()
            rng.shuffle(idx_k)
            open_sites = sizes < cap
            while True:
                p = rng.dirichlet(np.full(n_sites, float(alpha)))
                p = p * open_sites
                total = p.sum()
                if total > 0 and np.isfinite(total):
                    break
            p = p / total
            cuts = (np.cumsum(p) * len(idx_k)).astype(int)[:-1]
            for j, part in enumerate(np.split(idx_k, cuts)):
                batches[j].append(part)
                sizes[j] += len(part)
        if sizes.min() >= min_size:
            break
    else:
        raise ValueError(
            f"no Dirichlet(alpha={alpha}) split over {n_sites} sites gave every site >= {min_size} "
            f"samples in {max_attempts} attempts; use a larger alpha, fewer sites or a smaller min_size"
        )
    out = []
    for parts in batches:
        idx = np.concatenate(parts).astype(np.int64) if parts else np.empty(0, dtype=np.int64)
        rng.shuffle(idx)
        out.append(idx)
    return out


def split_test(n_test: int, n_sites: int, seed: int) -> list[np.ndarray]:
    """Cut the test set into disjoint, near-equal shares, one per site.

    A permutation of ``range(n_test)`` drawn with ``np.random.default_rng(seed)`` is cut
    with ``np.array_split`` (share sizes differ by at most 1). The shares cover the whole
    test set, so the sample-weighted mean of per-site accuracies equals the accuracy on
    the whole test set.

    Returns:
        ``n_sites`` int64 index arrays.

    Raises:
        ValueError: ``n_sites < 1`` or ``n_sites > n_test`` (a site would get no test image).
    """
    if isinstance(n_sites, bool) or int(n_sites) != n_sites or n_sites < 1:
        raise ValueError(f"n_sites must be an integer >= 1, not {n_sites!r}")
    if n_test < n_sites:
        raise ValueError(f"cannot give each of {n_sites} sites a test image: only {n_test} test samples")
    perm = np.random.default_rng(seed).permutation(int(n_test)).astype(np.int64)
    return [np.asarray(a) for a in np.array_split(perm, int(n_sites))]
