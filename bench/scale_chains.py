"""The scale study's real part (``python -m bench.scale --chains 10,100``): real FedELMY chains of
peer daemons on Fashion-MNIST, their memory, wall time against training time and ledger bytes,
published under ``scale.chains`` (docs/explanation/scale.md; the coordinator's part is
:mod:`bench.scale`)."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

from bench.common import record
from bench.measures import process_tree_rss, training_times

__all__ = ["MemorySampler", "real_chain", "real_study"]


class MemorySampler:
    """Samples the resident memory of a set of process trees (daemons and their workers) every
    ``interval`` seconds in a thread; ``peak`` is the largest total seen (bytes)."""

    def __init__(self, pids: list[int], interval: float = 0.5):
        self.pids, self.interval, self.peak = pids, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, process_tree_rss(self.pids))
            self._stop.wait(self.interval)

    def __enter__(self) -> "MemorySampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _split(n: int, work: Path, source: Path | None, seed: int = 0, dirichlet: float = 0.5) -> list[Path]:
    from deploy.processes import tool

    out = work / f"sites-{n}"
    if not (out / "split.json").exists():
        cmd = [tool("coordinator"), "split-dataset", "fashion-mnist", "--sites", str(n), "--dirichlet",
               str(dirichlet), "--seed", str(seed), "--out", str(out)]
        subprocess.run(cmd + (["--source", str(source)] if source else []), check=True, capture_output=True)
    return sorted(p for p in out.iterdir() if p.is_dir() and p.name.startswith("site-"))


def real_chain(n: int, work: Path, source: Path | None, chain_args: list[str], start_concurrency: int = 8) -> dict:
    """A real FedELMY chain of ``n`` peer daemons (``deploy/local_trial.py``'s LocalTrial: mutual
    TLS, separate processes, one host's worker slots) on Fashion-MNIST (Dirichlet 0.5, seed 0):
    idle daemon memory once all registered, peak total memory of every process (coordinator,
    daemons, their workers) during the run, wall times, the ledger's total against (n-1)·M, the
    sites evaluated, and the chain's overhead (run start to final model against the sum of the
    sites' training times, each site's "training" to "sending" events:
    ``bench.measures.training_times``)."""
    from fedrelay.coordinator.client import OperatorClient

    from deploy import local_trial as lt
    lt.raise_open_files_limit()
    sites = _split(n, work, source)
    t0 = time.monotonic()
    with lt.LocalTrial(work / f"trial-{n}", sites, start_concurrency=start_concurrency) as trial:
        started = time.monotonic() - t0
        daemons = {name: p.pid for name, p in trial.procs.items() if name != "coordinator"}
        idle = sorted(_rss(pid) for pid in daemons.values())
        pids = [p.pid for p in trial.procs.values()]
        with MemorySampler(pids) as mem:
            t1 = time.monotonic()
            res = trial.cli("start-chain", "--seed", "0", "--wait", "--json", *chain_args,
                            capture_output=True, text=True, timeout=6 * 3600)
            run_wall = time.monotonic() - t1
        if res.returncode != 0:
            raise RuntimeError(f"the {n}-site chain failed: {res.stderr[-2000:]}")
        run = json.loads(res.stdout)
        with OperatorClient(trial.coordinator, trial.transport()) as c:
            events = [{"kind": e.kind, "site": e.site, "time": e.time, "data": e.data_json}
                      for e in c.watch(run["run_id"])]
    wall, spent = training_times(events)
    m = run["model_bytes"]
    evaluated = len(run["final"]["per_site"])
    return {"sites": n, "chain_args": " ".join(chain_args), "status": run["status"],
            "start_seconds": round(started, 1), "run_seconds": round(run_wall, 1),
            "chain_wall_seconds": round(wall, 2), "training_seconds_sum": round(sum(spent.values()), 2),
            "chain_overhead": round(wall / sum(spent.values()), 4),
            "idle_daemon_rss_max_bytes": idle[-1], "idle_daemon_rss_median_bytes": idle[len(idle) // 2],
            "peak_total_rss_bytes": mem.peak, "model_bytes": m, "ledger_total_bytes": run["total_bytes"],
            "expected_total_bytes": (n - 1) * m, "sites_evaluated": evaluated,
            "accuracy": run["final"]["accuracy"], "final_sha256": run["final"]["sha256"]}


def real_study(ns: list[int], work: Path, source: Path | None, publish: bool, start_concurrency: int) -> dict:
    """The scale study's real-chain figures: the 100-site chain (S = 2, E = 1, Ew = 1) and the 10-site
    chain with the demo's parameters (S = 5, E = 2, Ew = 2), published under ``scale.chains``."""
    rows = []
    for n in ns:
        args = ["--models-per-site", "2", "--local-epochs", "1", "--warmup-epochs", "1"] if n > 10 else \
            ["--models-per-site", "5", "--local-epochs", "2", "--warmup-epochs", "2"]
        row = real_chain(n, work, source, args, start_concurrency)
        print(json.dumps(row), flush=True)
        rows.append(row)
    mb = 1 << 20
    notes = []
    for r in rows:
        notes.append(f"{r['sites']} sites ({r['chain_args']}): {r['status']}, {r['sites_evaluated']} of "
                     f"{r['sites']} sites evaluated, ledger total {r['ledger_total_bytes']:,} bytes "
                     f"{'=' if r['ledger_total_bytes'] == r['expected_total_bytes'] else '!='} (N-1)·M = "
                     f"{r['expected_total_bytes']:,}; idle daemon at most {r['idle_daemon_rss_max_bytes'] / mb:.0f} MB "
                     f"({'within' if r['idle_daemon_rss_max_bytes'] <= 150 * mb else 'over'} the 150 MB target); "
                     f"peak memory of all processes {r['peak_total_rss_bytes'] / mb:,.0f} MB; chain wall "
                     f"{r['chain_wall_seconds']} s against {r['training_seconds_sum']} s of training: "
                     f"{r['chain_overhead']}x"
                     + (f" (target at 10 sites with the demo's parameters <= 1.05: "
                        f"{'met' if r['chain_overhead'] <= 1.05 else 'not met'})." if r["sites"] == 10 else "."))
    figures = {
        "summary": "Real FedELMY chains of peer daemons (light daemons: training and evaluation in worker "
                   "processes bounded by the host's worker slots, default 3) on Fashion-MNIST, Dirichlet 0.5, "
                   "seed 0, small CNN, mutual TLS, every process on this machine (deploy/local_trial.py).",
        "rows": rows,
        "tables": [{"title": "real chains", "columns": [
            "sites", "S/E/Ew", "status", "evaluated", "idle daemon max MB", "peak all processes MB",
            "chain wall s", "training s", "overhead", "ledger = (N-1)·M", "start-up s"],
            "rows": [[r["sites"], r["chain_args"].replace("--models-per-site ", "S=").replace(
                " --local-epochs ", " E=").replace(" --warmup-epochs ", " Ew="), r["status"],
                r["sites_evaluated"], round(r["idle_daemon_rss_max_bytes"] / mb, 1),
                round(r["peak_total_rss_bytes"] / mb), r["chain_wall_seconds"], r["training_seconds_sum"],
                r["chain_overhead"], r["ledger_total_bytes"] == r["expected_total_bytes"], r["start_seconds"]]
                for r in rows]}],
        "notes": notes,
    }
    if publish:
        record("scale", figures, sub="chains")
    return figures
