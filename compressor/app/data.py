"""Small image-classification data sets for the demo, the examples and the tests, as numpy arrays.

* :func:`load_digits`: scikit-learn's bundled 8x8 digits (1797 images, no download; needs the ``demo``
  extra), split into train/test with a fixed seed;
* :func:`load_mnist`: MNIST from the four original IDX files (``train-images-idx3-ubyte.gz`` ...) in a
  directory you give; ``.gz`` or uncompressed files are both read. Nothing is downloaded.

Images are float32 ``[N, H, W]`` scaled to [0, 1] (backends add the channel axis where their layout
wants it), labels int64 ``[N]``. Missing files raise ``FileNotFoundError``; unreadable or inconsistent
files raise :class:`DataError` naming the file and what is wrong. Importing this module imports only numpy.

For language models: :func:`load_text_corpus` reads a corpus of text files (a ``.tar.gz`` or a directory,
e.g. Vim's help files) as byte-level tokens with a fixed train / held-out split, and :func:`byte_windows`
draws calibration / training windows from it.
"""

from __future__ import annotations

import gzip
import os
import tarfile
import zlib
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

__all__ = ["DataError", "Dataset", "MNIST_FILES", "TextCorpus", "byte_windows", "load_dataset", "load_digits", "load_mnist",
           "load_text_corpus", "read_idx"]

#: split -> (images file, labels file), the names of the original distribution
MNIST_FILES: dict[str, tuple[str, str]] = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}

# IDX type codes (third byte of the magic number) -> numpy big-endian dtype
_IDX_TYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


class DataError(ValueError):
    """A data file exists but cannot be used (corrupt, truncated, wrong kind, inconsistent)."""


@dataclass(frozen=True)
class Dataset:
    """Train and test split of an image-classification data set (numpy arrays)."""

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int = 10

    @property
    def image_shape(self) -> tuple[int, int]:
        """``(H, W)`` of one image."""
        return tuple(self.x_train.shape[1:3])  # type: ignore[return-value]

    def subset(self, n_train: int | None = None, n_test: int | None = None) -> Dataset:
        """The first ``n_train`` / ``n_test`` examples (deterministic; for quick runs and tests)."""
        return replace(self, x_train=self.x_train[:n_train], y_train=self.y_train[:n_train],
                       x_test=self.x_test[:n_test], y_test=self.y_test[:n_test])

    def describe(self) -> str:
        h, w = self.image_shape
        return f"{self.name}: {len(self.x_train)} train / {len(self.x_test)} test images of {h}x{w}, {self.num_classes} classes"


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> Dataset:
    """scikit-learn's bundled 8x8 digits (pixel values 0..16 scaled to [0, 1]), stratified split."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")
    try:
        from sklearn.datasets import load_digits as _sk_digits
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("the digits data set needs scikit-learn: pip install 'compressor[demo]'") from e
    bunch = _sk_digits()
    x = (bunch.images / 16.0).astype(np.float32)
    y = bunch.target.astype(np.int64)
    rng = np.random.default_rng(seed)
    test_idx = []
    for c in np.unique(y):  # stratified: the same fraction of every class in the test split
        idx = np.flatnonzero(y == c)
        rng.shuffle(idx)
        test_idx.append(idx[: int(round(len(idx) * test_fraction))])
    test = np.zeros(len(y), dtype=bool)
    test[np.concatenate(test_idx)] = True
    train_idx = rng.permutation(np.flatnonzero(~test))
    test_order = rng.permutation(np.flatnonzero(test))
    return Dataset("digits", x[train_idx], y[train_idx], x[test_order], y[test_order], num_classes=10)


def _find(directory: Path, stem: str) -> Path | None:
    for name in (stem + ".gz", stem):
        p = directory / name
        if p.is_file():
            return p
    return None


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read one IDX file (gzip-compressed or not) into a numpy array of its declared shape and type."""
    p = Path(path)
    try:
        if p.suffix == ".gz":
            with gzip.open(p, "rb") as f:
                raw = f.read()
        else:
            raw = p.read_bytes()
    except (OSError, EOFError, zlib.error) as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise DataError(f"{p}: cannot read ({e}); the file is corrupt or not gzip-compressed IDX") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_TYPES or raw[3] == 0:
        raise DataError(f"{p}: not an IDX file (bad magic number {raw[:4].hex() or 'empty'})")
    dtype = np.dtype(_IDX_TYPES[raw[2]])
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{p}: truncated header ({len(raw)} bytes, expected at least {header})")
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    need = header + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) != need:
        what = "truncated" if len(raw) < need else "has trailing bytes"
        raise DataError(f"{p}: {what}: {len(raw)} bytes, expected {need} for shape {shape} of {dtype.name}")
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


