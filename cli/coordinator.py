"""``coordinator``: the coordinator daemon and the operator's commands."""

from __future__ import annotations

import json
import time
from pathlib import Path

import grpc
import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich import box
from rich.table import Table

from fedrelay import params as run_params
from fedrelay.cli.common import (INSECURE_HELP, TLS_HELP, console, err_console, fail, setup_logging, stop_on_sigterm,
                                 transport_from)
from fedrelay.registry import STRATEGIES

app = typer.Typer(help="fedrelay coordinator: plans chains, assigns roles, keeps the ledger.",
                  no_args_is_help=True, add_completion=False)

COORD = typer.Option("127.0.0.1:50070", "--coordinator", "-c", envvar="FEDRELAY_COORDINATOR",
                     help="HOST:PORT of the coordinator.")
INSECURE = typer.Option(False, "--insecure", help=INSECURE_HELP)
TLS = typer.Option(None, "--tls", help=TLS_HELP + " Operator commands: PKI/operator.", file_okay=False)
HOSTS = typer.Option(None, "--host", help="Host name or IP others dial this identity at (repeatable; goes in the "
                     "certificate's SAN) \\[default: localhost, 127.0.0.1, ::1].")


def _client(address: str, tls: Path | None, insecure: bool):
    transport = transport_from(tls, insecure)
    from fedrelay.coordinator.client import OperatorClient

    return OperatorClient(address, transport)


def _rpc_fail(exc: grpc.RpcError, address: str) -> None:
    details = exc.details() or ""
    if exc.code() == grpc.StatusCode.UNAVAILABLE and any(w in details for w in ("ssl", "SSL", "TLS", "Tls", "verif", "handshake")):
        fail(f"TLS with the coordinator at {address} failed ({details}); check --tls (same CA? an insecure "
             "coordinator?)")
    if exc.code() == grpc.StatusCode.UNAVAILABLE:
        fail(f"coordinator at {address} is not reachable ({exc.details()}); is `coordinator serve` running?")
    fail(exc.details() or exc.code().name)


@app.command()
def serve(
    listen: str = typer.Option("127.0.0.1:50070", "--listen", help="HOST:PORT to listen on."),
    db: Path = typer.Option(Path("fedrelay-ledger.sqlite"), "--db", help="SQLite ledger file."),
    tls: Path = typer.Option(None, "--tls", help=TLS_HELP + " Here: PKI/coordinator.", file_okay=False),
    insecure: bool = INSECURE,
    peer_timeout: float = typer.Option(120.0, "--peer-timeout",
                                       help="Seconds a site of a running chain may go without a heartbeat "
                                            "before the chain is routed around it."),
    verbose: bool = typer.Option(False, "--verbose", "-v"),
) -> None:
    """Run the coordinator (ledger: SQLite at --db)."""
    transport = transport_from(tls, insecure)
    setup_logging(verbose, prefix="[coordinator] ")
    stop_on_sigterm()
    from fedrelay.coordinator.service import serve as run_service

    try:
        run_service(listen, db, transport=transport, peer_timeout=peer_timeout)
    except (RuntimeError, ValueError) as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        pass


