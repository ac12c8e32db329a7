"""What every study shares: machine metadata, merging figures into results.json, RESULTS.md,
and the command line, log and failures of the grid studies (accuracy, few_shot, parallel)."""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RESULTS_JSON = BENCH / "results.json"
RESULTS_MD = BENCH / "RESULTS.md"
PLOTS = BENCH / "plots"


def study_workdir(args, prefix: str, default: Path) -> Path:
    """A study's work folder: ``args.workdir``, else a new temporary folder named ``prefix...``
    for a ``--quick`` smoke run, else ``default``. An ``args.results`` or ``args.plots`` left
    None (the study has the flag, and it was not given) becomes the work folder's
    ``results.json`` / ``plots/`` in a quick run, else bench/'s ``results.json`` / ``plots/``."""
    work = args.workdir or (Path(tempfile.mkdtemp(prefix=prefix)) if args.quick else default)
    if getattr(args, "results", "") is None:
        args.results = work / "results.json" if args.quick else RESULTS_JSON
    if getattr(args, "plots", "") is None:
        args.plots = work / "plots" if args.quick else PLOTS
    return work


def log(msg: str) -> None:
    """One progress line on stdout, stamped ``[HH:MM:SS]``."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def failed(failures: list[str], what: str, exc: BaseException, method: str = "") -> None:
    """Book a cell (or a group of cells) that failed: ``what: exc`` into ``failures`` (cut to
    1,500 characters, for RESULTS.md), and a ``FAILED`` line in the log (naming ``method``)."""
    failures.append(f"{what}: {exc}"[:1500])
    log(f"  {method + ' ' if method else ''}FAILED: {exc}")


def finish(data: dict, started: float, failures: list[str], quick: bool) -> dict:
    """A grid study's last word: how long it took (``started``: ``time.monotonic()`` at its
    start) and its failures, each again on stderr unless ``quick``; returns ``data``."""
    log(f"done in {time.monotonic() - started:.0f} s; {len(failures)} failure(s)")
    if failures and not quick:
        print("\n".join(failures), file=sys.stderr)
    return data


QUICK = {"seeds": "0", "dirichlets": "0.5", "sites": 3, "S": 2, "E": 1, "warmup_epochs": 1}  # a --quick grid


def grid_flags(ap: argparse.ArgumentParser, quick: str, *, seeds: str, dirichlets: str, methods, default_methods,
               E: int, warmup_epochs: int, workdir: Path) -> None:
    """Add the flags a grid study through the daemons (bench.few_shot, bench.parallel) has to
    ``ap``: the grid (``--seeds``, ``--dirichlets``, ``--methods``), the sites, FedELMY's S, E,
    E_w, alpha and beta, and where its cache, data and results go. ``quick`` is the help of
    ``--quick``; the other arguments are the flags' defaults (``methods``: the choices)."""
    ap.add_argument("--quick", action="store_true", help=quick)
    ap.add_argument("--publish-only", action="store_true", help="figures from the cache; train nothing")
    ap.add_argument("--seeds", default=seeds)
    ap.add_argument("--dirichlets", default=dirichlets)
    ap.add_argument("--methods", default=",".join(default_methods), help=f"subset of {','.join(methods)}")
    ap.add_argument("--sites", type=int, default=10)
    ap.add_argument("--max-train-per-site", type=int, default=None, help="passed to split-dataset (default: all)")
    ap.add_argument("-S", type=int, default=5)
    ap.add_argument("-E", type=int, default=E)
    ap.add_argument("--warmup-epochs", type=int, default=warmup_epochs)
    ap.add_argument("--alpha", type=float, default=0.06)
    ap.add_argument("--beta", type=float, default=1.0)
    ap.add_argument("--workdir", type=Path, default=None, help=f"cache and data (default {workdir})")
    ap.add_argument("--source", type=Path, default=None, help="Fashion-MNIST IDX folder")
    ap.add_argument("--results", type=Path, default=None,
                    help="default bench/results.json (--quick: results.json in the work dir)")
    ap.add_argument("--plots", type=Path, default=None, help="default bench/plots (--quick: the work dir's plots/)")
    ap.add_argument("--note", dest="notes", action="append", default=[], help="a line for RESULTS.md (repeatable)")


def grid_args(ap: argparse.ArgumentParser, argv: list[str] | None, module: str, methods, **quick) -> argparse.Namespace:
    """``argv`` parsed by ``ap`` (:func:`grid_flags` and the study's own flags), with
    ``args.resume_command`` (:func:`resume_command` of ``module``); a ``--quick`` run takes
    :data:`QUICK` and ``quick`` (the study's own small values, by attribute) instead of the flags;
    then ``seeds``, ``dirichlets`` and ``methods`` become lists of int, float and str. Raises
    ``SystemExit`` (argparse's, or naming a method not in ``methods``)."""
    args = ap.parse_args(argv)
    args.resume_command = resume_command(module, argv)
    if args.quick:
        for name, value in {**QUICK, **quick}.items():
            setattr(args, name, value)
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    args.dirichlets = [float(a) for a in args.dirichlets.split(",") if a.strip()]
    args.methods = [m for m in args.methods.split(",") if m]
    bad = sorted(set(args.methods) - set(methods))
    if bad:
        raise SystemExit(f"unknown method(s) {bad}; choose from {methods}")
    return args


