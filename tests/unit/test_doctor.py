"""doctor keeps what a build can do per build, so neither doctor nor a run start imports a framework
to ask again; --fresh asks anew."""

from __future__ import annotations

import json
import subprocess

import pytest

from hvdtrain.measure import doctor


class Probe:
    """A stand-in for the child process that imports horovod.<framework>."""

    started: list[list[str]] = []
    exit_code = 0

    def __init__(self, argv, **kwargs):
        Probe.started.append(argv)

    def wait(self, timeout=None):
        return Probe.exit_code


@pytest.fixture
def build(tmp_path, monkeypatch):
    monkeypatch.setattr(doctor, "BUILD_VERDICTS", tmp_path / "build-verdicts.json")
    monkeypatch.setattr(doctor, "_build_identity", lambda framework: f"id-of-{framework}")
    monkeypatch.setattr(subprocess, "Popen", Probe)
    Probe.started, Probe.exit_code = [], 0
    return tmp_path


def test_a_framework_is_probed_once_per_build_and_anew_with_fresh(build):
    assert doctor.frameworks_built(["torch", "tensorflow"]) == {"torch": True, "tensorflow": True}
    assert [argv[-1] for argv in Probe.started] == ["import horovod.torch", "import horovod.tensorflow"]
    assert doctor.framework_built("tensorflow") and len(Probe.started) == 2  # kept: nothing started
    Probe.exit_code = 1
    assert not doctor.framework_built("tensorflow", fresh=True) and len(Probe.started) == 3
    assert not doctor.framework_built("tensorflow") and len(Probe.started) == 4  # a failure is not kept
    assert json.loads(doctor.BUILD_VERDICTS.read_text()) == {"id-of-torch": True}


def test_a_missing_extension_is_no_probe(build, monkeypatch):
    monkeypatch.setattr(doctor, "_build_identity", lambda framework: None)
    assert doctor.frameworks_built(["tensorflow"]) == {"tensorflow": False} and Probe.started == []


def test_controllers_are_read_once_per_build(build, monkeypatch):
    library = build / "mpi_lib_v2.so"
    library.write_bytes(b"x")
    monkeypatch.setattr(doctor, "_extensions", lambda: [("torch", library)])
    reads = []

    def read(argv, **kwargs):
        reads.append(argv)
        flags = {"gloo": True, "mpi": True, "nccl": False, "ddl": False, "ccl": False}
        return subprocess.CompletedProcess(argv, 0, json.dumps(flags), "")

    monkeypatch.setattr(subprocess, "run", read)
    assert doctor.build_features()["gloo"] and len(reads) == 1
    assert doctor.build_features()["mpi"] and len(reads) == 1
    assert doctor.build_features(fresh=True)["gloo"] and len(reads) == 2
    library.write_bytes(b"rebuilt")  # another build: read again
    assert doctor.build_features()["gloo"] and len(reads) == 3


def test_nccl_is_a_part_that_can_be_required_and_its_fix_names_the_cuda_build():
    report = doctor.Report(
        versions={"horovod": "0.28.1"},
        frameworks={"torch": True, "tensorflow": True},
        controllers={"gloo": True, "mpi": True},
        tensor_operations={"NCCL": False, "MPI": True, "Gloo": True},
    )
    assert report.missing(["torch", "gloo", "mpi"]) == []
    assert report.missing(["torch", "nccl"]) == ["nccl"]
    assert doctor.verdict(report, ["torch", "nccl"]) == (
        f"verdict: FAIL: Horovod was built without NCCL; fix: HVDTRAIN_DEVICE=cuda {doctor.FIX_COMMAND}"
    )
    report.tensor_operations["NCCL"] = True
    assert (
        doctor.verdict(report, ["torch", "gloo", "mpi", "nccl"])
        == "verdict: OK: PyTorch, Gloo, MPI, NCCL built"
    )


@pytest.mark.parametrize(
    ("versions", "nccl", "mpirun", "required"),
    [
        ({"torch": "2.13.0", "tensorflow": "2.21.0"}, False, True, ["torch", "tensorflow", "gloo", "mpi"]),
        ({"torch": "2.13.0", "tensorflow": None}, False, True, ["torch", "gloo", "mpi"]),  # torch alone
        ({"torch": "2.13.0"}, False, False, ["torch", "gloo"]),  # built --controllers gloo, no MPI here
        ({"torch": "2.13.0", "tensorflow": "2.21.0"}, True, True, ["torch", "gloo", "mpi"]),  # CUDA: torch's
        ({}, False, True, ["torch", "tensorflow", "gloo", "mpi"]),  # no framework: asks for both
    ],
)
def test_doctor_requires_what_this_machine_can_use(versions, nccl, mpirun, required):
    report = doctor.Report(versions={"horovod": "0.28.1", **versions}, tensor_operations={"NCCL": nccl})
    assert doctor.default_required(report, mpirun) == required
