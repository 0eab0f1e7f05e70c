"""The `hvdtrain` command. Each command is thin: parse, call a pure function, run."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import click

from hvdtrain import config as config_module
from hvdtrain import doctor as doctor_module
from hvdtrain import registry, strategies
from hvdtrain.launch import (
    LAUNCHERS,
    LaunchSpec,
    choose_launcher,
    parse_hosts,
    rank_stderr_tail,
    read_hostfile,
    run_launch,
)
from hvdtrain.runtime.watchdog import STALL_MARKER
from hvdtrain.strategies.ps import PS_MARKER

EXIT_USAGE = 2
FORWARDED_ENV = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV", "TF_CPP_MIN_LOG_LEVEL")


class UserError(click.ClickException):
    """Bad input: one line, exit 2, no traceback."""

    exit_code = EXIT_USAGE

    def show(self, file=None) -> None:
        click.echo(f"hvdtrain: error: {self.format_message()}", err=True)


class JobFailed(click.ClickException):
    exit_code = 1

    def show(self, file=None) -> None:
        click.echo(f"hvdtrain: {self.format_message()}", err=True)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
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
    help="Comma-separated parts that must be built: torch, tensorflow, gloo, mpi.",
)
def doctor(as_json: bool, require: str) -> None:
    """Versions, and what the installed Horovod was built with; exit 1 if a required part is missing."""
    required = [name.strip() for name in require.split(",") if name.strip()]
    valid = set(doctor_module.FRAMEWORKS) | set(doctor_module.CONTROLLERS)
    if unknown := sorted(set(required) - valid):
        raise UserError(
            f"--require: unknown part(s) {', '.join(unknown)}; choose from {', '.join(sorted(valid))}"
        )
    report = doctor_module.collect()
    missing = report.missing(required) if report.versions["horovod"] else required
    if as_json:
        click.echo(
            json.dumps(
                {**report.to_dict(), "required": required, "missing": missing, "ok": not missing}, indent=2
            )
        )
    else:
        click.echo(doctor_module.render(report, required))
    sys.exit(1 if missing else 0)


@main.command(name="list")
def list_recipes() -> None:
    """The registered recipes."""
    recipes = registry.all_recipes()
    width = max(len(name) for name in recipes)
    for recipe in recipes.values():
        click.echo(f"{recipe.name:<{width}}  {recipe.framework:<10}  {recipe.dataset}")
        click.echo(f"{'':<{width}}  {recipe.description}")


def _default_run_dir(name: str) -> Path:
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def _latest_run_dir(name: str) -> Path:
    runs = sorted(Path("runs").glob(f"{name}-*"))
    if not runs:
        raise UserError(f"--resume: no earlier run of {name} under runs/; pass --run-dir")
    return runs[-1]


def _hosts(hosts: str | None, hostfile: str | None):
    if hosts and hostfile:
        raise UserError("give --hosts or --hostfile, not both")
    try:
        if hostfile:
            return read_hostfile(Path(hostfile))
        return parse_hosts(hosts) if hosts else ()
    except (OSError, ValueError) as error:
        raise UserError(str(error)) from None


def _preflight(framework: str) -> None:
    """A missing framework in the Horovod build is one line before any rank starts."""
    if doctor_module.installed_version("horovod") is None:
        raise UserError(f"Horovod is not installed; fix: {doctor_module.FIX_COMMAND}")
    if not doctor_module.framework_built(framework):
        label = doctor_module.FRAMEWORKS[framework]
        raise UserError(f"Horovod was built without {label}; fix: {doctor_module.FIX_COMMAND}")


@main.command()
@click.pass_context
@click.argument("target")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
@click.option(
    "--np", "num_proc", type=int, default=None, help="Number of ranks. [default: the number of cores]"
)
@click.option("--hosts", default=None, help="HOST:SLOTS,... [default: localhost]")
@click.option("--hostfile", default=None, type=click.Path(), help="File of 'HOST slots=N' lines.")
@click.option(
    "--launcher",
    type=click.Choice([*LAUNCHERS, "auto"]),
    default="auto",
    show_default=True,
    help="auto: the launcher measured fastest here (hvdtrain bench --launchers gloo,mpi), else mpi.",
)
@click.option(
    "--horovod-autotune", is_flag=True, help="Let Horovod tune fusion and cycle time while training."
)
@click.option(
    "--threads-per-rank",
    type=int,
    default=None,
    help="Compute threads per rank. [default: cores / ranks on the host]",
)
@click.option(
    "--strategy",
    default="horovod",
    show_default=True,
    help="horovod, ddp, dp or ps (see hvdtrain strategies).",
)
@click.option("--num-ps", type=int, default=1, show_default=True, help="Parameter servers (--strategy ps).")
@click.option("--variant", default=None, help="A recipe variant, e.g. debug.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a config field.")
@click.option(
    "--run-dir",
    type=click.Path(path_type=Path),
    default=None,
    help="Where metrics, checkpoints and logs go. [default: runs/RECIPE-TIMESTAMP]",
)
@click.option("--resume", is_flag=True, help="Continue from the run directory's checkpoint.")
@click.option(
    "--stall-timeout",
    type=int,
    default=120,
    show_default=True,
    help="Seconds a rank may miss a collective before the job is ended.",
)
@click.option("--network-interface", default=None, help="NIC for gloo/MPI traffic. [default: lo on one host]")
@click.option(
    "--image", default=None, help="Run the job inside this container image (make image builds one)."
)
@click.option("--dry-run", is_flag=True, help="Print the launch command and exit.")
def run(
    ctx,
    target,
    script_args,
    num_proc,
    hosts,
    hostfile,
    launcher,
    threads_per_rank,
    horovod_autotune,
    strategy,
    num_ps,
    variant,
    overrides,
    run_dir,
    resume,
    stall_timeout,
    network_interface,
    image,
    dry_run,
) -> None:
    """Train TARGET, a recipe name or a Horovod training script, on --np ranks.

    Arguments after `--` go to the script unchanged.
    """
    cores = os.cpu_count() or 1
    num_proc = cores if num_proc is None else num_proc
    if num_proc < 1:
        raise UserError(f"--np must be at least 1, got {num_proc}")
    if threads_per_rank is not None and threads_per_rank < 1:
        raise UserError(f"--threads-per-rank must be at least 1, got {threads_per_rank}")
    if stall_timeout < 1:
        raise UserError(f"--stall-timeout must be at least 1 second, got {stall_timeout}")
    python = "python" if image else sys.executable  # an image has its own interpreter on PATH
    script = Path(target)
    is_script = target.endswith(".py") or os.sep in target
    try:
        if is_script:
            if not script.is_file():
                raise UserError(f"script {target} not found")
            if overrides or variant or resume:
                raise UserError("--set, --variant and --resume apply to recipes, not to scripts")
            framework = _script_framework(script)
            chosen = strategies.get(strategy, framework)
            name = script.stem
            program = [python, "-m", "hvdtrain.worker", "--script", str(script), "--", *script_args]
        else:
            if script_args:
                raise UserError("arguments after -- are for scripts; recipes take --set KEY=VALUE")
            recipe = registry.get(target)
            chosen = strategies.get(strategy, recipe.framework)
            framework, name = recipe.framework, recipe.name
            run_dir = run_dir or (_latest_run_dir(name) if resume else _default_run_dir(name))
            saved = run_dir / "config.json"
            base = config_module.load(recipe.config, saved) if resume and saved.exists() else None
            config = config_module.apply(
                base or recipe.make_config(variant), config_module.parse_overrides(recipe.config, overrides)
            )
            if recipe.preflight is not None:
                recipe.preflight(config)
            program = [
                python,
                "-m",
                "hvdtrain.worker",
                "--recipe",
                name,
                "--run-dir",
                str(run_dir),
                "--strategy",
                chosen.name,
            ] + (["--resume"] if resume else [])
        run_dir = run_dir or _default_run_dir(name)
        launcher_note = None
        if launcher == "auto":
            launcher, launcher_note = _auto_launcher(framework)
        spec = LaunchSpec(
            program=program,
            np=num_proc,
            launcher=launcher,
            hosts=_hosts(hosts, hostfile),
            cores_per_host=cores,
            threads_per_rank=threads_per_rank,
            num_ps=num_ps,
            horovod_tuning=_autotune(run_dir) if horovod_autotune else {},
            log_dir=str(run_dir / "logs"),
            network_interface=network_interface,
            stall_timeout_s=stall_timeout,
            run_as_root=os.geteuid() == 0,
            horovodrun="horovodrun" if image else _sibling_script("horovodrun"),
            rendezvous_port=_free_port() if not dry_run else 29500,
            forward_env=() if image else tuple(n for n in FORWARDED_ENV if n in os.environ),
        )
        command = chosen.launch(spec)
        if image:
            command = _in_image(command, image, run_dir)
    except ValueError as error:
        raise UserError(str(error)) from None

    if dry_run:
        click.echo(command.render())
        return
    if chosen.name == "horovod" and not image:  # an image's Horovod was checked when it was built
        _preflight(framework)
    run_dir.mkdir(parents=True, exist_ok=True)
    if not is_script:
        config_module.save(config, run_dir / "config.json")
    if launcher_note and chosen.name == "horovod":
        click.echo(launcher_note)
    result = run_launch(command, show_framework_noise=ctx.obj["verbose"])
    if result.returncode != 0:
        _report_failure(result, run_dir)
    summary_path = run_dir / "summary.json"
    if summary_path.exists():
        summary = {**json.loads(summary_path.read_text()), "wall_seconds": result.wall_seconds}
        summary_path.write_text(json.dumps(summary, indent=2) + "\n")  # the job's, start-up included
        _print_summary(summary)
    else:
        click.echo(f"hvdtrain: done in {result.wall_seconds:.1f}s; logs in {run_dir / 'logs'}")


def _autotune(run_dir: Path) -> dict[str, str]:
    return {"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": str(run_dir / "horovod-autotune.csv")}


def _in_image(command, image: str, run_dir: Path):
    """Wrap the launch in the image; the run directory and the working directory are mounted at the
    same paths, and the image's own python and horovodrun are on its PATH."""
    from hvdtrain.container import detect_engine, in_image

    cwd = str(Path.cwd())
    user = f"{os.getuid()}:{os.getgid()}"
    return in_image(command, image, detect_engine(), [str(run_dir.resolve()), cwd], cwd, user)


