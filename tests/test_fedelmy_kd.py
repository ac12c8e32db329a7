"""``fedelmy-kd``: fedrelay's extension of FedELMY against forgetting under label skew (issue #25,
item 2; docs/explanation/fedelmy-kd.md). Its options come from its registry entry (start-chain's
flags and checks); with ``kd_weight = 0`` and ``kd_ce_classes = all`` a visit is FedELMY's, bit
for bit; the distillation term is used only towards a received model; DP refuses it."""

from __future__ import annotations

import json
import re

import pytest
import torch

from fedrelay import params, privacy
from fedrelay.cli import exits
from conftest import flat, invoke_coordinator as invoke

BASE = dict(strategy="fedelmy-kd", models_per_site=2, local_epochs=1, warmup_epochs=1, alpha=1.0, beta=1.0,
            lr=1e-3, batch_size=8, weight_decay=0.0, selection="best-val")


def test_start_chain_help_lists_the_strategy_and_its_options_with_their_defaults():
    text = flat(invoke("start-chain", "--help").output)
    assert "fedelmy-kd: fedrelay's extension of FedELMY, not in the paper" in text
    assert "fedseq-kd: fedrelay's ablation of fedelmy-kd, not in a paper" in text
    assert re.search(r"--kd-weight <float> fedelmy-kd, fedseq-kd: weight w of the distillation[^-]*"
                     r"\[default: 0\.75\]", text)
    assert re.search(r"--kd-temperature <float> fedelmy-kd, fedseq-kd: the distillation's temperature T\.[^-]*"
                     r"\[default: 2\.0\]", text)
    assert re.search(r"--kd-ce-classes <all\|seen> fedelmy-kd, fedseq-kd: all .*\| seen .*\[default: all\]", text)


def test_bad_values_are_refused_naming_the_flag_before_the_coordinator_is_called():
    for flags, words in ((("--kd-weight", "-1"), "--kd-weight must be >= 0, got -1.0"),
                         (("--kd-temperature", "0"), "--kd-temperature must be > 0, got 0.0"),
                         (("--kd-ce-classes", "some"),
                          "'--kd-ce-classes': Value error, 'some' is not one of 'all', 'seen'"),
                         (("--kd-weight", "nan"), "--kd-weight must be a finite number")):
        res = invoke("start-chain", "--seed", "1", "--strategy", "fedelmy-kd", *flags, "--coordinator",
                     "127.0.0.1:9", "--insecure")
        assert res.exit_code == exits.USAGE and words in flat(res.output), res.output
        assert "not reachable" not in res.output


def test_the_options_travel_as_text_and_come_back_typed():
    d = {**BASE, "kd_weight": 0.5, "kd_ce_classes": "all"}
    back = params.to_dict(params.to_pb(d))
    params.check(back)
    opts = params.options(back)
    assert {k: opts[k] for k in ("kd_weight", "kd_temperature", "kd_ce_classes")} == \
        {"kd_weight": 0.5, "kd_temperature": 2.0, "kd_ce_classes": "all"}
    assert dict(params.to_pb(d).method_options) == {"kd_weight": "0.5", "kd_ce_classes": "all"}
    assert params.options(params.to_dict(params.to_pb(BASE)))["kd_ce_classes"] == "all"  # the default


def test_differential_privacy_refuses_the_strategy_by_name():
    with pytest.raises(ValueError, match="--strategy fedelmy-kd: differential privacy .* reads the set of classes"):
        privacy.check({**BASE, "selection": "last-epoch", "dp_noise_multiplier": 1.0})
    assert "fedelmy-kd" not in privacy.covered() and "fedelmy" in privacy.covered()
    with pytest.raises(ValueError, match="--strategy fedseq-kd: differential privacy .* reads the set of classes"):
        privacy.check({**BASE, "strategy": "fedseq-kd", "selection": "last-epoch", "dp_noise_multiplier": 1.0})
    assert "fedseq-kd" not in privacy.covered() and "fedseq" in privacy.covered()


# -- training in-process, on tiny data -----------------------------------------------------------


