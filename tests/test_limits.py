"""Bounded per identity and per endpoint (docs/limits.md): progress reports rate-limited per run
member (``coordinator/progress_limit.py``), the run page's and metrics endpoint's own connection
limits, ``Host:`` check and cached page data (``coordinator/http_limits.py``, ``coordinator/web``,
``fedrelay/metrics.py``), the gRPC servers' connection bounds (``fedrelay/limits.py``) and the
peer's warm workers held only for planned senders (``peer/worker_pool.py``, ``peer/prepared.py``).

Every test here uses counts and hooks, never sleeps or timing margins."""

from __future__ import annotations

import logging

from conftest import FakeContext, new_run
from fedrelay.coordinator.ledger import Ledger
from fedrelay.coordinator.plan import chain_plan
from fedrelay.coordinator.progress_limit import ProgressLimit
from fedrelay.coordinator.service import CoordinatorService
from fedrelay.v1 import coordinator_pb2 as cpb


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


# -- progress reports --------------------------------------------------------------------------------
def test_progress_bucket_refills_at_its_rate_and_logs_once(caplog):
    clock = Clock()
    limit = ProgressLimit(burst=3, rate=2.0, log_window=60, clock=clock)
    with caplog.at_level(logging.WARNING, logger="fedrelay.coordinator.progress"):
        assert [limit.admit("r", "a") for _ in range(5)] == [True, True, True, False, False]
        assert limit.admit("r", "b")  # another member has its own bucket
        assert limit.admit("other", "a")  # and so has the same site in another run
        clock.now += 0.5  # one token back
        assert [limit.admit("r", "a") for _ in range(2)] == [True, False]
        assert len(caplog.records) == 1 and "dropping the excess" in caplog.records[0].getMessage()
        clock.now += 61
        assert limit.admit("r", "a")
        for _ in range(10):
            limit.admit("r", "a")
        lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and lines[1].startswith("run r: dropped 2 progress reports from a"), lines
    limit.forget("r")
    assert len(limit) == 1


def test_a_flood_of_progress_reports_stops_growing_the_ledger(caplog):
    """2,000 progress reports from one run member: the ledger keeps the bucket's worth, the rest
    are answered as duplicates; one log line says so; another member still reports."""
    ledger = Ledger(":memory:")
    new_run(ledger, "flood")
    service = CoordinatorService(ledger)
    clock = Clock()
    service.progress_limit = ProgressLimit(burst=50, rate=1.0, clock=clock)
    try:
        before = len(ledger.events_after("flood", 0))
        report = cpb.ProgressReport(run_id="flood", site="a", kind="state", state="training", detail="x" * 1000)
        with caplog.at_level(logging.WARNING, logger="fedrelay.coordinator.progress"):
            replies = [service.ReportProgress(report, FakeContext()) for _ in range(2000)]
        assert sum(not r.duplicate for r in replies) == 50
        assert len(ledger.events_after("flood", 0)) - before == 50
        assert len([r for r in caplog.records if r.name == "fedrelay.coordinator.progress"]) == 1
        reply = service.ReportProgress(cpb.ProgressReport(run_id="flood", site="b", kind="state", state="training"),
                                       FakeContext())
        assert not reply.duplicate and len(service.progress_limit) == 2
        ledger.finish_run("flood", "failed", error="test", message="run failed")
        assert len(service.progress_limit) == 0  # an ended run's buckets go
    finally:
        service.close()


# -- the run page ------------------------------------------------------------------------------------
import json  # noqa: E402
import math  # noqa: E402
import socket  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402


def page_client(service, base_url="http://localhost", hosts=None):
    from starlette.testclient import TestClient

    from fedrelay.coordinator.web import create_app

    return TestClient(create_app(service, hosts=hosts), base_url=base_url)


@pytest.mark.parametrize("host,ok", [("localhost", True), ("localhost:8070", True), ("127.0.0.1:8070", True),
                                     ("[::1]:8070", True), ("10.1.2.3", True), ("runs.example.org", True),
                                     ("evil.example.com", False), ("evil.example.com:8070", False),
                                     ("localhost.evil.example.com", False), ("", False), ("[::1", False),
                                     ("localhost:x", False)])
