"""``coordinator``: the coordinator daemon and the operator's commands."""

from __future__ import annotations

import inspect
import json
import time
from pathlib import Path
from typing import Literal

import grpc
import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich import box
from rich.table import Table

from fedrelay import params as run_params, privacy
from fedrelay.text import safe, safe_tree
from fedrelay.cli import exits
from fedrelay.cli.common import (ENV_COORDINATOR, ENV_TLS, INSECURE, METRICS_LISTEN, TLS_HELP, address_callback,
                                 config_option, console, err_console, fail, json_option, load_config_callback,
                                 make_app, setup_logging, stop_on_sigterm, transport_from, version_option,
                                 web_callback)
from fedrelay.coordinator.plan import ORDERS
from fedrelay import registry, scoring, tasks as task_registry
from fedrelay.registry import STRATEGIES

app = make_app("fedrelay coordinator: plans chains, assigns roles, keeps the ledger.",
               env_prefix="FEDRELAY_COORDINATOR")


@app.callback()
def main(version: bool = version_option()) -> None:
    """fedrelay coordinator: plans chains, assigns roles, keeps the ledger."""


COORD = typer.Option("127.0.0.1:50070", "--coordinator", "-c", envvar=ENV_COORDINATOR, callback=address_callback,
                     help="HOST:PORT of the coordinator.")
TLS = typer.Option(None, "--tls", envvar=ENV_TLS, help=TLS_HELP + " Operator commands: PKI/operator.",
                   file_okay=False)
HOSTS = typer.Option(None, "--host", help="Host name or IP others dial this identity at (repeatable; goes in the "
                     "certificate's SAN) \\[default: localhost, 127.0.0.1, ::1].")


_secure: list[bool] = []  # the transport of this process's client (_rpc_fail's hint)


def _client(address: str, tls: Path | None, insecure: bool):
    transport = transport_from(tls, insecure)
    _secure[:] = [transport.secure]
    from fedrelay.coordinator.client import OperatorClient

    return OperatorClient(address, transport)


def _rpc_fail(exc: grpc.RpcError, address: str) -> None:
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


@app.command()
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


@app.command("relay")
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


def _choice(values):
    """The allowed values of an option as the type typer offers as choices, from the registry or
    fedrelay/params.py (never retyped)."""
    return Literal[tuple(values)]


@app.command("start-chain")
def start_chain(
    config: Path = typer.Option(None, "--config", is_eager=True, callback=load_config_callback, dir_okay=False,
                                help="A TOML file of start-chain options (keys: the long option names, e.g. "
                                     "models-per-site = 5); options given on the command line override it "
                                     "(deploy/run.example.toml)."),
    coordinator: str = COORD,
    peers: str = typer.Option("", "--peers", help="Comma-separated site names \\[default: every registered peer]."),
    order: _choice(ORDERS) = typer.Option("random", "--order",
                              help="random (fixed by --seed) | given (as --peers lists them)."),
    seed: int = typer.Option(..., "--seed", help="Fixes the order, each site's train/validation split and the training."),
    strategy: _choice(STRATEGIES) = typer.Option("fedelmy", "--strategy"),  # its help: _start_chain_signature
    rounds: int = typer.Option(1, "--rounds", "-T", help="T: passes over the chain (few-shot cycles, FedELMY "
                               "supplementary Alg. 1; warm-up in round 1 only); 1 = one-shot."),
    models_per_site: int = typer.Option(5, "--models-per-site", "-S", help="S: pool models trained per site."),
    local_epochs: int = typer.Option(2, "--local-epochs", "-E", help="E: epochs per pool model (fedseq: S*E in all)."),
    warmup_epochs: int = typer.Option(2, "--warmup-epochs", help="Ew: warm-up epochs at the first site."),
    alpha: float = typer.Option(1.0, "--alpha", help="Weight of d1 (distance to the pool)."),
    beta: float = typer.Option(1.0, "--beta", help="Weight of d2 (distance to m0)."),
    lr: float = typer.Option(1e-3, "--lr", help="Adam learning rate."),
    batch_size: int = typer.Option(128, "--batch-size", help="Images per training step."),
    weight_decay: float = typer.Option(1e-4, "--weight-decay", help="Adam weight decay (coupled L2)."),
    selection: _choice(run_params.SELECTIONS) = typer.Option(None, "--selection",
                                  help="Which epoch's model a site keeps: best-val (best validation accuracy, the "
                                       "paper's protocol) | last-epoch \\[default: best-val; last-epoch with DP]."),
    task: str = typer.Option("image-folder", "--task", help="The task every site runs: how it reads its folder, the "
                             "model, loss and metrics (an installed task package's name, or module:attr; "
                             "`coordinator peers` lists what each site offers)."),
    task_sha256: str = typer.Option("", "--task-sha256", help="Pin the task's code: the SHA-256 every site's copy "
                                    "must have \\[default: the one every site reports]."),
    model: str = typer.Option("", "--model", help="One of the task's models (image-folder: cnn, resnet18, cnn-gn (for DP); "
                              "tabular-csv: mlp, logistic) \\[default: the task's first]."),
    aggregator: str = typer.Option("", "--aggregator", help="Parallel methods: the site that combines the uploads "
                                   "\\[default: chosen by --seed]."),
    init: _choice(run_params.INITS) = typer.Option(
        None, "--init", help="The initial model: shared (one seeded init for every site) | per-site (independent seeded "
        "inits, as supplementary Alg. 2 reads) | file (--init-weights) \\[default: shared]."),
    init_weights: str = typer.Option("", "--init-weights", help="--init file: the SHA-256 of a safetensors weights file "
                                     "every site holds in its --weights-dir (docs/how-to/start-a-run.md: 'A pretrained initial model')."),
    wait: bool = typer.Option(False, "--wait", help="Follow the run until it ends and print its summary."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON (with --wait: the run summary)."),
    tls: Path = TLS,
    insecure: bool = INSECURE,
    **declared,
) -> None:
    """Start a run over the registered peers: a chain (one-shot, or T rounds with --rounds), or,
    for the parallel methods (the strategies on a star plan, e.g. fedavg), a star around --aggregator.
    Each method's options (after --init-weights) come from its registry entry."""
    if selection is None:  # DP-SGD's accounting does not cover best-validation selection
        selection = "last-epoch" if privacy.enabled(declared) else "best-val"
    chosen = dict(strategy=strategy, models_per_site=models_per_site, local_epochs=local_epochs,
                  warmup_epochs=warmup_epochs, alpha=alpha, beta=beta, lr=lr, batch_size=batch_size,
                  weight_decay=weight_decay, selection=selection, init=init or "", init_sha256=init_weights.lower())
    # The declared options: those with a field of their own always (as before method_options),
    # the others only when the strategy reads them.
    read = {o.name for o in run_params.read_by(strategy)}
    chosen.update({name: value for name, value in declared.items() if run_params.has_field(name) or name in read})
    try:
        run_params.check(chosen, strict=True)
        run_params.check_rounds(rounds)
        run_params.check_seed(seed)
        task_registry.check_name(task)
        if task_sha256 and not all(c in "0123456789abcdef" for c in task_sha256.lower()) or len(task_sha256) not in (0, 64):
            raise ValueError(f"--task-sha256 must be the task's SHA-256 (64 hex digits), got {task_sha256!r}")
    except ValueError as exc:
        fail(str(exc))
    client = _client(coordinator, tls, insecure)
    sites = [p.strip() for p in peers.split(",") if p.strip()]
    try:
        reply = client.start_chain(peers=sites, order=order, seed=seed, model=model, params=run_params.to_pb(chosen),
                                   rounds=rounds, aggregator=aggregator, task=task, task_sha256=task_sha256.lower())
    except grpc.RpcError as exc:
        _rpc_fail(exc, coordinator)
    if not wait:
        for w in reply.warnings:
            err_console.print(f"[yellow]warning:[/] {safe(w)}", highlight=False)
        if as_json:
            print(json.dumps({"run_id": reply.run_id}))
        else:
            console.print(f"run [bold]{safe(reply.run_id)}[/] started: {safe(' -> '.join(reply.order))}")
        return
    watch_view(client, reply.run_id, coordinator, as_json)


def _declared_options() -> tuple:
    """start-chain's generated options: every method's (fedrelay.registry), then DP's."""
    return registry.all_options() + privacy.OPTIONS


def _start_chain_signature() -> inspect.Signature:
    """start-chain's parameters: those written out above, with ``--strategy``'s choices and help
    from the registry, and a flag per declared option (name, type, choices, default and help from
    its declaration, ``fedrelay.registry.Option``) where the method options go (before ``--wait``)."""
    base = _BASE_SIGNATURE
    out = []
    for p in base.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            continue
        if p.name == "strategy":  # its choices: the annotation, read from the registry's live table
            p = p.replace(default=typer.Option(p.default.default, *p.default.param_decls, help="What each site does: "
                                               + "; ".join(f"{s.name}: {s.summary}" for s in STRATEGIES.values())
                                               + "."))
        if p.name == "wait":
            taken = sorted({o.name for o in _declared_options()} & set(base.parameters))
            if taken:
                raise ValueError(f"option {taken[0]} would take start-chain's own --{taken[0].replace('_', '-')}")
            out += [inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY,
                                      annotation=_choice(o.choices) if o.choices else o.kind,
                                      default=typer.Option(o.default, o.flag, help=o.help))
                    for o in _declared_options()]
        out.append(p.replace(kind=inspect.Parameter.KEYWORD_ONLY))
    return base.replace(parameters=out)


