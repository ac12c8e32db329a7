"""A site's local image data: an ImageFolder-style folder, decoded once into memory.

Layout (the same one ``coordinator split-dataset`` writes)::

    root/
      train/<class name>/<file>.png|.jpg|.jpeg|.dcm     (required; at least one image overall)
      test/<class name>/<file>.png|.jpg|.jpeg|.dcm      (optional)
      fedrelay.toml                                      (optional: [image-folder] resize, depth)

* Extensions are matched case-insensitively (``.PNG``, ``.JPG``, ``.DCM`` ...); ``.dcm`` and
  ``.dicom`` files are DICOM (read with pydicom, see :mod:`.dicom`). Any other file in a
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
  the same ``(C, H, W)``. Nothing is resized unless the site's ``fedrelay.toml`` says
  ``size = [H, W]`` under ``[image-folder]`` (:mod:`.options`); without it a mismatch is
  reported, naming the file.

Depth: a site's images are stored in memory at 8 bits (uint8) or, when they are 16-bit,
at 16 bits (uint16), and the task feeds the model ``v / 255`` or ``v / 65535`` (both in
[0, 1]). 16-bit images are 16-bit greyscale PNGs and DICOM files with more than 8 bits stored;
everything else is 8-bit. A site mixing the two is refused, naming a file of each, unless its
``fedrelay.toml`` sets ``bits`` (:mod:`.options`). A 16-bit site's input description has
``"bits": 16``; an 8-bit site's has no ``bits`` key (as before 16-bit support).

Colour modes of PNG/JPEG (decoded with Pillow):

* greyscale (``L``), 1-bit (``1``) and greyscale + alpha (``LA``) -> 1 channel, 8 bits; the
  alpha channel is dropped (not composited);
* 16-bit greyscale (``I;16*``) -> 1 channel, 16 bits, values as stored (0 .. 65535);
* palette images (``P``/``PA``) -> 1 channel if every palette entry used is grey (r == g == b),
  else 3 channels (RGB); transparency is dropped;
* RGB -> 3 channels; RGBA/RGBX -> 3 channels, alpha dropped (not composited); CMYK, YCbCr
  and the other colour modes -> converted to RGB; Pillow reads 16-bit colour PNGs at 8 bits
  per channel, and 16-bit greyscale + alpha PNGs as 8-bit RGBA (so 3 channels: save them
  without alpha to keep them 16-bit greyscale);
* 32-bit integer or float images (``I``, ``F``) are refused: convert them to 8- or 16-bit PNG.

EXIF orientation tags are not applied (the pixels are used as stored).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

# Listing folders and reading image headers needs no torch: scan.py (the light daemon's part).
from fedrelay.task import SiteData as GenericSiteData
from fedrelay.tasks.image_folder import dicom
from fedrelay.tasks.image_folder.options import SiteOptions, read_options
from fedrelay.tasks.image_folder.scan import (IMAGE_EXTENSIONS, DataError, _is_image_file, _palette_is_grey,  # noqa: F401
                                              _scan_folders, _scan_split, depth_mismatch, input_description, is_dicom,
                                              pillow_bits, shape_mismatch, skipped_message)

__all__ = ["DataError", "SiteData", "IMAGE_EXTENSIONS", "load_site"]

SPLITS = ("train", "test")


@dataclass
class SiteData(GenericSiteData):
    """The decoded images of one site, held in memory as uint8 (or, for a 16-bit site, uint16)
    tensors: a :class:`fedrelay.SiteData` (``inputs[split]``: uint8/uint16 ``(N, C, H, W)``,
    ``labels[split]``: int64 ``(N,)`` positions in ``class_names``; ``input``:
    ``{"channels", "height", "width"}``, plus ``"bits": 16`` for a 16-bit site) with the
    folder's particulars.

    Attributes:
        root: the site folder that was loaded.
        class_names: sorted names of the class folders holding >= 1 image in train/ or test/.
        image_shape: ``(C, H, W)`` shared by every image of the site (C is 1 or 3), after the
            site's resize if it has one.
        bits: 8 (uint8 inputs) or 16 (uint16 inputs).
        options: the site's ``[image-folder]`` settings (its ``fedrelay.toml``).
        train_counts / test_counts: class name -> number of images (0 allowed); both have
            one key per entry of ``class_names``, except that ``test_counts`` is empty when
            the site has no ``test/`` folder.
        has_test: whether the site has a ``test/`` folder.
        skipped: files in class folders that are not .png/.jpg/.jpeg/.dcm.
    """

    root: Path = Path(".")
    image_shape: tuple[int, int, int] = (0, 0, 0)
    bits: int = 8
    options: SiteOptions = field(default_factory=SiteOptions)
    train_counts: dict[str, int] = field(default_factory=dict)
    test_counts: dict[str, int] = field(default_factory=dict)
    has_test: bool = True
    skipped: list[Path] = field(default_factory=list)

    def skipped_message(self, show: int = 3) -> str:
        """One line on :attr:`skipped` (empty if none): how many files, and the first ``show``."""
        return skipped_message(self.skipped, show)

    def tensors(self, split: str, class_index: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """The images and labels of one split: uint8 ``(N, C, H, W)`` (values 0..255, not
        normalised; uint16, 0..65535, for a 16-bit site; shared with this object, so do not
        modify it in place) and int64 ``(N,)`` positions in the federation-wide ``class_index`` (which may contain classes this site
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
    """Decode one image file to ``(C, H, W)`` with C in {1, 3}: uint8, or uint16 for a 16-bit
    image (see the module docstring); DataError on failure."""
    if is_dicom(path):
        return dicom.decode(path)
    try:
        with Image.open(path) as im:
            im.load()
            mode = im.mode
            if pillow_bits(path, im) == 16:  # 16-bit greyscale, kept at full range
                arr16 = np.asarray(im)
                return np.clip(arr16, 0, 65535).astype(np.uint16)[None]
            if mode in ("1", "LA", "La"):
                im = im.convert("L")
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


_RESAMPLE = {"nearest": Image.Resampling.NEAREST, "box": Image.Resampling.BOX, "bilinear": Image.Resampling.BILINEAR,
             "bicubic": Image.Resampling.BICUBIC, "lanczos": Image.Resampling.LANCZOS}


def _store(arr: np.ndarray, bits: int, options: SiteOptions) -> np.ndarray:
    """A decoded image ``(C, H, W)`` (uint8 or uint16) as the site stores it: resized to
    ``options.size`` (if set and different) and at ``bits`` (8: uint8, 16: uint16). The identity
    (no copy) when neither applies. 8 -> 16 bits is ``v * 257``, 16 -> 8 bits ``round(v / 257)``;
    a resize runs Pillow's ``options.resample`` filter per channel on float32 values (already
    at the target depth) and rounds to the nearest integer."""
    have = 8 if arr.dtype == np.uint8 else 16
    size = options.size
    resize = size is not None and tuple(arr.shape[1:]) != tuple(size)
    if have == bits and not resize:
        return arr
    if not resize:
        if bits == 16:
            return arr.astype(np.uint16) * np.uint16(257)
        return ((arr.astype(np.uint32) + 128) // 257).astype(np.uint8)
    x = arr.astype(np.float32)
    if have != bits:
        x = x * 257.0 if bits == 16 else x / 257.0
    h, w = size
    filt = _RESAMPLE[options.resample]
    out = np.stack([np.asarray(Image.fromarray(ch, mode="F").resize((w, h), filt)) for ch in x])
    top = 255 if bits == 8 else 65535
    return np.clip(np.rint(out), 0, top).astype(np.uint8 if bits == 8 else np.uint16)


def _shape_str(shape: Sequence[int]) -> str:
    return "(C={}, H={}, W={})".format(*shape)


def load_site(root: str | Path, *, expect_shape: tuple[int, int, int] | None = None) -> SiteData:
    """Load and decode every image of a site folder into memory, once.

    Args:
        root: the site folder, holding ``train/`` and optionally ``test/`` and
            ``fedrelay.toml`` (see module doc).
        expect_shape: if given, the ``(C, H, W)`` every image must have after the site's
            resize (e.g. what the run's model expects).

    Returns:
        A :class:`SiteData`; get tensors with ``site.tensors("train", class_index)``.

    Raises:
        DataError: root missing or not a folder; ``train/`` missing; no training image at
            all; ``test`` present but not a folder; a bad ``fedrelay.toml``; an unreadable or
            corrupt image; an image directly in ``train/``/``test/``; an image whose (C, H, W)
            differs from the site's first image or from ``expect_shape``; a site mixing 8- and
            16-bit images without ``bits`` in its ``fedrelay.toml``. The message names the
            offending path.
    """
    root = Path(root)
    if expect_shape is not None:
        expect_shape = tuple(int(v) for v in expect_shape)  # type: ignore[assignment]
        if len(expect_shape) != 3 or min(expect_shape) < 1:
            raise ValueError(f"expect_shape must be (C, H, W) with positive entries, not {expect_shape}")
    scans, skipped, has_test = _scan_folders(root)
    options = read_options(root)
    class_names = sorted({c for scan in scans.values() for c, files in scan.items() if files})
    class_pos = {c: i for i, c in enumerate(class_names)}

    shape: tuple[int, int, int] | None = None
    bits: int | None = options.bits
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
            native = 8 if arr.dtype == np.uint8 else 16
            if shape is None:
                bits = bits or native
            elif options.bits is None and native != bits:
                raise depth_mismatch(root, path, native, reference_file, bits)
            arr = _store(arr, bits, options)
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
                raise shape_mismatch(root, path, arr.shape, reference_file, shape, options.size is not None)
            if buf is None:
                buf = np.empty((len(paths), *shape), dtype=arr.dtype)
            buf[i] = arr
        if buf is None:
            buf = np.empty((0, *(shape or (1, 1, 1))), dtype=np.uint8 if bits in (None, 8) else np.uint16)
        images[split] = torch.from_numpy(buf)
        local_labels[split] = torch.tensor(labels, dtype=torch.int64)

    if len(unreadable) == 1:
        raise unreadable[0]
    if unreadable:
        raise DataError(
            f"{len(unreadable)} images of {root} cannot be read or decoded; the first ones: "
            + "; ".join(str(e).split(";")[0] for e in unreadable[:3])
            + "; check that the files are readable and valid PNG/JPEG/DICOM, else replace or delete them"
        )
    assert shape is not None and bits is not None  # at least one training image was decoded
    dtype = torch.uint8 if bits == 8 else torch.uint16
    # The test split may have been allocated before the shape was known only if empty.
    if images["test"].shape[1:] != torch.Size(shape) or images["test"].dtype != dtype:
        images["test"] = torch.empty((0, *shape), dtype=dtype)
    return SiteData(
        class_names=class_names,
        inputs=images,
        labels=local_labels,
        input=input_description(shape, bits),
        notes=[line for line in [skipped_message(skipped)] if line],
        root=root,
        image_shape=shape,
        bits=bits,
        options=options,
        train_counts=counts["train"],
        test_counts=counts["test"],
        has_test=has_test,
        skipped=skipped,
    )
