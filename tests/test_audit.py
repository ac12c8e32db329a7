"""A ledger anyone can audit: signed records, the hash chain, `coordinator audit` and its bundle.

Unit tests of the canonical encoding, signatures and the chain; the coordinator refusing
unsigned or badly signed reports and evaluations; then one small real run (a coordinator and
three peer daemons in this process, mutual TLS with a PKI made like `init-ca` / `enroll` do),
whose ledger is copied and tampered with one edit at a time: every edit (bytes, digest, accuracy,
order), dropped row and swap is named by the audit; the untouched ledger and its exported bundle
verify with nothing but the CA certificate."""

from __future__ import annotations

import json
import shutil
import sqlite3
import time

import grpc
import pytest
from typer.testing import CliRunner

from fedrelay import params as run_params, signing
from fedrelay.transport import Transport
from fedrelay.cli.coordinator import app as coordinator_app
from fedrelay.coordinator import audit, hashchain, pki
from fedrelay.coordinator.ledger import Ledger
from fedrelay.coordinator.plan import chain_plan
from fedrelay.coordinator.signatures import Signatures
from fedrelay.v1 import common_pb2, coordinator_pb2 as cpb, peer_pb2
from test_security import ORDER, coordinator, cstub, ids  # noqa: F401 - pytest fixtures
from conftest import chain_to_the_end, serve_in_threads, self_signed, stop_threads

pytestmark = pytest.mark.integration

PARAMS = dict(strategy="fedelmy", models_per_site=1, local_epochs=1, warmup_epochs=1, alpha=1.0, beta=1.0, lr=1e-3,
              batch_size=32, weight_decay=0.0, selection="best-val")


def hop_report(**kw) -> cpb.HopReport:
    fields = dict(run_id="r", hop=1, purpose=common_pb2.CHAIN_HOP, sender="site-a", receiver="site-b",
                  payload_bytes=1234, wire_bytes=1300, sha256="ab" * 32, started=1.5, ended=2.25, schema_sha256="5" * 64)
    fields.update(kw)
    return cpb.HopReport(**fields)


# -- canonical encoding and signatures ----------------------------------------------------------------
def test_canonical_encoding_is_deterministic_typed_and_leaves_the_signature_out(ids):  # noqa: F811
    report = hop_report()
    record = signing.canonical(report)
    assert record.startswith(signing.PREFIX + b"fedrelay.v1.HopReport\n")
    assert signing.canonical(hop_report()) == record  # the same fields, the same bytes
    signed = signing.signer_for(ids["site-a"]).sign(report)
    assert signed.signature and not report.signature  # the message given is not changed
    assert signing.canonical(signed) == record  # the signature is not part of what is signed
    assert signing.parse(record, cpb.HopReport) == report
    assert signing.canonical(hop_report(payload_bytes=1235)) != record
    # Domain separation: the same field bytes as another message type are another record.
    as_receipt = cpb.ReceiptReport()
    as_receipt.ParseFromString(report.SerializeToString())
    assert signing.canonical(as_receipt) != record
    with pytest.raises(signing.SignatureError, match="is a fedrelay.v1.HopReport"):
        signing.parse(record, cpb.ReceiptReport)
    with pytest.raises(signing.SignatureError, match="prefix"):
        signing.record_type(b"not a record")


