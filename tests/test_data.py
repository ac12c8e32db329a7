"""Tests for fedrelay.peer.data (loading a site's ImageFolder-style folder)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from fedrelay.peer.training import train_val_split
from fedrelay.tasks.image_folder.data import DataError, SiteData, load_site

# ----------------------------------------------------------------------------- helpers


def save(path: Path, value: int = 0, size=(8, 8), mode: str = "L", fmt: str | None = None) -> Path:
    """An image of constant colour ``value`` (so tests can tell which file went where)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    w, h = size[1], size[0]
    if mode == "L":
        im = Image.new("L", (w, h), value)
    elif mode == "RGB":
        im = Image.new("RGB", (w, h), (value, 255 - value, 7))
    elif mode == "RGBA":
        im = Image.new("RGBA", (w, h), (value, 1, 2, 128))
    elif mode == "LA":
        im = Image.new("LA", (w, h), (value, 10))
    elif mode == "P-grey":
        im = Image.new("P", (w, h), 3)
        im.putpalette([i for i in range(256) for _ in range(3)])  # grey palette: entry i = (i, i, i)
    elif mode == "P-colour":
        im = Image.new("P", (w, h), 1)
        im.putpalette([0, 0, 0, 200, 10, 20] + [0] * 762)
    else:
        raise ValueError(mode)
    im.save(path, format=fmt)
    return path


@pytest.fixture
def good_site(tmp_path: Path) -> Path:
    """train: A (3), B (2), C (empty folder); test: A (1), D (1); no class E anywhere."""
    root = tmp_path / "site"
    save(root / "train" / "A" / "a2.png", 12)
    save(root / "train" / "A" / "a0.png", 10)
    save(root / "train" / "A" / "a1.PNG", 11)  # upper-case extension
    save(root / "train" / "B" / "b1.jpg", 200, fmt="JPEG")
    save(root / "train" / "B" / "b0.jpeg", 100, fmt="JPEG")
    (root / "train" / "C").mkdir(parents=True)
    (root / "train" / "A" / ".DS_Store").write_bytes(b"\x00\x01junk")
    (root / "train" / "A" / "README").write_text("not an image")
    (root / "train" / "notes.txt").write_text("ignored")
    (root / "train" / "A" / "sub").mkdir()  # sub-folders are not scanned
    save(root / "train" / "A" / "sub" / "deep.png", 99)
    save(root / "test" / "A" / "t.png", 50)
    save(root / "test" / "D" / "d.png", 60)
    return root


# ----------------------------------------------------------------------------- good folders


def test_load_good_site(good_site):
    site = load_site(good_site)
    assert isinstance(site, SiteData)
    assert site.root == good_site
    assert site.class_names == ["A", "B", "D"]  # C is empty, E absent
    assert site.image_shape == (1, 8, 8)
    assert site.train_counts == {"A": 3, "B": 2, "D": 0}
    assert site.test_counts == {"A": 1, "B": 0, "D": 1}

    class_index = ["E", "D", "C", "B", "A"]
    x, y = site.tensors("train", class_index)
    assert x.dtype == torch.uint8 and x.shape == (5, 1, 8, 8)
    assert y.dtype == torch.int64 and y.tolist() == [4, 4, 4, 3, 3]
    # deterministic order: sorted class, then sorted file name (a0, a1.PNG, a2, b0, b1)
    assert x[:3, 0, 0, 0].tolist() == [10, 11, 12]
    assert abs(int(x[3, 0, 0, 0]) - 100) <= 3 and abs(int(x[4, 0, 0, 0]) - 200) <= 3  # JPEG is lossy

    tx, ty = site.tensors("test", class_index)
    assert tx.shape == (2, 1, 8, 8) and ty.tolist() == [4, 1]
    assert tx[:, 0, 0, 0].tolist() == [50, 60]


