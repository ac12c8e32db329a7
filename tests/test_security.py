"""Security over real mutual-TLS sockets on loopback: who may call what (identity = certificate
name), refused certificates (another CA, expired, none, plaintext), replays, hostile payloads and
streams, stalled senders. Every refusal is a clear status, nothing on disk changes, and the
daemon keeps serving."""

from __future__ import annotations

import datetime as dt
import hashlib
import struct
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

from fedrelay import signing
from fedrelay.server import make_server
from fedrelay.tensors import encode_state
from fedrelay.transport import INSECURE, Transport, TransportError
from fedrelay.coordinator import pki
from fedrelay.tasks.image_folder.data import load_site
from fedrelay.models import ModelSpec, build_model
from fedrelay.tasks.image_folder import spec as image_spec
from conftest import registration, start_coordinator
from fedrelay.peer.node import PeerNode
from fedrelay.peer.reporting import CoordinatorLink
from fedrelay.peer.servicer import PeerServicer
from fedrelay.peer.transfer import add_peer_servicer, send_model
from fedrelay.v1 import common_pb2, coordinator_pb2 as cpb, coordinator_pb2_grpc, peer_pb2, peer_pb2_grpc

from test_transfer import CLASSES, stream
from test_transfer import assignment as transfer_assignment

SPEC = image_spec("cnn", 1, (28, 28), 10)
ORDER = ["site-a", "site-b", "site-c"]
STALL = 1.0  # the test peer's --stall-timeout, seconds


# -- PKI and identities --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ids(tmp_path_factory) -> dict[str, Transport]:
    root = tmp_path_factory.mktemp("pki")
    pki.init_ca(root / "pki")
    out = {"coordinator": Transport.from_dir(root / "pki" / "coordinator"),
           "operator": Transport.from_dir(root / "pki" / "operator")}
    for name in ORDER:
        out[name] = Transport.from_dir(pki.enroll(name, root / "pki", root / name))
    # Another CA with identities of the same names: a different federation, or an attacker's.
    pki.init_ca(root / "rogue")
    out["rogue-coordinator"] = Transport.from_dir(root / "rogue" / "coordinator")
    out["rogue-site-a"] = Transport.from_dir(pki.enroll("site-a", root / "rogue", root / "rogue-a"))
    # site-a's certificate from the right CA, expired a week ago.
    expired = pki.enroll("site-a", root / "pki", root / "expired-a", days=1,
                         not_before=dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=8))
    with pytest.raises(TransportError, match="valid from"):
        Transport.from_dir(expired)  # the CLI refuses it up front...
    out["expired-site-a"] = Transport(key=(expired / "key.pem").read_bytes(),
                                      cert=(expired / "cert.pem").read_bytes(),
                                      ca=(expired / "ca.pem").read_bytes(), identity="site-a")
    out["_root"] = root
    return out


def assignment(run_id: str) -> peer_pb2.Assignment:
    """site-b's assignment in a 3-site chain over ORDER (test_transfer's, with site-c after it)."""
    return transfer_assignment(run_id, order=ORDER)


RUNS = ("replay", "bad", "fuzz", "final", "after", "stall", "cut")


def start_peer(site_dir: Path, state: Path, ids, runs=RUNS, guard=None) -> tuple[grpc.Server, PeerNode, str]:
    """site-b's daemon over mutual TLS (its servicer and node, as `peer serve` builds them), with
    ``runs`` assigned (site-a -> site-b -> site-c) and ``guard`` (default: ``server.make_server``'s).
    Returns (server, node, address); stop the server when done."""
    server, port = make_server("127.0.0.1:0", transport=ids["site-b"], guard=guard)
    address = f"127.0.0.1:{port}"
    node = PeerNode("site-b", address, load_site(site_dir), state, "cpu", None, start_workers=False,
                    transport=ids["site-b"], stall_timeout=STALL)
    add_peer_servicer(PeerServicer(node), server)
    server.start()
    coord = stub(ids["coordinator"], address)
    for run_id in runs:
        coord.Assign(assignment(run_id), timeout=10)
    return server, node, address


