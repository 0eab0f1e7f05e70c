"""--launcher ray for real: horovod.ray's RayExecutor on a Ray started for the run, on an existing
cluster, elastic, and on two namespace hosts; failures named by rank; nothing of Ray left behind."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import torch

from hvdtrain.launching.rank_output import rank_output_files
from tests.support.helpers import (
    EVERY_STEP_PROGRESS,
    PROGRAMS,
    beyond_loopback,
    hvdtrain,
    kill_mid_run,
    listeners,
    stalled_rank_ends_the_job,
    summary,
)

BARS = {"digits-mlp-torch": 0.9, "digits-mlp-tf": 0.9}
RAY_BIN = Path(sys.executable).parent / "ray"
TOKEN = Path.home() / ".ray" / "auth_token"
NO_AUTH = {"RAY_AUTH_MODE": "disabled"}


def ray_processes() -> dict[tuple[int, float], str]:
    """Ray's processes on this machine (raylet, GCS, workers, agents, hvdtrain's Ray driver) that
    run: a zombie has ended, its parent or init has yet to collect it."""
    found = {}
    for process in psutil.process_iter(["pid", "name", "cmdline", "create_time", "status"]):
        if process.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        command = " ".join(process.info["cmdline"] or [])
        name = process.info["name"] or ""
        if (
            name in ("raylet", "gcs_server")
            or name.startswith("ray::")
            or "ray::" in command
            or "site-packages/ray/" in command
            or "hvdtrain.launchers.ray_driver" in command
        ):
            found[(process.info["pid"], process.info["create_time"])] = command[:200]
    return found


def new_ray_processes(before: dict, timeout: float = 10) -> list[str]:
    """Ray processes that appeared since `before` and still run after timeout seconds."""
    deadline = time.monotonic() + timeout
    while True:
        left = [command for key, command in ray_processes().items() if key not in before]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def token_state() -> tuple[bool, int | None]:
    return TOKEN.exists(), TOKEN.stat().st_mtime_ns if TOKEN.exists() else None


def check_trained(run_dir: Path, recipe: str, epochs: int = 15) -> dict:
    found = summary(run_dir)
    assert found["world_size"] == 2 and found["weights_consistent"] is True
    assert found["test_accuracy"] >= BARS[recipe], found
    for stream in ("stdout", "stderr"):
        assert set(rank_output_files(run_dir / "logs", stream)) == {0, 1}, f"every rank's {stream} file"
    assert f"epoch {epochs}/{epochs}" in rank_output_files(run_dir / "logs")[0].read_text()
    return found


def ranks_got_hvdtrains_environment(run_dir: Path) -> bool:
    """Each rank's stall watchdog ran: it starts only with HVDTRAIN_STALL_TIMEOUT and
    HVDTRAIN_STATUS_DIR, which the ranks get from hvdtrain, not from the cluster."""
    return {path.name for path in (run_dir / "logs" / "status").glob("rank.*.json")} == {
        "rank.0.json",
        "rank.1.json",
    }


@pytest.mark.parametrize("recipe", ["digits-mlp-torch", "digits-mlp-tf"])
def test_a_ray_started_for_the_run_trains_and_is_gone_after(recipe, tmp_path, shared_runs):
    """torch: the full recipe, whose weights must equal a gloo run's bit for bit (Ray changes how ranks
    start, not what they compute; the gloo run is test_torch's); tf: its debug variant."""
    before, token = ray_processes(), token_state()
    started = time.monotonic()
    variant = ["--variant", "debug"] if recipe.endswith("tf") else []
    hvdtrain("run", recipe, "--np", "2", "--launcher", "ray", *variant, run_dir=tmp_path / "ray", timeout=240)
    seconds = time.monotonic() - started
    found = check_trained(tmp_path / "ray", recipe, epochs=8 if variant else 15)
    assert new_ray_processes(before, timeout=0) == [], "the run's Ray is stopped before hvdtrain exits"
    assert token_state() == token, "no token file in ~/.ray for a Ray that lived as long as the run"
    print(f"\nray {recipe}: {seconds:.1f} s, accuracy {found['test_accuracy']:.3f}")
    if recipe == "digits-mlp-torch":
        gloo = shared_runs.run(recipe, "--np", "2", "--launcher", "gloo", env=EVERY_STEP_PROGRESS)
        assert found["parameter_digest"] == summary(gloo.run_dir)["parameter_digest"]


