"""`hvdtrain sweep`: a hyperparameter search over a recipe's config fields, each trial a real
`hvdtrain run`, on Optuna (the optional extra `hvdtrain[sweep]`).

- space.py: pure: the --param ranges typed against the recipe's config, the metric and its
  direction, trials' command lines, sweep.json and the trial table;
- study.py: the plan, the Optuna study (made or continued, its sampler and pruner), its trials' rows;
- driver.py: the trials' processes, pruning from their metrics.jsonl, stopping and going on;
- plots.py: `hvdtrain show SWEEP_DIR`'s figures;
- batch.py: the sweep as one Slurm batch job (--submit), its trials steps of the allocation;
- parent_run.py: with MLflow, the sweep's own run, the parent of its trials' runs.

`prepare` checks everything before anything runs (bad input is one UserError); `run` runs the sweep.
This package is itself callable: `hvdtrain.sweep(TARGET, [...], trials=8, np=2)` is `sweep` below.
"""

from __future__ import annotations

import os
import sys
import time
import types
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from hvdtrain.errors import UserError
from hvdtrain.launching.spec import threads_from_environment
from hvdtrain.sweep import space
from hvdtrain.sweep.study import SweepPlan, SweepResult

__all__ = ["SweepPlan", "SweepResult", "is_sweep_dir", "prepare", "run", "sweep"]

NOT_FOR_TRIALS = {
    "run_dir": "each trial runs in a run directory of its own under --sweep-dir",
    "resume_from": "a sweep resumes each interrupted trial from its newest checkpoint",
    "dry_run": "a sweep has no dry run",
    "script_args": "a sweep searches a recipe's config fields; a Horovod script has none",
}
DEFAULT_TRIALS = 20


def is_sweep_dir(path: Path) -> bool:
    return (path / space.SWEEP_RECORD).is_file() or (path / space.JOURNAL).is_file()


def prepare(
    target: str,
    params: Sequence[str],
    *,
    trials: int | None = None,
    metric: str | None = None,
    direction: str | None = None,
    sweep_dir: str | os.PathLike | None = None,
    storage: str | None = None,
    sampler: str = "tpe",
    pruner: Any = "median",
    seed: int | None = 0,
    concurrent: int = 1,
    resume: bool = False,
    console: bool = True,
    run_keywords: Mapping[str, Any] | None = None,
    runs: Path = Path("runs"),
    submit: bool = False,
) -> SweepPlan:
    """The plan of a sweep, or a UserError for anything that would make it fail, before anything runs
    or is written: the params against the recipe's config, the run options as `hvdtrain run`
    checks them (planned, not started), Optuna installed. With `submit` (the sweep is to be a batch
    job) the run options that depend on the allocation's nodes are checked in it, as `hvdtrain
    submit` leaves them to its job."""
    from hvdtrain import config as config_module
    from hvdtrain import job, registry
    from hvdtrain.job.request import from_keywords
    from hvdtrain.sweep.study import optuna_module

    run_keywords = dict(run_keywords or {})
    if isinstance(params, str) or not all(isinstance(p, str) for p in params):
        raise UserError("params must be a list of 'NAME=KIND:...' strings, e.g. ['lr=log:1e-4:1e-1']")
    for name, why in NOT_FOR_TRIALS.items():
        if run_keywords.get(name):
            flag = "--" + name.replace("_", "-") if name != "script_args" else "arguments after --"
            raise UserError(f"{flag}: {why}")
    for name, value, least in (("trials", trials, 1), ("concurrent", concurrent, 1)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < least):
            raise UserError(f"--{name} must be a whole number, {least} or more, got {value!r}")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise UserError(f"--seed must be an int, got {seed!r}")
    if sampler not in space.SAMPLERS:
        raise UserError(f"--sampler {sampler}: choose one of {', '.join(space.SAMPLERS)}")
    if isinstance(pruner, str) and pruner not in space.PRUNERS:
        raise UserError(f"--pruner {pruner}: choose one of {', '.join(space.PRUNERS)}")
    if not isinstance(pruner, str) and not callable(getattr(pruner, "prune", None)):
        raise UserError(
            f"pruner must be one of {', '.join(space.PRUNERS)} or an Optuna pruner, got {pruner!r}"
        )
    run_keywords["resume"] = False
    base = from_keywords(target, {**run_keywords, "console": False})
    if not submit:
        planned = job.prepare(replace(base, dry_run=True))  # every run option checked as `hvdtrain run` does
        is_recipe = planned.recipe is not None and planned.config is not None
        recipe = registry.load(planned.recipe_source or planned.recipe) if is_recipe else None
        config = planned.config
    else:  # the hosts and cores are the allocation's, known only in it: what can be checked here is
        from hvdtrain.job.submit import checked_recipe

        try:
            recipe, config = checked_recipe(base)
        except ValueError as error:
            raise UserError(str(error)) from None
    if recipe is None or config is None:
        raise UserError(f"{target} is a script: hvdtrain sweep searches a recipe's config fields")
    try:
        fixed = config_module.parse_overrides(recipe.config, base.overrides)
        typed = space.check_params(params, recipe.config, config, fixed)
        chosen_metric, chosen_direction = space.metric_and_direction(
            recipe.metrics, config, metric, direction
        )
        grid = space.grid_size(typed) if sampler == "grid" else None
    except ValueError as error:
        raise UserError(str(error)) from None
    budget = trials if trials is not None else (grid or DEFAULT_TRIALS)
    if grid is not None:
        budget = min(budget, grid)
    where = _sweep_dir(sweep_dir, resume, storage, recipe.name, runs)
    slots = () if submit else _slots(base, planned, concurrent)
    optuna_module()
    return SweepPlan(
        target=str(target),
        recipe=recipe.name,
        framework=recipe.framework,
        params=typed,
        metric=chosen_metric,
        direction=chosen_direction,
        trials=budget,
        sweep_dir=where,
        storage=storage,
        sampler=sampler,
        pruner=pruner,
        seed=seed,
        concurrent=concurrent,
        base=base,
        slots=slots,
        epochs=config.epochs,
        config=config,
        console=console,
    )


