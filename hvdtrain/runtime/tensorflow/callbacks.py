"""How the Keras loops follow the one schedule step by step: fit's callback, and the two helpers it
shares with the custom loop (each step's learning rate, progress), so that both loops take the same
learning rate at the same step and report the same progress."""

from __future__ import annotations

import time
from collections.abc import Callable

import keras

from hvdtrain.runtime.common import RunLog
from hvdtrain.runtime.schedule import Schedule


class ScheduleCallback(keras.callbacks.Callback):
    """fit's side of the loop: the learning rate of every step from the schedule, progress, and the
    step checkpoints (fit's batches are accumulation passes; a resumed epoch's fit starts `first`
    steps in)."""

    def __init__(self, schedule: Schedule, optimizer, log: RunLog, at_step: Callable[[int, float], None]):
        super().__init__()
        self.schedule, self.optimizer, self.log = schedule, optimizer, log
        self.at_step = at_step
        """Called with (steps taken in the epoch, this rank's loss sum over them) after each step."""
        self.epoch_base = 0
        """The loop's step count at this epoch's start (a resumed run's carries on)."""
        self.first, self.loss_sum = 0, 0.0
        """Steps of the epoch taken before this fit began, and their loss sum (a resumed epoch's)."""
        self.epoch, self.began = 0, time.perf_counter()

    def on_epoch_begin(self, epoch: int, logs=None) -> None:
        self.epoch, self.began = epoch, time.perf_counter()

    def on_train_batch_begin(self, batch: int, logs=None) -> None:
        if batch % self.schedule.batches_per_step == 0:
            taken = self.first + batch // self.schedule.batches_per_step
            set_step_lr(self.optimizer, self.schedule, self.epoch, taken, self.epoch_base + taken, self.log)

    def on_train_batch_end(self, batch: int, logs=None) -> None:
        if (batch + 1) % self.schedule.batches_per_step:
            return
        taken = self.first + (batch + 1) // self.schedule.batches_per_step
        mean = float(logs["loss"]) if logs and "loss" in logs else None  # fit's mean over its batches
        loss_sum = None if mean is None else self.loss_sum + mean * (batch + 1)
        batches = taken * self.schedule.batches_per_step
        show_progress(
            self.log, self.schedule, self.epoch, taken, self.first, self.began,
            lambda: None if loss_sum is None else loss_sum / batches,
        )  # fmt: skip
        self.at_step(taken, loss_sum)


def show_progress(
    log: RunLog, schedule: Schedule, epoch: int, taken: int, first: int, began: float, loss
) -> None:
    """`loss`: a function giving the epoch's loss so far, read only for a record that is printed;
    `first`: the steps taken before `began` (a resumed epoch's)."""
    samples = (taken - first) * schedule.samples_per_step * schedule.world_size
    elapsed = time.perf_counter() - began
    log.progress(epoch, schedule.config.epochs, taken, schedule.steps_per_epoch, samples, elapsed, loss)


def set_step_lr(optimizer, schedule: Schedule, epoch: int, taken: int, step: int, log: RunLog) -> None:
    """The learning rate of the step `taken` steps into `epoch` (the run's step `step`)."""
    optimizer.learning_rate = schedule.lr_of_step(schedule.at(epoch, taken), step, log)
