"""Background failures are visible, and bad parameters are refused before anything is written
(issue "A run is a transfer plan", the bugs found while reading the code)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import grpc
import pytest

from fedrelay.server import make_server
from fedrelay.transport import insecure_channel
from fedrelay.coordinator.ledger import Ledger
from fedrelay.coordinator.plan import chain_plan
from fedrelay.coordinator.service import CoordinatorService
from fedrelay.v1 import common_pb2, coordinator_pb2 as cpb, coordinator_pb2_grpc


def running(ledger: Ledger, run_id: str = "r") -> None:
    ledger.create_run(run_id, strategy="fedelmy", arch="cnn", seed=1, params={},
                      chain=[{"name": n, "address": "127.0.0.1:9"} for n in ("a", "b")], class_index=["x"],
                      model={}, warnings=[], insecure=True, plan=chain_plan(["a", "b"]).to_json())


def test_an_evaluation_that_breaks_fails_the_run_with_its_reason():
    """The evaluation future used to be dropped: an exception left the run 'running' for ever."""
    ledger = Ledger(":memory:")
    running(ledger)
    service = CoordinatorService(ledger)

    def broken(run_id):
        raise KeyError("per_site")

    service.evaluator.submit("r", evaluate=broken)
    service.evaluator.pool.shutdown(wait=True)  # the done-callback runs before shutdown returns
    run = ledger.run("r")
    assert run["status"] == "failed" and "KeyError" in run["error"] and "evaluation" in run["error"]


def test_a_monitor_step_that_raises_does_not_end_the_monitor():
    """An exception in the reroutes' step used to end the monitor thread silently, and with it every
    later reroute and end notice."""
    from fedrelay.coordinator.routing import start_monitor

    ledger = Ledger(":memory:")
    service = CoordinatorService(ledger)
    ticks, enough = [], threading.Event()

    def reroutes():
        raise RuntimeError("a site's row vanished")

    def notices():
        ticks.append(1)
        if len(ticks) >= 3:
            enough.set()

    stop = threading.Event()
    start_monitor(service.ledger, service.routing.check_route, [reroutes, notices], stop, interval=0.01)
    try:
        assert enough.wait(10), "the monitor stopped after the first failure"
    finally:
        stop.set()


def test_a_progress_reporter_that_hits_an_unexpected_error_goes_on():
    """The peer's progress thread caught only RpcError: anything else ended it, and every later
    report was lost."""
    from fedrelay.peer.reporting import Reporter

    got, second = [], threading.Event()

    def report(r, timeout):
        if r.epoch == 1:
            raise ValueError("a bug in a report")
        got.append(r.epoch)
        second.set()

    reporter = Reporter(SimpleNamespace(stub=SimpleNamespace(ReportProgress=report)), lambda: threading.Event())
    reporter.progress(cpb.ProgressReport(run_id="r", site="a", kind="epoch", epoch=1))
    reporter.progress(cpb.ProgressReport(run_id="r", site="a", kind="epoch", epoch=2))
    assert second.wait(10) and got == [2]


def test_a_heartbeat_that_hits_an_unexpected_error_goes_on():
    from fedrelay.peer.daemon import _heartbeat

    calls, stop = [], threading.Event()

    def register(request, timeout):
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("unexpected")
        stop.set()
        return SimpleNamespace(heartbeat_seconds=1)

    link = SimpleNamespace(stub=SimpleNamespace(Register=register), address="x")
    t = threading.Thread(target=_heartbeat, args=(link, cpb.RegisterRequest(name="a"), stop), daemon=True)
    t.start()
    t.join(15)
    assert not t.is_alive() and len(calls) == 2


@pytest.fixture
def coordinator(tmp_path):
    ledger = Ledger(tmp_path / "l.sqlite")
    server, port = make_server("127.0.0.1:0")
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(CoordinatorService(ledger), server)
    server.start()
    with insecure_channel(f"127.0.0.1:{port}") as ch:
        yield coordinator_pb2_grpc.CoordinatorStub(ch), ledger
    server.stop(0)


@pytest.mark.parametrize("field,value,words", [
    ("lr", float("nan"), "--lr must be a finite number"), ("lr", float("inf"), "--lr must be a finite number"),
    ("alpha", float("nan"), "--alpha"), ("beta", -1.0, "--beta"), ("weight_decay", float("-inf"), "--weight-decay"),
    ("local_epochs", 0, "--local-epochs"), ("strategy", "fedprox", "unknown strategy"),
    ("selection", "best", "--selection")])
def test_bad_parameters_are_refused_before_anything_is_written(coordinator, field, value, words):
    stub, ledger = coordinator
    params = dict(strategy="fedelmy", models_per_site=1, local_epochs=1, warmup_epochs=0, alpha=1.0, beta=1.0,
                  lr=1e-3, batch_size=8, weight_decay=0.0, selection="best-val")
    params[field] = value
    with pytest.raises(grpc.RpcError) as err:
        stub.StartChain(cpb.StartChainRequest(seed=1, params=common_pb2.TrainingParams(**params)), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.value.details()
    assert ledger.run_ids() == []  # no failed run left behind


def test_rounds_out_of_range_are_refused(coordinator):
    stub, ledger = coordinator
    params = common_pb2.TrainingParams(strategy="fedelmy", models_per_site=1, local_epochs=1, lr=1e-3, batch_size=8,
                                       selection="best-val")
    with pytest.raises(grpc.RpcError) as err:
        stub.StartChain(cpb.StartChainRequest(seed=1, params=params, rounds=100_000), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "--rounds" in err.value.details()
    assert ledger.run_ids() == []
