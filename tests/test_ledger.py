"""The ledger tells the truth: a transfer is recorded only as planned and as received.

Over real mutual-TLS sockets, with the enrolled sites of test_security's PKI: every report is
checked against the run's plan (who sends what to whom, at which transfer), a transfer is *done*
only when its sender and receiver agree, and a disagreement is recorded and shown."""

from __future__ import annotations

import grpc
import pytest

from fedrelay.coordinator.client import summary_dict
from fedrelay.coordinator.plan import chain_plan
from fedrelay.v1 import common_pb2, coordinator_pb2 as cpb
from test_security import ORDER, coordinator, cstub, ids  # noqa: F401 - pytest fixtures

M = 1234
A, B, C = ORDER
HOP, FINAL = common_pb2.CHAIN_HOP, common_pb2.FINAL_MODEL
SHA = {1: "1" * 64, 2: "2" * 64, "final": "f" * 64}
SCHEMA = "5" * 64


def new_run(ledger, run_id: str) -> None:
    ledger.create_run(run_id, strategy="fedelmy", arch="cnn", seed=1, params={},
                      chain=[{"name": n, "address": "127.0.0.1:9"} for n in ORDER], class_index=["x"], model={},
                      warnings=[], insecure=False, plan=chain_plan(ORDER).to_json())


def hop(run_id, index, sender, receiver, sha, nbytes=M, purpose=HOP) -> cpb.HopReport:
    return cpb.HopReport(run_id=run_id, hop=index, purpose=purpose, sender=sender, receiver=receiver,
                         payload_bytes=nbytes, wire_bytes=nbytes + 50, sha256=sha, started=1.0, ended=2.0,
                         schema_sha256=SCHEMA)


def receipt(run_id, index, sender, receiver, sha, nbytes=M, purpose=HOP) -> cpb.ReceiptReport:
    return cpb.ReceiptReport(run_id=run_id, hop=index, purpose=purpose, sender=sender, receiver=receiver,
                             payload_bytes=nbytes, sha256=sha, schema_sha256=SCHEMA, received=3.0)


def genuine(ids, address, run_id) -> None:
    """What the sites of an undisturbed 3-site chain report, in order."""
    for index, (s, r) in ((1, (A, B)), (2, (B, C))):
        cstub(ids[s], address).ReportHop(hop(run_id, index, s, r, SHA[index]), timeout=5)
        cstub(ids[r], address).ReportReceipt(receipt(run_id, index, s, r, SHA[index]), timeout=5)
    for r in (A, B):
        cstub(ids[C], address).ReportHop(hop(run_id, 0, C, r, SHA["final"], purpose=FINAL), timeout=5)
        cstub(ids[r], address).ReportReceipt(receipt(run_id, 0, C, r, SHA["final"], purpose=FINAL), timeout=5)
    cstub(ids[C], address).ReportFinal(cpb.FinalReport(run_id=run_id, site=C, sha256=SHA["final"], model_bytes=M),
                                       timeout=5)


def ledger_view(ledger, run_id) -> dict:
    run = ledger.run(run_id)
    return {"hops": [(h["hop"], h["sender"], h["receiver"], h["payload_bytes"], h["sha256"], h["status"])
                     for h in ledger.hops(run_id)],
            "final": [(h["sender"], h["receiver"], h["sha256"], h["status"]) for h in ledger.hops(run_id, "final")],
            "model_bytes": run["model_bytes"], "final_sha256": run["final_sha256"]}


def refused(call, code) -> str:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == code, err.value.details()
    return err.value.details()


