"""Studies 2, 4b and 5 from real chains: communication, peer memory, chain overhead, and the
pairwise-distance heatmap of the final site's model pool (the paper's Figure 9).

A coordinator and N peer daemons run as separate processes on loopback (``deploy/
local_trial.py``'s ``LocalTrial``, mutual TLS), on Fashion-MNIST split into N sites; one FedELMY
chain and one FedSeq chain with the same seed run through the real CLI. Then:

- **communication**: the ledger's chain total against (N-1)·M; the ledger's wire bytes against
  its payload bytes; and, independently of fedrelay's own counting, the kernel's byte counters.
  As root with iproute2 (``--netns``, the default where possible) every daemon runs on its own
  host, a network namespace joined to a switch by a veth link (``deploy/netns_trial.py``), and
  a sampler inside the switch reads every link's counters (/proc/net/dev) every 10 ms: the
  bytes into the receiver's link from the sample before a hop starts to the sample after it
  ends are that hop's bytes on the wire (IP, TCP, TLS and HTTP/2 included, plus any control
  traffic to that site in the window). Without namespaces (``--no-netns``) only the loopback
  interface's total over the run is available: an upper bound holding every process's
  loopback traffic;
- **memory**: each site's peak resident set against baseline + data + (S+3)·M: the larger of
  the daemon's own peak (VmHWM) and the peak of the daemon and its worker processes together
  (the light daemon trains in workers; their resident sets are summed with the daemon's every
  50 ms during the FedELMY chain),
  where baseline is the peak RSS of a process that imports what a peer imports (and, to explain
  the gap, of one that has also run one training step);
- **chain overhead**: the chain's wall time (run start to final model) against the sum of the
  sites' training times (each site's "training" to "sending" events);
- **Figure 9**: pairwise L2 distances over the parameters of the last site's pool (m0 and the
  S trained models; BatchNorm running statistics excluded), from its state dir.

    python -m bench.chain                      # 10 sites, Dirichlet 0.5, S=5, E=2, Ew=2
    python -m bench.chain --quick              # synthetic data, 3 sites, tiny (smoke run)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

from bench.common import PLOTS, record
from deploy.processes import tool
from bench.measures import process_tree_rss, training_times


def lo_bytes() -> int:
    """Bytes received on the loopback interface so far (kernel counter)."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == "lo":
            return int(rest.split()[0])
    return 0


SAMPLER = r"""
import json, sys, time
links = sys.argv[1].split(",")
out = open(sys.argv[2], "w", buffering=1)
while True:
    row = {"t": time.time()}
    for line in open("/proc/net/dev").read().splitlines()[2:]:
        name, _, rest = line.partition(":")
        if name.strip() in links:
            f = rest.split()
            row[name.strip()] = [int(f[0]), int(f[8])]  # rx bytes, tx bytes
    out.write(json.dumps(row) + "\n")
    time.sleep(0.01)
"""


class LinkSampler:
    """Samples the byte counters of the switch's veth links (one per host) every 10 ms from
    inside the switch's namespace. The switch side *transmits* what the host receives."""

    def __init__(self, trial, path: Path):
        self.trial, self.path = trial, path
        self.link_of = dict(trial.links)  # daemon name -> switch-side veth

    def __enter__(self):
        self.proc = subprocess.Popen(["ip", "netns", "exec", self.trial.switch, sys.executable, "-c", SAMPLER,
                                      ",".join(self.link_of.values()), str(self.path)])
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait()

    def rows(self) -> list[dict]:
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.endswith("}")]

    def into(self, name: str, start: float, end: float, rows: list[dict] | None = None) -> int:
        """Bytes the kernel sent towards ``name`` between the last sample at or before ``start``
        and the first at or after ``end`` (unix seconds)."""
        rows = rows if rows is not None else self.rows()
        link = self.link_of[name]
        before = [r for r in rows if r["t"] <= start and link in r]
        after = [r for r in rows if r["t"] >= end and link in r]
        if not before or not after:
            raise RuntimeError(f"no counter samples around [{start}, {end}] for {name}")
        return after[0][link][1] - before[-1][link][1]


