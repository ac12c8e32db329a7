"""The full-data grid study (bench/grid.py): its cell order, its stops, its tracked cells and the
reading RESULTS.md gets from them. (Its --quick smoke through the daemons, interrupted and resumed,
is in test_bench_accuracy.py, where the accuracy studies' smokes share their trials.)"""

from __future__ import annotations

import datetime as dt
import json
import subprocess

import pytest

from bench import grid
from bench.grid_cells import CellStore, commit_cell, plan

RECIPE = "paper-cnn"


def test_cells_come_round_robin_seed_by_seed():
    cells = plan({0.5: [0, 1], 0.1: [0, 1, 2]}, ["fedelmy", "fedavg"])
    assert cells[:4] == [(0, 0.5, "fedelmy"), (0, 0.5, "fedavg"), (0, 0.1, "fedelmy"), (0, 0.1, "fedavg")]
    assert cells[4:8] == [(1, 0.5, "fedelmy"), (1, 0.5, "fedavg"), (1, 0.1, "fedelmy"), (1, 0.1, "fedavg")]
    assert cells[8:] == [(2, 0.1, "fedelmy"), (2, 0.1, "fedavg")]  # the extra seeds at 0.1 come last


def test_deadline_and_seed_flags():
    now = dt.datetime(2026, 1, 1, 23, 0, tzinfo=dt.timezone.utc)
    assert grid.deadline_at("23:30", now) == now.replace(minute=30)
    assert grid.deadline_at("00:50", now) == dt.datetime(2026, 1, 2, 0, 50, tzinfo=dt.timezone.utc)
    assert grid.seed_range("0-2,5", "--seeds-at") == [0, 1, 2, 5]
    with pytest.raises(SystemExit, match="--deadline"):
        grid.deadline_at("25:99", now)
    with pytest.raises(SystemExit, match="--seeds-at"):
        grid.seed_range("a-b", "--seeds-at")
    with pytest.raises(SystemExit, match="Dirichlet 0.3 is not in --dirichlets"):
        grid.parse(["--seeds-at", "0.3=0-9"])
    args = grid.parse(["--seeds-at", "0.1=0-9", "--recipe", "ours"])
    assert args.seeds_of == {0.5: [0, 1, 2, 3, 4], 0.1: list(range(10))} and args.model == "cnn-gn"
    assert args.worker_slots == 1 and grid.parse(["--device", "cuda"]).worker_slots == 3
    with pytest.raises(SystemExit, match="--worker-slots 0"):
        grid.parse(["--worker-slots", "0"])


def test_deadline_estimate_is_the_methods_median_else_all_cells(tmp_path):
    store = CellStore(tmp_path, "s")
    assert grid._estimate(store, RECIPE, "fedelmy") == 0.0
    for seed, (m, secs) in enumerate([("fedelmy", 100.0), ("fedelmy", 300.0), ("fedavg", 50.0)]):
        store.put({"method": m, "seconds": secs, "accuracy": 0.5}, RECIPE, 0.5, seed, m)
    assert grid._estimate(store, RECIPE, "fedelmy") == 200.0 and grid._estimate(store, RECIPE, "fedavg") == 50.0
    assert grid._estimate(store, RECIPE, "ofasd") == 100.0  # no ofasd cell yet: all cells' median


def _cell(acc: float, sha: str, method: str, to_model: int | None = 1000) -> dict:
    b = None if to_model is None else {"to_model_bytes": to_model, "final_total_bytes": 900, "ledger_equals_plan": True}
    return {"method": method, "accuracy": acc, "sha256": sha, "bytes": b, "seconds": 5.0, "commit": "abc",
            "machine": {"cpu": "test cpu", "device": "cpu"},
            "recipe": {"name": "paper", "tag": RECIPE, "about": "constant lr", "model": "cnn"}}


