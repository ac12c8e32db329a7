"""The scale study (docs/explanation/scale.md), the coordinator's part: its cost per hop from 3 to 100 sites.

A real coordinator (``fedrelay.coordinator.service.serve``, plaintext gRPC on loopback) runs in
its own process; this process plays N synthetic sites: each has a small fake ``Peer`` server
(GetStatus, Assign, Evaluate, EndRun, Reroute: what the coordinator calls) and its own channel
to the coordinator, registers, heartbeats at the interval the coordinator asks for, and reports
what a real FedELMY site reports for S = 2, E = 1, Ew = 1 (state changes, one progress report
per epoch, ``ReportHop`` / ``ReportReceipt`` per hop, the final copies, ``ReportFinal``), one
visit after the other, each visit taking ``--visit-seconds`` (no training). An operator watches
the run (``WatchRun``) as ``start-chain --wait`` does. Measured from StartChain to the run's
end: the coordinator process's CPU seconds (``/proc/PID/stat``) and its SQLite write
transactions (a trace callback on the ledger's connection, in the coordinator process), each
divided by the run's hops (N - 1).

    python -m bench.scale --coordinator-only               # N = 3, 10, 30, 100; publishes `scale`
    python -m bench.scale --coordinator-only --sites 3,30 --visit-seconds 0 --no-record

The real part (``--chains 10,100``): real peer daemons on Fashion-MNIST, published under
``scale.chains`` (:mod:`bench.scale_chains`).

    python -m bench.scale --chains 10,100
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

from bench.common import record
from bench.measures import process_tree_rss
from bench.scale_chains import real_study

S, E, EW = 2, 1, 1
MODEL_BYTES = 210_000  # about the small CNN's safetensors size (the coordinator only checks consistency)
PARAMS = dict(strategy="fedelmy", models_per_site=S, local_epochs=E, warmup_epochs=EW, alpha=1.0, beta=1.0,
              lr=1e-3, batch_size=128, weight_decay=1e-4, selection="best-val")


# -- the coordinator's process ------------------------------------------------------------------
class WriteCounter:
    """Counts an SQLite connection's write transactions (a write statement outside BEGIN, or a
    COMMIT) and reads (SELECT statements) through its trace callback."""

    def __init__(self):
        self.writes = self.reads = 0
        self._in_txn = False

    def __call__(self, sql: str) -> None:
        word = sql.lstrip().split(None, 1)[0].upper() if sql.strip() else ""
        if word == "BEGIN":
            self._in_txn = True
        elif word in ("COMMIT", "END"):
            self._in_txn = False
            self.writes += 1
        elif word == "ROLLBACK":
            self._in_txn = False
        elif word in ("INSERT", "UPDATE", "DELETE", "REPLACE") and not self._in_txn:
            self.writes += 1
        elif word == "SELECT":
            self.reads += 1


def counted_ledger(counter: WriteCounter):
    """A Ledger class whose connection reports every statement to ``counter``."""
    from fedrelay.coordinator.ledger import Ledger

    class CountedLedger(Ledger):
        def __init__(self, path):
            super().__init__(path)
            self._db.set_trace_callback(counter)

    return CountedLedger


def serve_coordinator(listen: str, db: str, stats: str) -> None:
    """The coordinator's process: ``serve`` with a counted ledger; SIGUSR1 writes the counts to
    ``stats`` (JSON: n, writes, reads)."""
    import fedrelay.coordinator.service as service
    from fedrelay.transport import INSECURE

    counter, asked = WriteCounter(), [0]
    service.Ledger = counted_ledger(counter)

    def dump(signum, frame):
        asked[0] += 1
        tmp = stats + ".tmp"
        Path(tmp).write_text(json.dumps({"n": asked[0], "writes": counter.writes, "reads": counter.reads}))
        os.replace(tmp, stats)

    signal.signal(signal.SIGUSR1, dump)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    service.serve(listen, db, transport=INSECURE, stop=stop)


class CoordinatorProcess:
    def __init__(self, work: Path):
        from bench.common import REPO

        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.stats = work / "stats.json"
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.scale", "--serve-coordinator", self.address,
                                      str(work / "ledger.sqlite"), str(self.stats)], cwd=REPO,
                                     stdout=open(work / "coordinator.log", "ab"), stderr=subprocess.STDOUT)
        self._asked = 0

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def counts(self) -> dict:
        self._asked += 1
        self.proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                got = json.loads(self.stats.read_text())
                if got["n"] >= self._asked:
                    return got
            except (OSError, ValueError):
                pass
            time.sleep(0.02)
        raise RuntimeError("the coordinator did not report its counts")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- synthetic sites ----------------------------------------------------------------------------
def _peer_servicer_base():
    from fedrelay.v1 import peer_pb2_grpc

    return peer_pb2_grpc.PeerServicer


class FakePeer(_peer_servicer_base()):
    """The Peer service of one synthetic site: answers what the coordinator calls (the rest:
    UNIMPLEMENTED)."""

    def __init__(self, name: str, listen: str = "127.0.0.1:0"):
        from fedrelay.v1 import peer_pb2_grpc

        self.name = name
        self.instance = hashlib.sha256(name.encode()).hexdigest()[:16]
        self.assigned = threading.Event()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        peer_pb2_grpc.add_PeerServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port(listen)
        self.address = f"127.0.0.1:{self.port}"
        self.server.start()

    def GetStatus(self, request, context):
        from fedrelay.v1 import peer_pb2

        return peer_pb2.PeerStatus(name=self.name, address=self.address, device="cpu", instance=self.instance)

    def Assign(self, request, context):
        from fedrelay.v1 import peer_pb2

        self.assigned.set()
        return peer_pb2.AssignReply()

    def Evaluate(self, request, context):
        from fedrelay.v1 import peer_pb2

        return peer_pb2.EvaluateReply(site=self.name, correct=80, test_samples=100, accuracy=0.8, seconds=0.1,
                                      run_id=request.run_id, sha256=request.sha256)

    def EndRun(self, request, context):
        from fedrelay.v1 import peer_pb2

        return peer_pb2.EndRunReply(run_id=request.run_id, state="done")

    def Reroute(self, request, context):
        from fedrelay.v1 import peer_pb2

        return peer_pb2.RerouteReply()


class Sites:
    """N synthetic sites against the coordinator at ``address``."""

    def __init__(self, address: str, n: int):
        from fedrelay.v1 import coordinator_pb2_grpc

        self.names = [f"site-{i:03d}" for i in range(n)]
        self.peers = {name: FakePeer(name) for name in self.names}
        self.channels = {name: grpc.insecure_channel(address) for name in self.names}
        self.stubs = {name: coordinator_pb2_grpc.CoordinatorStub(ch) for name, ch in self.channels.items()}
        self.heartbeat_seconds = 10
        self._stop = threading.Event()
        self.heartbeats = 0
        from fedrelay import tasks
        from fedrelay.task import DataSummary
        from fedrelay.tasks.offers import Offer

        # What every synthetic site registers: the image-folder task over three classes of 28x28 images.
        self.offer = Offer(name=tasks.DEFAULT, version="0", sha256=tasks.find(tasks.DEFAULT).sha256,
                           models=("cnn", "resnet18"),
                           summary=DataSummary(classes={c: (60, 10) for c in ("T-shirt_top", "Trouser", "Pullover")},
                                               input={"channels": 1, "height": 28, "width": 28}))

    def register(self, name: str) -> None:
        from fedrelay import __version__
        from fedrelay.v1 import coordinator_pb2 as cpb

        p = self.peers[name]
        reply = self.stubs[name].Register(cpb.RegisterRequest(
            name=name, address=p.address, device="cpu", version=__version__, instance=p.instance,
            tasks=[self.offer.to_pb()]), timeout=30)
        self.heartbeat_seconds = reply.heartbeat_seconds or 10

    def start(self) -> None:
        for name in self.names:
            self.register(name)
        threading.Thread(target=self._heartbeats, daemon=True).start()

    def _heartbeats(self) -> None:
        """Every site re-registers every ``heartbeat_seconds``, spread evenly over the interval."""
        k = 0
        while not self._stop.wait(self.heartbeat_seconds / len(self.names)):
            try:
                self.register(self.names[k % len(self.names)])
                self.heartbeats += 1
            except grpc.RpcError:
                pass
            k += 1

    def close(self) -> None:
        self._stop.set()
        for ch in self.channels.values():
            ch.close()
        for p in self.peers.values():
            p.server.stop(0)


def chain(sites: Sites, run_id: str, order: list[str], visit_seconds: float) -> None:
    """Report, site after site, what a FedELMY chain's sites report (S = 2, E = 1, Ew = 1)."""
    from fedrelay.v1 import common_pb2, coordinator_pb2 as cpb

    schema = hashlib.sha256(b"schema").hexdigest()
    sha = lambda k: hashlib.sha256(f"{run_id}/{k}".encode()).hexdigest()  # noqa: E731

    def state(site, s, detail=""):
        sites.stubs[site].ReportProgress(cpb.ProgressReport(run_id=run_id, site=site, kind="state", state=s,
                                                            detail=detail), timeout=30)

    def epoch(site, stage, model, k):
        time.sleep(visit_seconds / (S * E + (EW if k == 0 else 0)))
        sites.stubs[site].ReportProgress(cpb.ProgressReport(
            run_id=run_id, site=site, kind="epoch", stage=stage, model=model, epoch=1, epochs=1, train_loss=0.5,
            val_accuracy=0.7, seconds=0.1), timeout=30)

    def transfer(purpose, hop, sender, receiver, digest):
        now = time.time()
        sites.stubs[sender].ReportHop(cpb.HopReport(
            run_id=run_id, hop=hop, purpose=purpose, sender=sender, receiver=receiver, payload_bytes=MODEL_BYTES,
            wire_bytes=MODEL_BYTES, sha256=digest, started=now - 0.01, ended=now, attempts=1,
            schema_sha256=schema), timeout=30)
        sites.stubs[receiver].ReportReceipt(cpb.ReceiptReport(
            run_id=run_id, purpose=purpose, hop=hop, sender=sender, receiver=receiver, payload_bytes=MODEL_BYTES,
            sha256=digest, schema_sha256=schema, received=now), timeout=30)

    for k, site in enumerate(order):
        if k:
            state(site, "receiving", f"hop {k} from {order[k - 1]}")
        state(site, "training")
        if k == 0:
            epoch(site, "warmup", 0, k)
        for m in range(1, S + 1):
            epoch(site, "pool", m, k)
        if k + 1 < len(order):
            state(site, "sending", f"hop {k + 1} to {order[k + 1]}")
            transfer(common_pb2.CHAIN_HOP, k + 1, site, order[k + 1], sha(k + 1))
            state(site, "done")
    last = order[-1]
    state(last, "distributing", "final model to every site")
    final = sha("final")
    for other in order[:-1]:
        transfer(common_pb2.FINAL_MODEL, 0, last, other, final)
    sites.stubs[last].ReportFinal(cpb.FinalReport(run_id=run_id, site=last, sha256=final, model_bytes=MODEL_BYTES),
                                  timeout=30)
    state(last, "done")


