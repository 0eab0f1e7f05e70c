"""Launchers that start Horovod ranks, as a registry: `hvdtrain run --launcher NAME`.

A launcher is one module here that defines LAUNCHER, and everything hvdtrain knows of it is there:
- its own `hvdtrain run` options (the CLI's flags and help, hvdtrain.run's keywords);
- its argv builder (pure: a LaunchSpec, the facts every launcher shares, its options in; a
  LaunchCommand out);
- where it writes each rank's output under the log directory;
- the tag it puts before a rank's line, the lines naming the rank that failed, and the lines
  saying the job is ending in failure;
- the variables that give a rank its local rank and local size;
- where its hosts come from: its build reads the spec's hosts (--hosts, --hostfile), its discovery
  script (elastic), or refuses both for nodes of its own (ray's cluster).
The CLI's choices and help, the console's tag parser (hvdtrain.launching.rank_output), the runner's failure
patterns and the rank log readers all come from `all_launchers()`; a new launcher is a new module
here, not a branch elsewhere.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING, Any

from hvdtrain.config import TrainConfig
from hvdtrain.launching.slurm import Allocation
from hvdtrain.launching.spec import LaunchCommand, LaunchSpec, RankOutput
from hvdtrain.options import Option, given_over_defaults, readers_of
from hvdtrain.plugins import discover, installed

if TYPE_CHECKING:
    from hvdtrain.measure.tuning import Setting

PLUGIN_GROUP = "hvdtrain.launchers"
AUTO = "auto"
MEASURED_DEFAULT = "mpi"
"""What `--launcher auto` picks before this machine has measurements: MPI with yielding beat gloo
and DDP on synthetic-torch here (docs/performance.md)."""


@dataclass(frozen=True)
class LaunchContext:
    """What the plan read of the place the processes start in (an image has its own), for the
    strategy and its launcher alike: one record between the facts and the plan."""

    horovodrun: str = "horovodrun"
    run_as_root: bool = False
    cores_per_host: int = 1
    threads_per_rank: int | None = None
    """The user's --threads-per-rank; None derives it from the cores."""
    executables: frozenset[str] = frozenset()
    """Launcher programs found on PATH (mpirun)."""
    modules: frozenset[str] = frozenset()
    """Python modules of launchers found importable (ray)."""
    measured_launchers: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    """framework -> launcher -> samples/s, recorded by `hvdtrain bench`."""
    framework: str = "torch"
    free_port: int = 29500
    bind_library: str | None = None
    """hvdtrain's listener library, preloaded into mpirun (None: mpirun listens on every interface)."""
    allocation: Allocation | None = None
    """The Slurm allocation the run is inside, if any."""
    probed: Mapping[str, Any] = field(default_factory=dict)
    """launcher name -> what its probe found here (srun: its MPI plugins, inside an allocation)."""
    allreduce_rules: str | None = None
    """hvdtrain's Open MPI allreduce rules for mpirun (None in an image: Open MPI's own choices)."""
    tuning: tuple[Setting, float, str] | None = None
    """The strategy's communication setting (Horovod's fusion threshold and cycle time, DDP's bucket
    size) that `hvdtrain bench --tune` found best for this recipe here: (setting, its ratio to the
    defaults, where it was measured)."""
    host_addresses: Mapping[str, str | None] = field(default_factory=dict)
    """Each host name the run's options give -> its address (None where it does not resolve)."""

    @property
    def cpus_per_task(self) -> int | None:
        """The Slurm allocation's CPUs per task, which srun (since Slurm 22.05) does not inherit."""
        return self.allocation.cpus_per_task if self.allocation is not None else None


