"""Issue #25 item 3, "faithful aggregators": OFASD's transfer data and selection, and the MA-Echo
ablation ``fedavg-classaware`` (FedAvg plus MA-Echo's class-aware head alone).  CPU, tiny, in-process."""

from __future__ import annotations

import re

import pytest
import torch
from test_aggregators import (KEYS, SPEC, assert_states_equal, context, ensemble_kl, initial_state, make_data,
                              perturbed, plain_uploads)
from typer.testing import CliRunner

from fedrelay import registry
from fedrelay.cli import coordinator as coord_cli
from fedrelay.peer.aggregators import Upload, class_aware, join_payload, maecho, ofasd, ofasd_transfer
from fedrelay.peer.states import average_states
from fedrelay.tensors import encode_state

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def theta0():
    return initial_state(0)


@pytest.fixture(scope="module")
def disagreeing(theta0):
    """Three sites far apart (large perturbations of θ0): their ensemble is not their average."""
    return [perturbed(theta0, i, scale=1.5) for i in range(3)]


# --------------------------------------------------------------------------- OFASD


def test_mixup_draws_are_a_function_of_the_seed():
    a = ofasd_transfer.draw(ofasd_transfer.generator(11), 50, 1.0)
    b = ofasd_transfer.draw(ofasd_transfer.generator(11), 50, 1.0)
    c = ofasd_transfer.draw(ofasd_transfer.generator(12), 50, 1.0)
    assert torch.equal(a.a, b.a) and torch.equal(a.b, b.b) and torch.equal(a.lam, b.lam)
    assert not torch.equal(a.lam, c.lam) and not torch.equal(a.a, c.a)
    for perm in (a.a, a.b):
        assert sorted(perm.tolist()) == list(range(50)) and perm.dtype == torch.int64
    assert a.lam.dtype == torch.float32 and bool(((a.lam >= 0) & (a.lam <= 1)).all())
    # The next epoch's draw from the same generator is another one.
    rng = ofasd_transfer.generator(11)
    first, second = ofasd_transfer.draw(rng, 50, 1.0), ofasd_transfer.draw(rng, 50, 1.0)
    assert not torch.equal(first.lam, second.lam)
    # mix: λ xa + (1 − λ) xb per row, by hand.
    xa, xb = torch.ones(2, 1, 2, 2), torch.zeros(2, 1, 2, 2)
    mixed = ofasd_transfer.mix(xa, xb, torch.tensor([0.25, 1.0]))
    assert torch.equal(mixed[0], torch.full((1, 2, 2), 0.25)) and torch.equal(mixed[1], torch.ones(1, 2, 2))
    with pytest.raises(ValueError, match="--ofasd-transfer plain"):
        ofasd_transfer.mix(torch.ones(2, 3, dtype=torch.int64), torch.ones(2, 3, dtype=torch.int64), torch.ones(2))
    with pytest.raises(ValueError, match="ofasd_mixup_alpha"):
        ofasd_transfer.draw(rng, 5, 0.0)
    # More pairs than images: runs of permutations, every image once per n pairs.
    big = ofasd_transfer.draw(ofasd_transfer.generator(3), 4, 0.5, 10)
    assert len(big) == 10 and sorted(big.a[:8].tolist()) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert sorted(big.a[:4].tolist()) == sorted(big.b[4:8].tolist()) == [0, 1, 2, 3]


