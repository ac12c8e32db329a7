"""Bits every fedrelay command shares: logging, errors, the --tls / --insecure rule."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import typer
from rich.console import Console
from typer.core import TyperGroup

from fedrelay.cli import exits

# No emoji codes: ":x:" in a site's text stays text (markup is escaped with fedrelay.text.safe).
console = Console(emoji=False)
err_console = Console(stderr=True, emoji=False)

INSECURE_HELP = ("Plaintext gRPC, no identities: only for local experiments on a network you trust "
                 "(prints a warning; runs started by an insecure coordinator are marked insecure).")
TLS_HELP = ("Mutual TLS identity: a folder with key.pem, cert.pem and ca.pem (from `coordinator init-ca`, "
            "or a site's `peer init` + `peer install-cert`).")


def transport_from(tls, insecure: bool):
    """The ``fedrelay.transport.Transport`` for ``--tls DIR`` or ``--insecure`` (exactly one of them).

    Exits with a clear error when neither or both are given, or the folder is unusable; warns
    on stderr for ``--insecure``.
    """
    from fedrelay.transport import Transport, TransportError

    if tls is not None and insecure:
        tls, insecure = _drop_environment_default(tls, insecure)
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


def _drop_environment_default(tls, insecure: bool):
    """--tls and --insecure both set, one of them only by its environment variable: the option
    given on the command line wins (e.g. FEDRELAY_INSECURE=1 in the shell, --tls DIR typed)."""
    import os

    env_tls = bool(os.environ.get(ENV_TLS))
    env_insecure = os.environ.get(ENV_INSECURE, "").strip().lower() in ("1", "true", "t", "yes", "y", "on")
    if env_insecure and not env_tls:
        return tls, False
    if env_tls and not env_insecure:
        return None, insecure
    return tls, insecure


def stop_on_sigterm() -> None:
    """Make SIGTERM stop a daemon like Ctrl-C does (servers shut down, files stay consistent)."""
    import signal

    def _raise(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _raise)


def setup_logging(verbose: bool, prefix: str = "") -> None:
    """Log to stderr, one line per record (``fedrelay.text.OneLineFormatter``: text from other
    parties cannot start a line of its own or send control sequences), each with the date, the
    local time and its offset from UTC, ISO 8601 / RFC 3339 (``2026-11-23 09:12:01+01:00
    [coordinator] INFO ...``); debug lines too when ``verbose``."""
    from fedrelay.text import OneLineFormatter

    class Formatter(OneLineFormatter):
        def formatTime(self, record, datefmt=None):  # noqa: N802 (logging's name)
            from datetime import datetime

            return datetime.fromtimestamp(record.created).astimezone().isoformat(sep=" ", timespec="seconds")

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(Formatter(f"%(asctime)s {prefix}%(levelname)s %(message)s"))
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, handlers=[handler])


def fail(message: str, code: int = exits.USAGE) -> None:
    """Print ``error: MESSAGE`` on stderr and exit with ``code`` (``fedrelay.cli.exits``; by
    default :data:`~fedrelay.cli.exits.USAGE`, a bad value). Under ``--json`` the error is also one
    JSON object on stdout: ``{"error": MESSAGE, "code": CODE}``. ``message`` is plain text (it
    often quotes a coordinator's or a site's words): shown as it is, never read as markup."""
    from fedrelay.text import safe

    if json_mode():
        print(json.dumps({"error": message, "code": code}), flush=True)
    err_console.print(f"[bold red]error:[/] {safe(message)}", highlight=False, soft_wrap=True)  # paths stay whole
    raise typer.Exit(code)


_ARGV_JSON = [False]  # --json on the command line being run (Group.main), for errors before it is parsed


def json_mode() -> bool:
    """Whether the command being run was given ``--json`` (its ``as_json`` parameter is set, or,
    while its options are still being read, e.g. by ``--config``, its command line holds it)."""
    from typer._click.globals import get_current_context

    if _ARGV_JSON[0]:
        return True
    ctx = get_current_context(silent=True)
    while ctx is not None:
        if ctx.params.get("as_json"):
            return True
        ctx = ctx.parent
    return False


def _argv_wants_json(args) -> bool:
    """``--json`` on a command line (before a ``--``), for errors raised while it is parsed."""
    for a in args:
        if a == "--":
            return False
        if a == "--json":
            return True
    return False


class Group(TyperGroup):
    """The command group of ``peer``, ``coordinator`` and ``fedrelay``: a usage error (unknown
    option, missing or malformed value) exits :data:`~fedrelay.cli.exits.USAGE` as click does,
    and is also one JSON object on stdout when the command line holds ``--json``."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        from typer._click import exceptions as click

        argv = list(sys.argv[1:] if args is None else args)
        _ARGV_JSON[0] = _argv_wants_json(argv)
        if not standalone_mode or not _ARGV_JSON[0]:
            return super().main(argv, prog_name, complete_var, standalone_mode, **extra)
        try:
            rv = super().main(argv, prog_name, complete_var, False, **extra)
        except click.ClickException as exc:
            print(json.dumps({"error": exc.format_message(), "code": exc.exit_code}), flush=True)
            from fedrelay.text import safe

            err_console.print(f"[bold red]error:[/] {safe(exc.format_message())}", highlight=False)
            sys.exit(exc.exit_code)
        except click.Abort:
            sys.exit(exits.FAILED)
        sys.exit(rv if isinstance(rv, int) else exits.OK)


