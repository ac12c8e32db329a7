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
    from fedrelay.coordinator.split import split_dataset

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
                 "test_bench", "test_bench_few_shot", "test_watching", "test_export", "test_outbound", "test_netns",
                 "test_byo_task", "test_new_task", "test_light_daemon", "test_reroute", "test_audit")


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