_BASE_SIGNATURE = inspect.signature(start_chain, eval_str=True)


def _refresh_start_chain() -> None:
    start_chain.__signature__ = _start_chain_signature()


_refresh_start_chain()
registry.on_change(_refresh_start_chain)


WATCH_RECONNECT = 600.0  # seconds --wait keeps trying to reach a coordinator that went away


def watch_view(client, run_id: str, address: str, as_json: bool) -> None:
    """The live view of a run, the same for ``start-chain --wait`` and ``watch``: while the run
    is running, a header (strategy, order, warnings), a progress bar over the epochs the run
    trains in all (``planned_epochs``, from the run's summary at the coordinator), a line per
    transfer; then the run's summary (``--json``: the summary as JSON on stdout, the progress on
    stderr). A run that has already ended gets its summary at once. Exits 1 unless the run
    finished, 130 on Ctrl-C (the run goes on); ``fedrelay.cli.exits``."""
    from fedrelay.coordinator.client import planned_epochs

    out = err_console if as_json else console
    try:
        summary = client.run(run_id)
        if summary["status"] == "running":
            _header(summary, out)
            _follow(client, run_id, planned_epochs(summary), out)
            summary = client.run(run_id)
    except grpc.RpcError as exc:
        _rpc_fail(exc, address)
    except KeyboardInterrupt:
        out.print(f"stopped watching; the run goes on: coordinator watch {safe(run_id)}", highlight=False)
        raise typer.Exit(exits.INTERRUPTED)
    if as_json:
        print(json.dumps(summary, indent=1))
    else:
        render_summary(summary)
    if summary["status"] != "finished":
        raise typer.Exit(exits.FAILED)


def _header(s: dict, out) -> None:
    """The first lines of the live view: the run's strategy, rounds, order and warnings."""
    s = safe_tree(s)  # what sites reported is text, never markup
    cycles = f", {s['rounds']} rounds" if s.get("rounds", 1) > 1 else ""
    shape = "sites in parallel" if STRATEGIES[s["strategy"]].plan == "star" else "chain order"
    out.print(f"run [bold]{s['run_id']}[/]: {s['strategy']}{cycles}, {shape} {' -> '.join(s['order'])}",
              highlight=False)
    for w in s["warnings"]:
        out.print(f"[yellow]warning:[/] {w}", highlight=False)


def _follow(client, run_id: str, total_epochs: int, out) -> None:
    """Show the run's events: a progress bar over all epochs of the chain, a line per hop.
    Follows the run across coordinator restarts for up to WATCH_RECONNECT seconds."""
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("epochs"),
                  TimeElapsedColumn(), console=out, transient=False) as progress:
        task = progress.add_task("chain", total=total_epochs)

        def lost(exc: grpc.RpcError) -> None:
            progress.console.print(f"coordinator unreachable ({exc.code().name}); reconnecting ...", highlight=False)

        for ev in client.follow(run_id, reconnect_for=WATCH_RECONNECT, on_reconnect=lost):
            if ev.kind == "epoch":
                progress.advance(task)
                progress.update(task, description=safe(ev.site))
            elif ev.kind in ("hop", "upload", "final", "failed", "finished", "cancelled", "warning", "skip",
                             "revoked"):
                progress.console.print(safe(ev.message), highlight=False)
            elif ev.kind == "state" and (ev.message.endswith(": training") or "restarted" in ev.message):
                progress.console.print(safe(ev.message), highlight=False)


