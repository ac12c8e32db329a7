"""Files written whole or not at all, read in chunks, and their digests."""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Iterator

from fedrelay.calls import CHUNK_BYTES


def sha256_file(path: str | Path, chunk: int = CHUNK_BYTES) -> str:
    """Hex SHA-256 of a file, read in ``chunk``-byte pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def atomic_file(path: str | Path) -> Iterator[BinaryIO]:
    """A binary file to write ``path``'s new content to: a temp file in the same folder (made if
    missing), fsynced and renamed onto ``path`` when the block ends, removed if it raises."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: temp file in the same folder, fsync, rename."""
    with atomic_file(path) as f:
        f.write(data)


def iter_file_chunks(path: str | Path, chunk: int = CHUNK_BYTES, start: int = 0) -> Iterator[bytes]:
    """The bytes of a file from byte ``start`` on, in pieces of at most ``chunk`` bytes."""
    with open(path, "rb") as f:
        f.seek(start)
        while block := f.read(chunk):
            yield block
