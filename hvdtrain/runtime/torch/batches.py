"""A rank's data, batch by batch, on its device: which samples each rank takes in an epoch (fixed
world or elastic), read from arrays in memory or from datasets on disk through DataLoader workers."""

from __future__ import annotations

import os

import numpy as np
import torch

from hvdtrain.config import TrainConfig
from hvdtrain.data import Split, shard_indices
from hvdtrain.runtime.torch.task import Datasets


def train_size(data: Split | Datasets) -> int:
    return len(data.train) if isinstance(data, Datasets) else len(data.y_train)


ON_DEVICE_VARIABLE = "HVDTRAIN_DATA_ON_GPU_MB"
ON_DEVICE_MB = 4096
"""Arrays up to this size (MiB, inputs and targets together) are copied to a GPU once and batches
are gathered there; larger ones stay in host memory and each batch is copied from pinned memory."""


def on_device_limit(environ: dict[str, str] | None = None) -> int:
    """Bytes of arrays kept whole on a GPU (HVDTRAIN_DATA_ON_GPU_MB, 0: never)."""
    value = (os.environ if environ is None else environ).get(ON_DEVICE_VARIABLE)
    try:
        megabytes = float(value) if value else ON_DEVICE_MB
    except ValueError:
        megabytes = ON_DEVICE_MB
    return int(max(megabytes, 0) * 2**20)


class BatchReader:
    """(inputs, targets) on the device, batch after batch of the indices given (a short last batch is
    dropped). Arrays are indexed in memory: on a GPU, arrays that fit (on_device_limit) are copied
    there once and each batch is gathered on the GPU; larger ones are gathered into pinned host memory
    and copied without blocking, while the GPU still runs the step before. Datasets are read by one
    DataLoader for the whole run, whose worker processes stay up across epochs and read ahead of
    training (into pinned memory on a GPU): each epoch only changes the indices its sampler hands out.
    Image batches are laid out as `memory_format` says (channels_last for a conv net on a GPU)."""

    def __init__(
        self,
        data: Split | Datasets,
        batch_size: int,
        device: torch.device,
        seed: int = 0,
        memory_format: torch.memory_format | None = None,
    ) -> None:
        self.data, self.batch_size, self.device = data, batch_size, device
        self.memory_format = memory_format
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
            self.resident = device.type == "cuda" and self.x.nbytes + self.y.nbytes <= on_device_limit()
            if self.resident:
                self.x, self.y = self.x.to(device), self.y.to(device)

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

    def laid_out(self, inputs: torch.Tensor) -> torch.Tensor:
        if self.memory_format is None or inputs.dim() != 4:
            return inputs
        return inputs.contiguous(memory_format=self.memory_format)

    def __call__(self, indices: np.ndarray | list[int]):
        device = self.device
        if self.loader is not None:
            self.indices = [int(i) for i in indices]
            for inputs, targets in self.loader:
                inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
                yield self.laid_out(inputs), targets
            return
        order = torch.from_numpy(np.asarray(indices, dtype=np.int64))
        pinned = device.type == "cuda"
        if pinned and self.resident:  # the epoch's indices in one copy, then no host-to-GPU copy a step
            order, pinned = order.pin_memory().to(device, non_blocking=True), False
        for start in range(0, len(order) - self.batch_size + 1, self.batch_size):
            chosen = order[start : start + self.batch_size]
            inputs, targets = self.x[chosen], self.y[chosen]
            if pinned:  # torch's pinned-memory cache keeps a block until its copy has run
                inputs, targets = inputs.pin_memory(), targets.pin_memory()
            yield (
                self.laid_out(inputs.to(device, non_blocking=True)),
                targets.to(device, non_blocking=True),
            )


def first_sample(data: Split | Datasets) -> tuple[torch.Tensor, torch.Tensor]:
    """The first training sample as a batch of one (input, target)."""
    if isinstance(data, Datasets):
        inputs, target = data.train[0]
        return torch.as_tensor(inputs)[None], torch.as_tensor(target)[None]
    return torch.from_numpy(data.x_train[:1]), torch.from_numpy(data.y_train[:1])


def rank_indices(
    data: Split | Datasets, rank: int, size: int, epoch: int, seed: int
) -> np.ndarray | list[int]:
    """This rank's samples of one epoch. A dataset with an order of its own (tar shards: a contiguous
    run of shards each) gives it; other datasets are sharded by torch's DistributedSampler; arrays by
    shard_indices, the same rule (one shared permutation, trimmed, every size-th from rank)."""
    if isinstance(data, Datasets) and hasattr(data.train, "rank_indices"):
        return data.train.rank_indices(rank, size, epoch, seed)
    if isinstance(data, Datasets):
        sampler = torch.utils.data.DistributedSampler(
            data.train, num_replicas=size, rank=rank, shuffle=True, seed=seed, drop_last=True
        )
        sampler.set_epoch(epoch)
        return list(sampler)
    return shard_indices(len(data.y_train), rank, size, epoch, seed)


def elastic_indices(order: np.ndarray, done: int, rank: int, size: int, batch: int) -> np.ndarray:
    """This rank's samples for the rest of an elastic epoch, `done` of `order` taken: every pass the
    world takes the next size * batch samples, rank r the r-th batch of them."""
    starts = range(done + rank * batch, len(order) - (size - rank) * batch + 1, size * batch)
    return np.concatenate([order[start : start + batch] for start in starts] or [order[:0]])


TEST_BATCH = 256


def test_batches(data: Split | Datasets, rank: int, size: int):
    """This rank's share of the test set (every size-th sample from rank), in batches."""
    if isinstance(data, Datasets):
        mine = list(range(rank, len(data.test), size))
        if mine:
            yield from torch.utils.data.DataLoader(
                data.test, batch_size=TEST_BATCH, sampler=mine, num_workers=0
            )
        return
    x, y = torch.from_numpy(data.x_test), torch.from_numpy(data.y_test)
    mine = torch.from_numpy(np.arange(rank, len(data.y_test), size))
    for start in range(0, len(mine), TEST_BATCH):  # a ResNet's activations of a whole test set would not fit
        chosen = mine[start : start + TEST_BATCH]
        yield x[chosen], y[chosen]


def seed_epoch(config: TrainConfig, epoch: int, rank: int) -> None:
    """Every epoch's random state derives from (seed, epoch, rank): a resumed run replays it exactly."""
    torch.manual_seed(config.seed * 100_003 + epoch * 1_009 + rank)
