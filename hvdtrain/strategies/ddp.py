"""PyTorch DistributedDataParallel: torch.distributed.run starts the ranks, DDP averages gradients.

Gloo on CPU, NCCL where GPUs are. One host: torchrun must run on every node of a multi-host job.
"""

from __future__ import annotations

import gc
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hvdtrain.config import TrainConfig
from hvdtrain.launch import LaunchCommand, LaunchSpec, hosts_of, is_local
from hvdtrain.strategies import LaunchContext, Strategy, StrategyLaunch, rank_threads


def launch(spec: LaunchSpec, options: Mapping[str, Any], context: LaunchContext) -> StrategyLaunch:
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


class TorchDDP:
    name = "ddp"

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist

        from hvdtrain.runtime.torch import set_threads

        self.torch, self.dist = torch, dist
        if torch.cuda.is_available():  # one GPU per process, chosen by torchrun's LOCAL_RANK
            local_rank = int(os.environ.get("LOCAL_RANK", 0))
            torch.cuda.set_device(local_rank)
            self.device = torch.device("cuda", local_rank)
        else:
            self.device = torch.device("cpu")
        dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo")
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        set_threads()

    def wrap(self, model, optimizer, config):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [self.device.index] if self.device.type == "cuda" else None
        wrapped = DistributedDataParallel(model, device_ids=device_ids)
        if config.fp16_allreduce:
            wrapped.register_comm_hook(self.dist.group.WORLD, default_hooks.fp16_compress_hook)
        return wrapped, optimizer

    def broadcast_state(self, model, optimizer, extra):
        module = getattr(model, "module", model)
        for tensor in module.state_dict().values():
            self.dist.broadcast(tensor, src=0)
        payload = [optimizer.state_dict(), extra] if self.rank == 0 else [None, None]
        self.dist.broadcast_object_list(payload, src=0)
        if self.rank != 0:
            optimizer.load_state_dict(payload[0])
        return payload[1]

    def sum(self, values, name):
        tensor = self.torch.tensor(values, dtype=self.torch.float64, device=self.device)
        self.dist.all_reduce(tensor)
        return tensor.tolist()

    def allgather_object(self, value):
        gathered = [None] * self.size
        self.dist.all_gather_object(gathered, value)
        return gathered


def train(recipe, config, run_dir: Path, resume: bool) -> dict:
    from hvdtrain.runtime import torch as runtime

    backend = TorchDDP()
    try:
        return runtime.run(recipe.build, config, backend, run_dir, recipe.name, resume)
    finally:
        # The DDP wrapper's reducer holds the process group; free it (it sits in reference cycles)
        # while the interpreter is fully alive, or Gloo's threads are torn down at interpreter exit
        # and the rank dies with SIGABRT ("terminate called without an active exception").
        gc.collect()
        backend.dist.destroy_process_group()


STRATEGY = Strategy(
    name="ddp",
    frameworks=("torch",),
    description="PyTorch DistributedDataParallel over gloo (CPU) or NCCL (GPU), started by torchrun",
    launch=launch,
    train=train,
    refuse=refuse,
)
