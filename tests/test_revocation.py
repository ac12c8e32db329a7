"""Revocation (docs/site-keys-and-revocation.md), over real mutual-TLS sockets on loopback: `coordinator revoke`
signs a revocation list with the CA, the coordinator records who revoked whom and when and
publishes the list; the revoked site's calls are refused by the coordinator and by a peer
daemon, its calls in flight (a control stream, a model transfer) are cancelled, with no daemon
restarted; `peers` and `show` say the site is revoked; a running run is routed around it.
The peer takes the list the way its heartbeat does (``peer.daemon._follow_crl``) or from a file
(``--crl``, ``RevocationList.reload_file``): the tests call those hooks instead of waiting."""

from __future__ import annotations

import hashlib
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from typer.testing import CliRunner

from fedrelay import revocation
from fedrelay.server import make_server
from fedrelay.transport import Transport
from fedrelay.cli.coordinator import app as coord_app
from fedrelay.coordinator import pki
from fedrelay.coordinator.ledger import Ledger
from fedrelay.coordinator.plan import chain_plan
from fedrelay.coordinator.service import CoordinatorService
from fedrelay.guard import Guard
from fedrelay.peer import daemon
from fedrelay.peer.node import PeerNode
from fedrelay.peer.reporting import CoordinatorLink
from fedrelay.peer.servicer import PeerServicer
from fedrelay.peer.transfer import add_peer_servicer
from fedrelay.tasks.image_folder.data import load_site
from fedrelay.v1 import common_pb2, coordinator_pb2 as cpb, coordinator_pb2_grpc, peer_pb2, peer_pb2_grpc

from test_transfer import assignment

ORDER = ["site-a", "site-b", "site-c"]
WAIT = 20.0  # seconds a test waits for something that takes milliseconds (a loaded machine)
runner = CliRunner()


def said(result) -> str:
    return " ".join(result.output.split())


@pytest.fixture
def world(tmp_path, three_sites):
    """A PKI (sites enrolled with their own keys), a coordinator (as `coordinator serve` builds
    it: its guard enforces its revocation list), and site-b's peer daemon (its guard enforces
    the daemon's revocation list), with run r1 (site-a -> site-b -> site-c) assigned to it."""
    root = tmp_path
    pki.init_ca(root / "pki")
    ids = {n: Transport.from_dir(pki.enroll(n, root / "pki", root / n)) for n in ORDER}
    ids["operator"] = Transport.from_dir(root / "pki" / "operator")
    ids["coordinator"] = Transport.from_dir(root / "pki" / "coordinator")
    ledger = Ledger(root / "ledger.sqlite")
    service = CoordinatorService(ledger, transport=ids["coordinator"])
    guard = service.monitor.guard()
    guard.watch(service.revocations.list)
    server, port = make_server("127.0.0.1:0", transport=ids["coordinator"], guard=guard)
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(service, server)
    server.start()
    coordinator = f"127.0.0.1:{port}"

    peer_revocations = revocation.for_daemon(ids["site-b"], keep=root / "state-b" / "crl.der")
    peer_server, peer_port = make_server("127.0.0.1:0", transport=ids["site-b"],
                                         guard=Guard(revocations=peer_revocations))
    node = PeerNode("site-b", f"127.0.0.1:{peer_port}", load_site(three_sites[0]), root / "state-b", "cpu", None,
                    start_workers=False, transport=ids["site-b"], stall_timeout=120)
    node.revocations = peer_revocations
    add_peer_servicer(PeerServicer(node), peer_server)
    peer_server.start()
    peer = f"127.0.0.1:{peer_port}"
    peer_pb2_grpc.PeerStub(ids["coordinator"].channel(peer, expect="site-b")).Assign(
        assignment("r1", order=ORDER), timeout=WAIT)
    pool = ThreadPoolExecutor(4)
    yield dict(root=root, ids=ids, ledger=ledger, service=service, coordinator=coordinator, peer=peer, node=node,
               peer_revocations=peer_revocations, pool=pool)
    pool.shutdown(wait=False, cancel_futures=True)
    peer_server.stop(0)
    server.stop(0)
    service.close()
    ledger.close()


def coord_stub(w, who: str) -> coordinator_pb2_grpc.CoordinatorStub:
    return coordinator_pb2_grpc.CoordinatorStub(w["ids"][who].channel(w["coordinator"], expect="coordinator"))


def peer_stub(w, who: str) -> peer_pb2_grpc.PeerStub:
    return peer_pb2_grpc.PeerStub(w["ids"][who].channel(w["peer"], expect="site-b"))


def revoke(w, name: str, *extra: str):
    return runner.invoke(coord_app, ["revoke", name, "--ca", str(w["root"] / "pki"), "-c", w["coordinator"],
                                     "--tls", str(w["root"] / "pki" / "operator"), *extra],
                         env={"FEDRELAY_TLS": None, "FEDRELAY_INSECURE": None})