def test_tensors_is_deterministic_across_loads(good_site):
    a = load_site(good_site).tensors("train", ["A", "B", "D"])
    b = load_site(good_site).tensors("train", ["A", "B", "D"])
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_tensors_class_index_missing_site_class(good_site):
    site = load_site(good_site)
    with pytest.raises(DataError) as ei:
        site.tensors("train", ["A", "B"])  # D (test-only) missing
    assert "'D'" in str(ei.value) and str(good_site) in str(ei.value)
    with pytest.raises(DataError, match="twice"):
        site.tensors("train", ["A", "B", "D", "A"])
    with pytest.raises(ValueError):
        site.tensors("val", ["A", "B", "D"])


def test_missing_test_folder_is_allowed(tmp_path):
    root = tmp_path / "s"
    save(root / "train" / "x" / "0.png", 1, size=(5, 7))
    save(root / "train" / "y" / "0.png", 2, size=(5, 7))
    site = load_site(root)
    assert site.test_counts == {}
    assert site.train_counts == {"x": 1, "y": 1}
    assert site.image_shape == (1, 5, 7)
    tx, ty = site.tensors("test", ["x", "y"])
    assert tx.shape == (0, 1, 5, 7) and tx.dtype == torch.uint8
    assert ty.shape == (0,) and ty.dtype == torch.int64


def test_rgb_site_has_three_channels(tmp_path):
    root = tmp_path / "rgb"
    save(root / "train" / "a" / "0.png", 30, size=(6, 4), mode="RGB")
    save(root / "train" / "b" / "0.png", 40, size=(6, 4), mode="RGBA")  # alpha dropped -> 3 ch
    save(root / "test" / "a" / "0.jpg", 90, size=(6, 4), mode="RGB", fmt="JPEG")
    site = load_site(root, expect_shape=(3, 6, 4))
    assert site.image_shape == (3, 6, 4)
    x, y = site.tensors("train", ["a", "b"])
    assert x.shape == (2, 3, 6, 4)
    assert x[0, :, 0, 0].tolist() == [30, 225, 7]
    assert x[1, :, 0, 0].tolist() == [40, 1, 2]  # RGBA: colour kept as stored, alpha dropped


def test_grey_alpha_and_palette_conversions(tmp_path):
    root = tmp_path / "modes"
    save(root / "train" / "a" / "la.png", 77, mode="LA")
    save(root / "train" / "a" / "pg.png", mode="P-grey")
    site = load_site(root)
    assert site.image_shape == (1, 8, 8)
    x, _ = site.tensors("train", ["a"])
    assert x[:, 0, 0, 0].tolist() == [77, 3]

    root2 = tmp_path / "modes2"
    save(root2 / "train" / "a" / "pc.png", mode="P-colour")
    site2 = load_site(root2)
    assert site2.image_shape == (3, 8, 8)
    assert site2.tensors("train", ["a"])[0][0, :, 0, 0].tolist() == [200, 10, 20]


# ----------------------------------------------------------------------------- errors


def test_root_missing(tmp_path):
    with pytest.raises(DataError, match="does not exist") as ei:
        load_site(tmp_path / "nope")
    assert str(tmp_path / "nope") in str(ei.value)


def test_root_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(DataError, match="not a folder") as ei:
        load_site(f)
    assert str(f) in str(ei.value)


def test_train_missing(tmp_path):
    save(tmp_path / "s" / "test" / "a" / "0.png")
    with pytest.raises(DataError, match="missing") as ei:
        load_site(tmp_path / "s")
    assert str(tmp_path / "s" / "train") in str(ei.value)


def test_no_training_images(tmp_path):
    root = tmp_path / "s"
    (root / "train" / "a").mkdir(parents=True)
    (root / "train" / "a" / "README").write_text("no images here")
    save(root / "test" / "a" / "0.png")
    with pytest.raises(DataError, match="no training images") as ei:
        load_site(root)
    assert str(root / "train") in str(ei.value)


