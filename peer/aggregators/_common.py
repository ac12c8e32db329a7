"""Checks and means shared by the aggregators (internal)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from fedrelay.models import ModelSpec, check_state, expected_signature
from ..states import State
from . import Upload

Schema = dict[str, tuple[tuple[int, ...], torch.dtype]]


def check_uploads(uploads: Sequence[Upload], spec: ModelSpec, schema: Mapping, method: str) -> list[Upload]:
    """``uploads`` as a list, after checking that there is at least one, that every item is an
    :class:`Upload` from a distinct site, that every state fits ``spec`` (names, shapes, dtypes,
    finite values) and that every upload's extras match ``schema`` exactly.

    Raises ``ValueError`` naming the site and the first difference.
    """
    uploads = list(uploads)
    if not uploads:
        raise ValueError(f"{method}: no uploads to aggregate")
    seen: set[str] = set()
    for upload in uploads:
        if not isinstance(upload, Upload):
            raise ValueError(f"{method}: expected Upload objects, got {type(upload).__name__}")
        if upload.site in seen:
            raise ValueError(f"{method}: two uploads from site {upload.site!r}")
        seen.add(upload.site)
        try:
            check_state(upload.state, spec)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{method}: the model uploaded by site {upload.site!r}: {exc}") from None
        check_extras(upload.extras, schema, f"{method}: site {upload.site!r}")
    return uploads


def check_extras(extras: Mapping[str, Tensor], schema: Mapping, what: str) -> None:
    """Raise ``ValueError`` unless ``extras`` has exactly the names, shapes and dtypes of
    ``schema`` and no NaN/Inf in floating tensors."""
    if not isinstance(extras, Mapping):
        raise ValueError(f"{what}: extras must be a dict of tensors, got {type(extras).__name__}")
    names, expected = set(extras), set(schema)
    if names != expected:
        raise ValueError(f"{what}: extras {sorted(names)[:5]} do not match the method's schema "
                         f"{sorted(expected)[:5]} (missing {sorted(expected - names)[:5]}, "
                         f"unexpected {sorted(names - expected)[:5]})")
    for name, (shape, dtype) in schema.items():
        tensor = extras[name]
        if not isinstance(tensor, Tensor):
            raise ValueError(f"{what}: extra {name!r} is {type(tensor).__name__}, not a tensor")
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise ValueError(f"{what}: extra {name!r} is {tuple(tensor.shape)} {tensor.dtype}, "
                             f"the schema says {tuple(shape)} {dtype}")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{what}: extra {name!r} holds NaN or Inf")


def weighted_mean(tensors: Sequence[Tensor], weights: Sequence[float] | None = None) -> Tensor:
    """``Σ w_k t_k / Σ w_k`` (uniform when ``weights`` is None), summed in float64 in the order
    given and cast back to the tensors' dtype (integers truncate toward zero, like
    :func:`fedrelay.peer.states.average_states`).  A new contiguous CPU tensor."""
    tensors = list(tensors)
    dtype = tensors[0].dtype
    total = torch.zeros(tensors[0].shape, dtype=torch.float64)
    if weights is None:
        for t in tensors:
            total += t.detach().to(device="cpu", dtype=torch.float64)
        total /= len(tensors)
    else:
        weights = [float(w) for w in weights]
        for w, t in zip(weights, tensors, strict=True):
            total += w * t.detach().to(device="cpu", dtype=torch.float64)
        total /= sum(weights)
    return total.to(dtype).contiguous()


def expected_keys(spec: ModelSpec) -> list[str]:
    """The run model's state keys, in state order."""
    return list(expected_signature(spec))


def head_names(spec: ModelSpec) -> tuple[str, str | None]:
    """``(weight name, bias name or None)`` of the classifier head: the last 2-D weight in state
    order (``classifier.3`` for ``"cnn"``, ``fc`` for ``"resnet18"``)."""
    signature = expected_signature(spec)
    weights = [k for k, (shape, _) in signature.items() if k.endswith(".weight") and len(shape) == 2]
    if not weights:
        raise ValueError(f"model {spec.arch!r} has no 2-D weight (no classifier head)")
    weight = weights[-1]
    bias = weight[: -len("weight")] + "bias"
    return weight, (bias if bias in signature else None)


def uniform_state(states: Sequence[State], keys: Sequence[str]) -> State:
    """``{k: uniform mean of states[*][k]}`` for ``keys`` (float64 sums, cast back)."""
    return {k: weighted_mean([s[k] for s in states]) for k in keys}
