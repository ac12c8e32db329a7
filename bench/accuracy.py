"""Study 1, accuracy (the paper's Tables 1, 3 and 4 on data we have): Fashion-MNIST split into N
sites with Dirichlet label skew, and a domain-shift variant with one rotated domain per site.

Methods, all with the small CNN and the same local compute (a site trains S*E epochs; the first
site also warms up for Ew epochs):

- chain methods, each one real chain through the daemons (``deploy/local_trial.py``'s
  ``LocalTrial``: a coordinator and one ``peer serve`` per site as separate processes on
  loopback, mutual TLS) started with ``coordinator start-chain --seed SEED --wait --json``;
  the accuracy is the run's ``final.accuracy`` (sample-weighted over the sites' test splits,
  i.e. the accuracy on the whole test set):

  ``fedelmy`` (alpha, beta as given), ``fedseq_best_val`` and ``fedseq_last_epoch`` (one
  model, S*E epochs, best-validation or last-epoch selection), and the ablation
  ``pool_only`` (alpha = beta = 0), ``pool_d1`` (beta = 0), ``pool_d2`` (alpha = 0);
- references, trained in-process with the same training code (``fedrelay.peer.training``;
  single-component runs, not daemon runs): ``local_only`` (each site's own model, as the first
  site of a FedSeq chain would train it: Ew + S*E epochs from a seeded init; the figure is the
  mean over sites of each model's accuracy on the whole test set) and ``centralized`` (all
  sites' training data pooled, each site's train/validation split kept, Ew + S*E epochs).

Each (Dirichlet, seed) gets its own split (``coordinator split-dataset ... --seed SEED``) and
its own trial; ``--seed SEED`` also fixes the chain order. Every finished cell (Dirichlet,
seed, method) is cached as JSON under ``--workdir``; a rerun skips it, and results.json and
RESULTS.md are rewritten after every cell from everything cached for this configuration, so a
long run can be interrupted and resumed with the same command.

``--domain-shift``: 4 sites, each a disjoint share of Fashion-MNIST's train and test sets
rotated by 0, 30, 60 or 90 degrees (all classes everywhere); FedELMY and FedSeq over a stated
subset of the 24 orders (default: a balanced 4x4 Latin square, in which every domain holds
every position once and every ordered pair of domains is adjacent once), all with one seed.

    python -m bench.accuracy --quick                                   # smoke run, < 90 s
    nice -n 15 python -m bench.accuracy --seeds 0,1,2 --dirichlets 0.5,0.1 --domain-shift
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.accuracy_figures import _pct, aggregate, plot
from bench.accuracy_notes import DISCUSSION, method_notes, progress_notes, target_notes
from bench.cells import CHAIN_METHODS, DOMAIN_METHODS, LABELS, METHODS, REF_METHODS, Cache, Config
from bench.common import PLOTS, REPO, commits_note, failed, finish, log, record
from bench.runs import run_chain, run_references
from bench.sites import ANGLES, make_domain_sites, make_split, orders_from, site_dirs, write_synthetic_idx

DEFAULT_WORKDIR = REPO / ".fedrelay" / "bench-accuracy"


def publish(cache: Cache, cfg: Config, args, started: float, failures: list[str]) -> dict:
    """Aggregate every cached cell of this configuration; plots; results.json and RESULTS.md."""
    figures = aggregate(cache, cfg)
    plots = plot(figures, args.plots / "accuracy.png", args.plots / "accuracy_domain_shift.png")
    tables, notes = [], []
    target_seeds = list(range(args.target_seeds))
    for key in [k for k in figures if k.startswith("dir")]:
        block = figures[key]
        seeds = sorted({int(s) for m in METHODS if m in block for s in block[m]["per_seed"]})
        rows = [[LABELS[m], _pct(block[m]["mean"], block[m]["std"]), block[m]["n_seeds"],
                 ", ".join(f"{s}: {100 * v:.2f}" for s, v in block[m]["per_seed"].items())]
                for m in METHODS if m in block]
        tables.append({"title": f"Dirichlet({block['dirichlet']:g}), {cfg.sites} sites: test accuracy % "
                                f"(mean ± sample std over seeds)",
                       "columns": ["method", "accuracy %", "seeds", "per seed (seed: %)"], "rows": rows})
        missing = [f"{m}@seed{s}" for s in target_seeds for m in METHODS
                   if m not in block or str(s) not in block[m]["per_seed"]]
        block["seeds_finished"] = seeds
        block["cells_missing_for_5_seeds"] = missing
    prows = []
    for key in [k for k in figures if k.startswith("dir")] + (["domain_shift"] if "domain_shift" in figures else []):
        b = figures[key]
        where = f"Dirichlet({b['dirichlet']:g})" if key.startswith("dir") else "domain shift (per order)"
        for name, d in b.get("paired", {}).items():
            a_, b_ = name.split("_minus_")
            prows.append([where, f"{LABELS[a_]} − {LABELS[b_]}", f"{100 * d['mean']:+.2f} ± {100 * d['std']:.2f}",
                          f"{d['positive']} of {d['n']}",
                          ", ".join(f"{k}: {100 * v:+.2f}" for k, v in d["per_seed"].items())])
    if prows:
        tables.append({"title": "paired differences, same seed (or order): points, mean ± sample std",
                       "columns": ["setting", "difference", "points", "positive in", "per seed (or order)"],
                       "rows": prows})
    dom = figures.get("domain_shift")
    if dom:
        ms = [m for m in DOMAIN_METHODS if m in dom]
        orders = sorted({o for m in ms for o in dom[m]["per_order"]})
        rows = [[LABELS[m], *[f"{100 * dom[m]['per_order'][o]:.2f}" if o in dom[m]["per_order"] else "—"
                              for o in orders], _pct(dom[m]["mean"], dom[m]["std"])] for m in ms]
        tables.append({"title": f"domain shift (4 sites: rotation {'/'.join(map(str, ANGLES))}°), test accuracy % "
                                "per chain order (degrees, first site first), seed "
                                f"{cfg.domain_seed}", "columns": ["method", *orders, "mean ± std over orders"],
                       "rows": rows})
    extra = {
        "config": {"sites": cfg.sites, "max_train_per_site": cfg.max_train, "S": cfg.S, "E": cfg.E, "Ew": cfg.Ew,
                   "alpha": cfg.alpha, "beta": cfg.beta, "lr": 1e-3, "batch_size": 128, "weight_decay": 1e-4,
                   "model": "cnn", "domain_max_train_per_site": cfg.domain_max_train,
                   "domain_seed": cfg.domain_seed},
        "quick": args.quick,
        "failures": failures,
        "wall_seconds_this_run": time.monotonic() - started,
        "resume_command": args.resume_command,
    }
    summary = (f"Fashion-MNIST, {cfg.sites} sites, "
               f"{'all training data' if not cfg.max_train else f'at most {cfg.max_train} training images per site'}"
               f"; small CNN, Adam lr 1e-3, batch 128; S = {cfg.S}, E = {cfg.E}, Ew = {cfg.Ew}; FedELMY α = "
               f"{cfg.alpha:g}, β = {cfg.beta:g}. Every FL method is a real chain through the daemons (one coordinator "
               "and one `peer serve` process per site, mutual TLS, loopback; `coordinator start-chain --seed SEED`, "
               "which also fixes the chain order); local-only and centralized are single-component runs of the same "
               "training code in-process (not daemon runs). Mean ± sample std over the seeds finished so far "
               "(column 'seeds').")
    notes += method_notes(cfg, args) + target_notes(figures, cfg) + progress_notes(figures, cfg, args)
    cells = [c for by_seed in cache.label_skew(cfg).values() for ms in by_seed.values() for c in ms.values()]
    cells += [c for ms in cache.domain(cfg).values() for c in ms.values()]
    notes += commits_note(cells)
    if not args.quick:
        notes += DISCUSSION.get((cfg.train_tag, cfg.split_tag, cfg.domain_tag), [])
    notes += args.notes
    data = {**figures, **extra, "summary": summary, "tables": tables, "notes": notes, "plots": plots}
    kw = {"results": args.results} if args.results else {}
    record("accuracy", data, **kw)
    return data


# ------------------------------------------------------------------------------------------ main


def parse(argv):
    ap = argparse.ArgumentParser(description="Accuracy study (paper Tables 1, 3, 4) through real daemons")
    ap.add_argument("--quick", action="store_true", help="synthetic data, 3 sites, 1 seed, S=2 E=1 Ew=1 (smoke run)")
    ap.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated seeds (default 0..4)")
    ap.add_argument("--dirichlets", default="0.5,0.1", help="comma-separated Dirichlet concentrations")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"subset of {','.join(METHODS)}")
    ap.add_argument("--sites", type=int, default=10)
    ap.add_argument("--max-train-per-site", type=int, default=None, help="passed to split-dataset")
    ap.add_argument("-S", type=int, default=5, help="pool models per site")
    ap.add_argument("-E", type=int, default=1, help="epochs per pool model (FedSeq: S*E)")
    ap.add_argument("--warmup-epochs", type=int, default=1)
    ap.add_argument("--alpha", type=float, default=0.06, help="FedELMY d1 weight (paper's CIFAR-10 choice)")
    ap.add_argument("--beta", type=float, default=1.0, help="FedELMY d2 weight (paper's CIFAR-10 choice)")
    ap.add_argument("--no-label-skew", action="store_true", help="skip the Dirichlet study")
    ap.add_argument("--domain-shift", action="store_true", help="run the domain-shift study too")
    ap.add_argument("--orders", default="latin", help="latin (4 orders, balanced Latin square) | all (24) | "
                    "semicolon-separated angle lists, e.g. '0,30,60,90;90,60,30,0'")
    ap.add_argument("--domain-methods", default=",".join(DOMAIN_METHODS))
    ap.add_argument("--domain-max-train-per-site", type=int, default=None)
    ap.add_argument("--domain-seed", type=int, default=0)
    ap.add_argument("--target-seeds", type=int, default=5, help="seeds the full grid has (for 'missing')")
    ap.add_argument("--workdir", type=Path, default=None, help=f"cache and data (default {DEFAULT_WORKDIR})")
    ap.add_argument("--source", type=Path, default=None, help="Fashion-MNIST IDX folder")
    ap.add_argument("--results", type=Path, default=None)
    ap.add_argument("--plots", type=Path, default=PLOTS)
    ap.add_argument("--note", dest="notes", action="append", default=[], help="a line for RESULTS.md (repeatable)")
    args = ap.parse_args(argv)
    args.resume_command = "nice -n 15 python -m bench.accuracy " + " ".join(shlex.quote(a) for a in (argv or []))
    finish = [a for a in (argv or [])]
    for flag in ("--seeds", "--workdir", "--results", "--plots", "--note"):  # paths: the defaults hold the cache
        while flag in finish:
            i = finish.index(flag)
            del finish[i:i + 2]
        finish = [a for a in finish if not a.startswith(flag + "=")]
    args.finish_command = ("nice -n 15 python -m bench.accuracy --seeds "
                           + ",".join(map(str, range(args.target_seeds))) + " "
                           + " ".join(shlex.quote(a) for a in finish)).strip()
    if args.quick:
        args.seeds, args.dirichlets, args.sites = "0", "0.5", 3
        args.S, args.E, args.warmup_epochs = 2, 1, 1
        args.domain_shift, args.orders = True, "0,30,60,90"
        if args.domain_methods == ",".join(DOMAIN_METHODS):  # not chosen on the command line
            args.domain_methods = "fedelmy,fedseq_best_val"
        args.target_seeds = 1
    return args


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    started = time.monotonic()
    work = args.workdir or (Path(tempfile.mkdtemp(prefix="fedrelay-bench-acc-")) if args.quick else DEFAULT_WORKDIR)
    if args.quick and args.source is None:
        args.source = write_synthetic_idx(work / "idx")
    cfg = Config(args)
    cache = Cache(work / "cells")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    dirichlets = [float(a) for a in args.dirichlets.split(",") if a.strip()]
    methods = [m for m in args.methods.split(",") if m]
    bad = sorted(set(methods) - set(METHODS)) + sorted(set(args.domain_methods.split(",")) - set(DOMAIN_METHODS))
    if bad:
        raise SystemExit(f"unknown method(s) {bad}; choose from {METHODS}")
    from deploy import local_trial as lt
    failures: list[str] = []
    log(f"workdir {work}; config {cfg.train_tag} {cfg.split_tag}")

    if not args.no_label_skew:
        for seed in seeds:  # seed-major: partial results cover every Dirichlet
            for a in dirichlets:
                group = (cfg.train_tag, cfg.split_tag, f"dir{a:g}-seed{seed}")
                chain_todo = [m for m in methods if m in CHAIN_METHODS and cache.get(*group, m) is None]
                ref_todo = [m for m in methods if m in REF_METHODS and cache.get(*group, m) is None]
                if not chain_todo and not ref_todo:
                    continue
                sites_dir = make_split(work / "splits" / cfg.split_tag / f"dir{a:g}-seed{seed}", cfg, a, seed,
                                       args.source)
                dirs = site_dirs(sites_dir)
                if chain_todo:
                    log(f"Dirichlet {a:g} seed {seed}: starting {len(dirs)} peers for {chain_todo}")
                    try:
                        with lt.LocalTrial(work / "trial", dirs) as trial:
                            for m in chain_todo:
                                cell = run_chain(trial, m, cfg, seed)
                                cell.update(dirichlet=a, seed=seed)
                                cache.put(cell, *group, m)
                                log(f"  {m}: {100 * cell['accuracy']:.2f}% in {cell['seconds']:.0f} s")
                                publish(cache, cfg, args, started, failures)
                    except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError) as exc:
                        failed(failures, f"Dirichlet {a:g} seed {seed}", exc)
                for m in ref_todo:
                    cell = run_references(dirs, cfg, seed, [m])[m]
                    cell.update(dirichlet=a, seed=seed)
                    cache.put(cell, *group, m)
                    log(f"  {m}: {100 * cell['accuracy']:.2f}% in {cell['seconds']:.0f} s (in-process)")
                    publish(cache, cfg, args, started, failures)

    if args.domain_shift:
        dmethods = [m for m in args.domain_methods.split(",") if m]
        todo = []
        for order in orders_from(args.orders):
            label = "-".join(map(str, order))
            ms = [m for m in dmethods if cache.get(cfg.train_tag, cfg.domain_tag, label, m) is None]
            if ms:
                todo.append((order, label, ms))
        if todo:
            dirs = make_domain_sites(work / "domain" / cfg.domain_tag, cfg, args.source)
            name_of = {angle: d.name for angle, d in zip(ANGLES, dirs)}
            log(f"domain shift: starting 4 peers for {len(todo)} order(s)")
            try:
                with lt.LocalTrial(work / "trial", dirs) as trial:
                    for order, label, ms in todo:
                        peers = ",".join(name_of[x] for x in order)
                        for m in ms:
                            cell = run_chain(trial, m, cfg, cfg.domain_seed, ["--order", "given", "--peers", peers])
                            cell.update(order_degrees=list(order),
                                        per_site={f"{ANGLES[[d.name for d in dirs].index(k)]}deg": v
                                                  for k, v in cell["per_site"].items()})
                            cache.put(cell, cfg.train_tag, cfg.domain_tag, label, m)
                            log(f"  order {label} {m}: {100 * cell['accuracy']:.2f}% in {cell['seconds']:.0f} s")
                            publish(cache, cfg, args, started, failures)
            except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError) as exc:
                failed(failures, "domain shift", exc)

    return finish(publish(cache, cfg, args, started, failures), started, failures, args.quick)


if __name__ == "__main__":
    main()
