"""Export a run's learning curves and final metrics to the tools researchers already use: MLflow
tracking (a local store by default, ``./mlflow.db``, or any tracking server) and TensorBoard event files.

``coordinator metrics RUN --mlflow [URI]`` and ``--tensorboard DIR`` call these with what the
operator's client reads from the ledger: the run's summary (``client.summary_dict``, the JSON of
``coordinator show --json``) and its per-epoch rows (``client.metric_dict``, the rows of
``coordinator metrics --json``). Nothing here talks to the coordinator, and mlflow, tensorboard
and torch are imported only when an export is asked for, so the daemons never load them.

What is written, the same names in both tools:

- **curves**, one point per epoch a site reported, its x the epoch within that stage
  (``step``) and its time the coordinator's record of it:
  ``site/<site>/<stage>[/model<j>]/train_loss`` and ``.../val_accuracy`` (stage: warmup, pool,
  fedseq, aggregate; ``model<j>``: pool model j of S), and the whole run as one curve,
  ``run/train_loss`` and ``run/val_accuracy``, whose step counts epochs in the order the ledger
  recorded them (so two runs line up epoch for epoch);
- **final metrics**, once the run has finished (a single value at step 0): ``final/accuracy``
  and ``final/<metric>`` (global, from the sites' pooled statistics: ``fedrelay/scoring.py``),
  ``final/site/<site>/<metric>`` (each site on its own test split, ``accuracy`` included), and
  the run's bytes (``bytes/total``, ``bytes/expected_total``, ``bytes/model``);
- **parameters**: the training parameters (``coordinator show --json``'s ``params``), ``seed``,
  ``strategy``, ``arch``, ``task``, ``rounds``, ``sites``; and tags naming the fedrelay run
  (``fedrelay.run_id``, ``fedrelay.status``, ``fedrelay.order``, ``fedrelay.final_sha256``,
  ``fedrelay.task_sha256``...).

A value missing from the ledger (no validation split: ``val_accuracy`` is null; a run not
finished: no final metrics) is left out, never written as a number.
"""

from __future__ import annotations

import logging
import math
import os
import re
from pathlib import Path

DEFAULT_EXPERIMENT = "fedrelay"
RUN_ID_TAG = "fedrelay.run_id"
# MLflow's key rule: alphanumerics, underscores, dashes, periods, spaces and slashes.
_KEY_UNSAFE = re.compile(r"[^A-Za-z0-9_\-. /]")
_MLFLOW_STATUS = {"finished": "FINISHED", "failed": "FAILED", "cancelled": "KILLED", "running": "RUNNING"}
_BATCH = 1000  # MLflow's log_batch takes at most 1000 metrics per call (and 100 params, 100 tags)


class ExportError(RuntimeError):
    """An export that cannot be done: the library is not installed, or the destination refuses."""


def _key(*parts: object) -> str:
    return "/".join(_KEY_UNSAFE.sub("_", str(p)) for p in parts if p != "")


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def curve_points(rows: list[dict]) -> list[tuple[str, float, int, float]]:
    """The run's learning curves as ``(key, value, step, unix seconds)`` points, from the rows of
    ``coordinator metrics --json`` (site, stage, model, epoch, epochs, train_loss,
    val_accuracy, seconds, time) in the ledger's order. ``val_accuracy`` null (no validation
    split) gives no point."""
    points = []
    for i, r in enumerate(rows, start=1):
        series = _key("site", r["site"], r["stage"], f"model{r['model']}" if r["stage"] == "pool" and r.get("model")
                      else "")
        for name in ("train_loss", "val_accuracy"):
            if _finite(r.get(name)):
                points.append((_key(series, name), float(r[name]), int(r["epoch"]), float(r["time"])))
                points.append((_key("run", name), float(r[name]), i, float(r["time"])))
    return points


