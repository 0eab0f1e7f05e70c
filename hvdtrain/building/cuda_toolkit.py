"""What a Horovod build with NCCL needs beside a CUDA build of torch, read from that torch's own
metadata: the CUDA major it was built for, the PyPI packages to compile against it (nvcc, the runtime
headers and libraries, CCCL) at the version torch pins, and the NCCL distribution torch loads, so
Horovod links the very NCCL that torch brings. Nothing here needs a GPU or a system CUDA: the
toolkit comes from PyPI like torch's own CUDA libraries. Standard library only, like horovod_wheel.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*(?:===?\s*([^;\s,]+))?")
_CU_SUFFIX = re.compile(r"-cu(\d+)$")

TOOLKIT_EXTRAS = "nvcc,cccl,cudart"
"""cuda-toolkit's extras that compile a CUDA extension: nvcc (with crt and nvvm), CCCL and cudart."""


@dataclass(frozen=True)
class CudaTorch:
    major: int
    toolkit: tuple[str, ...]
    """pip requirements of the compiler, headers and runtime, at the CUDA release torch was built with."""
    nccl: str
    """The distribution torch loads NCCL from, e.g. nvidia-nccl-cu13."""

    def key(self, nccl_version: str) -> dict[str, str]:
        """What goes into the wheel cache key: the build's toolkit and NCCL, not where they lie."""
        return {
            "cuda": f"{self.major}",
            "cuda-toolkit": " ".join(self.toolkit),
            "nccl": f"{self.nccl}=={nccl_version}",
        }


def requirements(requires: Iterable[str]) -> dict[str, str]:
    """name -> pinned version ('' unpinned) of each unconditional requirement (extras' are skipped)."""
    found = {}
    for line in requires:
        requirement, _, marker = line.partition(";")
        if "extra" in marker:
            continue
        if match := _REQUIREMENT.match(requirement):
            found[match[1].lower().replace("_", "-")] = match[2] or ""
    return found


def cuda_torch(requires: Iterable[str]) -> CudaTorch | None:
    """The CUDA build behind these requirements of torch's, or None for a CPU build (none of NVIDIA's
    packages among them). torch 2.13 pins `cuda-toolkit[...]==X.Y.Z` and `nvidia-nccl-cuNN`; older
    CUDA 12 builds pinned each library as `nvidia-<part>-cu12`."""
    pinned = requirements(requires)
    nccl = next((name for name in pinned if name.startswith("nvidia-nccl-cu")), None)
    if nccl is None:
        return None
    major = int(_CU_SUFFIX.search(nccl)[1])
    if pinned.get("cuda-toolkit"):
        return CudaTorch(major, (f"cuda-toolkit[{TOOLKIT_EXTRAS}]=={pinned['cuda-toolkit']}",), nccl)
    runtime = pinned.get(f"nvidia-cuda-runtime-cu{major}", "")
    release = ".".join(runtime.split(".")[:2])
    pin = f"=={release}.*" if release else ""
    parts = ("nvidia-cuda-nvcc", "nvidia-cuda-runtime", "nvidia-cuda-cccl")
    return CudaTorch(major, tuple(f"{part}-cu{major}{pin}" for part in parts), nccl)


def cuda_home(site_packages: Path) -> Path | None:
    """The toolkit folder the PyPI packages make: nvcc, the runtime headers and its libraries under one
    root (nvidia/cu13/ for CUDA 13). CUDA 12's packages spread them over several folders, which
    Horovod's CMake cannot take; then None, and HOROVOD_CUDA_HOME must name a toolkit."""
    for nvcc in sorted(site_packages.glob("nvidia/*/bin/nvcc")):
        root = nvcc.parent.parent
        if (root / "include" / "cuda_runtime.h").exists():
            return root
    return None


def build_env(home: Path, nccl_root: Path, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment for Horovod's build against that toolkit and NCCL; NCCL settings the user made
    (HOROVOD_NCCL_HOME for a system NCCL, say) are kept. torch's cpp_extension reads CUDA_HOME. PyPI's
    NCCL is a shared library only (libnccl.so.2), hence HOROVOD_NCCL_LINK=SHARED. PyPI's toolkit
    keeps its libraries in lib/ where nvcc's own profile looks in lib64/, hence NVCC_APPEND_FLAGS."""
    env = {
        "HOROVOD_GPU_OPERATIONS": environ.get("HOROVOD_GPU_OPERATIONS", "NCCL"),
        "HOROVOD_CUDA_HOME": str(home),
        "CUDA_HOME": str(home),
    }
    if not any(name.startswith("HOROVOD_NCCL_") for name in environ):
        env |= {"HOROVOD_NCCL_HOME": str(nccl_root), "HOROVOD_NCCL_LINK": "SHARED"}
    if (home / "lib").is_dir() and not (home / "lib64").exists():
        env["NVCC_APPEND_FLAGS"] = f"{environ.get('NVCC_APPEND_FLAGS', '')} -L{home / 'lib'}".strip()
    return env
