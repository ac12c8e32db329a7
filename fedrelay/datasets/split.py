"""Building trial sites from a public data set (Fashion-MNIST; the breast-cancer table is
:mod:`fedrelay.datasets.breast_cancer`), for simulations and demos.

``split_dataset("fashion-mnist", sites=10, dirichlet=0.5, seed=0, out=Path("sites"))`` reads
the four Fashion-MNIST IDX files, gives each site a Dirichlet label-skewed share of the
training set (the NIID-Bench partition the FedELMY authors use, implementation notes §1.5)
and an equal, disjoint share of the test set, and writes one ImageFolder-style folder per
site (``site-00/train/<class>/<index>.png``, ``site-00/test/<class>/<index>.png``) that
``fedrelay.tasks.image_folder.data.load_site`` reads, plus ``split.json`` describing the split.

Differences from the reference code (``helpers/datasets.py::partition_data``):

* The partition is drawn with ``np.random.default_rng(seed)`` and is fixed by the seed; it
  is not cached in a pickle keyed by (data set, beta, N) and reused regardless of the seed.
* The test set is not shared whole by every client: it is cut into disjoint near-equal
  shares, one per site, so that the sample-weighted mean of the per-site accuracies equals
  the accuracy on the whole test set.
* The reference loops forever when ``min_size`` cannot be reached; here the retry loop
  gives up with a ValueError after ``max_attempts`` draws.
* The validation split is not made here: each peer makes it from its own train folder
  (``fedrelay.peer.site_data.train_val_split``).
"""

from __future__ import annotations

from pathlib import Path

from .breast_cancer import split_breast_cancer
from .fashion_mnist import DEFAULT_FASHION_MNIST_DIR, FASHION_MNIST_CLASSES, DatasetNotFound, load_fashion_mnist
from .partition import dirichlet_label_split, split_test
from .site_folders import Progress, write_sites

__all__ = ["SUPPORTED_DATASETS", "DEFAULT_DIRICHLET", "DatasetNotFound", "split_dataset"]

SUPPORTED_DATASETS = ("fashion-mnist", "breast-cancer")  # breast-cancer: fedrelay/datasets/breast_cancer.py
DEFAULT_DIRICHLET = 0.5  # fashion-mnist's label skew when none is given (the FedELMY paper's)


def split_dataset(
    name: str,
    *,
    sites: int,
    dirichlet: float | None = None,
    seed: int,
    out: str | Path,
    source: str | Path | None = None,
    max_train_per_site: int | None = None,
    min_size: int = 10,
    workers: int | None = None,
    progress: Progress | None = None,
) -> dict:
    """Split a public data set into ``sites`` site folders under ``out``.

    Train: :func:`dirichlet_label_split` with concentration ``dirichlet`` (NIID-Bench /
    FedELMY implementation notes §1.5). Test: :func:`split_test` (disjoint equal shares).
    Both use ``seed``. With ``max_train_per_site``, each site keeps only the first
    ``max_train_per_site`` of its (already seeded-shuffled) train indices, i.e. a seeded
    uniform subsample, for quick trials; test shares are not subsampled.

    ``breast-cancer`` (the Wisconsin Diagnostic Breast Cancer table bundled with scikit-learn)
    writes tabular-csv folders instead: :func:`fedrelay.datasets.breast_cancer.split_breast_cancer`
    (``source``, ``max_train_per_site``, ``min_size`` and ``workers`` do not apply to it).

    Args:
        name: data set name: "fashion-mnist" or "breast-cancer".
        sites: number of sites (>= 1).
        dirichlet: Dirichlet concentration alpha (> 0), e.g. 0.5 as in the paper; None: 0.5 for
            fashion-mnist, no label skew (stratified shares) for breast-cancer.
        seed: seed of every random choice; same arguments -> same folders.
        out: output folder (see :func:`write_sites` for what may be overwritten).
        source: folder of the IDX files (default :data:`DEFAULT_FASHION_MNIST_DIR`).
        max_train_per_site: optional cap on each site's train images (>= 1).
        min_size: minimum train samples per site before subsampling (reference: 10).
        workers: PNG-writing processes (default up to 2).
        progress: ``progress(images_written, images_total)``.

    Returns:
        The split.json summary (see :func:`write_sites`), with ``name``, ``seed``,
        ``dirichlet``, ``min_size``, ``max_train_per_site`` and ``source`` added.

    Raises:
        ValueError: unsupported ``name`` (message lists the supported ones), bad
            arguments, or an ``out`` that may not be written into.
        DatasetNotFound: the IDX files are missing (message says how to get them).
    """
    key = name.strip().lower().replace("_", "-")
    if key not in SUPPORTED_DATASETS:
        raise ValueError(f"unsupported data set {name!r}; supported: {', '.join(SUPPORTED_DATASETS)}")
    if key == "breast-cancer":
        given = [flag for flag, value in (("--source", source), ("--max-train-per-site", max_train_per_site))
                 if value is not None]
        if given:
            raise ValueError(f"{', '.join(given)} do(es) not apply to breast-cancer (scikit-learn ships the whole "
                             "table; every patient is used)")
        return split_breast_cancer(sites=sites, seed=seed, out=out, dirichlet=dirichlet)
    if dirichlet is None:
        dirichlet = DEFAULT_DIRICHLET
    if max_train_per_site is not None and (int(max_train_per_site) != max_train_per_site or max_train_per_site < 1):
        raise ValueError(f"max_train_per_site must be an integer >= 1, not {max_train_per_site!r}")
    src = Path(source) if source is not None else DEFAULT_FASHION_MNIST_DIR
    train_x, train_y, test_x, test_y = load_fashion_mnist(src)
    train_parts = dirichlet_label_split(train_y, sites, dirichlet, seed, min_size=min_size)
    if max_train_per_site is not None:
        train_parts = [p[: int(max_train_per_site)] for p in train_parts]
    test_parts = split_test(len(test_y), sites, seed)
    meta = {
        "name": key,
        "seed": seed,
        "dirichlet": dirichlet,
        "min_size": min_size,
        "max_train_per_site": max_train_per_site,
        "source": str(src.resolve()),
    }
    return write_sites(
        out,
        class_names=FASHION_MNIST_CLASSES,
        train_x=train_x,
        train_y=train_y,
        train_parts=train_parts,
        test_x=test_x,
        test_y=test_y,
        test_parts=test_parts,
        meta=meta,
        workers=workers,
        progress=progress,
    )
