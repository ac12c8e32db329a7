"""MA-Echo: one-shot aggregation by null-space projection ("echoes" of the local models).

Paper: Su, Li, Xue, "One-shot Federated Learning without server-side training" (MA-Echo),
Neural Networks, Algorithm 1 and Eq. 5-11.  Behaviour follows the authors'
released code (``FudanVI/MAEcho``, ``utils.py::createp`` and ``noniid_aggr``) as
reference-code §2 describes it; every difference is listed under "Differences".

Site side (:func:`site_extras`; the pass is :func:`.maecho_projectors.projectors`)
    After its local training, each site makes one eval-mode pass over its own train split and
    builds, per *echoed* layer (every ``Conv2d`` and ``Linear`` but the classifier head), the
    projector ``P^c`` onto the orthogonal complement of the span of the batch-mean inputs the
    layer saw, by the recursive OWM/RLS update ``k = P r; P -= so k kᵀ / (a + rᵀ k)``
    (:mod:`.maecho_projectors` gives the batches, patches and constants).  Each site also sends
    its train label counts ``class_counts`` for the class-aware head (:mod:`.class_aware`).

Aggregator side (:func:`aggregate`, :func:`echo_layer`)
    W⁽⁰⁾ = the class-aware mean (:func:`class_aware_mean`; for echoed layers simply the
    uniform mean), ``V_m = W_m``; then for each echoed layer, ``maecho_tau`` iterations of
    (code form, ``P_m`` = the site's complement projector)::

        D  = Σ_m η α_m (W − V_m)(P_m − I)ᵀ           # Eq. 7: −η Σ α_m (W − V_m) P_m^span
        W += D
        V_m += η · rownorm((W − V_m) P_mᵀ)            # Eq. 11, rows normalised if maecho_norm

    The final model is the class-aware mean of the echoed *local* models V_m, not W, as the
    released code returns ``noniid_avgmodel(w)`` (reference-code §2.3).  The layers do not
    interact, so running all iterations of one layer before the next (done here) gives the
    same result as the code's ``for t: for layer`` loop.

    α (``maecho_alpha``): ``"uniform"`` = 1/N, what the released code runs (its QP call is
    commented out); ``"qp"`` solves Eq. (6) per layer per iteration with CVXOPT (imported only
    then): minimise ``αᵀGα`` s.t. ``Σα = 1, 0 ≤ α ≤ C`` (``maecho_c``) with the Gram matrix
    ``G_ij = ⟨(W − V_i)(I − P_i^c), (W − V_j)(I − P_j^c)⟩`` built with each site's *span*
    projector ``I − P^c`` on both sides (the code's ``SVM.fit`` leaves it out of the diagonal,
    reference-code §2.3: a bug not copied).  The ``2`` of Eq. (6)/(7) is dropped like the
    code does (it only rescales η).

Class-aware mean (head; :func:`.class_aware.class_aware_init`, the code's ``noniid_avgmodel``)
    For the classifier head's weight rows AND bias entries (the last 2-D weight in state
    order and its bias), row c is the uniform mean over the sites with ``class_counts[c] > 1``
    (the authors' rule: a site with at most one sample of c does not vote on c).  A class no
    site holds is the uniform mean over all sites (the authors' code would divide by zero).
    Every other tensor not echoed is the uniform mean (float64 sums in upload order).  The
    strategy ``fedavg-classaware`` is this step alone (ablation, :mod:`.class_aware`).

Which layers (any model): MA-Echo echoes every ``Linear`` and ``Conv2d`` (groups = 1) module
but the head (the last 2-D weight in state order, which gets the class-aware mean), and averages
normalisation layers (BatchNorm, LayerNorm, GroupNorm, RMSNorm) and every buffer uniformly. A
model with any other layer that holds parameters (``Conv1d``, ``Conv3d``, transposed or grouped
convolutions, ``Embedding``, recurrent layers, attention, a module's own ``nn.Parameter``) is
refused, naming the layer: its inputs are not projected by the method, and averaging it
silently would not be MA-Echo. A model without a 2-D weight has no head and is refused too.

Options: ``maecho_tau`` (100), ``maecho_eta`` (0.05; the code's CIFAR/CNN ``lambdastep``),
``maecho_alpha`` ("uniform"), ``maecho_c`` (0.5), ``maecho_norm`` (True).

Differences from the authors' code (whose models have neither biases nor BatchNorm)
    * Biases: a layer with a bias is echoed as the augmented matrix ``[W | b]`` (the bias is the
      last column of the flattened weight) against inputs augmented with a constant 1, so its P
      is ``(d+1) x (d+1)``.
    * BatchNorm parameters and running statistics are not echoed: plain uniform mean.  The
      echoed layers' inputs are recorded in eval mode, i.e. after each site's own BatchNorm.
    * A zero row in the row normalisation stays zero (the code divides by its zero norm).
    * The RLS recursion runs in float64 (the code: float32) and P is sent as float32.
    * The pass is in data order (the authors' loader shuffles; the batch means then differ).
    * ``maecho_alpha="qp"``: the Gram matrix is divided by its mean diagonal and gets a 1e-9
      ridge (a unique, well-conditioned solution); ``C`` below ``1/N`` (possible with missing
      uploads, e.g. one upload and C = 0.5) is raised to ``1/N``, which forces α = 1/N.
    * The head is the last 2-D weight, whatever its name or class count (the code hard-codes
      ``fc4`` and 10 classes).

Bandwidth: the P matrices dominate.  For ``ModelSpec("cnn", 1, (28, 28), 10)`` the model is
828,472 bytes; the extras (:func:`extras_schema`) are P of ``features.0`` 10 x 10 (400 B),
``features.4`` 145 x 145 (84,100 B), ``classifier.1`` 1569 x 1569 (9,847,044 B) and
``class_counts`` (80 B): 9,931,624 bytes, 12x the model (P is symmetric: half would do).  For
``ModelSpec("cnn", 3, (32, 32), 10)``: model 1,075,384 B, extras 16,880,920 B (15.7x; P of
``classifier.1`` is 2049 x 2049).  ``ModelSpec("resnet18", 3, (32, 32), 10)``: model
44,734,408 B, extras 367,954,868 B (8.2x; 92 M P entries, the largest 4608 x 4608), and its
site pass makes one rank-1 update of such a P per patch: possible, but slow and heavy.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from fedrelay import registry

from fedrelay.models import ModelSpec, check_state
from ..states import State
from ..training import check_site_data
from . import Context, Upload
from ._common import Schema, check_uploads, expected_keys, weighted_mean
from .class_aware import COUNTS, check_counts, class_aware_init, class_aware_mean, class_counts
from .maecho_projectors import (A_CONV, A_LINEAR, BATCH_SIZE, P_PREFIX, PATCH_STRIDE, SO, EchoedLayer, echoed_layers,
                                projectors, rls_update)

__all__ = [
    "extras_schema",
    "site_extras",
    "aggregate",
    "echoed_layers",
    "rls_update",
    "echo_layer",
    "class_aware_mean",
    "class_aware_init",
    "projectors",
    "EchoedLayer",
    "qp_alpha",
    "BATCH_SIZE",
    "SO",
    "A_LINEAR",
    "A_CONV",
    "PATCH_STRIDE",
    "P_PREFIX",
    "COUNTS",
]

ALPHAS = ("uniform", "qp")


# --------------------------------------------------------------------------- options and site side


@dataclass(frozen=True)
class _Options:
    tau: int
    eta: float
    alpha: str
    c: float
    norm: bool


def _options(options: dict) -> _Options:
    options = registry.with_defaults("maecho", options)  # the defaults: its registry entry
    tau, eta, alpha = options["maecho_tau"], options["maecho_eta"], options["maecho_alpha"]
    c = options.get("maecho_c", 0.5)
    norm = options.get("maecho_norm", True)
    if isinstance(tau, bool) or not isinstance(tau, int) or tau < 0:
        raise ValueError(f"maecho_tau must be an int >= 0, got {tau!r}")
    if isinstance(eta, bool) or not isinstance(eta, (int, float)) or not eta > 0:
        raise ValueError(f"maecho_eta must be a number > 0, got {eta!r}")
    if alpha not in ALPHAS:
        raise ValueError(f"maecho_alpha must be one of {ALPHAS}, got {alpha!r}")
    if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 < c <= 1:
        raise ValueError(f"maecho_c must be a number in (0, 1], got {c!r}")
    if not isinstance(norm, bool):
        raise ValueError(f"maecho_norm must be a bool, got {norm!r}")
    return _Options(tau, float(eta), alpha, float(c), norm)


def extras_schema(spec: ModelSpec, options: dict) -> Schema:
    """``{"maecho.P.<weight name>": ((d, d), float32)}`` per echoed layer (d includes the bias's
    1) and ``{"class_counts": ((num_classes,), int64)}``."""
    _options(options)
    schema: Schema = {layer.extra: ((layer.dim, layer.dim), torch.float32) for layer in echoed_layers(spec)}
    schema[COUNTS] = ((spec.num_classes,), torch.int64)
    return schema


def site_extras(state, spec: ModelSpec, train, options: dict, device="cpu") -> dict[str, Tensor]:
    """The site's projectors and label counts (see the module docstring, "Site side").

    Args:
        state: the site's trained model state.
        train: the site's own train split ``(inputs N x ..., int64 N)``, non-empty; the model
            sees ``task.batch(rows, train=False)``.
        device: where the pass and the recursions run.

    Returns:
        ``{"maecho.P.<weight name>": float32 (d x d) per echoed layer, "class_counts": int64
        (num_classes,)}`` as new contiguous CPU tensors.

    Raises:
        ValueError: a state or data that do not fit ``spec``, bad options.
    """
    _options(options)
    check_state(state, spec)
    inputs = train[0] if isinstance(train, (tuple, list)) and len(train) == 2 else None
    empty = (inputs[:0] if inputs is not None else torch.empty(0), torch.empty((0,), dtype=torch.int64))
    (images, labels), _ = check_site_data(spec, train, empty)
    extras = projectors(state, spec, images, device)
    extras[COUNTS] = class_counts(labels, spec.num_classes)
    return extras


# --------------------------------------------------------------------------- aggregator side


def _cvxopt():
    try:
        import cvxopt
        import cvxopt.solvers
    except ImportError:
        raise ImportError("maecho_alpha='qp' needs the cvxopt package (pip install cvxopt); "
                          "maecho_alpha='uniform' (the released code's choice) does not") from None
    return cvxopt


def qp_alpha(A: Tensor, c: float) -> Tensor:
    """α of Eq. (6): ``argmin αᵀGα`` s.t. ``Σα = 1``, ``0 ≤ α ≤ c``, ``G_ij = ⟨A_i, A_j⟩``.

    ``A`` is ``(N, ...)``: ``A_m = (W − V_m)(P_m − I)ᵀ``, i.e. minus the span-projected
    difference (the sign does not change G).  Solved with ``cvxopt.solvers.qp`` (quiet).  ``c``
    below ``1/N`` is raised to ``1/N`` (then α = 1/N); N = 1 gives α = [1]; an all-zero G gives
    the uniform α (every α is optimal).  G is divided by its mean diagonal and gets a 1e-9 ridge.
    The solution is clipped to ``[0, c]`` and renormalised to sum 1.  Returns float64 ``(N,)``.
    """
    n = int(A.shape[0])
    uniform = torch.full((n,), 1.0 / n, dtype=torch.float64)
    c = max(float(c), 1.0 / n)
    if n == 1 or c * n <= 1.0 + 1e-12:
        return uniform
    flat = A.reshape(n, -1).to(device="cpu", dtype=torch.float64)
    gram = flat @ flat.T
    scale = float(gram.diagonal().mean())
    if not scale > 0 or not torch.isfinite(gram).all():
        return uniform
    gram = gram / scale + 1e-9 * torch.eye(n, dtype=torch.float64)
    cvxopt = _cvxopt()
    import numpy as np

    eye = np.eye(n)
    solution = cvxopt.solvers.qp(
        cvxopt.matrix(np.ascontiguousarray(gram.numpy())),
        cvxopt.matrix(np.zeros((n, 1))),
        cvxopt.matrix(np.vstack([-eye, eye])),
        cvxopt.matrix(np.hstack([np.zeros(n), np.full(n, c)])),
        cvxopt.matrix(np.ones((1, n))),
        cvxopt.matrix(1.0),
        options={"show_progress": False},
    )
    alpha = torch.tensor(np.array(solution["x"]).ravel(), dtype=torch.float64).clamp_(0.0, c)
    total = float(alpha.sum())
    return alpha / total if total > 0 else uniform


def _rownorm(G: Tensor) -> Tensor:
    norms = G.norm(dim=-1, keepdim=True)
    return G / torch.where(norms > 0, norms, torch.ones_like(norms))


def echo_layer(
    W: Tensor,
    V: Tensor,
    P: Tensor,
    *,
    tau: int,
    eta: float,
    alpha: str = "uniform",
    c: float = 0.5,
    norm: bool = True,
) -> tuple[Tensor, Tensor]:
    """Algorithm 1's inner loop for one layer, ``tau`` times (code form; module docstring).

    Args:
        W: ``(F, d)`` the global matrix W⁽⁰⁾.
        V: ``(N, F, d)`` the local matrices V_m (initially the uploaded W_m).
        P: ``(N, d, d)`` each site's complement projector P^c_m.
        alpha: ``"uniform"`` (1/N) or ``"qp"`` (:func:`qp_alpha` every iteration).

    Returns:
        ``(W, V)`` after the iterations (new tensors; the inputs are not modified).
    """
    n = int(V.shape[0])
    W, V = W.clone(), V.clone()
    Pt = P.transpose(1, 2)
    Q = Pt - torch.eye(P.shape[-1], dtype=P.dtype, device=P.device)  # (P_m − I)ᵀ
    uniform = [1.0 / n] * n
    for _ in range(tau):
        A = torch.bmm(W.unsqueeze(0) - V, Q)  # (W − V_m)(P_m − I)ᵀ
        weights = uniform if alpha == "uniform" else qp_alpha(A, c).tolist()
        D = (eta * weights[0]) * A[0]
        for m in range(1, n):
            D += (eta * weights[m]) * A[m]
        W = W + D
        G = torch.bmm(W.unsqueeze(0) - V, Pt)  # (W − V_m) P_mᵀ
        V = V + eta * (_rownorm(G) if norm else G)
    return W, V


def _augmented(state: State, layer: EchoedLayer) -> Tensor:
    """The layer's ``(F, d)`` matrix: the flattened weight, with the bias as its last column."""
    weight = state[layer.weight].detach().to("cpu")
    matrix = weight.reshape(weight.shape[0], -1)
    if layer.bias is not None:
        matrix = torch.cat([matrix, state[layer.bias].detach().to("cpu").reshape(-1, 1)], dim=1)
    return matrix


