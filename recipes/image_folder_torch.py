"""A small CNN on a folder of images read from disk batch by batch: data larger than memory.

The folder holds DIR/train/CLASS/*.jpg and DIR/test/CLASS/*.jpg (one sub-folder per class, one image
size, any format Pillow reads), or its tar shards (`hvdtrain data pack DIR OUT`, then data_dir=OUT).
Each rank reads only its part (torch's DistributedSampler; of shards, a contiguous run of them)
through a DataLoader with worker processes; only file names (or the shards' index) stay in memory.
`python -m hvdtrain.data digits-jpeg DIR` writes a folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from hvdtrain import data
from hvdtrain.config import TrainConfig, bounded
from hvdtrain.registry import Recipe, debug_variant


@dataclass(kw_only=True)
class Config(TrainConfig):
    epochs: int = 8
    lr: float = 0.05
    channels: int = bounded(16, minimum=1)
    """Channels of the convolutions."""
    workers: int = bounded(2, minimum=0)
    """DataLoader worker processes per rank, reading and decoding images ahead of training."""


def build(config: Config):
    import torch
    from torch import nn

    from hvdtrain.runtime.torch import Datasets, TorchTask

    train, test = data.image_folders(config.data_dir)
    channels, c = train.shape()[0], config.channels
    model = nn.Sequential(
        nn.Conv2d(channels, c, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(c, c, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Linear(c * 16, len(train.classes)),
    )
    return TorchTask(
        model=model,
        data=Datasets(train, test, workers=config.workers),
        optimizer=partial(torch.optim.SGD, momentum=config.momentum),
    )


RECIPE = Recipe(
    name="image-folder-torch",
    framework="torch",
    dataset="image files in --set data_dir=DIR (DIR/train/CLASS/*.jpg, DIR/test/CLASS/*.jpg)",
    description="small CNN reading images from disk per batch (DataLoader workers); flat memory",
    config=Config,
    build=build,
    variants={"debug": debug_variant(epochs=3, channels=8)},
    preflight=lambda config: data.check_image_folders(config.data_dir),
)
