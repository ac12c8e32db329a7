"""Operating a federation (docs/how-to/monitor.md): Prometheus metrics on both daemons, the gRPC health
service, a site asking its own daemon for its status, and the coordinator's log lines.

One coordinator and three peer daemons in this process (threads, each with its own metrics
registry), over mutual TLS with a PKI made like `coordinator init-ca` / `enroll` do, and one
small real chain whose ledger the metrics must match."""

from __future__ import annotations

import logging
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from fedrelay import params as run_params
from fedrelay.transport import INSECURE, Transport
from fedrelay.coordinator import pki
from fedrelay.coordinator.client import OperatorClient
from fedrelay.health import probe
from fedrelay.v1 import coordinator_pb2 as cpb, coordinator_pb2_grpc, peer_pb2, peer_pb2_grpc
from conftest import chain_to_the_end, free_port, start_thread, stop_threads

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent
PARAMS = dict(strategy="fedelmy", models_per_site=1, local_epochs=1, warmup_epochs=1, alpha=1.0, beta=1.0, lr=1e-3,
              batch_size=32, weight_decay=0.0, selection="best-val")


class Lines(logging.Handler):
    """Every log record's message, as the daemons' loggers write them."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def scrape(address: str) -> dict[tuple, float]:
    """/metrics at ``address`` as {(sample name, (sorted label pairs)): value}."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


@pytest.fixture(scope="module")
def fed(three_sites, tmp_path_factory):
    from fedrelay.coordinator.service import serve as serve_coordinator
    from fedrelay.peer.daemon import serve as serve_peer

    root = tmp_path_factory.mktemp("monitoring")
    pki.init_ca(root / "pki")
    names = [d.name for d in three_sites]
    tls = {"coordinator": root / "pki" / "coordinator", "operator": root / "pki" / "operator"}
    for n in names:
        tls[n] = pki.enroll(n, root / "pki", root / f"{n}.pki")
    ids = {k: Transport.from_dir(v) for k, v in tls.items()}
    handler = Lines()
    logger = logging.getLogger("fedrelay")
    old_level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    address, metrics = f"127.0.0.1:{free_port()}", {"coordinator": f"127.0.0.1:{free_port()}"}
    daemons = [start_thread(serve_coordinator, listen=address, db=root / "ledger.sqlite",
                            transport=ids["coordinator"], metrics_listen=metrics["coordinator"])]
    peers = {}
    for n, d in zip(names, three_sites):
        peers[n], metrics[n] = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        daemons.append(start_thread(serve_peer, data_dir=d, name=n, listen=peers[n], coordinator=address,
                                    state_dir=root / "state" / n, device="cpu", transport=ids[n],
                                    metrics_listen=metrics[n], fork_workers=True))
    client = OperatorClient(address, ids["operator"])
    try:
        _, run = chain_to_the_end(client, names, run_params.to_pb(PARAMS))
        yield dict(root=root, tls=tls, ids=ids, names=names, address=address, peers=peers, metrics=metrics,
                   run=run, lines=handler.lines, daemons=daemons)
    finally:
        client.close()
        stop_threads(daemons)
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def test_metrics_match_the_ledger(fed):
    run = fed["run"]
    assert run["status"] == "finished", run["error"]
    c = scrape(fed["metrics"]["coordinator"])
    assert value(c, "fedrelay_coordinator_runs", state="finished") == 1
    assert value(c, "fedrelay_coordinator_runs", state="running") == 0
    for purpose, rows in (("chain", run["hops"]), ("final", run["final_transfers"])):
        assert len(rows) == 2
        assert value(c, "fedrelay_coordinator_transfers_total", purpose=purpose) == len(rows)
        assert value(c, "fedrelay_coordinator_transfer_payload_bytes_total", purpose=purpose) == \
            sum(h["payload_bytes"] for h in rows)
        assert value(c, "fedrelay_coordinator_transfer_wire_bytes_total", purpose=purpose) == \
            sum(h["wire_bytes"] for h in rows)
        assert value(c, "fedrelay_coordinator_transfer_retries_total", purpose=purpose) == \
            sum(h["attempts"] - 1 for h in rows)
        # Each peer's own counters add up to the same transfers, as sent and as received.
        per_peer = {n: scrape(fed["metrics"][n]) for n in fed["names"]}
        for side in ("sent", "received"):
            assert sum(value(p, f"fedrelay_peer_transfers_{side}_total", purpose=purpose)
                       for p in per_peer.values()) == len(rows)
            assert sum(value(p, f"fedrelay_peer_{side}_bytes_total", purpose=purpose)
                       for p in per_peer.values()) == sum(h["payload_bytes"] for h in rows)
    for n in fed["names"]:
        assert value(c, "fedrelay_coordinator_peer_up", site=n) == 1
        assert 0 <= value(c, "fedrelay_coordinator_peer_last_seen_age_seconds", site=n) < 60
        p = scrape(fed["metrics"][n])
        assert value(p, "fedrelay_peer_training_images_per_second") > 0
        assert value(p, "fedrelay_peer_epochs_trained_total") >= 1
        assert value(p, "fedrelay_peer_run_state", run_id=run["run_id"], state="done") == 1
        latest = [k for k in p if k[0] == "fedrelay_peer_epoch"]
        assert len(latest) == 1 and dict(latest[0][1])["run_id"] == run["run_id"]
        assert p[latest[0]] == p[("fedrelay_peer_epochs", latest[0][1])]  # the last epoch of its stage


