"""DICOM files (``.dcm``, ``.dicom``) in a site's class folders, read with pydicom (no torch).

One file is one image: a single-frame DICOM image with Pixel Data, in any transfer syntax the
site's pydicom can decode (uncompressed, deflated, RLE; JPEG baseline and JPEG 2000 through
Pillow; JPEG lossless, JPEG-LS and HTJ2K need a pydicom plugin, named in the error).

**What the model sees** is the file's *stored* pixel values, as a radiologist's viewer shows
them before windowing, mapped linearly to the file's full range:

* the range is the one Bits Stored (0028,0101) allows: ``0 .. 2^b - 1`` for unsigned data,
  ``-2^(b-1) .. 2^(b-1) - 1`` for signed data (Pixel Representation 1, e.g. CT); its lowest
  value becomes 0 and its highest the top of the stored depth;
* the stored depth is 8 bits when Bits Stored <= 8, else 16 bits (Bits Stored up to 16); so
  a 12-bit X-ray's 0 .. 4095 becomes 0 .. 65535 (``v * 65535 / 4095``, rounded), and the task
  feeds the model ``v / 65535`` in [0, 1];
* MONOCHROME1 (high values dark, e.g. many CR/DX exports) is inverted, so that in every file
  high values are bright as in MONOCHROME2;
* colour (RGB; YBR_FULL, YBR_FULL_422, YBR_ICT, YBR_RCT, which pydicom converts to RGB) gives
  3 channels; PALETTE COLOR and other photometric interpretations are refused (convert the
  files to RGB).

Rescale Slope / Intercept (Hounsfield units), windowing (Window Center / Width, VOI LUTs) and
the Modality LUT are **not** applied: they are linear or display transforms, usually the same
for all of a modality's files; an operator who needs a window exports windowed images (8- or
16-bit PNG) instead. Multi-frame files (Number of Frames > 1) are refused: export one frame per
file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedrelay.task import DataError

__all__ = ["DICOM_EXTENSIONS", "DicomHeader", "read_header", "decode"]

DICOM_EXTENSIONS = frozenset({".dcm", ".dicom"})
_GREY = ("MONOCHROME1", "MONOCHROME2")
_COLOUR = ("RGB", "YBR_FULL", "YBR_FULL_422", "YBR_ICT", "YBR_RCT")  # pydicom's pixel_array gives RGB
_MAX_BITS = 16


@dataclass(frozen=True)
class DicomHeader:
    """What :func:`read_header` found: the image's ``channels`` (1 or 3), ``height`` (Rows),
    ``width`` (Columns), ``bits`` (the stored depth: 8 or 16), and the tags :func:`decode`
    uses: ``bits_stored``, ``signed`` (Pixel Representation 1), ``photometric``."""

    channels: int
    height: int
    width: int
    bits: int
    bits_stored: int
    signed: bool
    photometric: str


def _read(path: Path, *, pixels: bool):
    import pydicom
    from pydicom.errors import InvalidDicomError

    try:
        return pydicom.dcmread(path, stop_before_pixels=not pixels)
    except InvalidDicomError as exc:
        raise DataError(f"{path} is not a DICOM file ({exc}); check that it is a DICOM Part 10 file (with the "
                        f"'DICM' marker), else replace or delete it") from None
    except OSError as exc:
        raise DataError(f"cannot read DICOM file {path}: {exc}; check that the file is readable") from None
    except Exception as exc:  # noqa: BLE001 - pydicom raises many kinds on a malformed file
        raise DataError(f"cannot parse DICOM file {path}: {type(exc).__name__}: {exc}; the file may be corrupt "
                        f"or truncated: replace or delete it") from None


def _header(path: Path, ds) -> DicomHeader:
    def tag(name: str, default=None):
        try:
            value = ds.get(name, default)
        except Exception:  # noqa: BLE001 - a malformed element value
            raise DataError(f"DICOM file {path} has a malformed {name} element; the file may be corrupt: replace "
                            f"or delete it") from None
        return default if value is None or value == "" else value

    def number(name: str, default: int | None = None) -> int | None:
        value = tag(name, default)
        if value is None:
            return None
        try:
            return int(value)
        except (TypeError, ValueError):
            raise DataError(f"DICOM file {path} has a malformed {name} {value!r}; the file may be corrupt: replace "
                            f"or delete it") from None

    rows, cols = number("Rows"), number("Columns")
    if not rows or not cols:
        raise DataError(f"DICOM file {path} is not an image (it has no Rows/Columns, or zero); keep only DICOM "
                        f"images in the class folders (not reports, DICOMDIRs or presentation states)")
    frames = number("NumberOfFrames", 1)
    if frames != 1:
        raise DataError(f"DICOM file {path} holds {frames} frames; image-folder reads one image per file: export "
                        f"each frame as a file of its own")
    photometric = str(tag("PhotometricInterpretation", "")).strip().upper()
    samples = number("SamplesPerPixel", 1)
    if photometric in _GREY and samples == 1:
        channels = 1
    elif photometric in _COLOUR and samples == 3:
        channels = 3
    else:
        raise DataError(f"DICOM file {path} has Photometric Interpretation {photometric or 'missing'!r} with "
                        f"{samples} sample(s) per pixel; image-folder reads MONOCHROME1/MONOCHROME2 (1 sample) and "
                        f"RGB/YBR (3 samples): convert the file (e.g. to RGB)")
    allocated = number("BitsAllocated", 0)
    stored = number("BitsStored", allocated)
    if not 1 <= stored <= _MAX_BITS or (allocated and stored > allocated):
        raise DataError(f"DICOM file {path} has Bits Stored {stored} (Bits Allocated {allocated}); image-folder "
                        f"reads integer pixel data of 1 to {_MAX_BITS} bits")
    ts = getattr(getattr(ds, "file_meta", None), "TransferSyntaxUID", None)
    if ts is None:
        raise DataError(f"DICOM file {path} has no Transfer Syntax UID in its file meta information; re-export it "
                        f"as a DICOM Part 10 file")
    _check_decodable(path, ts)
    return DicomHeader(channels=channels, height=int(rows), width=int(cols), bits=8 if stored <= 8 else 16,
                       bits_stored=stored, signed=number("PixelRepresentation", 0) == 1, photometric=photometric)


def _check_decodable(path: Path, ts) -> None:
    """DataError unless this site's pydicom can decode pixel data of transfer syntax ``ts``."""
    from pydicom.pixels import get_decoder

    try:
        decoder = get_decoder(ts)
    except (NotImplementedError, ValueError):
        raise DataError(f"DICOM file {path} uses transfer syntax {getattr(ts, 'name', ts)} ({ts}), whose pixel data "
                        f"pydicom cannot decode; convert the file to an uncompressed transfer syntax (e.g. "
                        f"'gdcmconv --raw IN OUT', or dcmtk's 'dcmdjpeg IN OUT')") from None
    if not decoder.is_available:
        options = "; or ".join(decoder.missing_dependencies) or "a pydicom pixel data plugin"
        raise DataError(f"DICOM file {path} is compressed with {ts.name} ({ts}), which this site's pydicom cannot "
                        f"decode: install one of these in the site's Python environment: {options} (e.g. 'pip "
                        f"install pylibjpeg pylibjpeg-libjpeg pylibjpeg-openjpeg'), then restart the daemon; or "
                        f"convert the files to an uncompressed transfer syntax ('gdcmconv --raw IN OUT', or dcmtk's "
                        f"'dcmdjpeg IN OUT')")


