"""`make bench` sections on the models users train: ResNet-50, a 10M-parameter GPT and the small conv
net, each at np=2 over every data-parallel path (Horovod over gloo and MPI, DDP, ZeRO stages 1 and 2,
FSDP2), with np=1 and the no-communication ceiling beside them; and hvdtrain's resnet-torch against
Horovod's own pytorch_synthetic_benchmark.py under plain horovodrun, on the same model and batch.
Every rank gets one core; runs are interleaved and the medians compared."""

from __future__ import annotations

import os
import re
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks import PROGRAMS
from hvdtrain.measure.bench import BenchError, checked_run, recipe_samples_per_sec
from hvdtrain.measure.tune import render_tuning, tune

WORKLOADS: dict[str, tuple[str, int, tuple[str, ...]]] = {
    "resnet-torch": ("ResNet-50, 64x64 synthetic images", 32, ("--set", "image_size=64")),
    "gpt-torch": (
        "10.8M parameters (6 layers of width 384), 128-byte context",
        8,
        ("--set", "layers=6", "--set", "width=384", "--set", "heads=6"),
    ),
    "synthetic-torch": ("the 2.2M-parameter conv net", 32, ()),
}
"""recipe -> (what it trains, batch per rank, its settings): a step takes half a second to a second."""


PATHS: dict[str, tuple[str, str | None, tuple[str, ...]]] = {
    "horovod gloo": ("horovod", "gloo", ()),
    "horovod mpi": ("horovod", "mpi", ()),
    "ddp": ("ddp", None, ()),
    "zero-1": ("zero", "gloo", ()),
    "zero-2": ("zero", "gloo", ("--set", "zero_stage=2")),
    "fsdp": ("fsdp", None, ()),
}
"""The np=2 paths, by name: strategy, launcher, extra arguments."""

GOALS: tuple[tuple[str, str, float], ...] = (
    ("horovod mpi", "ddp", 1.1),
    ("horovod gloo", "ddp", 1.0),
    ("zero-1", "horovod gloo", 0.95),
    ("zero-2", "horovod gloo", 0.9),
)
"""(path, against, goal): the ratios of samples/s each workload must reach."""

BF16 = ("horovod mpi", "ddp")
"""The paths also run with precision=bf16 (autocast forward, bf16 activations), once: a ratio to read,
with no goal behind it, so it is not repeated."""

STEPS, EPOCHS, REPEATS = 5, 3, 2
"""Three epochs of five steps (the first epoch left out), twice, interleaved."""
ONE_CORE = ("--threads-per-rank", "1", "--set", "checkpoint=false")


def _rate(recipe: str, path: str, np_: int, run_dir: Path, precision: str = "fp32") -> float:
    strategy, launcher, extra = PATHS[path]
    _, batch, settings = WORKLOADS[recipe]
    args = (*settings, "--set", f"batch_size={batch}", "--set", f"precision={precision}", *extra, *ONE_CORE)
    return recipe_samples_per_sec(recipe, strategy, np_, launcher, STEPS, EPOCHS, run_dir, args)


def measure(recipe: str, out: Path) -> dict[str, float]:
    """Median samples/s of every np=2 path, np=1 (horovod gloo) and two np=1 runs at once; the BF16
    paths in bf16 once."""
    rates: dict[str, list[float]] = {name: [] for name in (*PATHS, "np=1", "two np=1")}
    for repeat in range(REPEATS):
        for path in PATHS:
            rates[path].append(_rate(recipe, path, 2, out / f"{recipe}-{path.replace(' ', '-')}-{repeat}"))
        if repeat == 0:  # bf16, np=1 and the ceiling once
            for path in BF16:
                run_dir = out / f"{recipe}-{path.replace(' ', '-')}-bf16"
                rates[f"{path} bf16"] = [_rate(recipe, path, 2, run_dir, precision="bf16")]
            rates["np=1"].append(_rate(recipe, "horovod gloo", 1, out / f"{recipe}-np1"))
            with ThreadPoolExecutor(2) as pool:
                apart = pool.map(
                    lambda i: _rate(recipe, "horovod gloo", 1, out / f"{recipe}-apart{i}"), (0, 1)
                )
                rates["two np=1"].append(sum(apart))
    return {name: statistics.median(found) for name, found in rates.items() if found}


def render(recipe: str, rates: dict[str, float]) -> str:
    one, ceiling = rates["np=1"], rates["two np=1"]
    what, per_rank, _ = WORKLOADS[recipe]
    lines = [f"{recipe}: {what}, batch {per_rank}"]
    lines.append(f"  {'path':<14}{'samples/s':>10}{'ms/step':>9}{'weak scaling':>14}{'of ceiling':>12}")
    for name in PATHS:
        rate = rates[name]
        ms = 1000 * 2 * per_rank / rate
        lines.append(f"  {name:<14}{rate:>10.1f}{ms:>9.0f}{rate / (2 * one):>14.2f}{rate / ceiling:>12.2f}")
    lines.append(f"  {'np=1':<14}{one:>10.1f}{1000 * per_rank / one:>9.0f}")
    lines.append(f"  {'two np=1':<14}{ceiling:>10.1f}   (no communication: the ceiling)")
    for path, against, goal in GOALS:
        ratio = rates[path] / rates[against]
        lines.append(f"  {path} / {against}: {ratio:.2f}  (goal >= {goal})")
    for path in BF16:
        if f"{path} bf16" in rates:
            bf16 = rates[f"{path} bf16"]
            lines.append(f"  {path} in bf16: {bf16:.1f} samples/s, {bf16 / rates[path]:.2f} of fp32")
    worst = min(rates[name] / ceiling for name in PATHS)
    lines.append(f"  weak scaling against the ceiling, worst path: {worst:.2f}  (goal >= 0.9)")
    return "\n".join(lines)