def _fmt_bytes(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def _status(h: dict) -> str:
    """A transfer's standing in the ledger: both ends agree, one has spoken, or they disagree."""
    return {"done": "[green]done[/]", "disputed": "[red]disputed[/]"}.get(h["status"], h["status"])


def _transfer_table(title: str, first: str, rows: list[dict], rounds: int = 1) -> Table:
    relayed = any(h.get("route") == "relayed" for h in rows)
    t = Table(title=title + ("; via: direct or through the relay, sealed" if relayed else ""), box=box.SIMPLE_HEAD,
              collapse_padding=True, pad_edge=False)
    columns = (first, *(("r",) if rounds > 1 else ()), "sender → receiver", "bytes", "on wire", "SHA-256",
               "s", "tries", *(("via",) if relayed else ()), "ledger")
    for col in columns:  # nothing is cut: the table fits 80 columns with 8-digit site numbers
        t.add_column(col, justify="left" if col in ("sender → receiver", "SHA-256", "ledger") else "right",
                     no_wrap=True)
    for h in rows:
        tries = str(h["attempts"]) + (f" (resumed at {_fmt_bytes(h['resumed_from'])})" if h["resumed_from"] else "")
        via = ("relay" if h.get("route") == "relayed" else "direct",) if relayed else ()
        t.add_row(str(h["hop"]), *((str(h["round"]),) if rounds > 1 else ()), f"{h['sender']} → {h['receiver']}",
                  _fmt_bytes(h["payload_bytes"]), _fmt_bytes(h["wire_bytes"]), (h["sha256"] or "")[:10] + "…",
                  f"{h['seconds']:.2f}", tries, *via, _status(h))
    return t


def _render_relayed(s: dict) -> None:
    """One line on the transfers that went through the relay: which, and the bytes of each leg."""
    kinds = (("hop", s["hops"]), ("upload", s.get("uploads", [])), ("final copy to", s["final_transfers"]))
    rows = [(f"{kind} {h['receiver'] if kind.startswith('final') else h['hop']}", h)
            for kind, group in kinds for h in group if h.get("route") == "relayed"]
    if not rows:
        return
    up = sum(h["wire_bytes"] or 0 for _, h in rows)
    down = sum(h["relay_wire_bytes"] or 0 for _, h in rows)
    sealed = sum(h["sealed_bytes"] or 0 for _, h in rows)
    console.print(f"through the relay, sealed to the receiver's key: {', '.join(label for label, _ in rows)}; "
                  f"sealed envelopes {_fmt_bytes(sealed)} bytes; on the wire sender → relay {_fmt_bytes(up)}, "
                  f"relay → receiver {_fmt_bytes(down)}", highlight=False)


def _render_star(s: dict) -> None:
    """A star plan's transfers: the uploads, the final copies, and the totals the plan expects."""
    console.print(f"sites in parallel: {', '.join(s['order'])}; aggregator {s['aggregator']}", highlight=False)
    console.print(_transfer_table("uploads (each site's model + the aggregator's extras)", "#", s["uploads"]))
    console.print(_transfer_table("final copies (aggregator → every site)", "#", s["final_transfers"]))
    exp = s["expected_total_bytes"]
    total = s["upload_total_bytes"] + s["final_total_bytes"]
    verdict = "" if exp is None else (" [green](equal)[/]" if total == exp else " [red](differs)[/]")
    console.print(f"total payload bytes: uploads {_fmt_bytes(s['upload_total_bytes'])} + final copies "
                  f"{_fmt_bytes(s['final_total_bytes'])} = {_fmt_bytes(total)}; planned {s['planned_uploads']} × "
                  f"{_fmt_bytes(s['upload_bytes'])} + {s['planned_final_copies']} × {_fmt_bytes(s['model_bytes'])} = "
                  f"{_fmt_bytes(exp)}{verdict}", highlight=False)


def render_summary(s: dict) -> None:
    """Print a run summary (``summary_dict``) for people; every string in it is shown as text
    (``fedrelay.text.safe``: no markup, control or bidi character from a site gets through)."""
    s = safe_tree(s)
    rounds = s.get("rounds", 1)
    cycles = f", {rounds} rounds" if rounds > 1 else ""
    task = f"task {s['task']} {s['task_version'] or ''}".rstrip() + ", " if s.get("task") else ""
    console.print(f"\n[bold]run {s['run_id']}[/] ({s['strategy']}{cycles}, {task}{s['arch']}, seed {s['seed']}): "
                  f"[bold]{s['status']}[/]", highlight=False)
    if s.get("task_sha256"):
        console.print(f"task code SHA-256 {s['task_sha256']} (the same at every site)", highlight=False)
    if s.get("started_by"):
        console.print(f"started by {s['started_by']}", highlight=False)
    dp = privacy.describe_options(s.get("params") or {})
    if dp:
        console.print(f"differential privacy (DP-SGD at every site): {dp}", highlight=False)
    _render_live(s)
    if s.get("aggregator"):
        _render_star(s)
    else:
        _render_chain(s)
    _render_relayed(s)
    for r in s.get("revoked") or ():
        console.print(f"[bold red]revoked:[/] {_revoked_line(r)}", highlight=False, soft_wrap=True)
    _render_outcome(s)


def _revoked_line(r: dict) -> str:
    """One revoked site, for people: who revoked it, when (local time) and why."""
    why = f": {r['reason']}" if r.get("reason") else ""
    return (f"{r['name']} (certificate {r['serial'][:16]}) by {r['revoked_by'] or '?'} at "
            f"{_local_time(r['revoked_at'])}{why}")


def _render_live(s: dict) -> None:
    """While the run is running: what each site is doing now (busy sites in bold), with the
    seconds since its latest report."""
    if not s.get("live"):
        return
    console.print("now:", highlight=False)
    for v in s["live"]:
        line = f"[bold]{v['line']}[/]" if v["busy"] else v["line"]
        console.print(f"  {line} [dim]({v['age_seconds']:.0f} s ago)[/]", highlight=False)


def _render_chain(s: dict) -> None:
    rounds = s.get("rounds", 1)
    console.print("chain order: " + " -> ".join(s["order"]), highlight=False)
    console.print(_transfer_table("hops (chain transfers" + ("; r: round)" if rounds > 1 else ")"), "hop",
                                  s["hops"], rounds))
    exp = s["expected_total_bytes"]
    verdict = "" if exp is None else (" [green](equal)[/]" if s["total_bytes"] == exp else " [red](differs)[/]")
    console.print(f"total payload bytes on the chain: {_fmt_bytes(s['total_bytes'])}; planned hops × M = "
                  f"{s['planned_hops']} × {_fmt_bytes(s['model_bytes'])} = {_fmt_bytes(exp)}{verdict}", highlight=False)
    if s["final_transfers"]:
        fb = sum(h["payload_bytes"] for h in s["final_transfers"])
        console.print(f"final model copied to {len(s['final_transfers'])} sites for evaluation: {fb:,} bytes "
                      "(outside the chain's total)", highlight=False)


METRIC_HEADS = scoring.LABELS  # the built-in metrics' column heads, as on the run page


def _final_metrics_table(f: dict) -> Table:
    """The final model's metrics per site (each site's exact figures on its own test split) and
    global (from the sites' pooled statistics; docs/how-to/data-folders.md, "Metrics")."""
    names = [k for k in METRIC_HEADS if k in f.get("metrics", {}) or any(k in v.get("metrics", {})
                                                                       for v in f["per_site"].values())]
    own = sorted({k for v in f["per_site"].values() for k in v.get("metrics", {})} - set(METRIC_HEADS))
    names = names or ["accuracy"]
    t = Table(title="final model per site (own test split) and global (pooled statistics)")
    t.add_column("site")
    for k in names + own:
        t.add_column(METRIC_HEADS.get(k, k), justify="right")
    t.add_column("test samples", justify="right")

    def cells(metrics: dict, accuracy: float) -> list[str]:
        values = {"accuracy": accuracy, **metrics}
        return [f"{values[k]:.4f}" if k in values else "-" for k in names + own]

    for site, v in f["per_site"].items():
        t.add_row(site, *cells(v.get("metrics", {}), v["accuracy"]), str(v["test_samples"]))
    t.add_row("[bold]global[/]", *(f"[bold]{c}[/]" for c in cells(f.get("metrics", {}), f["accuracy"])),
              str(sum(v["test_samples"] for v in f["per_site"].values())))
    return t


def _render_outcome(s: dict) -> None:
    disputed = [h for h in s["hops"] + s.get("uploads", []) + s["final_transfers"] if h["status"] == "disputed"]
    for h in disputed:
        console.print(f"[red]disputed:[/] {h['sender']} → {h['receiver']} (transfer {h['hop']}): the sender reported "
                      f"sha256 {(h['sha256'] or '')[:16]}…, {_fmt_bytes(h['payload_bytes'])} bytes; the receiver kept "
                      f"sha256 {h['receiver_sha256'][:16]}…, {_fmt_bytes(h['receiver_bytes'])} bytes", highlight=False)
    f = s["final"]
    if f:
        console.print(f"final model sha256 {f['sha256']}", highlight=False)
        _print_wide(_final_metrics_table(f))
        for site, v in f["per_site"].items():
            if v.get("privacy"):
                console.print(f"privacy spent at {site}: {privacy.describe(v['privacy'])}", highlight=False)
    if s.get("skipped"):
        console.print(f"[yellow]routed around (down past --peer-timeout):[/] {', '.join(s['skipped'])}; "
                      f"the final model holds the training of {', '.join(s['contributors'])}", highlight=False)
    if s["status"] == "cancelled":
        _render_cancelled(s)
    if s.get("refused_by"):
        whose = "its site policy" if s.get("refused_by_policy") else "the site"
        console.print(f"[red]refused by {s['refused_by']}[/] ({whose}), before any model moved: {s['refusal']}",
                      highlight=False)
    if s["error"]:
        console.print(f"[red]error:[/] {s['error']}", highlight=False)
    for w in s["warnings"]:
        console.print(f"[yellow]warning:[/] {w}", highlight=False)


def _render_cancelled(s: dict) -> None:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(s["ended"] or 0))
    why = f": {s['cancel_reason']}" if s.get("cancel_reason") else ""
    console.print(f"[yellow]cancelled[/] by {s.get('cancelled_by') or '?'} at {when}{why}", highlight=False)


