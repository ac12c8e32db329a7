"""Tests for fedrelay.datasets (trial-site construction from Fashion-MNIST IDX files).

Everything runs on tiny synthetic IDX files; the real data set is never needed.
"""

from __future__ import annotations

import gzip
import json
import struct
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fedrelay.datasets import site_folders as sp
from fedrelay.datasets.fashion_mnist import FASHION_MNIST_CLASSES, DatasetNotFound, load_fashion_mnist, read_idx
from fedrelay.datasets.partition import dirichlet_label_split, split_test
from fedrelay.datasets.split import split_dataset

# ----------------------------------------------------------------------------- helpers


def idx_bytes(arr: np.ndarray) -> bytes:
    codes = {np.dtype(np.uint8): 0x08, np.dtype(np.int8): 0x09, np.dtype(">i2"): 0x0B,
             np.dtype(">i4"): 0x0C, np.dtype(">f4"): 0x0D, np.dtype(">f8"): 0x0E}
    be = arr.astype(arr.dtype.newbyteorder(">")) if arr.dtype.itemsize > 1 else arr
    code = codes[np.dtype(be.dtype)]
    header = bytes([0, 0, code, arr.ndim]) + b"".join(struct.pack(">I", d) for d in arr.shape)
    return header + np.ascontiguousarray(be).tobytes()


def write_idx(path: Path, arr: np.ndarray, gz: bool) -> Path:
    data = idx_bytes(arr)
    if gz:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)
    return path


def make_fake_fashion_mnist(folder: Path, n_train: int = 300, n_test: int = 100, gz: bool = True, seed: int = 0):
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    train_x = rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8)
    train_y = (np.arange(n_train) % 10).astype(np.uint8)
    test_x = rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8)
    test_y = (np.arange(n_test) % 10).astype(np.uint8)
    write_idx(folder / "train-images-idx3-ubyte", train_x, gz)
    write_idx(folder / "train-labels-idx1-ubyte", train_y, gz)
    write_idx(folder / "t10k-images-idx3-ubyte", test_x, gz)
    write_idx(folder / "t10k-labels-idx1-ubyte", test_y, gz)
    return train_x, train_y, test_x, test_y


