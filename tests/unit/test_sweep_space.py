"""hvdtrain sweep before anything runs: the --param ranges typed against the recipe's config, the
metric, the trials' command lines, sweep.json, and every bad input refused in one line, exit 2."""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

import hvdtrain
from hvdtrain.cli import main
from hvdtrain.config import TrainConfig
from hvdtrain.errors import UserError
from hvdtrain.job.request import from_keywords
from hvdtrain.recipes.digits_mlp_torch import Config
from hvdtrain.sweep import space
from hvdtrain.sweep import study as study_module


def invoke(*args: str):
    return CliRunner().invoke(main, list(args))


def params(*given: str, fixed=()):
    return space.check_params(list(given), Config, Config(), fixed)


def test_ranges_are_typed_as_their_fields():
    lr, hidden, precision, width, zero = params(
        "lr=log:1e-4:1e-1", "hidden=int:32:256", "precision=choice:fp32,bf16", "epochs=log:2:32",
        "zero_stage=choice:1,2",
    )  # fmt: skip
    assert (lr.kind, lr.low, lr.high, lr.integer) == ("log", 1e-4, 0.1, False)
    assert (hidden.kind, hidden.low, hidden.high) == ("int", 32, 256)
    assert precision.choices == ("fp32", "bf16")
    assert (width.integer, width.low, width.high) == (True, 2, 32)  # log over an int field: ints
    assert zero.choices == (1, 2)  # as --set reads them: Literal[1, 2] takes ints
    assert params("momentum=float:0:1")[0].ends() == (0.0, 1.0)
    assert params("scale_lr=choice:true,false")[0].choices == (True, False)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ("lr", "expected NAME=KIND:..."),
        ("lr=uniform:0:1", "unknown kind 'uniform'"),
        ("lr=log:1e-4", "expected log:LOW:HIGH"),
        ("lr=log:a:b", "LOW and HIGH must be numbers"),
        ("hidden=int:1.5:8", "LOW and HIGH must be integers"),
        ("lr=float:0.1:0.01", "LOW must be below HIGH"),
        ("lr=log:0:0.1", "a log range needs LOW > 0"),
        ("lr=float:0:inf", "must be finite"),
        ("precision=choice:", "expected choice:X,Y,... with no empty value"),
        ("precision=choice:fp32,fp32", "a choice is given twice"),
        ("lrr=log:1e-4:1e-1", "the recipe has no field lrr; fields:"),
        ("hidden=float:8:64", "hidden is an int field; use int:A:B or log:A:B"),
        ("lr=int:1:3", "lr is a float field; use float:A:B or log:A:B"),
        ("hidden=log:1.5:8", "LOW and HIGH must be ints"),
        (
            "precision=log:1:2",
            "precision is a choice of fp32, bf16, fp16 field; give its values as choice:X,Y",
        ),
        ("scale_lr=int:0:1", "scale_lr is a bool field"),
        ("precision=choice:fp32,fp64", "'fp64': choose one of fp32, bf16, fp16"),
        ("hidden=choice:8,wide", "'wide': expected int"),
        ("lr=float:0:0.1", "lr=0.0: lr must be greater than 0"),
        ("hidden=int:0:64", "hidden=0: hidden must be at least 1"),
        ("momentum=float:0.5:1.5", "momentum=1.5: momentum must be at most 1"),
        ("epochs=choice:0,5", "epochs=0: epochs must be at least 1"),
        ("min_lr=float:0.01:0.1", None),  # constant schedule: min_lr is not checked against lr
    ],
)
def test_a_bad_param_is_refused_with_what_is_wrong(given, message):
    if message is None:
        params(given)
        return
    with pytest.raises(ValueError, match=None) as refused:
        params(given)
    assert message in str(refused.value)
    assert str(refused.value).startswith("--param")


