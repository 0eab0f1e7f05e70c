"""Images in tar shards, WebDataset's layout: for data on shared or object-like storage, where a
million small files hurt, a few hundred large files that are read by offset.

A shard is a plain tar of samples, each two members in a row: `KEY.jpg` (any image format, as it was
in the folder) and `KEY.cls` (the label as a decimal integer), so WebDataset and `tar` read it too.
`hvdtrain data pack DIR OUT` writes them from an image folder, with `index.npz` beside them: every
sample's shard, byte offset, size and label, and the class names. A rank holds that index (about 20
bytes a sample, however many shards) and reads a sample with one positional read, no scan of the
tar. Shards without an index (made by another tool) are indexed by reading their tar headers.

Each epoch the shards are shuffled, then the samples within each shard, and each rank takes one
contiguous run of that order: a rank reads about 1/size of the shards, mostly whole, and the order
is a function of the seed and the epoch alone, so a resumed epoch skips exactly the batches done.
"""

from __future__ import annotations

import contextlib
import io
import os
import tarfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hvdtrain.data.images import ImageFolder, decoded
from hvdtrain.errors import InputError

INDEX = "index.npz"
LABEL_SUFFIX = ".cls"
SHARD_NAME = "shard-{:06d}.tar"
OPEN_SHARDS = 16
"""Descriptors a process keeps open, however many shards there are."""
PARTIAL = ".partial"
"""What a shard being written is called: a pack that stops half-way leaves no *.tar to be read."""


@dataclass(frozen=True)
class TarShards:
    """Samples in tar shards, read by offset: a map-style dataset (`len`, `[i]` -> (image, label))
    like ImageFolder, with the rank order above (`rank_indices`)."""

    root: Path
    shards: tuple[str, ...]
    shard: np.ndarray
    """Per sample: which shard (an index into `shards`)."""
    offset: np.ndarray
    size: np.ndarray
    labels: np.ndarray
    suffixes: tuple[str, ...]
    """Per sample: its image member's suffix (.jpg, .png, ...), as an index into `formats`."""
    formats: tuple[str, ...]
    classes: tuple[str, ...]
    _open: dict[str, int] = field(default_factory=dict, compare=False, repr=False)
    """shard -> a file descriptor of this process (positional reads share no file offset)."""
    _pid: list[int] = field(default_factory=lambda: [os.getpid()], compare=False, repr=False)

    @classmethod
    def open(cls, root: Path | str) -> TarShards:
        root = Path(root)
        names = tuple(sorted(path.name for path in root.glob("*.tar"))) if root.is_dir() else ()
        if not names:
            raise InputError(
                f"no tar shards in {root} (expected {root}/*.tar; hvdtrain data pack writes them)"
            )
        if (root / INDEX).is_file():
            return cls._indexed(root, names)
        return cls._scanned(root, names)

    @classmethod
    def _indexed(cls, root: Path, names: tuple[str, ...]) -> TarShards:
        try:
            with np.load(root / INDEX) as index:
                listed = tuple(str(name) for name in index["shards"])
                columns = {key: index[key] for key in ("shard", "offset", "size", "label", "format")}
                formats, classes = tuple(map(str, index["formats"])), tuple(map(str, index["classes"]))
        except (OSError, KeyError, ValueError) as error:
            raise InputError(f"{root / INDEX} cannot be read as a shard index: {error}") from None
        if listed != names:
            raise InputError(
                f"{root / INDEX} lists other shards than {root} holds ({len(listed)} listed, {len(names)} "
                "there): pack the folder again"
            )
        return cls._of(root, names, columns, formats, classes)

    @classmethod
    def _scanned(cls, root: Path, names: tuple[str, ...]) -> TarShards:
        rows, formats = [], {}
        for number, name in enumerate(names):
            for _key, image, label in _members(root / name):
                suffix = Path(image.name).suffix.lower()
                rows.append(
                    (number, image.offset_data, image.size, label, formats.setdefault(suffix, len(formats)))
                )
        if not rows:
            raise InputError(f"no samples (KEY.jpg with KEY.cls) in the tar shards of {root}")
        columns = _columns(rows)
        classes = tuple(str(i) for i in range(int(columns["label"].max()) + 1))
        return cls._of(root, names, columns, tuple(formats), classes)

    @classmethod
    def _of(cls, root: Path, names: tuple[str, ...], columns: dict[str, np.ndarray], formats, classes):
        return cls(root, names, columns["shard"], columns["offset"], columns["size"], columns["label"],
                   columns["format"], tuple(formats), tuple(classes))  # fmt: skip

    def __len__(self) -> int:
        return len(self.labels)

    def read(self, index: int) -> bytes:
        """The sample's image file, as it was packed."""
        if self._pid[0] != os.getpid():  # a DataLoader worker: its own descriptors
            self._open.clear()
            self._pid[0] = os.getpid()
        path = str(self.root / self.shards[int(self.shard[index])])
        return _pread(self._open, path, int(self.offset[index]), int(self.size[index]))

    def name(self, index: int) -> str:
        """Where the sample is: SHARD@OFFSET:SIZE, which read_named reads (tf.data's element)."""
        shard = self.root / self.shards[int(self.shard[index])]
        return f"{shard}@{int(self.offset[index])}:{int(self.size[index])}"

    def names(self) -> list[str]:
        return [self.name(index) for index in range(len(self))]

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.int64]:
        return decoded(io.BytesIO(self.read(index)), self.name(index)), self.labels[index]

    def shape(self) -> tuple[int, ...]:
        return self[0][0].shape

    def only(self, suffixes: frozenset[str], reader: str) -> None:
        """Raises InputError naming a format in the shards that `reader` does not decode."""
        for number, suffix in enumerate(self.formats):
            if suffix not in suffixes:
                first = int(np.flatnonzero(self.suffixes == number)[0])
                raise InputError(
                    f"{self.name(first)} is {suffix}: {reader} decodes only {', '.join(sorted(suffixes))}"
                )

    def rank_indices(self, rank: int, size: int, epoch: int, seed: int) -> np.ndarray:
        """This rank's samples of one epoch: the shards shuffled, then each shard's samples, and rank r
        the r-th of `size` equal contiguous runs (the remainder dropped, as every sampler here does)."""
        rng = np.random.default_rng([seed, epoch])
        by_shard = np.argsort(self.shard, kind="stable")
        starts = np.searchsorted(self.shard[by_shard], np.arange(len(self.shards) + 1))
        order = np.concatenate(
            [rng.permutation(by_shard[starts[s] : starts[s + 1]]) for s in rng.permutation(len(self.shards))]
        )
        per = len(order) // size
        return order[rank * per : (rank + 1) * per]


