"""The pure plan: from the request and the facts, every decision of a run, or a ValueError naming what is
wrong, before anything starts."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hvdtrain import config as config_module
from hvdtrain import container, launchers, registry, slurm, strategies, tracking, tuning
from hvdtrain import hosts as remote
from hvdtrain.config import TrainConfig
from hvdtrain.console import LIVE_PROGRESS_S, PLAIN_PROGRESS_S
from hvdtrain.job.environment import HOST_SPECIFIC, forwarded_environment
from hvdtrain.job.facts import Facts
from hvdtrain.job.request import RUNS, RunRequest, recipe_spec, requested_hosts
from hvdtrain.job.resume import resumed_config
from hvdtrain.launch import LOOPBACK_NAMES, Host, LaunchCommand, LaunchSpec, is_local
from hvdtrain.launchers import mpi as mpi_launcher
from hvdtrain.runtime import metrics, preempt
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
    """Where this process logs the run in MLflow once the job ends (hvdtrain.tracking)."""
    slurm_job: slurm.Allocation | None = None
    """The Slurm job this run is inside (run.json records it), whatever the strategy."""
    preempt_via_launcher: bool = False
    stops_at_step: bool = False
    """Whether the ranks stop at an agreed step when asked (a recipe's fixed-size loop; not a script,
    whose ranks ignore the request, nor elastic training): SIGTERM then waits for them."""
    """SIGUSR1 goes to the launcher too, which passes it on to every rank (hvdtrain.runner)."""


def _script_framework(text: str) -> str:
    return "tensorflow" if ("horovod.tensorflow" in text or "import tensorflow" in text) else "torch"


def _remote_hosts(hosts, facts: Facts) -> tuple[str, ...]:
    """The hosts that are not this machine; a name that does not resolve is refused here."""
    if unresolved := [
        h.name for h in hosts if h.name not in LOOPBACK_NAMES and not facts.host_addresses.get(h.name)
    ]:
        raise ValueError(f"host {unresolved[0]} does not resolve to an address")
    return tuple(
        h.name
        for h in hosts
        if h.name not in LOOPBACK_NAMES
        and facts.host_addresses[h.name] not in facts.local_addresses
        and not facts.host_addresses[h.name].startswith("127.")  # Debian maps its own name to 127.0.1.1
    )


def _recipe_config(
    recipe: registry.Recipe, source: str | None, request: RunRequest, facts: Facts
) -> TrainConfig:
    overrides = config_module.parse_overrides(recipe.config, request.overrides)
    if request.resume_from is not None and not request.resume:
        raise ValueError("--resume-from applies with --resume")
    if not request.resume:
        config = config_module.apply(recipe.make_config(request.variant), overrides)
    elif request.variant:
        raise ValueError("--variant applies to a new run; --resume continues the run's saved config")
    elif facts.resume is None:
        raise ValueError(f"--resume: no earlier run of {recipe.name} under {RUNS}/; pass --run-dir")
    else:
        config = resumed_config(recipe, source, facts.resume, overrides)
    metrics.check_monitor(config.monitor, config.mode, recipe.metrics, recipe.name)
    if recipe.framework != "torch":
        for knob, why in TORCH_ONLY.items():
            if getattr(config, knob):
                raise ValueError(f"{knob}: torch recipes only; {recipe.name}'s Keras loop {why}")
    return config


TORCH_ONLY = {
    "sync_batch_norm": "keeps each rank's batch statistics (averaged at epochs' ends)",
    "compile": "runs its steps as tf.function graphs already",
    "async_checkpoint": "saves with Keras's model.save, which reads the model as it trains on",
}
"""Config knobs the Keras loops cannot honour yet, and what they do instead."""


RANKS_PER_CORE_LIMIT = 4
RANK_MEMORY = {"torch": 400 << 20, "tensorflow": 900 << 20}
"""A rank's resident memory, measured here on the digits and synthetic recipes (make bench prints it)."""