def _auto_launcher(framework: str) -> tuple[str, str]:
    import shutil

    from hvdtrain.bench import AUTOTUNE_FILE

    measured = json.loads(AUTOTUNE_FILE.read_text()) if AUTOTUNE_FILE.exists() else {}
    chosen = choose_launcher(measured, framework, shutil.which("mpirun") is not None)
    basis = f"measured {measured[framework]}" if framework in measured else "the project's measured default"
    return chosen, f"hvdtrain: --launcher auto chose {chosen} ({basis})"


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _sibling_script(name: str) -> str:
    """The console script installed beside this interpreter, so a venv works without being activated."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def _script_framework(script: Path) -> str:
    text = script.read_text(errors="replace")
    return "tensorflow" if ("horovod.tensorflow" in text or "import tensorflow" in text) else "torch"


def _report_failure(result, run_dir: Path) -> None:
    if result.returncode == 124:
        raise JobFailed(f"the job did not finish in time; logs in {run_dir / 'logs'}")
    lines = []
    reports = [line for line in result.output_tail if STALL_MARKER in line or PS_MARKER in line]
    if reports:
        lines.append(reports[0][reports[0].index("hvdtrain: ") :])
    elif result.failed_rank is not None:
        lines.append(
            f"rank {result.failed_rank} failed first (job exit code {result.returncode}); "
            f"last lines of its stderr:"
        )
        lines += [f"  {line}" for line in rank_stderr_tail(run_dir / "logs", result.failed_rank)]
    else:
        lines.append(f"the job failed (exit code {result.returncode}); last lines of its output:")
        lines += [f"  {line}" for line in result.output_tail[-15:]]
    lines.append(f"logs: {run_dir / 'logs'}")
    raise JobFailed("\n".join(lines))


def _print_summary(summary: dict) -> None:
    def shown(value):
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    keys = (
        "recipe",
        "strategy",
        "world_size",
        "final_loss",
        "test_accuracy",
        "samples_per_sec",
        "wall_seconds",
        "weights_consistent",
        "run_dir",
    )
    click.echo("summary: " + "  ".join(f"{key}={shown(summary.get(key))}" for key in keys))


def _int_list(text: str, option: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UserError(f"{option}: expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise UserError(f"{option}: expected integers >= 1, got {text!r}")
    return values


@main.command()
@click.argument("recipe_name", metavar="RECIPE")
@click.option(
    "--strategies",
    "strategy_names",
    default="horovod",
    show_default=True,
    help="Comma-separated: horovod, ddp, dp.",
)
@click.option("--np", "nps", default="1,2", show_default=True, help="Comma-separated world sizes.")
@click.option("--launchers", default="gloo", show_default=True, help="Launchers for the horovod strategy.")
@click.option("--steps", type=int, default=20, show_default=True, help="Steps per epoch.")
@click.option("--epochs", type=int, default=3, show_default=True, help="Epochs; the first is left out.")
@click.option("--batch-size", type=int, default=32, show_default=True, help="Per process.")
@click.option("--repeats", type=int, default=1, show_default=True, help="Interleaved repeats; the median.")
@click.option("--out", type=click.Path(path_type=Path), default=None, help="[default: runs/bench-TIMESTAMP]")
def bench(recipe_name, strategy_names, nps, launchers, steps, epochs, batch_size, repeats, out) -> None:
    """Run RECIPE under each strategy and world size side by side; print a table, write CSV and PNG."""
    from hvdtrain import bench as bench_module

    try:
        recipe = registry.get(recipe_name)
        chosen = [strategies.get(name.strip(), recipe.framework).name for name in strategy_names.split(",")]
    except ValueError as error:
        raise UserError(str(error)) from None
    launcher_list = [name.strip() for name in launchers.split(",") if name.strip()]
    if unknown := sorted(set(launcher_list) - set(LAUNCHERS)) or not launcher_list:
        raise UserError(f"--launchers: unknown {unknown}; choose from {', '.join(LAUNCHERS)}")
    world_sizes = _int_list(nps, "--np")
    if min(steps, epochs, batch_size, repeats) < 1 or epochs < 2:
        raise UserError("--steps, --batch-size and --repeats must be >= 1 and --epochs >= 2")
    out = out or Path("runs") / f"bench-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    try:
        rows = bench_module.matrix(
            recipe.name, chosen, world_sizes, launcher_list, steps, epochs, batch_size, out, repeats
        )
    except bench_module.BenchError as error:
        raise JobFailed(str(error)) from None
    click.echo(bench_module.render(rows))
    bench_module.write_csv(rows, out / "bench.csv")
    bench_module.plot(rows, out / "bench.png")
    if bench_module.record_launchers(rows, recipe.framework):
        click.echo(f"recorded launcher throughput for --launcher auto in {bench_module.AUTOTUNE_FILE}")
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
