"""The built-in ``tabular-csv`` task (fedrelay/tasks/tabular_csv.py) and ``coordinator split-dataset
breast-cancer`` (fedrelay/datasets/breast_cancer.py): reading a site's CSV files, the errors a site's
administrator sees, the federation's feature scaling from summed statistics, the models."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fedrelay import tasks
from fedrelay.coordinator.plan import PeerInfo, choose_sites
from fedrelay.datasets.split import split_dataset
from fedrelay.datasets.breast_cancer import load_breast_cancer, split_breast_cancer
from fedrelay.peer.worker_main import Worker
from fedrelay.task import DataError, DataSummary, ModelSpec
from fedrelay.tasks.offers import Offer
from fedrelay.tasks.tabular_csv import TabularCsvTask, feature_stats, scaling, spec

TASK = TabularCsvTask()


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def site(tmp_path: Path, train: str, test: str | None = None, toml: str | None = None) -> Path:
    root = tmp_path / "site"
    write(root / "train.csv", train)
    if test is not None:
        write(root / "test.csv", test)
    if toml is not None:
        write(root / "fedrelay.toml", toml)
    return root


TRAIN = "age,bmi,label\n50,22.5,yes\n61,30.25,no\n\n45,27,yes\n"


# --------------------------------------------------------------------------- reading a site


def test_load_reads_features_labels_and_statistics(tmp_path):
    root = site(tmp_path, TRAIN, test="bmi,label,age\n25,no,70\n")  # test's columns in another order
    data = TASK.load(root)
    assert data.class_names == ["no", "yes"]
    assert data.input == {"features": ["age", "bmi"]}
    assert data.inputs["train"].dtype == torch.float32 and data.inputs["train"].shape == (3, 2)
    assert data.inputs["train"].tolist() == [[50.0, 22.5], [61.0, 30.25], [45.0, 27.0]]  # the blank line skipped
    assert data.labels["train"].tolist() == [1, 0, 1]
    assert data.inputs["test"].tolist() == [[70.0, 25.0]] and data.labels["test"].tolist() == [0]
    # the statistics are the train split's only, in float64
    assert data.stats == {"count": [3.0], "sum": [156.0, 79.75], "sum_sq": [50**2 + 61**2 + 45**2,
                                                                          22.5**2 + 30.25**2 + 27**2]}
    summary = TASK.describe(root).check()
    assert summary.classes == {"no": (1, 1), "yes": (2, 0)}
    assert summary.stats == data.stats


def test_config_names_label_drops_and_picks_features(tmp_path):
    train = "id,b,a,outcome,notes\n1,2,3,x,free text\n2,5,6,y,more\n"
    root = site(tmp_path, train, toml='[tabular-csv]\nlabel = "outcome"\ndrop = ["id", "notes"]\n'
                                      '[other-task]\nkey = 1\n')
    data = TASK.load(root)
    assert data.input == {"features": ["b", "a"]} and data.class_names == ["x", "y"]
    assert data.inputs["train"].tolist() == [[2.0, 3.0], [5.0, 6.0]]
    # features pins the order (a site whose export orders the columns differently)
    write(root / "fedrelay.toml", '[tabular-csv]\nlabel = "outcome"\nfeatures = ["a", "b"]\n')
    data = TASK.load(root)
    assert data.input == {"features": ["a", "b"]} and data.inputs["train"].tolist() == [[3.0, 2.0], [6.0, 5.0]]


def test_no_test_csv_is_allowed_with_a_note(tmp_path):
    data = TASK.load(site(tmp_path, TRAIN))
    assert data.num_samples("test") == 0 and data.inputs["test"].shape == (0, 2)
    assert any("no test.csv" in n for n in data.notes)
    assert any("only 3 training rows" in n for n in data.notes)  # the sums disclose nearly single rows


@pytest.mark.parametrize("train, test, toml, words", [
    (None, None, None, ["no train.csv", "header row"]),
    ("", None, None, ["train.csv is empty", "header row"]),
    ("\n\n", None, None, ["train.csv is empty"]),
    ("age,label\n", None, None, ["no data rows"]),
    ("age,bmi,diagnosis\n1,2,x\n", None, None,
     ["train.csv", "no label column 'label'", "age, bmi, diagnosis", "fedrelay.toml", 'label = "..."']),
    ("age,bmi,label\n1,2,x\n3,abc,y\n", None, None,
     ["train.csv: line 3, column 'bmi'", "'abc' is not a number", "drop = [...]"]),
    ("age,bmi,label\n1,2,x\n3,,y\n", None, None, ["line 3, column 'bmi'", "missing (an empty cell)", "impute"]),
    ("age,bmi,label\n1,NaN,x\n", None, None, ["line 2, column 'bmi'", "'NaN', not a finite number"]),
    ("age,bmi,label\n1,inf,x\n", None, None, ["'inf', not a finite number"]),
    ("age,bmi,label\n1,1e39,x\n", None, None, ["beyond the range", "float32"]),
    ("age,bmi,label\n1,2,\n", None, None, ["line 2, column 'label'", "label is missing"]),
    ("age,bmi,label\n1,2,x\n1,2\n", None, None, ["line 3 has 2 cells, the header 3 columns"]),
    ("age,age,label\n1,2,x\n", None, None, ["'age' more than once"]),
    ("age,,label\n1,2,x\n", None, None, ["column 2 of the header row has no name"]),
    ("label\nx\n", None, None, ["no feature column"]),
    ("age,bmi,label\n1,2,.hidden\n", None, None, ["line 2, column 'label'", "cannot be a class name"]),
    (TRAIN, "age,label\n1,x\n", None, ["test.csv", "train.csv", "different columns", "test.csv lacks 'bmi'"]),
    (TRAIN, "age,bmi,weight,label\n1,2,3,x\n", None, ["test.csv has 'weight' that train.csv lacks"]),
    (TRAIN, "age,bmi,label\n1,x,no\n", None, ["test.csv: line 2, column 'bmi'", "not a number"]),
    (TRAIN, None, "[tabular-csv\nlabel =", ["fedrelay.toml", "not valid TOML"]),
    (TRAIN, None, '[tabular-csv]\nlable = "y"\n', ["unknown key(s) lable", "label, drop and features"]),
    (TRAIN, None, "[tabular-csv]\nlabel = 3\n", ["label must be a column name"]),
    (TRAIN, None, '[tabular-csv]\ndrop = "age"\n', ["drop must be a list of column names"]),
    (TRAIN, None, '[tabular-csv]\ndrop = ["label"]\n', ["label column 'label' cannot also be dropped"]),
    (TRAIN, None, '[tabular-csv]\ndrop = ["weight"]\n', ["names column(s) 'weight' that the file lacks"]),
    (TRAIN, None, "[tabular-csv]\nfeatures = []\n", ["features is empty"]),
])
def test_bad_site_is_a_clear_data_error(tmp_path, train, test, toml, words):
    root = tmp_path / "site"
    root.mkdir()
    if train is not None:
        write(root / "train.csv", train)
    if test is not None:
        write(root / "test.csv", test)
    if toml is not None:
        write(root / "fedrelay.toml", toml)
    with pytest.raises(DataError) as err:
        TASK.load(root)
    for w in words:
        assert w in str(err.value), str(err.value)


def test_not_utf8_and_not_a_folder(tmp_path):
    root = site(tmp_path, "x")
    (root / "train.csv").write_bytes(b"age,label\n\xff\xfe1,x\n")
    with pytest.raises(DataError, match="not UTF-8"):
        TASK.load(root)
    with pytest.raises(DataError, match="is not a folder"):
        TASK.load(root / "train.csv")


def test_bom_and_quoted_cells_are_read(tmp_path):
    root = site(tmp_path, '\ufeff"age","weight, kg",label\n" 40 ","70.5","a b"\n')
    data = TASK.load(root)
    assert data.input == {"features": ["age", "weight, kg"]} and data.class_names == ["a b"]
    assert data.inputs["train"].tolist() == [[40.0, 70.5]]


# --------------------------------------------------------------------------- scaling and models


def test_scaling_from_summed_statistics_is_the_pooled_mean_and_std():
    rng = np.random.default_rng(0)
    parts = [rng.normal(100.0, 5.0, (n, 3)) * [1.0, 0.01, 1000.0] for n in (7, 20, 3)]
    total: dict = {}
    for p in parts:
        for k, v in feature_stats(p).items():
            total[k] = [a + b for a, b in zip(total[k], v)] if k in total else v
    mean, std = scaling(total, 3)
    pooled = np.concatenate(parts)
    np.testing.assert_allclose(mean, pooled.mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(std, pooled.std(axis=0), rtol=1e-6)


def test_constant_column_std_is_floored():
    mean, std = scaling(feature_stats(np.array([[5.0, 0.0], [5.0, 0.0]])), 2)
    assert mean == [5.0, 0.0] and std[0] == pytest.approx(5e-6) and std[1] == 1e-12
    model = TASK.build_model(spec(["a", "b"], 2, feature_stats(np.array([[5.0, 0.0], [5.0, 0.0]]))))
    assert torch.isfinite(model(torch.tensor([[5.0, 0.0], [6.0, 1.0]]))).all()


@pytest.mark.parametrize("name, k, layers", [("mlp", 3, 3), ("logistic", 2, 1)])
def test_models_take_raw_features(name, k, layers):
    rows = np.array([[1.0, 200.0], [3.0, 400.0], [2.0, 900.0]])
    model = TASK.build_model(spec(["a", "b"], k, feature_stats(rows), model=name))
    x = torch.tensor(rows, dtype=torch.float32)
    out = model(x)
    assert out.shape == (3, k) and out.dtype == torch.float32
    assert sum(isinstance(m, torch.nn.Linear) for m in model.modules()) == layers
    # the first layer is the fixed standardisation: buffers in the state, no trained parameter
    state = model.state_dict()
    assert state["scale.mean"].dtype == torch.float32 and "scale.mean" not in dict(model.named_parameters())
    np.testing.assert_allclose(state["scale.mean"].numpy(), rows.mean(axis=0), rtol=1e-6)
    np.testing.assert_allclose(state["scale.std"].numpy(), rows.std(axis=0), rtol=1e-6)
    scaled = (x - torch.tensor(rows.mean(axis=0), dtype=torch.float32)) / torch.tensor(rows.std(axis=0),
                                                                                       dtype=torch.float32)
    torch.testing.assert_close(out, model.net(scaled))


def test_build_model_refuses_what_it_cannot_build():
    stats = feature_stats(np.ones((2, 2)))
    with pytest.raises(ValueError, match="no model 'cnn'"):
        TASK.build_model(spec(["a", "b"], 2, stats, model="cnn"))
    with pytest.raises(ValueError, match="summed statistics"):
        TASK.build_model(ModelSpec(task="tabular-csv", model="mlp", num_classes=2, input_json='{"features":["a"]}'))
    with pytest.raises(ValueError, match="1 features"):
        TASK.build_model(spec(["a"], 2, stats))
    with pytest.raises(ValueError, match="feature names"):
        TASK.build_model(ModelSpec(task="tabular-csv", model="mlp", num_classes=2, input_json="{}"))


# --------------------------------------------------------------------------- breast cancer, end to end in-process


@pytest.fixture(scope="module")
def bc_sites(tmp_path_factory) -> list[Path]:
    out = tmp_path_factory.mktemp("bc")
    split_dataset("breast-cancer", sites=3, seed=0, out=out)
    return sorted(p for p in out.iterdir() if p.is_dir())


def test_split_breast_cancer_writes_three_hospitals(bc_sites):
    out = bc_sites[0].parent
    meta = json.loads((out / "split.json").read_text())
    assert meta["name"] == "breast-cancer" and meta["sites"] == 3 and meta["classes"] == ["benign", "malignant"]
    assert [s["site"] for s in meta["per_site"]] == ["site-00", "site-01", "site-02"]
    x, diagnosis, features = load_breast_cancer()
    assert x.shape == (569, 30) and meta["features"] == features and len(features) == 30
    seen: list[int] = []
    for s, folder in zip(meta["per_site"], bc_sites):
        assert (folder / "fedrelay.toml").is_file()
        for split in ("train", "test"):
            with open(folder / f"{split}.csv", newline="") as f:
                rows = list(csv.DictReader(f))
            assert len(rows) == s[f"n_{split}"] == sum(s[split].values())
            for r in rows:
                i = int(r["patient_id"])
                seen.append(i)
                assert r["diagnosis"] == diagnosis[i]
                assert [float(r[c]) for c in features] == x[i].tolist()  # exactly scikit-learn's numbers
        assert s["n_test"] / (s["n_train"] + s["n_test"]) == pytest.approx(0.2, abs=0.01)
        share = (s["train"]["malignant"] + s["test"]["malignant"]) / (s["n_train"] + s["n_test"])
        assert share == pytest.approx(212 / 569, abs=0.01)  # stratified: every site has the overall mix
    assert sorted(seen) == list(range(569))  # every patient once, at one site


def test_split_breast_cancer_is_seeded_and_can_skew(tmp_path, bc_sites):
    again = tmp_path / "again"
    split_breast_cancer(sites=3, seed=0, out=again)
    for folder in bc_sites:
        for name in ("train.csv", "test.csv", "fedrelay.toml"):
            assert (again / folder.name / name).read_bytes() == (folder / name).read_bytes()
    other = split_breast_cancer(sites=3, seed=1, out=tmp_path / "other")
    assert (tmp_path / "other" / "site-00" / "train.csv").read_bytes() != (bc_sites[0] / "train.csv").read_bytes()
    assert sum(s["n_train"] + s["n_test"] for s in other["per_site"]) == 569
    skewed = split_breast_cancer(sites=3, seed=0, out=tmp_path / "skew", dirichlet=0.3)
    shares = [(s["train"]["malignant"] + s["test"]["malignant"]) / (s["n_train"] + s["n_test"])
              for s in skewed["per_site"]]
    assert max(shares) - min(shares) > 0.2 and skewed["dirichlet"] == 0.3
    # rewriting over the previous split replaces its site folders only
    write(tmp_path / "skew" / "notes.txt", "mine")
    split_breast_cancer(sites=2, seed=0, out=tmp_path / "skew")
    assert not (tmp_path / "skew" / "site-02").exists() and (tmp_path / "skew" / "notes.txt").exists()


def test_split_breast_cancer_refuses_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="at most 56 sites"):
        split_breast_cancer(sites=57, seed=0, out=tmp_path / "a")
    with pytest.raises(ValueError, match="--source"):
        split_dataset("breast-cancer", sites=3, seed=0, out=tmp_path / "b", source=tmp_path)
    with pytest.raises(ValueError, match="alpha"):
        split_breast_cancer(sites=3, seed=0, out=tmp_path / "c", dirichlet=-1.0)
    write(tmp_path / "d" / "precious.txt", "x")
    with pytest.raises(ValueError, match="not empty"):
        split_breast_cancer(sites=3, seed=0, out=tmp_path / "d")
    assert not (tmp_path / "a").exists() and sorted(p.name for p in (tmp_path / "d").iterdir()) == ["precious.txt"]


def test_sites_describe_and_the_plan_pins_the_federation_scaling(bc_sites):
    """What the daemons and the coordinator do: each site's worker describes its folder, the
    planner sums the statistics into the run's model spec, and the model built from it scales
    with the mean and standard deviation of all the sites' training rows, computed here
    directly from the files."""
    installed = tasks.find("tabular-csv")
    peers = []
    for folder in bc_sites:
        found = Worker().describe({"data": str(folder), "tasks": {"tabular-csv": installed.sha256}})
        answer = found["tasks"]["tabular-csv"]
        assert "error" not in answer, answer
        assert answer["models"] == ["mlp", "logistic"] and answer["positive_class"] is None
        offer = Offer(name="tabular-csv", version=installed.version, sha256=installed.sha256,
                      models=tuple(answer["models"]), summary=DataSummary.from_dict(answer["summary"]))
        peers.append(PeerInfo(name=folder.name, address="", offers={"tabular-csv": Offer.from_pb(offer.to_pb())}))
    plan = choose_sites(peers, seed=0, task="tabular-csv")
    assert plan.class_index == ["benign", "malignant"] and plan.model.model == "mlp"
    assert plan.model.task_sha256 == installed.sha256
    rows = []
    for folder in bc_sites:
        with open(folder / "train.csv", newline="") as f:
            rows += [[float(r[c]) for c in plan.model.input["features"]] for r in csv.DictReader(f)]
    pooled = np.array(rows)
    assert plan.model.input["stats"]["count"] == [float(len(rows))]
    model = TASK.build_model(plan.model)
    np.testing.assert_allclose(model.scale.mean.numpy(), pooled.mean(axis=0), rtol=1e-6)
    np.testing.assert_allclose(model.scale.std.numpy(), pooled.std(axis=0), rtol=1e-5)
    assert model(torch.tensor(pooled[:5], dtype=torch.float32)).shape == (5, 2)


def test_split_dataset_cli_breast_cancer(tmp_path):
    from typer.testing import CliRunner

    from fedrelay.cli.coordinator import app

    res = CliRunner().invoke(app, ["split-dataset", "breast-cancer", "--sites", "3", "--seed", "2", "--out",
                                   str(tmp_path / "bc")])
    assert res.exit_code == 0, res.output
    assert "wrote 3 sites" in res.output and "site-02: train" in res.output and "--task tabular-csv" in res.output
    assert json.loads((tmp_path / "bc" / "split.json").read_text())["seed"] == 2
    res = CliRunner().invoke(app, ["split-dataset", "breast-cancer", "--sites", "3", "--out", str(tmp_path / "x"),
                                   "--max-train-per-site", "5"])
    assert res.exit_code == 2 and "--max-train-per-site" in res.output and "Traceback" not in res.output