def test_the_page_checks_its_host_header(service, host, ok):
    """DNS rebinding: a page reached under a name it does not know answers 400, API included."""
    from fedrelay.coordinator.http_limits import allowed_hosts

    new_run(service.ledger, "r1")
    with page_client(service, hosts=allowed_hosts("127.0.0.1", ["runs.example.org"])) as client:
        for path in ("/", "/api/runs", "/api/runs/r1"):
            r = client.get(path, headers={"host": host})
            assert (r.status_code != 400) == ok, (host, path, r.status_code)
            if not ok:
                assert r.text == "Invalid host header" and "r1" not in r.text


def test_a_bad_web_host_name_is_a_clear_error():
    from fedrelay.coordinator.http_limits import allowed_hosts

    with pytest.raises(ValueError, match="--web-host 'a b'"):
        allowed_hosts("127.0.0.1", ["a b"])


def test_page_data_is_built_once_per_change_not_per_reader(service):
    ledger = service.ledger
    new_run(ledger, "r1")
    ledger.add_event("r1", "started", "run r1")
    with page_client(service) as client:
        cache = client.app.state.page_cache
        cache.max_age = math.inf  # only changes rebuild (no clock in this test)
        barrier = threading.Barrier(30)
        bodies = []

        def reader():
            barrier.wait()
            bodies.append(client.get("/api/runs/r1").json())

        threads = [threading.Thread(target=reader) for _ in range(30)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(bodies) == 30 and all(b["run_id"] == "r1" and b["now"] > 0 for b in bodies)
        assert cache.builds == 1
        ledger.add_event("r1", "state", "a: training", site="a", state="training", detail="")
        view = client.get("/api/runs/r1").json()
        assert cache.builds == 2 and view["sites"]["a"]["state"] == "training"
        client.get("/api/runs/r1")
        assert cache.builds == 2
        for i in range(50):  # unknown runs are not cached (nor remembered)
            assert client.get(f"/api/runs/nope-{i}").status_code == 404
        assert len(cache._building) <= 1


def test_an_infinite_value_in_a_run_never_answers_500(service):
    """A ledger written before the value checks may hold inf/nan: the page data shows null."""
    ledger = service.ledger
    new_run(ledger, "inf")
    ledger.record_metric("inf", "a", "pool", 1, 1, 1, math.inf, None, math.nan)
    ledger.add_event("inf", "epoch", "a: epoch", site="a", stage="pool", model=1, epoch=1, epochs=1,
                     train_loss=math.inf, val_accuracy=None, seconds=1.0)
    with page_client(service) as client:
        r = client.get("/api/runs/inf")
        assert r.status_code == 200, r.text
        assert [(m["train_loss"], m["seconds"]) for m in r.json()["metrics"]] == [(None, None)]


def wait_until(predicate, what: str, limit: float = 30.0) -> None:
    """Poll ``predicate`` until true (a bound for a broken build, not a timing margin)."""
    deadline = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def closed_by_server(sock: socket.socket) -> bool:
    """Block until the server closes ``sock`` (True) or 30 s pass (False)."""
    sock.settimeout(30)
    try:
        return sock.recv(65536) == b"" or sock.recv(65536) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


HALF = b"GET /api/runs HTTP/1.1\r\nHost: localhost\r\nX-Slow: "


def test_the_page_closes_connections_over_its_limit(service):
    from fedrelay.coordinator.http_limits import HttpLimits
    from fedrelay.coordinator.web import start_web

    page = start_web("127.0.0.1:0", service, limits_=HttpLimits(max_connections=3, head_timeout=600))
    held = []
    try:
        connections = page._server.server_state.connections
        for _ in range(3):
            s = socket.create_connection(("127.0.0.1", page.port))
            s.sendall(HALF)
            held.append(s)
        wait_until(lambda: len(connections) == 3, "3 connections")
        extra = socket.create_connection(("127.0.0.1", page.port))
        extra.sendall(HALF)
        assert closed_by_server(extra)
        assert page.protocol.counts.refused >= 1 and len(connections) == 3
        for s in held:
            s.close()
        wait_until(lambda: not connections, "the held connections to close")
        import urllib.request

        with urllib.request.urlopen(f"{page.url}api/runs", timeout=30) as r:
            assert r.status == 200 and json.loads(r.read()) == []
    finally:
        for s in held:
            s.close()
        page.stop()


def test_the_page_closes_a_half_sent_request(service):
    from fedrelay.coordinator.http_limits import HttpLimits
    from fedrelay.coordinator.web import start_web

    page = start_web("127.0.0.1:0", service, limits_=HttpLimits(max_connections=8, head_timeout=0.2,
                                                                keep_alive=600))
    try:
        s = socket.create_connection(("127.0.0.1", page.port))
        s.sendall(HALF)
        assert closed_by_server(s)
        # A whole request is answered; half of the next one on the same connection is closed too.
        s = socket.create_connection(("127.0.0.1", page.port))
        s.sendall(b"GET /api/runs HTTP/1.1\r\nHost: localhost\r\n\r\n")
        s.settimeout(30)
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        s.sendall(HALF)
        assert closed_by_server(s)
        assert page.protocol.counts.head_timeouts == 2
    finally:
        page.stop()


def test_a_flood_of_errors_logs_a_few_lines_without_tracebacks():
    from fedrelay.limits import QuietFilter

    clock = Clock()
    logger = logging.getLogger("fedrelay.test.flood")
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(self.format(record))

    handler = Keep()
    logger.addHandler(handler)
    logger.propagate = False
    logger.addFilter(QuietFilter(lines=5, window=60, clock=clock))
    try:
        for i in range(1000):
            try:
                raise OSError(24, "Too many open files")
            except OSError:
                logger.exception("socket.accept() out of system resource %d", i)
        assert len(records) == 5 and not any("Traceback" in r for r in records)
        assert "Too many open files" in records[0]
        clock.now += 61
        logger.error("later")
        assert len(records) == 6 and "995 similar lines suppressed" in records[-1]
    finally:
        logger.removeHandler(handler)


# -- the metrics endpoint ----------------------------------------------------------------------------
def test_the_metrics_endpoint_serves_from_a_bounded_pool_and_closes_the_excess():
    """Idle connections neither take a thread each nor are kept beyond the queue."""
    import urllib.request

    from prometheus_client import CollectorRegistry, Counter

    from fedrelay.metrics import MetricsServer

    registry = CollectorRegistry()
    Counter("fedrelay_test_total", "a test counter", registry=registry).inc()
    server = MetricsServer("127.0.0.1:0", registry, workers=2, queued=1, timeout=600)
    held = []
    try:
        threads_before = threading.active_count()
        port = int(server.address.rpartition(":")[2])
        for _ in range(3):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"GET /metrics HTTP/1.1\r\n")
            held.append(s)
        wait_until(lambda: server._server.pending == 3, "3 connections taken")
        extra = socket.create_connection(("127.0.0.1", port))
        assert closed_by_server(extra)
        assert server._server.refused >= 1
        assert threading.active_count() <= threads_before + 2  # the pool's threads, no more
        for s in held:
            s.close()
        wait_until(lambda: server._server.pending == 0, "the held connections to end")
        with urllib.request.urlopen(f"http://{server.address}/metrics", timeout=30) as r:
            assert b"fedrelay_test_total 1.0" in r.read()
    finally:
        for s in held:
            s.close()
        server.close()


