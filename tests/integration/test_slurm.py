"""hvdtrain on a real Slurm cluster (tests/support/slurm.py, on the namespace hosts): inside an
sbatch allocation with no --hosts, `hvdtrain submit` with --launcher srun, and a preempted job that
requeues itself and resumes bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from hvdtrain.launching.rank_output import rank_output_files
from hvdtrain.runtime import checkpoint
from tests.support.helpers import PROGRAMS, final_weights

BAR = 0.9
RUN = ["digits-mlp-torch", "--set", "epochs=6"]


def sbatch_script(run_dir: Path, nodes: int, tasks: int) -> str:
    """What a user writes: one `hvdtrain run` line, no --hosts."""
    return "\n".join(
        [
            "#!/bin/bash",
            f"#SBATCH --nodes={nodes}",
            f"#SBATCH --ntasks-per-node={tasks}",
            f"#SBATCH --output={run_dir}.out",
            f"exec {sys.executable} -m hvdtrain run {' '.join(RUN)} --run-dir {run_dir}",
            "",
        ]
    )


def submitted_job(output: str) -> str:
    line = next(line for line in output.splitlines() if line.startswith("submitted Slurm job "))
    return line.split()[3].rstrip(":")


def trained(run_dir: Path, world_size: int) -> dict:
    found = json.loads((run_dir / "summary.json").read_text())
    assert found["world_size"] == world_size and found["weights_consistent"] is True, found
    assert found["test_accuracy"] >= BAR, found
    return found


@pytest.fixture(scope="module")
def submitted(slurm, tmp_path_factory):
    """`hvdtrain submit` on 2 nodes x 2 tasks with --launcher srun, run to its end: the run of the
    submit test, and the uninterrupted run the requeued one must equal."""
    base = tmp_path_factory.mktemp("submitted")  # /tmp: a disk every node shares
    run_dir = base / "run"
    started = time.monotonic()
    argv = [sys.executable, "-m", "hvdtrain", "submit", *RUN, "--nodes", "2", "--ntasks-per-node", "2"]
    done = slurm.run([*argv, "--launcher", "srun", "--run-dir", str(run_dir)], cwd=base, timeout=60)
    assert done.returncode == 0, done.stderr
    job = submitted_job(done.stdout)
    final = slurm.wait_job_gone(job, timeout=240)
    return run_dir, job, final, time.monotonic() - started


def test_an_sbatch_script_trains_on_the_allocations_nodes_and_collects_every_ranks_log(slurm, rig):
    """The nodes share no disk (the run directory is on each host's private disk): the run directory
    is staged to node 2 by a Slurm step, and its ranks' logs come back to node 1 after the job."""
    name = f"sbatch-{time.monotonic_ns()}"
    run_dir = rig.disk / name  # in the job: node 1's private disk, and node 2's
    done = slurm.run(["sbatch", "--parsable"], input=sbatch_script(run_dir, 2, 1), timeout=60)
    assert done.returncode == 0, done.stderr
    job = done.stdout.strip().split(";")[0]
    final = slurm.wait_job_gone(job, timeout=240)
    on_node_1 = rig.private_disk(1) / name
    output = Path(f"{on_node_1}.out").read_text()
    assert final["JobState"] == "COMPLETED", output[-3000:]
    assert f"hvdtrain: inside Slurm job {job}: --np 2 on its 2 nodes hvdhost1,hvdhost2, 1 task each" in output
    assert f"hvdtrain: --launcher auto chose srun (inside Slurm job {job})" in output
    trained(on_node_1, 2)
    assert set(rank_output_files(on_node_1 / "logs")) == {0, 1}, "rank 1's log, collected from node 2"
    assert "epoch 6/6" in rank_output_files(on_node_1 / "logs")[0].read_text()
    record = json.loads((on_node_1 / "run.json").read_text())
    assert (record["status"], record["slurm_job_id"], record["slurm_state"]) == ("finished", job, "COMPLETED")
    assert (rig.private_disk(2) / name / "config.json").exists(), "staged to node 2 through Slurm"


def test_submit_with_srun_trains_four_ranks_and_runs_shows_the_job(slurm, submitted):
    run_dir, job, final, seconds = submitted
    output = (run_dir / f"slurm-{job}.out").read_text()
    assert final["JobState"] == "COMPLETED", output[-3000:]
    found = trained(run_dir, 4)
    assert set(rank_output_files(run_dir / "logs")) == {0, 1, 2, 3}
    script = (run_dir / "submit.sbatch").read_text()
    assert "#SBATCH --nodes=2" in script and "#SBATCH --requeue" in script and "\nexec " in script
    listed = slurm.run([sys.executable, "-m", "hvdtrain", "runs", str(run_dir)]).stdout.splitlines()
    assert listed[0].split()[4] == "SLURM" and listed[1].split()[3:6] == ["finished", job, "COMPLETED"], (
        listed
    )
    print(f"\nsubmit to the end: {seconds:.1f} s, {found['samples_per_sec']:.0f} samples/s")


def test_a_preempted_job_checkpoints_requeues_itself_and_resumes_bit_for_bit(slurm, submitted, tmp_path):
    """scancel --signal=USR1 --batch, the warning Slurm sends before a time limit or preemption: the
    ranks stop at one step with a checkpoint, the job requeues itself, and the requeued job resumes
    the run to the uninterrupted run's weights."""
    straight = submitted[0]
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "hvdtrain", "submit", *RUN, "--nodes", "2", "--ntasks-per-node", "2"]
    done = slurm.run([*argv, "--launcher", "srun", "--run-dir", str(run_dir)], cwd=tmp_path, timeout=60)
    assert done.returncode == 0, done.stderr
    job = submitted_job(done.stdout)
    slurm.wait_job_writes(job, run_dir / "metrics.jsonl", run_dir / f"slurm-{job}.out")  # training has begun
    signalled = time.monotonic()
    warned = slurm.run(["scancel", "--signal=USR1", "--batch", job])
    assert warned.returncode == 0, warned.stderr
    final = slurm.wait_job_gone(job, timeout=300)
    output = (run_dir / f"slurm-{job}.out").read_text()
    assert final["JobState"] == "COMPLETED" and final["Restarts"] == "1", (final, output[-3000:])
    assert "hvdtrain: preempted: every rank stopped after step" in output
    assert f"hvdtrain: Slurm job {job} requeued" in output
    assert f"hvdtrain: inside Slurm job {job}, requeued (restart 1): the run resumes" in output
    record = json.loads((run_dir / "run.json").read_text())
    assert (record["status"], record["slurm_restart_count"]) == ("finished", 1)
    for a, b in zip(final_weights(straight), final_weights(run_dir), strict=True):
        np.testing.assert_array_equal(a, b)
    print(f"\nUSR1 to the requeued job's end: {time.monotonic() - signalled:.1f} s")


