"""A Horovod build with NCCL: which device the build is for, and the CUDA build of torch, the toolkit
it was built with and the NCCL it loads, installed from PyPI or, offline, found at hand. Standard
library only."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

from hvdtrain.building import cuda_toolkit
from hvdtrain.building.steps import BuildError, ask, installed_version, run


def device_of(choice: str) -> str:
    """cpu or cuda; auto is cuda where nvidia-smi lists a GPU."""
    if choice != "auto":
        return choice
    if shutil.which("nvidia-smi") is None:
        return "cpu"
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return "cuda" if listed.returncode == 0 and "GPU " in listed.stdout else "cpu"


def torch_requires(python: str) -> list[str]:
    return ask(
        python, "import importlib.metadata as m; print('\\n'.join(m.requires('torch') or []))"
    ).splitlines()


def nvcc_version(home: Path) -> str:
    """The last line of `nvcc --version` (e.g. "Build cuda_13.0.r13.0/compiler.36424714_0"), or
    "unknown" where that nvcc does not run."""
    try:
        out = subprocess.run([str(home / "bin" / "nvcc"), "--version"], capture_output=True, text=True)
    except OSError:
        return "unknown"
    lines = out.stdout.strip().splitlines()
    return lines[-1].strip() if out.returncode == 0 and lines else "unknown"


def offline_cuda_home(site: Path, environ: Mapping[str, str]) -> tuple[Path, str]:
    """The toolkit an offline build compiles with, and what kind it is: $HOROVOD_CUDA_HOME, else PyPI's
    toolkit in the environment (nvcc and cuda_runtime.h under nvidia/cuNN), else the toolkit of the
    `nvcc` on PATH."""
    if environ.get("HOROVOD_CUDA_HOME"):
        return Path(environ["HOROVOD_CUDA_HOME"]), "HOROVOD_CUDA_HOME"
    home = cuda_toolkit.cuda_home(site)
    if home is not None:
        return home, "pypi"
    nvcc = shutil.which("nvcc", path=environ.get("PATH", os.defpath))
    if nvcc is None:
        raise BuildError(
            f"offline: no CUDA toolkit: no nvcc with cuda_runtime.h under {site}/nvidia, no nvcc on "
            "PATH and no HOROVOD_CUDA_HOME"
        )
    home = Path(nvcc).resolve().parent.parent
    if not (home / "include" / "cuda_runtime.h").exists():
        raise BuildError(
            f"offline: the nvcc on PATH ({nvcc}) has no {home}/include/cuda_runtime.h; "
            "set HOROVOD_CUDA_HOME to a CUDA toolkit"
        )
    return home, "nvcc on PATH"


def nccl_root(site: Path, environ: Mapping[str, str]) -> Path:
    """The NCCL that torch loads (PyPI's, under nvidia/nccl), checked to hold the header Horovod compiles
    against; some releases of the pip package ship the library only. A NCCL the user named with
    HOROVOD_NCCL_* is theirs to vouch for."""
    root = site / "nvidia" / "nccl"
    if any(name.startswith("HOROVOD_NCCL_") for name in environ):
        return root
    if not (root / "include" / "nccl.h").exists():
        found = "has its library but no include/nccl.h" if (root / "lib").is_dir() else "is missing"
        raise BuildError(
            f"NCCL at {root} {found}; set HOROVOD_NCCL_HOME to a NCCL with include/nccl.h and lib/"
        )
    return root


def prepare_cuda(
    python: str, torch_version: str, offline: bool = False
) -> tuple[dict[str, str], dict[str, str]]:
    """Make the target environment's torch a CUDA build and install the toolkit that torch was built
    with, from PyPI; return the build's environment and what of it goes into the cache key. Offline,
    install nothing: torch must be a CUDA build already and the toolkit is the one at hand."""
    plan = cuda_toolkit.cuda_torch(torch_requires(python))
    if plan is None and offline:
        raise BuildError(f"offline: torch in {python} is not a CUDA build, and none can be installed")
    if plan is None:
        # `===` matches PyPI's own build only, never a local +cpu build of the same release.
        print(f"hvdtrain: installing the CUDA build of torch {torch_version} from PyPI", flush=True)
        run([python, "-m", "pip", "install", "--quiet", "--no-compile", f"torch==={torch_version}"])
        plan = cuda_toolkit.cuda_torch(torch_requires(python))
        if plan is None:
            raise BuildError(f"torch {torch_version} as pip installs it here is not a CUDA build")
    site = Path(ask(python, "import sysconfig; print(sysconfig.get_paths()['purelib'])"))
    settings = {}
    if offline:
        home, kind = offline_cuda_home(site, os.environ)
        # An offline toolkit is not the one torch pins: the key says which it was, so an offline
        # wheel and an online one never stand in for each other.
        settings["cuda-home"] = f"{kind}: {nvcc_version(home)}"
        print(
            f"hvdtrain: CUDA {plan.major} toolkit for the build: {home} ({settings['cuda-home']})", flush=True
        )
    else:
        print(f"hvdtrain: CUDA {plan.major} toolkit for the build: {' '.join(plan.toolkit)}", flush=True)
        run([python, "-m", "pip", "install", "--quiet", "--no-compile", *plan.toolkit])
        home = (
            Path(os.environ["HOROVOD_CUDA_HOME"])
            if "HOROVOD_CUDA_HOME" in os.environ
            else cuda_toolkit.cuda_home(site)
        )
        if home is None:
            raise BuildError(
                f"no CUDA {plan.major} toolkit with nvcc and cuda_runtime.h under {site}/nvidia; "
                "set HOROVOD_CUDA_HOME to a CUDA toolkit"
            )
    nccl = nccl_root(site, os.environ)
    nccl_version = installed_version(python, plan.nccl) or "system"
    return cuda_toolkit.build_env(home, nccl, os.environ), plan.key(nccl_version) | settings