def vm_hwm(pid: int) -> int:
    """Peak resident set size of a process, bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


class TreePeaks:
    """Samples, every ``period`` seconds in a thread, the summed resident set (bytes) of each
    site's daemon and its descendants (the workers that train); ``peaks`` holds the maximum per
    site. Peaks shorter than the period can be missed; the daemon's own VmHWM is exact."""

    def __init__(self, pids: dict[str, int], period: float = 0.05):
        import threading

        self.pids, self.period = pids, period
        self.peaks = {name: 0 for name in pids}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            for name, pid in self.pids.items():
                self.peaks[name] = max(self.peaks[name], process_tree_rss([pid]))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def baseline_rss(batch_size: int = 128) -> tuple[int, int]:
    """Peak RSS (bytes) of a fresh process that imports what a peer imports, and of the same
    process once it has also run one training step (forward, backward, Adam) of the small CNN on
    a batch and one evaluation batch: the working memory of training itself (activations,
    gradients, optimiser state, allocator and oneDNN scratch), which the issue's bound omits.
    One process, its peak (VmHWM) read after the imports and again after the step."""
    code = (
        "import fedrelay.peer.daemon, fedrelay.peer.training, torch, torchvision, grpc\n"
        "def hwm(): return [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]\n"
        "print(hwm(), flush=True)\n"
        "from fedrelay.models import build_model\n"
        "from fedrelay.tasks.image_folder import spec as image_spec\n"
        "import torch.nn.functional as F\n"
        "m = build_model(image_spec('cnn', 1, (28, 28), 10)); opt = torch.optim.Adam(m.parameters())\n"
        f"x = torch.rand({batch_size}, 1, 28, 28); y = torch.randint(0, 10, ({batch_size},))\n"
        "F.cross_entropy(m(x), y).backward(); opt.step()\n"
        "m.eval()\n"
        "with torch.no_grad(): m(torch.rand(512, 1, 28, 28))\n"
        "print(hwm())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    imports, trained = out.split()
    return int(imports) * 1024, int(trained) * 1024

BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


def pool_distances(run_dir: Path):
    """Pairwise L2 distances between m0 and the pool models, over the parameters (BatchNorm
    running statistics excluded, as in d1 and d2)."""
    import torch

    from fedrelay.tensors import decode_state

    files = [run_dir / "received.safetensors"] + sorted((run_dir / "pool").glob("model-*.safetensors"),
                                                        key=lambda p: int(p.stem.split("-")[1]))
    flat = []
    for f in files:
        state = decode_state(f.read_bytes())
        flat.append(torch.cat([v.flatten().double() for k, v in sorted(state.items())
                               if v.is_floating_point() and not k.endswith(BUFFERS)]))
    n = len(flat)
    return [[float((flat[i] - flat[j]).norm()) for j in range(n)] for i in range(n)], \
        ["m0"] + [f"m{i}" for i in range(1, n)]


def plot_heatmap(dist, labels, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.2, 4.4))
    im = ax.imshow(dist, cmap="viridis")
    ax.set_xticks(range(len(labels)), labels)
    ax.set_yticks(range(len(labels)), labels)
    for i in range(len(labels)):
        for j in range(len(labels)):
            ax.text(j, i, f"{dist[i][j]:.2f}", ha="center", va="center", fontsize=7,
                    color="white" if dist[i][j] < max(map(max, dist)) / 2 else "black")
    fig.colorbar(im, ax=ax, label="L2 distance")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_hops(runs: dict[str, dict], path: Path) -> None:
    """Bars per hop: each run's ledger payload and, where measured, the kernel's bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    series = []
    for name, run in runs.items():
        series.append((f"{name}, ledger payload (total {run['total_bytes'] / 1e6:.2f} MB)",
                       [(h["hop"], h["payload_bytes"]) for h in run["hops"]]))
        if all("kernel_bytes" in h for h in run["hops"]):
            series.append((f"{name}, kernel bytes into the receiver's link "
                           f"(total {sum(h['kernel_bytes'] for h in run['hops']) / 1e6:.2f} MB)",
                           [(h["hop"], h["kernel_bytes"]) for h in run["hops"]]))
    width = 0.8 / len(series)
    for k, (label, points) in enumerate(series):
        ax.bar([hop + (k - (len(series) - 1) / 2) * width for hop, _ in points], [b / 1e6 for _, b in points],
               width, label=label)
    m = next(iter(runs.values()))["model_bytes"] / 1e6
    ax.axhline(m, color="grey", lw=0.8, ls="--", label=f"M = {m:.3f} MB")
    ax.set_xlabel("hop")
    ax.set_ylabel("MB")
    ax.set_title("bytes per hop", fontsize=9)
    ax.set_xticks(sorted({hop for _, points in series for hop, _ in points}))
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=1, frameon=False)  # below the bars
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description="Communication, memory, overhead and Figure 9 from real chains")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sites", type=int, default=10)
    ap.add_argument("--dirichlet", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--source", type=Path, default=None, help="Fashion-MNIST IDX folder")
    ap.add_argument("--results", type=Path, default=None)
    ap.add_argument("--plots", type=Path, default=PLOTS)
    ap.add_argument("--netns", action=argparse.BooleanOptionalAction, default=None,
                    help="one network namespace per daemon and per-hop kernel counts (default: where possible)")
    ap.add_argument("--subnet", type=int, default=79, help="--netns: use 10.SUBNET.0.0/24")
    args = ap.parse_args(argv)

    from fedrelay.coordinator.client import OperatorClient

    from deploy import local_trial as lt
    from deploy import netns_trial as netns
    usable, why = netns.netns_available()
    if args.netns and not usable:
        raise SystemExit(f"--netns: {why}")
    use_netns = usable if args.netns is None else args.netns
    work = args.workdir or Path(tempfile.mkdtemp(prefix="fedrelay-bench-chain-"))
    S, E, Ew = (2, 1, 1) if args.quick else (5, 2, 2)
    n_sites = 3 if args.quick else args.sites
    split = [tool("coordinator"), "split-dataset", "fashion-mnist", "--sites", str(n_sites), "--dirichlet",
             str(args.dirichlet), "--seed", str(args.seed), "--out", str(work / "sites")]
    if args.source:
        split += ["--source", str(args.source)]
    if not (work / "sites" / "split.json").exists():
        subprocess.run(split, check=True, capture_output=True)
    sites = sorted(p for p in (work / "sites").iterdir() if p.is_dir() and p.name.startswith("site-"))
    split_meta = json.loads((work / "sites" / "split.json").read_text())
    chain_args = ["--models-per-site", str(S), "--local-epochs", str(E), "--warmup-epochs", str(Ew)]
    baseline, baseline_trained = baseline_rss()
    runs, lo = {}, {}
    trial_cls = (lambda *a: netns.NetnsTrial(*a, subnet=args.subnet)) if use_netns else lt.LocalTrial
    with trial_cls(work / "trial", sites) as trial:
        for strategy in ("fedelmy", "fedseq"):
            before = lo_bytes()
            daemons = {name: p.pid for name, p in trial.procs.items() if name != "coordinator"}
            with LinkSampler(trial, work / f"links-{strategy}.jsonl") if use_netns else nullcontext() as sampler, \
                    TreePeaks(daemons) as tree:
                res = trial.cli("start-chain", "--seed", str(args.seed), "--strategy", strategy, "--wait", "--json",
                                *chain_args, capture_output=True, text=True, timeout=3600)
                time.sleep(0.05)  # a sample after the last transfer
            lo[strategy] = lo_bytes() - before
            if res.returncode != 0:
                raise RuntimeError(f"{strategy} chain failed: {res.stderr[-2000:]}")
            runs[strategy] = json.loads(res.stdout)
            if sampler:
                rows = sampler.rows()
                for h in runs[strategy]["hops"]:
                    h["kernel_bytes"] = sampler.into(h["receiver"], h["started"], h["ended"], rows)
            if strategy == "fedelmy":
                peaks = {name: max(vm_hwm(pid), tree.peaks[name]) for name, pid in daemons.items()}
                with OperatorClient(trial.coordinator, trial.transport()) as c:
                    events = [{"kind": e.kind, "site": e.site, "time": e.time, "data": e.data_json}
                              for e in c.watch(runs[strategy]["run_id"])]
        elmy = runs["fedelmy"]
        last_dir = trial.workdir / "state" / elmy["order"][-1] / "runs" / elmy["run_id"]
        dist, labels = pool_distances(last_dir)
    n, m = len(elmy["order"]), elmy["model_bytes"]
    wall, spent = training_times(events)
    data_bytes = {}
    shape = split_meta.get("image_shape", [1, 28, 28])
    px = shape[0] * shape[1] * shape[2]
    for s in split_meta["per_site"]:
        count = s["n_train"] + s["n_test"]
        data_bytes[s["site"]] = count * (px + 8)  # uint8 pixels + int64 label
    mem_rows, worst = [], 0.0
    for name, peak in sorted(peaks.items()):
        bound = baseline + data_bytes[name] + (S + 3) * m
        worst = max(worst, peak / bound)
        mem_rows.append([name, peak, bound, round(peak / bound, 3)])
    # The same bound with the working memory of one training step in the baseline.
    worst_trained = max(peak / (baseline_trained + data_bytes[name] + (S + 3) * m) for name, peak in peaks.items())
    plot_hops(runs, args.plots / "bytes_per_hop.png")
    plot_heatmap(dist, labels, args.plots / "pool_heatmap.png",
                 f"final site's pool ({elmy['order'][-1]}), pairwise L2 distance")
    ledger_wire = sum(h["wire_bytes"] for h in elmy["hops"]) / elmy["total_bytes"]
    kernel = {k: [h["kernel_bytes"] for h in r["hops"]] for k, r in runs.items()} if use_netns else None
    comm = {"ledger_total_bytes": elmy["total_bytes"], "expected_total_bytes": (n - 1) * m, "model_bytes": m,
            "sites": n,
            # The kernel's count where measured (netns), else the sender's own count (the ledger's).
            "wire_over_payload": sum(kernel["fedelmy"]) / elmy["total_bytes"] if kernel else ledger_wire,
            "wire_counted_by": "kernel (veth counters, one namespace per site)" if kernel else "sender (ledger)",
            "ledger_wire_over_payload": ledger_wire,
            "kernel_bytes_per_hop": kernel,
            "fedseq_ledger_total_bytes": runs["fedseq"]["total_bytes"],
            "fedseq_wire_over_payload": (sum(kernel["fedseq"]) if kernel else
                                         sum(h["wire_bytes"] for h in runs["fedseq"]["hops"]))
            / runs["fedseq"]["total_bytes"],
            "loopback_bytes_during_fedelmy_run": None if use_netns else lo["fedelmy"],
            "final_copies_bytes": sum(h["payload_bytes"] for h in elmy["final_transfers"]),
            "paper_table": {"fedelmy": "(N-1)*M", "fedseq": "(N-1)*M", "metafed": "(2N-1)*M",
                            "dense_fedov": "N*M"}}
    figures = {
        "communication": comm,
        "memory": {"peak_rss_bytes": max(peaks.values()), "bound_bytes": max(r[2] for r in mem_rows),
                   "worst_peak_over_bound": worst, "baseline_bytes": baseline,
                   "baseline_after_a_training_step_bytes": baseline_trained,
                   "worst_peak_over_bound_with_training_step": worst_trained},
        "chain_overhead": wall / sum(spent.values()),
        "chain_wall_seconds": wall, "training_seconds": spent,
        "accuracy": {"fedelmy": elmy["final"]["accuracy"], "fedseq": runs["fedseq"]["final"]["accuracy"]},
        "final_sha256": {"fedelmy": elmy["final"]["sha256"], "fedseq": runs["fedseq"]["final"]["sha256"]},
        "pool_distances": {"labels": labels, "matrix": dist},
        "quick": args.quick,
        "summary": f"{n} sites, Dirichlet({args.dirichlet}), seed {args.seed}, S={S}, E={E}, Ew={Ew}, small CNN, "
                   "mutual TLS, real peer processes, "
                   + ("each daemon on its own host (network namespace + veth link)." if use_netns else "on loopback."),
        "tables": [
            {"title": "communication (one-shot chain)", "columns": ["figure", "bytes"],
             "rows": [["M (model)", m], ["ledger chain total, FedELMY", elmy["total_bytes"]],
                      ["(N-1)·M", (n - 1) * m], ["ledger chain total, FedSeq", runs["fedseq"]["total_bytes"]],
                      ["ledger (sender-counted) wire bytes / payload bytes", round(ledger_wire, 5)],
                      *([["kernel bytes into the receivers' links, FedELMY hops", sum(kernel["fedelmy"])],
                         ["kernel bytes / ledger payload bytes, FedELMY", round(comm["wire_over_payload"], 5)],
                         ["kernel bytes into the receivers' links, FedSeq hops", sum(kernel["fedseq"])],
                         ["kernel bytes / ledger payload bytes, FedSeq", round(comm["fedseq_wire_over_payload"], 5)]]
                        if kernel else
                        [["kernel loopback bytes during the FedELMY run (all traffic)", lo["fedelmy"]]]),
                      ["final model copies for evaluation (outside the chain)", comm["final_copies_bytes"]]]},
            *([{"title": "bytes per hop: ledger payload against the kernel's count on the receiver's link",
                "columns": ["run", "hop", "sender → receiver", "payload", "kernel", "kernel/payload"],
                "rows": [[k, h["hop"], f"{h['sender']} → {h['receiver']}", h["payload_bytes"], h["kernel_bytes"],
                          round(h["kernel_bytes"] / h["payload_bytes"], 4)]
                         for k, r in runs.items() for h in r["hops"]]}] if kernel else []),
            {"title": "peak RSS per peer (bytes) against baseline + data + (S+3)·M",
             "columns": ["site", "peak", "bound", "peak/bound"], "rows": mem_rows},
        ],
        "notes": [f"chain wall time {wall:.1f} s against {sum(spent.values()):.1f} s of training: "
                  f"{wall / sum(spent.values()):.3f}x (target <= 1.05x)",
                  f"final accuracy: FedELMY {elmy['final']['accuracy']:.4f}, FedSeq "
                  f"{runs['fedseq']['final']['accuracy']:.4f} (one seed; see the accuracy study for means)",
                  ("kernel bytes per hop: the switch-side veth's transmit counter towards the receiver, from "
                   "the 10 ms sample before the hop's start to the one after its end (the sender's clock; one "
                   "machine); it holds the hop's TCP/IP, TLS and HTTP/2 bytes (veth counts a segmentation-"
                   "offloaded packet's headers once) and any control traffic to that site in the window"
                   if use_netns else
                   "the loopback counter is an upper bound, not a per-hop count: it holds every process's "
                   "loopback traffic during the run (other work on the machine included); run as root with "
                   "iproute2 for per-hop kernel counts (--netns)"),
                  f"peak RSS over the bound: worst {worst:.2f}x. The bound counts the imports, the site's data "
                  f"once and (S+3) models ({(S + 3) * m / 2**20:.1f} MiB); it leaves out the working memory of "
                  f"training itself: a fresh process that has run one training step and one evaluation batch "
                  f"peaks at {baseline_trained / 2**20:.0f} MiB against {baseline / 2**20:.0f} MiB after the "
                  f"imports alone. With that baseline the worst peer is at "
                  f"{worst_trained:.2f}x. "
                  "The rest is not profiled: the per-run train/validation copies of the site's data are a few "
                  "MiB, so the suspects are glibc's per-thread malloc arenas (gRPC and training threads), "
                  "allocator caching across the pool's models, and gRPC/TLS buffers"],
        "plots": ["bytes_per_hop.png", "pool_heatmap.png"],
    }
    print(json.dumps({k: figures[k] for k in ("communication", "memory", "chain_overhead", "accuracy")}, indent=1))
    kw = {"results": args.results} if args.results else {}
    record("chain", figures, **kw)
    return figures


if __name__ == "__main__":
    main()
