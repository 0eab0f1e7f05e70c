"""`make bench` section: what each rank holds of a 57M-parameter model trained with AdamW, under plain
Horovod, ZeRO stages 1 and 2 on Horovod, FSDP2, and torch's ZeroRedundancyOptimizer under DDP (a
hand-written loop, zero_redundancy.py), at 1, 2 and 4 ranks: parameter and optimizer-state bytes a
rank (the tensors it keeps), peak RSS and samples/s, side by side."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks import PROGRAMS
from hvdtrain.measure.bench import BenchError, hvdtrain_run

WIDE = {"width": 768, "layers": 8, "heads": 12, "block_size": 32, "batch_size": 2}
"""gpt-torch widened to GPT-2-small's width: 56.9M parameters, trained on 32-byte windows."""
QUICK = {"epochs": 2, "steps_per_epoch": 3, "validation_fraction": 0.001, "checkpoint": "false"}
"""Two short epochs (the first is left out of samples/s) and a test set of a few windows."""
RUNS = {
    "horovod": ("--strategy", "horovod", "--launcher", "gloo"),
    "zero-1": ("--strategy", "zero", "--launcher", "gloo"),
    "zero-2": ("--strategy", "zero", "--launcher", "gloo", "--set", "zero_stage=2"),
    "fsdp": ("--strategy", "fsdp"),
    "ddp+zro": (),
}
"""hvdtrain runs, and (ddp+zro) the hand-written DDP loop with torch's ZeroRedundancyOptimizer."""
NPS = (1, 2, 4)
MIB = 1 << 20


def measure(out: Path, name: str, np_: int) -> dict:
    if name == "ddp+zro":
        return zero_redundancy(np_)
    settings = [arg for key, value in {**WIDE, **QUICK}.items() for arg in ("--set", f"{key}={value}")]
    run_dir = out / f"memory-{name}-{np_}"
    hvdtrain_run("gpt-torch", *RUNS[name], "--np", str(np_), *settings, run_dir=run_dir)
    return json.loads((run_dir / "summary.json").read_text())


def main(out: Path) -> None:
    print(
        f"{'np':>2}  {'strategy':<8} {'params MiB/rank':>15} {'optimizer MiB/rank':>18} "
        f"{'peak RSS MiB/rank':>17} {'samples/s':>9}  optimizer vs horovod"
    )
    for np_ in NPS:
        plain = None
        for name in RUNS:
            found = measure(out, name, np_)
            params, state = max(found["param_bytes"]), max(found["optimizer_state_bytes"])
            plain = plain or state
            print(
                f"{np_:>2}  {name:<8} {params / MIB:>15.1f} {state / MIB:>18.1f} "
                f"{max(found['peak_rss_mib']):>17.0f} {found['steady_samples_per_sec']:>9.1f}  "
                f"{state / plain:.3f}",
                flush=True,
            )


def zero_redundancy(np_: int) -> dict:
    """The hand-written DDP loop with ZeroRedundancyOptimizer, its threads as hvdtrain gives ranks."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(np_)]
    argv += [str(PROGRAMS / "zero_redundancy.py"), "--epochs", str(QUICK["epochs"])]
    argv += [
        "--steps",
        str(QUICK["steps_per_epoch"]),
        *(f"--set={key}={value}" for key, value in WIDE.items()),
    ]
    threads = str(max(1, (os.cpu_count() or 1) // np_))
    done = subprocess.run(
        argv, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": threads}
    )
    found = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not found:
        raise BenchError(f"zero_redundancy.py at np={np_} exited {done.returncode}: {done.stderr[-2000:]}")
    return json.loads(found[-1])
