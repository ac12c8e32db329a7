"""``peer``: the site daemon's command line."""

from __future__ import annotations

from pathlib import Path

import typer

from fedrelay.cli.common import INSECURE_HELP, TLS_HELP, fail, setup_logging, stop_on_sigterm, transport_from

app = typer.Typer(help="fedrelay peer: one daemon per site (institution).", no_args_is_help=True,
                  add_completion=False)


@app.callback()
def main() -> None:
    """fedrelay peer: one daemon per site (institution)."""


@app.command()
def serve(
    data: Path = typer.Option(..., "--data", help="Site folder: train/<class>/*.png|jpg and test/<class>/*."),
    name: str = typer.Option(..., "--name", help="This site's name (unique in the federation)."),
    listen: str = typer.Option("127.0.0.1:0", "--listen", help="HOST:PORT to listen on (port 0: any free port)."),
    coordinator: str = typer.Option("127.0.0.1:50070", "--coordinator", envvar="FEDRELAY_COORDINATOR",
                                    help="HOST:PORT of the coordinator."),
    state_dir: Path = typer.Option(None, "--state-dir", help="Where runs and models are kept \\[default: ./.fedrelay/<name>]."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda:N"),
    advertise: str = typer.Option(None, "--advertise", help="HOST:PORT other sites use to reach this peer \\[default: the listen address]."),
    tls: Path = typer.Option(None, "--tls", help=TLS_HELP + " Here: the folder `coordinator enroll NAME` wrote.",
                             file_okay=False),
    insecure: bool = typer.Option(False, "--insecure", help=INSECURE_HELP),
    stall_timeout: float = typer.Option(60.0, "--stall-timeout",
                                        help="Seconds a sender may send nothing before its handoff is dropped."),
    deterministic: bool = typer.Option(True, "--deterministic/--no-deterministic",
                                       help="On a CUDA GPU: deterministic cuDNN/cuBLAS kernels, so that the same "
                                            "seed gives the same models (slower; the CPU is always deterministic)."),
    weights_dir: Path = typer.Option(None, "--weights-dir", file_okay=False,
                                     help="Initial-weights files this site holds (start-chain --init file finds "
                                          "them by SHA-256) \\[default: <state-dir>/weights]."),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
) -> None:
    """Serve a site: receive models from the predecessor, train the model pool, send to the successor."""
    transport = transport_from(tls, insecure)
    setup_logging(verbose, prefix=f"[{name}] ")
    stop_on_sigterm()
    from fedrelay.peer.daemon import serve as run_daemon
    from fedrelay.peer.data import DataError

    try:
        run_daemon(data_dir=data, name=name, listen=listen, coordinator=coordinator,
                   state_dir=state_dir or Path(".fedrelay") / name, device=device, advertise=advertise,
                   transport=transport, stall_timeout=stall_timeout, deterministic=deterministic,
                   weights_dir=weights_dir)
    except (DataError, ValueError, RuntimeError) as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        pass


@app.command()
def status(
    peer: str = typer.Option(..., "--peer", help="HOST:PORT of a peer daemon."),
    tls: Path = typer.Option(None, "--tls", help=TLS_HELP + " Peers answer only the coordinator's identity "
                             "(PKI/coordinator).", file_okay=False),
    insecure: bool = typer.Option(False, "--insecure", help=INSECURE_HELP),
) -> None:
    """Ask a peer daemon for its state and runs."""
    transport = transport_from(tls, insecure)
    import grpc
    from rich.table import Table

    from fedrelay import wire
    from fedrelay.cli.common import console
    from fedrelay.v1 import peer_pb2, peer_pb2_grpc

    try:
        with transport.channel(peer) as ch:
            st = peer_pb2_grpc.PeerStub(ch).GetStatus(peer_pb2.StatusRequest(), timeout=wire.CONTROL_TIMEOUT)
    except grpc.RpcError as exc:
        fail(f"peer at {peer}: {wire.status_message(exc)}")
    console.print(f"peer [bold]{st.name}[/] at {st.address}, device {st.device}, fedrelay {st.version}", highlight=False)
    t = Table(title="runs")
    for col in ("run", "state", "detail"):
        t.add_column(col)
    for r in st.runs:
        t.add_row(r.run_id, r.state, r.detail)
    console.print(t)


@app.command()
def prune(
    state_dir: Path = typer.Option(..., "--state-dir", file_okay=False,
                                   help="The peer's state dir (`peer serve --state-dir`)."),
    older_than: float = typer.Option(..., "--older-than", help="Remove the runs that ended more than DAYS days "
                                     "ago (0: every ended run).", metavar="DAYS"),
    dry_run: bool = typer.Option(False, "--dry-run", help="Only print what would be removed."),
) -> None:
    """Delete the files of ended runs (finished, failed, cancelled) older than --older-than days
    from a peer's state dir; never a running run's. Works while the daemon runs or not."""
    from fedrelay.cli.common import console
    from fedrelay.peer.retention import prune as do_prune

    try:
        found = do_prune(state_dir, older_than, dry_run=dry_run)
    except (ValueError, OSError) as exc:
        fail(str(exc))
    gone = [r for r in found if r.pruned]
    verb = "would remove" if dry_run else "removed"
    for r in gone:
        console.print(f"{verb} run {r.run_id} ({r.status}, {r.bytes:,} bytes)", highlight=False)
    kept = len(found) - len(gone)
    console.print(f"{verb} {len(gone)} run(s), {sum(r.bytes for r in gone):,} bytes; kept {kept} "
                  f"(running, or ended within {older_than:g} days)", highlight=False)


if __name__ == "__main__":
    app()
