"""The data-parallel training loop for PyTorch, and the Horovod steps, written once.

`train` is the loop every torch recipe runs. What differs between ways of parallelising
(Horovod allreduce, DistributedDataParallel, DataParallel) is a small `TorchBackend`, which also
owns the device: Horovod pins each rank to the GPU of its local rank, else the CPU, and the loop
moves every batch there. The Horovod backend and the single-process one are here, the others live
in hvdtrain/strategies/.
"""

from __future__ import annotations

import io
import os
import sys
import time
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from hvdtrain.config import TrainConfig
from hvdtrain.data import Split, epoch_order, shard_indices
from hvdtrain.runtime.common import (
    CHECKPOINT_FILES,
    RunLog,
    Throughput,
    atomic_write_bytes,
    digest,
    rank_final,
)
from hvdtrain.runtime.schedule import Schedule

(CHECKPOINT,) = CHECKPOINT_FILES["torch"]


@dataclass
class Datasets:
    """Data read from disk as training goes, instead of arrays in memory: map-style datasets (a
    torch Dataset, or anything with `len` and `[i]` -> (input, target), e.g. hvdtrain.data.ImageFolder).
    Each rank reads only its shard, in batches, with a DataLoader's worker processes."""

    train: Any
    test: Any
    workers: int = 2
    """DataLoader worker processes per rank (0: read in the training process)."""


@dataclass
class TorchTask:
    """What a torch recipe builds: framework code only, no distribution."""

    model: torch.nn.Module
    data: Split | Datasets
    """Arrays in memory, or datasets read from disk batch by batch."""
    make_optimizer: Callable[[Iterable[torch.nn.Parameter], float], torch.optim.Optimizer]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch.nn.functional.cross_entropy
    evaluate: bool = True
    """False for throughput recipes, whose test set means nothing."""


class TorchBackend(Protocol):
    name: str
    rank: int
    size: int
    device: torch.device
    """Where the model lives and every batch goes."""

    def wrap(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: TrainConfig
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer]: ...

    def broadcast_state(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any] | None
    ) -> dict[str, Any] | None: ...

    def sum(self, values: list[float], name: str) -> list[float]: ...

    def allgather_object(self, value: Any) -> list[Any]: ...


def set_threads() -> None:
    torch.set_num_threads(int(os.environ.get("HVDTRAIN_THREADS_PER_RANK", torch.get_num_threads())))


class LocalTorch:
    """One process, no communication: the in-process test tier, and DataParallel's base."""

    name = "local"
    rank, size = 0, 1

    def __init__(self, device: str = "cpu") -> None:
        self.device = torch.device(device)

    def wrap(self, model, optimizer, config):
        return model, optimizer

    def broadcast_state(self, model, optimizer, extra):
        return extra

    def sum(self, values, name):
        return list(values)

    def allgather_object(self, value):
        return [value]


class DataParallelTorch(LocalTorch):
    """One process; with GPUs the model lives on the first and DataParallel splits each batch, whose
    inputs the loop puts on that device."""

    name = "dp"

    def __init__(self, max_devices: int) -> None:
        self.device_ids = list(range(min(max_devices, torch.cuda.device_count())))
        super().__init__(f"cuda:{self.device_ids[0]}" if self.device_ids else "cpu")
        set_threads()
        if not self.device_ids:
            print("hvdtrain: no GPU visible: DataParallel runs the model on one device (the CPU)", flush=True)

    def wrap(self, model, optimizer, config):
        if not self.device_ids:
            return model, optimizer
        return torch.nn.DataParallel(model, device_ids=self.device_ids), optimizer


class HorovodTorch:
    """init, device pinning, threads, optimizer wrapping, broadcast from rank 0 and metric
    reduction: Horovod's steps."""

    name = "horovod"

    def __init__(self) -> None:
        import horovod.torch as hvd

        self.hvd = hvd
        hvd.init()
        self.rank, self.size = hvd.rank(), hvd.size()
        self.elastic = os.environ.get("HOROVOD_ELASTIC") == "1"
        """Started by Horovod's elastic driver: train inside hvd.elastic.run."""
        if torch.cuda.is_available():  # hvd: one GPU per rank, chosen by local rank
            torch.cuda.set_device(hvd.local_rank())
            self.device = torch.device("cuda", hvd.local_rank())
        else:
            self.device = torch.device("cpu")
        set_threads()

    def wrap(self, model, optimizer, config):
        hvd = self.hvd
        optimizer = hvd.DistributedOptimizer(
            optimizer,
            named_parameters=model.named_parameters(),
            compression=hvd.Compression.fp16 if config.fp16_allreduce else hvd.Compression.none,
            backward_passes_per_step=config.backward_passes_per_step,
            op=hvd.Adasum if config.reduce_op == "adasum" else hvd.Average,
        )
        return model, optimizer

    def broadcast_state(self, model, optimizer, extra):
        self.hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        self.hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        return self.hvd.broadcast_object(extra, root_rank=0, name="hvdtrain.extra")

    def sum(self, values, name):
        tensor = torch.tensor(values, dtype=torch.float64)
        return self.hvd.allreduce(tensor, op=self.hvd.Sum, name=name).tolist()

    def allgather_object(self, value):
        return self.hvd.allgather_object(value, name="hvdtrain.gather")

    def refresh(self) -> None:
        """After an elastic reset: this rank's new place in a world of a new size."""
        self.rank, self.size = self.hvd.rank(), self.hvd.size()


