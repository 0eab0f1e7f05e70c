"""mpirun (Open MPI): Horovod's MPI controller."""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hvdtrain import native
from hvdtrain.launchers import LaunchContext, Launcher
from hvdtrain.launching.remote import Ssh
from hvdtrain.launching.spec import LaunchCommand, LaunchSpec, RankOutput, host_argument, interface_for
from hvdtrain.options import Option

ALLREDUCE_RULES = Path(__file__).with_name("allreduce_rules.conf")
"""Which allreduce algorithm Open MPI takes, by message size (the file says why)."""


def build(spec: LaunchSpec, context: LaunchContext, options: Mapping[str, Any]) -> LaunchCommand:
    argv = ["mpirun"]
    if context.run_as_root:
        argv.append("--allow-run-as-root")
    argv += ["-np", str(spec.np), "-H", host_argument(spec), "--bind-to", "none", "--map-by", "slot"]
    argv.append("--tag-output")
    # Open MPI busy-polls while a rank waits, which steals the cores the other ranks compute on
    # (docs/performance.md has what yielding gains).
    argv += ["--mca", "mpi_yield_when_idle", "1"]
    if context.allreduce_rules:
        argv += ["--mca", "coll_tuned_use_dynamic_rules", "1"]
        argv += ["--mca", "coll_tuned_dynamic_rules_filename", context.allreduce_rules]
    interface = interface_for(spec)
    if interface == "lo":  # one host: ranks talk through shared memory and listen on no TCP port
        argv += ["--mca", "btl", "self,vader", "--mca", "oob_tcp_if_include", "lo"]
        argv += ["--mca", "oob_tcp_disable_ipv6_family", "1"]
    else:  # other hosts over ssh: a host that cannot be reached, or goes away, ends the job in seconds
        # (without keepalives mpirun waited on a remote orted whose link went down for 8+ minutes)
        argv += ["--mca", "plm_rsh_args", " ".join(Ssh(spec.ssh_port, spec.ssh_identity_file).args())]
        if interface:
            argv += ["--mca", "btl_tcp_if_include", interface, "--mca", "oob_tcp_if_include", interface]
    # Open MPI binds its listeners to every interface whatever *_if_include says: mpirun's and each
    # orted's out-of-band one, and on several hosts the ranks' TCP BTL. They run with hvdtrain's
    # library that narrows a wildcard bind to the run's interface (it leaves what they start alone).
    launcher_env = {}
    if context.bind_library and interface:
        launcher_env = native.preload_env(context.bind_library, interface)
        assignments = [f"{name}={value}" for name, value in launcher_env.items()]
        if interface != "lo":  # IPv4 only, as on one host: the library narrows to one address each
            argv += ["--mca", "orte_launch_agent", " ".join(["env", *assignments, "orted"])]
            argv += ["--mca", "oob_tcp_disable_ipv6_family", "1", "--mca", "btl_tcp_disable_family", "6"]
            for assignment in assignments:
                argv += ["-x", assignment]
    if spec.log_dir:
        argv += ["--output-filename", spec.log_dir]
    # Open MPI passes on to the ranks only the variables -x names.
    for name in sorted(spec.env) + [n for n in spec.forward_env if n not in spec.env]:
        argv += ["-x", name]
    try:  # last, so that the user's own mpirun options win over hvdtrain's
        argv += shlex.split(options.get("mpi_args") or "")
    except ValueError as error:
        raise ValueError(f"--mpi-args: {error}") from None
    return LaunchCommand(argv + list(spec.program), {**spec.env, **launcher_env})


LAUNCHER = Launcher(
    name="mpi",
    description="mpirun (Open MPI) with Horovod's MPI controller",
    build=build,
    # --tag-output: `[1,0]<stdout>:` (job, rank); --output-filename: LOG_DIR/1/rank.N/
    output=RankOutput(
        tag=r"\[\d+,(?P<rank>\d+)\]<std(?P<stream>out|err)>:", logs="*/rank.*/{stream}", in_pieces=True
    ),
    failed_rank_patterns=(
        re.compile(r"process rank (\d+) with PID \d+ on node \S+ exited on signal (?P<signal>\d+)"),
        re.compile(r"Process name: \[\[\d+,\d+\],(\d+)\]"),  # a rank that exited non-zero
    ),
    job_failing=(re.compile(r"the job has been aborted"),),
    local_env=("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    executable="mpirun",
    passes_on_usr1=True,
    options=(
        Option(
            "mpi_args",
            "--mpi-args",
            None,
            'More mpirun options, as one string (horovodrun\'s flag), e.g. "--mca btl_tcp_if_include eth0".',
        ),
    ),
)
