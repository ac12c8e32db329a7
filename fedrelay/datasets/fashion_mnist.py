"""Fashion-MNIST as its four IDX files: :func:`read_idx` (the MNIST / Fashion-MNIST container) and
:func:`load_fashion_mnist`; :class:`DatasetNotFound` says how to get the files."""

from __future__ import annotations

import gzip
import math
import zlib
from pathlib import Path
from typing import Sequence

import numpy as np

__all__ = [
    "FASHION_MNIST_CLASSES",
    "DEFAULT_FASHION_MNIST_DIR",
    "FASHION_MNIST_FILES",
    "DatasetNotFound",
    "read_idx",
    "load_fashion_mnist",
]

FASHION_MNIST_CLASSES = [
    "T-shirt_top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle_boot",
]
DEFAULT_FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_FILES = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}

# IDX element type code -> big-endian numpy dtype
_IDX_DTYPES = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


class DatasetNotFound(FileNotFoundError):
    """The data set's files are not where we looked; the message says how to get them."""


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