def _objective(W: Tensor, V: Tensor, P: Tensor) -> float:
    """Eq. (3) per site, averaged: mean_m ‖(W − V_m)(I − P^c_m)‖²_F."""
    E = W.unsqueeze(0) - V
    A = E - torch.bmm(E, P.transpose(1, 2))
    return float(A.to(torch.float64).pow(2).sum() / V.shape[0])


def aggregate(uploads: Sequence[Upload], ctx: Context) -> State:
    """MA-Echo (Alg. 1) over the uploads, in the order given (module docstring).

    ``ctx.train``, ``ctx.val``, ``ctx.initial``, ``ctx.cfg`` and ``ctx.seed`` are not used.
    ``ctx.on_epoch`` is called after each echoed layer with ``{"stage": "aggregate", "model": 0,
    "epoch": the layer's 1-based index, "epochs": the number of echoed layers, "train_loss": the
    Eq. (3) objective mean_m ‖(W − V_m)(I − P^c_m)‖²_F after the layer's iterations,
    "val_accuracy": None, "seconds"}``.

    Raises:
        ValueError: no uploads, a state that does not fit ``ctx.spec``, extras that do not
            match :func:`extras_schema`, negative class counts, bad options.
        ImportError: ``maecho_alpha="qp"`` without cvxopt installed.
    """
    opts = _options(ctx.options)
    spec = ctx.spec
    uploads = check_uploads(uploads, spec, extras_schema(spec, ctx.options), "maecho")
    if opts.alpha == "qp":
        _cvxopt()  # fail before any work
    counts = check_counts(uploads, "maecho")
    device = ctx.device
    states = [u.state for u in uploads]
    layers = echoed_layers(spec)
    keys = expected_keys(spec)
    # W⁽⁰⁾ and every entry not echoed: the class-aware mean (the code's noniid_avgmodel); the
    # echoed layers' entries are replaced below.
    result = class_aware_init(states, counts, spec)
    for index, layer in enumerate(layers, start=1):
        started = time.perf_counter()
        V = torch.stack([_augmented(s, layer) for s in states]).to(device)
        P = torch.stack([u.extras[layer.extra].detach() for u in uploads]).to(device)
        # W⁽⁰⁾: the class-aware mean, which is the uniform mean for a layer other than the head.
        W0 = _augmented(result, layer).to(device)
        W, V = echo_layer(W0, V, P, tau=opts.tau, eta=opts.eta, alpha=opts.alpha, c=opts.c, norm=opts.norm)
        # The final model averages the echoed local models V_m (the code's noniid_avgmodel(w)).
        final = weighted_mean(list(V))
        columns = final.shape[1] - (1 if layer.bias is not None else 0)
        result[layer.weight] = final[:, :columns].reshape(states[0][layer.weight].shape).contiguous()
        if layer.bias is not None:
            result[layer.bias] = final[:, columns].contiguous()
        if ctx.on_epoch is not None:
            ctx.on_epoch({
                "stage": "aggregate",
                "model": 0,
                "epoch": index,
                "epochs": len(layers),
                "train_loss": _objective(W, V, P),
                "val_accuracy": None,
                "seconds": time.perf_counter() - started,
            })
    return {k: result[k] for k in keys}
