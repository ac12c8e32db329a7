"""The model zoo: the architectures a fedrelay run can train.

Every model takes a float32 batch ``N x C x H x W`` with pixel values in ``[0, 1]``
and returns float32 logits ``N x K`` (no softmax).  Construction draws its initial
weights from torch's *global* RNG and never seeds it: the caller does
``torch.manual_seed(...)`` immediately before :func:`build_model` when it needs a
reproducible initialisation (see ``fedrelay.peer.training.run_site``).

Architectures (``ARCHS``):

``"cnn"``
    A small CPU-friendly CNN (not one of the reference code's CNNs, which are
    BN-free and sized for GPUs; implementation-notes section 1.6)::

        Conv3x3(C->16, pad 1) + BatchNorm2d + ReLU + MaxPool2
        Conv3x3(16->32, pad 1) + BatchNorm2d + ReLU + MaxPool2
        Flatten, Linear(32*(H//4)*(W//4) -> 128) + ReLU, Linear(128 -> K)

    About 0.2 M parameters for 28x28 grey images.  Needs ``H, W >= 4``.

``"resnet18"``
    ``torchvision.models.resnet18(num_classes=K)`` with the CIFAR-style stem used
    by the reference code's ``models/resnet.py`` (implementation-notes section 1.6):
    ``conv1 = Conv2d(C, 64, 3, stride 1, padding 1, bias=False)`` and
    ``maxpool = Identity``.  BasicBlocks [2, 2, 2, 2], widths 64-512, adaptive
    average pool, Linear head.  Needs ``H, W >= 9`` (the stem keeps the resolution
    and the three strided stages divide it by 8; from 9 px on, layer4 sees at
    least 2x2, so BatchNorm also works on a last training batch of one image).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from fedrelay.registry import ARCHS  # the one list of architectures

__all__ = ["ARCHS", "ModelSpec", "SmallCNN", "build_model", "state_signature", "expected_signature",
           "state_bytes", "check_state"]

_MIN_SIZE = {"cnn": 4, "resnet18": 9}

# Held while a model is constructed, so that a seeded construction (_build_seeded) is
# not interleaved with another thread's build_model drawing from the same global RNG.
_BUILD_LOCK = threading.RLock()


@dataclass(frozen=True)
class ModelSpec:
    """What to build.

    Attributes:
        arch: one of :data:`ARCHS` (``"cnn"`` or ``"resnet18"``).
        in_channels: image channels C (1 for grey, 3 for RGB).
        image_size: ``(H, W)`` in pixels.
        num_classes: K, the number of output logits (>= 2).
    """

    arch: str
    in_channels: int
    image_size: tuple[int, int]
    num_classes: int


class SmallCNN(nn.Module):
    """The ``"cnn"`` architecture (see the module docstring).

    Input ``N x C x H x W`` float32, output ``N x K`` float32 logits.
    State-dict keys: ``features.{0,1,4,5}.*`` (conv, BN, conv, BN) and
    ``classifier.{1,3}.*`` (the two Linear layers).
    """

    def __init__(self, in_channels: int, image_size: tuple[int, int], num_classes: int):
        super().__init__()
        h, w = image_size
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 16, kernel_size=3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, kernel_size=3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(32 * (h // 4) * (w // 4), 128),
            nn.ReLU(inplace=True),
            nn.Linear(128, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"ModelSpec.{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"ModelSpec.{name} must be >= {minimum}, got {value}")
    return value


def _checked(spec: ModelSpec) -> tuple[str, int, tuple[int, int], int]:
    if spec.arch not in ARCHS:
        raise ValueError(f"unknown arch {spec.arch!r}; expected one of {ARCHS}")
    channels = _check_int("in_channels", spec.in_channels, 1)
    classes = _check_int("num_classes", spec.num_classes, 2)
    try:
        h, w = spec.image_size
    except (TypeError, ValueError):
        raise ValueError(f"ModelSpec.image_size must be (H, W), got {spec.image_size!r}") from None
    minimum = _MIN_SIZE[spec.arch]
    h = _check_int("image_size[0] (H)", h, minimum)
    w = _check_int("image_size[1] (W)", w, minimum)
    return spec.arch, channels, (h, w), classes


def build_model(spec: ModelSpec) -> nn.Module:
    """Build a freshly initialised model for ``spec`` on the CPU, in train mode.

    Deterministic given the global torch RNG state (the caller seeds it; this
    function never does).  The model maps float32 ``N x C x H x W`` in ``[0, 1]``
    to float32 ``N x K`` logits.

    Raises:
        ValueError: unknown ``arch``; ``in_channels < 1``; ``num_classes < 2``;
            ``H`` or ``W`` below 4 (``"cnn"``) or 9 (``"resnet18"``); non-int sizes.
    """
    arch, channels, size, classes = _checked(spec)
    if arch == "cnn":
        with _BUILD_LOCK:
            return SmallCNN(channels, size, classes)
    # resnet18: the reference code's CIFAR ResNet-18 (3x3 stride-1 stem, no max-pool).
    from torchvision.models import resnet18  # imported lazily: torchvision is slow to import

    with _BUILD_LOCK:
        model = resnet18(weights=None, num_classes=classes)
        model.conv1 = nn.Conv2d(channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        # Same initialisation torchvision applies to every other conv of the network.
        nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
        model.maxpool = nn.Identity()
    return model


def _build_seeded(spec: ModelSpec, seed: int) -> nn.Module:
    """``torch.manual_seed(seed)`` immediately followed by :func:`build_model`.

    Atomic with respect to :func:`build_model` calls in other threads of the process
    (a daemon may build models to validate received states while a site trains), and
    the global CPU RNG state is restored afterwards (``torch.random.fork_rng``).
    """
    with _BUILD_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build_model(spec)


def state_signature(model_or_state) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Return ``{name: (shape, dtype)}`` for every state_dict entry.

    Accepts an ``nn.Module`` (its ``state_dict()``) or a mapping of name to tensor
    (e.g. a received state).  Compare the signature of a received state with
    ``state_signature(build_model(spec))`` to validate it before loading.

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
    """:func:`state_signature` of the model ``spec`` describes, without building its weights.

    The model is constructed on PyTorch's ``meta`` device (shapes and dtypes only: no memory,
    no random numbers drawn), and the result is cached per spec, so checking a received
    payload against the run's model costs microseconds, not a model construction.
    Raises ``ValueError`` like :func:`build_model`.
    """
    with torch.device("meta"):
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
