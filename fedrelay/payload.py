"""Payload validation without torch: a received safetensors payload checked
against a schema with safetensors' numpy API, so that a light site daemon that never imports
torch can refuse a bad model before keeping it.

A schema is ``{tensor name: (shape, dtype)}`` with ``shape`` a tuple of ints and ``dtype`` the
safetensors dtype string (``"F32"``, ``"I64"`` ...), e.g. what :func:`schema_from_torch` makes
from a torch signature (``fedrelay.models.expected_signature``) in a process that has torch, written
to JSON with :func:`dump_schema` and read back with :func:`load_schema`.

The checks and their messages are those of ``peer.models.check_state``: the same tensor names,
shapes and dtypes, and no NaN or Inf in floating tensors. Everything raises ``ValueError``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

__all__ = ["Schema", "check_payload", "payload_bytes", "schema_from_torch", "dump_schema", "load_schema"]

Schema = dict[str, tuple[tuple[int, ...], str]]

# safetensors dtype string -> (numpy dtype, bytes per element); the dtypes numpy can hold.
_DTYPES = {"F64": (np.float64, 8), "F32": (np.float32, 4), "F16": (np.float16, 2), "I64": (np.int64, 8),
           "I32": (np.int32, 4), "I16": (np.int16, 2), "I8": (np.int8, 1), "U8": (np.uint8, 1), "BOOL": (np.bool_, 1)}
_NUMPY_TO_ST = {np.dtype(v[0]): k for k, v in _DTYPES.items()}
_TORCH_TO_ST = {"torch.float64": "F64", "torch.float32": "F32", "torch.float16": "F16", "torch.bfloat16": "BF16",
                "torch.int64": "I64", "torch.int32": "I32", "torch.int16": "I16", "torch.int8": "I8",
                "torch.uint8": "U8", "torch.bool": "BOOL"}


def schema_from_torch(signature: dict) -> Schema:
    """A torch signature ``{name: (shape, torch.dtype)}`` as a torch-free schema (dtype strings).
    Raises ``ValueError`` for a dtype safetensors cannot name."""
    out: Schema = {}
    for name, (shape, dtype) in signature.items():
        if str(dtype) not in _TORCH_TO_ST:
            raise ValueError(f"tensor {name!r} has dtype {dtype}, which has no safetensors name here")
        out[name] = (tuple(int(s) for s in shape), _TORCH_TO_ST[str(dtype)])
    return out


def payload_bytes(schema: Schema) -> int:
    """Bytes of the tensor data a payload of ``schema`` holds (its safetensors header excluded)."""
    size = {k: v[1] for k, v in _DTYPES.items()} | {"BF16": 2}
    return sum(int(np.prod(shape, dtype=np.int64)) * size[dtype] for shape, dtype in schema.values())


def dump_schema(schema: Schema, path: str | Path) -> None:
    """Write ``schema`` as JSON (``{name: [shape list, dtype]}``) to ``path``."""
    Path(path).write_text(json.dumps({k: [list(s), d] for k, (s, d) in sorted(schema.items())}))


def load_schema(path: str | Path) -> Schema:
    """Read a schema :func:`dump_schema` wrote. Raises ``ValueError`` for a malformed file."""
    try:
        raw = json.loads(Path(path).read_text())
        return {str(k): (tuple(int(x) for x in s), str(d)) for k, (s, d) in raw.items()}
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path}: not a payload schema: {exc}") from None


def _all_finite(a: np.ndarray) -> bool:
    # As peer.models._all_finite: a finite sum implies finite elements; only a non-finite sum
    # (NaN/Inf, or an overflow of huge finite values) needs the elementwise check.
    with np.errstate(over="ignore", invalid="ignore"):
        return bool(np.isfinite(a.sum(dtype=np.float64))) or bool(np.isfinite(a).all())


def check_payload(data: bytes, schema: Schema) -> None:
    """Parse ``data`` (safetensors bytes, e.g. a received model) with safetensors' numpy API and
    check it against ``schema``: the same tensor names, shapes and dtypes, and no NaN or Inf in
    floating tensors. Raises ``ValueError`` naming the first difference (a payload that is not
    safetensors, or holds a dtype numpy cannot represent, is "not a valid safetensors payload")."""
    from safetensors import SafetensorError
    from safetensors.numpy import load

    try:
        arrays = load(bytes(data))
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except (SafetensorError, BaseException) as exc:  # the Rust parser raises several error types
        raise ValueError(f"not a valid safetensors payload: {exc}") from exc
    got = {k: (tuple(a.shape), _NUMPY_TO_ST.get(a.dtype, str(a.dtype))) for k, a in arrays.items()}
    if set(got) != set(schema):
        extra, missing = sorted(set(got) - set(schema)), sorted(set(schema) - set(got))
        raise ValueError(f"tensor names differ from the run's model (unexpected {extra[:5]}, missing {missing[:5]})")
    for k, sig in schema.items():
        if got[k] != tuple(sig):
            raise ValueError(f"tensor {k!r} is {got[k]}, the run's model has {tuple(sig)}")
    for k, a in arrays.items():
        if np.issubdtype(a.dtype, np.floating) and not _all_finite(a):
            raise ValueError(f"tensor {k!r} holds NaN or Inf")
