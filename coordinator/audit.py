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
"""

from __future__ import annotations

import base64
import json
import math
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from fedrelay import purpose as purposes
from fedrelay import signing
from fedrelay.coordinator import hashchain
from fedrelay.coordinator.plan import Plan
from fedrelay.signing import SignatureError
from fedrelay.v1 import common_pb2, coordinator_pb2 as cpb, peer_pb2

FORMAT = "fedrelay-audit-bundle"
FORMAT_VERSION = 1
ROW_TABLES = ("hops", "receipts", "evaluations")
MESSAGES = {m.DESCRIPTOR.full_name: m for m in (cpb.HopReport, cpb.ReceiptReport, cpb.FinalReport, cpb.FailureReport,
                                                peer_pb2.EvaluateReply)}
# The event kinds a record of each type is kept with.
EVENT_KINDS = {"HopReport": ("hop", "upload", "final_copy"), "ReceiptReport": ("receipt",), "FinalReport": ("final",),
               "FailureReport": ("failed",), "EvaluateReply": ("evaluated",)}
TERMINAL = ("finished", "failed", "cancelled")


class AuditError(ValueError):
    """The ledger or bundle cannot be read, or the run is unknown (not a verdict on its records)."""


# -- bundles --------------------------------------------------------------------------------------
def _b64(data: bytes) -> str:
    return base64.b64encode(bytes(data)).decode("ascii")


def _unb64(text: str) -> bytes:
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, AttributeError) as exc:
        raise AuditError(f"not base64: {exc}") from None


def bundle_from_ledger(db: str | Path, run_id: str) -> dict[str, Any]:
    """The audit bundle of ``run_id`` read from the SQLite ledger ``db`` (opened read-only: the
    file is never changed). Raises ``AuditError`` when the file is not a ledger or the run is
    unknown."""
    path = Path(db)
    if not path.is_file():
        raise AuditError(f"no ledger at {path} (pass --db, the file `coordinator serve --db` writes)")
    try:
        con = sqlite3.connect(f"file:{quote(str(path.resolve()))}?mode=ro", uri=True)
        con.row_factory = sqlite3.Row
        try:
            return _read_bundle(con, run_id)
        finally:
            con.close()
    except sqlite3.Error as exc:
        raise AuditError(f"cannot read the ledger {path}: {exc}") from None


def _read_bundle(con: sqlite3.Connection, run_id: str) -> dict[str, Any]:
    tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if "runs" not in tables:
        raise AuditError("not a fedrelay ledger (it has no runs table)")

    def rows(sql: str, args: tuple = ()) -> list[dict[str, Any]]:
        return [dict(r) for r in con.execute(sql, args)]

    run = rows("SELECT * FROM runs WHERE run_id = ?", (run_id,))
    if not run:
        known = [r["run_id"] for r in rows("SELECT run_id FROM runs ORDER BY created DESC LIMIT 5")]
        raise AuditError(f"unknown run {run_id!r} in this ledger" + (f" (latest: {', '.join(known)})" if known else ""))
    event_columns = {r["name"] for r in con.execute("PRAGMA table_info(events)")}
    chain_cols = ", prev_hash, hash, record" if "hash" in event_columns else ", '' AS prev_hash, '' AS hash, '' AS record"
    events = rows(f"SELECT seq, run_id, time, kind, site, message, data{chain_cols} FROM events "
                  "WHERE run_id = ? ORDER BY seq", (run_id,))
    records = rows("SELECT * FROM records WHERE run_id = ? ORDER BY seq", (run_id,)) if "records" in tables else []
    seal = rows("SELECT * FROM seals WHERE run_id = ?", (run_id,)) if "seals" in tables else []
    wanted = {r["certificate"] for r in records + seal if r["certificate"]}
    certificates = {}
    if "certificates" in tables and wanted:
        for r in rows(f"SELECT sha256, pem FROM certificates WHERE sha256 IN ({','.join('?' * len(wanted))})",
                      tuple(sorted(wanted))):
            certificates[r["sha256"]] = r["pem"]
    return {
        "format": FORMAT, "version": FORMAT_VERSION, "run_id": run_id, "exported": time.time(),
        "run": run[0],
        "plans": rows("SELECT version, plan, time FROM plans WHERE run_id = ? ORDER BY version", (run_id,)),
        "events": events,
        "records": [{"seq": r["seq"], "type": r["type"], "signer": r["signer"], "record": _b64(r["record"]),
                     "signature": _b64(r["signature"]), "certificate": r["certificate"]} for r in records],
        "certificates": certificates,
        "seal": ({"seq": seal[0]["seq"], "signer": seal[0]["signer"], "record": _b64(seal[0]["record"]),
                  "signature": _b64(seal[0]["signature"]), "certificate": seal[0]["certificate"]} if seal else None),
        **{t: rows(f"SELECT * FROM {t} WHERE run_id = ?", (run_id,)) for t in ROW_TABLES},
    }


def write_bundle(bundle: dict[str, Any], path: str | Path) -> None:
    """Write ``bundle`` as one JSON file at ``path`` (atomically). Raises ``OSError``."""
    from fedrelay.files import atomic_write

    atomic_write(path, (json.dumps(bundle, indent=1, sort_keys=True) + "\n").encode())


def load_bundle(path: str | Path) -> dict[str, Any]:
    """An audit bundle from a JSON file. Raises ``AuditError`` when it cannot be read or is not
    a fedrelay audit bundle."""
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as exc:
        raise AuditError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise AuditError(f"{path} is not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise AuditError(f"{path} is not a fedrelay audit bundle (`coordinator audit RUN --export FILE` writes one)")
    if doc.get("version") != FORMAT_VERSION:
        raise AuditError(f"{path} is an audit bundle of version {doc.get('version')!r}; this fedrelay reads "
                         f"version {FORMAT_VERSION}")
    missing = [k for k in ("run_id", "run", "plans", "events", "records", "certificates", "seal", *ROW_TABLES)
               if k not in doc]
    if missing:
        raise AuditError(f"{path}: the bundle lacks {', '.join(missing)}")
    return doc


def load_ca_file(path: str | Path) -> list:
    """The CA certificate(s) of ``--ca``: a PEM file, or a folder holding ``ca.pem`` (a ``--tls``
    folder) or ``ca/ca.pem`` (the PKI folder of ``init-ca``). Raises ``AuditError``."""
    p = Path(path)
    if p.is_dir():
        for candidate in (p / "ca.pem", p / "ca" / "ca.pem"):
            if candidate.is_file():
                p = candidate
                break
        else:
            raise AuditError(f"--ca {path}: no ca.pem in that folder (pass the CA certificate, ca.pem)")
    try:
        return signing.load_ca(p.read_bytes())
    except OSError as exc:
        raise AuditError(f"--ca {path}: {exc.strerror or exc}") from None
    except SignatureError as exc:
        raise AuditError(f"--ca {path}: {exc}") from None


# -- the verdict ----------------------------------------------------------------------------------
@dataclass
class Problem:
    """One thing that does not verify: ``where`` (the record, row or event, in words),
    ``message`` (what is wrong), ``order`` (its place in the ledger: problems are reported in
    chain order, the run's row first)."""

    order: float
    where: str
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


@dataclass
class Report:
    """The outcome of :func:`verify`: ``problems`` (in ledger order), what was checked
    (``events``, ``records`` by type, ``signers``, ``sealed``, ``after_seal``) and whether the
    run's records are signed (``signed``; False: a plaintext run)."""

    run_id: str
    status: str = ""
    signed: bool = True
    problems: list[Problem] = field(default_factory=list)
    events: int = 0
    records: dict[str, int] = field(default_factory=dict)
    signers: set[str] = field(default_factory=set)
    sealed: bool = False
    after_seal: int = 0
    head: str = ""

    @property
    def first(self) -> Problem | None:
        return min(self.problems, key=lambda p: p.order) if self.problems else None

    @property
    def verified(self) -> bool:
        """Every check passed and every record is signed."""
        return not self.problems and self.signed

    @property
    def verdict(self) -> str:
        return "failed" if self.problems else ("verified" if self.signed else "unsigned")

    def ordered(self) -> list[Problem]:
        return sorted(self.problems, key=lambda p: p.order)

    def to_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "verdict": self.verdict, "verified": self.verified, "signed": self.signed,
                "status": self.status, "events": self.events, "records": dict(self.records),
                "signers": sorted(self.signers), "sealed": self.sealed, "events_after_seal": self.after_seal,
                "head": self.head,
                "first_problem": str(self.first) if self.first else None,
                "problems": [{"where": p.where, "message": p.message} for p in self.ordered()]}

    def summary(self) -> str:
        """What was checked, in one sentence."""
        words = {"HopReport": "transfer report", "ReceiptReport": "receipt", "FinalReport": "final report",
                 "FailureReport": "failure report", "EvaluateReply": "evaluation"}
        kinds = ", ".join(f"{self.records[t]} {words[t]}{'s' if self.records[t] != 1 else ''}"
                          for t in words if t in self.records) or "no records"
        seal = ("sealed by the coordinator" + (f", {self.after_seal} event(s) after the seal" if self.after_seal else "")
                if self.sealed else "not sealed (the run has not ended)")
        who = f" signed by {', '.join(sorted(self.signers))}" if self.signed and self.signers else ""
        return (f"{self.events} events in one hash chain (head {self.head[:16]}), {seal}; {kinds}{who}; every "
                "hops, receipts and evaluations row and the run's row match them")


