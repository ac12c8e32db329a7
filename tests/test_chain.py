"""A real chain: a coordinator and 3 peer daemons as separate processes on loopback, driven
through the CLI, on tiny synthetic data, over mutual TLS with a PKI made by the CLI (and once in
plaintext, with --insecure)."""

from __future__ import annotations

import hashlib
import json
import sqlite3

import pytest

from conftest import image_offer_pbs

from deploy import local_trial

pytestmark = pytest.mark.integration


CHAIN = ["--models-per-site", "2", "--local-epochs", "1", "--warmup-epochs", "1", "--batch-size", "32"]


@pytest.fixture(scope="module")
def trial(three_sites, tmp_path_factory):
    with local_trial.LocalTrial(tmp_path_factory.mktemp("trial"), three_sites) as t:
        yield t


def start(trial, seed: int, *extra: str) -> dict:
    res = trial.cli("start-chain", "--seed", str(seed), "--peers", ",".join(trial.names), "--wait", "--json",
                    *CHAIN, *extra,
                    capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout)


def test_one_shot_chain_end_to_end(trial):
    run = start(trial, 7)
    assert run["status"] == "finished" and run["strategy"] == "fedelmy"
    assert run["insecure"] is False  # a TLS coordinator records the run as secure
    assert sorted(run["order"]) == trial.names
    m = run["model_bytes"]
    assert m > 0
    hops = run["hops"]
    assert len(hops) == 2
    assert [(h["sender"], h["receiver"]) for h in hops] == list(zip(run["order"], run["order"][1:]))
    assert all(h["payload_bytes"] == m for h in hops)
    assert all(h["wire_bytes"] >= h["payload_bytes"] for h in hops)
    assert run["total_bytes"] == run["expected_total_bytes"] == 2 * m
    # Each digest in the ledger is the digest of the file the sender sent and the receiver kept.
    for h in hops:
        sent = trial.workdir / "state" / h["sender"] / "runs" / run["run_id"] / "outgoing.safetensors"
        kept = trial.workdir / "state" / h["receiver"] / "runs" / run["run_id"] / "received.safetensors"
        assert hashlib.sha256(sent.read_bytes()).hexdigest() == h["sha256"]
        assert kept.read_bytes() == sent.read_bytes()
    final = run["final"]
    last = trial.workdir / "state" / run["order"][-1] / "runs" / run["run_id"] / "outgoing.safetensors"
    assert hashlib.sha256(last.read_bytes()).hexdigest() == final["sha256"]
    assert set(final["per_site"]) == set(trial.names)
    samples = sum(v["test_samples"] for v in final["per_site"].values())
    assert samples == 200  # equal, disjoint shares of the whole test set
    weighted = sum(v["accuracy"] * v["test_samples"] for v in final["per_site"].values()) / samples
    assert final["accuracy"] == pytest.approx(weighted)
    assert final["accuracy"] > 0.3  # chance is 0.1 on 10 classes
    # The ledger itself holds the same figures.
    db = sqlite3.connect(trial.workdir / "ledger.sqlite")
    rows = db.execute("SELECT payload_bytes, sha256 FROM hops WHERE run_id = ? AND purpose = 'chain' ORDER BY hop",
                      (run["run_id"],)).fetchall()
    assert rows == [(h["payload_bytes"], h["sha256"]) for h in hops]
    # show --json gives the same summary; fetch-model gives the final model's bytes.
    shown = trial.cli("show", run["run_id"], "--json", capture_output=True, text=True, timeout=60)
    assert json.loads(shown.stdout)["final"] == final
    out = trial.workdir / "final.safetensors"
    assert trial.cli("fetch-model", run["run_id"], "-o", str(out), capture_output=True, timeout=60).returncode == 0
    # The fetched file carries metadata (so its own digest differs); its tensors are the final model's.
    from fedrelay import final_model, load_model

    assert final_model.original_sha256(out) == final["sha256"]
    meta = final_model.read_metadata(out)
    assert (meta["final_sha256"], meta["run_id"], meta["model"]) == (final["sha256"], run["run_id"], run["arch"])
    assert (meta["task"], meta["task_sha256"]) == ("image-folder", run["task_sha256"]) and len(run["task_sha256"]) == 64
    model, classes = load_model(out)
    assert classes == run["class_index"] and not model.training
    import torch

    with torch.no_grad():
        shape = (meta["input"]["channels"], meta["input"]["height"], meta["input"]["width"])
        assert model(torch.rand(2, *shape)).shape == (2, len(classes))


