"""PyTorch DistributedDataParallel: torchrun (hvdtrain.launching.torchrun) starts the ranks, DDP
averages gradients (the backend: hvdtrain.runtime.torch.ddp).

Gloo on CPU, NCCL where GPUs are. On several hosts (--hosts, or a Slurm allocation's nodes) torchrun
runs once on each, with a static rendezvous on the first host.
"""

from __future__ import annotations

import gc
import re
import traceback
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from hvdtrain import launchers
from hvdtrain.config import TrainConfig
from hvdtrain.launching import slurm
from hvdtrain.launching.remote import rank_hosts
from hvdtrain.launching.spec import (
    LOOPBACK_NAMES,
    Host,
    LaunchCommand,
    LaunchSpec,
    RankOutput,
    host_argument,
    hosts_of,
    is_local,
    thread_env,
)
from hvdtrain.launching.torchrun import MODULE as TORCHRUN
from hvdtrain.measure import tuning
from hvdtrain.measure.estimate import Traffic
from hvdtrain.runtime.common import BUCKET_VARIABLE
from hvdtrain.strategies import LaunchContext, Strategy, StrategyLaunch, rank_threads

PREFIX_TEMPLATE = {"TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE": "[default${rank}]:"}
"""torchrun tags a worker's line with its global rank, not its rank on the host."""
ON_EACH_HOST = (
    "trap '' USR1; "  # torchrun dies of the preemption warning; its workers set their own handler
    'PET_NODE_RANK="$OMPI_COMM_WORLD_RANK"; '
    'if [ -z "$PET_NODE_RANK" ]; then PET_NODE_RANK=0; '
    'for node in ${HVDTRAIN_DDP_NODES//,/ }; do [ "$node" = "$SLURMD_NODENAME" ] && break; '
    "PET_NODE_RANK=$((PET_NODE_RANK + 1)); done; fi; "
    'export PET_NODE_RANK PET_LOG_DIR="$0/ranks.$((PET_NODE_RANK * PET_NPROC_PER_NODE))"; '
    'exec "$@"'
)
"""torchrun on one host of several: its node rank is its host's place in the hosts' order, the
first hosting the rendezvous (mpirun's task id, which follows -H; under srun, its node's place in
HVDTRAIN_DDP_NODES, since Slurm orders a step's nodes its own way); its workers' logs go to
LOG_DIR ($0)/ranks.FIRST/."""


# smaller buckets start their allreduce sooner in the backward; larger ones are fewer
TUNABLE = tuning.Tunable(
    "ddp",
    "DDP",
    tuning.DDP_DEFAULTS,
    (tuning.DDP_DEFAULTS, tuning.Buckets(5), tuning.Buckets(50), tuning.Buckets(100)),
    tuning.Buckets,
    (BUCKET_VARIABLE,),
    autotune=False,
)


def launch(
    spec: LaunchSpec, options: Mapping[str, Any], context: LaunchContext, config: TrainConfig | None = None
) -> StrategyLaunch:
    hosts = hosts_of(spec)
    python, *module_args = spec.program
    tuned, line = tuning.planned(TUNABLE, context.tuning, {*spec.env, *spec.forward_env})
    spec = replace(spec, env={**tuned, **spec.env})
    if not is_local(hosts):
        chosen = _across_hosts(spec, context, python, module_args)
        return replace(chosen, notes=(line,)) if line else chosen
    argv = [
        python,
        "-m",
        TORCHRUN,
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(spec.np),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(context.free_port),
    ]
    if spec.log_dir:  # per-rank files under LOG_DIR/<run id>/attempt_0/<rank>/, and the console
        argv += ["--log-dir", spec.log_dir, "--tee", "3"]
    argv += module_args
    env = {**rank_threads(spec, context, processes_per_host=spec.np), **spec.env}
    return StrategyLaunch(LaunchCommand(argv, env), TORCHRUN_FAILED_RANK, notes=(line,) if line else ())


