"""Differential privacy at the site (docs/differential-privacy.md): DP-SGD with Opacus as an option of a run.

In-process: the options' checks and the CLI's messages, DP-SGD in ``fit`` (FedELMY's regulariser
included), the accounting and its book, BatchNorm refused. Through the daemons (coordinator and 3
peers as processes, mutual TLS, tiny data, 1 epoch): each site's (epsilon, delta) in ``show
--json``, ``show`` and the run page's table; a BatchNorm model fails the run with the reason.
"""

from __future__ import annotations

import json
import math

import pytest
from typer.testing import CliRunner

from fedrelay import params, privacy
from fedrelay.peer import privacy as dp
from fedrelay.peer.states import build_loaded
from fedrelay.peer.training import TrainConfig, evaluate, run_site
from fedrelay.tasks.image_folder import ImageFolderTask, spec as image_spec
from test_training import TEST, TRAIN, VAL

GN = image_spec("cnn-gn", 1, (8, 8), 3)
BASE = dict(strategy="fedelmy", models_per_site=2, local_epochs=1, warmup_epochs=1, alpha=1.0, beta=1.0, lr=1e-2,
            batch_size=8, weight_decay=0.0, selection="last-epoch")


# One intra-op torch thread while this module trains in-process (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ------------------------------------------------------------------ options


