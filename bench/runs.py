"""One cell's training: a chain (or star) through the daemons with ``coordinator start-chain
--wait --json`` (:func:`start_chain`, :func:`run_chain`), and the in-process references
local-only and centralized (:func:`run_references`: the peers' training code, single-component
runs, not daemon runs)."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from bench.cells import Config
from bench.common import meta
from fedrelay.tasks import resolve as resolve_task


def start_chain(trial, method: str, cfg: Config, seed: int, extra: list[str] = ()) -> tuple[dict, float]:
    """One chain through the daemons (``start-chain --seed SEED --wait --json``): the finished
    run's summary (``show --json``'s keys) and the seconds it took. Raises ``RuntimeError`` when
    the chain fails."""
    started = time.monotonic()
    res = trial.cli("start-chain", "--seed", str(seed), "--wait", "--json", *cfg.chain_args(method), *extra,
                    capture_output=True, text=True, timeout=6 * 3600)
    seconds = time.monotonic() - started
    if res.returncode != 0:
        dead = trial.dead()
        raise RuntimeError(f"{method} chain failed (rc {res.returncode}): {res.stderr[-2000:]}"
                           + ("\n" + "\n".join(dead) if dead else ""))
    run = json.loads(res.stdout)
    if run.get("status") != "finished" or not run.get("final"):
        raise RuntimeError(f"{method} chain ended {run.get('status')}: {run.get('error')}")
    return run, seconds


def run_chain(trial, method: str, cfg: Config, seed: int, extra: list[str] = ()) -> dict:
    """One chain through the daemons; the cell to cache."""
    run, seconds = start_chain(trial, method, cfg, seed, extra)
    return {"method": method, "accuracy": run["final"]["accuracy"], "sha256": run["final"]["sha256"],
            "commit": meta()["commit"],
            "per_site": {k: v["accuracy"] for k, v in run["final"]["per_site"].items()}, "order": run["order"],
            "run_id": run["run_id"], "seconds": seconds, "params": run.get("params"), "insecure": run.get("insecure"),
            "how": "daemon chain (coordinator start-chain, mutual TLS on loopback)"}


def _load_sites(dirs: list[Path]):
    from fedrelay.tasks.image_folder.data import load_site

    sites = [load_site(d) for d in dirs]
    class_index = sorted({c for s in sites for c in s.class_names})
    return sites, class_index


def run_references(dirs: list[Path], cfg: Config, seed: int, methods: list[str], *, model: str = "cnn",
                   options: dict | None = None, device: str = "cpu") -> dict[str, dict]:
    """local_only and centralized, in-process with the peers' training code (not daemon runs):
    method -> cell (``accuracy`` a fraction of the whole test set, ``seconds`` wall time).
    ``model``: the image-folder task's architecture; ``options``: further ``TrainConfig`` fields
    (a recipe's, e.g. a learning-rate schedule); ``device``: where torch trains (cpu, cuda).
    Raises ``TypeError`` for an option ``TrainConfig`` lacks."""
    import torch

    from fedrelay.peer.training import train_val_split
    from fedrelay.models import build_model
    from fedrelay.tasks.image_folder import spec as image_spec
    from fedrelay.peer.training import TrainConfig, derive_seed, evaluate, run_site

    sites, class_index = _load_sites(dirs)
    c, h, w = sites[0].image_shape
    spec = image_spec(model, c, (h, w), len(class_index))
    tcfg = TrainConfig(strategy="fedseq", models_per_site=cfg.S, local_epochs=cfg.E, warmup_epochs=cfg.Ew,
                       selection="best-val", **(options or {}))
    tests = [s.tensors("test", class_index) for s in sites]
    test_x = torch.cat([t[0] for t in tests])
    test_y = torch.cat([t[1] for t in tests])
    # each site's train/validation split exactly as its daemon makes it
    splits = [train_val_split(*s.tensors("train", class_index), seed=derive_seed(seed, "split", d.name))
              for s, d in zip(sites, dirs)]

    def accuracy(state) -> float:
        net = build_model(spec)
        net.load_state_dict(state)
        net.to(device)  # evaluate() takes a model already on its device
        correct, total = evaluate(net, test_x, test_y, device=device, task=resolve_task(spec))
        return correct / total

    out = {}
    if "local_only" in methods:
        started = time.monotonic()
        per_site = {}
        for d, (train, val) in zip(dirs, splits):
            state, _ = run_site(None, spec, train, val, tcfg, derive_seed(seed, "local", d.name), device)
            per_site[d.name] = accuracy(state)
        out["local_only"] = {"method": "local_only", "accuracy": statistics.fmean(per_site.values()),
                             "commit": meta()["commit"],
                             "per_site_model": per_site, "seconds": time.monotonic() - started,
                             "epochs": cfg.Ew + cfg.S * cfg.E,
                             "how": "in-process (fedrelay.peer.training.run_site, fedseq, best-val), not a daemon run"}
    if "centralized" in methods:
        started = time.monotonic()
        train = (torch.cat([s[0][0] for s in splits]), torch.cat([s[0][1] for s in splits]))
        val = (torch.cat([s[1][0] for s in splits]), torch.cat([s[1][1] for s in splits]))
        state, _ = run_site(None, spec, train, val, tcfg, derive_seed(seed, "centralized"), device)
        out["centralized"] = {"method": "centralized", "accuracy": accuracy(state), "train_samples": int(train[1].numel()),
                              "commit": meta()["commit"],
                              "seconds": time.monotonic() - started, "epochs": cfg.Ew + cfg.S * cfg.E,
                              "how": "in-process (fedrelay.peer.training.run_site, fedseq, best-val), not a daemon run"}
    return out