@pytest.mark.integration
def test_publish_only_reads_the_cells_and_states_the_targets(tmp_path):
    store = CellStore(tmp_path / "cells", "s")
    acc = {  # (Dirichlet, seed) -> method -> accuracy
        (0.5, 0): {"fedelmy": 0.90, "fedseq_last_epoch": 0.85, "fedseq_best_val": 0.80, "fedavg": 0.70, "ofasd": 0.70,
                   "fedelmy-kd": 0.91, "local_only": 0.6, "centralized": 0.92},
        (0.5, 1): {"fedelmy": 0.88, "fedseq_last_epoch": 0.86, "fedseq_best_val": 0.81, "fedavg": 0.71, "ofasd": 0.72,
                   "fedelmy-kd": 0.90, "local_only": 0.6, "centralized": 0.92},
        (0.1, 0): {"fedelmy": 0.50, "fedseq_last_epoch": 0.40, "fedavg": 0.30, "ofasd": 0.35},
    }
    for (a, s), ms in acc.items():
        for m, v in ms.items():
            store.put(_cell(v, f"{m}-{a}-{s}", m, None if m in ("local_only", "centralized") else 1000), RECIPE, a, s, m)
    r = tmp_path / "r.json"
    methods = "fedelmy,fedelmy-kd,fedseq_last_epoch,fedseq_best_val,fedavg,ofasd,maecho,local_only,centralized"
    data = grid.main(["--publish-only", "--cells", str(tmp_path / "cells"), "--study", "s", "--seeds", "0,1",
                      "--methods", methods, "--results", str(r), "--plots", str(tmp_path / "plots")])
    assert json.loads(r.read_text())["accuracy"]["grid"]["recipes"][RECIPE]["dir0_5"]["fedelmy"]["n"] == 2
    b = data["recipes"][RECIPE]["dir0_5"]
    assert b["fedelmy"]["mean"] == pytest.approx(0.89) and b["fedelmy"]["to_model_bytes"] == [1000]
    titles = [t["title"] for t in data["tables"]]
    assert len(titles) == 2 and all(t.startswith(f"Recipe {RECIPE} (constant lr, model cnn)") for t in titles)
    notes = "\n".join(data["notes"])
    # FedELMY against the strongest FedSeq (last epoch here), paired by seed: +5.0 and +2.0 points
    assert "Dirichlet(0.5): FedELMY − the strongest FedSeq (FedSeq, last epoch), paired by seed: +3.50" in notes
    assert "ahead in 2 of 2 seed(s)" in notes and "target ≥ +3 points MET" in notes
    assert "Dirichlet(0.1): FedELMY − the strongest FedSeq (FedSeq, last epoch), paired by seed: +10.00" in notes
    assert "Dirichlet(0.5): best method FedELMY-KD (ours) at 90.50 ± 0.71 % (n = 2); target ≥ 89.5 % MET" in notes
    assert "Dirichlet(0.1): best method FedELMY (paper) at 50.00 % (n = 1); target ≥ 75.0 % NOT met " \
           "(short by 25.00 points)" in notes
    assert "FedELMY-KD (ours) − FedELMY (paper): +1.50" in notes
    assert "Dirichlet(0.5): OFASD's accuracy differs from FedAvg's in 1 of 2 cell(s) (equal at seed(s) 0)" in notes
    assert "'differs in every cell' NOT met" in notes
    assert "Dirichlet(0.1): OFASD's accuracy differs from FedAvg's in 1 of 1 cell(s); its final model differs in 1 " \
           "of 1; target 'differs in every cell' MET." in notes
    # missing: maecho everywhere, every seed-1 cell at 0.1, the references and the extension at 0.1
    assert f"recipe {RECIPE}: 20 of 36 planned cells done; missing: fedelmy at Dir(0.1) seed 1; fedelmy-kd at " \
           "Dir(0.1) seeds 0,1; fedseq_last_epoch at Dir(0.1) seed 1; fedseq_best_val at Dir(0.1) seeds 0,1; fedavg " \
           "at Dir(0.1) seed 1; ofasd at Dir(0.1) seed 1; maecho in every cell; local_only at Dir(0.1) seeds 0,1; " \
           "centralized at Dir(0.1) seeds 0,1." in notes
    assert (tmp_path / "plots" / f"grid-{RECIPE}.png").stat().st_size > 1000
    md = (tmp_path / "RESULTS.md").read_text()
    assert "### accuracy.grid" in md and f"**Recipe {RECIPE} (constant lr, model cnn); Dirichlet(0.1)" in md


