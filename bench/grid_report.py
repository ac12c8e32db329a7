"""The full-data grid's figures and reading, generated from its cells only (``bench.grid_cells``),
never typed: per recipe and Dirichlet a table (mean ± sample std, n, bytes, per-seed values);
FedELMY against the strongest FedSeq paired by seed; the extension against both, with and without
d1/d2; OFASD against FedAvg in every cell; the MA-Echo ablation; issue #25's targets, each met or
not met with its figure; the cells still missing; and an accuracy-against-bytes plot per recipe.
With ``--paired-with STUDY`` also each method against FedELMY, FedSeq and itself in another study
at the same settings (a study that changes one method's flags).
Published as ``accuracy.grid`` in results.json and its section of RESULTS.md; a study at other
settings than the issue's grid (:data:`MAIN_GRID`) as ``accuracy.grid_<study>`` beside it.
"""

from __future__ import annotations

import time
from pathlib import Path

from bench.accuracy_figures import _pct, _stats, seed_summary
from bench.bytes_plot import accuracy_against_bytes
from bench.cells import dir_key
from bench.common import record
from bench.grid_cells import CellStore, each, every_cell, plan
from bench.grid_methods import CHAINS, FEDSEQS, LABELS, METHODS, REFS, STARS, GridConfig

SECTION, SUB = "accuracy", "grid"
# The grid (sites, training images per site, S, E, Ew): published as accuracy.grid; a study
# at other settings (e.g. -S 1) publishes beside it, as accuracy.grid_<study>, with plots of its own.
MAIN_GRID = (10, None, 5, 5, 5)
# issue #25's targets: the best method's mean accuracy per Dirichlet, and FedELMY over FedSeq (points).
TARGETS = {0.5: 0.895, 0.1: 0.75}
FEDELMY_OVER_FEDSEQ = 0.03
MARKERS = {"fedelmy": "o", "fedelmy-kd": "*", "fedelmy-kd-nod": "X", "fedseq-kd": "p", "fedseq_last_epoch": "s", "fedseq_best_val": "d",
           "fedavg": "^", "fedavg_uniform": "<", "fedavg-classaware": ">", "fedelmy-pfl": "D", "maecho": "v", "ofasd": "P"}


def blocks(by_dirichlet: dict) -> dict:
    """Dirichlet -> seed -> method -> cell (one recipe) -> results key ``dir0_5`` -> method ->
    {mean, std, n, seeds, per_seed, sha256_per_seed, to_model_bytes, final_copies_bytes,
    ledger_equals_plan, seconds_mean}; ``dirichlet`` too. Accuracies are fractions."""
    out: dict = {}
    for a, by_seed in sorted(by_dirichlet.items(), reverse=True):
        block: dict = {"dirichlet": a}
        for m in METHODS:
            cells = {str(s): ms[m] for s, ms in sorted(by_seed.items()) if m in ms}
            if not cells:
                continue
            b = [c.get("bytes") for c in cells.values()]
            mb = {**seed_summary(cells), "sha256_per_seed": {s: c.get("sha256") for s, c in cells.items()},
                  "seconds_mean": sum(c.get("seconds", 0.0) for c in cells.values()) / len(cells)}
            if m not in REFS and all(b):
                mb["to_model_bytes"] = sorted({x["to_model_bytes"] for x in b})
                mb["final_copies_bytes"] = sorted({x["final_total_bytes"] for x in b})
                mb["ledger_equals_plan"] = all(x.get("ledger_equals_plan") for x in b)
            block[m] = mb
        out[dir_key(a)] = block
    return out


def paired(block: dict, a: str, b: str, other: dict | None = None) -> dict | None:
    """``a − b`` on the seeds both have: {mean, std, n, wins (seeds where a > b), per_seed}; None
    without a common seed. ``b`` is read from ``other`` (another study's block of the same recipe
    and Dirichlet) when given, else from ``block``."""
    other = block if other is None else other
    if a not in block or b not in other:
        return None
    common = [s for s in block[a]["per_seed"] if s in other[b]["per_seed"]]
    if not common:
        return None
    diffs = {s: block[a]["per_seed"][s] - other[b]["per_seed"][s] for s in common}
    mean, std = _stats(list(diffs.values()))
    return {"a": a, "b": b, "mean": mean, "std": std, "n": len(diffs), "wins": sum(v > 0 for v in diffs.values()),
            "per_seed": diffs}


