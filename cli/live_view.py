"""The live view of a run, the same for ``start-chain --wait`` and ``watch``: a header, a
progress bar over the run's epochs and a line per transfer while it runs, then its summary."""

from __future__ import annotations

import json

import grpc
import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from fedrelay.cli import connection, exits
from fedrelay.cli.common import console, err_console
from fedrelay.cli.views import render_summary
from fedrelay.registry import STRATEGIES
from fedrelay.text import safe, safe_tree


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
        connection.rpc_fail(exc, address)
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
