#!/usr/bin/env python3
"""A whole trial on one machine, on loopback: split a dataset into site folders, start a
coordinator and one peer daemon per site as separate OS processes, run a chain through the
real CLI (``coordinator start-chain --wait``), print its summary, and stop every process it
started (also on Ctrl-C, SIGTERM or failure).

This is what ``make demo`` runs::

    python deploy/local_trial.py --sites 10 --dirichlet 0.5 --seed 0 --workdir demo

and ``make demo-breast-cancer`` (three hospitals' tables, the built-in ``tabular-csv`` task)::

    python deploy/local_trial.py --dataset breast-cancer --sites 3 --seed 0 --workdir demo-breast-cancer \
        -- --models-per-site 3 --local-epochs 5 --warmup-epochs 5 --lr 0.01 --batch-size 32

Everything after ``--`` goes to ``coordinator start-chain`` (e.g. ``-- --strategy fedseq -S 3``);
with ``--dataset breast-cancer``, ``--task tabular-csv`` is added unless it names a ``--task``.
Logs of every process are in ``<workdir>/logs``; the ledger is ``<workdir>/ledger.sqlite``; each
site's state dir (received, pool and outgoing models) is ``<workdir>/state/<site>``.

Every channel uses mutual TLS: the launcher makes a fresh PKI in ``<workdir>/pki`` with the real
CLI (``coordinator init-ca``; then, per site, ``peer init`` makes the site's own key and request
in ``<workdir>/pki/sites/<site>`` and ``coordinator enroll --csr`` signs the request: no key is
made by the operator). ``--insecure`` runs everything in plaintext instead.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

PKI_CACHE_ENV = "FEDRELAY_TRIAL_PKI_CACHE"  # a folder keeping trials' PKIs by site names and hosts (tests)
DATASETS = ("fashion-mnist", "breast-cancer")

if __package__ in (None, ""):  # run as a script (make demo): the repository root, for ``deploy.*``
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from deploy.launcher import chain_args_problem, ensure_fashion_mnist, guarded, split_chain_args  # noqa: E402
from deploy.processes import die_with_parent, free_port, free_ports, raise_open_files_limit, tool  # noqa: E402


def port_taken(log_tail: str) -> bool:
    """Whether a daemon's log ends saying its --listen port was taken (``fedrelay/server.py``'s
    ``cannot listen on HOST:PORT: Address already in use`` / ``address in use ...``)."""
    return "cannot listen on" in log_tail and "in use" in log_tail.lower()


class LocalTrial:
    """A coordinator and peers as subprocesses on 127.0.0.1. Use as a context manager.

    ``env``: variables over this process's environment for every daemon and CLI call;
    ``site_env``: site name -> variables for that site's daemon only (over ``env``)."""

    def __init__(self, workdir: Path, site_dirs: list[Path], *, device: str = "cpu", env: dict | None = None,
                 insecure: bool = False, peer_args: list[str] | None = None,
                 coordinator_args: list[str] | None = None, start_concurrency: int = 8,
                 outbound_only: list[str] | None = None, site_env: dict[str, dict[str, str]] | None = None):
        self.insecure = insecure
        # Sites whose daemons accept no inbound connection (peer serve --outbound-only): they
        # register no address, and their models come through the coordinator's relay.
        self.outbound_only = set(outbound_only or [])
        self.peer_args = list(peer_args or [])
        self.coordinator_args = list(coordinator_args or [])
        # Peer daemons starting at once (each decodes its data and registers): at most this
        # many are started and not yet registered, so that 100 do not compete for 2 cores.
        self.start_concurrency = max(1, start_concurrency)
        self.pki = Path(workdir) / "pki"
        self.workdir = Path(workdir)
        self.site_dirs = site_dirs
        self.device = device
        self.env = {**os.environ, **(env or {})}
        # The trial's daemons share one set of worker slots (peer/slots.py): the trial's own.
        self.env.setdefault("FEDRELAY_WORKER_SLOTS_DIR", str(Path(workdir).resolve() / "worker-slots"))
        # Variables for one site's daemon only (name -> {variable: value}, over ``env``): e.g. a
        # PYTHONPATH holding the task package that site installed, as each hospital has its own.
        unknown = sorted(set(site_env or {}) - {d.name for d in site_dirs})
        if unknown:
            raise ValueError(f"site_env names no site of the trial: {', '.join(unknown)}")
        self.site_env = {name: dict(v) for name, v in (site_env or {}).items()}
        self.procs: dict[str, subprocess.Popen] = {}
        self.argv: dict[str, list[str]] = {}
        self.port_retries: dict[str, int] = {}  # site -> restarts on a new port (its port taken at its start)
        # Fixed addresses, so that a daemon restarted with the same command is found where it was.
        self.addresses = self.plan_addresses()
        self.coordinator = self.addresses["coordinator"]
        self.logs = self.workdir / "logs"

    def plan_addresses(self) -> dict[str, str]:
        """HOST:PORT of every daemon (``coordinator`` and each site): free ports on 127.0.0.1."""
        names = ["coordinator", *self.names]
        return {name: f"127.0.0.1:{port}" for name, port in zip(names, free_ports(len(names)))}

    def new_address(self, name: str) -> str | None:
        """Another HOST:PORT for site ``name`` whose planned port was taken before its daemon
        bound it (a free port is picked here but bound only after the daemon has read its data,
        seconds later: other trials or outbound connections on the machine can take it
        meanwhile); None where the address cannot change (subclasses with fixed hosts)."""
        return f"127.0.0.1:{free_port()}"

    def host_prefix(self, name: str) -> list[str]:
        """What a daemon's command runs under (a network namespace in subclasses; nothing here)."""
        return []

    def setup_network(self) -> None:
        """Build the hosts the daemons run on (nothing on loopback)."""

    def teardown_network(self) -> None:
        """Remove what ``setup_network`` built."""

    @property
    def names(self) -> list[str]:
        return [d.name for d in self.site_dirs]

    def site_tls(self, name: str) -> Path:
        """The --tls folder of site ``name``."""
        return self.pki / "sites" / name

    def security_args(self, identity: str = "operator") -> list[str]:
        """``--tls <pki>/<identity>`` (operator or coordinator), or ``--insecure``."""
        return ["--insecure"] if self.insecure else ["--tls", str(self.pki / identity)]

    def transport(self, identity: str = "operator"):
        """A ``fedrelay.transport.Transport`` with the operator's (or coordinator's) identity."""
        from fedrelay.transport import Transport

        return Transport.insecure() if self.insecure else Transport.from_dir(self.pki / identity)

    def make_pki(self) -> None:
        """A fresh CA and identities, through the real CLI: init-ca; per site, the site's own key
        and request (``peer init``), signed by the CA (``coordinator enroll --csr``)."""
        shutil.rmtree(self.pki, ignore_errors=True)
        cached = self._cached_pki()
        if cached is not None and cached.is_dir():  # the same names and hosts made before: a copy
            shutil.copytree(cached, self.pki)
            return

        def hosts(name: str) -> list[str]:
            names = dict.fromkeys(("localhost", "127.0.0.1", self.addresses[name].rsplit(":", 1)[0]))
            return [arg for h in names for arg in ("--host", h)]

        def run(step: list[str], command: str = "coordinator") -> None:
            res = subprocess.run([tool(command), *step], env=self.env, capture_output=True, text=True)
            if res.returncode != 0:
                raise RuntimeError(f"{command} {' '.join(step)} failed: {res.stderr.strip()}")

        def enrol(n: str) -> None:  # what the site does, then what the operator does
            run(["init", "--name", n, "--tls", str(self.site_tls(n)), *hosts(n)], command="peer")
            run(["enroll", "--csr", str(self.site_tls(n) / f"{n}.csr"), "--ca", str(self.pki),
                 "--out", str(self.site_tls(n))])

        run(["init-ca", "--out", str(self.pki), *hosts("coordinator")])
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:  # 100 sites: in parallel
            list(pool.map(enrol, self.names))
        if cached is not None:
            tmp = cached.with_name(cached.name + f".{os.getpid()}.tmp")
            shutil.copytree(self.pki, tmp)
            try:
                tmp.rename(cached)
            except OSError:  # another trial made it meanwhile
                shutil.rmtree(tmp, ignore_errors=True)

    def _cached_pki(self) -> Path | None:
        """Where a PKI for these site names and addresses' hosts is kept between trials, when
        ``$FEDRELAY_TRIAL_PKI_CACHE`` names a folder (the test suite sets it: every trial would
        otherwise run the same seven CLI commands for the same three sites); None otherwise (the
        demo makes its PKI anew, through the CLI, every time)."""
        folder = os.environ.get(PKI_CACHE_ENV)
        if not folder:
            return None
        key = json.dumps([[n, self.addresses[n].rsplit(":", 1)[0]] for n in sorted(self.names)]
                         + [self.addresses["coordinator"].rsplit(":", 1)[0]])
        return Path(folder) / hashlib.sha256(key.encode()).hexdigest()[:16]

    def _spawn(self, name: str, argv: list[str]) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        argv = [*self.host_prefix(name), *argv]
        self.argv[name] = argv
        log = open(self.logs / f"{name}.log", "ab")
        self.procs[name] = subprocess.Popen([*die_with_parent(), *argv], stdout=log, stderr=subprocess.STDOUT,
                                            env={**self.env, **self.site_env.get(name, {})}, start_new_session=True)
        log.close()

    def kill(self, name: str) -> None:
        """``kill -9`` one daemon (a site or ``coordinator``) and reap it."""
        p = self.procs[name]
        p.send_signal(signal.SIGKILL)
        p.wait()

    def wait_ready(self, name: str, timeout: float = 120.0) -> None:
        """Wait until a (restarted) peer daemon answers a status call."""
        import grpc

        from fedrelay.v1 import peer_pb2, peer_pb2_grpc

        transport = self.transport("coordinator")
        deadline = time.monotonic() + timeout
        while True:
            try:
                with transport.channel(self.addresses[name], expect=name) as ch:
                    peer_pb2_grpc.PeerStub(ch).GetStatus(peer_pb2.StatusRequest(), timeout=5)
                return
            except grpc.RpcError:
                if time.monotonic() > deadline or self.procs[name].poll() is not None:
                    raise RuntimeError(f"{name} did not come up: " + "; ".join(self.dead()))
                time.sleep(0.3)

    def restart(self, name: str, listen: str | None = None, extra: list[str] | None = None) -> None:
        """Start a killed daemon again with the same command (same port, state dir, ledger), or
        with ``--listen`` changed to ``listen`` (a peer that comes back on another address), and
        ``extra`` arguments added (e.g. ``--outbound-only``)."""
        if self.procs[name].poll() is None:
            raise RuntimeError(f"{name} is still running")
        argv = self.argv[name][len(self.host_prefix(name)):]
        if listen is not None:
            argv[argv.index("--listen") + 1] = listen
            self.addresses[name] = listen
        self._spawn(name, [*argv, *(extra or [])])

    def start(self, timeout: float = 180.0) -> None:
        for sub in ("state",):
            shutil.rmtree(self.workdir / sub, ignore_errors=True)
        for f in ("ledger.sqlite", "ledger.sqlite-wal", "ledger.sqlite-shm"):
            (self.workdir / f).unlink(missing_ok=True)
        shutil.rmtree(self.logs, ignore_errors=True)
        if not self.insecure:
            self.make_pki()
        self.setup_network()
        self._spawn("coordinator", [tool("coordinator"), "serve", "--listen", self.coordinator,
                                    "--db", str(self.workdir / "ledger.sqlite"), *self.security_args("coordinator"),
                                    *self.coordinator_args])
        # A budget per site: 100 daemons start a few at a time (start_concurrency).
        timeout = max(timeout, 180.0 * len(self.site_dirs) / (10 * self.start_concurrency) * 2)
        started: list[str] = []
        for d in self.site_dirs:
            if len(started) >= self.start_concurrency:
                self.wait_registered(timeout, started, pending=self.start_concurrency - 1)
            sec = ["--insecure"] if self.insecure else ["--tls", str(self.site_tls(d.name))]
            self._spawn(d.name, self.peer_argv(d, sec))
            started.append(d.name)
        self.wait_registered(timeout)

    def peer_argv(self, site_dir: Path, security: list[str]) -> list[str]:
        """The command of one site's peer daemon (``security``: ``--tls DIR`` or ``--insecure``)."""
        return [tool("peer"), "serve", "--data", str(site_dir), "--name", site_dir.name,
                "--listen", self.addresses[site_dir.name], "--coordinator", self.coordinator,
                "--state-dir", str(self.workdir / "state" / site_dir.name),
                "--device", self.device, *security, *self.peer_args,
                *(["--outbound-only"] if site_dir.name in self.outbound_only else [])]

    def wait_registered(self, timeout: float, names: list[str] | None = None, pending: int = 0) -> None:
        """Wait until at most ``pending`` of ``names`` (default: every site) are not registered
        yet; raise ``RuntimeError`` when a daemon died or after ``timeout`` seconds."""
        from fedrelay.coordinator.client import OperatorClient

        import grpc

        names = list(self.names if names is None else names)
        deadline = time.monotonic() + timeout
        with OperatorClient(self.coordinator, self.transport()) as client:
            while True:
                dead = self.dead()
                if dead and self.retry_taken_ports():
                    continue
                if dead:
                    raise RuntimeError("\n".join(dead))
                try:
                    registered = {p.name for p in client.peers()}
                except grpc.RpcError:
                    registered = set()
                if len(set(names) - registered) <= pending:
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"peers not registered after {timeout:.0f} s: "
                                       f"{sorted(set(names) - registered)} (see {self.logs})")
                time.sleep(0.5)

    def retry_taken_ports(self, attempts: int = 3) -> bool:
        """Restart on a new address (:meth:`new_address`) each site daemon that exited at its start
        because its port was taken (its log ends as :func:`port_taken` says), at most ``attempts``
        times per site. True when every exited daemon was restarted so."""
        exited = [n for n, p in self.procs.items() if p.poll() is not None]
        retry = []
        for name in exited:
            tail = (self.logs / f"{name}.log").read_text(errors="replace")[-300:]
            if name == "coordinator" or not port_taken(tail) or self.port_retries.get(name, 0) >= attempts:
                return False
            retry.append(name)
        for name in retry:
            address = self.new_address(name)
            if address is None:
                return False
            self.port_retries[name] = self.port_retries.get(name, 0) + 1
            with open(self.logs / f"{name}.log", "a") as log:
                log.write(f"(local_trial: restarting {name} on {address}: its port was taken)\n")
            self.restart(name, listen=address)
        return bool(retry)

    def dead(self) -> list[str]:
        """Daemons that have exited, each with the end of its log."""
        out = []
        for name, p in self.procs.items():
            if p.poll() is not None:
                tail = (self.logs / f"{name}.log").read_text(errors="replace")[-1500:]
                out.append(f"{name} exited with code {p.returncode}; end of {self.logs / (name + '.log')}:\n{tail}")
        return out

    def cli_watched(self, *args: str) -> int:
        """Run a ``coordinator`` command (output to this terminal) while watching the daemons:
        if one of them dies, stop the command and say which one and why."""
        cmd = subprocess.Popen([tool("coordinator"), *args, "--coordinator", self.coordinator,
                                *self.security_args()], env=self.env)
        try:
            while cmd.poll() is None:
                dead = self.dead()
                if dead:
                    cmd.terminate()
                    cmd.wait()
                    print("error: a daemon of the trial died:\n" + "\n".join(dead), file=sys.stderr)
                    return 1
                time.sleep(0.5)
            return cmd.returncode
        finally:
            if cmd.poll() is None:
                cmd.kill()
                cmd.wait()

    def cli(self, *args: str, **kw) -> subprocess.CompletedProcess:
        """Run ``coordinator ARGS --coordinator <this trial>`` with ``--tls <pki>/operator`` (or
        ``--insecure`` for an insecure trial)."""
        return subprocess.run([tool("coordinator"), *args, "--coordinator", self.coordinator,
                               *self.security_args()], env=self.env, **kw)

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.teardown_network()

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()


