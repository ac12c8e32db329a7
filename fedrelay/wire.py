"""What both daemons need on the wire: gRPC settings, channels, servers, and the model codec.

Every limit here is set on purpose (see ``PERF-NOTES`` in the design material: 1 MiB chunks
move ~3x faster than 64 KiB ones; gRPC's default 4 MiB receive cap must not decide anything):

- ``CHUNK_BYTES`` = 1 MiB: payload bytes per ``ModelChunk`` message.
- ``MAX_MESSAGE_BYTES`` = 8 MiB: send/receive cap for one gRPC message, on every channel and
  server. Chunks are 1 MiB, every other message is small; the cap leaves room and nothing more.
- Deadlines (seconds) for each kind of call: ``CONTROL_TIMEOUT`` for small control calls,
  ``transfer_timeout(n)`` for streams (a floor plus time for ``n`` bytes at a pessimistic
  ``MIN_TRANSFER_RATE``), ``EVALUATE_TIMEOUT`` for evaluation of a site's test split.

Models are exchanged as safetensors only (``encode_state``/``decode_state``): nothing received
is ever unpickled or passed to ``torch.load``.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Iterator

import grpc

CHUNK_BYTES = 1 << 20
MAX_MESSAGE_BYTES = 8 << 20
CONTROL_TIMEOUT = 30.0
EVALUATE_TIMEOUT = 900.0
MIN_TRANSFER_RATE = 5e6  # bytes/s assumed for a deadline; far below loopback and LAN speeds
TRANSFER_FLOOR = 60.0

_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Keepalive so a dead TCP peer is noticed within a minute, not at the OS's 2-hour default.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
_SERVER_OPTIONS = _OPTIONS + [
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.so_reuseport", 0),
]


def transfer_timeout(total_bytes: int) -> float:
    """Deadline in seconds for streaming ``total_bytes`` bytes."""
    return TRANSFER_FLOOR + total_bytes / MIN_TRANSFER_RATE


def insecure_channel(address: str) -> grpc.Channel:
    """A plaintext channel to ``HOST:PORT`` with fedrelay's message limits and keepalive."""
    return grpc.insecure_channel(address, options=_OPTIONS)


def make_server(listen: str, max_workers: int = 16) -> tuple[grpc.Server, int]:
    """A gRPC server bound (plaintext) to ``listen`` (``HOST:PORT``; port 0 picks a free one).

    Returns (server, bound port). Raises ``RuntimeError`` when the address cannot be bound.
    """
    from concurrent import futures

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=_SERVER_OPTIONS)
    try:
        port = server.add_insecure_port(listen)
    except RuntimeError as exc:  # grpc raises RuntimeError("Failed to bind ...")
        raise RuntimeError(f"cannot listen on {listen}: {exc}") from exc
    if port == 0:
        raise RuntimeError(f"cannot listen on {listen}: address in use or not available")
    return server, port


def split_hostport(address: str) -> tuple[str, int]:
    """``'host:port'`` or ``'[v6]:port'`` -> (host, port). Raises ``ValueError``."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def with_port(listen: str, port: int) -> str:
    """Replace the port of ``listen`` (e.g. ``127.0.0.1:0`` -> ``127.0.0.1:43121``)."""
    host, _ = split_hostport(listen)
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{port}"


# ---------------------------------------------------------------------------------------------
# Model codec and digests


def sha256_file(path: str | Path, chunk: int = CHUNK_BYTES) -> str:
    """Hex SHA-256 of a file, read in ``chunk``-byte pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def encode_state(state: dict) -> bytes:
    """A state dict (name -> CPU tensor) as safetensors bytes.

    The encoding is deterministic (no run-specific metadata), so the same weights always have
    the same SHA-256: the ledger's digests identify models across runs.
    """
    from safetensors.torch import save

    return save({k: v.detach().cpu().contiguous() for k, v in state.items()}, metadata={"format": "pt"})


def decode_state(data: bytes) -> dict:
    """Safetensors bytes -> state dict of CPU tensors. Raises ``ValueError`` on malformed input."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        return load(bytes(data))
    except (SafetensorError, Exception) as exc:  # the Rust parser raises several error types
        raise ValueError(f"not a valid safetensors payload: {exc}") from exc


def atomic_write(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically: temp file in the same folder, fsync, rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def iter_file_chunks(path: str | Path, chunk: int = CHUNK_BYTES) -> Iterator[bytes]:
    """The bytes of a file in pieces of at most ``chunk`` bytes."""
    with open(path, "rb") as f:
        while block := f.read(chunk):
            yield block


def status_message(exc: grpc.RpcError) -> str:
    """A one-line description of a failed call: ``CODE: details``."""
    try:
        return f"{exc.code().name}: {exc.details()}"
    except Exception:  # not a call error with a status
        return str(exc)
