"""The image-folder task's models: the architectures its runs can train (``--model``).

Every model takes a float32 batch ``N x C x H x W`` with pixel values in ``[0, 1]``
and returns float32 logits ``N x K`` (no softmax).  Construction draws its initial
weights from torch's *global* RNG and never seeds it: the caller does
``torch.manual_seed(...)`` immediately before :func:`build` when it needs a
reproducible initialisation (``fedrelay.models.build_seeded``).

Architectures (:data:`MODELS`):

``"cnn"``
    A small CPU-friendly CNN (not one of the reference code's CNNs, which are
    BN-free and sized for GPUs; reference-code §1.6)::

        Conv3x3(C->16, pad 1) + BatchNorm2d + ReLU + MaxPool2
        Conv3x3(16->32, pad 1) + BatchNorm2d + ReLU + MaxPool2
        Flatten, Linear(32*(H//4)*(W//4) -> 128) + ReLU, Linear(128 -> K)

    About 0.2 M parameters for 28x28 grey images.  Needs ``H, W >= 4``.

``"cnn-gn"``
    The ``"cnn"`` with each BatchNorm2d(c) replaced by GroupNorm(min(32, c), c), as Opacus'
    ``ModuleValidator.fix`` converts it: the model for differential privacy (DP-SGD needs
    per-sample gradients, which BatchNorm does not have; ``fedrelay.peer.privacy``). Same
    parameter count and initial draw of the convolutions and linear layers as ``"cnn"``; its
    state has no running statistics.

``"cnn-wide"``
    The ``"cnn"`` twice as wide in its convolutions and with a narrower dense layer, so that
    fewer of its weights sit in one linear layer and its bytes on the wire do not grow::

        Conv3x3(C->32, pad 1) + BatchNorm2d + ReLU + MaxPool2
        Conv3x3(32->64, pad 1) + BatchNorm2d + ReLU + MaxPool2
        Flatten, Linear(64*(H//4)*(W//4) -> 48) + ReLU, Linear(48 -> K)

    170,074 parameters for 28x28 grey images and 10 classes (``"cnn"``: 207,018), 88 % of them
    in the first linear layer (``"cnn"``: 97 %); about 3.3 times ``"cnn"``'s multiply-adds per
    image (4.0 M against 1.2 M at 28x28). Same state-dict keys as ``"cnn"``. Needs ``H, W >= 4``.

``"resnet18"``
    ``torchvision.models.resnet18(num_classes=K)`` with the CIFAR-style stem used
    by the reference code's ``models/resnet.py`` (reference-code §1.6):
    ``conv1 = Conv2d(C, 64, 3, stride 1, padding 1, bias=False)`` and
    ``maxpool = Identity``.  BasicBlocks [2, 2, 2, 2], widths 64-512, adaptive
    average pool, Linear head.  Needs ``H, W >= 9`` (the stem keeps the resolution
    and the three strided stages divide it by 8; from 9 px on, layer4 sees at
    least 2x2, so BatchNorm also works on a last training batch of one image).
"""

from __future__ import annotations

import torch
from torch import nn

from .architectures import MODELS

__all__ = ["MODELS", "MIN_SIZE", "WIDTHS", "SmallCNN", "build"]

MIN_SIZE = {"cnn": 4, "cnn-gn": 4, "cnn-wide": 4, "resnet18": 9}
# (first conv's channels, second conv's channels, dense layer's width) of the small CNNs
WIDTHS = {"cnn": (16, 32, 128), "cnn-gn": (16, 32, 128), "cnn-wide": (32, 64, 48)}


class SmallCNN(nn.Module):
    """The ``"cnn"`` architecture (see the module docstring); ``norm="group"``: ``"cnn-gn"``;
    ``widths=(32, 64, 48)``: ``"cnn-wide"``.

    Input ``N x C x H x W`` float32, output ``N x K`` float32 logits.
    State-dict keys: ``features.{0,1,4,5}.*`` (conv, BN, conv, BN) and
    ``classifier.{1,3}.*`` (the two Linear layers).

    Args:
        widths: output channels of the two convolutions and the width of the dense layer.
    """

    def __init__(self, in_channels: int, image_size: tuple[int, int], num_classes: int, norm: str = "batch",
                 widths: tuple[int, int, int] = WIDTHS["cnn"]):
        super().__init__()
        h, w = image_size
        c1, c2, hidden = widths

        def normalise(c: int) -> nn.Module:  # "group": as opacus.validators.ModuleValidator.fix makes it
            return nn.BatchNorm2d(c) if norm == "batch" else nn.GroupNorm(min(32, c), c)

        self.features = nn.Sequential(
            nn.Conv2d(in_channels, c1, kernel_size=3, padding=1),
            normalise(c1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, kernel_size=3, padding=1),
            normalise(c2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(c2 * (h // 4) * (w // 4), hidden),
            nn.ReLU(inplace=True),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def build(model: str, channels: int, size: tuple[int, int], num_classes: int) -> nn.Module:
    """A freshly initialised ``model`` (one of :data:`MODELS`) for ``channels`` x ``size`` images
    and ``num_classes`` logits, on the CPU, in train mode; weights drawn from torch's global RNG
    (never seeded here).  Maps float32 ``N x C x H x W`` in ``[0, 1]`` to float32 ``N x K``.

    Raises:
        ValueError: unknown ``model``; ``channels < 1``; ``num_classes < 2``; ``H`` or ``W``
            below 4 (``"cnn"``, ``"cnn-gn"``, ``"cnn-wide"``) or 9 (``"resnet18"``); non-int sizes.
    """
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r} for image-folder; choose one of {', '.join(MODELS)}")
    channels = _check_int("channels", channels, 1)
    num_classes = _check_int("num_classes", num_classes, 2)
    try:
        h, w = size
    except (TypeError, ValueError):
        raise ValueError(f"the image size must be (H, W), got {size!r}") from None
    h = _check_int("height", h, MIN_SIZE[model])
    w = _check_int("width", w, MIN_SIZE[model])
    if model in WIDTHS:
        return SmallCNN(channels, (h, w), num_classes, norm="group" if model == "cnn-gn" else "batch",
                        widths=WIDTHS[model])
    # resnet18: the reference code's CIFAR ResNet-18 (3x3 stride-1 stem, no max-pool).
    from torchvision.models import resnet18  # imported lazily: torchvision is slow to import

    net = resnet18(weights=None, num_classes=num_classes)
    net.conv1 = nn.Conv2d(channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    # Same initialisation torchvision applies to every other conv of the network.
    nn.init.kaiming_normal_(net.conv1.weight, mode="fan_out", nonlinearity="relu")
    net.maxpool = nn.Identity()
    return net
