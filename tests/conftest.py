"""Shared fixtures: tiny, learnable synthetic data in Fashion-MNIST's IDX format and as site folders."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.synthetic import write_fashion_like

REPO = Path(__file__).resolve().parent.parent

# Every site daemon the tests start (LocalTrial and the netns trial pass the environment on) forks
# its workers from a template that imported torch once (peer/forking.py): a test run starts
# hundreds of short jobs, and a fresh worker's imports cost ~3 s of CPU each. The default path, a
# new Python per worker, is tested in test_light_daemon.py and test_worker.py (WorkerPool and
# WorkerProcess without fork) and by bench/ and `make demo`.
os.environ.setdefault("FEDRELAY_FORK_WORKERS", "1")

# One intra-op thread for torch in the test processes and every daemon and worker they start
# (they inherit the environment): `make test` runs three pytest processes on two cores, each with
# daemons and workers of its own, and torch's default pool (a thread per core, spinning while it
# waits for work) would only fight over the cores: measured alone, tests/test_rounds.py used 16 %
# less CPU with one thread, for the same wall time; under the suite's load more.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Trials of the same site names on loopback share one PKI made through the CLI, copied per trial
# (deploy/local_trial.py PKI_CACHE_ENV): the CLI's PKI commands are tested in their own tests.
import tempfile  # noqa: E402

os.environ.setdefault("FEDRELAY_TRIAL_PKI_CACHE", tempfile.mkdtemp(prefix="fedrelay-test-pki-"))

# `make test` runs the suite in several pytest-xdist processes (most of a test's time is waiting on
# daemons, not computing). Each gets worker slots of its own (peer/slots.py), so that one test's
# daemons never wait for the slots another test's daemons hold.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("FEDRELAY_WORKER_SLOTS_DIR",
                          tempfile.mkdtemp(prefix=f"fedrelay-test-slots-{os.environ['PYTEST_XDIST_WORKER']}-"))


# Tiers: a test marked neither ``integration`` nor ``system`` is a unit test. Under
# FEDRELAY_TEST_TIER=unit (``make test-fast``) a unit test that starts a process fails, naming the
# marker it needs, so the fast tier stays fast and says so when a test outgrows it.
TIER_ENV = "FEDRELAY_TEST_TIER"


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request, monkeypatch):
    if os.environ.get(TIER_ENV) != "unit" or any(request.node.get_closest_marker(m) for m in ("integration", "system")):
        yield
        return
    import multiprocessing.process
    import subprocess

    def refuse(*args, **kwargs):
        raise AssertionError(f"{request.node.nodeid} starts a process: mark it @pytest.mark.integration "
                             "(or system), or keep it in-process")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    yield


@pytest.fixture(scope="session")
def idx_source(tmp_path_factory) -> Path:
    """A folder of tiny synthetic Fashion-MNIST-format IDX files (600 train, 200 test)."""
    return write_fashion_like(tmp_path_factory.mktemp("idx"))


@pytest.fixture(scope="session")
def three_sites(tmp_path_factory, idx_source) -> list[Path]:
    """Three site folders split from the synthetic IDX files (Dirichlet 0.5, seed 0)."""
    from fedrelay.datasets.split import split_dataset

    out = tmp_path_factory.mktemp("sites")
    split_dataset("fashion-mnist", sites=3, dirichlet=0.5, seed=0, out=out, source=idx_source)
    return sorted(p for p in out.iterdir() if p.is_dir() and p.name.startswith("site-"))


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op torch thread in this process while a module trains in-process (its workloads
    are tiny: faster so, and immune to CPU contention); the count before is restored after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def hold_folders(base: Path, sites: list[Path]) -> dict[str, Path]:
    """A hold folder per site under ``base / "holds"`` (``peer/jobs.py`` ``hold_point``), made:
    name -> folder. :func:`hold_env` gives a trial's ``site_env`` for them."""
    holds = {s.name: base / "holds" / s.name for s in sites}
    for folder in holds.values():
        folder.mkdir(parents=True)
    return holds


def hold_env(holds: dict[str, Path]) -> dict[str, dict[str, str]]:
    """``LocalTrial(site_env=...)``: each site's daemon (and its workers) told its hold folder."""
    from fedrelay.peer.jobs import HOLD_ENV

    return {name: {HOLD_ENV: str(folder)} for name, folder in holds.items()}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a daemon started in this process)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_thread(target, **kw):
    """``target(**kw, stop=, ready=)`` (a daemon's ``serve``) in a daemon thread, once ``ready``
    is set (within 60 s): (thread, its stop event)."""
    import threading

    stop, ready = threading.Event(), threading.Event()
    t = threading.Thread(target=target, kwargs=dict(kw, stop=stop, ready=ready), daemon=True)
    t.start()
    assert ready.wait(60), f"{target.__module__} did not start"
    return t, stop