def test_a_signature_verifies_only_for_its_record_and_its_signer(ids):  # noqa: F811
    a = signing.signer_for(ids["site-a"])
    signed = a.sign(hop_report())
    rec = signing.received(signed, "site-a", ids["site-a"].cert)
    assert rec.signer == "site-a" and rec.type == "HopReport" and rec.signature == signed.signature
    assert rec.certificate_sha256 == signing.fingerprint(signing.load_certificate(ids["site-a"].cert))
    tampered = cpb.HopReport()
    tampered.CopyFrom(signed)
    tampered.payload_bytes += 1
    with pytest.raises(signing.SignatureError, match="does not verify"):
        signing.received(tampered, "site-a", ids["site-a"].cert)
    with pytest.raises(signing.SignatureError, match="does not verify"):  # another site's key
        signing.received(signed, "site-b", ids["site-b"].cert)
    with pytest.raises(signing.SignatureError, match="not signed"):
        signing.received(hop_report(), "site-a", ids["site-a"].cert)
    ca = signing.load_ca(ids["site-a"].ca)
    cert = signing.load_certificate(ids["site-a"].cert)
    signing.check_certificate(cert, ca, "site-a", at=time.time())
    with pytest.raises(signing.SignatureError, match="names 'site-a', not 'site-b'"):
        signing.check_certificate(cert, ca, "site-b")
    rogue = signing.load_certificate(ids["rogue-site-a"].cert)
    with pytest.raises(signing.SignatureError, match="not signed by the CA"):
        signing.check_certificate(rogue, ca, "site-a")
    with pytest.raises(signing.SignatureError, match="not valid at"):
        signing.check_certificate(cert, ca, "site-a", at=time.time() - 86400 * 365 * 20)
    # The binding digest changes with the record, the signature and the certificate.
    b = rec.binding()
    assert b != signing.binding_digest(rec.record, rec.signature, "0" * 64)
    assert b != signing.binding_digest(rec.record + b"x", rec.signature, rec.certificate_sha256)


def test_the_signing_stub_signs_reports_only():
    calls = []

    class Stub:
        def __getattr__(self, name):
            return lambda request, **kw: calls.append((name, request))

    # A throwaway identity: any EC key and a self-made certificate will do.
    from cryptography.hazmat.primitives import serialization

    key, cert = self_signed("site-x")
    signer = signing.Signer(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                              serialization.NoEncryption()),
                            cert.public_bytes(serialization.Encoding.PEM))
    assert signer.name == "site-x"
    stub = signing.SigningStub(Stub(), signer)
    stub.ReportHop(hop_report(sender="site-x"), timeout=1)
    stub.ReportProgress(cpb.ProgressReport(run_id="r", site="site-x"), timeout=1)
    assert calls[0][1].signature
    signing.verify(signing.canonical(calls[0][1]), calls[0][1].signature, signer.certificate)
    assert calls[1][0] == "ReportProgress" and not hasattr(calls[1][1], "signature")
    plain = signing.SigningStub(Stub(), None)  # plaintext: nothing is signed
    plain.ReportHop(hop_report(), timeout=1)
    assert not calls[2][1].signature


