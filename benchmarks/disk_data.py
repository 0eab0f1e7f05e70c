"""`make bench` section: memory per rank of a recipe that reads its data from disk
(image-folder-torch), with 1x and 10x the files. Data held as arrays grows with the data; read from
disk batch by batch, a rank holds only the file names and the batches in flight."""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path

from hvdtrain.data import write_digits_images
from hvdtrain.measure.bench import hvdtrain_run

COPIES = (1, 10)
STEPS, EPOCHS = 20, 2


def peak_rss(out: Path, copies: int) -> tuple[int, list[float]]:
    """(training files, each rank's peak RSS in MiB) of one 2-rank run on `copies` x the digits."""
    with tempfile.TemporaryDirectory(prefix="hvdtrain-png-") as folder:
        counts = write_digits_images(Path(folder), copies)
        run_dir = hvdtrain_run(
            "image-folder-torch",
            "--np",
            "2",
            "--launcher",
            "gloo",
            "--set",
            f"data_dir={folder}",
            "--set",
            f"steps_per_epoch={STEPS}",
            "--set",
            f"epochs={EPOCHS}",
            run_dir=out / f"disk-data-x{copies}",
        )
    summary = json.loads((run_dir / "summary.json").read_text())
    return counts["train"], summary["peak_rss_mib"]


def main(out: Path) -> None:
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
