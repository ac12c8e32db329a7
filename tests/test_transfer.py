"""The handoff over a real gRPC socket: good payloads are accepted and written; every bad one is
refused with a clear status, nothing is written, and the peer keeps serving."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import grpc
import pytest
import torch

from fedrelay.server import make_server
from fedrelay.tensors import encode_state
from fedrelay.transport import INSECURE
from fedrelay.datasets.fashion_mnist import FASHION_MNIST_CLASSES
from fedrelay.tasks.image_folder.data import load_site
from fedrelay.models import ModelSpec, build_model
from fedrelay.tasks.image_folder import spec as image_spec
from fedrelay.peer.node import PeerNode
from fedrelay.peer.servicer import PeerServicer
from fedrelay.peer.transfer import add_peer_servicer, send_model
from fedrelay.v1 import common_pb2, peer_pb2, peer_pb2_grpc

SPEC = image_spec("cnn", 1, (28, 28), 10)
CLASSES = sorted(FASHION_MNIST_CLASSES)


def assignment(run_id: str, order=("site-a", "site-b"), site: str = "site-b", rounds: int = 1) -> peer_pb2.Assignment:
    """site-b's assignment in a chain over ``order`` (its part of the plan from the real planner)."""
    from fedrelay.coordinator.plan import chain_plan

    part = chain_plan(list(order), rounds).part_pb(site, {n: f"127.0.0.1:{i + 1}" for i, n in enumerate(order)})
    return peer_pb2.Assignment(
        run_id=run_id, position=list(order).index(site), chain_length=len(order), seed=1, site=site,
        order=list(order), rounds=rounds, **part,
        params=common_pb2.TrainingParams(strategy="fedelmy", models_per_site=1, local_epochs=1, warmup_epochs=1,
                                         alpha=1, beta=1, lr=1e-3, batch_size=32, weight_decay=1e-4,
                                         selection="best-val"),
        model=image_spec("cnn", 1, (28, 28), 10).to_pb(),
        class_index=CLASSES)


@pytest.fixture(scope="module")
def peer(three_sites, tmp_path_factory):
    state = tmp_path_factory.mktemp("state")
    server, port = make_server("127.0.0.1:0")
    address = f"127.0.0.1:{port}"
    node = PeerNode("site-b", address, load_site(three_sites[0]), state, "cpu", None, start_workers=False)
    add_peer_servicer(PeerServicer(node), server)
    server.start()
    channel = INSECURE.channel(address)
    stub = peer_pb2_grpc.PeerStub(channel)
    for run_id in ("ok", "bad"):
        stub.Assign(assignment(run_id), timeout=10)
    yield node, stub, address
    channel.close()
    server.stop(0)


def payload(tmp_path: Path, spec: ModelSpec = SPEC, nan: bool = False) -> tuple[Path, bytes]:
    torch.manual_seed(0)
    state = build_model(spec).state_dict()
    if nan:
        next(v for v in state.values() if v.is_floating_point())[0] = float("nan")
    data = encode_state(state)
    path = tmp_path / "model.safetensors"
    path.write_bytes(data)
    return path, data


def header(run_id: str, data: bytes, **kw) -> common_pb2.TransferHeader:
    fields = dict(run_id=run_id, hop=1, sender="site-a", total_bytes=len(data),
                  sha256=hashlib.sha256(data).hexdigest(), purpose=common_pb2.CHAIN_HOP)
    fields.update(kw)
    return common_pb2.TransferHeader(**fields)


def stream(h: common_pb2.TransferHeader, data: bytes, chunk: int = 1 << 16):
    yield common_pb2.ModelChunk(header=h)
    for i in range(0, len(data), chunk):
        yield common_pb2.ModelChunk(data=data[i:i + chunk])


def run_files(node: PeerNode, run_id: str) -> set[str]:
    return {p.name for p in (node.state_dir / "runs" / run_id).rglob("*") if p.is_file()}


def test_good_handoff_is_verified_written_and_idempotent(peer, tmp_path):
    node, stub, address = peer
    path, data = payload(tmp_path)
    sent = send_model(address, header("ok", data), path)
    assert sent.receipt.received_bytes == len(data)
    assert sent.receipt.sha256 == hashlib.sha256(data).hexdigest()
    assert not sent.receipt.duplicate
    stored = node.state_dir / "runs" / "ok" / "received.safetensors"
    assert stored.read_bytes() == data
    assert sent.wire_bytes > len(data)  # framing and headers are counted on top of the payload
    again = send_model(address, header("ok", data), path)
    assert again.receipt.duplicate
    assert stored.read_bytes() == data
    # A different model for the same hop is refused and the accepted one is kept.
    torch.manual_seed(1)
    different = encode_state(build_model(SPEC).state_dict())
    with pytest.raises(grpc.RpcError) as err:
        stub.Handoff(stream(header("ok", different), different), timeout=10)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert stored.read_bytes() == data


