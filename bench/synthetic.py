"""A tiny, learnable stand-in for Fashion-MNIST in its IDX format, for smoke runs and tests
(no download, seconds to train): class k is a bright 7x7 square at a class-specific place, on
noise. ``coordinator split-dataset fashion-mnist --source FOLDER`` reads it like the real files."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np


def synthetic_images(n: int, seed: int, classes: int = 10, size: int = 28) -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 n×size×size, labels uint8 n), deterministic for ``seed``."""
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
    """The four Fashion-MNIST IDX files (train/t10k images and labels) in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    tx, ty = synthetic_images(n_train, seed)
    vx, vy = synthetic_images(n_test, seed + 1)
    write_idx(folder / "train-images-idx3-ubyte.gz", tx)
    write_idx(folder / "train-labels-idx1-ubyte.gz", ty)
    write_idx(folder / "t10k-images-idx3-ubyte.gz", vx)
    write_idx(folder / "t10k-labels-idx1-ubyte.gz", vy)
    return folder
