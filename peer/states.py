"""Model states as plain dicts of tensors: averaging, copying, checking and loading them.

A *state* is a ``dict[str, torch.Tensor]`` as returned by ``nn.Module.state_dict()``
(parameters, BatchNorm running statistics and the int64 ``num_batches_tracked`` counters).
Every state this module returns holds new, contiguous CPU tensors, whatever device its
inputs were on.

:func:`average_states` is the ``mean`` aggregator of :mod:`fedrelay.registry`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from fedrelay.models import ModelSpec, build_model, state_signature

__all__ = ["State", "average_states", "clone_state", "check_signature", "build_loaded", "param_names", "flatten"]

State = dict[str, torch.Tensor]


def average_states(states: Sequence[Mapping[str, Tensor]]) -> State:
    """Uniform mean of every state_dict entry (paper Eq. 5/6; reference ``mean_average_weights``).

    Parameters, BatchNorm ``running_mean``/``running_var`` and ``num_batches_tracked``
    are all averaged; there is no weighting by data size.  Sums are taken in float64
    in the order of ``states``.  Floating entries are cast back to their dtype.
    Integer entries (``num_batches_tracked``) are averaged in float64 and cast back to
    their integer dtype, which truncates toward zero, like the reference code's
    ``true_divide`` followed by the cast to long on load.

    Returns:
        A new state with the key order of ``states[0]``; new contiguous CPU tensors.

    Raises:
        ValueError: ``states`` is empty, or the states differ in keys, shapes or dtypes.
    """
    states = list(states)
    if not states:
        raise ValueError("average_states needs at least one state")
    first = states[0]
    keys = list(first.keys())
    for index, state in enumerate(states[1:], start=1):
        if set(state.keys()) != set(keys):
            missing = sorted(set(keys) - set(state.keys()))
            extra = sorted(set(state.keys()) - set(keys))
            raise ValueError(f"state {index} has different keys: missing {missing[:5]}, extra {extra[:5]}")
        for key in keys:
            a, b = first[key], state[key]
            if a.shape != b.shape or a.dtype != b.dtype:
                raise ValueError(
                    f"state {index} entry {key!r} is {tuple(b.shape)} {b.dtype}, "
                    f"expected {tuple(a.shape)} {a.dtype}"
                )
    count = len(states)
    result: State = {}
    with torch.no_grad():
        for key in keys:
            dtype = first[key].dtype
            total = torch.zeros(first[key].shape, dtype=torch.float64)
            for state in states:
                total += state[key].detach().to(device="cpu", dtype=torch.float64)
            mean = total / count
            result[key] = mean.to(dtype).contiguous()
    return result


def clone_state(state: Mapping[str, Tensor]) -> State:
    """Detached, contiguous CPU copies of every entry."""
    return {k: v.detach().to(device="cpu", copy=True).contiguous() for k, v in state.items()}


def check_signature(state: Mapping[str, Tensor], expected: dict, what: str) -> None:
    """Raise ``ValueError`` (naming ``what``) unless ``state`` has the names, shapes and dtypes
    of ``expected`` (a :func:`~fedrelay.models.state_signature`)."""
    try:
        got = state_signature(state)
    except TypeError as exc:
        raise ValueError(f"{what} is not a state dict: {exc}") from None
    if got != expected:
        missing = sorted(set(expected) - set(got))
        extra = sorted(set(got) - set(expected))
        wrong = sorted(k for k in set(got) & set(expected) if got[k] != expected[k])
        raise ValueError(
            f"{what} does not fit the model: missing {missing[:5]}, unexpected {extra[:5]}, "
            f"wrong shape/dtype {wrong[:5]}"
        )


def build_loaded(spec: ModelSpec, state: Mapping[str, Tensor]) -> nn.Module:
    """Build a model and load ``state`` without disturbing the global RNG."""
    with torch.random.fork_rng(devices=[]):
        model = build_model(spec)
    model.load_state_dict(state)
    return model


def param_names(model: nn.Module) -> list[str]:
    """The state names of ``model``'s parameters, in ``model.parameters()`` order (buffers left out)."""
    return [name for name, _ in model.named_parameters()]


def flatten(params: Sequence[Tensor]) -> Tensor:
    """The detached parameters concatenated into one flat tensor. Raises ``ValueError`` if empty."""
    params = list(params)
    if not params:
        raise ValueError("no parameters given")
    return torch.cat([p.detach().reshape(-1) for p in params])