def until(condition, timeout: float = WAIT) -> None:
    """Wait for ``condition()`` (checked every 20 ms) or fail after ``timeout`` seconds."""
    tick = threading.Event()
    for _ in range(int(timeout / 0.02)):
        if condition():
            return
        tick.wait(0.02)
    raise AssertionError("timed out")


def refused_as_revoked(call) -> str:
    with pytest.raises(grpc.RpcError) as err:
        call()
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value
    assert "revoked" in err.value.details()
    return err.value.details()


def test_a_revoked_site_is_refused_and_cut_off_everywhere(world):
    w = world
    a = coord_stub(w, "site-a")
    # site-a connects out only: its control stream to the coordinator is open.
    assert a.Register(cpb.RegisterRequest(name="site-a", instance="ia", outbound_only=True), timeout=WAIT)
    hello_sent = threading.Event()

    def hello():
        yield cpb.ControlReply(id=0, site="site-a", instance="ia")
        hello_sent.wait()

    control = a.Connect(hello())
    assert next(control).id == 0
    # site-a streams hop 1 of run r1 to site-b, and stalls mid-transfer (the call stays in flight).
    data = b"\0" * 4096
    header = common_pb2.TransferHeader(run_id="r1", hop=1, sender="site-a", total_bytes=len(data) * 2,
                                       sha256=hashlib.sha256(data * 2).hexdigest(), purpose=common_pb2.CHAIN_HOP)
    more = threading.Event()

    def transfer():
        yield common_pb2.ModelChunk(header=header)
        yield common_pb2.ModelChunk(data=data)
        more.wait()

    handoff = peer_stub(w, "site-a").Handoff.future(transfer(), timeout=120)
    until(lambda: w["node"].runs["r1"].state == "receiving")  # its header was taken: the stream is open
    # site-c is registered and in good standing.
    c = coord_stub(w, "site-c")
    assert c.Register(cpb.RegisterRequest(name="site-c", address="127.0.0.1:9", instance="ic"), timeout=WAIT)

    r = revoke(w, "site-a", "--reason", "left the federation")
    assert r.exit_code == 0, r.output
    assert "revoked site-a" in said(r) and "by operator" in said(r)
    assert (w["root"] / "pki" / "ca" / "crl.pem").exists()

    # The coordinator: the control stream in flight is cancelled, the next call refused.
    with pytest.raises(grpc.RpcError) as err:
        w["pool"].submit(next, control).result(timeout=WAIT)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    refused_as_revoked(lambda: a.Register(cpb.RegisterRequest(name="site-a", instance="ia", outbound_only=True),
                                          timeout=WAIT))
    details = refused_as_revoked(lambda: a.ResolveSite(cpb.ResolveSiteRequest(name="site-c"), timeout=WAIT))
    assert "by operator" in details and "left the federation" in details
    # site-c goes on; its heartbeat says a revocation list exists.
    reply = c.Register(cpb.RegisterRequest(name="site-c", address="127.0.0.1:9", instance="ic"), timeout=WAIT)
    assert reply.crl_number == 1

    # The peer takes the list as its heartbeat does (site-b's registration names the list's number).
    b_link = CoordinatorLink(w["coordinator"], w["ids"]["site-b"])
    try:
        number = b_link.stub.Register(cpb.RegisterRequest(name="site-b", address=w["peer"], instance="ib"),
                                      timeout=WAIT).crl_number
        assert w["peer_revocations"].number == 0
        daemon._follow_crl(b_link, w["peer_revocations"], number)
    finally:
        b_link.close()
    assert w["peer_revocations"].number == 1
    assert w["peer_revocations"].revoked_name("site-a").revoked_by == "operator"
    assert (w["root"] / "state-b" / "crl.der").read_bytes() == w["peer_revocations"].der  # kept for a restart
    # The transfer in flight stops at once (no stall timeout, no restart); the next one is refused.
    with pytest.raises(grpc.RpcError) as err:
        handoff.result(timeout=WAIT)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    more.set()
    refused_as_revoked(lambda: peer_stub(w, "site-a").TransferOffset(header, timeout=WAIT))
    # The peer still serves the others.
    status = peer_pb2_grpc.PeerStub(w["ids"]["coordinator"].channel(w["peer"], expect="site-b")).GetStatus(
        peer_pb2.StatusRequest(), timeout=WAIT)
    assert status.name == "site-b"
    # site-b sends nothing to the revoked site (the sender's check, by the coordinator's names).
    assert w["node"].sending.is_revoked("site-a") and not w["node"].sending.is_revoked("site-c")

    # The ledger says who revoked whom, when and why; `peers` says so.
    row = w["ledger"].store.all("SELECT * FROM revocations")
    assert [(x["name"], x["revoked_by"], x["reason"]) for x in row] == [("site-a", "operator", "left the federation")]
    r = runner.invoke(coord_app, ["peers", "--json", "-c", w["coordinator"], "--tls",
                                  str(w["root"] / "pki" / "operator")], env={"FEDRELAY_INSECURE": None})
    assert r.exit_code == 0, r.output
    peers = {p["name"]: p for p in json.loads(r.output)}
    assert peers["site-a"]["revoked"]["revoked_by"] == "operator"
    assert peers["site-a"]["revoked"]["reason"] == "left the federation"
    assert peers["site-c"]["revoked"] is None
    r = runner.invoke(coord_app, ["peers", "-c", w["coordinator"], "--tls", str(w["root"] / "pki" / "operator")],
                      env={"FEDRELAY_INSECURE": None})
    assert "revoked" in said(r) and "left the federation" in said(r)
    hello_sent.set()

    # site-a is enrolled anew (a new key, a new certificate): back in good standing once it
    # registers; its old certificate stays refused; the peer learns it with its next heartbeat.
    w["ids"]["site-a2"] = Transport.from_dir(pki.enroll("site-a", w["root"] / "pki", w["root"] / "site-a2"))
    reply = coord_stub(w, "site-a2").Register(cpb.RegisterRequest(name="site-a", address="127.0.0.1:9", instance="ia2"),
                                              timeout=WAIT)
    assert (reply.crl_number, reply.revoked_sites) == (1, 0)
    refused_as_revoked(lambda: a.ResolveSite(cpb.ResolveSiteRequest(name="site-c"), timeout=WAIT))
    b_link = CoordinatorLink(w["coordinator"], w["ids"]["site-b"])
    try:
        daemon._follow_crl(b_link, w["peer_revocations"], reply.crl_number, reply.revoked_sites)
    finally:
        b_link.close()
    assert not w["node"].sending.is_revoked("site-a")
    refused_as_revoked(lambda: peer_stub(w, "site-a").TransferOffset(header, timeout=WAIT))
    assert w["service"].ListPeers(cpb.ListPeersRequest(), _operator_context()).peers[0].HasField("revocation") is False


