"""The image-folder task's train-time augmentation (``coordinator start-chain --augment``):
:func:`flip_crop`, vectorised over the batch (one gather, no per-image loop)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["PAD", "flip_crop"]

PAD = 2  # pixels of zero padding around each image before the random crop


def flip_crop(images: Tensor, generator: torch.Generator, pad: int = PAD) -> Tensor:
    """A random crop of each image padded with ``pad`` zero pixels on every side, back to its
    own ``H x W``, then a horizontal flip with probability 1/2 (the standard CIFAR recipe; with
    ``pad=2`` for 28-pixel images).

    Draws, in this order, from ``generator`` (a CPU generator): ``N`` vertical offsets, ``N``
    horizontal offsets (each uniform in ``0 .. 2*pad``) and ``N`` flips; nothing else.

    Args:
        images: float ``N x C x H x W`` (any device; ``N`` may be 0).
        generator: CPU ``torch.Generator`` (consumed).
        pad: padding in pixels, >= 0 (0: flips only).

    Returns:
        A new tensor of the same shape, dtype and device.

    Raises:
        ValueError: ``images`` is not 4-dimensional, or ``pad < 0``.
    """
    if images.dim() != 4:
        raise ValueError(f"flip-crop needs images N x C x H x W, got a tensor of {images.dim()} dimensions")
    if pad < 0:
        raise ValueError(f"flip-crop's padding must be >= 0 pixels, got {pad}")
    n, _, h, w = images.shape
    dy = torch.randint(0, 2 * pad + 1, (n,), generator=generator)
    dx = torch.randint(0, 2 * pad + 1, (n,), generator=generator)
    flip = torch.randint(0, 2, (n,), generator=generator).bool()
    rows = dy[:, None] + torch.arange(h)                                   # N x H, in the padded image
    cols = torch.arange(w).expand(n, w)
    cols = dx[:, None] + torch.where(flip[:, None], w - 1 - cols, cols)    # N x W, flipped where drawn
    device = images.device
    padded = torch.nn.functional.pad(images, (pad, pad, pad, pad))
    out = padded[torch.arange(n, device=device)[:, None, None], :, rows.to(device)[:, :, None],
                 cols.to(device)[:, None, :]]                              # N x H x W x C
    return out.permute(0, 3, 1, 2).contiguous()
