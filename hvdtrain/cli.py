"""The `hvdtrain` command: a thin shell over the Python API. Each command parses, calls the library,
and turns its typed errors into one line and exit code 2. Only this module imports click."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

import click

import hvdtrain
from hvdtrain import config as config_module
from hvdtrain import doctor as doctor_module
from hvdtrain import launchers, registry, strategies
from hvdtrain.errors import UserError
from hvdtrain.job.request import RUNS
from hvdtrain.options import COMMON, RunOption


class Commands(click.Group):
    """hvdtrain's errors as the user sees them: one line on stderr, no traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except UserError as error:
            click.echo(f"hvdtrain: error: {error}", err=True)
            ctx.exit(error.exit_code)


def fail(message: str, exit_code: int = 1) -> None:
    """A command that ran and failed: what happened, and the exit code."""
    click.echo(f"hvdtrain: {message}", err=True)
    sys.exit(exit_code)


@click.group(cls=Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="hvdtrain")
@click.option("--verbose", is_flag=True, help="Show the frameworks' start-up logs too.")
@click.pass_context
def main(ctx: click.Context, verbose: bool) -> None:
    """Data-parallel training of PyTorch and TensorFlow/Keras 3 models with Horovod."""
    ctx.obj = {"verbose": verbose}
    if not verbose:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option(
    "--require",
    default=",".join(doctor_module.DEFAULT_REQUIRED),
    show_default=True,
    help="Comma-separated parts that must be built: torch, tensorflow, gloo, mpi, nccl.",
)
@click.option(
    "--fresh",
    is_flag=True,
    help="Probe the build anew (imports each framework) instead of the kept verdicts.",
)
def doctor(as_json: bool, require: str, fresh: bool) -> None:
    """Versions, and what the installed Horovod was built with; exit 1 if a required part is missing.

    What a build can do is probed once and kept per build (the extension files' identity)."""
    required = [name.strip() for name in require.split(",") if name.strip()]
    valid = set(doctor_module.PARTS)
    if unknown := sorted(set(required) - valid):
        raise UserError(
            f"--require: unknown part(s) {', '.join(unknown)}; choose from {', '.join(sorted(valid))}"
        )
    report = doctor_module.collect(fresh=fresh)
    missing = report.missing(required) if report.versions["horovod"] else required
    if as_json:
        found = {**report.to_dict(), "required": required, "missing": missing, "ok": not missing}
        click.echo(json.dumps(found, indent=2))
    else:
        click.echo(doctor_module.render(report, required))
    sys.exit(1 if missing else 0)


@main.command(name="list")
def list_recipes() -> None:
    """The registered recipes (built in and installed as plugins), and any recipe module or plugin
    that cannot be used."""
    found = registry.catalog()
    width = max((len(name) for name in found.recipes), default=0)
    for recipe in found.recipes.values():
        click.echo(f"{recipe.name:<{width}}  {recipe.framework:<10}  {recipe.dataset}")
        click.echo(f"{'':<{width}}  {recipe.description}")
    for module, error in found.broken.items():
        click.echo(f"hvdtrain: {module} failed to import: {error}", err=True)
    for where, why in doctor_module.broken_plugins().items():
        click.echo(f"hvdtrain: {where} {why}; left out", err=True)


def strategy_options(command):
    """The run options only some strategies or launchers read, from their registries. None when not
    given, so a strategy or launcher can refuse what it does not read."""
    by_launcher = launchers.all_options()
    for option, readers in reversed(strategies.all_options().values()):
        if option.name in by_launcher:  # read by the horovod strategy's launchers, each its own
            option, launcher_names = by_launcher[option.name]
            readers = [f"--launcher {', '.join(launcher_names)}"]
        help_text = f"[{', '.join(readers)}] {option.help} [default: {str(option.default).lower()}]"
        if option.type is bool:
            kind = {"is_flag": True}
        elif isinstance(option.type, tuple):
            kind = {"type": click.Choice(option.type)}
        else:
            kind = {"type": option.type}
        command = click.option(option.flag, option.name, default=None, help=help_text, **kind)(command)
    return command


