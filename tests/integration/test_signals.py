"""A signal to hvdtrain ends the whole job: every rank, within seconds, with one line and exit code
128 + signal. SIGTERM (timeout, systemd, Slurm, docker stop) lets the ranks stop at one step and
checkpoint there first; a closed terminal and Ctrl-C end them at once; SIGUSR1 (a preemption warning)
stops them at one step with exit 0."""

from __future__ import annotations

import json
import signal

import numpy as np
import psutil
import pytest

from hvdtrain.runtime import checkpoint
from tests.support.helpers import child_with_env, final_weights, hvdtrain, kill_mid_run, summary


def _the_cli_once_ranks_run(launcher_pid: int):
    """hvdtrain itself, once its ranks (or torchrun's workers) are up."""
    ranks = child_with_env(launcher_pid, lambda env: "HVDTRAIN_THREADS_PER_RANK" in env)
    return psutil.Process(launcher_pid) if ranks else None


@pytest.mark.parametrize(
    ("signum", "strategy_args"),
    [
        (signal.SIGHUP, ["--launcher", "mpi"]),
        (signal.SIGINT, ["--launcher", "gloo"]),
        (signal.SIGINT, ["--strategy", "ddp"]),
    ],
)
def test_a_signal_to_the_cli_ends_every_rank(signum, strategy_args, tmp_path):
    args = ["run", "synthetic-torch", "--np", "2", *strategy_args, "--set", "epochs=1000"]
    args += ["--set", "steps_per_epoch=5"]
    stopped = kill_mid_run(
        args, tmp_path, ready=tmp_path / "metrics.jsonl", find_victim=_the_cli_once_ranks_run, signum=signum
    )
    assert stopped.returncode == 128 + signum, stopped.stderr[-3000:]
    assert stopped.seconds_to_exit < 10, f"{stopped.seconds_to_exit:.1f}s to end the job"
    assert not stopped.orphans, f"left running: {stopped.orphans}"
    name = signal.Signals(signum).name
    assert f"hvdtrain: stopped by {name}: every rank was ended" in stopped.stderr, stopped.stderr[-3000:]
    assert "failed first" not in stopped.stderr
    epochs_then = (tmp_path / "metrics.jsonl").read_text()
    psutil.wait_procs([], timeout=2)
    assert (tmp_path / "metrics.jsonl").read_text() == epochs_then, "a rank is still writing the run dir"
    strategy = "ddp" if "ddp" in strategy_args else "horovod"
    listed = hvdtrain("runs", "--dir", str(tmp_path)).stdout.splitlines()
    assert listed[1].split()[:4] == ["synthetic-torch", strategy, "2", "interrupted"], listed
    shown = hvdtrain("show", str(tmp_path)).stdout
    assert f"interrupted (by {name}, exit code {128 + signum})" in shown, shown
    assert (tmp_path / "curves.png").exists()


@pytest.mark.parametrize("strategy_args", [["--launcher", "gloo"], ["--strategy", "ddp"]])
def test_sigterm_stops_every_rank_at_one_step_checkpointed_and_the_run_is_interrupted(
    strategy_args, tmp_path
):
    """What a scheduler's or a container's stop sends: the ranks agree on a step, checkpoint there
    (a step checkpoint: the stop falls inside an epoch of 7 steps) and end; the run is interrupted."""
    args = ["run", "synthetic-torch", "--np", "2", *strategy_args, "--set", "epochs=1000"]
    args += ["--set", "steps_per_epoch=7", "--set", "checkpoint=true"]
    stopped = kill_mid_run(
        args,
        tmp_path,
        ready=tmp_path / "metrics.jsonl",
        find_victim=_the_cli_once_ranks_run,
        signum=signal.SIGTERM,
    )
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    assert stopped.seconds_to_exit < 10, f"{stopped.seconds_to_exit:.1f}s to end the job"
    assert not stopped.orphans, f"left running: {stopped.orphans}"
    assert "hvdtrain: stopped by SIGTERM: every rank stopped after step" in stopped.stderr, stopped.stderr[
        -3000:
    ]
    assert "its checkpoint saved; --resume" in stopped.stderr and "failed first" not in stopped.stderr
    step = json.loads((tmp_path / "preempted.json").read_text())["step"]
    assert step % 5 == 0, "stopped at an agreed step"
    assert checkpoint.latest(tmp_path).step == step, "the checkpoint is of the step they stopped at"
    strategy = "ddp" if "ddp" in strategy_args else "horovod"
    listed = hvdtrain("runs", "--dir", str(tmp_path)).stdout.splitlines()
    assert listed[1].split()[:4] == ["synthetic-torch", strategy, "2", "interrupted"], listed
    shown = hvdtrain("show", str(tmp_path)).stdout
    assert "interrupted (by SIGTERM, exit code 143)" in shown, shown
    print(f"\n{strategy}: SIGTERM to every rank stopped at step {step}: {stopped.seconds_to_exit:.1f} s")


@pytest.mark.parametrize("launcher", ["gloo"])  # through srun and MPI: test_slurm's preempted job
def test_sigusr1_stops_every_rank_at_one_step_checkpointed_and_a_resume_is_bit_exact(
    launcher, tmp_path, shared_runs
):
    """The preemption warning: hvdtrain passes SIGUSR1 on, the ranks agree on a step, checkpoint
    there and end; hvdtrain exits 0 with the run `preempted`, and --resume ends with the weights of
    the uninterrupted run, bit for bit."""
    args = ["digits-mlp-torch", "--np", "2", "--launcher", launcher, "--set", "epochs=15"]
    straight = shared_runs.run(*args).run_dir
    stopped = kill_mid_run(
        ["run", *args],
        tmp_path,
        ready=tmp_path / "metrics.jsonl",
        find_victim=_the_cli_once_ranks_run,
        signum=signal.SIGUSR1,
    )
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert not stopped.orphans, f"left running: {stopped.orphans}"
    assert "hvdtrain: preempted: every rank stopped after step" in stopped.stderr, stopped.stderr[-3000:]
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["status"] == "preempted" and record["exit_code"] == 0
    step = json.loads((tmp_path / "preempted.json").read_text())["step"]
    assert step % 5 == 0 and step < 15 * 21, "stopped at an agreed step, before the end"
    assert checkpoint.latest(tmp_path).step == step, "the checkpoint is of the step they stopped at"
    listed = hvdtrain("runs", "--dir", str(tmp_path)).stdout.splitlines()
    assert listed[1].split()[:4] == ["digits-mlp-torch", "horovod", "2", "preempted"], listed
    resumed = hvdtrain("run", "digits-mlp-torch", "--resume", run_dir=tmp_path)
    assert "resuming from" in resumed.output
    for a, b in zip(final_weights(straight), final_weights(tmp_path), strict=True):
        np.testing.assert_array_equal(a, b)
    assert summary(tmp_path)["parameter_digest"] == summary(straight)["parameter_digest"]
