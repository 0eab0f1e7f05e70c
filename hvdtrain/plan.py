"""`hvdtrain run` as plan, execute, report.

`gather_facts` reads everything the decision needs from this machine, once. `plan_run` is pure: from
the request and the facts it decides what runs, where, with which argv and environment, and refuses
bad input with a ValueError before anything starts. `execute` starts the plan; `report` speaks.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import sys
import time
import zipfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import click
import psutil

from hvdtrain import config as config_module
from hvdtrain import hosts as remote
from hvdtrain import launchers, registry, strategies
from hvdtrain.config import TrainConfig
from hvdtrain.console import LIVE_PROGRESS_S, PLAIN_PROGRESS_S, PROGRESS_ENV, human
from hvdtrain.errors import JobFailed, UserError
from hvdtrain.launch import (
    LOOPBACK_NAMES,
    LaunchCommand,
    LaunchSpec,
    free_ports,
    is_local,
    parse_hostfile,
    parse_hosts,
    rank_stderr_tail,
)
from hvdtrain.runner import LaunchResult, run_launch
from hvdtrain.runs import ended_record, now_iso, pid_alive, running_record
from hvdtrain.runtime.common import (
    CHECKPOINT_FILES,
    RUN_RECORD,
    atomic_write_bytes,
    read_json_object,
    remove_stale_tmp_files,
)
from hvdtrain.runtime.watchdog import STALL_MARKER
from hvdtrain.strategies.ps import PS_MARKER

HOST_SPECIFIC = frozenset(
    {"HOME", "USER", "LOGNAME", "SHELL", "TERM", "TMPDIR", "SSH_AUTH_SOCK", "LD_PRELOAD", "KRB5CCNAME"}
    | {"XDG_RUNTIME_DIR", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME"}
)
"""Forwarded to the launcher, but not pushed by mpirun -x to ranks on other hosts, which have their own."""
FORWARDED_NAMES = HOST_SPECIFIC | frozenset(
    {"PATH", "LANG", "LANGUAGE", "TZ", "LD_LIBRARY_PATH", "VIRTUAL_ENV", "CONDA_PREFIX"}
    | {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH"}  # how --launcher ray reaches a cluster (not the token)
    | {"http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY"}
)
FORWARDED_PREFIXES = (
    "HVDTRAIN_", "HOROVOD_", "PYTHON", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "TF_", "XLA_", "TORCH",
    "PYTORCH_", "CUDA_", "NCCL_", "NVIDIA_", "GLOO_", "OMPI_", "OPAL_", "PMIX_", "PRTE_", "UCX_",
    "HWLOC_", "SLURM_", "PBS_", "LSB_", "LC_", "XDG_",
)  # fmt: skip
"""The environment the launcher and ranks get: hvdtrain's, the frameworks' and the system's
variables, plus what --env names; nothing else (tokens and cloud keys stay in this process)."""


def forwarded_environment(environ: dict[str, str], requested: tuple[str, ...]) -> dict[str, str]:
    """The variables passed on to the ranks; a --env name that is not set is refused."""
    if missing := [name for name in requested if name not in environ]:
        raise ValueError(f"--env {missing[0]}: not set in this environment")
    return {
        name: value
        for name, value in environ.items()
        if name in FORWARDED_NAMES or name.startswith(FORWARDED_PREFIXES) or name in requested
    }


RUNS = Path("runs")
RUN_STAMP = re.compile(r"-\d{8}-\d{6}")
"""What a default run directory's name adds to the recipe's: runs/RECIPE-YYYYmmdd-HHMMSS."""


@dataclass(frozen=True)
class RunRequest:
    """What the user asked for, as parsed from the command line."""

    target: str
    """A recipe name, module:pkg.mod, or a .py file: a recipe when it defines RECIPE, else a script."""
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
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    env: tuple[str, ...] = ()
    """--env NAME: more variables for the ranks, beyond the forwarded ones."""
    image: str | None = None
    dry_run: bool = False
    verbose: bool = False
    oversubscribe: bool = False
    """Run more ranks than this host's cores or memory hold."""
    max_restarts: int = 0
    """Relaunch a failed job from its last checkpoint this many times (without hosts that were lost)."""

    @property
    def is_path(self) -> bool:
        return registry.is_path(self.target)


