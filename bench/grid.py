"""The full-data grid (issue #25 item 4): every one-shot method, one recipe, Fashion-MNIST, 10 sites,
Dirichlet 0.5 and 0.1, seeds 0-4 (more at 0.1 with ``--seeds-at 0.1=0-9``), E = Ew = 5, S = 5,
every site's whole share of the training set; each cell through the daemons with its ledger checked
against its plan and its bytes beside its accuracy.

Methods (``bench.grid_methods``): the chains ``fedelmy`` (the paper's), ``fedelmy-kd`` (ours:
FedELMY plus distillation towards the received model), ``fedelmy-kd-nod`` (ours without d1/d2:
α = β = 0), ``fedseq-kd`` (ours without the pool: FedSeq plus the distillation, last epoch),
``fedseq_last_epoch`` (and ``fedseq_best_val`` on request); the stars ``fedavg``,
``fedavg-classaware`` (FedAvg + MA-Echo's class-aware last layer: the MA-Echo ablation),
``fedelmy-pfl``, ``maecho``, ``ofasd``; the in-process references ``local_only`` and
``centralized`` (``bench.runs.run_references``). ``--recipe`` (``paper``: constant lr, no
augmentation, ``cnn``; ``ours``: cosine, flip-and-crop, ``--model``, default ``cnn-gn``) adds the
same ``start-chain`` flags to every method.

Resumable across sessions: every finished cell is a small JSON file in a tracked folder
(``bench.grid_cells``: ``bench/cells/<study>/<recipe>/dir<a>/seed<s>/<method>.json``);
``--commit-cells`` commits each as it lands. A rerun skips finished cells; cells come round-robin
(all methods of seed 0 at both Dirichlets, then seed 1, ...), so a partial grid is a useful one;
``--max-cells N`` and ``--deadline HH:MM`` (UTC) stop between cells; ``--jobs N`` runs up to N
(Dirichlet, seed) groups at once as processes of their own (``bench.grid_jobs``). ``--publish-only`` rebuilds
results.json (``accuracy.grid``), RESULTS.md and the plots from the cells (``bench.grid_report``).
A study at other settings (``-S``, ``-E``, ``--warmup-epochs``, ``--sites``, ``--max-train-per-site``)
keeps its cells in a folder of its own and publishes beside the grid, as ``accuracy.grid_<study>``.

    python -m bench.grid --quick                                   # smoke run, a couple of minutes
    nice -n 15 python -m bench.grid --recipe paper --commit-cells  # the grid; rerun to resume
    python -m bench.grid --publish-only                            # tables and plots from the cells
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import subprocess
import sys
from pathlib import Path

from bench.common import BENCH, REPO, failed, finish, grid_args, grid_flags, log, meta, study_start
from bench.bn_oracle import BnOracle, final_model_file
from bench.ofasd_start import distance_from_average
from bench.grid_cells import CellStore, commit_cell, each, plan
from bench.grid_methods import (DEFAULT_METHODS, METHODS, RECIPES, REFS, GridConfig, check_build, probe_start_chain,
                                recipe_tag, reference_options, train_config_fields)
from bench.grid_report import check_paired, publish

DEFAULT_CELLS = BENCH / "cells"
DEFAULT_WORKDIR = REPO / ".fedrelay" / "bench-grid"  # splits and the daemons' state: not tracked
QUICK_METHODS = ("fedelmy", "fedavg", "local_only")


def seed_range(text: str, flag: str) -> list[int]:
    """``"0-4"`` or ``"0,2,5-9"`` -> the seeds; ``SystemExit`` naming ``flag`` otherwise."""
    out: list[int] = []
    try:
        for part in (p.strip() for p in text.split(",") if p.strip()):
            lo, _, hi = part.partition("-")
            out += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    except ValueError:
        raise SystemExit(f"{flag} {text!r}: expected seeds such as 0-4 or 0,2,5-9") from None
    if not out:
        raise SystemExit(f"{flag} {text!r}: no seeds")
    return sorted(set(out))


def deadline_at(hhmm: str, now: dt.datetime) -> dt.datetime:
    """The next time of day ``HH:MM`` (UTC) after ``now`` (an aware datetime): today's, or
    tomorrow's once today's has passed. ``SystemExit`` naming ``--deadline`` for a bad time."""
    try:
        t = dt.datetime.strptime(hhmm, "%H:%M").time()
    except ValueError:
        raise SystemExit(f"--deadline {hhmm!r}: expected HH:MM (UTC), e.g. 06:30") from None
    at = now.astimezone(dt.timezone.utc).replace(hour=t.hour, minute=t.minute, second=0, microsecond=0)
    return at if at > now else at + dt.timedelta(days=1)


def parse(argv):
    ap = argparse.ArgumentParser(description="The full-data grid of the one-shot methods, through the daemons")
    grid_flags(ap, "synthetic data, 3 sites, seed 0, Dirichlet 0.5, S=2 E=1 Ew=1, fedelmy/fedavg/local_only unless "
               "--methods (smoke run)", seeds="0,1,2,3,4", dirichlets="0.5,0.1", methods=METHODS,
               default_methods=DEFAULT_METHODS, E=5, warmup_epochs=5, workdir=DEFAULT_WORKDIR)
    ap.add_argument("--seeds-at", action="append", default=[], metavar="DIRICHLET=SEEDS",
                    help="other seeds at one Dirichlet, e.g. 0.1=0-9 (repeatable)")
    ap.add_argument("--recipe", choices=sorted(RECIPES), default="paper",
                    help="; ".join(f"{r.name}: {r.about}, model {r.model}" for r in RECIPES.values()))
    ap.add_argument("--model", default=None, help="the recipe's model (image-folder: cnn, cnn-gn, cnn-wide, ...)")
    ap.add_argument("--cells", type=Path, default=None,
                    help=f"the tracked cells folder (default {DEFAULT_CELLS}; --quick: the work dir's cells/)")
    ap.add_argument("--study", default=None, help="the cells' study name (default from sites, data, S, E, Ew)")
    ap.add_argument("--commit-cells", action="store_true", help="git add + git commit each cell file as it lands")
    ap.add_argument("--max-cells", type=int, default=None, help="stop after computing N cells")
    ap.add_argument("--deadline", default=None, metavar="HH:MM",
                    help="UTC; start no cell that would end after it (estimate: the median of the method's "
                    "earlier cells, else of all cells)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="run up to N (Dirichlet, seed) groups at once, each its own bench.grid process "
                    "(bench.grid_jobs; for machines with more cores, e.g. a lent GPU machine)")
    ap.add_argument("--device", default="cpu", help="the peers' and the references' torch device (cpu, cuda)")
    ap.add_argument("--worker-slots", type=int, default=None,
                    help="each peer's `peer serve --worker-slots` (the sites of a cell share them): default 1 on "
                    "the CPU, where a star's sites training at once share the cores and each runs slower than "
                    "alone; 3 (the daemon's default) with --device cuda. The cells' arithmetic does not depend "
                    "on it")
    ap.add_argument("--maecho-tau", type=int, default=100)
    ap.add_argument("--maecho-eta", type=float, default=0.05)
    ap.add_argument("--method-args", action="append", default=[], metavar="METHOD=FLAGS",
                    help="more start-chain flags for one method, e.g. 'ofasd=--ofasd-epochs 20' (repeatable)")
    ap.add_argument("--paired-with", action="append", default=[], metavar="STUDY",
                    help="also pair this study's methods, seed by seed, with FedELMY, the strongest FedSeq and the "
                    "same method in STUDY's cells (same cells folder and recipe; the same sites, data, S, E, Ew, "
                    "alpha, beta and init, else refused): for a study that changes one method's flags, e.g. "
                    "--method-args 'fedelmy-kd=--kd-weight 0.75' (repeatable: one pairing per STUDY)")
    argv = list(argv or [])
    args = grid_args(ap, argv, "bench.grid", METHODS, maecho_tau=3)
    if args.quick and not any(a == "--methods" or a.startswith("--methods=") for a in argv):
        args.methods = list(QUICK_METHODS)
    if args.worker_slots is None:
        args.worker_slots = 1 if args.device == "cpu" else 3
    if args.worker_slots < 1:
        raise SystemExit(f"--worker-slots {args.worker_slots}: expected 1 or more")
    if args.jobs < 1:
        raise SystemExit(f"--jobs {args.jobs}: expected 1 or more")
    if args.jobs > 1 and args.max_cells is not None:
        raise SystemExit("--max-cells counts one process's cells: use it without --jobs")
    if args.max_cells is not None and args.max_cells < 0:
        raise SystemExit(f"--max-cells {args.max_cells}: expected 0 or more")
    args.seeds_of = {a: args.seeds for a in args.dirichlets}
    for spec in args.seeds_at:
        d, _, seeds = spec.partition("=")
        try:
            a = float(d)
        except ValueError:
            raise SystemExit(f"--seeds-at {spec!r}: expected DIRICHLET=SEEDS, e.g. 0.1=0-9") from None
        if a not in args.seeds_of:
            raise SystemExit(f"--seeds-at {spec!r}: Dirichlet {a:g} is not in --dirichlets")
        args.seeds_of[a] = seed_range(seeds, "--seeds-at")
    args.model = args.model or RECIPES[args.recipe].model
    args.deadline_at = deadline_at(args.deadline, dt.datetime.now(dt.timezone.utc)) if args.deadline else None
    return args


def machine(device: str) -> dict:
    """Where a cell ran: CPU, its torch kernels, host, device (and GPU name), torch and Python."""
    from bench.measures import cpu_capability

    m = meta()
    out = {"cpu": m["cpu"], "cpu_capability": cpu_capability(), "host": platform.node(), "device": device,
           "torch": m["torch"], "python": m["python"]}
    if device.startswith("cuda"):
        import torch

        out["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "unavailable"
    return out


def _estimate(store: CellStore, recipe: str, method: str) -> float:
    """Seconds a cell of ``method`` will take: the median over the study's earlier cells of it in
    this recipe, else over all its cells of this recipe, else 0."""
    cells = [c for *_, c in each(store.all().get(recipe, {})) if "seconds" in c]
    own = [c["seconds"] for c in cells if c.get("method") == method]
    return statistics.median(own or [c["seconds"] for c in cells] or [0.0])


class Stop(Exception):
    """Raised between cells when ``--max-cells`` or ``--deadline`` says so."""


def main(argv=None) -> dict:
    args, work, started = study_start(argv, parse, "fedrelay-bench-grid-", DEFAULT_WORKDIR)
    cells_root = args.cells or (work / "cells" if args.quick else DEFAULT_CELLS)
    failures: list[str] = []
    recipe = RECIPES[args.recipe]
    tag = recipe_tag(args.recipe, args.model)
    if args.publish_only:
        cfg = GridConfig(args, {})
        store = CellStore(cells_root, args.study or cfg.study)
        return finish(publish(store, cfg, args, tag, started, failures), started, failures, args.quick)
    flags, strategies = probe_start_chain()
    recipe_flags, cannot, build_notes = check_build(recipe, args.model, args.methods, flags, strategies)
    cfg = GridConfig(args, recipe_flags)
    store = CellStore(cells_root, args.study or cfg.study)
    for pair in args.paired_with:  # refused before any cell is computed, not only when publishing at the end
        check_paired(CellStore(cells_root, pair).all(), pair, cfg, store.study)
    ref_options = None
    log(f"cells {store.base / tag}; workdir {work}; recipe {tag} {recipe_flags}")
    for note in build_notes:
        log(f"  note: {note}")
    for m, why in cannot.items():
        failed(failures, f"{m} (every cell)", RuntimeError(why), m)
    todo = [(s, a, m) for s, a, m in plan(args.seeds_of, args.methods)
            if m not in cannot and store.get(tag, a, s, m) is None]
    log(f"{len(todo)} cell(s) to compute")
    computed = 0
    from deploy import local_trial as lt

    from bench import parallel
    from bench.sites import make_split, site_dirs

    def gate(method: str) -> None:
        if args.max_cells is not None and computed >= args.max_cells:
            raise Stop(f"--max-cells {args.max_cells} reached")
        if args.deadline_at:
            end = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=_estimate(store, tag, method))
            if end > args.deadline_at:
                raise Stop(f"--deadline {args.deadline}: a {method} cell would end about {end:%H:%M} UTC")

    def land(cell: dict, seed: int, a: float, m: str) -> None:
        nonlocal computed
        cell.update(study=store.study, recipe={"name": recipe.name, "tag": tag, "about": recipe.about,
                                               "model": args.model, "flags": recipe_flags, "notes": build_notes},
                    dirichlet=a, seed=seed, machine={**machine(args.device), "worker_slots": args.worker_slots},
                    config=cfg.config())
        path = store.put(cell, tag, a, seed, m)
        computed += 1
        log(f"  {m}: {100 * cell['accuracy']:.2f}% in {cell['seconds']:.0f} s -> {path}")
        if args.commit_cells:
            why = commit_cell(path, f"bench.grid cell {store.study}/{tag}/dir{a:g}/seed{seed}/{m}: "
                                    f"{100 * cell['accuracy']:.2f} %")
            if why:
                log(f"  could not commit the cell ({why}); it stays in {path}")
        publish(store, cfg, args, tag, started, failures)

    groups: dict[tuple[int, float], list[str]] = {}
    for s, a, m in todo:
        groups.setdefault((s, a), []).append(m)
    if args.jobs > 1:
        from bench.grid_jobs import run_groups

        committed = set(store.base.glob("*/dir*/seed*/*.json"))

        def commit_new(running: int) -> None:  # the parent alone commits: the group processes never race for git's index
            for path in sorted(set(store.base.glob("*/dir*/seed*/*.json")) - committed):
                committed.add(path)
                if args.commit_cells:
                    why = commit_cell(path, f"bench.grid cell {path.relative_to(store.root)}")
                    if why:
                        log(f"  could not commit {path} ({why}); it stays there")

        log(f"{len(groups)} group(s), up to {args.jobs} at once (logs in {work / 'jobs'})")
        for why in run_groups(list(groups), list(sys.argv[1:] if argv is None else argv), work, cells_root,
                              args.jobs, on_poll=commit_new):
            failed(failures, "group", RuntimeError(why))
        return finish(publish(store, cfg, args, tag, started, failures), started, failures, args.quick)
    try:
        for (seed, a), methods in groups.items():
            gate(methods[0])
            try:
                dirs = site_dirs(make_split(work / "splits" / cfg.split_tag / f"dir{a:g}-seed{seed}", cfg, a, seed,
                                            args.source))
            except RuntimeError as exc:  # split-dataset's own words (e.g. no Fashion-MNIST: --source DIR)
                failed(failures, f"Dirichlet {a:g} seed {seed}", exc)
                continue
            daemon = [m for m in methods if m not in REFS]
            if daemon:
                log(f"Dirichlet {a:g} seed {seed}: starting {len(dirs)} peers for {daemon}")
                try:
                    oracle = BnOracle(dirs, args.model)  # reads the split at its first measurement
                    with lt.LocalTrial(work / "trial", dirs, device=args.device,
                                       peer_args=["--worker-slots", str(args.worker_slots)]) as trial:
                        for m in daemon:
                            gate(m)
                            try:
                                cell = parallel.run_cell(trial, m, cfg, seed, len(dirs))
                            except RuntimeError as exc:
                                failed(failures, f"Dirichlet {a:g} seed {seed} {m}", exc, m)
                                continue
                            cell["args"] = cfg.chain_args(m)
                            final = lambda: final_model_file(trial.workdir, cell)  # noqa: E731
                            cell["bn_oracle"] = reading("BatchNorm oracle", lambda: oracle.measure(final()))
                            if m == "ofasd":
                                cell["ofasd_start"] = reading("OFASD's distance from the weight average",
                                                              lambda: distance_from_average(trial.workdir, cell, final()))
                            land(cell, seed, a, m)
                except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError) as exc:
                    failed(failures, f"Dirichlet {a:g} seed {seed}", exc)
            for m in [m for m in methods if m in REFS]:
                gate(m)
                try:
                    if ref_options is None:
                        ref_options = reference_options(recipe, train_config_fields())
                    cell = reference_cell(dirs, cfg, seed, m, args, ref_options)
                except (ValueError, TypeError) as exc:
                    failed(failures, f"Dirichlet {a:g} seed {seed} {m}", exc, m)
                    continue
                land(cell, seed, a, m)
    except Stop as why:
        log(f"stopping between cells: {why}")
    return finish(publish(store, cfg, args, tag, started, failures), started, failures, args.quick)


def reading(what: str, measure) -> dict | None:
    """A reading beside a daemon cell (``bench.bn_oracle``, ``bench.ofasd_start``): what
    ``measure()`` returns, or ``{"error": why}`` when it cannot be had (the cell itself stands)."""
    try:
        return measure()
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        log(f"  {what} not measured: {exc}")
        return {"error": str(exc)[:500]}


def reference_cell(dirs, cfg: GridConfig, seed: int, method: str, args, options: dict) -> dict:
    """One reference cell (``bench.runs.run_references`` with the recipe's model and options)."""
    from bench.runs import run_references

    cell = run_references(dirs, cfg, seed, [method], model=args.model, options=options, device=args.device)[method]
    cell["bytes"] = None  # no transfer: local only sends nothing, centralized pools raw data
    return cell


if __name__ == "__main__":
    main()
