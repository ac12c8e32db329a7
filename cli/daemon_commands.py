"""The coordinator's daemons and their probe: ``serve`` (the coordinator), ``relay`` (a relay on
its own) and ``health`` (the coordinator's gRPC health service)."""

from __future__ import annotations

from pathlib import Path

import typer

from fedrelay.cli import exits
from fedrelay.cli.common import (ENV_TLS, INSECURE, METRICS_LISTEN, TLS_HELP, address_callback, config_option, fail,
                                 json_option, setup_logging, stop_on_sigterm, transport_from, web_callback)
from fedrelay.cli.connection import COORD


def serve(
    config: Path = config_option("coordinator serve"),
    listen: str = typer.Option("127.0.0.1:50070", "--listen", callback=address_callback, help="HOST:PORT to listen on."),
    db: Path = typer.Option(Path("fedrelay-ledger.sqlite"), "--db", help="SQLite ledger file."),
    tls: Path = typer.Option(None, "--tls", envvar=ENV_TLS, help=TLS_HELP + " Here: PKI/coordinator.",
                             file_okay=False),
    insecure: bool = INSECURE,
    peer_timeout: float = typer.Option(120.0, "--peer-timeout",
                                       help="Seconds a site of a running chain may go without a heartbeat "
                                            "before the chain is routed around it."),
    web: str = typer.Option(None, "--web", callback=web_callback, help="HOST:PORT to serve the live run page on (read-only, no "
                            "authentication; like --metrics-listen) \\[default: off]. A bare PORT still works (deprecated: "
                            "127.0.0.1:PORT)."),
    operator_listen: str = typer.Option(None, "--operator-listen", callback=address_callback,
                                        help="A second HOST:PORT for the operator's "
                                        "commands (e.g. 127.0.0.1:50071), whose connections the sites' cannot "
                                        "crowd out \\[default: off]."),
    web_host: list[str] = typer.Option([], "--web-host", help="A host name the live run page may be reached by "
                                       "(its Host: header), besides IP addresses, localhost and the --web host; "
                                       "repeat for several. Any other name is refused (DNS rebinding)."),
    metrics_listen: str = METRICS_LISTEN,
    relay_dir: Path = typer.Option(None, "--relay-dir", file_okay=False,
                                   help="Where the coordinator's relay keeps sealed payloads for sites that cannot "
                                        "be reached directly (TLS only) \\[default: the folder 'relay' beside --db]."),
    relay: str = typer.Option("", "--relay", callback=address_callback, help="HOST:PORT of the operator's own relay (`coordinator relay`), "
                              "told to every site; the coordinator then relays nothing itself."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log debug messages too."),
) -> None:
    """Run the coordinator (ledger: SQLite at --db)."""
    import math

    if not (math.isfinite(peer_timeout) and peer_timeout > 0):
        fail(f"--peer-timeout must be > 0 seconds, got {peer_timeout:g}")  # before the ledger file is created
    transport = transport_from(tls, insecure)
    setup_logging(verbose, prefix="[coordinator] ")
    stop_on_sigterm()
    from fedrelay.coordinator.ledger import LedgerError
    from fedrelay.coordinator.service import serve as run_service

    try:
        run_service(listen, db, transport=transport, peer_timeout=peer_timeout, web=web, web_hosts=web_host,
                    operator_listen=operator_listen,
                    metrics_listen=metrics_listen, relay_dir=relay_dir, relay=relay)
    except (ValueError, LedgerError) as exc:  # LedgerError: --db is a folder, another file, not writable
        fail(str(exc))
    except RuntimeError as exc:
        fail(str(exc), exits.FAILED)
    except KeyboardInterrupt:
        pass


def relay_command(
    config: Path = config_option("coordinator relay"),
    listen: str = typer.Option("0.0.0.0:50072", "--listen", callback=address_callback, help="HOST:PORT to listen on."),
    folder: Path = typer.Option(Path("fedrelay-relay"), "--dir", file_okay=False,
                                help="Where the sealed payloads are kept until their receiver fetches them."),
    tls: Path = typer.Option(None, "--tls", envvar=ENV_TLS, help=TLS_HELP + " Here: PKI/coordinator (sites dial "
                             "the relay expecting the coordinator's certificate name).", file_okay=False),
    keep_hours: float = typer.Option(24.0, "--keep-hours", min=0.001,
                                     help="Hours an envelope waits for its receiver before it is removed unfetched."),
    sender_gib: float = typer.Option(8.0, "--sender-quota-gib", min=0.001,
                                     help="GiB one sending site may have held here, over all runs."),
    sender_envelopes: int = typer.Option(256, "--sender-envelopes", min=1,
                                         help="Envelopes one sending site may have held here, over all runs."),
    crl: Path = typer.Option(None, "--crl", envvar="FEDRELAY_CRL", dir_okay=False,
                             help="The federation's revocation list (PKI/ca/crl.pem, rewritten by `coordinator "
                                  "revoke`), reloaded when it changes: revoked sites are refused."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log debug messages too."),
) -> None:
    """Run a relay on its own: where senders leave payloads, sealed to the receiver's key, for sites
    they cannot reach directly (point the coordinator at it with `serve --relay HOST:PORT`). It
    carries only transfers the coordinator granted, each within its run's payload cap (see
    docs/relay-bounds.md)."""
    if tls is None:
        fail("coordinator relay needs --tls PKI/coordinator (or FEDRELAY_TLS): it serves sealed payloads over "
             "mutual TLS only")
    transport = transport_from(tls, False)
    setup_logging(verbose, prefix="[relay] ")
    stop_on_sigterm()
    from fedrelay.coordinator.relay_server import serve_relay
    from fedrelay.coordinator.relay_bounds import RelayLimits

    try:
        bounds = RelayLimits(lifetime=keep_hours * 3600.0, identity_bytes=int(sender_gib * (1 << 30)),
                             identity_envelopes=sender_envelopes)
        serve_relay(listen, folder, transport=transport, limits=bounds, crl=crl)
    except ValueError as exc:
        fail(str(exc))
    except RuntimeError as exc:
        fail(str(exc), exits.FAILED)
    except KeyboardInterrupt:
        pass


def health(coordinator: str = COORD,
           tls: Path = typer.Option(None, "--tls", envvar=ENV_TLS, file_okay=False, help=TLS_HELP + " The health service sits behind "
                                    "mutual TLS like every call: PKI/coordinator or PKI/operator."),
           insecure: bool = INSECURE,
           timeout: float = typer.Option(5.0, "--timeout", min=0.0, help="Seconds to wait for the answer."),
           as_json: bool = json_option('Print {"address", "status", "serving", "detail", "code"} as JSON.')) -> None:
    """Probe the coordinator's gRPC health service: prints one line; exits 0 when SERVING, 1 for
    another answer, 3 when nothing answers, 4 when it refuses the caller."""
    transport = transport_from(tls, insecure)
    from fedrelay.callers import COORDINATOR_IDENTITY
    from fedrelay.cli.common import report_health
    from fedrelay.health import probe_result

    report_health("coordinator", coordinator,
                  probe_result(transport, coordinator, expect=COORDINATOR_IDENTITY, timeout=timeout), as_json)
