"""Routing around a site that stays down (coordinator --peer-timeout): the chain goes on without
it, the ledger and the run's summary say which site was skipped and which contributed."""

from __future__ import annotations

import json
import time

import pytest

from deploy import local_trial
from conftest import hold_env, hold_folders, write_fashion_like

pytestmark = pytest.mark.system


CHAIN = ["--models-per-site", "2", "--local-epochs", "1", "--warmup-epochs", "1", "--batch-size", "32"]


@pytest.fixture(scope="module")
def trial(tmp_path_factory):
    from fedrelay.datasets.split import split_dataset

    base = tmp_path_factory.mktemp("reroute")
    split_dataset("fashion-mnist", sites=4, dirichlet=1.0, seed=2, out=base / "sites",
                  source=write_fashion_like(base / "idx", n_train=800, n_test=200, seed=9))
    sites = sorted(p for p in (base / "sites").iterdir() if p.is_dir() and p.name.startswith("site-"))
    # Each site's hold folder (peer/jobs.py hold_point): a test stops a site at a known step.
    holds = hold_folders(base, sites)
    with local_trial.LocalTrial(base / "trial", sites, coordinator_args=["--peer-timeout", "3"],
                                site_env=hold_env(holds)) as t:
        t.holds = holds
        yield t


def start(trial, seed: int, chain: list[str] = CHAIN) -> dict:
    res = trial.cli("start-chain", "--seed", str(seed), "--json", *chain, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return show(trial, json.loads(res.stdout)["run_id"])


def show(trial, run_id: str) -> dict:
    from fedrelay.coordinator.client import OperatorClient

    with OperatorClient(trial.coordinator, trial.transport()) as c:
        return c.run(run_id)


def wait_for(trial, run_id: str, predicate, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = show(trial, run_id)
        if predicate(run):
            return run
        time.sleep(0.2)
    raise AssertionError(f"timed out; last summary: {run}")


def site_state(trial, site: str, run_id: str, *expected: str, timeout: float = 60) -> str:
    """The site's own state for the run (its state.json), once it is one of ``expected`` or at
    the timeout."""
    path = trial.workdir / "state" / site / "runs" / run_id / "state.json"
    deadline = time.monotonic() + timeout
    while True:
        state = json.loads(path.read_text())["state"] if path.exists() else None
        if state in expected or time.monotonic() > deadline:
            return state
        time.sleep(0.2)


def test_a_site_down_before_its_hop_is_routed_around(trial):
    # The first site is held after its warm-up (only the first site warms up) until the
    # coordinator has routed around b: the first hop cannot reach b before b goes down.
    holds = [trial.holds[s] / "hold-warmup" for s in trial.names]
    for hold in holds:
        hold.touch()
    try:
        run = start(trial, 1)
        a, b, c, d = run["order"]
        trial.kill(b)  # down for good, before the model reaches it
        wait_for(trial, run["run_id"], lambda r: r["skipped"] == [b])
    finally:
        for hold in holds:
            hold.unlink(missing_ok=True)
    try:
        done = wait_for(trial, run["run_id"], lambda r: r["status"] != "running")
        assert done["status"] == "finished", done["error"]
        assert done["skipped"] == [b]
        assert done["contributors"] == [a, c, d]
        assert [(h["sender"], h["receiver"]) for h in done["hops"]] == [(a, c), (c, d)]
        assert done["total_bytes"] == 2 * done["model_bytes"]
        assert set(done["final"]["per_site"]) == {a, c, d}  # evaluated where the sites are up
        # The ledger's records of the run verify against the CA alone (coordinator audit).
        from fedrelay.coordinator import audit

        bundle = audit.bundle_from_ledger(trial.workdir / "ledger.sqlite", run["run_id"])
        report = audit.verify(bundle, audit.load_ca_file(trial.pki))
        assert report.verdict == "verified", [str(p) for p in report.ordered()]
    finally:
        trial.restart(b)  # the next test needs every peer reachable
        trial.wait_ready(b)
    # Back, b is told that the run is over (Peer.EndRun) and stops waiting for a model.
    assert site_state(trial, b, run["run_id"], "ended") == "ended"
    assert all(site_state(trial, s, run["run_id"], "done") == "done" for s in (a, c, d))


def test_the_last_site_down_after_receiving_makes_its_predecessor_last(trial):
    run = start(trial, 2)
    a, b, c, d = run["order"]
    wait_for(trial, run["run_id"], lambda r: len(r["hops"]) == 3)  # the model has reached d
    trial.kill(d)
    done = wait_for(trial, run["run_id"], lambda r: r["status"] != "running")
    assert done["status"] == "finished", done["error"]
    assert done["skipped"] == [d]
    assert done["contributors"] == [a, b, c]
    last = trial.workdir / "state" / c / "runs" / run["run_id"] / "outgoing.safetensors"
    import hashlib

    assert hashlib.sha256(last.read_bytes()).hexdigest() == done["final"]["sha256"]  # c's pool average
    assert set(done["final"]["per_site"]) == {a, b, c}
    # fetch-model asks the site that produced the final model (c), not the order's last (d, down).
    out = trial.workdir / "rerouted-final.safetensors"
    res = trial.cli("fetch-model", run["run_id"], "-o", str(out), capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    from fedrelay import final_model

    assert final_model.original_sha256(out) == done["final"]["sha256"]  # the fetched file adds metadata
    assert done["final_site"] == c
    trial.restart(d)
    trial.wait_ready(d)
    # d resumes the training it was doing when it went down; the end notice stops it ("ended").
    # On a fast machine d may finish training first and try to deliver the final model: the
    # sites refuse it (d is no longer their last site) and d's run fails there ("failed").
    # Either way d stops, and the run's final model stays c's.
    assert site_state(trial, d, run["run_id"], "ended", "failed") in ("ended", "failed")
    assert show(trial, run["run_id"])["final"]["sha256"] == done["final"]["sha256"]