def main(argv: list[str] | None = None) -> int:
    argv, chain_args = split_chain_args(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", choices=DATASETS, default="fashion-mnist",
                    help="fashion-mnist (image folders, the default task) | breast-cancer (three hospitals' "
                         "tables from scikit-learn, task tabular-csv)")
    ap.add_argument("--sites", type=int, default=10, help="N sites (default 10)")
    ap.add_argument("--dirichlet", type=float, default=None,
                    help="label skew (default 0.5 for fashion-mnist, none for breast-cancer)")
    ap.add_argument("--seed", type=int, default=0, help="split and chain seed (default 0)")
    ap.add_argument("--workdir", type=Path, default=Path("demo"), help="where sites, logs, ledger go (default ./demo)")
    ap.add_argument("--source", type=Path, default=None, help="folder with the Fashion-MNIST IDX files")
    ap.add_argument("--max-train-per-site", type=int, default=None)
    ap.add_argument("--device", default="cpu", help="peers' --device (default cpu)")
    ap.add_argument("--json", action="store_true", help="print the run summary as JSON")
    ap.add_argument("--start-concurrency", type=int, default=8,
                    help="peer daemons started at once, each waited for until it registers (default 8)")
    ap.add_argument("--outbound-only", default="", metavar="SITES",
                    help="comma-separated sites whose daemons accept no inbound connection (peer serve "
                         "--outbound-only: their models come through the coordinator's relay, sealed)")
    ap.add_argument("--insecure", action="store_true",
                    help="plaintext gRPC everywhere instead of mutual TLS with a PKI made in <workdir>/pki")
    args = ap.parse_args(argv)
    problem = chain_args_problem(chain_args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2

    sites_dir = args.workdir / "sites"
    if args.dataset == "fashion-mnist":
        ensure_fashion_mnist(args.source)
        dirichlet = 0.5 if args.dirichlet is None else args.dirichlet
        split_args = ["split-dataset", "fashion-mnist", "--sites", str(args.sites), "--dirichlet", str(dirichlet),
                      "--seed", str(args.seed), "--out", str(sites_dir)]
        if args.source:
            split_args += ["--source", str(args.source)]
        if args.max_train_per_site:
            split_args += ["--max-train-per-site", str(args.max_train_per_site)]
        what = f"Fashion-MNIST into {args.sites} sites (Dirichlet {dirichlet}, seed {args.seed})"
    else:
        if args.source or args.max_train_per_site:
            print("--source and --max-train-per-site apply to fashion-mnist only", file=sys.stderr)
            return 2
        split_args = ["split-dataset", "breast-cancer", "--sites", str(args.sites), "--seed", str(args.seed),
                      "--out", str(sites_dir)]
        if args.dirichlet is not None:
            split_args += ["--dirichlet", str(args.dirichlet)]
        skew = "stratified" if args.dirichlet is None else f"Dirichlet {args.dirichlet}"
        what = f"the Wisconsin breast-cancer table into {args.sites} hospitals ({skew}, seed {args.seed})"
        if not any(a == "--task" or a.startswith("--task=") for a in chain_args):
            chain_args = ["--task", "tabular-csv", *chain_args]
    marker = args.workdir / "split-args.json"
    if not (marker.exists() and json.loads(marker.read_text()) == split_args):
        print(f"splitting {what} ...", flush=True)
        if subprocess.call([tool("coordinator"), *split_args]) != 0:
            return 2
        marker.write_text(json.dumps(split_args))
    site_dirs = sorted(p for p in sites_dir.iterdir() if p.is_dir() and p.name.startswith("site-"))[: args.sites]

    def body() -> int:
        started = time.monotonic()
        how = "plaintext (--insecure)" if args.insecure else f"mutual TLS, PKI in {args.workdir / 'pki'}"
        print(f"starting a coordinator and {len(site_dirs)} peer daemons on loopback, {how} "
              f"(logs: {args.workdir / 'logs'}) ...", flush=True)
        raise_open_files_limit()
        outbound = [n for n in args.outbound_only.split(",") if n]
        unknown = sorted(set(outbound) - {d.name for d in site_dirs})
        if unknown:
            print(f"--outbound-only names no site of this trial: {', '.join(unknown)}", file=sys.stderr)
            return 2
        with LocalTrial(args.workdir, site_dirs, device=args.device, insecure=args.insecure,
                        start_concurrency=args.start_concurrency, outbound_only=outbound) as trial:
            print(f"all {len(site_dirs)} peers registered with the coordinator at {trial.coordinator}", flush=True)
            cmd = ["start-chain", "--seed", str(args.seed), "--wait", *chain_args]
            if args.json:
                cmd.append("--json")
            rc = trial.cli_watched(*cmd)
        print(f"stopped all processes; {time.monotonic() - started:.0f} s in all", file=sys.stderr, flush=True)
        return rc

    return guarded(body, "interrupted: stopped all processes")


if __name__ == "__main__":
    sys.exit(main())
