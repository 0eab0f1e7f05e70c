"""Several hosts without a shared disk, for real: namespace hosts from the rig, each with its own
address, hostname, sshd and private run-directory disk; hvdtrain launches from the root namespace."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np
import psutil
import pytest

from hvdtrain.launching.rank_output import rank_output_files
from hvdtrain.runtime import checkpoint
from tests.support.helpers import final_weights, hvdtrain, summary
from tests.support.rig import rig_host_args

BARS = {"digits-mlp-torch": 0.9, "digits-mlp-tf": 0.9}


def on_hosts(rig, *hosts: int) -> list[str]:
    return rig_host_args(rig, *hosts)


@pytest.mark.parametrize(
    ("recipe", "launcher", "strategy"),
    [
        ("digits-mlp-torch", "gloo", "horovod"),
        ("digits-mlp-torch", "mpi", "zero"),  # each rank writes its slice of the state on its own disk
        ("digits-mlp-tf", "mpi", "horovod"),
    ],
)
def test_two_hosts_without_a_shared_disk_train_and_bring_everything_back(rig, recipe, launcher, strategy):
    run_dir = rig.disk / f"{recipe}-{launcher}"
    hvdtrain(
        "run", recipe, *on_hosts(rig, 1, 2), "--launcher", launcher, "--strategy", strategy,
        "--variant", "debug", run_dir=run_dir,
    )  # fmt: skip
    found = summary(run_dir)
    assert found["world_size"] == 2 and found["weights_consistent"] is True
    assert found["test_accuracy"] >= BARS[recipe]
    assert found["hosts"] == [rig.host(1).hostname, rig.host(2).hostname], "one rank on each host"
    written = (
        {"horovod": "checkpoint.pt", "zero": "optimizer.1.pt"}[strategy]
        if recipe.endswith("torch")
        else "checkpoint.keras"
    )
    latest = checkpoint.latest(run_dir)
    assert latest.path(written).exists() and (run_dir / "metrics.jsonl").exists()
    assert set(checkpoint.check(latest).values()) == {"ok"}, "every rank's file, as the manifest says"
    assert (rig.private_disk(1) / run_dir.name / "checkpoints" / "latest").exists(), (
        "rank 0 wrote on host 1's own disk"
    )
    on_host_2 = sorted(p.name for p in (rig.private_disk(2) / run_dir.name).glob("checkpoints/*/*"))
    assert on_host_2 == (["optimizer.1.pt"] if strategy == "zero" else []), (
        "rank 1's own file, the newest only"
    )
    for stream in ("stdout", "stderr"):
        assert set(rank_output_files(run_dir / "logs", stream)) == {0, 1}, f"every rank's {stream} came back"
    assert rig.leftover_processes() == {}, "nothing left running on any host"


def test_a_host_that_cannot_be_reached_is_named_before_any_rank_starts(rig):
    rig.link_down(2)
    try:
        started = time.monotonic()
        result = hvdtrain(
            "run", "digits-mlp-torch", *on_hosts(rig, 1, 2), run_dir=rig.disk / "x", check=False
        )
        seconds = time.monotonic() - started
    finally:
        rig.link_up(2)
    assert result.returncode == 2, result.output[-2000:]
    assert f"host {rig.host(2).address} did not answer over ssh" in result.stderr or (
        f"host {rig.host(2).address}: ssh failed" in result.stderr
    ), result.stderr
    assert seconds < 30, f"took {seconds:.1f} s"
    assert not (rig.disk / "x").exists(), "a refused start leaves no run directory behind"
    assert rig.leftover_processes() == {}


@dataclass
class LostHost:
    code: int
    lines: list[tuple[float, str]]
    """Each line of hvdtrain's stderr, with the seconds from link down to when it came."""
    seconds_to_exit: float

    @property
    def stderr(self) -> str:
        return "".join(line for _, line in self.lines)

    def seconds_to(self, text: str) -> float:
        return next(seconds for seconds, line in self.lines if text in line)