def strongest_fedseq(block: dict) -> str | None:
    found = [m for m in FEDSEQS if m in block]
    return max(found, key=lambda m: block[m]["mean"]) if found else None


def _pts(d: dict) -> str:
    spread = f" ± {100 * d['std']:.2f}" if d["n"] > 1 else ""  # no spread from one seed
    return (f"{100 * d['mean']:+.2f}{spread} points, ahead in {d['wins']} of {d['n']} seed(s) "
            f"(per seed: {', '.join(f'{s}: {100 * v:+.2f}' for s, v in d['per_seed'].items())})")


def _acc(b: dict) -> str:
    """A method's accuracy %: mean ± sample std over its seeds, the mean alone from one seed."""
    return _pct(b["mean"], b["std"]) if b["n"] > 1 else f"{100 * b['mean']:.2f}"


def reading(block: dict) -> list[str]:
    """The sentences of one (recipe, Dirichlet) block, each a figure from the cells."""
    a = block["dirichlet"]
    where = f"Dirichlet({a:g})"
    out = []
    fl = [m for m in CHAINS + STARS if m in block]
    if fl:
        best = max(fl, key=lambda m: block[m]["mean"])
        line = f"{where}: best method {LABELS[best]} at {_acc(block[best])} % " \
               f"(n = {block[best]['n']})"
        if a in TARGETS:
            met = block[best]["mean"] >= TARGETS[a]
            line += (f"; target ≥ {100 * TARGETS[a]:.1f} % {'MET' if met else 'NOT met'}"
                     + ("" if met else f" (short by {100 * (TARGETS[a] - block[best]['mean']):.2f} points)"))
        if len({tuple(sorted(block[m].get("per_seed", {}))) for m in fl}) > 1:
            line += (" (the methods' means are over different seeds, so this ranking is provisional: the "
                     "paired lines below compare methods on their common seeds)")
        out.append(line + ".")
    fs = strongest_fedseq(block)
    d = paired(block, "fedelmy", fs) if fs else None
    if d:
        met = d["mean"] >= FEDELMY_OVER_FEDSEQ
        out.append(f"{where}: FedELMY − the strongest FedSeq ({LABELS[fs]}), paired by seed: {_pts(d)}; target "
                   f"≥ +{100 * FEDELMY_OVER_FEDSEQ:.0f} points {'MET' if met else 'NOT met'}.")
    for ext in ("fedelmy-kd", "fedelmy-kd-nod", "fedseq-kd"):
        for other in ("fedelmy", fs, {"fedelmy-kd": "fedelmy-kd-nod", "fedseq-kd": "fedelmy-kd-nod"}.get(ext)):
            d = paired(block, ext, other) if other else None
            if d:
                out.append(f"{where}: {LABELS[ext]} − {LABELS[other]}: {_pts(d)}.")
    if "ofasd" in block and "fedavg" in block:
        common = [s for s in block["ofasd"]["per_seed"] if s in block["fedavg"]["per_seed"]]
        acc = [s for s in common if block["ofasd"]["per_seed"][s] != block["fedavg"]["per_seed"][s]]
        sha = [s for s in common if block["ofasd"]["sha256_per_seed"][s] != block["fedavg"]["sha256_per_seed"][s]]
        same = sorted(set(common) - set(acc), key=int)
        every = bool(common) and len(acc) == len(common)
        out.append(f"{where}: OFASD's accuracy differs from FedAvg's in {len(acc)} of {len(common)} cell(s)"
                   + (f" (equal at seed(s) {', '.join(same)})" if same else "")
                   + f"; its final model differs in {len(sha)} of {len(common)}; target 'differs in every cell' "
                   + ("MET." if every else "NOT met."))
    for x, y in (("maecho", "fedavg"), ("fedavg-classaware", "fedavg"), ("maecho", "fedavg-classaware"),
                 ("fedavg-classaware", "fedavg_uniform"), ("maecho", "fedavg_uniform")):
        d = paired(block, x, y)
        if d:
            out.append(f"{where}, MA-Echo ablation: {LABELS[x]} − {LABELS[y]}: {_pts(d)}.")
    if "local_only" in block and "centralized" in block and fl:
        below = [LABELS[m] for m in fl if block[m]["mean"] < block["local_only"]["mean"]]
        out.append(f"{where}: references local only {_acc(block['local_only'])} %, "
                   f"centralized {_acc(block['centralized'])} %; "
                   + (f"below local only: {', '.join(below)}." if below else "every method is above local only."))
    return out