def final_values(summary: dict) -> dict[str, float]:
    """The run's final figures (global, per site) and bytes as ``{key: value}``; empty for the
    final part while the run has no final model."""
    out: dict[str, float] = {}
    final = summary.get("final") or {}
    if final:
        if _finite(final.get("accuracy")):
            out[_key("final", "accuracy")] = float(final["accuracy"])
        for name, value in (final.get("metrics") or {}).items():
            if _finite(value):
                out[_key("final", name)] = float(value)
        for site, figures in (final.get("per_site") or {}).items():
            for name, value in {"accuracy": figures.get("accuracy"), "test_samples": figures.get("test_samples"),
                                **(figures.get("metrics") or {})}.items():
                if _finite(value):
                    out[_key("final", "site", site, name)] = float(value)
    for key, field in (("bytes/total", "total_bytes"), ("bytes/expected_total", "expected_total_bytes"),
                       ("bytes/model", "model_bytes")):
        if _finite(summary.get(field)):
            out[key] = float(summary[field])
    return out


def run_params(summary: dict) -> dict[str, str]:
    """The run's parameters as strings (MLflow params; TensorBoard hparams)."""
    out = {k: str(v) for k, v in sorted((summary.get("params") or {}).items()) if v is not None}
    for key in ("seed", "strategy", "arch", "task", "task_version", "rounds"):
        if summary.get(key) is not None:
            out[key] = str(summary[key])
    out["sites"] = str(len(summary.get("order") or []))
    return out


def run_tags(summary: dict) -> dict[str, str]:
    tags = {RUN_ID_TAG: summary["run_id"], "fedrelay.status": summary.get("status") or "",
            "fedrelay.order": " -> ".join(summary.get("order") or []),
            "fedrelay.final_sha256": (summary.get("final") or {}).get("sha256") or "",
            "fedrelay.task_sha256": summary.get("task_sha256") or "",
            "fedrelay.insecure": str(bool(summary.get("insecure"))).lower()}
    if summary.get("error"):
        tags["fedrelay.error"] = str(summary["error"])[:5000]
    return {k: v for k, v in tags.items() if v != ""}


def export_mlflow(summary: dict, rows: list[dict], tracking_uri: str | None = None,
                  experiment: str = DEFAULT_EXPERIMENT) -> tuple[str, str]:
    """Write one run to MLflow as one MLflow run (named by the fedrelay run id) in
    ``experiment``; returns ``(tracking URI, MLflow run id)``.

    ``tracking_uri``: a server (``http://host:5000``), a database URI (``sqlite:///runs.db``), a
    ``.db`` file, or a folder (a path or ``file:`` URI: MLflow's file store); default
    ``./mlflow.db``, MLflow's own default local store (what ``mlflow ui`` started in the same
    folder reads). Exporting the same fedrelay run again replaces its
    earlier export (that MLflow run is deleted, which MLflow keeps restorable), so a run exported
    while it was going can be exported again once it has finished. Raises :class:`ExportError`
    when mlflow is not installed or the tracking store refuses (naming the URI)."""
    try:
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.tracking import MlflowClient
    except ImportError as exc:
        raise ExportError(f"--mlflow needs the mlflow package ({exc}); install it with pip install 'fedrelay[export]'"
                          ) from None
    uri = _tracking_uri(tracking_uri)
    for name in ("mlflow", "alembic"):  # their INFO lines (a new database's tables...) are not the operator's
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        client = MlflowClient(tracking_uri=uri)
        found = client.get_experiment_by_name(experiment)
        exp_id = found.experiment_id if found else client.create_experiment(experiment)
        for old in client.search_runs([exp_id], filter_string=f"tags.`{RUN_ID_TAG}` = '{summary['run_id']}'"):
            client.delete_run(old.info.run_id)
        created = summary.get("created")
        run = client.create_run(exp_id, run_name=summary["run_id"],
                                start_time=int(created * 1000) if _finite(created) else None)
        mlflow_id = run.info.run_id
        ended = summary.get("ended") or summary.get("created") or 0.0
        metrics = [Metric(k, v, int(t * 1000), step) for k, v, step, t in curve_points(rows)]
        metrics += [Metric(k, v, int(ended * 1000), 0) for k, v in final_values(summary).items()]
        params = [Param(k, v[:6000]) for k, v in run_params(summary).items()]
        tags = [RunTag(k, v) for k, v in run_tags(summary).items()]
        for i in range(0, max(len(params), len(tags), 1), 100):
            client.log_batch(mlflow_id, params=params[i:i + 100], tags=tags[i:i + 100])
        for i in range(0, len(metrics), _BATCH):
            client.log_batch(mlflow_id, metrics=metrics[i:i + _BATCH])
        status = _MLFLOW_STATUS.get(summary.get("status") or "", "FINISHED")
        if status != "RUNNING":
            client.set_terminated(mlflow_id, status=status,
                                  end_time=int(summary["ended"] * 1000) if _finite(summary.get("ended")) else None)
    except ExportError:
        raise
    except Exception as exc:  # the store's own errors (MlflowException, OSError, connection errors)
        raise ExportError(f"MLflow at {uri} refused the export: {exc}") from None
    return uri, mlflow_id


