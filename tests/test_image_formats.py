"""The image-folder task's formats beyond 8-bit PNG/JPEG: 16-bit PNG at full range, DICOM
files (synthetic, written with pydicom), a site's resize and bit depth in its fedrelay.toml, and
that an 8-bit site (the demo's) is read exactly as before."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedrelay.task import DataError, canonical_json
from fedrelay.tasks.image_folder import ImageFolderTask, spec as image_spec
from fedrelay.tasks.image_folder.data import load_site
from fedrelay.tasks.image_folder.scan import scan_site

TASK = ImageFolderTask()

# ----------------------------------------------------------------------------- writers


def png(path: Path, arr: np.ndarray) -> Path:
    """``arr`` (H, W) uint8 or uint16, or (H, W, 3) uint8, as a PNG (uint16: a 16-bit greyscale PNG)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.ascontiguousarray(arr)).save(path)
    return path


def dcm(path: Path, arr: np.ndarray, *, photometric: str = "MONOCHROME2", bits_stored: int | None = None,
        transfer_syntax=None, frames: int = 1, pixel_data: bytes | None = None) -> Path:
    """A DICOM Part 10 file (Explicit VR Little Endian unless ``transfer_syntax``) holding
    ``arr``: (H, W) grey or (H, W, 3) colour; uint8/uint16 unsigned, int16 signed."""
    from pydicom.dataset import FileDataset, FileMetaDataset
    from pydicom.uid import ExplicitVRLittleEndian, SecondaryCaptureImageStorage, generate_uid

    path.parent.mkdir(parents=True, exist_ok=True)
    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = SecondaryCaptureImageStorage
    meta.MediaStorageSOPInstanceUID = generate_uid()
    meta.TransferSyntaxUID = transfer_syntax or ExplicitVRLittleEndian
    ds = FileDataset(str(path), {}, file_meta=meta, preamble=b"\0" * 128)
    ds.SOPClassUID, ds.SOPInstanceUID = meta.MediaStorageSOPClassUID, meta.MediaStorageSOPInstanceUID
    ds.Modality = "OT"
    ds.Rows, ds.Columns = arr.shape[:2]
    ds.SamplesPerPixel = 1 if arr.ndim == 2 else 3
    if arr.ndim == 3:
        ds.PlanarConfiguration = 0
    if frames != 1:
        ds.NumberOfFrames = frames
    ds.PhotometricInterpretation = photometric
    ds.BitsAllocated = arr.dtype.itemsize * 8
    ds.BitsStored = bits_stored or ds.BitsAllocated
    ds.HighBit = ds.BitsStored - 1
    ds.PixelRepresentation = 1 if arr.dtype.kind == "i" else 0
    ds.PixelData = arr.tobytes() if pixel_data is None else pixel_data
    if transfer_syntax is not None and transfer_syntax.is_compressed:
        ds["PixelData"].VR = "OB"
        ds["PixelData"].is_undefined_length = True
    ds.save_as(path, enforce_file_format=True)
    return path


