"""Auditing a run's hash chain and the signed records bound into it (checks 1 and 2 of
``coordinator/audit.py``).

:class:`Verifier` holds one audit's state: it walks the run's events in order, checks each
link of the chain and each signed record (bound to its event, its certificate issued by the CA,
its signature, its signer the site it speaks for and planned for that role) and gathers what
the signed records say the ``hops``, ``receipts`` and ``evaluations`` rows must hold, for
``coordinator/audit_tables.py`` to compare.
"""

from __future__ import annotations

import json
import math
from typing import Any

from fedrelay import purpose as purposes
from fedrelay import signing
from fedrelay.coordinator import hashchain
from fedrelay.coordinator.audit_bundle import AuditError, unb64
from fedrelay.coordinator.audit_report import Problem, Report
from fedrelay.coordinator.ledger_runs import TERMINAL
from fedrelay.coordinator.plan import Plan
from fedrelay.signing import SignatureError
from fedrelay.v1 import coordinator_pb2 as cpb, peer_pb2

MESSAGES = {m.DESCRIPTOR.full_name: m for m in (cpb.HopReport, cpb.ReceiptReport, cpb.FinalReport, cpb.FailureReport,
                                                peer_pb2.EvaluateReply)}
# The event kinds a record of each type is kept with.
EVENT_KINDS = {"HopReport": ("hop", "upload", "final_copy"), "ReceiptReport": ("receipt",), "FinalReport": ("final",),
               "FailureReport": ("failed",), "EvaluateReply": ("evaluated",)}


def describe_event(e: dict) -> str:
    """An event in words: its seq, kind and (the start of) its message."""
    message = str(e.get("message", ""))
    return f"event seq {e.get('seq')} ({e.get('kind')}: {message[:70]}{'...' if len(message) > 70 else ''})"


def transfer_words(purpose: str, hop: int, sender: str, receiver: str) -> str:
    """A transfer in words: ``chain hop 2 (a → b)``, ``upload 1 (...)``, ``final copy (...)``."""
    what = {"chain": f"chain hop {hop}", "upload": f"upload {hop}", "final": "final copy"}.get(purpose, f"{purpose} {hop}")
    return f"{what} ({sender} → {receiver})"


def describe_record(type_: str, msg, signer: str) -> str:
    """A signed record in words: whose report, receipt or evaluation of what."""
    if type_ in ("HopReport", "ReceiptReport"):
        purpose = purposes.ledger_of_wire(msg.purpose) or str(msg.purpose)
        what = "report" if type_ == "HopReport" else "receipt"
        return f"{signer}'s {what} of {transfer_words(purpose, msg.hop, msg.sender, msg.receiver)}"
    return {"FinalReport": f"{signer}'s final report", "FailureReport": f"{signer}'s failure report",
            "EvaluateReply": f"{signer}'s evaluation"}.get(type_, f"{signer}'s {type_}")


