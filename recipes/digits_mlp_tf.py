"""A Keras 3 MLP on the 8x8 handwritten digits hvdtrain ships, trained with model.fit under Horovod."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from hvdtrain.config import TrainConfig, bounded
from hvdtrain.registry import Recipe, debug_variant


@dataclass(kw_only=True)
class Config(TrainConfig):
    epochs: int = 15
    hidden: int = bounded(128, minimum=1)
    """Width of the hidden layer."""


def build(config: Config):
    import keras

    from hvdtrain import data
    from hvdtrain.runtime.tensorflow import KerasTask

    split = data.digits(seed=config.seed)
    model = keras.Sequential(
        [
            keras.Input((split.x_train.shape[1],)),
            keras.layers.Dense(config.hidden, activation="relu"),
            keras.layers.Dense(split.num_classes),
        ]
    )
    return KerasTask(
        model=model,
        data=split,
        optimizer=partial(keras.optimizers.SGD, momentum=config.momentum),
    )


RECIPE = Recipe(
    name="digits-mlp-tf",
    framework="tensorflow",
    dataset="handwritten digits (1797 8x8 images, shipped with hvdtrain)",
    description="Keras 3 two-layer MLP with model.fit; >= 0.95 test accuracy in seconds on CPU",
    config=Config,
    build=build,
    variants={"debug": debug_variant(epochs=8)},
)
