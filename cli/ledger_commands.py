"""The operator's reading of the ledger, and its one deletion: ``show``, ``runs``, ``peers``,
``metrics`` (with its MLflow / TensorBoard export), ``fetch-model``, ``audit`` (a run's signed
records verified with the CA certificate) and ``forget-peer``."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import typer
from rich.table import Table

from fedrelay.cli import connection, exits
from fedrelay.cli.common import INSECURE, console, err_console, fail, json_option
from fedrelay.cli.connection import COORD, TLS
from fedrelay.cli.views import (final_metrics_table, local_time, metrics_table, offer_line, print_wide,
                                render_summary, revoked_line)
from fedrelay.text import safe, safe_tree


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
    reply = connection.ask(coordinator, tls, insecure, lambda client: client.forget_peer(name))
    if as_json:
        print(json.dumps({"name": reply.name, "address": reply.address}))
        return
    console.print(f"forgot peer {safe(reply.name)} (registered at {safe(reply.address or 'no address')}); its "
                  "daemon's heartbeats are refused from now on; a daemon started there afterwards registers anew",
                  highlight=False)


def show(run_id: str = typer.Argument(..., help="The run's id (from start-chain or `coordinator runs`)."),
         coordinator: str = COORD,
         as_json: bool = typer.Option(False, "--json", help="Print the run's summary as one JSON object."),
         tls: Path = TLS, insecure: bool = INSECURE) -> None:
    """Show one run: order, hops, bytes, final accuracy; while it runs, what each site is doing
    now (state, pool model, epoch)."""
    s = connection.ask(coordinator, tls, insecure, lambda client: client.run(run_id))
    if as_json:
        print(json.dumps(s, indent=1))
    else:
        render_summary(s)


def runs(coordinator: str = COORD,
         as_json: bool = typer.Option(False, "--json", help="Print every run's summary as a JSON list "
                                      "(created, ended: unix seconds)."),
         tls: Path = TLS, insecure: bool = INSECURE) -> None:
    """List the runs in the ledger."""
    all_runs = connection.ask(coordinator, tls, insecure, lambda client: client.runs())
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
                  str(len(s["hops"]) + len(s.get("uploads", []))), acc, local_time(s["created"]),
                  local_time(s["ended"]))
    print_wide(t)


def peers(coordinator: str = COORD,
          as_json: bool = typer.Option(False, "--json", help="Print the peers as a JSON list, each with last_seen "
                                       "(unix seconds), age_seconds and live (heard from within the coordinator's "
                                       "--peer-timeout)."),
          tls: Path = TLS, insecure: bool = INSECURE) -> None:
    """List the registered peers: address, data, device, last heartbeat, and whether each is live
    (heard from within the coordinator's --peer-timeout) or stale."""
    from fedrelay.coordinator.client import peer_dict

    records = connection.ask(coordinator, tls, insecure, lambda client: client.peers())
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

            status = f"[bold red]revoked[/] {safe(revoked_line(revocation_dict(p.revocation)))}"
        address = safe(p.address) or ("connects out only, " + ("[green]stream open[/]" if p.connected
                                                              else "[red]no stream[/]"))
        offers = "\n".join(offer_line(o) for o in p.tasks) or "-"
        if p.classes_omitted:
            offers += f"\n(+{p.classes_omitted} classes not listed: the reply's size cap)"
        t.add_row(safe(p.name), address, offers, safe(p.device),
                  f"{p.age_seconds:.0f} s ago", status)
    print_wide(t)


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
    with connection.open_client(coordinator, tls, insecure) as client:
        try:
            rows = client.metrics(run_id)
            summary = client.run(run_id) if exporting or not (as_json or as_csv) else None
        except grpc.RpcError as exc:
            connection.rpc_fail(exc, coordinator)
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
        print_wide(metrics_table(safe(run_id), safe_tree(rows)))
        if final:
            print_wide(final_metrics_table(safe_tree(final)))  # metric names are the task's words


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
    with connection.open_client(coordinator, tls, insecure) as client:
        try:
            sha, size = client.fetch_model(run_id, out)
        except grpc.RpcError as exc:
            connection.rpc_fail(exc, coordinator)
        except ValueError as exc:
            fail(str(exc), exits.FAILED)
        except OSError as exc:
            fail(f"cannot write {out}: {exc.strerror or exc}", exits.FAILED)
    if as_json:
        print(json.dumps({"run_id": run_id, "path": str(out), "bytes": size, "sha256": sha}))
        return
    console.print(f"wrote {safe(out)}: the final model ({size:,} bytes, sha256 {safe(sha)} in the ledger) with fedrelay's "
                  "metadata; load it with fedrelay.load_model", highlight=False)


AUDIT_SHOWN = 10  # problems listed after the first (the rest are counted)


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