@pytest.mark.integration  # publishing starts a process (ldconfig -p, from an import)
def test_a_study_at_other_settings_publishes_beside_the_grid(tmp_path):
    r = tmp_path / "r.json"
    r.write_text(json.dumps({"accuracy": {"grid": {"study": "the grid's"}, "subsections": ["grid"]}}))
    store = CellStore(tmp_path / "cells", grid.GridConfig(grid.parse(["-S", "1"]), {}).study)
    store.put({**_cell(0.7, "a", "fedelmy"), "config": {"method_args": {"fedelmy": ["--kd-weight", "0.75"]}}},
              RECIPE, 0.5, 0, "fedelmy")
    data = grid.main(["--publish-only", "-S", "1", "--cells", str(tmp_path / "cells"), "--seeds", "0",
                      "--dirichlets", "0.5", "--methods", "fedelmy", "--results", str(r),
                      "--plots", str(tmp_path / "plots")])
    acc = json.loads(r.read_text())["accuracy"]
    assert store.study == "fmnist-n10-full-S1-E5-Ew5" and data["study"] == store.study
    assert acc["grid"]["study"] == "the grid's"  # the grid (S = 5) is left as it was
    assert acc[f"grid_{store.study}"]["recipes"][RECIPE]["dir0_5"]["fedelmy"]["n"] == 1
    assert data["summary"].startswith("A study beside the full-data grid")
    assert f"Recipe {RECIPE}: FedELMY (paper) ran with its own extra `start-chain` flags `--kd-weight 0.75` " \
           "(--method-args)." in data["notes"]
    assert (tmp_path / "plots" / f"grid-{store.study}-{RECIPE}.png").exists()
    assert not (tmp_path / "plots" / f"grid-{RECIPE}.png").exists()


def other_study(tmp_path, config: dict) -> None:
    """A third study, ``other``, of FedELMY-KD without d1/d2 at 0.88 and 0.90 (seeds 0, 1)."""
    store = CellStore(tmp_path / "cells", "other")
    for seed, v in enumerate((0.88, 0.90)):
        store.put({**_cell(v, f"o{seed}", "fedelmy-kd-nod"), "config": config}, RECIPE, 0.5, seed, "fedelmy-kd-nod")


@pytest.mark.integration  # publishing starts a process (ldconfig -p, from an import)
def test_a_study_of_other_flags_pairs_with_the_study_it_varies(tmp_path):
    s1 = {"sites": 10, "max_train_per_site": None, "S": 1, "E": 5, "Ew": 5, "alpha": 0.06, "beta": 1.0,
          "init": "shared", "method_args": {}}
    base, kdw = CellStore(tmp_path / "cells", "base"), CellStore(tmp_path / "cells", "kdw")
    for seed, (elmy, seq, kd3, kd) in enumerate([(0.85, 0.76, 0.75, 0.87), (0.84, 0.87, 0.78, 0.89)]):
        for m, v in (("fedelmy", elmy), ("fedseq_last_epoch", seq), ("fedelmy-kd-nod", kd3)):
            base.put({**_cell(v, f"{m}{seed}", m), "config": s1}, RECIPE, 0.5, seed, m)
        kdw.put({**_cell(kd, f"kd{seed}", "fedelmy-kd-nod"),
                 "config": {**s1, "method_args": {"fedelmy-kd-nod": ["--kd-weight", "0.75"]}}},
                RECIPE, 0.5, seed, "fedelmy-kd-nod")
    argv = ["--publish-only", "-S", "1", "--cells", str(tmp_path / "cells"), "--study", "kdw", "--seeds", "0,1",
            "--dirichlets", "0.5", "--methods", "fedelmy-kd-nod", "--results", str(tmp_path / "r.json"),
            "--plots", str(tmp_path / "plots")]
    data = grid.main([*argv, "--paired-with", "base"])
    notes = "\n".join(data["notes"])
    kd = "Recipe paper-cnn: Dirichlet(0.5): FedELMY-KD without d1/d2 (ours, α = β = 0) (this study)"
    assert f"{kd} − FedELMY (paper) (study base), paired by seed: +3.50 ± 2.12 points, ahead in 2 of 2" in notes
    # the strongest FedSeq of the other study by its mean, last epoch here: +11.00 and +2.00 points
    assert f"{kd} − FedSeq, last epoch (study base), paired by seed: +6.50 ± 6.36 points, ahead in 2 of 2" in notes
    assert f"{kd} − FedELMY-KD without d1/d2 (ours, α = β = 0) (study base), paired by seed: +11.50" in notes
    assert data["paired_with"] == ["base"]
    # a study paired with two: the lines of each (the second pairs its own FedELMY-KD without d1/d2)
    other_study(tmp_path, s1)
    both = grid.main([*argv, "--paired-with", "base", "--paired-with", "other"])
    assert both["paired_with"] == ["base", "other"]
    assert f"{kd} − FedELMY (paper) (study base)" in "\n".join(both["notes"])
    assert f"{kd} − FedELMY-KD without d1/d2 (ours, α = β = 0) (study other), paired by seed: -1.00" in "\n".join(both["notes"])
    with pytest.raises(SystemExit, match="that is this study"):
        grid.main([*argv, "--paired-with", "kdw"])
    with pytest.raises(SystemExit, match="no cell"):
        grid.main([*argv, "--paired-with", "nothing"])
    base.put({**_cell(0.8, "x", "fedelmy"), "config": {**s1, "S": 5}}, RECIPE, 0.1, 0, "fedelmy")
    with pytest.raises(SystemExit, match=r"other settings: S 5 \(this study: 1\)"):
        grid.main([*argv, "--paired-with", "base"])


