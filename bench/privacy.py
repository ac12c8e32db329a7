"""Privacy–utility: the final model's accuracy at a few target ε for FedELMY and FedSeq chains
with DP-SGD at every site (``coordinator start-chain --dp-epsilon EPS``, ``fedrelay.privacy``),
and without DP, on the demo's sites (``make demo``: Fashion-MNIST split over Dirichlet-skewed
sites) at a reduced scale that fits a busy 2-core machine in about 15 minutes.

One chain per (method, ε) through the daemons (``deploy/local_trial.py``'s ``LocalTrial``, mutual
TLS on loopback), every cell on the same sites, seed and model (``cnn-gn``: the demo's CNN with
GroupNorm, which DP-SGD needs; the no-DP row uses it too, so that the rows differ by DP alone).
Every cell uses last-epoch selection (DP refuses best-validation selection). The ε a cell
reports is the largest any site spent, as the sites signed it in their evaluations (``show
--json``'s ``final.per_site[*].privacy``); δ is the same at every site.

Every finished cell is cached as JSON under ``--workdir``; a rerun with the same command skips
it, and the ``privacy`` section of bench/results.json and bench/RESULTS.md is rewritten from the
cache after every cell (every figure and sentence there comes from the cells and the command's
settings).

    nice -n 15 python -m bench.privacy                  # 2 methods x (no DP + 3 ε), ~15 min on 2 cores
    python -m bench.privacy --source DIR                # Fashion-MNIST's IDX files in DIR
    python -m bench.privacy --publish-only              # the section from the cache, no training
    python -m bench.privacy --quick                     # smoke run: 1 ε, a temporary folder
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from bench.common import REPO, meta, record, study_workdir
from deploy.processes import tool

SECTION = "privacy"
DEFAULT_WORKDIR = REPO / ".fedrelay" / "bench-privacy"
DEBIAN_FASHION_MNIST = Path("/usr/share/datasets/fashion-mnist")
METHODS = ("fedelmy", "fedseq")
NO_DP = "none"


def log(msg: str) -> None:
    print(f"[privacy] {msg}", file=sys.stderr, flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.privacy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", type=Path, default=None, help="Fashion-MNIST IDX files [default: "
                    f"{DEBIAN_FASHION_MNIST} when present, else synthetic Fashion-MNIST-format data]")
    ap.add_argument("--sites", type=int, default=3)
    ap.add_argument("--dirichlet", type=float, default=0.5, help="label skew (the demo's: 0.5)")
    ap.add_argument("--seed", type=int, default=0, help="the split's and the chains' seed (the demo's: 0)")
    ap.add_argument("--max-train-per-site", type=int, default=300)
    ap.add_argument("--epsilons", default="1,4,16", help="target ε per site, comma-separated")
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("-S", type=int, default=2, help="models per site (FedSeq: S·E epochs)")
    ap.add_argument("-E", type=int, default=1, help="epochs per pool model")
    ap.add_argument("--warmup-epochs", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--results", type=Path, default=None, help="results.json to write [default: bench/'s]")
    ap.add_argument("--publish-only", action="store_true", help="the section from the cache; train nothing")
    ap.add_argument("--quick", action="store_true", help="smoke run: synthetic data, one ε, a temporary folder")
    return ap.parse_args(argv)


def settings(args) -> dict:
    """What every cell shares (the cache key and the table's scale line)."""
    return {"sites": args.sites, "dirichlet": args.dirichlet, "seed": args.seed,
            "max_train_per_site": args.max_train_per_site, "S": args.S, "E": args.E, "Ew": args.warmup_epochs,
            "batch_size": args.batch_size, "lr": args.lr, "max_grad_norm": args.max_grad_norm, "delta": args.delta,
            "model": "cnn-gn", "data": args.data_name}


def cell_path(work: Path, s: dict, method: str, eps: str) -> Path:
    tag = "-".join(f"{k}{s[k]}" for k in ("sites", "dirichlet", "seed", "max_train_per_site", "S", "E", "Ew",
                                           "batch_size", "lr", "max_grad_norm", "delta"))
    return work / "cells" / ("synthetic" if "synthetic" in s["data"] else "fmnist") / tag / f"{method}-eps{eps}.json"


def chain_args(s: dict, method: str, eps: str) -> list[str]:
    args = ["--strategy", method, "-S", str(s["S"]), "-E", str(s["E"]), "--warmup-epochs", str(s["Ew"]),
            "--batch-size", str(s["batch_size"]), "--lr", f"{s['lr']:g}", "--model", s["model"],
            "--selection", "last-epoch"]
    if eps != NO_DP:
        args += ["--dp-epsilon", eps, "--dp-delta", f"{s['delta']:g}", "--dp-max-grad-norm", f"{s['max_grad_norm']:g}"]
    return args


def run_cell(trial, s: dict, method: str, eps: str) -> dict:
    started = time.monotonic()
    res = trial.cli("start-chain", "--seed", str(s["seed"]), "--wait", "--json", *chain_args(s, method, eps),
                    capture_output=True, text=True, timeout=3 * 3600)
    seconds = time.monotonic() - started
    if res.returncode != 0:
        raise RuntimeError(f"{method} ε={eps} failed (rc {res.returncode}): {res.stderr[-2000:]}")
    run = json.loads(res.stdout)
    spent = {site: v.get("privacy") for site, v in run["final"]["per_site"].items()}
    return {"method": method, "epsilon_target": eps, "accuracy": run["final"]["accuracy"],
            "sha256": run["final"]["sha256"], "run_id": run["run_id"], "order": run["order"], "seconds": seconds,
            "privacy": spent, "params": run["params"], "commit": meta()["commit"],
            "how": "daemon chain (coordinator start-chain --wait --json, mutual TLS on loopback)"}


def split_dir(work: Path, s: dict) -> Path:
    return work / "splits" / (f"n{s['sites']}-dir{s['dirichlet']:g}-seed{s['seed']}-max{s['max_train_per_site']}-"
                              f"{'synthetic' if 'synthetic' in s['data'] else 'fmnist'}")


def split(work: Path, s: dict, source: Path) -> list[Path]:
    out = split_dir(work, s)
    if not (out / "split.json").exists():
        cmd = [tool("coordinator"), "split-dataset", "fashion-mnist", "--sites", str(s["sites"]), "--dirichlet",
               f"{s['dirichlet']:g}", "--seed", str(s["seed"]), "--out", str(out), "--source", str(source),
               "--max-train-per-site", str(s["max_train_per_site"])]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"split-dataset failed: {res.stderr[-2000:]}")
    return sorted(p for p in out.iterdir() if p.is_dir() and p.name.startswith("site-"))


