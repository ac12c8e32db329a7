"""Unit tests for fedrelay.peer.aggregators (mean, fedelmy_pfl, maecho, ofasd): CPU, tiny, < 30 s.

The hand-computed cases write their arithmetic in a comment next to the expected numbers.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from torch.nn import functional as F

from fedrelay.peer.aggregators import EXTRA, METHODS, Context, Upload, join_payload, split_payload
from fedrelay.peer.aggregators import maecho, mean, ofasd
from fedrelay.models import build_model, expected_signature, state_signature
from fedrelay.tasks.image_folder import spec as image_spec
from fedrelay.peer.states import average_states, build_loaded, clone_state
from fedrelay.peer.training import TrainConfig


# One intra-op torch thread while this module trains in-process (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


SPEC = image_spec("cnn", 1, (8, 8), 3)
KEYS = list(expected_signature(SPEC))
HEAD_W, HEAD_B = "classifier.3.weight", "classifier.3.bias"


def make_data(n: int, seed: int, classes=(0, 1, 2)) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, 1, 8, 8), generator=g, dtype=torch.uint8)
    pick = torch.randint(0, len(classes), (n,), generator=g)
    labels = torch.tensor(classes, dtype=torch.int64)[pick]
    return images, labels


def empty_data():
    return torch.empty((0, 1, 8, 8), dtype=torch.uint8), torch.empty((0,), dtype=torch.int64)


def initial_state(seed: int = 0) -> dict:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return clone_state(build_model(SPEC).state_dict())


def perturbed(base: dict, seed: int, scale: float = 0.2) -> dict:
    """``base`` with every float entry moved by ``scale`` x N(0, 1) x (its std or 0.1); running
    variances kept positive; ``num_batches_tracked`` = 10 * (seed + 1)."""
    g = torch.Generator().manual_seed(1000 + seed)
    out = {}
    for k, v in base.items():
        if v.is_floating_point():
            spread = float(v.std()) if v.numel() > 1 and float(v.std()) > 0 else 0.1
            moved = v + scale * spread * torch.randn(v.shape, generator=g)
            out[k] = moved.abs() + 0.5 if k.endswith("running_var") else moved
        else:
            out[k] = torch.tensor(10 * (seed + 1), dtype=v.dtype)
    return out


def constant_state(value: float, batches: int) -> dict:
    """Every float entry ``value``, every ``num_batches_tracked`` ``batches``."""
    return {k: (torch.full(shape, value, dtype=dtype) if dtype.is_floating_point
                else torch.full(shape, batches, dtype=dtype))
            for k, (shape, dtype) in expected_signature(SPEC).items()}


def context(options=None, initial=None, train=None, val=None, seed=7, batch_size=16, on_epoch=None) -> Context:
    return Context(
        spec=SPEC, initial=initial, train=train if train is not None else make_data(48, 99),
        val=val if val is not None else empty_data(), cfg=TrainConfig(batch_size=batch_size),
        options=dict(options or {}), seed=seed, on_epoch=on_epoch,
    )


def assert_states_equal(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def theta0():
    return initial_state(0)


@pytest.fixture(scope="module")
def site_states(theta0):
    return [perturbed(theta0, i) for i in range(3)]


@pytest.fixture(scope="module")
def site_data():
    # Site 0 holds classes {0, 1}, site 1 {1, 2}, site 2 all three.
    return [make_data(40, 1, (0, 1)), make_data(40, 2, (1, 2)), make_data(40, 3)]


@pytest.fixture(scope="module")
def maecho_uploads(site_states, site_data):
    return [Upload(f"site-{i}", s, maecho.site_extras(s, SPEC, d, {}))
            for i, (s, d) in enumerate(zip(site_states, site_data))]


def plain_uploads(states, module, options=None, data=None):
    mod = importlib.import_module(f"fedrelay.peer.aggregators.{module}")
    data = data or [make_data(10 + 5 * i, i) for i in range(len(states))]
    return [Upload(f"site-{i}", s, mod.site_extras(s, SPEC, d, dict(options or {})))
            for i, (s, d) in enumerate(zip(states, data))]


# --------------------------------------------------------------------------- payloads


def test_payload_round_trip():
    state = {"a.weight": torch.ones(2), "b": torch.zeros(1)}
    extras = {"num_samples": torch.tensor([3])}
    payload = join_payload(state, extras)
    assert list(payload) == ["a.weight", "b", EXTRA + "num_samples"]
    back_state, back_extras = split_payload(payload)
    assert list(back_state) == ["a.weight", "b"] and list(back_extras) == ["num_samples"]
    assert back_extras["num_samples"] is extras["num_samples"]
    with pytest.raises(ValueError, match="prefix"):
        join_payload({EXTRA + "x": torch.ones(1)}, {})
    with pytest.raises(ValueError):
        split_payload({EXTRA: torch.ones(1)})


# --------------------------------------------------------------------------- every module


@pytest.mark.parametrize("method", METHODS)
def test_aggregate_returns_the_model_signature_and_is_deterministic(method, theta0, site_states, maecho_uploads):
    mod = importlib.import_module(f"fedrelay.peer.aggregators.{method}")
    options = {"maecho_tau": 3, "ofasd_epochs": 1}
    if method == "maecho":
        uploads = maecho_uploads
    else:
        uploads = plain_uploads(site_states, method, options)
    for u in uploads:  # what every upload carries is exactly the schema
        assert state_signature(u.extras) == mod.extras_schema(SPEC, options)
    ctx = context(options, initial=theta0)
    first = mod.aggregate(uploads, ctx)
    assert state_signature(first) == expected_signature(SPEC)
    assert list(first) == KEYS
    for t in first.values():
        assert t.device.type == "cpu" and t.is_contiguous()
        assert t.data_ptr() not in {u.state[k].data_ptr() for u in uploads for k in u.state}
    assert_states_equal(first, mod.aggregate(uploads, context(options, initial=theta0)))


@pytest.mark.parametrize("method", METHODS)
def test_missing_uploads_and_bad_input(method, theta0, site_states, maecho_uploads):
    mod = importlib.import_module(f"fedrelay.peer.aggregators.{method}")
    options = {"maecho_tau": 2, "ofasd_epochs": 1}
    uploads = maecho_uploads if method == "maecho" else plain_uploads(site_states, method, options)
    ctx = context(options, initial=theta0)
    # Fewer uploads than sites: whatever arrived is combined; one upload is enough.
    assert state_signature(mod.aggregate(uploads[1:], ctx)) == expected_signature(SPEC)
    assert state_signature(mod.aggregate(uploads[:1], ctx)) == expected_signature(SPEC)
    with pytest.raises(ValueError, match="no uploads"):
        mod.aggregate([], ctx)
    with pytest.raises(ValueError, match="two uploads"):
        mod.aggregate([uploads[0], uploads[0]], ctx)
    # A state that does not fit the model.
    broken = dict(uploads[0].state)
    broken["classifier.1.weight"] = broken["classifier.1.weight"][:, :5]
    with pytest.raises(ValueError, match="site-0"):
        mod.aggregate([Upload("site-0", broken, uploads[0].extras), *uploads[1:]], ctx)
    # Extras that do not match the schema: one too many, and (where there are any) one missing.
    extra = {**uploads[1].extras, "surprise": torch.zeros(1)}
    with pytest.raises(ValueError, match="schema"):
        mod.aggregate([uploads[0], Upload("site-1", uploads[1].state, extra)], ctx)
    if uploads[1].extras:
        name = sorted(uploads[1].extras)[0]
        fewer = {k: v for k, v in uploads[1].extras.items() if k != name}
        with pytest.raises(ValueError, match="schema"):
            mod.aggregate([uploads[0], Upload("site-1", uploads[1].state, fewer)], ctx)
        wrong = {**uploads[1].extras, name: uploads[1].extras[name].to(torch.float64)}
        with pytest.raises(ValueError, match="schema says"):
            mod.aggregate([uploads[0], Upload("site-1", uploads[1].state, wrong)], ctx)


# --------------------------------------------------------------------------- mean, fedelmy_pfl


def test_mean_weighted_by_samples_by_hand():
    a, b = constant_state(1.0, 1), constant_state(5.0, 6)
    uploads = [Upload("a", a, {"num_samples": torch.tensor([1])}), Upload("b", b, {"num_samples": torch.tensor([3])})]
    out = mean.aggregate(uploads, context({"weighting": "samples"}))
    # floats: (1 * 1.0 + 3 * 5.0) / (1 + 3) = 16 / 4 = 4.0
    # num_batches_tracked: (1 * 1 + 3 * 6) / 4 = 19 / 4 = 4.75 -> 4 (truncated like average_states)
    for k, t in out.items():
        assert torch.equal(t, torch.full_like(t, 4)), k
    uniform = mean.aggregate([Upload("a", a, {}), Upload("b", b, {})], context({"weighting": "uniform"}))
    # floats: (1.0 + 5.0) / 2 = 3.0; num_batches_tracked: (1 + 6) / 2 = 3.5 -> 3
    for k, t in uniform.items():
        assert torch.equal(t, torch.full_like(t, 3)), k
    assert_states_equal(uniform, average_states([a, b]))


def test_mean_site_extras_and_schema():
    data = make_data(13, 0)
    assert mean.extras_schema(SPEC, {}) == {"num_samples": ((1,), torch.int64)}  # default: samples
    assert mean.extras_schema(SPEC, {"weighting": "uniform"}) == {}
    extras = mean.site_extras(initial_state(), SPEC, data, {})
    assert torch.equal(extras["num_samples"], torch.tensor([13]))
    assert mean.site_extras(initial_state(), SPEC, data, {"weighting": "uniform"}) == {}
    with pytest.raises(ValueError, match="weighting"):
        mean.extras_schema(SPEC, {"weighting": "median"})
    a = constant_state(1.0, 1)
    with pytest.raises(ValueError, match="num_samples"):
        mean.aggregate([Upload("a", a, {"num_samples": torch.tensor([0])})], context())


def test_fedelmy_pfl_is_the_uniform_mean_by_hand():
    from fedrelay.peer.aggregators import fedelmy_pfl

    states = [constant_state(1.0, 2), constant_state(2.0, 4), constant_state(6.0, 9)]
    out = fedelmy_pfl.aggregate([Upload(f"s{i}", s, {}) for i, s in enumerate(states)], context())
    # floats: (1 + 2 + 6) / 3 = 3.0; num_batches_tracked: (2 + 4 + 9) / 3 = 5
    for k, t in out.items():
        assert torch.equal(t, torch.full_like(t, 3 if t.is_floating_point() else 5)), k


# --------------------------------------------------------------------------- MA-Echo: site side


def test_rls_update_by_hand():
    a = maecho.A_LINEAR  # 0.01 ** 0.8 = 0.0251188643...
    assert a == pytest.approx(0.0251188643150958)
    # r = e1, so = 0.5: k = P r = e1, rᵀk = 1, P = I - 0.5 e1e1ᵀ / (a + 1)
    P = maecho.rls_update(torch.eye(2, dtype=torch.float64), torch.tensor([1.0, 0.0], dtype=torch.float64), 0.5, a)
    expected = torch.tensor([[1 - 0.5 / (1 + a), 0.0], [0.0, 1.0]], dtype=torch.float64)  # P[0,0] = 0.51225...
    torch.testing.assert_close(P, expected, rtol=0, atol=1e-15)
    # so = 1: P r = (1 - 1/(1 + a)) r = a/(1 + a) r = 0.0245 r: the seen direction is (nearly) projected out.
    P = maecho.rls_update(torch.eye(2, dtype=torch.float64), torch.tensor([1.0, 0.0], dtype=torch.float64), 1.0, a)
    assert float(P[0, 0]) == pytest.approx(a / (1 + a), rel=1e-12) and float(P[0, 0]) < 0.025
    # r = (1, 1), so = 0.5: P = I - 0.5 rrᵀ / (a + 2): diagonal 1 - 0.5/2.02512 = 0.753100, off-diagonal -0.246900;
    # P r = (1 - 1/(2 + a)) r = 0.506202 r, and the orthogonal direction (1, -1) is untouched.
    r = torch.tensor([1.0, 1.0], dtype=torch.float64)
    P = maecho.rls_update(torch.eye(2, dtype=torch.float64), r, 0.5, a)
    assert float(P[0, 0]) == pytest.approx(0.7531003, abs=1e-6) and float(P[0, 1]) == pytest.approx(-0.2468997, abs=1e-6)
    torch.testing.assert_close(P @ r, r * (1 - 1 / (2 + a)))
    torch.testing.assert_close(P @ torch.tensor([1.0, -1.0], dtype=torch.float64), torch.tensor([1.0, -1.0], dtype=torch.float64))
    assert torch.equal(P, P.T)
    # Repeated updates with r = e1: p = P[0,0] halves while p >> a (p <- p - 0.5 p²/(a + p)), then stalls at ~a.
    P = torch.eye(2, dtype=torch.float64)
    e1 = torch.tensor([1.0, 0.0], dtype=torch.float64)
    for _ in range(30):
        maecho.rls_update(P, e1, 0.5, a)
    assert 0 < float(P[0, 0]) < 2 * a and float(P[1, 1]) == 1.0 and float(P[0, 1]) == 0.0


def test_maecho_schema_and_site_extras(site_states, site_data, maecho_uploads):
    schema = maecho.extras_schema(SPEC, {})
    # features.0: 1*3*3 + 1 (bias) = 10; features.4: 16*3*3 + 1 = 145; classifier.1: 32*2*2 + 1 = 129.
    assert schema == {
        "maecho.P.features.0.weight": ((10, 10), torch.float32),
        "maecho.P.features.4.weight": ((145, 145), torch.float32),
        "maecho.P.classifier.1.weight": ((129, 129), torch.float32),
        "class_counts": ((3,), torch.int64),
    }
    extras = maecho_uploads[0].extras
    assert torch.equal(extras["class_counts"], torch.bincount(site_data[0][1], minlength=3))
    assert int(extras["class_counts"][2]) == 0
    for name in schema:
        if name.startswith("maecho.P."):
            P = extras[name]
            assert torch.equal(P, P.T)
            eig = torch.linalg.eigvalsh(P.double())
            assert float(eig.min()) > -1e-5 and float(eig.max()) <= 1 + 1e-5  # a contraction, like a projector
    # The first conv's P, rebuilt like the authors' loop: batch-mean image of each 64-image batch, 3x3 patches
    # at stride 2 without padding (8x8 -> 3x3 positions, row by row), each augmented with the bias's 1.
    images, _ = site_data[0]
    P = torch.eye(10, dtype=torch.float64)
    for start in range(0, images.shape[0], maecho.BATCH_SIZE):
        m = images[start:start + maecho.BATCH_SIZE].double().div(255).mean(0)  # (1, 8, 8)
        for i in range(3):
            for j in range(3):
                r = torch.cat([m[:, 2 * i:2 * i + 3, 2 * j:2 * j + 3].reshape(-1), torch.ones(1, dtype=torch.float64)])
                maecho.rls_update(P, r, 0.5, maecho.A_CONV)
    torch.testing.assert_close(extras["maecho.P.features.0.weight"], P.float(), rtol=0, atol=1e-6)
    # The first Linear layer: 40 images are one batch, so one rank-1 update of I with the augmented batch-mean
    # input r: P = I - 0.5 r rᵀ / (a + rᵀr).
    r = torch.cat([mean_input(site_states[0], images).double(), torch.ones(1, dtype=torch.float64)])
    P = torch.eye(129, dtype=torch.float64) - 0.5 * torch.outer(r, r) / (maecho.A_LINEAR + r @ r)
    torch.testing.assert_close(extras["maecho.P.classifier.1.weight"], P.float(), rtol=0, atol=1e-6)
    # Over 6 batches of similar means, the direction seen is (nearly) projected out.
    images = make_data(6 * 64, 11)[0]
    r = torch.cat([mean_input(site_states[0], images), torch.ones(1)])
    P = maecho.site_extras(site_states[0], SPEC, make_data(6 * 64, 11), {})["maecho.P.classifier.1.weight"]
    assert float((P @ r).norm()) < 0.1 * float(r.norm())


def mean_input(state, images) -> torch.Tensor:
    """The mean over ``images`` of the input of the first Linear layer."""
    model = build_loaded(SPEC, state).eval()
    seen = {}
    model.classifier[1].register_forward_pre_hook(lambda _m, args: seen.setdefault("x", args[0]))
    with torch.no_grad():
        model(images.float() / 255)
    return seen["x"].mean(0)


def test_maecho_map_smaller_than_the_kernel():
    # A 4x4 image: the second conv sees 2x2 maps, smaller than its 3x3 kernel, so no patch and P stays I.
    spec = image_spec("cnn", 1, (4, 4), 2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        state = build_model(spec).state_dict()
    data = (torch.randint(0, 256, (10, 1, 4, 4), dtype=torch.uint8), torch.arange(10) % 2)
    extras = maecho.site_extras(state, spec, data, {})
    assert torch.equal(extras["maecho.P.features.4.weight"], torch.eye(145))
    assert not torch.equal(extras["maecho.P.features.0.weight"], torch.eye(10))  # 4x4 -> one 3x3 patch


def test_maecho_site_extras_rejects_bad_input(site_states):
    with pytest.raises(ValueError):
        maecho.site_extras(site_states[0], SPEC, empty_data(), {})
    with pytest.raises(ValueError):
        maecho.site_extras({"x": torch.ones(1)}, SPEC, make_data(4, 0), {})
    with pytest.raises(ValueError, match="maecho_alpha"):
        maecho.extras_schema(SPEC, {"maecho_alpha": "svm"})


# --------------------------------------------------------------------------- MA-Echo: aggregator side


def test_echo_layer_one_iteration_by_hand():
    # A 1x2 matrix [w | b]; site 1 saw inputs along e1 (complement projector P1 = diag(0, 1)), site 2 along e2.
    W0 = torch.tensor([[0.5, 0.5]], dtype=torch.float64)
    V = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]], dtype=torch.float64)
    P = torch.stack([torch.diag(torch.tensor([0.0, 1.0])), torch.diag(torch.tensor([1.0, 0.0]))]).double()
    # A1 = (W - V1)(P1 - I)ᵀ = [-0.5, 0.5] @ diag(-1, 0) = [0.5, 0];  A2 = [0.5, -0.5] @ diag(0, -1) = [0, 0.5]
    # D = 0.1 * 0.5 * (A1 + A2) = [0.025, 0.025]  ->  W = [0.525, 0.525]
    # G1 = (W - V1) P1ᵀ = [-0.475, 0.525] @ diag(0, 1) = [0, 0.525] -> rownorm [0, 1] -> V1 = [1, 0] + 0.1 [0, 1] = [1, 0.1]
    # G2 = (W - V2) P2ᵀ = [0.525, -0.475] @ diag(1, 0) = [0.525, 0] -> [1, 0]         -> V2 = [0.1, 1]
    W, Vn = maecho.echo_layer(W0, V, P, tau=1, eta=0.1, norm=True)
    torch.testing.assert_close(W, torch.tensor([[0.525, 0.525]], dtype=torch.float64))
    torch.testing.assert_close(Vn, torch.tensor([[[1.0, 0.1]], [[0.1, 1.0]]], dtype=torch.float64))
    # Without the row normalisation: V1 = [1, 0] + 0.1 [0, 0.525] = [1, 0.0525], V2 = [0.0525, 1].
    W, Vn = maecho.echo_layer(W0, V, P, tau=1, eta=0.1, norm=False)
    torch.testing.assert_close(Vn, torch.tensor([[[1.0, 0.0525]], [[0.0525, 1.0]]], dtype=torch.float64))
    assert torch.equal(V, torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]], dtype=torch.float64))  # inputs untouched


def test_echo_layer_with_identity_projectors_by_hand():
    # P^c = I for every site (no input seen: the complement is the whole space).  Then P - I = 0, D = 0 and
    # W stays W0 = mean(V) = [1.5, 2]; each V_m walks eta = 0.1 per iteration straight towards W:
    # V1 = [0, 0] + 0.1 * [1.5, 2] / 2.5 = [0.06, 0.08] per step; after 5 steps [0.3, 0.4];
    # V2 = [3, 4] - 5 * [0.06, 0.08] = [2.7, 3.6]; their mean stays [1.5, 2]: nothing is learned.
    V = torch.tensor([[[0.0, 0.0]], [[3.0, 4.0]]], dtype=torch.float64)
    W0 = V.mean(0)
    P = torch.eye(2, dtype=torch.float64).expand(2, 2, 2).clone()
    W, Vn = maecho.echo_layer(W0, V, P, tau=5, eta=0.1)
    assert torch.equal(W, W0)
    torch.testing.assert_close(Vn, torch.tensor([[[0.3, 0.4]], [[2.7, 3.6]]], dtype=torch.float64))
    torch.testing.assert_close(Vn.mean(0), W0)


def test_class_aware_mean_by_hand():
    # 4 classes, head rows of width 1.  Counts: site A [5, 5, 0, 0], site B [5, 1, 5, 1].
    rows_a = torch.tensor([[1.0], [2.0], [3.0], [10.0]])
    rows_b = torch.tensor([[3.0], [4.0], [5.0], [20.0]])
    counts = [torch.tensor([5, 5, 0, 0]), torch.tensor([5, 1, 5, 1])]
    out = maecho.class_aware_mean([rows_a, rows_b], counts)
    # class 0: both hold it -> (1 + 3) / 2 = 2;  class 1: B has only 1 sample (not > 1) -> A's 2;
    # class 2: only B -> 5;  class 3: nobody has > 1 -> uniform over all: (10 + 20) / 2 = 15
    assert torch.equal(out, torch.tensor([[2.0], [2.0], [5.0], [15.0]]))
    bias = maecho.class_aware_mean([rows_a[:, 0], rows_b[:, 0]], counts)
    assert torch.equal(bias, torch.tensor([2.0, 2.0, 5.0, 15.0]))


def test_maecho_aggregate_head_and_initial_point(site_states, maecho_uploads):
    # tau = 0: no echo iteration; every tensor is the class-aware mean.  Site 0 lacks class 2, site 1 class 0.
    out = maecho.aggregate(maecho_uploads, context({"maecho_tau": 0}))
    counts = [u.extras["class_counts"] for u in maecho_uploads]
    assert [int(c[0]) > 1 for c in counts] == [True, False, True] and [int(c[2]) > 1 for c in counts] == [False, True, True]
    w = [s[HEAD_W].double() for s in site_states]
    b = [s[HEAD_B].double() for s in site_states]
    torch.testing.assert_close(out[HEAD_W][0], ((w[0][0] + w[2][0]) / 2).float(), rtol=0, atol=1e-7)  # class 0: sites 0, 2
    torch.testing.assert_close(out[HEAD_W][1], ((w[0][1] + w[1][1] + w[2][1]) / 3).float(), rtol=0, atol=1e-7)
    torch.testing.assert_close(out[HEAD_B][2], ((b[1][2] + b[2][2]) / 2).float(), rtol=0, atol=1e-7)  # class 2: sites 1, 2
    plain = average_states(site_states)
    for k in KEYS:
        if k not in (HEAD_W, HEAD_B):
            torch.testing.assert_close(out[k], plain[k], rtol=0, atol=1e-6)


def test_maecho_aggregate_single_upload_is_that_model(maecho_uploads):
    # One site: W0 = V1, so A = 0, D = 0, G = 0 (a zero row stays zero): the model comes back unchanged.
    out = maecho.aggregate(maecho_uploads[:1], context({"maecho_tau": 4}))
    assert_states_equal(out, {k: maecho_uploads[0].state[k] for k in KEYS})


def test_maecho_aggregate_echoes_and_reports(maecho_uploads):
    events = []
    out = maecho.aggregate(maecho_uploads, context({"maecho_tau": 5}, on_epoch=events.append))
    start = maecho.aggregate(maecho_uploads, context({"maecho_tau": 0}))
    assert not torch.equal(out["classifier.1.weight"], start["classifier.1.weight"])
    assert torch.equal(out[HEAD_W], start[HEAD_W])  # the head is never echoed
    assert torch.equal(out["features.1.running_var"], start["features.1.running_var"])  # nor is BatchNorm
    assert [e["epoch"] for e in events] == [1, 2, 3] and all(e["stage"] == "aggregate" for e in events)
    assert all(e["epochs"] == 3 and e["train_loss"] >= 0 and e["val_accuracy"] is None for e in events)


def test_qp_alpha_by_hand():
    # A1 = [1, 0], A2 = [0, 2]: G = diag(1, 4); min α1² + 4 α2² with α1 + α2 = 1 -> α1 = 4/5, α2 = 1/5.
    A = torch.tensor([[[1.0, 0.0]], [[0.0, 2.0]]])
    torch.testing.assert_close(maecho.qp_alpha(A, 1.0), torch.tensor([0.8, 0.2], dtype=torch.float64), atol=1e-5, rtol=0)
    # C = 0.7 caps α1: (0.7, 0.3); C = 0.5 = 1/N forces the uniform (0.5, 0.5).
    torch.testing.assert_close(maecho.qp_alpha(A, 0.7), torch.tensor([0.7, 0.3], dtype=torch.float64), atol=1e-5, rtol=0)
    torch.testing.assert_close(maecho.qp_alpha(A, 0.5), torch.tensor([0.5, 0.5], dtype=torch.float64))
    # One site: α = [1] whatever C (C is raised to 1/N).
    assert maecho.qp_alpha(A[:1], 0.5).tolist() == [1.0]


def test_maecho_qp_runs_and_is_deterministic(maecho_uploads):
    options = {"maecho_tau": 3, "maecho_alpha": "qp", "maecho_c": 0.6}
    first = maecho.aggregate(maecho_uploads, context(options))
    assert state_signature(first) == expected_signature(SPEC)
    assert_states_equal(first, maecho.aggregate(maecho_uploads, context(options)))
    uniform = maecho.aggregate(maecho_uploads, context({**options, "maecho_alpha": "uniform"}))
    assert not torch.equal(first["classifier.1.weight"], uniform["classifier.1.weight"])
    # One upload with C = 0.5 < 1/N = 1 still works (C is raised to 1/N).
    maecho.aggregate(maecho_uploads[:1], context(options))


def test_maecho_rejects_negative_counts(maecho_uploads):
    bad = {**maecho_uploads[0].extras, "class_counts": torch.tensor([3, -1, 2])}
    with pytest.raises(ValueError, match="negative"):
        maecho.aggregate([Upload("site-0", maecho_uploads[0].state, bad)], context())


# --------------------------------------------------------------------------- OFASD


def ensemble_kl(states, model_state, data) -> float:
    """KL(mean of the states' softmax ‖ model) over ``data``, batch-mean, all models in eval mode."""
    x = data[0].float() / 255
    with torch.no_grad():
        teacher = sum(F.softmax(build_loaded(SPEC, s).eval()(x), dim=1) for s in states) / len(states)
        log_q = F.log_softmax(build_loaded(SPEC, model_state).eval()(x), dim=1)
    return float(F.kl_div(log_q, teacher, reduction="batchmean"))


def test_ofasd_blocks_match_parameters_by_name():
    names = [n for n, _ in build_model(SPEC).named_parameters()]
    assert ofasd.blocks(SPEC, "block") == [[n] for n in names]
    assert ofasd.blocks(SPEC, "client") == [names]
    # BatchNorm weights and biases are blocks; the running statistics are not.
    assert ["features.1.weight"] in ofasd.blocks(SPEC) and ["features.1.running_mean"] not in ofasd.blocks(SPEC)


@pytest.mark.parametrize("mode", ofasd.MODES)
def test_ofasd_starts_at_the_weight_average(mode, theta0, site_states):
    uploads = plain_uploads(site_states, "ofasd")
    out = ofasd.aggregate(uploads, context({"ofasd_epochs": 0, "ofasd_mode": mode}, initial=theta0))
    # λ_k^(b) = ‖τ_k^(b)‖ / K: θ0 + Σ_k (‖τ_k‖/K) τ_k/‖τ_k‖ = θ0 + mean_k τ_k = mean_k θ_k
    average = average_states(site_states)
    for k in KEYS:
        if "running" in k or "num_batches" in k:
            assert torch.equal(out[k], average[k]), k  # buffers: exactly the uniform mean
        else:
            torch.testing.assert_close(out[k], average[k], rtol=0, atol=1e-6)


def test_ofasd_reduces_the_kl_to_the_ensemble(theta0):
    # Sites far apart (large perturbations), so that the weight average is a poor copy of the ensemble.
    states = [perturbed(theta0, i, scale=1.5) for i in range(3)]
    uploads = plain_uploads(states, "ofasd")
    train = make_data(64, 5)
    events = []
    options = {"ofasd_epochs": 4, "ofasd_lr": 0.05}
    out = ofasd.aggregate(uploads, context(options, initial=theta0, train=train, on_epoch=events.append))
    before = ensemble_kl(states, average_states(states), train)
    after = ensemble_kl(states, out, train)
    assert after < 0.8 * before, (before, after)
    assert [e["epoch"] for e in events] == [1, 2, 3, 4]
    assert all(e["stage"] == "aggregate" and e["val_accuracy"] is None for e in events)
    assert events[-1]["train_loss"] < events[0]["train_loss"]
    assert_states_equal(out, ofasd.aggregate(uploads, context(options, initial=theta0, train=train)))
    # Another seed: another batch order, other bits.
    other = ofasd.aggregate(uploads, context(options, initial=theta0, train=train, seed=8))
    assert not torch.equal(other["classifier.1.weight"], out["classifier.1.weight"])


def test_ofasd_best_validation_epoch(theta0):
    states = [perturbed(theta0, i, scale=1.5) for i in range(3)]
    uploads = plain_uploads(states, "ofasd")
    events = []
    # Selection by validation accuracy (the earlier default; test_faithful_aggregators.py tests "kl").
    options = {"ofasd_epochs": 2, "ofasd_lr": 0.05, "ofasd_select": "accuracy", "ofasd_transfer": "plain"}
    ctx = context(options, initial=theta0, val=make_data(30, 6), on_epoch=events.append)
    out = ofasd.aggregate(uploads, ctx)
    accuracies = [e["val_accuracy"] for e in events]
    assert all(0.0 <= a <= 1.0 for a in accuracies)
    # The model kept is one of: the weight average, epoch 1, epoch 2; its accuracy is the best seen.
    x, y = make_data(30, 6)
    with torch.no_grad():
        kept = float((build_loaded(SPEC, out).eval()(x.float() / 255).argmax(1) == y).float().mean())
    start = float((build_loaded(SPEC, average_states(states)).eval()(x.float() / 255).argmax(1) == y).float().mean())
    assert kept == pytest.approx(max([start, *accuracies]), abs=1e-9)


def test_ofasd_single_upload_and_errors(theta0, site_states):
    uploads = plain_uploads(site_states, "ofasd")
    # One upload, no epochs: θ0 + ‖τ‖ τ/‖τ‖ = θ1.
    out = ofasd.aggregate(uploads[:1], context({"ofasd_epochs": 0}, initial=theta0))
    for k in KEYS:
        torch.testing.assert_close(out[k], site_states[0][k], rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="initial"):
        ofasd.aggregate(uploads, context({}, initial=None))
    bad_initial = dict(theta0)
    del bad_initial[HEAD_B]
    with pytest.raises(ValueError, match="θ0"):
        ofasd.aggregate(uploads, context({}, initial=bad_initial))
    with pytest.raises(ValueError, match="ofasd_mode"):
        ofasd.aggregate(uploads, context({"ofasd_mode": "layer"}, initial=theta0))
    with pytest.raises(ValueError):
        ofasd.aggregate(uploads, context({}, initial=theta0, train=empty_data()))
    # A zero task vector block (a site that did not move a tensor) stays zero: no NaN.
    still = dict(site_states[1])
    still["classifier.1.weight"] = theta0["classifier.1.weight"].clone()
    out = ofasd.aggregate([uploads[0], Upload("site-1", still, {})], context({"ofasd_epochs": 1}, initial=theta0))
    assert all(bool(torch.isfinite(t).all()) for t in out.values() if t.is_floating_point())
    assert not math.isnan(float(out["classifier.1.weight"].sum()))
