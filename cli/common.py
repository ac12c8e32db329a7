"""Bits every fedrelay command shares: logging, errors, the --tls / --insecure rule."""

from __future__ import annotations

import logging
import sys

import typer
from rich.console import Console

console = Console()
err_console = Console(stderr=True)

INSECURE_HELP = ("Plaintext gRPC, no identities: only for local experiments on a network you trust "
                 "(prints a warning; runs started by an insecure coordinator are marked insecure).")
TLS_HELP = ("Mutual TLS identity: a folder with key.pem, cert.pem and ca.pem (from `coordinator init-ca` "
            "or `coordinator enroll`).")


def transport_from(tls, insecure: bool):
    """The ``fedrelay.wire.Transport`` for ``--tls DIR`` or ``--insecure`` (exactly one of them).

    Exits with a clear error when neither or both are given, or the folder is unusable; warns
    on stderr for ``--insecure``.
    """
    from fedrelay.wire import Transport, TransportError

    if tls is not None and insecure:
        fail("pass either --tls DIR or --insecure, not both")
    if tls is None and not insecure:
        fail("pass --tls DIR (mutual TLS: a folder with key.pem, cert.pem, ca.pem from `coordinator init-ca` / "
             "`coordinator enroll`) or --insecure (plaintext, only for local experiments on a network you trust)")
    if insecure:
        err_console.print("[bold yellow]warning:[/] --insecure: plaintext gRPC, no authentication; "
                          "anyone on the network can read and inject models", highlight=False)
        return Transport.insecure()
    try:
        return Transport.from_dir(tls)
    except TransportError as exc:
        fail(str(exc))


def stop_on_sigterm() -> None:
    """Make SIGTERM stop a daemon like Ctrl-C does (servers shut down, files stay consistent)."""
    import signal

    def _raise(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _raise)


def setup_logging(verbose: bool, prefix: str = "") -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO, stream=sys.stderr,
        format=f"%(asctime)s {prefix}%(levelname)s %(message)s", datefmt="%H:%M:%S")


def fail(message: str, code: int = 1) -> None:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code)