def measure(n: int, visit_seconds: float, work: Path) -> dict:
    """One N-site chain against a fresh coordinator: its CPU seconds and SQLite writes per hop."""
    from fedrelay import params as run_params
    from fedrelay.coordinator.client import OperatorClient

    work.mkdir(parents=True, exist_ok=True)
    coord = CoordinatorProcess(work)
    sites = None
    try:
        with OperatorClient(coord.address) as op:
            deadline = time.monotonic() + 60
            while True:
                try:
                    op.peers()
                    break
                except grpc.RpcError:
                    if time.monotonic() > deadline or coord.proc.poll() is not None:
                        raise RuntimeError(f"the coordinator did not start (see {work / 'coordinator.log'})")
                    time.sleep(0.2)
            sites = Sites(coord.address, n)
            sites.start()
            time.sleep(1.5)  # past the monitor's first ticks
            cpu0, c0, beats0 = coord.cpu_seconds(), coord.counts(), sites.heartbeats
            t0 = time.monotonic()
            reply = op.start_chain(peers=sites.names, order="given", seed=0, model="cnn",
                                   params=run_params.to_pb(PARAMS))
            watched = []
            watcher = threading.Thread(target=lambda: watched.extend(op.watch(reply.run_id)), daemon=True)
            watcher.start()
            chain(sites, reply.run_id, list(reply.order), visit_seconds)
            watcher.join(300)
            summary = op.run(reply.run_id)
            wall = time.monotonic() - t0
            cpu1, c1 = coord.cpu_seconds(), coord.counts()
            beats = sites.heartbeats - beats0
    finally:
        if sites is not None:
            sites.close()
        coord.stop()
    hops = n - 1
    if summary["status"] != "finished" or summary["total_bytes"] != hops * MODEL_BYTES:
        raise RuntimeError(f"{n} sites: run ended {summary['status']} ({summary.get('error')}), "
                           f"total {summary['total_bytes']}")
    return {"sites": n, "hops": hops, "wall_s": round(wall, 2), "events": len(watched), "heartbeats": beats,
            "heartbeat_s": sites.heartbeat_seconds,
            "cpu_s": round(cpu1 - cpu0, 3), "cpu_ms_per_hop": round(1000 * (cpu1 - cpu0) / hops, 2),
            "writes": c1["writes"] - c0["writes"], "writes_per_hop": round((c1["writes"] - c0["writes"]) / hops, 2),
            "reads_per_hop": round((c1["reads"] - c0["reads"]) / hops, 1),
            "evaluated": len(summary["final"]["per_site"])}


