"""Top-1 accuracy of a model on a set of rows: :func:`evaluate`."""

from __future__ import annotations

import torch
from torch import nn, Tensor

from fedrelay.task import Task

from .site_data import check_data

__all__ = ["evaluate"]


def evaluate(model: nn.Module, inputs: Tensor, labels: Tensor, batch_size: int = 512, device="cpu", *,
             task: Task) -> tuple[int, int]:
    """Count correct top-1 predictions.

    Args:
        model: already on ``device``; evaluated in ``eval()`` mode under
            ``torch.inference_mode``; its previous train/eval mode is restored.
        inputs: ``N x ...`` rows (``task.batch(rows, train=False)`` per batch).
        labels: int64 ``N``.
        batch_size: rows per forward pass.
        device: where the batches go.
        task: the run's task.

    Returns:
        ``(correct, total)``; ``(0, 0)`` for an empty set.
    """
    images, labels = check_data((inputs, labels), "evaluation data", allow_empty=True)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    total = int(labels.shape[0])
    if total == 0:
        return 0, 0
    was_training = model.training
    model.eval()
    correct = 0
    try:
        with torch.inference_mode():
            for start in range(0, total, batch_size):
                x = task.batch(images[start:start + batch_size].to(device), train=False)
                y = labels[start:start + batch_size].to(device)
                correct += int((model(x).argmax(dim=1) == y).sum())
    finally:
        model.train(was_training)
    return correct, total
