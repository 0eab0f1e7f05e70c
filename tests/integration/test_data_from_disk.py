"""A recipe whose data is files on disk, read batch by batch by each rank's DataLoader workers."""

from __future__ import annotations

import psutil

from hvdtrain.data import write_digits_images
from tests.support.helpers import hvdtrain, summary


def test_an_image_folder_on_disk_reaches_its_bar_on_two_ranks(tmp_path):
    counts = write_digits_images(tmp_path / "pngs")
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
        f"data_dir={tmp_path / 'pngs'}",
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
    hvdtrain("run", "image-folder-tf", "--np", "2", "--set", folder, "--set", "epochs=4", run_dir=run_dir)
    done = summary(run_dir)
    assert done["test_accuracy"] >= 0.85 and done["weights_consistent"] is True
    tiff = tmp_path / "jpegs" / "test" / "7" / "extra.tiff"
    from PIL import Image

    Image.new("L", (8, 8)).save(tiff)
    result = hvdtrain("run", "image-folder-tf", "--np", "2", "--set", folder, check=False)
    assert result.returncode == 2 and result.stderr.strip().startswith(
        f"hvdtrain: error: {tiff}: tf.io.decode_image decodes only .bmp, .gif"
    ), result.stderr
