"""Hostile values at the coordinator: every reported number, enumeration and digest checked
(``fedrelay/checks.py``), replies kept under the message cap (``coordinator/replies.py``), a
garbled answer over a control stream refused cleanly (``coordinator/tunnel_server.py``), a forgotten
peer kept out (``coordinator/forgotten.py``), and a sender's failing streams counted rather than
logged one by one (``peer/refusals.py``).

Each bad value reaches the coordinator over a real (plaintext) gRPC socket: it must be refused
with INVALID_ARGUMENT naming the field, never UNKNOWN, and leave the ledger as it was."""

from __future__ import annotations

import logging
import math
import queue
import threading
from types import SimpleNamespace

import grpc
import pytest
from conftest import Aborted, FakeContext, image_offer_pbs, image_offers, new_run

from fedrelay.server import make_server
from fedrelay.transport import INSECURE
from fedrelay.coordinator.client import OperatorClient
from fedrelay.coordinator.ledger import Ledger
from fedrelay.coordinator.service import CoordinatorService
from fedrelay.v1 import common_pb2, coordinator_pb2 as cpb, coordinator_pb2_grpc, peer_pb2, peer_pb2_grpc

SHA = "ab" * 32
SCHEMA = "cd" * 32
HOP = common_pb2.CHAIN_HOP
PARAMS = dict(strategy="fedelmy", models_per_site=1, local_epochs=1, warmup_epochs=0, alpha=1.0, beta=1.0, lr=1e-3,
              batch_size=8, weight_decay=0.0, selection="best-val")


@pytest.fixture(scope="module")
def coordinator():
    """A coordinator over a plaintext socket (the daemons' guard included): (service, ledger,
    stub, address)."""
    ledger = Ledger(":memory:")
    service = CoordinatorService(ledger)
    server, port = make_server("127.0.0.1:0")
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(service, server)
    server.start()
    address = f"127.0.0.1:{port}"
    with INSECURE.channel(address) as channel:
        yield service, ledger, coordinator_pb2_grpc.CoordinatorStub(channel), address
    server.stop(0)
    service.close()


def refused(call, field: str) -> None:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, err.value.code(), err.value.details())
    assert err.value.details().startswith(f"{field} must be"), (field, err.value.details())
    assert len(err.value.details()) < 400


def recorded(ledger: Ledger, run_id: str) -> tuple:
    """What the ledger holds of a run's reports."""
    return (ledger.hops(run_id), ledger.metrics(run_id), len(ledger.events_after(run_id, 0)),
            {k: v for k, v in ledger.run(run_id).items() if k not in ("live",)})


# -- reports -----------------------------------------------------------------------------------------
def good_hop(**kw) -> cpb.HopReport:
    fields = dict(run_id="hops", hop=1, purpose=HOP, sender="a", receiver="b", payload_bytes=10, wire_bytes=12,
                  sha256=SHA, schema_sha256=SCHEMA, started=1_700_000_000.0, ended=1_700_000_001.0)
    fields.update(kw)
    return cpb.HopReport(**fields)


BAD_HOPS = {
    "payload_bytes 2^63": ("payload_bytes", dict(payload_bytes=1 << 63)),
    "payload_bytes 2^64-1": ("payload_bytes", dict(payload_bytes=(1 << 64) - 1)),
    "wire_bytes 2^64-1": ("wire_bytes", dict(wire_bytes=(1 << 64) - 1)),
    "resumed past the payload": ("resumed_from", dict(resumed_from=11)),
    "ended +inf": ("ended", dict(ended=math.inf)),
    "started nan": ("started", dict(started=math.nan)),
    "started negative": ("started", dict(started=-5.0)),
    "ended in the year 3000": ("ended", dict(ended=32_503_680_000.0)),
    "route markup and ESC": ("route", dict(route="[bold]x\x1b[2J")),
    "route 5 MiB": ("route", dict(route="r" * (5 << 20))),
    "relay not an address": ("relay", dict(relay="not an address")),
    "relay markup": ("relay", dict(relay="[/]:1")),
    "sealed digest not a digest": ("sealed_sha256", dict(route="relayed", sealed_bytes=100, sealed_sha256="not a digest")),
    "sealed digest upper case": ("sealed_sha256", dict(sealed_sha256="AB" * 32)),
    "relayed without a digest": ("sealed_sha256", dict(route="relayed", sealed_bytes=100)),
    "relayed without a size": ("sealed_bytes", dict(route="relayed", sealed_sha256=SHA)),
    "sealed_bytes 2^63": ("sealed_bytes", dict(sealed_bytes=1 << 63)),
    "purpose 7": ("purpose", dict(purpose=7)),
}