def synthetic_labels(n: int = 2000, k: int = 10, seed: int = 123) -> np.ndarray:
    labels = np.repeat(np.arange(k), n // k)
    np.random.default_rng(seed).shuffle(labels)
    return labels


def assert_partition(parts, n):
    allidx = np.concatenate(parts)
    assert len(allidx) == n, "every index exactly once"
    assert len(np.unique(allidx)) == n, "parts must be disjoint"
    assert set(allidx.tolist()) == set(range(n))


def niid_bench_reference(labels, n_sites, alpha, seed, min_size=10):
    """A literal transcription of NIID-Bench's partition_data (implementation notes §1.5),
    with np.random.* replaced by one default_rng(seed) stream."""
    rng = np.random.default_rng(seed)
    n = len(labels)
    cur_min = 0
    while cur_min < min_size:
        idx_batch = [[] for _ in range(n_sites)]
        for k in np.unique(labels):
            idx_k = np.where(labels == k)[0]
            rng.shuffle(idx_k)
            proportions = rng.dirichlet(np.repeat(alpha, n_sites))
            proportions = np.array([p * (len(idx_j) < n / n_sites) for p, idx_j in zip(proportions, idx_batch)])
            proportions = proportions / proportions.sum()
            proportions = (np.cumsum(proportions) * len(idx_k)).astype(int)[:-1]
            idx_batch = [idx_j + idx.tolist() for idx_j, idx in zip(idx_batch, np.split(idx_k, proportions))]
        cur_min = min(len(idx_j) for idx_j in idx_batch)
    out = []
    for j in range(n_sites):
        a = np.array(idx_batch[j], dtype=np.int64)
        rng.shuffle(a)
        out.append(a)
    return out


# ----------------------------------------------------------------------------- dirichlet split


@pytest.mark.parametrize("n_sites,alpha", [(5, 0.5), (10, 0.5), (10, 0.1), (3, 100.0)])
def test_dirichlet_split_is_a_partition_with_min_size(n_sites, alpha):
    labels = synthetic_labels()
    parts = dirichlet_label_split(labels, n_sites, alpha, seed=0, min_size=10)
    assert len(parts) == n_sites
    assert_partition(parts, len(labels))
    assert all(len(p) >= 10 for p in parts)
    assert all(p.dtype == np.int64 for p in parts)


def test_dirichlet_split_matches_niid_bench_transcription():
    labels = synthetic_labels()
    for seed in (0, 1, 7):
        ours = dirichlet_label_split(labels, 10, 0.5, seed=seed)
        ref = niid_bench_reference(labels, 10, 0.5, seed=seed)
        for a, b in zip(ours, ref):
            np.testing.assert_array_equal(a, b)


def test_dirichlet_split_deterministic_by_seed():
    labels = synthetic_labels()
    a = dirichlet_label_split(labels, 10, 0.5, seed=3)
    b = dirichlet_label_split(labels, 10, 0.5, seed=3)
    c = dirichlet_label_split(labels, 10, 0.5, seed=4)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(len(x) == len(y) and np.array_equal(x, y) for x, y in zip(a, c))


def test_dirichlet_split_sites_are_shuffled_not_sorted():
    labels = synthetic_labels()
    parts = dirichlet_label_split(labels, 4, 0.5, seed=0)
    assert any(not np.all(np.diff(p) > 0) for p in parts)


def _mean_classes_over_5pct(labels, parts):
    counts = []
    for p in parts:
        share = np.bincount(labels[p], minlength=10) / len(p)
        counts.append(int((share > 0.05).sum()))
    return float(np.mean(counts))


def test_smaller_alpha_gives_more_label_skew():
    labels = synthetic_labels()
    skewed = np.mean([_mean_classes_over_5pct(labels, dirichlet_label_split(labels, 10, 0.1, s)) for s in range(3)])
    iid = np.mean([_mean_classes_over_5pct(labels, dirichlet_label_split(labels, 10, 100.0, s)) for s in range(3)])
    assert iid > 9.0, iid  # near-IID: almost every class present at every site
    assert skewed < 5.0, skewed
    assert skewed < iid


def test_balancing_cap_limits_site_size():
    # With the cap, a site that already holds >= n/N samples gets nothing from later
    # classes, so no site can exceed n/N + (largest class size).
    labels = synthetic_labels()
    for seed in range(5):
        parts = dirichlet_label_split(labels, 10, 0.1, seed)
        assert max(len(p) for p in parts) < len(labels) / 10 + 200


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(n_sites=300, alpha=0.5, min_size=10), "at least 10"),
        (dict(n_sites=0, alpha=0.5), "n_sites"),
        (dict(n_sites=2.5, alpha=0.5), "n_sites"),
        (dict(n_sites=5, alpha=0.0), "alpha"),
        (dict(n_sites=5, alpha=-1.0), "alpha"),
        (dict(n_sites=5, alpha=float("nan")), "alpha"),
        (dict(n_sites=5, alpha=float("inf")), "alpha"),
    ],
)
def test_dirichlet_split_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dirichlet_label_split(synthetic_labels(), seed=0, **kwargs)


def test_dirichlet_split_gives_up_instead_of_looping_forever():
    labels = synthetic_labels(200, 10)
    with pytest.raises(ValueError, match="attempts"):
        dirichlet_label_split(labels, 10, 0.01, seed=0, min_size=20, max_attempts=5)


# ----------------------------------------------------------------------------- test split


@pytest.mark.parametrize("n_test,n_sites", [(100, 3), (10_000, 10), (7, 7), (101, 10)])
def test_split_test_disjoint_covering_near_equal(n_test, n_sites):
    parts = split_test(n_test, n_sites, seed=1)
    assert len(parts) == n_sites
    assert_partition(parts, n_test)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    again = split_test(n_test, n_sites, seed=1)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))


def test_split_test_is_seeded_permutation():
    a = split_test(1000, 4, seed=0)
    b = split_test(1000, 4, seed=1)
    assert not np.array_equal(a[0], b[0])
    assert not np.array_equal(np.sort(a[0]), np.arange(250))  # not contiguous blocks


def test_split_test_rejects_more_sites_than_samples():
    with pytest.raises(ValueError):
        split_test(3, 4, seed=0)


