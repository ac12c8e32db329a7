"""Unit tests for fedrelay.models, .states, .training and .strategies (CPU, tiny, < 30 s)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedrelay.models import build_model, state_signature
from fedrelay.tasks.image_folder import MODELS, ImageFolderTask, spec as image_spec
from fedrelay.peer.states import average_states
from fedrelay.peer.strategies.fedelmy import (
    _Regulariser,
    d1,
    d2,
    magnitude_scale,
    model_parameters_distance_sq,
    train_one_model,
    train_pool,
)
from fedrelay.peer.training import TrainConfig, derive_seed, evaluate, run_site, warm_up


# One intra-op torch thread while this module trains in-process (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


SPEC = image_spec("cnn", 1, (8, 8), 3)
TASK = ImageFolderTask()
# Where each class's bright 3x3 square sits (row, column).
SQUARES = [(0, 0), (0, 5), (5, 2)]


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """n grey 8x8 uint8 images of 3 classes: dim noise plus a class-dependent bright square."""
    g = torch.Generator().manual_seed(seed)
    labels = (torch.arange(n) % 3)[torch.randperm(n, generator=g)]
    images = torch.randint(0, 80, (n, 1, 8, 8), generator=g, dtype=torch.uint8)
    for i, label in enumerate(labels.tolist()):
        r, c = SQUARES[label]
        images[i, 0, r:r + 3, c:c + 3] = 255
    return images, labels.to(torch.int64)


TRAIN = make_data(60, 1)
VAL = make_data(24, 2)
TEST = make_data(90, 3)


def tiny_cfg(**changes) -> TrainConfig:
    base = dict(models_per_site=2, local_epochs=2, warmup_epochs=2, lr=1e-2, batch_size=8)
    base.update(changes)
    return TrainConfig(**base)


def assert_states_equal(a, b):
    assert list(a) == list(b)
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert torch.equal(a[key], b[key]), key


def states_differ(a, b) -> bool:
    return any(not torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------- models


def test_cnn_shapes_and_signature():
    torch.manual_seed(0)
    model = build_model(image_spec("cnn", 1, (28, 28), 10))
    assert 150_000 < sum(p.numel() for p in model.parameters()) < 250_000
    out = model(torch.rand(5, 1, 28, 28))
    assert out.shape == (5, 10) and out.dtype == torch.float32
    sig = state_signature(model)
    assert sig == state_signature(model.state_dict())
    assert sig["features.1.num_batches_tracked"] == ((), torch.int64)
    assert sig["classifier.1.weight"] == ((128, 32 * 7 * 7), torch.float32)
    # odd sizes down to 4x4 work
    small = build_model(image_spec("cnn", 3, (5, 7), 2))
    assert small(torch.rand(2, 3, 5, 7)).shape == (2, 2)


@pytest.mark.parametrize("channels,size,classes", [(3, (32, 32), 10), (1, (28, 28), 7)])
def test_resnet18_builds_and_gives_logits(channels, size, classes):
    torch.manual_seed(0)
    model = build_model(image_spec("resnet18", channels, size, classes))
    assert isinstance(model.maxpool, torch.nn.Identity)
    assert model.conv1.weight.shape == (64, channels, 3, 3) and model.conv1.stride == (1, 1)
    assert model.conv1.bias is None
    model.eval()
    with torch.no_grad():
        out = model(torch.rand(2, channels, *size))
    assert out.shape == (2, classes) and out.dtype == torch.float32


def test_build_model_is_deterministic_and_rejects_bad_specs():
    torch.manual_seed(5)
    a = build_model(SPEC).state_dict()
    torch.manual_seed(5)
    b = build_model(SPEC).state_dict()
    assert_states_equal(a, b)
    assert MODELS == ("cnn", "resnet18", "cnn-gn", "cnn-wide")
    for bad in (
        image_spec("vgg", 1, (8, 8), 3),
        image_spec("cnn", 1, (3, 8), 3),
        image_spec("cnn", 0, (8, 8), 3),
        image_spec("cnn", 1, (8, 8), 1),
        image_spec("resnet18", 3, (8, 8), 10),
    ):
        with pytest.raises(ValueError):
            build_model(bad)


# --------------------------------------------------------------------------- averaging


def _bn_models(count: int):
    models = []
    for i in range(count):
        torch.manual_seed(100 + i)
        model = build_model(SPEC)
        model.train()
        for _ in range(2 ** i):  # 1, 2, 4 forward passes: different running stats and counters
            model(torch.rand(4, 1, 8, 8) * (i + 1))
        models.append(model)
    return models


@pytest.mark.parametrize("count,expected_batches", [(2, 1), (3, 2)])  # 1.5 -> 1, 7/3 -> 2 (truncation)
def test_average_states_every_entry(count, expected_batches):
    states = [m.state_dict() for m in _bn_models(count)]
    assert not torch.equal(states[0]["features.1.running_mean"], states[1]["features.1.running_mean"])
    avg = average_states(states)
    assert list(avg) == list(states[0])
    for key, value in avg.items():
        assert value.dtype == states[0][key].dtype, key
        assert value.device.type == "cpu" and value.is_contiguous()
        if value.dtype.is_floating_point:
            expected = sum(s[key].double() for s in states) / count
            assert torch.allclose(value.double(), expected, rtol=1e-6, atol=1e-7), key
        else:
            assert int(value) == expected_batches, key
    # BN statistics really are averaged, not copied from one model
    for key in ("features.1.running_mean", "features.5.running_var", "features.0.weight"):
        assert not torch.equal(avg[key], states[0][key])
    # new tensors: writing to the result leaves the inputs alone
    before = states[0]["classifier.3.bias"].clone()
    avg["classifier.3.bias"].add_(1.0)
    assert torch.equal(states[0]["classifier.3.bias"], before)


def test_average_states_errors():
    states = [m.state_dict() for m in _bn_models(2)]
    with pytest.raises(ValueError):
        average_states([])
    missing = dict(states[1])
    missing.pop("classifier.3.bias")
    with pytest.raises(ValueError):
        average_states([states[0], missing])
    wrong = dict(states[1])
    wrong["classifier.3.bias"] = torch.zeros(4)
    with pytest.raises(ValueError):
        average_states([states[0], wrong])
    # a single state averages to itself
    assert_states_equal(average_states([states[0]]), states[0])


# --------------------------------------------------------------------------- distances


def test_d1_d2_by_hand():
    params = [torch.tensor([1.0, 2.0], requires_grad=True), torch.tensor([[3.0]], requires_grad=True)]
    a = [torch.tensor([0.0, 0.0], requires_grad=True), torch.tensor([[0.0]], requires_grad=True)]
    b = [torch.tensor([1.0, 4.0]), torch.tensor([[1.0]])]
    # ||p-a||^2 = 1 + 4 + 9 = 14 ; ||p-b||^2 = 0 + 4 + 4 = 8
    assert model_parameters_distance_sq(params, a).item() == 14.0
    assert d2(params, a).item() == 14.0
    assert d1(params, [a, b]).item() == 11.0
    assert d1(params, [b]).item() == 8.0
    loss = d2(params, a)
    loss.backward()
    assert torch.equal(params[0].grad, torch.tensor([2.0, 4.0]))
    assert torch.equal(params[1].grad, torch.tensor([[6.0]]))
    assert a[0].grad is None  # pool / m0 tensors are detached
    with pytest.raises(ValueError):
        d1(params, [])
    with pytest.raises(ValueError):
        d2(params, [torch.zeros(2)])
    with pytest.raises(ValueError):
        d2(params, [torch.zeros(3), torch.zeros(1, 1)])


def test_d1_equals_d2_for_first_pool_model():
    torch.manual_seed(0)
    m0 = [p.detach().clone() for p in build_model(SPEC).parameters()]
    torch.manual_seed(1)
    params = list(build_model(SPEC).parameters())
    start = [t.clone() for t in m0]
    assert torch.allclose(d1(params, [m0, start]), d2(params, m0))
    assert d2(params, m0).item() > 0


def test_fast_regulariser_matches_d1_d2():
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 4), (5,), (2, 2, 2)]
    params = [torch.randn(s, generator=g, requires_grad=True) for s in shapes]
    pool = [[torch.randn(s, generator=g) for s in shapes] for _ in range(3)]
    reg = _Regulariser(pool[0], pool, alpha=1.0, beta=1.0, device="cpu")
    fast1, fast2 = reg.distances(params)
    assert torch.allclose(fast1, d1(params, pool), rtol=1e-5)
    assert torch.allclose(fast2, d2(params, pool[0]), rtol=1e-6)
    grad_fast = torch.autograd.grad(fast1 - 0.5 * fast2, params)
    grad_ref = torch.autograd.grad(d1(params, pool) - 0.5 * d2(params, pool[0]), params)
    for x, y in zip(grad_fast, grad_ref):
        assert torch.allclose(x, y, rtol=1e-5, atol=1e-6)
    # beta == 0: d2 still available for the scale, but without gradient
    reg0 = _Regulariser(pool[0], pool, alpha=1.0, beta=0.0, device="cpu")
    _, no_grad_d2 = reg0.distances(params)
    assert not no_grad_d2.requires_grad
    # alpha == 0: d1 skipped
    assert _Regulariser(pool[0], pool, alpha=0.0, beta=1.0, device="cpu").distances(params)[0] is None


def test_magnitude_scale():
    # supplementary example: CE 6.02, d = 45: oa = 0, ob = 1 -> a = 10**(1-0+1) = 100 -> 0.45
    a = magnitude_scale(6.02, 45.0)
    assert a == 100.0 and math.isclose(45.0 / a, 0.45)
    assert magnitude_scale(0.5, 3.0) == 100.0  # oa=-1, ob=0 -> 10**2
    assert magnitude_scale(2.3, 5.0) == 10.0  # same order -> one order below
    assert magnitude_scale(2.3, 0.05) == 1.0  # already small: never enlarged
    assert magnitude_scale(2.3, 0.5) == 1.0  # ob == oa - 1 -> 1
    assert magnitude_scale(6.02, 0.0) == 1.0  # d2 = 0 (first batch of model 1)
    assert magnitude_scale(0.0, 45.0) == 1.0  # CE = 0 (reference would crash)
    assert magnitude_scale(float("nan"), 45.0) == 1.0
    assert magnitude_scale(1.0, float("inf")) == 1.0


# --------------------------------------------------------------------------- seeds and config


def test_derive_seed():
    assert derive_seed(1, "site", 3) == 8641037640951849093  # sha256, stable across processes
    assert derive_seed(1, "site", 3) == derive_seed(np.int64(1), "site", 3)
    assert derive_seed(1, "site", 3) != derive_seed(1, "site", 4)
    assert derive_seed(1, "pool", 2) != derive_seed(1, "pool", "2")
    assert all(0 <= derive_seed(i, "x") < 2**63 for i in range(50))
    with pytest.raises(TypeError):
        derive_seed(object())


def test_config_validate():
    TrainConfig().validate()
    TrainConfig(warmup_epochs=0, alpha=0.0, beta=0.0).validate()
    for bad in (
        dict(strategy="fedprox"),
        dict(selection="best"),
        dict(models_per_site=0),
        dict(local_epochs=0),
        dict(warmup_epochs=-1),
        dict(batch_size=0),
        dict(batch_size=2.0),
        dict(models_per_site=True),
        dict(lr=0.0),
        dict(alpha=-1.0),
        dict(beta=float("nan")),
        dict(weight_decay=float("inf")),
    ):
        with pytest.raises(ValueError):
            TrainConfig(**bad).validate()


# --------------------------------------------------------------------------- training


@pytest.mark.parametrize("strategy", ["fedelmy", "fedseq"])
def test_run_site_learns(strategy):
    cfg = tiny_cfg(strategy=strategy)
    infos = []
    models = []
    sent, pool = run_site(None, SPEC, TRAIN, VAL, cfg, seed=7, device="cpu",
                          on_epoch=infos.append, on_model=lambda j, s: models.append(j))
    model = build_model(SPEC)
    model.load_state_dict(sent)
    correct, total = evaluate(model, *TEST, task=TASK)
    assert total == 90
    assert correct / total > 0.6, f"{strategy}: {correct}/{total}"  # chance is 1/3
    assert models == ([1, 2] if strategy == "fedelmy" else [1])
    if strategy == "fedelmy":
        assert len(pool) == 3
        assert_states_equal(sent, average_states(pool))
        stages = [(i["stage"], i["model"], i["epoch"]) for i in infos]
        assert stages == [("warmup", 0, 1), ("warmup", 0, 2), ("pool", 1, 1), ("pool", 1, 2),
                          ("pool", 2, 1), ("pool", 2, 2)]
    else:
        assert len(pool) == 2 and pool[1] is sent
        assert [(i["stage"], i["epoch"], i["epochs"]) for i in infos[2:]] == [("fedseq", e, 4) for e in (1, 2, 3, 4)]
    for info in infos:
        assert set(info) == {"stage", "model", "epoch", "epochs", "train_loss", "val_accuracy", "seconds"}
        assert 0.0 <= info["val_accuracy"] <= 1.0 and info["train_loss"] > 0 and info["seconds"] >= 0


def test_run_site_is_deterministic():
    cfg = tiny_cfg(models_per_site=2, local_epochs=1, warmup_epochs=1)
    a, pool_a = run_site(None, SPEC, TRAIN, VAL, cfg, seed=11, device="cpu")
    b, pool_b = run_site(None, SPEC, TRAIN, VAL, cfg, seed=11, device="cpu")
    assert_states_equal(a, b)
    for x, y in zip(pool_a, pool_b):
        assert_states_equal(x, y)
    c, _ = run_site(None, SPEC, TRAIN, VAL, cfg, seed=12, device="cpu")
    assert states_differ(a, c)
    # the first site's initialisation comes from the seed, not from the caller's global RNG,
    # and the caller's global RNG is left as it was
    torch.manual_seed(12345)
    rng = torch.get_rng_state()
    f, _ = run_site(None, SPEC, TRAIN, VAL, cfg, seed=11, device="cpu")
    assert torch.equal(torch.get_rng_state(), rng)
    assert_states_equal(a, f)
    # a later site (m0 given): deterministic too, and the global RNG is left alone
    rng = torch.get_rng_state()
    d, _ = run_site(a, SPEC, TRAIN, VAL, cfg, seed=13, device="cpu")
    assert torch.equal(torch.get_rng_state(), rng)
    e, _ = run_site(a, SPEC, TRAIN, VAL, cfg, seed=13, device="cpu")
    assert_states_equal(d, e)
    assert states_differ(a, d)


def test_train_pool_resume_is_identical():
    cfg = tiny_cfg(models_per_site=3, local_epochs=1)
    torch.manual_seed(3)
    m0 = build_model(SPEC).state_dict()
    saved = {}
    full_avg, full_pool = train_pool(m0, SPEC, TRAIN, VAL, cfg, seed=21, device="cpu",
                                     on_model=lambda j, s: saved.__setitem__(j, s))
    assert sorted(saved) == [1, 2, 3] and len(full_pool) == 4
    # the pool models differ from each other and from m0 (they start from different averages)
    assert states_differ(full_pool[1], full_pool[2]) and states_differ(full_pool[0], full_pool[1])
    resumed_calls = []
    avg, pool = train_pool(m0, SPEC, TRAIN, VAL, cfg, seed=21, device="cpu", finished=[saved[1]],
                           on_model=lambda j, s: resumed_calls.append(j))
    assert resumed_calls == [2, 3]
    assert_states_equal(avg, full_avg)
    for x, y in zip(pool, full_pool):
        assert_states_equal(x, y)
    # everything finished: nothing trained, same result
    avg_all, _ = train_pool(m0, SPEC, TRAIN, VAL, cfg, seed=21, device="cpu", finished=full_pool[1:])
    assert_states_equal(avg_all, full_avg)
    with pytest.raises(ValueError):
        train_pool(m0, SPEC, TRAIN, VAL, cfg, seed=21, device="cpu", finished=full_pool)


def test_pool_loss_matches_reference_formula():
    """Three Adam steps of train_one_model == a by-hand replica of the reference loss
    CE - alpha*d1/a + beta*d2/a (public d1/d2/magnitude_scale, literal |M|+1 pool)."""
    cfg = tiny_cfg(local_epochs=1, batch_size=20, alpha=0.7, beta=1.3, selection="last-epoch")
    torch.manual_seed(30)
    m0 = build_model(SPEC).state_dict()
    torch.manual_seed(31)
    b1 = build_model(SPEC).state_dict()
    start = average_states([m0, b1])
    names = [n for n, _ in build_model(SPEC).named_parameters()]
    m0_params = [m0[n] for n in names]
    pool_params = [[s[n] for n in names] for s in (m0, b1, start)]

    model = build_model(SPEC)
    model.load_state_dict(start)
    got = train_one_model(model, TRAIN, VAL, cfg, torch.Generator().manual_seed(5), "cpu",
                          m0_params=m0_params, pool_params=pool_params, task=TASK)

    ref = build_model(SPEC)
    ref.load_state_dict(start)
    ref.train()
    opt = torch.optim.Adam(ref.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    order = torch.randperm(60, generator=torch.Generator().manual_seed(5))
    scales = []
    for i in range(0, 60, 20):
        idx = order[i:i + 20]
        ce = torch.nn.functional.cross_entropy(ref(TRAIN[0][idx].float() / 255), TRAIN[1][idx])
        params = list(ref.parameters())
        dist1, dist2 = d1(params, pool_params), d2(params, m0_params)
        a = magnitude_scale(ce.item(), dist2.item())
        scales.append(a)
        loss = ce - cfg.alpha * dist1 / a + cfg.beta * dist2 / a
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert max(scales) > 1.0  # the scale really is exercised
    expected = ref.state_dict()
    for key in expected:
        if expected[key].dtype.is_floating_point:
            assert torch.allclose(got[key], expected[key], rtol=1e-4, atol=1e-6), key
        else:
            assert torch.equal(got[key], expected[key]), key
    # and d1 matters: without it the result is measurably different
    model = build_model(SPEC)
    model.load_state_dict(start)
    without_d1 = train_one_model(model, TRAIN, VAL, tiny_cfg(local_epochs=1, batch_size=20, alpha=0.0, beta=1.3,
                                                         selection="last-epoch"),
                              torch.Generator().manual_seed(5), "cpu", m0_params=m0_params, pool_params=pool_params,
                              task=TASK)
    assert any(not torch.allclose(without_d1[k], expected[k], rtol=1e-4, atol=1e-6)
               for k in expected if expected[k].dtype.is_floating_point)


def test_train_pool_model_j_uses_documented_inputs():
    """Pool model 2 == train_one_model from avg(m0, b1) with d2 to m0, d1 to [m0, b1, start]
    and batch order derive_seed(seed, "pool", 2).  (Leaving the start point out of d1 would
    not be caught: the start point is the pool mean, so it changes d1 only by a constant.)"""
    cfg = tiny_cfg(local_epochs=1, alpha=0.5, beta=1.0)
    torch.manual_seed(40)
    m0 = build_model(SPEC).state_dict()
    _, pool = train_pool(m0, SPEC, TRAIN, VAL, cfg, seed=8, device="cpu")
    b1 = pool[1]
    start = average_states([m0, b1])
    model = build_model(SPEC)
    model.load_state_dict(start)
    names = [n for n, _ in model.named_parameters()]
    g = torch.Generator().manual_seed(derive_seed(8, "pool", 2))
    by_hand = train_one_model(model, TRAIN, VAL, cfg, g, "cpu", m0_params=[m0[n] for n in names],
                              pool_params=[[s[n] for n in names] for s in (m0, b1, start)], task=TASK)
    assert_states_equal(by_hand, pool[2])


def test_first_pool_model_regulariser_cancels_when_alpha_equals_beta():
    # pool = [m0] + start point m0: d1 == d2, so with alpha == beta the loss is plain CE
    torch.manual_seed(41)
    m0 = build_model(SPEC).state_dict()
    _, reg = train_pool(m0, SPEC, TRAIN, VAL, tiny_cfg(models_per_site=1, alpha=2.0, beta=2.0), 3, "cpu")
    _, plain = train_pool(m0, SPEC, TRAIN, VAL, tiny_cfg(models_per_site=1, alpha=0.0, beta=0.0), 3, "cpu")
    assert_states_equal(reg[1], plain[1])
    _, unequal = train_pool(m0, SPEC, TRAIN, VAL, tiny_cfg(models_per_site=1, alpha=1.0, beta=2.0), 3, "cpu")
    assert states_differ(unequal[1], plain[1])


def test_regulariser_changes_training():
    torch.manual_seed(3)
    m0 = build_model(SPEC).state_dict()
    plain, _ = train_pool(m0, SPEC, TRAIN, VAL, tiny_cfg(alpha=0.0, beta=0.0, local_epochs=1), 5, "cpu")
    reg, _ = train_pool(m0, SPEC, TRAIN, VAL, tiny_cfg(alpha=0.0, beta=1.0, local_epochs=1), 5, "cpu")
    assert states_differ(plain, reg)


def test_best_val_selection_keeps_strictly_best_epoch():
    # lr 1e-3: validation accuracy rises after epoch 1, then plateaus at its maximum,
    # so best-val must take a later epoch than the first but not the last (ties keep the earlier).
    settings = dict(lr=1e-3, batch_size=16)
    torch.manual_seed(0)
    init = build_model(SPEC).state_dict()

    def train(config, epochs_seen, val=VAL):
        model = build_model(SPEC)
        model.load_state_dict(init)
        g = torch.Generator().manual_seed(99)
        return train_one_model(model, TRAIN, val, config, g, "cpu", on_epoch=epochs_seen.append, task=TASK)

    infos = []
    best = train(tiny_cfg(local_epochs=6, **settings), infos)
    accuracies = [i["val_accuracy"] for i in infos]
    k = accuracies.index(max(accuracies)) + 1  # first epoch reaching the maximum
    assert 1 < k < 6 and accuracies[-1] == max(accuracies), accuracies  # the scenario this test needs
    prefix = train(tiny_cfg(local_epochs=k, selection="last-epoch", **settings), [])
    assert_states_equal(best, prefix)
    seen_last = []
    last = train(tiny_cfg(local_epochs=6, selection="last-epoch", **settings), seen_last)
    assert states_differ(best, last)
    # last-epoch selection validates only the model it keeps, after the last epoch
    assert [i["val_accuracy"] for i in seen_last[:-1]] == [None] * 5
    assert seen_last[-1]["val_accuracy"] == accuracies[-1]
    # empty validation set: falls back to the last epoch
    seen = []
    no_val = train(tiny_cfg(local_epochs=6, **settings), seen, val=(VAL[0][:0], VAL[1][:0]))
    assert_states_equal(no_val, last)
    assert all(i["val_accuracy"] is None for i in seen)


def test_warm_up_and_evaluate():
    torch.manual_seed(0)
    model = build_model(SPEC)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state = warm_up(model, TRAIN, VAL, tiny_cfg(warmup_epochs=0), seed=1, device="cpu", task=TASK)
    assert_states_equal(state, before)
    state = warm_up(model, TRAIN, VAL, tiny_cfg(warmup_epochs=1), seed=1, device="cpu", task=TASK)
    assert states_differ(state, before)
    model.eval()
    assert evaluate(model, *TEST, batch_size=7, task=TASK)[1] == 90
    assert not model.training  # mode restored
    assert evaluate(model, TEST[0][:0], TEST[1][:0], task=TASK) == (0, 0)


def test_run_site_rejects_bad_inputs():
    cfg = tiny_cfg()
    with pytest.raises(ValueError):
        run_site(None, SPEC, (TRAIN[0].float(), TRAIN[1]), VAL, cfg, 1, "cpu")
    with pytest.raises(ValueError):
        run_site(None, image_spec("cnn", 3, (8, 8), 3), TRAIN, VAL, cfg, 1, "cpu")
    with pytest.raises(ValueError):
        run_site(None, image_spec("cnn", 1, (8, 8), 2), TRAIN, VAL, cfg, 1, "cpu")  # label 2 out of range
    torch.manual_seed(0)
    wrong = build_model(image_spec("cnn", 1, (8, 8), 4)).state_dict()
    with pytest.raises(ValueError):
        run_site(wrong, SPEC, TRAIN, VAL, cfg, 1, "cpu")
    with pytest.raises(ValueError):
        run_site(None, SPEC, TRAIN, VAL, TrainConfig(strategy="x"), 1, "cpu")



def test_expected_signature_matches_a_built_model_without_drawing_random_numbers():
    from fedrelay.models import expected_signature, state_bytes, state_signature
    from fedrelay.tasks.image_folder import spec as image_spec

    for spec in (image_spec("cnn", 1, (28, 28), 10), image_spec("resnet18", 3, (16, 16), 5)):
        rng = torch.random.get_rng_state()
        sig = expected_signature(spec)
        assert torch.equal(rng, torch.random.get_rng_state())
        built = build_model(spec).state_dict()
        assert sig == state_signature(built)
        assert state_bytes(spec) == sum(t.numel() * t.element_size() for t in built.values())


def test_check_state_refuses_wrong_names_shapes_and_non_finite_values():
    from fedrelay.models import check_state
    from fedrelay.tasks.image_folder import spec as image_spec

    spec = image_spec("cnn", 1, (8, 8), 3)
    state = build_model(spec).state_dict()
    check_state(state, spec)
    with pytest.raises(ValueError, match="names"):
        check_state({**state, "extra": torch.zeros(1)}, spec)
    key = next(k for k, v in state.items() if v.is_floating_point() and v.dim() == 2)
    with pytest.raises(ValueError, match=key):
        check_state({**state, key: torch.zeros(1, 1)}, spec)
    for bad in (float("nan"), float("inf"), float("-inf")):
        t = state[key].clone()
        t[0, 0] = bad
        with pytest.raises(ValueError, match="NaN or Inf"):
            check_state({**state, key: t}, spec)
    huge = torch.full_like(state[key], 3e38)  # finite values whose sum overflows: still accepted
    check_state({**state, key: huge}, spec)
