"""The parallel one-shot methods through real daemons (docs/explanation/methods.md): a star plan around one
aggregating site, over mutual TLS, driven through the CLI, on tiny synthetic data.

Every site trains from the run's initial model at once and uploads its payload (model + the
aggregator's extra tensors) straight to the aggregator, which combines them and copies the final
model to every site; the coordinator never holds a model, and the ledger records the uploads and
the final copies by purpose, with totals from the plan."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time

import pytest

from fedrelay.tasks.image_folder import spec as image_spec
from deploy import local_trial

pytestmark = pytest.mark.integration


# S = 1, E = 2, Ew = 1 on ~70 images per site: seconds per site.
STAR = ["--models-per-site", "1", "--local-epochs", "2", "--warmup-epochs", "1", "--batch-size", "32"]


@pytest.fixture(scope="module")
def trial(three_sites, tmp_path_factory):
    with local_trial.LocalTrial(tmp_path_factory.mktemp("star"), three_sites,
                                coordinator_args=["--peer-timeout", "3"]) as t:
        yield t


def start(trial, seed: int, *extra: str, ok: bool = True):
    res = trial.cli("start-chain", "--seed", str(seed), "--wait", "--json", *STAR, *extra,
                    capture_output=True, text=True, timeout=600)
    if not ok:
        return res
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout)


def run_dir(trial, site: str, run_id: str):
    return trial.workdir / "state" / site / "runs" / run_id


def test_fedavg_star_end_to_end_and_the_ledger_by_purpose(trial):
    run = start(trial, 3, "--strategy", "fedavg")
    assert run["status"] == "finished", run["error"]
    agg = run["aggregator"]
    others = sorted(s for s in run["order"] if s != agg)
    assert agg in trial.names and sorted(run["order"]) == trial.names
    # N-1 uploads into the aggregator, N-1 final copies out of it, and no chain hop.
    assert run["hops"] == [] and run["final_site"] == agg
    assert sorted(u["sender"] for u in run["uploads"]) == others and {u["receiver"] for u in run["uploads"]} == {agg}
    assert sorted(f["receiver"] for f in run["final_transfers"]) == others
    assert all(t["status"] == "done" for t in run["uploads"] + run["final_transfers"])
    # fedavg (samples) sends its train-image count with the model: the upload is a little bigger.
    m, u = run["model_bytes"], run["upload_bytes"]
    assert m > 0 and u > m
    assert run["planned_uploads"] == 2 and run["planned_final_copies"] == 2
    assert run["upload_total_bytes"] + run["final_total_bytes"] == run["expected_total_bytes"] == 2 * u + 2 * m
    # Each digest is the file's that the sender sent and the aggregator kept.
    for up in run["uploads"]:
        sent = run_dir(trial, up["sender"], run["run_id"]) / "outgoing.safetensors"
        kept = run_dir(trial, agg, run["run_id"]) / "uploads" / f"{up['sender']}.safetensors"
        assert hashlib.sha256(sent.read_bytes()).hexdigest() == up["sha256"] and kept.read_bytes() == sent.read_bytes()
    final = run_dir(trial, agg, run["run_id"]) / "final.safetensors"
    assert hashlib.sha256(final.read_bytes()).hexdigest() == run["final"]["sha256"]
    assert set(run["final"]["per_site"]) == set(trial.names) and run["final"]["accuracy"] > 0.2
    db = sqlite3.connect(trial.workdir / "ledger.sqlite")
    purposes = dict(db.execute("SELECT purpose, COUNT(*) FROM hops WHERE run_id = ? GROUP BY purpose",
                               (run["run_id"],)).fetchall())
    assert purposes == {"upload": 2, "final": 2}
    # The human view says the same.
    shown = trial.cli("show", run["run_id"], capture_output=True, text=True, timeout=60).stdout
    assert f"aggregator {agg}" in shown and "uploads" in shown and "(equal)" in shown


def test_same_seed_same_digest_and_the_named_aggregator(trial):
    a = start(trial, 5, "--strategy", "fedavg", "--weighting", "uniform", "--aggregator", trial.names[0])
    b = start(trial, 5, "--strategy", "fedavg", "--weighting", "uniform", "--aggregator", trial.names[0])
    assert a["aggregator"] == b["aggregator"] == trial.names[0]
    assert a["final"]["sha256"] == b["final"]["sha256"]
    assert sorted(u["sha256"] for u in a["uploads"]) == sorted(u["sha256"] for u in b["uploads"])
    assert a["upload_bytes"] == a["model_bytes"]  # uniform weights: nothing but the model is sent


@pytest.mark.parametrize("strategy, extra", [
    ("fedelmy-pfl", ("--models-per-site", "2", "--local-epochs", "1")),
    ("maecho", ("--maecho-tau", "5")),
    ("ofasd", ("--ofasd-epochs", "1")),
    ("fedavg-classaware", ()),
])
def test_each_parallel_method_runs_through_the_daemons(trial, strategy, extra):
    run = start(trial, 9, "--strategy", strategy, *extra)
    assert run["status"] == "finished", run["error"]
    assert run["strategy"] == strategy and len(run["uploads"]) == 2
    assert run["final"]["accuracy"] > 0.1
    if strategy == "maecho":  # projection matrices and class counts ride with the model
        assert run["upload_bytes"] > 2 * run["model_bytes"]
    elif strategy == "fedavg-classaware":  # class counts alone: 10 int64 and their header entry
        assert run["model_bytes"] < run["upload_bytes"] < run["model_bytes"] + 300
    else:
        assert run["upload_bytes"] == run["model_bytes"]
    # Same seed, same digest: through the daemons for FedAvg (test_same_seed_same_digest_...), and
    # for each aggregator's own arithmetic in test_aggregators.py (..._is_deterministic).


def test_initial_weights_file_named_by_its_digest(trial, tmp_path):
    from fedrelay.tensors import encode_state
    from fedrelay.models import build_seeded

    # The trial's images: 1 x 28 x 28, 10 classes (conftest).
    state = build_seeded(image_spec("cnn", 1, (28, 28), 10), 1234).state_dict()
    data = encode_state(state)
    sha = hashlib.sha256(data).hexdigest()
    # No site holds it yet: the run is refused, with where to put it, and nothing runs.
    res = start(trial, 4, "--strategy", "fedavg", "--init", "file", "--init-weights", sha, ok=False)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert "holds no initial-weights file" in res.stderr and "weights" in res.stderr
    # The operator copies it to every site (any name): the run starts from it.
    for name in trial.names:
        (trial.workdir / "state" / name / "weights").mkdir(parents=True, exist_ok=True)
        (trial.workdir / "state" / name / "weights" / "backbone.safetensors").write_bytes(data)
    run = start(trial, 4, "--strategy", "fedavg", "--init", "file", "--init-weights", sha)
    assert run["status"] == "finished", run["error"]
    assert run["params"]["init"] == "file" and run["params"]["init_sha256"] == sha
    # A site whose copy differs refuses the assignment (its digest is not the run's).
    (trial.workdir / "state" / trial.names[1] / "weights" / "backbone.safetensors").write_bytes(data[:-8] + b"\0" * 8)
    res = start(trial, 4, "--strategy", "fedavg", "--init", "file", "--init-weights", sha, ok=False)
    assert res.returncode == 1 and trial.names[1] in res.stderr and "holds no initial-weights file" in res.stderr


def test_a_dead_site_is_not_waited_for_and_the_ledger_says_who_is_missing(trial):
    """A site down past --peer-timeout before its upload: the aggregator combines the others;
    the ledger says it was routed around; it gets no final copy and no evaluation."""
    # A longer warm-up keeps the dead site's upload seconds after the kill below, which follows
    # the start at once.
    res = trial.cli("start-chain", "--seed", "6", "--json", "--strategy", "fedavg", "--aggregator", trial.names[0],
                    *STAR[:STAR.index("--warmup-epochs")], "--warmup-epochs", "4", "--batch-size", "32",
                    capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    run_id = json.loads(res.stdout)["run_id"]
    dead = trial.names[2]
    trial.kill(dead)
    try:
        from fedrelay.coordinator.client import OperatorClient

        with OperatorClient(trial.coordinator, trial.transport()) as c:
            deadline = time.monotonic() + 300
            while (run := c.run(run_id))["status"] == "running" and time.monotonic() < deadline:
                time.sleep(0.5)
        assert run["status"] == "finished", run["error"]
        assert run["skipped"] == [dead] and dead not in run["final"]["per_site"]
        assert [u["sender"] for u in run["uploads"]] == [trial.names[1]]
        assert [f["receiver"] for f in run["final_transfers"]] == [trial.names[1]]
        assert run["planned_uploads"] == 1 and run["planned_final_copies"] == 1
        assert run["upload_total_bytes"] + run["final_total_bytes"] == run["expected_total_bytes"]
        # The ledger's records of the run verify against the CA alone (coordinator audit).
        from fedrelay.coordinator import audit

        bundle = audit.bundle_from_ledger(trial.workdir / "ledger.sqlite", run_id)
        report = audit.verify(bundle, audit.load_ca_file(trial.pki))
        assert report.verdict == "verified", [str(p) for p in report.ordered()]
    finally:
        trial.restart(dead)
        trial.wait_ready(dead)


def test_bad_star_requests_get_clear_errors(trial):
    res = start(trial, 1, "--strategy", "fedavg", "--aggregator", "nowhere", ok=False)
    assert res.returncode == 2 and "--aggregator 'nowhere' is not one of the run's sites" in res.stderr
    res = start(trial, 1, "--strategy", "fedelmy", "--aggregator", trial.names[0], ok=False)
    assert res.returncode == 2 and "only the parallel methods" in res.stderr
    res = start(trial, 1, "--strategy", "maecho", "--rounds", "2", ok=False)
    assert res.returncode == 2 and "one round" in res.stderr


def star_assignment(run_id: str, site: str, strategy: str = "maecho", **params):
    from test_transfer import CLASSES

    from fedrelay.coordinator.plan import star_plan
    from fedrelay.v1 import common_pb2, peer_pb2

    order = ["site-a", "site-b", "site-c"]
    part = star_plan(order, "site-b").part_pb(site, {n: f"127.0.0.1:{i + 1}" for i, n in enumerate(order)})
    return peer_pb2.Assignment(
        run_id=run_id, position=order.index(site), chain_length=3, seed=1, site=site, order=order, rounds=1,
        aggregator="site-b", **part,
        params=common_pb2.TrainingParams(strategy=strategy, models_per_site=1, local_epochs=1, warmup_epochs=1,
                                         alpha=1, beta=1, lr=1e-3, batch_size=32, weight_decay=1e-4,
                                         selection="best-val", **params),
        model=image_spec("cnn", 1, (28, 28), 10).to_pb(),
        class_index=CLASSES)


def test_the_aggregator_stops_waiting_at_the_upload_timeout(three_sites, tmp_path):
    """An upload that never comes (a site alive but stuck, or slower than --upload-timeout): the
    aggregator combines what arrived and names the missing senders."""
    from fedrelay.tasks.image_folder.data import load_site
    from fedrelay.peer.node import PeerNode

    node = PeerNode("site-b", "127.0.0.1:1", load_site(three_sites[0]), tmp_path, "cpu", None, start_workers=False)
    node.assign(star_assignment("r1", "site-b", "fedavg", upload_timeout=0.3))
    run = node.runs["r1"]
    (run.path("uploads")).mkdir()
    (run.path("uploads") / "site-a.safetensors").write_bytes(b"held")  # site-a's upload arrived
    started = time.monotonic()
    arrived, missing = node.star.wait_for_uploads(run)
    assert 0.3 <= time.monotonic() - started < 5
    assert [t.sender for t in arrived] == ["site-a"] and missing == ["site-c"]


def test_an_upload_without_the_aggregators_extra_tensors_is_refused(three_sites, tmp_path):
    """MA-Echo's uploads must carry its projection matrices and class counts: a bare model, or
    extras of the wrong shape, is refused before anything is kept."""
    from fedrelay.tensors import encode_state
    from fedrelay.peer.aggregators import EXTRA
    from fedrelay.tasks.image_folder.data import load_site
    from fedrelay.models import build_seeded
    from fedrelay.peer.node import PeerNode

    node = PeerNode("site-b", "127.0.0.1:1", load_site(three_sites[0]), tmp_path, "cpu", None, start_workers=False)
    a = star_assignment("r2", "site-b")
    node.assign(a)
    from fedrelay.v1 import common_pb2

    state = build_seeded(image_spec("cnn", 1, (28, 28), 10), 1).state_dict()
    with pytest.raises(ValueError, match="tensor names differ"):
        node.schemas.check_model_bytes(a, encode_state(state), common_pb2.UPLOAD)
    from fedrelay import params as run_params
    from fedrelay.peer.aggregators import join_payload
    from fedrelay.peer.aggregators import maecho

    site = load_site(three_sites[0])
    train = site.tensors("train", list(a.class_index))
    opts = run_params.options(run_params.to_dict(a.params))
    made = maecho.site_extras(state, image_spec("cnn", 1, (28, 28), 10), train, opts)
    extras = {k: v.clone() for k, v in join_payload(state, made).items()}
    node.schemas.check_model_bytes(a, encode_state(extras), common_pb2.UPLOAD)  # the real thing passes
    counts = EXTRA + "class_counts"
    extras[counts] = extras[counts][:5]
    with pytest.raises(ValueError, match="class_counts"):
        node.schemas.check_model_bytes(a, encode_state(extras), common_pb2.UPLOAD)
    # A final copy is the bare model: the extras are refused there.
    with pytest.raises(ValueError, match="tensor names differ"):
        node.schemas.check_model_bytes(a, encode_state(extras), common_pb2.FINAL_MODEL)