def tensorboard_writer(log_dir: Path) -> Callable[[str, float, int], None]:
    # TensorBoard's stand-in for TF (its `no_tensorflow` build): otherwise writing a scalar imports
    # all of TensorFlow into a torch rank, seconds of start-up and a page of log noise.
    sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("tensorboard.compat.notf"))
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(log_dir))

    def write(name: str, value: float, step: int) -> None:
        writer.add_scalar(name, value, step)
        writer.flush()

    return write


def parameter_digest(model: torch.nn.Module) -> str:
    return digest(t.detach().cpu().contiguous().numpy().tobytes() for t in model.state_dict().values())


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)


def save_checkpoint(
    path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, epoch: int, step: int
) -> None:
    buffer = io.BytesIO()
    torch.save(
        {
            "model": _unwrapped(model).state_dict(),
            "optimizer": optimizer.state_dict(),
            "epoch": epoch,
            "step": step,
        },
        buffer,
    )
    atomic_write_bytes(path, buffer.getvalue())


def train_size(data: Split | Datasets) -> int:
    return len(data.train) if isinstance(data, Datasets) else len(data.y_train)


class BatchReader:
    """(inputs, targets) on the device, batch after batch of the indices given (a short last batch is
    dropped). Arrays are indexed in memory. Datasets are read by one DataLoader for the whole run,
    whose worker processes stay up across epochs and read ahead of training: each epoch only changes
    the indices its sampler hands out."""

    def __init__(self, data: Split | Datasets, batch_size: int, device: torch.device, seed: int = 0) -> None:
        self.data, self.batch_size, self.device = data, batch_size, device
        self.indices: list[int] = []
        self.loader = None
        if isinstance(data, Datasets):
            self.loader = torch.utils.data.DataLoader(
                data.train,
                batch_size=batch_size,
                sampler=self,  # iterated afresh each epoch: the indices set by __call__
                num_workers=data.workers,
                persistent_workers=data.workers > 0,
                drop_last=True,
                pin_memory=device.type == "cuda",
                # its own seeds: drawn from the global generator, they would shift the model's random
                # stream (dropout) between a resumed run and an uninterrupted one
                generator=torch.Generator().manual_seed(seed),
            )
        else:
            self.x, self.y = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)

    def close(self) -> None:
        """End the worker processes now: left to the garbage collector, a persistent DataLoader's
        workers are ended whenever it runs (seconds, at a random later point)."""
        iterator = getattr(self.loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)

    def __call__(self, indices: np.ndarray | list[int]):
        device = self.device
        if self.loader is not None:
            self.indices = [int(i) for i in indices]
            for inputs, targets in self.loader:
                yield inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            return
        for start in range(0, len(indices) - self.batch_size + 1, self.batch_size):
            chosen = torch.from_numpy(np.asarray(indices[start : start + self.batch_size]))
            yield self.x[chosen].to(device, non_blocking=True), self.y[chosen].to(device, non_blocking=True)


def _rank_indices(
    data: Split | Datasets, rank: int, size: int, epoch: int, seed: int
) -> np.ndarray | list[int]:
    """This rank's samples of one epoch. Datasets are sharded by torch's DistributedSampler; arrays by
    shard_indices, the same rule (one shared permutation, trimmed, every size-th from rank)."""
    if isinstance(data, Datasets):
        sampler = torch.utils.data.DistributedSampler(
            data.train, num_replicas=size, rank=rank, shuffle=True, seed=seed, drop_last=True
        )
        sampler.set_epoch(epoch)
        return list(sampler)
    return shard_indices(len(data.y_train), rank, size, epoch, seed)


def _elastic_indices(order: np.ndarray, done: int, rank: int, size: int, batch: int) -> np.ndarray:
    """This rank's samples for the rest of an elastic epoch, `done` of `order` taken: every pass the
    world takes the next size * batch samples, rank r the r-th batch of them."""
    starts = range(done + rank * batch, len(order) - (size - rank) * batch + 1, size * batch)
    return np.concatenate([order[start : start + batch] for start in starts] or [order[:0]])


