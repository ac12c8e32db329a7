#!/usr/bin/env python3
"""A multi-host trial on one Linux machine: every daemon on its own host (a network namespace
with its own address), joined by veth links to a switch (a bridge in a namespace of its own),
with faults injected on purpose. Needs root and iproute2 (``ip netns``).

    sudo python deploy/netns_trial.py --sites 5 --faults kill-peer,link-down,kill-coordinator

For each run it prints and records (``--report``, default deploy/FAULTS.md) the faults
injected, whether the run completed, its final model SHA-256 against the undisturbed run with
the same seed, and the time each fault cost. Faults:

- ``kill-peer``: SIGKILL the second site of the chain in the middle of its training (after its
  first pool model), then start it again with the same command;
- ``link-down``: take the last site's link down once its predecessor starts training, keep it
  down for ``--link-down-seconds`` (the hop into it meets the outage and is retried), bring it
  back;
- ``kill-coordinator``: SIGKILL the coordinator after the first hop, start it again.

Addresses: 10.77.<n>.0/24 (``--subnet``), coordinator .1, sites .11 on; the machine itself
gets .254 on the switch so that the operator's CLI reaches the coordinator. Every namespace,
link and process it made is removed on exit, also on Ctrl-C or failure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from local_trial import LocalTrial, _tool, ensure_fashion_mnist  # noqa: E402

PORT = 50070


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def netns_available() -> tuple[bool, str]:
    """(True, "") when this process can build network namespaces, else (False, why)."""
    if os.geteuid() != 0:
        return False, "needs root (network namespaces)"
    if shutil.which("ip") is None:
        return False, "needs iproute2 (the ip command)"
    probe = f"frprobe{os.getpid() % 100000}"
    res = ip("netns", "add", probe, check=False)
    if res.returncode != 0:
        return False, f"ip netns add failed: {res.stderr.strip()}"
    ip("netns", "del", probe, check=False)
    return True, ""


class NetnsTrial(LocalTrial):
    """``LocalTrial`` with each daemon on its own host: a namespace, a veth link, an address."""

    def __init__(self, *args, subnet: int = 77, **kw):
        self.tag = f"fr{os.getpid() % 10000}"
        self.subnet = subnet
        super().__init__(*args, **kw)
        self.hosts = {name: f"{self.tag}-{i}" for i, name in enumerate(["coordinator", *self.names])}
        self.links = {name: f"{self.tag}b{i}" for i, name in enumerate(["coordinator", *self.names])}
        self.switch = f"{self.tag}-sw"
        self.built: list[str] = []

    def plan_addresses(self) -> dict[str, str]:
        out = {"coordinator": f"10.{self.subnet}.0.1:{PORT}"}
        out.update({name: f"10.{self.subnet}.0.{11 + i}:{PORT}" for i, name in enumerate(self.names)})
        return out

    def host_prefix(self, name: str) -> list[str]:
        return ["ip", "netns", "exec", self.hosts[name]]

    def setup_network(self) -> None:
        ip("netns", "add", self.switch)
        self.built.append(self.switch)
        sw = ["netns", "exec", self.switch]
        ip(*sw, "ip", "link", "add", "br0", "type", "bridge")
        ip(*sw, "ip", "link", "set", "br0", "up")
        for name, ns in self.hosts.items():
            ip("netns", "add", ns)
            self.built.append(ns)
            inner, outer = f"{self.tag}h", self.links[name]
            ip("link", "add", inner, "netns", ns, "type", "veth", "peer", "name", outer, "netns", self.switch)
            ip(*sw, "ip", "link", "set", outer, "master", "br0")
            ip(*sw, "ip", "link", "set", outer, "up")
            host = self.addresses[name].rsplit(":", 1)[0]
            ip("netns", "exec", ns, "ip", "addr", "add", f"{host}/24", "dev", inner)
            ip("netns", "exec", ns, "ip", "link", "set", inner, "up")
            ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        # The machine itself joins the switch, so the operator's CLI reaches the coordinator.
        ip("link", "add", f"{self.tag}op", "type", "veth", "peer", "name", f"{self.tag}bo", "netns", self.switch)
        ip(*sw, "ip", "link", "set", f"{self.tag}bo", "master", "br0")
        ip(*sw, "ip", "link", "set", f"{self.tag}bo", "up")
        ip("addr", "add", f"10.{self.subnet}.0.254/24", "dev", f"{self.tag}op")
        ip("link", "set", f"{self.tag}op", "up")
        self.built.append(f"link:{self.tag}op")

    def teardown_network(self) -> None:
        for item in reversed(self.built):
            if item.startswith("link:"):
                ip("link", "del", item[5:], check=False)
            else:
                ip("netns", "del", item, check=False)
        self.built.clear()

    def link(self, name: str, up: bool) -> None:
        """Take ``name``'s link to the switch down or up."""
        ip("netns", "exec", self.switch, "ip", "link", "set", self.links[name], "up" if up else "down")


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except Exception:  # noqa: BLE001 - files appear, daemons restart
            value = None
        if value:
            return value
        time.sleep(0.1)
    raise RuntimeError(f"timed out waiting for {what}")


