"""What users and operators rely on, on real ranks: exit codes, secrets kept off command lines,
resumes that change nothing when they are refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from hvdtrain.runtime import checkpoint
from tests.support.helpers import PROGRAMS, beyond_loopback, hvdtrain, listeners


@pytest.mark.parametrize("launcher", ["gloo", "mpi"])
def test_a_scripts_exit_code_is_named_and_never_taken_for_one_of_hvdtrains(launcher, tmp_path):
    """The script's rank exits 2, hvdtrain's code for bad input: the job exits 1 and says the 2."""
    result = hvdtrain(
        "run",
        str(PROGRAMS / "exit_code.py"),
        "--np",
        "2",
        "--launcher",
        launcher,
        run_dir=tmp_path,
        check=False,
    )
    assert result.returncode == 1, result.output[-3000:]
    assert "rank 1 failed first (exit code 2)" in result.stderr
    assert "status           failed (exit code 1; a rank's 2)" in hvdtrain("show", str(tmp_path)).stdout


def test_a_refused_resume_leaves_the_run_directory_byte_identical(tmp_path):
    hvdtrain("run", "digits-mlp-torch", "--np", "2", "--set", "epochs=2", run_dir=tmp_path)
    found = checkpoint.latest(tmp_path)
    saved = [found.path(name).relative_to(tmp_path) for name in (*found.files, "manifest.json")]
    names = ("config.json", "summary.json", "checkpoints/latest", *saved)
    kept = {name: (tmp_path / name).read_bytes() for name in names}
    refused = [
        (["--set", "hidden=256"], 2, "hidden cannot change on resume"),
        ([], 0, "already finished its 2 epochs; nothing changed"),
    ]
    for extra, code, text in refused:
        result = hvdtrain("run", "digits-mlp-torch", "--resume", *extra, run_dir=tmp_path, check=False)
        assert result.returncode == code and text in result.output, result.output
        assert {name: (tmp_path / name).read_bytes() for name in kept} == kept
    other = hvdtrain("run", "digits-mlp-tf", "--resume", run_dir=tmp_path, check=False)
    assert other.returncode == 2 and "is a run of digits-mlp-torch, not of digits-mlp-tf" in other.stderr
    assert {name: (tmp_path / name).read_bytes() for name in kept} == kept
    more = hvdtrain("run", "digits-mlp-torch", "--np", "2", "--resume", "--set", "epochs=3", run_dir=tmp_path)
    assert "resuming from" in more.stdout and '"epochs": 3' in (tmp_path / "summary.json").read_text()


SECRET, NAMED = "tok-4f1c9e2a77", "named-9b3d0c1e55"


@dataclass
class TrainingJob:
    process: subprocess.Popen
    run_dir: Path
    ranks: list[psutil.Process]


# Last in the module: a module-scoped job is ended only when the module's tests are done, and no
# other test may run beside it.
@pytest.fixture(scope="module", params=["gloo", "mpi"])
def training_job(request, tmp_path_factory):
    """One job per launcher, training on one host with an unnamed and a named (--env) secret in
    hvdtrain's environment, watched by the tests below while it runs, then ended by SIGTERM."""
    launcher, run_dir = request.param, tmp_path_factory.mktemp(f"training-{request.param}")
    env = {**os.environ, "MY_API_TOKEN": SECRET, "MY_NAMED_TOKEN": NAMED}
    argv = [sys.executable, "-m", "hvdtrain", "run", "synthetic-torch", "--np", "2", "--launcher", launcher]
    argv += ["--set", "epochs=1000", "--set", "steps_per_epoch=5", "--env", "MY_NAMED_TOKEN"]
    argv += ["--run-dir", str(run_dir)]
    job = subprocess.Popen(
        argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        deadline, ranks = time.monotonic() + 120, []
        while time.monotonic() < deadline and not (len(ranks) == 2 and (run_dir / "metrics.jsonl").exists()):
            time.sleep(0.5)
            ranks = [
                p
                for p in psutil.Process(job.pid).children(recursive=True)
                if p.cmdline()[1:3] == ["-m", "hvdtrain.worker"]
            ]
        assert len(ranks) == 2, "the ranks never started"
        assert (run_dir / "metrics.jsonl").exists(), "training never got going"
        yield TrainingJob(job, run_dir, ranks)
    finally:
        os.killpg(job.pid, signal.SIGTERM)
        job.wait(timeout=30)


def test_no_secret_reaches_a_command_line_or_a_rank_unless_named(training_job):
    for process in psutil.process_iter(["cmdline"]):
        line = " ".join(process.info["cmdline"] or [])
        assert SECRET not in line and NAMED not in line, f"on a command line: {line[:200]}"
    for rank in training_job.ranks:
        rank_env = rank.environ()
        assert "MY_API_TOKEN" not in rank_env, "an unnamed variable reached a rank"
        assert rank_env.get("MY_NAMED_TOKEN") == NAMED, "--env NAME did not reach the rank"


def test_a_one_host_run_listens_on_loopback_only(training_job):
    """Under mpi, mpirun runs with hvdtrain's bind library (Open MPI binds its out-of-band listener
    to every interface whatever oob_tcp_if_include says); the ranks get neither the library nor its
    variable."""
    job = training_job.process
    family = [psutil.Process(job.pid), *psutil.Process(job.pid).children(recursive=True)]
    ranks = [p for p in family if p.cmdline()[1:3] == ["-m", "hvdtrain.worker"]]
    assert len(ranks) == 2
    preloaded = [
        rank.pid
        for rank in ranks
        if "bindto-" in rank.environ().get("LD_PRELOAD", "") or "HVDTRAIN_BIND_INTERFACE" in rank.environ()
    ]
    assert not preloaded, "the bind library reached a rank"
    listening = listeners(family)
    assert listening, "nothing listens: the check would prove nothing"
    exposed = beyond_loopback(listening)
    assert not exposed, f"listening beyond loopback: {exposed}"
