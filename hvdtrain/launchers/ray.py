"""Horovod on Ray: horovod.ray's RayExecutor starts the ranks as Ray actors, on a Ray cluster started
for the run (the default) or an existing one (--ray-address). With --min-np/--max-np the job is
elastic: Horovod's elastic driver over the cluster's nodes.

The argv is hvdtrain's small Ray driver (hvdtrain.launchers.ray_driver) with the worker's argv after
`--`: the driver starts or joins Ray, runs `hvdtrain.worker` in every rank's actor, writes each rank's
output under the log directory and stops what it started.
"""

from __future__ import annotations

import re

from hvdtrain.launch import LaunchCommand, LaunchSpec
from hvdtrain.launchers import HorovodLaunch, Launcher

DRIVER = "hvdtrain.launchers.ray_driver"
WORKER = ["-m", "hvdtrain.worker"]
MODULE = "ray"
NEEDS_RAY = "--launcher ray needs Ray: pip install 'hvdtrain[ray]'"
FAILED_RANK = re.compile(r"ray: rank (\d+) failed with exit code (?P<code>-?\d+)")
"""The driver's line naming the first rank that failed (ray_driver.report_failure writes it)."""


def check(spec: LaunchSpec, options: HorovodLaunch) -> None:
    """What Ray cannot run, refused before anything starts."""
    if spec.hosts:
        raise ValueError(
            "--launcher ray places ranks on a Ray cluster's nodes: give --ray-address, not --hosts"
        )
    if options.discovery_script:
        raise ValueError("--host-discovery-script is for --launcher elastic; Ray finds its nodes itself")
    if spec.program[1:3] != WORKER:
        raise ValueError(f"--launcher ray runs {' '.join(WORKER)}, not {spec.program[1:3]}")
    if options.ray_address and options.ray_address.startswith("ray://"):
        raise ValueError("--ray-address takes the cluster's HOST:PORT (Ray Client, ray://, is not supported)")
    if spec.network_interface and not options.ray_address:
        raise ValueError(
            "--network-interface applies to --launcher ray with --ray-address "
            "(the Ray started for a run is on this host alone: its ranks talk over loopback)"
        )
    low, high = options.min_np, options.max_np
    if low is None:
        return
    if options.ray_address and not spec.network_interface:
        raise ValueError(
            "elastic training on a Ray cluster needs --network-interface (the NIC its nodes share): "
            "Horovod's elastic driver cannot pick one while the cluster has a single node"
        )
    if high is None or not 1 <= low <= high:
        raise ValueError(f"--min-np {low} and --max-np {high}: need 1 <= min-np <= max-np")
    if not low <= spec.np <= high:
        raise ValueError(f"--np {spec.np} must lie between --min-np {low} and --max-np {high}")


def cpus_per_rank(spec: LaunchSpec) -> int:
    """Ray's CPU resource per rank: the threads each rank runs ("auto", decided on each host: 1)."""
    threads = spec.env.get("HVDTRAIN_THREADS_PER_RANK", "1")
    return int(threads) if threads.isdigit() else 1


def build(spec: LaunchSpec, options: HorovodLaunch) -> LaunchCommand:
    check(spec, options)
    python, *program = spec.program
    argv = [python, "-m", DRIVER, "--np", str(spec.np), "--cpus-per-rank", str(cpus_per_rank(spec))]
    if options.ray_address:
        argv += ["--address", options.ray_address]
    if options.min_np is not None:
        argv += ["--min-np", str(options.min_np), "--max-np", str(options.max_np)]
    if spec.network_interface:
        argv += ["--network-interface", spec.network_interface]
    if spec.log_dir:
        argv += ["--log-dir", spec.log_dir]
    # Ray actors get the cluster's environment; like mpirun -x, the driver passes on only these.
    for name in sorted(spec.env) + [n for n in spec.forward_env if n not in spec.env]:
        if not name.startswith("RAY_"):  # the driver's own (auth), not the ranks'
            argv += ["--env", name]
    return LaunchCommand([*argv, "--", *program], spec.env)


LAUNCHER = Launcher(
    name="ray",
    description="horovod.ray on a Ray cluster (one started for the run, or --ray-address)",
    build=build,
    failed_rank_patterns=(FAILED_RANK,),
    module=MODULE,
    missing=NEEDS_RAY,
    auto=False,
)
