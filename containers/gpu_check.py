"""`make gpu-check`, on a CUDA machine: Horovod built with NCCL, then digits and synthetic on every GPU
under the horovod and ddp strategies, samples/s side by side.

It makes its own environment (.venv-gpu: the CUDA torch wheel and TensorFlow with CUDA, pinned as in
versions.env) so the CPU venv of `make install` stays as it is, and builds Horovod through the same
build script and patches with HOROVOD_GPU_OPERATIONS=NCCL (a wheel cached under its own key).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "containers"))

from build_horovod import read_versions  # noqa: E402

VENV = ROOT / ".venv-gpu"
TORCH_INDEX_URL = os.environ.get("TORCH_INDEX_URL", "https://download.pytorch.org/whl/cu128")
RECIPES = ("digits-mlp-torch", "synthetic-torch")
STRATEGIES = ("horovod", "ddp")


def gpu_count() -> int:
    if not shutil.which("nvidia-smi"):
        return 0
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return (
        sum(line.startswith("GPU ") for line in listed.stdout.splitlines()) if listed.returncode == 0 else 0
    )


def sh(*argv: str, env: dict[str, str] | None = None) -> None:
    print("+", " ".join(argv), flush=True)
    subprocess.run(argv, check=True, env={**os.environ, **(env or {})})


def make_venv(versions: dict[str, str]) -> Path:
    python = VENV / "bin" / "python"
    if not python.exists():
        sh(sys.executable, "-m", "venv", str(VENV))
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    sh(*pip, "--upgrade", "pip", "wheel", "setuptools")
    sh(*pip, "--extra-index-url", TORCH_INDEX_URL, f"torch=={versions['TORCH_VERSION']}")
    sh(
        *pip,
        f"tensorflow[and-cuda]=={versions['TENSORFLOW_VERSION']}",
        "nvidia-nccl-cu12",
        "-e",
        f"{ROOT}[mpi]",
    )
    return python


def nccl_home(python: Path) -> str:
    """NCCL's headers and library as the nvidia-nccl wheel installs them, unless the system has them."""
    if os.environ.get("HOROVOD_NCCL_HOME"):
        return os.environ["HOROVOD_NCCL_HOME"]
    code = "import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))"
    return subprocess.run(
        [str(python), "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()


def samples_per_sec(python: Path, recipe: str, strategy: str, gpus: int) -> tuple[float, str]:
    run_dir = ROOT / "runs" / f"gpu-check-{recipe}-{strategy}-{time.strftime('%Y%m%d-%H%M%S')}"
    argv = [str(python), "-m", "hvdtrain", "run", recipe, "--np", str(gpus), "--strategy", strategy]
    sh(*argv, "--run-dir", str(run_dir))
    summary = json.loads((run_dir / "summary.json").read_text())
    return float(summary["steady_samples_per_sec"]), str(summary.get("device"))


def main() -> int:
    gpus = gpu_count()
    if gpus == 0:
        print(
            "gpu-check: no NVIDIA GPU here (nvidia-smi lists none); run it on a CUDA machine", file=sys.stderr
        )
        return 2
    versions = read_versions()
    python = make_venv(versions)
    build_env = {
        "HOROVOD_GPU_OPERATIONS": "NCCL",
        "HOROVOD_NCCL_HOME": nccl_home(python),
        "HOROVOD_CUDA_HOME": os.environ.get("HOROVOD_CUDA_HOME", "/usr/local/cuda"),
    }
    sh(str(python), str(ROOT / "containers" / "build_horovod.py"), "--python", str(python), env=build_env)
    rows = []
    for recipe in RECIPES:
        rates = {strategy: samples_per_sec(python, recipe, strategy, gpus) for strategy in STRATEGIES}
        rows.append((recipe, rates))
    print(f"\ngpu-check: {gpus} GPU(s), steady samples/s (first epoch left out)")
    print(f"{'recipe':<18} {'horovod':>12} {'ddp':>12} {'horovod/ddp':>12}  device (rank 0)")
    for recipe, rates in rows:
        (horovod, device), (ddp, _) = rates["horovod"], rates["ddp"]
        print(f"{recipe:<18} {horovod:>12,.0f} {ddp:>12,.0f} {horovod / ddp:>12.2f}  {device}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