# ----------------------------------------------------------------------------- IDX


@pytest.mark.parametrize("gz", [False, True])
def test_read_idx_round_trip(tmp_path, gz):
    imgs = np.random.default_rng(0).integers(0, 256, (5, 28, 28), dtype=np.uint8)
    p = write_idx(tmp_path / "imgs-idx3-ubyte", imgs, gz)
    out = read_idx(p)
    assert out.dtype == np.uint8 and out.shape == (5, 28, 28)
    np.testing.assert_array_equal(out, imgs)

    ints = np.array([[1, -2, 300000], [4, 5, -6]], dtype=np.int32)
    p2 = write_idx(tmp_path / "ints-idx2", ints, gz)
    out2 = read_idx(p2)
    assert out2.dtype == np.int32 and out2.dtype.isnative
    np.testing.assert_array_equal(out2, ints)

    floats = np.array([0.5, -1.25, 3e10], dtype=np.float32)
    np.testing.assert_array_equal(read_idx(write_idx(tmp_path / "f-idx1", floats, gz)), floats)


def test_read_idx_detects_gzip_by_content(tmp_path):
    labels = np.arange(10, dtype=np.uint8)
    p = tmp_path / "labels-idx1-ubyte"  # gzip content without .gz suffix
    p.write_bytes(gzip.compress(idx_bytes(labels)))
    np.testing.assert_array_equal(read_idx(p), labels)


@pytest.mark.parametrize(
    "payload",
    [
        b"",  # empty
        b"\x01\x02\x08\x01\x00\x00\x00\x02ab",  # bad magic
        b"\x00\x00\x07\x01\x00\x00\x00\x02ab",  # unknown type
        b"\x00\x00\x08\x00",  # zero dims
        b"\x00\x00\x08\x03\x00\x00\x00\x02",  # truncated header
        b"\x00\x00\x08\x01\x00\x00\x00\x05abc",  # truncated data
        b"\x00\x00\x08\x01\x00\x00\x00\x02abcd",  # trailing bytes
        b"\x1f\x8b\x08\x00garbage-not-gzip",  # corrupt gzip
    ],
)
def test_read_idx_malformed_raises_value_error(tmp_path, payload):
    p = tmp_path / "bad-idx"
    p.write_bytes(payload)
    with pytest.raises(ValueError, match="bad-idx"):
        read_idx(p)


def test_load_fashion_mnist_plain_and_gz(tmp_path):
    tx, ty, vx, vy = make_fake_fashion_mnist(tmp_path / "gz", 40, 20, gz=True)
    a = load_fashion_mnist(tmp_path / "gz")
    make_fake_fashion_mnist(tmp_path / "plain", 40, 20, gz=False)
    b = load_fashion_mnist(tmp_path / "plain")
    for got, want in zip(a, (tx, ty, vx, vy)):
        np.testing.assert_array_equal(got, want)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert a[0].dtype == np.uint8 and a[0].shape == (40, 28, 28)
    assert a[1].dtype == np.int64 and a[3].shape == (20,)


def test_load_fashion_mnist_missing_says_how_to_get_it(tmp_path):
    with pytest.raises(DatasetNotFound) as ei:
        load_fashion_mnist(tmp_path / "nowhere")
    msg = str(ei.value)
    assert "apt-get install -y dataset-fashion-mnist" in msg
    assert "zalandoresearch/fashion-mnist" in msg and "--source" in msg
    assert isinstance(ei.value, FileNotFoundError)


def test_load_fashion_mnist_rejects_inconsistent_files(tmp_path):
    make_fake_fashion_mnist(tmp_path, 40, 20, gz=False)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.zeros(39, dtype=np.uint8), gz=False)
    with pytest.raises(ValueError, match="labels"):
        load_fashion_mnist(tmp_path)


# ----------------------------------------------------------------------------- end to end


