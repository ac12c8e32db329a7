"""Bring your own task, end to end, as a federation would do it.

A task package made with ``fedrelay new-task``, changed to read its own file format (JSON Lines)
and to report a metric of its own (top-2 accuracy), is built into a wheel with pip; each of three
sites installs its own copy (the wheel unpacked onto that site daemon's Python path: a package
folder and its ``*.dist-info`` with the entry point, which is what ``pip install`` leaves).
Through real daemons over mutual TLS the task runs FedELMY, FedSeq, FedAvg and MA-Echo; its
metric appears per site and globally in ``show --json``, ``show`` and the run page. Then one
changed line in one site's copy, after the daemons registered, fails the next run before any
transfer, naming the site and both digests. Bad task code (a loader that raises, a model with
the wrong number of outputs, a loss that is not a finite scalar, a task a site lacks) fails its
run, or is refused, with a message naming the site, the task and the cause; every daemon keeps
serving and nothing is half-written.
"""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import urllib.request
import zipfile
from pathlib import Path

import pytest

from conftest import flat
from deploy import local_trial

pytestmark = pytest.mark.system


NAME, PACKAGE = "lab-values", "lab_values"
CLASSES = ["healthy", "pneumonia", "sepsis"]
FEATURES = ["crp", "lactate", "temperature", "wbc"]
RUN = ["-S", "1", "-E", "1", "--warmup-epochs", "1", "--batch-size", "16", "--task", NAME]
STRATEGIES = ["fedelmy", "fedseq", "fedavg", "maecho"]

# --------------------------------------------------------------------------- the task package

# The site's own file format: JSON Lines, one record per sample.
READ_JSONL = '''
def read_split(path: Path) -> tuple[list[str], list[list[float]], list[str]]:
    """One split as JSON Lines: {"values": {feature: number}, "diagnosis": class} per line."""
    import json

    names, rows, labels = None, [], []
    for line, text in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not text.strip():
            continue
        try:
            record = json.loads(text)
            values, label = record["values"], str(record["diagnosis"])
            row = {k: float(v) for k, v in values.items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise DataError(f"{path}, line {line}: not a record of values and a diagnosis ({exc})") from None
        names = names or sorted(row)
        if sorted(row) != names:
            raise DataError(f"{path}, line {line}: values {sorted(row)}, the first line has {names}")
        rows.append([row[n] for n in names])
        labels.append(label)
    if names is None:
        raise DataError(f"{path} holds no record")
    return names, rows, labels
'''

# A metric of the task's own.
TOP2 = '''
    def metrics(self, scores, labels, class_index):
        """Top-2 accuracy (scikit-learn)."""
        from sklearn.metrics import top_k_accuracy_score

        return {"top2_accuracy": float(top_k_accuracy_score(labels.numpy(), scores.numpy(), k=2,
                                                            labels=list(range(len(class_index)))))}
'''

# Task code that goes wrong, registered as more tasks (entry points) at two of the sites.
BAD_TASKS = '''
"""Tasks whose code goes wrong, each in one way."""
import torch
from torch import nn

from lab_values import LabValuesTask


class LoaderRaises(LabValuesTask):
    """Its loader raises, always."""
    def load(self, root):
        raise RuntimeError("the lab export is truncated")


class LoaderRaisesLater(LabValuesTask):
    """Its loader raises once the site folder holds a file named BROKEN."""
    def load(self, root):
        if (root / "BROKEN").exists():
            raise RuntimeError("the lab export is truncated")
        return super().load(root)


class WrongOutputs(LabValuesTask):
    """One logit too many."""
    def build_model(self, spec):
        return nn.Sequential(nn.Linear(len(spec.input["features"]), spec.num_classes + 1))


class VectorLoss(LabValuesTask):
    """A loss per sample, not their mean."""
    def loss(self, outputs, labels):
        return nn.functional.cross_entropy(outputs, labels, reduction="none")


class NanLoss(LabValuesTask):
    """A loss that is NaN."""
    def loss(self, outputs, labels):
        return outputs.sum() * float("nan")
'''
BAD = {"loader-raises": "LoaderRaises", "loader-raises-later": "LoaderRaisesLater", "wrong-outputs": "WrongOutputs",
       "vector-loss": "VectorLoss", "nan-loss": "NanLoss"}


