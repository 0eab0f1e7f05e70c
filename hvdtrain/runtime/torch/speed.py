"""What makes a torch step fast on its device, and how fast it was: channels-last for conv nets,
compiling the model whole or block by block, waiting for a GPU before reading a clock, and the
figures a run reports beside samples/s (tokens/s, model FLOPs utilisation, peak device memory)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import torch

from hvdtrain.config import TrainConfig
from hvdtrain.runtime.torch.batches import first_sample
from hvdtrain.runtime.torch.task import TorchTask

PEAK_TFLOPS = (  # dense (no sparsity) per GPU by NVIDIA's datasheets: (name contains, bf16/fp16, fp32)
    ("H100 PCIe", 756.0, 51.2),
    ("H100", 989.4, 66.9),  # SXM (H100 80GB HBM3)
    ("H200", 989.4, 66.9),  # the H100's chip with more memory: the same arithmetic rates
    ("GH200", 989.4, 66.9),
    ("A100", 312.0, 19.5),
    ("L40S", 362.05, 91.6),
    ("A10G", 70.0, 31.2),
)
"""Where a name matches more than one row, the first wins (so "H100 PCIe" before "H100")."""
PEAK_VARIABLE = "HVDTRAIN_PEAK_TFLOPS"
"""Overrides the table: the peak of one rank's device in the run's precision, in TFLOP/s."""


def settle(device: torch.device) -> None:
    """Wait for the work queued on a GPU, so that a clock read next counts it done."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def deterministic_kernels(on: bool) -> Iterator[None]:
    """With `on`: torch's deterministic kernels for the block (an operation that has none raises,
    naming itself), cuBLAS's fixed workspace where none is set (read when its first handle is made)
    and no cuDNN benchmarking; torch's settings as they were afterwards."""
    if not on:
        yield
        return
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.benchmark = before[1]


def wants_channels_last(config: TrainConfig, model: torch.nn.Module, device: torch.device) -> bool:
    """channels_last where asked, and by default (auto) for a model with 2-D convolutions on a GPU,
    whose convolution kernels read NHWC without a transposition."""
    if config.memory_format != "auto":
        return config.memory_format == "channels_last"
    return device.type == "cuda" and any(isinstance(m, torch.nn.Conv2d) for m in model.modules())


def compile_model(model: torch.nn.Module, blocks: list[torch.nn.Module] | None) -> None:
    """torch.compile the forward of the whole model, or of each block (regional: a transformer's
    identical layers compile once and share the code, in a fraction of the whole model's compile
    time). Only forwards are replaced: the modules, their state_dict's names and hooks stay."""
    for module in [model] if blocks is None else blocks:
        module.forward = torch.compile(module.forward)


def peak_flops(device: torch.device, precision: str) -> tuple[float, str] | None:
    """One device's dense peak in FLOP/s for the run's precision and where the figure comes from;
    None where unknown (a CPU, a GPU not in the table)."""
    given = os.environ.get(PEAK_VARIABLE)
    if given:
        return float(given) * 1e12, f"{PEAK_VARIABLE}={given}"
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for pattern, half, single in PEAK_TFLOPS:
        if pattern in name:
            tflops = single if precision == "fp32" else half
            kind = "fp32" if precision == "fp32" else "bf16/fp16 tensor-core"
            return tflops * 1e12, f"{name}: {tflops:g} TFLOP/s dense {kind} (datasheet)"
    return None


def counted_flops(
    model: torch.nn.Module, sample: torch.Tensor, target: torch.Tensor, loss_fn: Callable
) -> float:
    """FLOPs of one sample's forward, loss and backward, counted by torch's FlopCounterMode on the
    model as it is (in eval mode: no running statistics updated, no random numbers drawn)."""
    from torch.utils.flop_counter import FlopCounterMode

    was_training = model.training
    model.eval()
    try:
        with FlopCounterMode(display=False) as counter:
            loss_fn(model(sample), target).backward()
    finally:
        model.train(was_training)
        for parameter in model.parameters():
            parameter.grad = None
    return float(counter.get_total_flops())


def peak_memory_bytes(device: torch.device) -> int | None:
    """The most this process held on its GPU at once (torch's allocator), None on a CPU."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def training_flops(
    task: TorchTask,
    model: torch.nn.Module,
    config: TrainConfig,
    device: torch.device,
    memory_format: torch.memory_format | None,
) -> tuple[float, float, str] | None:
    """(FLOPs of one training sample, the device's peak FLOP/s, its source) where the peak is known:
    the recipe's count, else one sample's step counted on the device."""
    peak = peak_flops(device, config.precision)
    if peak is None:
        return None
    if task.flops_per_sample is not None:
        return task.flops_per_sample, *peak
    sample, target = first_sample(task.data)
    sample = sample.to(device)
    if memory_format is not None and sample.dim() == 4:
        sample = sample.contiguous(memory_format=memory_format)
    return counted_flops(model, sample, target.to(device), task.loss_fn), *peak


def rates(
    task: TorchTask, flops: tuple[float, float, str] | None, steady: float | None, devices: int
) -> dict[str, float | str]:
    """tokens/s where a sample holds tokens, and the model FLOPs utilisation of the steady rate where
    the peak is known: over the peak of every device in use (ranks that share a GPU count it once)."""
    found: dict[str, float | str] = {}
    if task.tokens_per_sample and steady is not None:
        found["tokens_per_sec"] = steady * task.tokens_per_sample
    if flops is not None and steady is not None:
        per_sample, peak, source = flops
        found |= {
            "flops_per_sample": per_sample,
            "mfu": per_sample * steady / (peak * devices),
            "peak_flops": peak,
            "peak_flops_source": source,
        }
    return found
