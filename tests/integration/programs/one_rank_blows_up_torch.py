"""A recipe file whose rank 1 alone blows up at one step (`at_step`): its outputs are multiplied
there by `by`. 1e6 (the default, under fp16): its scaled gradient is inf, the average of the ranks'
gradients is then inf on every rank, and every rank must skip that step and halve its loss scale
together. nan (under fp32): its loss is nan, and the run stops as diverged on every rank alike, or,
with nonfinite_patience, every rank skips that one step and goes on."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial
from typing import Literal

from hvdtrain.config import TrainConfig
from hvdtrain.registry import Recipe


@dataclass(kw_only=True)
class Config(TrainConfig):
    epochs: int = 1
    steps_per_epoch: int = 10
    precision: Literal["fp32", "bf16", "fp16"] = "fp16"
    at_step: int = 5
    """The step (of rank 1's forward passes in training) that blows up."""
    by: Literal["1e6", "nan"] = "1e6"
    """What rank 1's outputs are multiplied by there."""


def build(config: Config):
    import torch
    from torch import nn

    from hvdtrain import data
    from hvdtrain.runtime.torch import TorchTask

    class BlowsUpOnce(nn.Sequential):
        calls = 0

        def forward(self, inputs):
            outputs = super().forward(inputs)
            if self.training:
                self.calls += 1
                rank = os.environ.get("HOROVOD_RANK", os.environ.get("RANK"))  # Horovod's, torchrun's
                if self.calls == config.at_step and rank == "1":
                    return outputs * float(config.by)
            return outputs

    split = data.digits(seed=config.seed)
    model = BlowsUpOnce(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, split.num_classes))
    return TorchTask(model=model, data=split, optimizer=partial(torch.optim.SGD, momentum=config.momentum))


RECIPE = Recipe(
    name="one-rank-blows-up-torch",
    framework="torch",
    dataset="handwritten digits (shipped with hvdtrain)",
    description="an MLP whose rank 1 blows up at one step, for the loss-scale and divergence tests",
    config=Config,
    build=build,
)
