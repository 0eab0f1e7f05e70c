#!/usr/bin/env python3
"""The GPU check in one call, on a machine that reaches no network: build Horovod with NCCL against
the machine's own torch from the bundle (`make device-bundle` fills .device/), install hvdtrain
beside it, then run every check under its own time limit, writing the report as each one ends.

    containers/device_check.sh                 # on the GPU machine, from the repository's root
    containers/device_check.sh --toy           # the CPU rehearsal's sizes (make device-rehearsal)

The report is device-report.json (each check: name, status passed/failed/skipped, figures, seconds)
and device-report.md, in $OUT where that is set, else in runs/device-check/. A check that fails or
runs out of time leaves the others' results; checks that would start too late for the call's
deadline are reported skipped. Standard library only, except the plain loop (`plain-loop`), which
is torch written as a user would, to compare hvdtrain's samples/s with.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "containers")]

HOROVOD_CACHE = ROOT / "build" / "horovod-cache"
"""The build's wheel cache: ignored by git and not carried, so a warm machine's next call reuses it,
and the report's folder gets only the build's log."""
GOALS = {  # the goals, checked in the speed checks
    "hvdtrain_over_plain": 0.97,
    "gpt_mfu_bf16_compiled": 0.40,
    "resnet50_images_per_sec": 2470.0,  # one A100 with AMP, NVIDIA's DeepLearningExamples
}


MODES = {  # name -> settings: bf16 eager, bf16 compiled (the GPT block by block), fp16 with the scaler
    "bf16": ("--set", "precision=bf16"),
    "bf16-compiled": ("--set", "precision=bf16", "--set", "compile=true", "--set", "compile_scope=blocks"),
    "fp16": ("--set", "precision=fp16"),
}
STRATEGIES = ("horovod", "ddp", "zero", "fsdp")
EVERY = tuple((model, s, mode) for mode in MODES for model in ("gpt", "resnet") for s in STRATEGIES)


@dataclass
class Sizes:
    """What each check trains: the models users train on a GPU, or toy sizes for the CPU rehearsal."""

    gpt: tuple[str, ...]
    resnet: tuple[str, ...]
    small_gpt: tuple[str, ...]
    steps: int
    speed_steps: int
    speed_batches: dict[str, tuple[int, ...]]
    """The speed checks' batch sizes: the first compared with hvdtrain, the rest the plain loop's alone."""
    parallel: int
    matrix: tuple[tuple[str, str, str], ...]
    """(model, strategy, mode) of each training check."""
    resume_epochs: int
    """Of 12 steps: enough that the signal, sent at the first epoch's end, falls inside the run."""


FULL = Sizes(
    gpt=("gpt-torch", "--variant", "gpt2-small"),
    resnet=("resnet-torch", "--set", "batch_size=128", "--set", "num_samples=512"),
    small_gpt=("gpt-torch", "--set", "layers=4", "--set", "width=256", "--set", "block_size=256"),
    steps=8,
    speed_steps=30,
    speed_batches={"gpt": (32,), "resnet": (128,)},
    parallel=3,
    matrix=EVERY,
    resume_epochs=40,
)
TOY = Sizes(
    gpt=("gpt-torch", "--variant", "debug", "--set", "batch_size=8"),
    resnet=(
        "resnet-torch",
        *("--set", "arch=resnet18", "--set", "width=8", "--set", "image_size=32"),
        *("--set", "batch_size=8", "--set", "num_samples=64", "--set", "num_classes=10"),
    ),
    small_gpt=("gpt-torch", "--variant", "debug", "--set", "batch_size=8"),
    steps=4,
    speed_steps=6,
    speed_batches={"gpt": (8, 16), "resnet": (8,)},
    parallel=1,
    # each strategy on each model, each mode once: a CPU compiles for minutes
    matrix=(
        *((model, s, "bf16") for model in ("gpt", "resnet") for s in STRATEGIES),
        ("gpt", "horovod", "fp16"),
        ("resnet", "zero", "fp16"),
        ("gpt", "ddp", "bf16-compiled"),
    ),
    resume_epochs=3,
)


# ---- the report ------------------------------------------------------------------------------------


@dataclass
class Check:
    name: str
    status: str = "running"
    figures: dict = field(default_factory=dict)
    seconds: float = 0.0
    detail: str = ""


