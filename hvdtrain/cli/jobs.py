"""`hvdtrain list`, `run` and `submit`: the recipes, and a training job here or as a Slurm batch job.
Every run option comes from hvdtrain.options and the strategies' and launchers' registries."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import click
from click.core import ParameterSource

import hvdtrain
from hvdtrain import launchers, registry, strategies
from hvdtrain.errors import UserError
from hvdtrain.job import run_file
from hvdtrain.measure import doctor as doctor_module
from hvdtrain.options import COMMON, RunOption


@click.command(name="list")
@click.option("--json", "as_json", is_flag=True, help="One JSON list of the recipes, for programs.")
def list_recipes(as_json: bool) -> None:
    """The registered recipes (built in and installed as plugins), and any recipe module or plugin
    that cannot be used."""
    found = registry.catalog()
    if as_json:
        described = [
            {
                "name": recipe.name,
                "framework": recipe.framework,
                "dataset": recipe.dataset,
                "description": recipe.description,
                "variants": sorted(recipe.variants),
                "config": dataclasses.asdict(recipe.make_config(None)),
            }
            for recipe in found.recipes.values()
        ]
        click.echo(json.dumps(described, indent=1))
    width = max((len(name) for name in found.recipes), default=0)
    for recipe in () if as_json else found.recipes.values():
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


def complete_recipes(ctx, param, incomplete: str) -> list[str]:
    """The shell's completion of TARGET: the recipe names (built in and plugins')."""
    return sorted(name for name in registry.catalog().recipes if name.startswith(incomplete))


def complete_strategies(ctx, param, incomplete: str) -> list[str]:
    return sorted(name for name in strategies.all_strategies() if name.startswith(incomplete))


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
    if option.name == "strategy":
        kind |= {"shell_complete": complete_strategies}
    help_text = strategies.help_text() if option.name == "strategy" else option.help
    return click.option(option.flag, *option.aliases, option.name, help=help_text, **kind)


FILE_OVERRIDES = "hvdtrain.run_file_overrides"
"""Where --config leaves its [set] values, which go before the command line's --set."""


def read_run_file(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    """--config FILE: its values become the defaults of this command's parameters (the command line
    and HVDTRAIN_* variables win), its [set] the first --set values."""
    if value is None:
        return
    try:
        takes = {p.name: bool(p.multiple or p.nargs == -1) for p in ctx.command.params if p.name}
        found, overrides = run_file.read(Path(value), takes)
    except ValueError as error:
        raise UserError(str(error)) from None
    ctx.default_map = {**(ctx.default_map or {}), **found}
    ctx.meta[FILE_OVERRIDES] = overrides


def given(ctx: click.Context, options: dict) -> dict:
    """hvdtrain.run's keywords from the parsed options: those not given stay the API's defaults, and
    --config's [set] goes before the command line's --set (a later value of a key wins)."""
    arguments = {name: value for name, value in options.items() if value is not None}
    overrides = (*ctx.meta.get(FILE_OVERRIDES, ()), *arguments.get("overrides", ()))
    return {**arguments, "overrides": overrides} if overrides else arguments


RUN_OPTIONS = [
    click.option(
        "--config",
        type=click.Path(dir_okay=False),
        is_eager=True,
        expose_value=False,
        callback=read_run_file,
        help="A TOML file of these options and a [set] table (--print-config writes one); the command "
        "line wins over it.",
    ),
    click.argument("target", shell_complete=complete_recipes),
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


@click.command()
@click.pass_context
@run_options
@click.option("--dry-run", is_flag=True, help="Print the launch command and exit; nothing is written.")
@click.option(
    "--print-config",
    is_flag=True,
    help="Print this run's options and the recipe's whole config as the TOML --config reads, and exit.",
)
def run(ctx, target, dry_run, print_config, **options) -> None:
    """Train TARGET on --np ranks: a recipe name, your own recipe (a .py file, or module:pkg.mod, that
    defines RECIPE = hvdtrain.registry.Recipe(...)), or a Horovod training script.

    Arguments after `--` go to the script unchanged. Options marked [horovod] or [ps] are read by
    that strategy only, those marked [--launcher NAME] by that launcher only; the others refuse them.
    """
    arguments = given(ctx, options)  # each parameter is named as hvdtrain.run's keyword
    arguments["verbose"] = arguments.get("verbose") or ctx.obj["verbose"]
    if arguments["verbose"] and ctx.obj["quieted_tensorflow"]:  # `hvdtrain run --verbose`
        os.environ.pop("TF_CPP_MIN_LOG_LEVEL", None)
    if print_config or dry_run:
        try:
            planned = hvdtrain.plan(target, **arguments)
        except hvdtrain.NothingToDo as done:
            click.echo(f"hvdtrain: {done}")
            return
    if print_config:
        chosen = {  # in --help's order, not the command line's
            param.name: options[param.name]
            for param in ctx.command.params
            if param.name in options
            and ctx.get_parameter_source(param.name) not in (None, ParameterSource.DEFAULT)
        }
        defaults = None
        if planned.config is not None and planned.recipe is not None:
            recipe = registry.load(planned.recipe_source or planned.recipe)
            defaults = recipe.make_config(arguments.get("variant"))
        click.echo(run_file.text(target, chosen, planned.config, defaults), nl=False)
        return
    if dry_run:
        click.echo(f"# environment passed on: {' '.join(planned.passed_on)}")
        click.echo(planned.command.render())
        return
    result = hvdtrain.run(target, **arguments)
    if result.exit_code:
        sys.exit(result.exit_code)


def allocation_options(command):
    """The Slurm allocation a batch job asks for: `hvdtrain submit`'s and `hvdtrain sweep --submit`'s."""
    decorators = [
        click.option("--nodes", type=int, default=1, show_default=True, help="Nodes to ask Slurm for."),
        click.option(
            "--ntasks-per-node",
            type=int,
            default=None,
            help="Ranks per node. [default: --np over the nodes, else 1]",
        ),
        click.option(
            "--time",
            default=None,
            help="Slurm's time limit (MINUTES, HOURS:MINUTES:SECONDS, DAYS-HOURS, ...).",
        ),
        click.option("--partition", default=None, help="The Slurm partition. [default: the cluster's]"),
        click.option(
            "--sbatch-arg",
            "sbatch_args",
            multiple=True,
            metavar="ARG",
            help="One more sbatch option, e.g. --gres=gpu:4.",
        ),
    ]
    for decorate in reversed(decorators):
        command = decorate(command)
    return command


@click.command()
@click.pass_context
@run_options
@allocation_options
@click.option(
    "--dry-run", is_flag=True, help="Print the batch script and exit; nothing is written or submitted."
)
def submit(ctx, target, nodes, ntasks_per_node, time, partition, sbatch_args, dry_run, **options) -> None:
    """Submit `hvdtrain run TARGET ...` as a Slurm batch job: the script goes into the run directory,
    the job asks to be requeued when preempted, and a requeued job resumes the run."""
    arguments = given(ctx, options)
    done = hvdtrain.submit(
        target, nodes=nodes, ntasks_per_node=ntasks_per_node, time=time, partition=partition,
        sbatch_args=sbatch_args, dry_run=dry_run, **arguments,
    )  # fmt: skip
    if dry_run:
        click.echo(done.script, nl=False)
        return
    click.echo(f"submitted Slurm job {done.job_id}: the run {done.run_dir} (script {done.script.name})")
