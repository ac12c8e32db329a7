"""A site's own settings for the image-folder task: the ``[image-folder]`` table of the site
folder's ``fedrelay.toml`` (optional; without it, every image is used as stored).

::

    # site/fedrelay.toml
    [image-folder]
    size = [28, 28]        # resize every image to height x width pixels at load
    resample = "bilinear"  # the resize filter: nearest, box (area), bilinear, bicubic, lanczos
    bits = 16              # store every image at 16 bits (or 8): for a site mixing 8- and 16-bit files

* ``size = [H, W]``: every image is resized to ``H x W`` when the site loads it (an image
  already of that size is kept as is), so that sites whose images differ in native size can
  join one run; the aspect ratio is not kept (no cropping, no padding). The resize is done by
  Pillow in floating point, per channel, with the ``resample`` filter (default ``bilinear``,
  which Pillow widens when it shrinks an image, so that it averages the pixels it covers),
  and rounded to the nearest integer. Each of H and W: 1 to 8192.
* ``bits = 8`` or ``16``: the pixel depth the site's images are stored at. Without it, a site
  whose images are all 8-bit stays 8-bit and one whose images are all 16-bit stays 16-bit, and
  a site that mixes the two is refused (naming a file of each). ``16`` scales 8-bit images up
  (``v * 257``: the same value in [0, 1], no range lost); ``8`` rounds 16-bit images down
  (``round(v / 257)``: their low byte is lost).

Other tables of the file (another task's, e.g. ``[tabular-csv]``) are ignored; an unknown key
of ``[image-folder]``, a bad value or a file that is not TOML is a :class:`fedrelay.DataError`
naming the file. Reading it needs neither torch nor Pillow.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from fedrelay.task import DataError

__all__ = ["FILE", "TABLE", "RESAMPLE", "MAX_SIDE", "SiteOptions", "read_options"]

FILE = "fedrelay.toml"   # in the site folder, beside train/ and test/
TABLE = "image-folder"   # this task's table in it
RESAMPLE = ("nearest", "box", "bilinear", "bicubic", "lanczos")  # Pillow's filters, by name
MAX_SIDE = 8192          # pixels: a larger size = [H, W] is taken for a typo
_KEYS = ("size", "resample", "bits")


@dataclass(frozen=True)
class SiteOptions:
    """The ``[image-folder]`` settings of a site (see the module docstring).

    Attributes:
        size: ``(height, width)`` in pixels every image is resized to, or None (no resize).
        resample: the resize filter's name (one of :data:`RESAMPLE`).
        bits: 8 or 16, the depth every image is stored at, or None (the images' own depth,
            which must then be the same for all of the site's images).
        source: the file read, or None when the site has no ``fedrelay.toml`` / no
            ``[image-folder]`` table.
    """

    size: tuple[int, int] | None = None
    resample: str = "bilinear"
    bits: int | None = None
    source: Path | None = None

    def where(self, key: str) -> str:
        """How a message names the setting ``key`` (``"bits = 16 in /site/fedrelay.toml"``)."""
        return f"[{TABLE}] {key} in {self.source}"


def read_options(root: Path) -> SiteOptions:
    """The ``[image-folder]`` settings of the site folder ``root`` (defaults when it has no
    ``fedrelay.toml`` or the file has no ``[image-folder]`` table).

    Raises:
        DataError: the file cannot be read or is not TOML (with the parser's line and column),
            ``[image-folder]`` is not a table, has a key other than ``size``, ``resample`` and
            ``bits``, or a bad value; the message names the file and the fix.
    """
    path = Path(root) / FILE
    if not path.exists():
        return SiteOptions()
    try:
        with path.open("rb") as fp:
            doc = tomllib.load(fp)
    except tomllib.TOMLDecodeError as exc:
        raise DataError(f"{path} is not valid TOML: {exc}; fix the file (see docs/how-to/data-folders.md)") from None
    except UnicodeDecodeError:
        raise DataError(f"{path} is not UTF-8 text; save it as UTF-8 TOML") from None
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc}; check that it is a readable file") from None
    table = doc.get(TABLE)
    if table is None:
        return SiteOptions()
    if not isinstance(table, dict):
        raise DataError(f"{path}: {TABLE!r} must be a table ([{TABLE}] on a line of its own, then its keys), "
                        f"got {table!r}")
    unknown = sorted(set(table) - set(_KEYS))
    if unknown:
        raise DataError(f"{path}: unknown key(s) {', '.join(unknown)} in [{TABLE}]; the keys are "
                        f"{', '.join(_KEYS)}")
    size = table.get("size")
    if size is not None:
        if (not isinstance(size, list) or len(size) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_SIDE for v in size)):
            raise DataError(f"{path}: [{TABLE}] size must be [height, width], two whole numbers of pixels from 1 "
                            f"to {MAX_SIDE} (e.g. size = [28, 28]), got {size!r}")
        size = (int(size[0]), int(size[1]))
    resample = table.get("resample", "bilinear")
    if resample not in RESAMPLE:
        raise DataError(f"{path}: [{TABLE}] resample must be one of {', '.join(RESAMPLE)}, got {resample!r}")
    if "resample" in table and size is None:
        raise DataError(f"{path}: [{TABLE}] resample is set but size is not: add size = [height, width], or "
                        "remove resample")
    bits = table.get("bits")
    if bits is not None and (not isinstance(bits, int) or isinstance(bits, bool) or bits not in (8, 16)):
        raise DataError(f"{path}: [{TABLE}] bits must be 8 or 16, got {bits!r}")
    return SiteOptions(size=size, resample=resample, bits=bits, source=path)