def json_or_none(text: str):
    """``text`` parsed as JSON, or None when it is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def same_value(a, b) -> bool:
    """Whether a ledger value ``a`` equals the signed value ``b`` (a JSON column parsed first;
    floats compared as floats, NaN equal to NaN)."""
    if isinstance(b, (dict, list)) and isinstance(a, str):  # a JSON column against what was signed
        a = json_or_none(a)
    if isinstance(a, float) or isinstance(b, float):
        try:
            return float(a) == float(b) or (math.isnan(float(a)) and math.isnan(float(b)))
        except (TypeError, ValueError):
            return False
    return a == b


class Verifier:
    """One audit of a run's ``bundle`` against the CA certificates ``ca``: the parsed plans,
    certificates and order, what the signed records say the tables hold (``expected``), and the
    :class:`Report` it fills. :meth:`chain` runs checks 1 and 2 (``coordinator/audit.py``);
    ``coordinator/audit_tables.py`` runs 3 and 4 on what it gathered."""

    def __init__(self, bundle: dict[str, Any], ca: list | None):
        self.b = bundle
        self.ca = ca
        self.run = bundle["run"] or {}
        self.run_id = bundle["run_id"]
        self.report = Report(run_id=self.run_id, status=str(self.run.get("status", "")),
                             signed=not self.run.get("insecure", 1))
        self.certs: dict[str, Any] = {}
        self.bad_certs: dict[str, str] = {}
        for fp, pem in (bundle.get("certificates") or {}).items():
            try:
                cert = signing.load_certificate(pem)
            except SignatureError as exc:
                self.bad_certs[fp] = str(exc)
                continue
            if signing.fingerprint(cert) != fp:
                self.bad_certs[fp] = f"the certificate stored as {fp[:16]} has another fingerprint (edited)"
                continue
            self.certs[fp] = cert
        self.plans: list[Plan] = []
        for p in bundle.get("plans") or []:
            try:
                self.plans.append(Plan.from_json(json.loads(p["plan"])))
            except (ValueError, KeyError, TypeError) as exc:
                self.problem(-1, f"plan version {p.get('version')}", f"does not parse: {exc}")
        try:
            self.order = [c["name"] for c in json.loads(self.run.get("chain") or "[]")]
        except (ValueError, TypeError, KeyError):
            self.order = []
            self.problem(-1, f"run {self.run_id}", "its order (the chain column) does not parse")
        self.planned = {}
        for plan in self.plans:
            for t in plan.transfers:
                self.planned.setdefault((t.purpose, t.index, t.sender, t.receiver), t)
        self.final_sites = {plan.final_site for plan in self.plans if plan.visits}
        # what the signed records say the tables hold: (table, key) -> (order, where, signer, {column: value})
        self.expected: dict[tuple, tuple] = {}
        self.final_report: tuple | None = None
        self.evaluations: dict[str, peer_pb2.EvaluateReply] = {}
        self.terminal_seq: float = math.inf

    def problem(self, order: float, where: str, message: str) -> None:
        """Add a :class:`Problem` to the report."""
        self.report.problems.append(Problem(order, where, message))

    # -- 1. the chain --------------------------------------------------------------------------
    def chain(self) -> None:
        """Check 1 (each event follows its predecessor in the hash chain and matches its hash) and,
        on each event with a signed record, check 2 (:meth:`record`)."""
        events = sorted(self.b.get("events") or [], key=lambda e: e["seq"])
        self.events = events
        self.report.events = len(events)
        records = {}
        for r in self.b.get("records") or []:
            if r["seq"] in records:
                self.problem(r["seq"], f"records row of seq {r['seq']}", "appears twice")
            records[r["seq"]] = r
        prev, prev_seq = hashchain.genesis(self.run_id), None
        for e in events:
            where = describe_event(e)
            if e.get("run_id") != self.run_id:
                self.problem(e["seq"], where, f"belongs to run {e.get('run_id')!r}")
            if not e.get("hash"):
                self.problem(e["seq"], where, "has no chain hash (written by a fedrelay without the hash chain)")
            elif e.get("prev_hash") != prev:
                after = f"event seq {prev_seq}" if prev_seq is not None else "the start of the run's chain"
                self.problem(e["seq"], where, f"does not follow {after} in the hash chain: an event before it was "
                             "dropped, or events were moved or swapped")
            else:
                try:
                    ok = hashchain.event_hash(e["prev_hash"], e) == e["hash"]
                except (ValueError, KeyError, TypeError):
                    ok = False
                if not ok:
                    self.problem(e["seq"], where, "its content does not match its hash: the row was edited")
            prev, prev_seq = e.get("hash") or "", e["seq"]
            if e.get("kind") in TERMINAL:
                self.terminal_seq = min(self.terminal_seq, e["seq"])
            rec = records.pop(e["seq"], None)
            if e.get("record"):
                if rec is None:
                    self.problem(e["seq"], where, "the signed record bound to it is missing: its records row was dropped")
                else:
                    self.record(e, rec)
            elif rec is not None:
                self.problem(e["seq"], f"records row of seq {e['seq']}", f"is not bound to {where}: added afterwards")
        for seq, rec in sorted(records.items()):
            self.problem(seq, f"{rec.get('signer')}'s {rec.get('type')} (records row of seq {seq})",
                         "its event is missing from the run's chain: the event was dropped")
        self.report.head = prev

    # -- 2. the records ------------------------------------------------------------------------
    def record(self, e: dict, rec: dict) -> None:
        """Check 2 for the signed record ``rec`` bound to event ``e``, and note the row it says
        the ledger holds (:meth:`expect`)."""
        seq = e["seq"]
        try:
            raw, sig = unb64(rec["record"]), unb64(rec["signature"])
        except AuditError as exc:
            self.problem(seq, f"the record of {describe_event(e)}", str(exc))
            return
        signer = rec.get("signer", "")
        if signing.binding_digest(raw, sig, rec.get("certificate") or "") != e["record"]:
            self.problem(seq, f"{signer}'s {rec.get('type')} of {describe_event(e)}",
                         "it is not the record bound into the chain: its records row was edited or replaced")
            return
        try:
            full = signing.record_type(raw)
            if full not in MESSAGES:
                raise SignatureError(f"{full} is not a kind of record a site signs")
            msg = signing.parse(raw, MESSAGES[full])
        except SignatureError as exc:
            self.problem(seq, f"{signer}'s record of {describe_event(e)}", str(exc))
            return
        type_ = full.rsplit(".", 1)[-1]
        where = f"{describe_record(type_, msg, signer)} ({describe_event(e)})"
        if rec.get("type") != type_:
            self.problem(seq, where, f"its records row says {rec.get('type')!r}: edited")
        self.report.records[type_] = self.report.records.get(type_, 0) + 1
        if self.signature(seq, where, raw, sig, rec.get("certificate") or "", signer, e["time"]) is False:
            return
        self.report.signers.add(signer)
        # The signer speaks for itself, of this run, in a role the plan gave it.
        if type_ == "HopReport":
            role, named = "sender", msg.sender
        elif type_ == "ReceiptReport":
            role, named = "receiver", msg.receiver
        else:
            role, named = "site", msg.site
        if named != signer:
            self.problem(seq, where, f"signed by {signer}, but the record names {named!r} as its {role}")
            return
        if msg.run_id != self.run_id:
            self.problem(seq, where, f"it is a record of run {msg.run_id!r}")
            return
        if e.get("kind") not in EVENT_KINDS[type_]:
            self.problem(seq, where, f"a {type_} cannot be kept with a {e.get('kind')!r} event")
        if type_ in ("HopReport", "ReceiptReport"):
            purpose = purposes.ledger_of_wire(msg.purpose) or ""
            t = self.planned.get(((purposes.from_ledger(purpose) if purpose in purposes.LEDGER_WORDS else ""), msg.hop, msg.sender, msg.receiver))
            if t is None:
                self.problem(seq, where, f"{transfer_words(purpose, msg.hop, msg.sender, msg.receiver)} is not a "
                             "transfer of the run's recorded plan: signed by a site that was not planned for it")
                return
            key = (purpose, msg.hop, msg.receiver)
            if type_ == "HopReport":
                cols = {"sender": msg.sender, "payload_bytes": msg.payload_bytes, "wire_bytes": msg.wire_bytes,
                        "sha256": msg.sha256, "started": msg.started, "ended": msg.ended,
                        "attempts": max(1, msg.attempts), "resumed_from": msg.resumed_from, "round": t.round,
                        "schema_sha256": msg.schema_sha256, "route": msg.route or "direct",
                        "sealed_bytes": msg.sealed_bytes, "sealed_sha256": msg.sealed_sha256, "relay": msg.relay}
                self.expect(("hops", key), seq, f"the hops row of {transfer_words(*key[:2], msg.sender, key[2])}",
                            signer, cols)
            else:
                cols = {"sender": msg.sender, "payload_bytes": msg.payload_bytes, "sha256": msg.sha256,
                        "schema_sha256": msg.schema_sha256, "received": msg.received, "route": msg.route or "direct",
                        "relay_wire_bytes": msg.relay_wire_bytes}
                self.expect(("receipts", key), seq,
                            f"the receipts row of {transfer_words(*key[:2], msg.sender, key[2])}", signer, cols)
        elif type_ == "FinalReport":
            if msg.site not in self.final_sites:
                self.problem(seq, where, f"{msg.site} is not the final site of any version of the run's plan: signed "
                             "by a site that was not planned for it")
                return
            if self.final_report is not None:
                self.problem(seq, where, "a second final report")
            self.final_report = (seq, where, msg)
        elif type_ == "EvaluateReply":
            if msg.site not in self.order:
                self.problem(seq, where, f"{msg.site} is not a site of the run: not planned for it")
                return
            self.evaluations[msg.site] = msg
            self.expect(("evaluations", msg.site), seq, f"the evaluations row of {msg.site}", signer,
                        {"sha256": msg.sha256, "correct": msg.correct, "test_samples": msg.test_samples,
                         "accuracy": msg.accuracy, "seconds": msg.seconds, "metrics": dict(msg.metrics),
                         "stats": json_or_none(msg.stats_json or "{}")}, replace=True)
        elif type_ == "FailureReport":
            if msg.site not in self.order:
                self.problem(seq, where, f"{msg.site} is not a site of the run: not planned for it")
                return
            if e.get("kind") == "failed" and self.run.get("status") == "failed" and \
                    self.run.get("error") != f"{msg.site}: {msg.error}":
                self.problem(seq, f"run {self.run_id}'s error", f"the ledger says {self.run.get('error')!r}; "
                             f"{signer} signed {msg.error!r}")

    def signature(self, seq: float, where: str, raw: bytes, sig: bytes, fp: str, signer: str, at: float) -> bool | None:
        """Check a record's certificate and signature; False (and a problem) when they fail, None
        when it is unsigned (allowed on a plaintext run only)."""
        if not sig:
            if self.report.signed:
                self.problem(seq, where, "it is not signed, on a run that ran under mutual TLS")
                return False
            return None
        if self.ca is None:
            raise AuditError("this run's records are signed: pass --ca with the federation's CA certificate (ca.pem)")
        if fp in self.bad_certs:
            self.problem(seq, where, self.bad_certs[fp])
            return False
        cert = self.certs.get(fp)
        if cert is None:
            self.problem(seq, where, f"the certificate that signed it ({fp[:16]}) is missing from the ledger")
            return False
        try:
            signing.check_certificate(cert, self.ca, signer, at=at)
            signing.verify(raw, sig, cert)
        except SignatureError as exc:
            self.problem(seq, where, str(exc))
            return False
        return True

    def expect(self, key: tuple, seq: float, where: str, signer: str, cols: dict, replace: bool = False) -> None:
        """Note that ``signer`` signed row ``key`` (``(table, key)``) to hold ``cols``; a second
        record of the same row is a problem unless ``replace`` (a site's later evaluation)."""
        if key in self.expected and not replace:
            self.problem(seq, where, "a second signed record of the same row")
            return
        self.expected[key] = (seq, where, signer, cols)
