"""What the live run page shows, computed from the ledger: plain dicts, served as JSON.

A site's **state** on the page is one of ``waiting`` (assigned, nothing to do yet),
``receiving``, ``training``, ``sending`` (a hop, an upload, or the final model's copies),
``done``, ``skipped`` (routed around) and ``failed``; it comes from the run's events (the
sites' state reports, their per-epoch progress, the coordinator's skips and failures).
"""

from __future__ import annotations

import json
import time
from typing import Any

from fedrelay import purpose as purposes
from fedrelay.coordinator.client import summary_dict

#: A site's reported state (peer/node.py) -> its state on the page.
PAGE_STATE = {"assigned": "waiting", "receiving": "receiving", "training": "training", "sending": "sending",
              "distributing": "sending", "done": "done", "failed": "failed"}
STAGE_WORDS = {"warmup": "warm-up", "pool": "pool model", "fedseq": "fedseq"}
RECENT_EVENTS = 60


def run_list(ledger) -> list[dict[str, Any]]:
    """Every run, newest first: ``[{"run_id", "strategy", "status", "created", "ended" (unix
    seconds or None), "sites" (names in plan order), "rounds", "accuracy" (global, or None),
    "insecure"}]``."""
    out = []
    for run_id in reversed(ledger.run_ids()):
        r = ledger.run(run_id)
        if r is None:
            continue
        out.append({"run_id": run_id, "strategy": r["strategy"], "status": r["status"], "created": r["created"],
                    "ended": r["ended"], "sites": [c["name"] for c in r["chain"]], "rounds": r["rounds"],
                    "accuracy": r["accuracy"], "insecure": bool(r["insecure"])})
    return out


def transfer_key(purpose: str, index: int, receiver: str) -> str:
    """The page's id of a transfer: ``chain:H``, ``upload:I`` or ``final:RECEIVER``."""
    return f"final:{receiver}" if purpose == "final" else f"{purpose}:{index}"


def transfers(run: dict) -> list[dict[str, Any]]:
    """The transfer table: every transfer of the current plan, and every reported one a reroute
    dropped from it, in plan order. Each row: ``key`` (:func:`transfer_key`), ``purpose``
    (chain|upload|final), ``index``, ``round``, ``sender``, ``receiver``, ``payload_bytes``,
    ``sha256``, ``attempts``, ``seconds``, ``started``, ``ended`` (unix seconds; None until
    reported), ``status`` (``planned`` until an end reports, then done|sent|received|disputed) and
    ``route`` (direct|relayed; None until reported)."""
    reported = {}
    for purpose, field in (("chain", "hops"), ("upload", "uploads"), ("final", "final_transfers")):
        for h in run.get(field) or []:
            reported[transfer_key(purpose, h["hop"], h["receiver"])] = (purpose, h)
    rows, seen = [], set()

    def row(purpose, index, round_, sender, receiver, h):
        return {"key": transfer_key(purpose, index, receiver), "purpose": purpose, "index": index,
                "round": round_ or (h or {}).get("round") or 1, "sender": (h or {}).get("sender") or sender,
                "receiver": receiver, "payload_bytes": (h or {}).get("payload_bytes") or None,
                "sha256": (h or {}).get("sha256") or None, "attempts": (h or {}).get("attempts") or 0,
                "seconds": (h or {}).get("seconds") if h and h.get("ended") else None,
                "started": (h or {}).get("started") or None, "ended": (h or {}).get("ended") or None,
                "status": h["status"] if h else "planned", "route": (h or {}).get("route") or None}

    for t in run["plan"]:
        purpose = purposes.to_ledger(t["purpose"]) if t["purpose"] in purposes.WORDS else t["purpose"]  # the page's keys use the ledger's words
        key = transfer_key(purpose, t["index"], t["receiver"])
        seen.add(key)
        rows.append(row(purpose, t["index"], t["round"], t["sender"], t["receiver"], reported.get(key, (0, None))[1]))
    for key, (purpose, h) in reported.items():
        if key not in seen:
            rows.append(row(purpose, h["hop"], h["round"], h["sender"], h["receiver"], h))
    return rows


def _label(s: dict) -> str:
    if s["state"] == "training" and s["epoch"]:
        stage = STAGE_WORDS.get(s["stage"] or "", s["stage"] or "")
        if s["stage"] == "pool":
            stage = f"{stage} {s['model']}"
        return f"training ({stage}, epoch {s['epoch']}/{s['epochs']})"
    return s["state"]


def site_states(run: dict, events: list[dict]) -> dict[str, dict[str, Any]]:
    """Each site of the run (plan order) -> ``{"state", "label" (e.g. "training (pool model 2,
    epoch 1/2)"), "detail" (the site's own words), "stage", "model", "epoch", "epochs",
    "accuracy" (its evaluation of the final model, or None), "test_samples", "metrics" (that
    evaluation's metrics, built-in and the task's own; {} before it)}`` from the run's events
    (``Ledger.events_after`` rows, oldest first)."""
    sites = {name: {"state": "waiting", "label": "waiting", "detail": "", "stage": None, "model": None,
                    "epoch": None, "epochs": None, "accuracy": None, "test_samples": None, "metrics": {}}
             for name in run["order"]}
    for e in events:
        s = sites.get(e["site"])
        if s is None:
            continue
        data = json.loads(e["data"] or "{}")
        kind = e["kind"]
        if kind == "state" and data.get("state") in PAGE_STATE and s["state"] != "skipped":
            s.update(state=PAGE_STATE[data["state"]], detail=data.get("detail") or "", epoch=None, epochs=None,
                     stage=None, model=None)
        elif kind == "epoch" and s["state"] != "skipped":
            s.update(state="training", stage=data.get("stage"), model=data.get("model"), epoch=data.get("epoch"),
                     epochs=data.get("epochs"))
        elif kind == "skip":
            s.update(state="skipped", detail=e["message"])
        elif kind == "failed":
            s.update(state="failed", detail=data.get("error") or e["message"])
        elif kind == "evaluated":
            s.update(accuracy=data.get("accuracy"), test_samples=data.get("test_samples"),
                     metrics=dict(data.get("metrics") or {}))
    for name in run.get("skipped") or []:
        sites[name]["state"] = "skipped"
    for s in sites.values():
        s["label"] = _label(s)
    return sites


