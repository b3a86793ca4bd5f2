"""compressor.app.data: the digits split and the MNIST IDX reader (hand-written IDX files, exact values)."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest

from compressor.app.data import MNIST_FILES, DataError, load_dataset, load_digits, load_mnist, read_idx


def idx_bytes(array: np.ndarray) -> bytes:
    """Encode ``array`` (uint8) as an IDX file: magic 0x0000 08 <ndim>, big-endian dims, data."""
    a = np.ascontiguousarray(array, dtype=np.uint8)
    return bytes([0, 0, 0x08, a.ndim]) + struct.pack(f">{a.ndim}I", *a.shape) + a.tobytes()


def write_mnist(directory: Path, n_train: int = 6, n_test: int = 4, gz: bool = True, **override: bytes) -> dict:
    """A tiny MNIST-shaped directory; ``override`` replaces a file's bytes by stem."""
    rng = np.random.default_rng(0)
    arrays = {
        "train": (rng.integers(0, 256, (n_train, 3, 2), dtype=np.uint8), np.arange(n_train, dtype=np.uint8) % 10),
        "test": (rng.integers(0, 256, (n_test, 3, 2), dtype=np.uint8), (9 - np.arange(n_test, dtype=np.uint8)) % 10),
    }
    for split, (img_stem, lbl_stem) in MNIST_FILES.items():
        for stem, arr in zip((img_stem, lbl_stem), arrays[split]):
            data = override.get(stem, idx_bytes(arr))
            if gz:
                with gzip.open(directory / f"{stem}.gz", "wb") as f:
                    f.write(data)
            else:
                (directory / stem).write_bytes(data)
    return arrays


@pytest.mark.parametrize("gz", [True, False])
def test_mnist_reads_exact_values(tmp_path, gz):
    arrays = write_mnist(tmp_path, gz=gz)
    ds = load_mnist(tmp_path)
    assert ds.name == "mnist" and ds.image_shape == (3, 2)
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int64
    np.testing.assert_array_equal(ds.x_train, arrays["train"][0].astype(np.float32) / 255.0)
    np.testing.assert_array_equal(ds.y_train, [0, 1, 2, 3, 4, 5])
    np.testing.assert_array_equal(ds.y_test, [9, 8, 7, 6])
    assert ds.x_test.shape == (4, 3, 2)


def test_read_idx_other_dtypes(tmp_path):
    # int32 big-endian 2x2: type code 0x0C
    raw = bytes([0, 0, 0x0C, 2]) + struct.pack(">2I", 2, 2) + struct.pack(">4i", -1, 2, 70000, -70000)
    (tmp_path / "a.idx").write_bytes(raw)
    a = read_idx(tmp_path / "a.idx")
    assert a.dtype == np.int32 and a.dtype.byteorder in ("=", "<", "|")
    np.testing.assert_array_equal(a, [[-1, 2], [70000, -70000]])