def _tracking_uri(uri: str | None) -> str:
    """``uri`` as a tracking URI: none -> MLflow's own default local store, ``./mlflow.db``
    (SQLite; what ``mlflow ui`` started in the same folder reads); a path ending in ``.db`` -> that
    SQLite file; any other path -> MLflow's file store in that folder (which MLflow keeps in
    maintenance mode: it is allowed here because the operator named a folder)."""
    if not uri:
        return "sqlite:///" + str(Path("mlflow.db").resolve())
    if "://" in uri:
        return uri
    if uri.startswith("file:"):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        return uri
    path = Path(uri).expanduser().resolve()
    if path.suffix == ".db":
        return "sqlite:///" + str(path)
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return path.as_uri()


def export_tensorboard(summary: dict, rows: list[dict], logdir: str | Path) -> Path:
    """Write one run's curves and final figures as TensorBoard event files under
    ``logdir/<run id>/`` (``tensorboard --logdir LOGDIR`` shows every run exported there side by
    side), with its parameters and final figures in the HParams tab (``logdir/<run id>/hparams``)
    and the run's description as text. Returns the run's folder. Exporting again writes the
    folder anew. Raises :class:`ExportError` when tensorboard (or torch) is missing or the
    folder cannot be written."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ExportError(f"--tensorboard needs the tensorboard package ({exc}); install it with "
                          "pip install 'fedrelay[export]'") from None
    import shutil

    out = Path(logdir) / summary["run_id"]
    try:
        if out.exists():
            shutil.rmtree(out)
        with SummaryWriter(log_dir=str(out)) as writer:
            for key, value, step, t in curve_points(rows):
                writer.add_scalar(key, value, global_step=step, walltime=t)
            finals = final_values(summary)
            ended = summary.get("ended") or summary.get("created")
            for key, value in finals.items():
                writer.add_scalar(key, value, global_step=0, walltime=ended)
            writer.add_text("fedrelay/run", _describe(summary), global_step=0, walltime=ended)
            hparam_metrics = {f"hparam/{k}": v for k, v in finals.items() if k.startswith("final/")
                              and "/site/" not in k}
            writer.add_hparams(run_params(summary), hparam_metrics or {"hparam/final/accuracy": float("nan")},
                               run_name="hparams")
    except OSError as exc:
        raise ExportError(f"cannot write TensorBoard events to {out}: {exc}") from None
    return out


def _describe(summary: dict) -> str:
    final = summary.get("final") or {}
    return "  \n".join([f"run {summary['run_id']}: {summary.get('strategy')}, {summary.get('status')}",
                        f"order: {' -> '.join(summary.get('order') or [])}",
                        f"task: {summary.get('task')} {summary.get('task_version') or ''} "
                        f"(code SHA-256 {summary.get('task_sha256') or '-'})",
                        f"final model SHA-256: {final.get('sha256') or '-'}"])
