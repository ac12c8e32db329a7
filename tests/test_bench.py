"""Smoke runs of every benchmark study (tiny data, seconds), so that the scripts cannot rot.
The figures they print are not checked against targets here: that is what bench/ is for."""

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


def test_accuracy_study_smoke(tmp_path, idx_source):
    """The grid's script end to end on a subset of its methods (FedELMY and both references; the
    ablations and FedSeq are the same pipeline through the daemons with other parameters, and each
    strategy runs through the daemons in its own tests)."""
    from bench import accuracy

    methods = ["fedelmy", "local_only", "centralized"]
    args = ["--quick", "--source", str(idx_source), "--workdir", str(tmp_path / "w"), "--methods", ",".join(methods),
            "--domain-methods", "fedelmy", "--plots", str(tmp_path / "plots")]
    accuracy.main([*args, "--results", str(tmp_path / "r.json")])
    a = json.loads((tmp_path / "r.json").read_text())["accuracy"]
    assert not a["failures"]
    assert set(methods) <= set(a["dir0_5"])
    for method in methods:
        cell = a["dir0_5"][method]
        assert 0.0 <= cell["mean"] <= 1.0 and cell["std"] >= 0.0 and set(cell["per_seed"]) == {"0"}
    cell = a["domain_shift"]["fedelmy"]
    assert 0.0 <= cell["mean"] <= 1.0 and cell["std"] >= 0.0 and len(cell["per_seed"]) == 1
    assert (tmp_path / "plots" / "accuracy.png").stat().st_size > 1000
    assert (tmp_path / "plots" / "accuracy_domain_shift.png").stat().st_size > 1000
    assert "## accuracy" in (tmp_path / "RESULTS.md").read_text()
    # a rerun finds every cell in the cache and trains nothing
    again = accuracy.main([*args, "--results", str(tmp_path / "r2.json")])
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


def test_few_shot_study_smoke(tmp_path, idx_source):
    from bench import few_shot

    r = tmp_path / "r.json"
    r.write_text(json.dumps({"transfer": {"x": 1}}))  # an earlier section stays
    args = ["--quick", "--source", str(idx_source), "--workdir", str(tmp_path / "w"), "--results", str(r),
            "--plots", str(tmp_path / "plots")]
    few_shot.main(args)
    data = json.loads(r.read_text())
    assert data["transfer"] == {"x": 1}
    fs = data["accuracy"]["few_shot"]
    assert not fs["failures"]
    for method in ("fedelmy", "fedseq_last_epoch"):
        m = fs["dir0_5"][method]
        for t in ("T1", "T2"):
            assert 0.0 <= m[t]["mean"] <= 1.0 and m[t]["std"] >= 0.0 and set(m[t]["per_seed"]) == {"0"}
        by = m["bytes"]
        assert by["per_T"]["T1"]["hops"] == 2 and by["per_T"]["T2"]["hops"] == 5 and by["ledger_equals_plan"]
        assert by["per_T"]["T2"]["ledger_bytes_per_seed"]["0"] == 5 * by["model_bytes"] == by["run_total_bytes_per_seed"]["0"]
        assert m["final_check"]["max_abs_diff"] <= 1e-9
    assert (tmp_path / "plots" / "few_shot.png").stat().st_size > 1000
    assert "### accuracy.few_shot" in (tmp_path / "RESULTS.md").read_text()
    # T = 1 against a one-shot grid of the same configuration: equal where it is, flagged where not
    t1 = {m: fs["dir0_5"][m]["T1"]["per_seed"]["0"] for m in ("fedelmy", "fedseq_last_epoch")}
    one_shot = tmp_path / "one_shot.json"
    one_shot.write_text(json.dumps({"accuracy": {
        "config": {"sites": 3, "max_train_per_site": None, "S": 2, "E": 1, "Ew": 1, "alpha": 0.06, "beta": 1.0},
        "dir0_5": {"fedelmy": {"per_seed": {"0": t1["fedelmy"]}},
                   "fedseq_last_epoch": {"per_seed": {"0": t1["fedseq_last_epoch"] - 0.01}}}}}))
    again = few_shot.main([*args, "--publish-only", "--one-shot-results", str(one_shot)])
    assert again["dir0_5"]["fedelmy"]["T1_vs_one_shot"]["equal_in"] == 1
    assert again["dir0_5"]["fedseq_last_epoch"]["T1_vs_one_shot"]["equal_in"] == 0
    assert again["dir0_5"]["fedelmy"]["T2"] == fs["dir0_5"]["fedelmy"]["T2"] and again["wall_seconds_this_run"] < 30
    assert any("equal in 1 of 2 cells" in n and "fedseq_last_epoch/seed 0" in n for n in again["notes"])
    assert any("Why they differ" in n for n in again["notes"])


