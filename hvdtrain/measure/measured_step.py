"""The measuring half of `hvdtrain estimate`, and the command's report: a torch recipe's model and
optimizer built in this process as a run builds them, a few real training steps on its own batches,
what the tensors hold, what autograd saves for the backward pass, when each gradient is made; a
matmul probe of this machine's rate; a probe of this host's loopback link with two gloo processes.
`estimate` measures, then asks the model (hvdtrain.measure.estimate) about each strategy."""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from hvdtrain.measure.estimate import (
    Device,
    Estimate,
    Link,
    Step,
    Traffic,
    on_device,
    predict_all,
)


def measure_step(recipe: Any, config: Any, steps: int = 5, warmup: int = 1) -> Step:
    """One rank's step of `recipe` under `config` on the CPU: the median of `steps` timed steps after
    `warmup` untimed ones (the first step allocates the optimizer's state and warms the allocator; a
    median, as a shared machine stalls a step now and then).
    The step is the one every run takes (hvdtrain.runtime.torch.training.Training.step)."""
    import torch

    from hvdtrain.errors import InputError
    from hvdtrain.runtime.torch.backends import LocalTorch
    from hvdtrain.runtime.torch.batches import BatchReader, rank_indices
    from hvdtrain.runtime.torch.precision import Precision
    from hvdtrain.runtime.torch.task import TorchTask, blocks_of
    from hvdtrain.runtime.torch.training import Training, held_bytes

    torch.manual_seed(config.seed)
    task = recipe.build(config)
    if not isinstance(task, TorchTask):
        raise InputError(f"recipe {recipe.name}: build(config) must return a runtime.torch.TorchTask")
    backend = LocalTorch("cpu")
    model = task.model.to(backend.device)
    optimizer = backend.build_optimizer(task, model, config.lr, config)
    amp = Precision(config.precision, backend.device)
    # the step reads no checkpointer, log or watch: those are the loop's
    training = Training(
        task=task,
        config=config,
        backend=backend,
        checkpointer=None,
        model=model,
        optimizer=optimizer,
        amp=amp,
        log=None,
        watch=None,
    )
    passes = config.backward_passes_per_step
    needed = (warmup + steps) * passes * config.batch_size
    indices = rank_indices(task.data, 0, 1, 0, config.seed)
    while len(indices) < needed:  # a small data set: its epoch again, as the next epoch would
        indices = list(indices) + list(indices)
    reader = BatchReader(task.data, config.batch_size, backend.device, config.seed)
    batches = reader(indices[:needed])

    params = [p for p in model.parameters() if p.requires_grad]
    parameter_storage = {p.untyped_storage().data_ptr() for p in model.parameters()}
    marks: dict[str, Any] = {}

    def forward_done(module, inputs, outputs) -> None:
        marks["forward"] = time.perf_counter()

    def made(parameter) -> None:
        marks["ready"].append((time.perf_counter(), parameter.numel() * parameter.element_size()))

    saved: dict[int, int] = {}
    pass_bytes: list[int] = []

    def forward_starts(module, inputs) -> None:
        # With backward_passes_per_step > 1 the gradients are sent once, after the last pass, and
        # each pass frees what it saved: the step is its last pass's gradients and its largest pass's
        # activations.
        marks["ready"] = []
        pass_bytes.append(sum(saved.values()))
        saved.clear()

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameter_storage:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    handles = [model.register_forward_pre_hook(forward_starts), model.register_forward_hook(forward_done)]
    handles += [p.register_post_accumulate_grad_hook(made) for p in params]
    timings, activations = [], []
    model.train()
    try:
        for index in range(warmup + steps):
            marks.update(ready=[], forward=None)
            saved.clear()
            pass_bytes.clear()
            start = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                training.step(batches, passes, config.lr)
            end = time.perf_counter()
            activations.append(max([*pass_bytes, sum(saved.values())]))
            if index >= warmup:
                timings.append((start, marks["forward"] or start, marks["ready"], end))
    finally:
        for handle in handles:
            handle.remove()
        reader.close()

    forward_end = [forward - start for start, forward, _, _ in timings]
    backward = [(ready[-1][0] if ready else forward) - forward for _, forward, ready, _ in timings]
    typical = sorted(timings, key=lambda t: t[3] - t[0])[len(timings) // 2]
    ready = tuple((max(0.0, at - typical[1]), size) for at, size in typical[2])
    grads = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
    return Step(
        param_bytes=held_bytes(model.parameters()),
        grad_bytes=grads,
        optimizer_bytes=held_bytes(v for state in optimizer.state.values() for v in state.values()),
        activation_bytes=max(activations),
        compute_s=statistics.median(end - start for start, _, _, end in timings),
        forward_s=statistics.median(forward_end),
        backward_s=statistics.median(backward),
        ready=_rescaled(ready, statistics.median(backward)),
        blocks=len(blocks_of(task, model)),
        batch_size=config.batch_size,
        precision=config.precision,
        compressed=bool(config.fp16_allreduce),
        zero_stage=int(config.zero_stage),
        flops_per_s=matmul_flops(config.precision),
    )


def _rescaled(ready: tuple[tuple[float, int], ...], backward_s: float) -> tuple[tuple[float, int], ...]:
    """The median step's times of making each gradient, stretched to the median backward time."""
    if not ready or ready[-1][0] <= 0:
        return ready
    factor = backward_s / ready[-1][0]
    return tuple((at * factor, size) for at, size in ready)


def matmul_flops(precision: str = "fp32", size: int = 512, repeats: int = 5) -> float:
    """FLOP/s of a square matmul on the CPU in the step's precision, the best of `repeats`: the rate
    this machine's arithmetic reaches, which --device compares with a GPU's peak."""
    import torch

    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)
    best = min(_timed(torch.mm, a, b) for _ in range(max(1, repeats)))
    return 2 * size**3 / best


