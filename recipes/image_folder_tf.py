"""A small Keras 3 CNN on a folder of images read by a tf.data pipeline: data larger than memory.

The same folder as image-folder-torch (DIR/train/CLASS/*.jpg, DIR/test/CLASS/*.jpg), in the formats
tf.io.decode_image reads (BMP, GIF, JPEG, PNG, WebP), or its tar shards (`hvdtrain data pack DIR
OUT`, then data_dir=OUT). Only file names (or places in the shards) and labels are in the dataset;
each rank shards them, shuffles its shard per epoch, and reads and decodes its files in parallel, a
few batches ahead of training.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from hvdtrain import data
from hvdtrain.config import TrainConfig, bounded
from hvdtrain.data.shards import read_named
from hvdtrain.registry import Recipe, debug_variant


@dataclass(kw_only=True)
class Config(TrainConfig):
    epochs: int = 8
    lr: float = 0.05
    channels: int = bounded(16, minimum=1)
    """Channels of the convolutions."""


def build(config: Config):
    import keras
    import tensorflow as tf

    from hvdtrain.runtime.tensorflow import KerasTask, TFDatasets

    train, test = data.image_folders(config.data_dir)
    channels, height, width = train.shape()

    def files(images: data.ImageFolder | data.TarShards):
        """(name, label) elements: a file's path, or a sample's place in its shard (SHARD@OFFSET:SIZE)."""
        if isinstance(images, data.TarShards):
            return tf.data.Dataset.from_tensor_slices((images.names(), images.labels))
        paths = [str(images.root / name) for name in images.files]
        return tf.data.Dataset.from_tensor_slices((paths, images.labels))

    sharded = isinstance(train, data.TarShards)

    def decode(name, label):
        if sharded:  # one positional read in the shard, in Python (tf.io reads whole files only)
            encoded = tf.numpy_function(read_named, [name], tf.string, stateful=False)
        else:
            encoded = tf.io.read_file(name)
        image = tf.io.decode_image(encoded, channels=channels, expand_animations=False)
        image = tf.ensure_shape(image, (height, width, channels))  # decode_image's shape is unknown
        return tf.cast(image, tf.float32) / 255.0, label

    c = config.channels
    model = keras.Sequential(
        [
            keras.Input((height, width, channels)),
            keras.layers.Conv2D(c, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Conv2D(c, 3, padding="same", activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(len(train.classes)),
        ]
    )
    return KerasTask(
        model=model,
        data=TFDatasets(files(train), files(test), len(train), decode=decode),
        optimizer=partial(keras.optimizers.SGD, momentum=config.momentum),
    )


RECIPE = Recipe(
    name="image-folder-tf",
    framework="tensorflow",
    dataset="image files in --set data_dir=DIR (DIR/train/CLASS/*.jpg, DIR/test/CLASS/*.jpg)",
    description="Keras 3 CNN fed by tf.data reading images from disk per batch; flat memory",
    config=Config,
    build=build,
    variants={"debug": debug_variant(epochs=3, channels=8)},
    preflight=lambda config: data.check_image_folders(
        config.data_dir, data.TF_IMAGE_SUFFIXES, "tf.io.decode_image"
    ),
)
