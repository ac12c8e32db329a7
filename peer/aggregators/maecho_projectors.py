"""MA-Echo's site side: the projection matrices P^c of every echoed layer (internal to :mod:`.maecho`).

Paper: Su, Li, Xue, "One-shot Federated Learning without server-side training" (MA-Echo),
Neural Networks, Eq. 5 and Algorithm 1's client step; behaviour follows the authors' released
code (``FudanVI/MAEcho``, ``utils.py::createp``; implementation notes §2.2, project summary
``docs/explanation/reference-code.md`` §2).

The pass (:func:`projectors`)
    After its local training, each site makes one pass over its own train split with its model
    in eval mode, in data order, in batches of :data:`BATCH_SIZE` = 64 (the authors' loader
    batch), and hooks the input of every *echoed* layer (every ``Conv2d`` and ``Linear`` but the
    classifier head).  Per batch and layer it takes the batch-MEAN input r and applies the
    recursive OWM/RLS update (:func:`rls_update`)::

        k = P r;   P -= so * (k kᵀ) / (a + rᵀ k)       so = 0.5, P starts as I

    with ``a = 0.01**0.8`` for Linear layers and ``a = 1e-5**0.8`` for conv layers.  P
    converges to the projector onto the orthogonal complement of the span of the inputs the
    layer saw (``P^c`` below).  Linear layers get one rank-1 update per batch.  For a conv layer
    r is each flattened ``(C_in, kh, kw)`` patch of the batch-mean input map, taken at stride 2
    with no padding, row by row (as the authors' code, whatever the conv's own stride and
    padding: 13 x 13 patches of a 28 x 28 map, 6 x 6 of a 14 x 14 one; a map smaller than the
    kernel, e.g. the second conv of a 4 x 4 image, gives none and P stays I).

Which layers (:func:`echoed_layers`): every ``Linear`` and ``Conv2d`` (groups = 1) module but
the classifier head (the last 2-D weight in state order); normalisation layers (BatchNorm,
LayerNorm, GroupNorm, RMSNorm) are left to the uniform mean; any other layer holding
parameters is refused with ``ValueError`` naming it.  A layer with a bias is echoed as
``[W | b]`` against inputs augmented with a constant 1, so its P is ``(d+1) x (d+1)``.  The
recursion runs in float64 and P is sent as float32.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from fedrelay import tasks

from fedrelay.models import ModelSpec, build_model
from ..states import State, build_loaded
from ._common import head_names

__all__ = ["EchoedLayer", "echoed_layers", "rls_update", "projectors", "BATCH_SIZE", "SO", "A_LINEAR", "A_CONV",
           "PATCH_STRIDE", "P_PREFIX"]

BATCH_SIZE = 64          # images per batch of the site's pass (the authors' loader batch)
SO = 0.5                 # the RLS step (the code's args.C)
A_LINEAR = 0.01 ** 0.8   # RLS regulariser for Linear layers (alpha_array[2])
A_CONV = 1e-5 ** 0.8     # ... and for conv layers (alpha_array[0])
PATCH_STRIDE = 2         # conv patches are taken at stride 2, no padding (hard-coded by the authors)
P_PREFIX = "maecho.P."   # extras name of a layer's P: P_PREFIX + the layer's weight name


@dataclass(frozen=True)
class EchoedLayer:
    """One echoed layer: a ``Conv2d`` or ``Linear`` module other than the head.

    ``dim`` is the size of its P: ``C_in*kh*kw`` (conv) or ``in_features`` (linear), plus 1
    when the layer has a bias.
    """

    module: str
    weight: str
    bias: str | None
    conv: bool
    kernel: tuple[int, int]
    dim: int

    @property
    def extra(self) -> str:
        return P_PREFIX + self.weight


# Layers whose own parameters MA-Echo leaves to the uniform mean (normalisation layers: their
# weights scale features, there is no input to project).
_AVERAGED = (nn.modules.batchnorm._NormBase, nn.LayerNorm, nn.GroupNorm, nn.modules.normalization.RMSNorm)


@functools.lru_cache(maxsize=32)
def _layers(spec: ModelSpec) -> tuple[EchoedLayer, ...]:
    tasks.resolve(spec)  # imported outside the meta device
    with torch.device("meta"):
        model = build_model(spec)
    head, _ = head_names(spec)
    layers = []
    for name, module in model.named_modules():
        own = [n for n, _ in module.named_parameters(recurse=False)]
        if isinstance(module, nn.Conv2d) and module.groups == 1 or isinstance(module, nn.Linear):
            if f"{name}.weight" == head:
                continue
        elif own and not isinstance(module, _AVERAGED):
            kind = type(module).__name__ + (f" with groups={module.groups}" if isinstance(module, nn.Conv2d) else "")
            raise ValueError(f"maecho cannot aggregate layer {name!r} ({kind}): MA-Echo projects the inputs of "
                             "Linear and Conv2d (groups=1) layers only, and averages normalisation layers; use "
                             "fedavg, fedelmy-pfl or ofasd for this model")
        else:
            continue
        has_bias = module.bias is not None
        if isinstance(module, nn.Conv2d):
            kh, kw = module.kernel_size
            dim = module.in_channels * kh * kw
            conv, kernel = True, (kh, kw)
        else:
            dim, conv, kernel = module.in_features, False, (1, 1)
        layers.append(EchoedLayer(name, f"{name}.weight", f"{name}.bias" if has_bias else None,
                                  conv, kernel, dim + int(has_bias)))
    return tuple(layers)


def echoed_layers(spec: ModelSpec) -> list[EchoedLayer]:
    """The layers MA-Echo echoes, in model order: every ``Conv2d`` and ``Linear`` module but the
    classifier head."""
    return list(_layers(spec))


def rls_update(P: Tensor, r: Tensor, so: float = SO, a: float = A_LINEAR) -> Tensor:
    """One OWM/RLS step in place: ``k = P r; P -= so * k kᵀ / (a + rᵀ k)``.  Returns ``P``.

    Computed as the rank-1 update ``P -= s sᵀ`` with ``s = k sqrt(so / (a + rᵀ k))`` (one pass
    over P, no temporary matrix, no host sync; ``rᵀ k = rᵀ P r ≥ 0`` as P stays positive
    semi-definite).  ``s sᵀ`` is exactly symmetric, so a symmetric P stays exactly symmetric.
    """
    k = P @ r
    s = k * torch.sqrt(so / (a + torch.dot(r, k)))
    P.addr_(s, s, alpha=-1.0)
    return P


def _patches(mean_input: Tensor, layer: EchoedLayer) -> Tensor:
    """The rows r a batch contributes: ``(n, dim)``, augmented with 1 when the layer has a bias."""
    if layer.conv:
        if mean_input.shape[-2] < layer.kernel[0] or mean_input.shape[-1] < layer.kernel[1]:
            return mean_input.new_zeros((0, layer.dim))  # a map smaller than the kernel: no patch
        # (C, H, W) -> (C*kh*kw, L): columns are the patches, row-major over output positions.
        rows = F.unfold(mean_input.unsqueeze(0), layer.kernel, stride=PATCH_STRIDE)[0].T
    else:
        rows = mean_input.reshape(1, -1)
    if layer.bias is not None:
        rows = torch.cat([rows, rows.new_ones(rows.shape[0], 1)], dim=1)
    return rows


def projectors(state: State, spec: ModelSpec, images: Tensor, device="cpu") -> dict[str, Tensor]:
    """The site's P^c of every echoed layer (module docstring, "The pass").

    Args:
        state: the site's trained model state (fits ``spec``; checked by the caller).
        images: the site's own train inputs ``(N, ...)`` as the task stores them (checked by
            the caller), in data order; the model sees ``task.batch(rows, train=False)``.
        device: where the pass and the recursions run.

    Returns:
        ``{"maecho.P.<weight name>": float32 (d x d)}`` per echoed layer, new contiguous CPU
        tensors (d includes the bias's 1).

    Raises:
        ValueError: a model with a layer MA-Echo cannot echo (:func:`echoed_layers`).
    """
    task = tasks.resolve(spec)
    n = int(images.shape[0])
    layers = _layers(spec)
    model = build_loaded(spec, state).to(device).eval()
    modules = dict(model.named_modules())
    found = {layer.weight: torch.eye(layer.dim, dtype=torch.float64, device=device) for layer in layers}
    captured: dict[str, Tensor] = {}
    handles = []

    def hook_for(layer: EchoedLayer):
        def hook(_module, args):
            captured[layer.weight] = args[0].detach().to(torch.float64).mean(dim=0)
        return hook

    for layer in layers:
        handles.append(modules[layer.module].register_forward_pre_hook(hook_for(layer)))
    try:
        with torch.no_grad():
            for start in range(0, n, BATCH_SIZE):
                x = task.batch(images[start:start + BATCH_SIZE].to(device), train=False)
                captured.clear()
                model(x)
                for layer in layers:
                    P = found[layer.weight]
                    a = A_CONV if layer.conv else A_LINEAR
                    for r in _patches(captured[layer.weight], layer):
                        rls_update(P, r, SO, a)
    finally:
        for handle in handles:
            handle.remove()
    return {layer.extra: found[layer.weight].to(device="cpu", dtype=torch.float32).contiguous() for layer in layers}