def make_app(help: str, *, env_prefix: str) -> typer.Typer:
    """A command group with fedrelay's conventions (docs/cli-conventions.md): ``-h``, usage errors
    as JSON under ``--json`` (:class:`Group`), and every option readable from an environment
    variable ``ENV_PREFIX_COMMAND_OPTION`` (click's ``auto_envvar_prefix``; options with a
    variable of their own, e.g. ``FEDRELAY_COORDINATOR``, keep it)."""
    return typer.Typer(help=help, no_args_is_help=True, add_completion=False, cls=Group,
                       context_settings={**CONTEXT_SETTINGS, "auto_envvar_prefix": env_prefix},
                       pretty_exceptions_show_locals=False)


def address_callback(ctx, param, value):
    """Check an option's ``HOST:PORT`` value as it is parsed (``fedrelay.names.check_address``):
    a malformed one is a usage error naming the option, e.g. ``-c notanaddress`` says the port is
    missing. Port 0 (any free port) is allowed for listening addresses (``--listen``,
    ``--metrics-listen``, ``--operator-listen``, ``--web``)."""
    if value is None or value == "":
        return value
    values = value if isinstance(value, (list, tuple)) else [value]
    flag = max(param.opts, key=len)
    for v in values:
        problem = address_problem(v, allow_port_0=flag.endswith("listen") or flag == "--web")
        if problem:
            raise typer.BadParameter(problem, ctx=ctx, param=param)
    return value


def web_callback(ctx, param, value):
    """``--web HOST:PORT`` like ``--metrics-listen``; a bare ``PORT`` (the old form) still works,
    as ``127.0.0.1:PORT``, with a deprecation warning."""
    if value is not None and value.strip().isdigit():
        err_console.print(f"[bold yellow]warning:[/] --web {value.strip()}: a bare PORT is deprecated; write "
                          f"--web 127.0.0.1:{value.strip()} (HOST:PORT, like --metrics-listen)", highlight=False)
        value = f"127.0.0.1:{value.strip()}"
    return address_callback(ctx, param, value)


def json_option(help: str = "Print the result as JSON on stdout (errors too: {\"error\": ..., \"code\": ...})."):
    """The ``--json`` option every command that prints data takes (parameter ``as_json``)."""
    return typer.Option(False, "--json", help=help)


def config_option(command: str):
    """The ``--config FILE`` option (eager): a TOML file of the command's options (keys: the long
    option names), read by :func:`load_config_callback`; command line and environment override it."""
    return typer.Option(None, "--config", is_eager=True, callback=load_config_callback, dir_okay=False,
                        help=f"A TOML file of {command} options (keys: the long option names, e.g. "
                             "state-dir = \"/var/lib/fedrelay\"); options given on the command line or in "
                             "FEDRELAY_* variables override it (docs/cli-conventions.md).")


def address_problem(value: str, *, allow_port_0: bool = False) -> str | None:
    """What is wrong with ``value`` as ``HOST:PORT`` (None: nothing): says when the port is
    missing, not a number or out of range, or the host is malformed."""
    from fedrelay.names import InvalidName, check_address

    host, sep, port = value.rpartition(":")
    if not sep or not port or host.endswith(":") and not host.startswith("["):
        return f"{value!r} has no port: write HOST:PORT, e.g. {value.rstrip(':') or 'localhost'}:50070"
    if not port.isascii() or not port.isdigit():
        return f"{value!r}: the port {port!r} is not a number (write HOST:PORT)"
    if not 0 <= int(port) <= 65535 or (int(port) == 0 and not allow_port_0):
        return f"{value!r}: the port must be 1-65535" + (" (0: any free port)" if allow_port_0 else "")
    if not host:
        return f"{value!r} has no host: write HOST:PORT, e.g. 127.0.0.1:{port}"
    try:
        check_address(f"{host}:{int(port) or 1}")  # port 0 (any free port) passed the check above
    except InvalidName:
        return (f"{value!r}: the host must be a DNS name, an IPv4 address or an [IPv6] address in brackets "
                "(write HOST:PORT)")
    return None