def toml(root: Path, text: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    path = root / "fedrelay.toml"
    path.write_text(textwrap.dedent(text))
    return path


# ----------------------------------------------------------------------------- 8-bit: as before


def test_an_8_bit_site_is_read_exactly_as_before(tmp_path):
    """The demo's kind of site (8-bit greyscale PNGs): input description without a bits key,
    uint8 tensors equal to the stored pixels, batches ``/ 255``, and a fedrelay.toml resize to
    the images' own size changes nothing."""
    root = tmp_path / "site"
    rng = np.random.default_rng(0)
    stored = {f"{c}/{i}.png": rng.integers(0, 256, (28, 28), dtype=np.uint8) for c in "ab" for i in range(3)}
    for name, arr in stored.items():
        png(root / "train" / name, arr)
    site = load_site(root)
    assert canonical_json(site.input) == '{"channels":1,"height":28,"width":28}'
    assert canonical_json(TASK.describe(root).input) == '{"channels":1,"height":28,"width":28}'
    assert image_spec("cnn", 1, (28, 28), 10).input_json == '{"channels":1,"height":28,"width":28}'
    x, _ = site.tensors("train", ["a", "b"])
    assert x.dtype == torch.uint8 and site.bits == 8
    assert torch.equal(x, torch.from_numpy(np.stack([stored[n] for n in sorted(stored)])[:, None]))
    assert torch.equal(TASK.batch(x, train=True), x.to(torch.float32) / 255.0)

    toml(root, "[image-folder]\nsize = [28, 28]\n")  # already that size: kept as is
    again = load_site(root)
    assert torch.equal(again.tensors("train", ["a", "b"])[0], x) and again.input == site.input


# ----------------------------------------------------------------------------- 16-bit PNG


def test_16_bit_png_keeps_its_range(tmp_path):
    """Values that differ only in their low byte stay apart (``>> 8`` made 1 and 255 both 0);
    the description says bits 16 at describe and at load; batches are ``v / 65535``."""
    root = tmp_path / "site"
    values = np.array([[0, 1, 255, 256], [4095, 32768, 65534, 65535]], dtype=np.uint16)
    png(root / "train" / "a" / "0.png", values)
    png(root / "train" / "b" / "0.png", values[::-1].copy())
    png(root / "test" / "a" / "0.png", values)
    site = load_site(root)
    x, _ = site.tensors("train", ["a", "b"])
    assert x.dtype == torch.uint16 and x.shape == (2, 1, 2, 4)
    assert x[0, 0].to(torch.int64).tolist() == values.tolist()
    assert site.input == {"channels": 1, "height": 2, "width": 4, "bits": 16}
    assert TASK.describe(root).input == site.input == scan_site(root).input
    assert site.tensors("test", ["a", "b"])[0].dtype == torch.uint16
    batch = TASK.batch(x, train=False)
    assert batch.dtype == torch.float32
    assert torch.equal(batch[0, 0], torch.from_numpy(values.astype(np.float32) / np.float32(65535)))
    assert float(batch[0, 0, 0, 1]) > 0 and float(batch.max()) == 1.0
    assert json.loads(image_spec("cnn", 1, (2, 4), 2, bits=16).input_json)["bits"] == 16
    with pytest.raises(ValueError, match="uint8 or uint16"):
        TASK.batch(x.to(torch.int32), train=False)


def test_mixed_bit_depths_are_refused_naming_both_files_unless_the_site_sets_bits(tmp_path):
    root = tmp_path / "site"
    eight = png(root / "train" / "a" / "0.png", np.full((4, 4), 200, np.uint8))
    sixteen = png(root / "train" / "b" / "0.png", np.full((4, 4), 1000, np.uint16))
    for read in (load_site, scan_site, TASK.describe):
        with pytest.raises(DataError) as ei:
            read(root)
        msg = str(ei.value)
        assert str(eight) in msg and str(sixteen) in msg and "bits = 16" in msg and "fedrelay.toml" in msg

    toml(root, "[image-folder]\nbits = 16\n")
    site = load_site(root)
    x = site.tensors("train", ["a", "b"])[0]
    assert x.dtype == torch.uint16 and site.input["bits"] == 16 and TASK.describe(root).input == site.input
    assert int(x[0, 0, 0, 0]) == 200 * 257 and int(x[1, 0, 0, 0]) == 1000  # same value in [0, 1]; 16-bit kept
    assert float(TASK.batch(x, train=False)[0, 0, 0, 0]) == pytest.approx(200 / 255, abs=1e-7)

    toml(root, "[image-folder]\nbits = 8\n")
    site = load_site(root)
    x = site.tensors("train", ["a", "b"])[0]
    assert x.dtype == torch.uint8 and "bits" not in site.input and TASK.describe(root).input == site.input
    assert int(x[0, 0, 0, 0]) == 200 and int(x[1, 0, 0, 0]) == round(1000 / 257)


# ----------------------------------------------------------------------------- DICOM


def test_dicom_values_monochrome1_signed_and_colour(tmp_path):
    """12-bit stored values span 0..65535; MONOCHROME1 is inverted; signed 16-bit data are
    offset to 0..65535; 8-bit RGB is 3 uint8 channels with the 8-bit description."""
    ramp12 = (np.arange(16, dtype=np.uint16).reshape(4, 4) * 273)  # 0 .. 4095
    grey = tmp_path / "grey"
    dcm(grey / "train" / "a" / "m2.dcm", ramp12, bits_stored=12)
    dcm(grey / "train" / "a" / "m1.DCM", ramp12, bits_stored=12, photometric="MONOCHROME1")
    dcm(grey / "train" / "b" / "s.dicom", np.array([[-32768, -1], [0, 32767]], np.int16).repeat(2, 0).repeat(2, 1))
    site = load_site(grey)
    assert site.input == {"channels": 1, "height": 4, "width": 4, "bits": 16} == TASK.describe(grey).input
    x = site.tensors("train", ["a", "b"])[0].to(torch.int64)
    expect = np.rint(ramp12 * (65535 / 4095)).astype(np.int64)
    assert x[1, 0].tolist() == expect.tolist() and int(x[1, 0, 3, 3]) == 65535  # m2.dcm
    assert x[0, 0].tolist() == (65535 - expect).tolist()  # m1.DCM (sorted first)
    assert x[2, 0, ::2, ::2].tolist() == [[0, 32767], [32768, 65535]]

    colour = tmp_path / "colour"
    rgb = np.zeros((4, 4, 3), np.uint8)
    rgb[..., 0], rgb[..., 1], rgb[..., 2] = 200, 10, 20
    dcm(colour / "train" / "a" / "0.dcm", rgb, photometric="RGB")
    dcm(colour / "train" / "b" / "0.dcm", rgb[::-1].copy(), photometric="RGB")
    site = load_site(colour)
    assert site.input == {"channels": 3, "height": 4, "width": 4} == TASK.describe(colour).input
    x = site.tensors("train", ["a", "b"])[0]
    assert x.dtype == torch.uint8 and x[0, :, 0, 0].tolist() == [200, 10, 20]


@pytest.mark.integration
def test_dicom_describe_reads_headers_only_and_without_torch(tmp_path):
    """describe (scan_site) reads no pixel data: a file whose pixel data are truncated passes the
    scan, in an interpreter without torch, and load names it."""
    root = tmp_path / "site"
    dcm(root / "train" / "a" / "0.dcm", np.full((8, 8), 300, np.uint16), bits_stored=12)
    bad = dcm(root / "train" / "b" / "0.dcm", np.zeros((8, 8), np.uint16), bits_stored=12,
              pixel_data=b"\0" * 10)
    script = textwrap.dedent(f"""
        import json, sys
        from fedrelay.tasks.image_folder.scan import scan_site
        s = scan_site({str(root)!r})
        print(json.dumps([s.class_names, s.input, "torch" in sys.modules]))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [["a", "b"], {"channels": 1, "height": 8, "width": 8, "bits": 16}, False]
    with pytest.raises(DataError) as ei:
        load_site(root)
    assert str(bad) in str(ei.value) and "pixel data" in str(ei.value)


def test_bad_dicom_files_are_named(tmp_path):
    from pydicom.pixels import get_decoder
    from pydicom.uid import JPEGLSLossless

    def refused(make, *words):
        root = tmp_path / f"s{len(list(tmp_path.iterdir()))}"
        dcm(root / "train" / "a" / "ok.dcm", np.zeros((4, 4), np.uint8))
        bad = make(root / "train" / "b" / "bad.dcm")
        for read in (scan_site, load_site):
            with pytest.raises(DataError) as ei:
                read(root)
            assert str(bad) in str(ei.value)
            for word in words:
                assert word in str(ei.value)

    def junk(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"not a dicom file at all")
        return path

    refused(junk, "not a DICOM file")
    refused(lambda p: dcm(p, np.zeros((8, 4), np.uint8), frames=2), "2 frames")
    refused(lambda p: dcm(p, np.zeros((4, 4), np.uint8), photometric="PALETTE COLOR"), "PALETTE COLOR")
    refused(lambda p: dcm(p, np.zeros((4, 4), np.uint16), bits_stored=12), "bit")  # 16-bit among 8-bit files
    if not get_decoder(JPEGLSLossless).is_available:  # a plugin this site lacks: say what to install
        from pydicom.encaps import encapsulate

        refused(lambda p: dcm(p, np.zeros((4, 4), np.uint8), transfer_syntax=JPEGLSLossless,
                              pixel_data=encapsulate([b"\xff\xd8\xff\xf7not really jpeg-ls"])),
                "JPEG-LS", "install", "pylibjpeg")


def _dicom_site(root: Path, per_class: int, seed: int) -> None:
    """Two classes of 12-bit 8x8 DICOMs (half of them MONOCHROME1): dim noise plus a bright
    3x3 square whose place is the class."""
    rng = np.random.default_rng(seed)
    for split, n in (("train", per_class), ("test", per_class // 2)):
        for label, (r, c) in enumerate([(0, 0), (5, 5)]):
            for i in range(n):
                arr = rng.integers(0, 1200, (8, 8)).astype(np.uint16)
                arr[r:r + 3, c:c + 3] = 4095
                photometric = "MONOCHROME1" if i % 2 else "MONOCHROME2"
                if photometric == "MONOCHROME1":
                    arr = 4095 - arr
                dcm(root / split / f"class{label}" / f"{i:03d}.dcm", arr, bits_stored=12, photometric=photometric)


def test_a_dicom_class_folder_trains(tmp_path):
    """A site folder of DICOM files only: the worker describes it (16-bit description), loads
    it, trains on it through the train job (which checks the data against the run's spec) and
    the model it sends beats chance on the site's test split."""
    from fedrelay.peer.worker_main import Worker

    root = tmp_path / "site"
    _dicom_site(root, per_class=24, seed=0)
    worker = Worker()
    described = worker.describe({"data": str(root), "device": "cpu", "tasks": {"image-folder": ""}})
    found = described["tasks"]["image-folder"]
    assert "error" not in found, found
    assert found["summary"]["classes"] == {"class0": [24, 12], "class1": [24, 12]}
    assert found["summary"]["input"] == {"channels": 1, "height": 8, "width": 8, "bits": 16}
    assert worker.prepare({"data": str(root), "device": "cpu", "task": "image-folder"})["train"] == 48

    spec = image_spec("cnn", 1, (8, 8), 2, bits=16).to_dict()
    classes = ["class0", "class1"]
    folder = tmp_path / "visit"
    params = {"strategy": "fedseq", "models_per_site": 1, "local_epochs": 6, "warmup_epochs": 2, "alpha": 1.0,
              "beta": 1.0, "lr": 1e-2, "batch_size": 8, "weight_decay": 0.0, "selection": "last-epoch"}
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trained = worker.handle({"op": "train", "spec": spec, "params": params, "seed": 3, "class_index": classes,
                                 "site": "site", "aggregator": "", "options": {}, "position": 0, "round": 1,
                                 "folder": str(folder), "received": None,
                                 "outgoing": str(folder / "outgoing.safetensors"), "initial": None}, emit=None)
        assert trained["event"] == "trained"
        got = worker.handle({"op": "evaluate", "model": str(folder / "outgoing.safetensors"), "spec": spec,
                             "class_index": classes}, emit=None)
    finally:
        torch.set_num_threads(before)
    assert got["total"] == 24
    assert got["correct"] / got["total"] >= 0.75, got  # chance is 1/2

    eight_bit = image_spec("cnn", 1, (8, 8), 2).to_dict()  # a run made for 8-bit sites: refused
    with pytest.raises(ValueError, match="bits"):
        worker.handle({"op": "train", "spec": eight_bit, "params": params, "seed": 3, "class_index": classes,
                       "site": "site", "aggregator": "", "options": {}, "position": 0, "round": 1,
                       "folder": str(tmp_path / "v2"), "received": None,
                       "outgoing": str(tmp_path / "v2" / "out.safetensors"), "initial": None}, emit=None)


# ----------------------------------------------------------------------------- fedrelay.toml


def test_resize_in_fedrelay_toml_joins_sites_of_different_sizes(tmp_path):
    """Two sites with native sizes 8x8/12x10 and 20x20 both resize to 6x5: equal descriptions,
    resized tensors; a constant image stays constant; 16-bit images resize at 16 bits."""
    a, b = tmp_path / "a", tmp_path / "b"
    png(a / "train" / "x" / "0.png", np.full((8, 8), 100, np.uint8))
    png(a / "train" / "y" / "0.png", np.tile(np.array([0, 255], np.uint8), (12, 5)))
    png(b / "train" / "x" / "0.png", np.full((20, 20), 100, np.uint8))
    with pytest.raises(DataError, match=r"size = \[8, 8\]"):  # the mismatch says how to resize
        load_site(a)
    for root in (a, b):
        toml(root, """
            [tabular-csv]
            label = "ignored: another task's table"
            [image-folder]
            size = [6, 5]
            resample = "box"
        """)
    sa, sb = load_site(a), load_site(b)
    assert sa.input == sb.input == {"channels": 1, "height": 6, "width": 5}
    assert TASK.describe(a).input == TASK.describe(b).input == sa.input
    xa = sa.tensors("train", ["x", "y"])[0]
    assert xa.shape == (2, 1, 6, 5) and xa.dtype == torch.uint8
    assert (xa[0] == 100).all() and 0 < float(xa[1].float().mean()) < 255

    c = tmp_path / "c"
    png(c / "train" / "x" / "0.png", np.full((9, 9), 40000, np.uint16))
    toml(c, "[image-folder]\nsize = [3, 3]\n")
    sc = load_site(c)
    xc = sc.tensors("train", ["x"])[0]
    assert xc.dtype == torch.uint16 and xc.shape == (1, 1, 3, 3) and (xc.to(torch.int64) == 40000).all()
    assert sc.input == {"channels": 1, "height": 3, "width": 3, "bits": 16} == TASK.describe(c).input


@pytest.mark.parametrize("text, words", [
    ("[image-folder\nsize = [28, 28]\n", ["not valid TOML"]),
    ("[image-folder]\nsizes = [28, 28]\n", ["unknown key", "sizes"]),
    ("[image-folder]\nsize = [28, 28, 3]\n", ["[height, width]"]),
    ("[image-folder]\nsize = [0, 28]\n", ["[height, width]"]),
    ("[image-folder]\nsize = 28\n", ["[height, width]"]),
    ("[image-folder]\nsize = [true, 28]\n", ["[height, width]"]),
    ("[image-folder]\nsize = [100000, 28]\n", ["8192"]),
    ("[image-folder]\nsize = [28, 28]\nresample = \"cubic\"\n", ["resample", "bilinear"]),
    ("[image-folder]\nresample = \"box\"\n", ["size is not"]),
    ("[image-folder]\nbits = 12\n", ["8 or 16"]),
    ("image-folder = 3\n", ["must be a table"]),
])
def test_bad_fedrelay_toml_is_a_clear_data_error(tmp_path, text, words):
    root = tmp_path / "site"
    png(root / "train" / "a" / "0.png", np.zeros((4, 4), np.uint8))
    path = toml(root, text)
    for read in (load_site, TASK.describe):
        with pytest.raises(DataError) as ei:
            read(root)
        assert str(path) in str(ei.value)
        for word in words:
            assert word in str(ei.value)
