"""What the studies measure of processes and runs: the resident memory of a process tree (from
``/proc``), the chain's wall time and each site's training time (from a run's event log), and
the CPU kernels torch uses (:func:`cpu_capability`)."""

from __future__ import annotations

import json
from pathlib import Path


def process_tree_rss(pids: list[int]) -> int:
    """Sum of the resident set sizes (bytes) of ``pids`` and their children."""
    total, seen = 0, set()
    todo = list(pids)
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
            for task in Path(f"/proc/{pid}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            pass
    return total


def training_times(events: list[dict]) -> tuple[float, dict[str, float]]:
    """(chain wall seconds, site -> training seconds) from a run's event log."""
    start = next(e["time"] for e in events if e["kind"] == "started")
    end = next(e["time"] for e in events if e["kind"] == "final")
    began, spent = {}, {}
    for e in events:
        if e["kind"] != "state":
            continue
        state = json.loads(e["data"]).get("state")
        if state == "training":
            began[e["site"]] = e["time"]
        elif state in ("sending", "distributing") and e["site"] in began:
            spent[e["site"]] = e["time"] - began[e["site"]]
    return end - start, spent


def cpu_capability() -> str:
    """The CPU kernels torch dispatches to here (``AVX512``, ``AVX2``, ...): the trained bits depend
    on them, and results.json's cpu name does not tell machines apart."""
    import torch

    return torch.backends.cpu.get_cpu_capability()
