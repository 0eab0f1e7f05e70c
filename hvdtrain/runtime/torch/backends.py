"""What differs between ways of parallelising torch: a small `TorchBackend`, which also owns the device.

Horovod pins each rank to the GPU of its local rank, else the CPU, and the loop moves every batch
there. The backend builds the optimizer from what the task gives, wraps the model, reduces metrics
and gives the checkpointer, so a sharding backend can own its optimizer's state and save it per rank.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from hvdtrain.config import TrainConfig
from hvdtrain.runtime.common import fp16_allreduce
from hvdtrain.runtime.torch import sync_batch_norm
from hvdtrain.runtime.torch.checkpointer import Checkpointer, Rank0Checkpointer
from hvdtrain.runtime.torch.task import TorchTask, make_optimizer


class TorchBackend(Protocol):
    name: str
    rank: int
    size: int
    device: torch.device
    """Where the model lives and every batch goes."""

    def build_optimizer(
        self, task: TorchTask, model: torch.nn.Module, lr: float, config: TrainConfig
    ) -> torch.optim.Optimizer:
        """The optimizer the loop steps, over `model` on its device (before wrap_model)."""
        ...

    def wrap_model(self, model: torch.nn.Module, config: TrainConfig) -> torch.nn.Module: ...

    def sync_batch_norm(self, model: torch.nn.Module) -> torch.nn.Module:
        """`model` with its BatchNorm layers normalizing over every rank's batch (before the
        optimizer is built and the model wrapped)."""
        ...

    def averaged_gradients(self, optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager:
        """After the backward passes of a step: inside, every gradient is the average over ranks, and
        `optimizer.step()` applies them as they are (what is clipped or unscaled there stays so)."""
        ...

    def clip_grad_norm(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_norm: float
    ) -> torch.Tensor:
        """Inside averaged_gradients: the averaged gradient scaled to at most `max_norm` in L2 over
        every parameter; returns its norm before."""
        ...

    agree_on_overflow: Callable[[torch.Tensor], None] | None
    """Inside averaged_gradients, after the loss scale's unscale: makes the flag of a non-finite
    gradient the same on every rank; None where every rank unscaled the whole averaged gradient."""

    forwards_are_collective: bool
    channels_last_parameters: bool
    """Whether parameters may lie channels_last (fsdp splits only contiguous ones into shards, and
    Horovod's collectives take only contiguous tensors; there conv nets take channels_last batches
    with contiguous weights)."""

    """Each forward pass gathers parameters from every rank (fsdp): every rank runs as many,
    evaluation too."""

    def broadcast_state(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any] | None
    ) -> dict[str, Any] | None:
        """Collective: every rank ends with rank 0's model, optimizer state and `extra`."""
        ...

    def average_buffers(self, model: torch.nn.Module) -> None:
        """Collective, before evaluating and saving: the model's floating-point buffers (BatchNorm's
        running statistics, which each rank gathers from its own batches) averaged over ranks, so
        every rank evaluates, and ends with, the same model."""
        ...

    def sum(self, values: list[float], name: str) -> list[float]: ...

    def allgather_object(self, value: Any) -> list[Any]: ...

    def checkpointer(self) -> Checkpointer: ...


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (fsdp's parameters, their gradients and state); any other
    tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """Collective for a DTensor (every rank, in the same order): the whole tensor on every rank."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def rank_device(local_rank: int) -> torch.device:
    """The GPU of this rank's local rank (and current), else the CPU. Where a host runs more ranks
    than it has GPUs, ranks share them round-robin (local rank modulo the count)."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def set_threads() -> None:
    torch.set_num_threads(int(os.environ.get("HVDTRAIN_THREADS_PER_RANK", torch.get_num_threads())))


def squared_sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The sum of squares of every element, in float64 (each tensor's float64 norm, squared): its
    float32 square root is the same however the elements are split into tensors (whole parameters
    here, ZeRO's slices there), but at a rounding of float64. One multi-tensor kernel for all of them
    (a few kernels a parameter would cost a GPU step its launches)."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64)
    norms = torch._foreach_norm([t.detach() for t in tensors], 2, dtype=torch.float64)
    return torch.stack(norms).square().sum()


def clip_to_norm(grads: list[torch.Tensor], squared: torch.Tensor, max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_ from the squared norm: each gradient scaled by max_norm / (norm +
    1e-6), at most 1; returns the norm (float32) before."""
    norm = squared.sqrt().float()
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad in grads:
        by_kind.setdefault((grad.device, grad.dtype), []).append(grad)
    for (device, dtype), same in by_kind.items():
        torch._foreach_mul_(same, coefficient.to(device, dtype))
    return norm


def clip_whole_gradient(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_norm: float
) -> torch.Tensor:
    """Where every rank holds the whole averaged gradient."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return clip_to_norm(grads, squared_sum(grads), max_norm)


def floating_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers averaging makes sense of (not BatchNorm's integer count of batches, which every
    rank has the same)."""
    return [(name, b) for name, b in model.named_buffers() if b.is_floating_point()]


class LocalTorch:
    """One process, no communication: the in-process test tier, and DataParallel's base."""

    name = "local"
    rank, size = 0, 1

    def __init__(self, device: str = "cpu") -> None:
        self.device = torch.device(device)

    def build_optimizer(self, task, model, lr, config):
        return make_optimizer(task, model, lr)

    def wrap_model(self, model, config):
        return model

    def sync_batch_norm(self, model):
        return model  # one process: its batch is the global one

    def averaged_gradients(self, optimizer):
        return contextlib.nullcontext()  # one process: its gradients are the average

    clip_grad_norm = staticmethod(clip_whole_gradient)
    agree_on_overflow = None  # one process
    forwards_are_collective = False
    channels_last_parameters = True

    def broadcast_state(self, model, optimizer, extra):
        return extra

    def average_buffers(self, model):
        pass

    def sum(self, values, name):
        return list(values)

    def allgather_object(self, value):
        return [value]

    def checkpointer(self) -> Checkpointer:
        return Rank0Checkpointer(self)


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

    def wrap_model(self, model, config):
        if not self.device_ids:
            return model
        return torch.nn.DataParallel(model, device_ids=self.device_ids)


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
        self.device = rank_device(hvd.local_rank())  # hvd: one GPU per rank, chosen by local rank
        set_threads()

    def build_optimizer(self, task, model, lr, config):
        hvd = self.hvd
        return hvd.DistributedOptimizer(
            make_optimizer(task, model, lr),
            named_parameters=model.named_parameters(),
            compression=hvd.Compression.fp16 if fp16_allreduce(config) else hvd.Compression.none,
            backward_passes_per_step=config.backward_passes_per_step,
            op=hvd.Adasum if config.reduce_op == "adasum" else hvd.Average,
        )

    def wrap_model(self, model, config):
        return model

    def sync_batch_norm(self, model):
        return sync_batch_norm.for_horovod(model, self.device)

    @contextlib.contextmanager
    def averaged_gradients(self, optimizer) -> Iterator[None]:
        # Horovod's order for touching averaged gradients: wait for the allreduces, then step
        # without a second synchronize (which would allreduce the modified gradients again).
        # Adasum's optimizer combines updates inside its step, and has no averaged gradient to
        # hand out (clipping under Adasum is refused with the config).
        # Horovod builds its optimizer class from the methods of one of its two, so look at those.
        adasum = self.hvd.optimizer._DistributedAdasumOptimizer
        if type(optimizer).__dict__.get("skip_synchronize") is adasum.__dict__["skip_synchronize"]:
            yield
            return
        optimizer.synchronize()
        with optimizer.skip_synchronize():
            yield

    clip_grad_norm = staticmethod(clip_whole_gradient)
    agree_on_overflow = None  # every rank unscaled the same averaged gradient
    forwards_are_collective = False
    # Horovod's collectives refuse tensors that are not contiguous, and a channels_last weight's
    # gradient is channels_last: conv nets take channels_last batches with contiguous weights.
    channels_last_parameters = False

    def broadcast_state(self, model, optimizer, extra):
        self.hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        self.hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        return self.hvd.broadcast_object(extra, root_rank=0, name="hvdtrain.extra")

    def average_buffers(self, model):
        for name, buffer in floating_buffers(model):
            self.hvd.allreduce_(buffer, op=self.hvd.Average, name=f"hvdtrain.buffer.{name}")

    def sum(self, values, name):
        tensor = torch.tensor(values, dtype=torch.float64)
        return self.hvd.allreduce(tensor, op=self.hvd.Sum, name=name).tolist()

    def allgather_object(self, value):
        return self.hvd.allgather_object(value, name="hvdtrain.gather")

    def checkpointer(self) -> Checkpointer:
        return Rank0Checkpointer(self)

    def refresh(self) -> None:
        """After an elastic reset: this rank's new place in a world of a new size."""
        self.rank, self.size = self.hvd.rank(), self.hvd.size()
