"""The sweep's plan, its Optuna study and how the study's trials read: what a sweep process and
`hvdtrain show` share. Optuna is imported by the caller (optuna_module), never by hvdtrain's import."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from hvdtrain import config as config_module
from hvdtrain.errors import EXIT_USAGE, UserError
from hvdtrain.records.runs import parse_metrics, pid_alive
from hvdtrain.sweep import space
from hvdtrain.sweep.space import Param, TrialRow

INSTALL = "hvdtrain sweep needs Optuna: pip install 'hvdtrain[sweep]'"


def optuna_module():
    """Optuna, imported on first use; hvdtrain itself imports without it."""
    try:
        import optuna
    except ImportError:
        raise UserError(INSTALL) from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


@dataclass(frozen=True)
class SweepPlan:
    """Everything a sweep needs, checked before anything runs (hvdtrain.sweep.prepare)."""

    target: str
    recipe: str
    framework: str
    params: tuple[Param, ...]
    metric: str
    direction: str
    trials: int
    sweep_dir: Path
    storage: str | None
    """An RDB URL (--storage); None: the JournalStorage file in the sweep directory."""
    sampler: str
    pruner: Any
    """A name of space.PRUNERS, or an Optuna pruner (the API's)."""
    seed: int | None
    concurrent: int
    base: Any
    """The RunRequest every trial starts from (the sweep's run options and fixed --set)."""
    slots: tuple[Any, ...] = ()
    """Per concurrent slot: the RunRequest fields that slot's trials run with (hosts, threads)."""
    epochs: int = 1
    console: bool = True
    config: Any = None
    """The recipe's config with the sweep's fixed values: each trial's values are applied to it and
    checked together before the trial starts (None: not checked here)."""

    @property
    def study_name(self) -> str:
        return self.sweep_dir.name

    def settings(self) -> dict[str, Any]:
        """What sweep.json and the study record of the sweep: a sweep continues only with these."""
        pruner = self.pruner if isinstance(self.pruner, str) else type(self.pruner).__name__
        return {
            "target": self.target,
            "recipe": self.recipe,
            "params": [param.spec for param in self.params],
            "metric": self.metric,
            "direction": self.direction,
            "sampler": self.sampler,
            "pruner": pruner,
            "seed": self.seed,
            "budget": self.trials,
            "sweep_dir": str(self.sweep_dir),
            "storage": self.storage or str(self.sweep_dir / space.JOURNAL),
            "study": self.study_name,
        }


SAME_SWEEP = ("target", "params", "metric", "direction")
"""What must match for a command to continue a sweep directory's study."""


@dataclass(frozen=True)
class SweepResult:
    sweep_dir: Path
    trials: tuple[TrialRow, ...]
    best: TrialRow | None
    command: str | None
    """The `hvdtrain run ...` line that trains the best trial's config again."""
    metric: str
    direction: str
    stopped_by: int | None = None
    """The signal that stopped the sweep (its running trials checkpointed; the same command goes on)."""
    message: str = ""

    @property
    def exit_code(self) -> int:
        if self.stopped_by is not None:
            return 128 + self.stopped_by
        if self.message.startswith("error: "):
            return EXIT_USAGE
        return 0 if self.best is not None else 1


CREATE_TRIES = 5


def open_study(plan: SweepPlan, optuna: Any):
    """The sweep directory's study (made, or opened to continue it: then with the same search), its
    sampler and pruner set."""
    plan.sweep_dir.mkdir(parents=True, exist_ok=True)
    if plan.storage:
        storage: Any = plan.storage
    else:
        from optuna.storages.journal import JournalFileBackend

        backend = JournalFileBackend(str(plan.sweep_dir / space.JOURNAL))
        storage = optuna.storages.JournalStorage(backend)
    for attempt in range(CREATE_TRIES):
        try:
            study = optuna.create_study(
                study_name=plan.study_name, storage=storage, direction=plan.direction, load_if_exists=True
            )
            break
        except Exception as error:  # a bad URL, a store that does not answer
            # sweep processes started at once on a new database race to make its tables: the loser's
            # statement breaks a unique index or finds a table made, and they are there when it tries again
            raced = type(error).__name__ == "IntegrityError" or "already exists" in str(error)
            if raced and attempt + 1 < CREATE_TRIES:
                time.sleep(0.5 * (attempt + 1))
                continue
            raise UserError(f"--storage {plan.storage}: {error}".splitlines()[0]) from None
    recorded = study.user_attrs.get("hvdtrain.sweep")
    wanted = plan.settings()
    if recorded is None:
        study.set_user_attr("hvdtrain.sweep", wanted)
    else:
        differ = [key for key in SAME_SWEEP if recorded.get(key) != wanted[key]]
        if differ:
            was = "; ".join(f"{key} {recorded.get(key)}" for key in differ)
            raise UserError(
                f"{plan.sweep_dir} holds another sweep ({was}); give another --sweep-dir, or its own "
                "--param/--metric/--direction to continue it"
            )
    if study.direction.name.lower() != plan.direction:
        raise UserError(f"{plan.sweep_dir}: its study is to {study.direction.name.lower()}")
    already = len(study.get_trials(deepcopy=False))
    study.sampler = make_sampler(plan, optuna, already)
    study.pruner = make_pruner(plan, optuna)
    return study


def make_sampler(plan: SweepPlan, optuna: Any, already: int):
    """Seeded by --seed, and by how many trials the study holds, so a continued sweep does not draw
    the first sweep's params again."""
    samplers = optuna.samplers
    seed = None if plan.seed is None else plan.seed + already
    if plan.sampler == "grid":

        class Grid(samplers.GridSampler):
            def after_trial(self, study, trial, state, values) -> None:
                """Not Optuna's study.stop() once the grid is done, which works inside optimize() only:
                the sweep asks for no more trials than the grid has."""

        return Grid(space.grid_space(plan.params), seed=seed)
    if plan.sampler == "random":
        return samplers.RandomSampler(seed=seed)
    return samplers.TPESampler(seed=seed)


def make_pruner(plan: SweepPlan, optuna: Any):
    pruners = optuna.pruners
    chosen = plan.pruner
    if not isinstance(chosen, str):
        return chosen
    return {
        "median": lambda: pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=1),
        "halving": lambda: pruners.SuccessiveHalvingPruner(min_resource=2, reduction_factor=3),
        "hyperband": lambda: pruners.HyperbandPruner(min_resource=2, max_resource=max(plan.epochs, 2)),
        "none": pruners.NopPruner,
    }[chosen]()