def _load_split(directory: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    img_stem, lbl_stem = MNIST_FILES[split]
    img_path, lbl_path = _find(directory, img_stem), _find(directory, lbl_stem)
    images, labels = read_idx(img_path), read_idx(lbl_path)  # type: ignore[arg-type]
    if images.ndim != 3 or images.dtype != np.uint8:
        raise DataError(f"{img_path}: expected uint8 images [N, H, W], got {images.dtype.name} {images.shape}")
    if labels.ndim != 1 or labels.dtype != np.uint8:
        raise DataError(f"{lbl_path}: expected uint8 labels [N], got {labels.dtype.name} {labels.shape}")
    if len(images) != len(labels):
        raise DataError(f"{directory}: {split} split has {len(images)} images but {len(labels)} labels")
    if labels.size and labels.max() > 9:
        raise DataError(f"{lbl_path}: labels must be digits 0..9, found {int(labels.max())}")
    return (images.astype(np.float32) / 255.0), labels.astype(np.int64)


def load_mnist(data_dir: str | os.PathLike) -> Dataset:
    """MNIST from the original IDX files in ``data_dir`` (60000 train / 10000 test images of 28x28)."""
    d = Path(data_dir).expanduser()
    if not d.is_dir():
        raise FileNotFoundError(f"MNIST directory {str(d)!r} does not exist; it must hold the four IDX files "
                                f"{', '.join(s + '.gz' for pair in MNIST_FILES.values() for s in pair)}")
    missing = [stem + ".gz" for pair in MNIST_FILES.values() for stem in pair if _find(d, stem) is None]
    if missing:
        raise FileNotFoundError(f"MNIST directory {str(d)!r} lacks {', '.join(missing)} (original IDX files, "
                                f"gzip-compressed or not; see http://yann.lecun.com/exdb/mnist/)")
    x_train, y_train = _load_split(d, "train")
    x_test, y_test = _load_split(d, "test")
    if x_train.shape[1:] != x_test.shape[1:]:
        raise DataError(f"{d}: train images are {x_train.shape[1:]} but test images {x_test.shape[1:]}")
    return Dataset("mnist", x_train, y_train, x_test, y_test, num_classes=10)


def load_dataset(name: str, data_dir: str | os.PathLike | None = None, seed: int = 0) -> Dataset:
    """``'digits'`` or ``'mnist'`` (which needs ``data_dir``)."""
    if name == "digits":
        return load_digits(seed=seed)
    if name == "mnist":
        if data_dir is None:
            raise ValueError("the MNIST data set needs a directory with its IDX files (--data-dir DIR)")
        return load_mnist(data_dir)
    raise ValueError(f"unknown data set {name!r}; allowed: 'digits', 'mnist'")


# ---------------------------------------------------------------------------------- text (language models)
@dataclass(frozen=True)
class TextCorpus:
    """Byte-level text (vocabulary 256): ``train`` / ``held_out`` are uint8 arrays, the files of each split
    concatenated in name order; ``train_files`` / ``held_out_files`` their names."""

    name: str
    train: np.ndarray
    held_out: np.ndarray
    train_files: tuple[str, ...]
    held_out_files: tuple[str, ...]

    def describe(self) -> str:
        return (f"{self.name}: {len(self.train_files)} train files ({len(self.train):,} bytes), "
                f"{len(self.held_out_files)} held out ({len(self.held_out):,} bytes)")


def _text_files(path: Path, suffix: str) -> dict[str, bytes]:
    if path.is_dir():
        return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file() and p.name.endswith(suffix)}
    if path.is_file():
        try:
            with tarfile.open(path, "r:*") as tar:
                out = {}
                for m in tar.getmembers():
                    name = m.name.rsplit("/", 1)[-1]
                    if m.isfile() and name.endswith(suffix):
                        f = tar.extractfile(m)
                        out[name] = f.read() if f is not None else b""
                return out
        except (tarfile.TarError, OSError, EOFError, zlib.error) as e:
            raise DataError(f"{path}: not a readable tar archive of text files ({e})") from e
    raise FileNotFoundError(f"text corpus not found: {path} (give a directory or a .tar.gz of text files)")


def load_text_corpus(path: str | os.PathLike, held_out_every: int = 10, held_out_index: int = 7,
                     suffix: str = ".txt") -> TextCorpus:
    """The files ``*suffix`` of a directory or tar archive, sorted by name; file ``i`` is held out when
    ``i % held_out_every == held_out_index`` (the protocol of ``shared/data/text``: Vim's 151 help files,
    15 held out), the rest is training text. Bytes are the tokens (vocabulary 256). Nothing is decoded."""
    p = Path(path)
    files = _text_files(p, suffix)
    if not files:
        raise DataError(f"{p}: no '*{suffix}' file in it")
    if not 0 <= held_out_index < held_out_every:
        raise ValueError(f"held_out_index must be in [0, {held_out_every}), got {held_out_index}")
    names = sorted(files)
    held = tuple(n for i, n in enumerate(names) if i % held_out_every == held_out_index)
    train = tuple(n for n in names if n not in set(held))
    if not train or not held:
        raise DataError(f"{p}: {len(names)} file(s) give no train or no held-out split")

    def cat(ns: tuple[str, ...]) -> np.ndarray:
        return np.frombuffer(b"".join(files[n] for n in ns), dtype=np.uint8).copy()

    return TextCorpus(p.name, cat(train), cat(held), train, held)


def byte_windows(tokens: np.ndarray, count: int, length: int, seed: int = 0) -> np.ndarray:
    """``count`` windows of ``length`` consecutive tokens at random starts (``np.random.default_rng(seed)``),
    int64 ``[count, length]``: calibration sequences or training batches."""
    t = np.asarray(tokens)
    if t.ndim != 1 or len(t) <= length:
        raise ValueError(f"need a 1-D token array longer than length={length}, got shape {t.shape}")
    starts = np.random.default_rng(seed).integers(0, len(t) - length, size=int(count))
    return np.stack([t[s:s + length] for s in starts]).astype(np.int64)
