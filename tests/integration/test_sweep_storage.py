"""Sweeps of several processes on one study in a real PostgreSQL (Debian's server, started here on a
Unix socket of its own, gone after): what `--storage postgresql://...` is for, a sweep on each of
several nodes."""

from __future__ import annotations

import json
import subprocess
import sys

import optuna
import pytest

from tests.support.postgres import PostgresServer

TRIALS = 3
"""Enough for both processes to run trials (each asks for one as it starts; a trial takes seconds) and for
one of them to find the budget taken by the other at the end. Each process's first trial is its sampler's
first draw, seeded by the trials the study holds as it opens it: for 0, 1 or 2, lr 0.071, 0.052 or 0.055,
each past the 0.9 below in two epochs."""
SWEEP = [
    "digits-mlp-torch", "--np", "1", "--variant", "debug", "--set", "epochs=2", "--param", "lr=log:0.02:0.2",
    "--trials", str(TRIALS), "--pruner", "none",
]  # fmt: skip


@pytest.fixture
def postgres():
    with PostgresServer() as server:
        server.create_database("sweeps")
        yield server


def test_two_sweep_processes_on_one_postgresql_study_run_its_trials_once_between_them(postgres, tmp_path):
    url = postgres.url("sweeps")
    sweep_dir = tmp_path / "sweep"  # the study's name; each process's trials go under it
    argv = [
        sys.executable,
        "-m",
        "hvdtrain",
        "sweep",
        *SWEEP,
        "--storage",
        url,
        "--sweep-dir",
        str(sweep_dir),
    ]
    outputs = [tmp_path / f"sweep-{index}.out" for index in range(2)]
    processes = [subprocess.Popen(argv, stdout=out.open("w"), stderr=subprocess.STDOUT) for out in outputs]
    for process, out in zip(processes, outputs, strict=True):
        assert process.wait(timeout=600) == 0, out.read_text()[-3000:]

    study = optuna.load_study(study_name=sweep_dir.name, storage=url)
    trials = [trial for trial in study.get_trials() if not trial.user_attrs.get("hvdtrain.surplus")]
    assert [trial.number for trial in trials] == list(range(TRIALS))
    assert all(trial.state == optuna.trial.TrialState.COMPLETE for trial in trials), trials
    owners = {trial.user_attrs["hvdtrain.owner"]["pid"] for trial in trials}
    assert owners == {process.pid for process in processes}, "both processes ran trials"
    for trial in trials:
        run_dir = sweep_dir / f"trial-{trial.number:03d}"
        lines = (run_dir / "sweep-trial.log").read_text().splitlines()
        assert len([line for line in lines if line.startswith("$ ")]) == 1, f"trial {trial.number} ran once"
        summary = json.loads((run_dir / "summary.json").read_text())
        assert trial.value == pytest.approx(summary["test_accuracy"])
    made = sorted(path.name for path in sweep_dir.glob("trial-*"))
    assert made == [f"trial-{number:03d}" for number in range(TRIALS)], "no run beyond the budget"
    assert study.best_value >= 0.9
