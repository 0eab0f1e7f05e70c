"""Horovod on Ray: horovod.ray's RayExecutor starts the ranks as Ray actors, on a Ray cluster started
for the run (the default) or an existing one (--ray-address). With --min-np/--max-np the job is
elastic: Horovod's elastic driver over the cluster's nodes.

The argv is hvdtrain's small Ray driver (hvdtrain.launchers.ray_driver) with the worker's argv after
`--`: the driver starts or joins Ray, runs `hvdtrain.worker` in every rank's actor, writes each rank's
output under the log directory and stops what it started.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from hvdtrain.launch import LaunchCommand, LaunchSpec
from hvdtrain.launchers import Launcher, LauncherContext
from hvdtrain.launchers.elastic import RANGE, elastic_range
from hvdtrain.launchers.gloo import HOROVODRUN_OUTPUT
from hvdtrain.options import Option

DRIVER = "hvdtrain.launchers.ray_driver"
WORKER = ["-m", "hvdtrain.worker"]
MODULE = "ray"
NEEDS_RAY = "--launcher ray needs Ray: pip install 'hvdtrain[ray]'"
FAILED_RANK = re.compile(r"ray: rank (\d+) failed with exit code (?P<code>-?\d+)")
"""The driver's line naming the first rank that failed (ray_driver.report_failure writes it)."""


def check(spec: LaunchSpec, options: Mapping[str, Any]) -> None:
    """What Ray cannot run, refused before anything starts."""
    if spec.hosts:
        raise ValueError(
            "--launcher ray places ranks on a Ray cluster's nodes: give --ray-address, not --hosts"
        )
    if spec.discovery_script:
        raise ValueError("--host-discovery-script is for --launcher elastic; Ray finds its nodes itself")
    if spec.program[1:3] != WORKER:
        raise ValueError(f"--launcher ray runs {' '.join(WORKER)}, not {spec.program[1:3]}")
    address = options["ray_address"]
    if address and address.startswith("ray://"):
        raise ValueError("--ray-address takes the cluster's HOST:PORT (Ray Client, ray://, is not supported)")
    if spec.network_interface and not address:
        raise ValueError(
            "--network-interface applies to --launcher ray with --ray-address "
            "(the Ray started for a run is on this host alone: its ranks talk over loopback)"
        )
    if not elastic(options):
        return
    low, high = elastic_range(spec, options)
    if address and not spec.network_interface:
        raise ValueError(
            "elastic training on a Ray cluster needs --network-interface (the NIC its nodes share): "
            "Horovod's elastic driver cannot pick one while the cluster has a single node"
        )
    if not 1 <= low <= high:
        raise ValueError(f"--min-np {low} and --max-np {high}: need 1 <= min-np <= max-np")
    if not low <= spec.np <= high:
        raise ValueError(f"--np {spec.np} must lie between --min-np {low} and --max-np {high}")


def elastic(options: Mapping[str, Any]) -> bool:
    """Horovod's elastic driver on the cluster: a range of ranks was asked for."""
    return options["min_np"] is not None or options["max_np"] is not None


def cpus_per_rank(spec: LaunchSpec) -> int:
    """Ray's CPU resource per rank: the threads each rank runs ("auto", decided on each host: 1)."""
    threads = spec.env.get("HVDTRAIN_THREADS_PER_RANK", "1")
    return int(threads) if threads.isdigit() else 1


def build(spec: LaunchSpec, context: LauncherContext, options: Mapping[str, Any]) -> LaunchCommand:
    check(spec, options)
    python, *program = spec.program
    argv = [python, "-m", DRIVER, "--np", str(spec.np), "--cpus-per-rank", str(cpus_per_rank(spec))]
    if options["ray_address"]:
        argv += ["--address", options["ray_address"]]
    if elastic(options):
        low, high = elastic_range(spec, options)
        argv += ["--min-np", str(low), "--max-np", str(high)]
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
    output=HOROVODRUN_OUTPUT,  # the driver tags and keeps each rank's lines as horovodrun does
    failed_rank_patterns=(FAILED_RANK,),
    options=(
        *RANGE,
        Option(
            "ray_address",
            "--ray-address",
            None,
            "Join the Ray cluster at this address instead of starting one for the run.",
        ),
    ),
    module=MODULE,
    missing=NEEDS_RAY,
    auto=False,
    takes_elastic=True,
    takes_stop_request=False,
)
