"""Keras's own ResNet-50 (`keras.applications.ResNet50(weights=None)`) under Horovod, on the data of
resnet-torch: random 224x224 images in the shape of Horovod's synthetic benchmark (batch 32 per rank,
SGD at 0.01 x world size), or the digits hvdtrain ships enlarged to image_size (the debug variant)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Literal

from hvdtrain import data
from hvdtrain.config import ImageNetBenchmarkConfig
from hvdtrain.registry import Recipe, debug_variant


@dataclass(kw_only=True)
class Config(ImageNetBenchmarkConfig):
    data: Literal["synthetic", "digits"] = "synthetic"
    """Random images (speed, not learning) or the shipped digits."""


def build(config: Config):
    import keras

    from hvdtrain.runtime.tensorflow import KerasTask, named

    side = config.image_size
    if config.data == "synthetic":
        split = data.synthetic_images(
            config.num_samples, (3, side, side), config.num_classes, config.seed, channels_last=True
        )
        classes = config.num_classes
    else:
        split, classes = data.digits_images(config.seed, side, channels_last=True), 10
    model = keras.applications.ResNet50(
        weights=None, input_shape=(side, side, 3), classes=classes, classifier_activation=None
    )
    return KerasTask(
        model=model,
        data=split,
        optimizer=partial(keras.optimizers.SGD, momentum=config.momentum),
        loop="custom",
        metrics=named("accuracy", "top5"),
        evaluate=config.data != "synthetic",
    )


RECIPE = Recipe(
    name="resnet-tf",
    framework="tensorflow",
    dataset="random 224x224 images (Horovod's benchmark) or the shipped digits",
    description="keras.applications.ResNet50(weights=None); Horovod's synthetic benchmark by default",
    config=Config,
    build=build,
    variants={
        "debug": debug_variant(
            data="digits", image_size=32, epochs=1, steps_per_epoch=4, lr=0.01, momentum=0.9, checkpoint=True
        )
    },
    metrics=("accuracy", "top5"),
)
