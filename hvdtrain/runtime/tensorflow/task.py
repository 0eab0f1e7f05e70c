"""What a TensorFlow recipe gives the runtime: a Keras model, its data, how to make its optimizer,
its metrics and which loop trains it."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import keras
import numpy as np
import tensorflow as tf

from hvdtrain.config import TrainConfig
from hvdtrain.data import Split

Metric = Callable[[np.ndarray, np.ndarray], float]
"""(outputs, targets) of one test batch, as arrays -> the metric summed over its samples; the
runtime sums it over batches and ranks and divides by the number of samples."""


def correct(outputs: np.ndarray, targets: np.ndarray) -> float:
    """Top-1 hits: the mean over the test set is the accuracy."""
    return float((np.asarray(outputs).argmax(axis=1) == np.asarray(targets)).sum())


def top5(outputs: np.ndarray, targets: np.ndarray) -> float:
    """Samples whose target is among the five highest outputs."""
    outputs = np.asarray(outputs)
    best = np.argsort(-outputs, axis=1, kind="stable")[:, :5]
    return float((best == np.asarray(targets)[:, None]).any(axis=1).sum())


def cross_entropy_sum(outputs: np.ndarray, targets: np.ndarray) -> float:
    """Each sample's cross-entropy of its logits, summed: the mean over the test set is the test loss."""
    logits = np.asarray(outputs, dtype=np.float64)
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return float(-log_probs[np.arange(len(logits)), np.asarray(targets).astype(int)].sum())


METRICS: dict[str, Metric] = {
    "accuracy": correct,
    "top5": top5,
    "loss": cross_entropy_sum,
    "perplexity": cross_entropy_sum,
}
"""The metrics hvdtrain knows (hvdtrain.runtime.metrics.GOALS), for classifiers with logits."""


def named(*names: str) -> dict[str, Metric]:
    return {name: METRICS[name] for name in names}


@dataclass
class TFDatasets:
    """Data read from disk as training goes, instead of arrays in memory: tf.data datasets of
    unbatched (input, target) elements, cheap ones (e.g. file names) when `decode` is given. Each
    rank takes its shard (`Dataset.shard` by rank), shuffles it per epoch with a seed shared by all
    ranks, decodes and batches in parallel, and prefetches."""

    train: tf.data.Dataset
    test: tf.data.Dataset
    train_size: int
    """Elements in `train` (a file reader's cardinality is often unknown to tf.data)."""
    decode: Callable[[Any, Any], tuple[Any, Any]] | None = None
    """(element) -> (input, target), mapped after sharding and shuffling: files are read only by
    the rank that trains on them."""
    shuffle_buffer: int = 4096
    """Elements held for shuffling when there is no `decode` (the elements are the data itself)."""

    def rank_train(
        self, rank: int, size: int, epoch: int, seed: int, batch_size: int, batches: int, skip: int = 0
    ):
        """One epoch of this rank's batches, less the first `skip` (taken before a step checkpoint):
        the elements shuffled with a seed every rank shares (all of them when they are only names to
        decode, else through shuffle_buffer), every size-th from rank, decoded, batched; repeated so
        a train_size too large cannot leave a rank short of batches while the others wait for it in
        an allreduce. Skipped elements are passed over before they are decoded."""
        buffer = self.train_size if self.decode is not None else min(self.train_size, self.shuffle_buffer)
        order = self.train.shuffle(max(1, buffer), seed=seed * 1_009 + epoch, reshuffle_each_iteration=False)
        shard = self._decoded(order.shard(size, rank).repeat().skip(skip * batch_size))
        batched = shard.batch(batch_size, drop_remainder=True).take(batches - skip)
        return batched.prefetch(tf.data.AUTOTUNE)

    def rank_test(self, rank: int, size: int):
        return self._decoded(self.test.shard(size, rank)).batch(256).prefetch(tf.data.AUTOTUNE)

    def undecodable(self) -> str | None:
        """The first element (its first part: a file name) that `decode` fails on, and why, found by
        decoding each one eagerly: only once a run failed to decode one, whose error names no file."""
        if self.decode is None:
            return None
        for element in self.train.concatenate(self.test):
            try:
                self.decode(*element)
            except (
                tf.errors.InvalidArgumentError,
                tf.errors.DataLossError,
                tf.errors.NotFoundError,
            ) as error:
                first = np.asarray(element[0]).item()
                name = first.decode(errors="replace") if isinstance(first, bytes) else str(first)
                # TensorFlow's op and device names, and its empty "name:", around the reason
                reason = re.sub(r"\{\{[^}]*\}\}|\[Op:[^]]*\]|\s*name:\s*$", "", error.message).strip()
                return f"{name} cannot be decoded: {reason}"
        return None

    def _decoded(self, dataset):
        return (
            dataset if self.decode is None else dataset.map(self.decode, num_parallel_calls=tf.data.AUTOTUNE)
        )


@dataclass
class KerasTask:
    """What a TensorFlow recipe builds: framework code only, no distribution."""

    model: keras.Model
    data: Split | TFDatasets
    """Arrays in memory, or tf.data datasets read from disk batch by batch."""
    optimizer: Callable[..., keras.optimizers.Optimizer]
    """An optimizer class or factory, called with `learning_rate=` the scheduled lr, e.g.
    `functools.partial(keras.optimizers.SGD, momentum=0.9)`; the backend builds and wraps it."""
    loss: keras.losses.Loss = field(
        default_factory=lambda: keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    loop: Literal["fit", "custom"] = "fit"
    """`fit`: Keras' model.fit with Horovod's callbacks; `custom`: a tf.function step with a tape."""
    metrics: Mapping[str, Metric] = field(default_factory=lambda: {"accuracy": correct})
    """Evaluation metrics by name, reported as test_<name>."""
    evaluate: bool = True


def make_optimizer(task: KerasTask, lr: float, config: TrainConfig) -> keras.optimizers.Optimizer:
    """The task's optimizer at `lr`. With accumulation, Keras 3's own: gradients are averaged across
    ranks every batch and applied every N batches (Horovod's backward_passes_per_step relies on
    Keras 2 hooks). With clip_grad_norm, Keras's global_clipnorm, which clips the accumulated average."""
    passes = config.backward_passes_per_step
    options = {"gradient_accumulation_steps": passes} if passes > 1 else {}
    if config.clip_grad_norm is not None:  # Keras clips inside apply(), after Horovod's allreduce there
        options["global_clipnorm"] = config.clip_grad_norm
    optimizer = task.optimizer(learning_rate=lr, **options)
    if config.precision == "fp16":
        # Inside Horovod's DistributedOptimizer, which allreduces the scaled gradients before this
        # one checks them: every rank agrees on skipping a step and on the next scale. Wrapped the
        # other way round (what compile does by itself), each rank would check its own.
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    elif config.stop_on_nonfinite and config.nonfinite_patience:
        # Keras's one way to skip a step whose gradient is not finite: a loss scale that starts at
        # 1 and never grows. It halves at each skip, and scaling by a power of two is exact.
        optimizer = keras.optimizers.LossScaleOptimizer(
            optimizer, initial_scale=1.0, dynamic_growth_steps=2**31 - 1
        )
    return optimizer


def loss_scale(optimizer: keras.optimizers.Optimizer) -> Callable[[], float] | None:
    """What reads the optimizer's loss scale (built), where it has one: it falls at each skipped step."""
    scale = getattr(optimizer, "dynamic_scale", None)
    return None if scale is None else lambda: float(np.asarray(scale))