def _lose_host_mid_run(
    rig,
    launcher: str | None,
    run_dir,
    extra=("synthetic-torch", "--set", "epochs=400", "--set", "steps_per_epoch=5"),
    once: str = "metrics.jsonl",
) -> LostHost:
    """Starts a 2-host job, takes host 2's link down once `once` (a path under the run directory on
    host 1) is there, and brings it back when the job has ended. launcher None: the ddp strategy."""
    argv = [sys.executable, "-m", "hvdtrain", "run", *extra, *on_hosts(rig, 1, 2)]
    argv += ["--strategy", "ddp"] if launcher is None else ["--launcher", launcher, "--stall-timeout", "10"]
    argv += ["--run-dir", str(run_dir)]
    job = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    lines = []
    reader = threading.Thread(
        target=lambda: lines.extend((time.monotonic(), line) for line in job.stderr), daemon=True
    )
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not list(rig.private_disk(1).glob(f"{run_dir.name}/{once}")):
            assert time.monotonic() < deadline and job.poll() is None, "training never got going"
            time.sleep(0.2)
        rig.link_down(2)
        lost_at = time.monotonic()
        job.wait(timeout=120)
        ended_at = time.monotonic()
        reader.join(timeout=10)
    finally:
        rig.link_up(2)
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)  # hvdtrain and its launcher
    return LostHost(job.returncode, [(at - lost_at, line) for at, line in lines], ended_at - lost_at)


def test_a_lost_host_ends_the_job_in_time_and_is_named(rig):
    """Over MPI; over gloo, the restart test below loses the host the same way."""
    lost = _lose_host_mid_run(rig, "mpi", rig.disk / "lost-mpi")
    assert lost.code != 0
    assert f"host {rig.host(2).address}" in lost.stderr, lost.stderr[-3000:]
    seconds = lost.seconds_to_exit
    assert seconds < 10 + 30, f"the job ended {seconds:.1f} s after the link went down"
    print(f"\nmpi: a lost host (--stall-timeout 10) ended the job in {seconds:.1f} s")
    assert rig.leftover_processes(timeout=30) == {}, "nothing left on any host once the link is back"


