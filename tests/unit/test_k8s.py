"""`hvdtrain k8s` writes a Kubeflow MPIJob that the operator's CRD accepts."""

from __future__ import annotations

import jsonschema
import pytest
import yaml
from click.testing import CliRunner

from hvdtrain.cli import main
from hvdtrain.launching.k8s import MPIJobSpec, mpijob

# The parts of kubeflow/mpi-operator's kubeflow.org_mpijobs.yaml (v2beta1 openAPIV3Schema) that an
# MPIJob uses, written out here: field names, types and enums as the CRD declares them.
CONTAINER = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string"},
        "image": {"type": "string"},
        "command": {"type": "array", "items": {"type": "string"}},
        "args": {"type": "array", "items": {"type": "string"}},
        "env": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name"],
                "properties": {"name": {"type": "string"}, "value": {"type": "string"}},
                "additionalProperties": False,
            },
        },
        "resources": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "limits": {"type": "object", "additionalProperties": {"type": ["integer", "string"]}},
                "requests": {"type": "object", "additionalProperties": {"type": ["integer", "string"]}},
            },
        },
    },
    "additionalProperties": False,
}
REPLICA_SPEC = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "replicas": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1},
        "restartPolicy": {"type": "string", "enum": ["Always", "OnFailure", "Never", "ExitCode"]},
        "template": {
            "type": "object",
            "properties": {
                "metadata": {"type": "object"},
                "spec": {
                    "type": "object",
                    "required": ["containers"],
                    "properties": {
                        "containers": {"type": "array", "minItems": 1, "items": CONTAINER},
                    },
                },
            },
        },
    },
}
MPIJOB_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "kubeflow.org/v2beta1"},
        "kind": {"const": "MPIJob"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
        "spec": {
            "type": "object",
            "required": ["mpiReplicaSpecs"],
            "additionalProperties": False,
            "properties": {
                "slotsPerWorker": {"type": "integer", "minimum": 1},
                "mpiImplementation": {"type": "string", "enum": ["OpenMPI", "Intel", "MPICH"]},
                "runPolicy": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "cleanPodPolicy": {"type": "string", "enum": ["None", "Running", "All"]},
                        "backoffLimit": {"type": "integer"},
                        "activeDeadlineSeconds": {"type": "integer"},
                        "ttlSecondsAfterFinished": {"type": "integer"},
                    },
                },
                "mpiReplicaSpecs": {
                    "type": "object",
                    "required": ["Launcher"],
                    "propertyNames": {"enum": ["Launcher", "Worker"]},
                    "additionalProperties": REPLICA_SPEC,
                },
            },
        },
    },
}


def test_mpijob_validates_and_launches_the_recipe_with_mpirun():
    job = mpijob(
        MPIJobSpec(
            recipe="digits-mlp-torch",
            np=8,
            image="hvdtrain:cpu",
            slots_per_worker=4,
            set_overrides=("epochs=3",),
        )
    )
    jsonschema.validate(job, MPIJOB_SCHEMA)
    specs = job["spec"]["mpiReplicaSpecs"]
    assert job["spec"]["slotsPerWorker"] == 4 and specs["Worker"]["replicas"] == 2
    command = specs["Launcher"]["template"]["spec"]["containers"][0]["command"]
    assert command[:1] == ["mpirun"] and command[command.index("-np") + 1] == "8"
    assert (
        "-H" not in command and "--allow-run-as-root" not in command
    )  # the operator's hostfile; non-root image
    assert command[-4:] == ["--strategy", "horovod", "--set", "epochs=3"]
    worker = specs["Worker"]["template"]["spec"]["containers"][0]
    assert worker["resources"]["limits"]["cpu"] == "4"
    assert {"name": "OMP_NUM_THREADS", "value": "1"} in worker["env"]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"np": 6, "slots_per_worker": 4}, "not a multiple"),
        ({"np": 0}, "at least 1"),
        ({"name": "My_Job"}, "--name 'My_Job': a Kubernetes name is at most 63 lowercase"),
        ({"name": "x" * 64}, "a Kubernetes name"),
        ({"memory_per_worker": "4 GB"}, "--memory-per-worker '4 GB': expected a quantity"),
        ({"memory_per_worker": "lots"}, "expected a quantity"),
        ({"image": ""}, "--image '': expected an image reference"),
        ({"image": "a b"}, "expected an image reference"),
    ],
)
def test_bad_shapes_are_errors(changes, message):
    with pytest.raises(ValueError, match=message):
        mpijob(MPIJobSpec(**{"recipe": "r", "np": 2, "image": "i", **changes}))


def test_cli_prints_yaml_that_validates():
    result = CliRunner().invoke(
        main,
        ["k8s", "digits-mlp-tf", "--np", "4", "--image", "registry/hvdtrain:cpu", "--slots-per-worker", "2"],
    )
    assert result.exit_code == 0, result.output
    job = yaml.safe_load(result.output)
    jsonschema.validate(job, MPIJOB_SCHEMA)
    assert job["metadata"]["name"] == "hvdtrain-digits-mlp-tf"


def test_cli_rejects_a_bad_override_before_writing_anything():
    result = CliRunner().invoke(
        main, ["k8s", "digits-mlp-tf", "--np", "2", "--image", "i", "--set", "nope=1"]
    )
    assert result.exit_code == 2 and "unknown key" in result.output
