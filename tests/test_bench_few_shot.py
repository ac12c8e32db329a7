"""Smoke runs of the few-shot and parallel studies (bench/few_shot.py, parallel.py) end to end on tiny
data through the daemons; the figures are not checked against targets here."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.system


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
