"""A site's local image data: an ImageFolder-style folder, decoded once into memory.

Layout (the same one ``coordinator split`` writes)::

    root/
      train/<class name>/<file>.png|.jpg|.jpeg     (required; at least one image overall)
      test/<class name>/<file>.png|.jpg|.jpeg      (optional)

* Extensions are matched case-insensitively (``.PNG``, ``.JPG`` ...). Any other file in a
  class folder (``README``, ``labels.csv``, a ``.bmp`` or ``.webp`` image ...) is skipped and
  listed in ``SiteData.skipped`` (the daemon says so when it starts); hidden entries (names
  starting with ``.``) and sub-folders *inside* a class folder are ignored (the scan is not
  recursive).
* Every image is decoded even after one fails: unreadable or corrupt images are reported
  together (how many, and the first few paths).
* An image lying directly in ``train/`` or ``test/`` (not in a class folder) is an error:
  the label would be unknown.
* A class folder that is absent, or present but empty, is normal under label skew: the
  class simply has 0 images at this site. ``class_names`` lists the classes with at least
  one image in ``train/`` or ``test/``.
* A missing ``test/`` folder is allowed: ``test_counts`` is then empty and
  ``tensors("test", ...)`` returns empty tensors of shape ``(0, C, H, W)`` / ``(0,)``.
* Images may be greyscale or colour, of any size, but every image of a site must decode to
  the same ``(C, H, W)``. Nothing is resized: a mismatch is reported, naming the file.

Colour modes (decoded with Pillow, always to 8 bits per channel):

* greyscale (``L``), 1-bit (``1``) and greyscale + alpha (``LA``) -> 1 channel; the alpha
  channel is dropped (not composited);
* 16-bit greyscale (``I;16*``) -> 1 channel, scaled to 8 bits (``value >> 8``);
* palette images (``P``/``PA``) -> 1 channel if every palette entry used is grey (r == g == b),
  else 3 channels (RGB); transparency is dropped;
* RGB -> 3 channels; RGBA/RGBX -> 3 channels, alpha dropped (not composited); CMYK, YCbCr
  and the other colour modes -> converted to RGB;
* 32-bit integer or float images (``I``, ``F``) are refused: convert them to 8-bit PNG.

EXIF orientation tags are not applied (the pixels are used as stored).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

# Listing folders and reading image headers needs no torch: peer/scan.py (the light daemon's part).
from fedrelay.task import SiteData as GenericSiteData
from fedrelay.tasks.image_folder.scan import (IMAGE_EXTENSIONS, DataError, _is_image_file, _palette_is_grey,  # noqa: F401
                                              _scan_folders, _scan_split, skipped_message)

__all__ = ["DataError", "SiteData", "IMAGE_EXTENSIONS", "load_site"]

SPLITS = ("train", "test")


@dataclass
class SiteData(GenericSiteData):
    """The decoded images of one site, held in memory as uint8 tensors: a
    :class:`fedrelay.SiteData` (``inputs[split]``: uint8 ``(N, C, H, W)``, ``labels[split]``:
    int64 ``(N,)`` positions in ``class_names``; ``input``: ``{"channels", "height", "width"}``)
    with the folder's particulars.

    Attributes:
        root: the site folder that was loaded.
        class_names: sorted names of the class folders holding >= 1 image in train/ or test/.
        image_shape: ``(C, H, W)`` shared by every image of the site (C is 1 or 3).
        train_counts / test_counts: class name -> number of images (0 allowed); both have
            one key per entry of ``class_names``, except that ``test_counts`` is empty when
            the site has no ``test/`` folder.
        has_test: whether the site has a ``test/`` folder.
        skipped: files in class folders that are not .png/.jpg/.jpeg.
    """

    root: Path = Path(".")
    image_shape: tuple[int, int, int] = (0, 0, 0)
    train_counts: dict[str, int] = field(default_factory=dict)
    test_counts: dict[str, int] = field(default_factory=dict)
    has_test: bool = True
    skipped: list[Path] = field(default_factory=list)

    def skipped_message(self, show: int = 3) -> str:
        """One line on :attr:`skipped` (empty if none): how many files, and the first ``show``."""
        return skipped_message(self.skipped, show)

    def tensors(self, split: str, class_index: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """The images and labels of one split: uint8 ``(N, C, H, W)`` (values 0..255, not
        normalised; shared with this object, so do not modify it in place) and int64 ``(N,)``
        positions in the federation-wide ``class_index`` (which may contain classes this site
        lacks, but must contain every class of the site). Order: sorted class name, then sorted
        file name. Raises ``DataError`` (a class not in ``class_index``, or duplicates) and
        ``ValueError`` (an unknown split)."""
        try:
            return super().tensors(split, class_index)
        except DataError as exc:
            if "not in the run's class list" not in str(exc):
                raise
            missing = [c for c in self.class_names if c not in set(class_index)]
            raise DataError(
                f"site {self.root} has class folder(s) {missing} that are not in the federation's "
                f"class list {list(class_index)}; rename or remove those folders (under "
                f"{self.root / 'train'} / {self.root / 'test'}), or add the classes to the run's "
                f"class list") from None


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be 'train' or 'test', not {split!r}")


def _decode(path: Path) -> np.ndarray:
    """Decode one image file to uint8 (C, H, W) with C in {1, 3}; DataError on failure."""
    try:
        with Image.open(path) as im:
            im.load()
            mode = im.mode
            if mode in ("1", "LA", "La"):
                im = im.convert("L")
            elif mode.startswith("I;16"):
                arr16 = np.asarray(im).astype(np.uint32)
                return (arr16 >> 8).astype(np.uint8)[None]
            elif mode in ("I", "F"):
                raise DataError(
                    f"image {path} has 32-bit pixels (mode {mode}); convert it to an 8-bit "
                    f"greyscale or RGB PNG/JPEG"
                )
            elif mode in ("P", "PA"):
                grey = _palette_is_grey(im)
                rgb = np.asarray(im.convert("RGBA"), dtype=np.uint8)
                rgb = rgb[..., :1] if grey else rgb[..., :3]
                return np.ascontiguousarray(rgb.transpose(2, 0, 1))
            elif mode not in ("L", "RGB"):
                im = im.convert("RGB")
            arr = np.asarray(im, dtype=np.uint8)
    except DataError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise DataError(
            f"cannot read or decode image {path}: {e}; check that the file is readable and a "
            f"valid PNG/JPEG, else replace or delete it (it may be corrupt or truncated)"
        ) from e
    if arr.ndim == 2:
        return arr[None]
    return np.ascontiguousarray(arr.transpose(2, 0, 1))


def _shape_str(shape: Sequence[int]) -> str:
    return "(C={}, H={}, W={})".format(*shape)


def load_site(root: str | Path, *, expect_shape: tuple[int, int, int] | None = None) -> SiteData:
    """Load and decode every image of a site folder into memory, once.

    Args:
        root: the site folder, holding ``train/`` and optionally ``test/`` (see module doc).
        expect_shape: if given, the ``(C, H, W)`` every image must have (e.g. what the
            run's model expects); images are never resized.

    Returns:
        A :class:`SiteData`; get tensors with ``site.tensors("train", class_index)``.

    Raises:
        DataError: root missing or not a folder; ``train/`` missing; no training image at
            all; ``test`` present but not a folder; an unreadable or corrupt image; an image
            directly in ``train/``/``test/``; an image whose (C, H, W) differs from the
            site's first image or from ``expect_shape``. The message names the offending path.
    """
    root = Path(root)
    if expect_shape is not None:
        expect_shape = tuple(int(v) for v in expect_shape)  # type: ignore[assignment]
        if len(expect_shape) != 3 or min(expect_shape) < 1:
            raise ValueError(f"expect_shape must be (C, H, W) with positive entries, not {expect_shape}")
    scans, skipped, has_test = _scan_folders(root)
    class_names = sorted({c for scan in scans.values() for c, files in scan.items() if files})
    class_pos = {c: i for i, c in enumerate(class_names)}

    shape: tuple[int, int, int] | None = None
    reference_file: Path | None = None
    images: dict[str, torch.Tensor] = {}
    local_labels: dict[str, torch.Tensor] = {}
    counts: dict[str, dict[str, int]] = {}
    unreadable: list[DataError] = []
    for split in SPLITS:
        scan = scans[split]
        paths: list[Path] = []
        labels: list[int] = []
        for c in class_names:
            files = scan.get(c, [])
            paths.extend(files)
            labels.extend([class_pos[c]] * len(files))
        counts[split] = {c: len(scan.get(c, [])) for c in class_names} if (split == "train" or has_test) else {}
        buf: np.ndarray | None = None
        for i, path in enumerate(paths):
            try:
                arr = _decode(path)
            except DataError as exc:
                unreadable.append(exc)  # decode the others too, to report every bad file at once
                continue
            if shape is None:
                shape = tuple(arr.shape)  # type: ignore[assignment]
                reference_file = path
                if expect_shape is not None and shape != expect_shape:
                    raise DataError(
                        f"image {path} has shape {_shape_str(shape)} but the run expects "
                        f"{_shape_str(expect_shape)}; convert/resize the site's images to "
                        f"{expect_shape[2]}x{expect_shape[1]} with {expect_shape[0]} channel(s)"
                    )
            elif arr.shape != shape:
                raise DataError(
                    f"image {path} has shape {_shape_str(arr.shape)} but {reference_file} has "
                    f"{_shape_str(shape)}; all images of a site must have the same size and "
                    f"number of channels: convert/resize {path}"
                )
            if buf is None:
                buf = np.empty((len(paths), *shape), dtype=np.uint8)
            buf[i] = arr
        if buf is None:
            buf = np.empty((0, *(shape or (1, 1, 1))), dtype=np.uint8)
        images[split] = torch.from_numpy(buf)
        local_labels[split] = torch.tensor(labels, dtype=torch.int64)

    if len(unreadable) == 1:
        raise unreadable[0]
    if unreadable:
        raise DataError(
            f"{len(unreadable)} images of {root} cannot be read or decoded; the first ones: "
            + "; ".join(str(e).split(";")[0] for e in unreadable[:3])
            + "; check that the files are readable and valid PNG/JPEG, else replace or delete them"
        )
    assert shape is not None  # at least one training image was decoded
    # The test split may have been allocated before the shape was known only if empty.
    if images["test"].shape[1:] != torch.Size(shape):
        images["test"] = torch.empty((0, *shape), dtype=torch.uint8)
    return SiteData(
        class_names=class_names,
        inputs=images,
        labels=local_labels,
        input={"channels": shape[0], "height": shape[1], "width": shape[2]},
        notes=[line for line in [skipped_message(skipped)] if line],
        root=root,
        image_shape=shape,
        train_counts=counts["train"],
        test_counts=counts["test"],
        has_test=has_test,
        skipped=skipped,
    )