def resume_command(module: str, argv: list[str] | None) -> str:
    """What to run to finish a grid study's cells: ``nice -n 15 python -m MODULE`` and ``argv``
    less ``--publish-only`` and the ``--note``s."""
    resume, skip = [], False
    for a in argv or []:
        if skip or a == "--publish-only" or a.startswith("--note="):
            skip = False
        elif a == "--note":
            skip = True
        else:
            resume.append(a)
    return (f"nice -n 15 python -m {module} " + " ".join(shlex.quote(a) for a in resume)).strip()


def tally(cells, key: str) -> dict[str, int]:
    """How many of the cached ``cells`` (dicts) hold each value of ``key`` (``"not recorded"``:
    a cell without it)."""
    counts: dict[str, int] = {}
    for c in cells:
        counts[c.get(key, "not recorded")] = counts.get(c.get(key, "not recorded"), 0) + 1
    return counts


def commits_note(cells) -> list[str]:
    """RESULTS.md's note of the commit each cached cell was computed at (none without cells)."""
    commits = tally(cells, "commit")
    if not commits:
        return []
    return ["Commit each cached cell was computed at (cells: count): "
            + ", ".join(f"{k}: {v}" for k, v in sorted(commits.items())) + "."]


def study_start(argv: list[str] | None, parse, prefix: str, default: Path) -> tuple[argparse.Namespace, Path, float]:
    """A grid study's opening: ``argv`` (None: the command line) parsed by ``parse``, its work
    folder (:func:`study_workdir` with ``prefix`` and ``default``) and its start
    (``time.monotonic()``). A ``--quick`` run without ``--source`` gets tiny learnable
    Fashion-MNIST-format IDX files in ``<work>/idx`` (``bench.synthetic``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    started = time.monotonic()
    work = study_workdir(args, prefix, default)
    if args.quick and args.source is None:
        from bench.synthetic import write_fashion_like

        args.source = write_fashion_like(work / "idx", n_train=900, n_test=300, seed=0)
    return args, work, started


def meta() -> dict:
    """Date, commit, CPU, core count, torch and Python versions of this measurement."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    # A tree copied elsewhere (a GPU machine): git there may not know the commit; the caller says.
    commit = os.environ.get("FEDRELAY_BENCH_COMMIT") or _git_commit()
    return {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "commit": commit,
            "cpu": f"{cpu} ({os.cpu_count()} cores)", "torch": torch.__version__,
            "python": platform.python_version()}


