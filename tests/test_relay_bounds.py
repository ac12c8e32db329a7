"""The relay bounded like a peer's Handoff (docs/relay-bounds.md): only transfers a run's plan names
(the operator's relay: only with the coordinator's signed grant), the run's payload cap per
envelope, per-run and per-sender quotas, no compressed requests, a stall timeout, and expiry of
what is never fetched. Real relays on loopback over mutual TLS; an attacker holding one
enrolled site's certificate."""

from __future__ import annotations

import os
import threading
import time

import grpc
import pytest

from fedrelay import signing, transfer_bounds
from fedrelay.callers import COORDINATOR_IDENTITY
from fedrelay.calls import CHUNK_BYTES
from fedrelay.files import sha256_file
from fedrelay.server import make_server
from fedrelay.coordinator.relay_server import RelayService, serve_relay
from fedrelay.coordinator.relay_bounds import GRANT_SECONDS, CapUnknown, Permit, RelayLimits, issue_grant
from fedrelay.peer import relay_client
from fedrelay.receiving import partial_path
from fedrelay.v1 import common_pb2, relay_pb2, relay_pb2_grpc

MiB = 1 << 20
PUT = "/fedrelay.v1.Relay/Put"


def _start(federation, folder, relay_limits: RelayLimits):
    stop, ready, bound = threading.Event(), threading.Event(), []
    thread = threading.Thread(target=serve_relay, args=("127.0.0.1:0", folder), daemon=True, kwargs=dict(
        transport=federation["coordinator"], stop=stop, ready=ready, bound=bound, limits=relay_limits))
    thread.start()
    assert ready.wait(30)
    return bound[0], stop, thread


@pytest.fixture
def relay_with(federation, tmp_path):
    """``coordinator relay`` on loopback with the given ``RelayLimits``: returns (address, folder)."""
    started = []

    def start(**kw):
        folder = tmp_path / f"relay{len(started)}"
        address, stop, thread = _start(federation, folder, RelayLimits(**kw))
        started.append((stop, thread))
        return address, folder

    yield start
    for stop, thread in started:
        stop.set()
        thread.join(10)


def _t(index=1, sender="site-a", receiver="site-b", purpose=common_pb2.CHAIN_HOP) -> common_pb2.PlannedTransfer:
    return common_pb2.PlannedTransfer(purpose=purpose, index=index, round=1, sender=sender, receiver=receiver)


def _grant(federation, run_id, t, payload_cap=MiB, planned=4, signer="coordinator", now=None):
    ident = federation[signer]
    return issue_grant(signing.Signer(ident.key, ident.cert), run_id, t.purpose, t.index, t.sender, t.receiver,
                       Permit.for_plan(payload_cap, planned), now=now)


def _junk(tmp_path, size: int, name="junk.sealed") -> os.PathLike:
    path = tmp_path / name
    path.write_bytes(os.urandom(size))
    return path


def _stored(folder) -> list:
    """Every file the relay keeps (envelopes, partial uploads, meta files)."""
    return sorted(p for p in folder.rglob("*") if p.is_file())


def _put_code(address, federation, run_id, t, path, grant=None, sender="site-a"):
    with pytest.raises(grpc.RpcError) as err:
        relay_client.put(address, federation[sender], run_id, t, path, [0], grant=grant)
    return err.value


# -- only what the coordinator granted -------------------------------------------------------------
def test_the_operators_relay_refuses_made_up_runs_and_grants_not_the_coordinators(federation, relay_with, tmp_path):
    address, folder = relay_with()
    envelope = _junk(tmp_path, 100_000)
    t = _t()
    # No grant: a made-up run id is refused before a byte is kept (before: stored, 24 runs of 1 MiB).
    err = _put_code(address, federation, "made-up-run", t, envelope)
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "granted" in err.details()
    # A grant another site signed (the attacker's own key), one for another transfer, an expired one.
    err = _put_code(address, federation, "run-1", t, envelope, grant=_grant(federation, "run-1", t, signer="site-a"))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "not the coordinator's" in err.details()
    err = _put_code(address, federation, "run-1", _t(index=2), envelope, grant=_grant(federation, "run-1", t))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "another transfer" in err.details()
    old = _grant(federation, "run-1", t, now=time.time() - GRANT_SECONDS - 60)
    err = _put_code(address, federation, "run-1", t, envelope, grant=old)
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "expired" in err.details()
    # A grant whose body was changed (a bigger cap) no longer verifies.
    forged = _grant(federation, "run-1", t)
    forged.body = forged.body.replace(b'"max_bytes":', b'"max_bytes":9')
    err = _put_code(address, federation, "run-1", t, envelope, grant=forged)
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert _stored(folder) == []
    # The coordinator's grant for exactly this transfer: stored.
    sent = relay_client.put(address, federation["site-a"], "run-1", t, envelope, [0], grant=_grant(federation, "run-1", t))
    assert sent.receipt.stored_bytes == 100_000


