"""Smoke runs of every benchmark study (tiny data, seconds), so that the scripts cannot rot.
The figures they print are not checked against targets here: that is what bench/ is for."""

from __future__ import annotations

import json


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


def test_accuracy_study_smoke(tmp_path, idx_source):
    from bench import accuracy

    accuracy.main(["--quick", "--source", str(idx_source), "--workdir", str(tmp_path / "w"),
                   "--results", str(tmp_path / "r.json"), "--plots", str(tmp_path / "plots")])
    a = json.loads((tmp_path / "r.json").read_text())["accuracy"]
    assert not a["failures"]
    for method in accuracy.METHODS:
        cell = a["dir0_5"][method]
        assert 0.0 <= cell["mean"] <= 1.0 and cell["std"] >= 0.0 and set(cell["per_seed"]) == {"0"}
    for method in ("fedelmy", "fedseq_best_val"):
        cell = a["domain_shift"][method]
        assert 0.0 <= cell["mean"] <= 1.0 and cell["std"] >= 0.0 and len(cell["per_seed"]) == 1
    assert (tmp_path / "plots" / "accuracy.png").stat().st_size > 1000
    assert (tmp_path / "plots" / "accuracy_domain_shift.png").stat().st_size > 1000
    assert "## accuracy" in (tmp_path / "RESULTS.md").read_text()
    # a rerun finds every cell in the cache and trains nothing
    again = accuracy.main(["--quick", "--source", str(idx_source), "--workdir", str(tmp_path / "w"),
                           "--results", str(tmp_path / "r2.json"), "--plots", str(tmp_path / "plots")])
    assert again["dir0_5"]["fedelmy"] == a["dir0_5"]["fedelmy"] and again["wall_seconds_this_run"] < 30


def test_record_into_a_subsection_keeps_the_section_and_survives_its_rewrite(tmp_path):
    from bench.common import record

    r = tmp_path / "r.json"
    record("transfer", {"x": 1}, results=r)
    record("accuracy", {"dir0_5": {"fedelmy": 1}}, results=r)
    record("accuracy", {"dir0_1": {"fedelmy": {"T1": 0.5}}, "tables": [], "notes": ["n"]}, results=r, sub="few_shot")
    data = json.loads(r.read_text())
    assert data["transfer"]["x"] == 1 and data["accuracy"]["dir0_5"] == {"fedelmy": 1}
    assert data["accuracy"]["few_shot"]["dir0_1"] == {"fedelmy": {"T1": 0.5}} and data["accuracy"]["subsections"] == ["few_shot"]
    record("accuracy", {"dir0_5": {"fedelmy": 2}}, results=r)  # the one-shot study rewrites its section
    data = json.loads(r.read_text())
    assert data["accuracy"]["dir0_5"] == {"fedelmy": 2} and data["accuracy"]["few_shot"]["notes"] == ["n"]
    md = (tmp_path / "RESULTS.md").read_text()
    assert "## accuracy" in md and "### accuracy.few_shot" in md and "## transfer" in md

