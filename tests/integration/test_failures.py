"""Failures end the job with one message: a killed rank, a stalled rank, a missing extension."""

from __future__ import annotations

import json
import signal
import zipfile

import pytest
import torch

from hvdtrain.runtime import checkpoint
from tests.support.helpers import child_with_env, hvdtrain, kill_mid_run, stalled_rank_ends_the_job, summary


def _rank(rank: int):
    def is_rank(env: dict) -> bool:
        return (
            env.get("HOROVOD_RANK", env.get("OMPI_COMM_WORLD_RANK")) == str(rank)
            and "HVDTRAIN_STALL_TIMEOUT" in env
        )

    return lambda launcher_pid: child_with_env(launcher_pid, is_rank)


def _checkpoint_epoch(recipe: str, run_dir) -> int:
    found = checkpoint.latest(run_dir)
    if recipe.endswith("torch"):
        return torch.load(found.path("checkpoint.pt"), weights_only=True)["epoch"]
    with zipfile.ZipFile(found.path("checkpoint.keras")) as archive:
        return json.loads(archive.read("hvdtrain_state.json"))["epoch"]


@pytest.mark.parametrize(
    ("recipe", "launcher"),
    [("digits-mlp-torch", "mpi"), ("digits-mlp-tf", "gloo")],
)
def test_killed_rank_ends_the_job_then_resume_finishes(recipe, launcher, tmp_path):
    latest = tmp_path / "checkpoints" / "latest"
    run = ["run", recipe, "--np", "2", "--launcher", launcher, "--set", "epochs=100000"]
    killed = kill_mid_run(run, tmp_path, ready=latest, find_victim=_rank(1))
    assert killed.returncode != 0
    assert killed.seconds_to_exit < 30, (
        f"job took {killed.seconds_to_exit:.1f}s to end after a rank was killed"
    )
    assert "rank 1 failed first" in killed.stderr, killed.stderr[-3000:]
    assert not killed.orphans, "orphans left"
    assert not list(tmp_path.rglob(".hvdtrain-tmp-*")), "a half-written checkpoint was left behind"
    listed = hvdtrain("runs", "--dir", str(tmp_path)).stdout.splitlines()
    assert listed[1].split()[:4] == [recipe, "horovod", "2", "failed"], listed

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
        f"epochs={epoch + 6}",
    ]
    hvdtrain(*resumed, run_dir=tmp_path)
    done = summary(tmp_path)
    assert done["test_accuracy"] >= 0.9 and done["weights_consistent"] is True
    listed = hvdtrain("runs", str(tmp_path)).stdout.splitlines()
    assert listed[1].split()[3] == "finished", listed
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["first_started"] <= record["started"] < record["ended"], record  # the resume's own start


@pytest.mark.parametrize("launcher", ["gloo", "mpi"])  # ray: test_ray, with the other Ray jobs
def test_stalled_rank_is_named_and_the_job_ends(launcher, tmp_path):
    stalled_rank_ends_the_job(launcher, tmp_path)


@pytest.mark.parametrize("launcher", ["gloo"])  # mpi names a stopped rank as it names any stall
def test_a_stopped_rank_is_a_stall_named_in_time_without_a_traceback(launcher, tmp_path):
    """SIGSTOP to rank 1 alone: the other rank's watchdog names it at the stall timeout (Gloo's own
    timeout, which would end the job with a bare traceback, comes only well after)."""
    args = ["run", "synthetic-torch", "--np", "2", "--launcher", launcher, "--stall-timeout", "10"]
    args += ["--set", "epochs=1000", "--set", "steps_per_epoch=5"]
    stopped = kill_mid_run(
        args, tmp_path, ready=tmp_path / "metrics.jsonl", find_victim=_rank(1), signum=signal.SIGSTOP
    )
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    assert "stall: rank 0 waited" in stopped.stderr and "missing ranks: 1" in stopped.stderr, stopped.stderr
    assert "Traceback" not in stopped.stderr, stopped.stderr[-3000:]
    assert stopped.seconds_to_exit < 10 + 8, f"{stopped.seconds_to_exit:.1f} s after the rank stopped"
    assert not stopped.orphans, f"left running: {stopped.orphans}"
    print(
        f"\n{launcher}: a stopped rank (--stall-timeout 10) ended the job in {stopped.seconds_to_exit:.1f} s"
    )
