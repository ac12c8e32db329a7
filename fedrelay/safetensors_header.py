"""The safetensors header, read without torch: the one parser of it in fedrelay.

A safetensors file is an 8-byte little-endian header length ``n``, ``n`` bytes of JSON (tensor
name -> ``{"dtype", "shape", "data_offsets"}``, and an optional ``"__metadata__"`` of strings),
then the tensor data (https://github.com/huggingface/safetensors, "Format"). The schema digest of
a payload (:func:`fedrelay.tensors.schema_digest`) and the final model's metadata
(:mod:`fedrelay.final_model`) read it here; the tensors themselves are read by safetensors.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

__all__ = ["HeaderError", "MAX_HEADER_BYTES", "read_header", "split", "join"]

# safetensors' own limit on a header (100 MB, safetensors' MAX_HEADER_SIZE).
MAX_HEADER_BYTES = 100_000_000


class HeaderError(ValueError):
    """Bytes that do not start with a safetensors header."""


def _parse(head: bytes) -> dict:
    try:
        header = json.loads(head)
    except ValueError as exc:
        raise HeaderError(f"not a safetensors header: {exc}") from None
    if not isinstance(header, dict):
        raise HeaderError("not a safetensors header (not a JSON object)")
    return header


def _length(first8: bytes, available: int | None, limit: int) -> int:
    if len(first8) != 8:
        raise HeaderError("not a safetensors file (shorter than 8 bytes)")
    (length,) = struct.unpack("<Q", first8)
    if length > limit:
        raise HeaderError(f"not a safetensors file (a header of {length} bytes, over {limit})")
    if available is not None and length > available:
        raise HeaderError("not a safetensors file (its header length exceeds the file)")
    return length


def read_header(path: str | Path, *, limit: int = MAX_HEADER_BYTES) -> dict:
    """The JSON header (a dict) of the safetensors file at ``path``, reading the header only.
    Raises ``HeaderError`` (a ``ValueError``) for a file that is not safetensors or whose header is
    over ``limit`` bytes, ``OSError`` if it cannot be read."""
    with open(path, "rb") as f:
        first8 = f.read(8)
        length = _length(first8, None, limit)
        head = f.read(length)
        if len(head) != length:
            raise HeaderError("not a safetensors file (its header length exceeds the file)")
        return _parse(head)


def split(data: bytes, *, limit: int = MAX_HEADER_BYTES) -> tuple[dict, bytes]:
    """safetensors bytes -> (header dict, the tensor data after the header). Raises
    ``HeaderError``."""
    length = _length(data[:8], len(data) - 8, limit)
    return _parse(data[8:8 + length]), data[8 + length:]


def join(header: dict, body: bytes) -> bytes:
    """The inverse of :func:`split`: ``header`` written as safetensors writes it (compact JSON,
    padded with spaces to a multiple of 8 bytes), then ``body`` unchanged (tensor offsets are
    relative to the end of the header)."""
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head + body
