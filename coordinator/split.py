"""Building trial sites from a public data set (Fashion-MNIST; the breast-cancer table is
``split_tabular``), for simulations and demos.

``split_dataset("fashion-mnist", sites=10, dirichlet=0.5, seed=0, out=Path("sites"))`` reads
the four Fashion-MNIST IDX files, gives each site a Dirichlet label-skewed share of the
training set (the NIID-Bench partition the FedELMY authors use, implementation notes §1.5)
and an equal, disjoint share of the test set, and writes one ImageFolder-style folder per
site (``site-00/train/<class>/<index>.png``, ``site-00/test/<class>/<index>.png``) that
``fedrelay.peer.data.load_site`` reads, plus ``split.json`` describing the split.

Differences from the reference code (``helpers/datasets.py::partition_data``):

* The partition is drawn with ``np.random.default_rng(seed)`` and is fixed by the seed; it
  is not cached in a pickle keyed by (data set, beta, N) and reused regardless of the seed.
* The test set is not shared whole by every client: it is cut into disjoint near-equal
  shares, one per site, so that the sample-weighted mean of the per-site accuracies equals
  the accuracy on the whole test set.
* The reference loops forever when ``min_size`` cannot be reached; here the retry loop
  gives up with a ValueError after ``max_attempts`` draws.
* The validation split is not made here: each peer makes it from its own train folder
  (``fedrelay.peer.data.train_val_split``).
"""

from __future__ import annotations

import gzip
import io
import json
import math
import multiprocessing
import os
import re
import shutil
import tempfile
import zlib
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
from PIL import Image

__all__ = [
    "FASHION_MNIST_CLASSES",
    "DEFAULT_FASHION_MNIST_DIR",
    "SUPPORTED_DATASETS",
    "DatasetNotFound",
    "read_idx",
    "load_fashion_mnist",
    "dirichlet_label_split",
    "split_test",
    "site_dir_name",
    "write_sites",
    "split_dataset",
]

FASHION_MNIST_CLASSES = [
    "T-shirt_top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle_boot",
]
DEFAULT_FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
SUPPORTED_DATASETS = ("fashion-mnist", "breast-cancer")  # breast-cancer: coordinator/split_tabular.py
DEFAULT_DIRICHLET = 0.5  # fashion-mnist's label skew when none is given (the FedELMY paper's)
FASHION_MNIST_FILES = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}
SPLIT_JSON = "split.json"
SPLIT_FORMAT = 1

# IDX element type code -> big-endian numpy dtype
_IDX_DTYPES = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}

Progress = Callable[[int, int], None]


class DatasetNotFound(FileNotFoundError):
    """The data set's files are not where we looked; the message says how to get them."""


# --------------------------------------------------------------------------- IDX reading


def read_idx(path: str | Path) -> np.ndarray:
    """Read one IDX file (the MNIST / Fashion-MNIST container), gzip-compressed or plain.

    Format: 2 zero bytes, 1 type byte (0x08 uint8, 0x09 int8, 0x0B int16, 0x0C int32,
    0x0D float32, 0x0E float64), 1 byte ``ndim``, then ``ndim`` big-endian uint32 sizes,
    then the elements, big-endian, row-major. Compression is detected from the content
    (gzip magic), not from the file name.

    Returns:
        An array of shape ``dims`` in native byte order (uint8 for the Fashion-MNIST files).

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: bad magic, unknown type, ``ndim`` 0, or a payload whose size is not
            exactly ``prod(dims) * itemsize`` (truncated or trailing bytes), or a corrupt gzip
            stream. The message names the file.
    """
    path = Path(path)
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise ValueError(f"{path}: corrupt gzip stream ({e}); download the file again") from e
    if len(raw) < 4:
        raise ValueError(f"{path}: too short to be an IDX file ({len(raw)} bytes)")
    if raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"{path}: not an IDX file (magic bytes {raw[:4].hex()} do not start with 0000)")
    type_code, ndim = raw[2], raw[3]
    if type_code not in _IDX_DTYPES:
        raise ValueError(f"{path}: unknown IDX element type 0x{type_code:02x}")
    if ndim == 0:
        raise ValueError(f"{path}: IDX header declares 0 dimensions")
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{path}: truncated IDX header ({len(raw)} bytes, need {header})")
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    dtype = _IDX_DTYPES[type_code]
    expected = math.prod(dims) * dtype.itemsize
    if len(raw) - header != expected:
        raise ValueError(
            f"{path}: IDX payload is {len(raw) - header} bytes but the header {dims} of "
            f"{dtype.name} needs {expected}; the file is truncated or corrupt"
        )
    arr = np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims)
    return arr.astype(dtype.newbyteorder("="), copy=True)