def test_the_metrics_endpoint_closes_a_half_sent_request(capfd):
    from prometheus_client import CollectorRegistry

    from fedrelay.metrics import MetricsServer

    server = MetricsServer("127.0.0.1:0", CollectorRegistry(), timeout=0.2)
    try:
        port = int(server.address.rpartition(":")[2])
        for _ in range(3):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            assert closed_by_server(s)
        wait_until(lambda: server._server.pending == 0, "the connections to end")
    finally:
        server.close()
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err


# -- gRPC connections ----------------------------------------------------------------------------------
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000")  # + an empty SETTINGS frame

SERVER = r"""
import resource, sys, threading
resource.setrlimit(resource.RLIMIT_NOFILE, (200, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from fedrelay.server import make_server
from fedrelay.coordinator.ledger import Ledger
from fedrelay.coordinator.service import CoordinatorService
from fedrelay.v1 import coordinator_pb2_grpc
ledger = Ledger(":memory:")
server, port = make_server("127.0.0.1:0")
coordinator_pb2_grpc.add_CoordinatorServicer_to_server(CoordinatorService(ledger), server)
server.start()
print(port, resource.getrlimit(resource.RLIMIT_NOFILE)[0], flush=True)
sys.stdin.read()
"""


@pytest.mark.integration
def test_idle_connections_of_one_client_do_not_starve_the_operator():
    """300 idle HTTP/2 connections to a coordinator started with a soft limit of 200 open files:
    the operator's ListPeers is still answered (the daemon raised its limit; each listener takes
    at most ``limits.max_connections``)."""
    import resource
    import subprocess
    import sys

    import grpc

    from fedrelay.calls import status_message
    from fedrelay.transport import INSECURE
    from fedrelay.v1 import coordinator_pb2_grpc

    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 1200:
        pytest.skip("the hard open-files limit is too low to show the difference")
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    held = []
    try:
        port, _ = map(int, proc.stdout.readline().split())
        for _ in range(300):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(PREFACE)
            held.append(s)
        with INSECURE.channel(f"127.0.0.1:{port}") as channel:
            from fedrelay.v1 import coordinator_pb2 as cpb2

            reply = coordinator_pb2_grpc.CoordinatorStub(channel).ListPeers(cpb2.ListPeersRequest(), timeout=20)
            assert list(reply.peers) == []
    except grpc.RpcError as exc:
        pytest.fail(f"the operator's call failed beside 300 idle connections: {status_message(exc)}")
    finally:
        for s in held:
            s.close()
        proc.stdin.close()
        proc.wait(30)


