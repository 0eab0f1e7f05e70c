"""The environment the launcher and the ranks get from this process: a policy, not a copy of everything."""

from __future__ import annotations

HOST_SPECIFIC = frozenset(
    {"HOME", "USER", "LOGNAME", "SHELL", "TERM", "TMPDIR", "SSH_AUTH_SOCK", "LD_PRELOAD", "KRB5CCNAME"}
    | {"XDG_RUNTIME_DIR", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME"}
)
"""Forwarded to the launcher, but not pushed by mpirun -x to ranks on other hosts, which have their own."""
FORWARDED_NAMES = HOST_SPECIFIC | frozenset(
    {"PATH", "LANG", "LANGUAGE", "TZ", "LD_LIBRARY_PATH", "VIRTUAL_ENV", "CONDA_PREFIX"}
    | {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH"}  # how --launcher ray reaches a cluster (not the token)
    | {"http_proxy", "https_proxy", "no_proxy", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY"}
)
FORWARDED_PREFIXES = (
    "HVDTRAIN_", "HOROVOD_", "PYTHON", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "TF_", "XLA_", "TORCH",
    "PYTORCH_", "CUDA_", "NCCL_", "NVIDIA_", "GLOO_", "OMPI_", "OPAL_", "PMIX_", "PRTE_", "UCX_",
    "HWLOC_", "SLURM_", "PBS_", "LSB_", "LC_", "XDG_",
)  # fmt: skip
"""The environment the launcher and ranks get: hvdtrain's, the frameworks' and the system's
variables, plus what --env names; nothing else (tokens and cloud keys stay in this process)."""


def forwarded_environment(environ: dict[str, str], requested: tuple[str, ...]) -> dict[str, str]:
    """The variables passed on to the ranks; a --env name that is not set is refused."""
    if missing := [name for name in requested if name not in environ]:
        raise ValueError(f"--env {missing[0]}: not set in this environment")
    return {
        name: value
        for name, value in environ.items()
        if name in FORWARDED_NAMES or name.startswith(FORWARDED_PREFIXES) or name in requested
    }
