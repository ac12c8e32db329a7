"""Smoke runs of the accuracy studies (bench/accuracy.py, few_shot.py, parallel.py) end to end on tiny
data through the daemons; the figures are not checked against targets here."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.system


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