class Report:
    """Rewritten whole after each check: a call cut short still leaves what ended."""

    def __init__(self, out: Path, context: dict) -> None:
        self.out, self.context, self.checks = out, context, []
        self.lock = threading.Lock()
        out.mkdir(parents=True, exist_ok=True)

    def add(self, check: Check) -> None:
        with self.lock:
            self.checks.append(check)
            self.write()

    def write(self) -> None:
        document = {**self.context, "checks": [vars(c) for c in self.checks]}
        (self.out / "device-report.json").write_text(json.dumps(document, indent=2) + "\n")
        lines = ["# Device check", ""]
        lines += [f"- {key}: {value}" for key, value in self.context.items()]
        lines += ["", "| check | status | seconds | figures |", "| --- | --- | --- | --- |"]
        for c in self.checks:
            shown = ", ".join(f"{k} {fmt(v)}" for k, v in c.figures.items())
            lines.append(f"| {c.name} | {c.status} | {c.seconds:.1f} | {shown or c.detail[:120]} |")
        (self.out / "device-report.md").write_text("\n".join(lines) + "\n")


def fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


class Failed(Exception):
    """A check's own verdict: what it found wrong, in one line."""


# ---- running things --------------------------------------------------------------------------------


@dataclass
class Call:
    python: str
    out: Path
    env: dict
    deadline: float
    toy: bool
    sizes: Sizes
    cuda: bool = False
    started: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def sh(self, argv: list[str], log: str, timeout: float, env: dict | None = None) -> str:
        """Run to the end within `timeout` (and the call's deadline); its output in OUT/logs/log."""
        timeout = min(timeout, max(5.0, self.left()))
        path = self.out / "logs" / log
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as handle:
            handle.write("$ " + " ".join(argv) + "\n")
            handle.flush()
            process = subprocess.Popen(
                argv,
                stdout=handle,
                stderr=subprocess.STDOUT,
                env={**self.env, **(env or {})},
                cwd=ROOT,
                start_new_session=True,
            )
            try:
                code = process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                raise Failed(f"ran out of its {timeout:.0f} s (log: logs/{log})") from None
        text = path.read_text(errors="replace")
        if code != 0:
            tail = " | ".join(line for line in text.splitlines()[-4:] if line.strip())
            raise Failed(f"exit code {code} (logs/{log}): {tail[-400:]}")
        return text

    def run_dir(self, name: str) -> Path:
        """A fresh run directory: beside the report, or on the device machine (where OUT comes back
        to the caller) in /tmp, with only each run's summary and metrics copied beside the report."""
        root = Path("/tmp/hvdtrain-device-runs") if os.environ.get("OUT") else self.out / "runs"
        shutil.rmtree(root / name, ignore_errors=True)
        return root / name

    def kept(self, run_dir: Path) -> dict:
        kept = self.out / "summaries" / run_dir.name
        kept.mkdir(parents=True, exist_ok=True)
        for name in ("summary.json", "metrics.jsonl"):
            if (run_dir / name).exists():
                shutil.copy(run_dir / name, kept / name)
        return json.loads((run_dir / "summary.json").read_text())

    def hvdtrain_run(self, name: str, recipe: tuple[str, ...], *args: str, timeout: float = 240) -> dict:
        run_dir = self.run_dir(name)
        argv = [self.python, "-m", "hvdtrain", "run", *recipe, *args, "--run-dir", str(run_dir)]
        self.sh(argv, f"{name}.log", timeout)
        return self.kept(run_dir)


def epoch_losses(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "epoch" in r and r.get("loss") is not None]


def trained(call: Call, name: str, recipe: tuple[str, ...], *args: str) -> dict:
    """A run whose loss falls from its first epoch to its last and whose ranks end with the same
    weights; its figures."""
    steps = call.sizes.steps
    summary = call.hvdtrain_run(
        name,
        recipe,
        *args,
        "--set",
        "epochs=3",
        "--set",
        f"steps_per_epoch={steps}",
        "--set",
        "checkpoint=false",
        "--set",
        "log_step_lr=false",
    )
    losses = epoch_losses(Path(summary["run_dir"]))
    if not losses[-1] < losses[0]:
        raise Failed(f"loss did not fall: {losses}")
    if not summary["weights_consistent"]:
        raise Failed("ranks ended with different weights")
    peak = summary.get("peak_device_memory_bytes")
    return {
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "samples_per_sec": summary["steady_samples_per_sec"],
        "compute_dtype": summary.get("compute_dtype"),
        "peak_memory_gib": max(peak) / 2**30 if peak else None,
        "device": summary.get("device"),
    }