def recipe_spec(target: str, script_text: str | None, cwd: Path) -> str | None:
    """What registry.load (and each rank's --recipe) takes for TARGET: the name, module:pkg.mod, or
    a file's absolute path where the file defines RECIPE; None for a Horovod script, run untouched."""
    if not registry.is_path(target):
        return target
    if script_text is not None and registry.defines_recipe(script_text):
        return os.path.normpath(cwd / target)
    return None


@dataclass(frozen=True)
class ResumeFacts:
    run_dir: Path
    saved_config: dict[str, Any] | None = None
    """run_dir/config.json, None where missing or unreadable."""
    recipe: str | None = None
    """The recipe run_dir/run.json names (runs of older versions have none)."""
    files: dict[str, str] = field(default_factory=dict)
    """Checkpoint file -> "ok", "missing", or what is wrong with it."""
    finished_epochs: int | None = None
    """The epochs of a run that finished (its summary.json), else None."""
    recipe_source: str | None = None
    """The file or module:NAME of a recipe that is not built in, as run_dir/run.json records it."""
    in_use_by: int | None = None
    """The pid of another hvdtrain on this host that is training this run right now."""


def _check_file(path: Path) -> str:
    """Cheap integrity checks without importing a framework: torch and Keras checkpoints are zip files."""
    if not path.is_file():
        return "missing"
    try:
        if not zipfile.is_zipfile(path):
            return "corrupt (not a readable checkpoint)"
        with zipfile.ZipFile(path) as archive:
            if archive.testzip() is not None:
                return "corrupt (not a readable checkpoint)"
    except (OSError, ValueError, zipfile.BadZipFile) as error:
        return f"corrupt ({error})"
    return "ok"


def run_dir_problem(run_dir: Path) -> str | None:
    """Why a run directory cannot be written, found before any rank starts (None: it can)."""
    if run_dir.exists() and not run_dir.is_dir():
        return f"--run-dir {run_dir} is a file, not a directory"
    existing = run_dir
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"--run-dir {run_dir}: {existing} is a file, not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"--run-dir {run_dir}: {existing} is not writable"
    return None


def resume_facts(run_dir: Path) -> ResumeFacts:
    summary = read_json_object(run_dir / "summary.json")
    record = read_json_object(run_dir / RUN_RECORD) or {}
    return ResumeFacts(
        run_dir=run_dir,
        saved_config=read_json_object(run_dir / "config.json"),
        recipe=record.get("recipe"),
        recipe_source=record.get("recipe_source"),
        files={name: _check_file(run_dir / name) for names in CHECKPOINT_FILES.values() for name in names},
        finished_epochs=summary.get("epochs") if summary else None,
        in_use_by=_training_it(record),
    )


def _training_it(record: dict) -> int | None:
    """The pid of another live hvdtrain on this host whose record says it is running this run."""
    pid = record.get("pid")
    if record.get("status") != "running" or record.get("host") != socket.gethostname() or pid == os.getpid():
        return None
    return pid if pid_alive(pid, record.get("started")) else None


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
    environ: dict[str, str]
    """This process's environment, read once."""
    free_port: int
    timestamp: str
    memory_available: int = 1 << 40
    """Bytes of memory free for new processes here."""
    resume: ResumeFacts | None = None
    """What --resume would continue (--run-dir, else the recipe's latest run under runs/)."""
    run_dir_problem: str | None = None
    """Why the run directory asked for (--run-dir, else runs/) cannot be written."""
    hostfile_text: str | None = None
    script_text: str | None = None
    """A file TARGET's text: a recipe file when it defines RECIPE, else a Horovod script."""
    container_engine: str | None = None
    local_addresses: frozenset[str] = frozenset({"127.0.0.1"})
    """This machine's IPv4 addresses."""
    host_addresses: dict[str, str | None] = field(default_factory=dict)
    """Each --hosts/--hostfile name -> its address (None where it does not resolve)."""
    modules: frozenset[str] = frozenset()
    """The Python modules launchers need (ray) that are importable here."""
    terminal: bool = False
    """Whether hvdtrain's output is a terminal: rank 0's progress is then redrawn twice a second."""
    bind_library: str | None = None
    """hvdtrain's listener library for mpirun (hvdtrain.native), where mpirun is on PATH."""
    bind_library_problem: str | None = None
    """Why there is none, where mpirun is on PATH."""


