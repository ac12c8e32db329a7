"""The full-data grid's groups in parallel processes (``bench.grid --jobs N``): on a machine with
more cores than one trial uses (a lent GPU machine has 16), each (Dirichlet, seed) group of cells
runs as its own ``bench.grid`` process, at most ``N`` at once, all writing into the one cells
folder (a cell is a file of its own, written atomically: ``bench.grid_cells``).

Each group's process gets the parent's flags with its own ``--seeds``/``--dirichlets`` and its own
work folder (``<work>/jobs/dir<a>-seed<s>``: its split, trial, results and plots), and logs to
``<work>/jobs/dir<a>-seed<s>.log``. The parent commits the cells as they land (``--commit-cells``:
one committer, so that the processes never race for git's index) and publishes once at the end.

Measured once on a lent H200 (16 cores) with 16 groups at once: a FedELMY cell took 300-360 s,
the GPU's utilisation read 99-100 % and the load average 30-40: both saturated (bench/README.md).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from deploy.processes import die_with_parent

# Flags the parent sets per group (each followed by its value) or keeps to itself.
_PER_GROUP = {"--seeds", "--dirichlets", "--seeds-at", "--workdir", "--results", "--plots", "--cells", "--jobs"}
_PARENT_ONLY = {"--commit-cells"}


def group_argv(argv: list[str], seed: int, dirichlet: float, work: Path, cells: Path) -> list[str]:
    """``bench.grid``'s arguments for one group: ``argv`` (the parent's) without the per-group and
    parent-only flags, plus this group's seed, Dirichlet, work folder, results, plots and the
    shared cells folder. Understands ``--flag value`` and ``--flag=value``."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in _PER_GROUP:
            skip = "=" not in a
            continue
        if name in _PARENT_ONLY:
            continue
        out.append(a)
    return [*out, "--seeds", str(seed), "--dirichlets", f"{dirichlet:g}", "--workdir", str(work),
            "--results", str(work / "results.json"), "--plots", str(work / "plots"), "--cells", str(cells)]


def run_groups(groups: list[tuple[int, float]], argv: list[str], work: Path, cells: Path, jobs: int, *,
               on_poll: Callable[[int], None] = lambda running: None, poll_seconds: float = 10.0,
               command: list[str] | None = None) -> list[str]:
    """Run every group (seed, Dirichlet) as ``command + group_argv(...)`` (default ``python -m
    bench.grid``), at most ``jobs`` at once; ``on_poll`` is called every ``poll_seconds`` while
    any runs, and once at the end (the parent commits new cells there). Returns one line per
    group whose process failed (its exit code and the end of its log)."""
    command = command or [sys.executable, "-m", "bench.grid"]
    (work / "jobs").mkdir(parents=True, exist_ok=True)
    waiting = list(groups)
    running: dict[tuple[int, float], tuple[subprocess.Popen, Path]] = {}
    failures = []
    while waiting or running:
        while waiting and len(running) < max(1, jobs):
            seed, a = waiting.pop(0)
            folder = work / "jobs" / f"dir{a:g}-seed{seed}"
            log = folder.parent / f"{folder.name}.log"
            with open(log, "ab") as out:  # a group's process ends with this one, even a killed one (die_with_parent)
                proc = subprocess.Popen([*die_with_parent(), *command, *group_argv(argv, seed, a, folder, cells)],
                                        stdout=out, stderr=subprocess.STDOUT)
            running[(seed, a)] = (proc, log)
        for key, (proc, log) in list(running.items()):
            if proc.poll() is None:
                continue
            del running[key]
            if proc.returncode != 0:
                tail = log.read_text(errors="replace")[-800:]
                failures.append(f"Dirichlet {key[1]:g} seed {key[0]}: bench.grid exited with {proc.returncode}; "
                                f"end of {log}:\n{tail}")
        on_poll(len(running))
        if running:
            time.sleep(poll_seconds)
    return failures