def test_an_envelope_over_the_runs_payload_cap_is_refused_not_stored(federation, relay_with, tmp_path):
    address, folder = relay_with()
    t = _t()
    cap = 4 * 850_000 + MiB  # a run whose payload cap is 4.4 MB (transfer_bounds.payload_cap of a 0.85 MB model)
    assert cap == transfer_bounds.payload_cap(850_000)
    junk = _junk(tmp_path, 24 * MiB)
    err = _put_code(address, federation, "run-1", t, junk, grant=_grant(federation, "run-1", t, payload_cap=cap))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "cap" in err.details()
    assert _stored(folder) == []
    # At the cap plus the sealing overhead it fits.
    fits = _junk(tmp_path, transfer_bounds.sealed_cap(cap), "fits.sealed")
    sent = relay_client.put(address, federation["site-a"], "run-1", t, fits, [0],
                        grant=_grant(federation, "run-1", t, payload_cap=cap))
    assert sent.receipt.stored_bytes == transfer_bounds.sealed_cap(cap)


def test_a_runs_quota_and_a_senders_quota_bound_what_the_relay_holds(federation, relay_with, tmp_path):
    address, folder = relay_with(identity_envelopes=3)
    envelope = _junk(tmp_path, 50_000)
    # Run quota: its plan has 2 transfers, so a third envelope of the run is refused.
    for index in (1, 2):
        relay_client.put(address, federation["site-a"], "run-q", _t(index=index), envelope, [0],
                     grant=_grant(federation, "run-q", _t(index=index), planned=2))
    err = _put_code(address, federation, "run-q", _t(index=3), envelope,
                    grant=_grant(federation, "run-q", _t(index=3), planned=2))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "run run-q" in err.details()
    # Sender quota (3 envelopes over all runs): site-a's fourth is refused, in any run ...
    relay_client.put(address, federation["site-a"], "run-r", _t(), envelope, [0], grant=_grant(federation, "run-r", _t()))
    err = _put_code(address, federation, "run-s", _t(), envelope, grant=_grant(federation, "run-s", _t()))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "site-a" in err.details()
    # ... while another sender still gets its transfer through.
    t = _t(index=2, sender="site-c")
    relay_client.put(address, federation["site-c"], "run-s", t, envelope, [0], grant=_grant(federation, "run-s", t))
    # Once the receiver discarded one, site-a has room again (a resent envelope replaces, not adds).
    key = relay_pb2.RelayKey(run_id="run-r", purpose=common_pb2.CHAIN_HOP, index=1, receiver="site-b")
    relay_client.discard(address, federation["site-b"], key)
    relay_client.put(address, federation["site-a"], "run-s", _t(), envelope, [0], grant=_grant(federation, "run-s", _t()))
    assert len([p for p in _stored(folder) if p.suffix == ".sealed"]) == 4