# ---- the checks ------------------------------------------------------------------------------------


def build_horovod(call: Call, bundle: Path, controllers: str) -> dict:
    sdists = sorted(bundle.glob("horovod-*.tar.gz"))
    if not sdists:
        raise Failed(f"no Horovod sdist in {bundle}: run make device-bundle first")
    controllers = controllers or ("gloo,mpi" if shutil.which("mpicxx") else "gloo")
    argv = [
        call.python,
        "containers/build_horovod.py",
        "--python",
        call.python,
        "--offline",
        "--sdist",
        str(sdists[0]),
        "--device",
        "cuda" if call.cuda else "cpu",
        "--frameworks",
        "torch",
        "--controllers",
        controllers,
        "--cache-dir",
        str(HOROVOD_CACHE),
    ]
    began = time.monotonic()
    # A newer GCC than the patches were made with may miss another transitive include: the usual
    # three are included into every C++ file, so one missing include costs no GPU call.
    cxxflags = f"{os.environ.get('CXXFLAGS', '')} -include cstdint -include stdexcept -include string".strip()
    try:
        call.sh(
            argv, "build-horovod.log", 480, env={"MAKEFLAGS": f"-j{os.cpu_count()}", "CXXFLAGS": cxxflags}
        )
    except Failed:
        for log in HOROVOD_CACHE.glob("failed-build-*.log"):  # the compiler's whole output
            shutil.copy(log, call.out / "logs" / log.name)
        raise
    return {"build_seconds": time.monotonic() - began, "controllers": controllers, "cores": os.cpu_count()}


def install_hvdtrain(call: Call, bundle: Path) -> dict:
    """hvdtrain beside the machine's own packages; what it lacks from the bundle's wheels."""
    argv = [call.python, "-m", "pip", "install", "--quiet", "--no-index", "--no-compile"]
    argv += ["--find-links", str(bundle / "wheels"), str(ROOT)]
    try:
        call.sh(argv, "install-hvdtrain.log", timeout=240)
    except Failed:  # a dependency the bundle lacks: hvdtrain alone, as far as the image's packages go
        call.sh([*argv[:3], "--no-deps", *argv[3:]], "install-hvdtrain-no-deps.log", timeout=240)
        return {"dependencies": "not all: installed with --no-deps (logs/install-hvdtrain.log)"}
    return {}


def doctor(call: Call) -> dict:
    required = "torch,gloo,nccl" if call.cuda else "torch,gloo"
    text = call.sh(
        [call.python, "-m", "hvdtrain", "doctor", "--fresh", "--require", required], "doctor.log", 120
    )
    return {"required": required, "verdict": text.strip().splitlines()[-1][:160]}


ALLREDUCE = """
import json, os, sys, torch, horovod.torch as hvd
hvd.init()
device = torch.device("cuda", hvd.local_rank()) if torch.cuda.is_available() else torch.device("cpu")
tensor = torch.arange(1 << 20, dtype=torch.float32, device=device)
for i in range(3):
    out = hvd.allreduce(tensor, op=hvd.Sum, name=f"check.{i}")
torch.testing.assert_close(out, tensor * hvd.size())
found = {"size": hvd.size(), "device": str(device), "nccl_built": bool(hvd.nccl_built())}
hvd.shutdown()  # writes the rest of the timeline
print(json.dumps(found))
"""


def allreduce(call: Call) -> dict:
    timeline = call.out / "timeline.json"
    text = call.sh(
        [call.python, "-c", ALLREDUCE], "allreduce.log", 120, env={"HOROVOD_TIMELINE": str(timeline)}
    )
    found = json.loads(text.strip().splitlines()[-1])
    seen = timeline.read_text() if timeline.exists() else ""
    activities = sorted(set(re.findall(r'"name": "([A-Z_]+)"', seen)))  # Horovod's steps of each op

    if call.cuda and "NCCL_ALLREDUCE" not in seen:
        raise Failed(f"the timeline shows no NCCL_ALLREDUCE: {activities}")
    return {**found, "timeline_activities": " ".join(activities) or "none"}


