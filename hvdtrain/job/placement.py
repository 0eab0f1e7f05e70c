"""Where a run's ranks go, decided from the request and the facts: the hosts (--hosts, --hostfile or
a Slurm allocation), how many ranks, whether this host can carry its share, and how hvdtrain
reaches the others."""

from __future__ import annotations

from dataclasses import dataclass

from hvdtrain import launchers, strategies
from hvdtrain.job.facts import Facts
from hvdtrain.job.request import RunRequest, requested_hosts
from hvdtrain.launching import remote, slurm
from hvdtrain.launching.spec import LOOPBACK_NAMES, Host, is_local

RANKS_PER_CORE_LIMIT = 4
RANK_MEMORY = {"torch": 400 << 20, "tensorflow": 900 << 20}
"""A rank's resident memory, measured here on the digits and synthetic recipes (make bench prints it)."""


@dataclass(frozen=True)
class Placement:
    hosts: tuple[Host, ...]
    """The hosts of --hosts, --hostfile or the allocation; () for this machine alone."""
    np: int
    allocation: slurm.Allocation | None
    """The Slurm allocation the ranks take their hosts from (None outside one, and for the
    strategies that run on this node only)."""
    this_node: str
    slurm_job: slurm.Allocation | None
    """The Slurm job this run is inside, whatever the strategy."""
    slurm_line: str
    """The line that says where in Slurm the run is ("" outside it)."""


def place(request: RunRequest, facts: Facts) -> Placement:
    hosts = requested_hosts(request, facts.hostfile_text)
    slurm_job = slurm.allocation_from(facts.environ)
    allocation, this_node, slurm_line = _allocation(request, facts, slurm_job)
    if allocation is not None and hosts:
        slurm.hosts_within(hosts, allocation, this_node)
    elif allocation is not None:
        hosts = allocation.hosts()
        if allocation.nodes == (this_node,):  # one node: ranks talk as on any one machine
            hosts = (Host("localhost", allocation.tasks),)
        if request.np is not None and request.np > allocation.tasks:
            raise ValueError(
                f"--np {request.np} is more than the {allocation.tasks} tasks of Slurm job "
                f"{allocation.job_id} ({allocation.describe()})"
            )
    np = (sum(h.slots for h in hosts) if hosts else facts.cores) if request.np is None else request.np
    if np < 1:
        raise ValueError(f"--np must be at least 1, got {np}")
    if allocation is not None and request.np is None:
        slurm_line += f": --np {np} on its {allocation.describe()}"
    return Placement(hosts, np, allocation, this_node, slurm_job, slurm_line)


def _allocation(
    request: RunRequest, facts: Facts, allocation: slurm.Allocation | None
) -> tuple[slurm.Allocation | None, str, str]:
    """The Slurm allocation a Horovod run takes its hosts from (None outside one, and for the other
    strategies, which run on this node), this node's Slurm name, and the line saying so."""
    if allocation is None or request.image:
        return None, facts.hostname, ""
    this_node = facts.environ.get("SLURMD_NODENAME") or facts.hostname
    line = f"hvdtrain: inside Slurm job {allocation.job_id}"
    if allocation.restart_count and request.resume:
        line += f", requeued (restart {allocation.restart_count}): the run resumes"
    if not strategies.spans_hosts(request.strategy):
        return None, this_node, f"{line}: {request.strategy} runs on this node"
    return allocation, this_node, line


def local_load(np: int, hosts, framework: str, facts: Facts, oversubscribe: bool) -> tuple[str, ...]:
    """Refuse, before anything starts, more ranks than this host can run; say so when they share cores."""
    local = np if not hosts or is_local(hosts) else sum(h.slots for h in hosts if h.name in LOOPBACK_NAMES)
    local = min(local, np)
    needed = local * RANK_MEMORY[framework]
    if not oversubscribe and local > RANKS_PER_CORE_LIMIT * facts.cores:
        raise ValueError(
            f"--np {np} puts {local} ranks on this host's {facts.cores} cores (more than "
            f"{RANKS_PER_CORE_LIMIT} per core would make no progress); lower --np or pass --oversubscribe"
        )
    if not oversubscribe and needed > facts.memory_available:
        raise ValueError(
            f"{local} {framework} ranks need about {needed >> 30} GiB here and "
            f"{facts.memory_available >> 30} GiB is free; lower --np or pass --oversubscribe"
        )
    return (f"hvdtrain: {local} ranks share this host's {facts.cores} cores",) if local > facts.cores else ()


def reach(request: RunRequest, facts: Facts, where: Placement) -> tuple[tuple[str, ...], remote.Transport]:
    """The hosts other than this one, and how hvdtrain reaches them (ssh, or a Slurm job step)."""
    hosts, allocation = where.hosts, where.allocation
    if allocation is not None:  # the allocation's nodes by their Slurm names
        others = tuple(h.name for h in hosts if h.name not in (where.this_node, *LOOPBACK_NAMES))
    else:
        others = _remote_hosts(hosts, facts)
    if others and request.image:
        raise ValueError("--image runs on this host only; give --hosts without --image")
    discovered = bool(request.strategy_options.get("host_discovery_script"))  # hosts found as it runs
    for flag, value in (("--ssh-port", request.ssh_port), ("--ssh-identity-file", request.ssh_identity_file)):
        if value is not None and not others and not discovered:
            raise ValueError(
                f"{flag} applies to runs on other hosts (--hosts, --hostfile or --host-discovery-script)"
            )
    if request.ssh_port is not None and not 0 < request.ssh_port < 65536:
        raise ValueError(f"--ssh-port must be a port number (1-65535), got {request.ssh_port}")
    transport: remote.Transport = remote.Ssh(request.ssh_port, request.ssh_identity_file)
    if allocation is not None and (steps := launchers.in_allocation(facts.executables)) and steps.transport:
        transport = steps.transport()
    return others, transport


def _remote_hosts(hosts, facts: Facts) -> tuple[str, ...]:
    """The hosts that are not this machine; a name that does not resolve is refused here."""
    if unresolved := [
        h.name for h in hosts if h.name not in LOOPBACK_NAMES and not facts.host_addresses.get(h.name)
    ]:
        raise ValueError(f"host {unresolved[0]} does not resolve to an address")
    return tuple(
        h.name
        for h in hosts
        if h.name not in LOOPBACK_NAMES
        and facts.host_addresses[h.name] not in facts.local_addresses
        and not facts.host_addresses[h.name].startswith("127.")  # Debian maps its own name to 127.0.1.1
    )