def test_a_ranks_exit_code_is_named_and_the_job_exits_1(tmp_path):
    before = ray_processes()
    result = hvdtrain(
        "run", str(PROGRAMS / "exit_code.py"), "--np", "2", "--launcher", "ray", run_dir=tmp_path, check=False
    )
    assert result.returncode == 1, result.output[-3000:]
    assert "rank 1 failed first (exit code 2)" in result.stderr
    assert new_ray_processes(before, timeout=0) == []


def _rank_actor(rank: int, run_dir: Path):
    """The actor process running rank (its tee's parent: the tee holds the rank's stdout file)."""
    target = str(run_dir / "logs" / f"rank.{rank}" / "stdout")

    def find(launcher_pid: int):
        for process in psutil.Process(launcher_pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if any(file.path == target for file in process.open_files()):
                    return process.parent()
        return None

    return find


def test_a_stalled_rank_is_named_and_the_job_ends(tmp_path):
    stalled_rank_ends_the_job("ray", tmp_path)


def test_a_killed_rank_ends_the_job_naming_it(tmp_path):
    before = ray_processes()
    run = ["run", "digits-mlp-torch", "--np", "2", "--launcher", "ray", "--set", "epochs=100000"]
    killed = kill_mid_run(
        run, tmp_path, ready=tmp_path / "checkpoints" / "latest", find_victim=_rank_actor(1, tmp_path)
    )
    assert killed.returncode == 1 and killed.seconds_to_exit < 30, killed.stderr[-3000:]
    assert "rank 1 failed first" in killed.stderr, killed.stderr[-3000:]
    assert not killed.orphans
    assert new_ray_processes(before) == []


@pytest.mark.parametrize("elastic", [False, True], ids=["static", "elastic"])
def test_sigterm_mid_run_stops_every_ray_process_it_started_none_listening_beyond_loopback(elastic, tmp_path):
    """While it trains, every listener of the Ray started for the run (GCS, raylet, agents, the
    workers', the driver's), of horovod.ray's rendezvous and of the ranks is on loopback."""
    before = ray_processes()
    run = ["run", "digits-mlp-torch", "--np", "2", "--launcher", "ray", "--set", "epochs=100000"]
    run += ["--min-np", "1", "--max-np", "2"] if elastic else []
    latest, heard = tmp_path / "checkpoints" / "latest", []

    def driver_once_heard(hvdtrain_pid: int) -> psutil.Process | None:
        if not latest.exists():  # the ranks train: every server is up
            return None
        job = psutil.Process(hvdtrain_pid)
        heard.extend(listeners([job, *job.children(recursive=True)]))
        return job

    killed = kill_mid_run(run, tmp_path, ready=latest, find_victim=driver_once_heard, signum=signal.SIGTERM)
    assert killed.returncode == 128 + signal.SIGTERM, killed.stderr[-3000:]
    assert "stopped by SIGTERM" in killed.stderr and killed.seconds_to_exit < 15
    assert not killed.orphans
    assert new_ray_processes(before, timeout=0) == []
    names = {name for _, _, name in heard}
    assert {"gcs_server", "raylet"} <= names, f"the check saw Ray's servers: {heard}"
    exposed = beyond_loopback(heard)
    assert not exposed, f"listening beyond loopback: {exposed}"


class RayNode:
    """`ray start --block` as this test's child (a head, or a node joining `join`), so that stopping it
    stops only its own processes (`ray stop` would stop every Ray on the machine). argv_prefix runs it
    elsewhere (a rig host)."""

    def __init__(
        self, join: str | None = None, argv_prefix=(), node_ip: str | None = None, num_cpus: int = 2
    ) -> None:
        self.temp_dir = Path(tempfile.mkdtemp(prefix="hvdray-"))  # short: Ray's sockets live under it
        argv = [str(RAY_BIN), "start", *(["--address", join] if join else ["--head", "--port", "0"])]
        argv += [
            "--num-cpus",
            str(num_cpus),
            "--block",
            "--disable-usage-stats",
            "--temp-dir",
            str(self.temp_dir),
        ]
        argv += [] if join else ["--include-dashboard=false"]
        argv += ["--node-ip-address", node_ip] if node_ip else []
        self.log = self.temp_dir / "node.log"
        with self.log.open("w") as log:
            self.process = subprocess.Popen(
                [*argv_prefix, *argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **NO_AUTH},
                start_new_session=True,
            )
        self.address = join or self._wait_for(r"ray start --address='([^']+)'")
        if join:
            self._wait_for(r"(Ray runtime started)")

    def _wait_for(self, pattern: str, timeout: float = 90) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.process.poll() is None:
            if found := re.search(pattern, self.log.read_text()):
                time.sleep(1)  # the node's raylet registers with the GCS
                return found.group(1)
            time.sleep(0.2)
        log = self.log.read_text()[-3000:]
        self.stop()
        raise AssertionError(f"ray start did not come up:\n{log}")

    def family(self) -> list[psutil.Process]:
        with contextlib.suppress(psutil.NoSuchProcess):
            return [psutil.Process(self.process.pid), *psutil.Process(self.process.pid).children(True)]
        return []

    def stop(self) -> list[psutil.Process]:
        """SIGTERM the node (its --block loop stops its processes); returns those still running."""
        family = self.family()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=30)
        _, alive = psutil.wait_procs(family, timeout=15)
        for process in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        return alive


