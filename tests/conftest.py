"""Shared fixtures: tiny, learnable synthetic data in Fashion-MNIST's IDX format and as site folders."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent


def synthetic_images(n: int, seed: int, classes: int = 10, size: int = 28) -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 n×size×size, labels uint8 n): class k is a bright 7×7 square at a
    class-specific place, on noise. A small CNN learns it in a few epochs."""
    rng = np.random.default_rng(seed)
    labels = (np.arange(n) % classes).astype(np.uint8)
    rng.shuffle(labels)
    images = rng.integers(0, 70, size=(n, size, size), dtype=np.uint8)
    for i, k in enumerate(labels):
        r, c = divmod(int(k), 4)
        y, x = 1 + r * 9 + rng.integers(0, 2), 1 + c * 6 + rng.integers(0, 2)
        images[i, y:y + 7, x:x + 7] = rng.integers(190, 256, size=(7, 7))
    return images, labels


def write_idx(path: Path, array: np.ndarray) -> None:
    """Write ``array`` (uint8) as an IDX file, gzip-compressed when ``path`` ends in .gz."""
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + b"".join(struct.pack(">I", d) for d in array.shape)
    data = header + array.astype(np.uint8).tobytes()
    if path.suffix == ".gz":
        data = gzip.compress(data)
    path.write_bytes(data)


def write_fashion_like(folder: Path, n_train: int = 600, n_test: int = 200, seed: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tx, ty = synthetic_images(n_train, seed)
    vx, vy = synthetic_images(n_test, seed + 1)
    write_idx(folder / "train-images-idx3-ubyte.gz", tx)
    write_idx(folder / "train-labels-idx1-ubyte.gz", ty)
    write_idx(folder / "t10k-images-idx3-ubyte.gz", vx)
    write_idx(folder / "t10k-labels-idx1-ubyte.gz", vy)
    return folder


@pytest.fixture(scope="session")
def idx_source(tmp_path_factory) -> Path:
    """A folder of tiny synthetic Fashion-MNIST-format IDX files (600 train, 200 test)."""
    return write_fashion_like(tmp_path_factory.mktemp("idx"))


@pytest.fixture(scope="session")
def three_sites(tmp_path_factory, idx_source) -> list[Path]:
    """Three site folders split from the synthetic IDX files (Dirichlet 0.5, seed 0)."""
    from fedrelay.coordinator.split import split_dataset

    out = tmp_path_factory.mktemp("sites")
    split_dataset("fashion-mnist", sites=3, dirichlet=0.5, seed=0, out=out, source=idx_source)
    return sorted(p for p in out.iterdir() if p.is_dir() and p.name.startswith("site-"))