def _git_commit() -> str:
    """HEAD's short hash, with ``+dirty`` when tracked code differs from it; ``unknown`` without git."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                text=True, check=True).stdout.strip()
        # Dirty = code that ran differs from the commit; the studies' own outputs do not count.
        if subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                           ":!bench/results.json", ":!bench/RESULTS.md", ":!bench/plots"], cwd=REPO,
                          capture_output=True, text=True).stdout.strip():
            commit += "+dirty"
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return commit


def record(section: str, figures: dict, *, results: Path = RESULTS_JSON, sub: str | None = None) -> dict:
    """Merge ``figures`` into ``results[section]`` (with this run's metadata under
    ``results["meta"]`` and ``results[section]["meta"]``), write results.json and RESULTS.md.

    With ``sub``, the figures go to ``results[section][sub]`` instead (a study that publishes
    inside another's section, e.g. ``accuracy.few_shot``), with their own ``meta``; the rest of
    the section is kept, and ``sub`` is listed in ``results[section]["subsections"]``. A study that
    rewrites its whole section keeps the subsections other studies put there."""
    data = json.loads(results.read_text()) if results.exists() else {}
    m = meta()
    old = data.get(section) or {}
    if sub is None:
        kept = {k: old[k] for k in old.get("subsections", []) if k in old and k not in figures}
        data[section] = {**figures, **kept, "meta": m}
        if kept:
            data[section]["subsections"] = sorted(kept)
    else:
        data[section] = {**old, sub: {**figures, "meta": m},
                         "subsections": sorted(set(old.get("subsections", [])) | {sub})}
    data["meta"] = m
    _save(data, results)
    return data


def _save(data: dict, results: Path) -> None:
    """Write ``results`` (results.json) and the RESULTS.md beside it."""
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    write_markdown(data, results.parent / RESULTS_MD.name, source=results)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def write_markdown(data: dict, path: Path = RESULTS_MD, source: Path = RESULTS_JSON) -> None:
    """RESULTS.md from results.json (``source``): one section per study, figures as measured."""
    try:
        shown = Path(source).resolve().relative_to(REPO)
    except ValueError:
        shown = Path(source)
    lines = ["# Benchmark results", "",
             f"Generated by the studies in `bench/` from `{shown}`; do not edit by hand.", ""]
    path.write_text("\n".join(lines + sections_markdown(data)))


def sections_markdown(data: dict) -> list[str]:
    """The Markdown lines of every study in ``data`` (results.json), as RESULTS.md and the docs'
    results page show them: a ``## section`` per study, a ``### section.sub`` per subsection."""
    lines: list[str] = []
    for section in sorted(k for k in data if k != "meta"):
        body = data[section]
        lines += [f"## {section}", ""]
        _body_markdown(body, lines)
        for sub in body.get("subsections", []):
            if isinstance(body.get(sub), dict):
                lines += [f"### {section}.{sub}", ""]
                _body_markdown(body[sub], lines)
    return lines


def _body_markdown(body: dict, lines: list[str]) -> None:
    """A section's (or subsection's) measurement line, summary, tables, notes and plots."""
    m = body.get("meta")
    if m:
        lines += [f"Measured {m.get('date', '?')} at commit {m.get('commit', '?')} on {m.get('cpu', '?')}, "
                  f"torch {m.get('torch', '?')}, Python {m.get('python', '?')}.", ""]
    if body.get("summary"):
        lines += [body["summary"], ""]
    if recipe_line(body):
        lines += [recipe_line(body), ""]
    for table in body.get("tables", []):
        lines += [f"**{table['title']}**", "", "| " + " | ".join(table["columns"]) + " |",
                  "|" + "---|" * len(table["columns"])]
        lines += ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in table["rows"]]
        lines.append("")
    for note in body.get("notes", []):
        lines += [f"- {note}"]
    if body.get("notes"):
        lines.append("")
    for plot in body.get("plots", []):
        lines += [f"![{plot}](plots/{plot})", ""]


def recipe_line(body: dict) -> str | None:
    """The training recipe a section's figures were trained with (issue #25: every table says
    which), from its recorded ``config`` (or ``settings``): learning-rate schedule, augmentation,
    model, lr, batch size. A config without ``lr_schedule`` / ``augment`` (the studies that run
    the defaults, and those recorded before the flags existed) ran the defaults, constant and
    none, and the line says so. None for a section
    that trains no model (no ``model`` in its config) and for one whose tables name a recipe each
    (``recipes``: the grid)."""
    config = body.get("config") or body.get("settings") or {}
    if not isinstance(config, dict) or "model" not in config or "recipes" in body:
        return None
    parts, defaulted = [], []
    for key, default, what in (("lr_schedule", "constant", "learning-rate schedule"),
                               ("augment", "none", "augmentation")):
        parts.append(f"{what} {config.get(key, default)}")
        if key not in config:
            defaulted.append("--" + key.replace("_", "-"))
    if defaulted:
        parts[-1] += f" ({' and '.join(defaulted)} not in the config: the defaults, which every build has)"
    parts.append(f"model {config['model']}")
    parts += [f"{label} {config[key]:g}" if isinstance(config[key], float) else f"{label} {config[key]}"
              for key, label in (("lr", "lr"), ("batch_size", "batch size")) if key in config]
    return "Recipe (from this section's recorded config): " + ", ".join(parts) + "."


def merge(source: Path, section: str, *, results: Path = RESULTS_JSON, name: str | None = None,
          commit: str | None = None) -> dict:
    """Copy ``section`` (with its own ``meta``: where and when it was measured) from another
    results.json, e.g. one written on a GPU machine, into ``results`` (as ``name``, default the
    same); rewrite RESULTS.md. ``commit`` replaces the recorded commit, for a copy of the tree
    whose git did not know it (its meta then keeps ``recorded_commit``). Raises ``KeyError``
    when ``source`` has no such section."""
    section_data = json.loads(Path(source).read_text())[section]
    if commit:
        m = section_data.setdefault("meta", {})
        m["recorded_commit"], m["commit"] = m.get("commit"), commit
    data = json.loads(results.read_text()) if results.exists() else {}
    data[name or section] = section_data
    _save(data, results)
    return data


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="bench results: merge a study measured elsewhere")
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("merge", help="copy SECTION of SOURCE (a results.json) into bench/results.json")
    m.add_argument("source", type=Path)
    m.add_argument("section")
    m.add_argument("--results", type=Path, default=RESULTS_JSON)
    m.add_argument("--as", dest="name", default=None, help="the section's name in --results (default SECTION)")
    m.add_argument("--commit", default=None, help="the commit that ran, when the copy's git said otherwise")
    a = ap.parse_args()
    merge(a.source, a.section, results=a.results, name=a.name, commit=a.commit)
