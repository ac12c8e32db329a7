"""Sites that only connect out (docs/how-to/firewall.md): the relay (sealed envelopes, who may put and get,
resume through it) and a real trial whose outbound-only sites get their models through it with
the same final digest as the direct run."""

from __future__ import annotations

import json
import os

import grpc
import pytest

from fedrelay import sealing
from fedrelay.callers import caller_identity
from fedrelay.calls import CHUNK_BYTES
from fedrelay.transport import INSECURE, Transport
from fedrelay.coordinator import pki
from fedrelay.coordinator.relay_server import RelayService
from fedrelay.peer import relay_client
from fedrelay.receiving import TransferError, partial_path
from fedrelay.v1 import common_pb2, relay_pb2

pytestmark = pytest.mark.system


@pytest.fixture
def relay(federation, tmp_path):
    """``coordinator relay`` (the Relay service alone) on loopback, mutual TLS, keeping a copy of
    every envelope it held."""
    import threading

    from fedrelay.coordinator.relay_server import serve_relay

    held: list[bytes] = []
    stop, ready, bound = threading.Event(), threading.Event(), []
    folder = tmp_path / "relay"
    thread = threading.Thread(target=serve_relay, args=("127.0.0.1:0", folder), daemon=True, kwargs=dict(
        transport=federation["coordinator"], stop=stop, ready=ready, bound=bound,
        on_stored=lambda p: held.append(p.read_bytes())))
    thread.start()
    assert ready.wait(30)
    yield bound[0], RelayService(folder), held
    stop.set()
    thread.join(10)


def test_the_relay_runs_alone_only_with_the_coordinator_identity(federation, tmp_path):
    from fedrelay.coordinator.relay_server import serve_relay

    with pytest.raises(ValueError, match="mutual TLS"):
        serve_relay("127.0.0.1:0", tmp_path, transport=INSECURE)
    with pytest.raises(ValueError, match="coordinator's identity"):
        serve_relay("127.0.0.1:0", tmp_path, transport=federation["site-a"])


def _transfer(sender="site-a", receiver="site-b") -> common_pb2.PlannedTransfer:
    return common_pb2.PlannedTransfer(purpose=common_pb2.CHAIN_HOP, index=1, round=1, sender=sender, receiver=receiver)


def _grant(federation, run_id: str, t: common_pb2.PlannedTransfer, cap: int = 64 << 20) -> common_pb2.RelayGrant:
    """The coordinator's grant of ``t`` (what ``Coordinator.GrantRelay`` answers a planned sender)."""
    from fedrelay import signing
    from fedrelay.coordinator.relay_bounds import Permit, issue_grant

    c = federation["coordinator"]
    return issue_grant(signing.Signer(c.key, c.cert), run_id, t.purpose, t.index, t.sender, t.receiver,
                       Permit.for_plan(cap, 4))


def test_the_relay_holds_only_ciphertext_and_gives_it_to_its_receiver_only(federation, relay, tmp_path):
    address, service, held = relay
    a, b, c = federation["site-a"], federation["site-b"], federation["site-c"]
    payload = tmp_path / "model.safetensors"
    payload.write_bytes(os.urandom(300_000))
    t = _transfer()
    sealed, size, sha = relay_client.seal(a, "run-1", t, payload, b.cert, tmp_path / "out")
    sent = relay_client.put(address, a, "run-1", t, sealed, counter := [0], grant=_grant(federation, "run-1", t))
    assert sent.receipt.stored_bytes == size and sent.receipt.sha256 == sha and counter[0] > size
    # What the relay holds shares no 64-byte window with the model (it cannot read it).
    plain = payload.read_bytes()
    assert len(held) == 1 and held[0] == sealed.read_bytes()
    assert not any(plain[i:i + 64] in held[0] for i in range(0, len(plain) - 64, 997))
    # Only the receiver gets it; another site of the federation is refused.
    key = relay_pb2.RelayKey(run_id="run-1", purpose=common_pb2.CHAIN_HOP, index=1, receiver="site-b")
    with pytest.raises(grpc.RpcError) as err:
        relay_client.fetch(address, c, key, "site-a", tmp_path / "c.sealed", size, sha, [0])
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED and "site-b" in err.value.details()
    got = relay_client.fetch(address, b, key, "site-a", tmp_path / "b.sealed", size, sha, down := [0])
    assert got.sha256 == sha and down[0] > size
    # The wrong key cannot open it; the receiver's can, and gets the model back bit for bit.
    with pytest.raises(sealing.SealError):
        relay_client.open_envelope(c, got.path, tmp_path / "c.bin", "run-1", _transfer(receiver="site-c"))
    relay_client.open_envelope(b, got.path, tmp_path / "b.bin", "run-1", t)
    assert (tmp_path / "b.bin").read_bytes() == plain
    relay_client.discard(address, b, key)
    assert not service.path("run-1", common_pb2.CHAIN_HOP, 1, "site-b").exists()