def test_the_reading_names_mixed_options_and_defaults_changed_since():
    from bench.grid_report import option_notes

    def cell(w, args=("--strategy", "fedelmy-kd")):
        return {"params": {"kd_weight": w, "kd_temperature": 2.0}, "args": list(args)}

    mixed = {0.5: {0: {"fedelmy-kd": cell(3.0)}, 1: {"fedelmy-kd": cell(0.75)}}}
    assert option_notes(RECIPE, mixed) == [f"Recipe {RECIPE}: FedELMY-KD (ours)'s cells differ in kd_weight: 3.0 at "
                                           "Dir(0.5) seed 0; 0.75 at Dir(0.5) seed 1 (its figures mix them)."]
    old = {0.1: {0: {"fedelmy-kd": cell(3.0)}}, 0.5: {0: {"fedelmy-kd": cell(3.0)}}}
    assert option_notes(RECIPE, old) == [f"Recipe {RECIPE}: FedELMY-KD (ours) ran with --kd-weight 3.0 (today's "
                                         "default: 0.75)."]
    named = {0.5: {0: {"fedelmy-kd": cell(3.0, ("--strategy", "fedelmy-kd", "--kd-weight", "3"))}}}
    assert option_notes(RECIPE, named) == []  # the flag is in its arguments: nothing implicit to name