def read_header(path: Path) -> DicomHeader:
    """The image's shape and depth from its DICOM header alone (pydicom's
    ``stop_before_pixels``: the pixel data are not read). Raises ``DataError`` naming ``path``:
    not a DICOM file, not a single-frame image, an unsupported photometric interpretation or
    depth, or a transfer syntax this site cannot decode (naming what to install)."""
    return _header(path, _read(path, pixels=False))


def decode(path: Path) -> np.ndarray:
    """The image of the DICOM file ``path`` as ``(C, H, W)``: uint8 when Bits Stored <= 8, else
    uint16, mapped as the module docstring says. Raises ``DataError`` naming ``path`` (what
    :func:`read_header` raises, no Pixel Data, or pixel data that cannot be decoded)."""
    ds = _read(path, pixels=True)
    head = _header(path, ds)
    if "PixelData" not in ds:
        raise DataError(f"DICOM file {path} has no Pixel Data (7FE0,0010); image-folder reads integer pixel data "
                        f"(not Float Pixel Data): replace or delete the file")
    try:
        arr = np.asarray(ds.pixel_array)
    except Exception as exc:  # noqa: BLE001 - pydicom and its plugins raise many kinds on bad data
        raise DataError(f"cannot decode the pixel data of DICOM file {path}: {type(exc).__name__}: {exc}; the file "
                        f"may be corrupt or truncated: replace or delete it") from None
    want = (head.height, head.width) + ((3,) if head.channels == 3 else ())
    if arr.shape != want:
        raise DataError(f"DICOM file {path} decodes to an array of shape {arr.shape}, not {want} as its header says; "
                        f"the file may be corrupt: replace or delete it")
    top = 255 if head.bits == 8 else 65535
    lo = -(1 << (head.bits_stored - 1)) if head.signed else 0
    span = (1 << head.bits_stored) - 1
    values = np.clip(arr.astype(np.int64), lo, lo + span)  # bits above Bits Stored are not pixel data
    if lo == 0 and span == top:
        out = values
    else:
        out = np.rint((values - lo) * (top / span))
    if head.photometric == "MONOCHROME1":
        out = top - out
    out = out.astype(np.uint8 if head.bits == 8 else np.uint16)
    if head.channels == 1:
        return out[None]
    return np.ascontiguousarray(out.transpose(2, 0, 1))