PLAIN_LOOP_STEPS_WARM = 10
PROFILED_STEPS = 3

KERNEL_KINDS = (  # the first pattern a kernel's (or, on a CPU, an op's) name matches names its kind
    # cuDNN's attention: its kernels, and its backward's helpers (the row sums of dO x O, dQ's cast)
    ("attention", r"flash|fmha|attention|sdpa|compute_dot_do_o|convert_dq"),
    ("loss", r"softmax|nll_loss|cross_entropy"),  # a GPT's only softmax is its loss's (SDPA aside)
    ("convolution", r"convolution|conv2d|fprop|dgrad|wgrad|implicit_gemm|winograd"),
    ("matmul", r"gemm|xmma|cutlass|nvjet|cublas|wgmma|triton_tem|aten::(add|b)?mm\b"),
    ("optimizer", r"multi_tensor|adam|sgd|foreach"),
    ("norm", r"layer_norm|batch_norm|native_norm"),
    ("copy", r"memcpy|memset|copy_"),
    ("elementwise", r"^triton_|elementwise|vectorized|reduce_kernel|aten::"),
)


def kernel_breakdown(
    step: Callable[[], None], step_seconds: float, flops_per_step: float | None, trace: Path | None
) -> dict:
    """What a step's time goes to: each kind of kernel's share of the GPU's busy time, the GPU's busy
    fraction of an unprofiled step, the achieved rate in matmuls and attention (the step's FLOPs over
    their time: the MFU were everything else free), and the longest kernels; on a CPU, its ops."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(PROFILED_STEPS):
            step()
        if cuda:
            torch.cuda.synchronize()
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    timed: dict[str, float] = {}
    for event in prof.key_averages():
        on_device = getattr(event, "device_type", None) == DeviceType.CUDA
        if cuda and on_device:
            micros = getattr(event, "self_device_time_total", None)
            micros = micros or getattr(event, "self_cuda_time_total", 0)
        elif not cuda and event.key.startswith("aten::"):
            micros = event.self_cpu_time_total
        else:
            continue
        timed[event.key] = timed.get(event.key, 0.0) + micros / 1e6 / PROFILED_STEPS
    busy = sum(timed.values()) or 1e-12
    kinds: dict[str, float] = {}
    for name, seconds in timed.items():
        kind = next((k for k, pattern in KERNEL_KINDS if re.search(pattern, name, re.I)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + seconds
    found = {"profile_busy_of_step": busy / step_seconds}
    for kind, seconds in sorted(kinds.items(), key=lambda kv: -kv[1]):
        found[f"profile_share_{kind}"] = seconds / busy
    dense = kinds.get("matmul", 0.0) + kinds.get("attention", 0.0)
    if flops_per_step and dense:
        found["profile_tflops_in_matmul_attention"] = flops_per_step / dense / 1e12
    longest = sorted(timed.items(), key=lambda kv: -kv[1])[:8]
    found["profile_longest_ms_per_step"] = {name[:90]: round(seconds * 1e3, 3) for name, seconds in longest}
    return found


def plain_loop(
    model_name: str,
    batches: list[int],
    precision: str,
    compiled: bool,
    steps: int,
    toy: bool,
    trace: Path | None,
) -> dict:
    """The plain torch loop a user writes (nanoGPT's, Horovod's synthetic benchmark's): the model,
    one batch already on the device, autocast, the fused optimizer, clipping where the recipe clips,
    compile of the model's forward; samples/s over `steps` steps after a warm-up, at each batch size
    (each compiled for its own shape), and the first batch size's steps profiled."""
    import torch

    from hvdtrain.models.gpt import GPT, decayed_groups, sequence_loss
    from hvdtrain.models.resnet import ResNet
    from hvdtrain.runtime.torch.speed import peak_flops

    torch.manual_seed(0)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    fused = {"fused": True} if cuda else {}
    clip, flops_per_sample = None, None
    if model_name == "gpt":
        shape = (12, 12, 768, 1024, 50304) if not toy else (2, 2, 64, 64, 256)
        layers, heads, width, block, vocab = shape
        model = GPT(vocab, block, layers, heads, width).to(device)
        parameters = sum(p.numel() for p in model.parameters()) - model.transformer.wpe.weight.numel()
        flops_per_sample = float((6 * parameters + 12 * layers * width * block) * block)
        optimizer = torch.optim.AdamW(decayed_groups(model, 0.1), lr=6e-4, betas=(0.9, 0.99), **fused)
        loss_fn, clip = sequence_loss, 1.0

        def batch_of(size: int):
            inputs = torch.randint(0, 256, (size, block), device=device)
            return inputs, torch.randint(0, 256, (size, block), device=device)
    else:
        arch, side, width, classes = ("resnet50", 224, 64, 1000) if not toy else ("resnet18", 32, 8, 10)
        model = ResNet(arch, num_classes=classes, width=width).to(device)
        memory_format = torch.channels_last if cuda else torch.contiguous_format
        model = model.to(memory_format=memory_format)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.0, **fused)
        loss_fn = torch.nn.functional.cross_entropy

        def batch_of(size: int):
            inputs = torch.randn(size, 3, side, side, device=device).contiguous(memory_format=memory_format)
            return inputs, torch.randint(0, classes, (size,), device=device)

    forward = model.forward
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    peak = peak_flops(device, precision)
    results: dict = {}
    for size in batches:
        inputs, targets = batch_of(size)
        if compiled:  # the forward and the loss, as nanoGPT compiles its model, whose forward holds the loss
            torch._dynamo.reset()  # each batch size compiled for its own shape, as a user's run would be
            model.forward = torch.compile(forward)
        loss_of = torch.compile(loss_fn) if compiled else loss_fn

        def step(inputs=inputs, targets=targets, loss_of=loss_of) -> None:
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = loss_of(model(inputs), targets)
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()

        for _ in range(PLAIN_LOOP_STEPS_WARM):
            step()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        began = time.perf_counter()
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - began
        found = {
            "samples_per_sec": size * steps / seconds,
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        }
        if flops_per_sample and peak:
            found["mfu"] = flops_per_sample * found["samples_per_sec"] / peak[0]
        if not results:
            per_step = flops_per_sample * size if flops_per_sample else None
            found |= kernel_breakdown(step, seconds / steps, per_step, trace)
        results[size] = found
    first = results[batches[0]]
    return {**first, "by_batch": {str(size): results[size] for size in batches[1:]}}


