"""A peer system on the same split (issue 25, item 5): NVIDIA FLARE's cyclic weight transfer, run
by FLARE's own simulator, beside fedrelay's FedSeq chain through the daemons, on the same site
folders, model, initial weights and recipe: accuracy, wall time and bytes, in one run.

Why FLARE and not Flower: FLARE's cyclic workflow (``CyclicController``) is the field's form of
our FedSeq, and ``pip install nvflare`` adds only small pure-Python packages to the project's
environment; Flower's current release pins protobuf below the version fedrelay's generated stubs
use and downgrades grpcio-health-checking (its simulation engine also wants Ray).

Per (Dirichlet, seed), on the split ``coordinator split-dataset fashion-mnist --sites N
--dirichlet A --seed SEED`` writes (``bench.accuracy.make_split``, the grid's data):

- ``fedseq``: ``coordinator start-chain --strategy fedseq --selection last-epoch -S S -E E
  --warmup-epochs EW --init shared --seed SEED`` through the daemons (``deploy/local_trial.py``'s
  ``LocalTrial``; ``bench.parallel.run_cell``: the ledger checked against the plan). Accuracy is
  the run's ``final.accuracy`` (sample-weighted over the sites' test splits), checked against
  the final model evaluated in-process here.
- ``flare_cyclic``: FLARE's PyTorch ``CyclicRecipe``, one round, in the same site order, from the
  same initial weights (those the chain's first site draws from SEED: ``bench.peer_flare.initial_state``;
  a chain ignores ``--init shared``), every site training
  S·E epochs (the first site EW more) with a plain PyTorch loop (``bench/peer_flare_site.py``) on
  the same training images (the site's train split less fedrelay's validation tenth), run by
  ``nvflare``'s simulator (``bench/peer_flare.py``). Its persisted final model is evaluated
  in-process on the union of the sites' test splits (the same function and data as above).

Bytes: fedrelay's ledger (N − 1 hops of M bytes to the final model; N − 1 final copies so every
site evaluates it). FLARE keeps no per-run record: the figure is computed, 2 transfers of M per
visit (server -> site, site -> server), N visits, and checked against the stream sizes FLARE's
own communication statistics recorded at the server (``bench.peer_flare.server_stream_bytes``).

Wall time: fedrelay's is ``start-chain`` to finished with the daemons already running (their
start is recorded apart); FLARE's is the simulator's whole job (it starts its server and clients
itself). Both include each site's data loading.

Every finished cell is cached as JSON under ``--workdir``; a rerun skips it, and the figures
(section ``peer_system`` of results.json and RESULTS.md) are rewritten after every cell.

    python -m bench.peer_system --quick                 # smoke run: synthetic data, 3 sites
    nice -n 15 python -m bench.peer_system --max-train-per-site 2000
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.accuracy_figures import _pct, _stats
from bench.cells import Cache, dir_key
from bench.common import REPO, commits_note, failed, finish, grid_args, grid_flags, log, meta, record, study_start
from bench.few_shot_cell import visit_dir
from bench.measures import cpu_capability
from bench.parallel import ParallelConfig, run_cell
from bench.sites import grid_todo

METHODS = ("fedseq", "flare_cyclic")
LABELS = {"fedseq": "fedrelay FedSeq (daemons, peer to peer)", "flare_cyclic": "NVIDIA FLARE cyclic (its simulator)"}
DEFAULT_WORKDIR = REPO / ".fedrelay" / "bench-peer-system"
SECTION = "peer_system"


def flare_available() -> str | None:
    """None when NVIDIA FLARE can be imported, else why not."""
    try:
        import nvflare  # noqa: F401
        from nvflare.app_opt.pt.recipes.cyclic import CyclicRecipe  # noqa: F401
    except ImportError as exc:
        return f"NVIDIA FLARE is not installed ({exc}); pip install -e '.[peer-systems]'"
    return None


# ------------------------------------------------------------------------------------------ evaluation


def load_sites(dirs: list[Path]):
    """name -> fedrelay's loaded site, and the run's class index (sorted union of the sites')."""
    from fedrelay.tasks.image_folder import ImageFolderTask

    sites = {d.name: ImageFolderTask().load(d) for d in dirs}
    return sites, sorted({c for s in sites.values() for c in s.class_names})


def evaluate_state(state, sites: dict, class_index: list[str]) -> dict:
    """A small-CNN state on every site's test split, as a daemon evaluates a final model:
    ``{"accuracy": correct / total over the union, "correct", "test_samples", "per_site"}``."""
    from fedrelay.models import build_model
    from fedrelay.peer.training import evaluate
    from fedrelay.tasks import resolve
    from fedrelay.tasks.image_folder import spec as image_spec

    c, h, w = next(iter(sites.values())).image_shape
    spec = image_spec("cnn", c, (h, w), len(class_index))
    model = build_model(spec)
    model.load_state_dict(state)
    per_site, correct, total = {}, 0, 0
    for name, site in sites.items():
        images, labels = site.tensors("test", class_index)
        ok, n = evaluate(model, images, labels, device="cpu", task=resolve(spec)) if len(labels) else (0, 0)
        per_site[name] = ok / n if n else 0.0
        correct, total = correct + ok, total + n
    return {"accuracy": correct / total, "correct": correct, "test_samples": total, "per_site": per_site}


def model_bytes(sites: dict, class_index: list[str]) -> int:
    """M: the bytes of the small CNN's state (every tensor, BatchNorm buffers included; the
    tensor data only: fedrelay's payload, a safetensors file, adds its header of a few KB)."""
    from fedrelay.models import state_bytes
    from fedrelay.tasks.image_folder import spec as image_spec

    c, h, w = next(iter(sites.values())).image_shape
    return state_bytes(image_spec("cnn", c, (h, w), len(class_index)))


# ------------------------------------------------------------------------------------------ cells


def fedseq_cell(trial, cfg: ParallelConfig, seed: int, dirs: list[Path], sites: dict, class_index: list[str]) -> dict:
    """fedrelay's FedSeq chain through the daemons, its final model checked in-process."""
    import hashlib

    from fedrelay.tensors import decode_state

    cell = run_cell(trial, "fedseq", cfg, seed, len(dirs))
    order = cell["order"]
    path = visit_dir(trial, order[-1], cell["run_id"], 1) / "outgoing.safetensors"
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != cell["sha256"]:
        raise RuntimeError(f"fedseq: {path} is not the run's final model (SHA-256 differs from the ledger's)")
    mine = evaluate_state(decode_state(data), sites, class_index)
    if abs(mine["accuracy"] - cell["accuracy"]) > 1e-9:
        raise RuntimeError(f"fedseq: the final model evaluated in-process gives {mine['accuracy']!r}, the daemons "
                           f"{cell['accuracy']!r}")
    cell.update(in_process_accuracy=mine["accuracy"], test_samples=mine["test_samples"],
                epochs_per_site=cfg.S * cfg.E, warmup_epochs=cfg.Ew)
    return cell


def flare_cell(work: Path, cfg: ParallelConfig, seed: int, order: list[str], root: Path, sites: dict,
               class_index: list[str], timeout: int) -> dict:
    """FLARE's cyclic job (a child process: ``python -m bench.peer_flare``) in fedseq's order."""
    import torch

    work = work.resolve()  # FLARE's clients run in folders of their own: absolute paths only
    work.mkdir(parents=True, exist_ok=True)
    c, h, w = next(iter(sites.values())).image_shape
    spec = {"sites_root": str(root.resolve()), "order": order, "classes": class_index, "image_shape": [c, h, w],
            "seed": seed, "epochs": cfg.S * cfg.E, "warmup_epochs": cfg.Ew, "workspace": str(work / "flare"),
            "task_assignment_timeout": timeout}
    (work / "flare-spec.json").write_text(json.dumps(spec, indent=1))
    out = work / "flare-result.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    wrong = []
    for attempt in (1, 2):  # FLARE's simulator can start one client twice and another never (see below)
        out.unlink(missing_ok=True)
        with (work / f"flare-{attempt}.log").open("w") as logf:
            res = subprocess.run([sys.executable, "-m", "bench.peer_flare", str(work / "flare-spec.json"), str(out)],
                                 cwd=REPO, env=env, stdout=logf, stderr=subprocess.STDOUT, timeout=6 * 3600)
        text = (work / f"flare-{attempt}.log").read_text()
        if res.returncode != 0 or not out.exists():
            raise RuntimeError(f"the FLARE job failed (rc {res.returncode}): {text[-1500:]}")
        job = json.loads(out.read_text())
        visited = [v["site"] for v in job["visits"]]
        if visited == order:
            break
        errors = [x for x in text.splitlines() if "Error" in x and "Traceback" not in x]
        if errors:
            raise RuntimeError(f"FLARE's sites trained in the order {visited}, planned {order}: a site failed "
                               f"({errors[-1].strip()[:500]})")
        # Seen here: with several simulator threads, two threads picked the same client (its
        # "running" flag is set after the pick's lock is released) and one site never ran.
        wrong.append(visited)
        log(f"  FLARE's sites trained in the order {visited}, planned {order}; running the job again")
    else:
        raise RuntimeError(f"FLARE's sites trained in the orders {wrong}, planned {order}: its simulator started "
                           "one client twice and another never, or a site picked up its task later than "
                           f"task_assignment_timeout = {timeout} s and FLARE's CyclicController skipped it")
    saved = torch.load(job["final_model"], map_location="cpu", weights_only=False)
    ev = evaluate_state(saved.get("model", saved), sites, class_index)
    m = model_bytes(sites, class_index)
    n = len(order)
    stream = job["stream_bytes"]
    return {"method": "flare_cyclic", "accuracy": ev["accuracy"], "per_site": ev["per_site"],
            "test_samples": ev["test_samples"], "order": order, "seconds": job["seconds"],
            "visited": visited, "site_seconds": {v["site"]: v["seconds"] for v in job["visits"]},
            "train_images": {v["site"]: v["train_images"] for v in job["visits"]},
            "epochs": {v["site"]: v["epochs"] for v in job["visits"]},
            "bytes": {"model_bytes": m, "transfers": 2 * n, "to_model_bytes": 2 * n * m,
                      "how": "computed: N visits x 2 transfers (server -> site, site -> server) x M",
                      "flare_stream_stats": stream},
            "commit": meta()["commit"], "cpu_capability": cpu_capability(),
            "nvflare": __import__("nvflare").__version__, "init": job.get("init"), "attempts": len(wrong) + 1,
            "wrong_orders": wrong,
            "how": "NVIDIA FLARE CyclicRecipe (CyclicController, 1 round, fixed order), SimEnv (its simulator), "
                   "plain PyTorch loop per site (bench/peer_flare_site.py)"}


# ------------------------------------------------------------------------------------------ figures


def _cells(cache: Cache, cfg: ParallelConfig) -> dict:
    """dirichlet -> seed -> method -> cell, for this configuration."""
    out: dict = {}
    base = cache.root / cfg.train_tag / cfg.split_tag
    for d in sorted(base.glob("dir*-seed*")) if base.is_dir() else []:
        a, s = d.name[3:].split("-seed")
        for f in d.glob("*.json"):
            out.setdefault(float(a), {}).setdefault(int(s), {})[f.stem] = json.loads(f.read_text())
    return out


def _mb(b: float) -> str:
    return f"{b / 1e6:.2f} MB"


def aggregate(cells: dict) -> dict:
    figures: dict = {}
    for a, by_seed in sorted(cells.items(), reverse=True):
        block: dict = {"dirichlet": a}
        for m in METHODS:
            per = {str(s): ms[m] for s, ms in sorted(by_seed.items()) if m in ms}
            if not per:
                continue
            mean, std = _stats([c["accuracy"] for c in per.values()])
            block[m] = {"mean": mean, "std": std, "n": len(per), "per_seed": {s: c["accuracy"] for s, c in per.items()},
                        "seconds_per_seed": {s: c["seconds"] for s, c in per.items()},
                        "to_model_bytes": {s: c["bytes"]["to_model_bytes"] for s, c in per.items()},
                        "model_bytes": {s: c["bytes"]["model_bytes"] for s, c in per.items()}}
            if m == "fedseq":
                block[m]["final_copies_bytes"] = {s: c["bytes"]["final_total_bytes"] for s, c in per.items()}
                block[m]["trial_start_seconds"] = {s: c.get("trial_start_seconds") for s, c in per.items()}
            else:
                block[m]["site_seconds_sum"] = {s: sum(c["site_seconds"].values()) for s, c in per.items()}
                st = {s: c["bytes"]["flare_stream_stats"] for s, c in per.items()}
                block[m]["stream_model_bytes"] = {s: v["model_sent"] + v["model_received"] for s, v in st.items()}
                block[m]["stream_all_bytes"] = {s: v["all_sent"] + v["all_received"] for s, v in st.items()}
        both = [s for s in by_seed if all(m in by_seed[s] for m in METHODS)]
        if both:
            diffs = {str(s): by_seed[s]["flare_cyclic"]["accuracy"] - by_seed[s]["fedseq"]["accuracy"]
                     for s in sorted(both)}
            mean, std = _stats(list(diffs.values()))
            block["flare_minus_fedseq"] = {"mean": mean, "std": std, "n": len(diffs), "per_seed": diffs}
            block["same_order"] = all(by_seed[s]["flare_cyclic"]["order"] == by_seed[s]["fedseq"]["order"] for s in both)
        figures[dir_key(a)] = block
    return figures


def reading(figures: dict, n_sites: int) -> list[str]:
    """Sentences computed from the figures: the gap and whether it lies within the seeds' spread."""
    out = []
    for key, b in figures.items():
        if not key.startswith("dir") or "flare_minus_fedseq" not in b:
            continue
        d = b["flare_minus_fedseq"]
        fs, fl = b["fedseq"], b["flare_cyclic"]
        line = (f"Dirichlet({b['dirichlet']:g}): FLARE's cyclic workflow reaches {100 * fl['mean']:.2f} % against "
                f"fedrelay's FedSeq {100 * fs['mean']:.2f} % ({d['n']} seed(s) on identical splits, initial weights and "
                f"site order{'' if b['same_order'] else ' [orders differ!]'}): FLARE − fedrelay = "
                f"{100 * d['mean']:+.2f} points")
        if d["n"] > 1:
            below = sum(1 for v in d["per_seed"].values() if v < 0)
            spread = max(fs["std"], fl["std"])
            line += (f" (± {100 * d['std']:.2f} over seeds; FLARE below fedrelay in {below} of {d['n']} seeds); the "
                     f"seeds' spread (sample std over seeds, the larger of "
                     f"the two systems') is {100 * spread:.2f} points, so the gap lies "
                     f"{'within' if abs(d['mean']) <= spread else 'outside'} it.")
        else:
            line += (". One seed: no spread over seeds is measured here; the two runs differ only in the batch order "
                     "(each system draws its own shuffle) and in the training code (fedrelay's loop against a plain "
                     "PyTorch loop).")
        out.append(line)
        ws = statistics.fmean(fs["seconds_per_seed"].values())
        wf = statistics.fmean(fl["seconds_per_seed"].values())
        tf = statistics.fmean(fl["site_seconds_sum"].values())
        starts = [v for v in fs["trial_start_seconds"].values() if v]
        out.append(f"Wall time (mean over seeds): fedrelay's chain {ws:.0f} s from start-chain to finished"
                   + (f" (+ {statistics.fmean(starts):.0f} s to start the coordinator and the {n_sites} peer daemons, "
                      "once per trial)" if starts else "")
                   + f"; FLARE's simulator job {wf:.0f} s end to end (its server and clients start inside it), of "
                   f"which its sites spent {tf:.0f} s receiving-to-sending (training and its data handling). "
                   f"FLARE / fedrelay: {wf / ws:.2f}x. Shared 2-core machine: both figures move with the load.")
        mf = statistics.fmean(fl["to_model_bytes"].values())
        ms = statistics.fmean(fs["to_model_bytes"].values())
        st = statistics.fmean(fl["stream_model_bytes"].values())
        out.append(f"Bytes to the final model: fedrelay {_mb(ms)} (its ledger: N − 1 hops site to site), FLARE "
                   f"{_mb(mf)} (computed: 2 transfers per visit through its server), {mf / ms:.2f}x; FLARE's own "
                   f"stream statistics at its server counted {_mb(st)} of model streams "
                   f"({100 * (st - mf) / mf:+.1f} % against the computed figure: its serialisation and framing), and "
                   f"{_mb(statistics.fmean(fl['stream_all_bytes'].values()))} of streams of every kind (task "
                   "requests, results' metadata, control). "
                   "fedrelay also sends N − 1 final copies so that every site evaluates the final model "
                   f"({_mb(statistics.fmean(fs['final_copies_bytes'].values()))}); FLARE's job keeps the model at its "
                   "server.")
    return out


def publish(cache: Cache, cfg: ParallelConfig, args, started: float, failures: list[str]) -> dict:
    cells = _cells(cache, cfg)
    figures = aggregate(cells)
    tables = []
    for key, b in figures.items():
        rows = []
        for m in [m for m in METHODS if m in b]:
            f = b[m]
            rows.append([LABELS[m], _pct(f["mean"], f["std"]), f["n"],
                         f"{statistics.fmean(f['seconds_per_seed'].values()):.0f}",
                         _mb(statistics.fmean(f["to_model_bytes"].values())),
                         ", ".join(f"{s}: {100 * v:.2f}" for s, v in f["per_seed"].items())])
        tables.append({"title": f"Dirichlet({b['dirichlet']:g}), {cfg.sites} sites: test accuracy % (mean ± sample std "
                                "over seeds), wall seconds, bytes to the final model",
                       "columns": ["system", "accuracy %", "n", "wall s", "bytes to the final model",
                                   "per seed (seed: %)"], "rows": rows})
    data_name = "synthetic Fashion-MNIST-format data (--quick)" if args.quick else "Fashion-MNIST"
    summary = (f"A peer system on the same split: NVIDIA FLARE's cyclic weight transfer (CyclicController, one round, "
               f"run by FLARE's simulator) beside fedrelay's FedSeq chain through the daemons, on {data_name}, "
               f"{cfg.sites} sites, "
               f"{'all training data' if not cfg.max_train else f'at most {cfg.max_train} training images per site'}; "
               f"the same site folders (coordinator split-dataset), site order, initial weights (the chain's "
               f"first site's seeded draw), small CNN and recipe: Adam lr 1e-3, weight decay 1e-4, batch 128, {cfg.S * cfg.E} epoch(s) per "
               f"site{f' (+ {cfg.Ew} warm-up at the first)' if cfg.Ew else ''}, last epoch kept, on the same training "
               "images (each site's train split less fedrelay's validation tenth).")
    notes = [
        "Training code: fedrelay's sites run fedrelay's training loop; FLARE's run a plain PyTorch loop written for "
        "this study (bench/peer_flare_site.py) with the same optimiser, batch size, epochs and pixel scaling, and "
        "their own shuffle, so the two runs differ in batch order as two seeds would.",
        "Accuracy: the final model on the union of the sites' test splits (sample-weighted over sites, as fedrelay's "
        "final.accuracy). fedrelay's figure is the daemons' and equals the in-process evaluation of its final "
        "model (checked per cell); FLARE's persisted model is evaluated in-process with the same function.",
        "M, the model's bytes: fedrelay's ledger counts its payload (the state's tensors in a safetensors file, "
        "header included); FLARE's computed figure counts the state's tensor bytes.",
        "FLARE settings: task_assignment_timeout raised from its default 10 s to "
        f"{args.task_assignment_timeout} s (with 10 s its controller skipped sites that were still starting on this "
        "machine); one simulator client per site (its default threads = clients); exchange format PyTorch. A cell "
        "fails unless FLARE's sites trained in exactly fedrelay's order. Found on the way: with several threads "
        "FLARE's simulator can start one client twice and another never (two threads pick the same client; its "
        "running flag is set after the pick's lock is released), so a site trains twice and one not at all; such "
        "a job is run again once (the cell records its attempts and the wrong orders).",
        f"nvflare {_version()}; fedrelay daemons with mutual TLS on loopback.",
    ]
    notes += reading(figures, cfg.sites)
    missing = [f"Dir({a:g})/{m}/seed {s}" for a in args.dirichlets for s in args.seeds for m in args.methods
               if str(s) not in figures.get(dir_key(a), {}).get(m, {}).get("per_seed", {})]
    if missing:
        notes.append(f"{len(missing)} cell(s) missing: {', '.join(missing)}. To finish (the cache resumes): "
                     f"`{args.resume_command}`.")
    notes += commits_note(c for by_seed in cells.values() for ms in by_seed.values() for c in ms.values())
    if failures:
        notes.append(f"Failures this run ({len(failures)}): " + " | ".join(failures))
    notes += args.notes
    config = {"sites": cfg.sites, "max_train_per_site": cfg.max_train, "epochs_per_site": cfg.S * cfg.E,
              "S": cfg.S, "E": cfg.E, "Ew": cfg.Ew, "lr": 1e-3, "batch_size": 128, "weight_decay": 1e-4,
              "model": "cnn", "init": "the chain's first site's seeded draw (bench.peer_flare.initial_state)", "selection": "last-epoch", "seeds": args.seeds,
              "dirichlets": args.dirichlets, "methods": args.methods,
              "task_assignment_timeout": args.task_assignment_timeout}
    data = {**figures, "summary": summary, "tables": tables, "notes": notes, "config": config, "quick": args.quick,
            "failures": failures, "wall_seconds_this_run": time.monotonic() - started,
            "resume_command": args.resume_command}
    record(SECTION, data, results=args.results)
    return data


def _version() -> str:
    try:
        import nvflare

        return nvflare.__version__
    except ImportError:
        return "not installed"


# ------------------------------------------------------------------------------------------ main


def parse(argv):
    import argparse

    ap = argparse.ArgumentParser(description="NVIDIA FLARE's cyclic workflow beside fedrelay's FedSeq, same split")
    grid_flags(ap, "synthetic data, 3 sites, 1 seed, Dirichlet 0.5, 1 epoch per site (smoke run)", seeds="0",
               dirichlets="0.5", methods=METHODS, default_methods=METHODS, E=1, warmup_epochs=0,
               workdir=DEFAULT_WORKDIR)
    ap.set_defaults(S=1)
    ap.add_argument("--task-assignment-timeout", type=int, default=3600,
                    help="FLARE's CyclicController: seconds a site may take to pick up its task (FLARE default 10)")
    args = grid_args(ap, argv, "bench.peer_system", METHODS, S=1, E=1, warmup_epochs=0)
    args.maecho_tau = args.maecho_eta = args.ofasd_epochs = args.ofasd_lr = 0  # ParallelConfig's star options: unused
    return args


def main(argv=None) -> dict:
    args, work, started = study_start(argv, parse, "fedrelay-bench-peer-", DEFAULT_WORKDIR)
    cfg = ParallelConfig(args)
    cache = Cache(work / "cells")
    failures: list[str] = []
    why = flare_available()
    if why and "flare_cyclic" in args.methods and not args.publish_only:
        raise SystemExit(why)
    log(f"workdir {work}; config {cfg.train_tag} {cfg.split_tag}")
    from deploy import local_trial as lt

    for seed, a, group, todo, dirs in grid_todo(args, cfg, cache, work, lambda seed, a: (
            cfg.train_tag, cfg.split_tag, f"dir{a:g}-seed{seed}")):
        sites, class_index = load_sites(dirs)
        if "fedseq" in todo:
            log(f"Dirichlet {a:g} seed {seed}: fedrelay FedSeq through {len(dirs)} peer daemons")
            try:
                t0 = time.monotonic()
                with lt.LocalTrial(work / "trial", dirs) as trial:
                    trial_start = time.monotonic() - t0
                    cell = fedseq_cell(trial, cfg, seed, dirs, sites, class_index)
                cell.update(dirichlet=a, seed=seed, trial_start_seconds=trial_start)
                cache.put(cell, *group, "fedseq")
                log(f"  fedseq: {100 * cell['accuracy']:.2f}%, {cell['bytes']['to_model_bytes']:,} bytes to the "
                    f"model, {cell['seconds']:.0f} s")
                publish(cache, cfg, args, started, failures)
            except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError) as exc:
                failed(failures, f"Dirichlet {a:g} seed {seed} fedseq", exc, "fedseq")
        if "flare_cyclic" in todo:
            ours = cache.get(*group, "fedseq")
            if ours is None:
                failed(failures, f"Dirichlet {a:g} seed {seed} flare_cyclic",
                       RuntimeError("needs the fedseq cell's site order, and that cell is missing"), "flare_cyclic")
                continue
            log(f"Dirichlet {a:g} seed {seed}: NVIDIA FLARE cyclic in the order {ours['order']}")
            try:
                cell = flare_cell(work / "flare" / f"dir{a:g}-seed{seed}", cfg, seed, ours["order"],
                                  dirs[0].parent, sites, class_index, args.task_assignment_timeout)
            except (RuntimeError, subprocess.TimeoutExpired, json.JSONDecodeError, OSError) as exc:
                failed(failures, f"Dirichlet {a:g} seed {seed} flare_cyclic", exc, "flare_cyclic")
                continue
            cell.update(dirichlet=a, seed=seed)
            cache.put(cell, *group, "flare_cyclic")
            log(f"  flare_cyclic: {100 * cell['accuracy']:.2f}%, {cell['bytes']['to_model_bytes']:,} bytes to the "
                f"model (computed), {cell['seconds']:.0f} s")
            publish(cache, cfg, args, started, failures)
    return finish(publish(cache, cfg, args, started, failures), started, failures, args.quick)


if __name__ == "__main__":
    main()