def test_hop_reports_with_values_out_of_range_are_refused_and_change_nothing(coordinator):
    _, ledger, stub, _ = coordinator
    new_run(ledger, "hops")
    before = recorded(ledger, "hops")
    for what, (field, kw) in BAD_HOPS.items():
        refused(lambda: stub.ReportHop(good_hop(**kw), timeout=30), field)
        assert recorded(ledger, "hops") == before, what
    assert not stub.ReportHop(good_hop(), timeout=10).duplicate  # the genuine report still goes in
    assert [(h["payload_bytes"], h["route"]) for h in ledger.hops("hops")] == [(10, "direct")]


def test_receipts_and_final_reports_with_values_out_of_range_are_refused(coordinator):
    _, ledger, stub, _ = coordinator
    new_run(ledger, "receipts")
    before = recorded(ledger, "receipts")

    def receipt(**kw):
        fields = dict(run_id="receipts", hop=1, purpose=HOP, sender="a", receiver="b", payload_bytes=10, sha256=SHA,
                      schema_sha256=SCHEMA, received=1_700_000_002.0)
        fields.update(kw)
        return lambda: stub.ReportReceipt(cpb.ReceiptReport(**fields), timeout=10)

    for field, call in (("payload_bytes", receipt(payload_bytes=(1 << 64) - 1)),
                        ("received", receipt(received=math.inf)),
                        ("route", receipt(route="sideways")),
                        ("relay_wire_bytes", receipt(relay_wire_bytes=1 << 63)),
                        ("purpose", receipt(purpose=9)),
                        ("model_bytes", lambda: stub.ReportFinal(cpb.FinalReport(
                            run_id="receipts", site="b", sha256=SHA, model_bytes=1 << 63), timeout=10))):
        refused(call, field)
        assert recorded(ledger, "receipts") == before, field
    assert ledger.run("receipts")["final_sha256"] is None


def test_progress_reports_with_values_out_of_range_are_refused(coordinator):
    _, ledger, stub, _ = coordinator
    new_run(ledger, "progress")
    before = recorded(ledger, "progress")

    def epoch(**kw):
        fields = dict(run_id="progress", site="a", kind="epoch", stage="pool", model=1, epoch=1, epochs=2,
                      train_loss=0.5, val_accuracy=0.7, seconds=1.5)
        fields.update(kw)
        return lambda: stub.ReportProgress(cpb.ProgressReport(**fields), timeout=10)

    for field, call in (("train_loss", epoch(train_loss=math.inf)), ("train_loss", epoch(train_loss=math.nan)),
                        ("val_accuracy", epoch(val_accuracy=1.5)), ("val_accuracy", epoch(val_accuracy=math.nan)),
                        ("val_accuracy", epoch(val_accuracy=-math.inf)),
                        ("seconds", epoch(seconds=-1.0)), ("seconds", epoch(seconds=math.inf)),
                        ("stage", epoch(stage="[/bold]")), ("epoch", epoch(epoch=5, epochs=3)),
                        ("kind", epoch(kind="bogus")),
                        ("state", epoch(kind="state", state="[/]")), ("state", epoch(kind="state", state="sleeping"))):
        refused(call, field)
        assert recorded(ledger, "progress") == before, field
    epoch()()
    epoch(val_accuracy=-1.0)()  # negative: the site has no validation split
    stub.ReportProgress(cpb.ProgressReport(run_id="progress", site="a", kind="state", state="training",
                                           detail="model 1"), timeout=10)
    assert [m["val_accuracy"] for m in ledger.metrics("progress")] == [0.7, None]


