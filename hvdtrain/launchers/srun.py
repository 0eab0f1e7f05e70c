"""srun: Slurm starts every rank as a task of one job step, inside the allocation the run is in;
Horovod's MPI controller initialises from PMIx (`--mpi=pmix`), so no ssh and no mpirun are needed.

Slurm tags each line of a task with its task id (`--label`). Each rank also keeps its own output in
LOG_DIR/rank.N/ on its node, through tee: collected into the run directory after the job where the
nodes share no disk, like every launcher's logs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from hvdtrain import slurm
from hvdtrain.hosts import rank_hosts
from hvdtrain.launch import LaunchCommand, LaunchSpec, RankOutput, hosts_of, is_local
from hvdtrain.launchers import Launcher, LauncherContext

TEE = (
    "trap '' USR1; "  # tee must outlive the preemption warning; the rank installs its own handler
    'mkdir -p "$0/rank.$SLURM_PROCID" && '
    'exec > >(exec tee "$0/rank.$SLURM_PROCID/stdout") 2> >(exec tee "$0/rank.$SLURM_PROCID/stderr" >&2) && '
    'exec "$@"'
)
"""A rank's program, its stdout and stderr also written into LOG_DIR/rank.N/ on its node. srun
passes SIGUSR1 to every process of the step, tee included, which it would end."""
KILL_WAIT_S = 10
"""How long srun lets the other tasks end after one fails (--kill-on-bad-exit), before SIGKILL."""


def build(spec: LaunchSpec, context: LauncherContext, options: Mapping[str, Any]) -> LaunchCommand:
    placed = rank_hosts(hosts_of(spec), spec.np)
    nodes = list(dict.fromkeys(placed))
    argv = ["srun", "--mpi=pmix", f"--ntasks={spec.np}", f"--nodes={len(nodes)}"]
    if not is_local(hosts_of(spec)):  # else: this node alone, where Slurm places them itself
        argv += [f"--nodelist={','.join(nodes)}", "--distribution=block"]
    argv += ["--kill-on-bad-exit=1", f"--wait={KILL_WAIT_S}", "--label"]
    program = list(spec.program)
    if spec.log_dir:
        program = ["bash", "-c", TEE, spec.log_dir, *program]
    return LaunchCommand(argv + program, spec.env)


LAUNCHER = Launcher(
    name="srun",
    description="Slurm's srun inside an allocation (salloc, sbatch), Horovod's MPI controller over PMIx",
    build=build,
    # --label: `0: ` (padded to the widest task id); tee: LOG_DIR/rank.N/{stdout,stderr}
    output=RankOutput(tag=r" *(?P<rank>\d+): ", logs="rank.*/{stream}"),
    failed_rank_patterns=(
        re.compile(r"srun: error: \S+: tasks? (\d+)(?:[-,]\d+)*: Exited with exit code (?P<code>\d+)"),
        re.compile(
            r"srun: error: \S+: tasks? (\d+)(?:[-,]\d+)*: (?:Killed|Terminated|Segmentation fault|Aborted)"
        ),
    ),
    job_failing=(re.compile(r"srun: Job step aborted"),),
    local_env=("SLURM_LOCALID", "SLURM_STEP_TASKS_PER_NODE"),
    local_size=slurm.local_size,
    executable="srun",
    passes_on_usr1=True,
    missing="--launcher srun needs Slurm's srun on PATH",
    auto=False,  # chosen by --launcher auto inside an allocation, not by measured speed
)