def report_health(what: str, address: str, result, as_json: bool) -> None:
    """Print a health probe's outcome (``fedrelay.health.ProbeResult``) as one line, or under
    ``--json`` as ``{"address", "status", "serving", "detail", "code"}``, and exit: 0 SERVING, 1
    another answer (NOT_SERVING, ...), 3 no answer, 4 refused (``fedrelay.cli.exits``)."""
    from fedrelay.text import safe

    if result.serving:
        code = exits.OK
    elif result.status in ("UNREACHABLE", "ERROR"):
        code = exits.for_rpc_error(result.grpc_code, result.line)
    else:
        code = exits.FAILED
    if as_json:
        print(json.dumps({"address": address, "status": result.status, "serving": result.serving,
                          "detail": result.line, "code": code}))
    else:
        console.print(f"{what} {safe(address)}: {safe(result.line)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


# -- shared by both command groups: -h, --version, environment variables ----------------------

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"]}
ENV_COORDINATOR = "FEDRELAY_COORDINATOR"   # --coordinator HOST:PORT
ENV_TLS = "FEDRELAY_TLS"                   # --tls DIR
ENV_INSECURE = "FEDRELAY_INSECURE"         # --insecure (1 / true / yes)


def _print_version(value: bool) -> None:
    if value:
        from fedrelay import __version__

        print(f"fedrelay {__version__}")
        raise typer.Exit()


def version_option():
    """The ``--version`` option of a command group: prints ``fedrelay X.Y.Z`` and exits."""
    return typer.Option(False, "--version", callback=_print_version, is_eager=True,
                        help="Print fedrelay's version and exit.")


# -- start-chain --config run.toml ------------------------------------------------------------

def _annotation(param):
    """The Python type typer coerces an option to (int, float, bool, str, Path, Literal[...])."""
    desc = getattr(param, "type_descriptor", None)
    return desc.annotation if desc is not None else str


def _choices(param) -> tuple:
    from typing import Literal, get_args, get_origin

    ann = _annotation(param)
    return get_args(ann) if get_origin(ann) is Literal else ()


def _toml_type_ok(param, value) -> bool:
    """Whether a TOML value has the type the option takes (no silent coercion: a string "5"
    for an integer option is refused; an integer is a valid number)."""
    ann = _annotation(param)
    if ann is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if ann is int:
        return isinstance(value, int)
    if ann is float:
        return isinstance(value, (int, float))
    return isinstance(value, str)


def _type_name(param) -> str:
    ann = _annotation(param)
    if _choices(param):
        return "one of " + ", ".join(map(str, _choices(param)))
    return {bool: "true or false", int: "an integer", float: "a number"}.get(ann, "a string")


def config_defaults(ctx, path: Path, *, lists: tuple[str, ...] = ()) -> dict:
    """Read a TOML run configuration for the command of ``ctx`` and return it as click's
    ``default_map`` (parameter name -> value): what the file sets becomes the options'
    defaults, so options given on the command line override it.

    Keys are the command's long option names, with or without the leading ``--``, written
    with ``-`` or ``_`` (``models-per-site`` = ``models_per_site``); values must have the
    option's type (TOML integer, float, boolean or string; a choice must be one of its
    choices). ``lists``: option names whose value may also be a TOML array of strings (joined
    with commas, e.g. ``peers = ["a", "b"]``). ``config`` itself cannot be set.

    Exits with a clear error (naming the file and the key) for an unreadable or malformed
    file, an unknown key or a value of the wrong type.
    """
    import tomllib

    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except OSError as exc:
        fail(f"--config {path}: cannot read it: {exc.strerror or exc}")
    except tomllib.TOMLDecodeError as exc:
        fail(f"--config {path}: not valid TOML: {exc}")
    by_key: dict = {}
    for p in ctx.command.params:
        if getattr(p, "param_type_name", "") == "option" and p.name != "config":
            for opt in p.opts + p.secondary_opts:
                if opt.startswith("--"):
                    by_key[opt[2:].replace("-", "_")] = p
    out: dict = {}
    for key, value in table.items():
        p = by_key.get(key.lstrip("-").replace("-", "_"))
        if p is None:
            fail(f"--config {path}: unknown key {key!r}; keys are the long option names of `{ctx.command_path}`: "
                 + ", ".join(sorted({n.replace('_', '-') for n in by_key})))
        if p.name in lists and isinstance(value, list) and all(isinstance(v, str) for v in value):
            value = ",".join(value)
        if getattr(p, "multiple", False):
            value = [value] if isinstance(value, str) else value
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                fail(f"--config {path}: key {key!r} must be a string or an array of strings, got {value!r}")
            out[p.name] = value
            continue
        if not _toml_type_ok(p, value):
            fail(f"--config {path}: key {key!r} must be {_type_name(p)}, got {value!r}")
        if _choices(p) and value not in _choices(p):
            fail(f"--config {path}: key {key!r} must be {_type_name(p)}, got {value!r}")
        if p.name in out:
            fail(f"--config {path}: {p.opts[-1]} is set twice (key {key!r})")
        out[p.name] = value
    return out


def load_config_callback(ctx, param, value):
    """The ``--config FILE`` option's callback (eager): installs the file's values as the
    command's defaults (:func:`config_defaults`)."""
    if value is not None:
        ctx.default_map = {**(ctx.default_map or {}), **config_defaults(ctx, Path(value), lists=("peers",))}
    return value


# Options both daemons' commands declare the same way.
INSECURE = typer.Option(False, "--insecure", envvar=ENV_INSECURE, help=INSECURE_HELP)
METRICS_LISTEN = typer.Option(None, "--metrics-listen", callback=address_callback,
                              help="HOST:PORT to serve Prometheus metrics on (plain HTTP, /metrics; "
                                   "unauthenticated: bind it where only your monitoring reaches) \\[default: off].")