def _sibling_script(name: str) -> str:
    """The console script installed beside this interpreter, so a venv works without being activated."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def gather_facts(request: RunRequest) -> Facts:
    """Everything plan_run needs from the machine. A dry run probes no container daemon."""
    from hvdtrain.bench import LAUNCHER_MEASUREMENTS

    measured = read_json_object(LAUNCHER_MEASUREMENTS) or {}
    script_text = None
    if request.is_path and Path(request.target).is_file():
        script_text = Path(request.target).read_text(errors="replace")
    resume = None
    spec = recipe_spec(request.target, script_text, Path.cwd())
    if request.resume and spec is not None:
        name = registry.load(spec).name if registry.source(spec) else spec  # runs/NAME-TIMESTAMP
        runs = sorted(p for p in RUNS.glob(f"{name}-*") if RUN_STAMP.fullmatch(p.name[len(name) :]))
        resume_dir = request.run_dir or (runs[-1] if runs else None)
        resume = resume_facts(resume_dir) if resume_dir is not None else None
    hostfile_text = None
    if request.hostfile:
        try:
            hostfile_text = Path(request.hostfile).read_text()
        except OSError as error:
            raise ValueError(f"--hostfile: {error.strerror}: {request.hostfile}") from None
    engine = None
    if request.image:
        from hvdtrain.container import detect_engine

        engine = detect_engine(probe_daemon=not request.dry_run)
    try:
        named = _hosts(request, hostfile_text)
    except ValueError:
        named = ()  # plan_run says what is wrong with them
    addresses = {host.name: _resolve(host.name) for host in named}
    executables = frozenset(
        launcher.executable
        for launcher in launchers.all_launchers().values()
        if launcher.executable and shutil.which(launcher.executable)
    )
    bind_library, bind_library_problem = None, None
    if "mpirun" in executables and not request.image:
        from hvdtrain import native

        library, bind_library_problem = native.bind_library()
        bind_library = str(library) if library else None
    return Facts(
        cores=len(os.sched_getaffinity(0)) or 1,  # the cores this process may use (taskset, cgroups)
        python=sys.executable,
        horovodrun=_sibling_script("horovodrun"),
        executables=executables,
        measured_launchers=measured,
        uid=os.getuid(),
        gid=os.getgid(),
        cwd=Path.cwd(),
        environ=dict(os.environ),
        free_port=free_ports(1)[0],
        memory_available=psutil.virtual_memory().available,
        timestamp=time.strftime("%Y%m%d-%H%M%S"),
        resume=resume,
        run_dir_problem=run_dir_problem((request.run_dir or RUNS).absolute()),
        hostfile_text=hostfile_text,
        script_text=script_text,
        container_engine=engine,
        local_addresses=_local_addresses(),
        host_addresses=addresses,
        terminal=sys.stdout.isatty(),
        bind_library=bind_library,
        bind_library_problem=bind_library_problem,
        modules=frozenset(
            launcher.module
            for launcher in launchers.all_launchers().values()
            if launcher.module and importlib.util.find_spec(launcher.module)
        ),
    )


def _resolve(name: str) -> str | None:
    try:
        return socket.gethostbyname(name)
    except OSError:
        return None


def _local_addresses() -> frozenset[str]:
    found = {
        a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET
    }
    return frozenset(found | {"127.0.0.1"})


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
    ssh: remote.Ssh = remote.Ssh()
    python: str = sys.executable
    hosts: tuple = ()
    """The hosts of --hosts or --hostfile, as parsed (a restart goes on with those that answer)."""
    rank_hosts: tuple[str, ...] = ()
    """The host of each rank, for failure reports."""
    resume: bool = False
    """Continues the run directory's run (run.json keeps the run's first start)."""
    bind_library: str | None = None
    """hvdtrain's listener library that mpirun preloads: every other host must have it at this path."""


def _script_framework(text: str) -> str:
    return "tensorflow" if ("horovod.tensorflow" in text or "import tensorflow" in text) else "torch"


def _hosts(request: RunRequest, hostfile_text: str | None):
    if request.hosts and request.hostfile:
        raise ValueError("give --hosts or --hostfile, not both")
    if request.hostfile:
        return parse_hostfile(hostfile_text or "")
    return parse_hosts(request.hosts) if request.hosts else ()


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


