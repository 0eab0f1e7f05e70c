"""A Keras 3 conv net on random images with a custom tf.function loop: samples/s, Horovod-benchmark style."""

from __future__ import annotations

from functools import partial

from hvdtrain.config import SyntheticImagesConfig
from hvdtrain.registry import Recipe, debug_variant

Config = SyntheticImagesConfig


def build(config: Config):
    import keras

    from hvdtrain import data
    from hvdtrain.runtime.tensorflow import KerasTask

    w, side = config.width, config.image_size
    split = data.synthetic_images(config.num_samples, (3, side, side), 10, config.seed, channels_last=True)
    model = keras.Sequential(
        [
            keras.Input((side, side, 3)),
            keras.layers.Conv2D(w, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(2 * w, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    return KerasTask(
        model=model,
        data=split,
        optimizer=partial(keras.optimizers.SGD, momentum=config.momentum),
        loop="custom",
        evaluate=False,
    )


RECIPE = Recipe(
    name="synthetic-tf",
    framework="tensorflow",
    dataset="random 32x32x3 images, made in memory",
    description="Keras 3 conv net, custom tf.function loop with DistributedGradientTape; reports samples/s",
    config=Config,
    build=build,
    variants={"debug": debug_variant(epochs=1, steps_per_epoch=3, width=8, num_samples=256)},
    metrics=(),  # random labels: nothing to evaluate
)
