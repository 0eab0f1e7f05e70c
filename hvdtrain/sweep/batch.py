"""`hvdtrain sweep --submit`: the sweep as one Slurm batch job. Its batch script `exec`s the same
`hvdtrain sweep` line with the sweep directory fixed, inside an allocation of --nodes; there the
sweep shares the nodes out among its --concurrent trials, each trial an `srun` step on nodes of its
own.

One job holds the sweep and its trials run as steps of it, rather than a job a trial: the sweep
process reads each trial's epochs as rank 0 writes them, so pruning stops a trial within a poll,
and no trial waits in the queue behind other users' jobs between two of the sweep's. The job asks
to be requeued (--requeue). On Slurm's warning (SIGUSR1, `--signal=B:USR1@SECONDS` or `scancel
--signal=USR1 --batch`) the sweep stops every running trial at a step with its checkpoint and
requeues the job; the requeued job runs the same line, which continues the sweep: finished trials
are kept, interrupted ones resume from their checkpoints as the same trials. A preemption that
signals every step at once (SIGTERM) ends the same way, Slurm requeuing the job itself.

Pure: the script and the sbatch argv; `hvdtrain.job.submit.sbatch` hands it over.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from hvdtrain.errors import UserError
from hvdtrain.job.submit import (
    NOT_IN_A_BATCH_JOB,
    SCRIPT,
    SubmitPlan,
    SubmitRequest,
    batch_header,
    batch_script,
    run_argv,
)
from hvdtrain.sweep.study import SweepPlan


def sweep_argv(plan: SweepPlan, sweep_dir: Path) -> list[str]:
    """The `hvdtrain sweep` arguments of `plan`, run in `sweep_dir`: its target and run options,
    then the sweep's own options, every one given (the job's line does not depend on defaults)."""
    if not isinstance(plan.pruner, str):
        raise UserError(f"--submit: a pruner object ({type(plan.pruner).__name__}) cannot go into a batch "
                        "script; give one of median, halving, hyperband, none")  # fmt: skip
    if plan.seed is None:
        raise UserError("--submit: give the sweep a seed, so that its requeued job samples as it did")
    argv = run_argv(plan.base)
    for param in plan.params:
        argv += ["--param", param.spec]
    argv += ["--trials", str(plan.trials), "--metric", plan.metric, "--direction", plan.direction]
    argv += ["--sampler", plan.sampler, "--pruner", plan.pruner, "--seed", str(plan.seed)]
    argv += ["--concurrent", str(plan.concurrent), "--sweep-dir", str(sweep_dir)]
    if plan.storage:
        argv += ["--storage", plan.storage]
    return argv


def plan_submit(
    plan: SweepPlan, request: SubmitRequest, *, python: str, cwd: Path, sbatch: bool
) -> SubmitPlan:
    """Pure: the batch script of the sweep and its sbatch argv, or a UserError naming what is wrong.
    Without --ntasks-per-node the nodes get --concurrent x --np tasks among them; the trials' share
    of the allocation is checked as the sweep will cut it."""
    for option, why in NOT_IN_A_BATCH_JOB.items():
        if getattr(plan.base, option):
            raise UserError(why)
    trials_at_once, np = plan.concurrent, plan.base.np
    if request.ntasks_per_node is None and np is not None:
        request = replace(request, ntasks_per_node=-(-trials_at_once * np // request.nodes))
    per_node = request.ntasks_per_node or 1
    if request.nodes > 1 and request.nodes < trials_at_once:
        raise UserError(
            f"--concurrent {trials_at_once}: {request.nodes} nodes cannot give {trials_at_once} trials "
            "nodes of their own; ask for more --nodes or a lower --concurrent"
        )
    room = (request.nodes // trials_at_once) * per_node if request.nodes > 1 else per_node // trials_at_once
    if np is not None and np > room:
        raise UserError(
            f"--concurrent {trials_at_once} x --np {np}: each trial would have {room} of the "
            f"{request.nodes} x {per_node} tasks of --nodes {request.nodes} x --ntasks-per-node {per_node}"
        )
    sweep_dir = cwd / plan.sweep_dir
    try:
        header = batch_header(
            replace(request, run=replace(plan.base, np=None)),
            sbatch=sbatch,
            cwd=cwd,
            where=sweep_dir,
            name=f"sweep-{plan.recipe}",
            what=f"the sweep {sweep_dir.name}",
        )
    except ValueError as error:
        raise UserError(str(error)) from None
    command = [python, "-m", "hvdtrain", "sweep", *sweep_argv(plan, sweep_dir)]
    return SubmitPlan(
        batch_script(header, command),
        sweep_dir,
        ["sbatch", "--parsable", str(sweep_dir / SCRIPT)],
        plan.recipe,
    )