def _sweep_dir(given: Any, resume: bool, storage: str | None, recipe: str, runs: Path) -> Path:
    if given is not None:
        where = Path(given)
        if where.exists() and not where.is_dir():
            raise UserError(f"--sweep-dir {where} is a file, not a directory")
        if resume and storage is None and not is_sweep_dir(where):
            raise UserError(f"--resume: {where} holds no sweep ({space.JOURNAL} is not there)")
        return where
    if resume:
        names = [path.name for path in runs.iterdir()] if runs.is_dir() else []
        found = space.newest_sweep_dir(runs, recipe, names)
        if found is None:
            raise UserError(f"--resume: no sweep of {recipe} in {runs}/; give its --sweep-dir")
        return found
    return space.default_sweep_dir(runs, recipe, time.strftime("%Y%m%d-%H%M%S"))


def _slots(base: Any, planned: Any, concurrent: int) -> tuple[dict[str, Any], ...]:
    """What each of --concurrent K trials at once runs with, so that together they do not
    oversubscribe what was given: with --hosts or inside a Slurm allocation of several nodes, a run
    of consecutive hosts each; on this host, --np ranks each (K x np within its cores) with the
    cores shared out as threads."""
    if concurrent == 1:
        return ()
    hosts = planned.hosts
    if hosts and any(host.name not in ("localhost", "127.0.0.1") for host in hosts):
        if len(hosts) < concurrent:
            raise UserError(
                f"--concurrent {concurrent}: {len(hosts)} hosts cannot give {concurrent} trials hosts of "
                "their own; give more hosts or a lower --concurrent"
            )
        # consecutive hosts each: schedulers list an allocation's nodes in network order
        size, extra = divmod(len(hosts), concurrent)
        ends = [i * size + min(i, extra) for i in range(concurrent + 1)]
        groups = [hosts[ends[i] : ends[i + 1]] for i in range(concurrent)]
        slots = []
        for group in groups:
            room = sum(host.slots for host in group)
            if base.np is not None and base.np > room:
                raise UserError(
                    f"--concurrent {concurrent}: a trial's hosts ({', '.join(h.name for h in group)}) have "
                    f"{room} slots, fewer than --np {base.np}"
                )
            slots.append({"hosts": ",".join(f"{h.name}:{h.slots}" for h in group), "hostfile": None})
        return tuple(slots)
    if base.np is None:
        raise UserError(f"--concurrent {concurrent} on one host: give each trial's ranks with --np")
    cores = len(os.sched_getaffinity(0)) or 1  # the cores this process may use (taskset, cgroups)
    if concurrent * base.np > cores and not base.oversubscribe:
        raise UserError(
            f"--concurrent {concurrent} x --np {base.np} is {concurrent * base.np} ranks on this host's "
            f"{cores} cores; lower one, or pass --oversubscribe"
        )
    try:
        given = base.threads_per_rank or threads_from_environment(os.environ)
    except ValueError as error:
        raise UserError(str(error)) from None
    threads = given or max(1, cores // (concurrent * base.np))
    return tuple({"threads_per_rank": threads} for _ in range(concurrent))


def run(plan: SweepPlan) -> SweepResult:
    from hvdtrain.sweep.driver import Sweep

    return Sweep(plan).run()


def requeue_if_preempted(
    result: SweepResult, sweep_dir_given: bool, environ: Mapping[str, str] = os.environ
) -> str | None:
    """A sweep in a Slurm batch job stopped by SIGUSR1, Slurm's warning before a preemption or the
    time limit, requeues its job where its line names its sweep directory (as --submit's does): the
    same line then continues the sweep. Without --sweep-dir the requeued line would start a new sweep
    instead, so that job is not requeued (as `hvdtrain run` requeues only with --run-dir). The line
    that says so (last: Slurm ends this job now), or None."""
    import signal

    job_id = environ.get("SLURM_JOB_ID")
    if result.stopped_by != signal.SIGUSR1 or not job_id or not sweep_dir_given:
        return None
    from hvdtrain.job.execute import requeue

    return requeue(job_id, "the sweep")


def submit(plan: SweepPlan, allocation: Mapping[str, Any]) -> Any:
    """The sweep as a Slurm batch job (hvdtrain.sweep.batch) on `allocation` (nodes,
    ntasks_per_node, time, partition, sbatch_args: as `hvdtrain.submit` takes them); the script
    goes into the sweep directory. Returns the Submission (job_id, run_dir: the sweep directory,
    script)."""
    import shutil

    from hvdtrain.job import submit as submitting
    from hvdtrain.job.request import check_kinds
    from hvdtrain.sweep import batch
    from hvdtrain.sweep.study import open_study, optuna_module

    check_kinds(allocation, submitting.ALLOCATION_KINDS)
    request = submitting.SubmitRequest(
        plan.base,
        allocation.get("nodes") or 1,
        allocation.get("ntasks_per_node"),
        allocation.get("time"),
        allocation.get("partition"),
        tuple(allocation.get("sbatch_args") or ()),
    )
    planned = batch.plan_submit(
        plan, request, python=sys.executable, cwd=Path.cwd(), sbatch=shutil.which("sbatch") is not None
    )
    if is_sweep_dir(plan.sweep_dir):  # another sweep's directory is refused here, not in the job
        open_study(plan, optuna_module())
    try:
        job_id = submitting.sbatch(planned)
    except ValueError as error:
        raise UserError(str(error)) from None
    return submitting.Submission(job_id, planned.run_dir, planned.script_path)


SWEEP_OWN = (
    "trials", "metric", "direction", "sweep_dir", "storage", "sampler", "pruner", "seed", "concurrent",
    "resume", "console",
)  # fmt: skip
ALLOCATION = ("nodes", "ntasks_per_node", "time", "partition", "sbatch_args")
"""With submit=True: the Slurm allocation the sweep's batch job asks for."""


def sweep(target: str, params: Sequence[str], **keywords: Any) -> Any:
    """Search TARGET's config fields over `params` (`["lr=log:1e-4:1e-1", "hidden=int:32:256",
    "precision=choice:fp32,bf16"]`), each trial a real `hvdtrain run` in its own run directory under
    the sweep directory, and return the SweepResult: every trial (TrialRow: number, state, params,
    value, epochs, run_dir), the best and the `hvdtrain run ...` line that trains it again.

    The sweep's own keywords are `hvdtrain sweep`'s options: trials (default 20, or the grid's
    size), metric and direction (default: the recipe's monitored metric, the way it is better),
    sweep_dir (default runs/sweep-RECIPE-TIMESTAMP; an existing one continues), storage (an RDB URL
    for sweeps of many nodes; default a JournalStorage file in the sweep directory), sampler (tpe,
    random or grid), pruner (median, halving, hyperband, none, or an Optuna pruner), seed (default
    0), concurrent (trials at once), resume (continue the newest sweep of the recipe), console.
    Every other keyword is `hvdtrain.run`'s, passed to every trial (`np=2`, `strategy="ddp"`,
    `overrides={"epochs": 5}`, ...).

    With submit=True the sweep is a Slurm batch job instead (hvdtrain.sweep.batch), on the
    allocation of the keywords nodes, ntasks_per_node, time, partition and sbatch_args; the call
    returns its Submission once sbatch took it.

    Raises UserError for input refused before anything runs; a sweep stopped by SIGTERM or Ctrl-C
    returns with `stopped_by` set (the same call goes on with it)."""
    own = {name: keywords.pop(name) for name in SWEEP_OWN if name in keywords}
    allocation = {name: keywords.pop(name) for name in ALLOCATION if name in keywords}
    batch = keywords.pop("submit", False)
    if allocation and not batch:
        raise UserError(f"{', '.join(allocation)}: the allocation of a sweep submitted with submit=True")
    plan = prepare(target, params, **own, run_keywords=keywords, submit=bool(batch))
    if batch:
        return submit(plan, allocation)
    result = run(plan)
    if (line := requeue_if_preempted(result, own.get("sweep_dir") is not None)) and plan.console:
        print(line, file=sys.stderr, flush=True)
    return result


class _Callable(types.ModuleType):
    def __call__(self, target: str, params: Sequence[str], **keywords: Any) -> SweepResult:
        return sweep(target, params, **keywords)


sys.modules[__name__].__class__ = _Callable
