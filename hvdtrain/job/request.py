"""What the user asked `hvdtrain run` (or `hvdtrain.run`) for, before anything is read from the machine."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hvdtrain import registry
from hvdtrain.launch import Host, parse_hostfile, parse_hosts

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
    console: bool = True
    """Show the job's output and hvdtrain's notes on this process's stdout and stderr."""
    mlflow: str | None = None
    """The MLflow tracking URI to log the run to (else MLFLOW_TRACKING_URI, else none)."""

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


def requested_hosts(request: RunRequest, hostfile_text: str | None) -> tuple[Host, ...]:
    """The hosts of --hosts or --hostfile (the file's text read as a fact), or () for this one."""
    if request.hosts and request.hostfile:
        raise ValueError("give --hosts or --hostfile, not both")
    if request.hostfile:
        return parse_hostfile(hostfile_text or "")
    return parse_hosts(request.hosts) if request.hosts else ()


def requeued(request: RunRequest, environ: Mapping[str, str]) -> RunRequest:
    """A batch job Slurm requeued (SLURM_RESTART_COUNT above 0) runs its `hvdtrain run` line again:
    where that run directory holds a checkpoint, the run resumes from it (with its saved config, so
    the line's --variant is not applied again), whatever run.json says of the node it was on."""
    from hvdtrain.runtime import checkpoint

    restarts = environ.get("SLURM_RESTART_COUNT", "0").strip()
    if request.resume or request.run_dir is None or not restarts.isdigit() or int(restarts) == 0:
        return request
    if checkpoint.latest(request.run_dir) is None:
        return request  # nothing to resume: the job starts the run again
    return replace(request, resume=True, variant=None)