def run_chain(trial: NetnsTrial, seed: int, chain_args: list[str], faults: list[str], link_down: float) -> dict:
    """One chain with ``faults`` injected; returns the run summary plus what was done and when."""
    from fedrelay.coordinator.client import OperatorClient

    res = trial.cli("start-chain", "--seed", str(seed), "--json", *chain_args, capture_output=True, text=True,
                    timeout=120)
    if res.returncode != 0:
        raise RuntimeError(f"start-chain failed: {res.stderr.strip()}")
    run_id = json.loads(res.stdout)["run_id"]
    started = time.monotonic()

    def summary():
        with OperatorClient(trial.coordinator, trial.transport()) as c:
            return c.run(run_id)

    order = wait_until(summary, 60, "the run")["order"]
    state = lambda site: trial.workdir / "state" / site / "runs" / run_id  # noqa: E731
    done = []
    if "kill-peer" in faults:
        victim = order[1]
        wait_until((state(victim) / "pool" / "model-1.safetensors").exists, 1800, f"{victim}'s first pool model")
        trial.kill(victim)
        done.append(f"kill -9 {victim} after its first pool model, at {time.monotonic() - started:.1f} s")
        trial.restart(victim)
    if "link-down" in faults:
        # Cut the last site off while its predecessor trains, so that the hop into it meets the outage.
        victim, sender = order[-1], order[-2]
        wait_until(lambda: json.loads((state(sender) / "state.json").read_text())["state"] == "training", 1800,
                   f"{sender} to train")
        trial.link(victim, up=False)
        done.append(f"link of {victim} down at {time.monotonic() - started:.1f} s for {link_down:.0f} s, "
                    f"while {sender} trained and then sent")
        time.sleep(link_down)
        trial.link(victim, up=True)
    if "kill-coordinator" in faults:
        wait_until(lambda: summary()["hops"], 1800, "the first hop")
        trial.kill("coordinator")
        done.append(f"kill -9 coordinator after hop 1, at {time.monotonic() - started:.1f} s")
        time.sleep(1.0)
        trial.restart("coordinator")
    final = wait_until(lambda: (s := summary())["status"] != "running" and s, 3600, "the run to end")
    return {**final, "faults": done, "wall_seconds": time.monotonic() - started}