@pytest.mark.parametrize("content", [b"", b"this is not a png", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR"])
def test_corrupt_image_names_file(tmp_path, content):
    root = tmp_path / "s"
    save(root / "train" / "a" / "0.png")
    bad = root / "train" / "a" / "1.png"
    bad.write_bytes(content)
    with pytest.raises(DataError) as ei:
        load_site(root)
    assert str(bad) in str(ei.value)


def test_truncated_png_names_file(tmp_path):
    root = tmp_path / "s"
    good = save(root / "train" / "a" / "0.png", size=(64, 64))
    data = good.read_bytes()
    bad = root / "train" / "a" / "1.png"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError) as ei:
        load_site(root)
    assert str(bad) in str(ei.value)


def test_size_mismatch_names_file_and_both_shapes(tmp_path):
    root = tmp_path / "s"
    save(root / "train" / "a" / "0.png", size=(8, 8))
    odd = save(root / "test" / "a" / "odd.png", size=(9, 8))
    with pytest.raises(DataError) as ei:
        load_site(root)
    msg = str(ei.value)
    assert str(odd) in msg
    assert "(C=1, H=9, W=8)" in msg and "(C=1, H=8, W=8)" in msg


def test_channel_mismatch_names_file(tmp_path):
    root = tmp_path / "s"
    save(root / "train" / "a" / "0.png")
    rgb = save(root / "train" / "b" / "0.png", mode="RGB")
    with pytest.raises(DataError) as ei:
        load_site(root)
    assert str(rgb) in str(ei.value) and "C=3" in str(ei.value) and "C=1" in str(ei.value)


def test_expect_shape_mismatch(tmp_path):
    root = tmp_path / "s"
    first = save(root / "train" / "a" / "0.png", size=(8, 8))
    with pytest.raises(DataError) as ei:
        load_site(root, expect_shape=(1, 28, 28))
    assert str(first) in str(ei.value) and "(C=1, H=28, W=28)" in str(ei.value)
    assert load_site(root, expect_shape=(1, 8, 8)).image_shape == (1, 8, 8)
    with pytest.raises(ValueError):
        load_site(root, expect_shape=(8, 8))


def test_image_directly_in_train_is_an_error(tmp_path):
    root = tmp_path / "s"
    save(root / "train" / "a" / "0.png")
    loose = save(root / "train" / "loose.png")
    with pytest.raises(DataError) as ei:
        load_site(root)
    assert str(loose) in str(ei.value)


def test_data_error_is_value_error():
    assert issubclass(DataError, ValueError)


# ----------------------------------------------------------------------------- train/val split


def test_train_val_split_sizes_disjoint_deterministic():
    n = 95
    images = torch.arange(n, dtype=torch.uint8).view(n, 1, 1, 1).expand(n, 1, 2, 2).contiguous()
    labels = torch.arange(n, dtype=torch.int64)
    (tx, ty), (vx, vy) = train_val_split(images, labels, seed=0)
    assert len(vy) == 9 and len(ty) == 86  # int(0.1 * 95) = 9
    assert tx.shape == (86, 1, 2, 2) and vx.shape == (9, 1, 2, 2)
    assert set(ty.tolist()).isdisjoint(vy.tolist())
    assert sorted(ty.tolist() + vy.tolist()) == list(range(n))
    assert torch.equal(tx[:, 0, 0, 0].long(), ty) and torch.equal(vx[:, 0, 0, 0].long(), vy)  # pairs kept

    (tx2, ty2), (vx2, vy2) = train_val_split(images, labels, seed=0)
    assert torch.equal(ty, ty2) and torch.equal(vy, vy2)
    (_, ty3), (_, vy3) = train_val_split(images, labels, seed=1)
    assert not torch.equal(vy, vy3)

    # the reference protocol: val = first int(f*N) of a seeded torch permutation
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    assert vy.tolist() == perm[:9].tolist() and ty.tolist() == perm[9:].tolist()


def test_train_val_split_fraction_and_errors():
    x = torch.zeros(50, 1, 2, 2)
    y = torch.zeros(50, dtype=torch.int64)
    (_, ty), (_, vy) = train_val_split(x, y, seed=3, val_fraction=0.2)
    assert (len(ty), len(vy)) == (40, 10)
    (_, ty), (_, vy) = train_val_split(x[:5], y[:5], seed=3)
    assert (len(ty), len(vy)) == (5, 0)  # too few samples for a validation part
    with pytest.raises(ValueError):
        train_val_split(x, y, seed=0, val_fraction=1.0)
    with pytest.raises(ValueError):
        train_val_split(x, y[:10], seed=0)
