"""The data-parallel training loops for TensorFlow / Keras 3: `model.fit` and a custom `tf.function`
step, both on the one schedule (hvdtrain.runtime.schedule), with the backend's optimizer and
checkpointer. The parameter-server loop, beside them, is ps.py."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from hvdtrain.config import TrainConfig
from hvdtrain.data import Split, shard_indices
from hvdtrain.errors import InputError
from hvdtrain.runtime import metrics, preempt
from hvdtrain.runtime.checkpoint_write import keep_best
from hvdtrain.runtime.common import RunLog, Throughput, digest, rank_final
from hvdtrain.runtime.divergence import Guard
from hvdtrain.runtime.metrics import Watch
from hvdtrain.runtime.schedule import Schedule
from hvdtrain.runtime.tensorflow.backends import KerasBackend
from hvdtrain.runtime.tensorflow.callbacks import ScheduleCallback, set_step_lr, show_progress
from hvdtrain.runtime.tensorflow.task import KerasTask, TFDatasets, loss_scale
from hvdtrain.runtime.within import SHARDS, carried_on

POLICIES = {"fp32": "float32", "bf16": "mixed_bfloat16", "fp16": "mixed_float16"}
"""Keras's dtype policies: layers compute in the first, keep their variables in float32."""


def weights_digest(model: keras.Model) -> str:
    return digest(np.ascontiguousarray(w).tobytes() for w in model.get_weights())


def tensorboard_writer(log_dir: Path) -> Callable[[str, float, int], None]:
    writer = tf.summary.create_file_writer(str(log_dir))

    def write(name: str, value: float, step: int) -> None:
        with writer.as_default():
            tf.summary.scalar(name, value, step=step)
        writer.flush()

    return write


