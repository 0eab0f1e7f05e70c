"""PyTorch DistributedDataParallel: torch.distributed.run starts the ranks, DDP averages gradients
(the backend: hvdtrain.runtime.torch.ddp).

Gloo on CPU, NCCL where GPUs are. One host: torchrun must run on every node of a multi-host job.
"""

from __future__ import annotations

import gc
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hvdtrain.config import TrainConfig
from hvdtrain.launch import LaunchCommand, LaunchSpec, RankOutput, hosts_of, is_local
from hvdtrain.strategies import LaunchContext, Strategy, StrategyLaunch, rank_threads


def launch(
    spec: LaunchSpec, options: Mapping[str, Any], context: LaunchContext, config: TrainConfig | None = None
) -> StrategyLaunch:
    if spec.hosts and not is_local(spec.hosts):
        raise ValueError(
            "the ddp strategy runs on this host only; use the horovod strategy for several hosts"
        )
    hosts_of(spec)
    python, *module_args = spec.program
    argv = [
        python,
        "-m",
        "torch.distributed.run",
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
    return StrategyLaunch(LaunchCommand(argv, env), TORCHRUN_FAILED_RANK)


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
    finally:
        # The DDP wrapper's reducer holds the process group; free it (it sits in reference cycles)
        # while the interpreter is fully alive, or Gloo's threads are torn down at interpreter exit
        # and the rank dies with SIGABRT ("terminate called without an active exception").
        gc.collect()
        backend.close()


STRATEGY = Strategy(
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
    output=RankOutput(tag=r"\[default(?P<rank>\d+)\]:", logs="*/attempt_*/*/{stream}.log"),
)
