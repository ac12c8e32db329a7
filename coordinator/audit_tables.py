"""Auditing a run's rows and its seal (checks 3 and 4 of ``coordinator/audit.py``): the
``hops``, ``receipts``, ``evaluations`` and ``runs`` rows against the signed records that
:class:`~fedrelay.coordinator.audit_chain.Verifier` gathered, and the coordinator's signed
``RunSeal`` against the chain, the run's row and its plan versions.
"""

from __future__ import annotations

import json
import math

from fedrelay import signing
from fedrelay.coordinator import hashchain
from fedrelay.coordinator.audit_bundle import AuditError, unb64
from fedrelay.coordinator.audit_chain import TERMINAL, Verifier, same_value, transfer_words
from fedrelay.signing import SignatureError
from fedrelay.v1 import coordinator_pb2 as cpb


def check_tables(v: Verifier) -> None:
    """Check 3: every ``hops``, ``receipts`` and ``evaluations`` row against the signed record
    :meth:`Verifier.chain` found for it, and the run's final model and accuracy against the
    signed final report and evaluations."""
    rows: dict[tuple, dict] = {}
    for r in v.b.get("hops") or []:
        rows[("hops", (r.get("purpose"), r.get("hop"), r.get("receiver")))] = r
    for r in v.b.get("receipts") or []:
        rows[("receipts", (r.get("purpose"), r.get("hop"), r.get("receiver")))] = r
    for r in v.b.get("evaluations") or []:
        rows[("evaluations", r.get("site"))] = r
    for key, (seq, where, signer, cols) in v.expected.items():
        row = rows.pop(key, None)
        if row is None:
            v.problem(seq, where, f"is missing: the row {signer} signed for was dropped (or its key edited)")
            continue
        for col, want in cols.items():
            if not same_value(row.get(col), want):
                v.problem(seq, where, f"the ledger says {col} {row.get(col)!r}; {signer} signed {want!r}: "
                          "the row was edited")
                break
    for (table, key), row in rows.items():
        what = (f"the {table} row of {transfer_words(key[0], key[1], row.get('sender', '?'), key[2])}"
                if table != "evaluations" else f"the evaluations row of {key}")
        v.problem(math.inf, what, "no signed record in the run's chain says so: the row was added, or its "
                  "record and event dropped")
    # The run's final model and accuracy come from signed records.
    final_sha, final_site = v.run.get("final_sha256"), v.run.get("final_site")
    if v.final_report is not None:
        seq, where, msg = v.final_report
        if (final_sha, final_site) != (msg.sha256, msg.site):
            v.problem(seq, f"run {v.run_id}'s final model",
                      f"the ledger says {final_site or '-'} made {str(final_sha or '-')[:16]}; {msg.site} signed "
                      f"{msg.sha256[:16]}: the run's row was edited")
    elif final_sha:
        v.problem(v.terminal_seq, f"run {v.run_id}'s final model",
                  "no signed final report says so: it was dropped, or the run's row edited")
    if v.run.get("status") == "finished":
        evals = list(v.evaluations.values())
        total = sum(m.test_samples for m in evals)
        accuracy = sum(m.correct for m in evals) / total if total else 0.0
        if not same_value(v.run.get("accuracy"), accuracy):
            v.problem(v.terminal_seq, f"run {v.run_id}'s accuracy",
                      f"the ledger says {v.run.get('accuracy')!r}; the signed evaluations give {accuracy!r}")
        if final_sha and any(m.sha256 != final_sha for m in evals):
            v.problem(v.terminal_seq, f"run {v.run_id}'s evaluations",
                      "a site evaluated another model than the run's final one")


def check_seal(v: Verifier) -> None:
    """Check 4: the coordinator's seal of an ended run: signed by ``coordinator``, its chain
    head and length match the events, and the run's row and plan versions are the ones sealed."""
    s = v.b.get("seal")
    status = v.run.get("status")
    if s is None:
        if status in TERMINAL:
            v.problem(v.terminal_seq, f"run {v.run_id}'s seal",
                      f"the run is {status} but has no seal: it was dropped")
        return
    where = f"the coordinator's seal of run {v.run_id}"
    try:
        raw, sig = unb64(s["record"]), unb64(s["signature"])
        seal = signing.parse(raw, cpb.RunSeal)
    except (AuditError, SignatureError) as exc:
        v.problem(v.terminal_seq, where, str(exc))
        return
    if v.signature(s.get("seq", v.terminal_seq), where, raw, sig, s.get("certificate") or "", "coordinator",
                   seal.sealed) is False:
        return
    v.report.sealed = True
    order = seal.last_seq
    if seal.run_id != v.run_id:
        v.problem(order, where, f"it seals run {seal.run_id!r}")
        return
    covered = [e for e in v.events if e["seq"] <= seal.last_seq]
    v.report.after_seal = len(v.events) - len(covered)
    last = covered[-1] if covered else None
    if len(covered) != seal.events or (last is not None and last["seq"] != seal.last_seq) or \
            (last.get("hash") if last else hashchain.genesis(v.run_id)) != seal.head:
        have = f"{len(covered)} events up to seq {last['seq'] if last else '-'}"
        v.problem(order, where, f"it seals {seal.events} events ending at seq {seal.last_seq} with head "
                  f"{seal.head[:16]}; the ledger has {have}: events were dropped, added or rewritten")
    try:
        sealed = json.loads(seal.run_json)
        have = json.loads(hashchain.sealed_run(v.run))
    except ValueError as exc:
        v.problem(-1, where, f"its run row does not parse: {exc}")
        return
    for k in hashchain.SEALED_RUN_FIELDS:
        if k in hashchain.SEALED_SINCE_POLICY and k not in sealed:
            continue  # sealed by a coordinator from before the column
        if not same_value(have.get(k), sealed.get(k)):
            words = {"chain": "order", "params": "training parameters"}.get(k, k)
            v.problem(-1, f"run {v.run_id}'s row",
                      f"its {words} is {_show(k, have.get(k))} in the ledger; the coordinator sealed "
                      f"{_show(k, sealed.get(k))}: the row was edited")
            break
    plans = [hashchain.plan_digest(p["plan"]) for p in v.b.get("plans") or []]
    if plans != list(seal.plans):
        bad = next((i for i, (a, b) in enumerate(zip(plans, seal.plans)) if a != b), min(len(plans), len(seal.plans)))
        v.problem(-1, f"plan version {bad} of run {v.run_id}",
                  f"the ledger has {len(plans)} plan version(s), the coordinator sealed {len(seal.plans)}; "
                  f"version {bad} differs: a plan was edited, dropped or added")


def _show(key: str, value) -> str:
    """A sealed run column's value in words (the chain as its order), at most 80 characters."""
    if key == "chain":
        try:
            return " → ".join(c["name"] for c in json.loads(value))
        except (ValueError, TypeError, KeyError):
            pass
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."

