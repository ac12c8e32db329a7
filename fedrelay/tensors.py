"""The model codec: models are exchanged as safetensors only (``encode_state``/``decode_state``);
nothing received is ever unpickled or passed to ``torch.load``. ``schema_digest`` names a
safetensors file's tensors (names, dtypes, shapes) without reading their data."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from fedrelay.calls import MAX_MESSAGE_BYTES
from fedrelay.safetensors_header import HeaderError, read_header


def schema_digest(path: str | Path) -> str:
    """SHA-256 (hex) of a safetensors file's schema: its tensors' names, dtypes and shapes, read
    from the file's header alone (no torch; the data are not read). Both ends of a transfer
    report it, so the ledger can check that a payload is the run's model (or the strategy's
    payload) and not only that its bytes match. Raises ``ValueError`` for a file whose header
    is not safetensors."""
    try:
        header = read_header(path, limit=MAX_MESSAGE_BYTES)
    except HeaderError as exc:
        raise ValueError(f"{path}: {exc}") from None
    try:
        entries = sorted((k, v["dtype"], list(v["shape"])) for k, v in header.items() if k != "__metadata__")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path}: not a safetensors header: {exc}") from None
    return hashlib.sha256(json.dumps(entries, separators=(",", ":")).encode()).hexdigest()


def encode_state(state: dict) -> bytes:
    """A state dict (name -> CPU tensor) as safetensors bytes.

    The encoding is deterministic (no run-specific metadata), so the same weights always have
    the same SHA-256: the ledger's digests identify models across runs.
    """
    from safetensors.torch import save  # imports torch: only where a model is encoded

    return save({k: v.detach().cpu().contiguous() for k, v in state.items()}, metadata={"format": "pt"})


def decode_state(data: bytes) -> dict:
    """Safetensors bytes -> state dict of CPU tensors. Raises ``ValueError`` on malformed input."""
    from safetensors import SafetensorError
    from safetensors.torch import load  # imports torch: only where a model is decoded

    try:
        return load(bytes(data))
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except (SafetensorError, BaseException) as exc:  # the Rust parser raises several error types,
        # and a Rust panic surfaces as pyo3's PanicException, a BaseException
        raise ValueError(f"not a valid safetensors payload: {exc}") from exc
