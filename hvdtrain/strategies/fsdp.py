"""PyTorch FSDP2 (`fully_shard`, torch): started as ddp is (torchrun, one host or several, inside
Slurm allocations), each rank keeping 1/N of the parameters, gradients and optimizer state (the
backend: hvdtrain.runtime.torch.fsdp)."""

from __future__ import annotations

import gc
from pathlib import Path

from hvdtrain.config import TrainConfig
from hvdtrain.measure.estimate import Traffic
from hvdtrain.strategies import Strategy, ddp


def refuse(config: TrainConfig) -> str | None:
    if config.reduce_op != "average":
        return f"reduce_op={config.reduce_op} needs --strategy horovod (FSDP averages)"
    if config.fp16_allreduce:
        return "fp16_allreduce compresses Horovod's allreduces; FSDP reduce-scatters: use --strategy horovod"
    return None


def train(recipe, config, run_dir: Path, resume: bool) -> dict:
    from hvdtrain.runtime import torch as runtime
    from hvdtrain.runtime.torch.fsdp import TorchFSDP

    backend = TorchFSDP()
    try:
        return runtime.run(recipe.build, config, backend, run_dir, recipe.name, resume)
    finally:
        gc.collect()  # as under ddp: the process group goes while the interpreter is fully alive
        backend.close()


STRATEGY = Strategy(
    # parameters gathered block by block in the forward and again in the backward
    traffic=Traffic(
        overlap="blocks",
        shards=frozenset({"parameters", "gradients", "optimizer"}),
        gradient="reduce_scatter",
        parameter_gathers=2,
    ),
    spans_hosts=True,
    name="fsdp",
    frameworks=("torch",),
    description="PyTorch FSDP2 (fully_shard): parameters, gradients and optimizer state sharded; torchrun",
    launch=ddp.launch,
    train=train,
    refuse=refuse,
    finalize=ddp.STRATEGY.finalize,
    output=ddp.STRATEGY.output,
)
