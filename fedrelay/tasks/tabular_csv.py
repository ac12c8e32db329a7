"""``tabular-csv``: a site's table of numeric features and a class label, as CSV files; an MLP or
a logistic regression over the features, standardised with the federation's mean and standard
deviation (computed from summed statistics: no site's rows are pooled).

**Site folder**::

    site/
      train.csv          (required)
      test.csv           (optional: without it, the site trains but evaluates nothing)
      fedrelay.toml      (optional: which column is the label, which columns to use)

Each CSV file (UTF-8, a byte-order mark allowed, comma-separated, as the ``csv`` module reads
Excel's dialect) has a header row naming its columns, then one row per sample (a patient): a
**label** column, whose values are the class names (any text: ``malignant``/``benign``,
``0``/``1``; ``1`` and ``1.0`` are two different classes), and numeric **feature** columns
(anything Python's ``float`` reads: ``12.5``, ``-3``, ``1e-4``). Blank lines are skipped. A
missing value (an empty cell, ``NaN``, ``inf``) is an error: impute it, or leave out the row or
the column, before the run. ``test.csv`` must have the same columns as ``train.csv`` (in any
order). The optional ``fedrelay.toml``::

    [tabular-csv]
    label = "diagnosis"          # the label column (default "label")
    drop = ["patient_id"]        # columns to ignore (identifiers, free text, dates)
    features = ["age", "bmi"]    # or: exactly these feature columns, in this order

Without ``features``, the features are every column but the label and the dropped ones, in the
order of ``train.csv``'s header. Every site of a run must have the same feature columns in the
same order (the sites' input description is ``{"features": [names]}``, compared by the
coordinator); a site whose export orders its columns differently pins the order with
``features``. Other tables of ``fedrelay.toml`` are left to other tasks.

**Scaling without pooling data.** Features are standardised, ``(x - mean) / std``, with the
mean and standard deviation of the training rows of *all* the run's sites, obtained from sums:
each site reports, for its train split only, ``count`` (``[n]``), ``sum`` (per feature, ``Σ x``)
and ``sum_sq`` (per feature, ``Σ x²``), float64 (:attr:`fedrelay.DataSummary.stats`, sent when the
daemon registers); the coordinator adds them up over the run's sites and pins the totals in the
run's model spec (``spec.input["stats"]``); every site builds the same model from them. Then
``mean = Σ sum / Σ count`` and ``std = sqrt(max(Σ sum_sq / Σ count - mean², 0))`` (the population
standard deviation over the pooled training rows, ``numpy.std(ddof=0)``), floored at
``1e-6 · sqrt(Σ sum_sq / Σ count)`` (and at ``1e-12``) so that a constant column, or rounding in
the subtraction, does not divide by zero. The scaling is the model's first layer
(:class:`Standardize`: float32 buffers ``scale.mean`` and ``scale.std`` of the model's state,
carried with its weights and never trained), so the final model fetched by ``coordinator
fetch-model`` takes raw feature values.

**What the sums disclose.** No row leaves a site, but the coordinator learns each site's number
of training rows and, per feature, the mean and variance over them (``sum / n``, ``sum_sq / n``),
and every site learns those of the federation (they are in the run's model spec, and in the
final model's buffers). These are aggregate statistics of a site's cohort, like its class
counts; over very few rows they come close to single patients' values, so a site with fewer than
:data:`FEW_ROWS` training rows gets a warning in its log. A site that may not disclose them
should not offer this task.

**Models** (``coordinator start-chain --model``): ``mlp`` (the default: ``Linear(d, 64)``, ReLU,
``Linear(64, 32)``, ReLU, ``Linear(32, K)``) and ``logistic`` (one ``Linear(d, K)``), each
after the standardisation; inputs are float32 ``N x d`` rows (``d`` features), outputs logits
``N x K``. The loss is the mean cross-entropy and the optimiser Adam (the task defaults).
"""

from __future__ import annotations

import csv
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from fedrelay.names import InvalidName, check_class_name
from fedrelay.task import DataError, ModelSpec, SiteData, Task, canonical_json

__all__ = ["TabularCsvTask", "Standardize", "TabularModel", "Config", "MODELS", "CONFIG_FILE", "TABLE", "FEW_ROWS",
           "read_config", "read_site", "feature_stats", "scaling", "spec"]

MODELS = ("mlp", "logistic")   # the first is the default
CONFIG_FILE = "fedrelay.toml"
TABLE = "tabular-csv"           # the table of CONFIG_FILE this task reads
DEFAULT_LABEL = "label"
FEW_ROWS = 10                   # below this many training rows, the summed statistics near single rows
STD_FLOOR = 1e-6                # relative to the feature's root mean square
STD_MIN = 1e-12
_F32_MAX = 3.4e38               # a feature value beyond this does not fit the model's float32 input
_FIX = "impute it, or leave out the row or the column (drop = [...] in fedrelay.toml), before the run"


