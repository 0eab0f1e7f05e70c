"""`hvdtrain estimate`: memory per rank, bytes sent per step, step time and scaling efficiency of a
recipe under each strategy at world sizes this machine cannot run, from one step measured here
(hvdtrain.measure.measured_step) and a plain model of the network.

The model, on purpose no more than this: a ring collective of B bytes over N ranks sends 2(N-1)/N x B
per rank for an allreduce and (N-1)/N x B for an allgather or a reduce-scatter, and takes those bytes
over the link rate plus one latency per ring step (2(N-1) x alpha, N-1 for the halves). What a
strategy overlaps with computation is hidden: Horovod and DDP allreduce gradients while the backward
pass still makes the next ones (replayed against the times at which each gradient became ready in
the measured step), FSDP gathers the next block while this one computes, zero's allreduce and
broadcasts wait for the backward and the update. Efficiency = compute / (compute + exposed
communication). Nothing is fitted to the runs it predicts: the step is measured on one rank, the link
is given (or measured by a loopback probe), and the rest is arithmetic.

The model's functions are pure (no torch, no clock): a bench that shapes links calls `predict`
with the Step it measured; only `estimate` measures, through hvdtrain.measure.measured_step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal


@dataclass(frozen=True)
class Traffic:
    """How a strategy holds the model and moves it in a step, as estimates model it: each strategy
    declares its own (`Strategy.traffic`)."""

    overlap: Literal["fused", "buckets", "blocks", "none"]
    """What hides the collectives: the backward, fusing whatever gradients are made by the time the
    link is free (Horovod) or in fixed buckets (DDP); each block's compute hiding the next block's
    (FSDP); nothing."""
    shards: frozenset[str] = frozenset()
    """Of parameters, gradients, optimizer: what each rank keeps 1/N of."""
    gradient: Literal["allreduce", "reduce_scatter"] = "allreduce"
    parameter_gathers: int = 0
    """Allgathers of the whole parameters a step (FSDP's forward and backward; ZeRO's broadcast of
    the updated slices)."""
    gradients_sharded_at_stage_2: bool = False
    """zero_stage=2 keeps 1/N of the gradients too."""


@dataclass(frozen=True)
class Device:
    name: str
    fp32_tflops: float
    half_tflops: float
    half: str


DEVICES: dict[str, Device] = {
    "p100": Device("NVIDIA Tesla P100 SXM2", 10.6, 21.2, "fp16"),
    "v100": Device("NVIDIA Tesla V100 SXM2", 15.7, 125.0, "fp16 tensor core"),
    "a100": Device("NVIDIA A100 SXM4", 19.5, 312.0, "bf16 tensor core"),
    "h100": Device("NVIDIA H100 SXM5", 66.9, 989.4, "bf16 tensor core"),
    "h200": Device("NVIDIA H200 SXM", 66.9, 989.4, "bf16 tensor core"),
}
"""Dense peak TFLOP/s per GPU (no structured sparsity), from NVIDIA's datasheets: the Tesla P100
datasheet (SXM2, NVLink: 10.6 fp32, 21.2 fp16), the Tesla V100 datasheet (SXM2: 15.7 fp32, 125
tensor), the A100 datasheet (19.5 fp32, 312 bf16 tensor), the H100 datasheet (SXM: 67 fp32, 1,979
bf16 with sparsity, so 989.4 dense) and the H200 datasheet (the H100's arithmetic). P100 and V100
have no bfloat16: their half column is fp16, which a bf16 run would use there. The same figures as
hvdtrain.runtime.torch.speed.PEAK_TFLOPS where both list a GPU."""


def device_flops(device: Device, precision: str) -> float:
    """The device's peak FLOP/s for a run's precision (fp32, or its half-precision units)."""
    return 1e12 * (device.fp32_tflops if precision == "fp32" else device.half_tflops)


@dataclass(frozen=True)
class Step:
    """One rank's training step, measured in one process (or given, as a bench or a test gives it)."""

    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    """What the forward pass saves for the backward one (autograd's saved tensors)."""
    compute_s: float
    """Forward, backward and the optimizer's update of one batch on one rank."""
    forward_s: float
    """From the step's start to the end of the model's forward pass."""
    backward_s: float
    """From the end of the forward pass to the last gradient made."""
    ready: tuple[tuple[float, int], ...] = ()
    """(seconds after the forward pass ended, bytes of the gradient made then), in the order made;
    empty: gradients made at an even rate over the backward pass, the last layers' first."""
    blocks: int = 1
    """The modules fsdp shards one at a time."""
    batch_size: int = 0
    precision: str = "fp32"
    compressed: bool = False
    """Gradients travel in fp16 (fp16_allreduce): half the bytes."""
    zero_stage: int = 1
    flops_per_s: float | None = None
    """The rate a matmul probe reaches here, in the step's precision (what --device scales by)."""

    def scaled(self, factor: float) -> Step:
        """The same step on hardware `factor` times as slow (below 1: faster)."""
        return replace(
            self,
            compute_s=self.compute_s * factor,
            forward_s=self.forward_s * factor,
            backward_s=self.backward_s * factor,
            ready=tuple((at * factor, size) for at, size in self.ready),
            flops_per_s=None if self.flops_per_s is None else self.flops_per_s / factor,
        )

    def ready_times(self) -> list[tuple[float, int]]:
        if self.ready:
            return list(self.ready)
        pieces = 64
        return [((i + 1) * self.backward_s / pieces, self.grad_bytes // pieces) for i in range(pieces)]


@dataclass(frozen=True)
class Link:
    """What one rank's traffic goes over: the rate in Gbit/s and the latency of one ring step."""

    gbps: float
    latency_s: float = 10e-6
    source: str = "given"

    @property
    def bytes_per_s(self) -> float:
        return self.gbps * 1e9 / 8


@dataclass(frozen=True)
class Comm:
    """Horovod's fusion buffer and DDP's buckets, hvdtrain's defaults (measure.tuning)."""

    fusion_bytes: int = 128 << 20
    ddp_bucket_bytes: int = 25 << 20
    ddp_first_bucket_bytes: int = 1 << 20


@dataclass(frozen=True)
class Estimate:
    strategy: str
    world_size: int
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    sent_bytes: float
    """What one rank sends over its link in one step."""
    compute_s: float
    comm_s: float
    """How long the step's collectives keep the link busy, overlapped or not."""
    exposed_s: float
    """What of it the step waits for."""
    step_s: float
    efficiency: float

    @property
    def memory_bytes(self) -> float:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes


def allreduce_s(size: float, world_size: int, link: Link) -> float:
    """A ring allreduce of `size` bytes: 2(N-1) steps, 2(N-1)/N x size sent by each rank."""
    if world_size < 2:
        return 0.0
    steps = 2 * (world_size - 1)
    return steps * link.latency_s + steps / world_size * size / link.bytes_per_s


def gather_s(size: float, world_size: int, link: Link) -> float:
    """A ring allgather (or reduce-scatter) of `size` bytes whole: N-1 steps, (N-1)/N x size sent."""
    if world_size < 2:
        return 0.0
    steps = world_size - 1
    return steps * link.latency_s + steps / world_size * size / link.bytes_per_s


def replay(messages: Iterable[tuple[float, float]], world_size: int, link: Link) -> tuple[float, float]:
    """`messages` (ready at, bytes) allreduced one after another in order: when the last is done, and
    how long the link was busy in all."""
    free = busy = 0.0
    for ready, size in messages:
        took = allreduce_s(size, world_size, link)
        free, busy = max(free, ready) + took, busy + took
    return free, busy


def horovod_messages(ready: list[tuple[float, int]], world_size: int, link: Link, limit: int):
    """Horovod's background loop: once the link is free, it fuses every gradient made by then (up to
    the fusion buffer) into one allreduce; so a slow link sends fewer, larger messages."""
    pending, free, index = list(ready), 0.0, 0
    while index < len(pending):
        start = max(free, pending[index][0])
        size = 0
        while index < len(pending) and pending[index][0] <= start:
            if size and size + pending[index][1] > limit:
                break
            size += pending[index][1]
            index += 1
        yield start, size
        free = start + allreduce_s(size, world_size, link)


def ddp_messages(ready: list[tuple[float, int]], comm: Comm):
    """DDP's buckets, filled in the order gradients are made (the first one smaller), each sent once full."""
    size, cap = 0, comm.ddp_first_bucket_bytes
    for at, grad in ready:
        size += grad
        if size >= cap:
            yield at, size
            size, cap = 0, comm.ddp_bucket_bytes
    if size:
        yield ready[-1][0], size


def predict(
    step: Step, traffic: Traffic, world_size: int, link: Link, comm: Comm | None = None, name: str = ""
) -> Estimate:
    """One strategy (`traffic`, named `name`) at one world size: memory per rank, bytes sent, step
    time and efficiency."""
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    comm = comm or Comm()
    n, share = world_size, (world_size - 1) / world_size
    whole, grads = float(step.param_bytes), float(step.grad_bytes)
    wire = grads / 2 if step.compressed else grads
    sharded = set(traffic.shards)
    if traffic.gradients_sharded_at_stage_2 and step.zero_stage == 2:
        sharded.add("gradients")
    sizes = {"parameters": whole, "gradients": grads, "optimizer": float(step.optimizer_bytes)}
    held = {kind: size / n if kind in sharded else size for kind, size in sizes.items()}
    if traffic.gradient == "allreduce":
        sent, gradient_s = 2 * share * wire, allreduce_s(wire, n, link)
    else:
        sent, gradient_s = share * wire, gather_s(wire, n, link)
    sent += traffic.parameter_gathers * share * whole
    gathers_s = traffic.parameter_gathers * gather_s(whole, n, link)
    if n < 2:
        comm_s = exposed = 0.0
    elif traffic.overlap in ("fused", "buckets"):
        scale = wire / grads if grads else 1.0
        ready = [(at, size * scale) for at, size in step.ready_times()]
        if traffic.overlap == "fused":
            messages = horovod_messages(ready, n, link, comm.fusion_bytes)
        else:
            messages = ddp_messages(ready, comm)
        end, busy = replay(messages, n, link)
        comm_s, exposed = busy + gathers_s, max(0.0, end - step.backward_s) + gathers_s
    elif traffic.overlap == "blocks":
        forward = gather_s(whole, n, link) if traffic.parameter_gathers else 0.0
        backward = gathers_s - forward + gradient_s
        comm_s = forward + backward
        blocks = max(1, step.blocks)
        # the first block's gather and the last block's reduce-scatter have nothing to hide behind
        exposed = (
            forward / blocks
            + max(0.0, forward * (blocks - 1) / blocks - step.forward_s)
            + backward / blocks
            + max(0.0, backward * (blocks - 1) / blocks - step.backward_s)
        )
    else:
        comm_s = exposed = gradient_s + gathers_s
    step_s = step.compute_s + exposed
    return Estimate(
        strategy=name,
        world_size=n,
        param_bytes=held["parameters"],
        grad_bytes=held["gradients"],
        optimizer_bytes=held["optimizer"],
        activation_bytes=float(step.activation_bytes),
        sent_bytes=sent if n > 1 else 0.0,
        compute_s=step.compute_s,
        comm_s=comm_s,
        exposed_s=exposed,
        step_s=step_s,
        efficiency=step.compute_s / step_s if step_s > 0 else 1.0,
    )


def predict_all(
    step: Step,
    traffics: Mapping[str, Traffic],
    world_sizes: Sequence[int],
    link: Link,
    comm: Comm | None = None,
) -> list[Estimate]:
    """Each strategy (name -> its traffic) at each world size, strategy by strategy."""
    return [predict(step, t, n, link, comm, name) for name, t in traffics.items() for n in world_sizes]


def on_device(step: Step, device: Device | None, compute_ms: float | None) -> tuple[Step, str]:
    """The measured step as it would run on `device` (the step's share of this machine's matmul rate
    carried over to the device's peak) or taking `compute_ms`, and a line saying which."""
    if compute_ms is not None:
        factor = compute_ms / 1000 / step.compute_s
        return step.scaled(factor), f"as given (--compute-ms); {1000 * step.compute_s:.1f} ms measured here"
    if device is None:
        return step, "measured here"
    if not step.flops_per_s:
        raise ValueError("--device needs this machine's matmul rate, which was not measured")
    peak = device_flops(device, step.precision)
    kind = "fp32" if step.precision == "fp32" else device.half
    line = (
        f"{1000 * step.compute_s:.1f} ms measured here at a matmul rate of {step.flops_per_s / 1e9:.3g} "
        f"GFLOP/s, scaled to a {device.name}'s {peak / 1e12:g} TFLOP/s {kind}"
    )
    return step.scaled(step.flops_per_s / peak), line


def parse_world_sizes(text: str) -> list[int]:
    """--np: comma-separated positive integers, or a ValueError naming what is wrong."""
    parts = [part.strip() for part in str(text).split(",")]
    try:
        values = [int(part) for part in parts]
    except ValueError:
        raise ValueError(f"--np: expected comma-separated positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"--np: expected comma-separated positive integers, got {text!r}")
    return list(dict.fromkeys(values))


def parse_device(name: str | None) -> Device | None:
    if name is None:
        return None
    if name.lower() not in DEVICES:
        raise ValueError(f"--device: unknown device {name!r}; choose from {', '.join(DEVICES)}")
    return DEVICES[name.lower()]


def check_link(gbps: float, latency_us: float) -> None:
    if not (math.isfinite(gbps) and gbps > 0):
        raise ValueError(f"--link-gbps must be a positive number of Gbit/s, got {gbps:g}")
    if not (math.isfinite(latency_us) and latency_us >= 0):
        raise ValueError(f"--latency-us must be >= 0, got {latency_us:g}")
