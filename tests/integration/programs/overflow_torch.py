"""A recipe file whose rank 1 alone overflows at its fifth step: its outputs are multiplied by 1e6
there, so under fp16 its scaled gradient is inf. The average of the ranks' gradients is then inf on
every rank, and every rank must skip that step and halve its loss scale together."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial
from typing import Literal

from hvdtrain.config import TrainConfig
from hvdtrain.registry import Recipe

OVERFLOW_AT = 5


@dataclass(kw_only=True)
class Config(TrainConfig):
    epochs: int = 1
    steps_per_epoch: int = 10
    precision: Literal["fp32", "bf16", "fp16"] = "fp16"


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
                if self.calls == OVERFLOW_AT and rank == "1":
                    return outputs * 1e6
            return outputs

    split = data.digits(seed=config.seed)
    model = BlowsUpOnce(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, split.num_classes))
    return TorchTask(model=model, data=split, optimizer=partial(torch.optim.SGD, momentum=config.momentum))


RECIPE = Recipe(
    name="overflow-torch",
    framework="torch",
    dataset="handwritten digits (shipped with hvdtrain)",
    description="an MLP whose rank 1 overflows once under fp16, for the loss-scale test",
    config=Config,
    build=build,
)
