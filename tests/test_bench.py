"""Smoke runs of the benchmark studies (bench/): the transfer, training and chain studies end to end
on tiny data. The figures they print are not checked against targets here: that is what bench/ is for.
(The accuracy studies' smokes are in test_bench_accuracy.py, where they share their trials.)"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.system


def test_transfer_study_smoke(tmp_path):
    from bench import transfer

    out = transfer.main(["--quick", "--results", str(tmp_path / "r.json")])
    data = json.loads((tmp_path / "r.json").read_text())
    t = data["transfer"]
    assert t["payload_bytes"] == out["payload_bytes"] > 0
    assert t["handoff_seconds"] > 0 and t["socket_seconds"] > 0 and t["ratio_vs_socket"] > 0
    assert {"date", "commit", "cpu", "torch"} <= set(data["meta"])
    assert "## transfer" in (tmp_path / "RESULTS.md").read_text()

def test_training_study_smoke(tmp_path):
    from bench import training

    training.main(["--quick", "--results", str(tmp_path / "r.json")])
    t = json.loads((tmp_path / "r.json").read_text())["training"]
    assert set(t["images_per_second"]) == {"plain_loop", "fedseq", "fedseq_best_val", "fedelmy_pool_only", "fedelmy"}
    assert t["fedseq_vs_plain_loop"] > 0 and "fedelmy_regulariser_overhead" in t

def test_chain_study_smoke(tmp_path, idx_source):
    from bench import chain

    chain.main(["--quick", "--source", str(idx_source), "--workdir", str(tmp_path / "w"),
                "--results", str(tmp_path / "r.json"), "--plots", str(tmp_path / "plots")])
    c = json.loads((tmp_path / "r.json").read_text())["chain"]
    comm = c["communication"]
    assert comm["ledger_total_bytes"] == comm["expected_total_bytes"] == 2 * comm["model_bytes"]
    assert comm["fedseq_ledger_total_bytes"] == comm["expected_total_bytes"]
    assert comm["wire_over_payload"] >= 1.0
    if comm["kernel_bytes_per_hop"] is not None:  # as root with iproute2 (CI): counted by the kernel per hop
        assert comm["wire_counted_by"].startswith("kernel")
        for per_hop in comm["kernel_bytes_per_hop"].values():
            assert len(per_hop) == 2 and all(comm["model_bytes"] <= b < 1.5 * comm["model_bytes"] for b in per_hop)
    assert c["memory"]["peak_rss_bytes"] > 0 and c["chain_overhead"] >= 1.0
    matrix = c["pool_distances"]["matrix"]
    assert len(matrix) == 3 and all(matrix[i][i] == 0 for i in range(3)) and matrix[0][1] > 0
    assert (tmp_path / "plots" / "pool_heatmap.png").stat().st_size > 1000
    assert (tmp_path / "plots" / "bytes_per_hop.png").stat().st_size > 1000