def test_a_listener_takes_a_bounded_number_of_connections():
    from fedrelay import limits

    assert limits.max_connections(1024) == 256
    assert limits.max_connections(65536) == limits.MAX_CONNECTIONS
    assert limits.max_connections(100) == limits.MIN_CONNECTIONS


def test_connections_per_identity_are_bounded_within_the_idle_window():
    from fedrelay.limits import IdentityConnections

    clock = Clock()
    seen = IdentityConnections(per_identity=2, window=60, exempt=frozenset({"operator"}), clock=clock)
    assert seen.admit("site-a", "ipv4:1.2.3.4:1") and seen.admit("site-a", "ipv4:1.2.3.4:2")
    assert seen.admit("site-a", "ipv4:1.2.3.4:1")  # a connection it already uses
    assert not seen.admit("site-a", "ipv4:1.2.3.4:3")
    assert seen.admit("site-b", "ipv4:1.2.3.5:3")  # another identity has its own
    assert all(seen.admit("operator", f"ipv4:127.0.0.1:{i}") for i in range(10))
    clock.now += 30
    seen.admit("site-a", "ipv4:1.2.3.4:2")
    clock.now += 31  # connection 1 unused for 61 s: the server closed it
    assert seen.admit("site-a", "ipv4:1.2.3.4:3") and seen.count("site-a") == 2


# -- Prepare: warm workers ---------------------------------------------------------------------------
from fedrelay.peer.worker_protocol import TrainJob  # noqa: E402

TRAIN = TrainJob(spec={"task": "image-folder"}, params={}, seed=0, class_index=[], site="site-a", aggregator="",
                 options={}, position=0, round=1, folder="/nowhere", outgoing="/nowhere/out")  # a fake worker's job


class FakeWorker:
    """A worker process stand-in: answers every request at once, frees its host slot on close."""

    def __init__(self, slot):
        self.slot, self.prepared, self.closed = slot, None, False
        self.pid = id(self)
        self.proc = type("Proc", (), {"poll": staticmethod(lambda: None)})()

    def request(self, req, **kw):
        return {"op": req.NAME}

    def close(self, grace=None):
        if not self.closed:
            self.closed = True
            self.slot.release()


