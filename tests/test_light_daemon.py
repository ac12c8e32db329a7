"""The light site daemon (docs/explanation/scale.md). ``peer serve`` imports no torch and stays
small; its work runs in worker processes (peer/worker_pool.py) that exit after their job; a worker
that dies is replaced and the job resumes from its persisted steps with the same result; a warm
worker is started only for a planned sender's Prepare."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from fedrelay.peer.slots import HostSlots
from fedrelay.peer.worker_protocol import Prepare, TrainJob
from fedrelay.peer.worker_pool import WorkerPool
from fedrelay.v1 import peer_pb2, peer_pb2_grpc


pytestmark = pytest.mark.integration

from deploy.processes import free_port


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_an_idle_site_daemon_imports_no_torch_and_stays_small(three_sites, tmp_path):
    """A daemon with its data checked and serving: no torch library mapped, no worker left
    running, resident memory at most 150 MB (the issue's bound)."""
    port = free_port()
    env = {**os.environ, "FEDRELAY_WORKER_SLOTS_DIR": str(tmp_path / "slots")}
    env.pop("FEDRELAY_FORK_WORKERS", None)  # the default: no template process (conftest sets it)
    proc = subprocess.Popen([sys.executable, "-m", "fedrelay.cli.peer", "serve", "--data", str(three_sites[0]),
                             "--name", "site-a", "--listen", f"127.0.0.1:{port}", "--coordinator", "127.0.0.1:1",
                             "--state-dir", str(tmp_path / "state"), "--device", "cpu", "--insecure"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            grpc.channel_ready_future(ch).result(timeout=120)
            st = peer_pb2_grpc.PeerStub(ch).GetStatus(peer_pb2.StatusRequest(), timeout=10)
        assert st.name == "site-a" and st.device == "cpu"
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert "libtorch" not in maps and "/torch/" not in maps
        assert _children(proc.pid) == []  # the start-up check's worker has exited
        assert _rss_mb(proc.pid) <= 150
    finally:
        proc.terminate()
        proc.wait(30)


def _wait_for(path: Path, limit: float = 300.0) -> None:
    """Until ``path`` exists (a bound for a broken build, not a timing margin)."""
    deadline = time.monotonic() + limit
    while not path.exists():
        assert time.monotonic() < deadline, f"timed out waiting for {path.name}"
        time.sleep(0.02)


def _train_request(site: Path, folder: Path, class_index: list[str]) -> TrainJob:
    params = {"strategy": "fedelmy", "models_per_site": 2, "local_epochs": 1, "warmup_epochs": 1, "alpha": 1.0,
              "beta": 1.0, "lr": 1e-3, "batch_size": 32, "weight_decay": 1e-4, "selection": "best-val"}
    from fedrelay.tasks.image_folder import spec as image_spec

    return TrainJob(spec=image_spec("cnn", 1, (28, 28), len(class_index)).to_dict(), params=params, seed=5,
                    class_index=class_index, site=site.name, aggregator="", options={}, position=0, round=1,
                    folder=str(folder), received=None, outgoing=str(folder / "outgoing.safetensors"), initial=None)


def test_a_worker_killed_mid_training_is_replaced_and_gives_the_same_model(three_sites, tmp_path):
    """SIGKILL of the worker held after its first pool model (``peer/jobs.py``'s hold point, so
    the job cannot finish first): the pool starts another worker, which resumes from the
    persisted warm-up and first pool model; the model equals an undisturbed run's, bit for bit.
    The worker killed is the one the pool runs the job on (``busy_pids``), no other process."""
    from fedrelay.peer.jobs import HOLD_ENV
    from fedrelay.tasks.image_folder.scan import scan_site

    site = three_sites[0]
    classes = [f"{i}" for i in range(10)]
    classes = sorted(set(scan_site(site).class_names) | set(classes))
    holds = tmp_path / "holds"
    holds.mkdir()
    pool = WorkerPool(site, "cpu", HostSlots(2, tmp_path / "slots"), env={**os.environ, HOLD_ENV: str(holds)})
    pool.run(_train_request(site, tmp_path / "a", classes))  # no hold file: undisturbed
    assert pool.started == 1

    killed = []
    (holds / "hold-pool-1").touch()

    def on_event(info: dict) -> None:
        if info["model"] == 1 and not killed:  # pool model 1's last epoch: it is persisted, then held
            _wait_for(holds / "held-pool-1")
            killed.extend(pool.busy_pids())
            for pid in killed:
                os.kill(pid, signal.SIGKILL)
            (holds / "hold-pool-1").unlink()  # the next worker resumes after it and is not held

    pool.run(_train_request(site, tmp_path / "b", classes), on_event=on_event)
    assert len(killed) == 1 and pool.started == 3  # the one job worker killed was replaced once
    assert (tmp_path / "b" / "pool" / "model-1.safetensors").exists()
    digest = [hashlib.sha256((tmp_path / x / "outgoing.safetensors").read_bytes()).hexdigest() for x in "ab"]
    assert digest[0] == digest[1]
    assert HostSlots(2, tmp_path / "slots").held() == 0  # every worker gave its slot back


def test_a_second_death_fails_the_job_with_its_reason(three_sites, tmp_path):
    """A worker killed again on the retry: the job fails with WorkerDied naming the signal."""
    from fedrelay.peer.worker_pool import WorkerDied

    site = three_sites[0]
    pool = WorkerPool(site, "cpu", HostSlots(1, tmp_path / "slots"))

    def kill_workers() -> None:  # as the job is sent, once the worker is ready: the pool's own worker
        for pid in pool.busy_pids():
            os.kill(pid, signal.SIGKILL)

    with pytest.raises(WorkerDied, match="killed by SIGKILL"):
        pool.run(_train_request(site, tmp_path / "c", ["0", "1"]), on_start=kill_workers)
    assert pool.started == 2
    assert HostSlots(1, tmp_path / "slots").held() == 0


def test_prepare_is_taken_only_from_a_planned_sender(three_sites, tmp_path):
    """Prepare starts nothing for an unknown run, a site that sends nothing here, or a caller
    whose certificate is not the named sender."""
    from tests.test_transfer import assignment

    from fedrelay.tasks.image_folder.data import load_site
    from fedrelay.peer.node import PeerNode

    node = PeerNode("site-b", "127.0.0.1:1", load_site(three_sites[0]), tmp_path, "cpu", None, start_workers=False)
    node.assign(assignment("r1"))
    with pytest.raises(LookupError):
        node.prepare("nope", "site-a")
    with pytest.raises(PermissionError, match="sends nothing"):
        node.prepare("r1", "site-c")
    with pytest.raises(PermissionError, match="certificate"):
        node.prepare("r1", "site-a", caller="site-c")
    assert node.prepare("r1", "site-a", caller="site-a") is False  # nothing to start in a test node
    # the coordinator, on the planned sender's behalf (this site connects out only)
    assert node.prepare("r1", "site-a", caller="coordinator") is False
    with pytest.raises(PermissionError, match="sends nothing"):
        node.prepare("r1", "site-c", caller="coordinator")


def test_forked_workers_train_the_same_model_and_say_how_they_died(three_sites, tmp_path):
    """``--fork-workers``: a worker forked from the template trains the bit-identical model a new
    Python does, and one killed mid-request is reported with its signal, as a subprocess is."""
    from fedrelay.tasks.image_folder.scan import scan_site
    from fedrelay.peer.worker_pool import WorkerDied, WorkerProcess

    site = three_sites[0]
    classes = sorted(set(scan_site(site).class_names) | {f"{i}" for i in range(10)})
    for fork in (False, True):
        pool = WorkerPool(site, "cpu", HostSlots(2, tmp_path / "slots"), fork=fork)
        pool.run(_train_request(site, tmp_path / f"fork-{fork}", classes))
    digest = [hashlib.sha256((tmp_path / f"fork-{f}" / "outgoing.safetensors").read_bytes()).hexdigest()
              for f in (False, True)]
    assert digest[0] == digest[1]
    worker = WorkerProcess(fork=True)
    try:
        assert worker.request(Prepare(data=str(site), device="cpu"))["event"] == "ready"
        assert Path(f"/proc/{worker.pid}/status").exists() and worker.pid not in _children(os.getpid())
        os.kill(worker.pid, signal.SIGKILL)
        with pytest.raises(WorkerDied, match="killed by SIGKILL"):
            worker.request(_train_request(site, tmp_path / "killed", classes))
    finally:
        worker.close()
