"""How the operator commands show a run, its transfers and its sites to people: the run's
summary (``render_summary``: the chain's hops or the star's uploads and final copies, the
relayed legs, the outcome), the final model's metrics, the per-epoch metrics, and the rows of
``runs`` and ``peers``. Every string a site reported is shown as text (``fedrelay.text.safe``)."""

from __future__ import annotations

import time

from rich import box
from rich.table import Table

from fedrelay import privacy, scoring
from fedrelay.cli.common import console
from fedrelay.text import safe, safe_tree


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
        console.print(f"[bold red]revoked:[/] {revoked_line(r)}", highlight=False, soft_wrap=True)
    _render_outcome(s)


def revoked_line(r: dict) -> str:
    """One revoked site, for people: who revoked it, when (local time) and why."""
    why = f": {r['reason']}" if r.get("reason") else ""
    return (f"{r['name']} (certificate {r['serial'][:16]}) by {r['revoked_by'] or '?'} at "
            f"{local_time(r['revoked_at'])}{why}")


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


def final_metrics_table(f: dict) -> Table:
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
        print_wide(final_metrics_table(f))
        for site, v in f["per_site"].items():
            if v.get("privacy"):
                console.print(f"privacy spent at {site}: {privacy.describe(v['privacy'])}", highlight=False)
    if s.get("skipped"):
        console.print(f"[yellow]routed around (down past --peer-timeout):[/] {', '.join(s['skipped'])}; "
                      f"the final model holds the training of {', '.join(s['contributors'])}", highlight=False)
    if s["status"] == "cancelled":
        render_cancelled(s)
    if s.get("refused_by"):
        whose = "its site policy" if s.get("refused_by_policy") else "the site"
        console.print(f"[red]refused by {s['refused_by']}[/] ({whose}), before any model moved: {s['refusal']}",
                      highlight=False)
    if s["error"]:
        console.print(f"[red]error:[/] {s['error']}", highlight=False)
    for w in s["warnings"]:
        console.print(f"[yellow]warning:[/] {w}", highlight=False)


def render_cancelled(s: dict) -> None:
    """One line on a cancelled run: who cancelled it, when (local time) and why."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(s["ended"] or 0))
    why = f": {s['cancel_reason']}" if s.get("cancel_reason") else ""
    console.print(f"[yellow]cancelled[/] by {s.get('cancelled_by') or '?'} at {when}{why}", highlight=False)


def local_time(t: float | None) -> str:
    """Unix seconds as local time, e.g. 2026-11-23 10:15:02; "-" for none."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def print_wide(table: Table) -> None:
    """Print a table whole: on a terminal long cells fold onto more lines; into a pipe or a file
    the table keeps its natural width instead of being cut at 80 columns."""
    if console.is_terminal:
        console.print(table)
    else:
        from rich.console import Console

        Console(width=max(console.width, 400), file=console.file, force_terminal=False, emoji=False).print(table)


def offer_line(o) -> str:
    """One task a site offers, for the peers table (the site's words shown as text)."""
    if o.error:
        return f"{safe(o.name)}: [red]cannot read the data[/] ({safe(o.error, max_chars=120)})"
    return (f"{safe(o.name)} {safe(o.version)}: {len(o.classes)} classes, {sum(c.train for c in o.classes)}/"
            f"{sum(c.test for c in o.classes)}, {safe(o.sha256[:12])}…")


STAGES = {"warmup": "warm-up", "pool": "pool", "fedseq": "fedseq", "aggregate": "aggregation"}


def metrics_table(run_id: str, rows: list[dict]) -> Table:
    """The per-epoch rows of ``coordinator metrics`` (``OperatorClient.metrics``): site, stage,
    pool model, epoch, training loss, validation accuracy, seconds."""
    t = Table(title=f"run {run_id}: training per epoch", box=box.SIMPLE_HEAD)
    for col in ("site", "stage", "model", "epoch", "train loss", "val acc", "s"):
        t.add_column(col, justify="left" if col in ("site", "stage") else "right", no_wrap=col != "site",
                     overflow="fold")
    for r in rows:
        t.add_row(r["site"], STAGES.get(r["stage"], r["stage"]), str(r["model"]) if r["stage"] == "pool" else "-",
                  f"{r['epoch']}/{r['epochs']}", f"{r['train_loss']:.4f}",
                  "-" if r["val_accuracy"] is None else f"{r['val_accuracy']:.4f}", f"{r['seconds']:.2f}")
    return t