def test_ofasd_differs_from_fedavg_where_the_sites_disagree(theta0, disagreeing):
    uploads = plain_uploads(disagreeing, "ofasd")
    events = []
    val = make_data(30, 6)
    result = ofasd.distil(uploads, context({"ofasd_epochs": 3, "ofasd_lr": 0.05}, initial=theta0, val=val,
                                           on_epoch=events.append))
    assert result.criterion == "kl" and not result.at_start and result.kept_epoch >= 1
    average = average_states(disagreeing)  # the starting point: FedAvg with uniform weights
    moved = max(float((result.state[k] - average[k]).abs().max()) for k in KEYS if "running" not in k
                and "num_batches" not in k)
    assert moved > 1e-3
    # The kept coefficients have the lowest held-out KL seen, the first of equals (the start is index 0).
    assert len(result.scores) == 4 and result.scores[result.kept_epoch] == min(result.scores)
    assert result.scores.index(min(result.scores)) == result.kept_epoch
    assert [e["holdout_kl"] for e in events] == result.scores[1:]
    assert all(0.0 <= e["val_accuracy"] <= 1.0 for e in events)
    # And it is closer to the ensemble than FedAvg on the validation images.
    assert ensemble_kl(disagreeing, result.state, val) < ensemble_kl(disagreeing, average, val)
    # Same inputs and seed: the same bits (mixup drawn from the seed); another seed, other bits.
    ctx = context({"ofasd_epochs": 3, "ofasd_lr": 0.05}, initial=theta0, val=val)
    assert_states_equal(result.state, ofasd.aggregate(uploads, ctx))
    other = ofasd.aggregate(uploads, context({"ofasd_epochs": 3, "ofasd_lr": 0.05}, initial=theta0, val=val, seed=8))
    assert not torch.equal(other["classifier.1.weight"], result.state["classifier.1.weight"])


def test_ofasd_held_out_kl_by_hand_with_plain_transfer(theta0, disagreeing):
    # Plain transfer: the held-out set is the validation images alone, and the start is the average.
    uploads = plain_uploads(disagreeing, "ofasd")
    val = make_data(30, 6)
    result = ofasd.distil(uploads, context({"ofasd_epochs": 1, "ofasd_transfer": "plain"}, initial=theta0, val=val))
    assert result.scores[0] == pytest.approx(ensemble_kl(disagreeing, average_states(disagreeing), val), rel=1e-4)


def test_ofasd_without_validation_keeps_the_last_epoch_and_mixup_is_not_plain(theta0, disagreeing):
    uploads = plain_uploads(disagreeing, "ofasd")
    mixed = ofasd.distil(uploads, context({"ofasd_epochs": 2}, initial=theta0))
    assert (mixed.criterion, mixed.kept_epoch, mixed.at_start, mixed.scores) == ("last", 2, False, [])
    plain = ofasd.distil(uploads, context({"ofasd_epochs": 2, "ofasd_transfer": "plain"}, initial=theta0))
    assert not torch.equal(plain.state["classifier.1.weight"], mixed.state["classifier.1.weight"])
    # ofasd_transfer_size: an epoch of 100 mixup images from the 48 train images (3 batches more of 16).
    events = []
    ofasd.distil(uploads, context({"ofasd_epochs": 1, "ofasd_transfer_size": 100}, initial=theta0,
                                  on_epoch=events.append))
    small = []
    ofasd.distil(uploads, context({"ofasd_epochs": 1}, initial=theta0, on_epoch=small.append))
    assert events[0]["train_loss"] != small[0]["train_loss"]
    for bad, words in (({"ofasd_transfer": "gan"}, "ofasd_transfer"), ({"ofasd_select": "best"}, "ofasd_select"),
                       ({"ofasd_mixup_alpha": 0}, "ofasd_mixup_alpha"), ({"ofasd_transfer_size": -1},
                                                                            "ofasd_transfer_size")):
        with pytest.raises(ValueError, match=words):
            ofasd.aggregate(uploads, context(bad, initial=theta0))


# --------------------------------------------------------------------------- fedavg-classaware


@pytest.fixture(scope="module")
def site_data():
    # Site 0 holds classes {0, 1}, site 1 {1, 2}, site 2 all three (as test_aggregators.py).
    return [make_data(40, 1, (0, 1)), make_data(40, 2, (1, 2)), make_data(40, 3)]


