"""srun: Slurm starts every rank as a task of one job step, inside the allocation the run is in;
Horovod's MPI controller initialises from PMIx (`--mpi=pmix`), so no ssh and no mpirun are needed.

Each rank's lines are tagged as horovodrun tags them (`[N]<stdout>:`; srun's own `--label`, a bare
`N: `, cannot be told from a rank's text), and each rank keeps its own output in LOG_DIR/rank.N/
on its node: collected into the run directory after the job where the nodes share no disk, like
every launcher's logs.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Mapping
from typing import Any

from hvdtrain.launchers import LaunchContext, Launcher
from hvdtrain.launchers.gloo import HOROVODRUN_OUTPUT
from hvdtrain.launching import slurm
from hvdtrain.launching.remote import SlurmStep, rank_hosts
from hvdtrain.launching.spec import LaunchCommand, LaunchSpec, host_argument, hosts_of, is_local


def rank_output(keep: bool) -> str:
    """What runs a rank's program ($@) with its stdout and stderr tagged and, with `keep`, kept in
    LOG_DIR/rank.N/ on its node (LOG_DIR is $0). srun and Slurm signal every process of the step
    (SIGUSR1 passed on; SIGTERM on scancel), which would end tee and sed while the rank still writes:
    they ignore both, and the rank sets its own handlers."""

    def stream(name: str) -> str:
        kept = f'tee "$0/rank.$SLURM_PROCID/{name}" | ' if keep else ""
        return f'>({kept}exec sed -u "s/^/[$SLURM_PROCID]<{name}>:/"'

    made = 'mkdir -p "$0/rank.$SLURM_PROCID" && ' if keep else ""
    return f"trap '' USR1 TERM; {made}exec > {stream('stdout')}) 2> {stream('stderr')} >&2) && exec \"$@\""


KILL_WAIT_S = 10
"""How long srun lets the other tasks end after one fails (--kill-on-bad-exit), before SIGKILL."""


def build(spec: LaunchSpec, context: LaunchContext, options: Mapping[str, Any]) -> LaunchCommand:
    placed = rank_hosts(hosts_of(spec), spec.np)
    nodes = list(dict.fromkeys(placed))
    argv = ["srun", "--mpi=pmix", f"--ntasks={spec.np}", f"--nodes={len(nodes)}"]
    if not is_local(hosts_of(spec)):  # else: this node alone, where Slurm places them itself
        per_node = {placed.count(node) for node in nodes}
        if len(per_node) > 1:
            raise ValueError(
                f"--launcher srun places the same number of ranks on each node; --np {spec.np} on "
                f"{host_argument(spec)} would not (give --np as a multiple of the nodes' tasks, or --hosts)"
            )
        argv += [f"--nodelist={','.join(nodes)}", f"--ntasks-per-node={per_node.pop()}"]
    if context.cpus_per_task:
        argv.append(f"--cpus-per-task={context.cpus_per_task}")
    argv += ["--kill-on-bad-exit=1", f"--wait={KILL_WAIT_S}"]
    program = ["bash", "-c", rank_output(bool(spec.log_dir)), spec.log_dir or "hvdtrain-rank", *spec.program]
    return LaunchCommand(argv + program, spec.env)


def probe() -> frozenset[str]:
    """Inside an allocation, the MPI plugins srun offers (`srun --mpi=list`); elsewhere none."""
    if not os.environ.get("SLURM_JOB_ID"):
        return frozenset()
    try:
        listed = subprocess.run(["srun", "--mpi=list"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return frozenset()
    return slurm.mpi_plugins(listed.stdout + listed.stderr)


def preferred(allocation: slurm.Allocation | None, plugins: frozenset[str]) -> str | None:
    if allocation is not None and "pmix" in plugins:
        return f"inside Slurm job {allocation.job_id}"
    return None


def refuse_here(allocation: slurm.Allocation | None, plugins: frozenset[str]) -> str | None:
    if allocation is None:
        return "--launcher srun runs inside a Slurm allocation (salloc, sbatch); SLURM_JOB_ID is not set"
    if "pmix" not in plugins:
        listed = ", ".join(sorted(plugins)) or "none"
        return (
            f"--launcher srun needs Slurm's pmix MPI plugin (Horovod's MPI controller); srun --mpi=list "
            f"has {listed}; use --launcher mpi or gloo"
        )
    return None


def one_per_host(nodes: list[str], cpus: int) -> list[str]:
    argv = ["srun", f"--nodes={len(nodes)}", f"--ntasks={len(nodes)}", "--ntasks-per-node=1"]
    return argv + [
        f"--nodelist={','.join(nodes)}",
        f"--cpus-per-task={cpus}",
        "--kill-on-bad-exit=1",
        "--wait=10",
    ]


LAUNCHER = Launcher(
    name="srun",
    description="Slurm's srun inside an allocation (salloc, sbatch), Horovod's MPI controller over PMIx",
    build=build,
    output=HOROVODRUN_OUTPUT,
    failed_rank_patterns=(
        re.compile(r"srun: error: \S+: tasks? (\d+)(?:[-,]\d+)*: Exited with exit code (?P<code>\d+)"),
        re.compile(r"srun: error: \S+: tasks? (\d+)(?:[-,]\d+)*: (?:Killed|Segmentation fault|Aborted)"),
    ),
    job_failing=(re.compile(r"srun: Job step aborted"),),
    local_env=("SLURM_LOCALID", "SLURM_STEP_TASKS_PER_NODE"),
    local_size=slurm.local_size,
    executable="srun",
    passes_on_usr1=True,
    missing="--launcher srun needs Slurm's srun on PATH",
    auto=False,  # chosen by --launcher auto inside an allocation, not by measured speed
    preferred=preferred,
    refuse_here=refuse_here,
    probe=probe,
    one_per_host=one_per_host,
    transport=lambda: SlurmStep("srun"),
)
