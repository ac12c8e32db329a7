#!/usr/bin/env python3
"""A multi-host trial on one Linux machine: every daemon on its own host (a network namespace
with its own address), joined by veth links to a switch (a bridge in a namespace of its own),
with faults injected on purpose. Needs root and iproute2 (``ip netns``).

    sudo python deploy/netns_trial.py --sites 5 --faults kill-peer,link-down,kill-coordinator,cut-transfer,firewall

For each run it prints and records (``--report``, default deploy/FAULTS.md) the faults
injected, whether the run completed, its final model SHA-256 against the undisturbed run with
the same seed, and the time each fault cost. Faults:

- ``kill-peer``: SIGKILL the second site of the chain in the middle of its training (after its
  first pool model), then start it again with the same command;
- ``link-down``: take the last site's link down once its predecessor starts training, keep it
  down for ``--link-down-seconds`` (the hop into it meets the outage and is retried), bring it
  back;
- ``kill-coordinator``: SIGKILL the coordinator after the first hop, start it again;
- ``cut-transfer``: slow the last site's link to ``--cut-rate`` so that the hop into it takes
  seconds, take the link down in the middle of that transfer for ``--cut-seconds`` (longer than
  the peers' ``--stall-timeout``, so the receiver drops the stream and keeps its bytes), bring
  it back: the sender resumes at the receiver's offset. Its chain (two of the sites) trains
  ``--cut-model`` (a model of many 1 MiB chunks; the small CNN fits in one) for one epoch per
  site and is compared with an undisturbed run of the same chain.
- ``firewall``: the hosts of the chain's last ``--firewalled`` sites drop every inbound TCP
  connection (an nftables rule in their namespace: new TCP connections in are dropped, loopback
  and replies to their own connections pass), as a hospital's firewall does; their daemons are
  started again with ``--outbound-only`` (no address, a control stream to the coordinator).
  Their models come through the coordinator's relay, sealed to their keys. The report shows
  which transfers were relayed and the bytes of each leg; while the run lasts, every envelope
  the relay holds is copied aside and searched for the models those sites kept (no 64-byte
  window of a model may appear in an envelope). Needs ``nft`` (Debian's ``nftables``).

Addresses: 10.77.<n>.0/24 (``--subnet``), coordinator .1, sites .11 on; the machine itself
gets .254 on the switch so that the operator's CLI reaches the coordinator. Every namespace,
link and process it made is removed on exit, also on Ctrl-C or failure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import shutil
import subprocess
import sys
import time
from pathlib import Path

if not __package__:  # run as a script (python deploy/netns_trial.py): the checkout is where deploy/ is
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from deploy.launcher import chain_args_problem, ensure_fashion_mnist, guarded, split_chain_args  # noqa: E402
from deploy.local_trial import LocalTrial, tool  # noqa: E402

#: The fault scenarios ``--faults`` takes, each run on its own after the undisturbed runs.
SCENARIOS = ("kill-peer", "link-down", "kill-coordinator", "cut-transfer", "firewall")


def scenarios(text: str) -> str:
    """``--faults``: comma-separated names of :data:`SCENARIOS`; an unknown one (e.g. a misspelt
    ``firewalled``) is refused with the list, instead of running an undisturbed chain under its
    name."""
    names = [f.strip() for f in text.split(",") if f.strip()]
    bad = [f for f in names if f not in SCENARIOS]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown scenario(s) {', '.join(map(repr, bad))}; choose from "
                                         f"{', '.join(SCENARIOS)}")
    if not names:
        raise argparse.ArgumentTypeError(f"name at least one scenario: {', '.join(SCENARIOS)}")
    return ",".join(names)

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

    def new_address(self, name: str) -> str | None:
        return None  # each daemon has its own host: its fixed port cannot be taken by another trial

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

    def firewall(self, name: str, on: bool) -> None:
        """Make ``name``'s host drop (``on``) or accept again every inbound TCP connection: an
        nftables table in its namespace whose input chain drops new TCP connections that do not
        come in over loopback (replies to the host's own outbound connections still pass)."""
        ns = ["netns", "exec", self.hosts[name], "nft"]
        ip(*ns, "delete", "table", "inet", "fedrelay_fw", check=False)
        if on:
            ip(*ns, "add", "table", "inet", "fedrelay_fw")
            ip(*ns, "add", "chain", "inet", "fedrelay_fw", "input",
               "{ type filter hook input priority 0; policy accept; }")
            ip(*ns, "add", "rule", "inet", "fedrelay_fw", "input", "iifname", "lo", "accept")
            ip(*ns, "add", "rule", "inet", "fedrelay_fw", "input", "meta", "l4proto", "tcp", "ct", "state", "new", "drop")

    def refuses_connections(self, name: str, timeout: float = 2.0) -> bool:
        """True when a TCP connection from the coordinator's host to ``name``'s port does not get
        through within ``timeout`` seconds (its firewall drops it)."""
        host, port = self.addresses[name].rsplit(":", 1)
        probe = ("import socket,sys\ntry:\n socket.create_connection((sys.argv[1], int(sys.argv[2])), "
                 f"timeout={timeout})\nexcept OSError:\n sys.exit(1)")
        res = subprocess.run([*self.host_prefix("coordinator"), sys.executable, "-c", probe, host, port],
                             capture_output=True)
        return res.returncode == 1

    def throttle(self, name: str, rate: str | None) -> None:
        """Limit the traffic towards ``name`` to ``rate`` (tc's token bucket, e.g. ``80mbit``);
        ``None`` lifts the limit."""
        dev = ["dev", self.links[name], "root"]
        if rate is None:
            ip("netns", "exec", self.switch, "tc", "qdisc", "del", *dev, check=False)
        else:
            ip("netns", "exec", self.switch, "tc", "qdisc", "replace", *dev, "tbf", "rate", rate,
               "burst", "64kb", "latency", "500ms")


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


def run_chain(trial: NetnsTrial, seed: int, chain_args: list[str], faults: list[str], link_down: float,
              cut: tuple[str, float] = ("80mbit", 8.0)) -> dict:
    """One chain with ``faults`` injected; returns the run summary plus what was done and when.
    ``cut``: (link rate, seconds down) of the ``cut-transfer`` fault."""
    from fedrelay.coordinator.client import OperatorClient

    envelopes: dict[str, bytes] = {}
    stop_copying = None
    if "firewall" in faults:  # copy aside every envelope the relay holds while the run lasts
        import threading

        stop_copying = threading.Event()

        def copy_envelopes() -> None:
            while not stop_copying.wait(0.05):
                for f in (trial.workdir / "relay").rglob("*.sealed"):
                    try:
                        envelopes.setdefault(str(f.relative_to(trial.workdir)), f.read_bytes())
                    except OSError:
                        pass
        threading.Thread(target=copy_envelopes, daemon=True).start()
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
    if "cut-transfer" in faults:
        victim, sender = order[-1], order[-2]
        rate, seconds = cut
        trial.throttle(victim, rate)
        try:
            wait_until(lambda: json.loads((state(sender) / "state.json").read_text())["state"] == "sending", 3600,
                       f"{sender} to send")
            # Some MiB have arrived (and been written) when the link goes.
            part = wait_until(lambda: [p for p in state(victim).glob(".received.safetensors.*.part")
                                       if p.stat().st_size >= 4 << 20], 600, f"a partial transfer into {victim}")[0]
            held = part.stat().st_size
            trial.link(victim, up=False)
            done.append(f"link of {victim} ({rate}) down for {seconds:.0f} s at {time.monotonic() - started:.1f} s, "
                        f"{held / 2**20:.0f} MiB into the hop from {sender}")
            time.sleep(seconds)
            trial.link(victim, up=True)
            wait_until(lambda: any(h["receiver"] == victim for h in summary()["hops"]), 600, f"the hop into {victim}")
        finally:
            trial.throttle(victim, None)
    final = wait_until(lambda: (s := summary())["status"] != "running" and s, 3600, "the run to end")
    out = {**final, "faults": done, "wall_seconds": time.monotonic() - started}
    if stop_copying is not None:
        stop_copying.set()
        relayed = {h["receiver"] for h in final["hops"] + final["final_transfers"] if h["route"] == "relayed"}
        kept = [p.read_bytes() for site in relayed for p in (state(site).glob("*.safetensors"))]
        leaked = [name for name, blob in envelopes.items()
                  if any(m[i:i + 64] in blob for m in kept for i in range(0, len(m) - 64, 4093))]
        done.append(f"hosts of {', '.join(sorted(relayed))} drop every inbound TCP connection (nftables); "
                    f"{len(envelopes)} envelopes seen at the relay, {len(leaked)} holding model bytes")
        out["envelopes"], out["leaked"] = len(envelopes), leaked
    return out


def firewall_sites(trial: NetnsTrial, sites: list[str], on: bool, timeout: float = 120.0) -> None:
    """Put ``sites`` behind a firewall that drops every inbound TCP connection and restart their
    daemons with ``--outbound-only`` (``on``), or take the firewall away and restart them as
    before; wait until the coordinator sees them so (a control stream open, or an address)."""
    from fedrelay.coordinator.client import OperatorClient

    for name in sites:
        trial.kill(name)
        trial.firewall(name, on)
        argv = trial.argv[name][len(trial.host_prefix(name)):]
        if "--outbound-only" in argv:
            argv.remove("--outbound-only")
        trial.argv[name] = [*trial.host_prefix(name), *argv]
        trial.restart(name, extra=["--outbound-only"] if on else [])
        if on and not trial.refuses_connections(name):
            raise RuntimeError(f"the firewall of {name} lets connections through")

    def ready() -> bool:
        with OperatorClient(trial.coordinator, trial.transport()) as c:
            peers = {p.name: p for p in c.peers()}
        return all(n in peers and ((peers[n].outbound_only and peers[n].connected) if on else bool(peers[n].address))
                   for n in sites)
    wait_until(ready, timeout, "the restarted sites to register")


def write_report(path: Path, sites: int, baseline: dict, disturbed: list[tuple[str, dict]]) -> None:
    lines = ["# Fault-injected trial", "",
             f"Generated by `deploy/netns_trial.py` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: "
             f"{sites} sites and a coordinator, each in its own network namespace with its own address, "
             "mutual TLS, one chain per scenario with the same seed.", "",
             f"Time lost = a scenario's wall time minus the median of {len(baseline.get('walls', [0]))} "
             f"undisturbed runs ({baseline['wall_seconds']:.1f} s; they ranged over "
             f"{min(baseline.get('walls', [0])):.1f}-{max(baseline.get('walls', [0])):.1f} s, so a loss within "
             "about that spread is noise).", "",
             "| scenario | faults injected | status | final SHA-256 | same as undisturbed | wall s | time lost s "
             "| transfers retried or relayed |",
             "|---|---|---|---|---|---|---|---|"]
    for name, run, base in [("undisturbed", baseline, None), *disturbed]:
        sha = (run["final"] or {}).get("sha256", "-")
        same = "—" if base is None else "yes" if sha == (base["final"] or {}).get("sha256") else "**no**"
        lost = "—" if base is None else f"{run['wall_seconds'] - base['wall_seconds']:.1f}"
        retried = "; ".join(
            f"hop {h['hop']} {h['sender']} → {h['receiver']}: {h['attempts']} attempts"
            + (f", resumed at byte {h['resumed_from']:,} of {h['payload_bytes']:,}" if h["resumed_from"] else "")
            + f", {h['wire_bytes']:,} wire bytes" for h in run["hops"] if h["attempts"] > 1) or "none"
        relayed = [(f"hop {h['hop']}" if h in run["hops"] else "final copy") + f" {h['sender']} → {h['receiver']}"
                   for h in run["hops"] + run["final_transfers"] if h.get("route") == "relayed"]
        if relayed:
            legs = [h for h in run["hops"] + run["final_transfers"] if h.get("route") == "relayed"]
            retried += (f"; relayed, sealed: {', '.join(relayed)} (envelopes {sum(h['sealed_bytes'] for h in legs):,} "
                        f"bytes; sender → relay {sum(h['wire_bytes'] for h in legs):,}, relay → receiver "
                        f"{sum(h['relay_wire_bytes'] or 0 for h in legs):,} wire bytes)")
        lines.append(f"| {name} | {'; '.join(run['faults']) or 'none'} | {run['status']} | `{sha[:16]}…` | {same} | "
                     f"{run['wall_seconds']:.1f} | {lost} | {retried} |")
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv, chain_args = split_chain_args(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sites", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", type=Path, default=Path("netns-trial"))
    ap.add_argument("--source", type=Path, default=None, help="Fashion-MNIST IDX folder")
    ap.add_argument("--max-train-per-site", type=int, default=2000)
    ap.add_argument("--faults", type=scenarios, default="kill-peer,link-down,kill-coordinator,cut-transfer"
                    + (",firewall" if shutil.which("nft") else ""),
                    help=f"comma-separated scenarios of {', '.join(SCENARIOS)}, each run separately after an "
                         "undisturbed run (default: all; firewall only where nft is installed)")
    ap.add_argument("--link-down-seconds", type=float, default=20.0)
    ap.add_argument("--cut-rate", default="80mbit", help="cut-transfer: the last site's link rate (tc syntax)")
    ap.add_argument("--cut-seconds", type=float, default=8.0, help="cut-transfer: seconds the link stays down")
    ap.add_argument("--cut-model", default="resnet18", help="cut-transfer: the model its chain trains")
    ap.add_argument("--firewalled", type=int, default=2, help="firewall: how many of the chain's last sites drop "
                    "every inbound connection (default 2)")
    ap.add_argument("--stall-timeout", type=float, default=3.0, help="the peers' --stall-timeout (seconds)")
    ap.add_argument("--baseline-runs", type=int, default=3, help="undisturbed runs to take the median of")
    ap.add_argument("--warm-up-runs", type=int, default=1, help="undisturbed runs before those, not reported: "
                    "they warm every daemon up (imports, caches); 0 for a test that reads no timings")
    ap.add_argument("--subnet", type=int, default=77, help="use 10.SUBNET.0.0/24")
    ap.add_argument("--report", type=Path, default=Path(__file__).resolve().parent / "FAULTS.md")
    args = ap.parse_args(argv)
    chain_args = chain_args or ["--models-per-site", "3", "--local-epochs", "2", "--warmup-epochs", "1"]
    problem = chain_args_problem(chain_args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2

    ok, why = netns_available()
    if not ok:
        print(f"error: the namespace trial {why}", file=sys.stderr)
        return 2
    if "firewall" in args.faults.split(",") and shutil.which("nft") is None:
        print("error: the firewall scenario needs nft (Debian's nftables: apt-get install nftables)", file=sys.stderr)
        return 2
    ensure_fashion_mnist(args.source)
    sites_dir = args.workdir / "sites"
    if not (sites_dir / "split.json").exists():
        split = [tool("coordinator"), "split-dataset", "fashion-mnist", "--sites", str(args.sites), "--seed",
                 str(args.seed), "--out", str(sites_dir), "--max-train-per-site", str(args.max_train_per_site)]
        if args.source:
            split += ["--source", str(args.source)]
        subprocess.run(split, check=True)
    site_dirs = sorted(p for p in sites_dir.iterdir() if p.is_dir() and p.name.startswith("site-"))

    def body() -> int:
        with NetnsTrial(args.workdir / "trial", site_dirs, subnet=args.subnet,
                        peer_args=["--stall-timeout", f"{args.stall_timeout:g}"]) as trial:
            print("hosts: " + ", ".join(f"{n} {a}" for n, a in trial.addresses.items()), flush=True)
            # A first chain (--warm-up-runs) warms every daemon up (imports, caches) so that the
            # undisturbed run that faults are compared with is not slowed by one-time costs.
            warm = [run_chain(trial, args.seed, chain_args, [], 0) for _ in range(max(0, args.warm_up_runs))]
            # Several undisturbed runs: their median is what faults are compared with, their
            # spread is the noise of a "time lost" figure.
            calm = [run_chain(trial, args.seed, chain_args, [], 0) for _ in range(max(1, args.baseline_runs))]
            if len({(r["final"] or {}).get("sha256") for r in [*warm, *calm]}) != 1:
                raise RuntimeError("undisturbed runs with the same seed gave different final models")
            walls = sorted(r["wall_seconds"] for r in calm)
            baseline = {**calm[len(calm) // 2], "wall_seconds": statistics.median(walls), "walls": walls}
            print(f"undisturbed: {baseline['status']}, final {baseline['final']['sha256'][:16]}, median "
                  f"{baseline['wall_seconds']:.1f} s over {len(walls)} runs ({walls[0]:.1f}-{walls[-1]:.1f} s)",
                  flush=True)
            disturbed = []
            faults = [f for f in args.faults.split(",") if f]
            for i, scenario in enumerate(faults):
                base, cargs = baseline, chain_args
                if scenario == "cut-transfer":  # a model of many chunks, against its own undisturbed run
                    # Two sites, one epoch each: a ResNet trains slowly on CPU.
                    cargs = ["--models-per-site", "1", "--local-epochs", "1", "--warmup-epochs", "0",
                             "--model", args.cut_model, "--peers", ",".join(d.name for d in site_dirs[:2])]
                    base = run_chain(trial, args.seed, cargs, [], 0)
                    disturbed.append((f"undisturbed, {args.cut_model}", base, None))
                walled = baseline["order"][-args.firewalled:] if scenario == "firewall" else []
                if walled:
                    firewall_sites(trial, walled, on=True)
                run = run_chain(trial, args.seed, cargs, [scenario], args.link_down_seconds,
                                (args.cut_rate, args.cut_seconds))
                if walled:
                    if run.get("leaked"):
                        raise RuntimeError(f"the relay held model bytes in {run['leaked']}")
                    if i < len(faults) - 1:  # after the last scenario the trial ends, its namespaces with it
                        firewall_sites(trial, walled, on=False)
                same = (run["final"] or {}).get("sha256") == base["final"]["sha256"]
                print(f"{scenario}: {run['status']}, same final model: {same}, {run['wall_seconds']:.1f} s "
                      f"({'; '.join(run['faults'])})", flush=True)
                disturbed.append((scenario, run, base))
        write_report(args.report, len(site_dirs), baseline, disturbed)
        print(f"report: {args.report}")
        return 0 if all(b is None or (r["status"] == "finished" and r["final"]["sha256"] == b["final"]["sha256"])
                        for _, r, b in disturbed) else 1

    return guarded(body, "interrupted: stopped every process and removed every namespace")


if __name__ == "__main__":
    sys.exit(main())