def _png_files(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.png"))


def test_split_dataset_end_to_end(tmp_path):
    src = tmp_path / "src"
    train_x, train_y, test_x, test_y = make_fake_fashion_mnist(src, 300, 100)
    out = tmp_path / "sites"
    ticks = []
    summary = split_dataset(
        "fashion-mnist", sites=3, dirichlet=0.5, seed=0, out=out, source=src,
        progress=lambda done, total: ticks.append((done, total)),
    )
    meta = json.loads((out / "split.json").read_text())
    assert meta == summary
    assert meta["name"] == "fashion-mnist" and meta["seed"] == 0 and meta["dirichlet"] == 0.5
    assert meta["sites"] == 3 and meta["classes"] == FASHION_MNIST_CLASSES
    assert sorted(p.name for p in out.iterdir()) == ["site-00", "site-01", "site-02", "split.json"]
    assert ticks and ticks[-1] == (400, 400)

    seen = {"train": [], "test": []}
    for site in meta["per_site"]:
        root = out / site["site"]
        for split in ("train", "test"):
            files = _png_files(root / split)
            assert len(files) == site[f"n_{split}"] == sum(site[split].values())
            for cls, n in site[split].items():
                folder = root / split / cls
                assert (len(_png_files(folder)) if folder.exists() else 0) == n
                assert folder.exists() == (n > 0), "class folders only for present classes"
            src_x, src_y = (train_x, train_y) if split == "train" else (test_x, test_y)
            for f in files:
                idx = int(f.stem)
                seen[split].append(idx)
                assert f.parent.name == FASHION_MNIST_CLASSES[src_y[idx]]
                with Image.open(f) as im:
                    assert im.mode == "L" and im.size == (28, 28)
                    np.testing.assert_array_equal(np.asarray(im), src_x[idx])
        assert site["n_train"] >= 10
    # train shares and test shares are each disjoint and cover everything
    assert sorted(seen["train"]) == list(range(300))
    assert sorted(seen["test"]) == list(range(100))
    assert sorted(s["n_test"] for s in meta["per_site"]) == [33, 33, 34]
    # file names are zero-padded source indices
    assert all(len(f.stem) == 3 for f in _png_files(out / "site-00" / "train"))


def test_split_dataset_written_sites_load_with_load_site(tmp_path):
    from fedrelay.tasks.image_folder.data import load_site

    src = tmp_path / "src"
    make_fake_fashion_mnist(src, 300, 100)
    summary = split_dataset("fashion-mnist", sites=2, dirichlet=1.0, seed=5, out=tmp_path / "o", source=src)
    site = load_site(tmp_path / "o" / "site-01", expect_shape=(1, 28, 28))
    rec = summary["per_site"][1]
    assert site.image_shape == (1, 28, 28)
    assert {c: n for c, n in site.train_counts.items()} == {c: n for c, n in rec["train"].items() if n or rec["test"][c]}
    x, y = site.tensors("train", FASHION_MNIST_CLASSES)
    assert x.shape == (rec["n_train"], 1, 28, 28)
    assert np.bincount(y.numpy(), minlength=10).tolist() == [rec["train"][c] for c in FASHION_MNIST_CLASSES]


def test_split_dataset_deterministic_and_max_train(tmp_path):
    src = tmp_path / "src"
    make_fake_fashion_mnist(src, 300, 100)
    a = split_dataset("fashion-mnist", sites=3, dirichlet=0.5, seed=1, out=tmp_path / "a", source=src)
    b = split_dataset("fashion-mnist", sites=3, dirichlet=0.5, seed=1, out=tmp_path / "b", source=src)
    assert a["per_site"] == b["per_site"]
    names_a = [p.relative_to(tmp_path / "a") for p in _png_files(tmp_path / "a")]
    names_b = [p.relative_to(tmp_path / "b") for p in _png_files(tmp_path / "b")]
    assert names_a == names_b

    c = split_dataset("fashion-mnist", sites=3, dirichlet=0.5, seed=1, out=tmp_path / "c", source=src,
                      max_train_per_site=20)
    assert [s["n_train"] for s in c["per_site"]] == [min(20, s["n_train"]) for s in a["per_site"]]
    assert c["max_train_per_site"] == 20
    for s in c["per_site"]:
        sub = {int(f.stem) for f in _png_files(tmp_path / "c" / s["site"] / "train")}
        full = {int(f.stem) for f in _png_files(tmp_path / "a" / s["site"] / "train")}
        assert sub <= full and len(sub) == s["n_train"]
    # the test shares are not subsampled
    assert [s["n_test"] for s in c["per_site"]] == [s["n_test"] for s in a["per_site"]]


def test_split_dataset_replaces_previous_split_but_keeps_user_files(tmp_path):
    src = tmp_path / "src"
    make_fake_fashion_mnist(src, 300, 100)
    out = tmp_path / "o"
    split_dataset("fashion-mnist", sites=4, dirichlet=0.5, seed=0, out=out, source=src)
    (out / "notes.txt").write_text("mine")
    (out / "mydir").mkdir()
    (out / "site-00" / "extra.txt").write_text("inside a site folder: replaced with it")
    summary = split_dataset("fashion-mnist", sites=2, dirichlet=0.5, seed=1, out=out, source=src)
    assert sorted(p.name for p in out.iterdir()) == ["mydir", "notes.txt", "site-00", "site-01", "split.json"]
    assert (out / "notes.txt").read_text() == "mine"
    assert not (out / "site-00" / "extra.txt").exists()
    assert json.loads((out / "split.json").read_text())["seed"] == 1
    assert sum(len(_png_files(out / s["site"] / "train")) for s in summary["per_site"]) == 300


def test_split_dataset_refuses_non_empty_foreign_folder(tmp_path):
    src = tmp_path / "src"
    make_fake_fashion_mnist(src, 300, 100)
    out = tmp_path / "o"
    out.mkdir()
    (out / "precious.txt").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        split_dataset("fashion-mnist", sites=2, dirichlet=0.5, seed=0, out=out, source=src)
    assert [p.name for p in out.iterdir()] == ["precious.txt"]
    # a file as --out
    with pytest.raises(ValueError, match="not a folder"):
        split_dataset("fashion-mnist", sites=2, dirichlet=0.5, seed=0, out=out / "precious.txt", source=src)


def test_split_dataset_refuses_to_clobber_unlisted_site_folder(tmp_path):
    src = tmp_path / "src"
    make_fake_fashion_mnist(src, 300, 100)
    out = tmp_path / "o"
    split_dataset("fashion-mnist", sites=2, dirichlet=0.5, seed=0, out=out, source=src)
    (out / "site-02").mkdir()
    (out / "site-02" / "mine.png").write_bytes(b"x")
    with pytest.raises(ValueError, match="site-02"):
        split_dataset("fashion-mnist", sites=3, dirichlet=0.5, seed=0, out=out, source=src)
    assert (out / "site-02" / "mine.png").exists()
    assert json.loads((out / "split.json").read_text())["sites"] == 2  # previous split intact


def test_split_dataset_unknown_name_lists_supported(tmp_path):
    with pytest.raises(ValueError, match="fashion-mnist"):
        split_dataset("cifar10", sites=2, dirichlet=0.5, seed=0, out=tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_site_dir_names_widen_past_100():
    assert sp.site_dir_name(0, 10) == "site-00"
    assert sp.site_dir_name(99, 100) == "site-99"
    assert sp.site_dir_name(5, 101) == "site-005"


@pytest.mark.integration
def test_write_sites_parallel_path(tmp_path, monkeypatch):
    """The multi-process writer (used for the real 70k images) writes the same files."""
    monkeypatch.setattr(sp, "_CHUNK", 40)
    monkeypatch.setattr(sp, "_MIN_PARALLEL", 100)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (200, 28, 28), dtype=np.uint8)
    y = np.arange(200) % 10
    tx, ty = x[:50], y[:50]
    kw = dict(class_names=FASHION_MNIST_CLASSES, train_x=x, train_y=y,
              train_parts=[np.arange(0, 120), np.arange(120, 200)], test_x=tx, test_y=ty,
              test_parts=[np.arange(25), np.arange(25, 50)])
    par = sp.write_sites(tmp_path / "par", workers=2, **kw)
    ser = sp.write_sites(tmp_path / "ser", workers=1, **kw)
    assert par["per_site"] == ser["per_site"]
    fp = _png_files(tmp_path / "par")
    fs = _png_files(tmp_path / "ser")
    assert [p.relative_to(tmp_path / "par") for p in fp] == [p.relative_to(tmp_path / "ser") for p in fs]
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(fp, fs))
    assert not list((tmp_path / "par").glob(".split-staging-*"))