def _not_found_message(source: Path, missing: Sequence[str]) -> str:
    return (
        f"Fashion-MNIST not found in {source} (missing: {', '.join(missing)}; each may also be "
        f"gzip-compressed with a .gz suffix). To get it, either\n"
        f"  * on Debian/Ubuntu, as root: apt-get install -y dataset-fashion-mnist\n"
        f"    (installs the files into {DEFAULT_FASHION_MNIST_DIR}), or\n"
        f"  * download the 4 files train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz,\n"
        f"    t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz from the Fashion-MNIST\n"
        f"    GitHub repository (https://github.com/zalandoresearch/fashion-mnist, folder\n"
        f"    data/fashion) into a folder DIR and pass --source DIR."
    )


def load_fashion_mnist(source: str | Path | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Load Fashion-MNIST from the four IDX files in ``source``.

    Looks for ``{train,t10k}-{images-idx3,labels-idx1}-ubyte`` with or without ``.gz``
    (the plain file wins if both exist) in ``source`` (default
    :data:`DEFAULT_FASHION_MNIST_DIR`, where the Debian package ``dataset-fashion-mnist``
    puts them).

    Returns:
        ``(train_x, train_y, test_x, test_y)``: images uint8 ``(N, 28, 28)`` (0 = background),
        labels int64 ``(N,)`` in 0..9 indexing :data:`FASHION_MNIST_CLASSES`
        (60,000 train and 10,000 test samples for the real data set).

    Raises:
        DatasetNotFound: ``source`` or one of the files is missing (message says how to get them).
        ValueError: a file is malformed, or shapes/labels are inconsistent.
    """
    src = Path(source) if source is not None else DEFAULT_FASHION_MNIST_DIR
    found: dict[str, Path] = {}
    missing: list[str] = []
    for key, stem in FASHION_MNIST_FILES.items():
        for cand in (src / stem, src / f"{stem}.gz"):
            if cand.is_file():
                found[key] = cand
                break
        else:
            missing.append(stem)
    if missing:
        raise DatasetNotFound(_not_found_message(src, missing))
    arrays = {key: read_idx(p) for key, p in found.items()}
    for split in ("train", "test"):
        x, y = arrays[f"{split}_x"], arrays[f"{split}_y"]
        if x.ndim != 3 or x.shape[1:] != (28, 28) or x.dtype != np.uint8:
            raise ValueError(f"{found[split + '_x']}: expected uint8 images (N, 28, 28), got {x.dtype} {x.shape}")
        if y.ndim != 1 or y.shape[0] != x.shape[0]:
            raise ValueError(
                f"{found[split + '_y']}: expected {x.shape[0]} labels (one per image in "
                f"{found[split + '_x']}), got shape {y.shape}"
            )
        if y.size and (int(y.min()) < 0 or int(y.max()) >= len(FASHION_MNIST_CLASSES)):
            raise ValueError(f"{found[split + '_y']}: labels must be in 0..9, found {int(y.min())}..{int(y.max())}")
    return (
        arrays["train_x"],
        arrays["train_y"].astype(np.int64),
        arrays["test_x"],
        arrays["test_y"].astype(np.int64),
    )


# --------------------------------------------------------------------------- partitions


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


# --------------------------------------------------------------------------- writing


def site_dir_name(i: int, n_sites: int) -> str:
    """``site-00`` ... : zero-padded to width 2, or wider when ``n_sites > 100``."""
    width = max(2, len(str(n_sites - 1)))
    return f"site-{i:0{width}d}"


def _encode_png(img: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(img)).save(buf, format="PNG")  # 2-D uint8 -> mode "L"
    return buf.getvalue()


def _write_pngs(folder: str, names: list[str], images: np.ndarray) -> int:
    """Worker: write ``images[i]`` (uint8 (H, W)) to ``folder/names[i]`` (folders must exist)."""
    for name, img in zip(names, images):
        with open(os.path.join(folder, name), "wb") as f:
            f.write(_encode_png(img))
    return len(names)


_STAGING_PREFIX = ".split-staging-"
_CHUNK = 2000  # images per writing task
_MIN_PARALLEL = 8000  # below this many images, starting worker processes is not worth it
_SITE_RE = re.compile(r"^site-\d{2,}$")


def _previous_site_dirs(out: Path) -> list[Path]:
    """Site folders recorded by a previous split.json in ``out`` (validated names)."""
    meta_path = out / SPLIT_JSON
    try:
        meta = json.loads(meta_path.read_text())
        names = [s["site"] for s in meta["per_site"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"{meta_path} exists but is not a split.json written by this tool ({e}); "
            f"choose another output folder or remove it yourself"
        ) from e
    dirs = []
    for name in names:
        if not isinstance(name, str) or not _SITE_RE.match(name):
            raise ValueError(f"{meta_path} lists an unexpected site folder {name!r}; refusing to delete it")
        dirs.append(out / name)
    return dirs


def prepare_out(out: Path, names: Sequence[str]) -> list[Path]:
    """Check that the site folders ``names`` may be written under ``out`` and create ``out``;
    return the site folders a previous split recorded there (to be replaced by
    :func:`swap_in`). Staging folders left by an interrupted split are removed.

    Raises ``ValueError``: ``out`` is a file, or non-empty without a previous split.json, or
    a target site folder exists but was not written by the previous split."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"output path {out} exists and is not a folder; choose another --out")
    old_dirs: list[Path] = []
    if out.is_dir():
        # staging folders left behind by an interrupted split
        for stale in out.glob(f"{_STAGING_PREFIX}*"):
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
    if out.is_dir() and any(out.iterdir()):
        if not (out / SPLIT_JSON).is_file():
            raise ValueError(
                f"output folder {out} is not empty and holds no {SPLIT_JSON} from a previous split; "
                f"refusing to write into it: choose an empty or new folder"
            )
        old_dirs = _previous_site_dirs(out)
    old_set = {d.name for d in old_dirs}
    for name in names:
        if (out / name).exists() and name not in old_set:
            raise ValueError(
                f"{out / name} exists but is not listed in {out / SPLIT_JSON}; refusing to overwrite "
                f"it: move it away or choose another output folder"
            )
    out.mkdir(parents=True, exist_ok=True)
    return old_dirs


def staging_dir(out: Path) -> Path:
    """A fresh hidden folder inside ``out`` to write a split into before :func:`swap_in`."""
    return Path(tempfile.mkdtemp(prefix=_STAGING_PREFIX, dir=out))


def swap_in(out: Path, staging: Path, names: Sequence[str], old_dirs: Sequence[Path], summary: dict) -> None:
    """Move the site folders ``names`` written under ``staging`` into ``out``: the previous
    split's folders ``old_dirs`` out, the new ones in, ``split.json`` (``summary``) last."""
    for d in old_dirs:
        if d.is_dir() and not d.is_symlink():
            shutil.rmtree(d)
        elif d.exists() or d.is_symlink():
            d.unlink()
    for name in names:
        os.replace(staging / name, out / name)
    tmp_json = staging / SPLIT_JSON
    tmp_json.write_text(json.dumps(summary, indent=2) + "\n")
    os.replace(tmp_json, out / SPLIT_JSON)


def _plan_tasks(
    staging: Path,
    names: list[str],
    splits: dict[str, tuple[np.ndarray, np.ndarray, Sequence[np.ndarray]]],
    class_names: list[str],
    per_site: list[dict],
) -> list[tuple[str, list[str], np.ndarray]]:
    """Make the staging folders, fill ``per_site`` counts, return PNG-writing tasks."""
    widths = {s: len(str(max(len(x) - 1, 0))) for s, (x, _, _) in splits.items()}
    tasks: list[tuple[str, list[str], np.ndarray]] = []
    for i, name in enumerate(names):
        for split, (x, y, parts) in splits.items():
            idx = np.sort(np.asarray(parts[i], dtype=np.int64))
            if idx.size and (idx.min() < 0 or idx.max() >= len(x)):
                raise ValueError(f"{split} indices of site {i} are out of range 0..{len(x) - 1}")
            lab = np.asarray(y[idx], dtype=np.int64)
            if lab.size and (lab.min() < 0 or lab.max() >= len(class_names)):
                raise ValueError(f"{split} labels must be in 0..{len(class_names) - 1} (one per class name)")
            counts = np.bincount(lab, minlength=len(class_names))
            per_site[i][split] = {c: int(k) for c, k in zip(class_names, counts)}
            per_site[i][f"n_{split}"] = int(idx.size)
            folder = staging / name / split
            files = [f"{class_names[l]}/{j:0{widths[split]}d}.png" for j, l in zip(idx.tolist(), lab.tolist())]
            # make every folder now, before any (possibly parallel) writing task runs
            folder.mkdir(parents=True, exist_ok=True)
            for k in np.flatnonzero(counts):
                (folder / class_names[k]).mkdir(exist_ok=True)
            for s in range(0, idx.size, _CHUNK):
                tasks.append((str(folder), files[s : s + _CHUNK], x[idx[s : s + _CHUNK]]))
    return tasks


def write_sites(
    out: str | Path,
    *,
    class_names: Sequence[str],
    train_x: np.ndarray,
    train_y: np.ndarray,
    train_parts: Sequence[np.ndarray],
    test_x: np.ndarray,
    test_y: np.ndarray,
    test_parts: Sequence[np.ndarray],
    meta: dict | None = None,
    workers: int | None = None,
    progress: Progress | None = None,
) -> dict:
    """Write one ImageFolder-style folder per site, and ``out/split.json``.

    Site i gets ``out/site-ii/train/<class>/<index>.png`` for every index in
    ``train_parts[i]`` and likewise ``test/`` for ``test_parts[i]``; ``<index>`` is the
    sample's index in the source array, zero-padded to the width of the largest index.
    Class folders are made only for the classes present. Images are 8-bit greyscale PNG.

    Safety: ``out`` is created if missing. If it exists and is non-empty it must hold a
    ``split.json`` from a previous run; then only the site folders that file lists are
    replaced (other files are left alone). Everything is first written into a hidden
    staging folder inside ``out`` and moved into place at the end, so a failure leaves
    the previous split intact.

    Args:
        out: output folder.
        class_names: class name of each label value (label ``k`` -> ``class_names[k]``).
        train_x / test_x: uint8 ``(n, H, W)`` greyscale images.
        train_y / test_y: int ``(n,)`` labels in ``0..len(class_names)-1``.
        train_parts / test_parts: one index array per site (same number of sites).
        meta: extra fields for split.json (e.g. name, seed, dirichlet).
        workers: processes writing PNGs (default: up to 2, by CPU count; 1 = in-process).
        progress: called as ``progress(images_written, images_total)`` after each chunk.

    Returns:
        The summary written to split.json: ``meta`` plus ``sites``, ``classes``,
        ``image_shape`` ``[1, H, W]`` and ``per_site``, a list of
        ``{"site", "n_train", "n_test", "train": {class: count}, "test": {class: count}}``
        (every class listed, 0 allowed).

    Raises:
        ValueError: ``out`` is a file, or non-empty without a previous split.json, or a
            target site folder exists but was not written by the previous split; or the
            inputs are inconsistent.
    """
    out = Path(out)
    n_sites = len(train_parts)
    if n_sites != len(test_parts) or n_sites < 1:
        raise ValueError(f"need the same number (>= 1) of train and test parts, got {n_sites} and {len(test_parts)}")
    if train_x.ndim != 3 or test_x.ndim != 3 or train_x.dtype != np.uint8 or test_x.dtype != np.uint8:
        raise ValueError("train_x / test_x must be uint8 arrays (n, H, W)")
    class_names = list(class_names)

    names = [site_dir_name(i, n_sites) for i in range(n_sites)]
    old_dirs = prepare_out(out, names)

    # --- plan the work: one task per (site, split, chunk)
    splits = {"train": (train_x, np.asarray(train_y), train_parts), "test": (test_x, np.asarray(test_y), test_parts)}
    per_site: list[dict] = [
        {"site": name, "n_train": 0, "n_test": 0, "train": {}, "test": {}} for name in names
    ]
    staging = staging_dir(out)
    try:
        tasks = _plan_tasks(staging, names, splits, class_names, per_site)
        total = sum(len(t[1]) for t in tasks)

        # --- write, in parallel when it is worth it
        if workers is None:
            workers = min(2, os.cpu_count() or 1)
        done = 0
        if workers > 1 and total >= _MIN_PARALLEL:
            # spawn, not fork: the caller may be a multi-threaded daemon.
            ctx = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
                futures = [pool.submit(_write_pngs, *t) for t in tasks]
                try:
                    for fut in futures:
                        done += fut.result()
                        if progress:
                            progress(done, total)
                except BaseException:
                    for fut in futures:
                        fut.cancel()
                    raise
        else:
            for t in tasks:
                done += _write_pngs(*t)
                if progress:
                    progress(done, total)

        summary = dict(meta or {})
        summary.update(
            {
                "format": SPLIT_FORMAT,
                "sites": n_sites,
                "classes": class_names,
                "image_shape": [1, int(train_x.shape[1]), int(train_x.shape[2])],
                "per_site": per_site,
            }
        )
        swap_in(out, staging, names, old_dirs, summary)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return summary


# --------------------------------------------------------------------------- entry point


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
    writes tabular-csv folders instead: :func:`fedrelay.coordinator.split_tabular.split_breast_cancer`
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
        from fedrelay.coordinator.split_tabular import split_breast_cancer

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