def test_a_range_is_checked_with_the_config_it_runs_with():
    cosine = Config(lr_schedule="cosine", lr=0.05)
    with pytest.raises(ValueError, match=r"min_lr=0.1: min_lr must be below lr for lr_schedule=cosine"):
        space.check_params(["min_lr=float:0.001:0.1"], Config, cosine)
    with pytest.raises(ValueError, match="--set lr=... fixes it too"):
        params("lr=log:1e-4:1e-1", fixed=["lr"])
    with pytest.raises(ValueError, match="--param lr is given twice"):
        params("lr=log:1e-4:1e-1", "lr=float:0.1:0.2")
    with pytest.raises(ValueError, match="nothing to search"):
        params()


def test_the_metric_defaults_to_the_monitor_then_the_first_test_metric():
    metrics = ("accuracy",)
    assert space.metric_and_direction(metrics, Config(), None, None) == ("test_accuracy", "maximize")
    assert space.metric_and_direction(metrics, Config(), "loss", None) == ("loss", "minimize")
    assert space.metric_and_direction(metrics, Config(monitor="loss"), None, None) == ("loss", "minimize")
    assert space.metric_and_direction(metrics, Config(), None, "min") == ("test_accuracy", "minimize")
    assert space.metric_and_direction((), TrainConfig(), None, None) == ("loss", "minimize")
    with pytest.raises(ValueError, match="--metric test_top5: the recipe reports loss, test_accuracy"):
        space.metric_and_direction(metrics, Config(), "test_top5", None)
    with pytest.raises(ValueError, match="give --direction"):
        space.metric_and_direction(("iou",), Config(), "test_iou", None)


def test_a_grid_needs_values_to_enumerate():
    grid = space.grid_space(params("hidden=int:8:10", "precision=choice:fp32,bf16"))
    assert grid == {"hidden": [8, 9, 10], "precision": ["fp32", "bf16"]}
    assert space.grid_size(params("hidden=int:8:10", "precision=choice:fp32,bf16")) == 6
    with pytest.raises(ValueError, match="--sampler grid needs choice: or int: params"):
        space.grid_space(params("lr=log:1e-4:1e-1"))


def test_a_trial_runs_the_sweeps_options_with_its_values_and_resumes_from_its_saved_config(tmp_path):
    from hvdtrain.job.submit import run_argv

    base = from_keywords(
        "digits-mlp-torch", {"np": 2, "variant": "debug", "overrides": ["epochs=3"], "launcher": "gloo"}
    )
    lr = 0.012345678901234567
    trial = space.trial_request(base, {"lr": lr, "hidden": 64}, tmp_path / "trial-000")
    argv = run_argv(trial)
    assert argv == [
        "digits-mlp-torch", "--np", "2", "--variant", "debug", "--set", "epochs=3", "--set", f"lr={lr!r}",
        "--set", "hidden=64", "--run-dir", str(tmp_path / "trial-000"), "--launcher", "gloo",
    ]  # fmt: skip
    assert float(argv[argv.index(f"lr={lr!r}")].split("=")[1]) == lr  # the value sampled, exactly
    again = space.command_line(run_argv(space.trial_request(base, {"lr": lr, "hidden": 64}, None)))
    assert shlex.split(again)[:2] == ["hvdtrain", "run"] and "--run-dir" not in again
    resumed = run_argv(space.resume_request(trial, tmp_path / "trial-000"))
    assert resumed == [
        "digits-mlp-torch", "--np", "2", "--run-dir", str(tmp_path / "trial-000"), "--resume",
        "--launcher", "gloo",
    ]  # fmt: skip
    assert space.set_text(True) == "true" and space.set_text(1e-05) == "1e-05"


def test_sweep_json_and_the_table(tmp_path):
    rows = [
        space.TrialRow(0, "complete", {"lr": 0.01}, 0.95, 8, "s/trial-000"),
        space.TrialRow(1, "pruned", {"lr": 1e-5}, 0.1, 2, "s/trial-001"),
        space.TrialRow(2, "complete", {"lr": 0.05}, 0.97, 8, "s/trial-002"),
        space.TrialRow(3, "failed", {"lr": 0.9}, None, 1, "s/trial-003", "its run diverged (exit code 4)"),
    ]
    assert space.best_of(rows, "maximize").number == 2
    assert space.best_of(rows, "minimize").number == 0
    assert space.best_of(rows[1:2], "maximize") is None
    record = space.sweep_record({"metric": "test_accuracy"}, rows, rows[2], "hvdtrain run x")
    assert record["counts"] == {"complete": 2, "pruned": 1, "failed": 1, "running": 0}
    assert record["best"] == {**rows[2].record(), "command": "hvdtrain run x"}
    assert record["trials"][3]["reason"] == "its run diverged (exit code 4)"
    lines = space.table_lines(rows, "test_accuracy")
    assert lines[0].split() == ["trial", "params", "state", "test_accuracy", "epochs"]
    assert lines[2].split() == ["1", "lr=1e-05", "pruned", "0.1", "2"]
    assert space.row_line(rows[3], "test_accuracy").endswith("(its run diverged (exit code 4))")


