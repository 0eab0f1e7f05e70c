"""`hvdtrain sweep`: a hyperparameter search, each trial an `hvdtrain run` with every run option given
here. The run options are `hvdtrain run`'s own declarations (hvdtrain.options, hvdtrain.cli.jobs),
less those a sweep decides per trial (--run-dir, --resume-from; --resume continues the sweep)."""

from __future__ import annotations

import sys

import click
from click.core import ParameterSource

from hvdtrain.cli import jobs
from hvdtrain.errors import UserError
from hvdtrain.options import COMMON
from hvdtrain.sweep import space

PER_TRIAL = ("run_dir", "resume", "resume_from")
"""Run options a sweep does not pass on: each trial's run directory is its own, and --resume means
the sweep's."""


def sweep_run_options(command):
    """TARGET and every option of `hvdtrain run` but PER_TRIAL, as `hvdtrain run` declares them."""
    decorators = [
        click.option(
            "--config",
            type=click.Path(dir_okay=False),
            is_eager=True,
            expose_value=False,
            callback=jobs.read_run_file,
            help="A TOML file of the run options and a [set] table (hvdtrain run --print-config writes one).",
        ),
        click.argument("target", shell_complete=jobs.complete_recipes),
        *(
            decorator
            for option in COMMON
            if option.flag and option.name not in PER_TRIAL
            for decorator in (
                jobs.common_option(option),
                *[jobs.strategy_options] * (option.name == "strategy"),
            )
        ),
    ]
    for decorate in reversed(decorators):
        command = decorate(command)
    return command


@click.command()
@click.pass_context
@sweep_run_options
@click.option(
    "--param",
    "params",
    multiple=True,
    metavar="NAME=KIND:...",
    help="A config field to search: NAME=log:A:B, float:A:B, int:A:B or choice:X,Y,... (repeat).",
)
@click.option("--trials", type=int, default=None, help="Trials in all. [default: 20; grid: its size]")
@click.option(
    "--metric", default=None, help="What to optimize. [default: the recipe's monitor, else test metric]"
)
@click.option(
    "--direction",
    type=click.Choice(space.DIRECTIONS),
    default=None,
    help="[default: the metric's better way]",
)
@click.option(
    "--sweep-dir",
    type=click.Path(),
    default=None,
    help="The study, the trials' run directories and sweep.json; an existing one continues. "
    "[default: runs/sweep-RECIPE-TIMESTAMP]",
)
@click.option(
    "--storage",
    default=None,
    metavar="URL",
    help="An RDB URL for the study (many nodes). [default: a file in --sweep-dir]",
)
@click.option("--sampler", type=click.Choice(space.SAMPLERS), default="tpe", show_default=True)
@click.option("--pruner", type=click.Choice(space.PRUNERS), default="median", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Seeds the sampler.")
@click.option(
    "--concurrent",
    type=int,
    default=1,
    show_default=True,
    help="Trials at once, sharing out the hosts or cores.",
)
@click.option("--resume", is_flag=True, help="Continue the sweep: --sweep-dir's, else the recipe's newest.")
@click.option(
    "--submit",
    is_flag=True,
    help="Run the sweep as a Slurm batch job on --nodes (requeued when preempted); its trials share them.",
)
@jobs.allocation_options
def sweep(ctx, target, params, trials, metric, direction, sweep_dir, storage, sampler, pruner, seed,
          concurrent, resume, submit, nodes, ntasks_per_node, time, partition, sbatch_args,
          **options) -> None:  # fmt: skip
    """Search TARGET's config fields (--param) with Optuna: every trial an `hvdtrain run TARGET` with
    the options given here, in a run directory of its own under --sweep-dir. The same command again
    (or --resume) continues a stopped or killed sweep: finished trials are kept, interrupted ones
    resume from their checkpoints."""
    import hvdtrain.sweep as sweeping

    arguments = jobs.given(ctx, options)
    arguments["verbose"] = arguments.get("verbose") or ctx.obj["verbose"]
    allocation = {"nodes": nodes, "ntasks_per_node": ntasks_per_node, "time": time, "partition": partition,
                  "sbatch_args": sbatch_args}  # fmt: skip
    given = [
        name for name in allocation if ctx.get_parameter_source(name) not in (None, ParameterSource.DEFAULT)
    ]
    if given and not submit:
        flags = ", ".join(
            "--sbatch-arg" if name == "sbatch_args" else "--" + name.replace("_", "-") for name in given
        )
        raise UserError(f"{flags}: the allocation of a sweep run as a batch job, with --submit")
    plan = sweeping.prepare(
        target, params, trials=trials, metric=metric, direction=direction, sweep_dir=sweep_dir,
        storage=storage, sampler=sampler, pruner=pruner, seed=seed, concurrent=concurrent, resume=resume,
        run_keywords=arguments, submit=submit,
    )  # fmt: skip
    if submit:
        done = sweeping.submit(plan, allocation)
        click.echo(f"submitted Slurm job {done.job_id}: the sweep {done.run_dir} (script {done.script.name})")
        return
    result = sweeping.run(plan)
    for line in final_lines(result):
        click.echo(line)
    if result.message:
        click.echo(f"hvdtrain: {result.message}", err=True)
    if line := sweeping.requeue_if_preempted(result, sweep_dir is not None):  # last: Slurm ends this job now
        click.echo(line, err=True)
    if result.exit_code:
        sys.exit(result.exit_code)


def final_lines(result) -> list[str]:
    lines = ["", *space.table_lines(result.trials, result.metric), ""]
    counts = {state: sum(row.state == state for row in result.trials) for state in space.STATES}
    lines.append("trials: " + ", ".join(f"{count} {state}" for state, count in counts.items() if count))
    if result.stopped_by is not None:
        lines.append(
            "sweep stopped: its running trials checkpointed; the same command continues it "
            f"({result.sweep_dir})"
        )
    best = result.best
    if best is None:
        lines.append(f"best: none (no trial completed); sweep: {result.sweep_dir}/sweep.json")
        return lines
    lines.append(
        f"best: trial {best.number}  {result.metric}={space.shown_value(best.value)}  "
        f"{space.params_cell(best.params)}"
    )
    lines.append(f"  run dir: {best.run_dir}")
    lines.append(f"  again:   {result.command}")
    lines.append(f"sweep: {result.sweep_dir}/sweep.json")
    return lines
