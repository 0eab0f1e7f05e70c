"""A recipe file for the synchronized-BatchNorm equivalence test: a small conv net with a BatchNorm
layer after each convolution, on the shipped 8x8 digits. No max-pooling: which element a max-pool
picks flips with the last digit of its inputs, and would hide the arithmetic under test."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from hvdtrain.config import TrainConfig
from hvdtrain.registry import Recipe


@dataclass(kw_only=True)
class Config(TrainConfig):
    epochs: int = 1
    steps_per_epoch: int = 10
    scale_lr: bool = False
    momentum: float = 0.0


def build(config: Config):
    import torch
    from torch import nn

    from hvdtrain import data
    from hvdtrain.runtime.torch import TorchTask

    split = data.digits(seed=config.seed)
    model = nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 16),
        nn.BatchNorm1d(16),
        nn.ReLU(),
        nn.Linear(16, split.num_classes),
    )
    return TorchTask(model=model, data=split, optimizer=partial(torch.optim.SGD, momentum=config.momentum))


RECIPE = Recipe(
    name="batchnorm-torch",
    framework="torch",
    dataset="handwritten digits (shipped with hvdtrain)",
    description="a conv net with BatchNorm, for the synchronized-BatchNorm test",
    config=Config,
    build=build,
)