def write_report(path: Path, sites: int, baseline: dict, disturbed: list[tuple[str, dict]]) -> None:
    lines = ["# Fault-injected trial", "",
             f"Generated by `deploy/netns_trial.py` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: "
             f"{sites} sites and a coordinator, each in its own network namespace with its own address, "
             "mutual TLS, one chain per scenario with the same seed.", "",
             "| scenario | faults injected | status | final SHA-256 | same as undisturbed | wall s | time lost s |",
             "|---|---|---|---|---|---|---|",
             f"| undisturbed | none | {baseline['status']} | `{(baseline['final'] or {}).get('sha256', '-')[:16]}…` "
             f"| — | {baseline['wall_seconds']:.1f} | — |"]
    for name, run in disturbed:
        sha = (run["final"] or {}).get("sha256", "-")
        same = "yes" if sha == (baseline["final"] or {}).get("sha256") else "**no**"
        lines.append(f"| {name} | {'; '.join(run['faults'])} | {run['status']} | `{sha[:16]}…` | {same} | "
                     f"{run['wall_seconds']:.1f} | {run['wall_seconds'] - baseline['wall_seconds']:.1f} |")
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    chain_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, chain_args = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sites", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", type=Path, default=Path("netns-trial"))
    ap.add_argument("--source", type=Path, default=None, help="Fashion-MNIST IDX folder")
    ap.add_argument("--max-train-per-site", type=int, default=2000)
    ap.add_argument("--faults", default="kill-peer,link-down,kill-coordinator",
                    help="comma-separated scenarios, each run separately after an undisturbed run")
    ap.add_argument("--link-down-seconds", type=float, default=20.0)
    ap.add_argument("--subnet", type=int, default=77, help="use 10.SUBNET.0.0/24")
    ap.add_argument("--report", type=Path, default=Path(__file__).resolve().parent / "FAULTS.md")
    args = ap.parse_args(argv)
    chain_args = chain_args or ["--models-per-site", "3", "--local-epochs", "2", "--warmup-epochs", "1"]

    ok, why = netns_available()
    if not ok:
        print(f"error: the namespace trial {why}", file=sys.stderr)
        return 2
    ensure_fashion_mnist(args.source)
    sites_dir = args.workdir / "sites"
    if not (sites_dir / "split.json").exists():
        split = [_tool("coordinator"), "split-dataset", "fashion-mnist", "--sites", str(args.sites), "--seed",
                 str(args.seed), "--out", str(sites_dir), "--max-train-per-site", str(args.max_train_per_site)]
        if args.source:
            split += ["--source", str(args.source)]
        subprocess.run(split, check=True)
    site_dirs = sorted(p for p in sites_dir.iterdir() if p.is_dir() and p.name.startswith("site-"))

    def _terminate(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with NetnsTrial(args.workdir / "trial", site_dirs, subnet=args.subnet) as trial:
            print("hosts: " + ", ".join(f"{n} {a}" for n, a in trial.addresses.items()), flush=True)
            # A first chain warms every daemon up (imports, caches) so that the undisturbed run
            # that faults are compared with is not slowed by one-time costs.
            warm = run_chain(trial, args.seed, chain_args, [], 0)
            baseline = run_chain(trial, args.seed, chain_args, [], 0)
            if (warm["final"] or {}).get("sha256") != (baseline["final"] or {}).get("sha256"):
                raise RuntimeError("two undisturbed runs with the same seed gave different final models")
            print(f"undisturbed: {baseline['status']}, final {baseline['final']['sha256'][:16]}, "
                  f"{baseline['wall_seconds']:.1f} s", flush=True)
            disturbed = []
            for scenario in [f for f in args.faults.split(",") if f]:
                run = run_chain(trial, args.seed, chain_args, [scenario], args.link_down_seconds)
                same = (run["final"] or {}).get("sha256") == baseline["final"]["sha256"]
                print(f"{scenario}: {run['status']}, same final model: {same}, {run['wall_seconds']:.1f} s "
                      f"({'; '.join(run['faults'])})", flush=True)
                disturbed.append((scenario, run))
        write_report(args.report, len(site_dirs), baseline, disturbed)
        print(f"report: {args.report}")
        return 0 if all(r["status"] == "finished" and r["final"]["sha256"] == baseline["final"]["sha256"]
                        for _, r in disturbed) else 1
    except KeyboardInterrupt:
        print("interrupted: stopped every process and removed every namespace", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
