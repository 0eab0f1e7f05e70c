"""`hvdtrain runs`, `show` and `checkpoint`: what run directories hold."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import click

import hvdtrain
from hvdtrain.errors import UserError
from hvdtrain.job.request import RUNS


@click.command(name="runs")
@click.argument("folder", required=False, type=click.Path(path_type=Path))
@click.option(
    "--dir",
    "folder_option",
    type=click.Path(path_type=Path),
    default=None,
    help="The folder of run directories, or one run directory (same as FOLDER). [default: runs]",
)
@click.option("--json", "as_json", is_flag=True, help="One JSON list of the runs, for programs.")
def list_runs(folder: Path | None, folder_option: Path | None, as_json: bool) -> None:
    """The run directories in FOLDER, oldest first: recipe, strategy, ranks, status, test accuracy,
    final loss, start. A run whose hvdtrain process is gone without saying how it ended is interrupted."""
    from hvdtrain.records import runs as runs_module
    from hvdtrain.records import view as runs_view

    if folder and folder_option and folder != folder_option:
        raise UserError(f"give the folder once: {folder} or --dir {folder_option}")
    named = folder or folder_option
    if named is not None and not named.exists():  # a folder asked for by name: a typo, not "no runs"
        raise UserError(f"{'--dir ' if folder_option else ''}{named}: no such folder")
    where = named or RUNS
    if not where.exists() and as_json:
        click.echo("[]")
        return
    if not where.exists():
        click.echo(f"no runs: {where} does not exist")
        return
    if not where.is_dir():
        raise UserError(f"{where} is a file, not a folder of run directories")
    try:
        found = [runs_module.read_run(path, socket.gethostname()) for path in runs_module.find_runs(where)]
    except (OSError, ValueError) as error:
        raise UserError(str(error)) from None
    if as_json:
        click.echo(json.dumps([runs_view.row_record(facts) for facts in found], indent=1))
    elif not found:
        click.echo(f"no runs: {where} holds no run directory")
        return
    else:
        click.echo(runs_view.render_rows([runs_view.run_row(facts) for facts in found]))
    for problem in (problem for facts in found for problem in facts.problems):
        click.echo(f"hvdtrain: {problem}", err=True)


@click.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option(
    "--json", "as_json", is_flag=True, help="The run as one JSON object, for programs; no curves drawn."
)
def show(run_dir: Path, as_json: bool) -> None:
    """RUN_DIR's status, summary and config; writes RUN_DIR/curves.png: loss, test accuracy, learning
    rate and samples/s per epoch. Nothing else in RUN_DIR is changed. For a sweep directory (hvdtrain
    sweep): its trials and best trial, and its optimisation history, parallel coordinates and param
    importances as PNGs in it."""
    from hvdtrain.records import runs as runs_module
    from hvdtrain.records import view as runs_view

    if runs_module.is_sweep_dir(run_dir):
        show_sweep(run_dir, as_json)
        return
    try:
        facts = runs_module.read_run(run_dir, socket.gethostname())
    except ValueError as error:
        raise UserError(str(error)) from None
    if facts.problems:
        raise UserError("; ".join(facts.problems))
    if as_json:
        click.echo(json.dumps(runs_view.show_record(facts), indent=1))
        return
    click.echo("\n".join(runs_view.show_lines(facts)))
    if not facts.epochs:
        click.echo("\ncurves: none yet (metrics.jsonl holds no epoch)")
        return
    if missing := runs_view.plotting_missing():
        click.echo(f"\ncurves: not drawn: {missing}")
        return
    path = facts.path / runs_view.CURVES
    try:
        runs_view.draw_curves(facts)
    except OSError as error:
        raise UserError(f"cannot write {path}: {error.strerror}") from None
    click.echo(f"\ncurves: {path}")


def show_sweep(sweep_dir: Path, as_json: bool) -> None:
    from hvdtrain.sweep import plots

    try:
        record = plots.read_record(sweep_dir)
    except ValueError as error:
        raise UserError(str(error)) from None
    if as_json:
        click.echo(json.dumps(record, indent=1))
        return
    click.echo("\n".join(plots.show_lines(record)))
    written, problems = plots.draw(sweep_dir, record)
    click.echo("")
    for path in written:
        click.echo(f"figure: {path}")
    for problem in problems:
        click.echo(f"figure: {problem}")


@click.group()
def checkpoint() -> None:
    """A run directory's checkpoints."""


@checkpoint.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.option("--step", type=click.IntRange(min=0), default=None, help="[default: the newest checkpoint]")
def consolidate(run_dir: Path, step: int | None) -> None:
    """Write a sharded checkpoint of RUN_DIR (--strategy zero's) whole, into a new step directory that
    any torch strategy resumes and torch.load reads; the sharded one stays."""
    click.echo(f"consolidated: {hvdtrain.consolidate(run_dir, step)}")