def test_forged_reports_are_refused_and_the_ledger_equals_the_undisturbed_runs(coordinator, ids):
    address, ledger = coordinator
    new_run(ledger, "honest")
    genuine(ids, address, "honest")
    new_run(ledger, "attacked")
    denied = grpc.StatusCode.PERMISSION_DENIED
    # While the first site still trains, enrolled sites file transfers they never made.
    refused(lambda: cstub(ids[C], address).ReportHop(hop("attacked", 1, C, B, "f" * 64, nbytes=1), timeout=5), denied)
    refused(lambda: cstub(ids[A], address).ReportHop(hop("attacked", 0, A, B, "e" * 64, purpose=FINAL), timeout=5),
            denied)
    refused(lambda: cstub(ids[B], address).ReportHop(hop("attacked", 99, B, "../../../tmp/x", "d" * 64), timeout=5),
            grpc.StatusCode.INVALID_ARGUMENT)  # not a site name (fedrelay/names.py)
    refused(lambda: cstub(ids[B], address).ReportHop(hop("attacked", 99, B, C, "d" * 64), timeout=5), denied)
    refused(lambda: cstub(ids[C], address).ReportReceipt(receipt("attacked", 1, A, B, "c" * 64), timeout=5), denied)
    refused(lambda: cstub(ids[B], address).ReportReceipt(receipt("attacked", 2, A, C, "c" * 64), timeout=5), denied)
    refused(lambda: cstub(ids[A], address).ReportFinal(cpb.FinalReport(run_id="attacked", site=A, sha256="e" * 64),
                                                       timeout=5), denied)
    assert ledger.hops("attacked") == [] and ledger.run("attacked")["model_bytes"] is None
    genuine(ids, address, "attacked")
    # A repeat is a duplicate; a different report of a transfer already recorded is refused.
    assert cstub(ids[A], address).ReportHop(hop("attacked", 1, A, B, SHA[1]), timeout=5).duplicate
    refused(lambda: cstub(ids[A], address).ReportHop(hop("attacked", 1, A, B, "9" * 64), timeout=5),
            grpc.StatusCode.ALREADY_EXISTS)
    refused(lambda: cstub(ids[B], address).ReportReceipt(receipt("attacked", 1, A, B, "9" * 64), timeout=5),
            grpc.StatusCode.ALREADY_EXISTS)
    assert ledger_view(ledger, "attacked") == ledger_view(ledger, "honest")
    assert {h["status"] for h in ledger.hops("honest") + ledger.hops("honest", "final")} == {"done"}
    assert ledger.run("honest")["model_bytes"] == M


def test_a_transfer_is_done_only_when_both_ends_agree_and_a_disagreement_is_shown(coordinator, ids):
    address, ledger = coordinator
    new_run(ledger, "disputed")
    cstub(ids[A], address).ReportHop(hop("disputed", 1, A, B, SHA[1]), timeout=5)
    assert [h["status"] for h in ledger.hops("disputed")] == ["sent"]
    assert ledger.run("disputed")["model_bytes"] is None  # one end alone fixes nothing
    cstub(ids[B], address).ReportReceipt(receipt("disputed", 1, A, B, "b" * 64), timeout=5)
    shown = summary_dict(cstub(ids["operator"], address).GetRun(cpb.GetRunRequest(run_id="disputed"), timeout=5))
    h = shown["hops"][0]
    assert (h["status"], h["sha256"], h["receiver_sha256"]) == ("disputed", SHA[1], "b" * 64)
    assert shown["model_bytes"] is None
    assert any(e["kind"] == "warning" and "disputed" in e["message"] for e in ledger.events_after("disputed", 0))
    # A receipt that comes first waits for the sender's report; together they are done, and the
    # run's model size is then fixed: a report of another size is refused.
    cstub(ids[C], address).ReportReceipt(receipt("disputed", 2, B, C, SHA[2]), timeout=5)
    assert [h["status"] for h in ledger.hops("disputed")] == ["disputed", "received"]
    cstub(ids[B], address).ReportHop(hop("disputed", 2, B, C, SHA[2]), timeout=5)
    assert [h["status"] for h in ledger.hops("disputed")] == ["disputed", "done"]
    assert ledger.run("disputed")["model_bytes"] == M
    refused(lambda: cstub(ids[C], address).ReportHop(hop("disputed", 0, C, A, SHA["final"], nbytes=M + 1,
                                                         purpose=FINAL), timeout=5), grpc.StatusCode.INVALID_ARGUMENT)