def test_parallel_study_smoke(tmp_path, idx_source):
    """The study's script end to end on two stars (one with the aggregator's extra tensors) and a
    reference (its chains are the accuracy study's pipeline, smoke-tested above); every parallel
    method runs through the daemons in test_star.py."""
    from bench import parallel

    methods = ["fedavg", "maecho", "local_only"]
    chain, star = [], ["fedavg", "maecho"]
    r = tmp_path / "r.json"
    r.write_text(json.dumps({"transfer": {"x": 1}, "accuracy": {"dir0_5": {"fedelmy": 2}}}))  # earlier sections stay
    args = ["--quick", "--source", str(idx_source), "--workdir", str(tmp_path / "w"), "--results", str(r),
            "--plots", str(tmp_path / "plots"), "--methods", ",".join(methods)]
    parallel.main(args)
    data = json.loads(r.read_text())
    assert data["transfer"] == {"x": 1} and data["accuracy"]["dir0_5"] == {"fedelmy": 2}
    p = data["accuracy"]["parallel"]
    assert not p["failures"] and "parallel" in data["accuracy"]["subsections"]
    block = p["dir0_5"]
    for m in methods:
        assert 0.0 <= block[m]["mean"] <= 1.0 and block[m]["n"] == 1 and block[m]["seeds"] == [0], m
    comm = data["communication"]
    m_bytes = comm["fedavg"]["model_bytes"]
    for m in chain:  # 3 sites: 2 hops of M, 2 final copies of M
        assert comm[m]["kind"] == "chain" and comm[m]["to_model_bytes"] == 2 * m_bytes and comm[m]["hops"] == 2
    for m in star:  # 2 uploads of M + extra
        c = comm[m]
        assert c["kind"] == "star" and c["uploads"] == 2 and c["upload_bytes"] == m_bytes + c["extra_bytes"]
        assert c["to_model_bytes"] == 2 * c["upload_bytes"]
        assert block[m]["bytes"]["aggregator_per_seed"]["0"].startswith("site-")
    assert comm["maecho"]["extra_bytes"] > comm["maecho"]["model_bytes"] and comm["fedavg"]["extra_bytes"] > 0
    for c in [comm[m] for m in chain + star]:
        assert c["final_copies"] == 2 and c["final_copies_bytes"] == 2 * m_bytes and c["ledger_equals_plan"]
    assert (tmp_path / "plots" / "parallel.png").stat().st_size > 1000
    md = (tmp_path / "RESULTS.md").read_text()
    assert "### accuracy.parallel" in md and "## communication" in md
    # a ledger that disagrees with the plan fails the cell
    run = {"strategy": "fedseq", "run_id": "x", "model_bytes": 10, "hops": [{"payload_bytes": 10, "status": "done"}],
           "planned_hops": 2, "total_bytes": 10, "expected_total_bytes": 20,
           "final_transfers": [{"payload_bytes": 10, "status": "done"}] * 2}
    try:
        parallel.ledger_check(run, 3)
    except RuntimeError as exc:
        assert "disagrees" in str(exc)
    else:
        raise AssertionError("a chain ledger of 1 hop for 3 sites passed")
    # figures again from the cache, without training
    again = parallel.main([*args, "--publish-only"])
    assert again["dir0_5"]["maecho"]["per_seed"] == block["maecho"]["per_seed"] and again["wall_seconds_this_run"] < 30