@pytest.mark.parametrize("reply, field", [
    (peer_pb2.EvaluateReply(site="a", correct=11, test_samples=10, accuracy=1.1), "correct"),
    (peer_pb2.EvaluateReply(site="a", correct=10, test_samples=10, accuracy=math.inf), "accuracy"),
    (peer_pb2.EvaluateReply(site="a", correct=5, test_samples=10, accuracy=1.5), "accuracy"),
    (peer_pb2.EvaluateReply(site="a", correct=5, test_samples=10, accuracy=0.5, seconds=math.nan), "seconds"),
    (peer_pb2.EvaluateReply(site="a", correct=5, test_samples=(1 << 64) - 1, accuracy=0.0), "test_samples"),
])
def test_an_evaluation_with_values_out_of_range_fails_the_run_and_records_nothing(reply, field):
    ledger = Ledger(":memory:")
    service = CoordinatorService(ledger)
    new_run(ledger, "r")
    ledger.update_run("r", final_sha256=SHA, final_site="b")
    answers = {"a": reply, "b": peer_pb2.EvaluateReply(site="b", correct=8, test_samples=10, accuracy=0.8)}
    service.evaluator.call_peer = lambda site, method, request, timeout: answers[site["name"]]
    service.evaluator.evaluate_run("r")
    run = ledger.run("r")
    assert run["status"] == "failed" and f"a's EvaluateReply.{field} must be" in run["error"], run["error"]
    assert ledger.evaluations("r") == [] or all(e["site"] == "b" for e in ledger.evaluations("r"))
    assert run["accuracy"] is None
    service.close()


def test_a_genuine_evaluation_still_finishes_the_run():
    ledger = Ledger(":memory:")
    service = CoordinatorService(ledger)
    new_run(ledger, "r")
    ledger.update_run("r", final_sha256=SHA, final_site="b")
    service.evaluator.call_peer = lambda site, method, request, timeout: peer_pb2.EvaluateReply(
        site=site["name"], correct=8, test_samples=10, accuracy=0.8, seconds=0.1)
    service.evaluator.evaluate_run("r")
    assert (ledger.run("r")["status"], ledger.run("r")["accuracy"]) == ("finished", 0.8)
    service.close()


# -- replies under the message cap --------------------------------------------------------------------
def test_runs_whose_texts_add_up_past_the_message_cap_are_listed_in_pages(coordinator):
    """Three failed runs with 3 MiB errors (what a ledger may hold): ListRuns used to exceed
    the 8 MiB cap (RESOURCE_EXHAUSTED), so the operator could not list any run."""
    _, ledger, _, address = coordinator
    ids = [f"big-{i}" for i in range(3)]
    for run_id in ids:
        new_run(ledger, run_id)
        ledger.finish_run(run_id, "failed", error="e" * (3 << 20), message="run failed")
    with OperatorClient(address) as client:
        listed = [s["run_id"] for s in client.runs()]
        assert set(ids) <= set(listed) and len(listed) == len(set(listed))
        assert all(len(s["error"]) == 3 << 20 for s in client.runs() if s["run_id"] in ids)
    # One run past the cap by itself: GetRun answers it cut to size, and says so.
    new_run(ledger, "huge")
    ledger.finish_run("huge", "failed", error="e" * (9 << 20), message="run failed")
    with OperatorClient(address) as client:
        s = client.run("huge")
        assert s["error"].endswith(f"... ({9 << 20} characters)") and len(s["error"]) < 3000
        assert "huge" in [r["run_id"] for r in client.runs()]


