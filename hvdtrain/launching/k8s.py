"""A Kubeflow MPI Operator `MPIJob` (kubeflow.org/v2beta1) that runs an hvdtrain recipe on a cluster.

The launcher pod runs `mpirun` over the worker pods (the operator provides the hostfile and ssh);
each worker gets `slots_per_worker` ranks. Pure: it returns a dict; the CLI prints it as YAML.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from hvdtrain import strategies
from hvdtrain.launching.container import check_image
from hvdtrain.launching.spec import LaunchSpec


@dataclass(frozen=True)
class MPIJobSpec:
    recipe: str
    np: int
    image: str
    slots_per_worker: int = 1
    cpu_per_slot: str = "1"
    memory_per_worker: str = "4Gi"
    set_overrides: tuple[str, ...] = ()
    run_dir: str = "/workspace/run"
    name: str | None = None
    env: dict[str, str] = field(default_factory=dict)


def _dns_name(text: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:63] or "hvdtrain"


DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
"""Kubernetes' resource quantity, as the API server accepts it (e.g. 4Gi, 512M, 1.5G)."""


def _validate(spec: MPIJobSpec) -> None:
    """What the API server would refuse, refused here with the field's name."""
    if spec.name is not None and not DNS_LABEL.match(spec.name):
        raise ValueError(
            f"--name {spec.name!r}: a Kubernetes name is at most 63 lowercase letters, digits and '-', "
            "starting and ending with a letter or digit"
        )
    if not QUANTITY.match(spec.memory_per_worker):
        raise ValueError(
            f"--memory-per-worker {spec.memory_per_worker!r}: expected a quantity such as 4Gi or 512Mi"
        )
    check_image(spec.image)


def mpijob(spec: MPIJobSpec) -> dict:
    _validate(spec)
    if spec.np < 1 or spec.slots_per_worker < 1:
        raise ValueError(
            f"--np and --slots-per-worker must be at least 1, got {spec.np}, {spec.slots_per_worker}"
        )
    if spec.np % spec.slots_per_worker:
        raise ValueError(f"--np {spec.np} is not a multiple of --slots-per-worker {spec.slots_per_worker}")
    workers = spec.np // spec.slots_per_worker
    # No file system is shared between pods: each rank builds its config from the recipe and --set.
    program = [
        "python",
        "-m",
        "hvdtrain.worker",
        "--recipe",
        spec.recipe,
        "--run-dir",
        spec.run_dir,
        "--strategy",
        "horovod",
        *[item for pair in spec.set_overrides for item in ("--set", pair)],
    ]
    # The operator writes the hostfile (OMPI_MCA_orte_default_hostfile) and runs the launcher as the
    # image's user, so the launch is hvdtrain's MPI argv with the hosts left to Open MPI.
    horovod = strategies.get("horovod", "torch")
    launch_spec = LaunchSpec(
        program=program, np=spec.np, network_interface="eth0", env=dict(spec.env), forward_env=("PATH",)
    )
    context = strategies.LaunchContext(
        threads_per_rank=int(spec.cpu_per_slot), executables=frozenset({"mpirun"})
    )
    options = strategies.resolve_options(horovod, {"launcher": "mpi"})
    command = horovod.launch(launch_spec, options, context).command
    argv = list(command.argv)
    host_index = argv.index("-H")
    del argv[host_index : host_index + 2]
    name = spec.name or _dns_name(f"hvdtrain-{spec.recipe}")
    env = [{"name": key, "value": value} for key, value in sorted(command.env.items())]
    cpu = str(spec.slots_per_worker * int(spec.cpu_per_slot))
    return {
        "apiVersion": "kubeflow.org/v2beta1",
        "kind": "MPIJob",
        "metadata": {
            "name": name,
            "labels": {"app.kubernetes.io/name": "hvdtrain", "hvdtrain/recipe": spec.recipe},
        },
        "spec": {
            "slotsPerWorker": spec.slots_per_worker,
            "mpiImplementation": "OpenMPI",
            "runPolicy": {"cleanPodPolicy": "Running", "backoffLimit": 0},
            "mpiReplicaSpecs": {
                "Launcher": {
                    "replicas": 1,
                    "restartPolicy": "Never",
                    "template": {
                        "spec": {
                            "containers": [
                                {
                                    "name": "launcher",
                                    "image": spec.image,
                                    "command": argv,
                                    "env": env,
                                    "resources": {"limits": {"cpu": "1", "memory": "1Gi"}},
                                }
                            ]
                        }
                    },
                },
                "Worker": {
                    "replicas": workers,
                    "restartPolicy": "Never",
                    "template": {
                        "spec": {
                            "containers": [
                                {
                                    "name": "worker",
                                    "image": spec.image,
                                    "env": env,
                                    "resources": {
                                        "limits": {"cpu": cpu, "memory": spec.memory_per_worker},
                                        "requests": {"cpu": cpu, "memory": spec.memory_per_worker},
                                    },
                                }
                            ]
                        }
                    },
                },
            },
        },
    }