def common_option(option: RunOption):
    """The click option of one of the options every run reads."""
    kind: dict = {"default": option.default, "show_default": option.show_default, "metavar": option.metavar}
    if option.kind == "bool":
        kind |= {"is_flag": True}
    elif option.kind in ("strings", "overrides"):
        kind |= {"multiple": True, "default": ()}
    elif option.kind == "int":
        kind |= {"type": int}
    elif option.kind == "path":
        kind |= {"type": click.Path()}
    # the strategy's help lists the strategies the registry holds, plugins' too
    help_text = strategies.help_text() if option.name == "strategy" else option.help
    return click.option(option.flag, option.name, help=help_text, **kind)


RUN_OPTIONS = [
    click.argument("target"),
    click.argument("script_args", nargs=-1, type=click.UNPROCESSED),
    *(
        decorator
        for option in COMMON
        if option.flag
        for decorator in (common_option(option), *[strategy_options] * (option.name == "strategy"))
    ),
]
"""`hvdtrain run`'s argument and options, top to bottom (the options only some strategies or
launchers read after --strategy); `hvdtrain submit` takes them too."""


def run_options(command):
    """TARGET, the script's arguments and every option of a run, as if stacked on `command`."""
    for decorate in reversed(RUN_OPTIONS):
        command = decorate(command)
    return command


@main.command()
@click.pass_context
@run_options
@click.option("--dry-run", is_flag=True, help="Print the launch command and exit; nothing is written.")
def run(ctx, target, dry_run, **options) -> None:
    """Train TARGET on --np ranks: a recipe name, your own recipe (a .py file, or module:pkg.mod, that
    defines RECIPE = hvdtrain.registry.Recipe(...)), or a Horovod training script.

    Arguments after `--` go to the script unchanged. Options marked [horovod] or [ps] are read by
    that strategy only, those marked [--launcher NAME] by that launcher only; the others refuse them.
    """
    # each parameter is named as hvdtrain.run's keyword; options not given stay the API's defaults
    arguments = {name: value for name, value in options.items() if value is not None}
    arguments["verbose"] = ctx.obj["verbose"]
    if dry_run:
        try:
            plan = hvdtrain.plan(target, **arguments)
        except hvdtrain.NothingToDo as done:
            click.echo(f"hvdtrain: {done}")
            return
        click.echo(f"# environment passed on: {' '.join(plan.passed_on)}")
        click.echo(plan.command.render())
        return
    result = hvdtrain.run(target, **arguments)
    if result.exit_code:
        sys.exit(result.exit_code)


@main.command()
@click.pass_context
@run_options
@click.option("--nodes", type=int, default=1, show_default=True, help="Nodes to ask Slurm for.")
@click.option(
    "--ntasks-per-node", type=int, default=None, help="Ranks per node. [default: --np over the nodes, else 1]"
)
@click.option(
    "--time", default=None, help="Slurm's time limit (MINUTES, HOURS:MINUTES:SECONDS, DAYS-HOURS, ...)."
)
@click.option("--partition", default=None, help="The Slurm partition. [default: the cluster's]")
@click.option(
    "--sbatch-arg",
    "sbatch_args",
    multiple=True,
    metavar="ARG",
    help="One more sbatch option, e.g. --gres=gpu:4.",
)
@click.option(
    "--dry-run", is_flag=True, help="Print the batch script and exit; nothing is written or submitted."
)
def submit(ctx, target, nodes, ntasks_per_node, time, partition, sbatch_args, dry_run, **options) -> None:
    """Submit `hvdtrain run TARGET ...` as a Slurm batch job: the script goes into the run directory,
    the job asks to be requeued when preempted, and a requeued job resumes the run."""
    arguments = {name: value for name, value in options.items() if value is not None}
    done = hvdtrain.submit(
        target, nodes=nodes, ntasks_per_node=ntasks_per_node, time=time, partition=partition,
        sbatch_args=sbatch_args, dry_run=dry_run, **arguments,
    )  # fmt: skip
    if dry_run:
        click.echo(done.script, nl=False)
        return
    click.echo(f"submitted Slurm job {done.job_id}: the run {done.run_dir} (script {done.script.name})")


