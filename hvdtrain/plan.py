"""`hvdtrain run` as plan, execute, report.

`gather_facts` reads everything the decision needs from this machine, once. `plan_run` is pure: from
the request and the facts it decides what runs, where, with which argv and environment, and refuses
bad input with a ValueError before anything starts. `execute` starts the plan; `report` speaks.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from hvdtrain import config as config_module
from hvdtrain import launchers, registry, strategies
from hvdtrain.config import TrainConfig
from hvdtrain.errors import JobFailed, UserError
from hvdtrain.launch import (
    LaunchCommand,
    LaunchSpec,
    free_ports,
    parse_hostfile,
    parse_hosts,
    rank_stderr_tail,
)
from hvdtrain.runner import LaunchResult, run_launch
from hvdtrain.runtime.watchdog import STALL_MARKER
from hvdtrain.strategies.ps import PS_MARKER

FORWARDED_ENV = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV", "TF_CPP_MIN_LOG_LEVEL")
RUNS = Path("runs")


@dataclass(frozen=True)
class RunRequest:
    """What the user asked for, as parsed from the command line."""

    target: str
    """A recipe name, or a path to a training script."""
    script_args: tuple[str, ...] = ()
    np: int | None = None
    hosts: str | None = None
    hostfile: str | None = None
    threads_per_rank: int | None = None
    strategy: str = "horovod"
    strategy_options: dict[str, Any] = field(default_factory=dict)
    """Options only some strategies read (--launcher, --num-ps, ...); None where not given."""
    variant: str | None = None
    overrides: tuple[str, ...] = ()
    run_dir: Path | None = None
    resume: bool = False
    network_interface: str | None = None
    image: str | None = None
    dry_run: bool = False
    verbose: bool = False

    @property
    def is_script(self) -> bool:
        return self.target.endswith(".py") or os.sep in self.target


@dataclass(frozen=True)
class Facts:
    """This machine, read once before planning."""

    cores: int
    python: str
    horovodrun: str
    executables: frozenset[str]
    measured_launchers: dict[str, dict[str, float]]
    uid: int
    gid: int
    cwd: Path
    env_names: tuple[str, ...]
    """Which of FORWARDED_ENV are set here."""
    free_port: int
    timestamp: str
    resume_dir: Path | None = None
    """The run directory --resume continues (--run-dir, else the recipe's latest under runs/)."""
    saved_config: dict[str, Any] | None = None
    """resume_dir/config.json."""
    hostfile_text: str | None = None
    script_text: str | None = None
    container_engine: str | None = None


def _sibling_script(name: str) -> str:
    """The console script installed beside this interpreter, so a venv works without being activated."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def gather_facts(request: RunRequest) -> Facts:
    """Everything plan_run needs from the machine. A dry run probes no container daemon."""
    from hvdtrain.bench import LAUNCHER_MEASUREMENTS

    measured = json.loads(LAUNCHER_MEASUREMENTS.read_text()) if LAUNCHER_MEASUREMENTS.exists() else {}
    resume_dir, saved_config = None, None
    if request.resume and not request.is_script:
        runs = sorted(RUNS.glob(f"{request.target}-*"))
        resume_dir = request.run_dir or (runs[-1] if runs else None)
        saved = resume_dir / "config.json" if resume_dir else None
        if saved is not None and saved.is_file():
            try:
                saved_config = json.loads(saved.read_text())
            except (OSError, json.JSONDecodeError) as error:
                raise ValueError(f"--resume: cannot read {saved}: {error}") from None
    hostfile_text = None
    if request.hostfile:
        try:
            hostfile_text = Path(request.hostfile).read_text()
        except OSError as error:
            raise ValueError(f"--hostfile: {error.strerror}: {request.hostfile}") from None
    script_text = None
    if request.is_script and Path(request.target).is_file():
        script_text = Path(request.target).read_text(errors="replace")
    engine = None
    if request.image:
        from hvdtrain.container import detect_engine

        engine = detect_engine(probe_daemon=not request.dry_run)
    return Facts(
        cores=os.cpu_count() or 1,
        python=sys.executable,
        horovodrun=_sibling_script("horovodrun"),
        executables=frozenset(name for name in ("mpirun",) if shutil.which(name)),
        measured_launchers=measured,
        uid=os.getuid(),
        gid=os.getgid(),
        cwd=Path.cwd(),
        env_names=tuple(name for name in FORWARDED_ENV if name in os.environ),
        free_port=free_ports(1)[0],
        timestamp=time.strftime("%Y%m%d-%H%M%S"),
        resume_dir=resume_dir,
        saved_config=saved_config,
        hostfile_text=hostfile_text,
        script_text=script_text,
        container_engine=engine,
    )


@dataclass(frozen=True)
class RunPlan:
    command: LaunchCommand
    run_dir: Path
    framework: str
    launcher: str | None
    """The Horovod launcher chosen (None for strategies that start their own processes)."""
    config: TrainConfig | None
    """None for a user's script."""
    failed_rank_patterns: tuple = ()
    notes: tuple[str, ...] = ()
    check_horovod_build: bool = True
    """Before starting: is Horovod built with the framework? (An image's build was checked when made.)"""
    preflight: Any = None
    """The recipe's own check before any rank starts (data files present)."""
    verbose: bool = False


def _script_framework(text: str) -> str:
    return "tensorflow" if ("horovod.tensorflow" in text or "import tensorflow" in text) else "torch"


def _hosts(request: RunRequest, facts: Facts):
    if request.hosts and request.hostfile:
        raise ValueError("give --hosts or --hostfile, not both")
    if request.hostfile:
        return parse_hostfile(facts.hostfile_text or "")
    return parse_hosts(request.hosts) if request.hosts else ()


def _recipe_config(recipe: registry.Recipe, request: RunRequest, facts: Facts) -> TrainConfig:
    if request.resume:
        if request.variant:
            raise ValueError("--variant applies to a new run; --resume continues the run's saved config")
        if facts.resume_dir is None:
            raise ValueError(f"--resume: no earlier run of {recipe.name} under {RUNS}/; pass --run-dir")
    base = config_module.from_dict(recipe.config, facts.saved_config) if facts.saved_config else None
    overrides = config_module.parse_overrides(recipe.config, request.overrides)
    return config_module.apply(base or recipe.make_config(request.variant), overrides)


def plan_run(request: RunRequest, facts: Facts) -> RunPlan:
    """Pure: every decision of `hvdtrain run`, or a ValueError naming what is wrong."""
    np = facts.cores if request.np is None else request.np
    if np < 1:
        raise ValueError(f"--np must be at least 1, got {np}")
    if request.threads_per_rank is not None and request.threads_per_rank < 1:
        raise ValueError(f"--threads-per-rank must be at least 1, got {request.threads_per_rank}")
    python = "python" if request.image else facts.python  # an image has its own interpreter on PATH
    config, preflight = None, None
    if request.is_script:
        if facts.script_text is None:
            raise ValueError(f"script {request.target} not found")
        if request.overrides or request.variant or request.resume:
            raise ValueError("--set, --variant and --resume apply to recipes, not to scripts")
        framework, name = _script_framework(facts.script_text), Path(request.target).stem
        strategy = strategies.get(request.strategy, framework)
        run_dir = request.run_dir or RUNS / f"{name}-{facts.timestamp}"
        program = [python, "-m", "hvdtrain.worker", "--script", request.target, "--", *request.script_args]
    else:
        if request.script_args:
            raise ValueError("arguments after -- are for scripts; recipes take --set KEY=VALUE")
        recipe = registry.get(request.target)
        framework, name = recipe.framework, recipe.name
        strategy = strategies.get(request.strategy, framework)
        config = _recipe_config(recipe, request, facts)
        if reason := strategy.refuse(config):
            raise ValueError(reason)
        run_dir = (
            facts.resume_dir if request.resume else request.run_dir or RUNS / f"{name}-{facts.timestamp}"
        )
        program = [python, "-m", "hvdtrain.worker", "--recipe", name, "--run-dir", str(run_dir)]
        program += ["--strategy", strategy.name] + (["--resume"] if request.resume else [])
        preflight = recipe.preflight
    options = strategies.resolve_options(strategy, request.strategy_options)
    spec = LaunchSpec(
        program=program,
        np=np,
        hosts=_hosts(request, facts),
        log_dir=str(run_dir / "logs"),
        network_interface=request.network_interface,
        forward_env=() if request.image else facts.env_names,
    )
    context = strategies.LaunchContext(
        horovodrun="horovodrun" if request.image else facts.horovodrun,
        run_as_root=facts.uid == 0,
        cores_per_host=facts.cores,
        threads_per_rank=request.threads_per_rank,
        executables=facts.executables,
        measured_launchers=facts.measured_launchers,
        framework=framework,
        free_port=facts.free_port,
    )
    launch = strategy.launch(spec, options, context)
    if config is not None and launch.launcher and (reason := launchers.get(launch.launcher).refuse(config)):
        raise ValueError(reason)
    command = launch.command
    if request.image:
        from hvdtrain.container import in_image

        cwd = str(facts.cwd)
        mounts = [os.path.normpath(facts.cwd / run_dir), cwd]
        command = in_image(
            command, request.image, facts.container_engine, mounts, cwd, f"{facts.uid}:{facts.gid}"
        )
    return RunPlan(
        command=command,
        run_dir=run_dir,
        framework=framework,
        launcher=launch.launcher,
        config=config,
        failed_rank_patterns=launch.failed_rank_patterns,
        notes=launch.notes,
        check_horovod_build=strategy.name == "horovod" and not request.image,
        preflight=preflight,
        verbose=request.verbose,
    )


def execute(plan: RunPlan) -> LaunchResult:
    """Check what only running can check, leave the config in the run directory, run the job."""
    if plan.preflight is not None and plan.config is not None:
        plan.preflight(plan.config)
    if plan.check_horovod_build:
        _check_horovod_build(plan.framework)
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    if plan.config is not None:
        config_module.save(plan.config, plan.run_dir / "config.json")
    for note in plan.notes:
        click.echo(note)
    return run_launch(plan.command, plan.failed_rank_patterns, show_framework_noise=plan.verbose)


def _check_horovod_build(framework: str) -> None:
    """A missing framework in the Horovod build is one line before any rank starts."""
    from hvdtrain import doctor

    if doctor.installed_version("horovod") is None:
        raise UserError(f"Horovod is not installed; fix: {doctor.FIX_COMMAND}")
    if not doctor.framework_built(framework):
        raise UserError(
            f"Horovod was built without {doctor.FRAMEWORKS[framework]}; fix: {doctor.FIX_COMMAND}"
        )


def report(plan: RunPlan, result: LaunchResult) -> None:
    """The summary line, or one message naming what failed and where its logs are."""
    logs = plan.run_dir / "logs"
    if result.returncode != 0:
        raise JobFailed("\n".join(_failure_lines(result, logs)))
    summary_path = plan.run_dir / "summary.json"
    if not summary_path.exists():
        click.echo(f"hvdtrain: done in {result.wall_seconds:.1f}s; logs in {logs}")
        return
    summary = {**json.loads(summary_path.read_text()), "wall_seconds": result.wall_seconds}
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")  # the job's, start-up included
    click.echo(summary_line(summary))


def _failure_lines(result: LaunchResult, logs: Path) -> list[str]:
    reports = [line for line in result.output_tail if STALL_MARKER in line or PS_MARKER in line]
    if reports:
        lines = [reports[0][reports[0].index("hvdtrain: ") :]]
    elif result.failed_rank is not None:
        lines = [
            f"rank {result.failed_rank} failed first (job exit code {result.returncode}); "
            "last lines of its stderr:"
        ]
        lines += [f"  {line}" for line in rank_stderr_tail(logs, result.failed_rank)]
    else:
        lines = [f"the job failed (exit code {result.returncode}); last lines of its output:"]
        lines += [f"  {line}" for line in result.output_tail[-15:]]
    return [*lines, f"logs: {logs}"]


SUMMARY_KEYS = (
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


def summary_line(summary: dict) -> str:
    def shown(value):
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    return "summary: " + "  ".join(f"{key}={shown(summary.get(key))}" for key in SUMMARY_KEYS)