@pytest.fixture(scope="module")
def peer(three_sites, tmp_path_factory, ids):
    """site-b's daemon over mutual TLS: (node, address)."""
    server, node, address = start_peer(three_sites[0], tmp_path_factory.mktemp("state-b"), ids)
    yield node, address
    server.stop(0)


def stub(transport: Transport, address: str, expect: str | None = "site-b") -> peer_pb2_grpc.PeerStub:
    return peer_pb2_grpc.PeerStub(transport.channel(address, expect=expect))


def healthy(ids, address: str) -> None:
    assert stub(ids["coordinator"], address).GetStatus(peer_pb2.StatusRequest(), timeout=5).name == "site-b"


def snapshot(node: PeerNode, run_id: str) -> dict[str, tuple]:
    """Every file of the run (temp files included) with its size, mtime and inode."""
    return {str(p.relative_to(node.state_dir)): (p.stat().st_size, p.stat().st_mtime_ns, p.stat().st_ino)
            for p in (node.state_dir / "runs" / run_id).rglob("*") if p.is_file()}


def model_bytes(seed: int = 0, spec: ModelSpec = SPEC) -> bytes:
    torch.manual_seed(seed)
    return encode_state(build_model(spec).state_dict())


def header(run_id: str, data: bytes, **kw) -> common_pb2.TransferHeader:
    fields = dict(run_id=run_id, hop=1, sender="site-a", total_bytes=len(data),
                  sha256=hashlib.sha256(data).hexdigest(), purpose=common_pb2.CHAIN_HOP)
    fields.update(kw)
    return common_pb2.TransferHeader(**fields)


GOOD = model_bytes()


# -- who may connect -----------------------------------------------------------------------------
def channel_as(ids, who: str, address: str, expect: str) -> grpc.Channel:
    """A channel to the server ``expect`` (its certificate name) at ``address`` as ``who``: an
    identity of ``ids``, ``"no certificate"`` (TLS that trusts the federation's CA and presents
    no client certificate) or ``"plaintext"``."""
    if who == "no certificate":
        return grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=ids["site-a"].ca),
                                   options=[("grpc.ssl_target_name_override", expect)])
    if who == "plaintext":
        return INSECURE.channel(address)
    return ids[who].channel(address, expect=expect)


@pytest.mark.parametrize("who", ["rogue-coordinator", "rogue-site-a", "expired-site-a", "no certificate", "plaintext"])
def test_connection_without_an_enrolled_valid_certificate_is_refused(peer, ids, who):
    node, address = peer
    ch = channel_as(ids, who, address, "site-b")
    before = snapshot(node, "bad")
    with ch:
        for call in (lambda s: s.GetStatus(peer_pb2.StatusRequest(), timeout=5),
                     lambda s: s.Handoff(stream(header("bad", GOOD), GOOD), timeout=5)):
            with pytest.raises(grpc.RpcError) as err:
                call(peer_pb2_grpc.PeerStub(ch))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # the handshake fails: no call at all
    assert snapshot(node, "bad") == before
    healthy(ids, address)


