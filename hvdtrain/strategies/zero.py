"""ZeRO on Horovod (`--strategy zero`, torch): the ranks start as under the horovod strategy, with its
launchers and options, and each keeps the optimizer state (stage 1) and the averaged gradient
(stage 2 also frees the full gradients) of its own 1/N of the parameters (hvdtrain.runtime.torch.zero)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hvdtrain.config import TrainConfig
from hvdtrain.launching.spec import LaunchSpec
from hvdtrain.measure.estimate import Traffic
from hvdtrain.strategies import LaunchContext, Strategy, StrategyLaunch, horovod


def launch(
    spec: LaunchSpec, options: Mapping[str, Any], context: LaunchContext, config: TrainConfig | None = None
) -> StrategyLaunch:
    if horovod.asks_for_elastic(options):
        raise ValueError(
            "--strategy zero runs on a fixed number of ranks: elastic training would have to re-shard the "
            "optimizer state at every reset; use --strategy horovod for elastic runs"
        )
    return horovod.launch(spec, options, context, config)


def refuse(config: TrainConfig) -> str | None:
    if config.reduce_op != "average":
        return f"reduce_op={config.reduce_op} needs --strategy horovod (zero averages slices of the gradient)"
    if config.fp16_allreduce:
        return "fp16_allreduce compresses allreduces; --strategy zero reduce-scatters: use --strategy horovod"
    if config.async_checkpoint:
        return "async_checkpoint writes whole checkpoints; --strategy zero's are a shard per rank"
    return None


def train(recipe, config, run_dir: Path, resume: bool) -> dict:
    from hvdtrain.runtime import torch as runtime
    from hvdtrain.runtime.torch.zero import ZeroTorch

    return runtime.run(recipe.build, config, ZeroTorch(config.zero_stage), run_dir, recipe.name, resume)


STRATEGY = Strategy(
    # the averaged gradient after the backward, each rank's updated slice broadcast after the step
    traffic=Traffic(
        overlap="none",
        shards=frozenset({"optimizer"}),
        parameter_gathers=1,
        gradients_sharded_at_stage_2=True,
    ),
    checks_horovod_build=True,
    spans_hosts=True,
    name="zero",
    frameworks=("torch",),
    description="ZeRO on Horovod: optimizer state (zero_stage=1) and gradients (2) sharded across ranks",
    launch=launch,
    train=train,
    finalize=horovod.finalize,
    options=horovod.OPTIONS,
    refuse=refuse,
)