@main.command(name="runs")
@click.argument("folder", required=False, type=click.Path(path_type=Path))
@click.option(
    "--dir",
    "folder_option",
    type=click.Path(path_type=Path),
    default=None,
    help="The folder of run directories, or one run directory (same as FOLDER). [default: runs]",
)
def list_runs(folder: Path | None, folder_option: Path | None) -> None:
    """The run directories in FOLDER, oldest first: recipe, strategy, ranks, status, test accuracy,
    final loss, start. A run whose hvdtrain process is gone without saying how it ended is interrupted."""
    from hvdtrain import runs as runs_module
    from hvdtrain import runs_view

    if folder and folder_option and folder != folder_option:
        raise UserError(f"give the folder once: {folder} or --dir {folder_option}")
    named = folder or folder_option
    if named is not None and not named.exists():  # a folder asked for by name: a typo, not "no runs"
        raise UserError(f"{'--dir ' if folder_option else ''}{named}: no such folder")
    where = named or RUNS
    if not where.exists():
        click.echo(f"no runs: {where} does not exist")
        return
    if not where.is_dir():
        raise UserError(f"{where} is a file, not a folder of run directories")
    try:
        found = [runs_module.read_run(path, socket.gethostname()) for path in runs_module.find_runs(where)]
    except (OSError, ValueError) as error:
        raise UserError(str(error)) from None
    if not found:
        click.echo(f"no runs: {where} holds no run directory")
        return
    click.echo(runs_view.render_rows([runs_view.run_row(facts) for facts in found]))
    for problem in (problem for facts in found for problem in facts.problems):
        click.echo(f"hvdtrain: {problem}", err=True)


@main.group()
def checkpoint() -> None:
    """A run directory's checkpoints."""


@checkpoint.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--step", type=click.IntRange(min=0), default=None, help="[default: the newest checkpoint]")
def consolidate(run_dir: Path, step: int | None) -> None:
    """Write a sharded checkpoint of RUN_DIR (--strategy zero's) whole, into a new step directory that
    any torch strategy resumes and torch.load reads; the sharded one stays."""
    click.echo(f"consolidated: {hvdtrain.consolidate(run_dir, step)}")


@main.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
def show(run_dir: Path) -> None:
    """RUN_DIR's status, summary and config; writes RUN_DIR/curves.png: loss, test accuracy, learning
    rate and samples/s per epoch. Nothing else in RUN_DIR is changed."""
    from hvdtrain import runs as runs_module
    from hvdtrain import runs_view

    try:
        facts = runs_module.read_run(run_dir, socket.gethostname())
    except ValueError as error:
        raise UserError(str(error)) from None
    if facts.problems:
        raise UserError("; ".join(facts.problems))
    click.echo("\n".join(runs_view.show_lines(facts)))
    if not facts.epochs:
        click.echo("\ncurves: none yet (metrics.jsonl holds no epoch)")
        return
    path = facts.path / runs_view.CURVES
    try:
        runs_view.draw_curves(facts)
    except OSError as error:
        raise UserError(f"cannot write {path}: {error.strerror}") from None
    click.echo(f"\ncurves: {path}")