# -- the hash chain ---------------------------------------------------------------------------------
def test_events_form_a_hash_chain_and_an_ended_run_is_sealed(tmp_path):
    ledger = Ledger(tmp_path / "l.sqlite")
    for run_id in ("r1", "r2"):
        ledger.create_run(run_id, strategy="fedelmy", arch="cnn", seed=1, params={}, class_index=["x"], model={},
                          chain=[{"name": n, "address": "127.0.0.1:9"} for n in ("a", "b")], warnings=[],
                          insecure=True, plan=chain_plan(["a", "b"]).to_json())
    ledger.add_event("r1", "started", "one")
    ledger.add_event("r2", "started", "two")  # another run's chain: r1's is not affected
    report = hop_report(run_id="r1", sender="a", receiver="b")
    with ledger.batch():
        ledger.record_hop("r1", "chain", 1, "a", "b", report.payload_bytes, report.wire_bytes, report.sha256,
                          report.started, report.ended, schema_sha256=report.schema_sha256)
        ledger.add_event("r1", "hop", "hop 1", site="a", record=signing.unsigned("a", report))
        ledger.add_event("r1", "state", "a: done", site="a")
    ledger.finish_run("r1", "failed", error="x", message="run failed: x")
    ledger.close()
    con = sqlite3.connect(tmp_path / "l.sqlite")
    con.row_factory = sqlite3.Row
    rows = [dict(r) for r in con.execute("SELECT * FROM events WHERE run_id = 'r1' ORDER BY seq")]
    assert [r["kind"] for r in rows] == ["started", "hop", "state", "failed"]
    prev = hashchain.genesis("r1")
    for r in rows:
        assert r["prev_hash"] == prev and r["hash"] == hashchain.event_hash(prev, r)
        prev = r["hash"]
    assert rows[1]["record"] and not rows[0]["record"]
    rec = con.execute("SELECT * FROM records WHERE run_id = 'r1'").fetchone()
    assert rec["seq"] == rows[1]["seq"] and rec["type"] == "HopReport" and rec["signature"] == b""
    assert signing.binding_digest(rec["record"], rec["signature"], "") == rows[1]["record"]
    # Any edit of an event changes its hash.
    for key, value in (("message", "hop 2"), ("time", rows[1]["time"] + 1e-6), ("data", '{"x": 1}'),
                       ("kind", "state"), ("site", "b"), ("record", "")):
        assert hashchain.event_hash(rows[1]["prev_hash"], {**rows[1], key: value}) != rows[1]["hash"], key
    seal = signing.parse(con.execute("SELECT record FROM seals WHERE run_id = 'r1'").fetchone()[0], cpb.RunSeal)
    assert (seal.events, seal.last_seq, seal.head) == (4, rows[-1]["seq"], rows[-1]["hash"])
    assert json.loads(seal.run_json)["status"] == "failed" and len(seal.plans) == 1
    assert con.execute("SELECT COUNT(*) FROM seals WHERE run_id = 'r2'").fetchone()[0] == 0
    con.close()
    # A plaintext run's ledger is consistent, and its audit says it is unsigned.
    report = audit.verify(audit.bundle_from_ledger(tmp_path / "l.sqlite", "r1"), None)
    assert report.verdict == "unsigned" and not report.problems, report.ordered()


