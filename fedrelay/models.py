"""A run's model, whatever its task: building it (seeded, so every site builds the same one), its
state signature, and the checks every received state goes through.

The model itself comes from the run's task (:meth:`fedrelay.Task.build_model`, found by
``fedrelay.tasks.resolve(spec)``); nothing here knows its layers. A model's **state** is its
``state_dict()``: the parameters (floating point) and buffers (e.g. BatchNorm running
statistics and their int64 ``num_batches_tracked`` counters).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping

import torch
from torch import nn

from fedrelay import tasks
from fedrelay.task import ModelSpec

__all__ = ["ModelSpec", "build_model", "build_seeded", "state_signature", "expected_signature", "state_bytes",
           "check_state"]

# Held while a model is constructed, so that a seeded construction (build_seeded) is not
# interleaved with another thread's build_model drawing from the same global RNG.
_BUILD_LOCK = threading.RLock()


def build_model(spec: ModelSpec) -> nn.Module:
    """A freshly initialised model for ``spec``, built by the run's task, on the CPU, in train
    mode. Deterministic given the global torch RNG state (the caller seeds it; this function
    never does).

    Raises:
        ValueError: the task cannot build ``spec`` (its message), or returned something that is
            not an ``nn.Module`` with floating-point parameters.
        TaskNotInstalled, ImportError, TypeError: the task cannot be loaded
            (``fedrelay.tasks.load``).
    """
    task = tasks.resolve(spec)
    with _BUILD_LOCK:
        model = task.build_model(spec)
    if not isinstance(model, nn.Module):
        raise ValueError(f"task {spec.task!r}: build_model returned {type(model).__name__}, not a torch.nn.Module")
    params = list(model.parameters())
    if not params:
        raise ValueError(f"task {spec.task!r}: model {spec.model!r} has no parameters to train")
    bad = [name for name, p in model.named_parameters() if not p.is_floating_point()]
    if bad:
        raise ValueError(f"task {spec.task!r}: model {spec.model!r} has parameters that are not floating point: "
                         f"{bad[:3]}")
    return model


def build_seeded(spec: ModelSpec, seed: int) -> nn.Module:
    """``torch.manual_seed(seed)`` immediately followed by :func:`build_model`.

    Atomic with respect to :func:`build_model` calls in other threads of the process (a worker
    may build models to check received states while it trains), and the global CPU RNG state
    is restored afterwards (``torch.random.fork_rng``).
    """
    with _BUILD_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build_model(spec)


def state_signature(model_or_state) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Return ``{name: (shape, dtype)}`` for every state_dict entry.

    Accepts an ``nn.Module`` (its ``state_dict()``) or a mapping of name to tensor
    (e.g. a received state).  Compare the signature of a received state with
    ``expected_signature(spec)`` to validate it before loading.

    Raises:
        TypeError: the argument is neither a module nor a mapping of tensors.
    """
    if isinstance(model_or_state, nn.Module):
        state = model_or_state.state_dict()
    elif isinstance(model_or_state, Mapping):
        state = model_or_state
    else:
        raise TypeError(f"expected an nn.Module or a state dict, got {type(model_or_state).__name__}")
    signature = {}
    for name, tensor in state.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"state entry {name!r} is {type(tensor).__name__}, not a tensor")
        signature[name] = (tuple(tensor.shape), tensor.dtype)
    return signature


@functools.lru_cache(maxsize=32)
def expected_signature(spec: ModelSpec) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """:func:`state_signature` of the model ``spec`` describes, without building its weights
    where the task allows: the model is constructed on PyTorch's ``meta`` device (shapes and
    dtypes only: no memory, no random numbers drawn); a model that cannot be built there is
    built on the CPU with the global RNG state restored afterwards. Cached per spec. Raises
    like :func:`build_model`."""
    tasks.resolve(spec)  # imported outside the meta device: a task module may make tensors when imported
    try:
        with torch.device("meta"):
            return state_signature(build_model(spec))
    except (RuntimeError, NotImplementedError, TypeError):
        with torch.random.fork_rng(devices=[]):
            return state_signature(build_model(spec))


def state_bytes(spec: ModelSpec) -> int:
    """Bytes of all state entries of the model ``spec`` describes (the payload's tensor data)."""
    return sum(torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
               for shape, dtype in expected_signature(spec).values())


def _all_finite(t: torch.Tensor) -> bool:
    # A finite sum implies every element is finite (NaN and Inf propagate through a sum);
    # only a non-finite sum, e.g. an overflow of huge finite values, needs the elementwise check.
    # ~15x faster than isfinite().all() on large tensors.
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def check_state(state: Mapping[str, torch.Tensor], spec: ModelSpec, expected: dict | None = None) -> None:
    """Check that ``state`` is a state of the model ``spec`` describes (or, when given, matches
    the schema ``expected``, ``{name: (shape, dtype)}``: a strategy's payload): the same tensor
    names, shapes and dtypes, and no NaN or Inf in floating tensors.

    Raises ``ValueError`` naming the first difference.
    """
    expected = expected if expected is not None else expected_signature(spec)
    got = state_signature(state)
    if set(got) != set(expected):
        extra, missing = sorted(set(got) - set(expected)), sorted(set(expected) - set(got))
        raise ValueError(f"tensor names differ from the run's model (unexpected {extra[:5]}, missing {missing[:5]})")
    for k, sig in expected.items():
        if got[k] != sig:
            raise ValueError(f"tensor {k!r} is {got[k]}, the run's model has {sig}")
    for k, t in state.items():
        if t.is_floating_point() and not _all_finite(t):
            raise ValueError(f"tensor {k!r} holds NaN or Inf")
