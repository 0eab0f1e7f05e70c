"""horovodrun elastic: Horovod's elastic driver over Gloo. Ranks may fail or hosts come and go; the
job goes on between --min-np and --max-np ranks, from the last committed state (hvd.elastic.run)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hvdtrain.launchers import LaunchContext, Launcher
from hvdtrain.launchers.gloo import HOROVODRUN_FAILING, HOROVODRUN_OUTPUT, horovodrun_tail
from hvdtrain.launching.spec import LaunchCommand, LaunchSpec, RankOutput, host_argument, hosts_of
from hvdtrain.options import Option

RANGE = (
    Option(
        "min_np",
        "--min-np",
        None,
        "Elastic: train on no fewer ranks (implies --launcher elastic, unless --launcher ray).",
        int,
    ),
    Option("max_np", "--max-np", None, "Elastic: grow to at most this many ranks. [default: --np]", int),
)
"""The range of ranks an elastic job keeps to (--launcher ray reads it too)."""

COOLDOWN_S = (5, 30)
"""A failed host is blacklisted, then tried again after 5 s, 10 s, ... at most 30 s: without a cooldown
Horovod never takes a host back."""


def elastic_range(spec: LaunchSpec, options: Mapping[str, Any]) -> tuple[int, int]:
    """--min-np and --max-np, 1 and --np where not given."""
    low, high = options["min_np"], options["max_np"]
    return (1 if low is None else low), (spec.np if high is None else high)


def check(spec: LaunchSpec, options: Mapping[str, Any]) -> None:
    """What Horovod's elastic driver cannot run, refused before anything starts."""
    low, high = elastic_range(spec, options)
    if not 1 <= low <= high:
        raise ValueError(f"--min-np {low} and --max-np {high}: need 1 <= min-np <= max-np")
    if not low <= spec.np <= high:
        raise ValueError(f"--np {spec.np} must lie between --min-np {low} and --max-np {high}")
    if spec.discovery_script:
        if spec.hosts:
            raise ValueError("give --hosts or --host-discovery-script, not both")
        return
    if len({h.name for h in hosts_of(spec)}) < 2:
        raise ValueError(
            "elastic training needs two or more hosts (--hosts) or --host-discovery-script: "
            "Horovod takes a failed host out with all its slots"
        )


def build(spec: LaunchSpec, context: LaunchContext, options: Mapping[str, Any]) -> LaunchCommand:
    check(spec, options)
    low, high = elastic_range(spec, options)
    argv = [context.horovodrun, "-np", str(spec.np), "--min-np", str(low), "--max-np", str(high)]
    if spec.discovery_script:
        argv += ["--host-discovery-script", spec.discovery_script, "--slots-per-host", "1"]
    else:
        argv += ["-H", host_argument(spec)]
    argv += ["--blacklist-cooldown-range", *map(str, COOLDOWN_S)]
    return LaunchCommand(argv + horovodrun_tail(spec, spec.network_interface), spec.env)


LAUNCHER = Launcher(
    name="elastic",
    description="horovodrun's elastic driver (gloo; --min-np/--max-np, 2+ hosts or a discovery script)",
    build=build,
    # under a horovodrun output folder of its own, rank.N/ as horovodrun's static one
    output=RankOutput(tag=HOROVODRUN_OUTPUT.tag, logs="**/rank.*/{stream}"),
    failed_rank_patterns=(),  # workers it removes on purpose print the gloo launcher's failure line
    job_failing=(HOROVODRUN_FAILING,),
    options=RANGE,
    auto=False,
    elastic=True,
    takes_elastic=True,
    takes_stop_request=False,
)
