"""NVIDIA FLARE's cyclic weight transfer on fedrelay's site folders, run by FLARE's own simulator
(``bench.peer_system``'s peer system).

The job is FLARE's PyTorch ``CyclicRecipe`` (``nvflare.app_opt.pt.recipes.cyclic``): the
server's ``CyclicController`` relays the model through the clients in a fixed order (one round:
each site once), two transfers per visit (server -> site, site -> server), and persists the last
site's model. Every client runs ``bench/peer_flare_site.py`` (FLARE's Client API; the training
recipe is there). The initial model is the one the first site of a fedrelay chain run with
``--seed SEED`` draws (:func:`initial_state`), handed to the recipe as its initial checkpoint, so
both systems start from the same weights.

Run as a child process of the study (``python -m bench.peer_flare SPEC.json OUT.json``), so that
FLARE's logging and processes stay out of the study's: SPEC is the JSON of :func:`run`'s
arguments; OUT receives its result.

Bytes: FLARE keeps no per-run record of bytes transferred, only diagnostic statistics of its
communication layer. :func:`server_stream_bytes` reads them from the server's
``pool_stats/simulator_cell_stats.json`` (stream sizes in MiB, summed over each category's
histogram bins, at the server, through which every transfer passes).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

SITE_SCRIPT = Path(__file__).resolve().parent / "peer_flare_site.py"
MIB = 1024 * 1024


def server_stream_bytes(workspace: Path) -> dict:
    """The server's stream statistics of a finished simulator job under ``workspace``:
    ``{"model_sent", "model_received", "all_sent", "all_received"}`` in bytes (rounded from
    FLARE's MiB floats) and ``{"model_sent_streams", "model_received_streams"}`` (counts).
    "model" streams are the object downloads FLARE moves tensors by (category
    ``...return_only:download_service__:download_service__download``: the server handing the
    model to a site, and the server pulling a site's result). Raises ``FileNotFoundError``
    when the job left no statistics."""
    stats = json.loads((workspace / "server" / "pool_stats" / "simulator_cell_stats.json").read_text())

    def total(pool: str, model_only: bool) -> tuple[int, int]:
        mib, count = 0.0, 0
        for category, bins in stats.get(pool, {}).get("pool", {}).get("cat_data", {}).items():
            if model_only and "return_only:download_service__:download_service__download" not in category:
                continue
            for b in bins:
                if b:
                    mib += b["total"]
                    count += b["count"]
        return round(mib * MIB), count

    sent, n_sent = total("sent_stream_sizes", True)
    received, n_received = total("received_stream_sizes", True)
    return {"model_sent": sent, "model_received": received, "model_sent_streams": n_sent,
            "model_received_streams": n_received, "all_sent": total("sent_stream_sizes", False)[0],
            "all_received": total("received_stream_sizes", False)[0]}


def initial_state(spec, seed: int) -> dict:
    """The initial model of a fedrelay chain run with ``--seed seed``: its first site (round 1,
    position 0, site seed ``derive_seed(seed, "site", 0)``) builds it in ``run_site`` as
    ``build_seeded(spec, derive_seed(site_seed, "init"))`` (a chain ignores ``--init shared``:
    ``peer/assignment.py``)."""
    from fedrelay.models import build_seeded
    from fedrelay.peer.training import derive_seed

    return build_seeded(spec, derive_seed(derive_seed(seed, "site", 0), "init")).state_dict()


def run(sites_root: str, order: list[str], classes: list[str], image_shape: list[int], seed: int, epochs: int,
        warmup_epochs: int, workspace: str, lr: float = 1e-3, weight_decay: float = 1e-4, batch_size: int = 128,
        task_assignment_timeout: int = 3600, threads: int | None = None) -> dict:
    """One cyclic round over ``order`` (site folder names under ``sites_root``) with FLARE's
    simulator in ``workspace``; every site trains ``epochs`` epochs, the first also
    ``warmup_epochs`` more (fedrelay's warm-up). Returns ``{"seconds": simulator wall time,
    "visits": the sites' JSON lines in visit order, "final_model": path of the persisted
    model, "stream_bytes": server_stream_bytes(...)}``. ``task_assignment_timeout``: seconds a
    site may take to pick up its task before the controller skips it (FLARE's default, 10 s, skips
    sites on a loaded machine). Raises ``RuntimeError`` when the job fails."""
    import torch
    from nvflare.app_opt.pt.recipes.cyclic import CyclicRecipe
    from nvflare.client.config import ExchangeFormat
    from nvflare.recipe.sim_env import SimEnv

    from fedrelay.tasks.image_folder import spec as image_spec

    work = Path(workspace)
    work.mkdir(parents=True, exist_ok=True)
    c, h, w = image_shape
    spec = image_spec("cnn", c, (h, w), len(classes))
    init = work / "initial_model.pt"
    torch.save(initial_state(spec, seed), init)
    visits = work / "visits.jsonl"
    visits.unlink(missing_ok=True)
    train_args = (f"--sites-root {sites_root} --classes {','.join(classes)} --seed {seed} --epochs {epochs} "
                  f"--warmup-epochs {warmup_epochs} --first-site {order[0]} --lr {lr:g} --weight-decay "
                  f"{weight_decay:g} --batch-size {batch_size} --log {visits}")
    started = time.monotonic()
    recipe = CyclicRecipe(
        name="fedrelay-peer-cyclic",
        model={"class_path": "fedrelay.tasks.image_folder.models.SmallCNN",
               "args": {"in_channels": c, "image_size": [h, w], "num_classes": len(classes)}},
        initial_ckpt=str(init), num_rounds=1, min_clients=len(order), train_script=str(SITE_SCRIPT),
        train_args=train_args, task_assignment_timeout=task_assignment_timeout,
        server_expected_format=ExchangeFormat.PYTORCH, server_config_overrides={"order": list(order)})
    env = SimEnv(clients=list(order), num_threads=threads or len(order), workspace_root=str(work / "simulator"))
    recipe.execute(env)
    seconds = time.monotonic() - started
    if env.last_run_failed:
        raise RuntimeError(f"the FLARE simulator job failed; logs under {work / 'simulator'}")
    job = work / "simulator" / "fedrelay-peer-cyclic"
    final = job / "server" / "simulate_job" / "app_server" / "FL_global_model.pt"
    if not final.exists():
        raise RuntimeError(f"the FLARE job persisted no model ({final} missing); logs under {job}")
    lines = [json.loads(x) for x in visits.read_text().splitlines()] if visits.exists() else []
    return {"seconds": seconds, "visits": lines, "init": "fedrelay chain's first site: build_seeded(spec, "
            "derive_seed(derive_seed(seed, 'site', 0), 'init'))", "final_model": str(final), "stream_bytes": server_stream_bytes(job),
            "workspace": str(job)}


if __name__ == "__main__":
    spec_path, out_path = Path(sys.argv[1]), Path(sys.argv[2])
    result = run(**json.loads(spec_path.read_text()))
    out_path.write_text(json.dumps(result, indent=1) + "\n")