def test_same_seed_same_order_same_final_digest(trial):
    a = start(trial, 11, "--strategy", "fedseq")
    b = start(trial, 11, "--strategy", "fedseq")
    assert a["run_id"] != b["run_id"]
    assert a["order"] == b["order"]
    assert [h["sha256"] for h in a["hops"]] == [h["sha256"] for h in b["hops"]]
    assert a["final"]["sha256"] == b["final"]["sha256"]


def test_start_without_wait_returns_the_run_id_and_show_works_while_running(trial):
    res = trial.cli("start-chain", "--seed", "5", "--json", *CHAIN, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    run_id = json.loads(res.stdout)["run_id"]
    shown = json.loads(trial.cli("show", run_id, "--json", capture_output=True, text=True, timeout=60).stdout)
    assert shown["run_id"] == run_id and shown["status"] in ("running", "finished")
    if shown["status"] == "running":
        assert shown["final"] is None
    # Follow it to the end so the next test starts on idle peers.
    for _ in trial_watch(trial, run_id):
        pass


def trial_watch(trial, run_id):
    from fedrelay.coordinator.client import OperatorClient

    with OperatorClient(trial.coordinator, trial.transport()) as c:
        yield from c.watch(run_id)


def test_bad_requests_get_clear_errors(trial):
    res = trial.cli("start-chain", "--seed", "1", "--peers", "site-00,nowhere", capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "nowhere" in res.stderr and "not registered" in res.stderr
    res = trial.cli("start-chain", "--seed", "1", "--strategy", "fedprox", capture_output=True, text=True, timeout=60)
    # A usage error (exit 2) naming the choices, from the registry; no traceback.
    assert res.returncode == 2 and "fedprox" in res.stderr and "fedelmy" in res.stderr and "Traceback" not in res.stderr
    res = trial.cli("show", "no-such-run", capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "unknown run" in res.stderr


def test_unreachable_peer_is_named_and_no_run_starts(trial):
    from fedrelay.transport import Transport
    from fedrelay.coordinator import pki
    from fedrelay.coordinator.client import OperatorClient
    from fedrelay.v1 import coordinator_pb2 as cpb

    # An enrolled site "ghost" registers an address where nothing listens.
    ghost = Transport.from_dir(pki.enroll("ghost", trial.pki, trial.workdir / "ghost.pki"))
    with OperatorClient(trial.coordinator, ghost) as c:
        c.stub.Register(cpb.RegisterRequest(name="ghost", address="127.0.0.1:9",
                                            tasks=image_offer_pbs({"Bag": (20, 2)})), timeout=10)
    with OperatorClient(trial.coordinator, trial.transport()) as c:
        before = len(c.runs())
    res = trial.cli("start-chain", "--seed", "1", "--peers", "site-00,ghost", capture_output=True, text=True,
                    timeout=120)
    assert res.returncode == 1 and "ghost" in res.stderr and "not reachable" in res.stderr
    with OperatorClient(trial.coordinator, trial.transport()) as c:
        assert len(c.runs()) == before


def test_insecure_trial_still_runs_and_is_recorded_insecure(three_sites, tmp_path):
    """Scripts that pass --insecure keep working; the ledger marks their runs insecure. Also: a
    site whose planned port another process took before its daemon bound it (many trials on one
    machine) is restarted on a new port instead of failing the trial."""
    import socket

    t = local_trial.LocalTrial(tmp_path, three_sites[:2], insecure=True)  # two sites: one hop
    taken = t.addresses[t.names[1]]
    holder = socket.socket()
    holder.bind(("127.0.0.1", int(taken.rsplit(":", 1)[1])))
    holder.listen()
    with holder, t:
        assert t.port_retries == {t.names[1]: 1} and t.addresses[t.names[1]] != taken
        res = t.cli("start-chain", "--seed", "3", "--wait", "--json", "--strategy", "fedseq", "-S", "1", "-E", "1",
                    "--warmup-epochs", "1", "--batch-size", "32", capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        assert "warning" in res.stderr and "--insecure" in res.stderr
        run = json.loads(res.stdout)
        assert run["status"] == "finished" and run["insecure"] is True
        db = sqlite3.connect(t.workdir / "ledger.sqlite")
        assert db.execute("SELECT insecure FROM runs WHERE run_id = ?", (run["run_id"],)).fetchone() == (1,)
