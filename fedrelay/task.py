"""The user's part of a run: a **task** says how to read a site's folder, which model to build,
the loss, the optimiser and the metrics. Strategies and aggregators (FedELMY, FedSeq, FedAvg,
MA-Echo, OFASD ...) are written against this interface only.

A task is an ordinary Python class, installed at each site as a package that registers it under
the entry-point group ``fedrelay.tasks`` (see ``fedrelay new-task``), or named as ``module:attr``
for a module on the site's path. Its code never crosses the network: every site runs the copy its
own IT installed, and the run pins the copy by its SHA-256 (``fedrelay.tasks``).

A task is a classification task: ``build_model`` returns an ``nn.Module`` whose output for a
batch of ``N`` rows is float logits ``N x K`` (``K`` = the run's class count, the sorted union of
the sites' class names). Subclass :class:`Task` and define :meth:`Task.load` and
:meth:`Task.build_model`; everything else has a default::

    import torch
    from torch import nn
    import fedrelay

    class LabValues(fedrelay.Task):
        models = ("mlp",)

        def load(self, root):
            ...  # read root/train.csv and root/test.csv
            return fedrelay.SiteData(class_names=["negative", "positive"],
                                     inputs={"train": x_train, "test": x_test},
                                     labels={"train": y_train, "test": y_test},
                                     input={"features": 12})

        def build_model(self, spec):
            n = spec.input["features"]
            return nn.Sequential(nn.Linear(n, 32), nn.ReLU(), nn.Linear(32, spec.num_classes))

Where the methods run: ``describe`` and ``load`` in the site's worker processes (never in the
daemon, which stays free of torch and of task code), the rest in the worker that trains,
aggregates or evaluates. The coordinator never imports a task.

This module imports no torch at import time (the daemons read :class:`ModelSpec` and
:class:`DataSummary` from it); the methods that need torch import it when called.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:  # pragma: no cover - annotations only
    import torch
    from torch import Tensor, nn

__all__ = ["Task", "SiteData", "DataSummary", "ModelSpec", "DataError", "SPLITS", "canonical_json"]

SPLITS = ("train", "test")


class DataError(ValueError):
    """A site's data folder is unusable for a task; the message names the path, the problem and
    the fix. Raised by :meth:`Task.load` and :meth:`Task.describe`."""


def canonical_json(value: Any) -> str:
    """``value`` as compact JSON with sorted keys: the one text form of a task's input description,
    so that two sites' descriptions compare equal exactly when they are equal. Raises
    ``ValueError`` for a value JSON cannot hold (NaN and infinities included)."""
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"not JSON-able: {exc}") from None


# --------------------------------------------------------------------------- what a site describes


@dataclass(frozen=True)
class DataSummary:
    """What a site tells the coordinator about its data for one task (no sample leaves the site).

    Attributes:
        classes: class name -> ``(train samples, test samples)``; a class may have 0 of either.
        input: the description of the model's input that every site of a run must share exactly
            (JSON-able; e.g. ``{"channels": 1, "height": 28, "width": 28}`` for images, the
            feature names for a table). The coordinator compares the sites' descriptions and puts
            the common one in the run's :class:`ModelSpec`.
        stats: sufficient statistics that the coordinator **sums** over the run's sites, name ->
            list of numbers of the same length at every site (e.g. per-feature count, sum and sum
            of squares, from which every site then scales its features with the federation's
            mean and standard deviation). Empty for most tasks. Aggregates only: never a sample.
        notes: lines for the site's log (e.g. files skipped).
    """

    classes: dict[str, tuple[int, int]]
    input: dict = field(default_factory=dict)
    stats: dict[str, list[float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def check(self) -> "DataSummary":
        """Self, after checking the types (a task's own ``describe`` may return anything).
        Raises ``DataError``."""
        if not isinstance(self.classes, Mapping) or not self.classes:
            raise DataError("describe() found no class: a site needs at least one labelled sample")
        for name, counts in self.classes.items():
            if not isinstance(name, str) or not name:
                raise DataError(f"class names must be non-empty strings, got {name!r}")
            if (not isinstance(counts, (tuple, list)) or len(counts) != 2
                    or any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts)):
                raise DataError(f"class {name!r}: counts must be (train, test) non-negative integers, got {counts!r}")
        if sum(c[0] for c in self.classes.values()) == 0:
            raise DataError("no training sample: the site's train split is empty")
        if not isinstance(self.input, Mapping) or "stats" in self.input:
            raise DataError("the input description must be a dict without the key 'stats' (fedrelay adds the "
                            "summed statistics under that key)")
        try:
            canonical_json(self.input)
        except ValueError as exc:
            raise DataError(f"the input description is {exc}") from None
        if not isinstance(self.stats, Mapping):
            raise DataError("stats must be a dict of name -> list of numbers")
        for name, values in self.stats.items():
            if (not isinstance(values, (list, tuple))
                    or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                               for v in values)):
                raise DataError(f"stats {name!r} must be a list of finite numbers")
        return self

    def to_dict(self) -> dict:
        """JSON-able form (``classes`` as ``{name: [train, test]}``)."""
        return {"classes": {k: [int(a), int(b)] for k, (a, b) in sorted(self.classes.items())},
                "input": self.input, "stats": {k: [float(v) for v in vs] for k, vs in self.stats.items()},
                "notes": list(self.notes)}

    @classmethod
    def from_dict(cls, d: Mapping) -> "DataSummary":
        return cls(classes={k: (int(v[0]), int(v[1])) for k, v in d.get("classes", {}).items()},
                   input=dict(d.get("input") or {}), stats={k: list(v) for k, v in (d.get("stats") or {}).items()},
                   notes=list(d.get("notes") or []))


@dataclass
class SiteData:
    """One site's samples for a task, held in memory by the worker that trains.

    Attributes:
        class_names: the site's classes, in the order ``labels`` count them (usually sorted);
            each must be unique. A run's class index is the sorted union over its sites.
        inputs: split (``"train"``, ``"test"``) -> a tensor ``(N, ...)`` of any dtype, one row per
            sample; :meth:`Task.batch` turns a slice of rows into the model's input. ``"test"``
            may be missing or empty (the site then evaluates nothing).
        labels: split -> int64 ``(N,)``, the position of each sample's class in ``class_names``.
        input: the input description every site of a run must share (see
            :attr:`DataSummary.input`).
        stats: sufficient statistics summed over the sites (see :attr:`DataSummary.stats`).
        notes: lines for the site's log.
    """

    class_names: list[str]
    inputs: dict[str, "Tensor"]
    labels: dict[str, "Tensor"]
    input: dict = field(default_factory=dict)
    stats: dict[str, list[float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        import torch

        if len(set(self.class_names)) != len(self.class_names):
            raise DataError(f"class names must be unique, got {self.class_names}")
        for split in SPLITS:
            if split not in self.inputs:
                self.inputs[split] = self.inputs["train"][:0] if "train" in self.inputs else torch.empty(0)
                self.labels[split] = torch.empty(0, dtype=torch.int64)
        for split in SPLITS:
            x, y = self.inputs[split], self.labels.get(split)
            if not isinstance(x, torch.Tensor) or x.dim() < 1:
                raise DataError(f"{split} inputs must be a tensor with one row per sample")
            if not isinstance(y, torch.Tensor) or y.dtype != torch.int64 or y.dim() != 1:
                raise DataError(f"{split} labels must be an int64 tensor (N,)")
            if int(x.shape[0]) != int(y.shape[0]):
                raise DataError(f"{split}: {int(x.shape[0])} input rows but {int(y.shape[0])} labels")
            if y.numel() and (int(y.min()) < 0 or int(y.max()) >= len(self.class_names)):
                raise DataError(f"{split} labels must lie in [0, {len(self.class_names)}) (positions in class_names)")

    def num_samples(self, split: str) -> int:
        """Rows in ``split`` ("train" or "test")."""
        _check_split(split)
        return int(self.labels[split].shape[0])

    def counts(self, split: str) -> dict[str, int]:
        """class name -> samples of ``split``."""
        import torch

        _check_split(split)
        found = torch.bincount(self.labels[split], minlength=len(self.class_names)).tolist()
        return dict(zip(self.class_names, (int(c) for c in found)))

    def summary(self) -> DataSummary:
        """The :class:`DataSummary` of these samples."""
        train, test = self.counts("train"), self.counts("test")
        return DataSummary(classes={c: (train[c], test[c]) for c in self.class_names},
                           input=self.input, stats=self.stats, notes=self.notes)

    def tensors(self, split: str, class_index: Sequence[str]) -> tuple["Tensor", "Tensor"]:
        """``(inputs, labels)`` of ``split``, labels as positions in the run's ``class_index``
        (which must hold every class of the site, and may hold more). The inputs tensor is shared
        with this object: do not modify it in place.

        Raises ``DataError`` (a class of the site missing from ``class_index``, or duplicates in
        it) and ``ValueError`` (an unknown split)."""
        import torch

        _check_split(split)
        positions: dict[str, int] = {}
        for i, name in enumerate(class_index):
            if name in positions:
                raise DataError(f"class_index lists class {name!r} twice; class names must be unique")
            positions[name] = i
        missing = [c for c in self.class_names if c not in positions]
        if missing:
            raise DataError(f"this site has class(es) {missing} that are not in the run's class list "
                            f"{list(class_index)}")
        lut = torch.tensor([positions[c] for c in self.class_names], dtype=torch.int64)
        local = self.labels[split]
        labels = lut[local] if local.numel() else torch.empty(0, dtype=torch.int64)
        return self.inputs[split], labels


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be 'train' or 'test', not {split!r}")


# --------------------------------------------------------------------------- what a run trains


@dataclass(frozen=True)
class ModelSpec:
    """The run's model, the same at every site: which task, which of its models, the sites'
    common input description and the class count. The one form of a run's model spec: the
    coordinator builds it, the ledger stores :meth:`to_dict`, assignments carry it
    (``fedrelay.v1.ModelSpec``), and a worker hands it to :meth:`Task.build_model`.

    Attributes:
        task: the task's name as the run names it (an entry-point name such as
            ``"image-folder"``, or ``"module:attr"``).
        model: one of the task's :attr:`Task.models` (e.g. ``"cnn"``).
        num_classes: K, the number of logits (the run's class index), >= 2.
        input_json: the sites' common input description, with the summed statistics under
            ``"stats"`` when the task has any, as :func:`canonical_json` (see :attr:`input`).
        task_version: the task's version as the sites reported it ("" when unversioned).
        task_sha256: SHA-256 of the task's code as installed (``fedrelay.tasks``); "" in tests
            that build models without a run.
    """

    task: str
    model: str
    num_classes: int
    input_json: str = "{}"
    task_version: str = ""
    task_sha256: str = ""

    @functools.cached_property
    def input(self) -> dict:
        """The input description (a new dict each time would be costly: cached; do not modify)."""
        return json.loads(self.input_json)

    def to_dict(self) -> dict:
        """JSON-able form, for the ledger and job requests."""
        return {"task": self.task, "model": self.model, "num_classes": self.num_classes,
                "input": self.input, "task_version": self.task_version, "task_sha256": self.task_sha256}

    @classmethod
    def from_dict(cls, d: Mapping) -> "ModelSpec":
        """The inverse of :meth:`to_dict`. Raises ``KeyError``/``ValueError`` for a malformed dict."""
        return cls(task=str(d["task"]), model=str(d["model"]), num_classes=int(d["num_classes"]),
                   input_json=canonical_json(d.get("input") or {}), task_version=str(d.get("task_version", "")),
                   task_sha256=str(d.get("task_sha256", "")))

    def to_pb(self):
        from fedrelay.v1 import common_pb2

        return common_pb2.ModelSpec(task=self.task, model=self.model, num_classes=self.num_classes,
                                    input_json=self.input_json, task_version=self.task_version,
                                    task_sha256=self.task_sha256)

    @classmethod
    def from_pb(cls, m) -> "ModelSpec":
        return cls(task=m.task, model=m.model, num_classes=int(m.num_classes),
                   input_json=canonical_json(json.loads(m.input_json or "{}")), task_version=m.task_version,
                   task_sha256=m.task_sha256)


# --------------------------------------------------------------------------- the task


class Task:
    """The user's part of a run (see the module docstring). Subclass it; define :meth:`load`
    and :meth:`build_model`; override the other methods where the defaults do not fit.

    A task object is made with no arguments (``cls()``) in every worker that needs it. Keep it
    free of per-run state: the same object may serve several jobs one after another.

    Class attributes:
        models: the model names :meth:`build_model` knows, the first the default
            (``coordinator start-chain --model NAME``).
        positive_class: for two-class tasks, the class name that sensitivity, specificity and
            the reported AUROC treat as positive (None: the second class of the run's sorted
            class index; with the classes ``benign`` and ``malignant``, ``malignant``).
        augmentations: the train-time augmentations :meth:`augment` implements, by the names
            of ``coordinator start-chain --augment`` (``fedrelay.registry.AUGMENTATIONS``, e.g.
            ``"flip-crop"``). Default: none. Each site registers them with the task's offer, so
            ``start-chain`` refuses a run asking for one a chosen site's task does not list,
            naming ``--augment`` (the site refuses it too, should it get one).
    """

    models: ClassVar[tuple[str, ...]] = ("default",)
    positive_class: ClassVar[str | None] = None
    augmentations: ClassVar[tuple[str, ...]] = ()

    # ----------------------------------------------------------------------- data (site side)

    def load(self, root: Path) -> SiteData:
        """Read the site folder ``root`` into memory: its train split (required) and test split
        (optional). Called once per worker, in the site's worker process.

        Raises:
            DataError: the folder does not hold data this task can read; the message names the
                path, the problem and the fix (it is shown to the site's administrator and,
                for a run, to the operator).
        """
        raise NotImplementedError(f"{type(self).__name__} must define load(root)")

    def describe(self, root: Path) -> DataSummary:
        """What the site registers for this task: class counts per split, the input description
        and summed statistics (see :class:`DataSummary`). Called when the daemon starts. The
        default loads the data (:meth:`load`) and counts; override it when that can be done
        cheaply (e.g. reading file headers or one column).

        Raises ``DataError`` like :meth:`load`."""
        return self.load(root).summary()

    # ----------------------------------------------------------------------- the model

    def build_model(self, spec: ModelSpec) -> "nn.Module":
        """A freshly initialised model for ``spec`` (``spec.model``: one of :attr:`models`;
        ``spec.input``: the sites' common input description; ``spec.num_classes``: K), on the CPU.

        It must map a batch from :meth:`batch` (``N`` rows) to float logits ``N x K`` and draw
        its initial weights from torch's global RNG without seeding it (fedrelay seeds the RNG
        right before the call, so that every site builds the same initial model).

        Raises ``ValueError`` for a model name or input it cannot build."""
        raise NotImplementedError(f"{type(self).__name__} must define build_model(spec)")

    # ----------------------------------------------------------------------- training

    def batch(self, inputs: "Tensor", *, train: bool, generator: "torch.Generator | None" = None) -> "Tensor":
        """The model's input for a slice of rows of :attr:`SiteData.inputs` (already on the
        training device). ``train`` is True while training (apply train-time transforms here,
        drawing any randomness from ``generator``, a seeded CPU generator, so that runs repeat)
        and False for validation and evaluation. Default: ``inputs`` as float32."""
        import torch

        return inputs.to(torch.float32)

    def augment(self, inputs: "Tensor", *, method: str, generator: "torch.Generator") -> "Tensor":
        """The run's train-time augmentation ``method`` (its ``--augment``, one of
        :attr:`augmentations`) of a training batch: ``inputs`` is what :meth:`batch` returned with
        ``train=True`` (``N`` rows, float, on the training device); return a tensor of the same
        shape, dtype and device. Draw every random number from ``generator`` (a seeded CPU
        ``torch.Generator``, the one :meth:`batch` gets; draw on the CPU and move the draws), so
        that runs repeat and the batch order does not shift. Called by the training loop
        (``fedrelay.peer.training_loop.fit``) only for training batches and only when the run's
        ``--augment`` is not ``none``; never for validation or evaluation. Default: ``inputs``
        unchanged (the identity)."""
        return inputs

    def loss(self, outputs: "Tensor", labels: "Tensor") -> "Tensor":
        """The training loss of a batch: a 0-d tensor with gradient. ``outputs``: the model's
        float logits ``N x K``; ``labels``: int64 ``N`` (positions in the run's class index).
        Default: the mean cross-entropy. FedELMY's d1/d2 terms are added to it by the strategy."""
        from torch.nn import functional as F

        return F.cross_entropy(outputs, labels)

    def optimizer(self, params: list["Tensor"], *, lr: float, weight_decay: float) -> "torch.optim.Optimizer":
        """A fresh optimiser for ``params`` (one per trained model). ``lr`` and ``weight_decay``
        are the run's ``--lr`` and ``--weight-decay``. Default: ``torch.optim.Adam`` (coupled L2
        weight decay, as FedELMY's reference code)."""
        import torch

        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)

    # ----------------------------------------------------------------------- evaluation

    def metrics(self, scores: "Tensor", labels: "Tensor", class_index: Sequence[str]) -> dict[str, float]:
        """Metrics of the task's own, computed at a site on its test split, added to the built-in
        ones (accuracy, balanced accuracy, macro-F1, AUROC, and for two classes sensitivity and
        specificity: ``fedrelay.scoring``). ``scores``: float32 ``N x K`` class probabilities
        (the softmax of the logits); ``labels``: int64 ``N``; ``class_index``: the run's class
        names in label order. Return ``{name: finite float}``;
        names must not clash with the built-in ones. The run's global value of a task's own
        metric is the test-sample-weighted mean of the sites' values. Default: none."""
        return {}