def _across_hosts(
    spec: LaunchSpec, context: LaunchContext, python: str, module_args: list[str]
) -> StrategyLaunch:
    """torchrun once on each host, a static rendezvous on the first: started by srun inside a Slurm
    allocation, else by mpirun over ssh (one task a host; neither tags lines, torchrun does)."""
    placed = rank_hosts(hosts_of(spec), spec.np)
    nodes = list(dict.fromkeys(placed))
    per_host = {placed.count(node) for node in nodes}
    if len(per_host) > 1:
        raise ValueError(
            f"ddp across hosts runs the same number of ranks on each (torchrun's --nproc-per-node); "
            f"--np {spec.np} on {host_argument(spec)} would not"
        )
    per = per_host.pop()
    if any(node in LOOPBACK_NAMES for node in nodes):
        raise ValueError(
            "ddp across hosts: name this host by its name or address in --hosts, not "
            f"{next(node for node in nodes if node in LOOPBACK_NAMES)}: every host's torchrun dials the first"
        )
    torchrun = [
        python,
        "-m",
        TORCHRUN,
        "--nnodes",
        str(len(nodes)),
        "--nproc-per-node",
        str(per),
    ]
    torchrun += ["--master-addr", nodes[0], "--master-port", str(context.free_port), "--tee", "3"]
    threads = rank_threads(spec, context, processes_per_host=per)  # hosts alike: this one's cores
    if context.allocation is not None and context.threads_per_rank is None:  # the step's CPUs
        threads = thread_env(context.allocation.cpus_per_task or 1)
    env = {**threads, **PREFIX_TEMPLATE, "PET_NPROC_PER_NODE": str(per), **spec.env}
    env["HVDTRAIN_DDP_NODES"] = ",".join(nodes)
    if spec.network_interface:  # Gloo's and TCPStore's NIC (else the one the host name resolves to)
        env |= {"GLOO_SOCKET_IFNAME": spec.network_interface, "TP_SOCKET_IFNAME": spec.network_interface}
    program = ["bash", "-c", ON_EACH_HOST, spec.log_dir or ".", *torchrun, *module_args]
    steps = launchers.in_allocation() if context.allocation is not None else None
    if context.allocation is not None and steps is not None and steps.one_per_host:
        argv = steps.one_per_host(nodes, per * (context.allocation.cpus_per_task or 1))
        return StrategyLaunch(
            LaunchCommand(argv + program, env),
            TORCHRUN_FAILED_RANK,
            (slurm.TASK_FAILED,),
            passes_on_usr1=steps.passes_on_usr1,
        )
    if "mpirun" not in context.executables:
        raise ValueError(
            "ddp across hosts starts torchrun on each host with Open MPI's mpirun; install Open MPI"
        )
    one_each = replace(spec, np=len(nodes), hosts=tuple(Host(node, 1) for node in nodes), program=program)
    # torchrun's agents, not Horovod: neither hvdtrain's bind library (preloaded into torchrun, it left
    # the agents' rendezvous hanging) nor its Open MPI allreduce rules
    torchrun_context = replace(context, bind_library=None, allreduce_rules=None)
    command = launchers.get("mpi").build(replace(one_each, env=env, log_dir=None), torchrun_context, {})
    argv = [arg for arg in command.argv if arg != "--tag-output"]  # torchrun tags each worker's line
    return StrategyLaunch(replace(command, argv=argv), TORCHRUN_FAILED_RANK, launchers.get("mpi").job_failing)


def refuse(config: TrainConfig) -> str | None:
    if config.reduce_op != "average":
        return f"reduce_op={config.reduce_op} needs --strategy horovod (DDP averages)"
    return None


TORCHRUN_FAILED_RANK = (re.compile(r"^\s*rank\s*:\s*(\d+) \(local_rank"),)
"""torch.distributed.run's failure report (after its "Root Cause" line)."""


def train(recipe, config, run_dir: Path, resume: bool) -> dict:
    from hvdtrain.runtime import torch as runtime
    from hvdtrain.runtime.torch.ddp import TorchDDP

    backend = TorchDDP()
    try:
        return runtime.run(recipe.build, config, backend, run_dir, recipe.name, resume)
    except BaseException as error:
        # A stop (diverged, preempted) ends the loop as an exception whose frames hold the DDP
        # wrapper: let go of them, so that its reducer is freed below, before the process group.
        traceback.clear_frames(error.__traceback__)
        raise
    finally:
        # The DDP wrapper's reducer holds the process group; free it (it sits in reference cycles)
        # while the interpreter is fully alive, or Gloo's threads are torn down at interpreter exit
        # and the rank dies with SIGABRT ("terminate called without an active exception").
        gc.collect()
        backend.close()


STRATEGY = Strategy(
    traffic=Traffic(overlap="buckets"),
    spans_hosts=True,
    tunable=TUNABLE,
    name="ddp",
    frameworks=("torch",),
    description="PyTorch DistributedDataParallel over gloo (CPU) or NCCL (GPU), started by torchrun",
    launch=launch,
    train=train,
    refuse=refuse,
    # train has destroyed the process group; even so a Gloo rank now and then died in interpreter
    # teardown (SIGABRT, "terminate called without an active exception") after its summary was
    # written, and torchrun reported the finished run as failed
    finalize=lambda framework: None,
    # torchrun --tee tags a rank's line `[default0]:`; --log-dir keeps it in LOG_DIR/<run id>/attempt_0/N/
    # (on several hosts under LOG_DIR/ranks.FIRST/, N counted from the host's first rank)
    output=RankOutput(tag=r"\[default(?P<rank>\d+)\]:", logs="**/attempt_*/*/{stream}.log"),
)