def test_a_compressed_put_is_refused_and_leaves_nothing(federation, relay_with, tmp_path):
    """A declared upload of gzip-compressed zeros: before, a few KiB on the wire left many MiB
    on disk; now the relay accepts no compressed request at all."""
    address, folder = relay_with()
    t = _t()
    total = 8 * MiB
    header = common_pb2.TransferHeader(run_id="run-z", hop=1, purpose=common_pb2.CHAIN_HOP, sender="site-a",
                                       receiver="site-b", total_bytes=total, sha256="0" * 64)
    header.relay_grant.CopyFrom(_grant(federation, "run-z", t, payload_cap=16 * MiB))
    zeros = bytes(MiB)
    counter = []

    def stream():
        yield common_pb2.ModelChunk(header=header)
        for _ in range(total // MiB):
            counter.append(1)
            yield common_pb2.ModelChunk(data=zeros)

    with federation["site-a"].channel(address, expect=COORDINATOR_IDENTITY) as channel:
        put = channel.stream_unary(PUT, request_serializer=common_pb2.ModelChunk.SerializeToString,
                                   response_deserializer=relay_pb2.RelayReceipt.FromString)
        with pytest.raises(grpc.RpcError) as err:
            put(stream(), timeout=60, compression=grpc.Compression.Gzip)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED, err.value.details()
    assert [p for p in _stored(folder) if p.stat().st_size > 0 and p.suffix != ".json"] == []


def test_a_put_that_sends_nothing_is_dropped_after_the_stall_timeout(federation, relay_with, tmp_path):
    address, folder = relay_with(stall_timeout=0.5)
    t = _t()
    header = common_pb2.TransferHeader(run_id="run-st", hop=1, purpose=common_pb2.CHAIN_HOP, sender="site-a",
                                       receiver="site-b", total_bytes=MiB, sha256="0" * 64)
    header.relay_grant.CopyFrom(_grant(federation, "run-st", t))
    release = threading.Event()

    def silent():
        yield common_pb2.ModelChunk(header=header)
        release.wait(120)  # the client sends nothing more until the test ends

    # (A Put that sends not even its header is dropped earlier still, by the server's guard:
    # fedrelay/guard.py's deadline for the first request message.)
    started = time.monotonic()
    with federation["site-a"].channel(address, expect=COORDINATOR_IDENTITY) as channel:
        put = channel.stream_unary(PUT, request_serializer=common_pb2.ModelChunk.SerializeToString,
                                   response_deserializer=relay_pb2.RelayReceipt.FromString)
        try:
            with pytest.raises(grpc.RpcError) as err:
                put(silent(), timeout=90)
        finally:
            release.set()
    # The relay's own words: dropped at its stall timeout, not held until the caller's deadline.
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "stalled" in err.value.details(), err.value.details()
    assert time.monotonic() - started < 60


def test_envelopes_never_fetched_expire(federation, relay_with, tmp_path):
    address, folder = relay_with()
    t = _t()
    envelope = _junk(tmp_path, 3 * MiB)
    relay_client.put(address, federation["site-a"], "run-x", t, envelope, [0],
                 grant=_grant(federation, "run-x", t, payload_cap=4 * MiB))
    # A broken upload of another transfer leaves a partial one behind.
    chunks = iter([0])
    with pytest.raises(Exception):
        relay_client.put(address, federation["site-a"], "run-x", _t(index=2), envelope, [0],
                     cancelled=lambda: next(chunks, 1) == 1,
                     grant=_grant(federation, "run-x", _t(index=2), payload_cap=4 * MiB))
    service = RelayService(folder, limits=RelayLimits(lifetime=3600))
    dest2 = service.path("run-x", common_pb2.CHAIN_HOP, 2, "site-b")
    assert partial_path(dest2, sha256_file(envelope)).exists()
    assert service.sweep(force=True) == 0  # within their lifetime: kept
    removed = service.reservations.sweep(now=time.time() + 3601, force=True)
    assert removed == 3 * MiB + CHUNK_BYTES
    assert _stored(folder) == []
    key = relay_pb2.RelayKey(run_id="run-x", purpose=common_pb2.CHAIN_HOP, index=1, receiver="site-b")
    with pytest.raises(grpc.RpcError) as err:
        relay_client.fetch(address, federation["site-b"], key, "site-a", tmp_path / "b.sealed", 3 * MiB,
                       sha256_file(envelope), [0])
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_the_operators_relay_removes_expired_envelopes_on_its_own(federation, relay_with, tmp_path):
    address, folder = relay_with(lifetime=0.5, sweep_every=0.1)
    t = _t()
    relay_client.put(address, federation["site-a"], "run-y", t, _junk(tmp_path, 10_000), [0],
                 grant=_grant(federation, "run-y", t))
    deadline = time.monotonic() + 60
    while _stored(folder) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _stored(folder) == []


# -- the coordinator's own relay: permits from the ledger and the receiver ---------------------------
class _Ledger:
    def __init__(self, runs):
        self.runs = runs

    def run(self, run_id):
        return self.runs.get(run_id)


class _Plan:
    transfers = (object(), object(), object())


def _permits(runs, peer=None):
    from fedrelay.coordinator.relay_permits import RelayPermits

    planned = {("run-1", "chain", 1, "site-a", "site-b"), ("run-2", "chain", 1, "site-a", "site-b")}
    return RelayPermits(_Ledger(runs), lambda *k: object() if k in planned else None, lambda run_id: (0, _Plan()),
                        peer or (lambda site: (_ for _ in ()).throw(AssertionError("the receiver is not asked"))))


def _coordinator_relay(federation, folder, authorize):
    service = RelayService(folder, authorize=authorize)
    server, port = make_server("127.0.0.1:0", transport=federation["coordinator"])
    relay_pb2_grpc.add_RelayServicer_to_server(service, server)
    server.start()
    return server, f"127.0.0.1:{port}"


def test_the_coordinators_relay_takes_the_runs_cap_from_its_sizes_and_only_planned_transfers(federation, tmp_path):
    runs = {"run-1": {"run_id": "run-1", "status": "running", "model_bytes": 850_000, "upload_bytes": None},
            "run-9": {"run_id": "run-9", "status": "finished", "model_bytes": 850_000, "upload_bytes": None}}
    permits = _permits(runs)
    permit = permits.permit("run-1", common_pb2.CHAIN_HOP, 1, "site-a", "site-b")
    assert permit.max_bytes == transfer_bounds.sealed_cap(transfer_bounds.payload_cap(850_000)) and permit.run_envelopes == 3
    folder = tmp_path / "relay"
    server, address = _coordinator_relay(federation, folder, permits.permit)
    try:
        t = _t()
        err = _put_code(address, federation, "run-1", t, _junk(tmp_path, 24 * MiB))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for run_id, tt in (("run-1", _t(index=2)), ("run-9", t), ("made-up", t)):  # unplanned, ended, unknown
            err = _put_code(address, federation, run_id, tt, _junk(tmp_path, 1000))
            assert err.code() == grpc.StatusCode.PERMISSION_DENIED, run_id
        assert _stored(folder) == []
        relay_client.put(address, federation["site-a"], "run-1", t, _junk(tmp_path, 4 * MiB), [0])
    finally:
        server.stop(0)


def test_before_the_runs_sizes_are_known_the_receiver_states_its_cap(federation, tmp_path):
    from fedrelay.v1 import peer_pb2

    asked = []

    class Receiver:
        def __init__(self, answer):
            self.answer = answer

        def RelayQuota(self, request, timeout=None):  # noqa: N802 - a Peer stub's method
            asked.append(request.run_id)
            if isinstance(self.answer, Exception):
                raise self.answer
            return peer_pb2.RelayQuotaReply(payload_cap_bytes=self.answer)

    runs = {"run-2": {"run_id": "run-2", "status": "running", "model_bytes": None, "upload_bytes": None}}
    down = _permits(runs, peer=lambda site: Receiver(_unreachable()))
    with pytest.raises(CapUnknown, match="not known yet"):
        down.permit("run-2", common_pb2.CHAIN_HOP, 1, "site-a", "site-b")
    permits = _permits(runs, peer=lambda site: Receiver(2 * MiB))
    assert permits.permit("run-2", common_pb2.CHAIN_HOP, 1, "site-a", "site-b").max_bytes == transfer_bounds.sealed_cap(2 * MiB)
    permits.permit("run-2", common_pb2.CHAIN_HOP, 1, "site-a", "site-b")
    assert asked == ["run-2", "run-2"]  # once for the permits that could not ask, once for these (then kept)
    # Over loopback: an unreachable receiver makes the Put wait (UNAVAILABLE, the sender retries).
    folder = tmp_path / "relay"
    server, address = _coordinator_relay(federation, folder, down.permit)
    try:
        err = _put_code(address, federation, "run-2", _t(), _junk(tmp_path, 1000))
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "retry" in err.details()
    finally:
        server.stop(0)


def _unreachable():
    """What a Peer stub over a closed control stream raises."""
    from fedrelay.coordinator.tunnel_server import TunnelError

    return TunnelError(grpc.StatusCode.UNAVAILABLE, "site-b has no control stream open")


# -- the operator's relay with a real coordinator's grants ---------------------------------------------
def test_a_planned_sender_gets_a_grant_the_operators_relay_takes_and_nobody_else_does(federation, relay_with, tmp_path):
    from fedrelay.coordinator.ledger import Ledger
    from fedrelay.coordinator.plan import chain_plan
    from fedrelay.coordinator.service import CoordinatorService
    from fedrelay.v1 import coordinator_pb2 as cpb, coordinator_pb2_grpc

    sites = ["site-a", "site-b", "site-c"]
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ledger.create_run("run-g", strategy="fedelmy", arch="cnn", seed=1, params={},
                      chain=[{"name": n, "address": "127.0.0.1:9"} for n in sites], class_index=["x"], model={},
                      warnings=[], insecure=False, plan=chain_plan(sites).to_json())
    ledger.update_run("run-g", model_bytes=850_000)  # fixed by the run's first agreed transfer
    service = CoordinatorService(ledger, transport=federation["coordinator"], relay="127.0.0.1:1")
    server, port = make_server("127.0.0.1:0", transport=federation["coordinator"])
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(service, server)
    server.start()
    coordinator = f"127.0.0.1:{port}"
    relay, folder = relay_with()
    try:
        def grant(who, run_id="run-g", index=1, receiver="site-b"):
            with federation[who].channel(coordinator, expect="coordinator") as channel:
                return coordinator_pb2_grpc.CoordinatorStub(channel).GrantRelay(cpb.RelayGrantRequest(
                    run_id=run_id, purpose=common_pb2.CHAIN_HOP, index=index, receiver=receiver), timeout=30)

        t = _t()  # hop 1: site-a -> site-b
        mine = grant("site-a")
        # Only the planned sender of a planned transfer of a running run gets one.
        for who, kw in (("site-c", {}), ("site-a", {"run_id": "made-up"}), ("site-a", {"index": 2})):
            with pytest.raises(grpc.RpcError) as err:
                grant(who, **kw)
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, (who, kw)
        # The grant bounds the envelope by the run's cap: 24 MiB of junk is refused, a real-sized one kept.
        err = _put_code(relay, federation, "run-g", t, _junk(tmp_path, 24 * MiB), grant=mine)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert _stored(folder) == []
        sent = relay_client.put(relay, federation["site-a"], "run-g", t, _junk(tmp_path, 900_000, "ok.sealed"), [0],
                            grant=mine)
        assert sent.receipt.stored_bytes == 900_000
        # site-c cannot use site-a's grant (the relay checks the caller is the header's sender).
        err = _put_code(relay, federation, "run-g", t, _junk(tmp_path, 1000, "c.sealed"), grant=mine, sender="site-c")
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        # Once the run has ended, no grant.
        ledger.finish_run("run-g", "finished")
        with pytest.raises(grpc.RpcError) as err:
            grant("site-a")
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "not running" in err.value.details()
    finally:
        server.stop(0)
        service.close()
        ledger.close()


def test_a_resealed_envelope_replaces_the_one_held_and_a_refused_one_leaves_nothing(federation, relay_with, tmp_path):
    address, folder = relay_with()
    t = _t()
    first, second = _junk(tmp_path, 20_000, "1.sealed"), _junk(tmp_path, 30_000, "2.sealed")
    relay_client.put(address, federation["site-a"], "run-w", t, first, [0], grant=_grant(federation, "run-w", t))
    relay_client.put(address, federation["site-a"], "run-w", t, second, [0], grant=_grant(federation, "run-w", t))
    key = relay_pb2.RelayKey(run_id="run-w", purpose=common_pb2.CHAIN_HOP, index=1, receiver="site-b")
    got = relay_client.fetch(address, federation["site-b"], key, "site-a", tmp_path / "b.sealed", 30_000,
                         sha256_file(second), [0])
    assert got.path.read_bytes() == second.read_bytes()
    assert len([p for p in _stored(folder) if p.suffix == ".json"]) == 1  # one reservation for the transfer
    # A third whose bytes are not its declared digest: refused, and nothing of it or before it stays
    # behind (no envelope without a meta file, no reservation without an envelope).
    header = common_pb2.TransferHeader(run_id="run-w", hop=1, purpose=common_pb2.CHAIN_HOP, sender="site-a",
                                       receiver="site-b", total_bytes=1000, sha256="ab" * 32)
    header.relay_grant.CopyFrom(_grant(federation, "run-w", t))
    with federation["site-a"].channel(address, expect=COORDINATOR_IDENTITY) as channel:
        put = channel.stream_unary(PUT, request_serializer=common_pb2.ModelChunk.SerializeToString,
                                   response_deserializer=relay_pb2.RelayReceipt.FromString)
        with pytest.raises(grpc.RpcError) as err:
            put(iter([common_pb2.ModelChunk(header=header), common_pb2.ModelChunk(data=os.urandom(1000))]), timeout=30)
    assert err.value.code() == grpc.StatusCode.DATA_LOSS
    assert _stored(folder) == []


class _Context:
    def __init__(self, who):
        self.who = who

    def auth_context(self):
        return {"transport_security_type": [b"ssl"], "x509_common_name": [self.who.encode()]}

    def abort(self, code, message):
        raise grpc.RpcError(code, message)


def test_a_site_states_its_payload_cap_to_the_coordinator_only():
    from fedrelay.peer.servicer import PeerServicer
    from fedrelay.v1 import peer_pb2

    class Node:
        name = "site-b"

        def relay_quota(self, run_id):
            if run_id != "run-1":
                raise LookupError(f"unknown run {run_id!r}")
            return 4_400_000

    servicer = PeerServicer(Node())
    request = peer_pb2.RelayQuotaRequest(run_id="run-1")
    assert servicer.RelayQuota(request, _Context("coordinator")).payload_cap_bytes == 4_400_000
    with pytest.raises(grpc.RpcError) as err:
        servicer.RelayQuota(request, _Context("site-a"))
    assert err.value.args[0] == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.RpcError) as err:
        servicer.RelayQuota(peer_pb2.RelayQuotaRequest(run_id="run-2"), _Context("coordinator"))
    assert err.value.args[0] == grpc.StatusCode.NOT_FOUND


