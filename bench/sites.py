"""The site folders a grid study trains on: the Dirichlet label-skew split made with the real CLI
(``coordinator split-dataset``), the domain-shift sites (Fashion-MNIST rotated by 0/30/60/90
degrees, one domain per site, and the chain orders over them), tiny synthetic data for smoke
runs, and the walk over a grid's (seed, Dirichlet) groups that still have cells to compute."""

from __future__ import annotations

import subprocess
from itertools import permutations
from pathlib import Path

from bench.cells import Config
from deploy.processes import tool

ANGLES = (0, 30, 60, 90)
# Balanced Latin square (Williams design) over the 4 domains, as indices into ANGLES.
WILLIAMS = ((0, 1, 3, 2), (1, 2, 0, 3), (2, 3, 1, 0), (3, 0, 2, 1))


def write_synthetic_idx(folder: Path, n_train: int = 900, n_test: int = 300, seed: int = 0) -> Path:
    """Tiny learnable Fashion-MNIST-format IDX files (``bench.synthetic``)."""
    from bench.synthetic import write_fashion_like

    return write_fashion_like(folder, n_train=n_train, n_test=n_test, seed=seed)


def site_dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("site-"))


def grid_todo(args, cfg: Config, cache, work: Path, group_of):
    """The (seed, Dirichlet) groups of a grid study (bench.few_shot, bench.parallel) with cells
    still to compute, seed-major so that partial results cover every Dirichlet; none with
    ``--publish-only``. Yields ``(seed, a, group, todo, dirs)``: ``group = group_of(seed, a)``
    the cache key, ``todo`` the methods of ``args.methods`` whose cell ``cache`` lacks, ``dirs`` the
    site folders of the split (:func:`make_split` under ``work/splits``, made once and kept)."""
    for seed in ([] if args.publish_only else args.seeds):
        for a in args.dirichlets:
            group = group_of(seed, a)
            todo = [m for m in args.methods if cache.get(*group, m) is None]
            if todo:
                yield seed, a, group, todo, site_dirs(make_split(
                    work / "splits" / cfg.split_tag / f"dir{a:g}-seed{seed}", cfg, a, seed, args.source))


def make_split(out: Path, cfg: Config, dirichlet: float, seed: int, source: Path | None) -> Path:
    """Site folders for one (Dirichlet, seed), with the real CLI (kept between runs)."""
    if (out / "split.json").exists():
        return out
    cmd = [tool("coordinator"), "split-dataset", "fashion-mnist", "--sites", str(cfg.sites), "--dirichlet",
           f"{dirichlet:g}", "--seed", str(seed), "--out", str(out)]
    if source:
        cmd += ["--source", str(source)]
    if cfg.max_train:
        cmd += ["--max-train-per-site", str(cfg.max_train)]
    out.parent.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"split-dataset failed: {res.stderr[-2000:]}")
    return out


def rotate(images, angle: float):
    """uint8 (n, H, W) rotated counter-clockwise by ``angle`` degrees (bilinear, black fill)."""
    import numpy as np
    import torch
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as TF

    if angle % 360 == 0:
        return images.copy()
    if angle % 90 == 0:
        return np.ascontiguousarray(np.rot90(images, k=int(angle // 90), axes=(1, 2)))
    x = torch.from_numpy(images).unsqueeze(1).float()
    y = TF.rotate(x, float(angle), interpolation=InterpolationMode.BILINEAR, fill=0.0)
    return y.round().clamp(0, 255).to(torch.uint8).squeeze(1).numpy()


def make_domain_sites(out: Path, cfg: Config, source: Path | None) -> list[Path]:
    """4 site folders, site i = a disjoint share of train and of test, rotated by ANGLES[i]."""
    if (out / "split.json").exists():
        return site_dirs(out)
    import numpy as np

    from fedrelay.datasets.fashion_mnist import FASHION_MNIST_CLASSES, load_fashion_mnist
    from fedrelay.datasets.site_folders import write_sites

    train_x, train_y, test_x, test_y = load_fashion_mnist(source)
    rng = np.random.default_rng(cfg.domain_seed)
    n = len(ANGLES)
    tr = np.array_split(rng.permutation(len(train_y)), n)
    te = np.array_split(rng.permutation(len(test_y)), n)
    if cfg.domain_max_train:
        tr = [p[:cfg.domain_max_train] for p in tr]
    xs, ys, vxs, vys, tparts, vparts = [], [], [], [], [], []
    t_off = v_off = 0
    for i, angle in enumerate(ANGLES):
        xs.append(rotate(train_x[tr[i]], angle))
        ys.append(train_y[tr[i]])
        vxs.append(rotate(test_x[te[i]], angle))
        vys.append(test_y[te[i]])
        tparts.append(np.arange(t_off, t_off + len(tr[i])))
        vparts.append(np.arange(v_off, v_off + len(te[i])))
        t_off += len(tr[i])
        v_off += len(te[i])
    write_sites(out, class_names=FASHION_MNIST_CLASSES, train_x=np.concatenate(xs), train_y=np.concatenate(ys),
                train_parts=tparts, test_x=np.concatenate(vxs), test_y=np.concatenate(vys), test_parts=vparts,
                meta={"name": "fashion-mnist-rotated", "angles": list(ANGLES), "seed": cfg.domain_seed,
                      "max_train_per_site": cfg.domain_max_train})
    return site_dirs(out)


def orders_from(spec: str) -> list[tuple[int, ...]]:
    if spec == "latin":
        return [tuple(ANGLES[i] for i in row) for row in WILLIAMS]
    if spec == "all":
        return list(permutations(ANGLES))
    out = []
    for part in spec.split(";"):
        o = tuple(int(x) for x in part.split(","))
        if sorted(o) != sorted(ANGLES):
            raise SystemExit(f"--orders: {part!r} is not an order of {ANGLES}")
        out.append(o)
    return out