def refusal(config: object, values: Mapping[str, object]) -> str | None:
    """Why one trial's values, taken together, are not a config the recipe accepts (a cosine
    schedule's min_lr above its lr, say); None where they are. check_params tries each range's ends
    alone: a pair can still clash."""
    if config is None:
        return None
    try:
        config_module.apply(config, dict(values))
    except (ValueError, TypeError) as error:
        return f"{', '.join(f'{k}={v}' for k, v in values.items())}: {error}"
    return None


def suggest(plan: SweepPlan, trial: Any) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for param in plan.params:
        if param.kind == "choice":
            values[param.name] = trial.suggest_categorical(param.name, list(param.choices))
        elif param.kind == "int" or param.integer:
            values[param.name] = trial.suggest_int(param.name, param.low, param.high, log=param.kind == "log")
        else:
            values[param.name] = trial.suggest_float(
                param.name, param.low, param.high, log=param.kind == "log"
            )
    return values


def orphans(study: Any, optuna: Any, me: Mapping[str, Any]) -> list[Any]:
    """RUNNING trials whose sweep process is gone (killed, or stopped by a signal): this sweep
    goes on with them. `me` is this sweep's owner record (host, pid, started, and inside Slurm the
    job, its task and its restart count). A trial of a sweep process still alive, of another host's,
    or of another Slurm job's is left to it; one of an earlier start of the same job's same task
    (requeued, perhaps on another node) is this sweep's, since Slurm ends a job before it starts it
    again."""
    found = []
    for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        owner = trial.user_attrs.get("hvdtrain.owner") or {}
        job = owner.get("slurm_job")
        if job is not None and job != me.get("slurm_job"):
            continue  # another job's, pending again perhaps: it goes on with its own
        same_task = job is not None and owner.get("slurm_task") == me.get("slurm_task")
        if same_task and owner.get("slurm_restart") != me.get("slurm_restart"):
            found.append(trial)  # this job's, before Slurm requeued it
            continue
        if not owner and _seconds_since(trial.datetime_start) < CLAIM_S:
            continue  # another sweep asked for it a moment ago and records itself as its owner next
        if owner.get("host") not in (None, me["host"]):
            continue
        mine = owner.get("pid") == me["pid"]  # this process's earlier sweep, stopped by a signal
        if owner and not mine and pid_alive(owner.get("pid"), owner.get("started")):
            continue
        found.append(trial)
    return sorted(found, key=lambda trial: trial.number)


