"""The data-parallel training loop for PyTorch, written once for every backend: the fixed-size world
and Horovod's elastic one share the step, the end of an epoch, evaluation and the checkpointer
(training.py)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hvdtrain.config import TrainConfig
from hvdtrain.data import epoch_order
from hvdtrain.errors import InputError
from hvdtrain.runtime import preempt
from hvdtrain.runtime.checkpoint_write import BackgroundWriter
from hvdtrain.runtime.common import RunLog, Throughput
from hvdtrain.runtime.divergence import Guard
from hvdtrain.runtime.metrics import Watch
from hvdtrain.runtime.schedule import Schedule
from hvdtrain.runtime.torch.backends import TorchBackend
from hvdtrain.runtime.torch.batches import BatchReader, elastic_indices, rank_indices, seed_epoch, train_size
from hvdtrain.runtime.torch.checkpointer import Checkpointer
from hvdtrain.runtime.torch.precision import Precision, bf16_is_native
from hvdtrain.runtime.torch.speed import (
    compile_model,
    deterministic_kernels,
    settle,
    training_flops,
    wants_channels_last,
)
from hvdtrain.runtime.torch.task import TorchTask, blocks_of
from hvdtrain.runtime.torch.training import (
    Training,
    end_epoch,
    finish,
    read_later,
    tensorboard_writer,
    watch_stragglers,
)
from hvdtrain.runtime.torch.within import Within
from hvdtrain.runtime.within import ELASTIC, SHARDS


def _train_elastic(t: Training, start: tuple[int, int], within: Within) -> dict:
    """Horovod elastic training: the loop runs inside hvd.elastic.run, which on a failed rank restores
    the last commit, re-forms the world and enters again, and on hosts joining re-forms it at a commit.
    Each entry recomputes what depends on the world size (schedule, learning rate, shards): the epoch
    carries on where the committed state left it, its remaining samples split over the new world."""
    task, config, backend, model, log, amp = t.task, t.config, t.backend, t.model, t.log, t.amp
    hvd, samples = backend.hvd, train_size(task.data)
    commit_every = int(os.environ.get("HVDTRAIN_COMMIT_EVERY", "10"))
    every = config.checkpoint_every_steps
    state = hvd.elastic.TorchState(
        model=model,
        optimizer=t.optimizer,
        epoch=start[0],
        step=start[1],
        done=within.done,
        taken=within.taken,
        loss_sum=within.loss_sum,
        norms=within.norms,
        fraction=within.fraction,
        precision=amp.state_dict(),
        watch=t.watch.state_dict(),
    )
    throughput, outcome = Throughput(), {}
    reader = BatchReader(task.data, config.batch_size, backend.device, config.seed, t.memory_format)

    @hvd.elastic.run
    def train_elastic(state) -> None:
        backend.refresh()
        if t.guard is not None:
            t.guard.reset()
        if t.stragglers is not None:
            t.stragglers.reset(backend.rank, backend.size)
        amp.load_state_dict(state.precision)  # a rank that joined starts from the committed loss scale
        t.watch.load_state_dict(state.watch)
        log.is_chief, log.world_size = backend.rank == 0, backend.size
        if log.is_chief:  # rank 0 may now be on a host that has not written this run yet
            log.run_dir.mkdir(parents=True, exist_ok=True)
        schedule = Schedule.for_run(config, samples, backend.size)
        passes, batch = schedule.batches_per_step, config.batch_size
        model.train()
        while state.epoch < config.epochs:
            order = epoch_order(samples, state.epoch, config.seed)
            seed_epoch(config, state.epoch, backend.rank)
            entered, done_at_entry = time.perf_counter(), state.done
            batches = reader(elastic_indices(order, state.done, backend.rank, backend.size, batch))
            while (
                state.taken < schedule.steps_per_epoch
                and state.done + backend.size * batch * passes <= len(order)
            ):
                lr = schedule.lr_of_step(schedule.progress(state.epoch, state.fraction), state.step, log)
                loss, norm, skipped = t.step(batches, passes, lr)
                t.after_step(state.step + 1, state.epoch, loss, norm, skipped)
                # elastic's state is committed as Python values; a skipped bad step's loss is no number
                state.loss_sum += float(loss) if not skipped or t.amp.scaler else 0.0
                state.norms = state.norms + ([norm.detach()] if norm is not None else [])
                # each world's step is its share of an epoch: progress survives a resize
                state.fraction += 1 / schedule.steps_per_epoch
                state.done += backend.size * batch * passes
                state.step, state.taken = state.step + 1, state.taken + 1
                log.progress(
                    state.epoch,
                    config.epochs,
                    state.taken,
                    schedule.steps_per_epoch,
                    state.done - done_at_entry,
                    time.perf_counter() - entered,
                    state.loss_sum / state.taken,
                )
                more = state.done + backend.size * batch * passes <= len(order)
                if every and state.step % every == 0 and state.taken < schedule.steps_per_epoch and more:
                    at = Within(state.taken, state.loss_sum, state.norms, state.done, state.fraction)
                    position = at.position(t, state.epoch, state.step, ELASTIC)
                    t.settle(state.step, state.epoch)
                    t.checkpointer.save(log.run_dir, model, t.optimizer, position, config.keep_checkpoints)
                    t.saved(state.step)
                    log.flush_steps()
                if state.step % commit_every == 0:
                    state.precision = amp.state_dict()
                    state.commit()
            rate = None  # an entry that only finishes the epoch (a reset at its end) measured nothing
            settle(backend.device)
            if state.done > done_at_entry:
                rate = throughput.add(state.done - done_at_entry, time.perf_counter() - entered)
            outcome["loss"], outcome["tested"], stop = end_epoch(
                t, state.epoch, state.step, state.loss_sum / max(1, state.taken), rate, state.norms
            )
            state.epoch, state.done, state.taken, state.loss_sum = state.epoch + 1, 0, 0, 0.0
            state.norms, state.fraction, state.precision = [], 0.0, amp.state_dict()
            state.watch = t.watch.state_dict()
            if stop:
                state.epoch = config.epochs
            state.commit()

    try:
        train_elastic(state)
    finally:
        reader.close()
    loss_value, tested = outcome.get("loss", float("nan")), outcome.get("tested", {})
    return finish(t, throughput, state.step, loss_value, tested)


def run(
    build: Callable[[Any], TorchTask],
    config: TrainConfig,
    backend: TorchBackend,
    run_dir: Path,
    recipe: str,
    resume: bool = False,
) -> dict:
    torch.manual_seed(config.seed)  # identical init on every rank; the broadcast makes it certain
    task = build(config)
    if not isinstance(task, TorchTask):
        raise InputError(
            f"recipe {recipe}: build(config) must return a hvdtrain.runtime.torch.TorchTask, "
            f"not {type(task).__module__}.{type(task).__qualname__}"
        )
    return train(task, config, backend, run_dir, recipe, resume)


def train(
    task: TorchTask,
    config: TrainConfig,
    backend: TorchBackend,
    run_dir: Path,
    recipe: str,
    resume: bool = False,
) -> dict:
    with deterministic_kernels(config.deterministic):
        return _train(task, config, backend, run_dir, recipe, resume)


def _train(
    task: TorchTask, config: TrainConfig, backend: TorchBackend, run_dir: Path, recipe: str, resume: bool
) -> dict:
    schedule = Schedule.for_run(config, train_size(task.data), backend.size)
    device = backend.device
    model = task.model.to(device)
    memory_format = torch.channels_last if wants_channels_last(config, model, device) else None
    if memory_format is not None and backend.channels_last_parameters:
        model = model.to(memory_format=memory_format)
    if config.sync_batch_norm:
        model = backend.sync_batch_norm(model)
    flops = training_flops(task, model, config, device, memory_format)
    if device.type == "cuda":  # the peak a run reports is training's, not the count's
        torch.cuda.reset_peak_memory_stats(device)
    loss_fn = task.loss_fn
    if config.compile:
        compile_model(model, blocks_of(task, model) if config.compile_scope == "blocks" else None)
        # The loss too: a wide output layer's float32 softmax (a GPT's) is then fused into kernels
        # that read the half-precision logits, not cast and written out in float32 and read back.
        loss_fn = torch.compile(task.loss_fn)
    optimizer = backend.build_optimizer(task, model, schedule.peak_lr, config)
    model = backend.wrap_model(model, config)
    checkpointer: Checkpointer = backend.checkpointer()
    if config.async_checkpoint:
        checkpointer.writer = BackgroundWriter()
    is_chief = backend.rank == 0
    log = RunLog(run_dir, is_chief, recipe, backend.name, backend.size)
    if is_chief:
        log.scalar_writer = tensorboard_writer(run_dir / "tensorboard")

    amp = Precision(config.precision, device)
    if config.precision == "bf16" and not bf16_is_native(device) and is_chief:
        print(
            f"hvdtrain: this {device.type} has no bfloat16 instructions: bf16 is emulated, slower than fp32"
        )
    watch = Watch(config.monitor, config.mode, config.early_stopping_patience)
    guard = Guard(
        config.stop_on_nonfinite,
        config.nonfinite_patience,
        amp.scaler is not None,
        backend.sum,
        backend.allgather_object,
        run_dir,
        is_chief,
        read=read_later,
        before_stop=checkpointer.flush,
    )
    t = Training(
        task,
        config,
        backend,
        checkpointer,
        model,
        optimizer,
        amp,
        log,
        watch,
        memory_format,
        flops,
        loss_fn,
        guard,
    )
    t.stragglers, t.last_gradient = watch_stragglers(config, backend, model)

    if getattr(backend, "elastic", False):  # no collective before hvd.elastic.run: its sync is one
        state = checkpointer.read(run_dir, model, optimizer) if resume else None
        amp.load_state_dict(state)
        watch.load_state_dict((state or {}).get("watch"))
        within = Within.resumed(state, ELASTIC, backend, log)
        if state:  # a divergence names the checkpoint a resume continues from
            guard.saved(state["step"])
        return _train_elastic(t, schedule.start(state), within)
    state = checkpointer.load(run_dir, model, optimizer, resume)
    amp.load_state_dict(state)
    watch.load_state_dict((state or {}).get("watch"))
    if state:
        guard.saved(state["step"])
    return _train_fixed(t, schedule, state)


def _train_fixed(t: Training, schedule: Schedule, state: dict | None) -> dict:
    """A world of fixed size: each rank its shard of every epoch, a checkpoint at each epoch's end and
    every checkpoint_every_steps steps, from which a resume continues at the next batch."""
    task, config, backend, model, optimizer, log = t.task, t.config, t.backend, t.model, t.optimizer, t.log
    start_epoch, step = schedule.start(state)
    within = Within.resumed(state, SHARDS, backend, log)
    throughput, loss_value, tested = Throughput(), float("nan"), {}
    reader = BatchReader(task.data, config.batch_size, backend.device, config.seed, t.memory_format)
    every = config.checkpoint_every_steps
    try:
        passes = schedule.batches_per_step
        steps, samples_per_step = schedule.steps_per_epoch, schedule.samples_per_step * backend.size
        model.train()
        for epoch in range(start_epoch, config.epochs):
            if not within.taken:  # a resumed epoch's random state came back with its checkpoint
                seed_epoch(config, epoch, backend.rank)
            indices = rank_indices(task.data, backend.rank, backend.size, epoch, config.seed)
            skip = within.taken * schedule.samples_per_step
            batches = reader(indices[skip : schedule.samples_per_epoch])
            first, norms = within.taken, within.norms
            loss_sum = torch.tensor(within.loss_sum, dtype=torch.float64, device=backend.device)
            within, epoch_start, preempted = Within(), time.perf_counter(), False
            for taken in range(first + 1, steps + 1):
                lr = schedule.lr_of_step(schedule.at(epoch, taken - 1), step, log)
                loss, norm, skipped = t.step(batches, passes, lr)
                t.after_step(step + 1, epoch, loss, norm, skipped)
                if not skipped or t.amp.scaler is not None:  # a skipped bad step's loss is not a number
                    loss_sum += loss
                if norm is not None:
                    norms.append(norm)
                step += 1
                elapsed = time.perf_counter() - epoch_start
                log.progress(
                    epoch,
                    config.epochs,
                    taken,
                    steps,
                    (taken - first) * samples_per_step,
                    elapsed,
                    lambda: float(loss_sum) / taken,  # noqa: B023 (called here, if at all)
                )
                save, preempted = preempt.after_step(step, taken, steps, every, config.checkpoint, backend)
                if save:
                    t.settle(step, epoch)
                    position = Within(taken, float(loss_sum), norms).position(t, epoch, step, SHARDS)
                    t.checkpointer.save(log.run_dir, model, optimizer, position, config.keep_checkpoints)
                    t.saved(step)
                    log.flush_steps()
                if preempted and taken < steps:
                    t.checkpointer.flush()  # the marker says the checkpoint is saved
                    raise preempt.stopped(log.run_dir, step, log.is_chief, backend, config.checkpoint)
            samples = (steps - first) * samples_per_step
            settle(backend.device)  # the epoch's work done, not only queued
            rate = throughput.add(samples, time.perf_counter() - epoch_start) if samples > 0 else None
            mean_loss = float(loss_sum) / max(first, steps)
            loss_value, tested, stop = end_epoch(t, epoch, step, mean_loss, rate, norms)
            if stop:
                break
            if preempted and epoch + 1 < config.epochs:
                t.checkpointer.flush()
                raise preempt.stopped(log.run_dir, step, log.is_chief, backend, config.checkpoint)
    finally:
        reader.close()
    return finish(t, throughput, step, loss_value, tested)
