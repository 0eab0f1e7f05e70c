"""A recipe whose data is files on disk, read batch by batch by each rank's DataLoader workers."""

from __future__ import annotations

import psutil

from hvdtrain.data import write_digits_png
from tests.support.helpers import hvdtrain, summary


def test_an_image_folder_on_disk_reaches_its_bar_on_two_ranks(tmp_path):
    counts = write_digits_png(tmp_path / "pngs")
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
    assert (
        result.stderr.strip()
        == f"hvdtrain: error: no image folder at {tmp_path}/train: expected {tmp_path}/train/CLASS/*.png"
    )
    assert not list(tmp_path.iterdir()), "nothing written"