def test_a_job_suspended_past_the_stall_timeout_goes_on_to_the_same_weights(slurm, submitted, tmp_path):
    """scontrol suspend (gang scheduling, an admin) stops every task and hvdtrain with SIGSTOP, resume
    continues them: the ranks stopped together, which is no stall, even past --stall-timeout."""
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "hvdtrain", "submit", *RUN, "--nodes", "2", "--ntasks-per-node", "2"]
    argv += ["--launcher", "srun", "--stall-timeout", "8", "--run-dir", str(run_dir)]
    job = submitted_job(slurm.run(argv, cwd=tmp_path, timeout=60).stdout)
    slurm.wait_job_writes(job, run_dir / "metrics.jsonl", run_dir / f"slurm-{job}.out")
    assert slurm.run(["scontrol", "suspend", job]).returncode == 0
    time.sleep(12)  # past the stall timeout (Horovod's own backstop comes at three)
    assert slurm.job(job)["JobState"] == "SUSPENDED"
    assert slurm.run(["scontrol", "resume", job]).returncode == 0
    final = slurm.wait_job_gone(job, timeout=180)
    output = (run_dir / f"slurm-{job}.out").read_text()
    assert final["JobState"] == "COMPLETED" and "stall" not in output, output[-3000:]
    for a, b in zip(final_weights(submitted[0]), final_weights(run_dir), strict=True):
        np.testing.assert_array_equal(a, b)