@dataclass(frozen=True)
class Config:
    """A site's ``[tabular-csv]`` settings (module docstring): the label column, the columns to
    ignore, and optionally exactly which feature columns to use, in order."""

    label: str = DEFAULT_LABEL
    drop: tuple[str, ...] = ()
    features: tuple[str, ...] | None = None


def read_config(root: Path) -> Config:
    """The ``[tabular-csv]`` table of ``root/fedrelay.toml`` (defaults when the file or the table
    is absent). Raises ``DataError`` for a file that is not TOML, unknown keys (a typo) or values
    of the wrong type."""
    path = Path(root) / CONFIG_FILE
    if not path.is_file():
        return Config()
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: cannot be read: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise DataError(f"{path}: not valid TOML: {exc}") from None
    table = doc.get(TABLE, {})
    if not isinstance(table, dict):
        raise DataError(f"{path}: {TABLE} must be a table ([{TABLE}])")
    unknown = sorted(set(table) - {"label", "drop", "features"})
    if unknown:
        raise DataError(f"{path}: unknown key(s) {', '.join(unknown)} in [{TABLE}]; the keys are label, drop "
                        "and features")
    label = table.get("label", DEFAULT_LABEL)
    if not isinstance(label, str) or not label.strip():
        raise DataError(f"{path}: [{TABLE}] label must be a column name (a non-empty string), got {label!r}")

    def names(key: str) -> tuple[str, ...] | None:
        if key not in table:
            return None
        value = table[key]
        if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
            raise DataError(f"{path}: [{TABLE}] {key} must be a list of column names, got {value!r}")
        stripped = [v.strip() for v in value]
        twice = sorted({v for v in stripped if stripped.count(v) > 1})
        if twice:
            raise DataError(f"{path}: [{TABLE}] {key} lists {', '.join(twice)} more than once")
        return tuple(stripped)

    drop, features = names("drop") or (), names("features")
    label = label.strip()
    if label in drop or (features is not None and label in features):
        raise DataError(f"{path}: [{TABLE}] the label column {label!r} cannot also be dropped or a feature")
    if features is not None:
        both = sorted(set(features) & set(drop))
        if both:
            raise DataError(f"{path}: [{TABLE}] {', '.join(both)} both dropped and listed as features")
        if not features:
            raise DataError(f"{path}: [{TABLE}] features is empty: list at least one feature column")
    return Config(label=label, drop=drop, features=features)


@dataclass
class _Table:
    path: Path
    columns: list[str]          # the header, stripped
    rows: list[tuple[int, list[str]]]  # (line number, cells)


