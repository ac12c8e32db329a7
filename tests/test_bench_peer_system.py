"""bench.peer_system (NVIDIA FLARE's cyclic workflow beside fedrelay's FedSeq on the same split):
its smoke run end to end (FLARE's simulator and fedrelay's daemons) when NVIDIA FLARE is installed,
and the reading of FLARE's communication statistics."""

from __future__ import annotations

import json

import pytest

from bench.peer_flare import MIB, server_stream_bytes
from bench.peer_system import flare_available

WHY_NOT = flare_available()


@pytest.mark.system
@pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
def test_peer_system_study_smoke(tmp_path, idx_source):
    """Both systems train on the same sites in the same order; the bytes are what each plan says;
    a rerun takes every cell from the cache."""
    from bench import peer_system

    args = ["--quick", "--source", str(idx_source), "--workdir", str(tmp_path / "w")]
    data = peer_system.main([*args, "--results", str(tmp_path / "r.json")])
    assert not data["failures"]
    block = json.loads((tmp_path / "r.json").read_text())["peer_system"]["dir0_5"]
    assert block["same_order"] is True
    for method in ("fedseq", "flare_cyclic"):
        assert set(block[method]["per_seed"]) == {"0"} and 0.0 <= block[method]["mean"] <= 1.0
    cells = peer_system.Cache(tmp_path / "w" / "cells")
    group = ("S1-E1-Ew0-a0.06-b1", "n3-maxall", "dir0.5-seed0")
    ours, theirs = cells.get(*group, "fedseq"), cells.get(*group, "flare_cyclic")
    n, m = len(ours["order"]), ours["bytes"]["model_bytes"]
    assert theirs["order"] == theirs["visited"] == ours["order"] and set(theirs["site_seconds"]) == set(ours["order"])
    assert ours["in_process_accuracy"] == ours["accuracy"]
    assert theirs["test_samples"] == ours["test_samples"]
    # the same training images at every site: the daemon's train split less its validation tenth
    split = json.loads((tmp_path / "w" / "splits" / "n3-maxall" / "dir0.5-seed0" / "split.json").read_text())
    assert theirs["train_images"] == {s["site"]: s["n_train"] - int(0.1 * s["n_train"]) for s in split["per_site"]}
    assert all(e == 1 for e in theirs["epochs"].values())
    assert ours["bytes"]["to_model_bytes"] == (n - 1) * m
    # FLARE's M is the state's tensor bytes; fedrelay's payload adds its safetensors header (a few KB)
    mt = theirs["bytes"]["model_bytes"]
    assert mt < m < mt + 4096 and theirs["bytes"]["to_model_bytes"] == 2 * n * mt
    stats = theirs["bytes"]["flare_stream_stats"]
    # (streams are FLARE's download pieces, not transfers: their counts are not N; only their bytes are checked)
    assert stats["model_sent_streams"] >= n and stats["model_received_streams"] >= n
    assert abs(stats["model_sent"] + stats["model_received"] - 2 * n * mt) < 0.05 * 2 * n * mt
    assert "## peer_system" in (tmp_path / "RESULTS.md").read_text()
    again = peer_system.main([*args, "--results", str(tmp_path / "r2.json")])
    assert again["dir0_5"] == data["dir0_5"] and again["wall_seconds_this_run"] < 60


