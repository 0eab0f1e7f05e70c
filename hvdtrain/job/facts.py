"""This machine, read once before planning: everything `plan_run` decides from."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from hvdtrain import launchers, registry
from hvdtrain.job.request import RUN_STAMP, RUNS, RunRequest, recipe_spec, requested_hosts, script_file
from hvdtrain.job.resume import ResumeFacts, resume_facts
from hvdtrain.launchers.measurements import read_measurements
from hvdtrain.launching.container import detect_engine, image_problem
from hvdtrain.launching.spec import free_ports
from hvdtrain.measure import tuning


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
    script_path: str | None = None
    """The file a --module TARGET runs (a path TARGET is its own)."""
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
    hostname: str = "localhost"
    probed: Mapping[str, Any] = field(default_factory=dict)
    """launcher name -> what its probe found here (srun: its MPI plugins, inside an allocation)."""
    measured_tuning: dict[str, dict] = field(default_factory=dict)
    """recipe -> Horovod's fusion threshold and cycle time `hvdtrain bench --tune` chose here."""
    gpus: int = 0
    """The NVIDIA GPUs this process may use: the driver's, as many as CUDA_VISIBLE_DEVICES names."""


def _sibling_script(name: str) -> str:
    """The console script installed beside this interpreter, so a venv works without being activated."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def gather_facts(request: RunRequest) -> Facts:
    """Everything plan_run needs from the machine. A dry run probes no container daemon."""
    measured = read_measurements()
    found = script_file(request.target, request.module, Path.cwd())
    script_text = None if found is None else found.read_text(errors="replace")
    resume = None
    spec = recipe_spec(request.target, script_text, Path.cwd(), request.module)
    if request.resume and spec is not None:
        name = registry.load(spec).name if registry.source(spec) else spec  # runs/NAME-TIMESTAMP
        runs = sorted(p for p in RUNS.glob(f"{name}-*") if RUN_STAMP.fullmatch(p.name[len(name) :]))
        resume_dir = request.run_dir or (runs[-1] if runs else None)
        resume = resume_facts(resume_dir, request.resume_from) if resume_dir is not None else None
    hostfile_text = None
    if request.hostfile:
        try:
            hostfile_text = Path(request.hostfile).read_text()
        except OSError as error:
            raise ValueError(f"--hostfile: {error.strerror}: {request.hostfile}") from None
    engine = None
    if request.image and image_problem(request.image) is None:  # else plan_run says what is wrong
        engine = detect_engine(probe_daemon=not request.dry_run)
    try:
        named = [host.name for host in requested_hosts(request, hostfile_text)]
    except ValueError:
        named = []  # plan_run says what is wrong with them
    for launcher in launchers.all_launchers().values():
        named += launcher.named_hosts(request.strategy_options)
    addresses = {name: _resolve(name) for name in named}
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
    probed = {
        launcher.name: launcher.probe()
        for launcher in launchers.all_launchers().values()
        if launcher.probe and launcher.executable in executables
    }
    return Facts(
        cores=len(os.sched_getaffinity(0)) or 1,  # the cores this process may use (taskset, cgroups)
        python=sys.executable,
        horovodrun=_sibling_script("horovodrun"),
        executables=executables,
        measured_launchers=measured,
        measured_tuning=tuning.read(),
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
        script_path=None if found is None or not request.module else os.path.normpath(found),
        container_engine=engine,
        local_addresses=_local_addresses(),
        host_addresses=addresses,
        terminal=sys.stdout.isatty(),
        bind_library=bind_library,
        bind_library_problem=bind_library_problem,
        hostname=socket.gethostname(),
        probed=probed,
        gpus=visible_gpus(_driver_gpus(), os.environ.get("CUDA_VISIBLE_DEVICES")),
        modules=frozenset(
            launcher.module
            for launcher in launchers.all_launchers().values()
            if launcher.module and importlib.util.find_spec(launcher.module)
        ),
    )


NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")
"""One entry per GPU the NVIDIA driver gives this machine (a container: those it was given); read
instead of asking torch, whose import would cost every run seconds."""


def _driver_gpus() -> int:
    try:
        return len(list(NVIDIA_GPUS.iterdir()))
    except OSError:  # no NVIDIA driver
        return 0


def visible_gpus(driver_gpus: int, cuda_visible: str | None) -> int:
    """The GPUs CUDA lets this process use: the driver's, or as many as CUDA_VISIBLE_DEVICES names
    (indices or GPU-/MIG- UUIDs; CUDA stops at the first entry that names none, so '' and '-1' hide
    them all)."""
    if cuda_visible is None:
        return driver_gpus
    named: list[str] = []
    for entry in (entry.strip() for entry in cuda_visible.split(",")):
        index = entry.isdecimal() and int(entry) < driver_gpus
        if entry in named or not (index or entry.startswith(("GPU-", "MIG-"))):
            break
        named.append(entry)
    return min(len(named), driver_gpus)


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
