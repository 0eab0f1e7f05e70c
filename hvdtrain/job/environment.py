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


COMMAND_LINE_PREFIXES = tuple(
    f"HVDTRAIN_{command}" for command in ("RUN_", "SUBMIT_", "BENCH_", "LIST_", "RUNS_", "SHOW_", "VERBOSE")
)
"""The hvdtrain command's own options given as variables (HVDTRAIN_RUN_NP=4): read by the command
line here, not passed on."""


def forwarded_environment(environ: dict[str, str], requested: tuple[str, ...]) -> dict[str, str]:
    """The variables passed on to the ranks, with what --env/-x asks: NAME (as set here; one that is
    not set is refused) or NAME=VALUE."""
    values = dict(entry.split("=", 1) for entry in requested if "=" in entry)
    names = {entry for entry in requested if "=" not in entry}
    if bad := [name for name in [*names, *values] if not name.isidentifier()]:
        raise ValueError(f"--env {bad[0]!r}: expected NAME or NAME=VALUE")
    if missing := sorted(names - environ.keys()):
        raise ValueError(
            f"--env {missing[0]}: not set in this environment (or give it: -x {missing[0]}=VALUE)"
        )
    passed = {
        name: value
        for name, value in environ.items()
        if (name in FORWARDED_NAMES or name.startswith(FORWARDED_PREFIXES) or name in names)
        and not name.startswith(COMMAND_LINE_PREFIXES)
    }
    return passed | values