def test_client_refuses_a_server_with_another_identity(peer, ids):
    """site-a dialing "site-c" at site-b's address (a peer posing as another) or "coordinator"
    (a peer posing as the coordinator): the server's certificate does not name it."""
    _, address = peer
    for expect in ("site-c", "coordinator"):
        with pytest.raises(grpc.RpcError) as err:
            stub(ids["site-a"], address, expect=expect).GetStatus(peer_pb2.StatusRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    link = CoordinatorLink(address, ids["site-a"])  # a peer's coordinator link pointed at a site
    with pytest.raises(grpc.RpcError) as err:
        link.call("Register", cpb.RegisterRequest(name="site-a", address="127.0.0.1:1"))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    link.close()


# -- the peer's authorization --------------------------------------------------------------------
@pytest.mark.parametrize("who", ["site-a", "site-c", "operator"])
def test_only_the_coordinator_may_assign_evaluate_fetch_or_ask_status(peer, ids, who):
    node, address = peer
    s = stub(ids[who], address)
    calls = {
        "Assign": lambda: s.Assign(assignment("sneaky"), timeout=5),
        "GetStatus": lambda: s.GetStatus(peer_pb2.StatusRequest(), timeout=5),
        "Evaluate": lambda: s.Evaluate(peer_pb2.EvaluateRequest(run_id="replay"), timeout=5),
        "FetchModel": lambda: list(s.FetchModel(peer_pb2.FetchModelRequest(run_id="replay"), timeout=5)),
        "Reroute": lambda: s.Reroute(peer_pb2.RerouteRequest(run_id="replay", route_version=99), timeout=5),
        "EndRun": lambda: s.EndRun(peer_pb2.EndRunRequest(run_id="replay", status="failed"), timeout=5),
    }
    states = {r.run_id: r.state for r in node.runs.values()}
    for name, call in calls.items():
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, name
        assert "only the coordinator" in err.value.details() and repr(who) in err.value.details()
    assert "sneaky" not in node.runs
    assert {r.run_id: r.state for r in node.runs.values()} == states  # nothing ended or rerouted
    healthy(ids, address)


def test_handoff_only_from_the_assigned_predecessor_and_a_replay_has_no_effect(peer, ids):
    node, address = peer
    # Not the predecessor: site-c (even claiming to be site-a in the header), the operator, the coordinator.
    for who, sender in (("site-c", "site-c"), ("site-c", "site-a"), ("operator", "site-a"), ("coordinator", "site-a")):
        with pytest.raises(grpc.RpcError) as err:
            stub(ids[who], address).Handoff(stream(header("replay", GOOD, sender=sender), GOOD), timeout=10)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "predecessor" in err.value.details()
    # The predecessor with someone else's name in the header.
    with pytest.raises(grpc.RpcError) as err:
        stub(ids["site-a"], address).Handoff(stream(header("replay", GOOD, sender="site-c"), GOOD), timeout=10)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert snapshot(node, "replay").keys() == {"runs/replay/assignment.pb", "runs/replay/state.json"}
    # The predecessor: accepted once.
    first = stub(ids["site-a"], address).Handoff(stream(header("replay", GOOD), GOOD), timeout=10)
    assert not first.duplicate and first.sha256 == hashlib.sha256(GOOD).hexdigest()
    assert (node.state_dir / "runs" / "replay" / "received.safetensors").read_bytes() == GOOD
    before, state = snapshot(node, "replay"), node.runs["replay"].state
    # The same (run, hop, digest) again: from another site it is refused; from the predecessor
    # (its own retry) it is acknowledged as already delivered, with no effect at all.
    with pytest.raises(grpc.RpcError) as err:
        stub(ids["site-c"], address).Handoff(stream(header("replay", GOOD), GOOD), timeout=10)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    again = stub(ids["site-a"], address).Handoff(stream(header("replay", GOOD), GOOD), timeout=10)
    assert again.duplicate and again.sha256 == first.sha256 and again.hop == 1
    # A different model for the same hop is refused.
    other = model_bytes(seed=1)
    with pytest.raises(grpc.RpcError) as err:
        stub(ids["site-a"], address).Handoff(stream(header("replay", other), other), timeout=10)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert snapshot(node, "replay") == before and node.runs["replay"].state == state
    healthy(ids, address)


def test_final_model_only_from_the_runs_last_site(peer, ids):
    node, address = peer
    for who in ("site-a", "coordinator"):
        with pytest.raises(grpc.RpcError) as err:
            stub(ids[who], address).Handoff(stream(header("final", GOOD, hop=0, sender="site-c",
                                                          purpose=common_pb2.FINAL_MODEL), GOOD), timeout=10)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "last site" in err.value.details()
    receipt = stub(ids["site-c"], address).Handoff(
        stream(header("final", GOOD, hop=0, sender="site-c", purpose=common_pb2.FINAL_MODEL), GOOD), timeout=10)
    assert not receipt.duplicate
    assert (node.state_dir / "runs" / "final" / "final.safetensors").read_bytes() == GOOD


# -- hostile payloads and streams ------------------------------------------------------------------
def _raw_safetensors(header_json: bytes, body: bytes, declared: int | None = None) -> bytes:
    return struct.pack("<Q", len(header_json) if declared is None else declared) + header_json + body


def _state(**changes) -> dict:
    torch.manual_seed(0)
    state = build_model(SPEC).state_dict()
    for k, v in changes.items():
        changes[k](state)
    return state


def _first_float(state):
    return next(k for k, v in state.items() if v.is_floating_point())


def _poison(value):
    def f(state):
        state[_first_float(state)].view(-1)[3] = value
    return f


def _rename(state):
    k = _first_float(state)
    state["evil." + k] = state.pop(k)


def _reshape(state):
    k = _first_float(state)
    state[k] = torch.zeros(state[k].numel() + 1)


def _retype(state):
    k = _first_float(state)
    state[k] = state[k].double()


def _extra(state):
    state["extra"] = torch.zeros(3)


PAYLOADS = {
    "not safetensors": (lambda: b"\x00" * 4096, "safetensors"),
    "pickle": (lambda: b"\x80\x04\x95" + b"cos\nsystem\n" * 50, "safetensors"),
    "oversized header": (lambda: _raw_safetensors(b"{}", b"", declared=(1 << 40)), "safetensors"),
    "header longer than the payload": (lambda: _raw_safetensors(b'{"a":1}' + b" " * 10, b"", declared=4000), "safetensors"),
    "inconsistent offsets": (lambda: _raw_safetensors(
        b'{"w":{"dtype":"F32","shape":[4,4],"data_offsets":[0,64000]}}', b"\x00" * 64), "safetensors"),
    "overlapping tensors": (lambda: _raw_safetensors(
        b'{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},"b":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}',
        b"\x00" * 16), "safetensors"),
    "header not json": (lambda: _raw_safetensors(b"\xff\xfe{not json", b"\x00" * 16), "safetensors"),
    "wrong tensor names": (lambda: encode_state(_state(r=_rename)), "names"),
    "an extra tensor": (lambda: encode_state(_state(r=_extra)), "names"),
    "wrong shape": (lambda: encode_state(_state(r=_reshape)), "tensor"),
    "wrong dtype": (lambda: encode_state(_state(r=_retype)), "tensor"),
    "NaN": (lambda: encode_state(_state(r=_poison(float("nan")))), "NaN"),
    "Inf": (lambda: encode_state(_state(r=_poison(float("inf")))), "Inf"),
    "another model": (lambda: model_bytes(spec=image_spec("cnn", 1, (28, 28), 7)), "tensor"),
}


@pytest.mark.parametrize("case", sorted(PAYLOADS))
def test_malformed_payload_is_refused_and_nothing_changes(peer, ids, case):
    node, address = peer
    make, words = PAYLOADS[case]
    data = make()
    before = snapshot(node, "bad")
    with pytest.raises(grpc.RpcError) as err:
        stub(ids["site-a"], address).Handoff(stream(header("bad", data), data), timeout=20)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert "payload refused" in err.value.details() and words in err.value.details(), err.value.details()
    assert snapshot(node, "bad") == before
    healthy(ids, address)


def _chunks(data: bytes, size: int = 1 << 16) -> list[common_pb2.ModelChunk]:
    return [common_pb2.ModelChunk(data=data[i:i + size]) for i in range(0, len(data), size)]


def _hm(**kw) -> common_pb2.ModelChunk:
    return common_pb2.ModelChunk(header=header("bad", GOOD, **kw))


STREAMS = {
    "truncated": (lambda: [_hm()] + _chunks(GOOD[:-1]), grpc.StatusCode.DATA_LOSS, "truncated"),
    "longer than declared": (lambda: [_hm()] + _chunks(GOOD + b"\x00"), grpc.StatusCode.OUT_OF_RANGE, "longer"),
    "chunks out of order": (lambda: [_hm()] + list(reversed(_chunks(GOOD))), grpc.StatusCode.DATA_LOSS, "SHA-256"),
    "data before the header": (lambda: _chunks(GOOD)[:1] + [_hm()] + _chunks(GOOD)[1:], grpc.StatusCode.INVALID_ARGUMENT, "header"),
    "a second header": (lambda: [_hm()] + _chunks(GOOD)[:2] + [_hm()] + _chunks(GOOD)[2:], grpc.StatusCode.INVALID_ARGUMENT, "second header"),
    "wrong SHA-256": (lambda: [_hm(sha256="ab" * 32)] + _chunks(GOOD), grpc.StatusCode.DATA_LOSS, "SHA-256"),
    "malformed SHA-256": (lambda: [_hm(sha256="xyz")] + _chunks(GOOD), grpc.StatusCode.INVALID_ARGUMENT, "sha256"),
    "declared size above the cap": (lambda: [_hm(total_bytes=len(GOOD) * 5 + (2 << 20))] + _chunks(GOOD),
                                    grpc.StatusCode.RESOURCE_EXHAUSTED, "cap"),
    "empty": (lambda: [], grpc.StatusCode.INVALID_ARGUMENT, "header"),
    "wrong hop": (lambda: [_hm(hop=2)] + _chunks(GOOD), grpc.StatusCode.INVALID_ARGUMENT, "hop"),
    "unknown run": (lambda: [common_pb2.ModelChunk(header=header("nope", GOOD))] + _chunks(GOOD),
                    grpc.StatusCode.FAILED_PRECONDITION, "no assignment"),
}


@pytest.mark.parametrize("case", sorted(STREAMS))
def test_malformed_stream_is_refused_and_nothing_changes(peer, ids, case):
    node, address = peer
    make, code, words = STREAMS[case]
    before = snapshot(node, "bad")
    with pytest.raises(grpc.RpcError) as err:
        stub(ids["site-a"], address).Handoff(iter(make()), timeout=20)
    assert err.value.code() == code, err.value.details()
    assert words in err.value.details(), err.value.details()
    after = snapshot(node, "bad")
    if case == "truncated":  # the assigned sender's bytes are kept for a resume, and nothing else
        kept = {k: v for k, v in after.items() if k not in before}
        assert [(Path(k).name.endswith(".part"), v[0]) for k, v in kept.items()] == [(True, len(GOOD) - 1)]
        for k in kept:
            (node.state_dir / k).unlink()
        after = snapshot(node, "bad")
    assert after == before
    healthy(ids, address)


def test_stalled_sender_is_dropped_its_bytes_kept_and_the_transfer_resumes(peer, ids, tmp_path):
    node, address = peer
    half = threading.Event()
    run_dir = node.state_dir / "runs" / "stall"

    def stalling():
        yield common_pb2.ModelChunk(header=header("stall", GOOD))
        yield from _chunks(GOOD[: len(GOOD) // 2])
        half.set()
        time.sleep(STALL * 4)  # then nothing: the receiver must give up after STALL seconds
        yield from _chunks(GOOD[len(GOOD) // 2:])

    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        stub(ids["site-a"], address).Handoff(stalling(), timeout=30)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "stalled" in err.value.details()
    assert time.monotonic() - started < STALL * 4  # dropped by the receiver, not by the sender's deadline
    assert node.runs["stall"].state == "assigned"
    assert not (run_dir / "received.safetensors").exists()
    # The legitimate sender's bytes stay, fsynced, for a resume (one partial file, no more).
    parts = list(run_dir.glob(".*.part"))
    assert [p.stat().st_size for p in parts] == [len(GOOD) // 2]
    healthy(ids, address)
    # Only that sender learns the offset.
    for who in ("site-c", "operator"):
        with pytest.raises(grpc.RpcError) as err:
            stub(ids[who], address).TransferOffset(header("stall", GOOD, sender=who), timeout=10)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    held = stub(ids["site-a"], address).TransferOffset(header("stall", GOOD), timeout=10)
    assert (held.offset, held.complete) == (len(GOOD) // 2, False)
    # Claiming more than is held is refused, and loses nothing.
    with pytest.raises(grpc.RpcError) as err:
        stub(ids["site-a"], address).Handoff(iter([common_pb2.ModelChunk(header=header(
            "stall", GOOD, offset=len(GOOD) // 2 + 1))]), timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert [p.stat().st_size for p in run_dir.glob(".*.part")] == [len(GOOD) // 2]
    # The sender's own code resumes there; the digest covers the whole payload.
    path = tmp_path / "m.safetensors"
    path.write_bytes(GOOD)
    sent = send_model(address, header("stall", GOOD), path, transport=ids["site-a"], expect="site-b")
    assert sent.resumed_from == len(GOOD) // 2 and not sent.receipt.duplicate
    assert sent.wire_bytes < len(GOOD) * 0.6
    assert (run_dir / "received.safetensors").read_bytes() == GOOD
    assert not list(run_dir.glob(".*.part"))
    again = stub(ids["site-a"], address).TransferOffset(header("stall", GOOD), timeout=10)
    assert again.complete


def test_a_cut_stream_resumes_and_a_bad_resume_loses_the_partial(peer, ids):
    """A stream cut mid-way (the call cancelled: a lost link) keeps its bytes; a resumed stream
    whose whole payload fails the digest is refused and its partial removed (the next try
    starts from byte 0); a stream for another digest replaces an older partial."""
    node, address = peer
    run_dir = node.state_dir / "runs" / "cut"
    other = model_bytes(seed=5)

    def cut(data: bytes, n: int) -> None:
        """Send the header and the first n bytes, then cancel the call (the link is lost)."""
        gate = threading.Event()

        def chunks():
            yield common_pb2.ModelChunk(header=header("cut", data))
            yield from _chunks(data[:n])
            gate.wait(10)

        call = stub(ids["site-a"], address).Handoff.future(chunks(), timeout=10)
        part = run_dir / f".received.safetensors.{hashlib.sha256(data).hexdigest()}.part"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (part.exists() and part.stat().st_size == n):
            time.sleep(0.02)
        call.cancel()
        gate.set()
        while time.monotonic() < deadline and len(node.streams):  # the receiver has ended the stream
            time.sleep(0.02)

    cut(other, 1 << 16)
    assert [p.stat().st_size for p in run_dir.glob(".*.part")] == [1 << 16]
    cut(GOOD, 3 << 16)
    # One partial, of the newest digest, with every byte the receiver got.
    held = stub(ids["site-a"], address).TransferOffset(header("cut", GOOD), timeout=10).offset
    parts = list(run_dir.glob(".*.part"))
    assert len(parts) == 1 and hashlib.sha256(GOOD).hexdigest() in parts[0].name
    assert held == 3 << 16
    # A resume whose bytes do not add up to the declared digest: refused, partial gone.
    tampered = bytearray(GOOD)
    tampered[held + 10] ^= 0xFF
    with pytest.raises(grpc.RpcError) as err:
        stub(ids["site-a"], address).Handoff(iter([common_pb2.ModelChunk(header=header("cut", GOOD, offset=held)),
                                                   *_chunks(bytes(tampered[held:]))]), timeout=10)
    assert err.value.code() == grpc.StatusCode.DATA_LOSS
    assert not list(run_dir.glob(".*.part"))
    assert stub(ids["site-a"], address).TransferOffset(header("cut", GOOD), timeout=10).offset == 0
    assert not (run_dir / "received.safetensors").exists()
    healthy(ids, address)


@pytest.fixture(scope="module")
def coordinator(ids, tmp_path_factory):
    server, address, ledger = start_coordinator(tmp_path_factory.mktemp("ledger") / "l.sqlite", ids)
    yield address, ledger
    server.stop(0)
    ledger.close()


def cstub(transport: Transport, address: str, signed: bool = True) -> coordinator_pb2_grpc.CoordinatorStub:
    """A stub to the coordinator with ``transport``'s identity; its reports are signed with that
    identity's key, as a peer's are (``signed=False``: sent as given)."""
    stub = coordinator_pb2_grpc.CoordinatorStub(transport.channel(address, expect="coordinator"))
    return signing.SigningStub(stub, signing.signer_for(transport)) if signed else stub


def test_coordinator_takes_registrations_and_reports_only_from_the_site_itself(coordinator, ids):
    address, ledger = coordinator
    assert cstub(ids["site-a"], address).Register(registration("site-a"), timeout=5).heartbeat_seconds > 0
    denied = {
        "site-a as site-b": lambda: cstub(ids["site-a"], address).Register(registration("site-b"), timeout=5),
        "operator as a site": lambda: cstub(ids["operator"], address).Register(registration("operator"), timeout=5),
        "coordinator as a site": lambda: cstub(ids["coordinator"], address).Register(registration("site-c"), timeout=5),
        "hop as another": lambda: cstub(ids["site-a"], address).ReportHop(
            cpb.HopReport(run_id="r", hop=1, purpose=common_pb2.CHAIN_HOP, sender="site-b", receiver="site-c",
                          sha256="ab" * 32), timeout=5),
        "progress as another": lambda: cstub(ids["site-a"], address).ReportProgress(
            cpb.ProgressReport(run_id="r", site="site-b", kind="state", state="training"), timeout=5),
        "final as another": lambda: cstub(ids["site-a"], address).ReportFinal(
            cpb.FinalReport(run_id="r", site="site-c", sha256="ab" * 32), timeout=5),
        "failure as another": lambda: cstub(ids["site-a"], address).ReportFailure(
            cpb.FailureReport(run_id="r", site="site-b"), timeout=5),
    }
    for what, call in denied.items():
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, what
    assert [p["name"] for p in ledger.peers()] == ["site-a"]


def test_operator_calls_only_from_the_operator(coordinator, ids):
    address, _ = coordinator
    for who in ("operator", "coordinator"):
        cstub(ids[who], address).ListRuns(cpb.ListRunsRequest(), timeout=5)
        cstub(ids[who], address).ListPeers(cpb.ListPeersRequest(), timeout=5)
    site = cstub(ids["site-a"], address)
    for name, call in {
        "StartChain": lambda: site.StartChain(cpb.StartChainRequest(seed=1), timeout=5),
        "ListRuns": lambda: site.ListRuns(cpb.ListRunsRequest(), timeout=5),
        "ListPeers": lambda: site.ListPeers(cpb.ListPeersRequest(), timeout=5),
        "GetRun": lambda: site.GetRun(cpb.GetRunRequest(run_id="x"), timeout=5),
        "WatchRun": lambda: list(site.WatchRun(cpb.WatchRunRequest(run_id="x"), timeout=5)),
        "FetchModel": lambda: list(site.FetchModel(peer_pb2.FetchModelRequest(run_id="x"), timeout=5)),
    }.items():
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, name
        assert "only the operator" in err.value.details()


@pytest.mark.parametrize("who", ["rogue-site-a", "expired-site-a", "no certificate", "plaintext"])
def test_coordinator_refuses_connections_without_a_valid_enrolled_certificate(coordinator, ids, who):
    address, ledger = coordinator
    ch = channel_as(ids, who, address, "coordinator")
    with ch, pytest.raises(grpc.RpcError) as err:
        coordinator_pb2_grpc.CoordinatorStub(ch).Register(registration("site-a"), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    cstub(ids["operator"], address).ListRuns(cpb.ListRunsRequest(), timeout=5)  # still serving


def test_the_received_bytes_are_never_unpickled():
    """Nothing in fedrelay calls pickle or torch.load (received models are parsed by safetensors)."""
    from conftest import REPO

    for folder in ("fedrelay", "peer", "coordinator", "cli", "deploy"):
        for path in (REPO / folder).rglob("*.py"):
            text = path.read_text()
            for word in ("import pickle", "torch.load(", "pickle.load", "weights_only"):
                assert word not in text, f"{path}: {word}"
