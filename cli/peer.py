"""``peer``: the site daemon's command line."""

from __future__ import annotations

from pathlib import Path

import typer

from fedrelay.cli import exits
from fedrelay.cli.common import (ENV_COORDINATOR, ENV_TLS, INSECURE, METRICS_LISTEN, TLS_HELP, address_callback,
                                 config_option, err_console, fail, json_option, make_app, setup_logging,
                                 stop_on_sigterm, transport_from, version_option)

app = make_app("fedrelay peer: one daemon per site (institution).", env_prefix="FEDRELAY_PEER")



@app.callback()
def main(version: bool = version_option()) -> None:
    """fedrelay peer: one daemon per site (institution)."""


@app.command()
def serve(
    ctx: typer.Context,
    config: Path = config_option("peer serve"),
    data: Path = typer.Option(..., "--data", envvar="FEDRELAY_DATA", help="Site folder: train/<class>/*.png|jpg and test/<class>/*."),
    name: str = typer.Option(..., "--name", envvar="FEDRELAY_NAME", help="This site's name (unique in the federation)."),
    listen: str = typer.Option("127.0.0.1:0", "--listen", envvar="FEDRELAY_LISTEN", callback=address_callback,
                               help="HOST:PORT to listen on (port 0: any free port). The default reaches only "
                                    "this host: a warning, refused when the coordinator is elsewhere; pass "
                                    "--listen 0.0.0.0:PORT --advertise HOST:PORT for a federation across hosts."),
    coordinator: str = typer.Option("127.0.0.1:50070", "--coordinator", "-c", envvar=ENV_COORDINATOR,
                                    callback=address_callback,
                                    help="HOST:PORT of the coordinator."),
    state_dir: Path = typer.Option(None, "--state-dir", envvar="FEDRELAY_STATE_DIR", help="Where runs and models are kept \\[default: ./.fedrelay/<name>]."),
    device: str = typer.Option("auto", "--device", envvar="FEDRELAY_DEVICE", help="auto | cpu | cuda:N"),
    advertise: str = typer.Option(None, "--advertise", envvar="FEDRELAY_ADVERTISE", callback=address_callback, help="HOST:PORT other sites use to reach this peer \\[default: the listen address]."),
    tls: Path = typer.Option(None, "--tls", envvar=ENV_TLS,
                             help=TLS_HELP + " Here: the folder `peer init` wrote the site's key to.", file_okay=False),
    insecure: bool = INSECURE,
    stall_timeout: float = typer.Option(60.0, "--stall-timeout",
                                        help="Seconds a sender may send nothing before its handoff is dropped."),
    deterministic: bool = typer.Option(True, "--deterministic/--no-deterministic",
                                       help="On a CUDA GPU: deterministic cuDNN/cuBLAS kernels, so that the same "
                                            "seed gives the same models (slower; the CPU is always deterministic)."),
    weights_dir: Path = typer.Option(None, "--weights-dir", file_okay=False,
                                     help="Initial-weights files this site holds (start-chain --init file finds "
                                          "them by SHA-256) \\[default: <state-dir>/weights]."),
    metrics_listen: str = METRICS_LISTEN,
    worker_slots: int = typer.Option(3, "--worker-slots", min=1, max=64,
                                     help="At most this many worker processes (training, evaluation) at once on "
                                          "this host, shared by every site daemon of this user here. On a CPU "
                                          "each worker uses every core: several sites of a star training at once "
                                          "on a small CPU host run faster with 1 (docs/explanation/scale.md)."),
    outbound_only: bool = typer.Option(False, "--outbound-only", envvar="FEDRELAY_OUTBOUND_ONLY",
                                       help="This site accepts no inbound connection: it registers no address, "
                                            "keeps a control stream open to the coordinator, and receives models "
                                            "through the relay, sealed to its certificate key (needs --tls; "
                                            "--listen then serves only local `peer status`/`peer health`)."),
    relay_after: float = typer.Option(60.0, "--relay-after",
                                      help="Seconds a receiver with an address may stay unreachable before this "
                                           "site sends to it through the relay (TLS only; 0: never)."),
    fork_workers: bool = typer.Option(False, "--fork-workers", envvar="FEDRELAY_FORK_WORKERS",
                                      help="Fork each worker from a process that has imported torch once: a job "
                                           "starts in milliseconds instead of ~3 s of CPU, for ~680 MB more "
                                           "resident memory while the daemon runs (many short jobs, few sites "
                                           "per host)."),
    task: list[str] = typer.Option(None, "--task", envvar="FEDRELAY_TASKS",
                                   help="Offer only this task (repeat for more): an installed task's name, or "
                                        "module:attr for a task module on this daemon's Python path \\[default: "
                                        "every installed task (entry-point group fedrelay.tasks) and the built-in "
                                        "ones]."),
    crl: Path = typer.Option(None, "--crl", envvar="FEDRELAY_CRL", dir_okay=False,
                             help="A certificate revocation list file from the operator (PKI/ca/crl.pem), reloaded "
                                  "when it changes (every 10 s); the coordinator's newest list also comes with the "
                                  "heartbeats. Calls from revoked sites are refused."),
    policy: Path = typer.Option(None, "--policy", envvar="FEDRELAY_POLICY", dir_okay=False,
                                help="This site's policy file (TOML: the tasks, strategies, epochs and operators it "
                                     "accepts, and a pause switch; read again when it changes; docs/site-policy.md) "
                                     "\\[default: STATE_DIR/policy.toml if it exists]."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log debug messages too."),
    check: bool = typer.Option(False, "--check", help="Only validate the options (name, TLS identity, addresses, "
                               "device, state dir, data folder), print one line and exit 0; listens on nothing."),
) -> None:
    """Serve a site: receive models from the predecessor, train the model pool, send to the successor."""
    transport = transport_from(tls, insecure)
    source = ctx.get_parameter_source("listen")
    _judge_address(listen, advertise or None, coordinator, outbound_only,
                   chosen=getattr(source, "name", "DEFAULT") != "DEFAULT")
    if crl is not None:  # said before anything starts (--check too): a list that is not this CA's
        from fedrelay import revocation

        try:
            revocation.RevocationList(transport.ca if transport.secure else None).update(
                crl.read_bytes(), source=f"--crl {crl}")
        except OSError as exc:
            fail(f"--crl {crl}: cannot read it ({exc.strerror or exc})")
        except revocation.CrlError as exc:
            fail(str(exc))
    if check:
        _check_serve(data, name, listen, coordinator, state_dir or Path(".fedrelay") / name, device, advertise,
                     transport, stall_timeout, weights_dir, outbound_only, relay_after, task or None, policy)
        return
    setup_logging(verbose, prefix=f"[{name}] ")
    stop_on_sigterm()
    from fedrelay.peer.daemon import serve as run_daemon
    from fedrelay.task import DataError

    try:
        run_daemon(data_dir=data, name=name, listen=listen, coordinator=coordinator,
                   state_dir=state_dir or Path(".fedrelay") / name, device=device, advertise=advertise,
                   transport=transport, stall_timeout=stall_timeout, deterministic=deterministic,
                   weights_dir=weights_dir, metrics_listen=metrics_listen, worker_slots=worker_slots,
                   outbound_only=outbound_only, relay_after=relay_after, fork_workers=fork_workers,
                   tasks=task or None, crl=crl, policy=policy)
    except (DataError, ValueError) as exc:
        fail(str(exc))
    except RuntimeError as exc:
        fail(str(exc), exits.FAILED)
    except KeyboardInterrupt:
        pass


def _judge_address(listen: str, advertise: str | None, coordinator: str, outbound_only: bool, *,
                   chosen: bool) -> None:
    """Refuse an address other sites cannot reach when the coordinator is elsewhere; warn when
    only sites on this host can reach it, unless ``chosen`` (--listen given on the command line,
    in FEDRELAY_LISTEN: a trial on one host that knows it) (``fedrelay.peer.reachability``)."""
    from fedrelay.peer.reachability import judge

    verdict = judge(listen=listen, advertise=advertise, coordinator=coordinator, outbound_only=outbound_only,
                    chosen=chosen)
    if verdict.problem:
        fail(verdict.problem)
    from fedrelay.text import safe

    for w in verdict.warnings:
        err_console.print(f"[bold yellow]warning:[/] {safe(w)}", highlight=False)


def _check_serve(data, name, listen, coordinator, state_dir, device, advertise, transport, stall_timeout,
                 weights_dir, outbound_only=False, relay_after=60.0, tasks=None, policy=None) -> None:
    """``peer serve --check``: ``fedrelay.peer.preflight.check_serve_options`` and the site's
    policy file, one line, exit 0 or fail."""
    from fedrelay.cli.common import console
    from fedrelay.peer.policy import SitePolicy
    from fedrelay.peer.preflight import check_serve_options

    try:
        site_policy = SitePolicy.at(policy, state_dir).current()
    except ValueError as exc:
        fail(str(exc))

    try:
        r = check_serve_options(data_dir=data, name=name, listen=listen, coordinator=coordinator, state_dir=state_dir,
                                device=device, transport=transport, advertise=advertise, stall_timeout=stall_timeout,
                                weights_dir=weights_dir, outbound_only=outbound_only, relay_after=relay_after,
                                tasks=tasks)
    except ValueError as exc:
        fail(str(exc))
    from fedrelay.peer.reachability import is_loopback

    reach = "connects out only (models through the relay)"
    if r.address:
        host, _, port = r.address.rpartition(":")
        reach = f"dialled at {host}:{'<a free port chosen at start>' if port == '0' else port}"
        if is_loopback(host):
            reach += " (from this host only)"
    console.print(f"ok: site {name}, {'; '.join(r.lines())}, device {r.device}, {reach}, "
                  f"coordinator {coordinator}, state dir {state_dir}, "
                  f"{'site policy ' + str(policy or Path(state_dir) / 'policy.toml') if site_policy else 'no site policy'}",
                  highlight=False, soft_wrap=True, markup=False)


@app.command()
def status(
    peer: str = typer.Option(..., "--peer", callback=address_callback, help="HOST:PORT of a peer daemon."),
    tls: Path = typer.Option(None, "--tls", envvar=ENV_TLS, help=TLS_HELP + " A peer answers the coordinator's identity "
                             "(PKI/coordinator) and its own site's (the folder `coordinator enroll NAME` wrote, "
                             "which the daemon uses); other sites are refused.", file_okay=False),
    insecure: bool = INSECURE,
    as_json: bool = json_option("Print the daemon's state as one JSON object: name, address, device, version, "
                                "coordinator link, runs (run_id, state, detail)."),
) -> None:
    """Ask a peer daemon for its state and runs."""
    transport = transport_from(tls, insecure)
    import grpc
    from rich.table import Table

    from fedrelay.calls import CONTROL_TIMEOUT, status_message
    from fedrelay.transport import transport_mismatch
    from fedrelay.cli.common import console
    from fedrelay.text import safe
    from fedrelay.v1 import peer_pb2, peer_pb2_grpc

    try:
        with transport.channel(peer, expect=_own_site(transport)) as ch:
            st = peer_pb2_grpc.PeerStub(ch).GetStatus(peer_pb2.StatusRequest(), timeout=CONTROL_TIMEOUT)
    except grpc.RpcError as exc:
        hint = transport_mismatch(exc, peer, transport.secure, what="peer")
        fail(hint or f"peer at {peer}: {status_message(exc)}",
             exits.USAGE if hint else exits.for_rpc_error(exc.code(), exc.details() or ""))
    if as_json:
        import json

        print(json.dumps({"name": st.name, "address": st.address, "device": st.device, "version": st.version,
                          "coordinator": st.coordinator, "last_registered": st.last_registered or None,
                          "registration_error": st.registration_error, "started": st.started or None,
                          "runs": [{"run_id": r.run_id, "state": r.state, "detail": r.detail} for r in st.runs]},
                         indent=1))
        return
    # Every string here may quote another party (a run's end reason, a failure's details): text,
    # never markup or control (fedrelay.text.safe).
    console.print(f"peer [bold]{safe(st.name)}[/] at {safe(st.address)}, device {safe(st.device)}, "
                  f"fedrelay {safe(st.version)}", highlight=False)
    _print_link(st)
    t = Table(title="runs")
    for col in ("run", "state", "detail"):
        t.add_column(col)
    for r in st.runs:
        t.add_row(safe(r.run_id), safe(r.state), safe(r.detail))
    console.print(t)


def _print_link(st) -> None:
    """One line on the daemon's link to the coordinator (PeerStatus fields 20-23)."""
    import time

    from fedrelay.cli.common import console
    from fedrelay.text import safe

    if not st.coordinator:
        return
    now = time.time()
    seen = (f"last registered {now - st.last_registered:.0f} s ago" if st.last_registered
            else "[yellow]not registered yet[/]")
    error = f"; [red]latest attempt failed: {safe(st.registration_error)}[/]" if st.registration_error else ""
    up = f", up {now - st.started:.0f} s" if st.started else ""
    console.print(f"coordinator {safe(st.coordinator)}: {seen}{error}{up}", highlight=False)


def _own_site(transport) -> str | None:
    """The identity a daemon's certificate must name when dialled with ``transport``: a site's
    own identity asks its own daemon; the coordinator's and operator's dial by address."""
    from fedrelay.callers import COORDINATOR_IDENTITY, is_operator

    who = transport.identity
    return who if who and who != COORDINATOR_IDENTITY and not is_operator(who) else None


@app.command()
def health(
    peer: str = typer.Option(..., "--peer", callback=address_callback, help="HOST:PORT of a peer daemon."),
    tls: Path = typer.Option(None, "--tls", envvar=ENV_TLS, help=TLS_HELP + " The health service sits behind mutual TLS like "
                             "every call: the site's own folder (then the daemon's certificate must name that "
                             "site) or PKI/coordinator.", file_okay=False),
    insecure: bool = INSECURE,
    timeout: float = typer.Option(5.0, "--timeout", min=0.0, help="Seconds to wait for the answer."),
    as_json: bool = json_option('Print {"address", "status", "serving", "detail", "code"} as JSON.'),
) -> None:
    """Probe a peer daemon's gRPC health service: prints one line; exits 0 when SERVING, 1 for
    another answer, 3 when nothing answers, 4 when it refuses the caller."""
    transport = transport_from(tls, insecure)
    from fedrelay.cli.common import report_health
    from fedrelay.health import probe_result

    report_health("peer", peer, probe_result(transport, peer, expect=_own_site(transport), timeout=timeout), as_json)


@app.command()
def init(
    name: str = typer.Option(..., "--name", help="This site's name (what it passes as `peer serve --name`)."),
    state_dir: Path = typer.Option(None, "--state-dir", file_okay=False,
                                   help="The site's state dir (`peer serve --state-dir`) \\[default: ./.fedrelay/<name>]."),
    tls: Path = typer.Option(None, "--tls", file_okay=False,
                             help="Folder for the key and request (later `peer serve --tls`) \\[default: "
                                  "<state-dir>/tls]."),
    host: list[str] = typer.Option(None, "--host", help="Host name or IP other sites dial this site at (repeatable; "
                                   "goes in the certificate's SAN) \\[default: localhost, 127.0.0.1, ::1]."),
    force: bool = typer.Option(False, "--force", help="Replace a key the folder already holds (its certificate "
                               "stops working: the operator must sign the new request)."),
    as_json: bool = json_option('Print {"name", "key", "request", "request_sha256"} as JSON.'),
) -> None:
    """Make this site's private key and a certificate signing request, here at the site: send the
    request (NAME.csr) to the operator (`coordinator enroll --csr`), then put the cert.pem and
    ca.pem you get back beside the key (`peer install-cert`). The key never leaves this folder."""
    from fedrelay.cli.common import console
    from fedrelay.identity import DEFAULT_HOSTS, IdentityError, init_site

    folder = tls or (state_dir or Path(".fedrelay") / name) / "tls"
    try:
        request = init_site(name, folder, hosts=host or DEFAULT_HOSTS, force=force)
    except (IdentityError, OSError) as exc:
        fail(str(exc))
    from fedrelay.identity import load_csr, request_fingerprint

    digest = request_fingerprint(load_csr(request.read_bytes()))
    if as_json:
        import json

        print(json.dumps({"name": name, "key": str(folder / "key.pem"), "request": str(request),
                          "request_sha256": digest}))
        return
    console.print(f"site {name}: private key {folder / 'key.pem'} (mode 0600; it never leaves this host), "
                  f"request {request}", highlight=False, soft_wrap=True)
    console.print(f"request SHA-256 {digest} (read it to the operator over another channel: `enroll --csr` "
                  "prints the same)", highlight=False, soft_wrap=True)
    console.print(f"next: send {request.name} to the federation's operator, who runs\n"
                  f"  coordinator enroll --csr {request.name} --ca PKI --out DIR\n"
                  f"then put what comes back beside the key: peer install-cert DIR --tls {folder}",
                  highlight=False, soft_wrap=True)


@app.command("install-cert")
def install_cert(
    source: Path = typer.Argument(..., help="The folder the operator returned (cert.pem and ca.pem from "
                                  "`coordinator enroll --csr`; a site kit folder)."),
    tls: Path = typer.Option(..., "--tls", file_okay=False, help="The folder `peer init` wrote the key to."),
    as_json: bool = json_option('Print {"site", "tls"} (the identity installed and its folder) as JSON.'),
) -> None:
    """Check that the operator's certificate is for this site's key and from the CA, and put
    cert.pem and ca.pem beside the key: the folder is then `peer serve --tls`."""
    from fedrelay.cli.common import console
    from fedrelay.identity import IdentityError, copy_certificate
    from fedrelay.transport import Transport, TransportError

    try:
        copy_certificate(source, tls)
        t = Transport.from_dir(tls)
    except (IdentityError, TransportError, OSError) as exc:
        fail(str(exc))
    if as_json:
        import json

        print(json.dumps({"site": t.identity, "tls": str(tls)}))
        return
    console.print(f"site {t.identity}: certificate installed in {tls}; serve with `peer serve --tls {tls} ...`",
                  highlight=False, soft_wrap=True)


@app.command()
def prune(
    state_dir: Path = typer.Option(..., "--state-dir", file_okay=False,
                                   help="The peer's state dir (`peer serve --state-dir`)."),
    older_than: float = typer.Option(..., "--older-than", help="Remove the runs that ended more than DAYS days "
                                     "ago (0: every ended run).", metavar="DAYS"),
    dry_run: bool = typer.Option(False, "--dry-run", help="Only print what would be removed."),
    as_json: bool = json_option("Print the ended runs found as a JSON list (run_id, status, bytes, pruned)."),
) -> None:
    """Delete the files of ended runs (finished, failed, cancelled) older than --older-than days
    from a peer's state dir; never a running run's. Works while the daemon runs or not."""
    from fedrelay.cli.common import console
    from fedrelay.peer.retention import prune as do_prune
    from fedrelay.text import safe

    try:
        found = do_prune(state_dir, older_than, dry_run=dry_run)
    except ValueError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(str(exc), exits.FAILED)
    if as_json:
        import json

        print(json.dumps([{"run_id": r.run_id, "status": r.status, "bytes": r.bytes, "pruned": r.pruned}
                          for r in found], indent=1))
        return
    gone = [r for r in found if r.pruned]
    verb = "would remove" if dry_run else "removed"
    for r in gone:
        console.print(f"{verb} run {safe(r.run_id)} ({safe(r.status)}, {r.bytes:,} bytes)", highlight=False)
    kept = len(found) - len(gone)
    console.print(f"{verb} {len(gone)} run(s), {sum(r.bytes for r in gone):,} bytes; kept {kept} "
                  f"(running, or ended within {older_than:g} days)", highlight=False)


if __name__ == "__main__":
    app()
