"""Bits every fedrelay command shares: logging, errors, the --tls / --insecure rule."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import typer
from rich.console import Console

# No emoji codes: ":x:" in a site's text stays text (markup is escaped with fedrelay.text.safe).
console = Console(emoji=False)
err_console = Console(stderr=True, emoji=False)

INSECURE_HELP = ("Plaintext gRPC, no identities: only for local experiments on a network you trust "
                 "(prints a warning; runs started by an insecure coordinator are marked insecure).")
TLS_HELP = ("Mutual TLS identity: a folder with key.pem, cert.pem and ca.pem (from `coordinator init-ca`, "
            "or a site's `peer init` + `peer install-cert`).")


def transport_from(tls, insecure: bool):
    """The ``fedrelay.wire.Transport`` for ``--tls DIR`` or ``--insecure`` (exactly one of them).

    Exits with a clear error when neither or both are given, or the folder is unusable; warns
    on stderr for ``--insecure``.
    """
    from fedrelay.wire import Transport, TransportError

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
    local time and its offset from UTC (``2026-11-23 09:12:01+0100 [coordinator] INFO ...``);
    debug lines too when ``verbose``."""
    from fedrelay.text import OneLineFormatter

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(OneLineFormatter(f"%(asctime)s {prefix}%(levelname)s %(message)s",
                                          datefmt="%Y-%m-%d %H:%M:%S%z"))
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, handlers=[handler])


def fail(message: str, code: int = 1) -> None:
    """Print ``error: MESSAGE`` on stderr and exit with ``code``. ``message`` is plain text (it
    often quotes a coordinator's or a site's words): shown as it is, never read as markup."""
    from fedrelay.text import safe

    err_console.print(f"[bold red]error:[/] {safe(message)}", highlight=False)
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