# What two studies must share for their cells to be paired seed by seed (the cells' config).
PAIRED_KEYS = ("sites", "max_train_per_site", "S", "E", "Ew", "alpha", "beta", "init")


def paired_study(block: dict, other: dict, study: str) -> list[str]:
    """The sentences pairing one (recipe, Dirichlet) block of this study with the same block of
    another study (``--paired-with``): each of this study's FL methods against the other's
    FedELMY, its strongest FedSeq and the same method (the other study ran it with other flags)."""
    where = f"Dirichlet({block['dirichlet']:g})"
    out = []
    fs = strongest_fedseq(other)
    for m in (m for m in CHAINS + STARS if m in block):
        for b in dict.fromkeys(x for x in ("fedelmy", fs, m) if x):
            d = paired(block, m, b, other)
            if d:
                out.append(f"{where}: {LABELS[m]} (this study) − {LABELS[b]} (study {study}), paired by seed: "
                           f"{_pts(d)}.")
    return out


def check_paired(other: dict, study: str, cfg: GridConfig, this: str) -> None:
    """Refuse (``SystemExit``, naming the setting) to pair with a study that has no cell or whose
    cells ran at other settings than this study's (:data:`PAIRED_KEYS`), or with this study itself."""
    if study == this:
        raise SystemExit(f"--paired-with {study}: that is this study")
    others = list(every_cell(other))
    if not others:
        raise SystemExit(f"--paired-with {study}: that study has no cell in this cells folder")
    mine = {k: cfg.config()[k] for k in PAIRED_KEYS}
    for c in others:
        theirs = {k: (c.get("config") or {}).get(k) for k in PAIRED_KEYS}
        differ = [f"{k} {theirs[k]} (this study: {mine[k]})" for k in PAIRED_KEYS if theirs[k] != mine[k]]
        if differ:
            raise SystemExit(f"--paired-with {study}: its cells ran at other settings: {', '.join(differ)}; "
                             "cells are paired only at the same sites, data, S, E, Ew, alpha, beta and init")


def recipe_notes(tag: str, by_dirichlet: dict) -> list[str]:
    """What the recipe's cells ran with: the ``start-chain`` flags every method got (and the
    recipe's flags this build lacked), from the cells; says so when the cells disagree."""
    seen = {}
    extra: dict[str, set[str]] = {}  # method -> its own extra flags (--method-args), as the cells ran them
    for _, _, m, c in each(by_dirichlet):
        r = c.get("recipe") or {}
        key = (tuple(sorted((r.get("flags") or {}).items())), tuple(r.get("notes") or ()))
        seen[key] = seen.get(key, 0) + 1
        flags = ((c.get("config") or {}).get("method_args") or {}).get(m)
        if flags:
            extra.setdefault(m, set()).add(" ".join(flags))
    out = []
    for (flags, build), n in seen.items():
        out.append(f"Recipe {tag}: every method's `start-chain` got {' '.join(f'{k} {v}' for k, v in flags) or 'no flags'}"
                   + (f" ({'; '.join(build)})" if build else "") + (f" [{n} cell(s)]" if len(seen) > 1 else "") + ".")
    if len(seen) > 1:
        out.append(f"Recipe {tag}: its cells ran with {len(seen)} different sets of flags (builds differed).")
    for m, flags in sorted(extra.items()):
        out.append(f"Recipe {tag}: {LABELS.get(m, m)} ran with its own extra `start-chain` flags "
                   f"{' | '.join(f'`{f}`' for f in sorted(flags))} (--method-args).")
    return out + option_notes(tag, by_dirichlet) + bn_oracle_notes(tag, by_dirichlet)