def tiny(classes, n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.tensor(classes)[torch.randint(0, len(classes), (n,), generator=g)]
    x = (torch.rand(n, 1, 8, 8, generator=g) * 80 + y.view(-1, 1, 1, 1) * 40).to(torch.uint8)
    return x, y


@pytest.fixture(scope="module")
def chain(one_torch_thread):
    """A two-site chain's pieces: spec, site A's and site B's data (label-skewed, 4 classes)."""
    from fedrelay.tasks.image_folder import spec as image_spec

    spec = image_spec("cnn", 1, (8, 8), 4)
    return spec, (tiny([0, 1, 2], seed=1), tiny([0, 1, 2], seed=2)), (tiny([2, 3], seed=3), tiny([2, 3], seed=4))


def visit(chain, m0, site, strategy, **options):
    from fedrelay.peer.training import TrainConfig, run_site

    spec = chain[0]
    run = {**BASE, "strategy": strategy, **options}
    params.check(run)
    cfg = TrainConfig(**params.train_config(run))
    train, val = chain[site]
    return run_site(m0, spec, train, val, cfg, 10 + site, "cpu", options=params.options(run))


def visit_finished(chain, m0, site, strategy, finished, **options):
    from fedrelay.peer.training import TrainConfig, run_site

    run = {**BASE, "strategy": strategy, **options}
    cfg = TrainConfig(**params.train_config(run))
    train, val = chain[site]
    return run_site(m0, chain[0], train, val, cfg, 10 + site, "cpu", options=params.options(run), finished=finished)


def same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_without_its_terms_the_strategy_is_fedelmy_bit_for_bit(chain):
    first, _ = visit(chain, None, 1, "fedelmy")
    send, pool = visit(chain, first, 2, "fedelmy")
    first_kd, _ = visit(chain, None, 1, "fedelmy-kd", kd_weight=0.0, kd_ce_classes="all")
    send_kd, pool_kd = visit(chain, first_kd, 2, "fedelmy-kd", kd_weight=0.0, kd_ce_classes="all")
    assert same(first, first_kd) and same(send, send_kd)
    assert len(pool) == len(pool_kd) == 3 and all(same(p, q) for p, q in zip(pool, pool_kd))
    # The first site distils towards nothing (m0 is its own warm-up): with every class's CE it
    # is FedELMY's visit whatever the weight.
    assert same(first, visit(chain, None, 1, "fedelmy-kd", kd_weight=3.0, kd_ce_classes="all")[0])
    # The hook itself: the task's loss handed through batch_loss changes no bit.
    from fedrelay import tasks
    from fedrelay.peer.strategies import fedelmy
    from fedrelay.peer.training import TrainConfig

    spec, (train, val) = chain[0], chain[2]
    task = tasks.resolve(spec)
    cfg = TrainConfig(**params.train_config({**BASE, "strategy": "fedelmy"}))
    hooked, _ = fedelmy.train_pool(first, spec, train, val, cfg, 12, "cpu",
                                   batch_loss=lambda outputs, inputs, labels: task.loss(outputs, labels))
    assert same(hooked, send)
    # Each term changes the received site's model.
    distilled, _ = visit(chain, first, 2, "fedelmy-kd", kd_weight=3.0, kd_ce_classes="all")
    restricted, _ = visit(chain, first, 2, "fedelmy-kd", kd_weight=0.0, kd_ce_classes="seen")
    assert not same(distilled, send) and not same(restricted, send) and not same(distilled, restricted)


def test_fedseq_kd_is_fedseq_without_its_terms_and_distils_with_them(chain):
    """``fedseq-kd`` (the extension without the pool): FedSeq's visit bit for bit at weight 0 and
    every class's CE; the distillation changes the received site's model, not the first site's."""
    first, _ = visit(chain, None, 1, "fedseq")
    send, pool = visit(chain, first, 2, "fedseq")
    first_kd, _ = visit(chain, None, 1, "fedseq-kd", kd_weight=3.0, kd_ce_classes="all")
    send_kd, pool_kd = visit(chain, first, 2, "fedseq-kd", kd_weight=0.0, kd_ce_classes="all")
    assert same(first, first_kd) and same(send, send_kd) and len(pool_kd) == 2 and same(pool_kd[1], send_kd)
    distilled, _ = visit(chain, first, 2, "fedseq-kd", kd_weight=0.75, kd_ce_classes="all")
    restricted, _ = visit(chain, first, 2, "fedseq-kd", kd_weight=0.0, kd_ce_classes="seen")
    assert not same(distilled, send) and not same(restricted, send) and not same(distilled, restricted)
    # resume: the trained model handed back as finished is sent as it is, without training
    again, _ = visit_finished(chain, first, 2, "fedseq-kd", [distilled], kd_weight=0.75)
    assert same(again, distilled)


def test_the_loss_terms():
    from fedrelay import tasks
    from fedrelay.peer.strategies.fedelmy_kd import ForgettingLoss, distillation, seen_classes
    from fedrelay.tasks.image_folder import spec as image_spec

    task = tasks.resolve(image_spec("cnn", 1, (8, 8), 4))
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 4, generator=g, dtype=torch.float64)
    labels = torch.tensor([0, 2, 2, 0, 0, 2])
    assert seen_classes(labels, 4).tolist() == [0, 2] and seen_classes(torch.arange(4), 4) is None
    # KL(teacher || student) at T, times T^2 (Hinton et al. 2015): zero against itself.
    teacher = torch.randn(6, 4, generator=g, dtype=torch.float64)
    p = torch.softmax(teacher / 2, 1)
    expected = (p * (torch.log(p) - torch.log_softmax(logits / 2, 1))).sum(1).mean() * 4
    assert torch.allclose(distillation(logits, teacher, 2.0), expected)
    assert float(distillation(teacher, teacher, 2.0)) == pytest.approx(0.0, abs=1e-12)
    # The restricted CE is the CE over the seen classes' logits; the unseen get no gradient from it.
    student = logits.clone().requires_grad_(True)
    loss = ForgettingLoss(task, teacher=None, weight=3.0, temperature=2.0, seen=seen_classes(labels, 4))
    value = loss(student, None, labels)
    value.backward()
    assert torch.allclose(value, torch.nn.functional.cross_entropy(logits[:, [0, 2]], labels // 2))
    assert torch.all(student.grad[:, [1, 3]] == 0) and torch.all(student.grad[:, [0, 2]] != 0)
    # With a teacher, the distillation is added with its weight.
    net = torch.nn.Linear(3, 4).double().eval()
    inputs = torch.randn(6, 3, generator=g, dtype=torch.float64)
    both = ForgettingLoss(task, teacher=net, weight=3.0, temperature=2.0, seen=None)
    with torch.no_grad():
        assert torch.allclose(both(logits, inputs, labels), task.loss(logits, labels)
                              + 3.0 * distillation(logits, net(inputs), 2.0))
    assert not ForgettingLoss(task, teacher=net, weight=0.0, temperature=2.0, seen=None).active


def test_fit_refuses_a_batch_loss_under_differential_privacy(chain, tmp_path):
    from fedrelay import tasks
    from fedrelay.models import build_model
    from fedrelay.peer import privacy as dp
    from fedrelay.peer.training import TrainConfig, fit

    spec, (train, val) = chain[0], chain[1]
    task = tasks.resolve(spec)
    cfg = TrainConfig(**params.train_config({**BASE, "strategy": "fedelmy", "selection": "last-epoch"}))
    options = privacy.options({"dp_noise_multiplier": 1.0})
    with dp.engaged(options, 1, dp.Book(tmp_path / "privacy.json")):
        with pytest.raises(ValueError, match="batch loss .* not trained under differential privacy"):
            fit(build_model(spec), train, val, cfg, torch.Generator().manual_seed(0), "cpu", epochs=1,
                stage="pool", index=1, task=task, batch_loss=lambda o, x, y: task.loss(o, y))


@pytest.mark.integration
def test_a_chain_through_the_daemons_runs_fedelmy_kd(three_sites, tmp_path):
    from deploy import local_trial

    with local_trial.LocalTrial(tmp_path / "trial", three_sites[:2], insecure=True) as trial:
        cfg = tmp_path / "run.toml"
        cfg.write_text('seed = 3\nstrategy = "fedelmy-kd"\nmodels-per-site = 1\nlocal-epochs = 1\n'
                       'warmup-epochs = 1\nbatch-size = 32\nselection = "last-epoch"\nkd-weight = 2.5\n'
                       'kd-ce-classes = "all"\n')
        res = trial.cli("start-chain", "--config", str(cfg), "--wait", "--json", capture_output=True, text=True,
                        timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        run = json.loads(res.stdout)
    assert run["status"] == "finished", run["error"]
    assert run["params"]["strategy"] == "fedelmy-kd"
    assert (run["params"]["kd_weight"], run["params"]["kd_temperature"], run["params"]["kd_ce_classes"]) == \
        (2.5, 2.0, "all")
