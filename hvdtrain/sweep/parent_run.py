"""The sweep's own MLflow run, the parent of its trials' runs: made (or found again, for a continued
sweep) as the sweep starts, its trials told of it through their environment (tracking.PARENT_ENV;
each trial's `hvdtrain run` makes its run a child of it), ended with the sweep's best and counts.
A store that fails is said in one line and the sweep goes on."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hvdtrain.records import tracking
from hvdtrain.sweep.study import SweepPlan, SweepResult

SWEEP_KEY = "hvdtrain.mlflow"
"""The sweep's Optuna study's user attr: {"uri", "run_id", "experiment_id"} of the sweep's MLflow run.
The study, not a file: the study is what a continued sweep opens and checks (with --storage it lives
outside the sweep directory), and its storage keeps each change as it is made, so a sweep killed
right after making its MLflow run still goes on in that run."""
SWEEP_PARAMS = ("params", "metric", "direction", "sampler", "pruner", "seed", "budget")
"""The sweep's settings its MLflow run holds as params (its folders are its name and a tag)."""
SWEEP_COUNTED = ("complete", "pruned", "failed")
"""The trials' states whose counts the sweep's run holds as metrics trials_STATE."""


def open_sweep_run(study: Any, plan: SweepPlan, say: Callable[[str], None]) -> dict[str, str] | None:
    """The sweep's MLflow run, RUNNING: the one its Optuna study names (a continued sweep's), else a
    new one in the recipe's experiment, named after the sweep directory. Returns its entry, which the
    study keeps (SWEEP_KEY); None where the sweep logs to no MLflow, or where the store fails: that is
    said in one line and the sweep goes on, its trials each logging a run of its own."""
    uri = tracking.chosen_uri(plan.base.mlflow, os.environ)  # where its trials log
    if uri is None:
        return None
    try:
        tracking.check_reachable(
            uri
        )  # a server that is down: said now, not after MLflow's client retried for minutes
        client = tracking.mlflow_client(uri)
        before = study.user_attrs.get(SWEEP_KEY)
        same = isinstance(before, dict) and before.get("uri") == uri
        entry = _sweep_run(client, uri, plan, before if same else None)
        study.set_user_attr(SWEEP_KEY, entry)
        return entry
    except Exception as error:
        why = tracking.first_line(error)
        say(f"hvdtrain: MLflow at {uri}: the sweep has no run of its own there ({why}); "
            "each trial logs as a run with no parent")  # fmt: skip
        return None


def _sweep_run(client, uri: str, plan: SweepPlan, before: dict[str, str] | None) -> dict[str, str]:
    """The run `before` names where it is still there, else a new one; with the sweep's settings as
    params. MLflow's params cannot change: a setting a continued sweep gives anew (a larger --trials,
    say) becomes a tag hvdtrain.continued.NAME."""
    from mlflow.entities import Param, RunTag

    run_id = _active(client, before["run_id"]) if before else None
    if run_id is not None and before is not None:
        experiment_id = before["experiment_id"]
        have = client.get_run(run_id).data.params
        client.update_run(run_id, status="RUNNING")
    else:
        experiment_id = tracking.experiment_of(client, uri, plan.recipe)
        tags = {"hvdtrain.sweep": str(plan.sweep_dir.absolute()), "hvdtrain.recipe": plan.recipe}
        run_id = client.create_run(experiment_id, run_name=plan.sweep_dir.name, tags=tags).info.run_id
        have = {}
    settings = tracking.as_params(
        {key: value for key, value in plan.settings().items() if key in SWEEP_PARAMS}
    )
    params = [Param(key, value) for key, value in settings.items() if key not in have]
    tags = [RunTag(f"hvdtrain.continued.{k}", v) for k, v in settings.items() if have.get(k, v) != v]
    client.log_batch(run_id, params=params, tags=tags)
    return {"uri": uri, "run_id": run_id, "experiment_id": experiment_id}


def _active(client, run_id: str) -> str | None:
    """`run_id` where the store still has it, not deleted: a continued sweep goes on in it."""
    try:
        return run_id if client.get_run(run_id).info.lifecycle_stage == "active" else None
    except Exception:  # gone from the store (or the store fails, which making a run will say)
        return None


def trial_environ(environ: dict[str, str], entry: dict[str, str] | None) -> dict[str, str]:
    """A trial's environment: tracking.PARENT_ENV names the sweep's MLflow run, and no other (one this process
    was given is not the sweep's)."""
    found = {key: value for key, value in environ.items() if key != tracking.PARENT_ENV}
    return found | ({tracking.PARENT_ENV: entry["run_id"]} if entry else {})


def end_sweep_run(
    entry: dict[str, str] | None, result: SweepResult | None, say: Callable[[str], None]
) -> None:
    """The sweep has ended, or was stopped: its best value and its trials' counts as metrics (at the
    number of trials, so that each end of a continued sweep is a point), the best trial as tags, and
    the status: FINISHED, KILLED when a signal stopped it (the same command goes on in this run, as
    it does with its trials), FAILED when it ended with an error (a refused trial, no best, or an
    exception: `result` None). Where another sweep process's trials still run (one --storage), the
    run is left RUNNING for the last of them to end. A store that fails is said in one line."""
    if entry is None:
        return
    if (
        result is not None
        and result.stopped_by is None
        and any(row.state == "running" for row in result.trials)
    ):
        return
    try:
        client = tracking.mlflow_client(entry["uri"])
        if result is None:
            client.set_terminated(entry["run_id"], status="FAILED")
        else:
            _end_sweep(client, entry["run_id"], result)
    except Exception as error:
        say(f"hvdtrain: MLflow at {entry['uri']}: the sweep's run not ended ({tracking.first_line(error)})")


def _end_sweep(client, run_id: str, result: SweepResult) -> None:
    from mlflow.entities import Metric, RunTag

    now, step = int(time.time() * 1000), len(result.trials)
    states = [row.state for row in result.trials]
    metrics = [Metric(f"trials_{s}", float(states.count(s)), now, step) for s in SWEEP_COUNTED]
    tags: dict[str, str] = {}
    if (best := result.best) is not None:
        if (value := tracking.finite_number(best.value)) is not None:
            metrics.append(Metric(f"best_{result.metric}", value, now, step))
        tags = {
            "hvdtrain.best_trial": str(best.number),
            "hvdtrain.best_run_dir": str(Path(best.run_dir).absolute()),  # as its run's hvdtrain.run_dir
            "hvdtrain.best_command": result.command or "",
        }
    client.log_batch(run_id, metrics=metrics, tags=[RunTag(key, value) for key, value in tags.items()])
    status = "KILLED" if result.stopped_by is not None else "FINISHED" if result.exit_code == 0 else "FAILED"
    client.set_terminated(run_id, status=status)
