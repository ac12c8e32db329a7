"""One cell of the few-shot study (:mod:`bench.few_shot`): an R-round chain through the daemons,
and the accuracy of the model after every T <= R rounds (hop T·N's payload, checked against the
ledger's SHA-256 and evaluated in-process the way a daemon evaluates a final model)."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from bench.cells import Config
from bench.runs import start_chain
from bench.common import meta
from bench.measures import cpu_capability
from fedrelay.tasks import resolve as resolve_task

__all__ = ["visit_dir", "settled", "evaluate_payload", "run_cell"]


def visit_dir(trial, site: str, run_id: str, round_: int) -> Path:
    """A site's folder for its visit in ``round_`` (peer/runs.py: round 1 is the run folder)."""
    folder = trial.workdir / "state" / site / "runs" / run_id
    return folder if round_ == 1 else folder / f"round-{round_}"


def settled(trial, run: dict, timeout: float = 60.0) -> dict:
    """The run once both ends of every hop have reported (receipts travel in the background), or
    as it stands after ``timeout`` seconds (the hops' statuses are recorded either way)."""
    deadline = time.monotonic() + timeout
    while not all(h["status"] == "done" for h in run["hops"]) and time.monotonic() < deadline:
        time.sleep(1.0)
        res = trial.cli("show", run["run_id"], "--json", capture_output=True, text=True, timeout=60)
        if res.returncode == 0:
            run = json.loads(res.stdout)
    return run


def evaluate_payload(data: bytes, spec, sites: dict, class_index: list[str]) -> dict[str, tuple[int, int]]:
    """site -> (correct, total) of a safetensors model on each site's test split, the way a
    daemon evaluates a final model (peer/node.py ``PeerNode.evaluate``)."""
    from fedrelay.tensors import decode_state
    from fedrelay.models import build_model
    from fedrelay.peer.training import evaluate

    model = build_model(spec)
    model.load_state_dict(decode_state(data))
    out = {}
    for name, site in sites.items():
        images, labels = site.tensors("test", class_index)
        out[name] = evaluate(model, images, labels, device="cpu", task=resolve_task(spec)) if len(labels) else (0, 0)
    return out


def run_cell(trial, method: str, cfg: Config, seed: int, rounds: int, sites: dict) -> dict:
    """One R-round chain; the accuracy after every T ≤ R, checks, bytes: the cell to cache."""
    from fedrelay.tasks.image_folder import spec as image_spec

    run, seconds = start_chain(trial, method, cfg, seed, ["--rounds", str(rounds)])
    run = settled(trial, run)
    order, rid, n = run["order"], run["run_id"], len(run["order"])
    hops = {h["hop"]: h for h in run["hops"]}
    if run["rounds"] != rounds or run["planned_hops"] != rounds * n - 1 or sorted(hops) != list(range(1, rounds * n)):
        raise RuntimeError(f"{method}: run {rid} has rounds {run['rounds']}, {len(hops)} hops, planned "
                           f"{run['planned_hops']}; expected {rounds} rounds and {rounds * n - 1} hops")
    if run.get("skipped"):
        raise RuntimeError(f"{method}: run {rid} was routed around {run['skipped']}: not the study's chain")
    class_index = sorted({c for s in sites.values() for c in s.class_names})
    if run["class_index"] != class_index or sorted(order) != sorted(sites):
        raise RuntimeError(f"{method}: run {rid}'s class index or sites differ from the site folders'")
    c, h, w = next(iter(sites.values())).image_shape
    spec = image_spec(run["arch"], c, (h, w), len(class_index))
    m = run["model_bytes"]
    per_t = {}
    for t in range(1, rounds + 1):
        if t < rounds:
            hop = hops[t * n]
            if (hop["round"], hop["sender"], hop["receiver"]) != (t + 1, order[-1], order[0]):
                raise RuntimeError(f"{method}: hop {t * n} of run {rid} is {hop}, not round {t + 1}'s "
                                   f"{order[-1]} -> {order[0]}")
            path = visit_dir(trial, order[0], rid, t + 1) / "received.safetensors"
            want, source = hop["sha256"], f"hop {t * n}'s payload ({order[-1]} -> {order[0]}, kept by the receiver)"
        else:
            path = visit_dir(trial, order[-1], rid, rounds) / "outgoing.safetensors"
            want, source = run["final"]["sha256"], f"the run's final model (outgoing of {order[-1]} in round {rounds})"
        data = path.read_bytes()
        got = hashlib.sha256(data).hexdigest()
        if got != want:
            raise RuntimeError(f"{method}: {path} has SHA-256 {got}, the ledger says {want} ({source})")
        res = evaluate_payload(data, spec, sites, class_index)
        correct, total = sum(v[0] for v in res.values()), sum(v[1] for v in res.values())
        sent = [hops[j]["payload_bytes"] for j in range(1, t * n)]
        per_t[str(t)] = {"accuracy": correct / total, "correct": correct, "test_samples": total,
                         "per_site": {k: v[0] / v[1] if v[1] else 0.0 for k, v in res.items()},
                         "sha256": got, "model": source, "hops": t * n - 1, "ledger_bytes": sum(sent),
                         "planned_bytes": (t * n - 1) * m if m else None}
    daemon = run["final"]["accuracy"]
    mine = per_t[str(rounds)]["accuracy"]
    if abs(mine - daemon) > 1e-9:
        raise RuntimeError(f"{method}: the final model evaluated in-process gives {mine!r}, the daemons {daemon!r}")
    per_t[str(rounds)]["accuracy"] = daemon  # T = R is the daemons' figure (equal, checked above)
    statuses: dict[str, int] = {}
    for hop in run["hops"]:
        statuses[hop["status"]] = statuses.get(hop["status"], 0) + 1
    return {"method": method, "seed": seed, "rounds": rounds, "sites": n, "order": order, "run_id": rid,
            "T": per_t, "daemon_final_accuracy": daemon, "in_process_final_accuracy": mine,
            "final_abs_diff": abs(mine - daemon),
            "daemon_per_site": {k: v["accuracy"] for k, v in run["final"]["per_site"].items()},
            "model_bytes": m, "total_bytes": run["total_bytes"], "planned_hops": run["planned_hops"],
            "expected_total_bytes": run["expected_total_bytes"], "hop_status": statuses,
            "seconds": seconds, "params": run.get("params"), "insecure": run.get("insecure"),
            "commit": meta()["commit"], "cpu_capability": cpu_capability(),
            "how": f"daemon chain (coordinator start-chain --rounds {rounds}, mutual TLS on loopback); T < {rounds}: "
                   "hop T·N's payload evaluated in-process (fedrelay.peer.training.evaluate, per site's test split)"}