def replace_block(source: str, header: str, new: str) -> str:
    """``source`` with the block that starts with the line ``header`` (a ``def``, with its
    indentation) up to the next line indented as much or less replaced by ``new``."""
    lines = source.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    indent = len(header) - len(header.lstrip())
    end = start + 1
    while end < len(lines) and (not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > indent):
        end += 1
    while end > start + 1 and not lines[end - 1].strip():
        end -= 1
    return "".join(lines[:start]) + new.strip("\n") + "\n" + "".join(lines[end:])


def make_release(root: Path) -> Path:
    """``fedrelay new-task``, adapted (its file format, its metric), built into a wheel by pip."""
    res = subprocess.run([sys.executable, "-m", "fedrelay.cli.fedrelay", "new-task", NAME, "--out",
                          str(root / NAME)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    code = root / NAME / PACKAGE / "__init__.py"
    source = code.read_text()
    assert 'FILES = {"train": "train.csv", "test": "test.csv"}' in source
    source = source.replace('FILES = {"train": "train.csv", "test": "test.csv"}',
                            'FILES = {"train": "train.jsonl", "test": "test.jsonl"}')
    source = replace_block(source, "def read_split(", READ_JSONL)
    source = replace_block(source, "    def metrics(", TOP2)
    code.write_text(source)
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                          "--no-cache-dir", "--quiet", "-w", str(root / "dist"), str(root / NAME)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    (wheel,) = (root / "dist").glob("lab_values-0.1.0-*.whl")
    return wheel


def install(wheel: Path, lib: Path, bad_tasks: bool) -> Path:
    """What ``pip install WHEEL --target LIB`` leaves (the package and its dist-info), and with
    ``bad_tasks`` a module of more tasks with its own entry points."""
    with zipfile.ZipFile(wheel) as z:
        z.extractall(lib)
    if bad_tasks:
        (lib / "bad_tasks.py").write_text(BAD_TASKS)
        info = lib / "bad_tasks-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: bad-tasks\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text("[fedrelay.tasks]\n" + "".join(
            f"{name} = bad_tasks:{cls}\n" for name, cls in BAD.items()))
    return lib