def run(
    build: Callable[[Any], KerasTask],
    config: TrainConfig,
    backend: KerasBackend,
    run_dir: Path,
    recipe: str,
    resume: bool = False,
) -> dict:
    keras.utils.set_random_seed(config.seed)  # identical init on every rank; the broadcast makes it certain
    before = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(POLICIES[config.precision])  # before the recipe builds layers
    try:
        task = build(config)
        if not isinstance(task, KerasTask):
            raise InputError(
                f"recipe {recipe}: build(config) must return a hvdtrain.runtime.tensorflow.KerasTask, "
                f"not {type(task).__module__}.{type(task).__qualname__}"
            )
        try:
            return train(task, config, backend, run_dir, recipe, resume)
        except (tf.errors.InvalidArgumentError, tf.errors.DataLossError, tf.errors.NotFoundError) as error:
            bad = task.data.undecodable() if isinstance(task.data, TFDatasets) else None
            if bad is None:
                raise
            raise InputError(bad) from error
    finally:  # a caller's later models (the Python API, a notebook) get their own policy back
        keras.mixed_precision.set_global_policy(before)


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

    optimizer = backend.build_optimizer(task, schedule.peak_lr, config)
    if task.loop == "fit":
        model.compile(optimizer=optimizer, loss=task.loss, metrics=["accuracy"])
    else:  # the custom loop steps by itself; compiled so checkpoints carry the optimizer's state
        model.compile(optimizer=optimizer, loss=task.loss)
    optimizer.build(model.trainable_variables)  # create the slots now, so they broadcast too

    checkpointer = backend.checkpointer()
    state = checkpointer.load(run_dir, model, optimizer, resume)
    start_epoch, step = schedule.start(state)
    watch = Watch(config.monitor, config.mode, config.early_stopping_patience, (state or {}).get("watch"))
    within = carried_on(state, SHARDS, backend.size, is_chief)
    epoch, epoch_base = start_epoch, step

    preempted = False  # whether the ranks agreed to stop for preemption after the last step
    guard = Guard(
        config.stop_on_nonfinite,
        config.nonfinite_patience,
        config.precision == "fp16",
        backend.sum,
        backend.allgather_object,
        run_dir,
        is_chief,
    )
    if state:  # a divergence names the checkpoint a resume continues from
        guard.saved(step)
    read_scale = loss_scale(optimizer)  # it falls at each step the optimizer skipped
    scales = [read_scale()] if read_scale is not None else []
    # nonfinite_patience's scale only marks skips: back to 1 after each good step, or a long run's
    # occasional bad batches would halve it into underflow
    scale_marks_skips = config.precision != "fp16" and read_scale is not None

    def at_step(taken: int, loss_sum: float | None) -> None:
        """Every rank after each step: whether the run diverged; a step checkpoint every
        checkpoint_every_steps steps (not at an epoch's end, which has its own), with each rank's
        loss sum over the epoch's batches; and where the ranks agree to stop for preemption, one at
        this step before they stop."""
        nonlocal preempted
        steps, step = schedule.steps_per_epoch, epoch_base + taken
        skipped = False
        if read_scale is not None:
            now = read_scale()
            skipped, scales[0] = now < scales[0], now
            if scale_marks_skips and not skipped and now != 1.0:
                optimizer.dynamic_scale.assign(1.0)
                scales[0] = 1.0
        guard.after_step(step, epoch, [0.0 if loss_sum is None else loss_sum], skipped, lambda: math.nan)
        save, preempted = preempt.after_step(
            step, taken, steps, config.checkpoint_every_steps, config.checkpoint, backend
        )
        if save:
            guard.settle(step, epoch, lambda: finite(model))
            position = {
                "epoch": epoch,
                "step": step,
                "watch": watch.state_dict(),
                "within": {
                    "order": SHARDS,
                    "world_size": backend.size,
                    "taken": taken,
                    "loss_sums": backend.allgather_object(loss_sum),
                },
            }
            checkpointer.save(run_dir, model, position, keep=config.keep_checkpoints)
            guard.saved(step)
            log.flush_steps()
        if preempted and taken < steps:
            raise preempt.stopped(run_dir, step, is_chief, backend, config.checkpoint)

    per_epoch = schedule.samples_per_epoch
    step_fn = None if task.loop == "fit" else _custom_step(task, model, optimizer, backend, config)
    schedule_callback = ScheduleCallback(schedule, optimizer, log, at_step)
    callbacks = [*backend.callbacks(), schedule_callback]

    throughput, loss_value, tested = Throughput(), float("nan"), {}
    passes, steps = schedule.batches_per_step, schedule.steps_per_epoch
    for epoch in range(start_epoch, config.epochs):
        preempted = False
        first, loss_sum = (within["taken"], within["loss_sums"][backend.rank]) if within else (0, 0.0)
        within, epoch_base = None, step - first
        skip = first * passes  # batches of the epoch a step checkpoint had taken
        if on_disk:
            batches = per_epoch // config.batch_size
            x = data.rank_train(
                backend.rank, backend.size, epoch, config.seed, config.batch_size, batches, skip
            )
            # batched by the dataset, which each rank shuffled itself
        else:
            indices = shard_indices(len(data.y_train), backend.rank, backend.size, epoch, config.seed)[
                skip * config.batch_size : per_epoch
            ]
            # batched here, not by fit: given arrays, fit builds a dataset that traces a function every
            # epoch. An epoch is whole batches, so the step's batch dimension stays static as fit's was.
            pairs = (floatx(data.x_train[indices]), floatx(data.y_train[indices]))
            x = tf.data.Dataset.from_tensor_slices(pairs).batch(config.batch_size, drop_remainder=True)
        began = time.perf_counter()
        if step_fn is None:
            schedule_callback.epoch_base, schedule_callback.first = epoch_base, first
            schedule_callback.loss_sum = loss_sum
            history = model.fit(
                x,
                epochs=epoch + 1,
                initial_epoch=epoch,
                shuffle=False,
                verbose=0,
                callbacks=callbacks,
            )
            mean = float(history.history["loss"][-1])  # fit's, over the batches this fit took
            rank_loss = mean if not first else (loss_sum + mean * (steps - first) * passes) / (steps * passes)
        else:
            for batch, (inputs, targets) in enumerate(x, start=skip):
                if batch % passes == 0:
                    taken = batch // passes
                    set_step_lr(optimizer, schedule, epoch, taken, epoch_base + taken, log)
                loss_sum += float(step_fn(inputs, targets))
                if (batch + 1) % passes == 0:
                    taken = (batch + 1) // passes
                    mean = loss_sum / (batch + 1)
                    show_progress(log, schedule, epoch, taken, first, began, lambda mean=mean: mean)
                    at_step(taken, loss_sum)
            rank_loss = loss_sum / (steps * passes)
        loss_value = backend.sum([rank_loss], name="hvdtrain.loss")[0] / backend.size
        backend.average_buffers(model)
        samples = (steps - first) * schedule.samples_per_step * backend.size
        rate = throughput.add(samples, time.perf_counter() - began)
        step = epoch_base + steps
        if task.evaluate:
            tested = {f"test_{name}": value for name, value in evaluate(model, task, backend).items()}
        else:
            tested = {f"test_{name}": None for name in task.metrics}
        learning_rate = float(np.asarray(optimizer.learning_rate))
        record = {"loss": loss_value, **tested, "lr": learning_rate}
        log.epoch(epoch + 1, config.epochs, {**record, "samples_per_sec": rate, "world_size": backend.size})
        if end_epoch(config, checkpointer, watch, backend, log, record, model, epoch, step, guard):
            break
        if preempted and epoch + 1 < config.epochs:
            raise preempt.stopped(run_dir, step, is_chief, backend, config.checkpoint)

    finals = backend.allgather_object(rank_final(weights_digest(model)))
    return log.finish(
        throughput,
        finals,
        step,
        tested,
        loss_value,
        config.epochs,
        compute_dtype=model.compute_dtype,
        **watch.summary(),
        nonfinite_skipped=guard.skipped,
    )