# -- the coordinator refuses what is not signed by the reporting site -----------------------------------
def test_unsigned_or_badly_signed_reports_and_evaluations_are_refused(coordinator, ids):  # noqa: F811
    address, ledger = coordinator
    ledger.create_run("signed", strategy="fedelmy", arch="cnn", seed=1, params={}, class_index=["x"], model={},
                      chain=[{"name": n, "address": "127.0.0.1:9"} for n in ORDER], warnings=[], insecure=False,
                      plan=chain_plan(ORDER).to_json())
    report = hop_report(run_id="signed")
    for stub, request, words in (
        (cstub(ids["site-a"], address, signed=False), report, "is not signed"),
        (cstub(ids["site-a"], address, signed=False), signing.signer_for(ids["site-b"]).sign(report),
         "does not verify"),  # signed with another site's key, sent over site-a's connection
    ):
        with pytest.raises(grpc.RpcError) as err:
            stub.ReportHop(request, timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.value.details()
    assert ledger.hops("signed") == []
    assert not cstub(ids["site-a"], address).ReportHop(report, timeout=5).duplicate  # signed as a peer does
    con = sqlite3.connect(f"file:{ledger_path(ledger)}?mode=ro", uri=True)
    row = con.execute("SELECT signer, type, length(signature) > 0, certificate FROM records WHERE run_id = 'signed'")
    signer, type_, has_sig, fp = row.fetchone()
    assert (signer, type_, has_sig) == ("site-a", "HopReport", 1)
    assert con.execute("SELECT name FROM certificates WHERE sha256 = ?", (fp,)).fetchone()[0] == "site-a"
    con.close()
    # Evaluations: the reply must name the run and model, and be signed by the site with a CA certificate.
    sig = Signatures(ids["coordinator"])
    reply = peer_pb2.EvaluateReply(site="site-a", correct=8, test_samples=10, accuracy=0.8, seconds=1.0,
                                   run_id="signed", sha256="f" * 64)
    good = signing.signer_for(ids["site-a"]).sign(reply)
    assert sig.evaluation(good, "site-a", "signed", "f" * 64).signer == "site-a"
    for bad, words in ((reply, "not signed"), (signing.signer_for(ids["rogue-site-a"]).sign(reply), "not signed by the CA"),
                       (signing.signer_for(ids["site-b"]).sign(reply), "names 'site-b'")):
        with pytest.raises(signing.SignatureError, match=words):
            sig.evaluation(bad, "site-a", "signed", "f" * 64)
    with pytest.raises(signing.SignatureError, match="not of run"):  # a genuine reply of another model
        sig.evaluation(good, "site-a", "signed", "e" * 64)


def ledger_path(ledger: Ledger) -> str:
    return ledger.store.db.execute("PRAGMA database_list").fetchone()[2]


# -- a real run, then its ledger tampered with -----------------------------------------------------------
@pytest.fixture(scope="module")
def finished(three_sites, tmp_path_factory):
    """One finished 3-site run over mutual TLS (daemons in this process, stopped afterwards):
    dict(db, run_id, pki, run)."""
    from fedrelay.coordinator.client import OperatorClient

    root = tmp_path_factory.mktemp("audit")
    pki.init_ca(root / "pki")
    names = [d.name for d in three_sites]
    tls = {n: pki.enroll(n, root / "pki", root / f"{n}.pki") for n in names}
    address, daemons = serve_in_threads(root, three_sites, tls)
    client = OperatorClient(address, Transport.from_dir(root / "pki" / "operator"))
    try:
        run_id, run = chain_to_the_end(client, names, run_params.to_pb(PARAMS))
    finally:
        client.close()
        stop_threads(daemons)
    assert run["status"] == "finished", run["error"]
    return dict(db=root / "ledger.sqlite", run_id=run_id, pki=root / "pki", run=run, names=names, tls=tls)


@pytest.fixture
def copy(finished, tmp_path):
    """A copy of the finished run's ledger to tamper with: (path, open connection)."""
    path = tmp_path / "ledger.sqlite"
    src = sqlite3.connect(finished["db"])
    dst = sqlite3.connect(path)
    src.backup(dst)
    src.close()
    dst.row_factory = sqlite3.Row
    dst.isolation_level = None
    yield path, dst
    dst.close()


def check(finished, path) -> audit.Report:
    return audit.verify(audit.bundle_from_ledger(path, finished["run_id"]),
                        audit.load_ca_file(finished["pki"] / "ca" / "ca.pem"))


def test_the_untouched_ledger_verifies_and_so_does_its_bundle(finished, tmp_path):
    run_id = finished["run_id"]
    report = check(finished, finished["db"])
    assert report.verdict == "verified", [str(p) for p in report.ordered()]
    assert report.records == {"HopReport": 4, "ReceiptReport": 4, "FinalReport": 1, "EvaluateReply": 3}
    assert report.signers == set(finished["names"]) and report.sealed
    runner = CliRunner()
    res = runner.invoke(coordinator_app, ["audit", run_id, "--db", str(finished["db"]), "--ca",
                                          str(finished["pki"] / "ca" / "ca.pem")])
    assert res.exit_code == 0 and f"run {run_id} verified" in res.output, res.output
    bundle = tmp_path / "bundle.json"
    res = runner.invoke(coordinator_app, ["audit", run_id, "--db", str(finished["db"]), "--export", str(bundle)])
    assert res.exit_code == 0 and "wrote the audit bundle" in res.output, res.output
    # A third party: the bundle and the CA certificate, nothing else (the PKI folder's ca.pem copied alone).
    ca = tmp_path / "third-party" / "ca.pem"
    ca.parent.mkdir()
    shutil.copy(finished["pki"] / "ca" / "ca.pem", ca)
    res = runner.invoke(coordinator_app, ["audit", "--bundle", str(bundle), "--ca", str(ca), "--json"])
    assert res.exit_code == 0, res.output
    verdict = json.loads(res.output)
    assert verdict["verdict"] == "verified" and verdict["run_id"] == run_id and verdict["problems"] == []
    # One byte of one signed record changed in the bundle: it no longer verifies.
    doc = json.loads(bundle.read_text())
    doc["evaluations"][0]["accuracy"] = 1.0
    bundle.write_text(json.dumps(doc))
    res = runner.invoke(coordinator_app, ["audit", "--bundle", str(bundle), "--ca", str(ca)])
    assert res.exit_code == 1 and "does not verify" in res.output and \
        f"evaluations row of {doc['evaluations'][0]['site']}" in res.output, res.output
    # Without --ca a signed run cannot be verified: said clearly, no traceback.
    res = runner.invoke(coordinator_app, ["audit", run_id, "--db", str(finished["db"])])
    assert res.exit_code == 2 and "pass --ca" in res.output and "Traceback" not in res.output
    res = runner.invoke(coordinator_app, ["audit", "no-such-run", "--db", str(finished["db"]), "--ca", str(ca)])
    assert res.exit_code == 2 and "unknown run" in res.output


def FLIP(column: str) -> str:
    """SQL for a hex digest with its first digit changed."""
    return f"(CASE WHEN substr({column}, 1, 1) = '0' THEN '1' ELSE '0' END || substr({column}, 2))"


def _first(finished, path) -> str:
    report = check(finished, path)
    assert report.verdict == "failed"
    return str(report.first)


def _hop(con, run_id, purpose="chain", hop=1) -> sqlite3.Row:
    return con.execute("SELECT * FROM hops WHERE run_id = ? AND purpose = ? AND hop = ? ORDER BY receiver",
                       (run_id, purpose, hop)).fetchone()


@pytest.mark.parametrize("edit", ["hop bytes", "hop digest", "receipt digest", "hop number", "evaluation accuracy",
                                  "run accuracy", "run order", "event message", "final model", "started by"])
def test_an_edited_row_is_named(finished, copy, edit):
    path, con = copy
    run_id, names = finished["run_id"], finished["names"]
    where = {
        "hop bytes": ("UPDATE hops SET payload_bytes = payload_bytes + 1 WHERE run_id = ? AND purpose = 'chain' "
                      "AND hop = 1", f"hops row of chain hop 1 ({names[0]} → {names[1]})", "payload_bytes"),
        "hop digest": (f"UPDATE hops SET sha256 = {FLIP('sha256')} WHERE run_id = ? AND purpose = 'chain' "
                       "AND hop = 2", f"hops row of chain hop 2 ({names[1]} → {names[2]})", "sha256"),
        "receipt digest": (f"UPDATE receipts SET sha256 = {FLIP('sha256')} WHERE run_id = ? AND "
                           "purpose = 'chain' AND hop = 1", "receipts row of chain hop 1", "sha256"),
        "hop number": ("UPDATE hops SET hop = 7 WHERE run_id = ? AND purpose = 'chain' AND hop = 1",
                       f"hops row of chain hop 1 ({names[0]} → {names[1]})", "is missing"),
        "evaluation accuracy": (f"UPDATE evaluations SET accuracy = 0.99 WHERE run_id = ? AND site = '{names[1]}'",
                                f"evaluations row of {names[1]}", "accuracy"),
        "run accuracy": ("UPDATE runs SET accuracy = 0.99 WHERE run_id = ?", f"run {run_id}'s", "accuracy"),
        "run order": ("UPDATE runs SET chain = (SELECT json_group_array(json(value)) FROM (SELECT value FROM "
                      "json_each(runs.chain) ORDER BY key DESC)) WHERE run_id = ?", f"run {run_id}'s row",
                      f"order is {' → '.join(reversed(names))} in the ledger"),
        "event message": ("UPDATE events SET message = message || '!' WHERE seq = (SELECT seq FROM events WHERE "
                          "run_id = ? AND kind = 'hop' ORDER BY seq LIMIT 1)", "(hop: ", "was edited"),
        "final model": (f"UPDATE runs SET final_sha256 = {FLIP('final_sha256')} WHERE run_id = ?",
                        f"run {run_id}'s", "final"),
        "started by": ("UPDATE runs SET started_by = 'operator.mallory' WHERE run_id = ?", f"run {run_id}'s row",
                       "its started_by is 'operator.mallory' in the ledger; the coordinator sealed 'operator'"),
    }[edit]
    assert check(finished, path).verdict == "verified"
    assert con.execute(where[0], (run_id,)).rowcount == 1
    first = _first(finished, path)
    assert where[1] in first and where[2] in first, first


@pytest.mark.parametrize("drop", ["hop", "receipt", "evaluation", "event", "last event", "record", "seal", "plan"])
def test_a_dropped_row_is_named(finished, copy, drop):
    path, con = copy
    run_id, names = finished["run_id"], finished["names"]
    sql, words = {
        "hop": ("DELETE FROM hops WHERE run_id = ? AND purpose = 'chain' AND hop = 2",
                [f"hops row of chain hop 2 ({names[1]} → {names[2]})", "is missing"]),
        "receipt": ("DELETE FROM receipts WHERE run_id = ? AND purpose = 'final' AND receiver = "
                    f"'{names[0]}'", [f"receipts row of final copy ({names[2]} → {names[0]})", "is missing"]),
        "evaluation": (f"DELETE FROM evaluations WHERE run_id = ? AND site = '{names[2]}'",
                       [f"evaluations row of {names[2]}", "is missing"]),
        "event": ("DELETE FROM events WHERE seq = (SELECT seq FROM events WHERE run_id = ? AND kind = 'epoch' "
                  "ORDER BY seq LIMIT 1)", ["does not follow event seq", "dropped"]),
        "last event": ("DELETE FROM events WHERE seq = (SELECT MAX(seq) FROM events WHERE run_id = ?)",
                       ["seal", "dropped"]),
        "record": ("DELETE FROM records WHERE seq = (SELECT seq FROM records WHERE run_id = ? AND "
                   "type = 'EvaluateReply' ORDER BY seq LIMIT 1)", ["(evaluated:", "records row was dropped"]),
        "seal": ("DELETE FROM seals WHERE run_id = ?", ["seal", "no seal"]),
        "plan": ("DELETE FROM plans WHERE run_id = ?", ["plan version 0", "dropped"]),
    }[drop]
    # End notices may add events after the seal: drop the run's sealed last event, not a later one.
    if drop == "last event":
        sealed = con.execute("SELECT seq FROM seals WHERE run_id = ?", (run_id,)).fetchone()[0]
        con.execute("DELETE FROM events WHERE run_id = ? AND seq > ?", (run_id, sealed))
        assert check(finished, path).verdict == "verified"  # events after the seal are not covered by it
    assert con.execute(sql, (run_id,)).rowcount == 1
    first = _first(finished, path)
    assert all(w in first for w in words), first


@pytest.mark.parametrize("swap", ["two events", "two hops' digests"])
def test_two_swapped_rows_are_named(finished, copy, swap):
    path, con = copy
    run_id, names = finished["run_id"], finished["names"]
    if swap == "two events":
        a, b = [r[0] for r in con.execute("SELECT seq FROM events WHERE run_id = ? AND kind = 'hop' ORDER BY seq",
                                          (run_id,))][:2]
        con.execute("UPDATE events SET seq = -1 WHERE seq = ?", (a,))
        con.execute("UPDATE events SET seq = ? WHERE seq = ?", (a, b))
        con.execute("UPDATE events SET seq = ? WHERE seq = -1", (b,))
        first = _first(finished, path)
        assert f"event seq {a} (hop: hop 2" in first and "does not follow" in first, first
    else:
        one, two = _hop(con, run_id, hop=1)["sha256"], _hop(con, run_id, hop=2)["sha256"]
        con.execute("UPDATE hops SET sha256 = ? WHERE run_id = ? AND purpose = 'chain' AND hop = 1", (two, run_id))
        con.execute("UPDATE hops SET sha256 = ? WHERE run_id = ? AND purpose = 'chain' AND hop = 2", (one, run_id))
        first = _first(finished, path)
        assert f"hops row of chain hop 1 ({names[0]} → {names[1]})" in first and "sha256" in first, first


def _rechain_and_reseal(finished, path, run_id: str) -> None:
    """What a coordinator's operator holding the ledger and the coordinator's key could do after
    editing it: recompute every event's hash and sign a new seal."""
    con = sqlite3.connect(path)
    con.row_factory = sqlite3.Row
    prev = hashchain.genesis(run_id)
    for e in [dict(r) for r in con.execute("SELECT * FROM events WHERE run_id = ? ORDER BY seq", (run_id,))]:
        h = hashchain.event_hash(prev, e)
        con.execute("UPDATE events SET prev_hash = ?, hash = ? WHERE seq = ?", (prev, h, e["seq"]))
        prev = h
    con.commit()
    con.close()
    ledger = Ledger(path)
    ledger.sealer = Signatures(Transport.from_dir(finished["pki"] / "coordinator")).seal
    with ledger.lock:
        ledger.store.db.execute("BEGIN IMMEDIATE")
        ledger.event_log.seal(run_id, time.time())
        ledger.store.db.execute("COMMIT")
    ledger.close()


def test_a_record_signed_by_a_site_not_planned_for_it_is_named(finished, copy):
    """Even the coordinator's operator, who can rewrite the chain and sign a new seal, cannot pass
    off a hop as made by a site the plan did not give it to: the site's signature says who."""
    path, con = copy
    run_id, names = finished["run_id"], finished["names"]
    row = con.execute("SELECT r.seq, r.record FROM records r JOIN events e ON e.seq = r.seq WHERE r.run_id = ? AND "
                      "r.type = 'HopReport' AND e.kind = 'hop' ORDER BY r.seq LIMIT 1", (run_id,)).fetchone()
    hop = signing.parse(row["record"], cpb.HopReport)
    assert (hop.hop, hop.sender) == (1, names[0])
    hop.sender = names[2]  # site 3 claims hop 1, and signs the claim with its own (valid) key
    other = signing.signer_for(Transport.from_dir(finished["tls"][names[2]]))
    forged = signing.received(other.sign(hop), names[2], other.certificate_pem)
    con.execute("INSERT OR IGNORE INTO certificates (sha256, name, pem, first_seen) VALUES (?, ?, ?, 0)",
                (forged.certificate_sha256, names[2], forged.certificate.decode()))
    con.execute("UPDATE records SET signer = ?, record = ?, signature = ?, certificate = ? WHERE seq = ?",
                (names[2], forged.record, forged.signature, forged.certificate_sha256, row["seq"]))
    con.execute("UPDATE events SET record = ? WHERE seq = ?", (forged.binding(), row["seq"]))
    con.execute("UPDATE hops SET sender = ? WHERE run_id = ? AND purpose = 'chain' AND hop = 1", (names[2], run_id))
    _rechain_and_reseal(finished, path, run_id)
    first = _first(finished, path)
    assert f"{names[2]}'s report of chain hop 1 ({names[2]} → {names[1]})" in first, first
    assert "not planned for it" in first, first


def test_a_certificate_not_signed_by_the_ca_is_named(finished, copy, tmp_path, ids):  # noqa: F811
    path, con = copy
    # The whole ledger checked against another federation's CA: the first signed record fails.
    rogue = audit.verify(audit.bundle_from_ledger(path, finished["run_id"]),
                         signing.load_ca(ids["rogue-coordinator"].ca))
    first_record = con.execute("SELECT MIN(seq) FROM records WHERE run_id = ?", (finished["run_id"],)).fetchone()[0]
    assert "is not signed by the CA" in str(rogue.first) and f"(event seq {first_record} (" in str(rogue.first), \
        rogue.first
    # A record re-signed with a key whose certificate another CA made for the same site name.
    row = con.execute("SELECT seq, record, signer FROM records WHERE run_id = ? AND type = 'ReceiptReport' "
                      "ORDER BY seq LIMIT 1", (finished["run_id"],)).fetchone()
    receipt = signing.parse(row["record"], cpb.ReceiptReport)
    root = tmp_path / "rogue"
    pki.init_ca(root)
    signer = signing.signer_for(Transport.from_dir(pki.enroll(row["signer"], root, root / "site")))
    forged = signing.received(signer.sign(receipt), row["signer"], signer.certificate_pem)
    con.execute("INSERT INTO certificates (sha256, name, pem, first_seen) VALUES (?, ?, ?, 0)",
                (forged.certificate_sha256, row["signer"], forged.certificate.decode()))
    con.execute("UPDATE records SET signature = ?, certificate = ? WHERE seq = ?",
                (forged.signature, forged.certificate_sha256, row["seq"]))
    con.execute("UPDATE events SET record = ? WHERE seq = ?", (forged.binding(), row["seq"]))
    _rechain_and_reseal(finished, path, finished["run_id"])
    first = _first(finished, path)
    assert f"{row['signer']}'s receipt of chain hop" in first and "not signed by the CA" in first, first


def test_a_ledger_from_before_the_chain_is_migrated_and_its_old_runs_do_not_verify(tmp_path):
    from fedrelay.coordinator import ledger as ledger_module

    old_schema = ledger_module.SCHEMA.split("CREATE TABLE IF NOT EXISTS events")[0] + """
CREATE TABLE events (seq INTEGER PRIMARY KEY AUTOINCREMENT, run_id TEXT NOT NULL, time REAL NOT NULL,
                     kind TEXT NOT NULL, site TEXT NOT NULL DEFAULT '', message TEXT NOT NULL,
                     data TEXT NOT NULL DEFAULT '{}');"""
    path = tmp_path / "old.sqlite"
    con = sqlite3.connect(path)
    con.executescript(old_schema)
    con.execute("INSERT INTO runs (run_id, created, status, strategy, arch, seed, params, chain, class_index, model, "
                "warnings, insecure) VALUES ('old', 1.0, 'running', 'fedelmy', 'cnn', 1, '{}', '[]', '[]', '{}', '[]', 0)")
    con.execute("INSERT INTO events (run_id, time, kind, message) VALUES ('old', 1.0, 'started', 'run old')")
    con.commit()
    con.close()
    ledger = Ledger(path)  # adds the chain's columns and tables
    ledger.add_event("old", "state", "after the upgrade")
    ledger.close()
    report = audit.verify(audit.bundle_from_ledger(path, "old"), None)
    assert "has no chain hash" in str(report.first), report.first


def test_a_malformed_bundle_gets_a_clear_message(tmp_path):
    runner = CliRunner()
    for name, text in (("not-json.json", "{"), ("other.json", '{"format": "x"}'),
                       ("broken.json", json.dumps({"format": audit.FORMAT, "version": audit.FORMAT_VERSION,
                                                   "run_id": "r", "run": {"insecure": 1}, "plans": [], "events": 3,
                                                   "records": [], "certificates": {}, "seal": None, "hops": [],
                                                   "receipts": [], "evaluations": []}))):
        (tmp_path / name).write_text(text)
        res = runner.invoke(coordinator_app, ["audit", "--bundle", str(tmp_path / name)])
        assert res.exit_code == 2 and "error:" in res.output, (name, res.output, res.exception)
        assert isinstance(res.exception, SystemExit) and "Traceback" not in res.output