def _test_batches(data: Split | Datasets, rank: int, size: int):
    """This rank's share of the test set (every size-th sample from rank), in batches."""
    if isinstance(data, Datasets):
        mine = list(range(rank, len(data.test), size))
        if mine:
            yield from torch.utils.data.DataLoader(data.test, batch_size=256, sampler=mine, num_workers=0)
        return
    mine = torch.from_numpy(np.arange(rank, len(data.y_test), size))
    if len(mine):
        yield torch.from_numpy(data.x_test)[mine], torch.from_numpy(data.y_test)[mine]


def _seed_epoch(config: TrainConfig, epoch: int, rank: int) -> None:
    """Every epoch's random state derives from (seed, epoch, rank): a resumed run replays it exactly."""
    torch.manual_seed(config.seed * 100_003 + epoch * 1_009 + rank)


def evaluate(model: torch.nn.Module, task: TorchTask, backend: TorchBackend) -> float:
    """Each rank scores its share of the test set on its own device; the counts are summed."""
    model.eval()
    correct, count = 0.0, 0
    with torch.no_grad():
        for inputs, targets in _test_batches(task.data, backend.rank, backend.size):
            predicted = model(inputs.to(backend.device)).argmax(dim=1).cpu()
            correct, count = correct + float((predicted == targets).sum()), count + len(targets)
    correct_total, count_total = backend.sum([correct, float(count)], name="hvdtrain.eval")
    model.train()
    return correct_total / count_total


def _end_epoch(task, config, backend, model, optimizer, log, epoch, step, mean_loss, rate):
    """Every rank: the epoch's loss averaged over ranks, the test accuracy; rank 0 logs and saves."""
    loss_value = backend.sum([mean_loss], name="hvdtrain.loss")[0] / backend.size
    accuracy = evaluate(_unwrapped(model), task, backend) if task.evaluate else None
    metrics = {"loss": loss_value, "test_accuracy": accuracy, "lr": optimizer.param_groups[0]["lr"]}
    log.epoch(epoch + 1, config.epochs, {**metrics, "samples_per_sec": rate, "world_size": backend.size})
    if config.checkpoint and backend.rank == 0:
        save_checkpoint(log.run_dir / CHECKPOINT, model, optimizer, epoch + 1, step)
    return loss_value, accuracy


def _train_elastic(task, config, backend, model, optimizer, log, start: tuple[int, int]) -> dict:
    """Horovod elastic training: the loop runs inside hvd.elastic.run, which on a failed rank restores
    the last commit, re-forms the world and enters again, and on hosts joining re-forms it at a commit.
    Each entry recomputes what depends on the world size (schedule, learning rate, shards): the epoch
    carries on where the committed state left it, its remaining samples split over the new world."""
    hvd, samples = backend.hvd, train_size(task.data)
    commit_every = int(os.environ.get("HVDTRAIN_COMMIT_EVERY", "10"))
    state = hvd.elastic.TorchState(
        model=model, optimizer=optimizer, epoch=start[0], step=start[1], done=0, taken=0, loss_sum=0.0
    )
    throughput, outcome = Throughput(), {}
    reader = BatchReader(task.data, config.batch_size, backend.device, config.seed)

    @hvd.elastic.run
    def train_elastic(state) -> None:
        backend.refresh()
        log.is_chief, log.world_size = backend.rank == 0, backend.size
        if log.is_chief:  # rank 0 may now be on a host that has not written this run yet
            log.run_dir.mkdir(parents=True, exist_ok=True)
        schedule = Schedule.for_run(config, samples, backend.size)
        passes, batch = schedule.batches_per_step, config.batch_size
        model.train()
        while state.epoch < config.epochs:
            order = epoch_order(samples, state.epoch, config.seed)
            _seed_epoch(config, state.epoch, backend.rank)
            entered, done_at_entry = time.perf_counter(), state.done
            batches = reader(_elastic_indices(order, state.done, backend.rank, backend.size, batch))
            while (
                state.taken < schedule.steps_per_epoch
                and state.done + backend.size * batch * passes <= len(order)
            ):
                for group in optimizer.param_groups:
                    group["lr"] = schedule.lr_at(state.step)
                optimizer.zero_grad()
                for _ in range(passes):
                    inputs, targets = next(batches)
                    loss = task.loss_fn(model(inputs), targets) / passes
                    loss.backward()
                    state.loss_sum += float(loss.detach())
                    state.done += backend.size * batch
                optimizer.step()
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
                if state.step % commit_every == 0:
                    state.commit()
            rate = None  # an entry that only finishes the epoch (a reset at its end) measured nothing
            if state.done > done_at_entry:
                rate = throughput.add(state.done - done_at_entry, time.perf_counter() - entered)
            outcome["loss"], outcome["accuracy"] = _end_epoch(
                task,
                config,
                backend,
                model,
                optimizer,
                log,
                state.epoch,
                state.step,
                state.loss_sum / max(1, state.taken),
                rate,
            )
            state.epoch, state.done, state.taken, state.loss_sum = state.epoch + 1, 0, 0, 0.0
            state.commit()
        outcome["finals"] = backend.allgather_object(rank_final(parameter_digest(_unwrapped(model))))

    try:
        train_elastic(state)
    finally:
        reader.close()
    return log.finish(
        throughput,
        outcome["finals"],
        state.step,
        test_accuracy=outcome.get("accuracy"),
        final_loss=outcome.get("loss", float("nan")),
        epochs=config.epochs,
        device=str(backend.device),
    )