_NAMED = threading.local()
"""Per thread (tf.data decodes in several): shard -> a descriptor no other thread closes."""


def read_named(name: bytes | str) -> bytes:
    """The bytes TarShards.name names (SHARD@OFFSET:SIZE), by one positional read."""
    text = name.decode() if isinstance(name, bytes) else name
    path, _, where = text.rpartition("@")
    offset, _, size = where.partition(":")
    return _pread(_NAMED.__dict__.setdefault("open", {}), path, int(offset), int(size))


def _pread(opened: dict[str, int], path: str, offset: int, size: int) -> bytes:
    """`size` bytes at `offset` of the shard `path`, through `opened` (shard -> descriptor, at most
    OPEN_SHARDS, the longest open closed first: a rank reads its run of shards in order)."""
    try:
        if path not in opened:
            if len(opened) >= OPEN_SHARDS:
                os.close(opened.pop(next(iter(opened))))
            opened[path] = os.open(path, os.O_RDONLY)
        data = os.pread(opened[path], size, offset)
    except OSError as error:
        raise InputError(f"cannot read {path}: {error.strerror}") from None
    if len(data) != size:
        raise InputError(f"{path} is shorter than its index says: pack the folder again")
    return data


def _columns(rows: list[tuple[int, int, int, int, int]]) -> dict[str, np.ndarray]:
    """Rows of (shard, offset, size, label, format) as the index's typed columns."""
    shard, offset, size, label, suffix = (np.asarray(column) for column in zip(*rows, strict=True))
    return {
        "shard": shard.astype(np.int32), "offset": offset.astype(np.int64), "size": size.astype(np.int64),
        "label": label.astype(np.int64), "format": suffix.astype(np.int16),
    }  # fmt: skip