def _timed(function, *args) -> float:
    start = time.perf_counter()
    function(*args)
    return time.perf_counter() - start


SMALL, LARGE = 4 << 10, 8 << 20
"""The two allreduce sizes the loopback probe times: the small one is almost all latency."""


def _probe_rank(rank: int, init_file: str, out: dict) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        times = {}
        for size in (SMALL, LARGE):
            tensor = torch.ones(size // 4)
            for _ in range(2):
                dist.all_reduce(tensor)
            samples = []
            for _ in range(5 if size == LARGE else 50):
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(tensor)
                samples.append(time.perf_counter() - start)
            times[size] = statistics.median(samples)
        if rank == 0:
            out.update(times)
    finally:
        dist.destroy_process_group()


def probe_loopback() -> Link:
    """This host's link as two gloo ranks on loopback see it: the latency of a ring step from a small
    allreduce, the rate from a large one (t = 2 alpha + size / rate at two ranks)."""
    import torch.multiprocessing as mp

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as folder, mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_probe_rank, args=(os.path.join(folder, "rendezvous"), out), nprocs=2, join=True)
        small, large = out[SMALL], out[LARGE]
    latency = small / 2
    rate = (LARGE - SMALL) / max(large - small, 1e-9)
    where = "measured on this host's loopback, 2 gloo ranks"
    return Link(gbps=rate * 8 / 1e9, latency_s=latency, source=where)


@dataclass(frozen=True)
class Report:
    recipe: str
    step: Step
    link: Link
    basis: str
    """Where the compute time comes from: measured, scaled to a device, or given."""
    rows: list[Estimate] = field(default_factory=list)
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {
            "recipe": self.recipe,
            "step": asdict(self.step),
            "link": {**asdict(self.link), "bytes_per_s": self.link.bytes_per_s},
            "basis": self.basis,
            "notes": list(self.notes),
            "rows": [{**asdict(row), "memory_bytes": row.memory_bytes} for row in self.rows],
        }


def megabytes(size: float) -> str:
    mib = size / 2**20
    return f"{mib:.0f}" if mib >= 1000 else f"{mib:.1f}" if mib >= 10 else f"{mib:.2f}"


