"""The fedrelay task ``example-task``: how a site reads its folder, the model, the loss and the
metrics of a federated run (``coordinator start-chain --task example-task``).

Made by ``fedrelay new-task example-task``; adapt it to your data and model (README.md says how).
Every site installs the same release of this package; the run pins the SHA-256 of this folder's
files (``example_task/``), so a site whose copy differs by one byte refuses the run.

**The file format it reads** (change :func:`read_split` and :data:`FILES` for yours)::

    <site folder>/
      train.csv     required
      test.csv      optional (without it the site evaluates nothing)

Each file is CSV (comma-separated, UTF-8): a header row, then one row per sample. The column
``label`` holds the sample's class name (text, e.g. ``benign``); every other column is a numeric
feature (a decimal number with ``.`` as the separator; an empty cell is refused). Every site's
files have the same feature columns in the same order.

**The model** (``--model``): ``mlp`` (the default: features -> 32 -> ReLU -> classes) or
``linear`` (multinomial logistic regression). Its first step standardises each feature with the
federation's mean and standard deviation: every site reports, for its train split, the count,
sum and sum of squares of each feature (aggregates only: no sample leaves a site); the
coordinator sums them into the run's model spec (``spec.input["stats"]``), so every site scales
with the same figures. The standardisation is fixed (not trained) and not part of the model's
state: it is never sent.

**Loss and optimiser**: fedrelay's defaults (mean cross-entropy; Adam with the run's ``--lr``
and ``--weight-decay``).

**A metric of its own**: ``log_loss``, the mean cross-entropy of the final model's predicted
probabilities on a site's test split (scikit-learn), next to fedrelay's built-in accuracy,
balanced accuracy, macro-F1, AUROC, and for two classes sensitivity and specificity.
The run's global ``log_loss`` is the test-sample-weighted mean of the sites' values, which for
a mean over samples is the pooled figure exactly.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

import fedrelay
from fedrelay import DataError

__all__ = ["ExampleTask", "FILES", "LABEL", "read_split"]

#: split -> the file of that split in a site's folder ("test" is optional).
FILES = {"train": "train.csv", "test": "test.csv"}
#: The column that holds each sample's class name.
LABEL = "label"
#: Width of the ``mlp`` model's hidden layer.
HIDDEN = 32


def read_split(path: Path) -> tuple[list[str], list[list[float]], list[str]]:
    """One split's file: ``(feature names, feature rows, class name of each row)``.

    Raises ``fedrelay.DataError`` naming the file, the line and the column, and what to fix: the
    site's administrator sees it when the daemon starts (``peer serve --check`` too)."""
    try:
        with Path(path).open(newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            header = [h.strip() for h in next(reader, [])]
            if not header:
                raise DataError(f"{path} is empty: it needs a header row (the feature names and {LABEL!r})")
            if LABEL not in header:
                raise DataError(f"{path}: no {LABEL!r} column in the header {header} (it holds each sample's class)")
            if len(set(header)) != len(header) or "" in header:
                raise DataError(f"{path}: the header {header} has an empty or repeated column name")
            at = header.index(LABEL)
            names = [h for i, h in enumerate(header) if i != at]
            if not names:
                raise DataError(f"{path}: no feature column besides {LABEL!r}")
            rows, labels = [], []
            for line, cells in enumerate(reader, start=2):
                if not any(c.strip() for c in cells):
                    continue  # a blank line
                if len(cells) != len(header):
                    raise DataError(f"{path}, line {line}: {len(cells)} cells, the header has {len(header)}")
                label = cells[at].strip()
                if not label:
                    raise DataError(f"{path}, line {line}: the {LABEL!r} cell is empty")
                values = []
                for i, cell in enumerate(cells):
                    if i == at:
                        continue
                    try:
                        value = float(cell)
                    except ValueError:
                        raise DataError(f"{path}, line {line}, column {header[i]!r}: {cell!r} is not a number") from None
                    if not math.isfinite(value):
                        raise DataError(f"{path}, line {line}, column {header[i]!r}: {cell!r} is not a finite number")
                    values.append(value)
                rows.append(values)
                labels.append(label)
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise DataError(f"cannot read {path}: {exc}") from None
    return names, rows, labels


class Standardise(nn.Module):
    """``(x - mean) / std`` per feature, with fixed figures (non-persistent buffers: not trained,
    not in the state dict, never sent)."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor(list(mean), dtype=torch.float32), persistent=False)
        self.register_buffer("std", torch.tensor(list(std), dtype=torch.float32), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std


def federation_scaling(stats: dict, features: int) -> tuple[list[float], list[float]]:
    """Per-feature mean and standard deviation from the summed ``count``, ``sum`` and ``sum_sq``
    (mean 0 and SD 1 where the statistics are missing; SD 1 for a constant feature)."""
    count = (stats.get("count") or [0.0])[0]
    if count <= 0 or len(stats.get("sum") or ()) != features or len(stats.get("sum_sq") or ()) != features:
        return [0.0] * features, [1.0] * features
    mean = [s / count for s in stats["sum"]]
    var = [max(q / count - m * m, 0.0) for q, m in zip(stats["sum_sq"], mean)]
    return mean, [math.sqrt(v) if v > 1e-12 else 1.0 for v in var]


class ExampleTask(fedrelay.Task):
    """CSV files of numeric features and a class label per row (see the module docstring)."""

    models = ("mlp", "linear")
    # For two classes: the class that sensitivity, specificity and AUROC call positive
    # (None: the second of the run's sorted class names).
    positive_class = None

    def load(self, root: Path) -> fedrelay.SiteData:
        """Read ``root/train.csv`` (and ``root/test.csv`` when present) into memory. Raises
        ``fedrelay.DataError``."""
        root = Path(root)
        if not (root / FILES["train"]).is_file():
            raise DataError(f"{root / FILES['train']} not found: a site folder of task example-task holds "
                            f"{FILES['train']} (and optionally {FILES['test']}), CSV files with a {LABEL!r} column")
        splits = {split: read_split(root / file) for split, file in FILES.items() if (root / file).is_file()}
        features = splits["train"][0]
        for split, (names, _, _) in splits.items():
            if names != features:
                raise DataError(f"{root / FILES[split]} has the feature columns {names}, {FILES['train']} has "
                                f"{features}: every file needs the same columns in the same order")
        classes = sorted({c for _, _, labels in splits.values() for c in labels})
        position = {c: i for i, c in enumerate(classes)}
        inputs = {s: torch.tensor(rows, dtype=torch.float32).reshape(len(rows), len(features))
                  for s, (_, rows, _) in splits.items()}
        labels = {s: torch.tensor([position[c] for c in names], dtype=torch.int64)
                  for s, (_, _, names) in splits.items()}
        x = inputs["train"].to(torch.float64)
        stats = {"count": [float(x.shape[0])], "sum": x.sum(dim=0).tolist(), "sum_sq": (x * x).sum(dim=0).tolist()}
        return fedrelay.SiteData(class_names=classes, inputs=inputs, labels=labels,
                                 input={"features": features}, stats=stats)

    def build_model(self, spec: fedrelay.ModelSpec) -> nn.Module:
        """The model ``spec.model`` for ``spec.input["features"]`` and ``spec.num_classes``
        classes, standardising with the federation's figures. Raises ``ValueError``."""
        features = spec.input.get("features")
        if not isinstance(features, list) or not features:
            raise ValueError(f"example-task needs the feature names in the input description, got {spec.input_json}")
        n = len(features)
        mean, std = federation_scaling(spec.input.get("stats") or {}, n)
        if spec.model == "mlp":
            head = [nn.Linear(n, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, spec.num_classes)]
        elif spec.model == "linear":
            head = [nn.Linear(n, spec.num_classes)]
        else:
            raise ValueError(f"example-task has no model {spec.model!r} (models: {', '.join(self.models)})")
        return nn.Sequential(Standardise(mean, std), *head)

    def metrics(self, scores: torch.Tensor, labels: torch.Tensor, class_index: Sequence[str]) -> dict[str, float]:
        """``log_loss`` of the site's test split (scikit-learn). ``scores``: float32 ``N x K``
        probabilities; ``labels``: int64 ``N``."""
        from sklearn.metrics import log_loss

        p = scores.to(torch.float64)
        p = p / p.sum(dim=1, keepdim=True)  # float32 softmax rows sum to 1 only within ~1e-7
        return {"log_loss": float(log_loss(labels.numpy(), p.numpy(), labels=list(range(len(class_index)))))}