def bn_oracle_notes(tag: str, by_dirichlet: dict) -> list[str]:
    """Per Dirichlet, what the BatchNorm oracle (``bench.bn_oracle``: the final model's BatchNorm
    statistics recomputed over every site's training data) changes in the final accuracy, over
    the cells that recorded it: mean ± sample std in points, the range, and per method."""
    out = []
    for a, by_seed in sorted(by_dirichlet.items(), reverse=True):
        diffs: dict[str, list[float]] = {}
        for ms in by_seed.values():
            for m, c in ms.items():
                o = c.get("bn_oracle") or {}
                if "oracle_accuracy" in o:
                    diffs.setdefault(m, []).append(o["oracle_accuracy"] - o["accuracy"])
        every = [d for ds in diffs.values() for d in ds]
        if not every:
            continue
        mean, std = _stats(every)
        spread = f" ± {100 * std:.2f}" if len(every) > 1 else ""
        per = "; ".join(f"{LABELS.get(m, m)} {100 * _stats(ds)[0]:+.2f} (n = {len(ds)})" for m, ds in sorted(diffs.items()))
        out.append(f"Recipe {tag}: Dirichlet({a:g}): BatchNorm statistics recomputed over every site's training data "
                   "(an oracle: no site holds that data; the most that carrying BatchNorm statistics along a chain, or "
                   "pooling them better in a star, could give the final weights; bench/bn_oracle.py) change the "
                   f"final accuracy by {100 * mean:+.2f}{spread} points over {len(every)} cell(s) ("
                   + (f"from {100 * min(every):+.2f} to {100 * max(every):+.2f}; " if len(every) > 1 else "")
                   + f"per method: {per}).")
    return out


def option_notes(tag: str, by_dirichlet: dict) -> list[str]:
    """From the run parameters each cell recorded (``params``): a method whose cells ran with
    different values of a parameter (named, with the cells at each value), which its table's mean
    would mix; and a method option (``fedrelay.registry``) that the cells' ``start-chain`` did not
    get but at which every cell of a method ran with a value other than today's default (the
    default changed since), so that a reader does not take today's default for what they ran."""
    from bench.grid_recommend import implicit_options

    by_method: dict[str, dict[str, dict]] = {}
    for a, seed, m, c in sorted(each(by_dirichlet), key=lambda t: (-t[0], t[1])):
        if c.get("params"):
            by_method.setdefault(m, {})[f"Dir({a:g}) seed {seed}"] = c
    out = []
    for m, cells in sorted(by_method.items()):
        implicit = [{o.name: (o, v) for o, v in implicit_options(c)} for c in cells.values()]
        keys = sorted({k for c in cells.values() for k in c["params"]})
        for k in keys:
            values: dict[str, list[str]] = {}
            for where, c in cells.items():
                values.setdefault(repr(c["params"].get(k)), []).append(where)
            if len(values) > 1:
                out.append(f"Recipe {tag}: {LABELS.get(m, m)}'s cells differ in {k}: "
                           + "; ".join(f"{v} at {', '.join(w)}" for v, w in values.items())
                           + " (its figures mix them).")
            elif all(k in i for i in implicit):
                o, v = implicit[0][k]
                out.append(f"Recipe {tag}: {LABELS.get(m, m)} ran with {o.flag} {v} (today's default: {o.default}).")
    return out


def _mb(values) -> str:
    return " / ".join(f"{v / 1e6:.3f}" for v in values) if values else "—"


def table(tag: str, about: str, block: dict, cfg: GridConfig) -> dict:
    rows = []
    for m in [m for m in METHODS if m in block]:
        b = block[m]
        bytes_ = (_mb(b["to_model_bytes"]) if "to_model_bytes" in b else "0 (no transfer)" if m == "local_only"
                  else "n/a (pools raw data)" if m == "centralized" else "—")
        rows.append([LABELS[m], _acc(b), b["n"], bytes_,
                     {True: "yes", False: "NO"}.get(b.get("ledger_equals_plan"), "—"),
                     ", ".join(f"{s}: {100 * v:.2f}" for s, v in b["per_seed"].items())])
    return {"title": f"Recipe {tag} ({about}); Dirichlet({block['dirichlet']:g}), {cfg.sites} sites, "
                     f"S = {cfg.S}, E = {cfg.E}, Ew = {cfg.Ew}: test accuracy % (mean ± sample std over seeds; "
                     "the value alone from one seed)",
            "columns": ["method", "accuracy %", "n", "MB to the final model", "ledger = plan", "per seed (seed: %)"],
            "rows": rows}