@pytest.fixture
def pool(tmp_path):
    from fedrelay.peer.slots import HostSlots
    from fedrelay.peer.worker_pool import WorkerPool

    clock = Clock()
    workers = []

    def start_process(slot):
        workers.append(FakeWorker(slot))
        return workers[-1]

    p = WorkerPool(tmp_path / "data", "cpu", HostSlots(3, tmp_path / "slots"), warm_timeout=120, clock=clock,
                   start_process=start_process)
    p.workers = workers
    p.test_clock = clock
    yield p
    p.close()


def test_one_sender_cannot_pin_the_worker_slots(pool):
    """Prepare for three runs from one sender holds one warm worker; warm workers of other
    senders that fill every slot give way to a job at once; an unused one is closed in time."""
    assert pool.warm("r1", sender="site-x")
    assert not pool.warm("r2", sender="site-x") and not pool.warm("r3", sender="site-x")
    assert not pool.warm("r1", sender="site-y")  # one per run
    assert pool.warm("r4", sender="site-y") and pool.warm("r5", sender="site-z")
    assert pool.slots.try_acquire() is None  # every slot is held by a warm worker
    done = threading.Event()
    answers = []

    def job():
        answers.append(pool.run(TRAIN, run_id="legit"))
        done.set()

    threading.Thread(target=job, daemon=True).start()
    assert done.wait(30), "the job waited for a slot held by a worker started ahead"
    assert answers == [{"op": "train"}] and pool.preempted == 1 and pool.workers[0].closed  # the oldest went
    # The run's own warm worker is used by its job, not preempted.
    assert pool.run(TRAIN, run_id="r4") == {"op": "train"} and pool.workers[1].closed
    # Left unused: closed after warm_timeout; the run's end closes its own at once.
    pool.test_clock.now += 121
    pool.expire()
    assert all(w.closed for w in pool.workers[:3])
    assert pool.warm("r6", sender="site-x")
    pool.drop("r6")
    assert pool.workers[-1].closed and not pool._warm


def test_prepare_holds_a_worker_only_while_the_sender_still_has_a_transfer_for_this_site(tmp_path):
    """A planned sender whose transfer into this site has arrived gets no warm worker."""
    from conftest import image_offers

    from fedrelay.peer.node import PeerNode
    from fedrelay.tasks.image_folder import spec as image_spec
    from fedrelay.tasks.offers import Offer
    from fedrelay.v1 import common_pb2, peer_pb2

    def assignment(run_id):
        order = ["site-a", "site-b"]
        part = chain_plan(order).part_pb("site-b", {n: f"127.0.0.1:{i + 1}" for i, n in enumerate(order)})
        return peer_pb2.Assignment(
            run_id=run_id, position=1, chain_length=2, seed=1, site="site-b", order=order, rounds=1, **part,
            params=common_pb2.TrainingParams(strategy="fedelmy", models_per_site=1, local_epochs=1, warmup_epochs=1,
                                             alpha=1, beta=1, lr=1e-3, batch_size=32, weight_decay=1e-4,
                                             selection="best-val"),
            model=image_spec("cnn", 1, (28, 28), 2).to_pb(), class_index=["x", "y"])

    class Jobs:
        def __init__(self):
            self.warmed = []

        def warm(self, run_id, prefetch=(), spec=None, sender=""):
            self.warmed.append((run_id, sender))
            return True

        def drop(self, run_id):
            pass

        def close(self):
            pass

    jobs = Jobs()
    offers = [Offer.from_dict(d) for d in image_offers({"x": (5, 1), "y": (5, 1)})]
    node = PeerNode("site-b", "127.0.0.1:1", offers, tmp_path, "cpu", None, jobs=jobs)
    node.assign(assignment("r1"))
    node.assign(assignment("r2"))
    assert node.prepare("r1", "site-a", caller="site-a") is True
    run = node.runs["r2"]
    for t in run.assignment.transfers:
        if t.receiver == "site-b":
            run.destination(t).parent.mkdir(parents=True, exist_ok=True)
            run.destination(t).write_bytes(b"arrived")
    assert node.prepare("r2", "site-a", caller="site-a") is False
    assert jobs.warmed == [("r1", "site-a")]


