"""A run's evaluation at the coordinator: checking what each site reports of the final model on
its test split, and combining the sites' aggregate statistics into the federation's figures
(``fedrelay.scoring``). No sample, score or prediction reaches the coordinator: counts only.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping

from fedrelay import privacy, scoring

__all__ = ["site_stats", "pooled", "metrics_line"]

MAX_METRICS = 64         # metrics one site may report
MAX_METRIC_NAME = 64     # characters of a metric's name
MAX_STATS_BYTES = 4 << 20


def site_stats(reply, num_classes: int) -> scoring.Stats:
    """The checked statistics of one site's ``EvaluateReply``; its metrics checked too (names
    of at most 64 printable characters, at most 64 of them, finite values, the built-in ones in
    [0, 1]). Raises ``ValueError`` naming the problem."""
    if len(reply.metrics) > MAX_METRICS:
        raise ValueError(f"{len(reply.metrics)} metrics (at most {MAX_METRICS})")
    for name, value in reply.metrics.items():
        if not name or len(name) > MAX_METRIC_NAME or not name.isprintable():
            raise ValueError(f"metric name {name[:MAX_METRIC_NAME]!r} is not 1 to {MAX_METRIC_NAME} printable characters")
        if not math.isfinite(value) or (name in scoring.BUILTIN and not 0.0 <= value <= 1.0):
            raise ValueError(f"metric {name!r} is {value}")
    if reply.correct > reply.test_samples:
        raise ValueError(f"{reply.correct} correct of {reply.test_samples} test samples")
    if len(reply.stats_json) > MAX_STATS_BYTES:
        raise ValueError(f"statistics of {len(reply.stats_json)} bytes (at most {MAX_STATS_BYTES})")
    try:
        raw = json.loads(reply.stats_json or "{}")
    except ValueError as exc:
        raise ValueError(f"statistics are not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError("statistics must be a JSON object")
    try:
        privacy.spent_from_stats(raw)  # a DP run's spent (epsilon, delta), when the site reports one
    except ValueError as exc:
        raise ValueError(f"its differential-privacy record does not check: {exc}") from None
    raw = {k: v for k, v in raw.items() if k != "privacy"}
    if not raw:  # a site that reports no statistics (no test split, or an older daemon)
        return scoring.Stats(confusion=[[0] * num_classes for _ in range(num_classes)],
                             positive=1 if num_classes == 2 else -1)
    stats = scoring.Stats.from_dict(raw, num_classes)
    if sum(map(sum, stats.confusion)) != reply.test_samples:
        raise ValueError(f"its confusion matrix counts {sum(map(sum, stats.confusion))} samples, not its "
                         f"{reply.test_samples} test samples")
    return stats


def pooled(results: Iterable[tuple]) -> dict[str, float]:
    """The run's global metrics from ``(EvaluateReply, Stats)`` pairs: the built-in ones from
    the summed statistics, a task's own as the test-sample-weighted mean
    (:func:`fedrelay.scoring.global_metrics`). Raises ``ValueError``."""
    results = [(r, s) for r, s in results if r.test_samples]
    return scoring.global_metrics([s for _, s in results], [(dict(r.metrics), r.test_samples) for r, _ in results])


def metrics_line(metrics: Mapping[str, float]) -> str:
    """``"; balanced accuracy 0.81, macro-F1 0.80, AUROC 0.97 ..."`` for a log or event line (""
    when there is nothing besides accuracy)."""
    words = {"balanced_accuracy": "balanced accuracy", "macro_f1": "macro-F1", "auroc": "AUROC"}
    shown = [f"{words.get(k, k)} {v:.4f}" for k, v in metrics.items() if k != "accuracy"]
    return ("; " + ", ".join(shown)) if shown else ""
