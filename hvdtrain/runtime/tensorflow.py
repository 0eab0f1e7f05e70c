"""The data-parallel training loop for TensorFlow / Keras 3, and the Horovod steps, written once.

Horovod's own Keras layer (`horovod.tensorflow.keras`) fails on Keras 3 as released; the project's
build patches it (containers/horovod/patches/0004, 0005), so this runtime uses Horovod's
DistributedOptimizer, DistributedGradientTape and callbacks unchanged, as user scripts do.
Two loops: `model.fit` and a custom `tf.function` step, both on the one schedule
(hvdtrain.runtime.schedule). What differs between ways of parallelising is a `KerasBackend`.
"""

from __future__ import annotations

import json
import os
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import keras
import numpy as np
import tensorflow as tf

from hvdtrain.config import TrainConfig
from hvdtrain.data import Split, shard_indices
from hvdtrain.runtime.common import (
    CHECKPOINT_FILES,
    RunLog,
    Throughput,
    commit_file,
    digest,
    rank_final,
    tmp_path_for,
)
from hvdtrain.runtime.schedule import Schedule

(CHECKPOINT,) = CHECKPOINT_FILES["tensorflow"]
STATE_MEMBER = "hvdtrain_state.json"
"""(epoch, step) inside the .keras archive itself, so weights, optimizer state and position are one
file, replaced in one rename; Keras ignores the extra member when it loads the model."""


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

    def rank_train(self, rank: int, size: int, epoch: int, seed: int, batch_size: int, batches: int):
        """One epoch of this rank's batches: the elements shuffled with a seed every rank shares (all
        of them when they are only names to decode, else through shuffle_buffer), every size-th from
        rank, decoded, batched; repeated so a train_size too large cannot leave a rank short of
        batches while the others wait for it in an allreduce."""
        buffer = self.train_size if self.decode is not None else min(self.train_size, self.shuffle_buffer)
        order = self.train.shuffle(max(1, buffer), seed=seed * 1_009 + epoch, reshuffle_each_iteration=False)
        shard = self._decoded(order.shard(size, rank)).repeat()
        return shard.batch(batch_size, drop_remainder=True).take(batches).prefetch(tf.data.AUTOTUNE)

    def rank_test(self, rank: int, size: int):
        return self._decoded(self.test.shard(size, rank)).batch(256).prefetch(tf.data.AUTOTUNE)

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
    make_optimizer: Callable[[float], keras.optimizers.Optimizer]
    loss: keras.losses.Loss = field(
        default_factory=lambda: keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    loop: Literal["fit", "custom"] = "fit"
    """`fit`: Keras' model.fit with Horovod's callbacks; `custom`: a tf.function step with a tape."""
    evaluate: bool = True


class KerasBackend(Protocol):
    name: str
    rank: int
    size: int

    def distributed_optimizer(self, optimizer: keras.optimizers.Optimizer, config: TrainConfig): ...

    def distributed_tape(self, tape: tf.GradientTape, config: TrainConfig): ...

    def broadcast_variables(self, variables: list) -> None: ...

    def broadcast_object(self, value: Any) -> Any: ...

    def sum(self, values: list[float], name: str) -> list[float]: ...

    def allgather_object(self, value: Any) -> list[Any]: ...

    def callbacks(self) -> list[keras.callbacks.Callback]: ...


class LocalKeras:
    """One process, no communication: the in-process test tier."""

    name = "local"
    rank, size = 0, 1

    def distributed_optimizer(self, optimizer, config):
        return optimizer

    def distributed_tape(self, tape, config):
        return tape

    def broadcast_variables(self, variables):
        return None

    def broadcast_object(self, value):
        return value

    def sum(self, values, name):
        return list(values)

    def allgather_object(self, value):
        return [value]

    def callbacks(self):
        return []


def pin_local_gpu(local_rank: int) -> None:
    """Each rank sees only the GPU of its local rank, allocating as it goes (none on CPU)."""
    gpus = tf.config.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.set_visible_devices(gpus[local_rank % len(gpus)], "GPU")


class HorovodKeras:
    name = "horovod"

    def __init__(self) -> None:
        import horovod.tensorflow as hvd
        import horovod.tensorflow.keras as hvd_keras

        self.hvd, self.hvd_keras = hvd, hvd_keras
        hvd.init()
        self.rank, self.size = hvd.rank(), hvd.size()
        pin_local_gpu(hvd.local_rank())  # hvd: one GPU per rank
        threads = int(os.environ.get("HVDTRAIN_THREADS_PER_RANK", "0"))
        if threads:
            tf.config.threading.set_intra_op_parallelism_threads(threads)
            tf.config.threading.set_inter_op_parallelism_threads(threads)

    def _reduction(self, config: TrainConfig) -> dict[str, Any]:
        # num_groups=1: one grouped allreduce per step, so small gradients travel fused.
        return {
            "compression": self.hvd.Compression.fp16 if config.fp16_allreduce else self.hvd.Compression.none,
            "op": self.hvd.Adasum if config.reduce_op == "adasum" else self.hvd.Average,
            "num_groups": 1,
        }

    def distributed_optimizer(self, optimizer, config: TrainConfig):
        return self.hvd_keras.DistributedOptimizer(optimizer, **self._reduction(config))

    def distributed_tape(self, tape, config: TrainConfig):
        return self.hvd.DistributedGradientTape(tape, **self._reduction(config))

    def broadcast_variables(self, variables: list) -> None:
        self.hvd.broadcast_variables(variables, root_rank=0)

    def broadcast_object(self, value: Any) -> Any:
        return self.hvd.broadcast_object(value, root_rank=0)

    def sum(self, values: list[float], name: str) -> list[float]:
        tensor = tf.constant(values, dtype=tf.float64)
        return self.hvd.allreduce(tensor, op=self.hvd.Sum, name=name).numpy().tolist()

    def allgather_object(self, value: Any) -> list[Any]:
        return self.hvd.allgather_object(value)

    def callbacks(self) -> list[keras.callbacks.Callback]:
        return [self.hvd_keras.callbacks.MetricAverageCallback()]


class ScheduleCallback(keras.callbacks.Callback):
    """Sets the learning rate of every step from the schedule (fit's batches are accumulation passes)."""

    def __init__(self, schedule: Schedule, optimizer, log: RunLog) -> None:
        super().__init__()
        self.schedule, self.optimizer, self.log = schedule, optimizer, log
        self.epoch_start_step = 0
        """The loop's step count when this epoch's fit began (a resumed run's carries on)."""
        self.epoch, self.began = 0, time.perf_counter()

    def on_epoch_begin(self, epoch: int, logs=None) -> None:
        self.epoch, self.began = epoch, time.perf_counter()

    def on_train_batch_begin(self, batch: int, logs=None) -> None:
        if batch % self.schedule.batches_per_step == 0:
            step = self.epoch_start_step + batch // self.schedule.batches_per_step
            set_step_lr(self.optimizer, self.schedule, step, self.log)

    def on_train_batch_end(self, batch: int, logs=None) -> None:
        if (batch + 1) % self.schedule.batches_per_step == 0:
            show_progress(
                self.log,
                self.schedule,
                self.epoch,
                (batch + 1) // self.schedule.batches_per_step,
                self.began,
                lambda: float(logs["loss"]) if logs and "loss" in logs else None,
            )


def show_progress(log: RunLog, schedule: Schedule, epoch: int, taken: int, began: float, loss) -> None:
    """`loss`: a function giving the epoch's loss so far, read only for a record that is printed."""
    samples = taken * schedule.samples_per_step * schedule.world_size
    elapsed = time.perf_counter() - began
    log.progress(epoch, schedule.config.epochs, taken, schedule.steps_per_epoch, samples, elapsed, loss)


def set_step_lr(optimizer, schedule: Schedule, step: int, log: RunLog) -> None:
    lr = schedule.lr_at(step)
    optimizer.learning_rate = lr
    if schedule.logs_lr(step):
        log.step_lr(step, lr)


def weights_digest(model: keras.Model) -> str:
    return digest(np.ascontiguousarray(w).tobytes() for w in model.get_weights())


def _optimizer_for(task: KerasTask, config: TrainConfig, schedule: Schedule):
    optimizer = task.make_optimizer(schedule.peak_lr)
    if config.backward_passes_per_step > 1:
        # Keras 3's own accumulation: gradients are averaged across ranks every batch and applied
        # every N batches (Horovod's backward_passes_per_step relies on Keras 2 hooks).
        optimizer = optimizer.__class__.from_config(
            {**optimizer.get_config(), "gradient_accumulation_steps": config.backward_passes_per_step}
        )
    return optimizer


def tensorboard_writer(log_dir: Path) -> Callable[[str, float, int], None]:
    writer = tf.summary.create_file_writer(str(log_dir))

    def write(name: str, value: float, step: int) -> None:
        with writer.as_default():
            tf.summary.scalar(name, value, step=step)
        writer.flush()

    return write


def save_checkpoint(run_dir: Path, model: keras.Model, epoch: int, step: int) -> None:
    """Rank 0 only. The model was compiled with its optimizer, so the archive holds the optimizer's
    state too and a resumed run continues exactly."""
    tmp = tmp_path_for(run_dir / CHECKPOINT)
    model.save(tmp)
    with zipfile.ZipFile(tmp, "a") as archive:
        archive.writestr(STATE_MEMBER, json.dumps({"epoch": epoch, "step": step}))
    commit_file(tmp, run_dir / CHECKPOINT)


def load_checkpoint(path: Path, model: keras.Model) -> dict:
    """Weights and optimizer state into the (compiled) model; returns the saved position."""
    model.load_weights(path)
    with zipfile.ZipFile(path) as archive:
        if STATE_MEMBER in archive.namelist():
            return json.loads(archive.read(STATE_MEMBER))
    return json.loads(path.with_name("checkpoint.state.json").read_text())  # run dirs of 0.1.0


def run(
    build: Callable[[Any], KerasTask],
    config: TrainConfig,
    backend: KerasBackend,
    run_dir: Path,
    recipe: str,
    resume: bool = False,
) -> dict:
    keras.utils.set_random_seed(config.seed)  # identical init on every rank; the broadcast makes it certain
    return train(build(config), config, backend, run_dir, recipe, resume)


def train(
    task: KerasTask,
    config: TrainConfig,
    backend: KerasBackend,
    run_dir: Path,
    recipe: str,
    resume: bool = False,
) -> dict:
    model, data = task.model, task.data
    on_disk = isinstance(data, TFDatasets)
    schedule = Schedule.for_run(config, data.train_size if on_disk else len(data.y_train), backend.size)
    is_chief = backend.rank == 0
    log = RunLog(run_dir, is_chief, recipe, backend.name, backend.size)
    if is_chief:
        log.scalar_writer = tensorboard_writer(run_dir / "tensorboard")

    optimizer = _optimizer_for(task, config, schedule)
    if task.loop == "fit":
        optimizer = backend.distributed_optimizer(optimizer, config)
        model.compile(optimizer=optimizer, loss=task.loss, metrics=["accuracy"])
    else:  # the custom loop steps by itself; compiled so checkpoints carry the optimizer's state
        model.compile(optimizer=optimizer, loss=task.loss)
    optimizer.build(model.trainable_variables)  # create the slots now, so they broadcast too

    state = None
    if resume and is_chief:
        checkpoint = run_dir / CHECKPOINT
        if not checkpoint.exists():
            raise FileNotFoundError(f"--resume: no checkpoint at {checkpoint}")
        state = load_checkpoint(checkpoint, model)
        print(f"resuming from {checkpoint} at epoch {state['epoch']}", flush=True)
    start_epoch, step = schedule.start(backend.broadcast_object(state))
    backend.broadcast_variables(model.variables + list(optimizer.variables))

    per_epoch = schedule.samples_per_epoch
    step_fn = None if task.loop == "fit" else _custom_step(task, model, optimizer, backend, config)
    schedule_callback = ScheduleCallback(schedule, optimizer, log)
    callbacks = [*backend.callbacks(), schedule_callback]

    throughput, loss_value, accuracy = Throughput(), float("nan"), None
    for epoch in range(start_epoch, config.epochs):
        if on_disk:
            batches = per_epoch // config.batch_size
            x = data.rank_train(backend.rank, backend.size, epoch, config.seed, config.batch_size, batches)
            y, fed = None, {}  # batched by the dataset, which each rank shuffled itself
        else:
            indices = shard_indices(len(data.y_train), backend.rank, backend.size, epoch, config.seed)[
                :per_epoch
            ]
            x, y = data.x_train[indices], data.y_train[indices]
            fed = {"batch_size": config.batch_size}
        began = time.perf_counter()
        if step_fn is None:
            schedule_callback.epoch_start_step = step
            history = model.fit(
                x,
                y,
                **fed,
                epochs=epoch + 1,
                initial_epoch=epoch,
                shuffle=False,
                verbose=0,
                callbacks=callbacks,
            )
            rank_loss = float(history.history["loss"][-1])
        else:
            losses = []
            for batch, (inputs, targets) in enumerate(_batches(x, y, per_epoch, config.batch_size)):
                if batch % schedule.batches_per_step == 0:
                    set_step_lr(optimizer, schedule, step + batch // schedule.batches_per_step, log)
                losses.append(float(step_fn(inputs, targets)))
                if (batch + 1) % schedule.batches_per_step == 0:
                    taken = (batch + 1) // schedule.batches_per_step
                    show_progress(
                        log, schedule, epoch, taken, began, lambda losses=losses: float(np.mean(losses))
                    )
            rank_loss = float(np.mean(losses))
        loss_value = backend.sum([rank_loss], name="hvdtrain.loss")[0] / backend.size
        rate = throughput.add(schedule.global_samples_per_epoch, time.perf_counter() - began)
        step += schedule.steps_per_epoch
        accuracy = evaluate(model, data, backend) if task.evaluate else None
        learning_rate = float(np.asarray(optimizer.learning_rate))
        log.epoch(
            epoch + 1,
            config.epochs,
            {
                "loss": loss_value,
                "test_accuracy": accuracy,
                "lr": learning_rate,
                "samples_per_sec": rate,
                "world_size": backend.size,
            },
        )
        if config.checkpoint and is_chief:
            save_checkpoint(run_dir, model, epoch + 1, step)

    finals = backend.allgather_object(rank_final(weights_digest(model)))
    return log.finish(
        throughput, finals, step, test_accuracy=accuracy, final_loss=loss_value, epochs=config.epochs
    )


def _custom_step(task: KerasTask, model: keras.Model, optimizer, backend: KerasBackend, config: TrainConfig):
    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = task.loss(y, model(x, training=True))
        tape = backend.distributed_tape(tape, config)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))
        return loss

    return step


def _batches(x, y, samples: int, batch_size: int):
    """The custom loop's batches: of arrays in memory, or of a tf.data dataset (y None)."""
    if y is None:
        yield from x
        return
    for start in range(0, samples, batch_size):
        yield x[start : start + batch_size], y[start : start + batch_size]


def evaluate(model: keras.Model, data: Split | TFDatasets, backend: KerasBackend) -> float:
    """Each rank scores its share of the test set (every size-th sample from rank); counts are summed."""
    if isinstance(data, TFDatasets):
        correct, count = 0.0, 0
        for inputs, targets in data.rank_test(backend.rank, backend.size):
            predicted = np.asarray(model(inputs, training=False)).argmax(axis=1)
            correct, count = correct + float((predicted == np.asarray(targets)).sum()), count + len(predicted)
    else:
        mine = np.arange(backend.rank, len(data.y_test), backend.size)
        predictions = model.predict(data.x_test[mine], verbose=0, batch_size=256) if len(mine) else None
        correct = float((predictions.argmax(axis=1) == data.y_test[mine]).sum()) if len(mine) else 0.0
        count = len(mine)
    correct_total, count_total = backend.sum([correct, float(count)], name="hvdtrain.eval")
    return correct_total / count_total
