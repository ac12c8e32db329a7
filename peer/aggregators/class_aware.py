"""The class-aware mean: MA-Echo's initial (and final) averaging, and FedAvg with it alone.

Paper: Su, Li, Xue, "One-shot Federated Learning without server-side training" (MA-Echo),
Neural Networks, Algorithm 1's initialisation; the rule is the authors' released code's
``noniid_avgmodel`` (``FudanVI/MAEcho``, ``utils.py``; implementation notes §2.3, project
summary ``docs/explanation/reference-code.md`` §2).

Class-aware mean (:func:`class_aware_init`)
    For the classifier head (the last 2-D weight in state order, and its bias), row c of the
    weight and entry c of the bias are the uniform mean over the sites with
    ``class_counts[c] > 1`` (the authors' rule: a site with at most one train sample of class c
    does not vote on row c).  A class that no site holds that way is the uniform mean over all
    sites (the authors' code would divide by zero).  Every other state entry (parameters,
    BatchNorm running statistics, ``num_batches_tracked``) is the uniform mean.  Float64 sums
    in upload order, cast back to each entry's dtype (integers truncate toward zero).

    MA-Echo (:mod:`.maecho`) starts its echo iterations from this model (W⁽⁰⁾) and returns this
    mean of the echoed local models; with zero echo iterations MA-Echo's result IS this
    function's (``tests/test_aggregators.py`` checks it bit for bit).

Aggregator ``class-aware-mean`` (strategy ``fedavg-classaware``, an ablation; ours, not a
published method): :func:`aggregate` is :func:`class_aware_init` over the uploads, i.e. one-shot
FedAvg plus MA-Echo's class-aware last layer alone, without the projection matrices and the
echo iterations.  It tells how much of MA-Echo's gain over FedAvg the head alone gives.  Its
body is the *uniform* mean, as MA-Echo's; the like-for-like FedAvg to compare it with is
``--strategy fedavg --weighting uniform`` (``fedavg``'s default weights by samples).

Uploads: the model plus one extra, ``class_counts`` (int64, ``(num_classes,)``: the site's train
label histogram), i.e. ``8 * num_classes`` bytes more than FedAvg's model (80 B for 10 classes).
No options.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from fedrelay.models import ModelSpec, check_state
from ..states import State
from ..training import check_site_data
from . import Context, Upload
from ._common import Schema, check_uploads, expected_keys, head_names, uniform_state

__all__ = ["COUNTS", "class_counts", "class_aware_mean", "class_aware_init", "check_counts",
           "extras_schema", "site_extras", "aggregate"]

COUNTS = "class_counts"  # the extra's name in every upload


def class_counts(labels: Tensor, num_classes: int) -> Tensor:
    """The label histogram: int64 ``(num_classes,)``, a new contiguous CPU tensor.  ``labels``
    is int64 ``(N,)`` with values in ``[0, num_classes)`` (checked by the caller)."""
    return torch.bincount(labels.to("cpu"), minlength=num_classes).to(torch.int64).contiguous()


def class_aware_mean(tensors: Sequence[Tensor], counts: Sequence[Tensor]) -> Tensor:
    """Row c (first dimension) = the uniform mean of ``tensors[i][c]`` over the sites i with
    ``counts[i][c] > 1``; over all sites when none has. Float64 sums in order, cast back.

    Args:
        tensors: one ``(C, ...)`` tensor per site, all of one shape and dtype.
        counts: one ``(C,)`` label count tensor per site, in the same order.

    Returns:
        A new contiguous CPU tensor of ``tensors[0]``'s shape and dtype.
    """
    tensors = list(tensors)
    mask = torch.stack([cnt.to(torch.float64) > 1 for cnt in counts]).to(torch.float64)  # (N, K)
    nobody = mask.sum(dim=0) == 0
    mask[:, nobody] = 1.0
    total = torch.zeros(tensors[0].shape, dtype=torch.float64)
    view = (-1,) + (1,) * (tensors[0].dim() - 1)
    for i, t in enumerate(tensors):
        total += mask[i].reshape(view) * t.detach().to(device="cpu", dtype=torch.float64)
    total /= mask.sum(dim=0).reshape(view)
    return total.to(tensors[0].dtype).contiguous()


def class_aware_init(states: Sequence[State], counts: Sequence[Tensor], spec: ModelSpec) -> State:
    """The class-aware mean of ``states`` (module docstring): the head by
    :func:`class_aware_mean`, every other entry the uniform mean; the model's keys in state
    order, new contiguous CPU tensors.  ``states`` fit ``spec`` and ``counts`` are int64
    ``(num_classes,)``, one per state (checked by the callers)."""
    keys = expected_keys(spec)
    head = tuple(k for k in head_names(spec) if k is not None)
    result = uniform_state(states, [k for k in keys if k not in head])
    for key in head:
        result[key] = class_aware_mean([s[key] for s in states], counts)
    return {k: result[k] for k in keys}


def check_counts(uploads: Sequence[Upload], method: str) -> list[Tensor]:
    """Every upload's ``class_counts``, in order; ``ValueError`` naming the site for a negative
    count (shape and dtype are the schema's, checked before)."""
    for u in uploads:
        if bool((u.extras[COUNTS] < 0).any()):
            raise ValueError(f"{method}: site {u.site!r} reports negative class counts")
    return [u.extras[COUNTS] for u in uploads]


def extras_schema(spec: ModelSpec, options: dict) -> Schema:
    """``{"class_counts": ((num_classes,), torch.int64)}``."""
    return {COUNTS: ((spec.num_classes,), torch.int64)}


def site_extras(state, spec: ModelSpec, train, options: dict, device="cpu") -> dict[str, Tensor]:
    """``{"class_counts": int64 (num_classes,)}``: the label histogram of ``train`` (the site's
    own train split ``(inputs N x ..., int64 N)``, non-empty).  ``device`` is not used.

    Raises ``ValueError`` for a state or data that do not fit ``spec``."""
    check_state(state, spec)
    inputs = train[0] if isinstance(train, (tuple, list)) and len(train) == 2 else None
    empty = (inputs[:0] if inputs is not None else torch.empty(0), torch.empty((0,), dtype=torch.int64))
    (_, labels), _ = check_site_data(spec, train, empty)
    return {COUNTS: class_counts(labels, spec.num_classes)}


def aggregate(uploads: Sequence[Upload], ctx: Context) -> State:
    """:func:`class_aware_init` of the uploads, in the order given.  Uses ``ctx.spec`` only (no
    progress events: there is nothing to iterate).

    Raises:
        ValueError: no uploads, a state that does not fit ``ctx.spec``, extras that do not
            match :func:`extras_schema`, negative class counts.
    """
    uploads = check_uploads(uploads, ctx.spec, extras_schema(ctx.spec, ctx.options), "class-aware-mean")
    counts = check_counts(uploads, "class-aware-mean")
    return class_aware_init([u.state for u in uploads], counts, ctx.spec)
