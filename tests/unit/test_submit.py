"""`hvdtrain submit`, pure: the batch script, the run line it execs (parsed back into the same
request), bad input refused before sbatch; and the Slurm job as run.json, `runs` and `show` keep it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import hvdtrain
from hvdtrain import cli
from hvdtrain.cli import jobs
from hvdtrain.job.request import RunRequest, from_keywords, requeued
from hvdtrain.job.submit import SubmitRequest, plan_submit, run_argv
from hvdtrain.records.runs import ended_record, read_run, running_record
from hvdtrain.records.view import render_rows, run_row, show_lines


def plan(run: RunRequest, **changes):
    facts = {
        "python": "/venv/bin/python",
        "cwd": Path("/home/me"),
        "timestamp": "20261203-1000",
        "sbatch": True,
    }
    return plan_submit(SubmitRequest(run, **changes), **facts)


def test_the_batch_script_asks_for_the_nodes_and_execs_the_run():
    planned = plan(
        RunRequest("digits-mlp-torch", np=4, overrides=("epochs=3",), strategy_options={"launcher": "srun"}),
        nodes=2,
        time="1-00:00",
        partition="gpu",
        sbatch_args=("--gres=gpu:2", "--exclusive"),
    )
    run_dir = Path("/home/me/runs/digits-mlp-torch-20261203-1000")
    assert planned.run_dir == run_dir and planned.argv == ["sbatch", "--parsable", f"{run_dir}/submit.sbatch"]
    assert planned.script.splitlines() == [
        "#!/bin/bash",
        "# Written by hvdtrain submit: the run digits-mlp-torch-20261203-1000, as a Slurm batch job.",
        "#SBATCH --job-name=hvdtrain-digits-mlp-torch",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=2",
        "#SBATCH --time=1-00:00",
        "#SBATCH --partition=gpu",
        "#SBATCH --chdir=/home/me",
        f"#SBATCH --output={run_dir}/slurm-%j.out",
        "#SBATCH --open-mode=append",
        "#SBATCH --requeue",
        "#SBATCH --gres=gpu:2",
        "#SBATCH --exclusive",
        "",
        "# exec: hvdtrain itself gets the batch step's signals.",
        f"exec /venv/bin/python -m hvdtrain run digits-mlp-torch --np 4 --set epochs=3 --run-dir {run_dir} "
        "--launcher srun",
    ]


@pytest.mark.parametrize(
    ("target", "keywords"),
    [
        ("digits-mlp-torch", {}),
        (
            "digits-mlp-tf",
            {
                "np": 3, "strategy": "ps", "num_ps": 2, "overrides": ["epochs=2", "lr=0.1"],
                "variant": "debug", "env": ["MY_VAR"], "threads_per_rank": 2, "max_restarts": 1,
                "oversubscribe": True, "mlflow": "sqlite:////tmp/m.db",
            },
        ),
        (
            "digits-mlp-torch",
            {"run_dir": "/r", "resume": True, "launcher": "gloo", "stall_timeout": 30, "timeline": True},
        ),
        ("train.py", {"script_args": ["--lr", "0.1", "--set", "x"], "min_np": 1}),
    ],
)  # fmt: skip
def test_the_run_line_parses_back_into_the_same_request(target, keywords):
    request = from_keywords(target, keywords)
    context = jobs.run.make_context("run", run_argv(request), obj={"verbose": False})
    given = {
        name: value
        for name, value in context.params.items()
        if value is not None and name not in ("dry_run", "print_config")
    }
    assert from_keywords(given.pop("target"), given) == request


@pytest.mark.parametrize(
    ("run", "changes", "message"),
    [
        (RunRequest("digits-mlp-torch", hosts="a:2"), {}, "--hosts: a submitted job runs on the nodes Slurm"),
        (
            RunRequest("digits-mlp-torch", np=5),
            {"nodes": 2, "ntasks_per_node": 2},
            "--np 5 is more than the 4",
        ),
        (RunRequest("digits-mlp-torch"), {"time": "1:2:3:4"}, "--time '1:2:3:4': Slurm takes MINUTES"),
        (RunRequest("digits-mlp-torch"), {"time": "2h"}, "--time '2h'"),
        (RunRequest("digits-mlp-torch"), {"nodes": 0}, "--nodes must be at least 1"),
        (RunRequest("digits-mlp-torch"), {"ntasks_per_node": 0}, "--ntasks-per-node must be at least 1"),
        (
            RunRequest("digits-mlp-torch"),
            {"sbatch_args": ("gres=gpu:1",)},
            "--sbatch-arg 'gres=gpu:1': give one",
        ),
    ],
)
def test_bad_submissions_are_refused_before_sbatch(run, changes, message):
    with pytest.raises(ValueError, match=message):
        plan(run, **changes)


@pytest.mark.parametrize("time", ["30", "30:00", "1:30:00", "2-0", "2-12:30", "2-12:30:15", "UNLIMITED"])
def test_every_form_of_slurm_time_is_taken(time):
    assert f"#SBATCH --time={time}" in plan(RunRequest("digits-mlp-torch"), time=time).script


def test_submit_where_sbatch_is_missing_is_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here
    done = CliRunner().invoke(cli.main, ["submit", "digits-mlp-torch", "--nodes", "2"])
    assert done.exit_code == 2 and done.output.strip().splitlines() == [
        "hvdtrain: error: hvdtrain submit needs Slurm's sbatch on PATH (is this a Slurm login node?)"
    ]
    assert list(tmp_path.iterdir()) == [], "nothing written"


def test_sbatchs_refusal_is_its_own_message_in_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    sbatch = tmp_path / "bin" / "sbatch"
    sbatch.parent.mkdir()
    sbatch.write_text("#!/bin/sh\necho 'sbatch: error: invalid partition specified: nope' >&2\nexit 1\n")
    sbatch.chmod(0o755)
    monkeypatch.setenv("PATH", f"{sbatch.parent}:/usr/bin:/bin")
    monkeypatch.chdir(tmp_path)
    done = CliRunner().invoke(cli.main, ["submit", "digits-mlp-torch", "--partition", "nope"])
    assert done.exit_code == 2
    assert done.output.strip() == "hvdtrain: error: sbatch refused the job: invalid partition specified: nope"
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_the_slurm_job_is_kept_apart_from_hvdtrains_status(tmp_path):
    submitted = {
        "recipe": "digits-mlp-torch",
        "status": "submitted",
        "slurm_job_id": "41",
        "slurm_state": "PENDING",
    }
    started = running_record(
        {"recipe": "digits-mlp-torch"}, submitted, pid=7, host="h1", now="t", resume=False
    )
    assert started["status"] == "running" and started["slurm_job_id"] == "41"
    ended = ended_record({**started, "slurm_state": "RUNNING"}, 0, None, "t2")
    assert (ended["status"], ended["slurm_state"]) == ("finished", "COMPLETED")
    (tmp_path / "run.json").write_text(json.dumps({**submitted, "slurm_restart_count": 1}))
    facts = read_run(tmp_path, "h1")  # no Slurm answers here: the state last recorded
    row = run_row(facts)
    assert row.status == "submitted" and row.slurm == "41 PENDING (requeued 1x)"
    assert render_rows([row]).splitlines()[0].split() == [
        "RECIPE", "STRATEGY", "NP", "STATUS", "SLURM", "TEST", "LOSS", "STARTED", "RUN",
    ]  # fmt: skip
    assert "slurm job        41 PENDING (requeued 1x)" in show_lines(facts)


def test_a_requeued_job_resumes_its_run_where_a_checkpoint_is(tmp_path):
    request = RunRequest("digits-mlp-torch", variant="debug", run_dir=tmp_path)
    assert requeued(request, {"SLURM_RESTART_COUNT": "1"}) == request, "no checkpoint yet: starts again"
    (tmp_path / "checkpoints" / "8").mkdir(parents=True)
    (tmp_path / "checkpoints" / "latest").write_text("8\n")
    assert requeued(request, {"SLURM_RESTART_COUNT": "0"}) == request
    resumed = requeued(request, {"SLURM_RESTART_COUNT": "1"})
    assert resumed.resume is True and resumed.variant is None and resumed.run_dir == tmp_path
    # the line's --resume-from took the first start back to an intact step; a requeue goes on
    from_step = RunRequest("digits-mlp-torch", run_dir=tmp_path, resume=True, resume_from=4)
    assert requeued(from_step, {"SLURM_RESTART_COUNT": "0"}) == from_step
    assert requeued(from_step, {"SLURM_RESTART_COUNT": "2"}).resume_from is None


@pytest.mark.parametrize(
    ("run", "changes", "message"),
    [
        (RunRequest("digits-mlp-torch", np=0), {}, "--np must be at least 1, got 0"),
        (RunRequest("digits-mlp-torch", max_restarts=-1), {}, "--max-restarts must be 0 or more"),
        (RunRequest("digits-mlp-torch", resume=True), {}, "--resume in a batch job needs --run-dir"),
        (RunRequest("digits-mlp-torch", strategy="dp"), {"nodes": 2}, "--strategy dp runs on one node"),
        (RunRequest("digits-mlp-torch", run_dir=Path("my runs/a")), {}, "a path without spaces or %"),
    ],
)
def test_what_the_batch_job_would_refuse_is_refused_at_submit(run, changes, message):
    with pytest.raises(ValueError, match=message):
        plan(run, **changes)


def test_the_api_refuses_a_submit_keyword_of_the_wrong_kind():
    with pytest.raises(hvdtrain.UserError, match="nodes must be an int, got '2'"):
        hvdtrain.submit("digits-mlp-torch", nodes="2", dry_run=True)


def test_a_scripts_run_directory_is_named_after_its_stem():
    assert plan(RunRequest("jobs/train.py")).run_dir == Path("/home/me/runs/train-20261203-1000")
