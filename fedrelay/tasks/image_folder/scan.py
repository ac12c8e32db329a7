"""A site folder's layout and image headers, without decoding pixels (and without torch).

``scan_site`` gives what a site registers for the image-folder task (class names, counts per
split, the image shape and bit depth, hence the input description) from folder listings, the
site's ``fedrelay.toml`` (:mod:`.options`) and image *headers* (Pillow opens a file without
decoding its pixels; a palette image's used entries are read to tell grey from colour; a DICOM
file's header is read without its pixel data, :mod:`.dicom`). The pixels are decoded by
``data.load_site`` (it also reports corrupt or truncated image bodies, which a header read
cannot see). The layout rules are in ``data``'s module docstring.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from fedrelay.task import DataError  # one error type for every task's data

from .dicom import DICOM_EXTENSIONS, read_header
from .options import FILE as OPTIONS_FILE, TABLE as OPTIONS_TABLE, SiteOptions, read_options

__all__ = ["DataError", "IMAGE_EXTENSIONS", "PILLOW_EXTENSIONS", "DICOM_EXTENSIONS", "SiteSummary", "scan_site",
           "skipped_message", "input_description"]

PILLOW_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg"})  # decoded by Pillow
IMAGE_EXTENSIONS = PILLOW_EXTENSIONS | DICOM_EXTENSIONS   # every file a class folder's scan takes
_FORMATS = ".png/.jpg/.jpeg/.dcm"


def _is_image_file(path: Path) -> bool:
    return path.suffix.lower() in IMAGE_EXTENSIONS and not path.name.startswith(".")


def is_dicom(path: Path) -> bool:
    """Whether ``path`` is read as a DICOM file (by its extension, case-insensitively)."""
    return path.suffix.lower() in DICOM_EXTENSIONS


def input_description(shape: tuple[int, int, int], bits: int) -> dict:
    """The image-folder input description of images of ``shape`` ``(C, H, W)`` stored at
    ``bits`` (8 or 16): ``{"channels": C, "height": H, "width": W}``, plus ``"bits": 16`` for
    16-bit images (an 8-bit site's description has no ``bits`` key, as before 16-bit support;
    sites of different depths thus never share a run)."""
    c, h, w = shape
    found = {"channels": int(c), "height": int(h), "width": int(w)}
    if bits != 8:
        found["bits"] = int(bits)
    return found


def _scan_split(split_dir: Path, skipped: list[Path] | None = None) -> dict[str, list[Path]]:
    """class name -> sorted image paths, for the class folders directly under split_dir; other
    visible files of the class folders are appended to ``skipped``."""
    try:
        entries = sorted(split_dir.iterdir(), key=lambda p: p.name)
    except OSError as e:
        raise DataError(f"cannot list {split_dir}: {e}; check that it is a readable folder") from e
    classes: dict[str, list[Path]] = {}
    for entry in entries:
        if entry.name.startswith("."):
            continue
        if entry.is_dir():
            try:
                listed = sorted(entry.iterdir(), key=lambda p: p.name)
                files = [p for p in listed if _is_image_file(p) and p.is_file()]
                if skipped is not None:
                    skipped.extend(p for p in listed if not p.name.startswith(".") and not _is_image_file(p)
                                   and p.is_file())
            except OSError as e:
                raise DataError(f"cannot list {entry}: {e}; check that it is a readable folder") from e
            classes[entry.name] = files
        elif _is_image_file(entry):
            raise DataError(
                f"image {entry} lies directly in {split_dir}; images must be inside one folder "
                f"per class ({split_dir}/<class name>/{entry.name}) so that their label is known"
            )
    return classes


def _palette_is_grey(im: Image.Image) -> bool:
    """True if every palette entry the image actually uses is grey (r == g == b)."""
    pal = im.getpalette()  # flat RGB triples
    if not pal:
        return False
    pal_arr = np.asarray(pal, dtype=np.int64)
    pal_arr = pal_arr[: (len(pal_arr) // 3) * 3].reshape(-1, 3)
    idx = np.asarray(im)
    used = np.unique(idx[..., 0] if idx.ndim == 3 else idx)  # PA: (H, W, 2), index first
    used = used[used < len(pal_arr)]
    sub = pal_arr[used]
    return bool(np.all(sub[:, 0] == sub[:, 1]) and np.all(sub[:, 1] == sub[:, 2]))


def _scan_folders(root: Path) -> tuple[dict[str, dict[str, list[Path]]], list[Path], bool]:
    """The image files of ``root``'s splits: ``({"train"|"test": {class: sorted paths}}, skipped
    files, has test/)``. Raises ``DataError`` for a missing or malformed folder or no training image."""
    if not root.exists():
        raise DataError(
            f"site data folder {root} does not exist; pass the folder that holds train/<class>/ "
            f"(and optionally test/<class>/) image folders"
        )
    if not root.is_dir():
        raise DataError(f"site data path {root} is not a folder; pass the folder that holds train/ and test/")
    train_dir = root / "train"
    if not train_dir.is_dir():
        what = "is not a folder" if train_dir.exists() else "is missing"
        raise DataError(
            f"{train_dir} {what}; a site folder must contain train/<class name>/ with the "
            f"training images (and optionally test/<class name>/)"
        )
    test_dir = root / "test"
    has_test = test_dir.exists()
    if has_test and not test_dir.is_dir():
        raise DataError(f"{test_dir} is not a folder; remove it or make it test/<class name>/ image folders")

    skipped: list[Path] = []
    scans = {"train": _scan_split(train_dir, skipped), "test": _scan_split(test_dir, skipped) if has_test else {}}
    if not any(scans["train"].values()):
        raise DataError(
            f"no training images found under {train_dir}; put the site's training images in "
            f"{train_dir}/<class name>/ as .png/.jpg/.jpeg (8- or 16-bit) or DICOM .dcm files"
        )
    return scans, skipped, has_test


@dataclass
class SiteSummary:
    """What a site registers (see ``fedrelay.tasks.image_folder.data.SiteData``, whose fields of the same names these are):
    ``class_names`` (sorted, classes with >= 1 image), ``image_shape`` ``(C, H, W)`` (after the
    site's resize, if any), ``bits`` (8 or 16, the depth the images are stored at),
    ``train_counts`` / ``test_counts`` (class -> images; ``test_counts`` empty without test/),
    ``skipped`` (files of class folders that are not .png/.jpg/.jpeg/.dcm), ``options`` (the
    site's ``[image-folder]`` settings)."""

    root: Path
    class_names: list[str]
    image_shape: tuple[int, int, int]
    train_counts: dict[str, int]
    test_counts: dict[str, int]
    has_test: bool = True
    skipped: list[Path] = field(default_factory=list)
    bits: int = 8
    options: SiteOptions = field(default_factory=SiteOptions)

    @property
    def input(self) -> dict:
        """The input description the site registers (:func:`input_description`)."""
        return input_description(self.image_shape, self.bits)

    def skipped_message(self, show: int = 3) -> str:
        """One line on :attr:`skipped` (empty if none)."""
        return skipped_message(self.skipped, show)


def skipped_message(skipped: list[Path], show: int = 3) -> str:
    """One line on the files of class folders that are not images (empty if none): how many, the
    first ``show``, and what to do."""
    if not skipped:
        return ""
    names = ", ".join(str(p) for p in skipped[:show]) + (", ..." if len(skipped) > show else "")
    return (f"skipped {len(skipped)} file(s) that are not {_FORMATS} images: {names}; convert "
            "images of other formats to PNG (DICOM files: name them .dcm) to use them")


def pillow_bits(path: Path, im: Image.Image) -> int:
    """8 or 16: the depth the image-folder task stores the opened image ``im`` at (16 for
    16-bit greyscale, Pillow's ``I;16*`` modes or, from older Pillow, a PNG opened as ``I``).
    Raises ``DataError`` for 32-bit integer or float images."""
    mode = im.mode
    if mode.startswith("I;16") or (mode == "I" and im.format == "PNG"):
        return 16
    if mode in ("I", "F") or mode.startswith("I;32") or mode.startswith("F;"):
        raise DataError(f"image {path} has 32-bit pixels (mode {mode}); convert it to an 8- or 16-bit "
                        f"greyscale or an RGB PNG")
    return 8


def _header(path: Path) -> tuple[tuple[int, int, int], int]:
    """``((C, H, W), bits)`` the image at ``path`` decodes to (``data._decode``'s rules), from
    its header (and, for palette images, its palette indices; for DICOM, :func:`.dicom.read_header`).
    Raises ``DataError``."""
    if is_dicom(path):
        head = read_header(path)
        return (head.channels, head.height, head.width), head.bits
    try:
        with Image.open(path) as im:
            mode, (w, h) = im.mode, im.size
            bits = pillow_bits(path, im)
            if mode in ("1", "L", "LA", "La") or bits == 16:
                return (1, h, w), bits
            if mode in ("P", "PA"):
                return (1 if _palette_is_grey(im) else 3, h, w), bits
            return (3, h, w), bits
    except DataError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise DataError(f"cannot read or decode image {path}: {e}; check that the file is readable and a "
                        f"valid PNG/JPEG, else replace or delete it (it may be corrupt or truncated)") from e


def shape_mismatch(root: Path, path: Path, got, first: Path, shape, resized: bool) -> DataError:
    """The error for an image whose ``(C, H, W)`` ``got`` differs from ``shape``, the one of the
    site's first image ``first``."""
    hint = f"convert/resize {path}"
    if not resized and got[1:] != shape[1:]:
        hint += (f", or have every image resized at load: size = [{shape[1]}, {shape[2]}] under "
                 f"[{OPTIONS_TABLE}] in {root / OPTIONS_FILE}")
    return DataError(f"image {path} has shape (C={got[0]}, H={got[1]}, W={got[2]}) but {first} has "
                     f"(C={shape[0]}, H={shape[1]}, W={shape[2]}); all images of a site must have the "
                     f"same size and number of channels: {hint}")


def depth_mismatch(root: Path, path: Path, bits: int, first: Path, first_bits: int) -> DataError:
    """The error for a site mixing 8- and 16-bit images (without ``bits`` in its settings)."""
    return DataError(f"image {path} has {bits}-bit pixels but {first} has {first_bits}-bit ones; all images of a "
                     f"site must have one bit depth: convert them, or set bits = 16 (8-bit images scaled up, "
                     f"nothing lost) or bits = 8 (16-bit images rounded down) under [{OPTIONS_TABLE}] in "
                     f"{root / OPTIONS_FILE}")


def scan_site(root: str | Path) -> SiteSummary:
    """Class names, counts, the image shape and depth of a site folder, from listings, its
    ``fedrelay.toml`` and image headers (no pixels kept, no torch). Raises ``DataError`` like
    ``data.load_site`` for the folder, its ``fedrelay.toml``, an unreadable header, an image
    whose ``(C, H, W)`` (after the site's resize) differs from the first one's, or one whose bit
    depth does (unless the site sets ``bits``)."""
    root = Path(root)
    scans, skipped, has_test = _scan_folders(root)
    options = read_options(root)
    class_names = sorted({c for scan in scans.values() for c, files in scan.items() if files})
    shape, bits, first = None, None, None
    for split in ("train", "test"):
        for c in class_names:
            for path in scans[split].get(c, []):
                got, got_bits = _header(path)
                if options.size is not None:
                    got = (got[0], *options.size)
                if options.bits is not None:
                    got_bits = options.bits
                if shape is None:
                    shape, bits, first = got, got_bits, path
                elif got != shape:
                    raise shape_mismatch(root, path, got, first, shape, options.size is not None)
                elif got_bits != bits:
                    raise depth_mismatch(root, path, got_bits, first, bits)
    counts = {s: {c: len(scans[s].get(c, [])) for c in class_names} for s in ("train", "test")}
    return SiteSummary(root=root, class_names=class_names, image_shape=shape, train_counts=counts["train"],
                       test_counts=counts["test"] if has_test else {}, has_test=has_test, skipped=skipped,
                       bits=bits, options=options)