def corrupt(data: bytes) -> bytes:
    b = bytearray(data)
    b[len(b) // 2] ^= 0xFF
    return bytes(b)


CASES = {
    "corrupted chunk": (lambda d: stream(header("bad", d), corrupt(d)), grpc.StatusCode.DATA_LOSS, "SHA-256"),
    "wrong digest": (lambda d: stream(header("bad", d, sha256="0" * 64), d), grpc.StatusCode.DATA_LOSS, "SHA-256"),
    "truncated": (lambda d: stream(header("bad", d + b"x" * 10), d), grpc.StatusCode.DATA_LOSS, "truncated"),
    "longer than declared": (lambda d: stream(header("bad", d[:-10]), d), grpc.StatusCode.OUT_OF_RANGE, "longer"),
    "wrong sender": (lambda d: stream(header("bad", d, sender="site-x"), d), grpc.StatusCode.PERMISSION_DENIED, "predecessor"),
    "wrong hop": (lambda d: stream(header("bad", d, hop=5), d), grpc.StatusCode.INVALID_ARGUMENT, "hop"),
    "unknown run": (lambda d: stream(header("nope", d), d), grpc.StatusCode.FAILED_PRECONDITION, "no assignment"),
    "oversized": (lambda d: stream(header("bad", d, total_bytes=1 << 40), d), grpc.StatusCode.RESOURCE_EXHAUSTED, "cap"),
    "no header": (lambda d: iter([common_pb2.ModelChunk(data=d[:100])]), grpc.StatusCode.INVALID_ARGUMENT, "header"),
    "not safetensors": (lambda d: stream(header("bad", b"\x00" * 4096), b"\x00" * 4096), grpc.StatusCode.INVALID_ARGUMENT, "safetensors"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_handoff_is_refused_and_nothing_is_written(peer, tmp_path, case):
    node, stub, _ = peer
    _, data = payload(tmp_path)
    make, code, words = CASES[case]
    before = run_files(node, "bad")
    with pytest.raises(grpc.RpcError) as err:
        stub.Handoff(make(data), timeout=10)
    assert err.value.code() == code, err.value.details()
    assert words in err.value.details()
    after = run_files(node, "bad")
    if case == "truncated":  # the one exception: the assigned sender's bytes stay for a resume
        kept = sorted(set(after) - set(before))
        assert len(kept) == 1 and kept[0].endswith(".part")
        (node.state_dir / "runs" / "bad" / kept[0]).unlink()
        after = run_files(node, "bad")
    assert after == before
    assert "received.safetensors" not in before
    assert stub.GetStatus(peer_pb2.StatusRequest(), timeout=5).name == "site-b"  # still serving


@pytest.mark.parametrize("what", ["shapes", "nan"])
def test_payload_that_is_not_the_runs_model_is_refused(peer, tmp_path, what):
    node, stub, _ = peer
    if what == "shapes":
        _, data = payload(tmp_path, spec=image_spec("cnn", 1, (28, 28), 7))
    else:
        _, data = payload(tmp_path, nan=True)
    with pytest.raises(grpc.RpcError) as err:
        stub.Handoff(stream(header("bad", data), data), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ("NaN" in err.value.details()) if what == "nan" else ("tensor" in err.value.details())
    assert "received.safetensors" not in run_files(node, "bad")


def test_assignment_for_another_site_or_shape_is_refused(peer):
    _, stub, _ = peer
    a = assignment("other")
    a.site = "site-z"
    with pytest.raises(grpc.RpcError) as err:
        stub.Assign(a, timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    a = assignment("other")
    a.model.input_json = '{"channels":1,"height":32,"width":28}'
    with pytest.raises(grpc.RpcError) as err:
        stub.Assign(a, timeout=5)
    assert "expects input" in err.value.details() and '"height":32' in err.value.details()


def test_progress_reports_never_block_the_caller(three_sites, tmp_path):
    """Progress (epochs, states) goes to the coordinator from one background thread: a
    coordinator that takes its full 5 s timeout per report (a link dropping packets) must not
    hold the training thread or a Handoff handler; the reports still arrive, in order."""
    import threading
    import time
    from types import SimpleNamespace

    from fedrelay.v1 import coordinator_pb2 as cpb

    got, release = [], threading.Event()

    def slow_report(report, timeout):
        release.wait(timeout)  # like a call whose packets are dropped, until the link is back
        got.append(report.epoch)

    link = SimpleNamespace(stub=SimpleNamespace(ReportProgress=slow_report))
    node = PeerNode("site-b", "127.0.0.1:1", load_site(three_sites[0]), tmp_path, "cpu", link, start_workers=False)
    started = time.monotonic()
    for epoch in range(1, 21):
        node.reporter.progress(cpb.ProgressReport(run_id="r", site="site-b", kind="epoch", epoch=epoch))
    assert time.monotonic() - started < 1.0  # 20 reports queued, none waited for
    release.set()
    deadline = time.monotonic() + 10
    while len(got) < 20 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert got == list(range(1, 21))


def test_end_run_stops_the_run_and_removes_partial_transfers(peer, tmp_path):
    node, stub, address = peer
    stub.Assign(assignment("ending"), timeout=10)
    folder = node.state_dir / "runs" / "ending"
    part = folder / f".received.safetensors.{'a' * 64}.part"  # a transfer that broke and never resumed
    part.write_bytes(b"x" * 1000)
    reply = stub.EndRun(peer_pb2.EndRunRequest(run_id="ending", status="finished", reason="routed around"), timeout=10)
    assert (reply.state, reply.removed_bytes) == ("ended", 1000)
    assert not part.exists() and (folder / "assignment.pb").exists()
    assert json.loads((folder / "state.json").read_text())["state"] == "ended"  # survives a restart
    path, data = payload(tmp_path)
    with pytest.raises(grpc.RpcError) as err:  # a late model for an ended run is refused
        stub.Handoff(stream(header("ending", data), data), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "ended" in err.value.details()
    assert not (folder / "received.safetensors").exists()
    again = stub.EndRun(peer_pb2.EndRunRequest(run_id="ending", status="finished"), timeout=10)
    assert (again.state, again.removed_bytes) == ("ended", 0)  # idempotent
    with pytest.raises(grpc.RpcError) as err:
        stub.EndRun(peer_pb2.EndRunRequest(run_id="never-assigned", status="failed"), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert stub.GetStatus(peer_pb2.StatusRequest(), timeout=5).name == "site-b"
