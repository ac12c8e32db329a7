"""Writing trial sites into an output folder: one ImageFolder-style folder per site
(``site-00/train/<class>/<index>.png``, ``site-00/test/<class>/<index>.png``; :func:`write_sites`)
and ``split.json`` describing the split, written safely: a non-empty output folder must hold a
previous split, whose site folders alone are replaced, and everything is written into a hidden
staging folder first (:func:`prepare_out`, :func:`staging_dir`, :func:`swap_in`, also used by the
tabular data sets)."""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import re
import shutil
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
from PIL import Image

__all__ = ["SPLIT_JSON", "SPLIT_FORMAT", "Progress", "site_dir_name", "prepare_out", "staging_dir", "swap_in",
           "write_sites"]

SPLIT_JSON = "split.json"
SPLIT_FORMAT = 1

Progress = Callable[[int, int], None]


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
