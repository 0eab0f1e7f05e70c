"""torch.nn.DataParallel: one process replicates the model over the visible GPUs and splits each
batch between them. Without GPUs it runs on the CPU as one device, and says so."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hvdtrain.config import TrainConfig
from hvdtrain.launching.spec import LaunchCommand, LaunchSpec
from hvdtrain.strategies import LaunchContext, Strategy, StrategyLaunch, rank_threads


def launch(
    spec: LaunchSpec, options: Mapping[str, Any], context: LaunchContext, config: TrainConfig | None = None
) -> StrategyLaunch:
    if len(spec.hosts) > 1:
        raise ValueError("the dp strategy is one process on one host")
    env = {
        **rank_threads(spec, context, processes_per_host=1),
        "HVDTRAIN_DP_DEVICES": str(spec.np),
        **spec.env,
    }
    return StrategyLaunch(LaunchCommand(list(spec.program), env))


def devices(np: int | None, gpus: int) -> int:
    """--np is the devices the one process splits each batch over: the visible GPUs, or on a machine
    without one the CPU alone; by default all of them. More than there are would train on fewer than
    asked, so it is refused."""
    usable = max(1, gpus)
    if np is None:
        return usable
    if np > usable:
        visible = f"{gpus} {'are' if gpus > 1 else 'is'}" if gpus else "none is"
        fewer = "1 (the CPU is one device)" if not gpus else f"{gpus} or less"
        raise ValueError(
            f"--np {np}: --strategy dp is one process over this host's GPUs, and {visible} visible; "
            f"give --np {fewer}, or a strategy that runs {np} processes (horovod, ddp)"
        )
    return np


def refuse(config: TrainConfig) -> str | None:
    """One process: there is no allreduce to compress or to sum with Adasum."""
    if config.reduce_op != "average":
        return f"reduce_op={config.reduce_op} needs --strategy horovod (DataParallel has no allreduce)"
    if config.fp16_allreduce:
        return "fp16_allreduce needs --strategy horovod or ddp (DataParallel has no allreduce)"
    if config.sync_batch_norm:
        return "sync_batch_norm needs --strategy horovod or ddp (DataParallel runs one process)"
    return None


def train(recipe, config, run_dir: Path, resume: bool) -> dict:
    import os

    from hvdtrain.runtime.torch import DataParallelTorch, run

    backend = DataParallelTorch(int(os.environ.get("HVDTRAIN_DP_DEVICES", "1")))
    return run(recipe.build, config, backend, run_dir, recipe.name, resume)


STRATEGY = Strategy(
    name="dp",
    frameworks=("torch",),
    description="single-process torch.nn.DataParallel over the visible GPUs (CPU: one device)",
    launch=launch,
    train=train,
    refuse=refuse,
    devices=devices,
    finalize=lambda framework: None,  # one process, nothing to end
)