@dataclass(frozen=True)
class Launcher:
    name: str
    description: str
    build: Callable[[LaunchSpec, LaunchContext, Mapping[str, Any]], LaunchCommand]
    """Pure: the command that starts spec.np Horovod ranks; the mapping holds this launcher's options."""
    output: RankOutput
    failed_rank_patterns: tuple[re.Pattern[str], ...]
    """Lines of the launcher's own output that name the rank that failed first (group 1)."""
    job_failing: tuple[re.Pattern[str], ...] = ()
    """Lines by which the launcher says the job is ending in failure, before it names the rank."""
    local_env: tuple[str, str] = ("HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE")
    """The variables that give a rank its rank and the number of ranks on its host."""
    local_size: Callable[[Mapping[str, str]], int | None] | None = None
    """The ranks on this host, where the second variable is not the number itself (None: it is)."""
    options: tuple[Option, ...] = ()
    """The `hvdtrain run` options this launcher reads; any other launcher refuses them when given."""
    executable: str | None = None
    """A program that must be on PATH for this launcher (a fact gathered once, before planning)."""
    module: str | None = None
    """A Python module that must be importable for this launcher (also a fact gathered once)."""
    missing: str | None = None
    """The one line that refuses it where its executable or module is missing (None: a default)."""
    refuse: Callable[[TrainConfig], str | None] = lambda config: None
    """The reason this launcher cannot run a config, or None."""
    auto: bool = True
    """Whether --launcher auto may pick it by measured speed (elastic needs options of its own)."""
    preferred: Callable[[Allocation | None, Any], str | None] = lambda allocation, probed: None
    """Given the Slurm allocation the run is in and what `probe` found: why --launcher auto takes
    it before any measured speed (srun inside an allocation with PMIx), or None."""
    refuse_here: Callable[[Allocation | None, Any], str | None] = lambda allocation, probed: None
    """Given the same: why it cannot start ranks in this place (srun outside an allocation), or None."""
    probe: Callable[[], Any] | None = None
    """A fact of this place it needs, gathered once before planning where its executable is here
    (srun: the MPI plugins `srun --mpi=list` names, inside an allocation)."""
    named_hosts: Callable[[Mapping[str, Any]], tuple[str, ...]] = lambda options: ()
    """The host names its given options hold (ray: --ray-address's), which are looked up before
    planning so that its build can refuse one that does not resolve (LaunchContext.host_addresses)."""
    passes_on_usr1: bool = False
    """Whether it passes SIGUSR1 on to every rank, also those on other hosts (mpirun, srun)."""
    elastic: bool = False
    """It runs Horovod's elastic training whenever it is chosen; its options ask for that training
    under --launcher auto too."""
    takes_elastic: bool = False
    """It runs elastic training where an elastic option is given (and always, where `elastic`)."""
    takes_stop_request: bool = True
    """Its ranks stop at an agreed step when hvdtrain asks (preemption, SIGTERM); an elastic driver's
    ranks end as the driver ends them."""
    one_per_host: Callable[[list[str], int], list[str]] | None = None
    """Inside an allocation: the argv that starts one task on each of these nodes with this many
    CPUs, before the task's program (srun): how ddp and fsdp start torchrun on each host there."""
    transport: Callable[[], Any] | None = None
    """Inside an allocation: how hvdtrain reaches its other nodes (a job step, where many clusters
    forbid ssh to compute nodes); None: ssh."""


@cache
def all_launchers() -> dict[str, Launcher]:
    """Every module of this package that defines LAUNCHER, and the launchers installed packages
    declare (entry points in the group hvdtrain.launchers)."""
    return _registry({})


def broken_plugins() -> dict[str, str]:
    """Installed launcher plugins that cannot be used: where -> why."""
    broken: dict[str, str] = {}
    _registry(broken)
    return broken


def _registry(broken: dict[str, str]) -> dict[str, Launcher]:
    found = discover(sys.modules[__name__], "LAUNCHER", Launcher)
    found += installed(PLUGIN_GROUP, Launcher, [launcher.name for launcher in found], broken)
    return {launcher.name: launcher for launcher in sorted(found, key=lambda launcher: launcher.name)}


def names() -> tuple[str, ...]:
    return tuple(all_launchers())


def elastic_default() -> Launcher:
    """The launcher an elastic option given without --launcher runs on."""
    return next(launcher for launcher in all_launchers().values() if launcher.elastic)


def in_allocation(executables: frozenset[str] | None = None) -> Launcher | None:
    """The launcher that starts tasks inside a Slurm allocation (where its program is among
    `executables`, when they are given)."""
    starters = [each for each in all_launchers().values() if each.one_per_host]
    return next((each for each in starters if executables is None or each.executable in executables), None)


def get(name: str) -> Launcher:
    known = all_launchers()
    if name not in known:
        raise ValueError(f"unknown launcher {name!r}; choose one of {', '.join(known)}")
    return known[name]


def all_options() -> dict[str, tuple[Option, list[str]]]:
    """option name -> (the option, the launchers that read it)."""
    return readers_of((launcher.name, launcher.options) for launcher in all_launchers().values())


def own_options(launcher: Launcher, given: Mapping[str, Any]) -> dict[str, Any]:
    """The launcher's options, what was given over their defaults. An option of another launcher that
    was given is refused, never silently ignored."""
    for name, (option, readers) in all_options().items():
        if given.get(name) is not None and launcher.name not in readers:
            raise ValueError(f"{option.flag} applies to --launcher {', '.join(readers)}")
    return given_over_defaults(launcher.options, given)


def choose(measured: dict[str, dict[str, float]], framework: str, available: set[str]) -> str:
    """`--launcher auto`: the available launcher with the best measured training throughput for this
    framework (`hvdtrain bench ... --launchers gloo,mpi` records it), else the measured default."""
    available = {name for name in available if all_launchers()[name].auto}
    candidates = {name: rate for name, rate in measured.get(framework, {}).items() if name in available}
    if candidates:
        return max(candidates, key=candidates.get)
    return MEASURED_DEFAULT if MEASURED_DEFAULT in available else sorted(available)[0]


def help_text() -> str:
    described = "; ".join(f"{launcher.name}: {launcher.description}" for launcher in all_launchers().values())
    auto = f"{AUTO}: the one measured fastest here, else {MEASURED_DEFAULT}"
    return f"How Horovod ranks start. {auto}; {described}."


def local_size(environ: Mapping[str, str]) -> int:
    """The ranks on this host, as whichever launcher started this rank says it."""
    for launcher in all_launchers().values():
        if value := environ.get(launcher.local_env[1]):
            found = int(value) if launcher.local_size is None else launcher.local_size(environ)
            if found:
                return found
    return 1
