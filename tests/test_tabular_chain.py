"""The medical demo through real daemons: three hospitals' breast-cancer tables (``coordinator
split-dataset breast-cancer``), a coordinator and three peer daemons as separate processes over
mutual TLS, a FedELMY chain of the built-in ``tabular-csv`` task, its per-site and global
metrics, and the fetched final model on raw features."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from deploy import local_trial

pytestmark = pytest.mark.integration


# Small and quick; the demo's own arguments (Makefile BC_CHAIN_ARGS) train longer.
CHAIN = ["--task", "tabular-csv", "--models-per-site", "2", "--local-epochs", "2", "--warmup-epochs", "2",
         "--lr", "0.01", "--batch-size", "32"]


@pytest.fixture(scope="module")
def trial(tmp_path_factory):
    from fedrelay.datasets.split import split_dataset

    out = tmp_path_factory.mktemp("bc-sites")
    split_dataset("breast-cancer", sites=3, seed=0, out=out)
    sites = sorted(p for p in out.iterdir() if p.is_dir())
    with local_trial.LocalTrial(tmp_path_factory.mktemp("bc-trial"), sites) as t:
        yield t


def test_breast_cancer_chain_reports_hospital_metrics(trial):
    from fedrelay import load_model, tasks
    from sklearn.metrics import roc_auc_score

    res = trial.cli("start-chain", "--seed", "0", "--wait", "--json", *CHAIN, capture_output=True, text=True,
                    timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    run = json.loads(res.stdout)
    assert run["status"] == "finished" and run["strategy"] == "fedelmy" and run["insecure"] is False
    assert run["task"] == "tabular-csv" and run["task_sha256"] == tasks.find("tabular-csv").sha256
    assert run["total_bytes"] == run["expected_total_bytes"] == 2 * run["model_bytes"]  # the ledger's total = plan's
    final = run["final"]
    assert set(final["per_site"]) == set(trial.names)
    for name, site in final["per_site"].items():
        assert site["test_samples"] == 38
        assert {"auroc", "sensitivity", "specificity", "balanced_accuracy", "macro_f1"} <= set(site["metrics"]), name
    assert final["metrics"]["auroc"] >= 0.95
    assert final["metrics"]["sensitivity"] >= 0.8 and final["metrics"]["specificity"] >= 0.8
    shown = trial.cli("show", run["run_id"], "--json", capture_output=True, text=True, timeout=120)
    assert json.loads(shown.stdout)["final"] == final
    # What the demo prints: the per-site and global table.
    table = trial.cli("show", run["run_id"], capture_output=True, text=True, timeout=120)
    assert table.returncode == 0, table.stderr[-2000:]
    assert all(w in table.stdout for w in ("AUROC", "sensitivity", "specificity", "global", *trial.names))

    # The fetched final model standardises raw features itself (the federation's mean and std).
    out = trial.workdir / "final.safetensors"
    assert trial.cli("fetch-model", run["run_id"], "-o", str(out), capture_output=True, timeout=120).returncode == 0
    model, class_names = load_model(out)
    assert class_names == ["benign", "malignant"]
    rows, labels = [], []
    for folder in trial.site_dirs:
        with open(folder / "test.csv", newline="") as f:
            for r in csv.DictReader(f):
                rows.append([float(v) for k, v in r.items() if k not in ("patient_id", "diagnosis")])
                labels.append(r["diagnosis"] == "malignant")
    import torch

    with torch.no_grad():
        scores = torch.softmax(model(torch.tensor(np.array(rows), dtype=torch.float32)), dim=1)[:, 1].numpy()
    assert roc_auc_score(labels, scores) == pytest.approx(final["metrics"]["auroc"], abs=0.01)
