"""Horovod allreduce (the default): horovodrun or mpirun starts the ranks, Horovod averages gradients."""

from __future__ import annotations

from pathlib import Path

from hvdtrain.launch import build_launch
from hvdtrain.strategies import Strategy


def train(recipe, config, run_dir: Path, resume: bool) -> dict:
    if recipe.framework == "torch":
        from hvdtrain.runtime import torch as runtime

        return runtime.run(recipe.build, config, runtime.HorovodTorch(), run_dir, recipe.name, resume)
    from hvdtrain.runtime import tensorflow as runtime

    return runtime.run(recipe.build, config, runtime.HorovodKeras(), run_dir, recipe.name, resume)


STRATEGY = Strategy(
    name="horovod",
    frameworks=("torch", "tensorflow"),
    description="batch-synchronous allreduce of gradients with Horovod (gloo or MPI)",
    launch=build_launch,
    train=train,
)
