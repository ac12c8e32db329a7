"""The full-data grid's finished cells, one small JSON file each, in a folder git tracks, so that
a study resumes across sessions and machines (issue #25 item 4):

    <root>/<study>/<recipe tag>/dir<Dirichlet>/seed<seed>/<method>.json

``root`` is ``bench/cells`` by default; ``study`` names what the cells share besides the recipe
(sites, data, S, E, Ew: ``bench.grid_methods.GridConfig.study``), the recipe tag the recipe and
its model (``paper-cnn``). A cell holds its accuracy, final SHA-256, the ledger's bytes and the
check of the ledger against the plan, the wall time, the commit and the machine. Writes are
atomic (a temporary file renamed), so an interrupted run leaves no half cell; :func:`commit_cell`
commits one cell file with git (``bench.grid --commit-cells``); :func:`plan` is the order cells
come in.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path


class CellStore:
    """The cells of one study under ``root / study``."""

    def __init__(self, root: Path, study: str):
        self.root, self.study = Path(root), study

    @property
    def base(self) -> Path:
        return self.root / self.study

    def path(self, recipe: str, dirichlet: float, seed: int, method: str) -> Path:
        return self.base / recipe / f"dir{dirichlet:g}" / f"seed{seed}" / f"{method}.json"

    def get(self, recipe: str, dirichlet: float, seed: int, method: str) -> dict | None:
        p = self.path(recipe, dirichlet, seed, method)
        return json.loads(p.read_text()) if p.exists() else None

    def put(self, cell: dict, recipe: str, dirichlet: float, seed: int, method: str) -> Path:
        p = self.path(recipe, dirichlet, seed, method)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(json.dumps(cell, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, p)
        return p

    def all(self) -> dict:
        """recipe tag -> Dirichlet (float) -> seed (int) -> method -> cell, for every cell of the
        study. Raises ``ValueError`` naming a file that is not a cell (bad JSON)."""
        out: dict = {}
        if not self.base.is_dir():
            return out
        for f in sorted(self.base.glob("*/dir*/seed*/*.json")):
            recipe, d, s = f.parent.parent.parent.name, f.parent.parent.name, f.parent.name
            try:
                cell = json.loads(f.read_text())
            except json.JSONDecodeError as exc:
                raise ValueError(f"{f}: not a cell ({exc})") from None
            out.setdefault(recipe, {}).setdefault(float(d[3:]), {}).setdefault(int(s[4:]), {})[f.stem] = cell
        return out


def each(by_dirichlet: dict) -> Iterator[tuple[float, int, str, dict]]:
    """``(Dirichlet, seed, method, cell)`` for every cell of one recipe's tree (a value of
    :meth:`CellStore.all`: Dirichlet -> seed -> method -> cell), in the tree's order."""
    for a, by_seed in by_dirichlet.items():
        for s, ms in by_seed.items():
            for m, c in ms.items():
                yield a, s, m, c


def every_cell(tree: dict) -> Iterator[dict]:
    """Every cell of :meth:`CellStore.all`'s tree (recipe tag -> Dirichlet -> ...), in its order."""
    for by_dirichlet in tree.values():
        for *_, c in each(by_dirichlet):
            yield c


def plan(seeds_of: dict[float, list[int]], methods: list[str]) -> list[tuple[int, float, str]]:
    """The grid's cells, (seed, Dirichlet, method), round-robin so that a partial grid is a useful
    one: every method of the lowest seed at every Dirichlet (in ``seeds_of``'s order), then the
    next seed, ...; ``seeds_of``: Dirichlet -> its seeds."""
    seeds = sorted({s for ss in seeds_of.values() for s in ss})
    return [(s, a, m) for s in seeds for a, ss in seeds_of.items() if s in ss for m in methods]


def commit_cell(path: Path, message: str) -> str | None:
    """``git add`` and ``git commit`` of the one file ``path`` (other staged changes stay staged
    and out of the commit), in the repository that holds it. Returns None, or why it failed (git's
    words); never raises for git's failure."""
    path = Path(path).resolve()
    cwd = path.parent
    try:
        add = subprocess.run(["git", "add", "--", path.name], cwd=cwd, capture_output=True, text=True, timeout=120)
        if add.returncode != 0:
            return f"git add: {add.stderr.strip()[-500:]}"
        done = subprocess.run(["git", "commit", "-q", "-m", message, "--only", "--", path.name], cwd=cwd,
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            return f"git commit: {(done.stderr or done.stdout).strip()[-500:]}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"git: {exc}"
    return None
