"""Horovod on Ray: horovod.ray's RayExecutor starts the ranks as Ray actors, on a Ray cluster started
for the run (the default) or an existing one (--ray-address). With --min-np/--max-np the job is
elastic: Horovod's elastic driver over the cluster's nodes.

The argv is hvdtrain's small Ray driver (hvdtrain.launchers.ray_driver) with the worker's argv after
`--`: the driver starts or joins Ray, runs `hvdtrain.worker` in every rank's actor, writes each rank's
output under the log directory and stops what it started.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from typing import Any

from hvdtrain.launchers import LaunchContext, Launcher
from hvdtrain.launchers.elastic import RANGE, elastic_range
from hvdtrain.launchers.gloo import HOROVODRUN_OUTPUT
from hvdtrain.launching.spec import LaunchCommand, LaunchSpec
from hvdtrain.options import Option

DRIVER = "hvdtrain.launchers.ray_driver"
WORKER = ["-m", "hvdtrain.worker"]
MODULE = "ray"
CLUSTER_HERE = "auto"
"""The --ray-address Ray itself takes for the cluster this machine is a node of (`ray start` here)."""
NEEDS_RAY = "--launcher ray needs Ray: pip install 'hvdtrain[ray]'"
FAILED_RANK = re.compile(r"ray: rank (\d+) failed with exit code (?P<code>-?\d+)")
"""The driver's line naming the first rank that failed (ray_driver.report_failure writes it)."""


def split_address(address: str) -> tuple[str, str | None]:
    """--ray-address's HOST and PORT (None: no port given); an IPv6 HOST loses its brackets."""
    host, colon, port = address.rpartition(":")
    if not colon:
        return address, None
    return (host[1:-1] if host.startswith("[") and host.endswith("]") else host), port


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def named_hosts(options: Mapping[str, Any]) -> tuple[str, ...]:
    """--ray-address's host name, to look up before planning (an IP address needs no lookup)."""
    address = options.get("ray_address")
    if not address or address == CLUSTER_HERE or address.startswith("ray://"):
        return ()
    host, _ = split_address(address)
    return (host,) if host and not _is_ip(host) else ()


def address_problem(address: str, addresses: Mapping[str, str | None]) -> str | None:
    """What is wrong with --ray-address, naming the part, before the driver would fail to join it."""
    if address == CLUSTER_HERE:
        return None
    if address.startswith("ray://"):
        return "give the cluster's HOST:PORT (Ray Client, ray://, is not supported)"
    host, port = split_address(address)
    if port is None:
        return "give the cluster's HOST:PORT (no port)"
    if not re.fullmatch(r"[0-9]{1,5}", port) or not 1 <= int(port) <= 65535:
        return f"port {port!r} is not a port number (1-65535)"
    if not host:
        return "give the cluster's HOST:PORT (no host)"
    if not _is_ip(host) and not addresses.get(host):
        return f"host {host!r} does not resolve to an address"
    return None


def check(spec: LaunchSpec, options: Mapping[str, Any], addresses: Mapping[str, str | None]) -> None:
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
    if address and (problem := address_problem(address, addresses)):
        raise ValueError(f"--ray-address {address!r}: {problem}")
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


def build(spec: LaunchSpec, context: LaunchContext, options: Mapping[str, Any]) -> LaunchCommand:
    check(spec, options, context.host_addresses)
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
    named_hosts=named_hosts,
    module=MODULE,
    missing=NEEDS_RAY,
    auto=False,
    takes_elastic=True,
    takes_stop_request=False,
)