def image_offers(classes: dict[str, tuple[int, int]] | None = None, shape=(1, 28, 28)) -> list[dict]:
    """A site's registration offers (``Offer.to_dict()``) for the default image-folder task, as the
    ledger keeps them: ``classes`` name -> (train, test) images of ``shape`` (C, H, W), with the
    digest of the image-folder code installed here (what a real daemon beside it reports)."""
    from fedrelay import __version__, tasks
    from fedrelay.task import DataSummary
    from fedrelay.tasks.offers import Offer

    c, h, w = shape
    summary = DataSummary(classes=dict(classes or {}), input={"channels": c, "height": h, "width": w})
    return [Offer(name="image-folder", version=__version__, sha256=tasks.find(tasks.DEFAULT).sha256,
                  models=("cnn", "resnet18"), summary=summary).to_dict()]


def image_offer_pbs(classes: dict[str, tuple[int, int]] | None = None, shape=(1, 28, 28)) -> list:
    """:func:`image_offers` as ``TaskOffer`` messages (a ``RegisterRequest``'s ``tasks``)."""
    from fedrelay.tasks.offers import Offer

    return [Offer.from_dict(d).to_pb() for d in image_offers(classes, shape)]


# The files that take longest (seconds of a quiet 2-core machine, most first): started first.
SLOWEST_FILES = ("test_reliability", "test_rounds", "test_star", "test_chain", "test_bench_accuracy", "test_privacy",
                 "test_bench", "test_watching", "test_export", "test_outbound", "test_netns",
                 "test_byo_task", "test_new_task", "test_light_daemon", "test_reroute", "test_audit",
                 "test_bench_peer_system")


def pytest_collection_modifyitems(config, items):
    """The slowest files first: with ``make test``'s ``--dist loadfile --no-loadscope-reorder``
    every file goes whole to one xdist process in this order, so the minutes-long trials start at
    once, side by side, and the short tests fill the processes around them: first the files of
    :data:`SLOWEST_FILES`, then the other system, integration and unit files (stable within each)."""
    def tier(item) -> int:
        if item.get_closest_marker("system"):
            return 0
        return 1 if item.get_closest_marker("integration") else 2

    rank = {}
    for item in items:  # a file's rank: where SLOWEST_FILES lists it, else its slowest tier
        path = item.nodeid.split("::")[0]
        stem = path.rsplit("/", 1)[-1].removesuffix(".py")
        own = (0, SLOWEST_FILES.index(stem)) if stem in SLOWEST_FILES else (1 + tier(item), 0)
        rank[path] = min(rank.get(path, own), own)
    items.sort(key=lambda item: rank[item.nodeid.split("::")[0]])


# -- the coordinator's service without a server ------------------------------------------------------
class Aborted(Exception):
    """What :class:`FakeContext` raises for ``context.abort(code, message)``: ``args`` = (code, message)."""


class FakeContext:
    """A ``grpc.ServicerContext`` for calling a servicer method directly: a plaintext caller
    (no identity) at 127.0.0.1; ``abort`` raises :class:`Aborted`."""

    def abort(self, code, message):
        raise Aborted(code, message)

    def auth_context(self):
        return {}

    def peer(self):
        return "ipv4:127.0.0.1:1"


@pytest.fixture
def service():
    """A ``CoordinatorService`` on an in-memory ledger (closed after the test)."""
    from fedrelay.coordinator.ledger import Ledger
    from fedrelay.coordinator.service import CoordinatorService

    ledger = Ledger(":memory:")
    svc = CoordinatorService(ledger)
    yield svc
    svc.close()
    ledger.close()


def new_run(ledger, run_id: str, sites=("a", "b")) -> None:
    """A running chain ``run_id`` of ``sites`` (in that order) in ``ledger``, made directly."""
    from fedrelay.coordinator.plan import chain_plan

    ledger.create_run(run_id, strategy="fedelmy", arch="cnn", seed=1, params={},
                      chain=[{"name": n, "address": "127.0.0.1:9"} for n in sites], class_index=["x"], model={},
                      warnings=[], insecure=True, plan=chain_plan(list(sites)).to_json())


