"""Building trial sites from a public table: three (or N) hospitals' ``tabular-csv`` folders from
the Wisconsin Diagnostic Breast Cancer data set, for the medical demo and tests.

The data come with scikit-learn (``sklearn.datasets.load_breast_cancer``: no download): 569
patients, 30 numeric features computed from a digitised image of a fine-needle aspirate of a
breast mass (radius, texture, perimeter, area, smoothness ... each as mean, standard error and
worst value), and the diagnosis, 212 ``malignant`` and 357 ``benign``. Source: W. N. Street,
W. H. Wolberg, O. L. Mangasarian, "Nuclear feature extraction for breast tumor diagnosis",
IS&T/SPIE 1993; UCI Machine Learning Repository, "Breast Cancer Wisconsin (Diagnostic)".

``split_breast_cancer(sites=3, seed=0, out=Path("sites"))`` gives each site a disjoint share of
the patients, stratified by diagnosis (``sklearn.model_selection.StratifiedKFold``: every site
has the overall mix), or with ``dirichlet=A`` a label-skewed share
(:func:`fedrelay.datasets.partition.dirichlet_label_split`, as for Fashion-MNIST); then cuts each
site's share into train (80 %) and test (20 %), stratified by diagnosis where the site has at
least two patients of each diagnosis (``sklearn.model_selection.train_test_split``). Each site
folder holds::

    site-00/
      train.csv       patient_id, the 30 features (snake_case names), diagnosis
      test.csv        the same columns
      fedrelay.toml   [tabular-csv] label = "diagnosis", drop = ["patient_id"]

``patient_id`` is the row's index in scikit-learn's copy of the data (not a real identifier):
it shows how a site's export keeps an identifier column out of the model. Values are written
as Python's shortest exact decimal form, so the sites' files hold exactly scikit-learn's
numbers. ``split.json`` describes the split like the image data sets' (``per_site`` class
counts), with ``features`` and ``label`` in place of ``image_shape``. Every choice is drawn from
``seed``: the same arguments give the same files.
"""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import numpy as np

from .partition import dirichlet_label_split
from .site_folders import SPLIT_FORMAT, prepare_out, site_dir_name, staging_dir, swap_in

__all__ = ["BREAST_CANCER", "LABEL", "ID_COLUMN", "TEST_FRACTION", "load_breast_cancer", "site_shares",
           "split_breast_cancer"]

BREAST_CANCER = "breast-cancer"
LABEL = "diagnosis"
ID_COLUMN = "patient_id"
TEST_FRACTION = 0.2
MIN_SITE = 10          # patients per site at least (a site needs rows to train on and to test)
CONFIG = f"""# Written by `coordinator split-dataset {BREAST_CANCER}`: how fedrelay's tabular-csv task reads this folder.
[tabular-csv]
label = "{LABEL}"
drop = ["{ID_COLUMN}"]
"""


def load_breast_cancer() -> tuple[np.ndarray, list[str], list[str]]:
    """The Wisconsin Diagnostic Breast Cancer data as scikit-learn ships it: ``(x, diagnosis,
    features)``, ``x`` float64 ``(569, 30)``, ``diagnosis`` 569 strings ``malignant`` /
    ``benign``, ``features`` the 30 column names in snake_case (``mean_radius`` ...)."""
    from sklearn.datasets import load_breast_cancer as sk_load

    d = sk_load()
    names = [str(n).replace(" ", "_") for n in d.feature_names]
    labels = [str(d.target_names[t]) for t in d.target]
    return np.asarray(d.data, dtype=np.float64), labels, names


