"""Datasets that ship with packages or are made on the fly, real file loaders, and rank sharding.

Everything returns numpy arrays so the torch and TensorFlow runtimes share one data path. Image
folders read from disk are in images.py; `python -m hvdtrain.data` writes one (__main__.py).
"""

from __future__ import annotations

import gzip
import math
import struct
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

from hvdtrain.data.images import TF_IMAGE_SUFFIXES, ImageFolder, image_suffixes  # noqa: F401 (data.X)
from hvdtrain.data.shards import TarShards


@dataclass(frozen=True)
class Split:
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray

    @property
    def num_classes(self) -> int:
        return int(max(self.y_train.max(), self.y_test.max())) + 1


def digits(seed: int, test_fraction: float = 0.25) -> Split:
    """The 8x8 handwritten digits (1797 images, hvdtrain/datasets/README.md), scaled to [0, 1], split
    as scikit-learn's `train_test_split(x, y, test_size=test_fraction, random_state=seed, stratify=y)`
    splits its copy of them. Shipped rather than read from scikit-learn: with scikit-learn installed,
    `import keras` imports it (and SciPy), a second of every TensorFlow rank's start-up."""
    with gzip.open(resources.files("hvdtrain") / "datasets" / "digits.csv.gz", "rt") as text:
        data = np.loadtxt(text, delimiter=",")
    x = (data[:, :-1] / 16.0).astype(np.float32)
    y = data[:, -1].astype(np.int64)
    train, test = stratified_split(y, test_fraction, seed)
    return Split(x[train], y[train], x[test], y[test])