def _members(path: Path) -> Iterator[tuple[str, tarfile.TarInfo, int]]:
    """(key, its image member, its label) for each sample of a shard, read from the tar headers."""
    pending: dict[str, tarfile.TarInfo] = {}
    labels: dict[str, int] = {}
    try:
        with tarfile.open(path) as archive:
            for member in archive:
                if not member.isfile():
                    continue
                key, _, suffix = member.name.rpartition(".")
                if f".{suffix}" == LABEL_SUFFIX:
                    labels[key] = int(archive.extractfile(member).read().decode().strip())
                else:
                    pending[key] = member
                if key in pending and key in labels:
                    yield key, pending.pop(key), labels.pop(key)
    except (OSError, tarfile.TarError, ValueError) as error:
        raise InputError(f"{path} cannot be read as a tar shard: {error}") from None


def pack(
    source: Path, out: Path, samples_per_shard: int = 10_000, shard_bytes: int = 256 << 20, seed: int = 0
) -> dict[str, int]:
    """An image folder (source/CLASS/*.jpg) as tar shards in `out`, with their index: a shard ends
    at `samples_per_shard` samples or `shard_bytes` bytes. The samples go in a seeded random order, so
    every shard holds every class: a rank reads a run of shards, whose batches would otherwise hold
    one class each. Returns the counts of samples and shards."""
    folder = ImageFolder.scan(source)
    order = np.random.default_rng(seed).permutation(len(folder))
    out.mkdir(parents=True, exist_ok=True)
    if stale := sorted(out.glob("*.tar")):
        raise InputError(f"{out} holds tar shards already ({stale[0].name}, ...): pack into an empty folder")
    rows, formats, names = [], {}, []
    archive, count, written = None, 0, 0
    try:
        for index in order:
            relative = folder.files[index]
            if archive is None or count >= samples_per_shard or written >= shard_bytes:
                if archive is not None:
                    archive.close()
                names.append(SHARD_NAME.format(len(names)))
                # open across samples until the shard is full; closed below or in `finally`
                archive = tarfile.open(out / (names[-1] + PARTIAL), "w", format=tarfile.USTAR_FORMAT)  # noqa: SIM115
                count, written = 0, 0
            path = folder.root / relative
            suffix = path.suffix.lower()
            key = f"{len(rows):09d}"
            image = tarfile.TarInfo(f"{key}{suffix}")
            image.size = path.stat().st_size
            data_at = archive.offset + len(image.tobuf(tarfile.USTAR_FORMAT))  # after its header
            with path.open("rb") as stream:
                archive.addfile(image, stream)
            label = str(int(folder.labels[index])).encode()
            tag = tarfile.TarInfo(f"{key}{LABEL_SUFFIX}")
            tag.size = len(label)
            archive.addfile(tag, io.BytesIO(label))
            rows.append((len(names) - 1, data_at, image.size, int(folder.labels[index]),
                         formats.setdefault(suffix, len(formats))))  # fmt: skip
            count, written = count + 1, written + image.size + len(label) + 1024
        archive.close()
        with (out / (INDEX + PARTIAL)).open("wb") as stream:
            np.savez(stream, shards=np.asarray(names), formats=np.asarray(list(formats)),
                     classes=np.asarray(folder.classes), **_columns(rows))  # fmt: skip
        for name in [*names, INDEX]:  # only whole shards, and their index last, take their names
            (out / (name + PARTIAL)).rename(out / name)
    except OSError as error:
        with contextlib.suppress(OSError, AttributeError):  # None: the first shard did not open
            archive.close()
        for name in [*names, INDEX]:
            (out / (name + PARTIAL)).unlink(missing_ok=True)
        where = f" ({error.filename})" if error.filename else ""
        raise InputError(f"cannot pack {source} into {out}: {error.strerror}{where}") from None
    return {"samples": len(rows), "shards": len(names)}
