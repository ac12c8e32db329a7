"""Numbers that bound a model transfer (its size, its stalls, its sealing), shared by the receiving site (``peer/node.py``) and the
relay (``coordinator/relay_bounds.py``), so that both refuse the same things.

- ``STALL_TIMEOUT``: seconds an inbound stream (a peer's ``Handoff``, a relay's ``Put``) may
  send nothing before it is dropped (DEADLINE_EXCEEDED).
- ``SEAL_OVERHEAD``: bytes a sealed envelope (``fedrelay/sealing.py``) may add to its payload:
  its header with the sender's certificate, its signature and a 16-byte GCM tag per 1 MiB
  segment (a few KiB for any model; 64 KiB leaves room).
- :func:`payload_cap`: the largest payload a run accepts, from the bytes of its tensors.
"""

from __future__ import annotations

STALL_TIMEOUT = 60.0  # seconds
SEAL_OVERHEAD = 64 << 10  # bytes a sealed envelope may add to its payload (header, certificate, GCM tags)
PAYLOAD_HEADER_BYTES = 1 << 20  # room for a safetensors header in a payload


def payload_cap(tensor_bytes: int) -> int:
    """Largest payload (bytes) a run accepts when its payload's tensors take ``tensor_bytes``
    bytes: 4 x ``tensor_bytes`` + 1 MiB of header (the rule of ``PeerNode._payload_cap``; 4x
    leaves room for a strategy's payload of several models or wider dtypes)."""
    return 4 * int(tensor_bytes) + PAYLOAD_HEADER_BYTES


def sealed_cap(payload_bytes: int) -> int:
    """Largest sealed envelope (bytes) of a payload of at most ``payload_bytes`` bytes (what a
    relay stores and a receiver fetches): ``payload_bytes`` + ``SEAL_OVERHEAD``."""
    return int(payload_bytes) + SEAL_OVERHEAD
