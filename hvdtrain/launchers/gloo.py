"""horovodrun --gloo: Horovod's own launcher and its Gloo controller (needed for elastic training)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from hvdtrain.config import TrainConfig
from hvdtrain.launchers import LaunchContext, Launcher
from hvdtrain.launching.spec import LaunchCommand, LaunchSpec, RankOutput, host_argument, interface_for

HOROVODRUN_OUTPUT = RankOutput(tag=r"\[(?P<rank>\d+)\]<std(?P<stream>out|err)>:", logs="rank.*/{stream}")
"""horovodrun tags a rank's line `[0]<stdout>:` and keeps it in LOG_DIR/rank.N/ (N zero-padded)."""
HOROVODRUN_FAILED_RANK = re.compile(r"Process (\d+) exit with status code (?P<code>-?\d+)")
HOROVODRUN_FAILING = re.compile(r"Terminating remaining workers after failure")


def horovodrun_tail(spec: LaunchSpec, interface: str | None) -> list[str]:
    """What every horovodrun command ends with, static or elastic: the NIC, ssh, the rank logs and
    the program."""
    argv = ["--network-interface", interface] if interface else []
    if spec.ssh_port is not None:
        argv += ["--ssh-port", str(spec.ssh_port)]
    if spec.ssh_identity_file is not None:
        argv += ["--ssh-identity-file", spec.ssh_identity_file]
    if spec.log_dir:
        argv += ["--output-filename", spec.log_dir]
    return argv + list(spec.program)


def build(spec: LaunchSpec, context: LaunchContext, options: Mapping[str, Any]) -> LaunchCommand:
    argv = [context.horovodrun, "-np", str(spec.np), "-H", host_argument(spec), "--gloo"]
    return LaunchCommand(argv + horovodrun_tail(spec, interface_for(spec)), spec.env)


def refuse(config: TrainConfig) -> str | None:
    if config.reduce_op == "adasum":  # measured: "No Adasum operation enabled" under the Gloo controller
        return "reduce_op=adasum needs --launcher mpi (Horovod's Adasum on CPU runs over MPI)"
    return None


LAUNCHER = Launcher(
    name="gloo",
    description="horovodrun with Gloo",
    build=build,
    output=HOROVODRUN_OUTPUT,
    failed_rank_patterns=(HOROVODRUN_FAILED_RANK,),
    job_failing=(HOROVODRUN_FAILING,),
    refuse=refuse,
)
