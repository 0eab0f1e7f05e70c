"""horovodrun elastic: Horovod's elastic driver over Gloo. Ranks may fail or hosts come and go; the
job goes on between --min-np and --max-np ranks, from the last committed state (hvd.elastic.run)."""

from __future__ import annotations

from hvdtrain.launch import LaunchCommand, LaunchSpec, host_argument, hosts_of
from hvdtrain.launchers import HorovodLaunch, Launcher
from hvdtrain.launchers.gloo import horovodrun_tail

COOLDOWN_S = (5, 30)
"""A failed host is blacklisted, then tried again after 5 s, 10 s, ... at most 30 s: without a cooldown
Horovod never takes a host back (measured: a host whose link returned rejoined 5 s later)."""


def check(spec: LaunchSpec, options: HorovodLaunch) -> None:
    """What Horovod's elastic driver cannot run, refused before anything starts."""
    low, high = options.min_np, options.max_np
    if low is None or high is None:
        raise ValueError("elastic training needs --min-np and --max-np")
    if not 1 <= low <= high:
        raise ValueError(f"--min-np {low} and --max-np {high}: need 1 <= min-np <= max-np")
    if not low <= spec.np <= high:
        raise ValueError(f"--np {spec.np} must lie between --min-np {low} and --max-np {high}")
    if options.discovery_script:
        if spec.hosts:
            raise ValueError("give --hosts or --host-discovery-script, not both")
        return
    if len({h.name for h in hosts_of(spec)}) < 2:
        raise ValueError(
            "elastic training needs two or more hosts (--hosts) or --host-discovery-script: "
            "Horovod takes a failed host out with all its slots"
        )


def build(spec: LaunchSpec, options: HorovodLaunch) -> LaunchCommand:
    check(spec, options)
    argv = [options.horovodrun, "-np", str(spec.np), "--min-np", str(options.min_np)]
    argv += ["--max-np", str(options.max_np)]
    if options.discovery_script:
        argv += ["--host-discovery-script", options.discovery_script, "--slots-per-host", "1"]
    else:
        argv += ["-H", host_argument(spec)]
    argv += ["--blacklist-cooldown-range", *map(str, COOLDOWN_S)]
    return LaunchCommand(argv + horovodrun_tail(spec, spec.network_interface), spec.env)


LAUNCHER = Launcher(
    name="elastic",
    description="horovodrun's elastic driver (gloo; --min-np/--max-np, 2+ hosts or a discovery script)",
    build=build,
    failed_rank_patterns=(),  # workers it removes on purpose print the gloo launcher's failure line
    auto=False,
)