@app.command()
def stop(
    run_id: str = typer.Argument(..., help="The run to cancel (`coordinator runs` lists them)."),
    reason: str = typer.Option("", "--reason", help="Why, recorded in the ledger with who stopped the run and when."),
    coordinator: str = COORD,
    as_json: bool = typer.Option(False, "--json", help="Print the run summary as JSON."),
    tls: Path = TLS,
    insecure: bool = INSECURE,
) -> None:
    """Cancel a running run: every site stops at its next epoch or transfer boundary and removes
    its partial files; the run ends `cancelled`, with who and when. Models already made stay at
    the sites (`peer prune` removes ended runs' files)."""
    with _client(coordinator, tls, insecure) as client:
        try:
            s = client.stop(run_id, reason=reason)
        except grpc.RpcError as exc:
            _rpc_fail(exc, coordinator)
    if as_json:
        print(json.dumps(s, indent=1))
        return
    console.print(f"run [bold]{safe(run_id)}[/] cancelled; its sites stop at their next epoch or transfer boundary",
                  highlight=False)
    _render_cancelled(safe_tree(s))


@app.command("forget-peer")
def forget_peer(
    name: str = typer.Argument(..., help="The registered site to remove (`coordinator peers` lists them)."),
    coordinator: str = COORD,
    as_json: bool = json_option('Print {"name", "address"} of the forgotten peer as JSON.'),
    tls: Path = TLS,
    insecure: bool = INSECURE,
) -> None:
    """Remove a registered peer from the ledger (refused while it is a site of a running run).
    The daemon registered under that name is refused from then on; a daemon started there
    afterwards registers anew (stop the site's daemon to remove the site for good)."""
    with _client(coordinator, tls, insecure) as client:
        try:
            reply = client.forget_peer(name)
        except grpc.RpcError as exc:
            _rpc_fail(exc, coordinator)
    if as_json:
        print(json.dumps({"name": reply.name, "address": reply.address}))
        return
    console.print(f"forgot peer {safe(reply.name)} (registered at {safe(reply.address or 'no address')}); its "
                  "daemon's heartbeats are refused from now on; a daemon started there afterwards registers anew",
                  highlight=False)


@app.command()
def show(run_id: str = typer.Argument(..., help="The run's id (from start-chain or `coordinator runs`)."),
         coordinator: str = COORD,
         as_json: bool = typer.Option(False, "--json", help="Print the run's summary as one JSON object."),
         tls: Path = TLS, insecure: bool = INSECURE) -> None:
    """Show one run: order, hops, bytes, final accuracy; while it runs, what each site is doing
    now (state, pool model, epoch)."""
    with _client(coordinator, tls, insecure) as client:
        try:
            s = client.run(run_id)
        except grpc.RpcError as exc:
            _rpc_fail(exc, coordinator)
    if as_json:
        print(json.dumps(s, indent=1))
    else:
        render_summary(s)


@app.command()
def runs(coordinator: str = COORD,
         as_json: bool = typer.Option(False, "--json", help="Print every run's summary as a JSON list "
                                      "(created, ended: unix seconds)."),
         tls: Path = TLS, insecure: bool = INSECURE) -> None:
    """List the runs in the ledger."""
    with _client(coordinator, tls, insecure) as client:
        try:
            all_runs = client.runs()
        except grpc.RpcError as exc:
            _rpc_fail(exc, coordinator)
    if as_json:
        print(json.dumps(all_runs, indent=1))
        return
    all_runs = safe_tree(all_runs)
    t = Table(title="runs")
    for col in ("run", "strategy", "sites", "status", "transfers", "accuracy", "created", "ended"):
        t.add_column(col, no_wrap=col != "run", overflow="fold")
    for s in all_runs:
        acc = f"{s['final']['accuracy']:.4f}" if s["final"] else "-"
        t.add_row(s["run_id"], s["strategy"], str(len(s["order"])), s["status"],
                  str(len(s["hops"]) + len(s.get("uploads", []))), acc, _local_time(s["created"]),
                  _local_time(s["ended"]))
    _print_wide(t)


