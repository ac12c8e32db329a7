"""Smoke runs of the accuracy studies (bench/accuracy.py, few_shot.py, parallel.py, grid.py) end to end
on tiny data through the daemons; the figures are not checked against targets here.

The studies of this module share their trials (:func:`shared_trials`): each study starts its
``LocalTrial`` on a split of the same data (3 sites, Dirichlet 0.5, seed 0) and gets one running
trial, whose daemons start once for the module instead of once per study (a trial's start, about
16 s of CPU for its daemons and their worker templates, was most of each smoke). Starting and
stopping a trial is tested where it is the subject (test_deploy.py, the trials of test_chain.py);
the accuracy study's domain-shift part (4 sites of other data) starts a trial of its own."""

from __future__ import annotations

import hashlib
import inspect
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.system

RECIPE = "paper-cnn"


def _data_key(site_dirs: list[Path]) -> str:
    """A digest of the site folders' names and every file in them (names and bytes)."""
    h = hashlib.sha256()
    for d in site_dirs:
        h.update(d.name.encode() + b"\0")
        for f in sorted(p for p in d.rglob("*") if p.is_file()):
            h.update(str(f.relative_to(d)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


class _Borrowed:
    """What a study's ``with lt.LocalTrial(...) as trial`` gets here: the running shared trial;
    leaving the ``with`` leaves it running."""

    def __init__(self, trial):
        self.trial = trial

    def __enter__(self):
        return self.trial

    def __exit__(self, *exc):
        return None


@pytest.fixture(scope="module")
def shared_trials(tmp_path_factory):
    """``deploy.local_trial.LocalTrial`` replaced, for the studies of this module, by one running
    trial per set of site data (and keyword arguments): a study asking for a trial on site folders
    holding the same files as an earlier study's gets that trial, its daemons still running; one
    on other data stops the running trial and starts its own (one trial runs at a time). Every
    trial is stopped at the module's end."""
    from deploy import local_trial as lt

    real = lt.LocalTrial
    running: dict = {}

    def shared(workdir, site_dirs, **kw):
        options = inspect.signature(real).bind(workdir, site_dirs, **kw)
        options.apply_defaults()  # device="cpu" given or not: the same trial
        key = (_data_key(site_dirs), repr(sorted((k, v) for k, v in options.arguments.items()
                                                 if k not in ("workdir", "site_dirs"))))
        if key not in running:
            for old in running.values():
                old.stop()
            running.clear()
            trial = real(tmp_path_factory.mktemp("shared-trial"), site_dirs, **kw)
            trial.__enter__()  # started, or stopped again and raised
            running[key] = trial
        return _Borrowed(running[key])

    mp = pytest.MonkeyPatch()
    mp.setattr(lt, "LocalTrial", shared)
    yield running
    mp.undo()
    for trial in running.values():
        trial.stop()


def test_few_shot_study_smoke(tmp_path, idx_source, shared_trials):
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


def test_parallel_study_smoke(tmp_path, idx_source, shared_trials):
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


def test_grid_quick_stops_between_cells_and_resumes(tmp_path, idx_source, shared_trials):
    """The study end to end on a chain, a star and a reference: stopped after 2 cells, then resumed
    (the finished cells are skipped), the tables rebuilt from the cells."""
    from bench import grid
    from bench.grid_cells import CellStore

    work, cells = tmp_path / "w", tmp_path / "cells"
    args = ["--quick", "--source", str(idx_source), "--workdir", str(work), "--cells", str(cells),
            "--results", str(tmp_path / "r.json"), "--plots", str(tmp_path / "plots")]
    first = grid.main([*args, "--max-cells", "2"])
    assert not first["failures"]
    study = first["study"]
    store = CellStore(cells, study)
    done = store.all()[RECIPE][0.5][0]
    assert sorted(done) == ["fedavg", "fedelmy"]  # the plan's order: fedelmy, fedavg, local_only
    for m in ("fedelmy", "fedavg"):
        c = done[m]
        assert 0.0 <= c["accuracy"] <= 1.0 and len(c["sha256"]) == 64 and c["bytes"]["ledger_equals_plan"]
        assert c["seed"] == 0 and c["dirichlet"] == 0.5 and c["recipe"]["tag"] == RECIPE and c["machine"]["cpu"]
        assert c["commit"] and c["seconds"] > 0
    assert done["fedelmy"]["bytes"]["to_model_bytes"] == 2 * done["fedelmy"]["bytes"]["model_bytes"]  # 3 sites: 2 hops
    for m in ("fedelmy", "fedavg"):  # the BatchNorm oracle read the run's own final model: same accuracy as is
        o = done[m]["bn_oracle"]
        assert o["accuracy"] == pytest.approx(done[m]["accuracy"]) and 0.0 <= o["oracle_accuracy"] <= 1.0, o
        assert o["bn_layers"] == 2
    assert f"recipe {RECIPE}: 2 of 3 planned cells done; missing: local_only in every cell." in "\n".join(first["notes"])
    second = grid.main(args)
    after = CellStore(cells, study).all()[RECIPE][0.5][0]
    assert sorted(after) == ["fedavg", "fedelmy", "local_only"] and after["local_only"]["bytes"] is None
    assert after["fedelmy"]["run_id"] == done["fedelmy"]["run_id"]  # skipped, not rerun
    assert not second["failures"] and second["missing"] == []
    rows = {r[0]: r for r in second["tables"][0]["rows"]}
    assert set(rows) == {"FedELMY (paper)", "FedAvg (sample-weighted)", "local only"}
    assert rows["FedAvg (sample-weighted)"][4] == "yes" and rows["local only"][3] == "0 (no transfer)"
    assert any(n.startswith(f"Recipe {RECIPE}: Dirichlet(0.5): BatchNorm statistics recomputed over every site's")
               and "over 2 cell(s)" in n for n in second["notes"]), second["notes"]
    assert any(n.startswith(f"Recipe {RECIPE}: every method's `start-chain` got ") and "--model cnn" in n
               and "--lr-schedule constant" in n and "--augment none" in n for n in second["notes"]), second["notes"]


def test_accuracy_study_smoke(tmp_path, idx_source, shared_trials):
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