def speed(call: Call, model_name: str) -> dict:
    """hvdtrain (horovod, np=1, bf16) against the plain loop of the same model, batch and precision,
    one after the other with nothing else running; the GPT compiled (its MFU goal is for compile),
    the ResNet eager (as NVIDIA's published rate is). The plain loop also times the GPT at a larger
    batch and profiles its steps: what limits the MFU."""
    toy, steps = call.toy, call.sizes.speed_steps
    batches = call.sizes.speed_batches[model_name]
    recipe = call.sizes.gpt if model_name == "gpt" else call.sizes.resnet
    compiled = not toy and model_name == "gpt"  # the rehearsal's compile is in its matrix
    settings = ["--set", "precision=bf16", "--set", f"batch_size={batches[0]}"]
    settings += ["--set", f"compile={compiled}"]
    settings += ["--set", "epochs=3", "--set", f"steps_per_epoch={steps}", "--set", "checkpoint=false"]
    trace = call.out / f"profile-{model_name}.json"
    argv = [call.python, __file__, "plain-loop", model_name, ",".join(map(str, batches)), "bf16"]
    argv += [str(int(compiled)), str(steps), str(trace)] + (["--toy"] if toy else [])
    plain = json.loads(call.sh(argv, f"plain-{model_name}.log", 420).splitlines()[-1])
    if trace.exists():  # a few MiB of JSON: what comes back from the device machine is bounded
        with trace.open("rb") as source, gzip.open(f"{trace}.gz", "wb") as packed:
            shutil.copyfileobj(source, packed)
        trace.unlink()
    summary = call.hvdtrain_run(f"speed-{model_name}", recipe, "--np", "1", *settings, timeout=420)
    ours = summary["steady_samples_per_sec"]
    figures = {
        "batch": batches[0],
        "compiled": compiled,
        "plain_samples_per_sec": plain["samples_per_sec"],
        "hvdtrain_samples_per_sec": ours,
        "hvdtrain_over_plain": ours / plain["samples_per_sec"],
        "plain_peak_memory_gib": plain["peak_memory_gib"],
    }
    if summary.get("peak_device_memory_bytes"):
        figures["hvdtrain_peak_memory_gib"] = max(summary["peak_device_memory_bytes"]) / 2**30
    for key in ("tokens_per_sec", "mfu", "flops_per_sample", "peak_flops_source"):
        if summary.get(key) is not None:
            figures[key] = summary[key]
    if "mfu" in plain:
        figures["plain_mfu"] = plain["mfu"]
    for size, found in plain["by_batch"].items():
        figures[f"plain_batch{size}_samples_per_sec"] = found["samples_per_sec"]
        if "mfu" in found:
            figures[f"plain_batch{size}_mfu"] = found["mfu"]
    figures |= {key: value for key, value in plain.items() if key.startswith("profile_")}
    figures["goal_hvdtrain_over_plain"] = GOALS["hvdtrain_over_plain"]
    if model_name == "gpt" and "mfu" in figures:
        figures["goal_mfu"] = GOALS["gpt_mfu_bf16_compiled"]
    if model_name == "resnet":
        figures["goal_images_per_sec"] = GOALS["resnet50_images_per_sec"]
    return figures