def coordinator_only(ns: list[int], visit_seconds: float, work: Path, publish: bool) -> dict:
    rows = []
    for n in ns:
        row = measure(n, visit_seconds, work / f"n{n}")
        print(json.dumps(row), flush=True)
        rows.append(row)
    by_n = {r["sites"]: r for r in rows}
    figures = {
        "coordinator": rows,
        "summary": "The coordinator's cost per hop of a FedELMY chain (S = 2, E = 1, Ew = 1) of N synthetic "
                   "sites (fake peers: real gRPC, real coordinator process and ledger, no training; each "
                   f"visit {visit_seconds:g} s), heartbeats at the period the coordinator asks for and one "
                   "watcher included.",
        "tables": [{"title": "coordinator cost per hop (from StartChain to the run's end, divided by N-1 hops)",
                    "columns": ["sites", "hops", "wall s", "coordinator CPU s", "CPU ms/hop", "SQLite write "
                                "transactions/hop", "SQLite reads/hop", "heartbeat period s", "heartbeats", "events watched",
                                "sites evaluated"],
                    "rows": [[r["sites"], r["hops"], r["wall_s"], r["cpu_s"], r["cpu_ms_per_hop"],
                              r["writes_per_hop"], r["reads_per_hop"], r.get("heartbeat_s"), r["heartbeats"], r["events"],
                              r["evaluated"]] for r in rows]}],
        "notes": [],
    }
    if 10 in by_n and 100 in by_n:
        ratio = by_n[100]["cpu_ms_per_hop"] / by_n[10]["cpu_ms_per_hop"]
        figures["cpu_per_hop_100_over_10"] = round(ratio, 3)
        figures["notes"].append(f"coordinator CPU per hop at 100 sites / at 10 sites: {ratio:.2f}x (target <= 1.5x)")
    figures["notes"].append("per-run costs that grow with N (assignments, final copies, evaluations, end notices) "
                            "are spread over the N-1 hops; heartbeats of idle sites grow with N x the run's wall "
                            "time, and are counted too")
    if publish:
        record("scale", figures, sub="coordinator")
    return figures