def test_a_site_identity_makes_calls_on_a_bounded_number_of_connections(tmp_path):
    """Over mutual TLS: site-a's third connection is refused (RESOURCE_EXHAUSTED) while its
    first two keep working; the operator is not bounded."""
    import grpc

    from fedrelay import signing
    from fedrelay.coordinator import pki
    from fedrelay.guard import Guard, Limits

    from conftest import registration, start_coordinator
    from fedrelay.transport import Transport
    from fedrelay.v1 import coordinator_pb2_grpc

    pki.init_ca(tmp_path / "pki")
    ids = {"coordinator": Transport.from_dir(tmp_path / "pki" / "coordinator"),
           "operator": Transport.from_dir(tmp_path / "pki" / "operator"),
           "site-a": Transport.from_dir(pki.enroll("site-a", tmp_path / "pki", tmp_path / "a"))}
    server, address, ledger = start_coordinator(tmp_path / "l.sqlite", ids, Guard(Limits(per_identity_connections=2)))

    def connection(who):
        t = ids[who]
        creds = grpc.ssl_channel_credentials(root_certificates=t.ca, private_key=t.key, certificate_chain=t.cert)
        channel = grpc.secure_channel(address, creds, options=[("grpc.ssl_target_name_override", "coordinator"),
                                                               ("grpc.use_local_subchannel_pool", 1)])
        return channel, signing.SigningStub(coordinator_pb2_grpc.CoordinatorStub(channel), signing.signer_for(t))

    channels = []
    try:
        sites = [connection("site-a") for _ in range(3)]
        channels += [c for c, _ in sites]
        for _, s in sites[:2]:
            s.Register(registration("site-a"), timeout=30)
        with pytest.raises(grpc.RpcError) as err:
            sites[2][1].Register(registration("site-a"), timeout=30)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "too many connections" in err.value.details()
        sites[0][1].Register(registration("site-a"), timeout=30)  # its first connections still work
        ops = [connection("operator") for _ in range(4)]
        channels += [c for c, _ in ops]
        for _, s in ops:
            s.ListPeers(cpb.ListPeersRequest(), timeout=30)
    finally:
        for c in channels:
            c.close()
        server.stop(0)
        ledger.close()



def test_the_operator_listener_has_connections_of_its_own():
    """Connections that fill the sites' listener leave the operator's listener free."""
    import grpc

    from fedrelay.server import make_server
    from fedrelay.transport import INSECURE
    from fedrelay.v1 import coordinator_pb2_grpc

    ledger = Ledger(":memory:")
    service = CoordinatorService(ledger)
    server, port = make_server("127.0.0.1:0", also=["127.0.0.1:0"], max_connections=8)
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(service, server)
    server.start()
    held = []
    try:
        for _ in range(20):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(PREFACE)
            held.append(s)
        assert sum(closed_by_server(s) for s in held[8:9]) == 1  # over the quota: closed
        with INSECURE.channel(f"127.0.0.1:{server.also_ports[0]}") as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            assert list(stub.ListPeers(cpb.ListPeersRequest(), timeout=30).peers) == []
        with INSECURE.channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.RpcError) as err:
                coordinator_pb2_grpc.CoordinatorStub(channel).ListPeers(cpb.ListPeersRequest(), timeout=30)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        for s in held:
            s.close()
        server.stop(0)
        service.close()


def test_a_bad_operator_listen_address_names_the_flag(tmp_path):
    from fedrelay.transport import INSECURE
    from fedrelay.coordinator.service import serve

    with pytest.raises(ValueError, match="--operator-listen"):
        serve("127.0.0.1:0", tmp_path / "l.sqlite", transport=INSECURE, operator_listen="nowhere")
