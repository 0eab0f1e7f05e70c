"""A recipe whose data is files on disk (image folders, tar shards), read batch by batch by each rank."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import psutil
import pytest

from hvdtrain.data import write_digits_images
from tests.support.helpers import Result, hvdtrain, summary


@pytest.fixture(scope="module")
def pngs(tmp_path_factory) -> tuple[Path, dict[str, int]]:
    """The digits as a PNG folder, written once: a run trains on it, a pack reads it (neither writes
    to it). The folder, and the images written per split."""
    folder = tmp_path_factory.mktemp("digits") / "pngs"
    return folder, write_digits_images(folder)


def test_an_image_folder_on_disk_reaches_its_bar_on_two_ranks(tmp_path, pngs):
    folder, counts = pngs
    assert counts == {"train": 1347, "test": 450}
    run_dir = tmp_path / "run"
    hvdtrain(
        "run",
        "image-folder-torch",
        "--np",
        "2",
        "--launcher",
        "gloo",
        "--set",
        f"data_dir={folder}",
        "--set",
        "epochs=6",
        run_dir=run_dir,
    )
    done = summary(run_dir)
    assert done["test_accuracy"] >= 0.9 and done["weights_consistent"] is True
    assert done["steps"] == 6 * (1347 // 2 // 32)
    assert len(done["peak_rss_mib"]) == 2 and all(
        0 < peak < psutil.virtual_memory().total / 2**20 for peak in done["peak_rss_mib"]
    )


def test_a_missing_image_folder_is_one_line_before_any_rank_starts(tmp_path):
    result = hvdtrain("run", "image-folder-torch", "--np", "2", "--set", f"data_dir={tmp_path}", check=False)
    assert result.returncode == 2
    expected = f"expected {tmp_path}/train/CLASS/*.png (or .jpg, ...)"
    assert result.stderr.strip() == f"hvdtrain: error: no image folder at {tmp_path}/train: {expected}"
    assert not list(tmp_path.iterdir()), "nothing written"


def test_a_jpeg_folder_trains_image_folder_tf_and_a_format_tf_cannot_decode_is_one_line(tmp_path):
    """tf.data decodes JPEG like PNG; a TIFF (which Pillow, and so the torch recipes, read) is named
    before any rank starts."""
    write_digits_images(tmp_path / "jpegs", suffix=".jpg")
    run_dir = tmp_path / "run"
    folder = f"data_dir={tmp_path / 'jpegs'}"
    hvdtrain("run", "image-folder-tf", "--np", "2", "--set", folder, "--set", "epochs=3", run_dir=run_dir)
    done = summary(run_dir)
    assert done["test_accuracy"] >= 0.85 and done["weights_consistent"] is True  # 0.95 after epoch 3
    tiff = tmp_path / "jpegs" / "test" / "7" / "extra.tiff"
    from PIL import Image

    Image.new("L", (8, 8)).save(tiff)
    result = hvdtrain("run", "image-folder-tf", "--np", "2", "--set", folder, check=False)
    assert result.returncode == 2 and result.stderr.strip().startswith(
        f"hvdtrain: error: {tiff}: tf.io.decode_image decodes only .bmp, .gif"
    ), result.stderr


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> tuple[Path, Result]:
    """A JPEG folder packed into shards, the folder then removed (the shards alone): the same pack for
    both frameworks, done once. The folder holding shards/, and `hvdtrain data pack`'s result."""
    base = tmp_path_factory.mktemp("packed")
    write_digits_images(base / "jpegs", suffix=".jpg")
    result = hvdtrain("data", "pack", str(base / "jpegs"), str(base / "shards"), "--samples-per-shard", "150")
    shutil.rmtree(base / "jpegs")
    return base, result


SHARD_EPOCHS = {"image-folder-torch": 4, "image-folder-tf": 3}
"""Well past the bar of 0.85: 0.95 (torch) and 0.97 (tf) after these epochs, 0.87 and 0.90 an epoch before."""


@pytest.mark.parametrize("recipe", ["image-folder-torch", "image-folder-tf"])
def test_tar_shards_packed_from_a_jpeg_folder_train_both_frameworks(recipe, tmp_path, packed):
    """`hvdtrain data pack` writes WebDataset-style shards that both frameworks read (torch: each
    rank a run of shards through DataLoader workers; tf.data: by offset), to the folder's bar."""
    base, result = packed
    assert result.stdout.splitlines() == [
        f"{base}/jpegs/train -> {base}/shards/train: 1,347 samples in 9 shards",
        f"{base}/jpegs/test -> {base}/shards/test: 450 samples in 3 shards",
    ]
    assert not (base / "jpegs").exists(), "the shards alone"
    run_dir, epochs = tmp_path / "run", SHARD_EPOCHS[recipe]
    hvdtrain(
        "run", recipe, "--np", "2", "--set", f"data_dir={base / 'shards'}", "--set", f"epochs={epochs}",
        run_dir=run_dir,
    )  # fmt: skip
    done = summary(run_dir)
    assert done["test_accuracy"] >= 0.85 and done["weights_consistent"] is True
    assert done["steps"] == epochs * (1347 // 2 // 32)


def test_a_pack_that_runs_out_of_disk_leaves_no_shard_and_says_so_in_one_line(tmp_path, pngs):
    folder, _ = pngs
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)], check=True)
    try:
        result = hvdtrain("data", "pack", str(folder / "train"), str(small / "out"), check=False)
        assert result.returncode == 2 and result.stderr.strip() == (
            f"hvdtrain: error: cannot pack {folder}/train into {small}/out: No space left on device"
        ), result.stderr
        assert list((small / "out").iterdir()) == [], "no half-written shard or index left"
    finally:
        subprocess.run(["umount", str(small)], check=True)