def test_a_grant_request_with_hostile_strings_is_invalid_argument(federation, tmp_path):
    from fedrelay.coordinator.ledger import Ledger
    from fedrelay.coordinator.service import CoordinatorService
    from fedrelay.v1 import coordinator_pb2 as cpb, coordinator_pb2_grpc

    ledger = Ledger(tmp_path / "ledger.sqlite")
    service = CoordinatorService(ledger, transport=federation["coordinator"], relay="127.0.0.1:1")
    server, port = make_server("127.0.0.1:0", transport=federation["coordinator"])
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(service, server)
    server.start()
    try:
        with federation["site-a"].channel(f"127.0.0.1:{port}", expect="coordinator") as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            for kw in ({"run_id": "[/]\x1b", "receiver": "site-b"}, {"run_id": "run-1", "receiver": "x" * 5000}):
                with pytest.raises(grpc.RpcError) as err:
                    stub.GrantRelay(cpb.RelayGrantRequest(purpose=common_pb2.CHAIN_HOP, index=1, **kw), timeout=30)
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, kw
    finally:
        server.stop(0)
        service.close()
        ledger.close()


def test_a_newer_put_of_the_same_transfer_ends_the_older_one(federation, relay_with, tmp_path):
    """As at a site's Handoff: one stream writes into an envelope; a sender that resumes after a
    link dropped (or an attacker opening many) ends the older stream, which keeps its bytes."""
    address, folder = relay_with()
    t = _t()
    envelope = _junk(tmp_path, 3 * MiB)
    grant = _grant(federation, "run-n", t, payload_cap=4 * MiB)
    header = common_pb2.TransferHeader(run_id="run-n", hop=1, purpose=common_pb2.CHAIN_HOP, sender="site-a",
                                       receiver="site-b", total_bytes=3 * MiB, sha256=sha256_file(envelope))
    header.relay_grant.CopyFrom(grant)
    first_sent, release, outcome = threading.Event(), threading.Event(), {}

    def older():
        yield common_pb2.ModelChunk(header=header)
        yield common_pb2.ModelChunk(data=envelope.read_bytes()[:MiB])
        first_sent.set()
        release.wait(120)

    def run_older():
        with federation["site-a"].channel(address, expect=COORDINATOR_IDENTITY) as channel:
            put = channel.stream_unary(PUT, request_serializer=common_pb2.ModelChunk.SerializeToString,
                                       response_deserializer=relay_pb2.RelayReceipt.FromString)
            try:
                put(older(), timeout=120)
            except grpc.RpcError as exc:
                outcome["code"], outcome["details"] = exc.code(), exc.details()

    thread = threading.Thread(target=run_older, daemon=True)
    thread.start()
    try:
        assert first_sent.wait(30)
        dest = RelayService(folder, limits=RelayLimits()).path("run-n", common_pb2.CHAIN_HOP, 1, "site-b")
        deadline = time.monotonic() + 30
        while held(dest, envelope) < MiB and time.monotonic() < deadline:  # the relay wrote the first MiB
            time.sleep(0.05)
        sent = relay_client.put(address, federation["site-a"], "run-n", t, envelope, [0], grant=grant)
        assert sent.resumed_from == MiB and sent.receipt.stored_bytes == 3 * MiB
        thread.join(30)
        assert outcome.get("code") == grpc.StatusCode.ABORTED, outcome
        assert dest.read_bytes() == envelope.read_bytes()
    finally:
        release.set()
        thread.join(10)


def held(dest, envelope) -> int:
    try:
        return partial_path(dest, sha256_file(envelope)).stat().st_size
    except FileNotFoundError:
        return 0
