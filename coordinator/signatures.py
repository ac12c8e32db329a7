"""The coordinator's side of signed records: verify what a site signed before the ledger keeps it,
and sign each ended run's seal.

Under mutual TLS (``fedrelay/signing.py`` says what is signed and how):

- a report (``HopReport``, ``ReceiptReport``, ``FinalReport``, ``FailureReport``) must carry the
  reporting site's signature, made with the key of the certificate it calls with (the one its
  TLS connection presented); an unsigned report, or one whose signature does not verify, is
  refused with ``INVALID_ARGUMENT`` and nothing is recorded;
- an evaluation (``EvaluateReply``, the answer to the coordinator's ``Evaluate`` call) must name
  the site, run and final model asked about, carry a certificate from the federation's CA that
  names the site, and a signature that verifies with it;
- a run's ``RunSeal`` is signed with the coordinator's own key.

On a plaintext coordinator nothing is signed: records are kept unsigned (and ``coordinator
audit`` says so).
"""

from __future__ import annotations

import time

import grpc

from fedrelay import signing
from fedrelay.signing import SignatureError, SignedRecord


class Signatures:
    """Verification of the sites' records and signing of seals for one coordinator
    (``transport``: its ``fedrelay.transport.Transport``)."""

    def __init__(self, transport):
        self.secure = transport.secure
        self.ca = signing.load_ca(transport.ca) if transport.secure else []
        self.signer = signing.signer_for(transport)

    def report(self, request, context, site: str) -> SignedRecord:
        """The record of a site's report (``site``: the reporting site, already checked to be
        the caller's certificate name). Aborts the call with ``INVALID_ARGUMENT`` when it is not
        signed, or its signature does not verify with the caller's certificate."""
        if not self.secure:
            return signing.unsigned(site, request)
        what = type(request).DESCRIPTOR.name
        pem = (context.auth_context() or {}).get("x509_pem_cert") or []
        if not pem:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, f"the {what} came without a client certificate")
        if not request.signature:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"the {what} from {site} is not signed: under mutual TLS every report is signed with the "
                          "site's key (is the site's fedrelay older than the coordinator's?)")
        try:
            return signing.received(request, site, pem[0])
        except SignatureError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the {what} from {site} was refused: {exc}")

    def evaluation(self, reply, site: str, run_id: str, sha256: str) -> SignedRecord:
        """The record of ``site``'s ``EvaluateReply`` for the final model ``sha256`` of
        ``run_id``. Raises ``SignatureError`` when it names another site, run or model, or (TLS)
        its certificate is not the CA's for ``site`` or its signature does not verify."""
        if reply.site != site:
            raise SignatureError(f"the evaluation names the site {reply.site!r}")
        if not self.secure:
            if not reply.run_id and not reply.sha256:  # a peer that does not say (plaintext only)
                filled = type(reply)()
                filled.CopyFrom(reply)
                filled.run_id, filled.sha256 = run_id, sha256
                reply = filled
        if (reply.run_id, reply.sha256) != (run_id, sha256):
            raise SignatureError(f"the evaluation is of run {reply.run_id!r}, model {reply.sha256[:12]!r}, not of "
                                 f"run {run_id}'s final model {sha256[:12]}")
        if not self.secure:
            return signing.unsigned(site, reply)
        if not reply.certificate:
            raise SignatureError("the evaluation is not signed (is the site's fedrelay older than the coordinator's?)")
        signing.check_certificate(signing.load_certificate(reply.certificate), self.ca, site, at=time.time())
        return signing.received(reply, site, reply.certificate)

    def seal(self, seal) -> SignedRecord:
        """A ``RunSeal`` signed with the coordinator's key (unsigned on a plaintext coordinator)."""
        if self.signer is None:
            return signing.unsigned("coordinator", seal)
        record = signing.canonical(seal)
        return SignedRecord(self.signer.name, record, self.signer.sign_bytes(record), self.signer.certificate_pem)