def _local_load(np: int, hosts, framework: str, facts: Facts, oversubscribe: bool) -> tuple[str, ...]:
    """Refuse, before anything starts, more ranks than this host can run; say so when they share cores."""
    local = np if not hosts or is_local(hosts) else sum(h.slots for h in hosts if h.name in LOOPBACK_NAMES)
    local = min(local, np)
    needed = local * RANK_MEMORY[framework]
    if not oversubscribe and local > RANKS_PER_CORE_LIMIT * facts.cores:
        raise ValueError(
            f"--np {np} puts {local} ranks on this host's {facts.cores} cores (more than "
            f"{RANKS_PER_CORE_LIMIT} per core would make no progress); lower --np or pass --oversubscribe"
        )
    if not oversubscribe and needed > facts.memory_available:
        raise ValueError(
            f"{local} {framework} ranks need about {needed >> 30} GiB here and "
            f"{facts.memory_available >> 30} GiB is free; lower --np or pass --oversubscribe"
        )
    return (f"hvdtrain: {local} ranks share this host's {facts.cores} cores",) if local > facts.cores else ()


def plan_run(request: RunRequest, facts: Facts) -> RunPlan:
    """Pure: every decision of `hvdtrain run`, or a ValueError naming what is wrong."""
    if facts.run_dir_problem and not request.dry_run:
        raise ValueError(facts.run_dir_problem)
    if request.image:
        container.check_image(request.image)
    hosts = requested_hosts(request, facts.hostfile_text)
    slurm_job = slurm.allocation_from(facts.environ)
    allocation, this_node, slurm_line = _allocation(request, facts, slurm_job)
    if allocation is not None and hosts:
        slurm.hosts_within(hosts, allocation, this_node)
    elif allocation is not None:
        hosts = allocation.hosts()
        if allocation.nodes == (this_node,):  # one node: ranks talk as on any one machine
            hosts = (Host("localhost", allocation.tasks),)
        if request.np is not None and request.np > allocation.tasks:
            raise ValueError(
                f"--np {request.np} is more than the {allocation.tasks} tasks of Slurm job "
                f"{allocation.job_id} ({allocation.describe()})"
            )
    np = (sum(h.slots for h in hosts) if hosts else facts.cores) if request.np is None else request.np
    if np < 1:
        raise ValueError(f"--np must be at least 1, got {np}")
    if allocation is not None and request.np is None:
        slurm_line += f": --np {np} on its {allocation.describe()}"
    if request.max_restarts < 0:
        raise ValueError(f"--max-restarts must be 0 or more, got {request.max_restarts}")
    if request.threads_per_rank is not None and request.threads_per_rank < 1:
        raise ValueError(f"--threads-per-rank must be at least 1, got {request.threads_per_rank}")
    tracking_uri = request.mlflow or facts.environ.get(tracking.ENV) or None
    if tracking_uri is not None:
        tracking.check_uri(tracking_uri, "--mlflow" if request.mlflow else tracking.ENV)
    python = "python" if request.image else facts.python  # an image has its own interpreter on PATH
    config, preflight = None, None
    recipe_ref = recipe_spec(request.target, facts.script_text, facts.cwd)
    resumed = facts.resume if request.resume else None
    if resumed and resumed.recipe_source and recipe_ref == resumed.recipe == request.target:
        recipe_ref = resumed.recipe_source  # resumed by name: the file or module the run was made with
    source = None if recipe_ref is None else registry.source(recipe_ref)
    if request.is_path and facts.script_text is not None:
        path = os.path.normpath(facts.cwd / request.target)
        if problem := registry.syntax_problem(facts.script_text, path):
            raise ValueError(problem)
    if recipe_ref is None:
        if facts.script_text is None:
            raise ValueError(f"script {request.target} not found")
        if request.overrides or request.variant or request.resume or request.max_restarts:
            raise ValueError(
                "--set, --variant, --resume and --max-restarts apply to recipes, not to scripts "
                f"({request.target} defines no RECIPE)"
            )
        framework, name = _script_framework(facts.script_text), Path(request.target).stem
        strategy = strategies.get(request.strategy, framework)
        run_dir = request.run_dir or RUNS / f"{name}-{facts.timestamp}"
        program = [python, "-m", "hvdtrain.worker", "--script", request.target, "--", *request.script_args]
    else:
        if request.script_args:
            raise ValueError("arguments after -- are for scripts; recipes take --set KEY=VALUE")
        recipe = registry.load(recipe_ref)
        framework, name = recipe.framework, recipe.name
        strategy = strategies.get(request.strategy, framework)
        config = _recipe_config(recipe, source, request, facts)
        if resumed and resumed.sharded_by not in (None, strategy.name):
            where, sharded_by = resumed.run_dir, resumed.sharded_by
            raise ValueError(
                f"--resume: the checkpoint in {where} is sharded by --strategy {sharded_by}, which alone "
                f"resumes it; `hvdtrain checkpoint consolidate {where}` makes a whole one for --strategy "
                f"{strategy.name}"
            )
        run_dir = (
            facts.resume.run_dir if request.resume else request.run_dir or RUNS / f"{name}-{facts.timestamp}"
        )
        program = [python, "-m", "hvdtrain.worker", "--recipe", recipe_ref]
        program += ["--run-dir", str(facts.cwd / run_dir), "--strategy", strategy.name]
        program += ["--config", config_module.to_json(config)]
        program += ["--resume"] if request.resume else []
        preflight = recipe.preflight
    if strategy.devices is not None:  # --np counts one process's devices, no more than this host has
        np = strategy.devices(request.np, facts.gpus)
    load_notes = _local_load(np, hosts, framework, facts, request.oversubscribe)
    environment = forwarded_environment(facts.environ, request.env)
    tuning.check_settings(environment)
    if allocation is not None:  # Slurm signals the ranks themselves: their SIGTERM asks them to stop
        environment[preempt.SIGTERM_STOPS] = "1"
    if config is not None:  # a recipe's rank 0 reports its progress within an epoch
        every = LIVE_PROGRESS_S if facts.terminal else PLAIN_PROGRESS_S
        environment.setdefault(PROGRESS_ENV, str(every))
    spec = LaunchSpec(
        program=program,
        np=np,
        hosts=hosts,
        log_dir=str(facts.cwd / run_dir / "logs"),
        network_interface=request.network_interface,
        forward_env=() if request.image else tuple(sorted(set(environment) - HOST_SPECIFIC)),
        ssh_port=request.ssh_port,
        ssh_identity_file=request.ssh_identity_file,
    )
    context = strategies.LaunchContext(
        horovodrun="horovodrun" if request.image else facts.horovodrun,
        run_as_root=facts.uid == 0,
        cores_per_host=facts.cores,
        threads_per_rank=request.threads_per_rank
        or (allocation.cpus_per_task if allocation is not None else None),
        executables=facts.executables,
        modules=facts.modules,
        measured_launchers=facts.measured_launchers,
        framework=framework,
        free_port=facts.free_port,
        bind_library=None if request.image else facts.bind_library,
        allocation=allocation,
        probed=facts.probed,
        allreduce_rules=None if request.image else str(mpi_launcher.ALLREDUCE_RULES),
        tuning=tuning.measured(facts.measured_tuning, strategy.tunable, name) if config is not None else None,
        host_addresses=facts.host_addresses,
    )
    launch = strategies.launch(strategy, spec, request.strategy_options, context, config)
    if allocation is not None:  # the allocation's nodes by their Slurm names
        remote_hosts = tuple(h.name for h in hosts if h.name not in (this_node, *LOOPBACK_NAMES))
    else:
        remote_hosts = _remote_hosts(hosts, facts)
    if remote_hosts and request.image:
        raise ValueError("--image runs on this host only; give --hosts without --image")
    for flag, value in (("--ssh-port", request.ssh_port), ("--ssh-identity-file", request.ssh_identity_file)):
        if value is not None and not remote_hosts:
            raise ValueError(f"{flag} applies to runs on other hosts (--hosts or --hostfile)")
    if request.ssh_port is not None and not 0 < request.ssh_port < 65536:
        raise ValueError(f"--ssh-port must be a port number (1-65535), got {request.ssh_port}")
    transport: remote.Transport = remote.Ssh(request.ssh_port, request.ssh_identity_file)
    if allocation is not None and (steps := launchers.in_allocation(facts.executables)) and steps.transport:
        transport = steps.transport()
    command, passed_on = launch.command, tuple(sorted(environment))
    if "LD_PRELOAD" in command.env and environment.get("LD_PRELOAD"):  # --env LD_PRELOAD: kept, after ours
        command = replace(
            command,
            env={**command.env, "LD_PRELOAD": f"{command.env['LD_PRELOAD']}:{environment['LD_PRELOAD']}"},
        )
    if request.image:
        cwd = str(facts.cwd)
        mounts = [os.path.normpath(facts.cwd / run_dir), cwd]
        mounts += [os.path.dirname(source)] if source and registry.is_path(source) else []
        user = f"{facts.uid}:{facts.gid}"
        # The engine runs with this environment (DOCKER_HOST, ...); the container gets only the
        # ranks' variables and the --env names, by name, beside its own PATH and interpreter.
        passed_on = tuple(sorted({*command.env, *request.env}))
        engine = facts.container_engine
        command = container.in_image(command, request.image, engine, mounts, cwd, user, passed_on)
        environment = dict(facts.environ)
    return RunPlan(
        command=command,
        run_dir=run_dir,
        recipe=None if recipe_ref is None else name,
        recipe_source=source,
        framework=framework,
        strategy=strategy.name,
        launcher=launch.launcher,
        config=config,
        failed_rank_patterns=launch.failed_rank_patterns,
        job_failing=launch.job_failing,
        environment=environment,
        passed_on=passed_on,
        notes=(slurm_line,) * bool(slurm_line)
        + load_notes
        + launch.notes
        + _listener_notes(launch.launcher, request, facts),
        check_horovod_build=strategy.checks_horovod_build and not request.image,
        preflight=preflight,
        verbose=request.verbose,
        remote_hosts=remote_hosts,
        transport=transport,
        python=python,
        hosts=hosts,
        rank_hosts=tuple(remote.rank_hosts(hosts, np)) if hosts else (),
        resume=request.resume,
        resume_from=request.resume_from if request.resume else None,
        bind_library=context.bind_library if "LD_PRELOAD" in launch.command.env else None,
        console=request.console,
        tracking_uri=tracking_uri,
        slurm_job=slurm_job,
        preempt_via_launcher=launch.passes_on_usr1,
        stops_at_step=config is not None
        and strategy.takes_stop_request
        and (launch.launcher is None or launchers.get(launch.launcher).takes_stop_request),
    )


def _allocation(
    request: RunRequest, facts: Facts, allocation: slurm.Allocation | None
) -> tuple[slurm.Allocation | None, str, str]:
    """The Slurm allocation a Horovod run takes its hosts from (None outside one, and for the other
    strategies, which run on this node), this node's Slurm name, and the line saying so."""
    if allocation is None or request.image:
        return None, facts.hostname, ""
    this_node = facts.environ.get("SLURMD_NODENAME") or facts.hostname
    line = f"hvdtrain: inside Slurm job {allocation.job_id}"
    if allocation.restart_count and request.resume:
        line += f", requeued (restart {allocation.restart_count}): the run resumes"
    if not strategies.spans_hosts(request.strategy):
        return None, this_node, f"{line}: {request.strategy} runs on this node"
    return allocation, this_node, line


def _listener_notes(launcher: str | None, request: RunRequest, facts: Facts) -> tuple[str, ...]:
    """mpirun without hvdtrain's bind library answers on every interface: said, not refused."""
    if launcher != "mpi" or request.image or facts.bind_library is not None:
        return ()
    why = facts.bind_library_problem or "hvdtrain's bind library is missing"
    return (f"hvdtrain: mpirun's out-of-band listener will answer on every interface ({why})",)