class NothingToDo(Exception):
    """A request that is already fulfilled (resuming a finished run): said, exit 0, nothing changed."""


def _recipe_config(
    recipe: registry.Recipe, source: str | None, request: RunRequest, facts: Facts
) -> TrainConfig:
    overrides = config_module.parse_overrides(recipe.config, request.overrides)
    if not request.resume:
        return config_module.apply(recipe.make_config(request.variant), overrides)
    return _resumed_config(recipe, source, request, facts.resume, overrides)


def _resumed_config(
    recipe, source: str | None, request: RunRequest, resume: ResumeFacts | None, overrides
) -> TrainConfig:
    """The saved config with what may change on resume; every check before any rank starts, so a
    refused resume leaves the run directory as it was."""
    if request.variant:
        raise ValueError("--variant applies to a new run; --resume continues the run's saved config")
    if resume is None:
        raise ValueError(f"--resume: no earlier run of {recipe.name} under {RUNS}/; pass --run-dir")
    where = resume.run_dir
    if resume.in_use_by is not None:
        raise ValueError(f"--resume: {where} is being trained right now by hvdtrain (pid {resume.in_use_by})")
    if resume.saved_config is None:
        raise ValueError(f"--resume: {where} holds no run (no readable config.json)")
    if resume.recipe not in (None, recipe.name):
        raise ValueError(f"--resume: {where} is a run of {resume.recipe}, not of {recipe.name}")
    if resume.recipe is not None and resume.recipe_source != source:
        builtin = f"the built-in {recipe.name}"
        raise ValueError(
            f"--resume: {where} is a run of {resume.recipe_source or builtin}, not of {source or builtin}"
        )
    for name in CHECKPOINT_FILES[recipe.framework]:
        if (status := resume.files.get(name, "missing")) != "ok":
            raise ValueError(f"--resume: {where / name} is {status}; nothing was changed")
    saved = config_module.from_dict(recipe.config, resume.saved_config)
    changed = sorted(name for name, value in overrides.items() if getattr(saved, name) != value)
    if fixed := [name for name in changed if name not in config_module.MAY_CHANGE_ON_RESUME]:
        raise ValueError(
            f"--resume: {', '.join(fixed)} cannot change on resume (the checkpoint was made with "
            f"{', '.join(f'{name}={getattr(saved, name)}' for name in fixed)}); "
            f"what may change: {', '.join(config_module.MAY_CHANGE_ON_RESUME)}"
        )
    config = config_module.apply(saved, overrides)
    if resume.finished_epochs is not None and config.epochs <= resume.finished_epochs:
        raise NothingToDo(
            f"hvdtrain: {where} already finished its {resume.finished_epochs} epochs; nothing changed "
            f"(--resume --set epochs=N with N > {resume.finished_epochs} trains more)"
        )
    return config


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
    hosts = _hosts(request, facts.hostfile_text)
    np = (sum(h.slots for h in hosts) if hosts else facts.cores) if request.np is None else request.np
    if np < 1:
        raise ValueError(f"--np must be at least 1, got {np}")
    if request.max_restarts < 0:
        raise ValueError(f"--max-restarts must be 0 or more, got {request.max_restarts}")
    if request.threads_per_rank is not None and request.threads_per_rank < 1:
        raise ValueError(f"--threads-per-rank must be at least 1, got {request.threads_per_rank}")
    python = "python" if request.image else facts.python  # an image has its own interpreter on PATH
    config, preflight = None, None
    recipe_ref = recipe_spec(request.target, facts.script_text, facts.cwd)
    resumed = facts.resume if request.resume else None
    if resumed and resumed.recipe_source and recipe_ref == resumed.recipe == request.target:
        recipe_ref = resumed.recipe_source  # resumed by name: the file or module the run was made with
    source = None if recipe_ref is None else registry.source(recipe_ref)
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
        if reason := strategy.refuse(config):
            raise ValueError(reason)
        run_dir = (
            facts.resume.run_dir if request.resume else request.run_dir or RUNS / f"{name}-{facts.timestamp}"
        )
        program = [python, "-m", "hvdtrain.worker", "--recipe", recipe_ref]
        program += ["--run-dir", str(facts.cwd / run_dir), "--strategy", strategy.name]
        program += ["--config", config_module.to_json(config)]
        program += ["--resume"] if request.resume else []
        preflight = recipe.preflight
    load_notes = _local_load(np, hosts, framework, facts, request.oversubscribe)
    options = strategies.resolve_options(strategy, request.strategy_options)
    environment = forwarded_environment(facts.environ, request.env)
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
        threads_per_rank=request.threads_per_rank,
        executables=facts.executables,
        modules=facts.modules,
        measured_launchers=facts.measured_launchers,
        framework=framework,
        free_port=facts.free_port,
        bind_library=None if request.image else facts.bind_library,
    )
    launch = strategy.launch(spec, options, context)
    if config is not None and launch.launcher and (reason := launchers.get(launch.launcher).refuse(config)):
        raise ValueError(reason)
    remote_hosts = _remote_hosts(hosts, facts)
    if remote_hosts and request.image:
        raise ValueError("--image runs on this host only; give --hosts without --image")
    for flag, value in (("--ssh-port", request.ssh_port), ("--ssh-identity-file", request.ssh_identity_file)):
        if value is not None and not remote_hosts:
            raise ValueError(f"{flag} applies to runs on other hosts (--hosts or --hostfile)")
    if request.ssh_port is not None and not 0 < request.ssh_port < 65536:
        raise ValueError(f"--ssh-port must be a port number (1-65535), got {request.ssh_port}")
    ssh = remote.Ssh(request.ssh_port, request.ssh_identity_file)
    command, passed_on = launch.command, tuple(sorted(environment))
    if "LD_PRELOAD" in command.env and environment.get("LD_PRELOAD"):  # --env LD_PRELOAD: kept, after ours
        command = replace(
            command,
            env={**command.env, "LD_PRELOAD": f"{command.env['LD_PRELOAD']}:{environment['LD_PRELOAD']}"},
        )
    if request.image:
        from hvdtrain.container import in_image

        cwd = str(facts.cwd)
        mounts = [os.path.normpath(facts.cwd / run_dir), cwd]
        mounts += [os.path.dirname(source)] if source and registry.is_path(source) else []
        user = f"{facts.uid}:{facts.gid}"
        # The engine runs with this environment (DOCKER_HOST, ...); the container gets only the
        # ranks' variables and the --env names, by name, beside its own PATH and interpreter.
        passed_on = tuple(sorted({*command.env, *request.env}))
        command = in_image(command, request.image, facts.container_engine, mounts, cwd, user, passed_on)
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
        environment=environment,
        passed_on=passed_on,
        notes=load_notes + launch.notes + _listener_notes(launch.launcher, request, facts),
        check_horovod_build=strategy.name == "horovod" and not request.image,
        preflight=preflight,
        verbose=request.verbose,
        remote_hosts=remote_hosts,
        ssh=ssh,
        python=python,
        hosts=hosts,
        rank_hosts=tuple(remote.rank_hosts(hosts, np)) if hosts else (),
        resume=request.resume,
        bind_library=context.bind_library if "LD_PRELOAD" in launch.command.env else None,
    )