def missing(cells: dict, tags: list[str], args) -> list[str]:
    """Per recipe with cells missing: ``'recipe: D of N planned cells done; missing: m1 at
    Dir(a) seeds s,t and Dir(b) seed u; m2 in every cell; ...'`` (methods in the plan's order)."""
    out, planned = [], plan(args.seeds_of, args.methods)
    for tag in tags:
        gaps: dict[str, dict[float, list[int]]] = {}
        for s, a, m in planned:
            if m not in cells.get(tag, {}).get(a, {}).get(s, {}):
                gaps.setdefault(m, {}).setdefault(a, []).append(s)
        if not gaps:
            continue
        parts = []
        for m, by_a in sorted(gaps.items(), key=lambda kv: args.methods.index(kv[0])):
            if sum(map(len, by_a.values())) == sum(1 for _, _, x in planned if x == m):
                parts.append(f"{m} in every cell")
            else:
                parts.append(f"{m} at " + " and ".join(f"Dir({a:g}) seed{'s' if len(ss) > 1 else ''} "
                                                        f"{','.join(map(str, ss))}" for a, ss in by_a.items()))
        done = len(planned) - sum(len(ss) for by_a in gaps.values() for ss in by_a.values())
        out.append(f"{tag}: {done} of {len(planned)} planned cells done; missing: " + "; ".join(parts))
    return out


def plot(tag: str, figures: dict, path: Path) -> list[str]:
    """Accuracy against the MB moved to make the final model (log axis), one marker per method,
    one colour per Dirichlet; the references as lines (:mod:`bench.bytes_plot`). Returns the file
    names written."""
    dirs = [k for k in figures if any(m in figures[k] and "to_model_bytes" in figures[k][m] for m in MARKERS)]
    present = [m for m in MARKERS if any(m in figures[k] and "to_model_bytes" in figures[k][m] for k in dirs)]
    points = []
    for key in dirs:
        b = figures[key]
        for i, m in enumerate(present):
            if m in b and "to_model_bytes" in b[m]:
                # methods moving the same bytes are spread sideways by 2 % per method (log axis)
                x = max(b[m]["to_model_bytes"]) / 1e6 * 1.02 ** (i - (len(present) - 1) / 2)
                points.append((key, m, x, b[m]["mean"], b[m]["std"], list(b[m]["per_seed"].values())))
    refs = {k: {m: figures[k][m]["mean"] for m in ("local_only", "centralized") if m in figures[k]} for k in dirs}
    return accuracy_against_bytes(
        path, points, {k: figures[k]["dirichlet"] for k in dirs}, refs, LABELS, MARKERS, present,
        spread="2 % each", figsize=(8.6, 4.6),
        title=f"Full-data grid, recipe {tag}: accuracy against bytes (mean ± std over seeds; dots: seeds)")