def test_resume_finds_the_recipes_newest_sweep():
    runs = Path("runs")
    names = ["sweep-digits-mlp-torch-20260101-000000", "sweep-digits-mlp-torch-20260102-000000",
             "sweep-digits-mlp-tf-20270101-000000", "digits-mlp-torch-20280101-000000"]  # fmt: skip
    assert space.newest_sweep_dir(runs, "digits-mlp-torch", names) == runs / names[1]
    assert space.newest_sweep_dir(runs, "gpt-torch", names) is None
    assert (
        space.default_sweep_dir(runs, "gpt-torch", "20260101-000000")
        == runs / "sweep-gpt-torch-20260101-000000"
    )


LR = ("--param", "lr=log:1e-4:1e-1")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "nothing to search: give at least one --param"),
        (("--param", "lrr=log:1e-4:1e-1"), "--param lrr=log:1e-4:1e-1: the recipe has no field lrr"),
        (("--param", "lr=log:1e-4"), "expected log:LOW:HIGH"),
        (("--param", "hidden=int:0:64"), "hidden must be at least 1"),
        ((*LR, "--set", "lr=0.1"), "--set lr=... fixes it too"),
        ((*LR, "--metric", "test_top5"), "--metric test_top5: the recipe reports loss, test_accuracy"),
        ((*LR, "--run-dir", "x"), "No such option '--run-dir'"),
        ((*LR, "--resume-from", "3"), "No such option '--resume-from'"),
        ((*LR, "--trials", "0"), "--trials must be a whole number, 1 or more, got 0"),
        ((*LR, "--sampler", "grid"), "--sampler grid needs choice: or int: params"),
        ((*LR, "--np", "0"), "--np must be at least 1, got 0"),
        ((*LR, "--variant", "huge"), "has no variant 'huge'"),
        ((*LR, "--set", "lrr=1"), "--set lrr: unknown key"),
        ((*LR, "--strategy", "ps"), "strategies for torch: horovod, ddp, dp"),
        ((*LR, "--concurrent", "2"), "--concurrent 2 on one host: give each trial's ranks with --np"),
        ((*LR, "--concurrent", "3", "--np", "4096"), "ranks on this host's"),
    ],
)
def test_bad_input_is_one_line_and_exit_2_before_anything_runs(args, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("sweep", "digits-mlp-torch", *args)
    assert result.exit_code == 2, result.output
    assert message in result.output, result.output
    if "No such option" not in message:
        assert result.output.startswith("hvdtrain: error: ") and result.output.count("\n") == 1, result.output
    assert not (tmp_path / "runs").exists()  # nothing written


def test_a_script_and_a_sweep_dir_of_another_sweep_are_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    result = invoke("sweep", "train.py", *LR)
    assert (
        result.exit_code == 2 and "train.py is a script: hvdtrain sweep searches a recipe's" in result.output
    )
    result = invoke("sweep", "digits-mlp-torch", *LR, "--resume")
    assert result.exit_code == 2 and "--resume: no sweep of digits-mlp-torch in runs/" in result.output
    result = invoke("sweep", "digits-mlp-torch", *LR, "--resume", "--sweep-dir", "elsewhere")
    assert result.exit_code == 2 and "--resume: elsewhere holds no sweep" in result.output


def test_the_api_refuses_what_a_trial_decides_itself():
    with pytest.raises(UserError, match="--run-dir: each trial runs in a run directory of its own"):
        hvdtrain.sweep("digits-mlp-torch", ["lr=log:1e-4:1e-1"], run_dir="x")
    with pytest.raises(UserError, match="params must be a list"):
        hvdtrain.sweep("digits-mlp-torch", "lr=log:1e-4:1e-1")
    with pytest.raises(UserError, match="--pruner wide: choose one of median, halving, hyperband, none"):
        hvdtrain.sweep("digits-mlp-torch", ["lr=log:1e-4:1e-1"], pruner="wide")
    with pytest.raises(UserError, match="unknown option nps"):
        hvdtrain.sweep("digits-mlp-torch", ["lr=log:1e-4:1e-1"], nps=2)


def test_hvdtrain_imports_without_optuna_and_sweep_says_how_to_install_it(tmp_path):
    code = (
        "import sys; sys.modules['optuna'] = None\n"
        "import hvdtrain, hvdtrain.cli, hvdtrain.sweep\n"
        "from click.testing import CliRunner\n"
        "args = ['sweep', 'digits-mlp-torch', '--param', 'lr=log:1e-4:1e-1']\n"
        "r = CliRunner().invoke(hvdtrain.cli.main, args)\n"
        "print(r.exit_code, r.output)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert (
        done.stdout.strip() == "2 hvdtrain: error: hvdtrain sweep needs Optuna: pip install 'hvdtrain[sweep]'"
    ), done.stdout + done.stderr


def test_runs_lists_a_sweeps_trials_under_it(tmp_path):
    from hvdtrain.records import runs, view

    sweep = tmp_path / "sweep-digits-mlp-torch-20260101-000000"
    for where in (tmp_path / "plain", sweep / "trial-000", sweep / "trial-001"):
        where.mkdir(parents=True)
        (where / "run.json").write_text(json.dumps({"recipe": "digits-mlp-torch", "status": "finished"}))
    (sweep / "sweep.json").write_text("{}")
    found = runs.find_runs(tmp_path)
    assert found == [tmp_path / "plain", sweep / "trial-000", sweep / "trial-001"]
    assert runs.find_runs(sweep) == [sweep / "trial-000", sweep / "trial-001"]
    names = [view.run_row(runs.read_run(path, "here")).name for path in found]
    assert names == ["plain", f"{sweep.name}/trial-000", f"{sweep.name}/trial-001"]


def test_concurrent_trials_share_out_the_hosts_or_the_cores(monkeypatch):
    from types import SimpleNamespace

    from hvdtrain.launching.spec import parse_hosts
    from hvdtrain.sweep import _slots

    base = from_keywords("digits-mlp-torch", {"np": 2})
    hosts = SimpleNamespace(hosts=parse_hosts("a:2,b:2,c:2,d:2"))
    assert _slots(base, hosts, 1) == ()
    assert _slots(base, hosts, 2) == (
        {"hosts": "a:2,b:2", "hostfile": None},
        {"hosts": "c:2,d:2", "hostfile": None},
    )
    five = SimpleNamespace(hosts=parse_hosts("a,b,c,d,e"))
    assert [slot["hosts"] for slot in _slots(from_keywords("digits-mlp-torch", {}), five, 3)] == [
        "a:1,b:1",
        "c:1,d:1",
        "e:1",
    ]
    with pytest.raises(UserError, match="4 hosts cannot give 5 trials hosts of their own"):
        _slots(base, hosts, 5)
    with pytest.raises(UserError, match=r"a trial's hosts \(a\) have 2 slots, fewer than --np 3"):
        _slots(from_keywords("digits-mlp-torch", {"np": 3}), SimpleNamespace(hosts=parse_hosts("a:2,b:4")), 2)
    here = SimpleNamespace(hosts=())
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert _slots(base, here, 2) == ({"threads_per_rank": 2}, {"threads_per_rank": 2})
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's, as for one run
    assert _slots(base, here, 2) == ({"threads_per_rank": 3}, {"threads_per_rank": 3})
    monkeypatch.setenv("OMP_NUM_THREADS", "none")
    with pytest.raises(UserError, match="OMP_NUM_THREADS must be a number of threads"):
        _slots(base, here, 2)
    monkeypatch.delenv("OMP_NUM_THREADS")
    with pytest.raises(UserError, match="--concurrent 5 x --np 2 is 10 ranks on this host's 8 cores"):
        _slots(base, here, 5)
    oversubscribed = from_keywords("digits-mlp-torch", {"np": 2, "oversubscribe": True})
    assert _slots(oversubscribed, here, 5) == ({"threads_per_rank": 1},) * 5


def test_values_that_clash_only_together_are_refused_per_trial_and_a_fitting_pair_is_not():
    """Each range's ends pass alone (check_params); one trial's pair may still clash, and that trial
    is refused before it starts rather than the sweep taken for one every trial would fail."""
    from hvdtrain import config as config_module
    from hvdtrain import registry

    base = config_module.apply(registry.load("digits-mlp-torch").config(), {"lr_schedule": "cosine"})
    clash = study_module.refusal(base, {"lr": 2e-4, "min_lr": 5e-3})
    assert (
        clash
        == "lr=0.0002, min_lr=0.005: min_lr must be below lr for lr_schedule=cosine, got 0.005 >= 0.0002"
    )
    assert study_module.refusal(base, {"lr": 2e-2, "min_lr": 5e-3}) is None
    assert study_module.refusal(None, {"lr": 2e-4, "min_lr": 5e-3}) is None


def test_figures_of_a_sweep_without_its_study_are_one_line_and_leave_the_folder_as_it_was(tmp_path):
    from hvdtrain.sweep import plots

    (tmp_path / "sweep.json").write_text("{}")
    written, problems = plots.draw(tmp_path, {})
    assert written == [] and problems == [f"not drawn: the study's {tmp_path / space.JOURNAL} is not there"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep.json"]
    written, problems = plots.draw(tmp_path, {"storage": f"sqlite:///{tmp_path / 'none' / 'x.db'}"})
    assert written == [] and problems[0].startswith("not drawn: cannot read the study: ")


def test_a_trial_asked_for_past_the_budget_by_a_racing_process_is_surplus():
    """Two sweep processes on one storage that both saw room for the last trial: the one the storage
    numbered second is surplus (ended unrun, not counted), whichever process marks it first."""
    import optuna

    from hvdtrain.sweep.study import SURPLUS, counted, surplus

    study = optuna.create_study()
    for _ in range(3):
        study.tell(study.ask(), 1.0)
    racing = [study.ask(), study.ask()]  # budget 4: each process saw 3 trials
    assert surplus(study, racing[1].number, 4) and not surplus(study, racing[0].number, 4)
    racing[1].set_user_attr(SURPLUS, True)
    study.tell(racing[1], state=optuna.trial.TrialState.FAIL)
    assert [trial.number for trial in counted(study)] == [0, 1, 2, 3]
    assert not surplus(study, racing[0].number, 4), "marking the other does not change the first"
    assert surplus(study, study.ask().number, 4) and not surplus(study, 5, 5)


def test_a_submitted_sweep_is_one_batch_job_that_runs_the_same_sweep_in_its_directory():
    """--submit: the batch script execs `hvdtrain sweep` with every option given and the sweep
    directory fixed (a requeued job continues the same sweep); tasks for --concurrent x --np."""
    from hvdtrain.job.submit import SubmitRequest
    from hvdtrain.sweep import batch

    keywords = {"np": 2, "variant": "debug", "launcher": "srun", "overrides": ("epochs=4",)}
    plan = hvdtrain.sweep.prepare(
        "digits-mlp-torch", ["lr=log:0.02:0.2"], trials=4, pruner="none", concurrent=2,
        sweep_dir="runs/lr", run_keywords=keywords, submit=True,
    )  # fmt: skip
    facts = {"python": "/venv/bin/python", "cwd": Path("/home/me"), "sbatch": True}
    planned = batch.plan_submit(plan, SubmitRequest(plan.base, nodes=4, time="2:00:00"), **facts)
    lines = planned.script.splitlines()
    assert planned.run_dir == Path("/home/me/runs/lr")
    assert planned.argv == ["sbatch", "--parsable", "/home/me/runs/lr/submit.sbatch"]
    assert {"#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --requeue", "#SBATCH --time=2:00:00",
            "#SBATCH --output=/home/me/runs/lr/slurm-%j.out"} <= set(lines)  # fmt: skip
    assert lines[-1] == (
        "exec /venv/bin/python -m hvdtrain sweep digits-mlp-torch --np 2 --variant debug --set epochs=4 "
        "--launcher srun --param lr=log:0.02:0.2 --trials 4 --metric test_accuracy --direction maximize "
        "--sampler tpe --pruner none --seed 0 --concurrent 2 --sweep-dir /home/me/runs/lr"
    )
    one_node = batch.plan_submit(plan, SubmitRequest(plan.base, nodes=1), **facts)
    assert "#SBATCH --ntasks-per-node=4" in one_node.script.splitlines()
    with pytest.raises(UserError, match="3 nodes cannot give 4 trials nodes of their own"):
        batch.plan_submit(replace(plan, concurrent=4), SubmitRequest(plan.base, nodes=3), **facts)
    with pytest.raises(
        UserError, match=r"--concurrent 2 x --np 2: each trial would have 1 of the 3 x 1 tasks"
    ):
        batch.plan_submit(plan, SubmitRequest(plan.base, nodes=3, ntasks_per_node=1), **facts)
    with pytest.raises(UserError, match="cannot go into a batch script"):
        batch.plan_submit(replace(plan, pruner=object()), SubmitRequest(plan.base, nodes=4), **facts)
    with pytest.raises(UserError, match=r"--hosts: a submitted job runs on the nodes Slurm allocates"):
        batch.plan_submit(
            replace(plan, base=replace(plan.base, hosts="a,b")), SubmitRequest(plan.base), **facts
        )


def test_the_allocation_options_go_with_submit_only():
    done = CliRunner().invoke(
        main, ["sweep", "digits-mlp-torch", "--param", "lr=log:0.01:0.1", "--nodes", "4", "--time", "10"]
    )
    assert done.exit_code == 2 and done.output.strip().splitlines()[-1] == (
        "hvdtrain: error: --nodes, --time: the allocation of a sweep run as a batch job, with --submit"
    )


def test_the_search_can_be_a_small_file_that_is_checked_like_the_command_line(tmp_path):
    """--config FILE takes the sweep's own options too: its params list is checked as --param is."""
    search = tmp_path / "sweep.toml"
    search.write_text(
        'target = "digits-mlp-torch"\nnp = 2\nparams = ["lr=log:1e-3:0.3", "width=int:32:256"]\ntrials = 3\n'
        "[set]\nepochs = 2\n"
    )
    done = CliRunner().invoke(main, ["sweep", "--config", str(search)])
    assert done.exit_code == 2
    assert (
        done.output.strip()
        .splitlines()[-1]
        .startswith("hvdtrain: error: --param width=int:32:256: the recipe has no field width; fields: ")
    )


def test_a_requeued_jobs_sweep_takes_up_its_earlier_starts_trials_and_no_other_jobs():
    """Inside Slurm the owner is the job, its task and its restart count: the same task of the same
    job after a requeue (a new pid, perhaps another node) takes its trials up; another job's trials,
    whose job may be pending again, are left to it, as are a live process's on this host."""
    import os

    import optuna

    from hvdtrain.sweep.study import orphans, owner_record

    study = optuna.create_study()
    owners = {
        "earlier start": {"host": "n9", "pid": 1, "started": "x", "slurm_job": "7", "slurm_restart": "0",
                          "slurm_task": "0"},
        "other job": {"host": "n1", "pid": 2, "started": "x", "slurm_job": "8", "slurm_restart": "0",
                      "slurm_task": "0"},
        "other task": {"host": "n9", "pid": 3, "started": "x", "slurm_job": "7", "slurm_restart": "0",
                       "slurm_task": "1"},
        "live here": {"host": "n1", "pid": os.getpid(), "started": "x"},
    }  # fmt: skip
    for name, owner in owners.items():
        trial = study.ask()
        trial.set_user_attr("hvdtrain.owner", owner)
        trial.set_user_attr("name", name)
    me = owner_record("n1", "y", {"SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1", "SLURM_PROCID": "0"})
    assert (me["slurm_job"], me["slurm_restart"], me["slurm_task"]) == ("7", "1", "0")
    found = [trial.user_attrs["name"] for trial in orphans(study, optuna, me)]
    assert found == ["earlier start", "live here"], "this process's own (stopped) trials are its too"
    outside = owner_record("n1", "y", {})
    assert "slurm_job" not in outside
    assert [t.user_attrs["name"] for t in orphans(study, optuna, outside)] == ["live here"]


def test_a_trial_another_sweep_just_asked_for_is_not_taken_before_it_names_its_owner(monkeypatch):
    """Two sweeps on one study: a trial RUNNING without an owner record is another sweep's, between
    its ask and its record (both sweeps then ran it and the second told a COMPLETE trial); one
    unclaimed for longer than CLAIM_S was asked for by a sweep that ended in between."""
    import optuna

    from hvdtrain.sweep import study as sweep_study

    study = optuna.create_study()
    study.ask().set_user_attr("name", "just asked")
    me = sweep_study.owner_record("n1", "y", {})
    assert sweep_study.CLAIM_S >= 10 and sweep_study.orphans(study, optuna, me) == []
    monkeypatch.setattr(sweep_study, "CLAIM_S", 0.0)
    assert [t.user_attrs["name"] for t in sweep_study.orphans(study, optuna, me)] == ["just asked"]


def test_only_a_sweep_with_its_directory_given_requeues_its_slurm_job():
    import signal

    from hvdtrain.sweep import requeue_if_preempted
    from hvdtrain.sweep.study import SweepResult

    warned = SweepResult(Path("s"), (), None, None, "m", "maximize", stopped_by=signal.SIGUSR1)
    assert requeue_if_preempted(warned, False, {"SLURM_JOB_ID": "7"}) is None, "the line would start anew"
    assert requeue_if_preempted(warned, True, {}) is None, "not in Slurm"
    stopped = SweepResult(Path("s"), (), None, None, "m", "maximize", stopped_by=signal.SIGTERM)
    assert requeue_if_preempted(stopped, True, {"SLURM_JOB_ID": "7"}) is None, (
        "SIGTERM: Slurm requeues, or it was cancelled"
    )


@pytest.mark.parametrize(
    ("exit_code", "stopping", "state"),
    [(0, False, "COMPLETE"), (0, True, "COMPLETE"), (143, False, "FAIL"), (143, True, "RUNNING")],
)
def test_a_trial_whose_run_exits_0_is_complete_whatever_its_record_kept(tmp_path, exit_code, stopping, state):
    """A trial adopted after a preemption whose run had trained every epoch but was ended in its
    teardown: `hvdtrain run --resume` says it is already finished and exits 0, its run.json still
    says interrupted. Exit 0 is the trial's value; any other code with that record is not."""
    from hvdtrain.sweep.driver import Running, Sweep

    plan = hvdtrain.sweep.prepare(
        "digits-mlp-torch", ["lr=log:0.02:0.2"], trials=2, pruner="none", sweep_dir=tmp_path / "sweep",
        run_keywords={"overrides": ("epochs=2",)},
    )  # fmt: skip
    sweep = Sweep(plan, out=lambda line: None)
    sweep.stops = [signal.SIGTERM] if stopping else []
    study = study_module.open_study(plan, sweep.optuna)
    trial = study.ask()
    run_dir = space.trial_dir(plan.sweep_dir, trial.number)
    run_dir.mkdir(parents=True)
    epochs = [{"epoch": 1, "test_accuracy": 0.9}, {"epoch": 2, "test_accuracy": 0.95}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in epochs))
    (run_dir / "run.json").write_text(json.dumps({"status": "interrupted", "exit_code": 143}))
    process = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({exit_code})"])
    process.wait()
    sweep.finish(study, Running(trial.number, trial, {"lr": 0.1}, run_dir, process))
    found = study.trials[0]
    assert found.state.name == state
    assert found.value == (0.95 if state == "COMPLETE" else None)