def test_an_existing_cluster_is_joined_and_left_running(tmp_path):
    head = RayNode()
    try:
        cluster = {process.pid for process in head.family()}
        hvdtrain(
            "run",
            "digits-mlp-torch",
            "--np",
            "2",
            "--launcher",
            "ray",
            "--ray-address",
            head.address,
            run_dir=tmp_path,
            timeout=180,
        )
        check_trained(tmp_path, "digits-mlp-torch")
        assert ranks_got_hvdtrains_environment(tmp_path), "the cluster's actors have the cluster's env"
        assert head.process.poll() is None, "hvdtrain left the cluster it joined running"
        still = {process.pid for process in head.family()}
        assert cluster <= still, "none of the cluster's own processes was stopped"
        assert any(process.name() == "raylet" for process in head.family())
    finally:
        alive = head.stop()
    assert alive == [] and not head.family(), "SIGTERM to the head stopped its cluster"


def test_elastic_on_one_node_trains_to_the_bar(tmp_path):
    """A clean elastic run only. A rank killed mid-run on a one-node cluster ends the job (measured:
    exit 1 in about 2 s): Horovod's elastic driver blacklists the failed rank's host, which is the only
    one, and stops with "blacklisted slots count == 2". Recovery needs a second node (the rig test).
    The training core's options ride along: bf16, a cosine decay, clipping of the averaged gradient
    and step checkpoints (an epoch is 21 steps)."""
    before = ray_processes()
    run = ["run", "digits-mlp-torch", "--np", "2", "--min-np", "1", "--max-np", "2", "--launcher", "ray"]
    sets = [
        "precision=bf16",
        "lr_schedule=cosine",
        "clip_grad_norm=0.5",
        "checkpoint_every_steps=40",
        "keep_checkpoints=30",
    ]
    hvdtrain(*run, *[arg for item in sets for arg in ("--set", item)], run_dir=tmp_path, timeout=180)
    found = check_trained(tmp_path, "digits-mlp-torch")
    assert found["compute_dtype"] == "bfloat16"
    epochs = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    epochs = [record for record in epochs if "epoch" in record]
    assert all(b["lr"] < a["lr"] for a, b in zip(epochs, epochs[1:], strict=False)), "cosine decays"
    assert max(record["grad_norm"] for record in epochs) > 0.5, "the clip was active"
    kept = [
        torch.load(path, weights_only=True) for path in (tmp_path / "checkpoints").glob("*/checkpoint.pt")
    ]
    assert any((state.get("within") or {}).get("order") == "elastic" for state in kept), "a step checkpoint"
    assert new_ray_processes(before, timeout=0) == []


@contextlib.contextmanager
def ray_cluster_on(rig):
    """A Ray head on rig host 1 and a node on host 2, one CPU each (so one rank each), stopped after;
    nothing of them may be left on the hosts."""
    head = RayNode(argv_prefix=rig.host_argv(1, []), node_ip=rig.host(1).address, num_cpus=1)
    try:
        node = RayNode(
            join=head.address, argv_prefix=rig.host_argv(2, []), node_ip=rig.host(2).address, num_cpus=1
        )
    except BaseException:
        head.stop()
        raise
    try:
        yield head, node
    finally:
        left = node.stop() + head.stop()
    assert left == [] and rig.leftover_processes(timeout=30) == {}