def test_peers_and_metrics_past_the_message_cap_are_listed_in_pages(coordinator, monkeypatch):
    from fedrelay.calls import MAX_MESSAGE_BYTES
    from fedrelay.coordinator import replies

    _, ledger, _, address = coordinator
    # The replies' budgets under the message cap, and the peers' class lists, scaled down SCALE
    # times: the same pages and cuts as at full size (three records of ~3.9 MB that take a page
    # each, one past a reply's budget), with 1/SCALE of the bytes to make, store and send.
    assert replies.PAGE_BYTES < replies.SUMMARY_BYTES < MAX_MESSAGE_BYTES
    scale = 100
    monkeypatch.setattr(replies, "PAGE_BYTES", replies.PAGE_BYTES // scale)
    monkeypatch.setattr(replies, "SUMMARY_BYTES", replies.SUMMARY_BYTES // scale)
    many = 30_000 // scale

    def long_classes(n: int) -> list[dict]:  # 128-character class names: ~3.9 MB per 30,000
        return image_offers({f"{i:06d}" + "c" * 122: (1, 1) for i in range(n)})

    for name in ("p-1", "p-2", "p-3"):
        ledger.upsert_peer(name, "127.0.0.1:9", long_classes(many), "cpu", "x")
    ledger.upsert_peer("p-4", "127.0.0.1:9", long_classes(3 * many), "cpu", "x")  # one record past the cap
    with OperatorClient(address) as client:
        peers = {p.name: p for p in client.peers()}
    assert {"p-1", "p-2", "p-3", "p-4"} <= set(peers)
    assert all(len(peers[n].tasks[0].classes) == many and peers[n].classes_omitted == 0
               for n in ("p-1", "p-2", "p-3"))
    p4 = peers["p-4"]
    assert p4.classes_omitted > 0 and len(p4.tasks[0].classes) + p4.classes_omitted == 3 * many
    # Metrics: small pages, so that a few rows take several.
    monkeypatch.setattr(replies, "PAGE_BYTES", 200)
    new_run(ledger, "metrics")
    for epoch in range(1, 31):
        ledger.record_metric("metrics", "a", "pool", 1, epoch, 30, 0.5, None, 1.0)
    with OperatorClient(address) as client:
        assert [m["epoch"] for m in client.metrics("metrics")] == list(range(1, 31))
        assert len({r["run_id"] for r in client.runs()}) == len(ledger.run_ids())
        assert len(client.peers()) == len(ledger.peers())
    stub = coordinator[2]
    first = stub.GetMetrics(cpb.GetRunRequest(run_id="metrics"), timeout=10)
    assert 0 < len(first.rows) < 30 and first.next_offset == len(first.rows)


# -- the control stream -------------------------------------------------------------------------------
class FakeDirectPeer:
    """A Peer daemon named ``name`` answering GetStatus and Assign."""

    def __init__(self, name: str):
        class Servicer(peer_pb2_grpc.PeerServicer):
            def GetStatus(self, request, context):
                return peer_pb2.PeerStatus(name=name, instance="direct")

            def Assign(self, request, context):
                return peer_pb2.AssignReply()

        self.server, port = make_server("127.0.0.1:0")
        peer_pb2_grpc.add_PeerServicer_to_server(Servicer(), self.server)
        self.server.start()
        self.address = f"127.0.0.1:{port}"


def answer_tunnel(tunnel, answers: dict, stop: threading.Event) -> threading.Thread:
    """The site's end of a control stream: every request gets ``answers[method]`` (a ControlReply
    without id)."""
    def loop():
        while not stop.is_set():
            try:
                req = tunnel.outbox.get(timeout=0.1)
            except queue.Empty:
                continue
            reply = cpb.ControlReply()
            # A method not in ``answers`` (e.g. CheckPolicy) is one an older daemon lacks.
            reply.CopyFrom(answers.get(req.method, cpb.ControlReply(code=grpc.StatusCode.UNIMPLEMENTED.value[0])))
            reply.id = req.id
            tunnel.deliver(reply)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return t


GARBAGE = b"\xff\xfe garbage, not a protobuf message"
STATUS_B = cpb.ControlReply(reply=peer_pb2.PeerStatus(name="b", instance="i-b").SerializeToString())


@pytest.mark.parametrize("answers, started", [
    ({"GetStatus": cpb.ControlReply(reply=GARBAGE)}, False),
    ({"GetStatus": STATUS_B, "Assign": cpb.ControlReply(reply=GARBAGE)}, True),
    ({"GetStatus": STATUS_B, "Assign": cpb.ControlReply(code=999, details="no such code")}, True),
], ids=["GetStatus garbage", "Assign garbage", "Assign unknown status code"])
def test_a_garbled_answer_over_a_control_stream_is_a_clean_refusal(answers, started):
    from fedrelay import params as run_params

    ledger = Ledger(":memory:")
    service = CoordinatorService(ledger, probe_timeout=10)
    direct = FakeDirectPeer("a")
    ledger.upsert_peer("a", direct.address, image_offers({"c": (5, 1), "d": (5, 1)}), "cpu", "x")
    ledger.upsert_peer("b", "", image_offers({"c": (5, 1), "d": (5, 1)}), "cpu", "x")  # connects out only
    tunnel = service.tunnels.open("b", "i-b")
    stop = threading.Event()
    answer_tunnel(tunnel, answers, stop)
    try:
        with pytest.raises(Aborted) as err:
            service.StartChain(cpb.StartChainRequest(peers=["a", "b"], order="given", seed=1,
                                                     params=run_params.to_pb(PARAMS)), FakeContext())
        code, message = err.value.args
        assert code == grpc.StatusCode.FAILED_PRECONDITION, (code, message)
        assert "b" in message and ("not a " in message or "not a gRPC status" in message), message
        if started:
            (run_id,) = ledger.run_ids()
            assert ledger.run(run_id)["status"] == "failed" and "assignment refused by b" in ledger.run(run_id)["error"]
        else:
            assert ledger.run_ids() == []
    finally:
        stop.set()
        direct.server.stop(0)
        service.close()


# -- forget-peer ----------------------------------------------------------------------------------------
def test_a_forgotten_daemon_stays_out_until_a_new_daemon_registers(tmp_path):
    db = tmp_path / "ledger.sqlite"
    ledger = Ledger(db)
    service = CoordinatorService(ledger)

    def register(instance: str):
        return service.Register(cpb.RegisterRequest(name="a", address="127.0.0.1:9", instance=instance,
                                                    tasks=image_offer_pbs({"c": (5, 1)})),
                                FakeContext())

    register("first")
    register("first")  # a heartbeat
    service.ForgetPeer(cpb.ForgetPeerRequest(name="a"), FakeContext())
    with pytest.raises(Aborted) as err:
        register("first")  # the forgotten daemon's next heartbeat
    assert err.value.args[0] == grpc.StatusCode.PERMISSION_DENIED and "forget-peer" in err.value.args[1]
    assert ledger.peer("a") is None
    service.close()
    ledger.close()
    ledger = Ledger(db)  # the coordinator restarted: the removal holds
    service = CoordinatorService(ledger)
    with pytest.raises(Aborted):
        register("first")
    assert ledger.peer("a") is None
    register("second")  # the site's daemon was restarted: a new instance registers anew
    assert ledger.peer("a")["instance"] == "second" and ledger.forgotten("a") is None
    register("second")
    service.close()
    ledger.close()


# -- a sender's failing streams --------------------------------------------------------------------------
def test_a_senders_failing_streams_are_reported_a_few_times_then_counted(three_sites, tmp_path, caplog):
    """A planned sender whose streams fail after the header: each used to write two log lines
    and two progress reports (two ledger events at the coordinator), without bound."""
    from test_transfer import assignment, corrupt, header, load_site, payload, stream

    from fedrelay.peer.node import PeerNode
    from fedrelay.peer.refusals import ANNOUNCED
    from fedrelay.receiving import TransferError

    node = PeerNode("site-b", "127.0.0.1:1", load_site(three_sites[0]), tmp_path / "state", "cpu", None,
                    start_workers=False)
    reports = []
    node.reporter = SimpleNamespace(progress=reports.append, receipt=lambda report, delivered: None)
    node.assign(assignment("r"))
    _, data = payload(tmp_path)
    caplog.set_level(logging.INFO, logger="fedrelay.peer")
    tries = 40
    for _ in range(tries):
        with pytest.raises(TransferError):
            node.handoff(stream(header("r", data), corrupt(data)), caller=None)
    assert node.runs["r"].state == "assigned"
    receiving = [r for r in reports if r.state == "receiving"]
    assert len(receiving) == ANNOUNCED, len(receiving)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("run r:")]
    assert len(lines) <= 2 * ANNOUNCED + 1, lines
    node.handoff(stream(header("r", data), data), caller=None)  # the sender gets it right at last
    assert any(f"{tries} streams from site-a failed before this one was accepted" in r.getMessage()
               for r in caplog.records)
    assert (node.state_dir / "runs" / "r" / "received.safetensors").read_bytes() == data


# -- end notices quoting the sites' words ------------------------------------------------------------------
def test_an_end_notice_quoting_a_long_or_odd_error_is_one_the_sites_take():
    """A run's error may be longer than a site takes in EndRun (a site's 16 KiB failure text
    plus its name, several sites' evaluation errors joined) or hold control characters (a
    site's refusal details): the notice was refused by every site, and sent again forever."""
    from fedrelay import names

    ledger = Ledger(":memory:")
    service = CoordinatorService(ledger)
    for n in ("a", "b"):
        ledger.upsert_peer(n, "127.0.0.1:9", image_offers({"c": (5, 1)}), "cpu", "x")
    new_run(ledger, "r")
    ledger.finish_run("r", "failed", error="b: " + "x" * names.MAX_TEXT + "\x1b[2J\n", message="run failed")
    taken = []

    class Site:
        def EndRun(self, request, timeout):
            names.check_end_run(request)  # what the site's servicer checks first
            taken.append(request)
            return peer_pb2.EndRunReply(state="ended")

    service.notices.stub = lambda site: Site()
    service.notices.send_end_notices()
    assert len(taken) == 2 and ledger.pending_end_notices() == []
    assert taken[0].reason.startswith("b: xxx") and len(taken[0].reason) == names.MAX_TEXT
    service.close()