@app.command("start-chain")
def start_chain(
    coordinator: str = COORD,
    peers: str = typer.Option("", "--peers", help="Comma-separated site names \\[default: every registered peer]."),
    order: str = typer.Option("random", "--order", help="random (fixed by --seed) | given (as --peers lists them)."),
    seed: int = typer.Option(..., "--seed", help="Fixes the order, each site's train/validation split and the training."),
    strategy: str = typer.Option("fedelmy", "--strategy", help="What each site does: "
                                 + "; ".join(f"{s.name}: {s.summary}" for s in STRATEGIES.values()) + "."),
    rounds: int = typer.Option(1, "--rounds", "-T", help="T: passes over the chain (few-shot cycles, FedELMY "
                               "supplementary Alg. 1; warm-up in round 1 only); 1 = one-shot."),
    models_per_site: int = typer.Option(5, "--models-per-site", "-S", help="S: pool models trained per site."),
    local_epochs: int = typer.Option(2, "--local-epochs", "-E", help="E: epochs per pool model (fedseq: S*E in all)."),
    warmup_epochs: int = typer.Option(2, "--warmup-epochs", help="Ew: warm-up epochs at the first site."),
    alpha: float = typer.Option(1.0, "--alpha", help="Weight of d1 (distance to the pool)."),
    beta: float = typer.Option(1.0, "--beta", help="Weight of d2 (distance to m0)."),
    lr: float = typer.Option(1e-3, "--lr", help="Adam learning rate."),
    batch_size: int = typer.Option(128, "--batch-size"),
    weight_decay: float = typer.Option(1e-4, "--weight-decay", help="Adam weight decay (coupled L2)."),
    selection: str = typer.Option("best-val", "--selection", help="best-val (the paper's protocol) | last-epoch"),
    model: str = typer.Option("cnn", "--model", help="cnn | resnet18"),
    aggregator: str = typer.Option("", "--aggregator", help="Parallel methods: the site that combines the uploads "
                                   "\\[default: chosen by --seed]."),
    init: str = typer.Option("", "--init", help="The initial model: shared (one seeded init for every site) | per-site "
                             "(independent seeded inits, as supplementary Alg. 2 reads) | file (--init-weights) "
                             "\\[default: shared]."),
    init_weights: str = typer.Option("", "--init-weights", help="--init file: the SHA-256 of a safetensors weights file "
                                     "every site holds in its --weights-dir (README: 'A pretrained initial model')."),
    weighting: str = typer.Option("samples", "--weighting", help="fedavg: samples (weights n_k / n) | uniform."),
    maecho_tau: int = typer.Option(100, "--maecho-tau", help="maecho: echo iterations (tau)."),
    maecho_eta: float = typer.Option(0.05, "--maecho-eta", help="maecho: step (eta)."),
    maecho_alpha: str = typer.Option("uniform", "--maecho-alpha", help="maecho: model weights uniform (the authors' "
                                     "released code) | qp (Eq. 6, solved with cvxopt)."),
    ofasd_mode: str = typer.Option("block", "--ofasd-mode", help="ofasd: block (a coefficient per site and parameter "
                                   "tensor) | client (one per site)."),
    ofasd_epochs: int = typer.Option(2, "--ofasd-epochs", help="ofasd: epochs of coefficient learning at the aggregator."),
    ofasd_lr: float = typer.Option(0.01, "--ofasd-lr", help="ofasd: Adam learning rate of the coefficients."),
    upload_timeout: float = typer.Option(3600.0, "--upload-timeout", help="Parallel methods: seconds the aggregator "
                                         "waits for the uploads after its own training, then combines what arrived."),
    wait: bool = typer.Option(False, "--wait", help="Follow the run until it ends and print its summary."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON (with --wait: the run summary)."),
    tls: Path = TLS,
    insecure: bool = INSECURE,
) -> None:
    """Start a run over the registered peers: a chain (one-shot, or T rounds with --rounds), or,
    for the parallel methods (fedavg, fedelmy-pfl, maecho, ofasd), a star around --aggregator."""
    chosen = dict(strategy=strategy, models_per_site=models_per_site, local_epochs=local_epochs,
                  warmup_epochs=warmup_epochs, alpha=alpha, beta=beta, lr=lr, batch_size=batch_size,
                  weight_decay=weight_decay, selection=selection, init=init, init_sha256=init_weights.lower(),
                  weighting=weighting, maecho_tau=maecho_tau, maecho_eta=maecho_eta, maecho_alpha=maecho_alpha,
                  ofasd_mode=ofasd_mode, ofasd_epochs=ofasd_epochs, ofasd_lr=ofasd_lr, upload_timeout=upload_timeout)
    try:
        run_params.check(chosen, strict=True)
        run_params.check_rounds(rounds)
    except ValueError as exc:
        fail(str(exc))
    client = _client(coordinator, tls, insecure)
    names = [p.strip() for p in peers.split(",") if p.strip()]
    try:
        reply = client.start_chain(peers=names, order=order, seed=seed, arch=model, params=run_params.to_pb(chosen),
                                   rounds=rounds, aggregator=aggregator)
    except grpc.RpcError as exc:
        _rpc_fail(exc, coordinator)
    out = err_console if as_json else console
    if not wait:
        for w in reply.warnings:
            err_console.print(f"[yellow]warning:[/] {w}", highlight=False)
        if as_json:
            print(json.dumps({"run_id": reply.run_id}))
        else:
            console.print(f"run [bold]{reply.run_id}[/] started: {' -> '.join(reply.order)}")
        return
    cycles = f", {rounds} rounds" if rounds > 1 else ""
    star = STRATEGIES[strategy].plan == "star"
    shape = "sites in parallel" if star else "chain order"
    out.print(f"run [bold]{reply.run_id}[/]: {strategy}{cycles}, {shape} {' -> '.join(reply.order)}",
              highlight=False)
    for w in reply.warnings:
        out.print(f"[yellow]warning:[/] {w}", highlight=False)
    per_site = models_per_site * local_epochs
    total = warmup_epochs + per_site * len(reply.order) * rounds
    if star:  # every site warms up; OFASD also learns its coefficients at the aggregator
        total = (warmup_epochs + per_site) * len(reply.order) + (ofasd_epochs if strategy == "ofasd" else 0)
    try:
        _follow(client, reply.run_id, total, out)
        summary = client.run(reply.run_id)
    except grpc.RpcError as exc:
        _rpc_fail(exc, coordinator)
    except KeyboardInterrupt:
        out.print(f"stopped watching; the run goes on: coordinator show {reply.run_id}")
        raise typer.Exit(130)
    if as_json:
        print(json.dumps(summary, indent=1))
    else:
        render_summary(summary)
    if summary["status"] != "finished":
        raise typer.Exit(1)


WATCH_RECONNECT = 600.0  # seconds --wait keeps trying to reach a coordinator that went away


def _follow(client, run_id: str, total_epochs: int, out) -> None:
    """Show the run's events: a progress bar over all epochs of the chain, a line per hop."""
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("epochs"),
                  TimeElapsedColumn(), console=out, transient=False) as progress:
        task = progress.add_task("chain", total=total_epochs)
        seq, lost_since = 0, None
        while True:
            try:
                for ev in client.watch(run_id, after_seq=seq):
                    seq, lost_since = ev.seq, None
                    if ev.kind == "epoch":
                        progress.advance(task)
                        progress.update(task, description=f"{ev.site}")
                    elif ev.kind in ("hop", "upload", "final", "failed", "finished", "cancelled", "warning", "skip"):
                        progress.console.print(f"{ev.message}", highlight=False)
                    elif ev.kind == "state" and (ev.message.endswith(": training") or "restarted" in ev.message):
                        progress.console.print(ev.message, highlight=False)
                    if ev.kind in ("finished", "failed", "cancelled"):
                        return
                return  # the stream ended: the run is over
            except grpc.RpcError as exc:
                # The coordinator restarted or the link dropped: the run goes on; follow it again
                # from the last event seen, for up to WATCH_RECONNECT seconds.
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    raise
                lost_since = lost_since or time.monotonic()
                if time.monotonic() - lost_since > WATCH_RECONNECT:
                    raise
                progress.console.print(f"coordinator unreachable ({exc.code().name}); reconnecting ...",
                                       highlight=False)
                time.sleep(2.0)


