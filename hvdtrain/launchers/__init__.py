"""Launchers that start Horovod ranks, as a registry: `hvdtrain run --launcher NAME`.

A launcher is one module here that defines LAUNCHER: its argv builder (pure: a LaunchSpec in, a
LaunchCommand out, rank logs under spec.log_dir), the lines by which it reports a failed rank, and
the config knobs it cannot run. The CLI's choices and help come from `all_launchers()`; a new
launcher (ray, elastic) is a new module here, not a branch elsewhere.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass

from hvdtrain.config import TrainConfig
from hvdtrain.launch import LaunchCommand, LaunchSpec
from hvdtrain.plugins import discover

AUTO = "auto"
MEASURED_DEFAULT = "mpi"
"""What `--launcher auto` picks before this machine has measurements: MPI with yielding beat gloo
and DDP on synthetic-torch here (README table)."""


@dataclass(frozen=True)
class Launcher:
    name: str
    description: str
    build: Callable[[LaunchSpec, HorovodLaunch], LaunchCommand]
    """Pure: the command that starts spec.np Horovod ranks."""
    failed_rank_patterns: tuple[re.Pattern[str], ...]
    """Lines of the launcher's own output that name the rank that failed first (group 1)."""
    executable: str | None = None
    """A program that must be on PATH for this launcher (a fact gathered once, before planning)."""
    module: str | None = None
    """A Python module that must be importable for this launcher (also a fact gathered once)."""
    missing: str | None = None
    """The one line that refuses it where its executable or module is missing (None: a default)."""
    refuse: Callable[[TrainConfig], str | None] = lambda config: None
    """The reason this launcher cannot run a config, or None."""
    auto: bool = True
    """Whether --launcher auto may pick it (elastic needs options of its own)."""


@dataclass(frozen=True)
class HorovodLaunch:
    """What every Horovod launcher needs beyond the common LaunchSpec."""

    horovodrun: str = "horovodrun"
    """The horovodrun of the environment the ranks run in."""
    run_as_root: bool = False
    min_np: int | None = None
    max_np: int | None = None
    discovery_script: str | None = None
    """Elastic only: the range of ranks, and a program that prints the hosts available now."""
    ray_address: str | None = None
    """Ray only: the existing cluster to join (None: one is started for the run)."""
    bind_library: str | None = None
    """MPI only: hvdtrain.native's library that keeps mpirun's and orted's listeners on the run's
    interface (None: Open MPI's out-of-band listener answers on every interface)."""


def all_launchers() -> dict[str, Launcher]:
    """Every module of this package that defines LAUNCHER."""
    found = discover(sys.modules[__name__], "LAUNCHER", Launcher)
    return {launcher.name: launcher for launcher in sorted(found, key=lambda launcher: launcher.name)}


def names() -> tuple[str, ...]:
    return tuple(all_launchers())


def get(name: str) -> Launcher:
    known = all_launchers()
    if name not in known:
        raise ValueError(f"unknown launcher {name!r}; choose one of {', '.join(known)}")
    return known[name]


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