def test_the_relay_refuses_a_sender_that_is_not_the_caller_and_plaintext(federation, relay, tmp_path):
    address, _, _ = relay
    payload = tmp_path / "model.bin"
    payload.write_bytes(b"x" * 1000)
    sealed, _, _ = relay_client.seal(federation["site-a"], "run-1", _transfer(), payload, federation["site-b"].cert,
                                 tmp_path / "out")
    # site-c sends an envelope whose header says site-a: refused before any byte is kept.
    with pytest.raises(grpc.RpcError) as err:
        relay_client.put(address, federation["site-c"], "run-1", _transfer(), sealed, [0],
                     grant=_grant(federation, "run-1", _transfer()))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(relay_client.RelayUnavailable, match="mutual TLS"):
        relay_client.seal(INSECURE, "run-1", _transfer(), payload, b"", tmp_path / "out2")


def test_a_broken_upload_and_a_broken_download_resume_through_the_relay(federation, relay, tmp_path):
    address, service, _ = relay
    a, b = federation["site-a"], federation["site-b"]
    payload = tmp_path / "model.bin"
    payload.write_bytes(os.urandom(3 * CHUNK_BYTES + 123))
    t = _transfer()
    sealed, size, sha = relay_client.seal(a, "run-2", t, payload, b.cert, tmp_path / "out")
    # The sender's stream is cut after its first chunk: the relay keeps those bytes ...
    chunks = iter([0])
    with pytest.raises(Exception):
        relay_client.put(address, a, "run-2", t, sealed, [0], cancelled=lambda: next(chunks, 1) == 1,
                     grant=_grant(federation, "run-2", t))
    dest = service.path("run-2", common_pb2.CHAIN_HOP, 1, "site-b")
    assert partial_path(dest, sha).stat().st_size == CHUNK_BYTES
    # ... and the next attempt sends only the rest.
    sent = relay_client.put(address, a, "run-2", t, sealed, [0], grant=_grant(federation, "run-2", t))
    assert sent.resumed_from == CHUNK_BYTES and sent.receipt.stored_bytes == size
    # A download that broke after 1 MiB carries on from there.
    key = relay_pb2.RelayKey(run_id="run-2", purpose=common_pb2.CHAIN_HOP, index=1, receiver="site-b")
    mine = tmp_path / "in" / "hop.sealed"
    mine.parent.mkdir()
    partial_path(mine, sha).write_bytes(sealed.read_bytes()[:CHUNK_BYTES])
    got = relay_client.fetch(address, b, key, "site-a", mine, size, sha, down := [0])
    assert got.path.read_bytes() == sealed.read_bytes()
    assert down[0] < size  # only the rest came over the wire
    # An envelope other than the one reported is refused.
    with pytest.raises(TransferError, match="not the one reported"):
        relay_client.fetch(address, b, key, "site-a", tmp_path / "other.sealed", size, "0" * 64, [0])


# -- a real trial ----------------------------------------------------------------------------------
CHAIN = ["--models-per-site", "2", "--local-epochs", "1", "--warmup-epochs", "1", "--batch-size", "32"]


