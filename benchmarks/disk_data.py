"""`make bench` section: a recipe that reads its data from disk (image-folder-torch).

- Memory per rank with 1x and 10x the files: data held as arrays grows with the data; read from disk
  batch by batch, a rank holds only the file names and the batches in flight.
- Samples per second that one loader core (one DataLoader worker) feeds from PNG and JPEG files and
  from the same images packed in tar shards, side by side.
- Memory per rank as the shard count grows tenfold over the same images."""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from hvdtrain.data import ImageFolder, TarShards, write_digits_images
from hvdtrain.data.shards import pack
from hvdtrain.measure.bench import hvdtrain_run

COPIES = (1, 10)
STEPS, EPOCHS = 20, 2
LOADER_COPIES = 10
"""The images the loader reads: 10 x the digits' 1347 training images, 13,470 small files."""
SHARD_SIZES = (1000, 100)
"""Samples per shard: the same images in 14 shards, then in 135."""


def peak_rss(out: Path, copies: int, name: str = "", samples_per_shard: int = 0) -> tuple[int, list[float]]:
    """(training files, each rank's peak RSS in MiB) of one 2-rank run on `copies` x the digits, as
    files, or packed in shards of `samples_per_shard`."""
    with tempfile.TemporaryDirectory(prefix="hvdtrain-png-") as folder:
        counts = write_digits_images(Path(folder), copies)
        data_dir = Path(folder)
        if samples_per_shard:
            for split in ("train", "test"):
                pack(data_dir / split, data_dir / "shards" / split, samples_per_shard)
            data_dir = data_dir / "shards"
        run_dir = hvdtrain_run(
            "image-folder-torch",
            "--np",
            "2",
            "--launcher",
            "gloo",
            "--set",
            f"data_dir={data_dir}",
            "--set",
            f"steps_per_epoch={STEPS}",
            "--set",
            f"epochs={EPOCHS}",
            run_dir=out / f"disk-data-x{copies}{name}",
        )
    summary = json.loads((run_dir / "summary.json").read_text())
    return counts["train"], summary["peak_rss_mib"]


def loader_rate(dataset, batch_size: int = 32) -> float:
    """Samples per second one DataLoader worker process reads and decodes, after its first batch."""
    import torch

    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=1)
    batches = iter(loader)
    next(batches)
    start, count = time.perf_counter(), 0
    for inputs, _ in batches:
        count += len(inputs)
    return count / (time.perf_counter() - start)


def loaders() -> None:
    with tempfile.TemporaryDirectory(prefix="hvdtrain-loader-") as folder:
        rates = {}
        for suffix, kind in ((".png", "PNG"), (".jpg", "JPEG")):
            root = Path(folder) / kind
            write_digits_images(root, LOADER_COPIES, suffix=suffix)
            pack(root / "train", root / "shards", SHARD_SIZES[0])
            files, shards = ImageFolder.scan(root / "train"), TarShards.open(root / "shards")
            rates[kind] = (loader_rate(files), loader_rate(shards))
            count = len(files)
    for kind, (from_files, from_shards) in rates.items():
        print(
            f"one loader core, {count:,} {kind} images (8x8): files {from_files:,.0f} samples/s, "
            f"tar shards {from_shards:,.0f} samples/s: {from_shards / from_files:.2f}x"
        )


def main(out: Path) -> None:
    loaders()
    by_shards = {size: peak_rss(out, LOADER_COPIES, f"-shards{size}", size) for size in SHARD_SIZES}
    (files, few), (_, many) = by_shards[SHARD_SIZES[0]], by_shards[SHARD_SIZES[-1]]
    counts = [-(-files // size) for size in SHARD_SIZES]
    growth = statistics.median(many) / statistics.median(few)
    print(
        f"image-folder-torch on {files:,} images in {counts[0]} shards: rank peak RSS "
        f"{', '.join(f'{p:,.0f}' for p in few)} MiB; in {counts[1]} shards: "
        f"{', '.join(f'{p:,.0f}' for p in many)} MiB: {growth:.3f}x (goal: flat, <= 1.05x)"
    )
    measured = {copies: peak_rss(out, copies) for copies in COPIES}
    for copies, (files, peaks) in measured.items():
        shown = ", ".join(f"{peak:,.0f}" for peak in peaks)
        print(f"image-folder-torch, {files:>7,} PNG files ({copies:>2}x): rank peak RSS {shown} MiB")
    (small_files, small), (large_files, large) = measured[COPIES[0]], measured[COPIES[-1]]
    growth = statistics.median(large) / statistics.median(small)
    print(
        f"rank memory at {large_files / small_files:.0f}x the files: {growth:.3f}x  (goal: flat, <= 1.05x; "
        f"as float32 arrays the training images alone would grow {small_files * 256 / 2**20:.2f} -> "
        f"{large_files * 256 / 2**20:.2f} MiB)"
    )
