"""Faults during a real chain (coordinator and 3 peer daemons as processes, mutual TLS, loopback):
a peer killed with SIGKILL in the middle of its training, a successor that is down when its
predecessor wants to send, and the coordinator killed mid-run. Each daemon is restarted with
the same command; each run must finish with the same final model as the undisturbed run."""

from __future__ import annotations

import json
import time
from pathlib import Path

import grpc
import pytest

from deploy import local_trial, processes
from conftest import hold_env, hold_folders

pytestmark = pytest.mark.system


# The sites are killed at known steps of their training (peer/jobs.py hold_point), not raced.
CHAIN = ["--models-per-site", "3", "--local-epochs", "1", "--warmup-epochs", "1", "--batch-size", "32"]
SEED = "4"


@pytest.fixture(scope="module")
def trial(tmp_path_factory, three_sites):
    base = tmp_path_factory.mktemp("reliability")
    holds = hold_folders(base, three_sites)
    # No routing around a site that is down here (tests/test_reroute.py does that): on a loaded
    # machine the sender may train past the default --peer-timeout while its successor is down,
    # and would then be rerouted past it instead of trying to send.
    with local_trial.LocalTrial(base / "trial", three_sites, site_env=hold_env(holds),
                                coordinator_args=["--peer-timeout", "3600"]) as t:
        t.holds = holds
        yield t


@pytest.fixture(scope="module")
def undisturbed(trial) -> dict:
    res = trial.cli("start-chain", "--seed", SEED, "--wait", "--json", *CHAIN, capture_output=True, text=True,
                    timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    run = json.loads(res.stdout)
    assert run["status"] == "finished"
    return run


def start(trial) -> dict:
    res = trial.cli("start-chain", "--seed", SEED, "--json", *CHAIN, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return show(trial, json.loads(res.stdout)["run_id"])


def show(trial, run_id: str) -> dict:
    from fedrelay.coordinator.client import OperatorClient

    with OperatorClient(trial.coordinator, trial.transport()) as c:
        return c.run(run_id)


def peers(trial) -> list[dict]:
    from fedrelay.coordinator.client import OperatorClient

    with OperatorClient(trial.coordinator, trial.transport()) as c:
        return c.peers()


def wait_until(predicate, timeout: float = 300, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except (grpc.RpcError, OSError, ValueError, KeyError):
            value = None
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def finished(trial, run_id: str) -> dict:
    run = wait_until(lambda: (r := show(trial, run_id))["status"] != "running" and r, what=f"run {run_id} to end")
    assert run["status"] == "finished", run["error"]
    return run


def run_dir(trial, site: str, run_id: str) -> Path:
    return trial.workdir / "state" / site / "runs" / run_id


def test_peers_killed_mid_run_resume_from_their_last_step(trial, undisturbed):
    """The first site killed right after its warm-up, the second in the middle of its pool:
    neither redoes finished work, and the final model is the undisturbed one."""
    first, second = undisturbed["order"][0], undisturbed["order"][1]  # the same seed, the same order
    (trial.holds[first] / "hold-warmup").touch()
    (trial.holds[second] / "hold-pool-1").touch()
    try:
        run = start(trial)
        assert run["order"] == undisturbed["order"]
        wait_until((trial.holds[first] / "held-warmup").exists, what=f"{first} held after its warm-up")
        warm = run_dir(trial, first, run["run_id"]) / "warmup.safetensors"
        warm_stamp = warm.stat().st_mtime_ns
        trial.kill(first)
        (trial.holds[first] / "hold-warmup").unlink()
        trial.restart(first)
        wait_until((trial.holds[second] / "held-pool-1").exists, what=f"{second} held after its first pool model")
        pool1 = run_dir(trial, second, run["run_id"]) / "pool" / "model-1.safetensors"
        pool_stamp = pool1.stat().st_mtime_ns
        state = json.loads((run_dir(trial, second, run["run_id"]) / "state.json").read_text())["state"]
        trial.kill(second)
        (trial.holds[second] / "hold-pool-1").unlink()
        trial.restart(second)  # before any assertion: the module's later tests need every site up
    finally:
        for hold in (trial.holds[first] / "hold-warmup", trial.holds[second] / "hold-pool-1"):
            hold.unlink(missing_ok=True)
    assert state == "training"
    done = finished(trial, run["run_id"])
    assert warm.stat().st_mtime_ns == warm_stamp  # no second warm-up
    assert pool1.stat().st_mtime_ns == pool_stamp  # the finished pool model was not trained again
    assert done["final"]["sha256"] == undisturbed["final"]["sha256"]
    assert [h["sha256"] for h in done["hops"]] == [h["sha256"] for h in undisturbed["hops"]]


def test_successor_and_coordinator_down_mid_run(trial, undisturbed):
    """The last site is down when its predecessor's model is ready, and the coordinator is killed
    while the predecessor retries. The coordinator comes back with the same command, the last
    site on another port (a machine that came back with a new address): the predecessor finds
    it through the coordinator, and the run finishes with the undisturbed final model and no
    extra hop in the ledger."""
    run = start(trial)
    sender, receiver = run["order"][1], run["order"][2]
    trial.kill(receiver)
    state_file = run_dir(trial, sender, run["run_id"]) / "state.json"
    wait_until(lambda: json.loads(state_file.read_text())["state"] == "sending", what=f"{sender} to try sending")
    assert len(show(trial, run["run_id"])["hops"]) == 1
    trial.kill("coordinator")
    time.sleep(1.5)  # a few failed delivery attempts with backoff
    moved = f"127.0.0.1:{processes.free_port()}"
    trial.restart(receiver, listen=moved)
    trial.restart("coordinator")
    done = finished(trial, run["run_id"])
    assert done["final"]["sha256"] == undisturbed["final"]["sha256"]
    assert len(done["hops"]) == 2
    assert set(done["final"]["per_site"]) == set(trial.names)  # evaluated at its new address too
    assert {p.name: p.address for p in peers(trial)}[receiver] == moved