def _listener_notes(launcher: str | None, request: RunRequest, facts: Facts) -> tuple[str, ...]:
    """mpirun without hvdtrain's bind library answers on every interface: said, not refused."""
    if launcher != "mpi" or request.image or facts.bind_library is not None:
        return ()
    why = facts.bind_library_problem or "hvdtrain's bind library is missing"
    return (f"hvdtrain: mpirun's out-of-band listener will answer on every interface ({why})",)


def execute(plan: RunPlan) -> LaunchResult:
    """Check what only running can check, leave the config in the run directory, run the job."""
    if plan.preflight is not None and plan.config is not None:
        plan.preflight(plan.config)
    if plan.check_horovod_build:
        _check_horovod_build(plan.framework)
    apart = _check_hosts(plan)
    try:
        plan.run_dir.mkdir(parents=True, exist_ok=True)
        if plan.config is not None:
            config_module.save(plan.config, plan.run_dir / "config.json")
        record = {"recipe": plan.recipe, "framework": plan.framework, "strategy": plan.strategy}
        record |= {"recipe_source": plan.recipe_source} if plan.recipe_source else {}
        previous = read_json_object(plan.run_dir / RUN_RECORD)
        record = running_record(
            record, previous, pid=os.getpid(), host=socket.gethostname(), now=now_iso(), resume=plan.resume
        )
        atomic_write_bytes(plan.run_dir / RUN_RECORD, (json.dumps(record) + "\n").encode())
    except OSError as error:
        raise UserError(f"cannot write the run directory {plan.run_dir}: {error.strerror}") from None
    for note in plan.notes:
        click.echo(note)
    lost: dict[str, str] = {}
    try:
        if problems := [
            c.problem for c in remote.stage(apart, plan.ssh, plan.run_dir.absolute()) if c.problem
        ]:
            raise UserError("; ".join(problems))
        result = run_launch(plan.command, plan.environment, plan.failed_rank_patterns, plan.verbose)
        if result.returncode != 0:  # which hosts still answer: a restart goes on without the others
            shared = [host for host in plan.remote_hosts if host not in apart]
            lost = {check.host: check.problem for check in remote.alive(shared, plan.ssh) if check.problem}
    finally:
        if apart:
            collected = remote.collect(apart, plan.ssh, plan.run_dir.absolute())
            lost |= {check.host: check.problem for check in collected if check.problem}
        (plan.run_dir / remote.MARKER).unlink(missing_ok=True)
        remove_stale_tmp_files(plan.run_dir)  # what a killed rank 0 was writing
    return replace(result, lost_hosts=lost)


