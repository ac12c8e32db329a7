"""Tests of the task example-task, on tiny synthetic site folders: ``python -m pytest tests``.

They run the task the way a fedrelay site does: describe and load a site's folder, build the
run's model from the sites' summed statistics, train it, score it with the task's metrics.
"""

from __future__ import annotations

import importlib.metadata
import math
import random
from pathlib import Path

import pytest
import torch

import fedrelay
from example_task import ExampleTask

CLASSES = ["negative", "positive"]
FEATURES = ["age", "marker_a", "marker_b"]


def write_site(folder: Path, seed: int, train: int = 60, test: int = 20) -> Path:
    """A site folder in the task's format: two classes, separable on ``marker_a``."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", train), ("test", test)):
        lines = [",".join([*FEATURES, "label"])]
        for i in range(n):
            label = CLASSES[i % 2]
            shift = 2.0 if label == "positive" else -2.0
            lines.append(f"{rng.gauss(60, 10):.1f},{rng.gauss(shift, 1):.3f},{rng.gauss(0, 1):.3f},{label}")
        (folder / f"{split}.csv").write_text("\n".join(lines) + "\n")
    return folder


def run_spec(task: ExampleTask, summaries: list[fedrelay.DataSummary], model: str = "mlp") -> fedrelay.ModelSpec:
    """The run's model spec as the coordinator makes it from the sites' summaries: the shared
    input description, the summed statistics, the sorted union of the classes."""
    from fedrelay.task import canonical_json

    stats: dict[str, list[float]] = {}
    for s in summaries:
        for key, values in s.stats.items():
            stats[key] = [a + b for a, b in zip(stats[key], values)] if key in stats else list(values)
    classes = sorted({c for s in summaries for c in s.classes})
    return fedrelay.ModelSpec(task="example-task", model=model, num_classes=len(classes),
                              input_json=canonical_json({**summaries[0].input, "stats": stats}))


def test_describe_and_load_agree(tmp_path):
    task = ExampleTask()
    site = write_site(tmp_path / "site-a", seed=1)
    summary = task.describe(site).check()
    assert summary.classes == {"negative": (30, 10), "positive": (30, 10)}
    assert summary.input == {"features": FEATURES}
    data = task.load(site)
    assert data.inputs["train"].shape == (60, 3) and data.inputs["train"].dtype == torch.float32
    assert data.summary().classes == summary.classes


def test_the_model_learns_and_the_metric_is_reported(tmp_path):
    task = ExampleTask()
    sites = [write_site(tmp_path / f"site-{i}", seed=i) for i in range(2)]
    spec = run_spec(task, [task.describe(s) for s in sites])
    torch.manual_seed(0)
    model = task.build_model(spec)
    data = task.load(sites[0])
    x, y = data.tensors("train", CLASSES)
    assert model(task.batch(x[:4], train=False)).shape == (4, spec.num_classes)
    assert set(model.state_dict()) == {"1.weight", "1.bias", "3.weight", "3.bias"}  # the scaling is not sent
    optimizer = task.optimizer(list(model.parameters()), lr=0.01, weight_decay=0.0)
    for _ in range(50):
        loss = task.loss(model(task.batch(x, train=True)), y)
        assert loss.dim() == 0 and math.isfinite(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    tx, ty = data.tensors("test", CLASSES)
    with torch.no_grad():
        scores = torch.softmax(model(task.batch(tx, train=False)), dim=1)
    assert float((scores.argmax(dim=1) == ty).float().mean()) > 0.8
    own = task.metrics(scores, ty, CLASSES)
    assert set(own) == {"log_loss"} and 0 <= own["log_loss"] < math.log(2)


def test_every_model_builds(tmp_path):
    task = ExampleTask()
    spec = run_spec(task, [task.describe(write_site(tmp_path / "s", seed=0))])
    for name in task.models:
        model = task.build_model(fedrelay.ModelSpec(task=spec.task, model=name, num_classes=2,
                                                    input_json=spec.input_json))
        assert model(torch.zeros(3, len(FEATURES))).shape == (3, 2)
    with pytest.raises(ValueError, match="no model"):
        task.build_model(fedrelay.ModelSpec(task=spec.task, model="nope", num_classes=2, input_json=spec.input_json))


def test_bad_files_are_named_with_the_line_and_column(tmp_path):
    task = ExampleTask()
    with pytest.raises(fedrelay.DataError, match="train.csv not found"):
        task.load(tmp_path)
    (tmp_path / "train.csv").write_text("age,label\n61,negative\nsixty,positive\n")
    with pytest.raises(fedrelay.DataError, match=r"line 3, column 'age': 'sixty' is not a number"):
        task.load(tmp_path)
    (tmp_path / "train.csv").write_text("age,weight\n61,80\n")
    with pytest.raises(fedrelay.DataError, match="no 'label' column"):
        task.load(tmp_path)


def test_installed_under_fedrelays_entry_point_group():
    """After ``pip install .``: the site finds the task by its name, with its code's digest."""
    if not any(ep.name == "example-task" for ep in importlib.metadata.entry_points(group="fedrelay.tasks")):
        pytest.skip("the package is not installed (pip install .); the entry point is checked after installing")
    from fedrelay import tasks

    found = tasks.find("example-task")
    assert found.target == "example_task:ExampleTask" and len(found.sha256) == 64
    assert isinstance(tasks.load("example-task", found.sha256), ExampleTask)
