"""Bits every fedrelay command shares: logging, errors, the --insecure rule."""

from __future__ import annotations

import logging
import sys

import typer
from rich.console import Console

console = Console()
err_console = Console(stderr=True)

INSECURE_HELP = ("Plaintext gRPC. Required today (mutual TLS is not built yet); once it is, this "
                 "stays the explicit opt-out, so scripts that pass it keep working.")


def require_insecure(insecure: bool) -> None:
    if not insecure:
        fail("fedrelay has no TLS transport yet: pass --insecure to use plaintext gRPC "
             "(only on networks you trust)")


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
