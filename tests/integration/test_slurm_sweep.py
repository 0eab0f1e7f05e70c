"""`hvdtrain sweep --submit` on a real Slurm cluster of four nodes (tests/support/slurm.py on the rig's
hosts): one batch job holds the sweep, two trials of two nodes each run at once as steps of it, and
a preemption warning halfway requeues the job, whose sweep ends with every trial complete and none
trained twice."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from tests.integration.test_slurm import submitted_job
from tests.support.helpers import PROGRAMS

pytest.importorskip("optuna", reason="hvdtrain[sweep]: make install installs it")

SLURM_NODES = 4
"""The slurm fixture's nodes (tests/integration/conftest.py)."""
EPOCHS = 3
SWEEP = [
    str(PROGRAMS / "slow_steps_torch.py"), "--set", f"epochs={EPOCHS}", "--set", "batch_size=16",
    "--np", "2", "--param", "lr=log:0.02:0.1", "--trials", "4", "--pruner", "none", "--concurrent", "2",
]  # fmt: skip
# batch 16: an epoch of 42 steps a rank, each of 30 ms or more, so that the preemption comes while
# trials 2 and 3 train however idle the machine


def trial_epochs(trial: Path) -> list[int]:
    lines = (trial / "metrics.jsonl").read_text().splitlines() if (trial / "metrics.jsonl").exists() else []
    return [record["epoch"] for record in map(json.loads, lines) if "epoch" in record]  # not the step records


def commands(trial: Path) -> list[str]:
    """The `hvdtrain run` lines the sweep started this trial with, in order."""
    return [line for line in (trial / "sweep-trial.log").read_text().splitlines() if line.startswith("$ ")]


def wait_for(condition, what: str, output: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            tail = output.read_text()[-3000:] if output.exists() else "(no output)"
            raise AssertionError(f"{what} not seen in {timeout:.0f} s\n{tail}")
        time.sleep(0.2)


def test_a_submitted_sweep_runs_two_trials_of_two_nodes_at_once_and_a_preemption_loses_nothing(
    slurm, tmp_path
):
    sweep_dir = tmp_path / "sweep"  # /tmp: a disk every node shares
    argv = [sys.executable, "-m", "hvdtrain", "sweep", *SWEEP, "--submit", "--nodes", "4", "--sweep-dir"]
    done = slurm.run([*argv, str(sweep_dir)], cwd=tmp_path, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"submitted Slurm job {submitted_job(done.stdout)}: the sweep {sweep_dir}")
    job = submitted_job(done.stdout)
    script = (sweep_dir / "submit.sbatch").read_text()
    assert "#SBATCH --nodes=4\n#SBATCH --ntasks-per-node=1\n" in script and "#SBATCH --requeue" in script
    output = sweep_dir / f"slurm-{job}.out"

    def halfway() -> bool:  # trials 0 and 1 done, 2 and 3 training
        record = (
            json.loads((sweep_dir / "sweep.json").read_text()) if (sweep_dir / "sweep.json").exists() else {}
        )
        states = {trial["number"]: trial["state"] for trial in record.get("trials", [])}
        started = all(trial_epochs(sweep_dir / f"trial-00{n}") for n in (2, 3) if states.get(n) == "running")
        return (
            states.get(0) == states.get(1) == "complete"
            and states.get(2) == states.get(3) == "running"
            and started
        )

    wait_for(
        halfway, "trials 0 and 1 complete and trials 2 and 3 past their first epoch", output, timeout=300
    )
    warned = slurm.run(["scancel", "--signal=USR1", "--batch", job])
    assert warned.returncode == 0, warned.stderr
    final = slurm.wait_job_gone(job, timeout=400)
    said = output.read_text()
    assert final["JobState"] == "COMPLETED" and final["Restarts"] == "1", (final, said[-3000:])
    assert f"hvdtrain: Slurm job {job} requeued: it resumes the sweep when it starts again" in said
    assert "sweep: continuing: 4 trials recorded, " in said

    record = json.loads((sweep_dir / "sweep.json").read_text())
    assert record["counts"] == {"complete": 4, "pruned": 0, "failed": 0, "running": 0}, record
    assert record["best"]["value"] >= 0.8
    resumed = 0
    for number in range(4):
        trial = sweep_dir / f"trial-{number:03d}"
        assert trial_epochs(trial) == list(range(1, EPOCHS + 1)), f"trial {number}: each epoch once"
        lines = commands(trial)
        if number < 2:
            assert len(lines) == 1, f"trial {number} finished before the preemption and was not run again"
        else:  # stopped at a step with its checkpoint, then resumed from it in the requeued job
            assert len(lines) in (1, 2) and all("--resume" in line for line in lines[1:]), lines
            resumed += len(lines) == 2
    assert resumed >= 1, "the preemption came while trials 2 and 3 trained: at least one was resumed"

    # two at once, on two nodes each: trial 0 on the first two nodes, trial 1 on the other two
    nodes = slurm.nodes
    assert f"--hosts {nodes[0]}:1,{nodes[1]}:1" in commands(sweep_dir / "trial-000")[0]
    assert f"--hosts {nodes[2]}:1,{nodes[3]}:1" in commands(sweep_dir / "trial-001")[0]
    times = {}
    for number in (0, 1):
        lines = (sweep_dir / f"trial-00{number}" / "metrics.jsonl").read_text().splitlines()
        stamps = [record["time"] for record in map(json.loads, lines)]
        times[number] = (min(stamps), max(stamps))
    assert times[0][0] < times[1][1] and times[1][0] < times[0][1], f"trials 0 and 1 trained at once: {times}"