def test_the_recommendation_is_the_best_mean_over_enough_seeds(tmp_path):
    from bench import grid_recommend

    cfg = {"sites": 10, "max_train_per_site": None}
    args = {"a": ["--strategy", "fedelmy"], "b": ["--strategy", "fedseq", "--selection", "last-epoch"]}
    accs = {("s1", "fedelmy"): [0.80, 0.82, 0.84], ("s1", "fedseq_last_epoch"): [0.78, 0.83, 0.82],
            ("s2", "fedelmy"): [0.95, 0.99]}  # the best mean, but two seeds only
    for (study, m), values in accs.items():
        for seed, v in enumerate(values):
            CellStore(tmp_path, study).put({**_cell(v, "x", m), "config": cfg, "args": args["a" if m == "fedelmy" else "b"]},
                                           RECIPE, 0.5, seed, m)
    CellStore(tmp_path, "s3").put({**_cell(0.99, "x", "fedelmy"), "config": {**cfg, "max_train_per_site": 600},
                                   "args": args["a"]}, RECIPE, 0.5, 0, "fedelmy")  # other data: never a candidate
    found = grid_recommend.candidates(tmp_path)
    assert [(c["study"], c["method"]) for c in found[0.5]] == [("s1", "fedelmy"), ("s1", "fedseq_last_epoch")]
    tables, notes = grid_recommend.reading(found)
    assert notes[0].startswith("Dirichlet(0.5): recommended FedELMY (paper) [s1, paper-cnn]: 82.00 ± 2.00 % over 3 "
                               "seeds; against the runner-up FedSeq, last epoch [s1, paper-cnn] (81.00 %), paired on 3 "
                               "common seed(s): +1.00 ± 1.73 points, ahead in 2 of 3")
    assert "`make demo DIRICHLET=0.5 SEED=0 CHAIN_ARGS='--strategy fedelmy'` (seed 0: 80.00 % in its cell)" in notes[0]
    assert "(a tie on these seeds: the paired difference is within its spread" in notes[0]  # +1.00 ± 1.73
    assert tables[0]["rows"][0][-1] == "--strategy fedelmy"
    assert grid_recommend.reading({})[1][0].startswith("No method has 3 seeds")
    # a cell that ran at an earlier default of a method option gets it named in the command
    cell = {"args": ["--strategy", "fedelmy-kd"], "params": {"kd_weight": 3.0, "kd_temperature": 2.0, "lr": 0.001}}
    assert grid_recommend.run_args(cell) == ["--strategy", "fedelmy-kd", "--kd-weight", "3.0"]


@pytest.mark.integration
def test_commit_cell_commits_that_file_only(tmp_path, tmp_path_factory):
    def git(*a):
        return subprocess.run(["git", *a], cwd=tmp_path, capture_output=True, text=True, check=True).stdout

    git("init", "-q")
    git("config", "user.email", "t@example.org")
    git("config", "user.name", "t")
    (tmp_path / "other.txt").write_text("x")
    git("add", "other.txt")  # staged, and must stay out of the cell's commit
    path = CellStore(tmp_path / "cells", "s").put({"accuracy": 0.5}, RECIPE, 0.5, 0, "fedelmy")
    assert commit_cell(path, "cell") is None
    assert git("show", "--name-only", "--format=%s", "HEAD").split() == ["cell", f"cells/s/{RECIPE}/dir0.5/seed0/fedelmy.json"]
    assert "A  other.txt" in git("status", "--porcelain")
    outside = CellStore(tmp_path_factory.mktemp("nogit"), "s").put({"accuracy": 0.5}, RECIPE, 0.5, 0, "fedelmy")
    assert "git add" in (commit_cell(outside, "cell") or "")  # git's reason, no exception


def test_bn_oracle_recomputes_the_statistics_over_every_sites_training_data(tmp_path, three_sites, one_torch_thread):
    """bench.bn_oracle: the oracle replaces a model's BatchNorm statistics by the sites' training
    data's (a model that already has them keeps its accuracy, and both end equal); the final
    model's file is found by its digest, and a wrong digest is refused."""
    import hashlib

    import torch
    from safetensors.torch import save_file

    from bench.bn_oracle import BnOracle, final_model_file
    from fedrelay.models import build_model

    oracle = BnOracle(three_sites, "cnn")
    oracle.load()
    torch.manual_seed(0)
    net = build_model(oracle.spec)
    state = {k: v.clone().contiguous() for k, v in net.state_dict().items()}
    for k in state:  # statistics nothing like the data's
        if k.endswith("running_mean"):
            state[k] += 5.0
    run = tmp_path / "state" / "site-01" / "runs" / "r1"
    run.mkdir(parents=True)
    save_file(state, str(run / "final.safetensors"))
    off = oracle.measure(run / "final.safetensors")
    assert off["bn_layers"] == 2 and 0.0 <= off["accuracy"] <= 1.0
    # measured again from the oracle's statistics, the oracle changes nothing more
    net.load_state_dict(state)
    for m in net.modules():
        if isinstance(m, torch.nn.BatchNorm2d | torch.nn.BatchNorm1d):
            m.reset_running_stats()
            m.momentum = None
            m.train()
    with torch.no_grad():
        for start in range(0, len(oracle.train_images), oracle.batch_size):
            net(oracle.task.batch(oracle.train_images[start:start + oracle.batch_size], train=True))
    fixed = {k: v.contiguous() for k, v in net.state_dict().items()}
    save_file(fixed, str(tmp_path / "fixed.safetensors"))
    again = oracle.measure(tmp_path / "fixed.safetensors")
    assert again["accuracy"] == pytest.approx(again["oracle_accuracy"]) == pytest.approx(off["oracle_accuracy"])
    sha = hashlib.sha256((run / "final.safetensors").read_bytes()).hexdigest()
    cell = {"run_id": "r1", "final_site": "site-00", "sha256": sha}
    assert final_model_file(tmp_path, cell) == run / "final.safetensors"  # another site's copy
    with pytest.raises(FileNotFoundError, match="no file of run r1's final model"):
        final_model_file(tmp_path, {**cell, "sha256": "0" * 64})