def test_refusals_are_counted_and_logged_with_the_caller(fed):
    a, b = fed["names"][:2]
    # A site may not start a run at the coordinator...
    with fed["ids"][a].channel(fed["address"], expect="coordinator") as ch:
        with pytest.raises(grpc.RpcError) as err:
            coordinator_pb2_grpc.CoordinatorStub(ch).StartChain(cpb.StartChainRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    c = scrape(fed["metrics"]["coordinator"])
    assert value(c, "fedrelay_coordinator_refusals_total", method="Coordinator.StartChain",
                 code="permission_denied") == 1
    line = next(x for x in fed["lines"] if x.startswith("refused Coordinator.StartChain"))
    assert f"from {a!r}: PERMISSION_DENIED" in line and "(peer ipv4:127.0.0.1:" in line
    # ...nor ask another site's daemon for its status (self-service is for the site itself).
    with fed["ids"][a].channel(fed["peers"][b], expect=b) as ch:
        with pytest.raises(grpc.RpcError) as err:
            peer_pb2_grpc.PeerStub(ch).GetStatus(peer_pb2.StatusRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert f"this site's own identity ({b!r})" in err.value.details() and repr(a) in err.value.details()
    p = scrape(fed["metrics"][b])
    assert value(p, "fedrelay_peer_refusals_total", method="Peer.GetStatus", code="permission_denied") == 1


def test_a_site_asks_its_own_daemon_for_its_status(fed):
    b = fed["names"][1]
    res = subprocess.run([str(BIN / "peer"), "status", "--peer", fed["peers"][b], "--tls", str(fed["tls"][b])],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert f"peer {b} at {fed['peers'][b]}" in res.stdout and fed["run"]["run_id"] in res.stdout
    assert "done" in res.stdout
    assert f"coordinator {fed['address']}: last registered" in res.stdout and "failed" not in res.stdout


def test_health_answers_serving_on_both_daemons(fed):
    b = fed["names"][1]
    assert probe(fed["ids"][b], fed["peers"][b], expect=b) == (True, "SERVING")
    assert probe(fed["ids"]["coordinator"], fed["peers"][b], service="fedrelay.v1.Peer") == (True, "SERVING")
    assert probe(fed["ids"]["operator"], fed["address"], expect="coordinator",
                 service="fedrelay.v1.Coordinator") == (True, "SERVING")
    res = subprocess.run([str(BIN / "peer"), "health", "--peer", fed["peers"][b], "--tls", str(fed["tls"][b])],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == f"peer {fed['peers'][b]}: SERVING", res.stdout + res.stderr


def test_the_coordinator_logs_registrations_runs_transfers_and_ends(fed):
    lines, run = fed["lines"], fed["run"]
    for n in fed["names"]:
        assert f"site {n} registered at {fed['peers'][n]}" in lines
    started = next(x for x in lines if x.startswith(f"run {run['run_id']} started by"))
    assert "'operator' (ipv4:127.0.0.1:" in started and "fedelmy, chain over 3 sites: " + ", ".join(fed["names"]) \
        in started
    h = run["hops"][0]
    assert any(x.startswith(f"run {run['run_id']}: chain transfer 1 {h['sender']} -> {h['receiver']}, "
                            f"{h['payload_bytes']} bytes") for x in lines)
    assert f"run {run['run_id']} ended: finished" in lines


def test_health_goes_not_serving_on_shutdown_and_the_coordinator_logs_it(tmp_path):
    from fedrelay.coordinator.service import serve as serve_coordinator

    handler = Lines()
    logger = logging.getLogger("fedrelay.coordinator")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    address = f"127.0.0.1:{free_port()}"
    try:
        thread, stop = start_thread(serve_coordinator, listen=address, db=tmp_path / "ledger.sqlite",
                                    transport=INSECURE)
        assert probe(INSECURE, address) == (True, "SERVING")
        with INSECURE.channel(address) as ch:
            watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=""), timeout=30)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            stop.set()
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
            watch.cancel()
        thread.join(30)
        ok, line = probe(INSECURE, address, timeout=2)
        assert not ok and line.startswith("UNREACHABLE")
        res = subprocess.run([str(BIN / "coordinator"), "health", "--coordinator", address, "--insecure",
                              "--timeout", "2"], capture_output=True, text=True, timeout=60)
        assert res.returncode == 3 and res.stdout.startswith(f"coordinator {address}: UNREACHABLE"), res.stdout
        assert "coordinator shutting down" in handler.lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