def publish(store: CellStore, cfg: GridConfig, args, current: str, started: float, failures: list[str]) -> dict:
    """Rebuild ``accuracy.grid`` (results.json, RESULTS.md) and the plots from every cell of the
    study; ``current``: the recipe tag of this run (its missing cells are listed even before it
    has one). Returns the section's data."""
    cells = store.all()
    sub, prefix = destination(store, cfg, args.quick)
    pair_cells = {pair: CellStore(store.root, pair).all() for pair in getattr(args, "paired_with", None) or []}
    for pair, theirs in pair_cells.items():
        check_paired(theirs, pair, cfg, store.study)
    tags = sorted(set(cells) | {current})
    data: dict = {"study": store.study, "recipes": {}, "paired_with": list(pair_cells)}
    tables, notes, plots = [], [], []
    for tag in tags:
        figures = blocks(cells.get(tag, {}))
        their_figures = {pair: blocks(theirs.get(tag, {})) for pair, theirs in pair_cells.items()}  # once per recipe
        first = next((c for *_, c in each(cells.get(tag, {}))), None)
        recipe = (first or {}).get("recipe") or {"tag": tag, "about": "no cell yet"}
        about = f"{recipe.get('about')}, model {recipe.get('model', '?')}"
        data["recipes"][tag] = {**figures, "recipe": recipe}
        notes += recipe_notes(tag, cells.get(tag, {}))
        for key in [k for k in figures if k.startswith("dir")]:
            tables.append(table(tag, about, figures[key], cfg))
            notes += [f"Recipe {tag}: {line}" for line in reading(figures[key])]
            for pair, by_key in their_figures.items():
                if by_key.get(key):
                    notes += [f"Recipe {tag}: {line}" for line in paired_study(figures[key], by_key[key], pair)]
        plots += plot(tag, figures, Path(args.plots) / f"{prefix}{tag}.png")
    gaps = missing(cells, tags, args)
    seeds = "; ".join(f"Dir({a:g}) seeds {','.join(map(str, s))}" for a, s in args.seeds_of.items())
    notes += [f"Cells missing from the planned grid ({seeds}; {len(args.methods)} methods), recipe {gap}."
              for gap in gaps] or [f"Cells missing from the planned grid ({seeds}; {len(args.methods)} methods): none."]
    if gaps and not args.quick:
        notes.append(f"To compute them (finished cells are skipped): `{args.resume_command}`.")
    commits = sorted({c.get("commit", "?") for c in every_cell(cells)})
    machines: dict[str, int] = {}
    for c in every_cell(cells):
        m = c.get("machine", {})
        where = f"{m.get('cpu', '?')}, device {m.get('device', '?')}" + (f" ({m['gpu']})" if m.get("gpu") else "")
        machines[where] = machines.get(where, 0) + 1
    if commits:
        notes.append(f"Cells computed at commit(s) {', '.join(commits)} on "
                     + "; ".join(f"{k}: {v} cell(s)" for k, v in sorted(machines.items())) + ".")
        if len(machines) > 1:
            notes.append("The cells come from more than one machine, whose float kernels train other weights from "
                         "the same seed: a paired difference between cells of two machines mixes the machine with "
                         "the method (each cell file names its machine).")
    if failures:
        notes.append(f"Failures this run ({len(failures)}): " + " | ".join(failures))
    notes += args.notes
    data_name = "synthetic Fashion-MNIST-format data (--quick)" if args.quick else "Fashion-MNIST"
    summary = (f"{'The full-data grid' if sub == SUB else 'A study beside the full-data grid'} (issue #25): {data_name}, {cfg.sites} sites, "
               f"{'all training data' if not cfg.max_train else f'at most {cfg.max_train} training images per site'}"
               f", S = {cfg.S}, E = {cfg.E}, Ew = {cfg.Ew} (every site trains Ew + S·E epochs), FedELMY α = "
               f"{cfg.alpha:g}, β = {cfg.beta:g}, `--init shared`. Every FL method runs through the daemons "
               "(`coordinator start-chain --seed SEED`, mutual TLS on loopback), its ledger checked against its plan; "
               "local only and centralized run in-process. Each table names its recipe, whose flags every method of "
               f"the table shares. Generated from the cells in `{_shown(store.base)}` (one JSON file per cell).")
    data.update(summary=summary, tables=tables, notes=notes, plots=plots, quick=args.quick, failures=failures,
                config=cfg.config(), wall_seconds_this_run=time.monotonic() - started,
                resume_command=args.resume_command, missing=gaps)
    record(SECTION, data, results=args.results, sub=sub)
    if not args.quick:  # the recommendation reads every study's cells: refreshed with any of them
        from bench import grid_recommend

        grid_recommend.publish(store.root, args.results)
    return data


def destination(store: CellStore, cfg: GridConfig, quick: bool) -> tuple[str, str]:
    """(the subsection of ``accuracy`` a study publishes to, its plots' file-name prefix):
    ``("grid", "grid-")`` for the issue's grid (:data:`MAIN_GRID`) and for ``--quick``, else
    ``("grid_<study>", "grid-<study>-")``, so that a study at other settings never overwrites the
    grid's section or plots."""
    if quick or (cfg.sites, cfg.max_train, cfg.S, cfg.E, cfg.Ew) == MAIN_GRID:
        return SUB, "grid-"
    return f"{SUB}_{store.study}", f"grid-{store.study}-"


def _shown(p: Path) -> str:
    from bench.common import REPO

    try:
        return str(Path(p).resolve().relative_to(REPO))
    except ValueError:
        return str(p)
