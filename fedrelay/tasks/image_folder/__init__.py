"""``image-folder``, the default task: a site folder of images in one folder per class, a small
CNN or a ResNet-18, cross-entropy, Adam.

Layout (the same one ``coordinator split-dataset`` writes; the rules are in :mod:`.data`)::

    site/
      train/<class name>/<file>.png|.jpg|.jpeg|.dcm     (required)
      test/<class name>/<file>.png|.jpg|.jpeg|.dcm      (optional)
      fedrelay.toml                                      (optional: [image-folder] size, bits)

PNG/JPEG are decoded with Pillow, DICOM files with pydicom (:mod:`.dicom`: stored values at
the file's Bits Stored range, MONOCHROME1 inverted). Every image of a site must decode to the
same ``(C, H, W)`` (or the site resizes them all: ``size = [H, W]`` in its ``fedrelay.toml``,
:mod:`.options`), and every site of a run to the same one: the sites' shared input description
is ``{"channels": C, "height": H, "width": W}``, plus ``"bits": 16`` for 16-bit images.
Inputs are kept as uint8 (8-bit images) or uint16 (16-bit: 16-bit greyscale PNG, DICOM with
more than 8 bits stored) and become float32 in ``[0, 1]`` per batch (``/ 255`` or
``/ 65535``); no normalisation. Train-time augmentation (``--augment flip-crop``): a random crop
with 2-pixel zero padding and a random horizontal flip (:mod:`.augment`). Models (``--model``):
``cnn`` (the default), ``cnn-gn``, ``cnn-wide`` and ``resnet18`` (:mod:`.models`).
"""

from __future__ import annotations

from pathlib import Path

from fedrelay.task import DataSummary, ModelSpec, Task, canonical_json

from .architectures import MODELS

__all__ = ["ImageFolderTask", "MODELS", "spec"]


class ImageFolderTask(Task):
    """Class folders of PNG/JPEG/DICOM images (see the module docstring)."""

    models = MODELS
    augmentations = ("flip-crop",)

    def describe(self, root: Path) -> DataSummary:
        """Class counts, the image shape and depth from listings, the site's ``fedrelay.toml``
        and image headers (no pixel decoded)."""
        from .scan import scan_site

        found = scan_site(root)
        return DataSummary(classes={k: (found.train_counts.get(k, 0), found.test_counts.get(k, 0))
                                    for k in found.class_names},
                           input=found.input,
                           notes=[found.skipped_message()] if found.skipped else [])

    def load(self, root: Path):
        """Every image decoded into memory as uint8, or uint16 for a 16-bit site
        (:func:`.data.load_site`)."""
        from .data import load_site

        return load_site(root)

    def build_model(self, spec: ModelSpec):
        from .models import build

        shape = spec.input
        try:
            channels, size = shape["channels"], (shape["height"], shape["width"])
        except (KeyError, TypeError):
            raise ValueError(f"image-folder needs an input description with channels, height and width, "
                             f"got {spec.input_json}") from None
        return build(spec.model, channels, size, spec.num_classes)

    def batch(self, inputs, *, train: bool, generator=None):
        """uint8 pixels ``N x C x H x W`` -> float32 in [0, 1] (``/ 255``); uint16 pixels (a
        16-bit site) -> float32 in [0, 1] (``/ 65535``). Raises ``ValueError`` for other inputs."""
        import torch

        if inputs.dim() != 4 or inputs.dtype not in (torch.uint8, torch.uint16):
            raise ValueError(f"image-folder inputs are uint8 or uint16 N x C x H x W pixels, got {inputs.dtype} of "
                             f"{inputs.dim()} dimensions")
        return inputs.to(torch.float32).div_(255.0 if inputs.dtype == torch.uint8 else 65535.0)

    def augment(self, inputs, *, method: str, generator):
        """``"flip-crop"``: :func:`.augment.flip_crop` of the float ``N x C x H x W`` batch (same
        shape, dtype and device). Raises ``ValueError`` for another method."""
        if method != "flip-crop":
            raise ValueError(f"--augment {method}: image-folder offers {', '.join(self.augmentations)}")
        from .augment import flip_crop

        return flip_crop(inputs, generator)


def spec(model: str, channels: int, size: tuple[int, int], num_classes: int, bits: int = 8) -> ModelSpec:
    """The :class:`fedrelay.ModelSpec` of an image-folder run: ``model`` (``"cnn"`` or
    ``"resnet18"``) over ``channels`` x ``size`` images of ``bits`` (8 or 16) bits with
    ``num_classes`` classes, without a pinned digest (for tests, benchmarks and notebooks that
    call the training functions)."""
    from .scan import input_description

    return ModelSpec(task="image-folder", model=model, num_classes=num_classes,
                     input_json=canonical_json(input_description((channels, *size), bits)))