def test_ddp_on_two_hosts_equals_two_ranks_on_one_and_brings_everything_back(rig, tmp_path):
    """torchrun on each host, started by mpirun over ssh, its rendezvous on host 1; no shared disk."""
    run_dir = rig.disk / "ddp-two-hosts"
    common = ["digits-mlp-torch", "--strategy", "ddp", "--set", "epochs=3"]
    hvdtrain("run", *common, *on_hosts(rig, 1, 2), run_dir=run_dir)
    hvdtrain("run", *common, "--np", "2", "--threads-per-rank", "1", run_dir=tmp_path / "one")
    found, one = summary(run_dir), summary(tmp_path / "one")
    assert found["world_size"] == 2 and found["weights_consistent"] is True
    assert found["test_accuracy"] >= BARS["digits-mlp-torch"]
    assert found["hosts"] == [rig.host(1).hostname, rig.host(2).hostname], "one rank on each host"
    for a, b in zip(final_weights(run_dir), final_weights(tmp_path / "one"), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    assert abs(found["final_loss"] - one["final_loss"]) < 1e-5
    for stream in ("stdout", "stderr"):
        assert set(rank_output_files(run_dir / "logs", stream)) == {0, 1}, f"every rank's {stream} came back"
    assert "epoch 3/3" in rank_output_files(run_dir / "logs")[0].read_text()
    assert rig.leftover_processes() == {}, "nothing left running on any host"


def test_ddp_across_hosts_names_a_lost_host_and_ends(rig):
    lost = _lose_host_mid_run(rig, None, rig.disk / "lost-ddp")
    assert lost.code != 0
    assert f"host {rig.host(2).address}" in lost.stderr, lost.stderr[-3000:]
    assert lost.seconds_to_exit < 60, f"the job ended {lost.seconds_to_exit:.1f} s after the link went down"
    print(f"\nddp: a lost host ended the job in {lost.seconds_to_exit:.1f} s")
    assert rig.leftover_processes(timeout=30) == {}


def test_a_restart_resumes_from_the_checkpoint_without_the_lost_host(rig):
    """Also: the lost host is named, and the job's first run ends in time (gloo, --stall-timeout 10)."""
    run_dir = rig.disk / "restarted"
    # the link goes down once the first checkpoint is committed, not at the first epoch's line: that
    # comes before the checkpoint's collective, which a loaded machine may not finish in time
    recipe = ("digits-mlp-torch", "--max-restarts", "1")
    lost = _lose_host_mid_run(rig, "gloo", run_dir, recipe, once="checkpoints/latest")
    assert lost.code == 0, lost.stderr[-3000:]
    restart = f"restart 1 of 1 from its last checkpoint on {rig.host(1).address}:1"
    assert restart in lost.stderr, lost.stderr[-3000:]
    assert f"host {rig.host(2).address}" in lost.stderr.split(restart)[0], lost.stderr[-3000:]
    seconds = lost.seconds_to(restart)
    assert seconds < 10 + 30, f"the first run ended {seconds:.1f} s after the link went down"
    print(f"\ngloo: a lost host (--stall-timeout 10) ended the first run in {seconds:.1f} s")
    found = summary(run_dir)
    assert found["world_size"] == 1 and found["hosts"] == [rig.host(1).hostname]
    assert found["test_accuracy"] >= BARS["digits-mlp-torch"]
    assert rig.leftover_processes(timeout=30) == {}


def _listeners(argv: list[str]) -> list[str]:
    """`ADDRESS:PORT (PROGRAM)` of each TCP listener that ss run by argv lists."""
    lines = subprocess.run([*argv, "ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    quote = '"'
    return [f"{line.split()[3]} ({line.split(quote)[1]})" for line in lines.splitlines() if quote in line]


def _exposed(rig, job: subprocess.Popen) -> dict[str, list[str]]:
    """What the job listens on beyond loopback and each host's address on the run's interface: on
    the launching host (hvdtrain's process tree) and on each rig host (all but its sshd)."""
    family = {job.pid, *(child.pid for child in psutil.Process(job.pid).children(recursive=True))}
    here = [
        f"{c.laddr.ip}:{c.laddr.port}"
        for c in psutil.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.pid in family
    ]
    exposed = {
        "launching host": [
            entry for entry in here if not entry.startswith((f"{rig.address}:", "127.", "::1", "fe80:"))
        ]
    }
    for host in (1, 2):
        kept = (f"{rig.host(host).address}:", "127.0.0.1:", "[::1]:", "[fe80::")  # link-local: on the NIC
        found = _listeners(rig.host_argv(host, []))
        exposed[f"host {host}"] = [
            entry for entry in found if "(sshd)" not in entry and not entry.startswith(kept)
        ]
    return exposed


@pytest.mark.parametrize("launcher", ["gloo", "mpi"])
def test_sigterm_to_hvdtrain_ends_the_ranks_on_every_host(rig, launcher):
    """Also: while it trains, nothing of the job listens beyond loopback and the run's interface, on
    any host (Open MPI's would, on every interface, without hvdtrain's bind library)."""
    run_dir = rig.disk / f"signalled-{launcher}"
    argv = [
        sys.executable,
        "-m",
        "hvdtrain",
        "run",
        "synthetic-torch",
        "--set",
        "epochs=10000",
        "--set",
        "steps_per_epoch=5",  # metrics.jsonl, which the test waits for, comes after an epoch
        *on_hosts(rig, 1, 2),
    ]
    argv += ["--launcher", launcher, "--run-dir", str(run_dir)]
    job = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 120
        started = rig.private_disk(1) / run_dir.name / "metrics.jsonl"
        while not (rig.processes(1) and rig.processes(2) and started.exists()):
            assert time.monotonic() < deadline and job.poll() is None, "training never got going"
            time.sleep(0.2)
        exposed = _exposed(rig, job)
        job.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        _, stderr = job.communicate(timeout=60)
        left = rig.leftover_processes(timeout=10)
        seconds = time.monotonic() - signalled
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 128 + signal.SIGTERM and "stopped by SIGTERM" in stderr, stderr[-2000:]
    assert left == {}, f"still running after SIGTERM: {left}"
    assert seconds < 10, f"the ranks on other hosts ended {seconds:.1f} s after SIGTERM"
    assert not any(exposed.values()), f"listening beyond the run's interface: {exposed}"
    print(f"\n{launcher}: SIGTERM ended the ranks on both hosts in {seconds:.1f} s")
