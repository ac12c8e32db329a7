"""Did OFASD leave its starting point? (issue #25 item 3: "selection that can tell it apart from FedAvg").

OFASD (``fedrelay.peer.aggregators.ofasd``) starts from the uniform weight average of the uploads
(λ = 1/K for every block: FedAvg with uniform weights) and keeps the coefficients of the epoch
its selection prefers, or the start when no epoch improves on it. The daemon says which only in
its worker; the run's ledger holds the final model and every upload's digest. So the bench reads
the answer from the files: :func:`distance_from_average` recomputes the uniform average of the
very uploads the aggregating site combined (its own ``outgoing.safetensors`` and the arrived
``uploads/*.safetensors`` of ``<trial>/state/<aggregator>/runs/<run id>/``; their count must be
the run's, ``cell["bytes"]["uploads"]`` + 1) and measures how far the final model lies from it. A
final model at the average means OFASD returned (uniform) FedAvg; one away from it means a
distilled epoch was kept. ``bench.grid`` records it in every new OFASD cell (``ofasd_start``);
the report does not read it yet.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["AT_AVERAGE", "distance_from_average"]

AT_AVERAGE = 1e-5  # relative L2 distance below which the final model is the weight average (float32 rounding)


def distance_from_average(trial_dir: Path, cell: dict, final: Path) -> dict:
    """How far a star cell's final model (the safetensors file ``final``) lies from the uniform
    weight average of the uploads its aggregating site (``cell["bytes"]["aggregator"]``) combined.

    Returns:
        ``{"relative_l2": ‖final − average‖₂ / ‖average‖₂ over the floating-point entries,
        "max_abs": the largest absolute difference of one entry, "uploads": how many were
        averaged, "at_average": relative_l2 < AT_AVERAGE}``.

    Raises:
        FileNotFoundError: the aggregating site's run folder or an upload is missing.
        ValueError: not a star cell, the uploads found are not the run's N (``uploads`` + 1), or
            their keys differ from the final model's.
    """
    import torch
    from safetensors.torch import load_file

    from fedrelay.peer.aggregators import split_payload
    from fedrelay.peer.states import average_states

    b = cell.get("bytes") or {}
    if b.get("kind") != "star" or not b.get("aggregator"):
        raise ValueError(f"not a star cell (bytes.kind {b.get('kind')!r})")
    run = Path(trial_dir) / "state" / str(b["aggregator"]) / "runs" / str(cell["run_id"])
    files = [run / "outgoing.safetensors"] + sorted((run / "uploads").glob("*.safetensors"))
    if not files[0].is_file():
        raise FileNotFoundError(f"no upload of the aggregating site under {run}")
    if len(files) != int(b["uploads"]) + 1:
        raise ValueError(f"{len(files)} upload file(s) under {run}, the run had {int(b['uploads']) + 1}")
    states = [split_payload(load_file(str(f)))[0] for f in files]
    average = average_states(states)
    model = load_file(str(final))
    if set(model) != set(average):
        raise ValueError(f"the final model's keys differ from the uploads' ({final})")
    diff = norm = 0.0
    max_abs = 0.0
    for key, avg in average.items():
        if not avg.is_floating_point():
            continue
        a, f = avg.to(torch.float64), model[key].to(torch.float64)
        diff += float(((f - a) ** 2).sum())
        norm += float((a ** 2).sum())
        max_abs = max(max_abs, float((f - a).abs().max()) if a.numel() else 0.0)
    relative = (diff ** 0.5) / (norm ** 0.5) if norm > 0 else float(diff > 0)
    return {"relative_l2": relative, "max_abs": max_abs, "uploads": len(files), "at_average": relative < AT_AVERAGE}
