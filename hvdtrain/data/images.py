"""Images on disk, one folder per class, read one at a time: every format Pillow decodes for torch,
and the ones tf.io.decode_image decodes for TensorFlow."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from hvdtrain.errors import InputError


def image_suffixes() -> frozenset[str]:
    """The file suffixes Pillow opens (PNG, JPEG, BMP, GIF, TIFF, WebP, ...): an image folder's files."""
    from PIL import Image

    Image.init()
    return frozenset(suffix.lower() for suffix in Image.registered_extensions())


TF_IMAGE_SUFFIXES = frozenset({".bmp", ".gif", ".jpg", ".jpeg", ".jpe", ".jfif", ".png", ".webp"})
"""The formats tf.io.decode_image reads (BMP, GIF, JPEG, PNG, WebP): what a tf.data pipeline decodes."""


def decoded(source: Path | BinaryIO, name: str) -> np.ndarray:
    """An image file's pixels as float32 in [0, 1], channels first (1 for grey, 3 for colour); an
    InputError naming `name` where Pillow cannot decode it."""
    from PIL import Image

    try:
        with Image.open(source) as image:
            pixels = np.asarray(image.convert("L" if image.mode in ("L", "LA", "I", "1") else "RGB"))
        if image.mode == "P" and (pixels == pixels[..., :1]).all():  # a grey palette: one channel
            pixels = pixels[..., 0]
    except OSError as error:
        raise InputError(f"{name} cannot be read as an image: {error}") from None
    pixels = pixels.astype(np.float32) / 255.0
    return pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)


@dataclass(frozen=True)
class ImageFolder:
    """Images on disk, one folder per class (`root/CLASS/NAME.jpg`, classes sorted by name give the
    labels), in any format Pillow reads, read one at a time when asked: a map-style dataset (`len`,
    `[i]` -> (image, label)) that torch's DataLoader reads with worker processes. Only the file names
    are held in memory, so a rank's memory stays flat however many files there are."""

    root: Path
    files: tuple[str, ...]
    """Paths relative to root, in a fixed order (class, then name): every rank indexes the same."""
    labels: np.ndarray
    classes: tuple[str, ...]

    @classmethod
    def scan(cls, root: Path | str) -> ImageFolder:
        root = Path(root)
        if not root.is_dir():
            raise InputError(f"no image folder at {root}: expected {root}/CLASS/*.png (or .jpg, ...)")
        files, labels, suffixes = [], [], image_suffixes()
        try:
            classes = tuple(sorted(entry.name for entry in root.iterdir() if entry.is_dir()))
            for label, name in enumerate(classes):
                found = sorted(p.name for p in (root / name).iterdir() if p.suffix.lower() in suffixes)
                files += [f"{name}/{file}" for file in found]
                labels += [label] * len(found)
        except OSError as error:
            raise InputError(
                f"cannot read the image folder {error.filename or root}: {error.strerror}"
            ) from None
        if not files:
            raise InputError(
                f"no image files in the class folders of {root} (expected {root}/CLASS/*.png, .jpg, ...)"
            )
        return cls(root, tuple(files), np.asarray(labels, dtype=np.int64), classes)

    def only(self, suffixes: frozenset[str], reader: str) -> None:
        """Raises InputError naming the first file whose format `reader` does not decode."""
        for name in self.files:
            if Path(name).suffix.lower() not in suffixes:
                known = ", ".join(sorted(suffixes))
                raise InputError(
                    f"{self.root / name}: {reader} decodes only {known}; convert it "
                    "(the torch recipes read it as it is, with Pillow)"
                )

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.int64]:
        """The image as float32 in [0, 1], channels first (1 for grey, 3 for colour), and its label."""
        path = self.root / self.files[index]
        return decoded(path, str(path)), self.labels[index]

    def shape(self) -> tuple[int, ...]:
        """One image's shape (channels, height, width), from the first file."""
        return self[0][0].shape