def _read_table(path: Path) -> _Table:
    """Header and rows of one CSV file (blank lines skipped). Raises ``DataError``."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(f)
            header: list[str] | None = None
            rows: list[tuple[int, list[str]]] = []
            for cells in reader:
                if not cells or all(not c.strip() for c in cells):
                    continue
                if header is None:
                    header = [c.strip() for c in cells]
                    continue
                rows.append((reader.line_num, cells))
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text ({exc}); save it as UTF-8 CSV") from None
    except csv.Error as exc:
        raise DataError(f"{path}: not a readable CSV file: {exc}") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot be read: {exc}") from None
    if header is None:
        raise DataError(f"{path} is empty: a tabular-csv file needs a header row naming its columns, then one row "
                        "per sample")
    for i, name in enumerate(header):
        if not name:
            raise DataError(f"{path}: column {i + 1} of the header row has no name; name every column")
    twice = sorted({c for c in header if header.count(c) > 1})
    if twice:
        raise DataError(f"{path}: the header names column(s) {', '.join(repr(c) for c in twice)} more than once")
    return _Table(path=path, columns=header, rows=rows)


def _features(table: _Table, cfg: Config, root: Path) -> list[str]:
    cols = table.columns
    where = f"{table.path}"
    if cfg.label not in cols:
        hint = (f"name the label column in {Path(root) / CONFIG_FILE} ([{TABLE}] label = \"...\")"
                if cfg.label == DEFAULT_LABEL else f"check [{TABLE}] label in {Path(root) / CONFIG_FILE}")
        raise DataError(f"{where}: no label column {cfg.label!r} (columns: {', '.join(cols)}); {hint}")
    missing = [c for c in (*cfg.drop, *(cfg.features or ())) if c not in cols]
    if missing:
        raise DataError(f"{where}: {CONFIG_FILE} names column(s) {', '.join(repr(c) for c in missing)} that the file "
                        f"lacks (columns: {', '.join(cols)})")
    if cfg.features is not None:
        return list(cfg.features)
    found = [c for c in cols if c != cfg.label and c not in cfg.drop]
    if not found:
        raise DataError(f"{where}: no feature column (columns: {', '.join(cols)}, label {cfg.label!r}, dropped: "
                        f"{', '.join(cfg.drop) or 'none'})")
    return found


def _parse(table: _Table, features: list[str], label: str):
    """float64 ``(N, d)`` features and the N label strings. Raises ``DataError`` naming the
    file, line and column of the first bad cell."""
    positions = {c: i for i, c in enumerate(table.columns)}
    cols = [positions[c] for c in features]
    at_label = positions[label]
    x = np.empty((len(table.rows), len(features)), dtype=np.float64)
    labels: list[str] = []
    width = len(table.columns)
    for r, (line, cells) in enumerate(table.rows):
        if len(cells) != width:
            raise DataError(f"{table.path}: line {line} has {len(cells)} cells, the header {width} columns; "
                            "check for a missing or extra comma (a value holding a comma must be quoted)")
        value = cells[at_label].strip()
        if not value:
            raise DataError(f"{table.path}: line {line}, column {label!r}: the label is missing; every row needs "
                            "its class")
        try:
            check_class_name(value)
        except InvalidName:
            raise DataError(f"{table.path}: line {line}, column {label!r}: {value[:40]!r} cannot be a class name "
                            "(1-128 printable characters, no '/' or '\\', not starting with '.')") from None
        labels.append(value)
        for j, c in enumerate(cols):
            cell = cells[c].strip()
            try:
                v = float(cell) if cell else math.nan
            except ValueError:
                raise DataError(f"{table.path}: line {line}, column {features[j]!r}: {cell[:40]!r} is not a number; "
                                "tabular-csv needs numeric features: encode a category as numbers (e.g. one "
                                "0/1 column per value) or leave the column out (drop = [...] in "
                                f"{CONFIG_FILE})") from None
            if not math.isfinite(v):
                what = "missing (an empty cell)" if not cell else f"{cell!r}, not a finite number"
                raise DataError(f"{table.path}: line {line}, column {features[j]!r}: the value is {what}; {_FIX}")
            if abs(v) > _F32_MAX:
                raise DataError(f"{table.path}: line {line}, column {features[j]!r}: {cell[:40]} is beyond the range "
                                "of the model's float32 inputs; rescale the column (e.g. another unit)")
            x[r, j] = v
    return x, labels


def read_site(root: Path):
    """A site folder as arrays: ``(features, {split: (x, labels)}, notes)`` with ``x`` float64
    ``(N, d)`` and ``labels`` a list of N class names; ``"test"`` is missing without
    ``test.csv``. Raises ``DataError`` (module docstring: the rules)."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"{root} is not a folder")
    cfg = read_config(root)
    train_path, test_path = root / "train.csv", root / "test.csv"
    if not train_path.is_file():
        raise DataError(f"{root} holds no train.csv: a tabular-csv site folder needs train.csv (a header row, a "
                        f"{cfg.label!r} column and numeric feature columns) and optionally test.csv")
    train = _read_table(train_path)
    features = _features(train, cfg, root)
    if not train.rows:
        raise DataError(f"{train_path} has a header but no data rows: the site needs training samples")
    out = {"train": _parse(train, features, cfg.label)}
    notes = []
    if test_path.is_file():
        test = _read_table(test_path)
        if set(test.columns) != set(train.columns):
            extra = [c for c in test.columns if c not in train.columns]
            lacking = [c for c in train.columns if c not in test.columns]
            raise DataError(f"{test_path} and {train_path} have different columns: " + "; ".join(
                part for part in (f"test.csv has {', '.join(map(repr, extra))} that train.csv lacks" if extra else "",
                                  f"test.csv lacks {', '.join(map(repr, lacking))}" if lacking else "") if part)
                + "; export both with the same columns")
        out["test"] = _parse(test, features, cfg.label)
    else:
        notes.append(f"no test.csv in {root}: this site trains but evaluates nothing")
    n = len(out["train"][1])
    if n < FEW_ROWS:
        notes.append(f"only {n} training rows: the per-feature sums this site reports (count, sum, sum of squares) "
                     "come close to single patients' values")
    return features, out, notes