def end_epoch(
    config,
    checkpointer,
    watch: Watch,
    backend,
    log: RunLog,
    record,
    model,
    epoch,
    step,
    guard: Guard | None = None,
) -> bool:
    """Every rank, after an epoch's record (the Keras loops' and the parameter server's): whether
    the run diverged, the checkpoint, the best one where `monitor` improved, and whether every rank
    stops early here."""
    if guard is not None:
        guard.settle(step, epoch, lambda: finite(model))
    improved = watch.observe(record)
    if config.checkpoint:
        position = {"epoch": epoch + 1, "step": step, "watch": watch.state_dict()}
        checkpointer.save(log.run_dir, model, position, keep=config.keep_checkpoints)
        if guard is not None:
            guard.saved(step)
        if improved and log.is_chief:
            keep_best(log.run_dir, step, {"monitor": config.monitor, "value": watch.best, "epoch": epoch + 1})
    return watch.agree_to_stop(backend, epoch + 1)


def finite(model: keras.Model) -> bool:
    return all(bool(np.isfinite(np.asarray(v)).all()) for v in model.trainable_variables)


def _custom_step(task: KerasTask, model: keras.Model, optimizer, backend: KerasBackend, config: TrainConfig):
    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = task.loss(y, model(x, training=True))
            scaled = optimizer.scale_loss(loss)  # fp16's loss scale; the loss itself otherwise
        tape = backend.distributed_tape(tape, config)
        gradients = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))
        return loss

    return step


def floatx(array: np.ndarray) -> np.ndarray:
    """Float arrays in Keras' float type, as fit and predict cast arrays they are given."""
    kind = keras.config.floatx()
    return array.astype(kind) if array.dtype.kind == "f" and array.dtype != kind else array


def evaluate(model: keras.Model, task: KerasTask, backend: KerasBackend) -> dict[str, float]:
    """The task's metrics over the test set: each rank scores its share (every size-th sample from
    rank), and the sums are added up across ranks."""
    data, names = task.data, list(task.metrics)
    sums, count = [0.0] * len(names), 0
    for outputs, targets in _test_outputs(model, data, backend):
        sums = [total + task.metrics[name](outputs, targets) for total, name in zip(sums, names, strict=True)]
        count += len(targets)
    *totals, count_total = backend.sum([*sums, float(count)], name="hvdtrain.eval")
    return {
        name: metrics.finish(name, total / count_total) for name, total in zip(names, totals, strict=True)
    }


def _test_outputs(model: keras.Model, data: Split | TFDatasets, backend: KerasBackend):
    """(outputs, targets) as arrays, batch by batch (tf.data) or in one (arrays, through predict's
    function)."""
    if isinstance(data, TFDatasets):
        for inputs, targets in data.rank_test(backend.rank, backend.size):
            yield np.asarray(model(inputs, training=False)), np.asarray(targets)
        return
    mine = np.arange(backend.rank, len(data.y_test), backend.size)
    if len(mine):
        # batch by batch through predict's function: predict itself builds a dataset every call
        x = floatx(data.x_test[mine])
        outputs = [np.asarray(model.predict_on_batch(x[at : at + 256])) for at in range(0, len(x), 256)]
        yield np.concatenate(outputs), data.y_test[mine]