@pytest.mark.parametrize("extra, message", [
    ({"dp_noise_multiplier": 1.0, "dp_epsilon": 2.0}, "not both"),
    ({"dp_noise_multiplier": -0.5}, "--dp-noise-multiplier must be >= 0"),
    ({"dp_epsilon": 3.0, "dp_delta": 1.5}, "--dp-delta must be between 0 and 1"),
    ({"dp_epsilon": 3.0, "dp_max_grad_norm": -1.0}, "--dp-max-grad-norm must be > 0"),
    ({"dp_epsilon": float("inf")}, "--dp-epsilon must be a finite number"),
    ({"dp_epsilon": 3.0, "selection": "best-val"}, "--selection best-val"),
    ({"dp_epsilon": 3.0, "strategy": "maecho"}, "--strategy maecho: differential privacy"),
    ({"dp_epsilon": 3.0, "strategy": "ofasd"}, "--strategy ofasd: differential privacy"),
])
def test_bad_dp_options_are_refused_naming_the_flag(extra, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        params.check({**BASE, **extra}, strict=True)


def test_dp_is_off_by_default_and_on_with_sigma_or_a_target():
    assert privacy.options(BASE) is None and not privacy.enabled(params.to_pb(BASE))
    params.check({**BASE, "dp_epsilon": 3.0})
    on = privacy.options({**BASE, "dp_epsilon": 3.0})
    assert on == {"noise_multiplier": 0.0, "epsilon": 3.0, "max_grad_norm": 1.0, "delta": 1e-5}
    assert privacy.enabled(params.to_pb({**BASE, "dp_noise_multiplier": 0.8}))
    assert privacy.planned_epochs(5, 2, 2, visits=3, warms_up=True) == 32


@pytest.mark.parametrize("args, message", [
    (["--dp-epsilon", "3", "--dp-noise-multiplier", "1"], "not both"),
    (["--dp-epsilon", "3", "--strategy", "ofasd"], "--strategy ofasd"),
    (["--dp-epsilon", "3", "--dp-delta", "2"], "--dp-delta must be between 0 and 1"),
    (["--dp-epsilon", "3", "--selection", "best-val"], "--selection best-val"),
    (["--dp-noise-multiplier", "1", "--dp-max-grad-norm", "0"], "--dp-max-grad-norm must be > 0"),
])
def test_the_cli_says_what_is_wrong_with_dp_options_without_a_traceback(args, message):
    from fedrelay.cli.coordinator import app

    res = CliRunner().invoke(app, ["start-chain", "--seed", "1", "--coordinator", "127.0.0.1:1", "--insecure",
                                   *args])
    assert res.exit_code != 0
    out = " ".join((res.output or "").split())
    assert message in out, out
    assert "Traceback" not in out


def test_a_run_configuration_file_takes_the_dp_options(tmp_path):
    from fedrelay.cli.coordinator import app

    cfg = tmp_path / "run.toml"
    cfg.write_text('seed = 1\ndp-epsilon = 3.0\nselection = "best-val"\ninsecure = true\n'
                   'coordinator = "127.0.0.1:1"\n')
    res = CliRunner().invoke(app, ["start-chain", "--config", str(cfg)])
    assert res.exit_code != 0 and "--selection best-val" in " ".join(res.output.split())
    cfg.write_text('seed = 1\ndp-epsilon = "high"\n')
    res = CliRunner().invoke(app, ["start-chain", "--config", str(cfg)])
    assert res.exit_code != 0 and "dp-epsilon" in " ".join(res.output.split()) and "Traceback" not in res.output


# ------------------------------------------------------------------ training


@pytest.fixture
def sigma_once(monkeypatch):
    """``dp.noise_multiplier`` asked of Opacus once per (options, sample rate, steps): the models
    of one visit have the same sample rate and planned steps, so the same sigma, and Opacus'
    search for it (tens of RDP evaluations over ``dp.ALPHAS``) is most of these tests' time. The
    sigmas are Opacus' own; ``asked`` counts the searches."""
    real, known, asked = dp.noise_multiplier, {}, []

    def once(options, sample_rate, steps):
        key = (tuple(sorted(options.items())), sample_rate, steps)
        if key not in known:
            asked.append(key)
            known[key] = real(options, sample_rate, steps)
        return known[key]

    monkeypatch.setattr(dp, "noise_multiplier", once)
    return asked


def test_dp_fedelmy_spends_the_target_epsilon_and_still_learns(tmp_path, sigma_once):
    book = dp.Book(tmp_path / privacy.BOOK)
    opts = privacy.options({**BASE, "dp_epsilon": 8.0})
    cfg = TrainConfig(**{k: BASE[k] for k in params.TRAIN_NAMES})
    planned = privacy.planned_epochs(2, 1, 1, visits=1, warms_up=True)
    with dp.engaged(opts, planned, book):
        send, pool = run_site(None, GN, TRAIN, VAL, cfg, 7, "cpu")
    assert dp.current() is None  # only inside the block
    # The warm-up and both pool models, each 1 epoch of ceil(60 / 8) = 8 Poisson steps, q = 1/8.
    assert sorted(book.data["entries"]) == ["pool/1", "pool/2", "warmup/0"]
    assert {tuple(e[1:]) for e in book.data["entries"].values()} == {(1 / 8, 8)}
    spent = dp.spent([book.path, tmp_path / "missing.json"], 1e-5)
    assert spent["steps"] == 24 and spent["accountant"] == "rdp" and spent["delta"] == 1e-5
    assert 7.5 < spent["epsilon"] <= 8.0 + 0.01  # get_noise_multiplier: within its 0.01 tolerance
    assert json.loads(book.path.read_text()) == book.data  # kept as it goes
    correct, total = evaluate(build_loaded(GN, send), *TEST, task=ImageFolderTask())
    assert correct / total > 0.5  # three classes: far above chance despite the noise
    # Opacus' hooks are gone and the in-place ReLUs are back: the model trains plainly again.
    model = build_loaded(GN, send)
    assert not model._forward_hooks and all(not m._forward_hooks for m in model.modules())


def test_more_noise_spends_less_epsilon_and_a_fixed_sigma_is_used_as_given(tmp_path):
    cfg = TrainConfig(**{**{k: BASE[k] for k in params.TRAIN_NAMES}, "strategy": "fedseq", "warmup_epochs": 0})
    spent = []
    for sigma in (0.8, 2.0):
        book = dp.Book(tmp_path / f"{sigma}.json")
        m0 = build_loaded(GN, run_site(None, GN, TRAIN, VAL, TrainConfig(**{**cfg.__dict__, "local_epochs": 1,
                                                                               "models_per_site": 1}), 1, "cpu")[0])
        with dp.engaged(privacy.options({"dp_noise_multiplier": sigma}), 2, book):
            run_site(m0.state_dict(), GN, TRAIN, VAL, cfg, 3, "cpu")
        assert {e[0] for e in book.data["entries"].values()} == {sigma}
        spent.append(dp.spent([book.path], 1e-5)["epsilon"])
    assert spent[0] > spent[1] > 0 and all(math.isfinite(e) for e in spent)


def test_a_model_with_batchnorm_is_refused_before_any_training(tmp_path):
    cnn = image_spec("cnn", 1, (8, 8), 3)
    book = dp.Book(tmp_path / privacy.BOOK)
    with dp.engaged(privacy.options({"dp_noise_multiplier": 1.0}), 2, book), \
            pytest.raises(ValueError, match=r"BatchNorm layers \(features.1, features.5\).*--model cnn-gn"):
        run_site(None, cnn, TRAIN, VAL, TrainConfig(**{k: BASE[k] for k in params.TRAIN_NAMES}), 1, "cpu")
    assert not book.path.exists()


def test_a_retrained_model_replaces_its_entry_in_the_book(tmp_path):
    book = dp.Book(tmp_path / privacy.BOOK)
    book.record("pool/1", 1.0, 0.1, 10, 1.0, 1e-5)
    again = dp.Book(tmp_path / privacy.BOOK)  # a restarted visit reads it back
    again.record("pool/1", 1.0, 0.1, 10, 1.0, 1e-5)
    again.record("pool/2", 1.0, 0.1, 10, 1.0, 1e-5)
    assert dp.spent([book.path], 1e-5)["steps"] == 20


def test_a_star_sites_jobs_train_under_dp_and_its_evaluation_reports_what_it_spent(tmp_path, sigma_once):
    """The worker's jobs as a FedAvg site runs them: train (warm-up and S·E epochs under DP-SGD,
    booked in the visit's folder), then evaluate (the spent (ε, δ) in the statistics it signs)."""
    from fedrelay.peer import jobs
    from fedrelay.task import SiteData

    data = SiteData(class_names=["a", "b", "c"], inputs={"train": TRAIN[0], "test": TEST[0]},
                    labels={"train": TRAIN[1], "test": TEST[1]}, input=GN.input)
    run_params = {**BASE, "strategy": "fedavg", "weighting": "uniform", "dp_epsilon": 4.0, "dp_delta": 1e-4}
    params.check(run_params)
    folder = tmp_path / "run"
    folder.mkdir()
    req = {"op": "train", "spec": GN.to_dict(), "params": params.to_dict(params.to_pb(run_params)), "seed": 3,
           "class_index": ["a", "b", "c"], "site": "site-a", "position": 0, "round": 1, "folder": str(folder),
           "received": None, "outgoing": str(folder / "outgoing.safetensors"), "initial": {"kind": "shared"},
           "aggregator": "mean", "options": params.options(run_params),
           "privacy_epochs": privacy.planned_epochs_of(run_params, visits=1, warms_up=True)}
    assert jobs.run(req, data, "cpu")["event"] == "trained"
    entries = json.loads((folder / privacy.BOOK).read_text())["entries"]
    assert sorted(entries) == ["fedseq/0", "warmup/0"]  # FedAvg's local training: FedSeq's one model
    answer = jobs.run({"op": "evaluate", "model": str(folder / "outgoing.safetensors"), "spec": GN.to_dict(),
                       "class_index": ["a", "b", "c"], "params": req["params"],
                       "privacy_books": [str(folder / privacy.BOOK)]}, data, "cpu")
    spent = privacy.spent_from_stats(answer["stats"])
    assert spent["delta"] == 1e-4 and 3.5 < spent["epsilon"] <= 4.01
    assert spent["steps"] == sum(e[2] for e in entries.values())


def test_the_coordinator_refuses_an_evaluation_whose_privacy_record_does_not_check():
    from fedrelay.coordinator.evaluation import site_stats
    from fedrelay.v1 import peer_pb2

    good = {"epsilon": 2.0, "delta": 1e-5, "noise_multiplier": 1.1, "max_grad_norm": 1.0, "steps": 7,
            "sample_rate": 0.1, "accountant": "rdp"}
    reply = peer_pb2.EvaluateReply(site="a", correct=0, test_samples=0, stats_json=json.dumps({"privacy": good}))
    site_stats(reply, 3)
    reply.stats_json = json.dumps({"privacy": {**good, "steps": -1}})
    with pytest.raises(ValueError, match="differential-privacy record.*steps"):
        site_stats(reply, 3)


# ------------------------------------------------------------------ through the daemons

CHAIN = ["--models-per-site", "2", "--local-epochs", "1", "--warmup-epochs", "1", "--batch-size", "32",
         "--lr", "0.01", "--model", "cnn-gn", "--wait", "--json"]


@pytest.fixture(scope="module")
def trial(three_sites, tmp_path_factory):
    from deploy import local_trial

    with local_trial.LocalTrial(tmp_path_factory.mktemp("privacy"), three_sites[:2]) as t:  # two sites: one hop a round
        yield t


@pytest.mark.system
def test_a_dp_run_through_the_daemons_reports_each_sites_epsilon_and_delta(trial):
    """Two rounds: each site's ε composes both its visits (and the first site's warm-up)."""
    res = trial.cli("start-chain", "--seed", "5", "--rounds", "2", "--dp-epsilon", "6", "--dp-delta", "1e-4", *CHAIN,
                    capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    run = json.loads(res.stdout)
    assert run["status"] == "finished", run["error"]
    assert run["params"]["dp_epsilon"] == 6.0 and run["params"]["selection"] == "last-epoch"
    per_site = run["final"]["per_site"]
    assert sorted(per_site) == sorted(run["order"])
    for site, v in per_site.items():
        p = v["privacy"]
        assert p["accountant"] == "rdp" and p["delta"] == 1e-4 and p["max_grad_norm"] == 1.0
        assert 0 < p["epsilon"] <= 6.0 + 0.01, (site, p)
        assert p["steps"] > 0 and 0 < p["sample_rate"] <= 1
        # The steps the site booked, visit by visit (round 1 in the run's folder, round 2 in round-2/).
        folder = trial.workdir / "state" / site / "runs" / run["run_id"]
        books = [json.loads(f.read_text())["entries"] for f in (folder / privacy.BOOK, folder / "round-2" / privacy.BOOK)]
        assert p["steps"] == sum(e[2] for book in books for e in book.values())
        stages = sorted(k for book in books for k in book)
        assert stages == (["pool/1", "pool/1", "pool/2", "pool/2", "warmup/0"] if site == run["order"][0]
                          else ["pool/1", "pool/1", "pool/2", "pool/2"])
    shown = trial.cli("show", run["run_id"], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    text = " ".join(shown.stdout.split())
    assert "differential privacy (DP-SGD at every site): target ε 6" in text
    for site in run["order"]:
        assert f"privacy spent at {site}: ε " in text
    as_json = json.loads(trial.cli("show", run["run_id"], "--json", capture_output=True, text=True,
                                   timeout=120).stdout)
    assert as_json["final"]["per_site"] == per_site
    # The run page's table carries the same figures.
    from fedrelay.coordinator.web.views import final_table

    table = final_table(as_json)
    assert table["privacy"] is True
    assert all(r["privacy"] == privacy.describe(per_site[r["site"]]["privacy"]) for r in table["rows"])
    assert privacy.describe_options(as_json["params"]) == "target ε 6, clipping C 1, δ 0.0001"
    # The figures are the ones the sites signed: the audit checks the ledger's rows against them.
    from fedrelay.cli.coordinator import app

    audit = CliRunner().invoke(app, ["audit", run["run_id"], "--db", str(trial.workdir / "ledger.sqlite"),
                                     "--ca", str(trial.pki), "--json"])
    assert audit.exit_code == 0, audit.output[-3000:]


@pytest.mark.system
def test_a_dp_run_with_a_batchnorm_model_fails_saying_why(trial):
    res = trial.cli("start-chain", "--seed", "6", "--dp-noise-multiplier", "1", *CHAIN[:-4], "--model", "cnn",
                    "--wait", "--json", capture_output=True, text=True, timeout=600)
    run = json.loads(res.stdout)
    assert run["status"] == "failed"
    assert "BatchNorm" in run["error"] and "--model cnn-gn" in run["error"], run["error"]
    assert not run["hops"]  # refused before any model left the first site