def restart_request(request: RunRequest, plan: RunPlan, result: LaunchResult) -> RunRequest:
    """What a restart after a failure runs: a resume of the same run directory from its last
    checkpoint (its saved config, so no --variant or --set), or the same run afresh where no epoch
    was saved yet; without the hosts that were lost, when others remain."""
    checkpointed = resume_facts(plan.run_dir).files.get(CHECKPOINT_FILES[plan.framework][0]) == "ok"
    retry = replace(request, run_dir=plan.run_dir, resume=checkpointed)
    if checkpointed:
        retry = replace(retry, variant=None, overrides=())
    hosts = plan.hosts  # this attempt's: hosts dropped by an earlier restart stay dropped
    kept = tuple(h for h in hosts if h.name not in result.lost_hosts) or hosts
    if hosts:
        retry = replace(retry, hosts=",".join(f"{h.name}:{h.slots}" for h in kept), hostfile=None)
    if len(kept) < len(hosts):
        slots = sum(h.slots for h in kept)
        retry = replace(retry, np=min(request.np or slots, slots))
    return retry


def run_with_restarts(request: RunRequest, plan: RunPlan) -> tuple[RunPlan, LaunchResult]:
    """execute, and with --max-restarts N relaunch a failed job up to N times, planned anew by
    restart_request. A signal that stopped the job is never overridden by a restart. However it
    ends, run.json then says so (hvdtrain runs shows it)."""
    run_dir = plan.run_dir  # restarts and resumes keep it
    try:
        plan, result = _attempts(request, plan)
    except KeyboardInterrupt:
        record_end(run_dir, 128 + signal.SIGINT, signal.SIGINT)
        raise
    except BaseException as error:  # a refused restart (ValueError: the CLI's exit 2), ...
        record_end(run_dir, 2 if isinstance(error, ValueError) else getattr(error, "exit_code", 1), None)
        raise
    if result.stopped_by is not None:
        record_end(run_dir, 128 + result.stopped_by, result.stopped_by)
    else:
        record_end(run_dir, 0 if result.returncode == 0 else _exit_code(result), None)
    return plan, result


def record_end(run_dir: Path, exit_code: int, stopped_by: int | None) -> None:
    """Close the running record this process wrote in run.json with how the job ended; a record
    that is not this process's (a start refused before writing one) is left as it is."""
    record = read_json_object(run_dir / RUN_RECORD)
    if not record or record.get("status") != "running" or record.get("pid") != os.getpid():
        return
    if record.get("host") != socket.gethostname():
        return
    ended = ended_record(record, exit_code, stopped_by, now_iso())
    with contextlib.suppress(OSError):  # what the job did is reported either way
        atomic_write_bytes(run_dir / RUN_RECORD, (json.dumps(ended) + "\n").encode())