def test_class_aware_mean_is_maechos_initial_step(theta0, site_data):
    states = [perturbed(theta0, i) for i in range(3)]
    echo = [Upload(f"site-{i}", s, maecho.site_extras(s, SPEC, d, {})) for i, (s, d) in enumerate(zip(states, site_data))]
    ablation = [Upload(f"site-{i}", s, class_aware.site_extras(s, SPEC, d, {}))
                for i, (s, d) in enumerate(zip(states, site_data))]
    # The one function both use (no copy), and the ablation's uploads carry its counts only.
    assert maecho.class_aware_init is class_aware.class_aware_init
    assert class_aware.extras_schema(SPEC, {}) == {"class_counts": ((3,), torch.int64)}
    for a, e in zip(ablation, echo):
        assert list(a.extras) == ["class_counts"] and torch.equal(a.extras["class_counts"], e.extras["class_counts"])
    assert ablation[0].extras["class_counts"].tolist() == torch.bincount(site_data[0][1], minlength=3).tolist()
    out = class_aware.aggregate(ablation, context())
    # MA-Echo with no echo iteration returns exactly its initial step, bit for bit.
    assert_states_equal(out, maecho.aggregate(echo, context({"maecho_tau": 0})))
    assert_states_equal(out, class_aware.class_aware_init(states, [u.extras["class_counts"] for u in ablation], SPEC))
    # It is FedAvg (uniform) everywhere but the head, and differs there (site 0 lacks class 2, site 1 class 0).
    average = average_states(states)
    for k in KEYS:
        if k.startswith("classifier.3."):
            assert not torch.equal(out[k], average[k]), k
        else:
            assert torch.equal(out[k], average[k]), k
    with pytest.raises(ValueError, match="negative class counts"):
        bad = {"class_counts": torch.tensor([3, -1, 2])}
        class_aware.aggregate([Upload("site-0", states[0], bad)], context())
    with pytest.raises(ValueError, match="do not match"):
        class_aware.aggregate([Upload("site-0", states[0], {})], context())


def test_class_aware_upload_bytes_are_about_fedavgs(theta0, site_data):
    state = perturbed(theta0, 0)
    model = len(encode_state(state))
    upload = len(encode_state(join_payload(state, class_aware.site_extras(state, SPEC, site_data[0], {}))))
    samples = plain_uploads([state], "mean")[0].extras  # fedavg's default upload: the model + num_samples
    fedavg = len(encode_state(join_payload(state, samples)))
    assert model < fedavg < upload < model + 300  # 3 int64 counts and their header entry


def test_registry_and_start_chain_help_show_the_new_strategy_and_options():
    s = registry.strategy("fedavg-classaware")
    assert (s.plan, s.aggregator) == (registry.STAR, "class-aware-mean")
    assert registry.aggregator("class-aware-mean").module == "fedrelay.peer.aggregators.class_aware"
    assert registry.defaults(registry.options_of("ofasd")) == {  # the run's recipe, the star plan's, OFASD's
        "lr_schedule": "constant", "augment": "none", "upload_timeout": 3600.0, "ofasd_mode": "block", "ofasd_epochs": 20, "ofasd_lr": 0.01,
        "ofasd_transfer": "mixup", "ofasd_mixup_alpha": 1.0, "ofasd_transfer_size": 0, "ofasd_select": "kl"}
    res = CliRunner().invoke(coord_cli.app, ["start-chain", "--help"], env={"COLUMNS": "200"})
    text = " ".join(res.output.replace("│", " ").split())
    assert "fedavg-classaware" in text and "ablation (ours)" in text
    for flag, default in (("--ofasd-transfer", "mixup"), ("--ofasd-mixup-alpha", "1.0"), ("--ofasd-select", "kl"),
                          ("--ofasd-epochs", "20"), ("--ofasd-transfer-size", "0")):
        assert re.search(re.escape(flag) + r" <[\w|]+> ofasd:[^<]*?\[default: " + re.escape(default) + r"\]", text), flag
