"""pip install and go: hvdtrain's wheel installed into a fresh venv beside the pinned torch, as a user
installs it into an environment of their own, then `hvdtrain setup` puts the patched Horovod there
(the cached build of the same versions, which `make install` made, so the test stays fast), doctor
passes and a 2-rank job trains. A machine without the build tools gets one line for each."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hvdtrain.building.steps import read_versions

ROOT = Path(__file__).resolve().parents[2]
NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv*", "runs", "build", "dist", "site", "*.egg-info", "*.whl", "__pycache__", ".*_cache"
)


def call(argv: list[str], cwd: Path, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, cwd=cwd, env={**environ, **env}
    )


@pytest.fixture(scope="module")
def fresh(tmp_path_factory) -> Path:
    """The bin/ of a new venv holding hvdtrain's wheel and the pinned torch, and nothing of the
    checkout's venv."""
    source = tmp_path_factory.mktemp("source") / "checkout"
    shutil.copytree(ROOT, source, ignore=NOT_SOURCE, symlinks=True)
    wheels = tmp_path_factory.mktemp("wheel")
    argv = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation"]
    built = call([*argv, str(source), "-w", str(wheels)], cwd=wheels)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = wheels.glob("hvdtrain-*.whl")
    venv = tmp_path_factory.mktemp("user") / "venv"
    made = call([sys.executable, "-m", "venv", str(venv)], cwd=venv.parent)
    assert made.returncode == 0, made.stderr
    torch = f"torch=={read_versions()['TORCH_VERSION']}"
    installed = call(
        [str(venv / "bin" / "pip"), "install", "--quiet", "--no-compile", str(wheel), torch], cwd=venv
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    return venv / "bin"


def test_setup_installs_the_patched_horovod_and_a_two_rank_job_trains(fresh, tmp_path):
    done = call([str(fresh / "hvdtrain"), "setup"], cwd=tmp_path, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "hvdtrain: reusing cached Horovod wheel" in done.stdout, "make install cached the same build"
    assert done.stdout.strip().splitlines()[-1] == "verdict: OK: PyTorch, Gloo, MPI built", done.stdout[
        -2000:
    ]
    where = call(
        [str(fresh / "python"), "-c", "import horovod.torch, sys; print(horovod.__file__)"], cwd=tmp_path
    )
    assert where.stdout.startswith(str(fresh.parent)), where.stdout + where.stderr
    doctor = call([str(fresh / "hvdtrain"), "doctor", "--json"], cwd=tmp_path)
    report = json.loads(doctor.stdout)
    assert doctor.returncode == 0 and report["required"] == ["torch", "gloo", "mpi"], doctor.stdout
    assert report["versions"]["tensorflow"] is None  # torch alone: no TensorFlow is asked of it
    run_dir = tmp_path / "run"
    job = call(
        [str(fresh / "hvdtrain"), "run", "digits-mlp-torch", "--np", "2", "--set", "epochs=4"]
        + ["--run-dir", str(run_dir)],
        cwd=tmp_path,
    )
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["weights_consistent"] is True
    assert summary["test_accuracy"] >= 0.9, summary
    assert "tensorboard is not installed" in job.stdout  # the torch extra's: the run goes on without


def test_setup_names_each_missing_build_tool_in_one_line_and_builds_nothing(fresh, tmp_path):
    done = call([str(fresh / "hvdtrain"), "setup"], cwd=tmp_path, PATH=str(fresh))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[-1] == "hvdtrain: setup: 5 build prerequisite(s) missing; nothing was built"
    for what, apt in [("C++ compiler", "g++"), ("cmake", "cmake"), ("make", "make"), ("patch", "patch")]:
        (line,) = [line for line in lines if line.startswith(f"hvdtrain: setup: {what} missing")]
        assert f"sudo apt-get install -y {apt}  (or: sudo dnf install -y " in line, line
    gloo_only = call(
        [str(fresh / "hvdtrain"), "setup", "--controllers", "gloo"], cwd=tmp_path, PATH=str(fresh)
    )
    assert "mpicxx" not in gloo_only.stderr and "4 build prerequisite(s) missing" in gloo_only.stderr
