"""Accuracy against communication of the one-shot methods (the paper's Table 1 / supplementary
Table 5 comparison of the parallel methods, and its Figure 5 bytes), on the one-shot grid's data
(``bench.accuracy``: Fashion-MNIST, N = 10 sites, Dirichlet 0.5 and 0.1, the small CNN) with
E = 5 and Ew = 5 (S = 5, α = 0.06, β = 1 as bench.accuracy's defaults).

Methods, every one through the daemons (``deploy/local_trial.py``'s ``LocalTrial``: a coordinator
and one ``peer serve`` per site on loopback, mutual TLS) with ``coordinator start-chain --seed SEED
--wait --json --strategy X --init shared``:

- chains: ``fedelmy`` (α, β, best-validation selection of the pool) and ``fedseq`` (last-epoch
  selection: the stronger FedSeq of the one-shot grid, chosen before this study ran);
- stars (every site trains at once, N − 1 uploads to the aggregating site): ``fedavg`` (weighted by
  train images), ``fedelmy-pfl`` (FedELMY supplementary Alg. 2), ``maecho`` (MA-Echo, τ, η, uniform
  α), ``ofasd`` (block-wise coefficients; its epochs and lr at the aggregator);
- references, in-process (``bench.runs.run_references``): ``local_only`` and ``centralized``.

Every site spends the same local epochs, Ew + S·E (what the daemons do). The initial model is the
shared seeded random init (``--init shared``): no pretrained Fashion-MNIST CNN is available
offline, and FedAvg, MA-Echo and OFASD need one common origin.

Per cell: the daemons' ``final.accuracy`` and final SHA-256, and the ledger's bytes. The
communication figure of a method is the bytes a run moves to produce the final model at the site
that makes it (chain: its N − 1 hops of M bytes; star: its N − 1 uploads of M + extra bytes); the
final copies (N − 1 of M bytes, for evaluation at every site) are recorded separately. A cell
whose ledger disagrees with the plan fails.

Every finished cell is cached as JSON under ``--workdir``; a rerun skips it, and the figures
(``accuracy.parallel`` and ``communication`` in results.json, their sections of RESULTS.md,
``plots/parallel.png``) are rewritten after every cell from the cache.

    python -m bench.parallel --quick            # smoke run: synthetic data, 3 sites, 1 seed
    nice -n 15 python -m bench.parallel         # seeds 0-4 x Dirichlet 0.5/0.1 x 8 methods
    python -m bench.parallel --publish-only     # figures from the cache, no training
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

from bench.accuracy_figures import _pct, seed_summary
from bench.bytes_plot import accuracy_against_bytes
from bench.cells import Cache, Config, dir_key
from bench.runs import run_references, start_chain
from bench.sites import grid_todo
from bench.common import REPO, commits_note, failed, finish, grid_args, grid_flags, log, meta, record, study_start
from bench.measures import cpu_capability

CHAIN = ("fedelmy", "fedseq")
STAR = ("fedavg", "fedelmy-pfl", "maecho", "ofasd")
REFS = ("local_only", "centralized")
METHODS = CHAIN + STAR + REFS
LABELS = {"fedelmy": "FedELMY (chain)", "fedseq": "FedSeq, last epoch (chain)", "fedavg": "FedAvg (star)",
          "fedelmy-pfl": "FedELMY-PFL (star)", "maecho": "MA-Echo (star)", "ofasd": "OFASD (star)",
          "local_only": "local only", "centralized": "centralized"}
MARKERS = {"fedelmy": "o", "fedseq": "s", "fedavg": "^", "fedelmy-pfl": "D", "maecho": "v", "ofasd": "P"}
DEFAULT_WORKDIR = REPO / ".fedrelay" / "bench-parallel"
SECTION, SUB, COMM = "accuracy", "parallel", "communication"


class ParallelConfig(Config):
    """bench.accuracy's Config with the star methods' options; ``chain_args`` gives every method's
    ``start-chain`` arguments (``bench.runs.start_chain`` calls it)."""

    def __init__(self, args):
        super().__init__(args)
        self.tau, self.eta, self.ofasd_epochs, self.ofasd_lr = (args.maecho_tau, args.maecho_eta, args.ofasd_epochs,
                                                                args.ofasd_lr)

    @property
    def star_tag(self) -> str:
        return f"tau{self.tau}-eta{self.eta:g}-oe{self.ofasd_epochs}-olr{self.ofasd_lr:g}"

    def chain_args(self, method: str) -> list[str]:
        common = ["-S", str(self.S), "-E", str(self.E), "--warmup-epochs", str(self.Ew), "--init", "shared"]
        if method == "fedseq":
            return ["--strategy", "fedseq", "--selection", "last-epoch", *common]
        if method in ("fedelmy", "fedelmy-pfl"):
            return ["--strategy", method, "--alpha", f"{self.alpha:g}", "--beta", f"{self.beta:g}",
                    "--selection", "best-val", *common]
        if method == "fedavg":
            return ["--strategy", "fedavg", "--weighting", "samples", *common]
        if method == "maecho":
            return ["--strategy", "maecho", "--maecho-tau", str(self.tau), "--maecho-eta", f"{self.eta:g}",
                    "--maecho-alpha", "uniform", *common]
        if method == "ofasd":
            # The OFASD this study published: distilled on the site's own images, the epoch of best
            # accuracy kept (the grid, bench.grid, runs OFASD at its faithful defaults: mixup, KL).
            return ["--strategy", "ofasd", "--ofasd-mode", "block", "--ofasd-epochs", str(self.ofasd_epochs),
                    "--ofasd-lr", f"{self.ofasd_lr:g}", "--ofasd-transfer", "plain", "--ofasd-select", "accuracy",
                    *common]
        raise ValueError(method)


# ------------------------------------------------------------------------------------------ one cell


def _settled(trial, run: dict, timeout: float = 60.0) -> dict:
    """The run once both ends of every transfer (hops, uploads, final copies) have reported, or as
    it stands after ``timeout`` seconds."""
    def done(r):
        return all(h["status"] == "done" for k in ("hops", "uploads", "final_transfers") for h in r.get(k) or [])

    deadline = time.monotonic() + timeout
    while not done(run) and time.monotonic() < deadline:
        time.sleep(1.0)
        res = trial.cli("show", run["run_id"], "--json", capture_output=True, text=True, timeout=60)
        if res.returncode == 0:
            run = json.loads(res.stdout)
    return run


def ledger_check(run: dict, n: int) -> dict:
    """The bytes figures of one run, checked against its plan; raises ``RuntimeError`` on disagreement."""
    m = run["model_bytes"]
    finals = run["final_transfers"]
    final_bytes = sum(h["payload_bytes"] for h in finals)
    problems = []
    if not m:
        problems.append("no model_bytes in the ledger")
    if len(finals) != n - 1 or final_bytes != (n - 1) * (m or 0):
        problems.append(f"{len(finals)} final copies of {final_bytes} bytes, planned {n - 1} × M = {(n - 1) * (m or 0)}")
    if run.get("aggregator"):
        up = run["upload_bytes"]
        ups = run["uploads"]
        extra = (up or 0) - (m or 0)
        if run["planned_uploads"] != n - 1 or len(ups) != n - 1:
            problems.append(f"{len(ups)} uploads (planned {run['planned_uploads']}), expected N − 1 = {n - 1}")
        if any(h["payload_bytes"] != up for h in ups) or run["upload_total_bytes"] != (n - 1) * (up or 0):
            problems.append(f"upload ledger {run['upload_total_bytes']} ≠ (N − 1)·(M + extra) = {(n - 1) * (up or 0)} "
                            f"(per upload {[h['payload_bytes'] for h in ups]})")
        if run["final_total_bytes"] != final_bytes or run["planned_final_copies"] != n - 1:
            problems.append(f"final_total_bytes {run['final_total_bytes']}, planned copies {run['planned_final_copies']}")
        if run["expected_total_bytes"] != run["upload_total_bytes"] + final_bytes:
            problems.append(f"expected_total_bytes {run['expected_total_bytes']} ≠ uploads + final copies "
                            f"{run['upload_total_bytes'] + final_bytes}")
        if run["hops"]:
            problems.append(f"a star run with {len(run['hops'])} chain hops")
        out = {"kind": "star", "aggregator": run["aggregator"], "upload_bytes": up, "extra_bytes": extra,
               "uploads": len(ups), "upload_total_bytes": run["upload_total_bytes"], "to_model_bytes": run["upload_total_bytes"],
               "planned_to_model_bytes": (n - 1) * (up or 0), "expected_total_bytes": run["expected_total_bytes"],
               "upload_status": sorted({h["status"] for h in ups})}
    else:
        hops = run["hops"]
        if run["planned_hops"] != n - 1 or len(hops) != n - 1 or run["total_bytes"] != (n - 1) * (m or 0):
            problems.append(f"chain ledger {run['total_bytes']} bytes over {len(hops)} hops (planned "
                            f"{run['planned_hops']}) ≠ (N − 1)·M = {(n - 1) * (m or 0)}")
        out = {"kind": "chain", "hops": len(hops), "total_bytes": run["total_bytes"], "to_model_bytes": run["total_bytes"],
               "planned_to_model_bytes": (n - 1) * (m or 0), "expected_total_bytes": run["expected_total_bytes"],
               "hop_status": sorted({h["status"] for h in hops})}
    if problems:
        raise RuntimeError(f"{run['strategy']} run {run['run_id']}: the ledger disagrees with the plan: "
                           + "; ".join(problems))
    out.update(model_bytes=m, final_copies=len(finals), final_total_bytes=final_bytes,
               final_status=sorted({h["status"] for h in finals}), ledger_equals_plan=True)
    return out


def run_cell(trial, method: str, cfg: ParallelConfig, seed: int, n: int) -> dict:
    run, seconds = start_chain(trial, method, cfg, seed)
    run = _settled(trial, run)
    if run.get("skipped") or len(run["order"]) != n:
        raise RuntimeError(f"{method}: run {run['run_id']} did not include all {n} sites (skipped {run.get('skipped')})")
    if len(run.get("contributors") or []) not in (0, n):
        raise RuntimeError(f"{method}: run {run['run_id']} has {len(run['contributors'])} contributors, not {n}")
    return {"method": method, "accuracy": run["final"]["accuracy"], "sha256": run["final"]["sha256"],
            "per_site": {k: v["accuracy"] for k, v in run["final"]["per_site"].items()}, "order": run["order"],
            "final_site": run.get("final_site"), "run_id": run["run_id"], "seconds": seconds,
            "bytes": ledger_check(run, n), "params": run.get("params"), "insecure": run.get("insecure"),
            "warnings": run.get("warnings"), "commit": meta()["commit"], "cpu_capability": cpu_capability(),
            "how": "daemons (coordinator start-chain --wait --json, mutual TLS on loopback)"}


# ------------------------------------------------------------------------------------------ figures


class ParallelCache(Cache):
    """``<workdir>/cells/<train tag>/<star tag>/<split tag>/dir<a>-seed<s>/<method>.json``."""

    def cells(self, cfg: ParallelConfig) -> dict:
        out: dict = {}
        base = self.root / cfg.train_tag / cfg.star_tag / cfg.split_tag
        for d in sorted(base.glob("dir*-seed*")) if base.is_dir() else []:
            a, s = d.name[3:].split("-seed")
            for f in d.glob("*.json"):
                out.setdefault(float(a), {}).setdefault(int(s), {})[f.stem] = json.loads(f.read_text())
        return out


def _one(values) -> object:
    """The value when all agree, else the sorted distinct values."""
    vals = {json.dumps(v, sort_keys=True): v for v in values}
    return next(iter(vals.values())) if len(vals) == 1 else [vals[k] for k in sorted(vals)]


def aggregate(cache: ParallelCache, cfg: ParallelConfig) -> tuple[dict, dict]:
    """(accuracy.parallel's per-Dirichlet blocks, communication's per-method figures)."""
    figures: dict = {}
    by_method: dict = {}
    for a, by_seed in sorted(cache.cells(cfg).items(), reverse=True):
        block: dict = {"dirichlet": a}
        for m in METHODS:
            cells = {str(s): ms[m] for s, ms in sorted(by_seed.items()) if m in ms}
            if not cells:
                continue
            mb = {**seed_summary(cells), "seconds_per_seed": {s: c["seconds"] for s, c in cells.items()}}
            if m not in REFS:
                mb["sha256_per_seed"] = {s: c["sha256"] for s, c in cells.items()}
                bs = [c["bytes"] for c in cells.values()]
                mb["bytes"] = {k: _one(b[k] for b in bs) for k in bs[0] if k not in ("aggregator",)}
                mb["bytes"]["aggregator_per_seed"] = {s: c["bytes"].get("aggregator") for s, c in cells.items()}
                by_method.setdefault(m, []).extend(bs)
            block[m] = mb
        figures[dir_key(a)] = block
    comm: dict = {}
    for m, bs in by_method.items():
        c = {"kind": _one(b["kind"] for b in bs), "model_bytes": _one(b["model_bytes"] for b in bs),
             "to_model_bytes": _one(b["to_model_bytes"] for b in bs),
             "final_copies_bytes": _one(b["final_total_bytes"] for b in bs),
             "final_copies": _one(b["final_copies"] for b in bs),
             "ledger_equals_plan": all(b["ledger_equals_plan"] for b in bs), "cells": len(bs)}
        if c["kind"] == "star":
            c.update(upload_bytes=_one(b["upload_bytes"] for b in bs), extra_bytes=_one(b["extra_bytes"] for b in bs),
                     uploads=_one(b["uploads"] for b in bs))
        else:
            c.update(hops=_one(b["hops"] for b in bs))
        if isinstance(c["to_model_bytes"], int) and isinstance(c["model_bytes"], int):
            c["to_model_in_M"] = c["to_model_bytes"] / c["model_bytes"]
        comm[m] = c
    return figures, comm


def plot(figures: dict, comm: dict, path: Path) -> list[str]:
    """The study's accuracy-against-communication figure (:mod:`bench.bytes_plot`); returns the
    file names written."""
    dirs = [k for k in figures if k.startswith("dir")]
    points = []
    for key in dirs:
        b = figures[key]
        for m in [m for m in METHODS if m in b and m in comm and isinstance(comm[m]["to_model_bytes"], int)]:
            # methods that move the same bytes are spread sideways by 6 % per method (log axis)
            x = comm[m]["to_model_bytes"] / 1e6 * 1.06 ** (list(MARKERS).index(m) - 2.5)
            points.append((key, m, x, b[m]["mean"], b[m]["std"], list(b[m]["per_seed"].values())))
    refs = {k: {m: figures[k][m]["mean"] for m in ("local_only", "centralized") if m in figures[k]} for k in dirs}
    n = max((figures[k][m]["n"] for k in dirs for m in METHODS if m in figures[k]), default=0)
    return accuracy_against_bytes(
        path, points, {k: figures[k]["dirichlet"] for k in dirs}, refs, LABELS, MARKERS,
        [m for m in MARKERS if m in comm], spread="a few %", figsize=(8.2, 4.4),
        title=f"One-shot methods: accuracy against communication (mean ± std, up to {n} seed(s); dots: seeds)")


def _mb(v) -> str:
    return f"{v / 1e6:.3f} MB" if isinstance(v, int) else "varies: " + ", ".join(map(str, v))


def notes_from_data(figures: dict, comm: dict, cfg: ParallelConfig) -> list[str]:
    out = []
    m_bytes = _one(c["model_bytes"] for c in comm.values()) if comm else None
    if isinstance(m_bytes, int):
        out.append(f"M = {m_bytes:,} bytes (the small CNN's safetensors). Per method, the bytes moved to produce the "
                   "final model, as the ledger recorded them: "
                   + "; ".join(f"{LABELS[m]} {_mb(c['to_model_bytes'])}"
                               + (f" ({c['to_model_in_M']:.2f} M)" if "to_model_in_M" in c else "")
                               + (f", upload = M + {c['extra_bytes']:,} bytes" if c["kind"] == "star"
                                  and isinstance(c.get("extra_bytes"), int) else "")
                               for m, c in comm.items())
                   + f". Final copies for evaluation: {cfg.sites - 1} × M for every method. "
                   + ("Every cell's ledger equals its plan (chain: (N − 1)·M; star: (N − 1)·(M + extra), "
                      "final copies (N − 1)·M)." if all(c["ledger_equals_plan"] for c in comm.values())
                      else "Some cells' ledgers did NOT equal the plan."))
    for key in [k for k in figures if k.startswith("dir")]:
        b = figures[key]
        fl = [m for m in CHAIN + STAR if m in b]
        if not fl:
            continue
        ranked = sorted(fl, key=lambda m: -b[m]["mean"])
        line = (f"Dirichlet({b['dirichlet']:g}), ranking by mean accuracy: "
                + " > ".join(f"{LABELS[m]} {100 * b[m]['mean']:.2f} %" for m in ranked) + ".")
        if "local_only" in b and "centralized" in b:
            lo, ce = b["local_only"]["mean"], b["centralized"]["mean"]
            below = [LABELS[m] for m in fl if b[m]["mean"] < lo]
            line += (f" References: local only {100 * lo:.2f} %, centralized {100 * ce:.2f} %."
                     + (f" Below local only: {', '.join(below)}." if below else " Every method is above local only."))
        chance = [LABELS[m] for m in fl if b[m]["mean"] < 0.15]
        if chance:
            line += f" At or near chance (10 classes, < 15 %): {', '.join(chance)}."
        out.append(line)
    secs = {m: [v for k in figures if k.startswith("dir") and m in figures[k]
                for v in figures[k][m]["seconds_per_seed"].values()] for m in METHODS}
    if any(secs.values()):
        out.append("Wall time per cell (mean over cells; daemons for the FL methods, in-process for the references; "
                   "shared 2-core machine under low CPU priority): "
                   + ", ".join(f"{LABELS[m]} {sum(v) / len(v):.0f} s" for m, v in secs.items() if v) + ".")
    return out


def publish(cache: ParallelCache, cfg: ParallelConfig, args, started: float, failures: list[str]) -> dict:
    figures, comm = aggregate(cache, cfg)
    plots = plot(figures, comm, args.plots / "parallel.png")
    dirs = [k for k in figures if k.startswith("dir")]
    tables = []
    for key in dirs:
        b = figures[key]
        rows = []
        for m in [m for m in METHODS if m in b]:
            c = comm.get(m)
            rows.append([LABELS[m], _pct(b[m]["mean"], b[m]["std"]), b[m]["n"],
                         _mb(c["to_model_bytes"]) if c else "0 (no transfer)" if m == "local_only" else "n/a (pools raw data)",
                         _mb(c["final_copies_bytes"]) if c else "—",
                         ", ".join(f"{s}: {100 * v:.2f}" for s, v in b[m]["per_seed"].items())])
        tables.append({"title": f"Dirichlet({b['dirichlet']:g}), {cfg.sites} sites: test accuracy % (mean ± sample std "
                                "over seeds) and bytes moved",
                       "columns": ["method", "accuracy %", "n", "bytes to the final model", "final copies",
                                   "per seed (seed: %)"], "rows": rows})
    if comm:
        tables.append({"title": "communication per run (ledger; identical in every cell unless a list is shown)",
                       "columns": ["method", "plan", "transfers", "bytes each", "bytes to the final model", "in M",
                                   "final copies bytes"],
                       "rows": [[LABELS[m], c["kind"], c.get("hops", c.get("uploads")),
                                 c.get("upload_bytes", c["model_bytes"]), c["to_model_bytes"],
                                 f"{c['to_model_in_M']:.3f}" if "to_model_in_M" in c else "—", c["final_copies_bytes"]]
                                for m, c in comm.items()]})
    data_name = "synthetic Fashion-MNIST-format data (--quick)" if args.quick else "Fashion-MNIST"
    summary = (f"Accuracy against communication of the one-shot methods (paper Table 1 / supplementary Table 5, "
               f"Figure 5's bytes) on {data_name}, {cfg.sites} sites, "
               f"{'all training data' if not cfg.max_train else f'at most {cfg.max_train} training images per site'}; "
               f"small CNN, Adam lr 1e-3, batch 128; S = {cfg.S}, E = {cfg.E}, Ew = {cfg.Ew}: every site trains "
               f"Ew + S·E = {cfg.Ew + cfg.S * cfg.E} epochs in every method. FedELMY and FedSeq (last-epoch selection) "
               "are chains, FedAvg, FedELMY-PFL, MA-Echo and OFASD stars, all through the daemons (mutual TLS, "
               "loopback, `coordinator start-chain --seed SEED --init shared`); local only and centralized are "
               "in-process references (bench.runs.run_references). Mean ± sample std over the seeds finished.")
    notes = [
        "Initial model: `--init shared`, one seeded random CNN at every site (the chains' first site draws the same "
        "one). No pretrained Fashion-MNIST CNN is available offline, and FedAvg, MA-Echo and OFASD need one common "
        "origin (independent inits average to chance); the papers' parallel baselines start from pretrained "
        "backbones, so their figures here are from-scratch figures.",
        f"Options: FedELMY and FedELMY-PFL α = {cfg.alpha:g}, β = {cfg.beta:g}, best-validation selection of the pool; "
        "FedSeq last-epoch selection (the stronger FedSeq of the one-shot grid); FedAvg weighted by train images "
        f"(its upload carries the image count: see the extra bytes below); MA-Echo τ = {cfg.tau}, η = {cfg.eta:g}, uniform model weights; OFASD block mode, "
        f"{cfg.ofasd_epochs} epoch(s) at lr {cfg.ofasd_lr:g} on the aggregating site's own train split. The star "
        "methods' local training uses the daemons' default best-validation selection. The aggregating site (stars) "
        "and the chain order are chosen by --seed.",
        "Communication: the bytes a run moves to produce the final model at the site that makes it (chain: the N − 1 "
        "hops of M bytes, `total_bytes`; star: the N − 1 uploads of M + extra bytes, `upload_total_bytes`); the final "
        "copies (N − 1 × M, sent so that every site evaluates the final model) are the same for every method and "
        "reported separately. Results keys: accuracy.parallel.<dir>.<method>.{mean, std, n, seeds, per_seed, "
        "sha256_per_seed, bytes}; communication.<method> at the top level of results.json.",
    ]
    notes += notes_from_data(figures, comm, cfg)
    missing = [f"Dir({a:g})/{m}/seed {s}" for a in args.dirichlets for s in args.seeds for m in args.methods
               if str(s) not in figures.get(dir_key(a), {}).get(m, {}).get("per_seed", {})]
    if missing:
        notes.append(f"{len(missing)} cell(s) of the planned grid missing: {', '.join(missing)}. To finish it (the "
                     f"cache resumes, skipping finished cells): `{args.resume_command}`.")
    notes += commits_note(c for by_seed in cache.cells(cfg).values() for ms in by_seed.values() for c in ms.values())
    if failures:
        notes.append(f"Failures this run ({len(failures)}): " + " | ".join(failures))
    notes += args.notes
    config = {"sites": cfg.sites, "max_train_per_site": cfg.max_train, "S": cfg.S, "E": cfg.E, "Ew": cfg.Ew,
              "alpha": cfg.alpha, "beta": cfg.beta, "lr": 1e-3, "batch_size": 128, "weight_decay": 1e-4,
              "model": "cnn", "init": "shared", "fedseq_selection": "last-epoch", "maecho_tau": cfg.tau,
              "maecho_eta": cfg.eta, "maecho_alpha": "uniform", "ofasd_mode": "block",
              "ofasd_epochs": cfg.ofasd_epochs, "ofasd_lr": cfg.ofasd_lr, "fedavg_weighting": "samples",
              "seeds": args.seeds, "dirichlets": args.dirichlets, "methods": args.methods}
    data = {**figures, "summary": summary, "tables": tables, "notes": notes, "plots": plots, "config": config,
            "quick": args.quick, "failures": failures, "wall_seconds_this_run": time.monotonic() - started,
            "resume_command": args.resume_command}
    record(SECTION, data, results=args.results, sub=SUB)
    if comm:
        record(COMM, {**comm, "summary": "Bytes per run of the one-shot methods (ledger), from the accuracy.parallel "
                                         "study: to_model_bytes = chain hops or star uploads; final copies separately. "
                                         f"N = {cfg.sites} sites.",
                      "quick": args.quick, "config": {"sites": cfg.sites}}, results=args.results)
    return data


# ------------------------------------------------------------------------------------------ main


def parse(argv):
    ap = argparse.ArgumentParser(description="Accuracy against communication of the one-shot methods, through daemons")
    grid_flags(ap, "synthetic data, 3 sites, 1 seed, Dirichlet 0.5, S=2 E=1 Ew=1, τ=3, OFASD 1 epoch (smoke run)",
               seeds="0,1,2,3,4", dirichlets="0.5,0.1", methods=METHODS, default_methods=METHODS, E=5,
               warmup_epochs=5, workdir=DEFAULT_WORKDIR)
    ap.add_argument("--maecho-tau", type=int, default=100)
    ap.add_argument("--maecho-eta", type=float, default=0.05)
    ap.add_argument("--ofasd-epochs", type=int, default=2)
    ap.add_argument("--ofasd-lr", type=float, default=0.01)
    args = grid_args(ap, argv, "bench.parallel", METHODS, maecho_tau=3, ofasd_epochs=1)
    return args


def main(argv=None) -> dict:
    args, work, started = study_start(argv, parse, "fedrelay-bench-par-", DEFAULT_WORKDIR)
    cfg = ParallelConfig(args)
    cache = ParallelCache(work / "cells")
    failures: list[str] = []
    log(f"workdir {work}; config {cfg.train_tag} {cfg.star_tag} {cfg.split_tag}")
    from deploy import local_trial as lt
    for seed, a, group, todo, dirs in grid_todo(args, cfg, cache, work, lambda seed, a: (
            cfg.train_tag, cfg.star_tag, cfg.split_tag, f"dir{a:g}-seed{seed}")):
        daemon = [m for m in todo if m not in REFS]
        if daemon:
            log(f"Dirichlet {a:g} seed {seed}: starting {len(dirs)} peers for {daemon}")
            try:
                with lt.LocalTrial(work / "trial", dirs) as trial:
                    for m in daemon:
                        try:
                            cell = run_cell(trial, m, cfg, seed, len(dirs))
                        except RuntimeError as exc:
                            failed(failures, f"Dirichlet {a:g} seed {seed} {m}", exc, m)
                            continue
                        cell.update(dirichlet=a, seed=seed)
                        cache.put(cell, *group, m)
                        log(f"  {m}: {100 * cell['accuracy']:.2f}%, {cell['bytes']['to_model_bytes']:,} bytes "
                            f"to the model, in {cell['seconds']:.0f} s")
                        publish(cache, cfg, args, started, failures)
            except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError) as exc:
                failed(failures, f"Dirichlet {a:g} seed {seed}", exc)
        refs = [m for m in todo if m in REFS]
        if refs:
            for m, cell in run_references(dirs, cfg, seed, refs).items():
                cell.update(dirichlet=a, seed=seed, cpu_capability=cpu_capability())
                cache.put(cell, *group, m)
                log(f"  {m}: {100 * cell['accuracy']:.2f}% in {cell['seconds']:.0f} s")
            publish(cache, cfg, args, started, failures)
    return finish(publish(cache, cfg, args, started, failures), started, failures, args.quick)


if __name__ == "__main__":
    main()