def _eps_sort(e: str) -> float:
    return float("inf") if e == NO_DP else float(e)


def publish(work: Path, s: dict, methods: list[str], epsilons: list[str], args, failures: list[str]) -> dict:
    """The section from the cached cells (every figure and sentence from them and ``s``)."""
    cells = {}
    for m in methods:
        for e in epsilons:
            p = cell_path(work, s, m, e)
            if p.exists():
                cells[(m, e)] = json.loads(p.read_text())
    rows = []
    for e in sorted(epsilons, key=_eps_sort):
        for m in methods:
            c = cells.get((m, e))
            if c is None:
                rows.append([e if e != NO_DP else "no DP", m, "not run", "", "", "", ""])
                continue
            spent = [p for p in c["privacy"].values() if p]
            rows.append([e if e != NO_DP else "no DP", m, round(c["accuracy"], 4),
                         round(max(p["epsilon"] for p in spent), 3) if spent else "–",
                         round(max(p["noise_multiplier"] for p in spent), 3) if spent else "–",
                         max(p["steps"] for p in spent) if spent else "–", round(c["seconds"], 1)])
    scale = (f"{s['sites']} sites of {s['data']} (Dirichlet {s['dirichlet']:g}, seed {s['seed']}, at most "
             f"{s['max_train_per_site']} training images per site), model {s['model']}, S = {s['S']}, E = {s['E']}, "
             f"Ew = {s['Ew']}, batch {s['batch_size']}, Adam lr {s['lr']:g}, last-epoch selection; DP: clipping "
             f"C = {s['max_grad_norm']:g}, δ = {s['delta']:g}")
    notes = [f"Scale: {scale}.",
             *([] if not (split_dir(work, s) / "split.json").exists() else [
                 "Images per site (train / test): " + ", ".join(
                     f"{p['site']} {p['n_train']} / {p['n_test']}"
                     for p in json.loads((split_dir(work, s) / "split.json").read_text())["per_site"]) + "."]),
             "ε target: --dp-epsilon given to start-chain; each site picks the noise multiplier σ that spends it over "
             "all its DP epochs of the run (RDP accountant). ε spent and σ: the largest over the sites, as they "
             "signed them in their evaluations; steps: the most DP-SGD steps any site took.",
             f"One chain per cell (seed {s['seed']}), no repeats; the DP cells' noise and batches come from each "
             "site's operating-system randomness (docs/differential-privacy.md), so a rerun of a DP cell gives "
             "another figure.",
             f"{len(cells)} of {len(methods) * len(epsilons)} cells measured; "
             f"{sum(c['seconds'] for c in cells.values()):.0f} s of chains in all."]
    for m in methods:
        base = cells.get((m, NO_DP))
        dp_cells = sorted(((e, c) for (mm, e), c in cells.items() if mm == m and e != NO_DP), key=lambda x: _eps_sort(x[0]))
        if base and dp_cells:
            parts = ", ".join(f"{c['accuracy']:.4f} at ε = {e}" for e, c in dp_cells)
            notes.append(f"{m}: accuracy {base['accuracy']:.4f} without DP; {parts}.")
    if failures:
        notes += [f"failed: {f}" for f in failures]
    body = {"summary": "Privacy–utility of DP-SGD at every site (bench/privacy.py): the final model's accuracy "
                       "on every site's test split, pooled, at a few target ε, and without DP.",
            "tables": [{"title": "Final accuracy by target ε (reduced scale; see the notes)",
                        "columns": ["ε target", "method", "accuracy", "ε spent (max site)", "σ (max site)",
                                    "DP steps (max site)", "seconds"], "rows": rows}],
            "notes": notes, "settings": s, "cells": {f"{m}/{e}": c for (m, e), c in sorted(cells.items())}}
    if args.results is not None:
        record(SECTION, body, results=args.results)
    return body


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.quick:
        args.epsilons = "4"
        args.max_train_per_site = min(args.max_train_per_site, 100)
    work = study_workdir(args, "fedrelay-bench-privacy-", DEFAULT_WORKDIR)
    source = args.source
    if source is None and DEBIAN_FASHION_MNIST.is_dir() and not args.quick:
        source = DEBIAN_FASHION_MNIST
    if source is None:
        from bench.synthetic import write_fashion_like

        source = write_fashion_like(work / "idx", n_train=args.sites * args.max_train_per_site,
                                    n_test=max(200, args.sites * 100))
        args.data_name = "synthetic Fashion-MNIST-format data (bench/synthetic.py; no Fashion-MNIST on this machine)"
    else:
        args.data_name = "Fashion-MNIST"
    s = settings(args)
    methods = [m for m in args.methods.split(",") if m]
    epsilons = [NO_DP] + [e.strip() for e in args.epsilons.split(",") if e.strip()]
    failures: list[str] = []
    todo = [(m, e) for e in epsilons for m in methods if not cell_path(work, s, m, e).exists()]
    if todo and not args.publish_only:
        from deploy import local_trial as lt
        dirs = split(work, s, source)
        with lt.LocalTrial(work / "trial", dirs) as trial:
            for m, e in todo:
                log(f"{m}, ε target {e} ...")
                try:
                    cell = run_cell(trial, s, m, e)
                except RuntimeError as exc:
                    failures.append(str(exc)[:500])
                    log(f"failed: {exc}")
                    continue
                p = cell_path(work, s, m, e)
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_text(json.dumps(cell, indent=1, sort_keys=True))
                log(f"{m}, ε target {e}: accuracy {cell['accuracy']:.4f} in {cell['seconds']:.0f} s")
                publish(work, s, methods, epsilons, args, failures)
    return publish(work, s, methods, epsilons, args, failures)


if __name__ == "__main__":
    main(sys.argv[1:])