def run(
    build: Callable[[Any], TorchTask],
    config: TrainConfig,
    backend: TorchBackend,
    run_dir: Path,
    recipe: str,
    resume: bool = False,
) -> dict:
    torch.manual_seed(config.seed)  # identical init on every rank; the broadcast makes it certain
    return train(build(config), config, backend, run_dir, recipe, resume)


def train(
    task: TorchTask,
    config: TrainConfig,
    backend: TorchBackend,
    run_dir: Path,
    recipe: str,
    resume: bool = False,
) -> dict:
    schedule = Schedule.for_run(config, train_size(task.data), backend.size)
    device = backend.device
    model = task.model.to(device)
    optimizer = task.make_optimizer(model.parameters(), schedule.peak_lr)
    model, optimizer = backend.wrap(model, optimizer, config)
    is_chief = backend.rank == 0
    log = RunLog(run_dir, is_chief, recipe, backend.name, backend.size)
    if is_chief:
        log.scalar_writer = tensorboard_writer(run_dir / "tensorboard")

    state = None
    checkpoint_path = run_dir / CHECKPOINT
    if resume and is_chief:
        if not checkpoint_path.exists():
            raise FileNotFoundError(f"--resume: no checkpoint at {checkpoint_path}")
        saved = torch.load(checkpoint_path, weights_only=True, map_location=device)
        _unwrapped(model).load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        state = {"epoch": saved["epoch"], "step": saved["step"]}
        print(f"resuming from {checkpoint_path} at epoch {state['epoch']}", flush=True)
    if getattr(backend, "elastic", False):
        return _train_elastic(task, config, backend, model, optimizer, log, schedule.start(state))
    start_epoch, step = schedule.start(backend.broadcast_state(model, optimizer, state))

    throughput, loss_value, accuracy = Throughput(), float("nan"), None
    reader = BatchReader(task.data, config.batch_size, device, config.seed)
    try:
        passes = schedule.batches_per_step
        model.train()
        for epoch in range(start_epoch, config.epochs):
            _seed_epoch(config, epoch, backend.rank)
            indices = _rank_indices(task.data, backend.rank, backend.size, epoch, config.seed)
            batches = reader(indices[: schedule.samples_per_epoch])
            epoch_start, loss_sum = time.perf_counter(), 0.0
            steps, samples_per_step = schedule.steps_per_epoch, schedule.samples_per_step * backend.size
            for taken in range(1, steps + 1):
                lr = schedule.lr_at(step)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                if schedule.logs_lr(step):
                    log.step_lr(step, lr)
                optimizer.zero_grad()
                for _ in range(passes):
                    inputs, targets = next(batches)
                    loss = task.loss_fn(model(inputs), targets) / passes
                    loss.backward()
                    loss_sum += float(loss.detach())
                optimizer.step()
                step += 1
                elapsed = time.perf_counter() - epoch_start
                log.progress(
                    epoch, config.epochs, taken, steps, taken * samples_per_step, elapsed, loss_sum / taken
                )
            rate = throughput.add(schedule.global_samples_per_epoch, time.perf_counter() - epoch_start)
            loss_value, accuracy = _end_epoch(
                task,
                config,
                backend,
                model,
                optimizer,
                log,
                epoch,
                step,
                loss_sum / schedule.steps_per_epoch,
                rate,
            )
    finally:
        reader.close()
    finals = backend.allgather_object(rank_final(parameter_digest(_unwrapped(model))))
    return log.finish(
        throughput,
        finals,
        step,
        test_accuracy=accuracy,
        final_loss=loss_value,
        epochs=config.epochs,
        device=str(device),
    )
