"""What every study shares: machine metadata, merging figures into results.json, RESULTS.md."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RESULTS_JSON = BENCH / "results.json"
RESULTS_MD = BENCH / "RESULTS.md"
PLOTS = BENCH / "plots"


def deploy_script(name: str):
    """A script of ``deploy/`` (``local_trial``, ``netns_trial``) loaded as a module (deploy/ is
    not a package: it holds what an institution copies, not a library)."""
    import importlib.util

    if str(REPO / "deploy") not in sys.path:
        sys.path.insert(0, str(REPO / "deploy"))  # netns_trial imports local_trial
    spec = importlib.util.spec_from_file_location(name, REPO / "deploy" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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


def tool(name: str) -> str:
    """Path of a console script of this environment (``peer``, ``coordinator``)."""
    path = Path(sys.executable).parent / name
    return str(path) if path.exists() else name


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
    import argparse

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
