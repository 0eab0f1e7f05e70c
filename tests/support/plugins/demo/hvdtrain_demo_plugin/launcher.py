"""Open MPI's mpirun with other defaults: ranks placed round-robin over the hosts (`--map-by node`)
instead of filling each host's slots first."""

from __future__ import annotations

import dataclasses

from hvdtrain.launchers import mpi


def build(spec, context, options):
    command = mpi.LAUNCHER.build(spec, context, options)
    argv = list(command.argv)
    argv[argv.index("--map-by") + 1] = "node"
    return dataclasses.replace(command, argv=argv)


LAUNCHER = dataclasses.replace(
    mpi.LAUNCHER,
    name="mpi-by-node",
    description="Open MPI's mpirun placing ranks round-robin over the hosts (--map-by node)",
    build=build,
    auto=False,
)