def _attempts(request: RunRequest, plan: RunPlan) -> tuple[RunPlan, LaunchResult]:
    result = execute(plan)
    for attempt in range(1, request.max_restarts + 1):
        if result.returncode == 0 or result.stopped_by is not None:
            break
        for line in [
            *result.lost_hosts.values(),
            *_failure_lines(result, plan.run_dir / "logs", plan.rank_hosts),
        ]:
            click.echo(f"hvdtrain: {line}", err=True)
        retry = restart_request(request, plan, result)
        try:
            plan = plan_run(retry, gather_facts(retry))
        except NothingToDo as done:  # rank 0 had finished every epoch before the job failed
            click.echo(str(done), err=True)
            break
        how = "from its last checkpoint" if retry.resume else "from the start (no checkpoint was saved yet)"
        where = f" on {retry.hosts}" if retry.hosts != request.hosts else ""
        click.echo(f"hvdtrain: restart {attempt} of {request.max_restarts} {how}{where}", err=True)
        result = execute(plan)
    return plan, result


def _check_hosts(plan: RunPlan) -> list[str]:
    """Every other host answers with the same hvdtrain and Horovod build, or the job does not start
    and nothing is written. Returns the hosts that do not share this host's run directory."""
    if not plan.remote_hosts:
        return []
    from hvdtrain import doctor

    run_dir = plan.run_dir.absolute()
    made = [path for path in (run_dir, *run_dir.parents) if not path.exists()]
    try:
        token = remote.write_marker(run_dir)
    except OSError as error:
        raise UserError(f"cannot write the run directory {plan.run_dir}: {error.strerror}") from None
    expected = {name: doctor.installed_version(name) or "none" for name in ("hvdtrain", "horovod")}
    expected |= {"bind_library": plan.bind_library} if plan.bind_library else {}
    checks = remote.preflight(list(plan.remote_hosts), plan.ssh, plan.python, run_dir, expected, token)
    for check in checks:
        if check.warning:
            click.echo(f"hvdtrain: {check.warning}", err=True)
    if problems := [check.problem for check in checks if check.problem]:
        (run_dir / remote.MARKER).unlink(missing_ok=True)
        for path in made:  # a refused start leaves no run directory behind
            with contextlib.suppress(OSError):
                path.rmdir()
        raise UserError("; ".join(problems))
    return [check.host for check in checks if not check.shared]


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
    if result.stopped_by is not None:
        name = signal.Signals(result.stopped_by).name
        raise JobFailed(f"stopped by {name}: every rank was ended; logs: {logs}", 128 + result.stopped_by)
    if result.returncode != 0:
        lines = _failure_lines(result, logs, plan.rank_hosts)
        raise JobFailed("\n".join([*result.lost_hosts.values(), *lines]), _exit_code(result))
    summary_path = plan.run_dir / "summary.json"
    if not summary_path.exists():
        click.echo(f"hvdtrain: done in {result.wall_seconds:.1f}s; logs in {logs}")
        return
    summary = {**json.loads(summary_path.read_text()), "wall_seconds": result.wall_seconds}
    atomic_write_bytes(summary_path, (json.dumps(summary, indent=2) + "\n").encode())  # start-up included
    click.echo(summary_line(summary))


def _exit_code(result: LaunchResult) -> int:
    """The failed rank's own exit code (a script's sys.exit(3) is 3), else 1."""
    code = result.failure.exit_code if result.failure else None
    if code is not None and 0 < code < 256:
        return code
    if code is not None and code < 0:  # the rank was killed by signal -code
        return 128 - code
    return 1


def _failure_lines(result: LaunchResult, logs: Path, rank_hosts: tuple[str, ...] = ()) -> list[str]:
    reports = [line for line in result.output_tail if STALL_MARKER in line or PS_MARKER in line]
    if reports:
        lines = [reports[0][reports[0].index("hvdtrain: ") + len("hvdtrain: ") :]]  # show() adds it
    elif result.failure is not None:
        rank, code = result.failure.rank, result.failure.exit_code
        how = f"exit code {code}" if code is not None else f"job exit code {result.returncode}"
        where = f" on {rank_hosts[rank]}" if rank < len(rank_hosts) else ""
        lines = [f"rank {rank}{where} failed first ({how}); last lines of its stderr:"]
        lines += [f"  {line}" for line in rank_stderr_tail(logs, rank)]
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
        return human(value).replace(",", "") if isinstance(value, float) else str(value)

    return "summary: " + "  ".join(f"{key}={shown(summary.get(key))}" for key in SUMMARY_KEYS)
