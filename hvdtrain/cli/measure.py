"""`hvdtrain doctor` and `bench`: what the installed Horovod can do, and how fast a recipe trains
under each strategy on this machine."""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import click

from hvdtrain import launchers, strategies
from hvdtrain.cli import jobs
from hvdtrain.cli.base import fail
from hvdtrain.errors import UserError
from hvdtrain.measure import doctor as doctor_module


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option(
    "--require",
    default=None,
    help="Comma-separated parts that must be built: torch, tensorflow, gloo, mpi, nccl. "
    "[default: the frameworks installed here, gloo, and mpi where mpirun is on PATH]",
)
@click.option(
    "--fresh",
    is_flag=True,
    help="Probe the build anew (imports each framework) instead of the kept verdicts.",
)
def doctor(as_json: bool, require: str | None, fresh: bool) -> None:
    """Versions, and what the installed Horovod was built with; exit 1 if a required part is missing.

    What a build can do is probed once and kept per build (the extension files' identity)."""
    required = [name.strip() for name in (require or "").split(",") if name.strip()]
    valid = set(doctor_module.PARTS)
    if unknown := sorted(set(required) - valid):
        raise UserError(
            f"--require: unknown part(s) {', '.join(unknown)}; choose from {', '.join(sorted(valid))}"
        )
    report = doctor_module.collect(fresh=fresh)
    required = required or doctor_module.default_required(report, shutil.which("mpirun") is not None)
    missing = report.missing(required) if report.versions["horovod"] else required
    if as_json:
        found = {**report.to_dict(), "required": required, "missing": missing, "ok": not missing}
        click.echo(json.dumps(found, indent=2))
    else:
        click.echo(doctor_module.render(report, required))
    sys.exit(1 if missing else 0)


@click.command()
@click.argument("recipe_name", metavar="RECIPE", shell_complete=jobs.complete_recipes)
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
@click.option("--variant", default=None, help="A recipe variant for every run, as `hvdtrain run --variant`.")
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override a config field in every run, as `hvdtrain run --set` (image_size=64, ...).",
)
@click.option("--out", type=click.Path(path_type=Path), default=None, help="[default: runs/bench-TIMESTAMP]")
@click.option(
    "--hosts",
    default=None,
    metavar="HOST:SLOTS,...",
    help="Run every run across these hosts, as `hvdtrain run --hosts`: what --tune keeps is then "
    "measured on their network, not this host's loopback.",
)
@click.option(
    "--tune",
    is_flag=True,
    help="Time each strategy's communication settings at the largest --np: Horovod's fusion threshold "
    "and cycle time (its defaults, a few others, its autotune; over the first launcher), DDP's bucket "
    "size. Keep the best for `hvdtrain run RECIPE`.",
)
def bench(
    recipe_name,
    strategy_names,
    nps,
    launcher_names,
    steps,
    epochs,
    batch_size,
    repeats,
    variant,
    overrides,
    out,
    hosts,
    tune,
) -> None:
    """Run RECIPE under each strategy and world size side by side; print a table, write CSV and PNG."""
    from hvdtrain.measure import bench as bench_module
    from hvdtrain.measure import tune as tune_module

    try:
        recipe, chosen, world_sizes, launcher_list = bench_module.check(
            recipe_name, strategy_names, nps, launcher_names, steps, epochs, batch_size, repeats
        )
        extra = bench_module.run_options(recipe, variant, tuple(overrides), hosts)
        if tune and not set(chosen) <= set(tunable := tune_module.tunables()):
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
                tune_module.tune_and_keep(
                    recipe.name,
                    chosen,
                    world_sizes,
                    launcher_list,
                    steps,
                    epochs,
                    batch_size,
                    out,
                    repeats,
                    extra=extra,
                    hosts=hosts,
                )
            )
        except bench_module.BenchError as error:
            fail(str(error))
        return
    try:
        rows = bench_module.matrix(
            recipe.name, chosen, world_sizes, launcher_list, steps, epochs, batch_size, out, repeats, extra
        )
    except bench_module.BenchError as error:
        fail(str(error))
    click.echo(bench_module.render(rows))
    bench_module.write_csv(rows, out / "bench.csv")
    from hvdtrain.records.view import plotting_missing

    if missing := plotting_missing():
        click.echo(f"hvdtrain: bench.png not drawn: {missing}", err=True)
    else:
        bench_module.plot(rows, out / "bench.png")
    if bench_module.record_launchers(rows, recipe.framework):
        click.echo(
            f"recorded launcher throughput for --launcher auto in {bench_module.LAUNCHER_MEASUREMENTS}"
        )
    click.echo(f"wrote {out / 'bench.csv'} and {out / 'bench.png'}")


@click.command()
@click.argument("recipe_name", metavar="RECIPE", shell_complete=jobs.complete_recipes)
@click.option("--np", "nps", default="2,8,64", show_default=True, help="Comma-separated world sizes.")
@click.option(
    "--link-gbps",
    default="25",
    show_default=True,
    help="Each rank's link in Gbit/s, or `here`: this host's loopback, measured with two gloo ranks.",
)
@click.option(
    "--latency-us",
    type=float,
    default=None,
    help="Latency of one ring step in microseconds. [default: 10 with --link-gbps G; measured with `here`]",
)
@click.option("--device", default=None, help="Scale the compute to a GPU: p100, v100, a100, h100, h200.")
@click.option("--compute-ms", type=float, default=None, help="A step's compute time on one rank, given.")
@click.option(
    "--strategies",
    "strategy_names",
    default=None,
    help="Comma-separated strategies that declare their traffic (horovod, ddp, zero, fsdp). "
    "[default: those that run the recipe]",
)
@click.option("--variant", default=None, help="A recipe variant, as `hvdtrain run --variant`.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a config field.")
@click.option("--threads-per-rank", type=int, default=None, help="torch threads for the measured step.")
@click.option("--json", "as_json", is_flag=True, help="Print the estimate as JSON.")
def estimate(
    recipe_name,
    nps,
    link_gbps,
    latency_us,
    device,
    compute_ms,
    strategy_names,
    variant,
    overrides,
    threads_per_rank,
    as_json,
) -> None:
    """Memory per rank, MB sent per step, step time and scaling efficiency of RECIPE under each strategy
    at each world size: one step measured here, the network modelled (docs/performance.md)."""
    from hvdtrain.measure import estimate as estimate_module
    from hvdtrain.measure import measured_step

    try:
        world_sizes = estimate_module.parse_world_sizes(nps)
        chosen_device = estimate_module.parse_device(device)
        link = None
        if link_gbps.strip().lower() != "here":
            try:
                gbps = float(link_gbps)
            except ValueError:
                raise ValueError(f"--link-gbps: expected Gbit/s or `here`, got {link_gbps!r}") from None
            latency = 10.0 if latency_us is None else latency_us
            estimate_module.check_link(gbps, latency)
            link = estimate_module.Link(gbps, latency / 1e6)
        elif latency_us is not None:
            raise ValueError("--latency-us goes with --link-gbps G; `here` measures the latency")
        names = [n.strip() for n in strategy_names.split(",") if n.strip()] if strategy_names else None
        report = measured_step.estimate(
            recipe_name,
            world_sizes,
            link,
            chosen_device,
            compute_ms,
            names,
            variant,
            tuple(overrides),
            threads_per_rank,
        )
    except ValueError as error:
        raise UserError(str(error)) from None
    click.echo(json.dumps(report.to_dict(), indent=2) if as_json else measured_step.render(report))