def write_site(folder: Path, seed: int, train: int = 36, test: int = 12) -> Path:
    """A site's folder in the task's JSON Lines format: three diagnoses, four lab values, one
    cluster per diagnosis; each site skews its classes differently."""
    rng = random.Random(seed)
    centres = {"healthy": [5, 1.0, 36.8, 7], "pneumonia": [80, 1.8, 38.6, 14], "sepsis": [150, 4.5, 39.2, 19]}
    weights = [[3, 2, 1], [1, 3, 2], [2, 1, 3]][seed % 3]
    folder.mkdir(parents=True)
    for split, n in (("train", train), ("test", test)):
        labels = [CLASSES[i % 3] for i in range(n)] if split == "test" else rng.choices(CLASSES, weights, k=n)
        with (folder / f"{split}.jsonl").open("w") as f:
            for label in labels:
                values = {k: rng.gauss(c, 0.15 * c + 0.2) for k, c in zip(FEATURES, centres[label])}
                f.write(json.dumps({"values": values, "diagnosis": label}) + "\n")
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The release, three sites with their data and their own copy of it, and a trial of real
    daemons (mutual TLS) with the run page on."""
    root = tmp_path_factory.mktemp("byo")
    wheel = make_release(root)
    sites = [write_site(root / "sites" / f"site-0{i}", seed=i) for i in range(3)]
    libs = {s.name: install(wheel, root / "libs" / s.name, bad_tasks=s.name != "site-02") for s in sites}
    web = free_port()
    with local_trial.LocalTrial(root / "trial", sites, coordinator_args=["--web", f"127.0.0.1:{web}"],
                                site_env={n: {"PYTHONPATH": str(lib)} for n, lib in libs.items()}) as trial:
        trial.libs, trial.web = libs, f"http://127.0.0.1:{web}"
        yield trial


def cli(trial, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return trial.cli(*args, capture_output=True, text=True, timeout=timeout)


def start(trial, *args: str) -> dict:
    res = cli(trial, "start-chain", "--seed", "3", "--wait", "--json", *RUN, *args)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout)


def page(trial, run_id: str) -> dict:
    with urllib.request.urlopen(f"{trial.web}/api/runs/{run_id}", timeout=30) as r:
        return json.load(r)


def run_ids(trial) -> set[str]:
    from fedrelay.coordinator.client import OperatorClient

    with OperatorClient(trial.coordinator, trial.transport()) as c:
        return {r["run_id"] for r in c.runs()}


def summary(trial, run_id: str) -> dict:
    from fedrelay.coordinator.client import OperatorClient

    with OperatorClient(trial.coordinator, trial.transport()) as c:
        return c.run(run_id)


# --------------------------------------------------------------------------- bad task code

# Two sites, the first of them training first: a failure is hers.
BAD_RUN = ["-S", "1", "-E", "1", "--warmup-epochs", "1", "--batch-size", "16", "--peers", "site-00,site-01",
           "--order", "given", "--strategy", "fedseq"]


def still_serving(trial) -> None:
    """Every daemon is alive and answers (a bad task fails its run, never a daemon)."""
    assert trial.dead() == []
    for name in trial.names:
        trial.wait_ready(name, timeout=60)


def nothing_half_written(trial, run_id: str) -> None:
    """No temporary file left behind, and no model to send, at any site of the run."""
    for site in trial.names:
        folder = trial.workdir / "state" / site / "runs" / run_id
        if folder.exists():
            leftovers = [p.name for p in folder.rglob("*") if p.name.endswith((".tmp", ".part"))]
            assert leftovers == [] and not (folder / "outgoing.safetensors").exists(), (site, leftovers)


def test_a_task_a_site_lacks_or_cannot_read_is_refused_at_start(world):
    """Refused by the coordinator from the sites' registrations: no run is made, the message
    names the site, the task and the cause."""
    before = run_ids(world)
    res = cli(world, "start-chain", "--seed", "5", "--wait", *RUN[:-2], "--task", "wrong-outputs")
    assert res.returncode == 2
    assert "task 'wrong-outputs' is not installed at site-02" in flat(res.stderr), res.stderr
    res = cli(world, "start-chain", "--seed", "5", "--wait", *BAD_RUN, "--task", "loader-raises")
    assert res.returncode == 2
    assert "task 'loader-raises' cannot read the data of site-00: RuntimeError: the lab export is truncated" \
        in flat(res.stderr), res.stderr
    assert "Traceback" not in res.stderr
    assert run_ids(world) == before
    still_serving(world)


def test_an_augmentation_the_task_lacks_is_refused_at_start(world):
    """``--augment flip-crop`` for a task that offers none (the template's): refused by the
    coordinator from what the daemons registered, not at the sites after the run started."""
    before = run_ids(world)
    res = cli(world, "start-chain", "--seed", "5", "--wait", *RUN, "--augment", "flip-crop", "--peers",
              "site-00,site-01", "--order", "given")
    assert res.returncode == 2, res.stderr[-2000:]
    assert (f"--augment flip-crop: task {NAME!r} has no train-time augmentation 'flip-crop' at site-00, site-01 "
            "(they offer: none); use --augment none") in flat(res.stderr), res.stderr
    assert "Traceback" not in res.stderr and res.stdout == ""
    assert run_ids(world) == before
    still_serving(world)


@pytest.mark.parametrize("task, cause", [
    ("loader-raises-later", "the lab export is truncated"),
    ("wrong-outputs", "returns (2, 4) for a batch of 2 rows; the run needs float logits of shape (2, 3)"),
    ("vector-loss", "returned (16,), not a scalar"),
    ("nan-loss", "not finite"),
])
def test_bad_task_code_fails_its_run_naming_the_site_the_task_and_the_cause(world, task, cause):
    broken = world.site_dirs[0] / "BROKEN"  # loader-raises-later: the site's data broke after it registered
    broken.write_text("")
    try:
        res = cli(world, "start-chain", "--seed", "5", "--wait", "--json", *BAD_RUN, "--task", task)
    finally:
        broken.unlink()
    assert res.returncode == 1, res.stderr[-2000:]
    run = json.loads(res.stdout)
    assert run["status"] == "failed" and run["final"] is None
    error = run["error"]
    assert error.startswith("site-00: ") and f"task {task!r}" in error and cause in error, error
    assert "Traceback" not in error and "Traceback" not in res.stderr
    assert run["hops"] == []
    nothing_half_written(world, run["run_id"])
    still_serving(world)


# --------------------------------------------------------------------------- the runs


def test_the_new_task_runs_four_strategies_and_reports_its_metric(world):
    from fedrelay import tasks

    digest = tasks.digest_of(world.libs["site-00"] / PACKAGE)
    assert all(tasks.digest_of(lib / PACKAGE) == digest for lib in world.libs.values())
    for strategy in STRATEGIES:
        run = start(world, "--strategy", strategy)
        assert run["status"] == "finished", run["error"]
        assert (run["task"], run["task_version"], run["task_sha256"]) == (NAME, "0.1.0", digest)
        assert run["class_index"] == CLASSES
        final = run["final"]
        assert set(final["per_site"]) == set(world.names)
        for site, v in final["per_site"].items():
            assert 0.0 <= v["metrics"]["top2_accuracy"] <= 1.0 and "auroc" in v["metrics"], (strategy, site, v)
        # The global figure of the task's own metric: the test-sample-weighted mean of the sites'.
        samples = sum(v["test_samples"] for v in final["per_site"].values())
        weighted = sum(v["metrics"]["top2_accuracy"] * v["test_samples"] for v in final["per_site"].values())
        assert final["metrics"]["top2_accuracy"] == pytest.approx(weighted / samples)
        shown = json.loads(cli(world, "show", run["run_id"], "--json").stdout)
        assert shown["final"] == final
        # The table of `show` has a column for it, with each site's value.
        text = cli(world, "show", run["run_id"])
        assert text.returncode == 0, text.stderr
        assert "top2_accuracy" in text.stdout
        assert all(f"{v['metrics']['top2_accuracy']:.4f}" in text.stdout for v in final["per_site"].values())
        # The run page shows it per site and globally.
        table = page(world, run["run_id"])["final_table"]
        keys = [c[0] for c in table["columns"]]
        assert keys[0] == "accuracy" and "top2_accuracy" in keys and "auroc" in keys
        rows = {r["site"]: r for r in table["rows"]}
        assert list(rows) == run["order"]
        for site, v in final["per_site"].items():
            assert rows[site]["values"]["top2_accuracy"] == v["metrics"]["top2_accuracy"]
            assert rows[site]["values"]["accuracy"] == v["accuracy"]
        assert table["global"]["values"]["top2_accuracy"] == final["metrics"]["top2_accuracy"]
        assert table["global"]["test_samples"] == samples
    # The page a browser gets draws that table (tests/test_webpage.py checks it in Chromium).
    html = urllib.request.urlopen(f"{world.web}/runs/{run['run_id']}", timeout=30).read().decode()
    script = urllib.request.urlopen(f"{world.web}/static/run.js", timeout=30).read().decode()
    assert 'id="final"' in html and "d.final_table" in script


def test_one_changed_line_at_one_site_fails_the_run_before_any_transfer(world):
    """The site's own guarantee: its copy changed after its daemon registered (so the
    coordinator pinned the registered digest); the site re-checks at assignment and refuses."""
    from fedrelay import tasks

    code = world.libs["site-01"] / PACKAGE / "__init__.py"
    original = code.read_text()
    pinned = tasks.digest_of(code.parent)
    code.write_text(original.replace("HIDDEN = 32", "HIDDEN = 33", 1))
    changed = tasks.digest_of(code.parent)
    assert changed != pinned
    before = run_ids(world)
    try:
        res = cli(world, "start-chain", "--seed", "4", "--wait", "--json", *RUN, "--strategy", "fedelmy")
    finally:
        code.write_text(original)
    assert res.returncode == 1
    message = flat(res.stderr)
    assert "assignment refused by site-01" in message and f"task '{NAME}' at this site has code SHA-256 {changed}, " \
        f"the run pins {pinned}" in message, res.stderr
    assert "Traceback" not in res.stderr
    (run_id,) = run_ids(world) - before
    run = summary(world, run_id)
    assert run["status"] == "failed" and "site-01" in run["error"]
    assert pinned in run["error"] and changed in run["error"]
    assert run["hops"] == [] and run["final_transfers"] == [] and run["final"] is None
    # Nothing was trained or written for it anywhere: the refusing site never took the run, and
    # no site sent anything.
    for site in world.names:
        folder = world.workdir / "state" / site / "runs" / run["run_id"]
        assert not (folder / "outgoing.safetensors").exists()
    assert not (world.workdir / "state" / "site-01" / "runs" / run["run_id"]).exists()
