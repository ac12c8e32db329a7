"""The runs in the ledger: each run's row and outcome (``runs``), every version of its plan
(``plans``), the sites routed around (``skips``) and the end notices owed to its sites
(``end_notices``).

:class:`RunRecords` starts a run (its row and plan version 0 in one transaction), records each
reroute as the next plan version, and ends a run in one transaction with its terminal event,
its end notices and its seal (``EventLog``, ``coordinator/ledger_events.py``).
"""

from __future__ import annotations

import json
import time
from typing import Any

from fedrelay import signing
from fedrelay.coordinator.ledger_events import EventLog
from fedrelay.coordinator.ledger_store import Store

TERMINAL = ("finished", "failed", "cancelled")


class RunRecords:
    """The ``runs``, ``plans``, ``skips`` and ``end_notices`` tables of the ledger in ``store``;
    ``log``: its event log (a run's terminal event and seal are written with its end)."""

    def __init__(self, store: Store, log: EventLog):
        self._store = store
        self._db = store.db
        self._lock = store.lock
        self._log = log
        self.on_run_ended: list = []  # callables (run_id, status, error), after a run ended (finish_run)
        self._plans: dict[str, list[dict]] = {}  # run id -> every version of its plan (immutable)

    def create_run(self, run_id: str, *, strategy: str, arch: str, seed: int, params: dict,
                   chain: list[dict], class_index: list[str], model: dict, warnings: list[str],
                   insecure: bool, rounds: int = 1, plan: dict | None = None, started_by: str = "") -> None:
        """Record a new running run and, when given, version 0 of its plan (one transaction).
        ``model``: the run's ``fedrelay.ModelSpec.to_dict()`` (its task, version and digest are
        also kept in columns of their own); ``arch``: the task's model name; ``started_by``: the
        operator identity that started it."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                now = time.time()
                self._db.execute(
                    """INSERT INTO runs (run_id, created, status, strategy, arch, seed, params, chain,
                                         class_index, model, warnings, insecure, rounds, task, task_version,
                                         task_sha256, started_by)
                       VALUES (?, ?, 'running', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)""",
                    (run_id, now, strategy, arch, seed, json.dumps(params), json.dumps(chain),
                     json.dumps(class_index), json.dumps(model), json.dumps(warnings), int(insecure), rounds,
                     model.get("task", ""), model.get("task_version", ""), model.get("task_sha256", ""),
                     started_by),
                )
                if plan is not None:
                    self._db.execute("INSERT INTO plans (run_id, version, plan, time) VALUES (?, 0, ?, ?)",
                                     (run_id, json.dumps(plan), now))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def plans(self, run_id: str) -> list[dict]:
        """Every version of the run's plan, oldest first: ``[{"version", "plan", "time"}]``.
        Versions never change once written: they are read from the file once per run and kept
        (callers must not modify them)."""
        with self._lock:
            cached = self._plans.get(run_id)
            if cached:
                return list(cached)
            rows = self._store.all("SELECT version, plan, time FROM plans WHERE run_id = ? ORDER BY version", (run_id,))
            for r in rows:
                r["plan"] = json.loads(r["plan"])
            if rows:
                self._plans[run_id] = rows
            return list(rows)

    def reroute(self, run_id: str, plan: dict, skips: list[tuple[str, str]]) -> int | None:
        """Record, in one transaction, the sites newly routed around (``[(site, reason)]``) and
        the plan that goes around them, as the next version. Returns that version, or None when
        every site given was already skipped (nothing written)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                now = time.time()
                new = 0
                for site, reason in skips:
                    new += self._db.execute(
                        "INSERT OR IGNORE INTO skips (run_id, site, time, reason) VALUES (?, ?, ?, ?)",
                        (run_id, site, now, reason)).rowcount
                if not new:
                    self._db.execute("ROLLBACK")
                    return None
                version = self._db.execute("SELECT COALESCE(MAX(version), -1) + 1 FROM plans WHERE run_id = ?",
                                           (run_id,)).fetchone()[0]
                self._db.execute("INSERT INTO plans (run_id, version, plan, time) VALUES (?, ?, ?, ?)",
                                 (run_id, version, json.dumps(plan), now))
                self._db.execute("COMMIT")
                self._plans.pop(run_id, None)  # read again, with the new version, on the next question
                return version
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def run(self, run_id: str) -> dict[str, Any] | None:
        """The run's row, its JSON columns (params, chain, class_index, model, warnings, metrics)
        parsed; None for an unknown run."""
        rows = self._store.all("SELECT * FROM runs WHERE run_id = ?", (run_id,))
        if not rows:
            return None
        r = rows[0]
        for key in ("params", "chain", "class_index", "model", "warnings"):
            r[key] = json.loads(r[key])
        r["metrics"] = json.loads(r["metrics"]) if r.get("metrics") else {}
        return r

    def running_run_ids(self) -> list[str]:
        """The runs still running, oldest first."""
        return [r["run_id"] for r in self._store.all("SELECT run_id FROM runs WHERE status = 'running' ORDER BY created")]

    def run_ids(self) -> list[str]:
        """Every run, oldest first."""
        return [r["run_id"] for r in self._store.all("SELECT run_id FROM runs ORDER BY created")]

    def run_counts(self) -> dict[str, int]:
        """Runs by status: ``{status: count}`` (statuses with no run are absent)."""
        return {r["status"]: r["n"] for r in self._store.all("SELECT status, COUNT(*) AS n FROM runs GROUP BY status")}

    def update_run(self, run_id: str, **fields: Any) -> None:
        """Set columns of the run's row (``fields``: column -> value, as stored)."""
        if not fields:
            return
        cols = ", ".join(f"{k} = ?" for k in fields)
        self._store.exec(f"UPDATE runs SET {cols} WHERE run_id = ?", (*fields.values(), run_id))

    def finish_run(self, run_id: str, status: str, *, error: str | None = None,
                   accuracy: float | None = None, message: str = "", site: str = "",
                   cancelled_by: str | None = None, cancel_reason: str | None = None,
                   metrics: dict[str, float] | None = None, record: signing.SignedRecord | None = None,
                   **data: Any) -> bool:
        """Move a running run to ``status`` (finished|failed|cancelled) and, when ``message`` is given, add
        the event of kind ``status`` that says so, in one transaction: a watcher that sees the
        terminal status has also seen that event (its data holds ``error`` and ``accuracy`` when
        given, and ``data``). The same transaction owes every site of the chain an end notice
        (:meth:`pending_end_notices`) and sets ``cancelled_by`` / ``cancel_reason`` / the global
        ``metrics`` when given. ``record``: the signed report that ended it (a site's
        ``FailureReport``), bound to the event. The same transaction writes the run's seal
        (``EventLog.seal``). False (nothing written) when it had already ended."""
        data = {**({"error": error} if error is not None else {}),
                **({"accuracy": accuracy} if accuracy is not None else {}),
                **({"cancelled_by": cancelled_by} if cancelled_by is not None else {}),
                **({"metrics": metrics} if metrics is not None else {}), **data}
        with self._log.changed:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                now = time.time()
                cur = self._db.execute(
                    "UPDATE runs SET status = ?, error = ?, accuracy = ?, ended = ?, "
                    "cancelled_by = coalesce(?, cancelled_by), cancel_reason = coalesce(?, cancel_reason), "
                    "metrics = coalesce(?, metrics) WHERE run_id = ? AND status = 'running'",
                    (status, error, accuracy, now, cancelled_by, cancel_reason,
                     json.dumps(metrics, sort_keys=True) if metrics is not None else None, run_id),
                )
                ended = cur.rowcount == 1
                if ended:
                    chain = json.loads(self._db.execute("SELECT chain FROM runs WHERE run_id = ?",
                                                        (run_id,)).fetchone()["chain"])
                    self._db.executemany("INSERT OR IGNORE INTO end_notices (run_id, site) VALUES (?, ?)",
                                         [(run_id, c["name"]) for c in chain])
                event = None
                if ended and message:
                    event = {"run_id": run_id, "time": now, "kind": status, "site": site, "message": message,
                             "data": json.dumps(data)}
                    event["seq"] = self._log.append(event, record)
                if ended:
                    self._log.seal(run_id, now)
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                self._log.forget_head(run_id)
                raise
            if event is not None:
                self._log.publish(event)
            for listener in self.on_run_ended if ended else ():
                listener(run_id, status, error)
            return ended

    def cancel_run(self, run_id: str, cancelled_by: str, reason: str) -> bool:
        """End a running run with status ``cancelled``, recording who (``cancelled_by``) and why
        (``reason``; the time is ``ended``), the ``cancelled`` event and the end notices owed to
        its sites (:meth:`finish_run`), in one transaction. False (nothing written) when it had
        already ended."""
        why = f": {reason}" if reason else ""
        return self.finish_run(run_id, "cancelled", message=f"run cancelled by {cancelled_by}{why}",
                               cancelled_by=cancelled_by, cancel_reason=reason, reason=reason)

    def refuse_run(self, run_id: str, site: str, reason: str, *, policy: bool) -> bool:
        """End a running run as failed because ``site`` refused its assignment for ``reason``
        (``policy``: its own site policy refused it): the run's ``refused_by``, ``refusal`` and
        ``refused_by_policy`` say so, and the ``failed`` event (site = ``site``) carries them.
        False (nothing written) when it had already ended."""
        if self.run(run_id) is None or self.run(run_id)["status"] != "running":
            return False
        self.update_run(run_id, refused_by=site, refusal=reason, refused_by_policy=int(policy))
        error = f"assignment refused by {site}: {'its site policy: ' if policy else ''}{reason}"
        return self.finish_run(run_id, "failed", error=error, message=f"run failed: {error}", site=site,
                               refused_by=site, refusal=reason, refused_by_policy=policy)

    # -- routing around sites that stayed down, and the end notices ------------------------------
    def add_skip(self, run_id: str, site: str, reason: str) -> bool:
        """Record that ``site`` was routed around in ``run_id``. False if it already was."""
        with self._lock:
            cur = self._db.execute("INSERT OR IGNORE INTO skips (run_id, site, time, reason) VALUES (?, ?, ?, ?)",
                                   (run_id, site, time.time(), reason))
            return cur.rowcount == 1

    def pending_end_notices(self) -> list[dict[str, Any]]:
        """End notices not yet delivered: ``[{"run_id", "site", "status", "error", "cancelled_by",
        "cancel_reason"}]``, oldest run first."""
        return self._store.all("""SELECT n.run_id, n.site, r.status, r.error, r.cancelled_by, r.cancel_reason
                            FROM end_notices n
                            JOIN runs r ON r.run_id = n.run_id
                            WHERE n.delivered IS NULL ORDER BY r.ended, n.site""")

    def end_notice_delivered(self, run_id: str, site: str) -> None:
        """Record that ``site`` answered the end notice of ``run_id`` (now)."""
        self._store.exec("UPDATE end_notices SET delivered = ? WHERE run_id = ? AND site = ?", (time.time(), run_id, site))

    def skips(self, run_id: str) -> list[dict[str, Any]]:
        """The sites routed around in ``run_id``: ``[{"run_id", "site", "time", "reason"}]``, oldest first."""
        return self._store.all("SELECT * FROM skips WHERE run_id = ? ORDER BY time", (run_id,))
