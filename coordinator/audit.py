"""Auditing a run: check its ledger records with nothing but the federation's CA certificate.

A run's **audit bundle** (:func:`bundle_from_ledger`, :func:`write_bundle`; one JSON file) holds
everything a third party needs: the run's row, every version of its plan, its events with their
hash chain (``coordinator/hashchain.py``), the signed records (each site's reports and
evaluations as signed, ``fedrelay/signing.py``), the certificates that signed them, the
coordinator's signed seal, and the ledger's ``hops``, ``receipts`` and ``evaluations`` rows of
the run. :func:`verify` checks a bundle (read from a ledger, or from a file) and names the first
thing that does not verify:

1. the events form an unbroken chain: each event's ``prev_hash`` is its predecessor's ``hash``
   (else an event before it was dropped, or events were moved or swapped) and its ``hash`` is
   that of its content (else the event was edited);
2. each signed record is bound to its event (its binding digest is the event's ``record``), its
   certificate was issued by the CA, names the signer and was valid when the record was kept,
   its signature verifies, the signer is the site the record speaks for (a hop report's sender,
   a receipt's receiver, the final report's, failure's and evaluation's site), of this run, and
   the run's recorded plan has that site in that role (a planned transfer; the plan's final
   site; a site of the run);
3. every ``hops``, ``receipts`` and ``evaluations`` row equals its signed record field by field
   (bytes, digests, times, accuracy...), none is missing and none lacks a record; the run's
   final model and site equal the signed final report, and its global accuracy is recomputed
   from the signed evaluations;
4. an ended run has the coordinator's seal: signed by the CA's ``coordinator`` identity, its
   chain head and length match the events (so events dropped at the end are caught), and the
   run's row (order, strategy, status, accuracy...) and plan versions are the ones sealed.

On a plaintext run (``insecure``) nothing is signed: the same consistency checks run, and the
verdict is "unsigned" (nothing proves who wrote the records).

This module holds :func:`verify`, which runs the checks in that order; the bundles live in
``audit_bundle.py``, checks 1 and 2 in ``audit_chain.py``, 3 and 4 in ``audit_tables.py`` and
the verdict (:class:`Problem`, :class:`Report`) in ``audit_report.py``.
"""

from __future__ import annotations

from typing import Any

from fedrelay.coordinator.audit_bundle import (FORMAT, FORMAT_VERSION, ROW_TABLES, AuditError, bundle_from_ledger,
                                               load_bundle, load_ca_file, write_bundle)
from fedrelay.coordinator.audit_chain import EVENT_KINDS, MESSAGES, Verifier
from fedrelay.coordinator.audit_report import Problem, Report
from fedrelay.coordinator.audit_tables import check_seal, check_tables

__all__ = ["EVENT_KINDS", "FORMAT", "FORMAT_VERSION", "MESSAGES", "ROW_TABLES", "AuditError", "Problem", "Report",
           "bundle_from_ledger", "load_bundle", "load_ca_file", "verify", "write_bundle"]


def verify(bundle: dict[str, Any], ca: list | None) -> Report:
    """Check a run's audit bundle (:func:`bundle_from_ledger` or :func:`load_bundle`) against
    the CA certificates ``ca`` (``fedrelay.signing.load_ca``; None only for a plaintext run).
    Returns the :class:`Report` (its ``first`` problem is the first thing in the ledger that does
    not verify). Raises ``AuditError`` when the run's records are signed and ``ca`` is None, or
    the bundle is malformed (a field of the wrong type or missing)."""
    try:
        v = Verifier(bundle, ca)
        if not bundle.get("run"):
            v.problem(-1, f"run {bundle.get('run_id')}", "the bundle holds no run row")
            return v.report
        v.chain()
        check_tables(v)
        check_seal(v)
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        if isinstance(exc, AuditError):
            raise
        raise AuditError(f"the audit bundle is malformed ({type(exc).__name__}: {exc}); export it again with "
                         "`coordinator audit RUN --export FILE`") from None
    return v.report
