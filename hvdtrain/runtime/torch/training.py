"""What the PyTorch loops share: the fixed-size world and Horovod's elastic one (loop.py) take the
same step, end an epoch the same way (the loss averaged over ranks, evaluation, the checkpoint and the
best one, early stopping) and finish the same report; written once here so that they cannot drift."""

from __future__ import annotations

import importlib.util
import math
import sys
import time
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from hvdtrain.config import TrainConfig
from hvdtrain.runtime import metrics
from hvdtrain.runtime.checkpoint_write import keep_best
from hvdtrain.runtime.common import RunLog, Throughput, digest, rank_final
from hvdtrain.runtime.divergence import Guard
from hvdtrain.runtime.metrics import Watch
from hvdtrain.runtime.stragglers import Stragglers
from hvdtrain.runtime.torch.backends import TorchBackend, local, whole
from hvdtrain.runtime.torch.batches import test_batches
from hvdtrain.runtime.torch.checkpointer import Checkpointer, unwrapped
from hvdtrain.runtime.torch.precision import Precision
from hvdtrain.runtime.torch.speed import peak_memory_bytes, rates
from hvdtrain.runtime.torch.task import TorchTask
from hvdtrain.runtime.torch.within import stacked

Batches = Iterator[tuple[torch.Tensor, torch.Tensor]]


def tensorboard_writer(log_dir: Path) -> Callable[[str, float, int], None] | None:
    """None where TensorBoard (the torch extra's) is not installed: metrics.jsonl has every scalar."""
    if importlib.util.find_spec("tensorboard") is None:
        print(
            f"hvdtrain: no {log_dir.name}/: tensorboard is not installed (pip install tensorboard)",
            flush=True,
        )
        return None
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
    """Collective where the parameters are sharded (every rank gathers each whole)."""
    return digest(whole(t).detach().cpu().contiguous().numpy().tobytes() for t in model.state_dict().values())


@dataclass
class Training:
    """What one run's loop works with, made once by train() for the fixed and the elastic loop, and
    the one step both take."""

    task: TorchTask
    config: TrainConfig
    backend: TorchBackend
    checkpointer: Checkpointer
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    amp: Precision
    log: RunLog
    watch: Watch
    memory_format: torch.memory_format | None = None
    """channels_last for a conv net's image batches (and weights), else None: as they come."""
    flops: tuple[float, float, str] | None = None
    """FLOPs of one training sample, the device's peak FLOP/s and where that figure comes from;
    None where the peak is unknown (the run reports no model FLOPs utilisation)."""
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    """The task's loss as the step calls it (compiled where the model is); None: the task's own."""
    guard: Guard | None = None
    """Stops a run whose loss or gradient is not finite (hvdtrain.runtime.divergence)."""
    stragglers: Stragglers | None = None
    """Names a rank slower than the others to be ready to average gradients; None: not watched."""
    last_gradient: Callable[[], float] | None = None
    """Where the backend averages gradients during backward (ddp): when backward produced this
    step's last gradient, which is when the rank was ready; None: the average's entry is."""
    times: tuple[float | None, float] = (None, 0.0)
    """The last step's time to ready (None where not watched) and its whole time, in seconds."""

    def step(
        self, batches: Batches, passes: int, lr: float
    ) -> tuple[torch.Tensor, torch.Tensor | None, bool]:
        """One optimizer update at learning rate `lr`: `passes` batches forward (in the run's
        precision) and backward, their gradients accumulated and averaged across ranks (by the
        backend), unscaled, clipped to clip_grad_norm, then the step. Returns this rank's loss of the
        step (a float64 tensor on the device: reading it would wait for a GPU), the averaged
        gradient's norm before clipping (None without clipping, unless the guard skips bad steps) and
        whether the update was skipped (fp16's overflow, or the guard's non-finite gradient)."""
        model, optimizer, amp, clip = self.model, self.optimizer, self.amp, self.config.clip_grad_norm
        began = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.backend.device)
        for _ in range(passes):
            inputs, targets = next(batches)
            with amp.autocast():
                outputs = model(inputs)
                loss = (self.loss_fn or self.task.loss_fn)(outputs, targets) / passes
            amp.computed_in = outputs.dtype
            amp.backward(loss)
            loss_sum += loss.detach().double()  # float64, as Python would add the floats
        ready = time.perf_counter() if self.last_gradient is None else self.last_gradient()
        with self.backend.averaged_gradients(optimizer):
            amp.unscale(optimizer, self.backend.agree_on_overflow)
            # a tensor: reading it every step would wait for a GPU
            norm = None if clip is None else self.backend.clip_grad_norm(model, optimizer, clip)
            if norm is None and self.guard is not None and self.guard.skips:
                norm = self.backend.clip_grad_norm(model, optimizer, math.inf)
            if self.guard is not None and self.guard.skips and not bool(torch.isfinite(norm)):
                skipped = True  # the same on every rank: the norm is of the averaged gradient
            else:
                skipped = amp.step(optimizer)
        amp.update()
        watched = self.stragglers is not None
        self.times = (ready - began if watched else None, time.perf_counter() - began)
        return loss_sum, norm, skipped

    def after_step(
        self, step: int, epoch: int, loss: torch.Tensor, norm: torch.Tensor | None, skipped: bool
    ) -> None:
        if self.stragglers is not None:
            self.stragglers.after_step(step, *self.times)
        if self.guard is None:
            return
        values = loss if norm is None else torch.stack([loss, norm.detach().double()])
        self.guard.after_step(step, epoch, values, skipped, lambda: float(norm if norm is not None else loss))

    def settle(self, step: int, epoch: int) -> None:
        """Before a checkpoint and at an epoch's end: nothing written once the run diverged."""
        if self.guard is not None:
            self.guard.settle(step, epoch, lambda: finite(self.model))

    def saved(self, step: int) -> None:
        if self.guard is not None:
            self.guard.saved(step)