def test_outbound_only_sites_get_their_models_through_the_relay_with_the_same_digest(three_sites, tmp_path):
    import time

    from deploy import local_trial
    from fedrelay.coordinator.client import OperatorClient

    with local_trial.LocalTrial(tmp_path, three_sites) as trial:
        def run(seed: int) -> dict:
            res = trial.cli("start-chain", "--seed", str(seed), "--wait", "--json", *CHAIN, capture_output=True,
                            text=True, timeout=600)
            assert res.returncode == 0, res.stderr[-3000:]
            return json.loads(res.stdout)

        direct = run(4)
        assert {h["route"] for h in direct["hops"] + direct["final_transfers"]} == {"direct"}
        # Two sites come back accepting no inbound connection (a hospital's firewall).
        outbound = [n for n in direct["order"][1:]]
        for name in outbound:
            trial.kill(name)
            trial.restart(name, extra=["--outbound-only"])
        deadline = time.monotonic() + 120
        while True:  # until both registered anew, with no address, and opened their control streams
            assert not trial.dead() and time.monotonic() < deadline
            with OperatorClient(trial.coordinator, trial.transport()) as c:
                peers = {p.name: p for p in c.peers()}
            if all(peers[n].outbound_only and peers[n].connected and not peers[n].address for n in outbound):
                break
            time.sleep(0.5)
        relayed = run(4)
        assert relayed["order"] == direct["order"]
        assert relayed["final"]["sha256"] == direct["final"]["sha256"]
        # The ledger says which transfers went through the relay, and the bytes of both legs.
        for h in relayed["hops"] + relayed["final_transfers"]:
            assert h["status"] == "done"
            assert h["route"] == ("relayed" if h["receiver"] in outbound else "direct")
            if h["route"] == "relayed":
                assert h["sealed_bytes"] > h["payload_bytes"] and h["wire_bytes"] >= h["sealed_bytes"]
                assert h["relay_wire_bytes"] >= h["sealed_bytes"]
        assert relayed["total_bytes"] == relayed["expected_total_bytes"]
        assert set(relayed["final"]["per_site"]) == set(trial.names)  # evaluated over the control streams
        # The ledger's records of the run verify against the CA alone (coordinator audit).
        from fedrelay.coordinator import audit

        bundle = audit.bundle_from_ledger(trial.workdir / "ledger.sqlite", relayed["run_id"])
        report = audit.verify(bundle, audit.load_ca_file(trial.pki))
        assert report.verdict == "verified", [str(p) for p in report.ordered()]
        # Their predecessors cannot reach them: the coordinator told them to prepare, over their streams.
        for name in outbound:
            log = (tmp_path / "logs" / f"{name}.log").read_text()
            assert f"run {relayed['run_id']}: started a worker ahead of the model's arrival" in log, name
        shown = trial.cli("show", relayed["run_id"], capture_output=True, text=True).stdout
        assert "through the relay" in shown and "via" in shown
        # The relay kept nothing once the receivers had their models.
        assert not [p for p in (tmp_path / "relay").rglob("*.sealed")]
        out = tmp_path / "final.safetensors"  # fetched from an outbound-only final site, over its stream
        assert trial.cli("fetch-model", relayed["run_id"], "-o", str(out), capture_output=True).returncode == 0


