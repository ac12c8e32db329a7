"""A run's life from the operator's desk: ``start-chain`` (with every method's options, generated
from ``fedrelay.registry``, and its ``--config`` file), ``stop`` and ``watch``."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Literal

import grpc
import typer

from fedrelay import params as run_params, privacy
from fedrelay import registry, tasks as task_registry
from fedrelay.cli import connection
from fedrelay.cli.common import INSECURE, console, err_console, fail, load_config_callback
from fedrelay.cli.connection import COORD, TLS
from fedrelay.cli.live_view import watch_view
from fedrelay.cli.views import render_cancelled
from fedrelay.coordinator.plan import ORDERS
from fedrelay.registry import STRATEGIES
from fedrelay.text import safe, safe_tree


def _choice(values):
    """The allowed values of an option as the type typer offers as choices, from the registry or
    fedrelay/params.py (never retyped)."""
    return Literal[tuple(values)]


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
    model: str = typer.Option("", "--model", help="One of the task's models (image-folder: cnn, resnet18, cnn-gn (for DP), cnn-wide; "
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
    client = connection.open_client(coordinator, tls, insecure)
    sites = [p.strip() for p in peers.split(",") if p.strip()]
    try:
        reply = client.start_chain(peers=sites, order=order, seed=seed, model=model, params=run_params.to_pb(chosen),
                                   rounds=rounds, aggregator=aggregator, task=task, task_sha256=task_sha256.lower())
    except grpc.RpcError as exc:
        connection.rpc_fail(exc, coordinator)
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
    s = connection.ask(coordinator, tls, insecure, lambda client: client.stop(run_id, reason=reason))
    if as_json:
        print(json.dumps(s, indent=1))
        return
    console.print(f"run [bold]{safe(run_id)}[/] cancelled; its sites stop at their next epoch or transfer boundary",
                  highlight=False)
    render_cancelled(safe_tree(s))


def watch(run_id: str = typer.Argument(..., help="The run's id (from start-chain or `coordinator runs`)."),
          coordinator: str = COORD,
          as_json: bool = typer.Option(False, "--json", help="At the end print the run's summary as JSON on stdout "
                                       "(the progress goes to stderr), like start-chain --wait --json."),
          tls: Path = TLS, insecure: bool = INSECURE) -> None:
    """Follow a run live (the view of start-chain --wait: progress per epoch, a line per transfer),
    then print its summary; a run that has ended gets its summary at once. Exit code 1 unless the
    run finished. Ctrl-C stops watching, not the run."""
    with connection.open_client(coordinator, tls, insecure) as client:
        watch_view(client, run_id, coordinator, as_json)
