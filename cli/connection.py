"""The operator commands' connection to the coordinator: the ``--coordinator`` and ``--tls``
options they share, the client they open (``open_client``), and a failed call turned into a
message and an exit code (``rpc_fail``, codes in ``fedrelay.cli.exits``)."""

from __future__ import annotations

from pathlib import Path

import grpc
import typer

from fedrelay.cli import exits
from fedrelay.cli.common import ENV_COORDINATOR, ENV_TLS, TLS_HELP, address_callback, fail, transport_from

COORD = typer.Option("127.0.0.1:50070", "--coordinator", "-c", envvar=ENV_COORDINATOR, callback=address_callback,
                     help="HOST:PORT of the coordinator.")
TLS = typer.Option(None, "--tls", envvar=ENV_TLS, help=TLS_HELP + " Operator commands: PKI/operator.",
                   file_okay=False)

_secure: list[bool] = []  # the transport of this process's client (rpc_fail's hint)


def open_client(address: str, tls: Path | None, insecure: bool):
    """An ``OperatorClient`` for the coordinator at ``address`` over the transport ``--tls`` /
    ``--insecure`` choose (a usage error exits 2 first). The commands look it up here at each
    call, so a test may replace it (``monkeypatch.setattr(connection, "open_client", ...)``)."""
    transport = transport_from(tls, insecure)
    _secure[:] = [transport.secure]
    from fedrelay.coordinator.client import OperatorClient

    return OperatorClient(address, transport)


def ask(coordinator: str, tls, insecure: bool, call):
    """One call to the coordinator: open the operator's client (:func:`open_client`), return
    ``call(client)``'s answer and close it; a failed call ends the command (:func:`rpc_fail`)."""
    with open_client(coordinator, tls, insecure) as client:
        try:
            return call(client)
        except grpc.RpcError as exc:
            rpc_fail(exc, coordinator)


def rpc_fail(exc: grpc.RpcError, address: str) -> None:
    """Exit with a message for a call to the coordinator that failed: the wrong transport flag
    (exit 2), a failed TLS handshake (4), an unreachable coordinator, else the call's own details;
    the code is ``exits.for_rpc_error``'s where no flag is to blame. Never returns."""
    from fedrelay.transport import transport_mismatch

    details = exc.details() or ""
    tls_words = any(w in details for w in ("ssl", "SSL", "TLS", "Tls", "verif", "handshake"))
    code = exits.for_rpc_error(exc.code(), details)
    hint = transport_mismatch(exc, address, secure=_secure[0] if _secure else tls_words, what="coordinator")
    if hint:  # --tls against a plaintext daemon or --insecure against a TLS one: the flag is wrong
        fail(hint, exits.USAGE)
    if exc.code() == grpc.StatusCode.UNAVAILABLE and any(w in details for w in ("ssl", "SSL", "TLS", "Tls", "verif", "handshake")):
        fail(f"TLS with the coordinator at {address} failed ({details}); check --tls (same CA? an insecure "
             "coordinator?)", exits.REFUSED)
    if exc.code() == grpc.StatusCode.UNAVAILABLE:
        fail(f"coordinator at {address} is not reachable ({exc.details()}); is `coordinator serve` running?", code)
    fail(exc.details() or exc.code().name, code)
