"""The accuracy study's figures from its cached cells: per-Dirichlet and domain-shift blocks
(mean, sample std, per seed), the paired differences the ranking rests on, and the bar plots."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from bench.cells import DOMAIN_METHODS, METHODS, LABELS, Cache, Config, dir_key
from bench.sites import ANGLES


def _stats(values: list[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return mean, std


def seed_summary(cells: dict[str, dict]) -> dict:
    """Seed (text) -> a cell with ``accuracy`` -> {mean, std (sample), n, seeds (ints, sorted),
    per_seed (seed -> accuracy)}: a method's figures over the seeds finished."""
    per_seed = {s: c["accuracy"] for s, c in cells.items()}
    mean, std = _stats(list(per_seed.values()))
    return {"mean": mean, "std": std, "n": len(per_seed), "seeds": sorted(int(s) for s in per_seed),
            "per_seed": per_seed}


def _pct(mean: float, std: float) -> str:
    return f"{100 * mean:.2f} ± {100 * std:.2f}"


def aggregate(cache: Cache, cfg: Config) -> dict:
    figures: dict = {}
    for a, by_seed in sorted(cache.label_skew(cfg).items(), reverse=True):
        block = {}
        for m in METHODS:
            per_seed = {str(s): cells[m]["accuracy"] for s, cells in sorted(by_seed.items()) if m in cells}
            if not per_seed:
                continue
            mean, std = _stats(list(per_seed.values()))
            block[m] = {"mean": mean, "std": std, "per_seed": per_seed, "n_seeds": len(per_seed)}
        if block:
            block["dirichlet"] = a
            figures[dir_key(a)] = block
    dom = cache.domain(cfg)
    if dom:
        block = {}
        for m in DOMAIN_METHODS:
            per_order = {o: cells[m]["accuracy"] for o, cells in sorted(dom.items()) if m in cells}
            if not per_order:
                continue
            mean, std = _stats(list(per_order.values()))
            per_domain: dict = {}
            for o, cells in dom.items():
                if m in cells:
                    for site, acc in cells[m]["per_site"].items():
                        per_domain.setdefault(site, []).append(acc)
            block[m] = {"mean": mean, "std": std, "per_order": per_order,
                        "per_seed": per_order,  # one seed; the runs vary the order (keys: order labels)
                        "n_orders": len(per_order),
                        "mean_per_domain": {k: statistics.fmean(v) for k, v in sorted(per_domain.items())}}
        if block:
            block["angles"] = list(ANGLES)
            block["seed"] = cfg.domain_seed
            figures["domain_shift"] = block
    for key in [k for k in figures if k.startswith("dir")] + (["domain_shift"] if "domain_shift" in figures else []):
        block = figures[key]
        fs = [m for m in ("fedseq_best_val", "fedseq_last_epoch") if m in block]
        if fs:
            best = max(fs, key=lambda m: block[m]["mean"])
            block["fedseq_baseline"] = best
            block["fedseq"] = block[best]
            if "fedelmy" in block:
                block["fedelmy_minus_fedseq"] = block["fedelmy"]["mean"] - block[best]["mean"]
        block["paired"] = paired_differences(block)
    return figures


PAIRS = (("fedelmy", "fedseq_best_val"), ("fedelmy", "fedseq_last_epoch"), ("fedelmy", "pool_only"),
         ("pool_d1", "pool_only"), ("pool_d2", "pool_only"), ("fedelmy", "pool_d2"), ("fedelmy", "pool_d1"))


def paired_differences(block: dict) -> dict:
    """a − b on the same seed (or order), in accuracy units: mean, sample std, per seed. Seeds move
    every method together (the split and the order change), so these are what the ranking rests on."""
    out = {}
    for a, b in PAIRS:
        if a not in block or b not in block:
            continue
        common = [k for k in block[a]["per_seed"] if k in block[b]["per_seed"]]
        if not common:
            continue
        diffs = {k: block[a]["per_seed"][k] - block[b]["per_seed"][k] for k in common}
        mean, std = _stats(list(diffs.values()))
        out[f"{a}_minus_{b}"] = {"mean": mean, "std": std, "per_seed": diffs, "n": len(diffs),
                                 "positive": sum(1 for v in diffs.values() if v > 0)}
    return out


def plot(figures: dict, path_skew: Path, path_domain: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    dirs = [k for k in figures if k.startswith("dir")]
    if dirs:
        fig, ax = plt.subplots(figsize=(10.5, 3.8))
        width = 0.8 / len(dirs)
        for k, key in enumerate(dirs):
            block = figures[key]
            ms = [m for m in METHODS if m in block]
            xs = [METHODS.index(m) + (k - (len(dirs) - 1) / 2) * width for m in ms]
            n = max(block[m]["n_seeds"] for m in ms)
            ax.bar(xs, [100 * block[m]["mean"] for m in ms], width, yerr=[100 * block[m]["std"] for m in ms],
                   capsize=3, label=f"Dirichlet({block['dirichlet']:g}), {n} seed(s)")
            for m, x in zip(ms, xs):
                for v in block[m]["per_seed"].values():
                    ax.plot(x, 100 * v, "k.", ms=3)
        ax.set_xticks(range(len(METHODS)), [LABELS[m] for m in METHODS], rotation=20, fontsize=8)
        ax.set_ylabel("test accuracy (%)")
        lo = min(100 * v for key in dirs for m in METHODS if m in figures[key] for v in figures[key][m]["per_seed"].values())
        ax.set_ylim(max(0, lo - 10), 100)
        ax.set_title("Fashion-MNIST, label skew: mean ± std over seeds (dots: seeds)", fontsize=9)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
        path_skew.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path_skew, dpi=120)
        plt.close(fig)
        made.append(path_skew.name)
    dom = figures.get("domain_shift")
    if dom:
        ms = [m for m in DOMAIN_METHODS if m in dom]
        orders = sorted({o for m in ms for o in dom[m]["per_order"]})
        cols = orders + ["mean"]
        fig, ax = plt.subplots(figsize=(max(6.5, 1.2 * len(cols) + 3.5), 3.6))
        width = 0.8 / len(ms)
        for k, m in enumerate(ms):
            vals = [100 * dom[m]["per_order"].get(o, math.nan) for o in orders] + [100 * dom[m]["mean"]]
            errs = [0] * len(orders) + [100 * dom[m]["std"]]
            ax.bar([i + (k - (len(ms) - 1) / 2) * width for i in range(len(cols))], vals, width, yerr=errs, capsize=3,
                   label=LABELS[m])
        ax.set_xticks(range(len(cols)), cols, fontsize=7, rotation=15)
        ax.set_xlabel("chain order (rotation in degrees, first site first)")
        ax.set_ylabel("test accuracy (%)")
        lo = min(100 * v for m in ms for v in dom[m]["per_order"].values())
        ax.set_ylim(max(0, lo - 10), 100)
        ax.set_title("domain shift: 4 sites = Fashion-MNIST rotated 0/30/60/90°", fontsize=9)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
        fig.savefig(path_domain, dpi=120)
        plt.close(fig)
        made.append(path_domain.name)
    return made


# Reading of the measured figures, written after looking at them (kept here so that RESULTS.md
# stays generated): why a target is missed, where one is. Keyed by the configuration it was