def test_a_running_run_is_routed_around_the_revoked_site(world):
    w = world
    ledger = w["ledger"]
    ledger.create_run("run1", strategy="fedelmy", arch="cnn", seed=1, params={}, class_index=["x"], model={},
                      chain=[{"name": n, "address": "127.0.0.1:9"} for n in ORDER], warnings=[], insecure=False,
                      plan=chain_plan(ORDER).to_json())
    for n in ORDER:  # every site heartbeats: none is routed around for silence
        ledger.upsert_peer(n, "127.0.0.1:9", [], "cpu", "x")
    r = revoke(w, "site-b", "--reason", "compromised")
    assert r.exit_code == 0, r.output
    assert "run1" in said(r)
    events = ledger.events_after("run1", 0)
    revoked = [e for e in events if e["kind"] == "revoked"]
    assert len(revoked) == 1 and revoked[0]["site"] == "site-b"
    assert json.loads(revoked[0]["data"]) == {"revoked_by": "operator", "reason": "compromised"}
    skips = ledger.skips("run1")
    assert [s["site"] for s in skips] == ["site-b"] and "revoked by operator" in skips[0]["reason"]
    summary = w["service"].summary("run1")
    assert list(summary.skipped) == ["site-b"]
    assert [(e.name, e.revoked_by, e.reason) for e in summary.revoked] == [("site-b", "operator", "compromised")]
    show = ["show", "run1", "-c", w["coordinator"], "--tls", str(w["root"] / "pki" / "operator")]
    r = runner.invoke(coord_app, [*show, "--json"], env={"FEDRELAY_INSECURE": None})
    assert r.exit_code == 0, r.output
    assert [(x["name"], x["revoked_by"]) for x in json.loads(r.output)["revoked"]] == [("site-b", "operator")]
    r = runner.invoke(coord_app, show, env={"FEDRELAY_INSECURE": None})
    assert r.exit_code == 0, r.output
    assert "revoked: site-b" in said(r) and "by operator" in said(r) and "compromised" in said(r)
    # A revoked site cannot be named for a new run.
    with pytest.raises(grpc.RpcError) as err:
        coord_stub(w, "operator").StartChain(cpb.StartChainRequest(peers=["site-b", "site-c"]), timeout=WAIT)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "revoked" in err.value.details()
    # Revoking again (another certificate, say) keeps every earlier entry in the list.
    r = revoke(w, "site-c")
    assert r.exit_code == 0, r.output
    crl = revocation.load_crl((w["root"] / "pki" / "ca" / "crl.pem").read_bytes())
    assert revocation.crl_number(crl) == 2 and len(list(crl)) == 2


