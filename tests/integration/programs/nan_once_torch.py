"""A recipe file whose rank 1 alone gets a nan loss at its NAN_AT-th step: its outputs are multiplied
by nan there. The average of the ranks' gradients is then nan on every rank: a run stops as diverged
on every rank alike, or, with nonfinite_patience, skips that one step on every rank and goes on."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial

from hvdtrain.config import TrainConfig
from hvdtrain.registry import Recipe

NAN_AT = 13


@dataclass(kw_only=True)
class Config(TrainConfig):
    epochs: int = 2
    steps_per_epoch: int = 10


def build(config: Config):
    import torch
    from torch import nn

    from hvdtrain import data
    from hvdtrain.runtime.torch import TorchTask

    class NanOnce(nn.Sequential):
        calls = 0

        def forward(self, inputs):
            outputs = super().forward(inputs)
            if self.training:
                self.calls += 1
                rank = os.environ.get("HOROVOD_RANK", os.environ.get("RANK"))  # Horovod's, torchrun's
                if self.calls == NAN_AT and rank == "1":
                    return outputs * float("nan")
            return outputs

    split = data.digits(seed=config.seed)
    model = NanOnce(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, split.num_classes))
    return TorchTask(model=model, data=split, optimizer=partial(torch.optim.SGD, momentum=config.momentum))


RECIPE = Recipe(
    name="nan-once-torch",
    framework="torch",
    dataset="handwritten digits",
    description="rank 1's loss is nan at one step",
    config=Config,
    build=build,
)
