"""The classification metrics a run reports, per site and for the whole federation, computed by
scikit-learn from what each site may share.

**At a site** (:func:`site_metrics`, in the worker that evaluates the final model on the site's
own test split): the exact figures from the site's predictions, which never leave it:

* ``accuracy``: top-1, correct / samples;
* ``balanced_accuracy``: the mean recall over the classes present in the site's test split
  (``sklearn.metrics.balanced_accuracy_score``);
* ``macro_f1``: the unweighted mean F1 over the classes present in the test labels or the
  predictions (``f1_score(average="macro", zero_division=0)``);
* ``auroc``: one-vs-rest ROC AUC of each class's softmax score, averaged over the classes that
  have both positive and negative test samples (``roc_auc_score``); for two classes, the AUC of
  the positive class's score;
* two classes only: ``sensitivity`` (recall of the positive class) and ``specificity`` (recall
  of the negative class), ``recall_score``. The positive class is the task's
  ``positive_class``, else the second class of the run's sorted class index.

and the site's **aggregate statistics** (:class:`Stats`): its confusion matrix (K x K counts)
and, per class, two histograms of that class's softmax score, one over the samples of the
class and one over the others, in :data:`BINS` bins of equal width in the score's logit
``log(p / (1 - p))`` from -10 to 10 (plus one bin below and one above: 202 in all). No sample,
score or prediction of a patient leaves the site: only counts.

**For the federation** (:func:`global_metrics`, at the coordinator): the same functions over
the sums of the sites' statistics: accuracy, balanced accuracy, macro-F1, sensitivity and
specificity from the summed confusion matrix (each (true, predicted) cell a sample weight),
AUROC from the summed histograms (each bin's centre a score, its count a sample weight, so two
samples in one bin count as a tie, ½; the binned AUROC differs from the exact one by at most
the share of (positive, negative) pairs that fall into the same bin). A task's own metrics
(``Task.metrics``) are combined as the test-sample-weighted mean of the sites' values.

No torch here (the coordinator uses it); scikit-learn and numpy are imported when called.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["BUILTIN", "BINS", "LOGIT_RANGE", "Stats", "site_metrics", "global_metrics", "positive_index"]

BUILTIN = ("accuracy", "balanced_accuracy", "macro_f1", "auroc", "sensitivity", "specificity")
BINS = 200            # equal-width logit bins between -LOGIT_RANGE and LOGIT_RANGE (+1 below, +1 above)
LOGIT_RANGE = 10.0
MAX_CLASSES = 4096    # a confusion matrix beyond this is not a classification report any more


@dataclass
class Stats:
    """A site's aggregate test statistics for a run's final model (JSON-able via
    :meth:`to_dict`).

    Attributes:
        confusion: K x K counts, ``confusion[t][p]`` = test samples of class t predicted as p.
        positives / negatives: per class index (as a string key), the sparse histogram
            ``{bin: count}`` of that class's score over the samples of the class / of the others
            (bins: :func:`score_bin`).
        positive: for two classes, the index of the positive class (-1 otherwise).
    """

    confusion: list[list[int]]
    positives: dict[str, dict[str, int]] = field(default_factory=dict)
    negatives: dict[str, dict[str, int]] = field(default_factory=dict)
    positive: int = -1

    def to_dict(self) -> dict:
        return {"confusion": self.confusion, "positives": self.positives, "negatives": self.negatives,
                "positive": self.positive, "bins": BINS, "logit_range": LOGIT_RANGE}

    @classmethod
    def from_dict(cls, d: Mapping, num_classes: int) -> "Stats":
        """Parse and check a site's statistics (they come from another party). Raises
        ``ValueError`` naming the first problem."""
        if not isinstance(d, Mapping):
            raise ValueError("statistics must be a JSON object")
        if d.get("bins", BINS) != BINS or d.get("logit_range", LOGIT_RANGE) != LOGIT_RANGE:
            raise ValueError(f"statistics binned differently (bins {d.get('bins')!r}, range {d.get('logit_range')!r})")
        confusion = d.get("confusion")
        if (not isinstance(confusion, list) or len(confusion) != num_classes
                or any(not isinstance(row, list) or len(row) != num_classes for row in confusion)
                or any(not _count(v) for row in confusion for v in row)):
            raise ValueError(f"confusion must be a {num_classes} x {num_classes} matrix of non-negative integers")
        hists = {}
        for key in ("positives", "negatives"):
            h = d.get(key) or {}
            if not isinstance(h, Mapping):
                raise ValueError(f"{key} must be an object")
            for c, bins in h.items():
                if not (isinstance(c, str) and c.isdigit() and int(c) < num_classes and isinstance(bins, Mapping)):
                    raise ValueError(f"{key}: bad class key {c!r}")
                for b, n in bins.items():
                    if not (isinstance(b, str) and b.isdigit() and int(b) < BINS + 2 and _count(n)):
                        raise ValueError(f"{key}[{c}]: bad bin {b!r} -> {n!r}")
            hists[key] = {c: dict(bins) for c, bins in h.items()}
        positive = d.get("positive", -1)
        if isinstance(positive, bool) or not isinstance(positive, int) or not (
                positive == -1 or (num_classes == 2 and positive in (0, 1))):
            raise ValueError(f"positive must be -1, or 0 or 1 for two classes, got {positive!r}")
        return cls(confusion=confusion, positives=hists["positives"], negatives=hists["negatives"],
                   positive=positive)


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**53


def positive_index(class_index: Sequence[str], positive_class: str | None) -> int:
    """The positive class's index for two classes (``positive_class``, else index 1), -1 for
    more. Raises ``ValueError`` when ``positive_class`` is not one of the two."""
    if len(class_index) != 2:
        return -1
    if positive_class is None:
        return 1
    if positive_class not in class_index:
        raise ValueError(f"the task's positive_class {positive_class!r} is not a class of the run "
                         f"({', '.join(class_index)})")
    return list(class_index).index(positive_class)


def score_bin(scores):
    """The histogram bin (0 .. BINS + 1) of each score in ``scores`` (a numpy array of
    probabilities): 0 below logit -10, BINS + 1 above logit +10, else 1 + the equal-width bin."""
    import numpy as np

    p = np.clip(np.asarray(scores, dtype=np.float64), 0.0, 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        logit = np.log(p) - np.log1p(-p)  # p = 0: -inf, p = 1: +inf
    width = 2 * LOGIT_RANGE / BINS
    # the infinite logits fall outside the range (bins 0 and BINS + 1 below): clipped before the
    # integer cast, which would otherwise warn "invalid value encountered in cast"
    inside = np.floor((np.clip(logit, -LOGIT_RANGE, LOGIT_RANGE) + LOGIT_RANGE) / width).astype(np.int64) + 1
    return np.where(logit < -LOGIT_RANGE, 0, np.where(logit >= LOGIT_RANGE, BINS + 1, np.clip(inside, 1, BINS)))


def _centres():
    import numpy as np

    width = 2 * LOGIT_RANGE / BINS
    inner = -LOGIT_RANGE + width * (np.arange(BINS) + 0.5)
    return np.concatenate([[-LOGIT_RANGE - width], inner, [LOGIT_RANGE + width]])


def _from_confusion(confusion, positive: int) -> dict[str, float]:
    """accuracy, balanced accuracy, macro-F1 (and sensitivity, specificity) from a confusion
    matrix, by scikit-learn with each cell as a sample weight."""
    import numpy as np
    from sklearn.metrics import accuracy_score, balanced_accuracy_score, f1_score, recall_score

    cm = np.asarray(confusion, dtype=np.int64)
    k = cm.shape[0]
    true, pred = np.divmod(np.arange(k * k), k)
    weight = cm.reshape(-1)
    keep = weight > 0
    true, pred, weight = true[keep], pred[keep], weight[keep]
    if weight.sum() == 0:
        return {}
    out = {"accuracy": float(accuracy_score(true, pred, sample_weight=weight)),
           "balanced_accuracy": float(balanced_accuracy_score(true, pred, sample_weight=weight)),
           "macro_f1": float(f1_score(true, pred, average="macro", sample_weight=weight, zero_division=0))}
    if positive in (0, 1):
        negative = 1 - positive
        if (true == positive).any():
            out["sensitivity"] = float(recall_score(true, pred, pos_label=positive, sample_weight=weight,
                                                    average="binary", zero_division=0))
        if (true == negative).any():
            out["specificity"] = float(recall_score(true, pred, pos_label=negative, sample_weight=weight,
                                                    average="binary", zero_division=0))
    return out


def site_metrics(scores, labels, num_classes: int, positive: int = -1,
                 predictions=None) -> tuple[dict[str, float], Stats]:
    """The exact metrics of one site's test split and its aggregate statistics (module
    docstring).

    Args:
        scores: float array ``(N, K)`` of class probabilities (rows sum to 1).
        labels: int array ``(N,)`` in ``[0, K)``.
        num_classes: K.
        positive: for K = 2, the positive class's index (:func:`positive_index`); -1 otherwise.
        predictions: int array ``(N,)`` of predicted classes (default: the argmax of
            ``scores``; pass the argmax of the logits to count exactly what top-1 accuracy does).

    Returns:
        ``(metrics, stats)``; ``metrics`` is empty for an empty test split.
    """
    import numpy as np
    from sklearn.metrics import confusion_matrix, roc_auc_score

    scores = np.asarray(scores, dtype=np.float64)
    labels = np.asarray(labels, dtype=np.int64)
    k = int(num_classes)
    if scores.ndim != 2 or scores.shape != (labels.shape[0], k):
        raise ValueError(f"scores must be (N, {k}) for {labels.shape[0]} labels, got {scores.shape}")
    if predictions is not None:
        pred = np.asarray(predictions, dtype=np.int64)
    else:
        pred = scores.argmax(axis=1) if len(labels) else labels
    confusion = confusion_matrix(labels, pred, labels=list(range(k))).tolist() if len(labels) else [[0] * k] * k
    stats = Stats(confusion=[[int(v) for v in row] for row in confusion], positive=positive if k == 2 else -1)
    for c in range(k):
        bins = score_bin(scores[:, c]) if len(labels) else np.zeros(0, dtype=np.int64)
        for key, mask in (("positives", labels == c), ("negatives", labels != c)):
            found, counts = np.unique(bins[mask], return_counts=True)
            if len(found):
                getattr(stats, key)[str(c)] = {str(int(b)): int(n) for b, n in zip(found, counts)}
    if not len(labels):
        return {}, stats
    metrics = _from_confusion(stats.confusion, stats.positive)
    if k == 2:
        if len(set(labels.tolist())) == 2:
            metrics["auroc"] = float(roc_auc_score(labels == stats.positive, scores[:, stats.positive]))
    else:
        aucs = [float(roc_auc_score(labels == c, scores[:, c])) for c in range(k)
                if (labels == c).any() and (labels != c).any()]
        if aucs:
            metrics["auroc"] = float(np.mean(aucs))
    return metrics, stats


def _binned_auc(pos: Mapping[str, int], neg: Mapping[str, int]) -> float | None:
    import numpy as np
    from sklearn.metrics import roc_auc_score

    if not sum(pos.values()) or not sum(neg.values()):
        return None
    centres = _centres()
    bins = sorted({*map(int, pos), *map(int, neg)})
    y = np.array([1] * len(bins) + [0] * len(bins))
    s = np.array([centres[b] for b in bins] * 2)
    w = np.array([pos.get(str(b), 0) for b in bins] + [neg.get(str(b), 0) for b in bins], dtype=np.float64)
    keep = w > 0
    return float(roc_auc_score(y[keep], s[keep], sample_weight=w[keep]))


def _summed(hists: Sequence[Mapping[str, Mapping[str, int]]]) -> dict[str, dict[str, int]]:
    total: dict[str, dict[str, int]] = {}
    for h in hists:
        for c, bins in h.items():
            into = total.setdefault(c, {})
            for b, n in bins.items():
                into[b] = into.get(b, 0) + int(n)
    return total


def global_metrics(stats: Sequence[Stats], own: Sequence[tuple[Mapping[str, float], int]] = ()) -> dict[str, float]:
    """The federation's metrics from the sites' :class:`Stats` (module docstring), plus each
    task-defined metric in ``own`` (``(site's metrics, test samples)`` pairs: names not in
    :data:`BUILTIN`) as the test-sample-weighted mean over the sites that report it.

    Raises ``ValueError`` when the sites disagree on the class count or the positive class."""
    import numpy as np

    stats = list(stats)
    out: dict[str, float] = {}
    if stats:
        k = len(stats[0].confusion)
        if any(len(s.confusion) != k for s in stats):
            raise ValueError("the sites' statistics have different class counts")
        positives = {s.positive for s in stats}
        if len(positives) > 1:
            raise ValueError(f"the sites name different positive classes: {sorted(positives)}")
        positive = positives.pop()
        confusion = np.sum([np.asarray(s.confusion, dtype=np.int64) for s in stats], axis=0)
        out.update(_from_confusion(confusion.tolist(), positive))
        pos, neg = _summed([s.positives for s in stats]), _summed([s.negatives for s in stats])
        if k == 2:
            auc = _binned_auc(pos.get(str(positive), {}), neg.get(str(positive), {}))
            if auc is not None:
                out["auroc"] = auc
        else:
            aucs = [a for a in (_binned_auc(pos.get(str(c), {}), neg.get(str(c), {})) for c in range(k))
                    if a is not None]
            if aucs:
                out["auroc"] = float(np.mean(aucs))
    weighted: dict[str, list[float]] = {}
    for metrics, samples in own:
        for name, value in metrics.items():
            if name in BUILTIN or not samples or not math.isfinite(value):
                continue
            acc = weighted.setdefault(name, [0.0, 0.0])
            acc[0] += value * samples
            acc[1] += samples
    for name, (total, samples) in sorted(weighted.items()):
        out[name] = total / samples
    return out