def site_shares(labels: list[str], sites: int, seed: int, dirichlet: float | None = None,
                min_size: int = MIN_SITE) -> list[np.ndarray]:
    """Disjoint shares of the rows (int64 index arrays, sorted), one per site: stratified by
    label (``StratifiedKFold(sites, shuffle=True, random_state=seed)``'s folds), or with
    ``dirichlet`` a Dirichlet label skew (:func:`dirichlet_label_split`, every site at least
    ``min_size`` rows). Raises ``ValueError`` for a bad ``sites``, ``dirichlet`` or ``seed``,
    or too few rows for ``sites``."""
    from sklearn.model_selection import StratifiedKFold

    if isinstance(sites, bool) or not isinstance(sites, (int, np.integer)) or sites < 1:
        raise ValueError(f"--sites must be an integer >= 1, not {sites!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**32:
        raise ValueError(f"--seed must be an integer between 0 and {2**32 - 1}, not {seed!r}")
    y = np.unique(np.asarray(labels), return_inverse=True)[1]
    n = len(y)
    if sites * min_size > n:
        raise ValueError(f"cannot give each of {sites} sites at least {min_size} patients: the data set has {n}; "
                         f"use at most {n // min_size} sites")
    if dirichlet is not None:
        return [np.sort(p) for p in dirichlet_label_split(y, sites, dirichlet, seed, min_size=min_size)]
    if sites == 1:
        return [np.arange(n, dtype=np.int64)]
    smallest = int(np.bincount(y).min())
    if sites > smallest:
        raise ValueError(f"cannot stratify {n} patients over {sites} sites: the rarer diagnosis has {smallest} "
                         "patients; use fewer sites")
    folds = StratifiedKFold(n_splits=sites, shuffle=True, random_state=int(seed))
    return [np.sort(test).astype(np.int64) for _, test in folds.split(np.zeros(n), y)]


def _train_test(rows: np.ndarray, labels: np.ndarray, seed: int, site: int) -> tuple[np.ndarray, np.ndarray]:
    """A site's rows cut into train and test (:data:`TEST_FRACTION`), stratified when every
    label of the site has at least 2 rows; the cut's seed is drawn from ``(seed, site)``."""
    from sklearn.model_selection import train_test_split

    state = int(np.random.SeedSequence([int(seed), int(site)]).generate_state(1)[0])
    counts = np.unique(labels[rows], return_counts=True)[1]
    stratify = labels[rows] if len(counts) > 1 and counts.min() >= 2 else None
    train, test = train_test_split(rows, test_size=TEST_FRACTION, random_state=state, stratify=stratify)
    return np.sort(train), np.sort(test)


def _write_csv(path: Path, features: list[str], x: np.ndarray, labels: np.ndarray, rows: np.ndarray) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow([ID_COLUMN, *features, LABEL])
        for r in rows.tolist():
            w.writerow([r, *(repr(float(v)) for v in x[r]), labels[r]])


def split_breast_cancer(*, sites: int, seed: int, out: str | Path, dirichlet: float | None = None) -> dict:
    """Write ``sites`` tabular-csv site folders under ``out`` from the breast-cancer data (module
    docstring), and ``out/split.json``.

    Safety as :func:`fedrelay.datasets.site_folders.write_sites`: a non-empty ``out`` must hold a
    previous ``split.json``, whose site folders alone are replaced; everything is written into
    a hidden staging folder first and moved into place at the end.

    Returns:
        The split.json summary: ``name``, ``seed``, ``dirichlet``, ``test_fraction``,
        ``source``, ``format``, ``sites``, ``classes`` (sorted: ``["benign", "malignant"]``),
        ``label``, ``features``, and ``per_site``, a list of ``{"site", "n_train", "n_test",
        "train": {class: count}, "test": {class: count}}``.

    Raises:
        ValueError: bad arguments (:func:`site_shares`) or an ``out`` that may not be written
            into.
    """
    import sklearn

    out = Path(out)
    x, diagnosis, features = load_breast_cancer()
    labels = np.asarray(diagnosis)
    classes = sorted(set(diagnosis))
    shares = site_shares(diagnosis, sites, seed, dirichlet)
    names = [site_dir_name(i, sites) for i in range(sites)]
    old_dirs = prepare_out(out, names)
    per_site = []
    staging = staging_dir(out)
    try:
        for i, (name, rows) in enumerate(zip(names, shares)):
            train, test = _train_test(rows, labels, seed, i)
            folder = staging / name
            folder.mkdir()
            _write_csv(folder / "train.csv", features, x, labels, train)
            _write_csv(folder / "test.csv", features, x, labels, test)
            (folder / "fedrelay.toml").write_text(CONFIG, encoding="utf-8")
            per_site.append({"site": name, "n_train": int(train.size), "n_test": int(test.size),
                             "train": {c: int((labels[train] == c).sum()) for c in classes},
                             "test": {c: int((labels[test] == c).sum()) for c in classes}})
        summary = {"name": BREAST_CANCER, "seed": seed, "dirichlet": dirichlet, "test_fraction": TEST_FRACTION,
                   "source": f"sklearn.datasets.load_breast_cancer (scikit-learn {sklearn.__version__})",
                   "format": SPLIT_FORMAT, "sites": sites, "classes": classes, "label": LABEL,
                   "features": features, "per_site": per_site}
        swap_in(out, staging, names, old_dirs, summary)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return summary