def main(out: Path) -> None:
    import torch

    from hvdtrain.runtime.torch.precision import bf16_is_native

    how = "in hardware" if bf16_is_native(torch.device("cpu")) else "by emulation (no AVX512-BF16, no AMX)"
    print(f"this CPU computes bfloat16 {how}")
    for recipe in WORKLOADS:
        print(render(recipe, measure(recipe, out)), flush=True)


PEER = PROGRAMS / "pytorch_synthetic_benchmark.py"
"""Horovod's own benchmark, copied from Horovod 0.28.1 with its image size made a flag."""
PEER_ITERS = 4
"""Horovod's benchmark: its 10 warm-up batches, then PEER_ITERS timed iterations of STEPS batches."""


def peer_argv(python: str, np_: int = 2) -> list[str]:
    """Horovod's benchmark under the venv's plain horovodrun over gloo, pinned to loopback as hvdtrain
    pins it on one host: ResNet-50, 64x64 images, batch 32 a rank, on the CPU."""
    horovodrun = str(Path(python).parent / "horovodrun")
    return [horovodrun, "-np", str(np_), "--gloo", "--network-interface", "lo", python, str(PEER)] + [
        "--no-cuda",
        "--image-size",
        "64",
        "--batch-size",
        str(WORKLOADS["resnet-torch"][1]),
        "--num-batches-per-iter",
        str(STEPS),
        "--num-iters",
        str(PEER_ITERS),
    ]


def peer_env(environ: dict[str, str]) -> dict[str, str]:
    """One thread a rank, as hvdtrain gives each rank here; benchmarks/peer first on the path, for its
    stand-in `torchvision.models`."""
    path = os.pathsep.join(filter(None, (str(PROGRAMS / "peer"), environ.get("PYTHONPATH"))))
    return {**environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}


def peer_samples_per_sec(output: str) -> float:
    """All ranks' images/s, from the benchmark's own last line: 'Total img/sec on N CPU(s): X +-Y'."""
    found = re.findall(r"Total img/sec on \d+ [CG]PU\(s\): ([0-9.]+)", output)
    if not found:
        raise BenchError(
            f"{PEER.name} printed no 'Total img/sec' line:\n" + "\n".join(output.splitlines()[-10:])
        )
    return float(found[-1])


def versus_horovod_benchmark(out: Path, repeats: int = 3) -> None:
    """hvdtrain's resnet-torch against Horovod's pytorch_synthetic_benchmark.py under plain horovodrun,
    at np=2 over gloo, interleaved: ResNet-50, 64x64 images, batch 32 a rank, one core a rank."""
    ours, theirs = [], []
    for repeat in range(repeats):
        ours.append(_rate("resnet-torch", "horovod gloo", 2, out / f"peer-hvdtrain-{repeat}"))
        done = checked_run(peer_argv(sys.executable), env=peer_env(dict(os.environ)))
        (out / f"peer-horovod-{repeat}.log").write_text(done.stdout + done.stderr)
        theirs.append(peer_samples_per_sec(done.stdout))
    mine, peer = statistics.median(ours), statistics.median(theirs)
    print(
        f"resnet-torch (ResNet-50, 64x64, batch 32, np=2, gloo): hvdtrain {mine:.1f} samples/s, "
        f"Horovod's pytorch_synthetic_benchmark.py under horovodrun {peer:.1f} samples/s, "
        f"ratio {mine / peer:.3f}  (goal >= 0.98)"
    )


TUNED = ("resnet-torch", "gpt-torch")


def tuning(out: Path) -> None:
    """Horovod's defaults against the other fusion and cycle settings and against its autotune (over
    MPI), and DDP's default bucket size against others, on the workloads whose gradients span several
    buffers' worth of tensors, at np=2, as `hvdtrain bench --tune` times them; printed, not kept."""
    for recipe in TUNED:
        _, batch, settings = WORKLOADS[recipe]
        extra = (*settings, "--set", "checkpoint=false")
        for strategy, launcher in (("horovod", "mpi"), ("ddp", None)):
            rates, autotune = tune(strategy, recipe, 2, launcher, STEPS, EPOCHS, batch, out, extra=extra)
            where = f"at np=2{f' over {launcher}' if launcher else ''}, batch {batch}"
            print(render_tuning(strategy, recipe, rates, autotune, where), flush=True)
