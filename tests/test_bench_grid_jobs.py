"""bench.grid --jobs: the grid's (Dirichlet, seed) groups as parallel bench.grid processes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from bench.grid_jobs import group_argv, run_groups


def test_a_group_gets_the_parents_flags_with_its_own_seed_dirichlet_and_folders(tmp_path):
    argv = ["--recipe", "ours", "--seeds", "0-4", "--dirichlets=0.5,0.1", "--seeds-at", "0.1=0-9", "--jobs", "8",
            "--commit-cells", "--workdir", "/w", "--results=/r.json", "--plots", "/p", "--device", "cuda",
            "--cells", "/c", "--deadline", "04:00"]
    out = group_argv(argv, 3, 0.1, tmp_path / "g", tmp_path / "cells")
    assert out == ["--recipe", "ours", "--device", "cuda", "--deadline", "04:00", "--seeds", "3", "--dirichlets",
                   "0.1", "--workdir", str(tmp_path / "g"), "--results", str(tmp_path / "g" / "results.json"),
                   "--plots", str(tmp_path / "g" / "plots"), "--cells", str(tmp_path / "cells")]


# A stand-in for `python -m bench.grid`: writes a cell named for its seed and Dirichlet into --cells;
# seed 2 fails.
FAKE = """
import sys, pathlib
a = sys.argv[1:]
seed, d, cells = a[a.index("--seeds") + 1], a[a.index("--dirichlets") + 1], pathlib.Path(a[a.index("--cells") + 1])
if seed == "2":
    print("no data for seed 2"); sys.exit(3)
cells.mkdir(parents=True, exist_ok=True)
(cells / f"dir{d}-seed{seed}.json").write_text("{}")
"""


@pytest.mark.integration
def test_every_group_runs_at_most_jobs_at_once_and_a_failed_group_is_reported(tmp_path):
    polls = []
    cells = tmp_path / "cells"
    groups = [(0, 0.5), (1, 0.5), (2, 0.1), (3, 0.1)]
    failures = run_groups(groups, ["--recipe", "paper"], tmp_path, cells, 2, poll_seconds=0.05,
                          on_poll=lambda running: polls.append((running, sorted(p.name for p in cells.glob("*.json")))),
                          command=[sys.executable, "-c", FAKE])
    assert sorted(p.name for p in cells.glob("*.json")) == ["dir0.1-seed3.json", "dir0.5-seed0.json",
                                                             "dir0.5-seed1.json"]
    assert polls[-1] == (0, sorted(p.name for p in cells.glob("*.json")))  # a last poll after the last group
    assert max(running for running, _ in polls) <= 2
    assert len(failures) == 1 and "seed 2" in failures[0] and "exited with 3" in failures[0]
    assert "no data for seed 2" in failures[0]
    assert Path(tmp_path / "jobs" / "dir0.1-seed2.log").exists()