def feature_stats(x) -> dict[str, list[float]]:
    """The sufficient statistics of a site's training features ``x`` (float64 ``(N, d)``) that
    the coordinator sums over the run's sites: ``count`` ``[N]``, ``sum`` and ``sum_sq`` (per
    feature, ``Σ x`` and ``Σ x²``), as Python floats."""
    x = np.asarray(x, dtype=np.float64)
    return {"count": [float(x.shape[0])], "sum": [float(v) for v in x.sum(axis=0)],
            "sum_sq": [float(v) for v in np.square(x).sum(axis=0)]}


def scaling(stats: dict, d: int) -> tuple[list[float], list[float]]:
    """``(mean, std)`` per feature (float64 lists of length ``d``) from the summed ``stats``
    (module docstring: the population standard deviation, floored). Raises ``ValueError`` for
    statistics that are missing, of the wrong length, or of no row."""
    try:
        (n,), sums, sq = stats["count"], stats["sum"], stats["sum_sq"]
    except (KeyError, TypeError, ValueError):
        raise ValueError("tabular-csv needs the summed statistics count, sum and sum_sq in the model spec's input "
                         "(spec.input['stats']; a run's spec carries them)") from None
    if len(sums) != d or len(sq) != d:
        raise ValueError(f"tabular-csv statistics have {len(sums)} sums and {len(sq)} sums of squares for {d} features")
    if not n > 0:
        raise ValueError(f"tabular-csv statistics over {n} rows: no training row")
    mean, std = [], []
    for s, q in zip(sums, sq):
        m, ms = s / n, q / n
        sd = math.sqrt(max(ms - m * m, 0.0))
        mean.append(m)
        std.append(max(sd, STD_FLOOR * math.sqrt(max(ms, 0.0)), STD_MIN))
    return mean, std


class Standardize(nn.Module):
    """``(x - mean) / std`` per feature, with fixed float32 buffers ``mean`` and ``std`` of shape
    ``(d,)`` (part of the model's state, so they travel with its weights; never trained):
    float32 ``N x d`` -> float32 ``N x d``."""

    def __init__(self, mean, std) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std

    def extra_repr(self) -> str:
        return f"features={self.mean.shape[0]}"


class TabularModel(nn.Module):
    """:class:`Standardize` (``scale``) then the network (``net``): float32 ``N x d`` raw
    features -> float32 logits ``N x K``."""

    def __init__(self, scale: Standardize, net: nn.Module) -> None:
        super().__init__()
        self.scale = scale
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.scale(x))


class TabularCsvTask(Task):
    """CSV tables of numeric features and a label column (see the module docstring)."""

    models = MODELS

    def load(self, root: Path) -> SiteData:
        """The site's rows as float32 ``N x d`` tensors, labels as positions in the sorted class
        names of the label column (over train and test), the input description
        ``{"features": [names]}`` and the train split's :func:`feature_stats`. Raises
        ``DataError``."""
        features, splits, notes = read_site(root)
        class_names = sorted({c for _, labels in splits.values() for c in labels})
        index = {c: i for i, c in enumerate(class_names)}
        inputs, labels = {}, {}
        for split, (x, names) in splits.items():
            inputs[split] = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
            labels[split] = torch.tensor([index[c] for c in names], dtype=torch.int64)
        return SiteData(class_names=class_names, inputs=inputs, labels=labels, input={"features": features},
                        stats=feature_stats(splits["train"][0]), notes=notes)

    def build_model(self, spec: ModelSpec) -> nn.Module:
        """The standardisation (from ``spec.input["stats"]``) then ``spec.model``: float32
        ``N x d`` raw features -> float32 logits ``N x K``. Raises ``ValueError`` for an unknown
        model or an input description without features or statistics."""
        features = spec.input.get("features")
        if not isinstance(features, list) or not features:
            raise ValueError(f"tabular-csv needs an input description with the feature names, got {spec.input_json}")
        d, k = len(features), spec.num_classes
        mean, std = scaling(spec.input.get("stats") or {}, d)
        if spec.model == "mlp":
            net = nn.Sequential(nn.Linear(d, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, k))
        elif spec.model == "logistic":
            net = nn.Sequential(nn.Linear(d, k))
        else:
            raise ValueError(f"tabular-csv has no model {spec.model!r}: choose one of {', '.join(MODELS)}")
        return TabularModel(Standardize(mean, std), net)


def spec(features: list[str], num_classes: int, stats: dict, model: str = "mlp") -> ModelSpec:
    """The :class:`fedrelay.ModelSpec` of a tabular-csv run over ``features`` with the summed
    ``stats`` (:func:`feature_stats` added up over the sites), without a pinned digest (for
    tests, benchmarks and notebooks that call the training functions)."""
    return ModelSpec(task=TABLE, model=model, num_classes=num_classes,
                     input_json=canonical_json({"features": list(features), "stats": stats}))
