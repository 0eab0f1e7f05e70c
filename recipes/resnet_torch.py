"""ResNet-18/34/50 with torchvision's architecture and parameter names (hvdtrain.models.resnet).

Its default is the shape of Horovod's own `pytorch_synthetic_benchmark.py` (ResNet-50, random
224x224 images, batch 32 per rank, SGD at 0.01 x world size), so samples/s compare with Horovod's
published numbers. `data=digits` trains on the 8x8 digits hvdtrain ships, enlarged to image_size and
repeated over three channels (the debug variant, which learns); `data=folder` reads image files (any
format Pillow reads) from --set data_dir=DIR (DIR/train/CLASS/*.jpg, DIR/test/CLASS/*.jpg) through
DataLoader workers.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Literal

import numpy as np

from hvdtrain import data
from hvdtrain.config import ImageNetBenchmarkConfig, bounded
from hvdtrain.registry import Recipe, debug_variant


@dataclass(kw_only=True)
class Config(ImageNetBenchmarkConfig):
    arch: Literal["resnet18", "resnet34", "resnet50"] = "resnet50"
    """torchvision's ResNet of that depth."""
    data: Literal["synthetic", "digits", "folder"] = "synthetic"
    """Random images (speed, not learning), the shipped digits, or image files (JPEG, PNG...) in data_dir."""
    width: int = bounded(64, minimum=1)
    """Channels of the stem and first stage; torchvision's ResNets have 64."""
    weight_decay: float = bounded(0.0, minimum=0)
    """SGD's L2 penalty (1e-4 is the usual ImageNet setting)."""
    workers: int = bounded(2, minimum=0)
    """data=folder: DataLoader worker processes per rank."""


@dataclass(frozen=True)
class ThreeChannels:
    """An image folder's grey images as the three channels a ResNet's stem takes (colour ones as they are)."""

    images: data.ImageFolder

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int):
        pixels, label = self.images[index]
        return np.repeat(pixels, 3 // pixels.shape[0], axis=0), label


def build(config: Config):
    import torch

    from hvdtrain.models.resnet import ResNet
    from hvdtrain.runtime.torch import Datasets, TorchTask, named

    evaluate = config.data != "synthetic"
    if config.data == "synthetic":
        side = config.image_size
        split = data.synthetic_images(
            config.num_samples, (3, side, side), config.num_classes, seed=config.seed
        )
        classes = config.num_classes
    elif config.data == "digits":
        split, classes = data.digits_images(config.seed, config.image_size), 10
    else:
        train, test = data.image_folders(config.data_dir)
        split = Datasets(ThreeChannels(train), ThreeChannels(test), workers=config.workers)
        classes = len(train.classes)
    return TorchTask(
        model=ResNet(config.arch, num_classes=classes, width=config.width),
        data=split,
        optimizer=partial(torch.optim.SGD, momentum=config.momentum, weight_decay=config.weight_decay),
        metrics=named("accuracy", "top5"),
        evaluate=evaluate,
    )


def preflight(config: Config) -> None:
    if config.data == "folder":
        data.check_image_folders(config.data_dir)


RECIPE = Recipe(
    name="resnet-torch",
    framework="torch",
    dataset="random 224x224 images (Horovod's benchmark), the shipped digits, or JPEG/PNG/... in data_dir",
    description="torchvision's ResNet-18/34/50, built in hvdtrain; Horovod's synthetic benchmark by default",
    config=Config,
    build=build,
    variants={
        "debug": debug_variant(
            arch="resnet18",
            data="digits",
            image_size=32,
            width=16,
            epochs=5,
            steps_per_epoch=0,
            lr=0.05,
            lr_schedule="cosine",
            momentum=0.9,
            checkpoint=True,
        )
    },
    preflight=preflight,
    metrics=("accuracy", "top5"),
)
