"""Which method to run, per label skew: the recommendation RESULTS.md gives a user choosing a
one-shot method (issue #25: "read bench/RESULTS.md and the accuracy-against-bytes plot, then run
the recommended strategy on the demo's sites"), computed from the full-data grid's cells of every
study (``bench/cells/<study>/...``, ``bench.grid_cells``), never typed.

A candidate is one method of one study and recipe (its cells share the same ``start-chain``
arguments) with at least :data:`MIN_SEEDS` seeds at a Dirichlet, at the grid's sites and data
(:data:`SITES`, all training data): a method seen on one or two seeds is not recommended, however
high. Per Dirichlet the candidates are ranked by their mean accuracy; the first is recommended,
with the paired difference to the runner-up on their common seeds, its bytes, and the
``make demo CHAIN_ARGS=...`` line that runs it on the demo's sites (the cells' own ``args``).
A last line names the method with the best mean of both Dirichlets' means, for a user who does
not know how skewed the sites are. Published as ``accuracy.recommendation``:

    python -m bench.grid_recommend          # after the studies' --publish-only (bench.grid does it too)
"""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from bench.accuracy_figures import _stats, seed_summary
from bench.cells import dir_key
from bench.common import RESULTS_JSON, record
from bench.grid_cells import CellStore
from bench.grid_methods import LABELS, REFS

SECTION, SUB = "accuracy", "recommendation"
MIN_SEEDS = 3
SITES = 10
TOP = 5  # rows per Dirichlet's table


def candidates(root: Path) -> dict:
    """Dirichlet -> list of candidates, best mean first; each {study, recipe, method, args (the
    ``start-chain`` arguments its cells share), mean, std, n, seeds, per_seed, to_model_bytes,
    machines}. Accuracies are fractions, bytes bytes.
    A method whose cells differ between seeds in their arguments or run parameters forms no
    candidate."""
    out: dict = {}
    for study in sorted(p.name for p in Path(root).iterdir() if p.is_dir()) if Path(root).is_dir() else []:
        for tag, by_dirichlet in CellStore(root, study).all().items():
            for a, by_seed in by_dirichlet.items():
                by_method: dict = {}
                for s, ms in by_seed.items():
                    for m, c in ms.items():
                        cfg = c.get("config") or {}
                        if m in REFS or cfg.get("sites") != SITES or cfg.get("max_train_per_site") is not None:
                            continue
                        by_method.setdefault(m, {})[str(s)] = c
                for m, cells in by_method.items():
                    args = {tuple(run_args(c)) for c in cells.values()}
                    params = {repr(sorted((c.get("params") or {}).items())) for c in cells.values()}
                    if len(cells) < MIN_SEEDS or len(args) != 1 or not next(iter(args)) or len(params) != 1:
                        continue
                    b = sorted({(c.get("bytes") or {}).get("to_model_bytes") for c in cells.values()} - {None})
                    machines = sorted({f"{(c.get('machine') or {}).get('cpu', '?')}, device "
                                       f"{(c.get('machine') or {}).get('device', '?')}" for c in cells.values()})
                    out.setdefault(a, []).append({"study": study, "recipe": tag, "method": m,
                                                  "args": list(next(iter(args))), "to_model_bytes": b,
                                                  "machines": machines, **seed_summary(cells)})
    for a in out:
        out[a].sort(key=lambda c: -c["mean"])
    return out


def run_args(cell: dict) -> list[str]:
    """The ``start-chain`` arguments that run ``cell`` again today: its own ``args``, plus each
    method option (``fedrelay.registry``) it ran at a value other than today's default without
    naming it (a default changed since; read from the ``params`` the cell recorded)."""
    args = list(cell.get("args") or ())
    for o, value in implicit_options(cell):
        args += [o.flag, str(value)]
    return args


def implicit_options(cell: dict) -> list[tuple]:
    """``(option, value)`` for each method option (``fedrelay.registry``) that ``cell`` ran at
    (its recorded ``params``) without naming its flag in its ``args``, at a value other than
    today's default: a default that changed since the cell ran."""
    from fedrelay import registry

    args = cell.get("args") or ()
    params = cell.get("params") or {}
    return [(o, params[o.name]) for o in registry.all_options()
            if o.name in params and o.flag not in args and params[o.name] != o.default]


def _name(c: dict) -> str:
    return f"{LABELS.get(c['method'], c['method'])} [{c['study']}, {c['recipe']}]"


def _paired(x: dict, y: dict) -> dict | None:
    common = [s for s in x["per_seed"] if s in y["per_seed"]]
    if not common:
        return None
    diffs = [x["per_seed"][s] - y["per_seed"][s] for s in common]
    mean, std = _stats(diffs)
    return {"mean": mean, "std": std, "n": len(diffs), "wins": sum(d > 0 for d in diffs)}


def demo_line(c: dict, dirichlet: float) -> str:
    """The command that runs candidate ``c`` on the demo's sites (``make demo``, README) at
    ``dirichlet`` and the candidate's first seed: the demo splits with the same
    ``split-dataset fashion-mnist --sites 10 --dirichlet A --seed S`` call as the grid and starts
    the chain with ``--seed S``, so it runs that very cell again."""
    return (f"make demo DIRICHLET={dirichlet:g} SEED={c['seeds'][0]} "
            f"CHAIN_ARGS={shlex.quote(' '.join(c['args']))}")


