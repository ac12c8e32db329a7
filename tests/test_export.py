"""A run's curves and final metrics where researchers look: ``coordinator metrics RUN --mlflow
[URI]`` and ``--tensorboard DIR`` (coordinator/export.py). The points and names without daemons;
then two finished runs of real daemons (a coordinator and 3 peers over mutual TLS) exported,
read back with MLflow's own client and TensorBoard's EventAccumulator."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from fedrelay.coordinator import export

pytestmark = pytest.mark.system

ROWS = [
    {"site": "site-a", "stage": "warmup", "model": 0, "epoch": 1, "epochs": 1, "train_loss": 1.5,
     "val_accuracy": 0.25, "seconds": 1.0, "time": 1000.0},
    {"site": "site-a", "stage": "pool", "model": 2, "epoch": 1, "epochs": 2, "train_loss": 1.25,
     "val_accuracy": None, "seconds": 1.0, "time": 1001.0},
    {"site": "site-b", "stage": "pool", "model": 1, "epoch": 2, "epochs": 2, "train_loss": 0.5,
     "val_accuracy": 0.75, "seconds": 1.0, "time": 1002.0},
]


def test_curves_name_site_stage_and_pool_model_and_skip_missing_values():
    points = {(k, step): (v, t) for k, v, step, t in export.curve_points(ROWS)}
    assert points[("site/site-a/warmup/train_loss", 1)] == (1.5, 1000.0)
    assert points[("site/site-a/pool/model2/train_loss", 1)] == (1.25, 1001.0)
    assert ("site/site-a/pool/model2/val_accuracy", 1) not in points  # no validation split: no point
    assert points[("site/site-b/pool/model1/val_accuracy", 2)] == (0.75, 1002.0)
    # The whole run as one curve, epochs counted in the ledger's order.
    assert [points[("run/train_loss", i)][0] for i in (1, 2, 3)] == [1.5, 1.25, 0.5]
    assert {s for (k, s) in points if k == "run/val_accuracy"} == {1, 3}


def test_final_values_are_global_per_site_and_bytes_and_names_are_made_safe():
    summary = {"total_bytes": 200, "expected_total_bytes": 200, "model_bytes": 100,
               "final": {"accuracy": 0.5, "metrics": {"auroc": 0.75, "f1 (macro)": 0.5, "bad": math.nan},
                         "per_site": {"site-a": {"accuracy": 0.25, "test_samples": 8, "metrics": {"auroc": 1.0}}}}}
    got = export.final_values(summary)
    assert got == {"final/accuracy": 0.5, "final/auroc": 0.75, "final/f1 _macro_": 0.5,
                   "final/site/site-a/accuracy": 0.25, "final/site/site-a/test_samples": 8.0,
                   "final/site/site-a/auroc": 1.0, "bytes/total": 200.0, "bytes/expected_total": 200.0,
                   "bytes/model": 100.0}
    assert "final/accuracy" not in export.final_values({"final": None})


# -- two finished runs through real daemons ----------------------------------------------------------

CHAIN = ["--strategy", "fedseq", "--models-per-site", "1", "--local-epochs", "1", "--warmup-epochs", "1",
         "--batch-size", "64"]


@pytest.fixture(scope="module")
def two_runs(three_sites, tmp_path_factory):
    from deploy import local_trial

    with local_trial.LocalTrial(tmp_path_factory.mktemp("export"), three_sites[:2]) as trial:  # two sites suffice
        summaries = []
        for seed in ("1", "2"):
            res = trial.cli("start-chain", "--seed", seed, "--wait", "--json", *CHAIN,
                            capture_output=True, text=True, timeout=300)
            assert res.returncode == 0, res.stderr[-3000:]
            summaries.append(json.loads(res.stdout))
        yield trial, summaries


def _cli(trial, *argv, cwd=None):
    res = trial.cli(*argv, capture_output=True, text=True, timeout=300, cwd=cwd)
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    return res


def test_two_finished_runs_side_by_side_in_mlflow_and_tensorboard(two_runs, tmp_path):
    pytest.importorskip("mlflow", reason="mlflow is not installed (pip install 'fedrelay[export]')")
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install 'fedrelay[export]')")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trial, summaries = two_runs
    store, logdir = tmp_path / "runs.db", tmp_path / "tb"  # a .db file: MLflow's SQLite store
    from fedrelay.coordinator.client import OperatorClient

    with OperatorClient(trial.coordinator, trial.transport()) as operator:
        rows = {s["run_id"]: operator.metrics(s["run_id"]) for s in summaries}
    # The first with --mlflow-uri typed; the second with --mlflow and MLflow's own variable.
    ways = [(["--mlflow-uri", str(store)], {}), (["--mlflow"], {"MLFLOW_TRACKING_URI": f"sqlite:///{store}"})]
    for s, (how, env) in zip(summaries, ways):
        assert s["status"] == "finished"
        saved, trial.env = trial.env, {**trial.env, **env}
        try:
            res = _cli(trial, "metrics", s["run_id"], *how, "--tensorboard", str(logdir))
        finally:
            trial.env = saved
        assert res.returncode == 0, res.stderr[-3000:]
        assert f"to MLflow at sqlite:///{store}" in res.stderr and "TensorBoard" in res.stderr
        assert f"run {s['run_id']}: training per epoch" in res.stdout  # the table as without an export
    # Exporting a run again replaces its export: still one MLflow run per fedrelay run.
    first = summaries[0]
    export.export_mlflow(first, rows[first["run_id"]], str(store))

    client = MlflowClient(tracking_uri=f"sqlite:///{store}")
    experiment = client.get_experiment_by_name("fedrelay")
    runs = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
    assert set(runs) == {s["run_id"] for s in summaries}
    for s in summaries:
        run = runs[s["run_id"]]
        assert run.info.status == "FINISHED"
        assert run.data.tags[export.RUN_ID_TAG] == s["run_id"]
        assert run.data.tags["fedrelay.final_sha256"] == s["final"]["sha256"]
        assert run.data.params["seed"] == str(s["seed"]) and run.data.params["strategy"] == "fedseq"
        assert run.data.metrics["final/accuracy"] == pytest.approx(s["final"]["accuracy"])
        for site, figures in s["final"]["per_site"].items():
            assert run.data.metrics[f"final/site/{site}/accuracy"] == pytest.approx(figures["accuracy"])
        assert run.data.metrics["bytes/total"] == s["total_bytes"]
        curve = client.get_metric_history(run.info.run_id, "run/train_loss")
        want = rows[s["run_id"]]
        assert [m.step for m in sorted(curve, key=lambda m: m.step)] == list(range(1, len(want) + 1))
        assert sorted(m.value for m in curve) == pytest.approx(sorted(r["train_loss"] for r in want))
        # TensorBoard: the same curves and figures, one folder per run under the log dir.
        events = EventAccumulator(str(logdir / s["run_id"]))
        events.Reload()
        scalars = events.Tags()["scalars"]
        assert "run/train_loss" in scalars and "final/accuracy" in scalars
        assert len(events.Scalars("run/train_loss")) == len(want)
        assert events.Scalars("final/accuracy")[0].value == pytest.approx(s["final"]["accuracy"], abs=1e-6)
        for r in want:
            key = f"site/{r['site']}/{r['stage']}" + (f"/model{r['model']}" if r["stage"] == "pool" else "")
            assert f"{key}/train_loss" in scalars
    assert runs[summaries[0]["run_id"]].data.params["seed"] != runs[summaries[1]["run_id"]].data.params["seed"]


def test_a_bad_destination_is_a_clear_error(tmp_path):
    pytest.importorskip("mlflow", reason="mlflow is not installed (pip install 'fedrelay[export]')")
    summary = {"run_id": "r1", "status": "finished", "order": ["site-a"], "final": None}
    with pytest.raises(export.ExportError, match="nosuchscheme://x"):
        export.export_mlflow(summary, ROWS, "nosuchscheme://x")
    (tmp_path / "a-file").write_text("")
    with pytest.raises(export.ExportError, match="a-file"):
        export.export_tensorboard(summary, ROWS, tmp_path / "a-file")


def test_the_daemons_do_not_import_the_exporters():
    code = ("import sys; import fedrelay.coordinator.service, fedrelay.peer.daemon, fedrelay.cli.coordinator; "
            "print(sorted(m for m in ('mlflow', 'tensorboard', 'torch.utils.tensorboard') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
