"""`make gpu-check`, on a CUDA machine: resnet-torch and gpt-torch on every GPU, under horovod (NCCL),
ddp and fsdp, in fp32 and bf16, samples/s side by side with horovod's ratio to each.

It runs in .venv-gpu, which `make gpu-wheel` made: PyPI's CUDA build of torch and its CUDA toolkit,
and Horovod built with NCCL through the same build script and patches as `make install`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = {  # recipe -> settings: the models of `make bench`, at sizes a GPU step is worth timing
    "resnet-torch": ("--set", "image_size=224", "--set", "batch_size=64"),
    "gpt-torch": ("--set", "batch_size=32"),
}
STRATEGIES = ("horovod", "ddp", "fsdp")
PRECISIONS = ("fp32", "bf16")
STEPS, EPOCHS = 50, 3


def gpu_count() -> int:
    if not shutil.which("nvidia-smi"):
        return 0
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return (
        sum(line.startswith("GPU ") for line in listed.stdout.splitlines()) if listed.returncode == 0 else 0
    )


def samples_per_sec(recipe: str, strategy: str, precision: str, gpus: int) -> tuple[float, str]:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = ROOT / "runs" / f"gpu-check-{recipe}-{strategy}-{precision}-{stamp}"
    argv = [sys.executable, "-m", "hvdtrain", "run", recipe, "--np", str(gpus), "--strategy", strategy]
    argv += [*WORKLOADS[recipe], "--set", f"precision={precision}", "--set", "checkpoint=false"]
    argv += ["--set", f"epochs={EPOCHS}", "--set", f"steps_per_epoch={STEPS}", "--run-dir", str(run_dir)]
    print("+", " ".join(argv), flush=True)
    subprocess.run(argv, check=True)
    summary = json.loads((run_dir / "summary.json").read_text())
    return float(summary["steady_samples_per_sec"]), str(summary.get("device"))


def main() -> int:
    gpus = gpu_count()
    if gpus == 0:
        print(
            "gpu-check: no NVIDIA GPU here (nvidia-smi lists none); run it on a CUDA machine", file=sys.stderr
        )
        return 2
    subprocess.run(
        [sys.executable, "-m", "hvdtrain", "doctor", "--require", "torch,gloo,mpi,nccl"], check=True
    )
    rates = {
        (recipe, strategy, precision): samples_per_sec(recipe, strategy, precision, gpus)
        for recipe in WORKLOADS
        for precision in PRECISIONS
        for strategy in STRATEGIES
    }
    print(f"\ngpu-check: {gpus} GPU(s), steady samples/s (first epoch left out)")
    print(
        f"{'recipe':<14}{'precision':<10}" + "".join(f"{s:>10}" for s in STRATEGIES) + "  hvd/ddp  hvd/fsdp"
    )
    for recipe in WORKLOADS:
        for precision in PRECISIONS:
            row = {s: rates[recipe, s, precision][0] for s in STRATEGIES}
            cells = "".join(f"{row[s]:>10,.0f}" for s in STRATEGIES)
            ratios = f"{row['horovod'] / row['ddp']:>9.2f}{row['horovod'] / row['fsdp']:>10.2f}"
            print(f"{recipe:<14}{precision:<10}{cells}{ratios}")
    print(f"device (rank 0): {rates[next(iter(rates))][1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
