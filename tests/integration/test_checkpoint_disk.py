"""Checkpoints that the disk fails: a full folder (a tiny tmpfs) or a read-only one under
checkpoints/ ends the job in one line naming the folder and the error, and the previous complete
checkpoint is still `latest`, whole, and resumes; for torch, zero's sharded checkpoints and Keras."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from hvdtrain.errors import EXIT_WRITE_FAILED
from hvdtrain.runtime import checkpoint
from tests.support.helpers import hvdtrain

SMALL = "150k"
"""Holds one checkpoint of digits-mlp (about 100 KB), not a second beside it."""


@pytest.fixture
def tiny_folder(tmp_path):
    """checkpoints/ of a run directory as a tmpfs of the given options (needs root, as make test has)."""
    mounted: list[Path] = []

    def mount(options: str) -> Path:
        folder = tmp_path / "checkpoints"
        folder.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], check=True)
        mounted.append(folder)
        return tmp_path

    yield mount
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], check=False)


def _the_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("hvdtrain: checkpoint:")]
    assert len(lines) == 1, result.output[-3000:]
    assert "Traceback" not in result.output, result.output[-3000:]
    return lines[0]


@pytest.mark.parametrize(
    "run",
    [
        ("digits-mlp-torch",),
        ("digits-mlp-torch", "--set", "async_checkpoint=true"),
        ("digits-mlp-torch", "--strategy", "zero"),
        ("digits-mlp-tf",),
    ],
    ids=["torch", "torch-async", "zero", "keras"],
)
def test_a_full_disk_ends_the_job_in_one_line_and_keeps_the_last_checkpoint(run, tiny_folder):
    run_dir = tiny_folder(f"size={SMALL}")
    result = hvdtrain("run", *run, "--np", "2", "--set", "epochs=3", run_dir=run_dir, check=False)
    assert result.returncode == EXIT_WRITE_FAILED, result.output[-3000:]
    line = _the_line(result)
    assert f"in {run_dir / 'checkpoints'}" in line and "No space left on device (ENOSPC)" in line, line
    assert line.endswith("the latest checkpoint is still step 21"), line
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "21"
    assert checkpoint.step_names(run_dir) == ["21"]  # the step it could not write is gone
    found = checkpoint.latest(run_dir)
    assert all(status == "ok" for status in checkpoint.check(found).values())
    assert json.loads((run_dir / "run.json").read_text())["status"] == "failed"

    if run != ("digits-mlp-torch",):
        return  # the resume once there is room, once: it is every strategy's resume
    subprocess.run(["mount", "-o", "remount,size=2m", str(run_dir / "checkpoints")], check=True)
    resumed = hvdtrain("run", *run, "--np", "2", "--resume", run_dir=run_dir)
    assert (
        "resuming from" in resumed.stdout
        and json.loads((run_dir / "summary.json").read_text())["epochs"] == 3
    )


def test_a_read_only_folder_ends_the_job_before_any_checkpoint_in_one_line(tiny_folder):
    run_dir = tiny_folder("ro,size=1m")
    result = hvdtrain(
        "run", "digits-mlp-torch", "--np", "2", "--set", "epochs=2", run_dir=run_dir, check=False
    )
    assert result.returncode == EXIT_WRITE_FAILED, result.output[-3000:]
    line = _the_line(result)
    assert "Read-only file system (EROFS)" in line and line.endswith("no checkpoint (none was written)"), line


@pytest.mark.parametrize(
    ("strategy", "damage"),
    [("horovod", "flip"), ("zero", "truncate")],
    ids=["flipped-bytes", "truncated-shard"],
)
def test_a_damaged_newest_checkpoint_names_the_intact_one_and_resume_from_takes_it(
    strategy, damage, tmp_path
):
    run = ("run", "digits-mlp-torch", "--np", "2", "--strategy", strategy)
    hvdtrain(*run, "--set", "epochs=2", "--set", "keep_checkpoints=2", run_dir=tmp_path)
    newest = checkpoint.at(tmp_path, 42)
    victim = newest.path(sorted(newest.files)[-1])  # under zero, rank 1's shard
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
    else:
        del data[len(data) // 2 :]
    victim.write_bytes(bytes(data))
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}

    refused = hvdtrain(*run, "--resume", "--set", "epochs=3", run_dir=tmp_path, check=False)
    assert refused.returncode == 2, refused.output[-3000:]
    assert f"{victim} is corrupt" in refused.stderr, refused.stderr
    assert "step 21 is intact: --resume-from 21 goes on from it" in refused.stderr
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before

    resumed = hvdtrain(*run, "--resume", "--resume-from", "21", "--set", "epochs=3", run_dir=tmp_path)
    assert f"resuming from {tmp_path / 'checkpoints' / '21'}" in resumed.stdout, resumed.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["epochs"] == 3 and summary["steps"] == 63 and summary["weights_consistent"], summary