def _local_time(t: float | None) -> str:
    """Unix seconds as local time, e.g. 2026-11-23 10:15:02; "-" for none."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def _print_wide(table: Table) -> None:
    """Print a table whole: on a terminal long cells fold onto more lines; into a pipe or a file
    the table keeps its natural width instead of being cut at 80 columns."""
    if console.is_terminal:
        console.print(table)
    else:
        from rich.console import Console

        Console(width=max(console.width, 400), file=console.file, force_terminal=False, emoji=False).print(table)


@app.command()
def peers(coordinator: str = COORD,
          as_json: bool = typer.Option(False, "--json", help="Print the peers as a JSON list, each with last_seen "
                                       "(unix seconds), age_seconds and live (heard from within the coordinator's "
                                       "--peer-timeout)."),
          tls: Path = TLS, insecure: bool = INSECURE) -> None:
    """List the registered peers: address, data, device, last heartbeat, and whether each is live
    (heard from within the coordinator's --peer-timeout) or stale."""
    from fedrelay.coordinator.client import peer_dict

    with _client(coordinator, tls, insecure) as client:
        try:
            records = client.peers()
        except grpc.RpcError as exc:
            _rpc_fail(exc, coordinator)
    if as_json:
        print(json.dumps([peer_dict(p) for p in records], indent=1))
        return
    t = Table(title="peers")
    for col in ("site", "address", "tasks (classes, train/test samples, code SHA-256)", "device", "last seen",
                "status"):
        t.add_column(col, no_wrap=col not in ("site", "address"), overflow="fold")
    for p in records:
        status = "[green]live[/]" if p.live else f"[red]stale[/] (> {p.peer_timeout:.0f} s)"
        if p.HasField("revocation"):
            from fedrelay.coordinator.client import revocation_dict

            status = f"[bold red]revoked[/] {safe(_revoked_line(revocation_dict(p.revocation)))}"
        address = safe(p.address) or ("connects out only, " + ("[green]stream open[/]" if p.connected
                                                              else "[red]no stream[/]"))
        offers = "\n".join(_offer_line(o) for o in p.tasks) or "-"
        if p.classes_omitted:
            offers += f"\n(+{p.classes_omitted} classes not listed: the reply's size cap)"
        t.add_row(safe(p.name), address, offers, safe(p.device),
                  f"{p.age_seconds:.0f} s ago", status)
    _print_wide(t)


def _offer_line(o) -> str:
    """One task a site offers, for the peers table (the site's words shown as text)."""
    if o.error:
        return f"{safe(o.name)}: [red]cannot read the data[/] ({safe(o.error, max_chars=120)})"
    return (f"{safe(o.name)} {safe(o.version)}: {len(o.classes)} classes, {sum(c.train for c in o.classes)}/"
            f"{sum(c.test for c in o.classes)}, {safe(o.sha256[:12])}…")


@app.command()
def watch(run_id: str = typer.Argument(..., help="The run's id (from start-chain or `coordinator runs`)."),
          coordinator: str = COORD,
          as_json: bool = typer.Option(False, "--json", help="At the end print the run's summary as JSON on stdout "
                                       "(the progress goes to stderr), like start-chain --wait --json."),
          tls: Path = TLS, insecure: bool = INSECURE) -> None:
    """Follow a run live (the view of start-chain --wait: progress per epoch, a line per transfer),
    then print its summary; a run that has ended gets its summary at once. Exit code 1 unless the
    run finished. Ctrl-C stops watching, not the run."""
    with _client(coordinator, tls, insecure) as client:
        watch_view(client, run_id, coordinator, as_json)


@app.command()
def metrics(ctx: typer.Context,
            run_id: str = typer.Argument(..., help="The run's id (from start-chain or `coordinator runs`)."),
            coordinator: str = COORD,
            site: str = typer.Option("", "--site", help="Only this site's epochs."),
            as_json: bool = typer.Option(False, "--json", help="Print the rows as a JSON list."),
            as_csv: bool = typer.Option(False, "--csv", help="Print the rows as CSV with a header row."),
            mlflow: bool = typer.Option(False, "--mlflow", help="Also export the run's curves and final metrics "
                                        "to MLflow, into --mlflow-uri \\[default: ./mlflow.db, what `mlflow ui` "
                                        "reads there]. Exporting a run again replaces its earlier export."),
            mlflow_uri: str = typer.Option(None, "--mlflow-uri", metavar="URI", envvar=["FEDRELAY_COORDINATOR_METRICS_MLFLOW_URI", "MLFLOW_TRACKING_URI"],
                                           help="Where --mlflow exports to (implies --mlflow when typed): a "
                                           "tracking server (http://HOST:PORT), a .db file or database URI, or a "
                                           "folder (MLflow's file store)."),
            mlflow_experiment: str = typer.Option("fedrelay", "--mlflow-experiment",
                                                  help="--mlflow: the MLflow experiment the run goes into."),
            tensorboard: Path = typer.Option(None, "--tensorboard", metavar="DIR", file_okay=False,
                                             help="Also write the run's curves and final metrics as TensorBoard "
                                             "event files in DIR/<run id>/ (`tensorboard --logdir DIR`)."),
            tls: Path = TLS, insecure: bool = INSECURE) -> None:
    """Per-epoch training metrics of a run, per site and pool model: training loss, validation
    accuracy, seconds (works while it runs); once the run has finished, the final model's
    metrics per site and global too (--json/--csv: the epoch rows only; `show --json` has the
    final metrics). --mlflow / --tensorboard export them too (coordinator/export.py)."""
    from fedrelay.coordinator.client import METRIC_FIELDS

    if as_json and as_csv:
        fail("pass either --json or --csv, not both")
    source = ctx.get_parameter_source("mlflow_uri")  # typed: implies --mlflow (MLFLOW_TRACKING_URI alone does not)
    mlflow = mlflow or getattr(source, "name", "") == "COMMANDLINE"
    exporting = mlflow or tensorboard is not None
    with _client(coordinator, tls, insecure) as client:
        try:
            rows = client.metrics(run_id)
            summary = client.run(run_id) if exporting or not (as_json or as_csv) else None
        except grpc.RpcError as exc:
            _rpc_fail(exc, coordinator)
    final = None if (as_json or as_csv) else summary["final"]
    if site:
        seen = {r["site"] for r in rows}
        rows = [r for r in rows if r["site"] == site]
        if not rows and seen:
            fail(f"run {run_id} has no metrics of site {site!r}; sites with metrics: {', '.join(sorted(seen))}")
    if exporting:
        _export_metrics(summary, rows, mlflow_uri if mlflow else None, mlflow, mlflow_experiment, tensorboard)
    if as_json:
        print(json.dumps(rows, indent=1))
    elif as_csv:
        import csv
        import sys

        writer = csv.DictWriter(sys.stdout, fieldnames=METRIC_FIELDS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
    else:
        _print_wide(_metrics_table(safe(run_id), safe_tree(rows)))
        if final:
            _print_wide(_final_metrics_table(safe_tree(final)))  # metric names are the task's words


def _export_metrics(summary: dict, rows: list[dict], mlflow_uri: str | None, mlflow: bool, experiment: str,
                    tensorboard: Path | None) -> None:
    """`metrics --mlflow/--tensorboard`: the export (coordinator/export.py), one line on stderr each."""
    from fedrelay.coordinator import export

    try:
        if mlflow:
            uri, mlflow_id = export.export_mlflow(summary, rows, mlflow_uri or None, experiment)
            err_console.print(f"exported run {safe(summary['run_id'])} to MLflow at {safe(uri)}: experiment "
                              f"{safe(experiment)!r}, MLflow run {mlflow_id}", highlight=False, soft_wrap=True)
        if tensorboard is not None:
            out = export.export_tensorboard(summary, rows, tensorboard)
            err_console.print(f"wrote TensorBoard events of run {safe(summary['run_id'])} to {safe(str(out))} "
                              f"(tensorboard --logdir {safe(str(tensorboard))})", highlight=False, soft_wrap=True)
    except export.ExportError as exc:  # the export (the work asked for) failed: a missing package, a store's refusal
        fail(str(exc), exits.FAILED)
    if summary.get("status") == "running":
        err_console.print("[bold yellow]warning:[/] the run is still running: the export holds its epochs so far "
                          "and no final metrics; export it again when it has ended", highlight=False)


STAGES = {"warmup": "warm-up", "pool": "pool", "fedseq": "fedseq", "aggregate": "aggregation"}


def _metrics_table(run_id: str, rows: list[dict]) -> Table:
    t = Table(title=f"run {run_id}: training per epoch", box=box.SIMPLE_HEAD)
    for col in ("site", "stage", "model", "epoch", "train loss", "val acc", "s"):
        t.add_column(col, justify="left" if col in ("site", "stage") else "right", no_wrap=col != "site",
                     overflow="fold")
    for r in rows:
        t.add_row(r["site"], STAGES.get(r["stage"], r["stage"]), str(r["model"]) if r["stage"] == "pool" else "-",
                  f"{r['epoch']}/{r['epochs']}", f"{r['train_loss']:.4f}",
                  "-" if r["val_accuracy"] is None else f"{r['val_accuracy']:.4f}", f"{r['seconds']:.2f}")
    return t


@app.command("fetch-model")
def fetch_model(run_id: str = typer.Argument(..., help="The run's id (`coordinator runs` lists them)."),
                out: Path = typer.Option(..., "--out", "-o", help="Where to write the safetensors file; an existing "
                                         "folder: FOLDER/<run id>.safetensors."),
                coordinator: str = COORD,
                as_json: bool = json_option('Print {"run_id", "path", "bytes", "sha256"} as JSON.'),
                tls: Path = TLS, insecure: bool = INSECURE) -> None:
    """Download a finished run's final model (safetensors), verified against its SHA-256, with
    its architecture, input shape and class names in the file's metadata (fedrelay.load_model)."""
    if out.is_dir():
        out = out / f"{run_id}.safetensors"
    with _client(coordinator, tls, insecure) as client:
        try:
            sha, size = client.fetch_model(run_id, out)
        except grpc.RpcError as exc:
            _rpc_fail(exc, coordinator)
        except ValueError as exc:
            fail(str(exc), exits.FAILED)
        except OSError as exc:
            fail(f"cannot write {out}: {exc.strerror or exc}", exits.FAILED)
    if as_json:
        print(json.dumps({"run_id": run_id, "path": str(out), "bytes": size, "sha256": sha}))
        return
    console.print(f"wrote {safe(out)}: the final model ({size:,} bytes, sha256 {safe(sha)} in the ledger) with fedrelay's "
                  "metadata; load it with fedrelay.load_model", highlight=False)


@app.command()
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


AUDIT_SHOWN = 10  # problems listed after the first (the rest are counted)


@app.command()
def audit(
    run_id: str = typer.Argument(None, help="The run to audit (`coordinator runs` lists them); optional with --bundle."),
    db: Path = typer.Option(Path("fedrelay-ledger.sqlite"), "--db", help="The coordinator's SQLite ledger (opened "
                            "read-only: never changed)."),
    bundle: Path = typer.Option(None, "--bundle", dir_okay=False, help="Audit this bundle (from --export) instead "
                                "of a ledger: offline, by anyone who has the CA certificate."),
    ca: Path = typer.Option(None, "--ca", help="The federation's CA certificate (ca.pem, or a folder holding it: a "
                            "--tls or init-ca folder); needed for a run that ran under mutual TLS."),
    export: Path = typer.Option(None, "--export", dir_okay=False, help="Write the run's audit bundle (its records, "
                                "signatures, certificates, plan and hash chain) to this JSON file; verified too when "
                                "--ca is given."),
    as_json: bool = json_option("Print the verdict as JSON."),
) -> None:
    """Verify a run's ledger records with nothing but the CA certificate: the events' hash chain,
    the sites' signatures on every report, receipt and evaluation, the plan they were made under,
    every hops/receipts/evaluations row, and the coordinator's seal. Names the first record that
    does not verify. Exit 0: verified; 1: something does not verify; 5: a plaintext run (its
    records are unsigned: consistent, but nothing proves who wrote them)."""
    from fedrelay.coordinator.audit import (AuditError, bundle_from_ledger, load_bundle, load_ca_file, verify,
                                            write_bundle)

    if bundle is not None and export is not None:
        fail("--export writes the bundle of a run in a ledger (--db); --bundle already is one")
    if bundle is None and not run_id:
        fail("name the RUN to audit (`coordinator runs` lists them), or pass --bundle FILE")
    try:
        doc = load_bundle(bundle) if bundle is not None else bundle_from_ledger(db, run_id)
        if run_id and doc["run_id"] != run_id:
            fail(f"{bundle} is the audit bundle of run {doc['run_id']}, not of {run_id}")
        if export is not None:
            try:
                write_bundle(doc, export)
            except OSError as exc:
                fail(f"cannot write {export}: {exc.strerror or exc}", exits.FAILED)
            signed = sum(1 for r in doc["records"] if r["signature"])
            (err_console if as_json else console).print(
                f"wrote the audit bundle of run {doc['run_id']} to {export} ({len(doc['events'])} events, "
                f"{len(doc['records'])} records, {signed} signed); anyone with the CA certificate can check it: "
                f"coordinator audit --bundle {export} --ca ca.pem", highlight=False, soft_wrap=True)
            if ca is None:
                return
        report = verify(doc, load_ca_file(ca) if ca is not None else None)
    except AuditError as exc:
        fail(str(exc))
    if as_json:
        print(json.dumps(report.to_dict(), indent=1))
    elif report.problems:
        problems = report.ordered()
        console.print(f"[bold red]run {report.run_id} does not verify[/]: {problems[0]}", highlight=False,
                      soft_wrap=True)
        for p in problems[1:1 + AUDIT_SHOWN]:
            console.print(f"  also: {p}", highlight=False, soft_wrap=True)
        if len(problems) > 1 + AUDIT_SHOWN:
            console.print(f"  and {len(problems) - 1 - AUDIT_SHOWN} more", highlight=False)
    elif report.signed:
        console.print(f"[bold green]run {report.run_id} verified[/] against the CA: {report.summary()}",
                      highlight=False, soft_wrap=True)
    else:
        console.print(f"[bold yellow]run {report.run_id} is unsigned[/]: it ran in plaintext (--insecure), so its "
                      f"records carry no signatures and nothing proves who wrote them. Consistency only: "
                      f"{report.summary()}", highlight=False, soft_wrap=True)
    raise typer.Exit({"verified": exits.OK, "failed": exits.FAILED, "unsigned": exits.UNSIGNED}[report.verdict])


@app.command()
def revoke(
    name: str = typer.Argument(..., help="The site to revoke (its certificate name)."),
    ca: Path = typer.Option(..., "--ca", help="The PKI folder made by init-ca: its CA key signs the revocation list "
                            "(PKI/ca/crl.pem), and PKI/ca/issued holds the site's certificates."),
    reason: str = typer.Option("", "--reason", help="Why, recorded in the ledger with who revoked the site and when."),
    serial: list[str] = typer.Option(None, "--serial", help="Revoke this certificate serial (hex; repeatable) "
                                     "\\[default: every certificate PKI/ca/issued holds for NAME]."),
    coordinator: str = COORD,
    as_json: bool = json_option('Print {"name", "serials", "revoked_by", "revoked_at", "crl_number", "runs"} as '
                                'JSON (serials in hex, revoked_at in unix seconds).'),
    tls: Path = TLS,
    insecure: bool = INSECURE,
) -> None:
    """Revoke a site: sign a new certificate revocation list with the CA (PKI/ca/crl.pem) and
    publish it through the coordinator, which records who revoked the site, when and why. The
    site's next call to the coordinator or to any site is refused and its transfers in flight
    stop (the sites fetch the list with their next heartbeat); its running runs are routed around
    it. No daemon restarts."""
    from fedrelay.coordinator.pki import PKIError, check_name, crl_path, issued, revoke as sign_revocation

    try:
        check_name(name)
    except PKIError as exc:
        fail(str(exc))
    if serial:
        try:
            serials = [int(s, 16) for s in serial]
        except ValueError:
            fail(f"--serial must be hex serial numbers (as `openssl x509 -serial` prints them), not {serial!r}")
    else:
        try:
            serials = [c.serial_number for c in issued(ca, name)]
        except OSError as exc:
            fail(f"--ca {ca}: {exc.strerror or exc}")
        if not serials:
            fail(f"--ca {ca} holds no certificate issued to {name} (PKI/ca/issued); pass its serial with --serial HEX")
    with _client(coordinator, tls, insecure) as client:  # the TLS options are checked before the CRL changes
        try:
            crl_der, number = sign_revocation(ca, serials)
        except (PKIError, OSError) as exc:
            fail(str(exc))
        try:
            reply = client.revoke(name, serials, crl_der, reason=reason)
        except grpc.RpcError as exc:
            err_console.print(f"[yellow]the revocation list {number} is signed ({crl_path(ca)}) but was not "
                              "published:[/]", highlight=False)
            _rpc_fail(exc, coordinator)
    if as_json:
        print(json.dumps({"name": name, "serials": [f"{s:x}" for s in serials], "revoked_by": reply.revoked_by,
                          "revoked_at": reply.revoked_at, "crl_number": reply.crl_number, "runs": list(reply.runs)}))
        return
    runs = f"; running run(s) routed around it: {', '.join(reply.runs)}" if reply.runs else ""
    console.print(f"revoked {safe(name)} (certificate(s) {', '.join(f'{s:x}' for s in serials)}) by "
                  f"{safe(reply.revoked_by)} at {_local_time(reply.revoked_at)}; revocation list {reply.crl_number} "
                  f"published ({crl_path(ca)}): the site's calls are refused from the next heartbeat of each "
                  f"site{runs}", highlight=False, soft_wrap=True)


@app.command("init-ca")
def init_ca(
    out: Path = typer.Option(..., "--out", "-o", help="PKI folder to create: ca/, coordinator/, operator/."),
    host: list[str] = HOSTS,
    as_json: bool = json_option('Print {"ca", "coordinator", "operator"} (the folders written) as JSON.'),
) -> None:
    """Create the federation's CA, the coordinator's identity (OUT/coordinator) and the operator's (OUT/operator)."""
    from fedrelay.coordinator.pki import DEFAULT_HOSTS, PKIError, init_ca as do_init

    try:
        do_init(out, hosts=host or DEFAULT_HOSTS)
    except PKIError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(str(exc), exits.FAILED)
    if as_json:
        print(json.dumps({k: str(out / k) for k in ("ca", "coordinator", "operator")}))
        return
    console.print(f"CA in {out / 'ca'} (keep ca-key.pem private); identities: {out / 'coordinator'} "
                  f"(coordinator serve --tls), {out / 'operator'} (operator commands --tls)", highlight=False)


@app.command()
def enroll(
    name: str = typer.Argument(None, help="The site's name: its identity, and what it passes as `peer serve --name` "
                               "(with --csr: optional, the request must name it)."),
    ca: Path = typer.Option(..., "--ca", help="The PKI folder made by init-ca."),
    out: Path = typer.Option(..., "--out", "-o", help="Folder to write cert.pem and ca.pem to (without --csr, for local "
                             "trials: key.pem too)."),
    csr: Path = typer.Option(None, "--csr", dir_okay=False, help="The site's certificate signing request (NAME.csr "
                             "from `peer init` at the site): signed with the CA; the site's key stays at the site."),
    host: list[str] = typer.Option(None, "--host", help="Host name or IP others dial this site at (repeatable; goes in "
                                   "the certificate's SAN) \\[default: those the request asks for; without --csr: "
                                   "localhost, 127.0.0.1, ::1]."),
    days: int = typer.Option(825, "--days", help="Validity of the certificate in days."),
    force: bool = typer.Option(False, "--force", help="Replace the certificate (and key, without --csr) of an --out "
                               "folder that already holds them."),
    kit: bool = typer.Option(False, "--kit", help="Also write a site kit into --out: peer.env, the systemd unit, "
                             "start-peer.sh and a README.md with ports, install steps and checks (needs --csr: a "
                             "kit holds no private key)."),
    kit_coordinator: str = typer.Option(None, "--coordinator", "-c", callback=address_callback, help="--kit: the coordinator's HOST:PORT, written "
                                        "into peer.env \\[default: a placeholder to edit]."),
    kit_outbound: bool = typer.Option(False, "--outbound-only", help="--kit: a site that accepts no inbound "
                                      "connection (its peer.env sets FEDRELAY_OUTBOUND_ONLY=1; its models come "
                                      "through the relay)."),
    kit_port: int = typer.Option(50071, "--port", help="--kit: the port the site's daemon listens on; it is "
                                 "advertised at the first --host."),
    operator: bool = typer.Option(False, "--operator", help="Enroll a further operator NAME instead of a site: "
                                  "its certificate names operator.NAME, which may start and stop runs (the ledger "
                                  "records which operator did; a site's policy may accept only some operators)."),
    as_json: bool = json_option('Print {"name", "out", "kit"} as JSON.'),
) -> None:
    """Sign a site's certificate request (--csr, from `peer init` at the site) and write its
    certificate and the CA's (give them back to the site: `peer install-cert`); with --kit, the
    folder is a whole site kit; with --operator, a key and certificate for a further operator (--tls
    DIR for the operator commands). Without --csr (LOCAL TRIALS ONLY), a site's key is made here,
    at the operator's desk, and must then be carried to the site."""
    from fedrelay.coordinator.pki import (DEFAULT_HOSTS, PKIError, check_name, enroll as do_enroll,
                                          operator_identity, sign_csr)

    if days < 1:
        fail("--days must be >= 1")
    if operator:
        if kit:
            fail("--kit makes a site's kit; it does not go with --operator")
        if csr is not None:
            fail("--operator makes the further operator's key and certificate here; it does not go with --csr")
        try:
            name = operator_identity(name)
        except PKIError as exc:
            fail(f"--operator: {exc}")
    if not kit and (kit_coordinator is not None or kit_port != 50071 or kit_outbound):
        fail("--coordinator, --port and --outbound-only only go with --kit")
    if kit and csr is None:
        fail("--kit needs --csr: a site kit holds no private key made by the operator; have the site run "
             "`peer init --name NAME` and send you its NAME.csr")
    if csr is None and not name:
        fail("name the site to enrol, or pass its request with --csr NAME.csr")
    request = None
    if csr is not None:
        try:
            request = csr.read_bytes()
        except OSError as exc:
            fail(f"--csr {csr}: cannot read it ({exc.strerror or exc})")
        from fedrelay.identity import IdentityError, csr_name, load_csr

        try:
            parsed = load_csr(request, f"--csr {csr}")
        except IdentityError as exc:
            fail(str(exc))
        asked = csr_name(parsed)
        if name and asked != name:
            fail(f"--csr {csr} is for {asked!r}, not {name!r}")
        name = asked
    try:
        if not operator:
            check_name(name)
    except PKIError as exc:
        fail(str(exc))
    hosts = host or (None if csr is not None else DEFAULT_HOSTS)
    if kit:
        from fedrelay.coordinator.kit import write_kit
        from fedrelay.names import InvalidName, check_address

        try:
            if kit_coordinator is not None:
                check_address(kit_coordinator, "--coordinator")
            if not 1 <= kit_port <= 65535:
                raise ValueError(f"--port must be 1-65535, not {kit_port}")
        except (InvalidName, ValueError) as exc:
            fail(str(exc))
    held = [f for f in (("cert.pem",) if csr is not None else ("key.pem", "cert.pem")) if (out / f).exists()]
    if held and not force:
        fail(f"{out} already holds {' and '.join(held)}: an identity is never overwritten silently; pass --force "
             "to replace it, or choose another --out folder")
    try:
        if csr is not None:
            from fedrelay.identity import CA_FILE, CERT_FILE, KEY_FILE, write_private

            _, cert_pem, ca_pem = sign_csr(request, ca, name=name, hosts=hosts, days=days, source=f"--csr {csr}")
            _check_own_key(out / KEY_FILE, cert_pem)
            out.mkdir(parents=True, exist_ok=True)
            write_private(out / CERT_FILE, cert_pem, 0o644)
            write_private(out / CA_FILE, ca_pem, 0o644)
            from fedrelay.identity import csr_hosts, load_csr

            kit_hosts = host or [h for h in csr_hosts(load_csr(request)) if h != name] or list(DEFAULT_HOSTS)
        else:
            do_enroll(name, ca, out, hosts=hosts, days=days)
            kit_hosts = hosts
        if kit:
            write_kit(out, name, hosts=kit_hosts, coordinator=kit_coordinator, port=kit_port,
                      outbound_only=kit_outbound)
    except (PKIError, ValueError) as exc:
        fail(str(exc))
    except OSError as exc:
        fail(str(exc), exits.FAILED)
    if as_json:
        print(json.dumps({"name": name, "out": str(out), "kit": kit, "operator": operator}))
        if kit and kit_coordinator is None:
            err_console.print("[bold yellow]warning:[/] no --coordinator: peer.env holds a placeholder "
                              "coordinator address to edit", highlight=False)
        return
    if csr is not None:
        from fedrelay.identity import request_fingerprint

        from cryptography import x509 as _x509

        san = _x509.load_pem_x509_certificate(cert_pem).extensions.get_extension_for_class(
            _x509.SubjectAlternativeName).value
        dialled = [str(v) for v in san.get_values_for_type(_x509.DNSName)] + [
            str(v) for v in san.get_values_for_type(_x509.IPAddress)]
        console.print(f"certificate for {name}, dialled at {', '.join(dialled)}", highlight=False, soft_wrap=True)
        console.print(f"enrolled {name}: {out} (cert.pem, ca.pem) for the key of its request (request SHA-256 "
                      f"{request_fingerprint(parsed)}: the site's `peer init` printed the same); the site installs "
                      f"them beside its key: peer install-cert {out} --tls ITS_TLS_FOLDER", highlight=False,
                      soft_wrap=True)
    else:
        console.print(f"enrolled {name}: {out} (key.pem, cert.pem, ca.pem)", highlight=False)
        err_console.print("[bold yellow]for local trials only:[/] this site's private key was made here, at the "
                          "operator's desk; a real site makes its own with `peer init` and you sign its request with "
                          "`enroll --csr`", highlight=False, soft_wrap=True)
    if kit:
        console.print(f"site kit in {out}: cert.pem, ca.pem, peer.env, fedrelay-peer.service, start-peer.sh, "
                      "README.md (no private key: the site keeps its own)", highlight=False, soft_wrap=True)
        if kit_coordinator is None:
            err_console.print("[bold yellow]warning:[/] no --coordinator: peer.env holds a placeholder "
                              "coordinator address to edit", highlight=False)


def _check_own_key(key_path: Path, cert_pem: bytes) -> None:
    """Refuse to write a certificate beside a key it is not for (an --out folder that holds
    another key). Raises ``ValueError``."""
    if not key_path.exists():
        return
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    der = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    try:
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except ValueError:
        raise ValueError(f"{key_path} is not a PEM private key; choose another --out folder") from None
    if key.public_key().public_bytes(*der) != x509.load_pem_x509_certificate(cert_pem).public_key().public_bytes(*der):
        raise ValueError(f"{key_path} is another key than the request's; choose another --out folder")


@app.command("split-dataset")
def split_dataset(
    name: str = typer.Argument(..., help="Dataset: fashion-mnist (image folders) | breast-cancer (tabular-csv "
                               "folders from scikit-learn's Wisconsin Diagnostic Breast Cancer data; no download)."),
    sites: int = typer.Option(10, "--sites", min=1, help="N: number of sites (>= 1)."),
    dirichlet: float = typer.Option(None, "--dirichlet", help="Dirichlet concentration of the label skew "
                                    "\\[default: 0.5 for fashion-mnist; none for breast-cancer: every site gets "
                                    "the overall mix of diagnoses]."),
    seed: int = typer.Option(0, "--seed", help="Fixes the Dirichlet draws, the shares and the subsampling."),
    out: Path = typer.Option(..., "--out", "-o", help="Folder for site-00 ... site-(N-1)."),
    source: Path = typer.Option(None, "--source", help="fashion-mnist: folder with the IDX files \\[default: "
                                "Debian's dataset-fashion-mnist]."),
    max_train_per_site: int = typer.Option(None, "--max-train-per-site", help="fashion-mnist: subsample each "
                                           "site's train images."),
    as_json: bool = json_option("Print the split's summary (per site: samples per class) as JSON."),
) -> None:
    """Write N site folders for a trial: label-skewed image folders (fashion-mnist), or hospitals'
    train.csv/test.csv tables (breast-cancer, for --task tabular-csv)."""
    import math

    from fedrelay.datasets.split import DatasetNotFound, split_dataset as do_split

    if dirichlet is not None and not (math.isfinite(dirichlet) and dirichlet > 0):
        fail(f"--dirichlet must be a finite number > 0 (the concentration of the label skew), got {dirichlet:g}")
    if max_train_per_site is not None and max_train_per_site < 1:
        fail(f"--max-train-per-site must be at least 1, got {max_train_per_site}")
    try:
        summary = do_split(name, sites=sites, dirichlet=dirichlet, seed=seed, out=out, source=source,
                           max_train_per_site=max_train_per_site)
    except DatasetNotFound as exc:
        fail(str(exc), exits.USAGE)
    except ValueError as exc:
        fail(str(exc))
    except OSError as exc:
        fail(str(exc), exits.FAILED)
    if as_json:
        print(json.dumps({"sites": sites, "out": str(out), **summary}, indent=1, default=str))
        return
    console.print(f"wrote {sites} sites under {out}", highlight=False)
    if summary.get("name") == "breast-cancer":
        for s in summary["per_site"]:
            train, test = (", ".join(f"{c} {n}" for c, n in s[split].items()) for split in ("train", "test"))
            console.print(f"  {s['site']}: train {s['n_train']} ({train}), test {s['n_test']} ({test})",
                          highlight=False, soft_wrap=True)
        console.print("train on them with start-chain --task tabular-csv (each folder's fedrelay.toml names the "
                      "label column)", highlight=False, soft_wrap=True)


if __name__ == "__main__":
    app()