def test_bn_oracle_notes_read_the_cells_that_recorded_it():
    from bench.grid_report import bn_oracle_notes

    def cell(m, acc, oracle):
        return {"method": m, "accuracy": acc, "bn_oracle": {"accuracy": acc, "oracle_accuracy": oracle, "bn_layers": 2}}

    tree = {0.1: {0: {"fedseq_last_epoch": cell("fedseq_last_epoch", 0.40, 0.38), "fedelmy": cell("fedelmy", 0.5, 0.56),
                      "local_only": {"method": "local_only", "accuracy": 0.3}},
                  1: {"fedelmy": {**cell("fedelmy", 0.5, 0.5), "bn_oracle": {"error": "no file"}}}},
            0.5: {0: {"fedelmy": {"method": "fedelmy", "accuracy": 0.8}}}}
    notes = bn_oracle_notes(RECIPE, tree)
    assert len(notes) == 1 and notes[0].startswith(f"Recipe {RECIPE}: Dirichlet(0.1): BatchNorm statistics")
    assert "by +2.00 ± 5.66 points over 2 cell(s) (from -2.00 to +6.00; per method: FedELMY (paper) +6.00 (n = 1); " \
           "FedSeq, last epoch -2.00 (n = 1))." in notes[0]


def test_ofasd_start_measures_the_final_models_distance_from_the_uploads_average(tmp_path):
    """bench.ofasd_start: a final model equal to the uniform average of the aggregating site's
    uploads (its own outgoing + the arrived ones) is 'at the average'; one moved away is not; a
    missing upload is an error, not a figure."""
    import torch
    from safetensors.torch import save_file

    from bench.ofasd_start import distance_from_average

    run = tmp_path / "state" / "site-01" / "runs" / "r1"
    (run / "uploads").mkdir(parents=True)
    states = [{"w": torch.full((2, 3), float(i)), "n": torch.tensor(i)} for i in range(3)]
    save_file(states[0], str(run / "outgoing.safetensors"))
    for i in (1, 2):
        save_file(states[i], str(run / "uploads" / f"site-0{i + 1}.safetensors"))
    cell = {"run_id": "r1", "bytes": {"kind": "star", "aggregator": "site-01", "uploads": 2}}
    at = tmp_path / "at.safetensors"
    save_file({"w": torch.full((2, 3), 1.0), "n": torch.tensor(1)}, str(at))
    got = distance_from_average(tmp_path, cell, at)
    assert got["at_average"] and got["relative_l2"] == 0.0 and got["uploads"] == 3
    away = tmp_path / "away.safetensors"
    save_file({"w": torch.full((2, 3), 1.5), "n": torch.tensor(1)}, str(away))
    got = distance_from_average(tmp_path, cell, away)
    assert not got["at_average"] and got["relative_l2"] == pytest.approx(0.5) and got["max_abs"] == pytest.approx(0.5)
    (run / "uploads" / "site-03.safetensors").unlink()
    with pytest.raises(ValueError, match="2 upload file"):
        distance_from_average(tmp_path, cell, at)
    with pytest.raises(ValueError, match="not a star cell"):
        distance_from_average(tmp_path, {"run_id": "r1", "bytes": {"kind": "chain"}}, at)