def matrix_check(call: Call, model_name: str, strategy: str, mode: str) -> dict:
    recipe = call.sizes.gpt if model_name == "gpt" else call.sizes.resnet
    settings = list(MODES[mode])
    if call.toy and mode == "bf16-compiled" and model_name == "resnet":
        settings = list(MODES["bf16"])  # the rehearsal compiles one model: a CPU compile takes minutes
    name = f"train-{model_name}-{strategy}-{mode}"
    return trained(call, name, recipe, "--np", "1", "--strategy", strategy, *settings)


def resume_bitwise(call: Call) -> dict:
    """A run stopped mid-epoch by the preemption signal (SIGUSR1, as Slurm sends) and resumed ends
    with the weights of the run that was never stopped, bit for bit: fp16 with its loss scale,
    dropout drawing from the GPU's generator, deterministic kernels."""
    args = [*call.sizes.small_gpt, "--np", "1", "--strategy", "ddp", "--set", "precision=fp16"]
    args += ["--set", "dropout=0.1"]
    args += ["--set", "deterministic=true", "--set", f"epochs={call.sizes.resume_epochs}"]
    args += ["--set", "steps_per_epoch=12"]
    args += ["--set", "checkpoint=true", "--set", "log_step_lr=false"]
    straight = call.hvdtrain_run("resume-straight", tuple(args), timeout=300)
    run_dir = call.run_dir("resume-stopped")
    argv = [call.python, "-m", "hvdtrain", "run", *args, "--run-dir", str(run_dir)]
    limit = time.monotonic() + min(240, max(10, call.left()))
    with (call.out / "logs" / "resume-stopped.log").open("w") as log:
        process = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=call.env, cwd=ROOT, start_new_session=True
        )
        metrics = run_dir / "metrics.jsonl"
        while time.monotonic() < limit and process.poll() is None:
            if metrics.exists() and '"epoch"' in metrics.read_text():
                process.send_signal(signal.SIGUSR1)  # to hvdtrain, which passes it on to the ranks
                break
            time.sleep(0.05)
        try:
            code = process.wait(timeout=max(1, limit - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise Failed("the signalled run ran out of its time (logs/resume-stopped.log)") from None
    if code != 0 or not (run_dir / "preempted.json").exists():
        raise Failed(f"the signalled run did not stop preempted (exit code {code}; logs/resume-stopped.log)")
    stopped_at = json.loads((run_dir / "preempted.json").read_text())["step"]
    resume = [
        call.python,
        "-m",
        "hvdtrain",
        "run",
        args[0],
        "--np",
        "1",
        "--strategy",
        "ddp",
        "--resume",
        "--run-dir",
        str(run_dir),
    ]
    call.sh(resume, "resume.log", 300)
    resumed = call.kept(run_dir)
    figures = {
        "stopped_at_step": stopped_at,
        "steps": resumed["steps"],
        "digest": resumed["parameter_digest"],
    }
    if resumed["parameter_digest"] != straight["parameter_digest"]:
        raise Failed(f"resumed weights differ from the uninterrupted run's: {figures}")
    return figures


def shared_device(call: Call) -> dict:
    """Two ranks on one host with one GPU: each picks its device from its local rank (modulo the GPUs
    there), ddp averages over gloo where NCCL refuses two ranks on one GPU, and they train."""
    figures = trained(call, "two-ranks-one-device", call.sizes.small_gpt, "--np", "2", "--strategy", "ddp")
    devices = json.loads((call.out / "summaries" / "two-ranks-one-device" / "summary.json").read_text())[
        "devices"
    ]
    expected = ["cuda:0", "cuda:0"] if call.cuda else ["cpu", "cpu"]
    if devices != expected:
        raise Failed(f"ranks on {devices}, expected {expected}")
    return {**figures, "devices": " ".join(devices)}


# ---- the order -------------------------------------------------------------------------------------


NEEDS = {
    "gpt": 80.0,
    "resnet": 40.0,
    "compiled": 40.0,
    "speed-gpt": 120.0,
    "speed-resnet": 40.0,
    "resume": 150.0,
    "shared": 40.0,
}
"""Seconds a check takes on the H200, as measured there (a compiled run adds its compile): one that
would start with less left of the call is reported skipped, not cut short."""


def needs_of(model: str, strategy: str, mode: str) -> float:
    return NEEDS[model] + (NEEDS["compiled"] if "compiled" in mode else 0.0)


def needs_horovod(name: str) -> bool:
    """Whether a check runs Horovod (the default strategy, or zero, which is built on it)."""
    torchrun = name.startswith("train-") and name.split("-")[2] in ("ddp", "fsdp")
    return not (torchrun or name in ("shared-device", "resume-bitwise"))


def run_check(report: Report, call: Call, name: str, work: Callable[[], dict], needs: float) -> bool:
    check = Check(name)
    began = time.monotonic()
    if call.left() < needs:
        check.status, check.detail = "skipped", f"{call.left():.0f} s left of the call, {needs:.0f} needed"
    else:
        try:
            check.figures = work() or {}
            check.status = "passed"
        except Failed as failure:
            check.status, check.detail = "failed", str(failure)
        except Exception as error:  # a check's own bug: reported, the others go on
            check.status, check.detail = "failed", f"{type(error).__name__}: {error}"
    check.seconds = time.monotonic() - began
    print(f"device-check: {check.status:<7} {name} ({check.seconds:.0f} s) {check.detail[:200]}", flush=True)
    report.add(check)
    return check.status == "passed"


def pack(out: Path, folders: tuple[str, ...]) -> None:
    """`folders` of `out` into out/logs.tar.gz, and removed."""
    with tarfile.open(out / "logs.tar.gz", "w:gz") as archive:
        for name in folders:
            if (out / name).exists():
                archive.add(out / name, arcname=name)
    for name in folders:
        shutil.rmtree(out / name, ignore_errors=True)


def probe(python: str) -> dict:
    code = (
        "import json, platform, torch; c = torch.cuda.is_available(); "
        "print(json.dumps({'python': platform.python_version(), 'torch': torch.__version__, 'cuda': c, "
        "'gpu': torch.cuda.get_device_name() if c else None, 'gpus': torch.cuda.device_count()}))"
    )
    return json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--bundle", type=Path, default=ROOT / ".device")
    parser.add_argument("--toy", action="store_true", help="the CPU rehearsal's sizes")
    parser.add_argument("--no-build", action="store_true", help="use the Horovod already installed")
    parser.add_argument("--no-install", action="store_true", help="use the hvdtrain already installed")
    parser.add_argument(
        "--controllers", default="", help="Horovod's, for the build (default: gloo, and mpi where mpicxx is)"
    )
    parser.add_argument("--budget", type=float, default=560.0, help="seconds for the whole call")
    parser.add_argument(
        "--only", default="", help="comma-separated check names; NAME* for every check whose name starts so"
    )
    parser.add_argument(
        "--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "runs" / "device-check")
    )
    args = parser.parse_args(argv)

    began = time.monotonic()
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "HVDTRAIN_PROGRESS_S": "",
        "TORCHINDUCTOR_COMPILE_THREADS": str(os.cpu_count()),
    }
    facts = probe(args.python)
    call = Call(
        args.python, args.out, env, began + args.budget, args.toy, TOY if args.toy else FULL, facts["cuda"]
    )
    report = Report(args.out, {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "toy": args.toy, **facts})
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
        )
        report.context["nvidia_smi"] = smi.stdout.strip()
    print(f"device-check: {facts}", flush=True)

    def wanted(name: str) -> bool:
        asked = [p for p in args.only.split(",") if p]
        return not asked or any(name == p or (p.endswith("*") and name.startswith(p[:-1])) for p in asked)

    # Horovod builds (all cores) while the checks that need none of it use the GPU.
    build_done = threading.Event()
    horovod_ok = [True]

    def build_then_install() -> None:
        if not args.no_build:
            horovod_ok[0] = run_check(
                report, call, "build-horovod", lambda: build_horovod(call, args.bundle, args.controllers), 60
            )
        build_done.set()

    if not args.no_install:
        run_check(report, call, "install-hvdtrain", lambda: install_hvdtrain(call, args.bundle), 20)
    builder = threading.Thread(target=build_then_install)
    builder.start()

    matrix = {f"train-{m}-{s}-{mode}": (m, s, mode) for m, s, mode in call.sizes.matrix}
    rest = [
        (name, (lambda spec=spec: matrix_check(call, *spec)), needs_of(*spec))
        for name, spec in matrix.items()
    ]
    rest += [
        ("resume-bitwise", lambda: resume_bitwise(call), NEEDS["resume"]),
        ("shared-device", lambda: shared_device(call), NEEDS["shared"]),
    ]
    # the resume first (it runs longest), then eager runs before compiled ones
    rest.sort(key=lambda c: (c[0].startswith("train") and "compiled" in c[0], c[0] != "resume-bitwise"))
    rest = [c for c in rest if wanted(c[0])]
    # While Horovod builds, the checks that need none of it take the GPU, until the build ends.
    early = deque(c for c in rest if not needs_horovod(c[0]))

    def while_building() -> None:
        while not build_done.is_set():
            try:
                check = early.popleft()
            except IndexError:
                return
            run_check(report, call, *check)

    with ThreadPoolExecutor(max(1, call.sizes.parallel - 1)) as pool:
        for _ in range(max(1, call.sizes.parallel - 1)):
            pool.submit(while_building)
    build_done.wait()
    builder.join()

    def then(name: str, work: Callable[[], dict], needs: float) -> bool:
        """A check after the build: skipped where it needs Horovod and the build failed."""
        if horovod_ok[0] or not needs_horovod(name):
            return run_check(report, call, name, work, needs)
        report.add(Check(name, "skipped", detail="Horovod did not build (logs/build-horovod.log)"))
        return False

    if wanted("doctor"):
        then("doctor", lambda: doctor(call), 20)
    if wanted("allreduce"):
        then("allreduce", lambda: allreduce(call), 20)
    for model in ("gpt", "resnet"):  # alone on the machine: timings
        if wanted(f"speed-{model}"):
            then(f"speed-{model}", lambda m=model: speed(call, m), NEEDS[f"speed-{model}"])
    done = {c.name for c in report.checks}
    with ThreadPoolExecutor(call.sizes.parallel) as pool:
        list(pool.map(lambda c: then(*c), [c for c in rest if c[0] not in done]))

    report.context["seconds"] = round(time.monotonic() - began, 1)
    report.write()
    counts = {s: sum(c.status == s for c in report.checks) for s in ("passed", "failed", "skipped")}
    print(
        f"device-check: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped "
        f"in {report.context['seconds']:.0f} s; report: {args.out}/device-report.md",
        flush=True,
    )
    print((args.out / "device-report.md").read_text(), flush=True)
    if os.environ.get("OUT"):  # a device call brings back 8 files: the logs and summaries as one
        pack(args.out, ("logs", "summaries"))
    return 0 if counts["failed"] == 0 else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "plain-loop":
        model, batches, precision, compiled, steps, trace = sys.argv[2:8]
        sizes = [int(size) for size in batches.split(",")]
        toy = "--toy" in sys.argv
        result = plain_loop(model, sizes, precision, compiled == "1", int(steps), toy, Path(trace))
        print(json.dumps(result), flush=True)
        sys.exit(0)
    sys.exit(main())
