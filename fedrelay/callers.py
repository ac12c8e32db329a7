"""Who calls: the certificate names (identities) of the coordinator and the operators, and the
identity of a server call's caller.

A site's identity is its name (one DNS label, no dot); the coordinator's is ``coordinator``; an
operator's is ``operator`` (made by ``coordinator init-ca``) or ``operator.NAME`` (``coordinator
enroll --operator NAME``), which no site certificate can carry.
"""

from __future__ import annotations

COORDINATOR_IDENTITY = "coordinator"
OPERATOR_IDENTITY = "operator"
# Further operators (``coordinator enroll --operator NAME``): certificate name "operator.NAME".
# A site's name is one DNS label (no dot), so no site certificate can carry such a name.
OPERATOR_PREFIX = OPERATOR_IDENTITY + "."


def is_operator(identity: str | None) -> bool:
    """Whether a certificate name is an operator's: ``operator`` (made by ``init-ca``) or
    ``operator.NAME`` (``enroll --operator NAME``)."""
    return bool(identity) and (identity == OPERATOR_IDENTITY or (
        identity.startswith(OPERATOR_PREFIX) and len(identity) > len(OPERATOR_PREFIX)))


def caller_identity(context) -> str | None:
    """The certificate name (CN) of the caller of a server call (``context``: a
    ``grpc.ServicerContext``), or ``None`` on a plaintext server (no identities). On a TLS
    server every caller has one (client certificates are required)."""
    ctx = context.auth_context() or {}
    if ctx.get("transport_security_type") != [b"ssl"]:
        return None
    names = ctx.get("x509_common_name") or []
    return names[0].decode() if names else ""