def test_server_stream_bytes_reads_flares_histograms(tmp_path):
    """Model streams are the download-service ones; MiB floats become bytes; other streams count
    only in the totals."""
    model = "server.simulate_job:blob:return_only:download_service__:download_service__download"
    stats = {
        "sent_stream_sizes": {"pool": {"cat_data": {
            model: ["", {"count": 2, "total": 1.5, "min": 0.5, "max": 1.0}, ""],
            "server.simulate_job:blob:return_only:server_command:get_task": [{"count": 1, "total": 0.25}]}}},
        "received_stream_sizes": {"pool": {"cat_data": {
            model.replace("blob", "stream"): [{"count": 1, "total": 0.5}, ""]}}},
    }
    (tmp_path / "server" / "pool_stats").mkdir(parents=True)
    (tmp_path / "server" / "pool_stats" / "simulator_cell_stats.json").write_text(json.dumps(stats))
    got = server_stream_bytes(tmp_path)
    assert got == {"model_sent": int(1.5 * MIB), "model_received": int(0.5 * MIB), "model_sent_streams": 2,
                   "model_received_streams": 1, "all_sent": int(1.75 * MIB), "all_received": int(0.5 * MIB)}
    with pytest.raises(FileNotFoundError):
        server_stream_bytes(tmp_path / "nowhere")


def test_flare_starts_from_the_weights_a_fedrelay_chain_starts_from():
    """The chain's first site draws its model from the run's seed (a chain ignores --init shared);
    FLARE's initial checkpoint is that draw: training from it gives the first site's model bit for
    bit, and from the star plans' shared init (another draw) it does not."""
    import torch

    from bench.peer_flare import initial_state
    from fedrelay.models import build_seeded
    from fedrelay.peer.training import TrainConfig, derive_seed, run_site
    from fedrelay.tasks.image_folder import spec as image_spec

    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (40, 1, 8, 8), dtype=torch.uint8, generator=gen)
    y = torch.randint(0, 3, (40,), generator=gen)
    spec = image_spec("cnn", 1, (8, 8), 3)
    cfg = TrainConfig(strategy="fedseq", models_per_site=1, local_epochs=1, warmup_epochs=0, selection="last-epoch")
    site_seed = derive_seed(7, "site", 0)

    def first_site(initial=None):
        sent, _ = run_site(None, spec, (x[:32], y[:32]), (x[32:], y[32:]), cfg, site_seed, "cpu", initial=initial)
        return sent

    chain = first_site()
    assert all(torch.equal(chain[k], v) for k, v in first_site(initial_state(spec, 7)).items())
    shared = first_site(build_seeded(spec, derive_seed(7, "init")).state_dict())
    assert not all(torch.equal(chain[k], v) for k, v in shared.items())


def test_flares_site_loop_is_fedrelays_fedseq_loop_given_the_same_batch_order():
    """The plain PyTorch loop FLARE's sites run (bench/peer_flare_site.py) and fedrelay's FedSeq visit
    give the same weights bit for bit when they draw the same batch order: the study's two systems
    differ in their shuffles (and transfers), not in the recipe."""
    import torch

    from bench.peer_flare import initial_state
    from bench.peer_flare_site import train as flare_train
    from fedrelay.models import build_model
    from fedrelay.peer.strategies.fedseq import train_fedseq
    from fedrelay.peer.training import TrainConfig, derive_seed, seeded_generator
    from fedrelay.tasks.image_folder import spec as image_spec

    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (300, 1, 8, 8), dtype=torch.uint8, generator=gen)
    y = torch.randint(0, 3, (300,), generator=gen)
    spec = image_spec("cnn", 1, (8, 8), 3)
    cfg = TrainConfig(strategy="fedseq", models_per_site=1, local_epochs=2, warmup_epochs=0, selection="last-epoch")
    m0, seed = initial_state(spec, 3), derive_seed(3, "site", 0)
    ours = train_fedseq(m0, spec, (x[:270], y[:270]), (x[270:], y[270:]), cfg, seed, "cpu")
    model = build_model(spec)
    model.load_state_dict(m0)
    flare_train(model, x[:270], y[:270], 2, 1e-3, 1e-4, 128, seeded_generator(derive_seed(seed, "fedseq")))
    theirs = model.state_dict()
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    other = build_model(spec)
    other.load_state_dict(m0)
    flare_train(other, x[:270], y[:270], 2, 1e-3, 1e-4, 128, torch.Generator().manual_seed(1))
    assert not torch.equal(other.state_dict()["classifier.3.weight"], ours["classifier.3.weight"])