def test_revocation_lists_are_checked_and_files_reloaded(world, tmp_path):
    """A daemon takes only its CA's lists, never an older one; a --crl file is reloaded when it
    changes (``reload_file``: the watcher's check, called here instead of waiting)."""
    w = world
    ca = w["root"] / "pki"
    crl_file = tmp_path / "crl.pem"
    serial_a = pki.issued(ca, "site-a")[0].serial_number
    pki.revoke(ca, [serial_a])
    crl_file.write_bytes((ca / "ca" / "crl.pem").read_bytes())
    stop = threading.Event()
    try:
        rl = revocation.for_daemon(w["ids"]["site-c"], crl_file=crl_file, stop=stop, interval=3600)
        assert rl.number == 1 and rl.refused(w["ids"]["site-a"].cert) and not rl.refused(w["ids"]["site-b"].cert)
        assert not rl.reload_file()  # unchanged
        pki.revoke(ca, [pki.issued(ca, "site-b")[0].serial_number])
        crl_file.write_bytes((ca / "ca" / "crl.pem").read_bytes())
        assert rl.reload_file() and rl.number == 2 and rl.refused(w["ids"]["site-b"].cert)
        # Another CA's list, and an older list, are refused; the list held stays.
        pki.init_ca(tmp_path / "rogue")
        rogue, _ = pki.revoke(tmp_path / "rogue", [serial_a, 99])
        with pytest.raises(revocation.CrlError, match="not signed by the federation's CA"):
            rl.update(rogue)
        with pytest.raises(revocation.CrlError, match="older"):
            rl.update(_older(ca))
        assert rl.number == 2
        crl_file.write_bytes(b"garbage")
        assert not rl.reload_file() and rl.number == 2
    finally:
        stop.set()
    # The coordinator refuses a list that is not the CA's, or lacks the serials named.
    op = coord_stub(w, "operator")
    for crl, serials, words in ((rogue, [f"{serial_a:x}"], "not signed by the federation's CA"),
                                ((ca / "ca" / "crl.pem").read_bytes(), ["abc"], "does not hold")):
        with pytest.raises(grpc.RpcError) as err:
            op.Revoke(cpb.RevocationRequest(name="site-a", crl=crl, serials=serials), timeout=WAIT)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.value.details()
    # Only the operator may revoke.
    with pytest.raises(grpc.RpcError) as err:
        coord_stub(w, "site-c").Revoke(cpb.RevocationRequest(name="site-a", crl=b"x", serials=["1"]), timeout=WAIT)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED


def _operator_context():
    """A stand-in server context for calling a servicer method directly (plaintext caller)."""
    class Context:
        def auth_context(self):
            return {}

        def abort(self, code, details):
            raise AssertionError(f"{code}: {details}")

    return Context()


def _older(ca) -> bytes:
    """A list signed by the CA with number 1 (the CA's list is at 2 by now)."""
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization

    cert, key, _ = pki.load_ca(ca)
    now = dt.datetime.now(dt.timezone.utc)
    crl = (x509.CertificateRevocationListBuilder().issuer_name(cert.subject).last_update(now)
           .next_update(now + dt.timedelta(days=1)).add_extension(x509.CRLNumber(1), critical=False)
           .sign(key, hashes.SHA256()))
    return crl.public_bytes(serialization.Encoding.DER)


def test_a_sender_sends_nothing_to_a_revoked_receiver(world):
    """site-b's next transfer (hop 2, to site-c) waits while site-c is revoked, until the
    coordinator's reroute takes the transfer off its plan (``run.rerouted`` wakes the wait); past
    the send deadline it fails, saying why."""
    import time

    w = world
    node, ca = w["node"], w["root"] / "pki"
    serial = pki.issued(ca, "site-c")[0].serial_number
    der, _ = pki.revoke(ca, [serial])
    w["peer_revocations"].update(der, [revocation.Revoked("site-c", serial, time.time(), "operator", "gone")])
    run = node.runs["r1"]
    hop = next(t for t in run.assignment.transfers if t.receiver == "site-c")
    with pytest.raises(RuntimeError, match="site-c: its certificate was revoked by operator"):
        node.sending.revoked("site-c", run, hop, deadline=time.monotonic(), delay=1.0)
    run.rerouted.set()  # a reroute arrived: the wait ends at once (then Sending.deliver finds hop off the plan)
    started = time.monotonic()
    assert node.sending.revoked("site-c", run, hop, deadline=time.monotonic() + 600, delay=300.0)
    assert time.monotonic() - started < WAIT
    assert not node.sending.revoked("site-a", run, hop, deadline=time.monotonic() + 600, delay=300.0)
