"""A site folder's layout and image headers, without decoding pixels (and without torch).

``scan_site`` gives what a site registers for the image-folder task (class names, counts per
split, the image shape) from folder listings and image *headers* (Pillow opens a file without
decoding its pixels; a palette image's used entries are read to tell grey from colour). The
pixels are decoded by ``data.load_site`` (it also reports corrupt or truncated image bodies,
which a header read cannot see). The layout rules are in ``data``'s module docstring.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from fedrelay.task import DataError  # one error type for every task's data

__all__ = ["DataError", "IMAGE_EXTENSIONS", "SiteSummary", "scan_site", "skipped_message"]

IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg"})


def _is_image_file(path: Path) -> bool:
    return path.suffix.lower() in IMAGE_EXTENSIONS and not path.name.startswith(".")


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
            f"{train_dir}/<class name>/ as .png/.jpg/.jpeg files"
        )
    return scans, skipped, has_test


@dataclass
class SiteSummary:
    """What a site registers (see ``fedrelay.tasks.image_folder.data.SiteData``, whose fields of the same names these are):
    ``class_names`` (sorted, classes with >= 1 image), ``image_shape`` ``(C, H, W)``,
    ``train_counts`` / ``test_counts`` (class -> images; ``test_counts`` empty without test/),
    ``skipped`` (files of class folders that are not .png/.jpg/.jpeg)."""

    root: Path
    class_names: list[str]
    image_shape: tuple[int, int, int]
    train_counts: dict[str, int]
    test_counts: dict[str, int]
    has_test: bool = True
    skipped: list[Path] = field(default_factory=list)

    def skipped_message(self, show: int = 3) -> str:
        """One line on :attr:`skipped` (empty if none)."""
        return skipped_message(self.skipped, show)


def skipped_message(skipped: list[Path], show: int = 3) -> str:
    """One line on the files of class folders that are not images (empty if none): how many, the
    first ``show``, and what to do."""
    if not skipped:
        return ""
    names = ", ".join(str(p) for p in skipped[:show]) + (", ..." if len(skipped) > show else "")
    return (f"skipped {len(skipped)} file(s) that are not .png/.jpg/.jpeg images: {names}; convert "
            "images of other formats to PNG to use them")


def _header_shape(path: Path) -> tuple[int, int, int]:
    """``(C, H, W)`` the image at ``path`` decodes to (``data._decode``'s channel rules), from
    its header (and, for palette images, its palette indices). Raises ``DataError``."""
    try:
        with Image.open(path) as im:
            mode, (w, h) = im.mode, im.size
            if mode in ("I", "F"):
                raise DataError(f"image {path} has 32-bit pixels (mode {mode}); convert it to an 8-bit "
                                f"greyscale or RGB PNG/JPEG")
            if mode in ("1", "L", "LA", "La") or mode.startswith("I;16"):
                return (1, h, w)
            if mode in ("P", "PA"):
                return (1 if _palette_is_grey(im) else 3, h, w)
            return (3, h, w)
    except DataError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise DataError(f"cannot read or decode image {path}: {e}; check that the file is readable and a "
                        f"valid PNG/JPEG, else replace or delete it (it may be corrupt or truncated)") from e


def scan_site(root: str | Path) -> SiteSummary:
    """Class names, counts and the image shape of a site folder, from listings and image headers
    (no pixels kept, no torch). Raises ``DataError`` like ``data.load_site`` for the folder,
    an unreadable header, or an image whose ``(C, H, W)`` differs from the first one's."""
    root = Path(root)
    scans, skipped, has_test = _scan_folders(root)
    class_names = sorted({c for scan in scans.values() for c, files in scan.items() if files})
    shape, first = None, None
    for split in ("train", "test"):
        for c in class_names:
            for path in scans[split].get(c, []):
                got = _header_shape(path)
                if shape is None:
                    shape, first = got, path
                elif got != shape:
                    raise DataError(f"image {path} has shape (C={got[0]}, H={got[1]}, W={got[2]}) but {first} has "
                                    f"(C={shape[0]}, H={shape[1]}, W={shape[2]}); all images of a site must have the "
                                    f"same size and number of channels: convert/resize {path}")
    counts = {s: {c: len(scans[s].get(c, [])) for c in class_names} for s in ("train", "test")}
    return SiteSummary(root=root, class_names=class_names, image_shape=shape, train_counts=counts["train"],
                       test_counts=counts["test"] if has_test else {}, has_test=has_test, skipped=skipped)
