"""The pure plan: from the request and the facts, every decision of a run, or a ValueError naming what is
wrong, before anything starts. Each decision has its owner: what trains (target.py), where the ranks
go (placement.py), how the strategy and its launcher start them (strategies/, launchers/)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hvdtrain import launchers, registry, strategies
from hvdtrain.config import TrainConfig
from hvdtrain.job import placement, target
from hvdtrain.job.environment import HOST_SPECIFIC, forwarded_environment
from hvdtrain.job.facts import Facts
from hvdtrain.job.placement import Placement
from hvdtrain.job.request import RunRequest
from hvdtrain.job.target import Target
from hvdtrain.launchers import mpi as mpi_launcher
from hvdtrain.launching import container, remote, slurm
from hvdtrain.launching.console import LIVE_PROGRESS_S, PLAIN_PROGRESS_S
from hvdtrain.launching.spec import LaunchCommand, LaunchSpec, threads_from_environment
from hvdtrain.measure import tuning
from hvdtrain.records import tracking
from hvdtrain.runtime import preempt
from hvdtrain.runtime.progress import PROGRESS_ENV


@dataclass(frozen=True)
class RunPlan:
    command: LaunchCommand
    run_dir: Path
    recipe: str | None
    """None for a user's script."""
    framework: str
    strategy: str
    launcher: str | None
    """The Horovod launcher chosen (None for strategies that start their own processes)."""
    config: TrainConfig | None
    """None for a user's script."""
    recipe_source: str | None = None
    """The file or module:NAME of a recipe that is not built in (run.json records it for --resume)."""
    failed_rank_patterns: tuple = ()
    job_failing: tuple = ()
    """The launcher's lines saying the job is ending in failure (before it names the failed rank)."""
    environment: dict[str, str] = field(default_factory=dict)
    """The launcher's environment before the command's own variables: the forwarded ones only
    (with --image, the engine's whole environment; the container gets `passed_on`)."""
    passed_on: tuple[str, ...] = ()
    """The names of the variables the ranks get from here (--dry-run lists them)."""
    notes: tuple[str, ...] = ()
    check_horovod_build: bool = True
    """Before starting: is Horovod built with the framework? (An image's build was checked when made.)"""
    preflight: Any = None
    """The recipe's own check before any rank starts (data files present)."""
    verbose: bool = False
    remote_hosts: tuple[str, ...] = ()
    """Hosts other than this one: checked over ssh first; their copy of the run directory is staged
    before and collected after the job where they do not share this one's disk."""
    transport: remote.Transport = remote.Ssh()
    """How hvdtrain reaches the other hosts: ssh, or inside a Slurm allocation a job step per node."""
    python: str = sys.executable
    hosts: tuple = ()
    """The hosts of --hosts or --hostfile, as parsed (a restart goes on with those that answer)."""
    rank_hosts: tuple[str, ...] = ()
    """The host of each rank, for failure reports."""
    resume: bool = False
    """Continues the run directory's run (run.json keeps the run's first start)."""
    resume_from: int | None = None
    """The step whose checkpoint `latest` is to name before the ranks start (--resume-from)."""
    bind_library: str | None = None
    """hvdtrain's listener library that mpirun preloads: every other host must have it at this path."""
    console: bool = True
    """Show the job's output and hvdtrain's notes here (the logs under run_dir/logs keep it either way)."""
    tracking_uri: str | None = None
    """Where this process logs the run in MLflow once the job ends (hvdtrain.records.tracking)."""
    slurm_job: slurm.Allocation | None = None
    """The Slurm job this run is inside (run.json records it), whatever the strategy."""
    preempt_via_launcher: bool = False
    """SIGUSR1 goes to the launcher too, which passes it on to every rank (hvdtrain.launching.runner)."""
    stops_at_step: bool = False
    """Whether the ranks stop at an agreed step when asked (a recipe's fixed-size loop; not a script,
    whose ranks ignore the request, nor elastic training): SIGTERM then waits for them."""


def plan_run(request: RunRequest, facts: Facts) -> RunPlan:
    """Pure: every decision of `hvdtrain run`, or a ValueError naming what is wrong."""
    if facts.run_dir_problem and not request.dry_run:
        raise ValueError(facts.run_dir_problem)
    if request.image:
        container.check_image(request.image)
    where = placement.place(request, facts)
    if request.max_restarts < 0:
        raise ValueError(f"--max-restarts must be 0 or more, got {request.max_restarts}")
    if request.threads_per_rank is not None and request.threads_per_rank < 1:
        raise ValueError(f"--threads-per-rank must be at least 1, got {request.threads_per_rank}")
    tracking_uri = tracking.chosen_uri(request.mlflow, facts.environ)
    if tracking_uri is not None:
        tracking.check_uri(tracking_uri, "--mlflow" if request.mlflow else tracking.ENV)
    python = "python" if request.image else facts.python  # an image has its own interpreter on PATH
    what = target.resolve(request, facts, python)
    strategy, config = what.strategy, what.config
    np = where.np
    if strategy.devices is not None:  # --np counts one process's devices, no more than this host has
        np = strategy.devices(request.np, facts.gpus)
    load_notes = placement.local_load(np, where.hosts, what.framework, facts, request.oversubscribe)
    environment = _environment(request, facts, where, what)
    context = _context(request, facts, where, what)
    spec = _spec(request, facts, what, np, where, environment)
    launch = strategies.launch(strategy, spec, request.strategy_options, context, config)
    remote_hosts, transport = placement.reach(request, facts, where)
    command, passed_on, environment = _command(request, facts, what, launch.command, environment)
    return RunPlan(
        command=command,
        run_dir=what.run_dir,
        recipe=None if what.recipe_ref is None else what.name,
        recipe_source=what.source,
        framework=what.framework,
        strategy=strategy.name,
        launcher=launch.launcher,
        config=config,
        failed_rank_patterns=launch.failed_rank_patterns,
        job_failing=launch.job_failing,
        environment=environment,
        passed_on=passed_on,
        notes=(where.slurm_line,) * bool(where.slurm_line)
        + load_notes
        + launch.notes
        + _listener_notes(launch.launcher, request, facts),
        check_horovod_build=strategy.checks_horovod_build and not request.image,
        preflight=what.preflight,
        verbose=request.verbose,
        remote_hosts=remote_hosts,
        transport=transport,
        python=python,
        hosts=where.hosts,
        rank_hosts=tuple(remote.rank_hosts(where.hosts, np)) if where.hosts else (),
        resume=request.resume,
        resume_from=request.resume_from if request.resume else None,
        bind_library=context.bind_library if "LD_PRELOAD" in launch.command.env else None,
        console=request.console,
        tracking_uri=tracking_uri,
        slurm_job=where.slurm_job,
        preempt_via_launcher=launch.passes_on_usr1,
        stops_at_step=config is not None
        and strategy.takes_stop_request
        and (launch.launcher is None or launchers.get(launch.launcher).takes_stop_request),
    )


