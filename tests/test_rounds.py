"""Few-shot cycles (FedELMY supplementary Alg. 1): `start-chain --rounds T` loops the chain T
times through the real daemons (coordinator and 3 peers as processes, mutual TLS): T·N−1 hops,
a ledger total of (T·N−1)·M from the plan, resume after kill -9 per (round, hop)."""

from __future__ import annotations

import hashlib
import json

import pytest

from test_chain import CHAIN, trial  # noqa: F401 - a fixture: this module's own trial of three sites
from test_reliability import finished, run_dir, show, wait_until

pytestmark = pytest.mark.integration


def start(trial, seed: int, *extra: str, wait: bool = True) -> dict:
    res = trial.cli("start-chain", "--seed", str(seed), *(("--wait",) if wait else ()), "--json", *CHAIN, *extra,
                    capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout)
    return out if wait else show(trial, out["run_id"])


def attested(trial, run_id: str) -> dict:
    """The run once both ends of every transfer have reported (receipts travel in the background)."""
    def settled():
        r = show(trial, run_id)
        return r if all(h["status"] == "done" for h in r["hops"] + r["final_transfers"]) else None

    return wait_until(settled, 60, "every receipt")


@pytest.fixture(scope="module")
def undisturbed(trial) -> dict:
    run = start(trial, 3, "--rounds", "3")
    assert run["status"] == "finished", run["error"]
    return attested(trial, run["run_id"])


def test_three_rounds_make_t_times_n_minus_1_hops_and_the_ledger_total_comes_from_the_plan(trial, undisturbed):
    run = undisturbed
    order, m = run["order"], run["model_bytes"]
    assert run["rounds"] == 3 and m > 0
    hops = run["hops"]
    assert len(hops) == 3 * 3 - 1 == run["planned_hops"]
    assert [h["hop"] for h in hops] == list(range(1, 9))
    assert [h["round"] for h in hops] == [1, 1, 2, 2, 2, 3, 3, 3]
    assert [(h["sender"], h["receiver"]) for h in hops] == [(order[i % 3], order[(i + 1) % 3]) for i in range(8)]
    assert run["total_bytes"] == run["expected_total_bytes"] == 8 * m
    assert {h["status"] for h in hops} == {"done"}  # sender and receiver agree on every hop
    assert all(h["receiver_sha256"] == h["sha256"] for h in hops)
    assert run["final_site"] == order[-1] and len(run["final_transfers"]) == 2
    # Each visit sends a different model; the final one is the last site's round-3 model.
    assert len({h["sha256"] for h in hops} | {run["final"]["sha256"]}) == 9
    last = run_dir(trial, order[-1], run["run_id"]) / "round-3" / "outgoing.safetensors"
    assert hashlib.sha256(last.read_bytes()).hexdigest() == run["final"]["sha256"]
    # The warm-up happens in round 1 only.
    first = run_dir(trial, order[0], run["run_id"])
    assert (first / "warmup.safetensors").exists() and not list(first.glob("round-*/warmup.safetensors"))


def test_one_round_is_the_one_shot_run_and_a_shorter_run_is_a_prefix(trial, undisturbed):
    one = start(trial, 3, "--rounds", "1")
    plain = start(trial, 3)
    assert one["rounds"] == plain["rounds"] == 1 and len(one["hops"]) == 2
    assert one["final"]["sha256"] == plain["final"]["sha256"]
    # Nothing a site does in round r depends on T: a T-round run's final model is the model
    # the last site of round T hands on in a longer run (hop T·N), which the few-shot study uses.
    two = start(trial, 3, "--rounds", "2")
    assert one["final"]["sha256"] == undisturbed["hops"][2]["sha256"]
    assert two["final"]["sha256"] == undisturbed["hops"][5]["sha256"]


def test_killed_in_round_2_with_the_coordinator_it_finishes_with_the_undisturbed_digest(trial, undisturbed):
    run = start(trial, 3, "--rounds", "3", wait=False)
    rid = run["run_id"]
    # Wait until round 2 is under way: a round-2 hop has arrived and its receiver trains.
    got = wait_until(lambda: [h for h in show(trial, rid)["hops"] if h["round"] == 2], what="a round-2 hop")
    victim = got[0]["receiver"]
    trial.kill(victim)
    trial.kill("coordinator")
    trial.restart("coordinator")
    trial.restart(victim)
    done = finished(trial, rid)
    assert done["final"]["sha256"] == undisturbed["final"]["sha256"]
    assert [h["sha256"] for h in done["hops"]] == [h["sha256"] for h in undisturbed["hops"]]
    assert attested(trial, rid)["total_bytes"] == undisturbed["total_bytes"]