def start_coordinator(db: Path, ids, guard=None):
    """The coordinator's service over mutual TLS (``ids["coordinator"]``) with a ledger at ``db``
    and ``guard`` (default: ``server.make_server``'s). Returns (server, address, ledger); stop and
    close them when done."""
    from fedrelay.coordinator.ledger import Ledger
    from fedrelay.coordinator.service import CoordinatorService
    from fedrelay.server import make_server
    from fedrelay.v1 import coordinator_pb2_grpc

    ledger = Ledger(db)
    server, port = make_server("127.0.0.1:0", transport=ids["coordinator"], guard=guard)
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(
        CoordinatorService(ledger, transport=ids["coordinator"]), server)
    server.start()
    return server, f"127.0.0.1:{port}", ledger


def registration(name: str):
    """A site's ``RegisterRequest``: ``name`` at 127.0.0.1:9 offering the image-folder task (one
    class ``Bag``, 5 training and 1 test image)."""
    from fedrelay.v1 import coordinator_pb2 as cpb

    return cpb.RegisterRequest(name=name, address="127.0.0.1:9", tasks=image_offer_pbs({"Bag": (5, 1)}))


# -- identities ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    """A CA, the coordinator's identity and three sites' (``site-a``, ``site-b``, ``site-c``):
    name -> ``Transport``."""
    from fedrelay.coordinator import pki
    from fedrelay.transport import Transport

    root = tmp_path_factory.mktemp("pki")
    pki.init_ca(root / "pki")
    ids = {"coordinator": Transport.from_dir(root / "pki" / "coordinator")}
    for name in ("site-a", "site-b", "site-c"):
        ids[name] = Transport.from_dir(pki.enroll(name, root / "pki", root / name))
    return ids


def self_signed(name: str, curve=None):
    """A throwaway identity: an EC key (P-256 unless ``curve``, a ``cryptography`` curve class)
    and a self-signed certificate naming ``name``, valid for a day: (key, certificate)."""
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key((curve or ec.SECP256R1)())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + dt.timedelta(days=1))
            .sign(key, hashes.SHA256()))
    return key, cert


# -- daemons in this process -----------------------------------------------------------------------
def serve_in_threads(root: Path, sites: list[Path], tls: dict[str, Path], **peer_options):
    """A coordinator (ledger ``root / "ledger.sqlite"``, identity ``root / "pki" / "coordinator"``)
    and a peer daemon per site folder (identity ``tls[name]``, state ``root / "state" / name``,
    forked workers), each ``serve`` in a thread of this process over mutual TLS.
    ``peer_options``: site name -> extra keyword arguments of its ``serve``. Returns (the
    coordinator's address, [(thread, stop event)] with the coordinator's first); stop them with
    :func:`stop_threads`."""
    from fedrelay.coordinator.service import serve as serve_coordinator
    from fedrelay.peer.daemon import serve as serve_peer
    from fedrelay.transport import Transport

    address = f"127.0.0.1:{free_port()}"
    daemons = [start_thread(serve_coordinator, listen=address, db=root / "ledger.sqlite",
                            transport=Transport.from_dir(root / "pki" / "coordinator"))]
    for d in sites:
        daemons.append(start_thread(serve_peer, data_dir=d, name=d.name, listen=f"127.0.0.1:{free_port()}",
                                    coordinator=address, state_dir=root / "state" / d.name, device="cpu",
                                    transport=Transport.from_dir(tls[d.name]), fork_workers=True,
                                    **peer_options.get(d.name, {})))
    return address, daemons


def stop_threads(daemons) -> None:
    """Stop daemons started by :func:`start_thread`, the last started first, and wait for each (30 s)."""
    for _, stop in reversed(daemons):
        stop.set()
    for t, _ in daemons:
        t.join(30)


def chain_to_the_end(client, names: list[str], params, seed: int = 1) -> tuple[str, dict]:
    """Once every site of ``names`` has registered, a chain of them in that order (model ``cnn``,
    ``params`` a ``TrainParams``) started with ``client`` (an ``OperatorClient``) and watched to
    its end: (run id, the run's summary)."""
    import time

    while {p.name for p in client.peers()} != set(names):  # each registers as it starts
        time.sleep(0.1)
    reply = client.start_chain(peers=names, order="given", seed=seed, model="cnn", params=params)
    for _ in client.watch(reply.run_id):  # the stream ends with the run
        pass
    return reply.run_id, client.run(reply.run_id)


def flat(text: str) -> str:
    """A command's output on one line: rich's wrapping and its panels' borders undone."""
    return " ".join(text.replace("│", " ").split())


def invoke_coordinator(*args: str):
    """``coordinator ARGS`` through typer's test runner at 200 columns; asserts that it printed
    no traceback. Returns the ``Result``."""
    from typer.testing import CliRunner

    from fedrelay.cli import coordinator as coord_cli

    res = CliRunner().invoke(coord_cli.app, list(args), env={"COLUMNS": "200"})
    assert "Traceback" not in res.output, res.output
    return res