def final_table(run: dict) -> dict[str, Any]:
    """The page's table of the final model's metrics: ``{"columns": [[key, label], ...], "rows":
    [{"site", "values": {key: float}, "test_samples"}, ...] (plan order), "global": {"values",
    "test_samples"} or None}``. Columns: accuracy first, then the other built-in metrics any site
    or the run reports (``fedrelay.scoring.BUILTIN`` order), then the task's own (sorted). Each
    site's values are its exact figures on its own test split; the global ones come from the
    sites' pooled statistics (a task's own metric: the test-sample-weighted mean). Once the run
    has finished they are the final result's (``run["final"]``); before, each site's evaluation
    as it arrives (``run["sites"]``, :func:`site_states`), and no global row."""
    from fedrelay.scoring import BUILTIN, LABELS

    final = run.get("final")
    rows = []
    for name in run["order"]:
        if final and name in final["per_site"]:
            v = final["per_site"][name]
            rows.append({"site": name, "values": {**v["metrics"], "accuracy": v["accuracy"]},
                         "test_samples": v["test_samples"]})
        else:
            s = (run.get("sites") or {}).get(name) or {}
            values = dict(s.get("metrics") or {})
            if s.get("accuracy") is not None:
                values["accuracy"] = s["accuracy"]
            rows.append({"site": name, "values": values, "test_samples": s.get("test_samples")})
    total = None
    if final:
        total = {"values": {**final["metrics"], "accuracy": final["accuracy"]},
                 "test_samples": sum(v["test_samples"] for v in final["per_site"].values())}
    seen = {k for r in [*rows, *([total] if total else [])] for k in r["values"]}
    keys = ["accuracy", *(k for k in BUILTIN if k in seen and k != "accuracy"), *sorted(seen - set(BUILTIN))]
    return {"columns": [[k, LABELS.get(k, k)] for k in keys], "rows": rows, "global": total}


def timeline(run: dict, events: list[dict], rows: list[dict]) -> list[dict[str, Any]]:
    """Spans per site, in unix seconds: what each site was doing (``kind`` = its page state:
    waiting, receiving, training, sending) from one state change to the next, and each reported
    transfer (``kind`` = ``transfer``, on its sender's row, ``key`` = :func:`transfer_key`).
    ``end`` is None for a span still open (the page draws it to now)."""
    spans, open_ = [], {}
    for e in events:
        if e["site"] not in run["order"]:
            continue
        data = json.loads(e["data"] or "{}")
        kind = {"state": PAGE_STATE.get(data.get("state")), "epoch": "training", "skip": "skipped",
                "failed": "failed"}.get(e["kind"])
        if kind is None or (e["site"] in open_ and open_[e["site"]]["kind"] == kind):
            continue
        if e["site"] in open_:
            open_.pop(e["site"])["end"] = e["time"]
        span = {"site": e["site"], "kind": kind, "start": e["time"], "end": None,
                "detail": data.get("detail") or ""}
        if kind in ("done", "skipped", "failed"):
            continue
        spans.append(span)
        open_[e["site"]] = span
    if run["status"] != "running":
        for span in open_.values():
            span["end"] = run["ended"] or span["start"]
    for t in rows:
        if t["started"] and t["ended"]:
            spans.append({"site": t["sender"], "kind": "transfer", "key": t["key"], "start": t["started"],
                          "end": t["ended"], "detail": f"{t['purpose']} {t['index']} to {t['receiver']}"})
    return spans


def run_view(service, run_id: str) -> dict[str, Any] | None:
    """The run page's data: the run summary (``coordinator show --json``'s object) plus
    ``sites`` (:func:`site_states`), ``final_table`` (:func:`final_table`), ``transfers``
    (:func:`transfers`), ``timeline``
    (:func:`timeline`), ``metrics`` (every per-epoch record: site, stage, model, epoch, epochs,
    train_loss, val_accuracy (None when the site holds no validation split), seconds, time),
    ``events`` (the last few: seq, time, kind, site, message), ``last_seq`` (the ledger's seq of
    the run's newest event; the page's event stream resumes after it) and ``now`` (unix seconds).
    None for an unknown run."""
    summary = service.summary(run_id)
    if summary is None:
        return None
    run = summary_dict(summary)
    ledger = service.ledger
    events = service.events.events_after(run_id, 0)  # the hub's memory when it holds the whole run
    run["sites"] = site_states(run, events)
    run["final_table"] = final_table(run)
    run["transfers"] = transfers(run)
    run["timeline"] = timeline(run, events, run["transfers"])
    run["metrics"] = [{k: m[k] for k in ("site", "stage", "model", "epoch", "epochs", "train_loss", "val_accuracy",
                                         "seconds", "time")} for m in ledger.metrics(run_id)]
    run["events"] = [{k: e[k] for k in ("seq", "time", "kind", "site", "message")} for e in events[-RECENT_EVENTS:]]
    run["last_seq"] = events[-1]["seq"] if events else 0
    run["now"] = time.time()
    return run