# -- verification ---------------------------------------------------------------------------------
def _describe_event(e: dict) -> str:
    message = str(e.get("message", ""))
    return f"event seq {e.get('seq')} ({e.get('kind')}: {message[:70]}{'...' if len(message) > 70 else ''})"


def _transfer_words(purpose: str, hop: int, sender: str, receiver: str) -> str:
    what = {"chain": f"chain hop {hop}", "upload": f"upload {hop}", "final": "final copy"}.get(purpose, f"{purpose} {hop}")
    return f"{what} ({sender} → {receiver})"


def _describe_record(type_: str, msg, signer: str) -> str:
    if type_ in ("HopReport", "ReceiptReport"):
        purpose = purposes.ledger_of_wire(msg.purpose) or str(msg.purpose)
        what = "report" if type_ == "HopReport" else "receipt"
        return f"{signer}'s {what} of {_transfer_words(purpose, msg.hop, msg.sender, msg.receiver)}"
    return {"FinalReport": f"{signer}'s final report", "FailureReport": f"{signer}'s failure report",
            "EvaluateReply": f"{signer}'s evaluation"}.get(type_, f"{signer}'s {type_}")


def _json_or_none(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _same(a, b) -> bool:
    if isinstance(b, (dict, list)) and isinstance(a, str):  # a JSON column against what was signed
        a = _json_or_none(a)
    if isinstance(a, float) or isinstance(b, float):
        try:
            return float(a) == float(b) or (math.isnan(float(a)) and math.isnan(float(b)))
        except (TypeError, ValueError):
            return False
    return a == b


class _Verifier:
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
        self.report.problems.append(Problem(order, where, message))

    # -- 1. the chain --------------------------------------------------------------------------
    def chain(self) -> None:
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
            where = _describe_event(e)
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
        seq = e["seq"]
        try:
            raw, sig = _unb64(rec["record"]), _unb64(rec["signature"])
        except AuditError as exc:
            self.problem(seq, f"the record of {_describe_event(e)}", str(exc))
            return
        signer = rec.get("signer", "")
        if signing.binding_digest(raw, sig, rec.get("certificate") or "") != e["record"]:
            self.problem(seq, f"{signer}'s {rec.get('type')} of {_describe_event(e)}",
                         "it is not the record bound into the chain: its records row was edited or replaced")
            return
        try:
            full = signing.record_type(raw)
            if full not in MESSAGES:
                raise SignatureError(f"{full} is not a kind of record a site signs")
            msg = signing.parse(raw, MESSAGES[full])
        except SignatureError as exc:
            self.problem(seq, f"{signer}'s record of {_describe_event(e)}", str(exc))
            return
        type_ = full.rsplit(".", 1)[-1]
        where = f"{_describe_record(type_, msg, signer)} ({_describe_event(e)})"
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
                self.problem(seq, where, f"{_transfer_words(purpose, msg.hop, msg.sender, msg.receiver)} is not a "
                             "transfer of the run's recorded plan: signed by a site that was not planned for it")
                return
            key = (purpose, msg.hop, msg.receiver)
            if type_ == "HopReport":
                cols = {"sender": msg.sender, "payload_bytes": msg.payload_bytes, "wire_bytes": msg.wire_bytes,
                        "sha256": msg.sha256, "started": msg.started, "ended": msg.ended,
                        "attempts": max(1, msg.attempts), "resumed_from": msg.resumed_from, "round": t.round,
                        "schema_sha256": msg.schema_sha256, "route": msg.route or "direct",
                        "sealed_bytes": msg.sealed_bytes, "sealed_sha256": msg.sealed_sha256, "relay": msg.relay}
                self.expect(("hops", key), seq, f"the hops row of {_transfer_words(*key[:2], msg.sender, key[2])}",
                            signer, cols)
            else:
                cols = {"sender": msg.sender, "payload_bytes": msg.payload_bytes, "sha256": msg.sha256,
                        "schema_sha256": msg.schema_sha256, "received": msg.received, "route": msg.route or "direct",
                        "relay_wire_bytes": msg.relay_wire_bytes}
                self.expect(("receipts", key), seq,
                            f"the receipts row of {_transfer_words(*key[:2], msg.sender, key[2])}", signer, cols)
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
                         "stats": _json_or_none(msg.stats_json or "{}")}, replace=True)
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
        if key in self.expected and not replace:
            self.problem(seq, where, "a second signed record of the same row")
            return
        self.expected[key] = (seq, where, signer, cols)

    # -- 3. the tables -------------------------------------------------------------------------
    def tables(self) -> None:
        rows: dict[tuple, dict] = {}
        for r in self.b.get("hops") or []:
            rows[("hops", (r.get("purpose"), r.get("hop"), r.get("receiver")))] = r
        for r in self.b.get("receipts") or []:
            rows[("receipts", (r.get("purpose"), r.get("hop"), r.get("receiver")))] = r
        for r in self.b.get("evaluations") or []:
            rows[("evaluations", r.get("site"))] = r
        for key, (seq, where, signer, cols) in self.expected.items():
            row = rows.pop(key, None)
            if row is None:
                self.problem(seq, where, f"is missing: the row {signer} signed for was dropped (or its key edited)")
                continue
            for col, want in cols.items():
                if not _same(row.get(col), want):
                    self.problem(seq, where, f"the ledger says {col} {row.get(col)!r}; {signer} signed {want!r}: "
                                 "the row was edited")
                    break
        for (table, key), row in rows.items():
            what = (f"the {table} row of {_transfer_words(key[0], key[1], row.get('sender', '?'), key[2])}"
                    if table != "evaluations" else f"the evaluations row of {key}")
            self.problem(math.inf, what, "no signed record in the run's chain says so: the row was added, or its "
                         "record and event dropped")
        # The run's final model and accuracy come from signed records.
        final_sha, final_site = self.run.get("final_sha256"), self.run.get("final_site")
        if self.final_report is not None:
            seq, where, msg = self.final_report
            if (final_sha, final_site) != (msg.sha256, msg.site):
                self.problem(seq, f"run {self.run_id}'s final model",
                             f"the ledger says {final_site or '-'} made {str(final_sha or '-')[:16]}; {msg.site} signed "
                             f"{msg.sha256[:16]}: the run's row was edited")
        elif final_sha:
            self.problem(self.terminal_seq, f"run {self.run_id}'s final model",
                         "no signed final report says so: it was dropped, or the run's row edited")
        if self.run.get("status") == "finished":
            evals = list(self.evaluations.values())
            total = sum(m.test_samples for m in evals)
            accuracy = sum(m.correct for m in evals) / total if total else 0.0
            if not _same(self.run.get("accuracy"), accuracy):
                self.problem(self.terminal_seq, f"run {self.run_id}'s accuracy",
                             f"the ledger says {self.run.get('accuracy')!r}; the signed evaluations give {accuracy!r}")
            if final_sha and any(m.sha256 != final_sha for m in evals):
                self.problem(self.terminal_seq, f"run {self.run_id}'s evaluations",
                             "a site evaluated another model than the run's final one")

    # -- 4. the seal ---------------------------------------------------------------------------
    def seal(self) -> None:
        s = self.b.get("seal")
        status = self.run.get("status")
        if s is None:
            if status in TERMINAL:
                self.problem(self.terminal_seq, f"run {self.run_id}'s seal",
                             f"the run is {status} but has no seal: it was dropped")
            return
        where = f"the coordinator's seal of run {self.run_id}"
        try:
            raw, sig = _unb64(s["record"]), _unb64(s["signature"])
            seal = signing.parse(raw, cpb.RunSeal)
        except (AuditError, SignatureError) as exc:
            self.problem(self.terminal_seq, where, str(exc))
            return
        if self.signature(s.get("seq", self.terminal_seq), where, raw, sig, s.get("certificate") or "", "coordinator",
                          seal.sealed) is False:
            return
        self.report.sealed = True
        order = seal.last_seq
        if seal.run_id != self.run_id:
            self.problem(order, where, f"it seals run {seal.run_id!r}")
            return
        covered = [e for e in self.events if e["seq"] <= seal.last_seq]
        self.report.after_seal = len(self.events) - len(covered)
        last = covered[-1] if covered else None
        if len(covered) != seal.events or (last is not None and last["seq"] != seal.last_seq) or \
                (last.get("hash") if last else hashchain.genesis(self.run_id)) != seal.head:
            have = f"{len(covered)} events up to seq {last['seq'] if last else '-'}"
            self.problem(order, where, f"it seals {seal.events} events ending at seq {seal.last_seq} with head "
                         f"{seal.head[:16]}; the ledger has {have}: events were dropped, added or rewritten")
        try:
            sealed = json.loads(seal.run_json)
            have = json.loads(hashchain.sealed_run(self.run))
        except ValueError as exc:
            self.problem(-1, where, f"its run row does not parse: {exc}")
            return
        for k in hashchain.SEALED_RUN_FIELDS:
            if k in hashchain.SEALED_SINCE_POLICY and k not in sealed:
                continue  # sealed by a coordinator from before the column
            if not _same(have.get(k), sealed.get(k)):
                words = {"chain": "order", "params": "training parameters"}.get(k, k)
                self.problem(-1, f"run {self.run_id}'s row",
                             f"its {words} is {_show(k, have.get(k))} in the ledger; the coordinator sealed "
                             f"{_show(k, sealed.get(k))}: the row was edited")
                break
        plans = [hashchain.plan_digest(p["plan"]) for p in self.b.get("plans") or []]
        if plans != list(seal.plans):
            bad = next((i for i, (a, b) in enumerate(zip(plans, seal.plans)) if a != b), min(len(plans), len(seal.plans)))
            self.problem(-1, f"plan version {bad} of run {self.run_id}",
                         f"the ledger has {len(plans)} plan version(s), the coordinator sealed {len(seal.plans)}; "
                         f"version {bad} differs: a plan was edited, dropped or added")


def _show(key: str, value) -> str:
    if key == "chain":
        try:
            return " → ".join(c["name"] for c in json.loads(value))
        except (ValueError, TypeError, KeyError):
            pass
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def verify(bundle: dict[str, Any], ca: list | None) -> Report:
    """Check a run's audit bundle (:func:`bundle_from_ledger` or :func:`load_bundle`) against
    the CA certificates ``ca`` (``fedrelay.signing.load_ca``; None only for a plaintext run).
    Returns the :class:`Report` (its ``first`` problem is the first thing in the ledger that does
    not verify). Raises ``AuditError`` when the run's records are signed and ``ca`` is None, or
    the bundle is malformed (a field of the wrong type or missing)."""
    try:
        v = _Verifier(bundle, ca)
        if not bundle.get("run"):
            v.problem(-1, f"run {bundle.get('run_id')}", "the bundle holds no run row")
            return v.report
        v.chain()
        v.tables()
        v.seal()
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        if isinstance(exc, AuditError):
            raise
        raise AuditError(f"the audit bundle is malformed ({type(exc).__name__}: {exc}); export it again with "
                         "`coordinator audit RUN --export FILE`") from None
    return v.report