def _fmt_bytes(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def _status(h: dict) -> str:
    """A transfer's standing in the ledger: both ends agree, one has spoken, or they disagree."""
    return {"done": "[green]done[/]", "disputed": "[red]disputed[/]"}.get(h["status"], h["status"])


def _transfer_table(title: str, first: str, rows: list[dict], rounds: int = 1) -> Table:
    t = Table(title=title, box=box.SIMPLE_HEAD, collapse_padding=True, pad_edge=False)
    columns = (first, *(("r",) if rounds > 1 else ()), "sender → receiver", "bytes", "on wire", "SHA-256",
               "s", "tries", "ledger")
    for col in columns:  # nothing is cut: the table fits 80 columns with 8-digit site numbers
        t.add_column(col, justify="left" if col in ("sender → receiver", "SHA-256", "ledger") else "right",
                     no_wrap=True)
    for h in rows:
        tries = str(h["attempts"]) + (f" (resumed at {_fmt_bytes(h['resumed_from'])})" if h["resumed_from"] else "")
        t.add_row(str(h["hop"]), *((str(h["round"]),) if rounds > 1 else ()), f"{h['sender']} → {h['receiver']}",
                  _fmt_bytes(h["payload_bytes"]), _fmt_bytes(h["wire_bytes"]), (h["sha256"] or "")[:10] + "…",
                  f"{h['seconds']:.2f}", tries, _status(h))
    return t


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
    rounds = s.get("rounds", 1)
    cycles = f", {rounds} rounds" if rounds > 1 else ""
    console.print(f"\n[bold]run {s['run_id']}[/] ({s['strategy']}{cycles}, {s['arch']}, seed {s['seed']}): "
                  f"[bold]{s['status']}[/]", highlight=False)
    if s.get("aggregator"):
        _render_star(s)
    else:
        _render_chain(s)
    _render_outcome(s)


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


def _render_outcome(s: dict) -> None:
    disputed = [h for h in s["hops"] + s.get("uploads", []) + s["final_transfers"] if h["status"] == "disputed"]
    for h in disputed:
        console.print(f"[red]disputed:[/] {h['sender']} → {h['receiver']} (transfer {h['hop']}): the sender reported "
                      f"sha256 {(h['sha256'] or '')[:16]}…, {_fmt_bytes(h['payload_bytes'])} bytes; the receiver kept "
                      f"sha256 {h['receiver_sha256'][:16]}…, {_fmt_bytes(h['receiver_bytes'])} bytes", highlight=False)
    f = s["final"]
    if f:
        console.print(f"final model sha256 {f['sha256']}", highlight=False)
        t = Table(title="final model accuracy per site (own test split)")
        t.add_column("site")
        t.add_column("accuracy", justify="right")
        t.add_column("test images", justify="right")
        for site, v in f["per_site"].items():
            t.add_row(site, f"{v['accuracy']:.4f}", str(v["test_samples"]))
        t.add_row("[bold]global[/]", f"[bold]{f['accuracy']:.4f}[/]",
                  str(sum(v["test_samples"] for v in f["per_site"].values())))
        console.print(t)
    if s.get("skipped"):
        console.print(f"[yellow]routed around (down past --peer-timeout):[/] {', '.join(s['skipped'])}; "
                      f"the final model holds the training of {', '.join(s['contributors'])}", highlight=False)
    if s["status"] == "cancelled":
        _render_cancelled(s)
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
    console.print(f"run [bold]{run_id}[/] cancelled; its sites stop at their next epoch or transfer boundary",
                  highlight=False)
    _render_cancelled(s)


@app.command("forget-peer")
def forget_peer(
    name: str = typer.Argument(..., help="The registered site to remove (`coordinator peers` lists them)."),
    coordinator: str = COORD,
    tls: Path = TLS,
    insecure: bool = INSECURE,
) -> None:
    """Remove a registered peer from the ledger (refused while it is a site of a running run).
    A daemon still running under that name registers again at its next heartbeat: stop it first
    to remove the site for good."""
    with _client(coordinator, tls, insecure) as client:
        try:
            reply = client.forget_peer(name)
        except grpc.RpcError as exc:
            _rpc_fail(exc, coordinator)
    console.print(f"forgot peer {reply.name} (registered at {reply.address}); if its daemon is still running it "
                  "registers again at its next heartbeat", highlight=False)


@app.command()
def show(run_id: str, coordinator: str = COORD, as_json: bool = typer.Option(False, "--json"),
         tls: Path = TLS, insecure: bool = INSECURE) -> None:
    """Show one run: order, hops, bytes, final accuracy (works while it runs)."""
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
def runs(coordinator: str = COORD, as_json: bool = typer.Option(False, "--json"), tls: Path = TLS,
         insecure: bool = INSECURE) -> None:
    """List the runs in the ledger."""
    with _client(coordinator, tls, insecure) as client:
        try:
            all_runs = client.runs()
        except grpc.RpcError as exc:
            _rpc_fail(exc, coordinator)
    if as_json:
        print(json.dumps(all_runs, indent=1))
        return
    t = Table(title="runs")
    for col in ("run", "strategy", "sites", "status", "transfers", "accuracy"):
        t.add_column(col)
    for s in all_runs:
        acc = f"{s['final']['accuracy']:.4f}" if s["final"] else "-"
        t.add_row(s["run_id"], s["strategy"], str(len(s["order"])), s["status"],
                  str(len(s["hops"]) + len(s.get("uploads", []))), acc)
    console.print(t)


@app.command()
def peers(coordinator: str = COORD, tls: Path = TLS, insecure: bool = INSECURE) -> None:
    """List the registered peers."""
    import time

    with _client(coordinator, tls, insecure) as client:
        try:
            records = client.peers()
        except grpc.RpcError as exc:
            _rpc_fail(exc, coordinator)
    t = Table(title="peers")
    for col in ("site", "address", "images", "classes", "train", "test", "device", "last seen"):
        t.add_column(col)
    for p in records:
        t.add_row(p.name, p.address, f"{p.channels}x{p.height}x{p.width}", str(len(p.classes)),
                  str(sum(c.train for c in p.classes)), str(sum(c.test for c in p.classes)), p.device,
                  f"{time.time() - p.last_seen:.0f} s ago")
    console.print(t)


@app.command("fetch-model")
def fetch_model(run_id: str, out: Path = typer.Option(..., "-o", "--out", help="Where to write the safetensors file."),
                coordinator: str = COORD, tls: Path = TLS, insecure: bool = INSECURE) -> None:
    """Download a finished run's final model (safetensors), verified against its SHA-256."""
    with _client(coordinator, tls, insecure) as client:
        try:
            sha, size = client.fetch_model(run_id, out)
        except grpc.RpcError as exc:
            _rpc_fail(exc, coordinator)
        except ValueError as exc:
            fail(str(exc))
    console.print(f"wrote {out} ({size:,} bytes, sha256 {sha})", highlight=False)


@app.command("init-ca")
def init_ca(
    out: Path = typer.Option(..., "--out", help="PKI folder to create: ca/, coordinator/, operator/."),
    host: list[str] = HOSTS,
) -> None:
    """Create the federation's CA, the coordinator's identity (OUT/coordinator) and the operator's (OUT/operator)."""
    from fedrelay.coordinator.pki import DEFAULT_HOSTS, PKIError, init_ca as do_init

    try:
        do_init(out, hosts=host or DEFAULT_HOSTS)
    except (PKIError, OSError) as exc:
        fail(str(exc))
    console.print(f"CA in {out / 'ca'} (keep ca-key.pem private); identities: {out / 'coordinator'} "
                  f"(coordinator serve --tls), {out / 'operator'} (operator commands --tls)", highlight=False)


@app.command()
def enroll(
    name: str = typer.Argument(..., help="The site's name: its identity, and what it passes as `peer serve --name`."),
    ca: Path = typer.Option(..., "--ca", help="The PKI folder made by init-ca."),
    out: Path = typer.Option(..., "--out", help="Folder to write key.pem (0600), cert.pem, ca.pem to."),
    host: list[str] = HOSTS,
    days: int = typer.Option(825, "--days", help="Validity of the certificate in days."),
) -> None:
    """Issue a key and certificate for one site (give the folder to the site; --tls DIR for `peer serve`)."""
    from fedrelay.coordinator.pki import DEFAULT_HOSTS, PKIError, enroll as do_enroll

    if days < 1:
        fail("--days must be >= 1")
    try:
        do_enroll(name, ca, out, hosts=host or DEFAULT_HOSTS, days=days)
    except (PKIError, OSError) as exc:
        fail(str(exc))
    console.print(f"enrolled {name}: {out} (key.pem, cert.pem, ca.pem)", highlight=False)


@app.command("split-dataset")
def split_dataset(
    name: str = typer.Argument(..., help="Dataset: fashion-mnist"),
    sites: int = typer.Option(10, "--sites", help="N: number of sites."),
    dirichlet: float = typer.Option(0.5, "--dirichlet", help="Dirichlet concentration of the label skew."),
    seed: int = typer.Option(0, "--seed"),
    out: Path = typer.Option(..., "--out", help="Folder for site-00 ... site-(N-1)."),
    source: Path = typer.Option(None, "--source", help="Folder with the IDX files \\[default: Debian's dataset-fashion-mnist]."),
    max_train_per_site: int = typer.Option(None, "--max-train-per-site", help="Subsample each site's train images."),
) -> None:
    """Write N label-skewed site folders (ImageFolder layout) for a trial."""
    from fedrelay.coordinator.split import DatasetNotFound, split_dataset as do_split

    try:
        summary = do_split(name, sites=sites, dirichlet=dirichlet, seed=seed, out=out, source=source,
                           max_train_per_site=max_train_per_site)
    except DatasetNotFound as exc:
        fail(str(exc), code=2)
    except (ValueError, OSError) as exc:
        fail(str(exc))
    console.print(f"wrote {sites} sites under {out}", highlight=False)
    _ = summary


if __name__ == "__main__":
    app()