def _environment(request: RunRequest, facts: Facts, where: Placement, what: Target) -> dict[str, str]:
    """The variables the launcher and the ranks get from here."""
    environment = forwarded_environment(facts.environ, request.env)
    tuning.check_settings(environment)
    if where.allocation is not None:  # Slurm signals the ranks themselves: their SIGTERM asks them to stop
        environment[preempt.SIGTERM_STOPS] = "1"
    if what.config is not None:  # a recipe's rank 0 reports its progress within an epoch
        every = LIVE_PROGRESS_S if facts.terminal else PLAIN_PROGRESS_S
        environment.setdefault(PROGRESS_ENV, str(every))
    return environment


def _spec(
    request: RunRequest, facts: Facts, what: Target, np: int, where: Placement, environment: dict[str, str]
) -> LaunchSpec:
    return LaunchSpec(
        program=what.program,
        np=np,
        hosts=where.hosts,
        log_dir=str(facts.cwd / what.run_dir / "logs"),
        network_interface=request.network_interface,
        forward_env=() if request.image else tuple(sorted(set(environment) - HOST_SPECIFIC)),
        ssh_port=request.ssh_port,
        ssh_identity_file=request.ssh_identity_file,
    )


def _context(request: RunRequest, facts: Facts, where: Placement, what: Target) -> strategies.LaunchContext:
    """What a strategy and its launcher read of the machine, from the facts (an image has its own)."""
    allocation = where.allocation
    measured = facts.measured_tuning
    return strategies.LaunchContext(
        horovodrun="horovodrun" if request.image else facts.horovodrun,
        run_as_root=facts.uid == 0,
        cores_per_host=facts.cores,
        threads_per_rank=request.threads_per_rank
        or threads_from_environment(facts.environ)
        or (allocation.cpus_per_task if allocation is not None else None),
        executables=facts.executables,
        modules=facts.modules,
        measured_launchers=facts.measured_launchers,
        framework=what.framework,
        free_port=facts.free_port,
        bind_library=None if request.image else facts.bind_library,
        allocation=allocation,
        probed=facts.probed,
        allreduce_rules=None if request.image else str(mpi_launcher.ALLREDUCE_RULES),
        tuning=tuning.measured(measured, what.strategy.tunable, what.name)
        if what.config is not None
        else None,
        host_addresses=facts.host_addresses,
    )


def _command(
    request: RunRequest, facts: Facts, what: Target, command: LaunchCommand, environment: dict[str, str]
) -> tuple[LaunchCommand, tuple[str, ...], dict[str, str]]:
    """The launcher's command as it runs here (inside --image's container where given), the names of
    the variables the ranks get, and the launcher's environment."""
    passed_on = tuple(sorted(environment))
    if "LD_PRELOAD" in command.env and environment.get("LD_PRELOAD"):  # --env LD_PRELOAD: kept, after ours
        command = replace(
            command,
            env={**command.env, "LD_PRELOAD": f"{command.env['LD_PRELOAD']}:{environment['LD_PRELOAD']}"},
        )
    if not request.image:
        return command, passed_on, environment
    cwd = str(facts.cwd)
    mounts = [os.path.normpath(facts.cwd / what.run_dir), cwd]
    mounts += [os.path.dirname(what.source)] if what.source and registry.is_path(what.source) else []
    user = f"{facts.uid}:{facts.gid}"
    # The engine runs with this environment (DOCKER_HOST, ...); the container gets only the
    # ranks' variables and the --env names, by name, beside its own PATH and interpreter.
    given = dict(entry.split("=", 1) for entry in request.env if "=" in entry)
    passed_on = tuple(sorted({*command.env, *(entry.split("=", 1)[0] for entry in request.env)}))
    engine = facts.container_engine
    command = container.in_image(command, request.image, engine, mounts, cwd, user, passed_on)
    return command, passed_on, {**facts.environ, **given}


def _listener_notes(launcher: str | None, request: RunRequest, facts: Facts) -> tuple[str, ...]:
    """mpirun without hvdtrain's bind library answers on every interface: said, not refused."""
    if launcher != "mpi" or request.image or facts.bind_library is not None:
        return ()
    why = facts.bind_library_problem or "hvdtrain's bind library is missing"
    return (f"hvdtrain: mpirun's out-of-band listener will answer on every interface ({why})",)