def test_outbound_only_needs_tls_and_no_advertised_address(three_sites, tmp_path):
    import subprocess

    from deploy import processes

    peer = processes.tool("peer")
    base = [peer, "serve", "--data", str(three_sites[0]), "--name", "site-00", "--outbound-only", "--check",
            "--state-dir", str(tmp_path / "state")]
    res = subprocess.run([*base, "--insecure"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "needs mutual TLS" in res.stderr and "Traceback" not in res.stderr


# -- the control stream's two ends, without a network ------------------------------------------------
def test_a_tunneled_call_is_answered_by_the_servicer_with_its_checks():
    from fedrelay.peer.tunnel_client import answer
    from fedrelay.v1 import coordinator_pb2 as cpb, peer_pb2

    class Servicer:
        def GetStatus(self, request, context):  # noqa: N802 - gRPC's name
            assert caller_identity(context) == "coordinator"  # the stream is the coordinator's
            return peer_pb2.PeerStatus(name="site-a")

        def EndRun(self, request, context):  # noqa: N802
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown run {request.run_id!r}")

        def FetchModel(self, request, context):  # noqa: N802
            yield common_pb2.ModelChunk(data=b"ab")
            yield common_pb2.ModelChunk(data=b"cd")

    def ask(method, request=b""):
        return list(answer(Servicer(), cpb.ControlRequest(id=7, method=method, request=request), secure=True))

    (ok,) = ask("GetStatus", peer_pb2.StatusRequest().SerializeToString())
    assert ok.id == 7 and ok.code == 0 and peer_pb2.PeerStatus.FromString(ok.reply).name == "site-a"
    (refused,) = ask("EndRun", peer_pb2.EndRunRequest(run_id="r1").SerializeToString())
    assert refused.code == grpc.StatusCode.NOT_FOUND.value[0] and "r1" in refused.details
    (bad,) = ask("GetStatus", b"\xff\xff")
    assert bad.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "malformed" in bad.details
    (other,) = ask("Handoff")  # site-to-site calls never come over the control stream
    assert other.code == grpc.StatusCode.UNIMPLEMENTED.value[0]
    chunks = ask("FetchModel", peer_pb2.FetchModelRequest(run_id="r1").SerializeToString())
    assert [c.more for c in chunks] == [True, True, False]


def test_a_call_on_a_closed_or_silent_control_stream_fails_clearly():
    import threading

    from fedrelay.coordinator.tunnel_server import TunnelError, Tunnels
    from fedrelay.v1 import coordinator_pb2 as cpb, peer_pb2

    tunnels = Tunnels()
    stub = tunnels.stub("site-a")
    with pytest.raises(TunnelError) as err:
        stub.GetStatus(peer_pb2.StatusRequest(), timeout=1)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "not open" in err.value.details()
    tunnel = tunnels.open("site-a", "i1")
    # The site answers: the reply reaches the waiting call.
    def site() -> None:
        request = tunnel.outbox.get(timeout=5)
        tunnel.deliver(cpb.ControlReply(id=request.id, reply=peer_pb2.PeerStatus(name="site-a").SerializeToString()))
    threading.Thread(target=site, daemon=True).start()
    assert stub.GetStatus(peer_pb2.StatusRequest(), timeout=5).name == "site-a"
    # No answer within the timeout: DEADLINE_EXCEEDED; the stream breaks meanwhile: UNAVAILABLE.
    with pytest.raises(TunnelError) as err:
        stub.GetStatus(peer_pb2.StatusRequest(), timeout=0.2)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    threading.Timer(0.2, lambda: tunnels.drop(tunnel)).start()
    with pytest.raises(TunnelError) as err:
        stub.Evaluate(peer_pb2.EvaluateRequest(run_id="r1"), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_coordinator_relay_says_what_it_needs(federation, tmp_path):
    from typer.testing import CliRunner

    from fedrelay.cli.coordinator import app

    runner = CliRunner()
    r = runner.invoke(app, ["relay", "--listen", "127.0.0.1:0", "--dir", str(tmp_path)], env={"FEDRELAY_TLS": None})
    assert r.exit_code == 2 and "needs --tls" in r.output and "Traceback" not in r.output
    pki_dir = tmp_path / "pki"
    pki.init_ca(pki_dir)
    site = pki.enroll("site-z", pki_dir, tmp_path / "site-z")
    r = runner.invoke(app, ["relay", "--listen", "127.0.0.1:0", "--dir", str(tmp_path / "r"), "--tls", str(site)])
    assert r.exit_code == 2 and "coordinator's identity" in r.output


def test_through_the_operators_relay_senders_present_the_coordinators_grants(three_sites, tmp_path):
    """``coordinator serve --relay HOST:PORT`` with ``coordinator relay`` there (docs/relay-bounds.md): the
    sender of each relayed transfer asks the coordinator for a grant and the relay takes the
    envelope with it; the run finishes with every relayed transfer done."""
    import threading

    from deploy import local_trial, processes
    from fedrelay.coordinator.relay_server import serve_relay

    relay = f"127.0.0.1:{processes.free_ports(1)[0]}"
    sites = three_sites[:2]  # the shortest chain: its one hop goes through the relay
    last = sites[-1].name
    stop, ready, stored = threading.Event(), threading.Event(), []
    with local_trial.LocalTrial(tmp_path, sites, coordinator_args=["--relay", relay],
                                outbound_only=[last]) as trial:
        thread = threading.Thread(target=serve_relay, args=(relay, tmp_path / "own-relay"), daemon=True, kwargs=dict(
            transport=Transport.from_dir(trial.pki / "coordinator"), stop=stop, ready=ready,
            on_stored=stored.append))
        thread.start()
        try:
            assert ready.wait(30)
            res = trial.cli("start-chain", "--seed", "4", "--wait", "--json", "--order", "given", "--peers",
                            ",".join(d.name for d in sites), *CHAIN, capture_output=True, text=True, timeout=600)
            assert res.returncode == 0, res.stderr[-3000:]
            run = json.loads(res.stdout)
            relayed = [h for h in run["hops"] + run["final_transfers"] if h["route"] == "relayed"]
            assert relayed and {h["receiver"] for h in relayed} == {last}
            assert all(h["status"] == "done" and h["relay"] == relay for h in relayed)
            assert stored  # the operator's relay held them (with the coordinator's grants)
            assert not [p for p in (tmp_path / "own-relay").rglob("*.sealed")]  # and discarded them once fetched
        finally:
            stop.set()
            thread.join(10)
