"""The exit codes of every fedrelay command (``peer``, ``coordinator``, ``fedrelay``), in one place.

A script tells the outcomes apart by the code alone (docs/cli-conventions.md has the table):

====  =============  ==============================================================================
code  name           meaning
====  =============  ==============================================================================
0     ``OK``         done (a run followed to its end finished; a probed daemon is SERVING)
1     ``FAILED``     the work failed: the run failed or was cancelled, a daemon stopped on an error,
                     a daemon answers NOT_SERVING, an audit does not verify
2     ``USAGE``      a bad command line, option value, configuration file or environment variable;
                     an unknown run, site, task or strategy name (nothing was changed)
3     ``UNREACHABLE``  no daemon answers at the address
4     ``REFUSED``    the daemon refused the caller (authorization: PERMISSION_DENIED, UNAUTHENTICATED,
                     or the mutual TLS handshake fails: another CA, an identity it does not accept)
5     ``UNSIGNED``   ``coordinator audit`` only: a plaintext run, consistent but unsigned
130   ``INTERRUPTED``  Ctrl-C (``watch``/``start-chain --wait``: the run goes on)
====  =============  ==============================================================================
"""

from __future__ import annotations

OK = 0
FAILED = 1
USAGE = 2
UNREACHABLE = 3
REFUSED = 4
UNSIGNED = 5
INTERRUPTED = 130

#: code -> one line, for the documentation and ``--json`` errors' readers.
MEANING = {
    OK: "done",
    FAILED: "the run or the work failed",
    USAGE: "bad command line, option value, configuration file or environment variable",
    UNREACHABLE: "cannot reach the daemon",
    REFUSED: "refused by authorization",
    UNSIGNED: "coordinator audit: the run is unsigned (plaintext)",
    INTERRUPTED: "interrupted (Ctrl-C)",
}


def for_grpc_status(code) -> int:
    """The exit code of a failed gRPC call with status ``code`` (a ``grpc.StatusCode``):
    UNAVAILABLE / DEADLINE_EXCEEDED -> :data:`UNREACHABLE`; PERMISSION_DENIED / UNAUTHENTICATED
    -> :data:`REFUSED`; INVALID_ARGUMENT / NOT_FOUND / OUT_OF_RANGE / ALREADY_EXISTS ->
    :data:`USAGE` (the daemon refused a value); anything else -> :data:`FAILED`."""
    name = getattr(code, "name", str(code))
    if name in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
        return UNREACHABLE
    if name in ("PERMISSION_DENIED", "UNAUTHENTICATED"):
        return REFUSED
    if name in ("INVALID_ARGUMENT", "NOT_FOUND", "OUT_OF_RANGE", "ALREADY_EXISTS"):
        return USAGE
    return FAILED


TLS_WORDS = ("ssl", "SSL", "TLS", "Tls", "verif", "handshake")


def for_rpc_error(code, details: str = "") -> int:
    """:func:`for_grpc_status`, except that a connection that failed in its TLS handshake
    (UNAVAILABLE with ``details`` that speak of SSL/TLS, verification or the handshake: another
    CA, an identity the other end does not accept) is :data:`REFUSED`, not UNREACHABLE."""
    name = getattr(code, "name", str(code))
    if name == "UNAVAILABLE" and any(w in (details or "") for w in TLS_WORDS):
        return REFUSED
    return for_grpc_status(code)
