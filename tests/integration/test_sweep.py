"""hvdtrain sweep on real ranks: every trial a real `hvdtrain run` at np=2 under the sweep directory,
a pruned trial stopped at a step with its checkpoint, and a sweep killed with SIGKILL going on
where it was. Small on purpose: the debug variant cut to three epochs, three trials a sweep."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import hvdtrain
from tests.support.helpers import hvdtrain as hvdtrain_cli

optuna = pytest.importorskip("optuna", reason="hvdtrain[sweep]: make install installs it")

EPOCHS = 3
"""Each trial's: lr 0.02 and 0.05 are both past 0.9 test accuracy by the third (lr 0.05 is not at its
second), and a trial stopped after its first epoch still has two to stop in."""
# batch 4: an epoch of ~180 steps a rank (a second or so), so that a trial's run is still training when
# the sweep reads its first epoch (a pruned trial stops well before its last)
TRIAL = {"np": 2, "variant": "debug", "launcher": "gloo", "overrides": {"batch_size": 4, "epochs": EPOCHS}}


@pytest.fixture(scope="module")
def pruned_sweep(tmp_path_factory):
    """Three trials over a grid of lr; the threshold pruner stops the one that cannot learn (lr=1e-5,
    about 0.1 accuracy after its first epoch) and none of the others."""
    where = tmp_path_factory.mktemp("sweep") / "sweep"
    result = hvdtrain.sweep(
        "digits-mlp-torch",
        ["lr=choice:0.00001,0.02,0.05"],
        sampler="grid",
        pruner=optuna.pruners.ThresholdPruner(lower=0.5),
        sweep_dir=where,
        console=False,
        **TRIAL,
    )
    return result, json.loads((where / "sweep.json").read_text())


def test_a_sweep_records_every_trial_and_the_line_that_reproduces_the_best(pruned_sweep):
    result, record = pruned_sweep
    assert result.exit_code == 0
    assert (record["metric"], record["direction"], record["budget"]) == ("test_accuracy", "maximize", 3)
    trials = {trial["params"]["lr"]: trial for trial in record["trials"]}
    assert sorted(trials) == [0.00001, 0.02, 0.05]
    assert record["counts"] == {"complete": 2, "pruned": 1, "failed": 0, "running": 0}
    for lr in (0.02, 0.05):
        done = trials[lr]
        assert (done["state"], done["epochs"]) == ("complete", EPOCHS)
        summary = json.loads((result.sweep_dir / f"trial-{done['number']:03d}" / "summary.json").read_text())
        assert done["value"] == pytest.approx(summary["test_accuracy"])
        assert done["value"] >= 0.9
    best = max((trials[0.02], trials[0.05]), key=lambda trial: trial["value"])
    assert record["best"]["number"] == best["number"] == result.best.number
    assert record["best"]["run_dir"] == str(result.sweep_dir / f"trial-{best['number']:03d}")
    lr = best["params"]["lr"]
    line = f"hvdtrain run digits-mlp-torch --np 2 --variant debug --set batch_size=4 --set epochs={EPOCHS}"
    line += f" --set lr={lr} --launcher gloo"
    assert record["best"]["command"] == result.command == line
    config = json.loads((result.sweep_dir / f"trial-{best['number']:03d}" / "config.json").read_text())
    assert (config["lr"], config["batch_size"], config["epochs"]) == (lr, 4, EPOCHS)
    study = optuna.load_study(
        study_name=result.sweep_dir.name,
        storage=optuna.storages.JournalStorage(
            optuna.storages.journal.JournalFileBackend(str(result.sweep_dir / "study.journal"))
        ),
    )
    assert [t.user_attrs["run_dir"] for t in study.trials] == [
        str((result.sweep_dir / f"trial-{t.number:03d}").absolute()) for t in study.trials
    ]


def test_a_pruned_trial_is_stopped_at_a_step_with_its_checkpoint(pruned_sweep):
    result, record = pruned_sweep
    pruned = next(trial for trial in record["trials"] if trial["state"] == "pruned")
    assert pruned["params"]["lr"] == 0.00001
    assert pruned["value"] < 0.5
    assert 1 <= pruned["epochs"] < EPOCHS
    run_dir = result.sweep_dir / f"trial-{pruned['number']:03d}"
    run = json.loads((run_dir / "run.json").read_text())
    assert (run["status"], run["signal"]) == ("interrupted", "SIGTERM")  # the preemption path
    assert (run_dir / "checkpoints" / "latest").exists()
    assert not (run_dir / "summary.json").exists()


def _sweep(sweep_dir, *more):
    return [
        sys.executable, "-m", "hvdtrain", "sweep", "digits-mlp-torch", "--np", "2", "--variant", "debug",
        "--launcher", "gloo", "--set", "batch_size=4", "--set", f"epochs={EPOCHS}",
        "--param", "lr=log:0.02:0.1", "--trials", "3",
        "--sampler", "random", "--pruner", "none", "--sweep-dir", str(sweep_dir), *more,
    ]  # fmt: skip


def _epochs(run_dir) -> int:
    try:
        return sum('"epoch"' in line for line in (run_dir / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return 0


def test_a_sweep_killed_mid_trial_goes_on_where_it_was(tmp_path):
    where = tmp_path / "sweep"
    process = subprocess.Popen(
        _sweep(where), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.monotonic() + 120
    # killed once trial 1 has an epoch: it is mid-trial, two epochs (of ~180 steps) from its end
    while _epochs(where / "trial-001") < 1 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    first = where / "trial-000"
    kept = {name: (first / name).read_text() for name in ("run.json", "metrics.jsonl", "summary.json")}
    assert json.loads(kept["run.json"])["status"] == "finished"

    again = hvdtrain_cli(*_sweep(where)[3:], timeout=240)
    assert "continuing: 2 trials recorded, 1 to resume" in again.stdout, again.stdout
    record = json.loads((where / "sweep.json").read_text())
    assert record["counts"] == {"complete": 3, "pruned": 0, "failed": 0, "running": 0}, record
    assert [trial["number"] for trial in record["trials"]] == [0, 1, 2]
    assert sorted(path.name for path in where.glob("trial-*")) == ["trial-000", "trial-001", "trial-002"]
    assert {name: (first / name).read_text() for name in kept} == kept  # the finished trial: not run again
    resumed = json.loads((where / "trial-001" / "run.json").read_text())
    assert resumed["status"] == "finished" and "first_started" in resumed  # went on from its checkpoint
    assert all(trial["epochs"] == EPOCHS for trial in record["trials"])
    assert f"again:   {record['best']['command']}" in again.stdout


def test_with_mlflow_the_sweep_is_the_parent_run_of_its_trials_and_stays_it_when_continued(tmp_path):
    pytest.importorskip("mlflow", reason="hvdtrain[mlflow]: make install installs it")
    from mlflow.tracking import MlflowClient

    from hvdtrain.sweep import parent_run

    uri, where = f"sqlite:///{tmp_path / 'mlflow.db'}", tmp_path / "sweep"
    argv = [
        "sweep", "digits-mlp-torch", "--np", "1", "--variant", "debug", "--set", "epochs=1",
        "--pruner", "none", "--param", "lr=log:0.01:0.3", "--mlflow", uri, "--sweep-dir", str(where),
    ]  # fmt: skip
    client = MlflowClient(tracking_uri=uri)

    def logged(trials: int):
        """The sweep's parent run, its children's hvdtrain.run_dir tags, and sweep.json."""
        hvdtrain_cli(*argv, "--trials", str(trials), timeout=300)
        experiment = client.get_experiment_by_name("digits-mlp-torch").experiment_id
        runs = client.search_runs([experiment])
        [parent] = [run for run in runs if "hvdtrain.sweep" in run.data.tags]
        children = [run for run in runs if run.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
        assert len(children) == len(runs) - 1 == trials  # every trial's run a child, and no other run
        assert all(child.info.status == "FINISHED" for child in children)
        run_dirs = sorted(child.data.tags["hvdtrain.run_dir"] for child in children)
        return parent, run_dirs, json.loads((where / "sweep.json").read_text())

    # a trial, then the same sweep continued to two: the second sweep's parent has both as children
    parent, run_dirs, record = logged(trials=1)
    assert run_dirs == [str((where / f"trial-{n:03d}").absolute()) for n in (0,)]
    assert (parent.info.status, parent.info.run_name) == ("FINISHED", "sweep")
    assert parent.data.tags["hvdtrain.sweep"] == str(where.absolute())
    assert parent.data.tags["hvdtrain.recipe"] == "digits-mlp-torch"
    assert parent.data.params == {
        key: record[key] if isinstance(record[key], str) else json.dumps(record[key])
        for key in parent_run.SWEEP_PARAMS
    }
    assert (parent.data.params["params"], parent.data.params["budget"]) == ('["lr=log:0.01:0.3"]', "1")
    assert parent.data.metrics["best_test_accuracy"] == record["best"]["value"]
    assert parent.data.metrics["trials_complete"] == 1
    assert parent.data.metrics["trials_pruned"] == parent.data.metrics["trials_failed"] == 0
    assert parent.data.tags["hvdtrain.best_trial"] == str(record["best"]["number"])
    assert parent.data.tags["hvdtrain.best_run_dir"] == str(where / f"trial-{record['best']['number']:03d}")
    assert parent.data.tags["hvdtrain.best_command"] == record["best"]["command"]

    again, run_dirs, record = logged(trials=2)  # the same sweep directory: the same parent
    assert again.info.run_id == parent.info.run_id
    assert run_dirs == [str((where / f"trial-{n:03d}").absolute()) for n in (0, 1)]
    assert again.info.status == "FINISHED"
    assert again.data.params["budget"] == "1"  # MLflow's params cannot change: the new budget is a tag
    assert again.data.tags["hvdtrain.continued.budget"] == "2"
    assert again.data.metrics["trials_complete"] == 2
    assert again.data.metrics["best_test_accuracy"] == record["best"]["value"]
