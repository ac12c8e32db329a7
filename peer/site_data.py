"""A site's data, checked and split: :func:`train_val_split`, :func:`check_data`,
:func:`check_site_data` and :func:`check_outputs` (the task's model maps the site's inputs to
logits).

Data: ``(inputs, labels)`` tuples: ``inputs`` a tensor ``N x ...`` (one row per sample, any dtype),
``labels`` an int64 tensor ``N`` of class indices.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from fedrelay.models import ModelSpec
from fedrelay.task import Task

__all__ = ["Dataset", "train_val_split", "check_data", "check_site_data", "check_outputs"]

Dataset = tuple[Tensor, Tensor]


def train_val_split(
    images: torch.Tensor, labels: torch.Tensor, seed: int, val_fraction: float = 0.1
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """Split a site's training samples into train and validation parts (reference protocol).

    A permutation of the N samples is drawn with a ``torch.Generator`` seeded by ``seed``;
    validation gets the first ``int(val_fraction * N)`` permuted indices and training the
    rest (FedELMY implementation notes §1.5: "val = first int(0.1*len) indices"). With
    N < 1 / val_fraction the validation part is empty.

    Args:
        images: tensor ``(N, ...)`` (any dtype).
        labels: tensor ``(N,)``.
        seed: generator seed; the same seed gives the same split.
        val_fraction: share of samples for validation, in [0, 1).

    Returns:
        ``((train_images, train_labels), (val_images, val_labels))`` (new tensors).
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), not {val_fraction}")
    n = int(images.shape[0])
    if int(labels.shape[0]) != n:
        raise ValueError(f"images has {n} samples but labels has {int(labels.shape[0])}")
    gen = torch.Generator().manual_seed(int(seed))
    perm = torch.randperm(n, generator=gen)
    n_val = int(val_fraction * n)
    val_idx, train_idx = perm[:n_val], perm[n_val:]
    return (images[train_idx], labels[train_idx]), (images[val_idx], labels[val_idx])


def check_data(data, what: str, allow_empty: bool) -> Dataset:
    """``data`` as ``(inputs, labels)``: a tensor ``N x ...`` and int64 ``N``.

    Raises:
        ValueError: naming ``what``: not a pair, not tensors, labels not int64 ``N``, different
            lengths, or empty when ``allow_empty`` is False.
    """
    try:
        inputs, labels = data
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be an (inputs, labels) tuple") from None
    if not isinstance(inputs, Tensor) or inputs.dim() < 1:
        raise ValueError(f"{what} inputs must be a tensor with one row per sample")
    if not isinstance(labels, Tensor) or labels.dtype != torch.int64 or labels.dim() != 1:
        raise ValueError(f"{what} labels must be an int64 tensor N")
    if inputs.shape[0] != labels.shape[0]:
        raise ValueError(f"{what}: {inputs.shape[0]} input rows but {labels.shape[0]} labels")
    if inputs.shape[0] == 0 and not allow_empty:
        raise ValueError(f"{what} is empty")
    return inputs, labels


def _check_labels(spec: ModelSpec, data: Dataset, what: str) -> None:
    labels = data[1]
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= spec.num_classes):
        raise ValueError(f"{what} labels must lie in [0, {spec.num_classes})")


def check_site_data(spec: ModelSpec, train, val) -> tuple[Dataset, Dataset]:
    """A site's ``(train, val)`` checked with :func:`check_data` (train non-empty, val may be
    empty), labels in ``[0, spec.num_classes)``.  Raises ``ValueError``."""
    train = check_data(train, "train", allow_empty=False)
    val = check_data(val, "val", allow_empty=True)
    _check_labels(spec, train, "train")
    _check_labels(spec, val, "val")
    return train, val


def check_outputs(model: nn.Module, task: Task, spec: ModelSpec, inputs: Tensor) -> None:
    """Check, before training or evaluating, that the task's model maps a batch of the task's
    inputs to logits ``N x K`` (``K = spec.num_classes``): one forward pass over the first two
    rows in eval mode without gradient (no weight, buffer or random state changes; the model's
    train/eval mode is restored). Raises ``ValueError`` naming the task, the model and the shape."""
    if inputs.shape[0] == 0:
        return
    where = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model(task.batch(inputs[:2].to(where), train=False))
    except (RuntimeError, TypeError, IndexError) as exc:  # e.g. a shape the model's first layer cannot take
        raise ValueError(f"the model {spec.model!r} of task {spec.task!r} cannot take this site's inputs "
                         f"{tuple(inputs.shape[1:])} ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
    finally:
        model.train(was_training)
    n = min(2, int(inputs.shape[0]))
    if not isinstance(out, Tensor) or tuple(out.shape) != (n, spec.num_classes) or not out.is_floating_point():
        got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
        raise ValueError(f"the model {spec.model!r} of task {spec.task!r} returns {got} for a batch of {n} "
                         f"rows; the run needs float logits of shape ({n}, {spec.num_classes}): one per class of "
                         "the run's class index")
