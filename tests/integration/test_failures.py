"""Failures end the job with one message: a killed rank, a stalled rank, a missing extension."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import psutil
import pytest
import torch
from conftest import PROGRAMS, hvdtrain, summary


def _rank_process(launcher_pid: int, rank: int) -> psutil.Process | None:
    for child in psutil.Process(launcher_pid).children(recursive=True):
        try:
            env = child.environ()
            child_rank = env.get("HOROVOD_RANK", env.get("OMPI_COMM_WORLD_RANK"))
            if "hvdtrain.worker" in " ".join(child.cmdline()) and child_rank == str(rank):
                return child
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


def _checkpoint_epoch(recipe: str, run_dir) -> int:
    if recipe.endswith("torch"):
        return torch.load(run_dir / "checkpoint.pt", weights_only=True)["epoch"]
    return json.loads((run_dir / "checkpoint.state.json").read_text())["epoch"]


@pytest.mark.parametrize(
    ("recipe", "launcher"),
    [("digits-mlp-torch", "gloo"), ("digits-mlp-torch", "mpi"), ("digits-mlp-tf", "gloo")],
)
def test_killed_rank_ends_the_job_then_resume_finishes(recipe, launcher, tmp_path):
    checkpoint = tmp_path / ("checkpoint.pt" if recipe.endswith("torch") else "checkpoint.state.json")
    run = [
        "run",
        recipe,
        "--np",
        "2",
        "--launcher",
        launcher,
        "--set",
        "epochs=100000",
        "--run-dir",
        str(tmp_path),
    ]
    stderr_path = tmp_path / "job.stderr"
    with stderr_path.open("w") as stderr:
        job = subprocess.Popen(
            [sys.executable, "-m", "hvdtrain", *run], stdout=subprocess.DEVNULL, stderr=stderr
        )
    try:
        deadline = time.monotonic() + 120
        victim = None
        while time.monotonic() < deadline and not (victim and checkpoint.exists()):
            victim = victim or _rank_process(job.pid, 1)
            time.sleep(0.2)
        assert victim is not None and checkpoint.exists(), "training never got going"
        family = psutil.Process(job.pid).children(recursive=True)
        victim.kill()
        killed_at = time.monotonic()
        job.wait(timeout=60)
        elapsed = time.monotonic() - killed_at
    finally:
        job.kill()
    assert job.returncode != 0
    assert elapsed < 30, f"job took {elapsed:.1f}s to end after a rank was killed"
    stderr = stderr_path.read_text()
    assert "rank 1 failed first" in stderr, stderr[-3000:]
    time.sleep(1)
    assert not [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], "orphans left"

    epoch = _checkpoint_epoch(recipe, tmp_path)
    assert epoch >= 1
    resumed = [
        "run",
        recipe,
        "--np",
        "2",
        "--launcher",
        launcher,
        "--resume",
        "--set",
        f"epochs={epoch + 15}",
    ]
    hvdtrain(*resumed, run_dir=tmp_path)
    done = summary(tmp_path)
    assert done["test_accuracy"] >= 0.95 and done["weights_consistent"] is True


@pytest.mark.parametrize("launcher", ["gloo", "mpi"])
def test_stalled_rank_is_named_and_the_job_ends(launcher, tmp_path):
    started = time.monotonic()
    result = hvdtrain(
        "run",
        str(PROGRAMS / "stall_torch.py"),
        "--np",
        "2",
        "--stall-timeout",
        "6",
        "--launcher",
        launcher,
        check=False,
        timeout=90,
        run_dir=tmp_path,
    )
    assert result.returncode != 0
    assert time.monotonic() - started < 60
    message = result.stderr.strip().splitlines()
    assert "never.completed" in result.stderr and "missing ranks: 1" in result.stderr.lower(), result.output[
        -3000:
    ]
    assert message[-1].startswith("logs:")