# -- the launcher and real chains -----------------------------------------------------------------
def fake_peer(name: str, listen: str, coordinator: str) -> None:
    """A fake daemon process for launcher dry runs: serves the fake Peer at ``listen``,
    registers with ``coordinator`` and heartbeats until SIGTERM."""
    from fedrelay.v1 import coordinator_pb2_grpc

    peer = FakePeer(name, listen)
    stub = coordinator_pb2_grpc.CoordinatorStub(grpc.insecure_channel(coordinator))
    sites = Sites.__new__(Sites)
    sites.peers, sites.stubs, sites.heartbeat_seconds = {name: peer}, {name: stub}, 10
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    while not stop.is_set():
        try:
            sites.register(name)
        except grpc.RpcError:
            stop.wait(0.5)
            continue
        stop.wait(sites.heartbeat_seconds)
    peer.server.stop(0)


def launcher_dry_run(n: int, work: Path, start_concurrency: int) -> dict:
    """``deploy/local_trial.py``'s LocalTrial at ``n`` sites with fake daemons (this module's
    ``--fake-peer``): ports, staggered start-up, the readiness wait, logs and teardown."""

    from deploy import local_trial as lt
    lt.raise_open_files_limit()

    class DryTrial(lt.LocalTrial):
        def peer_argv(self, site_dir, security):
            return [sys.executable, "-m", "bench.scale", "--fake-peer", site_dir.name, self.addresses[site_dir.name],
                    self.coordinator]

    dirs = [work / "sites" / f"site-{i:03d}" for i in range(n)]
    t0 = time.monotonic()
    trial = DryTrial(work / "trial", dirs, insecure=True, start_concurrency=start_concurrency,
                     env={"PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    with trial:
        started = time.monotonic() - t0
        assert len(set(trial.addresses.values())) == n + 1, "two daemons were given one port"
        pids = [p.pid for p in trial.procs.values()]
        rss = process_tree_rss(pids)
    stopped = time.monotonic() - t0 - started
    left = [name for name, p in trial.procs.items() if p.poll() is None]
    return {"sites": n, "start_s": round(started, 1), "stop_s": round(stopped, 1), "rss_bytes": rss,
            "logs": len(list((work / "trial" / "logs").glob("*.log"))), "still_running": left}


def main(argv=None) -> dict | None:
    ap = argparse.ArgumentParser(description="The scale study (the coordinator's part)")
    ap.add_argument("--serve-coordinator", nargs=3, metavar=("LISTEN", "DB", "STATS"), help=argparse.SUPPRESS)
    ap.add_argument("--fake-peer", nargs=3, metavar=("NAME", "LISTEN", "COORDINATOR"), help=argparse.SUPPRESS)
    ap.add_argument("--coordinator-only", action="store_true", help="synthetic sites against a real coordinator")
    ap.add_argument("--chains", default="", metavar="N,N",
                    help="real chains of N peer daemons on Fashion-MNIST (e.g. 10,100: the issue's study)")
    ap.add_argument("--source", type=Path, default=None, help="--chains: the Fashion-MNIST IDX folder")
    ap.add_argument("--launcher-dry-run", type=int, default=0, metavar="N",
                    help="start and stop N fake daemons with deploy/local_trial.py's launcher (no training)")
    ap.add_argument("--start-concurrency", type=int, default=8)
    ap.add_argument("--sites", default="3,10,30,100", help="N values, comma-separated")
    ap.add_argument("--visit-seconds", type=float, default=1.0, help="each synthetic visit's pretend training time")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--no-record", action="store_true", help="print, do not write bench/results.json")
    args = ap.parse_args(argv)
    if args.serve_coordinator:
        serve_coordinator(*args.serve_coordinator)
        return None
    if args.fake_peer:
        fake_peer(*args.fake_peer)
        return None
    work = args.workdir or Path(tempfile.mkdtemp(prefix="fedrelay-bench-scale-"))
    if args.launcher_dry_run:
        row = launcher_dry_run(args.launcher_dry_run, work, args.start_concurrency)
        print(json.dumps(row))
        return row
    if args.chains:
        return real_study([int(x) for x in args.chains.split(",")], work, args.source, not args.no_record,
                          args.start_concurrency)
    if not args.coordinator_only:
        ap.error("say --coordinator-only, --chains N,N or --launcher-dry-run N")
    ns = [int(x) for x in args.sites.split(",")]
    return coordinator_only(ns, args.visit_seconds, work, publish=not args.no_record)


if __name__ == "__main__":
    main()