CLAIM_S = 60.0
"""A RUNNING trial without an owner record is in its sweep's first moments (Optuna's ask, then the
record): another sweep sharing the study leaves it alone unless it is older than this, when the
sweep that asked for it must have ended between the two."""


def _seconds_since(started: Any) -> float:
    """Seconds since an Optuna trial's datetime_start (naive, this host's local time); inf if unknown."""
    return (datetime.now() - started).total_seconds() if started is not None else math.inf


def owner_record(host: str, started: str, environ: Mapping[str, str]) -> dict[str, Any]:
    """Who runs a trial: this process, and inside Slurm its job and how often Slurm requeued it."""
    owner: dict[str, Any] = {"host": host, "pid": os.getpid(), "started": started}
    if job := environ.get("SLURM_JOB_ID"):
        owner |= {"slurm_job": job, "slurm_restart": environ.get("SLURM_RESTART_COUNT", "0")}
        owner["slurm_task"] = environ.get("SLURM_PROCID", "0")  # one of several sweeps a job's tasks run
    return owner


SURPLUS = "hvdtrain.surplus"
"""A trial's user attribute: asked for by one sweep process while another took the study's last
trial (sweeps of several nodes on one --storage); ended unrun, it is not one of the sweep's."""


def counted(study: Any) -> list[Any]:
    """The study's trials that are the sweep's: every one but the surplus."""
    return [trial for trial in study.get_trials(deepcopy=False) if not trial.user_attrs.get(SURPLUS)]


def surplus(study: Any, number: int, budget: int) -> bool:
    """Is the trial just asked for (`number`) past the budget? The storage numbers trials in the
    order they were made, so the sweep's are the first `budget` of them: two processes that both
    saw room for one more trial cannot both run theirs."""
    before = [trial for trial in counted(study) if trial.number < number]
    return len(before) >= budget


def trial_rows(plan: SweepPlan, study: Any, optuna: Any) -> list[TrialRow]:
    """Every trial of the study as the sweep shows it and sweep.json records it."""
    TrialState = optuna.trial.TrialState
    states = {
        TrialState.COMPLETE: "complete",
        TrialState.PRUNED: "pruned",
        TrialState.FAIL: "failed",
        TrialState.RUNNING: "running",
        TrialState.WAITING: "running",
    }
    rows = []
    for trial in counted(study):
        run_dir = space.trial_dir(plan.sweep_dir, trial.number)
        values = trial.intermediate_values
        value = trial.value if trial.value is not None else (values[max(values)] if values else None)
        rows.append(
            TrialRow(
                trial.number,
                states[trial.state],
                {param.name: trial.params.get(param.name) for param in plan.params},
                value,
                len(epochs_of(run_dir)),
                str(run_dir),
                trial.user_attrs.get("reason", ""),
            )
        )
    return rows


def epochs_of(run_dir: Path) -> tuple[dict[str, Any], ...]:
    """The epoch records of a trial's metrics.jsonl."""
    try:
        text = (run_dir / "metrics.jsonl").read_text(errors="replace")
    except OSError:
        return ()
    return parse_metrics(text)[0]
