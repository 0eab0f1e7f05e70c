"""Horovod's classic synthetic benchmark shape: a conv net on random images for a fixed number of steps."""

from __future__ import annotations

from functools import partial

from hvdtrain.config import SyntheticImagesConfig
from hvdtrain.registry import Recipe, debug_variant

Config = SyntheticImagesConfig


def build(config: Config):
    import torch
    from torch import nn

    from hvdtrain import data
    from hvdtrain.runtime.torch import TorchTask

    w, side = config.width, config.image_size
    split = data.synthetic_images(config.num_samples, (3, side, side), num_classes=10, seed=config.seed)
    model = nn.Sequential(
        nn.Conv2d(3, w, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(w, 2 * w, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(2 * w * (side // 4) ** 2, 256),
        nn.ReLU(),
        nn.Linear(256, 10),
    )
    return TorchTask(
        model=model,
        data=split,
        optimizer=partial(torch.optim.SGD, momentum=config.momentum),
        evaluate=False,
    )


RECIPE = Recipe(
    name="synthetic-torch",
    framework="torch",
    dataset="random 3x32x32 images, made in memory",
    description="conv net on random images for fixed steps; reports samples/s",
    config=Config,
    build=build,
    variants={"debug": debug_variant(epochs=1, steps_per_epoch=3, width=8, num_samples=256)},
    metrics=(),  # random labels: nothing to evaluate
)