@main.command()
@click.argument("recipe_name", metavar="RECIPE")
@click.option(
    "--strategies",
    "strategy_names",
    default="horovod",
    show_default=True,
    help=f"Comma-separated: {', '.join(strategies.all_strategies())}.",
)
@click.option("--np", "nps", default="1,2", show_default=True, help="Comma-separated world sizes.")
@click.option(
    "--launchers",
    "launcher_names",
    default="gloo",
    show_default=True,
    help=f"Launchers for the horovod strategy: {', '.join(launchers.names())}.",
)
@click.option("--steps", type=int, default=20, show_default=True, help="Steps per epoch.")
@click.option("--epochs", type=int, default=3, show_default=True, help="Epochs; the first is left out.")
@click.option("--batch-size", type=int, default=32, show_default=True, help="Per process.")
@click.option("--repeats", type=int, default=1, show_default=True, help="Interleaved repeats; the median.")
@click.option("--out", type=click.Path(path_type=Path), default=None, help="[default: runs/bench-TIMESTAMP]")
@click.option(
    "--tune",
    is_flag=True,
    help="Time each strategy's communication settings at the largest --np: Horovod's fusion threshold "
    "and cycle time (its defaults, a few others, its autotune; over the first launcher), DDP's bucket "
    "size. Keep the best for `hvdtrain run RECIPE`.",
)
def bench(
    recipe_name, strategy_names, nps, launcher_names, steps, epochs, batch_size, repeats, out, tune
) -> None:
    """Run RECIPE under each strategy and world size side by side; print a table, write CSV and PNG."""
    from hvdtrain import bench as bench_module

    try:
        recipe, chosen, world_sizes, launcher_list = bench_module.check(
            recipe_name, strategy_names, nps, launcher_names, steps, epochs, batch_size, repeats
        )
        if tune and not set(chosen) <= set(tunable := bench_module.tunables()):
            raise ValueError(
                f"--tune times the {' and '.join(tunable)} strategies only; not {strategy_names}"
            )
    except ValueError as error:
        raise UserError(str(error)) from None
    out = out or Path("runs") / f"bench-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    if tune:
        try:
            click.echo(
                bench_module.tune_and_keep(
                    recipe.name, chosen, world_sizes, launcher_list, steps, epochs, batch_size, out, repeats
                )
            )
        except bench_module.BenchError as error:
            fail(str(error))
        return
    try:
        rows = bench_module.matrix(
            recipe.name, chosen, world_sizes, launcher_list, steps, epochs, batch_size, out, repeats
        )
    except bench_module.BenchError as error:
        fail(str(error))
    click.echo(bench_module.render(rows))
    bench_module.write_csv(rows, out / "bench.csv")
    bench_module.plot(rows, out / "bench.png")
    if bench_module.record_launchers(rows, recipe.framework):
        click.echo(
            f"recorded launcher throughput for --launcher auto in {bench_module.LAUNCHER_MEASUREMENTS}"
        )
    click.echo(f"wrote {out / 'bench.csv'} and {out / 'bench.png'}")


@main.command()
@click.argument("recipe_name", metavar="RECIPE")
@click.option("--np", "num_proc", type=int, required=True, help="Total ranks.")
@click.option("--image", required=True, help="Container image with hvdtrain (make image builds one).")
@click.option("--slots-per-worker", type=int, default=1, show_default=True, help="Ranks per worker pod.")
@click.option("--cpu-per-slot", default="1", show_default=True)
@click.option("--memory-per-worker", default="4Gi", show_default=True)
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a config field.")
@click.option("--name", default=None, help="MPIJob name. [default: hvdtrain-RECIPE]")
def k8s(
    recipe_name, num_proc, image, slots_per_worker, cpu_per_slot, memory_per_worker, overrides, name
) -> None:
    """Print a Kubeflow MPI Operator MPIJob (kubeflow.org/v2beta1) that trains RECIPE on a cluster."""
    import yaml

    from hvdtrain.k8s import MPIJobSpec, mpijob

    try:
        recipe = registry.get(recipe_name)
        strategies.get("horovod", recipe.framework)
        config_module.apply(recipe.make_config(), config_module.parse_overrides(recipe.config, overrides))
        if not cpu_per_slot.isdigit() or int(cpu_per_slot) < 1:
            raise ValueError(f"--cpu-per-slot must be a whole number of CPUs, got {cpu_per_slot!r}")
        job = mpijob(
            MPIJobSpec(
                recipe=recipe.name,
                np=num_proc,
                image=image,
                slots_per_worker=slots_per_worker,
                cpu_per_slot=cpu_per_slot,
                memory_per_worker=memory_per_worker,
                set_overrides=tuple(overrides),
                name=name,
            )
        )
    except ValueError as error:
        raise UserError(str(error)) from None
    click.echo(yaml.safe_dump(job, sort_keys=False), nl=False)


if __name__ == "__main__":
    main()
