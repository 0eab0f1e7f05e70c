"""The Slurm cluster on the rig's hosts (tests/support/slurm.py): real nodes with their own hostnames and
disks, steps across both, MPI ranks wired by pmix, batch jobs, and leftovers of a crashed cluster removed."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.support.slurm import PREFIX, clean_stale_clusters

HOROVOD = """\
import socket
import horovod.torch as hvd
hvd.init()
print(socket.gethostname(), hvd.rank(), hvd.size(), hvd.local_rank(), hvd.mpi_enabled(), flush=True)
"""


def test_the_nodes_are_the_rig_hosts_and_a_step_spans_both(slurm):
    slurm.wait_idle(timeout=30)  # a job of an earlier test may still be completing
    assert slurm.node_states() == {"hvdhost1": "idle", "hvdhost2": "idle"}
    done = slurm.run(["srun", "-N2", "-n2", "hostname"], timeout=60)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.split()) == ["hvdhost1", "hvdhost2"]
    plugins = slurm.run(["srun", "--mpi=list"], timeout=30)
    assert "pmix" in (plugins.stdout + plugins.stderr).split(), plugins


def test_a_job_writes_to_its_hosts_private_disk(slurm, rig):
    name = f"written-by-a-job-{os.getpid()}"
    done = slurm.run(["srun", "-w", "hvdhost2", "sh", "-c", f'hostname > "{rig.disk / name}"'], timeout=60)
    assert done.returncode == 0, done.stderr
    try:
        assert (rig.private_disk(2) / name).read_text() == "hvdhost2\n"
        assert not (rig.private_disk(1) / name).exists()
        assert not (rig.disk / name).exists()  # the launching host's own directory
    finally:
        (rig.private_disk(2) / name).unlink(missing_ok=True)


def test_horovod_ranks_over_pmix_span_both_nodes(slurm):
    argv = ["srun", "-N2", "-n4", "--mpi=pmix", sys.executable, "-c", HOROVOD]
    done = slurm.run(argv, timeout=180)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    ranks = sorted(line.split() for line in done.stdout.splitlines() if line.startswith("hvdhost"))
    assert ranks == [
        ["hvdhost1", "0", "4", "0", "True"],
        ["hvdhost1", "1", "4", "1", "True"],
        ["hvdhost2", "2", "4", "0", "True"],
        ["hvdhost2", "3", "4", "1", "True"],
    ], done.stderr


def test_a_batch_job_runs_its_steps_to_completion_with_this_venv(slurm, tmp_path):
    output = tmp_path / "job.out"  # /tmp is shared by the hosts; only rig.disk is private
    script = "srun hostname && command -v hvdtrain && command -v python && echo finished"
    submitted = slurm.run(
        ["sbatch", "--parsable", "-N2", "-n2", f"--output={output}", "--wrap", script], timeout=60
    )
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip()
    final = slurm.wait_job_gone(job, timeout=90)
    assert (final["JobState"], final["ExitCode"], final["NodeList"]) == ("COMPLETED", "0:0", "hvdhost[1-2]")
    lines = output.read_text().split()
    assert sorted(lines[:2]) == ["hvdhost1", "hvdhost2"], lines
    venv_bin = Path(sys.executable).parent  # slurm.env() puts it first on PATH, and jobs inherit PATH
    assert lines[2:] == [str(venv_bin / "hvdtrain"), str(venv_bin / "python"), "finished"]


def test_leftovers_of_a_dead_cluster_are_removed():
    """What a crashed session's cluster leaves outside the hosts: its munged (its directory in its command
    line), a client pointed at its slurm.conf, the directory itself; other programs that name it stay."""
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid names the leftovers: a process that is no more
    leftover_dir = Path(tempfile.gettempdir()) / f"{PREFIX}-{dead.pid}-slurm-crashed"
    leftover_dir.mkdir()
    sleep = ["-c", "import time; time.sleep(300)"]
    for name in ("munged", "srun"):  # programs by those names, as ps shows them
        (leftover_dir / name).symlink_to(sys.executable)
    munged = subprocess.Popen([str(leftover_dir / "munged"), *sleep, f"--socket={leftover_dir}/munge.socket"])
    conf = {**os.environ, "SLURM_CONF": f"{leftover_dir}/slurm.conf"}
    client = subprocess.Popen([str(leftover_dir / "srun"), *sleep], env=conf)
    bystanders = [
        subprocess.Popen([sys.executable, *sleep], env=conf),  # not a Slurm client
        subprocess.Popen([sys.executable, *sleep, f"{leftover_dir}/slurmctld.log"]),  # not a daemon
    ]
    try:
        deadline = time.monotonic() + 5  # until each has exec'd
        while time.monotonic() < deadline and not all(
            Path(f"/proc/{p.pid}/cmdline").read_bytes().startswith(str(p.args[0]).encode())
            for p in (munged, client, *bystanders)
        ):
            time.sleep(0.02)

        removed = clean_stale_clusters()

        assert munged.wait(timeout=5) == -9 and client.wait(timeout=5) == -9
        assert f"dir {leftover_dir}" in removed and not leftover_dir.exists()
        assert all(bystander.poll() is None for bystander in bystanders)
    finally:
        for process in (munged, client, *bystanders):
            process.kill()
            process.wait()
