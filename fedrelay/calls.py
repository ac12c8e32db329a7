"""How every gRPC call of both daemons and the CLI is sized, timed and retried, and how a failed
call is told.

Every number here is set on purpose (1 MiB chunks moved about 3x faster than 64 KiB ones when
measured on loopback; gRPC's default 4 MiB receive cap must not decide anything):

- ``CHUNK_BYTES`` = 1 MiB: payload bytes per ``ModelChunk`` message.
- ``MAX_MESSAGE_BYTES`` = 8 MiB: send/receive cap for one gRPC message, on every channel and
  server (``fedrelay.transport``, ``fedrelay.server``). Chunks are 1 MiB, every other message is
  small; the cap leaves room and nothing more.
- Deadlines (seconds) for each kind of call: ``CONTROL_TIMEOUT`` for small control calls,
  ``transfer_timeout(n)`` for streams (a floor plus time for ``n`` bytes at a pessimistic
  ``MIN_TRANSFER_RATE``), ``EVALUATE_TIMEOUT`` for evaluation of a site's test split.
- :func:`backoff_delays`: the one retry policy.

A failed call is described by :func:`status_message`; a site's refusal of an assignment by its
own policy (worded with ``POLICY_REFUSAL``) is told apart by :func:`assignment_refusal`.
"""

from __future__ import annotations

import random

import grpc

CHUNK_BYTES = 1 << 20
MAX_MESSAGE_BYTES = 8 << 20
CONTROL_TIMEOUT = 30.0
EVALUATE_TIMEOUT = 900.0
MIN_TRANSFER_RATE = 5e6  # bytes/s assumed for a deadline; far below loopback and LAN speeds
TRANSFER_FLOOR = 60.0

# How a site's daemon words an assignment its own policy refused (peer/policy.py); the
# coordinator records such a refusal as the site's policy's (RunSummary.refused_by_policy).
POLICY_REFUSAL = "refused by this site's policy: "


def backoff_delays(first: float = 0.5, cap: float = 15.0):
    """The one retry policy of both daemons: exponential backoff with full jitter, 0.5 s, 1 s,
    2 s, ... capped at ``cap`` seconds (an endless generator of delays in seconds)."""
    delay = first
    while True:
        yield random.uniform(0.5 * delay, delay)
        delay = min(cap, delay * 2)


def transfer_timeout(total_bytes: int) -> float:
    """Deadline in seconds for streaming ``total_bytes`` bytes."""
    return TRANSFER_FLOOR + total_bytes / MIN_TRANSFER_RATE


def status_message(exc: grpc.RpcError) -> str:
    """A one-line description of a failed call: ``CODE: details``."""
    try:
        return f"{exc.code().name}: {exc.details()}"
    except Exception:  # not a call error with a status
        return str(exc)


def assignment_refusal(exc: grpc.RpcError) -> tuple[str, bool]:
    """(reason, by its policy) of a site's refused ``Peer.Assign``: a refusal of the site's own
    policy (PERMISSION_DENIED worded with ``POLICY_REFUSAL``) gives the policy's reason and True;
    anything else ``status_message(exc)`` and False."""
    message = status_message(exc)
    try:
        code, details = exc.code(), exc.details() or ""
    except Exception:  # not a call error with a status
        return message, False
    if code == grpc.StatusCode.PERMISSION_DENIED and details.startswith(POLICY_REFUSAL):
        return details[len(POLICY_REFUSAL):], True
    return message, False