def watch_stragglers(
    config: TrainConfig, backend: TorchBackend, model: torch.nn.Module
) -> tuple[Stragglers | None, Callable[[], float] | None]:
    """The run's watch for a slow rank and, where gradients are averaged during backward, the clock
    of the last gradient (hooks on every parameter). None where slow_rank_every_steps is 0, and where
    a forward pass is collective (fsdp's gathers, DDP's broadcast of buffers): there a rank's time to
    ready would hold its wait for the others, as under synchronized batch norm. None at one rank:
    nobody to compare."""
    has_buffers = next(model.buffers(), None) is not None
    broadcasts_buffers = getattr(model, "broadcast_buffers", False) and has_buffers
    every, factor, checks = config.slow_rank_every_steps, config.slow_rank_factor, config.slow_rank_checks
    if (
        not every
        or backend.size < 2
        or backend.forwards_are_collective
        or broadcasts_buffers
        or config.sync_batch_norm
    ):
        return None, None
    stragglers = Stragglers(
        factor, checks, every, backend.rank, backend.size, backend.sum, backend.allgather_object
    )
    if not getattr(backend, "gradients_averaged_in_backward", False):
        return stragglers, None
    at = [0.0]

    def mark(_: torch.Tensor) -> None:
        at[0] = time.perf_counter()

    for parameter in model.parameters():
        if parameter.requires_grad:
            parameter.register_post_accumulate_grad_hook(mark)
    return stragglers, lambda: at[0]