@pytest.fixture(scope="module")
def ray_on_rig(rig):
    """One such cluster for the tests below: each job leaves it running, as a cluster outlives its jobs;
    the last test's teardown stops it and finds nothing of it left on the hosts."""
    with ray_cluster_on(rig) as cluster:
        yield cluster


def test_two_ray_nodes_on_namespace_hosts_run_a_rank_each(rig, ray_on_rig, tmp_path):
    """hvdtrain runs from the root namespace, which is no Ray node: the driver joins the cluster at host
    1's address over the bridge. The run directory is on a disk every host shares (tmp_path, not the
    rig's private disks): Ray brings no files back from its nodes."""
    head, node = ray_on_rig
    started = time.monotonic()
    run = ["run", "digits-mlp-torch", "--launcher", "ray", "--ray-address", head.address, "--np", "2"]
    hvdtrain(*run, "--network-interface", rig.bridge, run_dir=tmp_path, timeout=180)
    seconds = time.monotonic() - started
    found = check_trained(tmp_path, "digits-mlp-torch")
    assert sorted(found["hosts"]) == [rig.host(1).hostname, rig.host(2).hostname], "a rank on each node"
    assert ranks_got_hvdtrains_environment(tmp_path)
    assert head.process.poll() is None and node.process.poll() is None, "the cluster is left running"
    print(f"\nray on two nodes: {seconds:.1f} s, accuracy {found['test_accuracy']:.3f}")


def world_sizes(metrics: Path) -> list[int]:
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    return [json.loads(line)["world_size"] for line in lines if '"epoch"' in line]


def test_elastic_on_two_ray_nodes_goes_on_without_a_killed_rank_and_takes_its_node_back(
    rig, ray_on_rig, tmp_path
):
    """The rank on host 2 is killed: Horovod's elastic driver blacklists host 2, training goes on with
    one rank on host 1, and after the cooldown (10-15 s the first time) host 2 is taken back."""
    head, node = ray_on_rig
    run = [sys.executable, "-m", "hvdtrain", "run", "digits-mlp-torch", "--launcher", "ray", "--np", "2"]
    run += ["--ray-address", head.address, "--network-interface", rig.bridge, "--min-np", "1"]
    run += [
        "--max-np",
        "2",
        "--stall-timeout",
        "10",
        "--set",
        "epochs=100000",
        "--run-dir",
        str(tmp_path),
    ]
    job = subprocess.Popen(
        run, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    metrics = tmp_path / "metrics.jsonl"

    def wait_for(predicate, timeout: float, what: str) -> float:
        started = time.monotonic()
        while not predicate(world_sizes(metrics)):
            if time.monotonic() - started > timeout or job.poll() is not None:
                os.killpg(job.pid, signal.SIGKILL)
                raise AssertionError(f"{what}: not in {timeout} s; world sizes {world_sizes(metrics)}")
            time.sleep(0.1)
        return time.monotonic() - started

    try:
        wait_for(lambda sizes: len(sizes) >= 3 and sizes[-1] == 2, 120, "two ranks training")
        before = len(world_sizes(metrics))
        assert rig.kill_host_processes(2, r"^ray::BaseHorovodWorker"), "no rank found on host 2"
        alone = wait_for(lambda sizes: len(sizes) > before and sizes[-1] == 1, 60, "one rank going on")
        count = len(world_sizes(metrics))
        back = wait_for(lambda sizes: len(sizes) > count and sizes[-1] == 2, 90, "host 2 taken back")
        wait_for(lambda sizes: sizes[-3:] == [2, 2, 2], 60, "two ranks training again")
        os.kill(job.pid, signal.SIGTERM)  # training to the end after a fault: the gloo elastic test's
        output, _ = job.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 128 + signal.SIGTERM, output[-3000:]
    last = json.loads(metrics.read_text().splitlines()[-1])
    assert last["world_size"] == 2 and last["test_accuracy"] >= BARS["digits-mlp-torch"], last
    print(f"\nray elastic: rank killed -> 1 rank in {alone:.1f} s; host 2 back after {back:.1f} s")