def test_missing_directory_and_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_mnist(tmp_path / "nope")
    write_mnist(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(FileNotFoundError, match=r"lacks t10k-labels-idx1-ubyte\.gz$|lacks t10k-labels-idx1-ubyte\.gz "):
        load_mnist(tmp_path)


@pytest.mark.parametrize("stem, data, message", [
    ("train-images-idx3-ubyte", b"\x00\x00\x07\x03rest", "bad magic number"),
    ("train-images-idx3-ubyte", b"", "bad magic number empty"),
    ("train-labels-idx1-ubyte", bytes([0, 0, 8, 1, 0, 0]), "truncated header"),
    ("t10k-images-idx3-ubyte", idx_bytes(np.zeros((4, 3, 2), np.uint8))[:-1], "truncated: 39 bytes, expected 40"),
    ("t10k-images-idx3-ubyte", idx_bytes(np.zeros((4, 3, 2), np.uint8)) + b"x", "has trailing bytes"),
    ("train-labels-idx1-ubyte", idx_bytes(np.zeros(5, np.uint8)), "6 images but 5 labels"),
    ("train-labels-idx1-ubyte", idx_bytes(np.array([0, 1, 2, 3, 4, 10], np.uint8)), "labels must be digits 0..9, found 10"),
    ("train-labels-idx1-ubyte", idx_bytes(np.zeros((6, 1), np.uint8)), r"expected uint8 labels \[N\]"),
], ids=["magic", "empty", "short-header", "truncated", "trailing", "count-mismatch", "label-range", "label-shape"])
def test_corrupt_files_are_named(tmp_path, stem, data, message):
    write_mnist(tmp_path, **{stem: data})
    with pytest.raises(DataError, match=message) as info:
        load_mnist(tmp_path)
    assert stem in str(info.value) or "split has" in str(info.value)


def test_not_gzip(tmp_path):
    write_mnist(tmp_path)
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(b"plain text, not gzip")
    with pytest.raises(DataError, match="train-images-idx3-ubyte.gz: cannot read"):
        load_mnist(tmp_path)


def test_load_dataset_dispatch(tmp_path):
    write_mnist(tmp_path)
    assert load_dataset("mnist", tmp_path).x_train.shape == (6, 3, 2)
    with pytest.raises(ValueError, match="--data-dir"):
        load_dataset("mnist")
    with pytest.raises(ValueError, match="unknown data set 'cifar'"):
        load_dataset("cifar")


def test_subset_is_a_prefix(tmp_path):
    write_mnist(tmp_path)
    ds = load_mnist(tmp_path)
    sub = ds.subset(2, 3)
    np.testing.assert_array_equal(sub.x_train, ds.x_train[:2])
    assert len(sub.y_test) == 3 and sub.num_classes == 10


def test_digits_split_is_stratified_and_seeded():
    pytest.importorskip("sklearn")
    a, b, c = load_digits(seed=0), load_digits(seed=0), load_digits(seed=1)
    assert a.x_train.shape == (1438, 8, 8) and a.x_test.shape == (359, 8, 8)
    assert a.x_train.dtype == np.float32 and 0.0 <= a.x_train.min() and a.x_train.max() == 1.0
    np.testing.assert_array_equal(a.x_train, b.x_train)
    assert not np.array_equal(a.y_train, c.y_train)
    counts = np.bincount(a.y_test, minlength=10)  # ~20 % of each class (178..183 images per class)
    assert counts.min() >= 35 and counts.max() <= 37
    # train + test is exactly the whole data set, each image once
    from sklearn.datasets import load_digits as sk_digits

    whole = sk_digits()
    ours = np.concatenate([a.x_train, a.x_test]).reshape(1797, -1) * 16.0
    key = np.lexsort(ours.T)
    ref = whole.data[np.lexsort(whole.data.T)]
    np.testing.assert_array_equal(ours[key], ref)
    np.testing.assert_array_equal(np.sort(np.concatenate([a.y_train, a.y_test])), np.sort(whole.target))


def test_real_mnist(mnist_dir):
    ds = load_mnist(mnist_dir)
    assert ds.x_train.shape == (60000, 28, 28) and ds.x_test.shape == (10000, 28, 28)
    np.testing.assert_array_equal(ds.y_test[:10], [7, 2, 1, 0, 4, 1, 4, 9, 5, 9])
    np.testing.assert_array_equal(np.bincount(ds.y_train), [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949])


# ---------------------------------------------------------------------------------- text corpus
def _corpus_dir(tmp_path, n):
    d = tmp_path / "corpus"
    d.mkdir()
    for i in range(n):
        (d / f"f{i:02d}.txt").write_bytes(bytes([65 + i]) * (i + 1))
    (d / "skip.md").write_bytes(b"not text")
    return d


def test_text_corpus_split_is_by_sorted_name_index(tmp_path):
    import tarfile

    from compressor.app.data import byte_windows, load_text_corpus

    d = _corpus_dir(tmp_path, 12)
    c = load_text_corpus(d)
    assert c.held_out_files == ("f07.txt",)
    assert c.train_files == tuple(f"f{i:02d}.txt" for i in range(12) if i != 7)
    assert c.held_out.tolist() == [72] * 8
    assert len(c.train) == sum(i + 1 for i in range(12)) - 8 and c.train[:3].tolist() == [65, 66, 66]
    tgz = tmp_path / "c.tar.gz"
    with tarfile.open(tgz, "w:gz") as tar:
        tar.add(d, arcname="help")
    c2 = load_text_corpus(tgz)
    assert c2.train.tolist() == c.train.tolist() and c2.held_out_files == c.held_out_files
    w = byte_windows(c.train, 3, 4, seed=1)
    assert w.shape == (3, 4) and w.dtype == np.int64
    assert (byte_windows(c.train, 3, 4, seed=1) == w).all()
    with pytest.raises(ValueError, match="longer than length"):
        byte_windows(c.held_out, 1, 8)


def test_text_corpus_bad_input(tmp_path):
    from compressor.app.data import load_text_corpus

    with pytest.raises(FileNotFoundError):
        load_text_corpus(tmp_path / "missing")
    bad = tmp_path / "bad.tar.gz"
    bad.write_bytes(b"\x1f\x8b not really")
    with pytest.raises(DataError, match="not a readable tar"):
        load_text_corpus(bad)
    with pytest.raises(DataError, match="no train or no held-out"):
        load_text_corpus(_corpus_dir(tmp_path, 5))


def test_shared_vim_help_corpus_protocol(text_corpus):
    from compressor.app.data import load_text_corpus

    c = load_text_corpus(text_corpus)
    assert (len(c.train_files), len(c.held_out_files)) == (136, 15)
    assert c.held_out_files[0] == "debugger.txt"
    assert 290_000 < len(c.held_out) < 300_000