def read_later(values: list[torch.Tensor]) -> Callable[[], list[list[float]]]:
    """Start copying these figures off the device; what is returned waits for the copy alone (on a
    GPU, into pinned memory behind an event, so neither call waits for the steps queued since)."""
    stacked = torch.stack([value.double().reshape(-1) for value in values])
    if stacked.device.type != "cuda":
        return lambda: stacked.tolist()
    host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
    host.copy_(stacked, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def rows() -> list[list[float]]:
        copied.synchronize()
        return host.tolist()

    return rows


def finite(model: torch.nn.Module) -> bool:
    """Whether this rank's parameters (its shards, under fsdp) are all finite."""
    flags = [torch.isfinite(local(p)).all() for p in model.parameters()]
    return bool(torch.stack(flags).all()) if flags else True


def evaluate(model: torch.nn.Module, task: TorchTask, backend: TorchBackend) -> dict[str, float]:
    """The task's metrics over the test set: each rank scores its share on its own device, and the
    sums are added up across ranks."""
    model.eval()
    names = list(task.metrics)
    sums, count, batches = [0.0] * len(names), 0, 0
    with torch.no_grad():
        for inputs, targets in test_batches(task.data, backend.rank, backend.size):
            outputs = model(inputs.to(backend.device)).cpu()
            sums = [
                total + task.metrics[name](outputs, targets) for total, name in zip(sums, names, strict=True)
            ]
            count += len(targets)
            batches += 1
        if backend.forwards_are_collective:  # as many forwards as the rank with most
            spare = next(test_batches(task.data, 0, backend.size))[0].to(backend.device)
            for _ in range(max(backend.allgather_object(batches)) - batches):
                model(spare)
    *totals, count_total = backend.sum([*sums, float(count)], name="hvdtrain.eval")
    model.train()
    return {
        name: metrics.finish(name, total / count_total) for name, total in zip(names, totals, strict=True)
    }


def end_epoch(t: Training, epoch: int, step: int, mean_loss: float, rate, norms: list[torch.Tensor]):
    """Every rank: the epoch's loss averaged over ranks, the test metrics, the checkpoint (and the
    best one), whether to stop early; rank 0 logs (with the mean norm of the averaged gradient before
    clipping over the steps where it was finite: an fp16 step that overflowed was skipped). Returns
    the loss, the test metrics and whether every rank stops here."""
    task, config, backend, model, log = t.task, t.config, t.backend, t.model, t.log
    t.settle(step, epoch)
    loss_value = backend.sum([mean_loss], name="hvdtrain.loss")[0] / backend.size
    backend.average_buffers(unwrapped(model))
    if task.evaluate:
        tested = {f"test_{name}": value for name, value in evaluate(unwrapped(model), task, backend).items()}
    else:
        tested = {f"test_{name}": None for name in task.metrics}
    metrics = {"loss": loss_value, **tested, "lr": t.optimizer.param_groups[0]["lr"]}
    finite = [n for n in stacked(norms, backend.device).cpu().tolist() if math.isfinite(n)] if norms else []
    if finite:
        metrics["grad_norm"] = sum(finite) / len(finite)
    log.epoch(epoch + 1, config.epochs, {**metrics, "samples_per_sec": rate, "world_size": backend.size})
    improved = t.watch.observe(metrics)
    if config.checkpoint:
        position = {"epoch": epoch + 1, "step": step, **t.amp.state_dict(), "watch": t.watch.state_dict()}
        best = {"monitor": config.monitor, "value": t.watch.best, "epoch": epoch + 1}
        then = partial(keep_best, log.run_dir, step, best) if improved and log.is_chief else None
        t.checkpointer.save(log.run_dir, model, t.optimizer, position, config.keep_checkpoints, then)
        t.saved(step)
    return loss_value, tested, t.watch.agree_to_stop(backend, epoch + 1)


def held_bytes(tensors: Iterable[Any]) -> int:
    """What this rank holds of them (of a DTensor, its own shard)."""
    return sum(local(t).numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def finish(t: Training, throughput: Throughput, step: int, loss_value: float, tested: dict) -> dict:
    """Every rank, after its last epoch: the run's report, from what every rank gathers (its final
    weights, what it holds, its device and the most memory it used there)."""
    t.checkpointer.flush()  # the run is done once its last checkpoint is
    model = unwrapped(t.model)
    mine = (  # this rank's final weights, what it keeps of the model and the optimizer's state
        # (sharded under zero), the most it held on its GPU, and its device
        rank_final(parameter_digest(model)),
        held_bytes(model.parameters()),
        held_bytes(value for state in t.optimizer.state.values() for value in state.values()),
        peak_memory_bytes(t.backend.device),
        str(t.backend.device),
    )
    finals, params, states, peaks, devices = map(list, zip(*t.backend.allgather_object(mine), strict=True))
    hosts = [final[1] for final in finals]
    in_use = len(set(zip(hosts, devices, strict=True)))  # a GPU that ranks share counts once
    return t.log.finish(
        throughput,
        finals,
        step,
        tested,
        loss_value,
        t.config.epochs,
        device=str(t.backend.device),
        compute_dtype=t.amp.computed,
        param_bytes=params,
        optimizer_state_bytes=states,
        devices=devices,
        peak_device_memory_bytes=peaks if mine[3] is not None else None,
        **rates(t.task, t.flops, throughput.steady, in_use),
        **t.watch.summary(),
        nonfinite_skipped=t.guard.skipped if t.guard is not None else 0,
        **(t.stragglers.summary() if t.stragglers is not None else {}),
    )
