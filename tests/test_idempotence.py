"""Every state-changing call can be retried safely: a duplicate assignment, hop report, final
report or reroute has no second effect."""

from __future__ import annotations

import grpc
import pytest

from fedrelay.server import make_server
from fedrelay.transport import insecure_channel
from fedrelay.coordinator.ledger import Ledger
from fedrelay.coordinator.plan import chain_plan, replan
from fedrelay.coordinator.service import CoordinatorService
from fedrelay.tasks.image_folder.data import load_site
from fedrelay.peer.node import PeerNode
from fedrelay.v1 import common_pb2, coordinator_pb2 as cpb, coordinator_pb2_grpc, peer_pb2
from test_transfer import assignment


def test_duplicate_assignment_has_no_second_effect(three_sites, tmp_path):
    node = PeerNode("site-b", "127.0.0.1:1", load_site(three_sites[0]), tmp_path, "cpu", None, start_workers=False)
    a = assignment("r1")
    assert node.assign(a) == "assigned"
    stamp = (tmp_path / "runs" / "r1" / "assignment.pb").stat().st_mtime_ns
    assert node.assign(a) == "assigned"  # the coordinator's retry
    assert len(node.runs) == 1
    assert (tmp_path / "runs" / "r1" / "assignment.pb").stat().st_mtime_ns == stamp
    other = assignment("r1")
    other.seed = 99
    with pytest.raises(ValueError, match="differently"):
        node.assign(other)


def test_duplicate_reroute_has_no_second_effect(three_sites, tmp_path):
    node = PeerNode("site-b", "127.0.0.1:1", load_site(three_sites[0]), tmp_path, "cpu", None, start_workers=False)
    order = ["site-a", "site-b", "site-c"]
    node.assign(assignment("r2", order=order))
    # site-c stays down: site-b becomes the chain's final site (replanned as the coordinator does).
    plan = chain_plan(order)
    around = replan(order, 1, plan, {"site-c"}, plan.visits[1])
    r = peer_pb2.RerouteRequest(run_id="r2", route_version=1, skipped=["site-c"],
                                **around.part_pb("site-b", {"site-a": "127.0.0.1:1"}))
    node.reroute(r)
    run = node.runs["r2"]
    assert run.is_final_site and around.final_site == "site-b" and run.assignment.route_version == 1
    stamp = (tmp_path / "runs" / "r2" / "assignment.pb").stat().st_mtime_ns
    node.reroute(r)  # the same route again: nothing changes
    assert (tmp_path / "runs" / "r2" / "assignment.pb").stat().st_mtime_ns == stamp
    stale = peer_pb2.RerouteRequest(run_id="r2", route_version=0)
    node.reroute(stale)  # an older route is ignored
    assert run.assignment.route_version == 1 and run.is_final_site
    with pytest.raises(ValueError):
        node.reroute(peer_pb2.RerouteRequest(
            run_id="r2", route_version=2, visits=[1], peers=[common_pb2.SiteRef(name="nowhere", address="x:1")],
            transfers=[common_pb2.PlannedTransfer(purpose=common_pb2.CHAIN_HOP, index=2, round=1, sender="site-b",
                                                  receiver="nowhere")]))


def test_duplicate_reports_have_no_second_effect(tmp_path):
    ledger = Ledger(tmp_path / "l.sqlite")
    service = CoordinatorService(ledger)
    service.eval_retry = 0.0
    chain = [{"name": "a", "address": "127.0.0.1:9"}, {"name": "b", "address": "127.0.0.1:9"}]
    ledger.create_run("r", strategy="fedelmy", arch="cnn", seed=1, params={}, chain=chain, class_index=["x"],
                      model={}, warnings=[], insecure=True, plan=chain_plan(["a", "b"]).to_json())
    server, port = make_server("127.0.0.1:0")
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(service, server)
    server.start()
    try:
        with insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = coordinator_pb2_grpc.CoordinatorStub(ch)
            hop = cpb.HopReport(run_id="r", hop=1, purpose=common_pb2.CHAIN_HOP, sender="a", receiver="b",
                                payload_bytes=10, wire_bytes=12, sha256="f" * 64, started=1.0, ended=2.0)
            assert not stub.ReportHop(hop, timeout=10).duplicate
            assert stub.ReportHop(hop, timeout=10).duplicate
            assert len(ledger.hops("r")) == 1
            events = len(ledger.events_after("r", 0))
            final = cpb.FinalReport(run_id="r", site="b", sha256="e" * 64, model_bytes=10)
            assert not stub.ReportFinal(final, timeout=10).duplicate
            assert stub.ReportFinal(final, timeout=10).duplicate
            assert [e["kind"] for e in ledger.events_after("r", 0)][events:].count("final") == 1
            with pytest.raises(grpc.RpcError) as err:  # only the last site reports the final model
                stub.ReportFinal(cpb.FinalReport(run_id="r", site="a", sha256="e" * 64), timeout=10)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        server.stop(0)