def digits_images(seed: int, side: int, channels_last: bool = False) -> Split:
    """The digits as colour images for an ImageNet-shaped model: each pixel repeated to about
    side x side (a multiple of 8), the grey repeated in three channels."""
    split, scale = digits(seed), max(1, side // 8)

    def images(x: np.ndarray) -> np.ndarray:
        grid = x.reshape(-1, 1, 8, 8).repeat(scale, axis=2).repeat(scale, axis=3).repeat(3, axis=1)
        return np.ascontiguousarray(grid.transpose(0, 2, 3, 1) if channels_last else grid)

    return Split(images(split.x_train), split.y_train, images(split.x_test), split.y_test)


def stratified_split(labels: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Train and test indices, each class in proportion: scikit-learn's StratifiedShuffleSplit,
    draw for draw from the same RandomState, so a split is the one train_test_split gives."""
    n_test = math.ceil(test_fraction * len(labels))
    _, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
    per_class = np.split(np.argsort(inverse, kind="stable"), np.cumsum(counts)[:-1])
    rng = np.random.RandomState(seed)
    train_counts = _approximate_mode(counts, len(labels) - n_test, rng)
    test_counts = _approximate_mode(counts - train_counts, n_test, rng)
    train: list[int] = []
    test: list[int] = []
    for indices, n_train, n_tested in zip(per_class, train_counts, test_counts, strict=True):
        shuffled = indices.take(rng.permutation(len(indices)))
        train.extend(shuffled[:n_train])
        test.extend(shuffled[n_train : n_train + n_tested])
    return rng.permutation(train), rng.permutation(test)


def _approximate_mode(counts: np.ndarray, draws: int, rng: np.random.RandomState) -> np.ndarray:
    """How many of `draws` each class gets: its share rounded down, then one more for the classes
    with the largest remainders, ties broken by rng."""
    continuous = counts / counts.sum() * draws
    floored = np.floor(continuous)
    missing = int(draws - floored.sum())
    remainder = continuous - floored
    for value in np.sort(np.unique(remainder))[::-1]:
        if missing <= 0:
            break
        (tied,) = np.where(remainder == value)
        chosen = rng.choice(tied, size=min(len(tied), missing), replace=False)
        floored[chosen] += 1
        missing -= len(chosen)
    return floored.astype(int)


def synthetic_images(
    num_samples: int, shape: tuple[int, ...], num_classes: int, seed: int, channels_last: bool = False
) -> Split:
    """Random images and labels, as Horovod's synthetic benchmarks use: measures speed, not learning."""
    rng = np.random.default_rng(seed)
    full_shape = (num_samples, *shape)
    if channels_last:
        full_shape = (num_samples, *shape[1:], shape[0])
    x = rng.standard_normal(full_shape, dtype=np.float32)
    y = rng.integers(0, num_classes, size=num_samples, dtype=np.int64)
    return Split(x, y, x[: max(1, num_samples // 10)], y[: max(1, num_samples // 10)])


MNIST_FILES = {
    "x_train": "train-images-idx3-ubyte",
    "y_train": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte",
    "y_test": "t10k-labels-idx1-ubyte",
}
_IDX_DTYPES = {
    0x08: np.uint8,
    0x09: np.int8,
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def read_idx(path: Path) -> np.ndarray:
    """Read one IDX file (LeCun's MNIST format), gzipped or not; a damaged file is a ValueError
    naming it, whatever is wrong with it."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as stream:
            data = stream.read()
    except (OSError, EOFError) as error:  # gzip.BadGzipFile is an OSError; a truncated .gz, EOFError
        raise ValueError(f"{path} cannot be read: {error}") from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_DTYPES:
        raise ValueError(f"{path} is not an IDX file (bad magic number)")
    dtype, ndim = np.dtype(_IDX_DTYPES[data[2]]), data[3]
    if len(data) < 4 + 4 * ndim:
        raise ValueError(f"{path} is truncated inside its header")
    dims = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    usable = (len(data) - 4 - 4 * ndim) // dtype.itemsize * dtype.itemsize
    body = np.frombuffer(data[: 4 + 4 * ndim + usable], dtype=dtype, offset=4 + 4 * ndim)
    if body.size != int(np.prod(dims)):
        raise ValueError(f"{path}: header says {dims} but holds {body.size} values")
    return body.reshape(dims)


def write_idx(path: Path, array: np.ndarray) -> None:
    """Write an IDX file; the inverse of read_idx (tests make tiny MNIST files with it)."""
    codes = {np.dtype(v).newbyteorder("="): k for k, v in _IDX_DTYPES.items()}
    code = codes[array.dtype.newbyteorder("=")]
    header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + array.astype(array.dtype.newbyteorder(">")).tobytes()
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wb") as stream:
        stream.write(payload)


def mnist_files(data_dir: str) -> dict[str, Path]:
    """The four MNIST IDX files in data_dir (plain or .gz); a clear error names the first missing one."""
    if not data_dir:
        raise ValueError("this recipe reads MNIST IDX files: pass --set data_dir=DIR")
    root = Path(data_dir)
    paths = {}
    for key, stem in MNIST_FILES.items():
        path = next((p for p in (root / stem, root / f"{stem}.gz") if p.exists()), None)
        if path is None:
            raise ValueError(f"MNIST file {stem}[.gz] not found in {root}; hvdtrain downloads nothing")
        paths[key] = path
    return paths


def mnist(data_dir: str) -> Split:
    """MNIST from the four IDX files in data_dir. Nothing is downloaded."""
    arrays = {key: read_idx(path) for key, path in mnist_files(data_dir).items()}
    for kind in ("train", "test"):
        images, labels = arrays[f"x_{kind}"], arrays[f"y_{kind}"]
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise ValueError(
                f"MNIST {kind} files in {data_dir} do not match: images {images.shape}, labels {labels.shape}"
            )
    images = {k: (arrays[k].astype(np.float32) / 255.0)[:, None, :, :] for k in ("x_train", "x_test")}
    return Split(
        images["x_train"],
        arrays["y_train"].astype(np.int64),
        images["x_test"],
        arrays["y_test"].astype(np.int64),
    )


def epoch_order(num_samples: int, epoch: int, seed: int) -> np.ndarray:
    """One epoch's order of the samples, the same on every rank (seeded by seed and epoch)."""
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


def shard_indices(
    num_samples: int, rank: int, world_size: int, epoch: int, seed: int, shuffle: bool = True
) -> np.ndarray:
    """This rank's samples for one epoch: one permutation shared by all ranks (seeded by seed and
    epoch), trimmed to a multiple of world_size, rank r takes every world_size-th from r.
    The same rule as torch's DistributedSampler(drop_last=True), so both runtimes agree."""
    order = epoch_order(num_samples, epoch, seed) if shuffle else np.arange(num_samples)
    usable = num_samples - num_samples % world_size
    return order[:usable][rank::world_size]


def image_folders(data_dir: str) -> tuple[ImageFolder | TarShards, ImageFolder | TarShards]:
    """The training and test images under data_dir: image folders (DIR/train/CLASS/*.jpg,
    DIR/test/CLASS/*.jpg), or tar shards where DIR/train holds *.tar (`hvdtrain data pack`)."""
    if not data_dir:
        raise ValueError(
            "this recipe reads image files: pass --set data_dir=DIR (with DIR/train and DIR/test)"
        )
    root = Path(data_dir)

    def opened(path: Path) -> ImageFolder | TarShards:
        return TarShards.open(path) if any(path.glob("*.tar")) else ImageFolder.scan(path)

    train, test = opened(root / "train"), opened(root / "test")
    if type(train) is not type(test):
        raise ValueError(f"{root}/train and {root}/test are not both image folders or both tar shards")
    if train.classes != test.classes:
        raise ValueError(f"{root}/train and {root}/test have different class folders")
    return train, test


def check_image_folders(data_dir: str, suffixes: frozenset[str] | None = None, reader: str = "") -> None:
    """A recipe's preflight: both folders scanned, every file's format one `reader` decodes (when
    `suffixes` are given), and one image read, before any rank starts."""
    folders = image_folders(data_dir)
    if suffixes is not None:
        for folder in folders:
            folder.only(suffixes, reader)
    folders[0].shape()


def write_digits_images(root: Path, copies: int = 1, seed: int = 0, suffix: str = ".png") -> dict[str, int]:
    """scikit-learn's digits as an image folder: root/train/CLASS/*.png and root/test/CLASS/*.png
    (8x8 grey images, in the format Pillow writes for `suffix`: .png, .jpg, .bmp, ...). `copies`
    writes each training image that many times (under other names): the same data in more files, to
    measure how memory grows with the file count. Returns file counts."""
    from PIL import Image

    split = digits(seed)
    counts = {}
    for kind, images, labels, times in (
        ("train", split.x_train, split.y_train, copies),
        ("test", split.x_test, split.y_test, 1),
    ):
        for label in range(10):
            (root / kind / str(label)).mkdir(parents=True, exist_ok=True)
        pixels = np.rint(images.reshape(-1, 8, 8) * 255).astype(np.uint8)
        for copy in range(times):
            for index, (image, label) in enumerate(zip(pixels, labels, strict=True)):
                Image.fromarray(image, mode="L").save(
                    root / kind / str(label) / f"{index:05d}-{copy}{suffix}"
                )
        counts[kind] = len(labels) * times
    return counts