def reading(found: dict) -> tuple[list[dict], list[str]]:
    """(tables, notes) of the recommendation from :func:`candidates`' result."""
    tables, notes = [], []
    for a, cands in sorted(found.items(), reverse=True):
        tables.append({"title": f"Dirichlet({a:g}), {SITES} sites, all training data: the methods with at least "
                                f"{MIN_SEEDS} seeds, best mean first (of {len(cands)})",
                       "columns": ["method [study, recipe]", "accuracy %", "n", "MB to the final model",
                                   "start-chain arguments"],
                       "rows": [[_name(c), f"{100 * c['mean']:.2f} ± {100 * c['std']:.2f}", c["n"],
                                 ", ".join(f"{b / 1e6:.3f}" for b in c["to_model_bytes"]) or "—",
                                 " ".join(c["args"])] for c in cands[:TOP]]})
        best = cands[0]
        line = (f"Dirichlet({a:g}): recommended {_name(best)}: {100 * best['mean']:.2f} ± {100 * best['std']:.2f} % "
                f"over {best['n']} seeds")
        if len(cands) > 1:
            d = _paired(best, cands[1])
            line += (f"; against the runner-up {_name(cands[1])} ({100 * cands[1]['mean']:.2f} %), paired on "
                     f"{d['n']} common seed(s): {100 * d['mean']:+.2f} ± {100 * d['std']:.2f} points, ahead in "
                     f"{d['wins']} of {d['n']}" if d else f"; the runner-up {_name(cands[1])} shares no seed with it")
            if d and (d["n"] < 2 or abs(d["mean"]) <= d["std"]):
                line += (" (a tie on these seeds: the paired difference is within its spread over seeds, so the "
                         "ranking rests on the means alone)")
            if d and best["machines"] != cands[1]["machines"]:
                line += (f" (their cells ran on other machines, {'; '.join(best['machines'])} against "
                         f"{'; '.join(cands[1]['machines'])}: the pairing mixes the machine with the method)")
        notes.append(line + f". Run it on the demo's sites: `{demo_line(best, a)}` (seed "
                     f"{best['seeds'][0]}: {100 * best['per_seed'][str(best['seeds'][0])]:.2f} % in its cell).")
    both = {}
    if len(found) > 1:
        keys = [{(c["study"], c["recipe"], c["method"]): c for c in cands} for cands in found.values()]
        for k in set.intersection(*(set(x) for x in keys)):
            both[k] = sum(x[k]["mean"] for x in keys) / len(keys)
    if both:
        k = max(both, key=both.get)
        c = next(x for x in next(iter(found.values())) if (x["study"], x["recipe"], x["method"]) == k)
        notes.append(f"Skew unknown: {_name(c)} has the best mean of the Dirichlets' means "
                     f"({', '.join(f'{a:g}' for a in sorted(found, reverse=True))}) among the methods with at "
                     f"least {MIN_SEEDS} seeds at each: {100 * both[k]:.2f} %.")
    if not found:
        notes.append(f"No method has {MIN_SEEDS} seeds at any Dirichlet yet: nothing to recommend.")
    notes.append("Every candidate's cells ran through the daemons with their ledger equal to their plan "
                 "(bench.grid writes no other cell); a study's own section gives its tables, plots and pairings. "
                 "`make demo DIRICHLET=A SEED=S` splits the data with the grid's own `split-dataset` call and "
                 "starts the chain with the same seed, so the command above runs that cell again: on a machine "
                 "with the cell's float kernels (its file names its machine) it ends on the cell's accuracy.")
    return tables, notes


def publish(root: Path, results: Path = RESULTS_JSON) -> dict:
    """Compute the recommendation from the cells under ``root`` and record it as
    ``accuracy.recommendation`` in ``results`` (and RESULTS.md beside it). Returns the data."""
    found = candidates(root)
    tables, notes = reading(found)
    data = {"summary": "Which one-shot method to run (issue #25), from the full-data grid's cells of every study "
                       f"(`bench/cells`), among the methods measured on at least {MIN_SEEDS} seeds; generated by "
                       "`python -m bench.grid_recommend`.",
            "tables": tables, "notes": notes, "min_seeds": MIN_SEEDS,
            "candidates": {dir_key(a): cands for a, cands in found.items()}}
    record(SECTION, data, results=results, sub=SUB)
    return data


def main(argv=None) -> dict:
    from bench.grid import DEFAULT_CELLS

    ap = argparse.ArgumentParser(description="The recommended one-shot method per label skew, from the grid's cells")
    ap.add_argument("--cells", type=Path, default=DEFAULT_CELLS)
    ap.add_argument("--results", type=Path, default=RESULTS_JSON)
    args = ap.parse_args(argv)
    data = publish(args.cells, args.results)
    for line in data["notes"]:
        print(line)
    return data


if __name__ == "__main__":
    main()
