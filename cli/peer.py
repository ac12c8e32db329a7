"""``peer``: the site daemon's command line."""

from __future__ import annotations

from pathlib import Path

import typer

from fedrelay.cli.common import (CONTEXT_SETTINGS, ENV_COORDINATOR, ENV_INSECURE, ENV_TLS, INSECURE_HELP, TLS_HELP,
                                 fail, setup_logging, stop_on_sigterm, transport_from, version_option)

app = typer.Typer(help="fedrelay peer: one daemon per site (institution).", no_args_is_help=True,
                  add_completion=False, context_settings=CONTEXT_SETTINGS)

INSECURE = typer.Option(False, "--insecure", envvar=ENV_INSECURE, help=INSECURE_HELP)


@app.callback()
def main(version: bool = version_option()) -> None:
    """fedrelay peer: one daemon per site (institution)."""


@app.command()
def serve(
    data: Path = typer.Option(..., "--data", help="Site folder: train/<class>/*.png|jpg and test/<class>/*."),
    name: str = typer.Option(..., "--name", help="This site's name (unique in the federation)."),
    listen: str = typer.Option("127.0.0.1:0", "--listen", help="HOST:PORT to listen on (port 0: any free port)."),
    coordinator: str = typer.Option("127.0.0.1:50070", "--coordinator", envvar=ENV_COORDINATOR,
                                    help="HOST:PORT of the coordinator."),
    state_dir: Path = typer.Option(None, "--state-dir", help="Where runs and models are kept \\[default: ./.fedrelay/<name>]."),
    device: str = typer.Option("auto", "--device", help="auto | cpu | cuda:N"),
    advertise: str = typer.Option(None, "--advertise", help="HOST:PORT other sites use to reach this peer \\[default: the listen address]."),
    tls: Path = typer.Option(None, "--tls", envvar=ENV_TLS,
                             help=TLS_HELP + " Here: the folder `coordinator enroll NAME` wrote.", file_okay=False),
    insecure: bool = INSECURE,
    stall_timeout: float = typer.Option(60.0, "--stall-timeout",
                                        help="Seconds a sender may send nothing before its handoff is dropped."),
    deterministic: bool = typer.Option(True, "--deterministic/--no-deterministic",
                                       help="On a CUDA GPU: deterministic cuDNN/cuBLAS kernels, so that the same "
                                            "seed gives the same models (slower; the CPU is always deterministic)."),
    weights_dir: Path = typer.Option(None, "--weights-dir", file_okay=False,
                                     help="Initial-weights files this site holds (start-chain --init file finds "
                                          "them by SHA-256) \\[default: <state-dir>/weights]."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log debug messages too."),
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
    tls: Path = typer.Option(None, "--tls", envvar=ENV_TLS, help=TLS_HELP + " Peers answer only the coordinator's "
                             "identity (PKI/coordinator).", file_okay=False),
    insecure: bool = INSECURE,
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
        fail(wire.transport_mismatch(exc, peer, transport.secure, what="peer")
             or f"peer at {peer}: {wire.status_message(exc)}")
    console.print(f"peer [bold]{st.name}[/] at {st.address}, device {st.device}, fedrelay {st.version}", highlight=False)
    t = Table(title="runs")
    for col in ("run", "state", "detail"):
        t.add_column(col)
    for r in st.runs:
        t.add_row(r.run_id, r.state, r.detail)
    console.print(t)


if __name__ == "__main__":
    app()