def render(report: Report) -> str:
    """The table, in `hvdtrain bench`'s style."""
    step, link = report.step, report.link
    lines = [
        f"{report.recipe}: batch {step.batch_size}/rank, {step.precision}, "
        f"compute {1000 * step.compute_s:.1f} ms a step ({report.basis})",
        f"link {link.gbps:g} Gbit/s, {1e6 * link.latency_s:g} us a ring step ({link.source})",
        *report.notes,
    ]
    header = (
        f"{'strategy':<8} {'np':>5} {'params':>8} {'grads':>8} {'optim':>8} {'activ':>8} {'MiB/rank':>9} "
        f"{'MiB sent':>9} {'comm ms':>8} {'exposed':>8} {'step ms':>8} {'eff':>5}"
    )
    lines += ["", "memory per rank in MiB; MiB sent per rank per step", header, "-" * len(header)]
    for row in report.rows:
        lines.append(
            f"{row.strategy:<8} {row.world_size:>5} {megabytes(row.param_bytes):>8} "
            f"{megabytes(row.grad_bytes):>8} {megabytes(row.optimizer_bytes):>8} "
            f"{megabytes(row.activation_bytes):>8} {megabytes(row.memory_bytes):>9} "
            f"{megabytes(row.sent_bytes):>9} {1000 * row.comm_s:>8.1f} {1000 * row.exposed_s:>8.1f} "
            f"{1000 * row.step_s:>8.1f} {row.efficiency:>5.2f}"
        )
    return "\n".join(lines)


def applicable(recipe: Any, config: Any, names: Sequence[str] | None) -> tuple[dict[str, Traffic], list[str]]:
    """The strategies estimated for this recipe and config, name -> the traffic each declares: those
    asked for (default: every one that declares its traffic and runs the recipe's framework) that
    honour the config; and a note for each left out."""
    from hvdtrain import strategies

    modelled = {s.name: s for s in strategies.all_strategies().values() if s.traffic is not None}
    chosen: dict[str, Traffic] = {}
    notes = []
    for name in names or modelled:
        if name not in modelled:
            raise ValueError(f"--strategies: no traffic model of {name!r}; choose from {', '.join(modelled)}")
        strategy = modelled[name]
        if recipe.framework not in strategy.frameworks:
            if names:
                strategies.get(name, recipe.framework)  # says which strategies run it
            continue
        if reason := strategy.refuse(config):
            notes.append(f"{name} left out: {reason}")
            continue
        chosen[name] = strategy.traffic
    return chosen, notes


def estimate(
    recipe_name: str,
    world_sizes: Sequence[int],
    link: Link | None,
    device: Device | None = None,
    compute_ms: float | None = None,
    strategy_names: Sequence[str] | None = None,
    variant: str | None = None,
    overrides: Sequence[str] = (),
    threads: int | None = None,
) -> Report:
    """Measure one step of the recipe here, then predict each strategy at each world size. `link`
    None: this host's loopback, probed. Raises ValueError (UserError) for input it cannot use."""
    from hvdtrain import config as config_module
    from hvdtrain import registry

    recipe = registry.get(recipe_name)
    if recipe.framework != "torch":
        raise ValueError(
            f"estimate measures torch recipes; {recipe.name} is a {recipe.framework} recipe "
            "(time it with `hvdtrain bench` instead)"
        )
    parsed = config_module.parse_overrides(recipe.config, overrides)
    config = config_module.apply(recipe.make_config(variant), parsed)
    config_module.validate(config)
    if compute_ms is not None and not (math.isfinite(compute_ms) and compute_ms > 0):
        raise ValueError(f"--compute-ms must be a positive number of milliseconds, got {compute_ms:g}")
    if compute_ms is not None and device is not None:
        raise ValueError("give --device or --compute-ms, not both: each sets the compute time")
    chosen, notes = applicable(recipe, config, strategy_names)
    if not chosen:
        raise ValueError(f"no strategy to estimate for {recipe.name}; {'; '.join(notes)}")
    if threads is not None:
        if threads < 1:
            raise ValueError(f"--threads-per-rank must be >= 1, got {threads}")
        import torch

        torch.set_num_threads(threads)
    from hvdtrain.measure import measured_step

    measured = measured_step.measure_step(recipe, config)
    step, basis = on_device(measured, device, compute_ms)
    link = link or measured_step.probe_loopback()
    rows = predict_all(step, chosen, world_sizes, link)
    return Report(recipe.name, step, link, basis, rows, tuple(notes))
