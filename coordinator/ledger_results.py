"""The results in the ledger: the sites' evaluations of a run's final model (``evaluations``)
and the training progress they report, epoch by epoch (``metrics``).
"""

from __future__ import annotations

import json
import time
from typing import Any

from fedrelay.coordinator.ledger_store import Store


class Results:
    """The ``evaluations`` and ``metrics`` tables of the ledger in ``store``."""

    def __init__(self, store: Store):
        self._store = store

    def record_evaluation(self, run_id: str, site: str, sha256: str, correct: int, test_samples: int,
                          accuracy: float, seconds: float, metrics: dict[str, float] | None = None,
                          stats: dict | None = None) -> None:
        """A site's evaluation of the final model: its top-1 count, exact ``metrics`` and aggregate
        ``stats`` (``fedrelay.scoring``)."""
        self._store.exec(
            """INSERT OR REPLACE INTO evaluations (run_id, site, sha256, correct, test_samples, accuracy, seconds,
                                                   metrics, stats)
               VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)""",
            (run_id, site, sha256, correct, test_samples, accuracy, seconds, json.dumps(metrics or {}, sort_keys=True),
             json.dumps(stats or {}, sort_keys=True)),
        )

    def evaluations(self, run_id: str) -> list[dict[str, Any]]:
        """The sites' evaluations, ``metrics`` and ``stats`` parsed."""
        rows = self._store.all("SELECT * FROM evaluations WHERE run_id = ? ORDER BY site", (run_id,))
        for r in rows:
            r["metrics"] = json.loads(r.get("metrics") or "{}")
            r["stats"] = json.loads(r.get("stats") or "{}")
        return rows

    def recent_results(self, limit: int) -> list[dict[str, Any]]:
        """The ``limit`` most recently ended finished runs: ``run_id``, ``task``, ``accuracy``,
        ``metrics`` (global, parsed) and ``evaluations`` (per site, as :meth:`evaluations`)."""
        rows = self._store.all("SELECT run_id, task, accuracy, metrics FROM runs WHERE status = 'finished' "
                         "ORDER BY ended DESC LIMIT ?", (int(limit),))
        for r in rows:
            r["metrics"] = json.loads(r["metrics"]) if r["metrics"] else {}
            r["evaluations"] = self.evaluations(r["run_id"])
        return rows

    def record_metric(self, run_id: str, site: str, stage: str, model: int, epoch: int, epochs: int,
                      train_loss: float, val_accuracy: float | None, seconds: float) -> None:
        """A site's progress: epoch ``epoch`` of ``epochs`` of ``model`` at ``stage``, its mean
        training loss, validation accuracy (None: not measured) and ``seconds`` it took."""
        self._store.exec(
            """INSERT INTO metrics (run_id, site, time, stage, model, epoch, epochs, train_loss,
                                    val_accuracy, seconds) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)""",
            (run_id, site, time.time(), stage, model, epoch, epochs, train_loss, val_accuracy, seconds),
        )

    def metrics(self, run_id: str) -> list[dict[str, Any]]:
        """The run's progress rows (``record_metric``), oldest first."""
        return self._store.all("SELECT * FROM metrics WHERE run_id = ? ORDER BY time", (run_id,))