def test_ddp_in_an_allocation_runs_torchrun_once_on_each_node(slurm, tmp_path):
    run_dir = tmp_path / "run"
    script = sbatch_script(run_dir, 2, 2).replace(" ".join(RUN), " ".join([*RUN, "--strategy", "ddp"]))
    job = slurm.run(["sbatch", "--parsable"], input=script, timeout=60).stdout.strip().split(";")[0]
    final = slurm.wait_job_gone(job, timeout=240)
    output = Path(f"{run_dir}.out").read_text()
    assert final["JobState"] == "COMPLETED", output[-3000:]
    found = trained(run_dir, 4)
    assert found["hosts"] == ["hvdhost1", "hvdhost1", "hvdhost2", "hvdhost2"], found["hosts"]
    assert set(rank_output_files(run_dir / "logs")) == {0, 1, 2, 3}, "ranks 2, 3: node 2's, by global rank"


def test_hvdtrain_outside_an_allocation_refuses_srun(slurm):
    done = subprocess.run(
        [sys.executable, "-m", "hvdtrain", "run", "digits-mlp-torch", "--launcher", "srun"],
        env=slurm.env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "hvdtrain: error: --launcher srun runs inside a Slurm allocation (salloc, sbatch); "
        "SLURM_JOB_ID is not set"
    ]


def job_processes(rig) -> list[str]:
    """hvdtrain's processes and the job's steps on the nodes (the daemons are not the job's)."""
    return [
        command
        for found in rig.all_processes().values()
        for _, command in found
        if "hvdtrain" in command or "slurmstepd" in command or command.startswith("srun")
    ]


def test_a_failed_task_is_named_by_its_node_and_rank(slurm, rig, tmp_path):
    script = sbatch_script(tmp_path / "run", 2, 1).replace(" ".join(RUN), str(PROGRAMS / "exit_code.py"))
    done = slurm.run(["sbatch", "--parsable"], input=script, timeout=60)
    job = done.stdout.strip().split(";")[0]
    final = slurm.wait_job_gone(job, timeout=120)
    output = (tmp_path / "run.out").read_text()
    assert (final["JobState"], final["ExitCode"]) == ("FAILED", "1:0"), output[-3000:]
    assert "hvdtrain: rank 1 on hvdhost2 failed first (exit code 2)" in output, output[-3000:]


def test_scancel_checkpoints_then_ends_every_task_on_every_node_and_the_run_is_interrupted(
    slurm, rig, tmp_path
):
    """Under --strategy zero over srun: every rank checkpoints its own slice of the state."""
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "hvdtrain", "submit", "digits-mlp-torch", "--set", "epochs=1000"]
    argv += [
        "--nodes",
        "2",
        "--ntasks-per-node",
        "1",
        "--strategy",
        "zero",
        "--run-dir",
        str(run_dir),
    ]
    job = submitted_job(slurm.run(argv, cwd=tmp_path, timeout=60).stdout)
    slurm.wait_job_writes(job, run_dir / "metrics.jsonl", run_dir / f"slurm-{job}.out")
    assert any("hvdtrain.worker" in command for command in job_processes(rig))
    cancelled = time.monotonic()
    assert slurm.run(["scancel", job]).returncode == 0
    final = slurm.wait_job_gone(job, timeout=60)
    assert final["JobState"] == "CANCELLED"
    while (left := job_processes(rig)) and time.monotonic() < cancelled + 20:
        time.sleep(0.2)
    assert left == [], left
    record = json.loads((run_dir / "run.json").read_text())
    assert (record["status"], record["signal"], record["slurm_state"]) == (
        "interrupted",
        "SIGTERM",
        "CANCELLED",
    )
    left_at = time.monotonic() - cancelled
    # Slurm's SIGTERM reached every task: they stopped at one step and checkpointed it before its SIGKILL
    step = json.loads((run_dir / "preempted.json").read_text())["step"]
    found = checkpoint.latest(run_dir)
    assert step % 5 == 0 and found.step == step
    assert found.files == ("model.pt", "optimizer.0.pt", "optimizer.1.pt") and set(
        checkpoint.check(found).values()
    ) == {"ok"}
    output = (run_dir / f"slurm-{job}.out").read_text()
    assert f"stopped by SIGTERM: every rank stopped after step {step}, its checkpoint saved" in output, output
    print(f"\nscancel to nothing left: {left_at:.1f} s, every rank stopped at step {step}")
