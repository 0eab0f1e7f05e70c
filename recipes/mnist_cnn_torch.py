"""A small CNN on MNIST read from IDX files in --set data_dir=DIR (nothing is downloaded)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from hvdtrain import data
from hvdtrain.config import TrainConfig, bounded
from hvdtrain.registry import Recipe, debug_variant


@dataclass(kw_only=True)
class Config(TrainConfig):
    epochs: int = 3
    lr: float = 0.01
    channels: int = bounded(16, minimum=1)
    """Channels of the first convolution; the second has twice as many."""


def build(config: Config):
    import torch
    from torch import nn

    from hvdtrain.runtime.torch import TorchTask

    split = data.mnist(config.data_dir)
    side = split.x_train.shape[-1]
    c = config.channels
    model = nn.Sequential(
        nn.Conv2d(1, c, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(c, 2 * c, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(2 * c * (side // 4) ** 2, split.num_classes),
    )
    return TorchTask(
        model=model,
        data=split,
        optimizer=partial(torch.optim.SGD, momentum=config.momentum),
    )


RECIPE = Recipe(
    name="mnist-cnn-torch",
    framework="torch",
    dataset="MNIST IDX files from --set data_dir=DIR",
    description="two-conv CNN on MNIST; needs the four IDX files, downloads nothing",
    config=Config,
    build=build,
    variants={"debug": debug_variant(epochs=2, channels=4)},
    preflight=lambda config: data.mnist(config.data_dir),  # every file read and checked before ranks start
)
