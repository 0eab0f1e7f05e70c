"""What the integration tests share: `hvdtrain` as a subprocess with a timeout that, on failure, shows
the command and the tail of every rank's log; a job killed mid-run; what a run left behind."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from hvdtrain.data import write_idx
from hvdtrain.launching.rank_output import rank_json_records
from hvdtrain.runtime import checkpoint

PROGRAMS = Path(__file__).parents[1] / "integration" / "programs"
"""Horovod scripts and recipe files the integration tests run."""


EVERY_STEP_PROGRESS = {"HVDTRAIN_PROGRESS_S": "0"}
"""A progress line every step: epochs of the digits recipes take milliseconds."""

RESUMABLE_SYNTHETIC_TF = ["--variant", "debug", "--set", "checkpoint=true", "--set", "steps_per_epoch=3"]
"""synthetic-tf's custom tf.function loop, small, with checkpoints to resume from."""


@dataclass
class Result:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def rank_json_lines(run_dir: Path) -> list[dict]:
    return rank_json_records(run_dir / "logs")


def _rank_logs(run_dir: Path | None) -> str:
    if run_dir is None:
        return ""
    parts = []
    # Horovod's layout (rank.N/stdout) and torchrun's (attempt_0/N/stdout.log)
    found = {*run_dir.glob("logs/**/rank.*/std*"), *run_dir.glob("logs/**/attempt_*/*/std*.log")}
    for path in sorted(found):
        lines = path.read_text(errors="replace").splitlines()[-20:]
        parts.append(f"--- {path} (last 20 lines)\n" + "\n".join(lines))
    return "\n".join(parts)


def _stacks_of_job(root: int) -> str:
    """Where each process of a hung job waits: its state, kernel wait channel and native threads'
    innermost frames (gdb, where installed), for a timeout that happens once in many runs."""
    parents: dict[int, int] = {}
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            parents[int(proc.name)] = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
    job, added = {root}, True
    while added:
        more = {pid for pid, parent in parents.items() if parent in job} - job
        job |= more
        added = bool(more)
    parts = []
    for pid in sorted(job):
        proc = Path("/proc", str(pid))
        try:
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            wchan = (proc / "wchan").read_text()
        except (OSError, IndexError):
            continue
        parts.append(f"--- pid {pid} [{state} {wchan}] {command[:300]}")
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            traced = subprocess.run(
                ["gdb", "-p", str(pid), "-batch", "-nx", "-ex", "thread apply all bt 8"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            parts += [line[:200] for line in traced.stdout.splitlines() if line.startswith(("#", "Thread"))]
    return "\n".join(parts)


def hvdtrain(
    *args: str,
    timeout: float = 300,
    check: bool = True,
    run_dir: Path | None = None,
    env: dict[str, str] | None = None,
) -> Result:
    argv = [sys.executable, "-m", "hvdtrain", *args]
    if run_dir is not None:  # before any `--`, after the command and its target
        argv[5:5] = ["--run-dir", str(run_dir)]
    process = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stacks = _stacks_of_job(process.pid)
        os.killpg(process.pid, signal.SIGKILL)  # the whole job: launcher and ranks
        stdout, stderr = process.communicate()
        pytest.fail(
            f"timed out after {timeout}s: {' '.join(argv)}\n{stdout[-4000:]}\n{stderr[-4000:]}\n"
            f"{_rank_logs(run_dir)}\n{stacks}"
        )
    done = subprocess.CompletedProcess(argv, process.returncode, stdout, stderr)
    result = Result(argv, done.returncode, done.stdout, done.stderr)
    if check and done.returncode != 0:
        _fail(result, run_dir)
    return result


def _fail(result: Result, run_dir: Path | None) -> None:
    pytest.fail(
        f"exit {result.returncode}: {' '.join(result.argv)}\n{result.output[-6000:]}\n{_rank_logs(run_dir)}"
    )


@dataclass
class SharedRun:
    result: Result
    run_dir: Path


class SharedRuns:
    """`hvdtrain run` once per distinct command for the whole session, whichever pytest worker asks
    first: tests that check different properties of the same run share it instead of each starting
    it again. `root` is a folder every worker sees; a lock file per command makes a second worker wait
    for the first one's run and read its result. A run is kept whatever its exit code, and every test
    that asks for a failed one fails on its own, with the command and the rank logs."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def run(self, *args: str, env: dict[str, str] | None = None, timeout: float = 300) -> SharedRun:
        key = json.dumps([list(args), sorted((env or {}).items())])
        run_dir = self.root / f"run-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
        record = run_dir.with_suffix(".json")
        with run_dir.with_suffix(".lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if not record.exists():
                result = hvdtrain("run", *args, timeout=timeout, check=False, run_dir=run_dir, env=env)
                record.write_text(json.dumps({"key": key, "result": result.__dict__}))
        shared = SharedRun(Result(**json.loads(record.read_text())["result"]), run_dir)
        if shared.result.returncode != 0:
            _fail(shared.result, shared.run_dir)
        return shared


def metric_records(run_dir: Path) -> list[dict]:
    """metrics.jsonl: a record per epoch, and one per step where the schedule logs the step's lr."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def final_weights(run_dir: Path) -> list:
    """The weights in rank 0's last checkpoint, as numpy arrays, whichever framework wrote it."""
    from hvdtrain.runtime import checkpoint

    found = checkpoint.latest(run_dir)
    if torch_file := next((name for name in ("checkpoint.pt", "model.pt") if name in found.files), None):
        import torch  # a whole checkpoint, or rank 0's file of a sharded one

        state = torch.load(found.path(torch_file), weights_only=True)["model"]
        return [tensor.numpy() for tensor in state.values()]
    import keras

    return keras.models.load_model(found.path("checkpoint.keras"), compile=False).get_weights()


def stalled_rank_ends_the_job(launcher: str, run_dir: Path) -> None:
    """A rank that never joins a collective is named, as missing from it, within --stall-timeout (10 s,
    not less: on make test's three workers over two cores a healthy rank may wait seconds for a core)."""
    started = time.monotonic()
    result = hvdtrain(
        "run", str(PROGRAMS / "stall_torch.py"), "--np", "2", "--stall-timeout", "10", "--launcher", launcher,
        check=False, timeout=120, run_dir=run_dir,
    )  # fmt: skip
    assert result.returncode != 0
    assert time.monotonic() - started < 60
    assert "never.completed" in result.stderr and "missing ranks: 1" in result.stderr.lower(), result.output[
        -3000:
    ]
    assert result.stderr.strip().splitlines()[-1].startswith("logs:")


@dataclass
class Killed:
    returncode: int
    seconds_to_exit: float
    stderr: str
    orphans: list


def kill_mid_run(
    args: list[str],
    run_dir: Path,
    ready: Path,
    find_victim,
    startup_s: float = 180,
    signum: int = signal.SIGKILL,
) -> Killed:
    """Start `hvdtrain *args`, wait until `ready` exists and find_victim(hvdtrain_pid) names a process,
    send it signum, and measure how the job ends: exit code, seconds after the signal, stderr, orphans."""
    import psutil

    stderr_path = run_dir / "job.stderr"
    run_dir.mkdir(parents=True, exist_ok=True)
    with stderr_path.open("w") as stderr:
        job = subprocess.Popen(
            [sys.executable, "-m", "hvdtrain", *args, "--run-dir", str(run_dir)],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,
            preexec_fn=_stop_signals_by_default,
        )
    family = []
    try:
        deadline, victim = time.monotonic() + startup_s, None
        while time.monotonic() < deadline and not (victim and ready.exists()):
            victim = victim or find_victim(job.pid)
            time.sleep(0.2)
        assert victim is not None and ready.exists(), "training never got going"
        family = psutil.Process(job.pid).children(recursive=True)
        victim.send_signal(signum)
        killed_at = time.monotonic()
        job.wait(timeout=60)
        seconds = time.monotonic() - killed_at
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
        if job.returncode is None:  # a job that did not end: its launcher's own sessions go too
            for process in family:
                with contextlib.suppress(psutil.Error):
                    process.kill()
    _, alive = psutil.wait_procs(family, timeout=1)  # an orphan still runs a second after the job
    orphans = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    return Killed(job.returncode, seconds, stderr_path.read_text(), orphans)


def _stop_signals_by_default() -> None:
    """The job as a terminal starts it: a test run in the background (`&`, nohup) would pass on its
    ignored SIGINT or SIGHUP, which hvdtrain rightly keeps ignoring."""
    for signum in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)


def child_with_env(launcher_pid: int, predicate):
    """The first descendant of the launcher whose environment satisfies predicate(env)."""
    import psutil

    for child in psutil.Process(launcher_pid).children(recursive=True):
        try:
            if predicate(child.environ()) and "python" in child.name():
                return child
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


def write_tiny_mnist(root, train: int = 512, test: int = 128) -> None:
    """Learnable 28x28 'digits': class k lights up a 7x7 block at one of ten positions."""
    rng = np.random.default_rng(0)
    for prefix, count in (("train", train), ("t10k", test)):
        labels = rng.integers(0, 10, count).astype(np.uint8)
        images = rng.integers(0, 60, (count, 28, 28)).astype(np.uint8)
        for i, label in enumerate(labels):
            row, col = divmod(int(label), 4)
            images[i, 7 * row : 7 * row + 7, 7 * col : 7 * col + 7] = 255
        write_idx(root / f"{prefix}-images-idx3-ubyte.gz", images)
        write_idx(root / f"{prefix}-labels-idx1-ubyte", labels)


def listeners(processes: list) -> list[tuple[str, int, str]]:
    """(address, port, process name) of every TCP socket listening and UDP socket bound in `processes`
    (psutil.Process)."""
    import psutil

    names = {}
    for process in processes:
        with contextlib.suppress(psutil.Error):
            names[process.pid] = process.name()
    found = []
    for sock in psutil.net_connections(kind="inet"):
        unconnected = sock.status == psutil.CONN_NONE and not sock.raddr  # UDP's
        if sock.pid in names and (sock.status == psutil.CONN_LISTEN or unconnected):
            found.append((sock.laddr.ip, sock.laddr.port, names[sock.pid]))
    return found


def on_loopback(address: str) -> bool:
    """Ray's gRPC servers listen on IPv6 sockets: ::ffff:127.0.0.1 takes only 127.0.0.1's connections."""
    ip = ipaddress.ip_address(address.split("%")[0])
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


def beyond_loopback(found: list[tuple[str, int, str]]) -> list[tuple[str, int, str]]:
    """The listeners of `found` (from `listeners`) on an address other than loopback's."""
    return [entry for entry in found if not on_loopback(entry[0])]


def saving(data: bytes):
    """What checkpoint_write.write_file takes for a file of these bytes."""
    return lambda stream: stream.write(data)


def interrupted_after(run_dir: Path, step: int) -> None:
    """As if the run had been killed right after its checkpoint of `step`: the newer ones go."""
    steps = [int(p.name) for p in (run_dir / checkpoint.CHECKPOINTS).iterdir() if p.name.isdigit()]
    assert step in steps, steps
    for newer in (s for s in steps if s > step):
        shutil.rmtree(run_dir / checkpoint.CHECKPOINTS / str(newer))
    (run_dir / checkpoint.CHECKPOINTS / checkpoint.LATEST).write_text(f"{step}\n")


def killed_copy(run_dir: Path, copy: Path, step: int, epochs_done: int) -> None:
    """`copy`: the finished run in `run_dir` as it would be had it been killed right after its
    checkpoint of `step`, `epochs_done` epochs recorded: no summary, no newer records or checkpoints.
    A resume of it that ends the run writes all that is compared again."""
    shutil.copytree(run_dir, copy)
    (copy / "summary.json").unlink()
    kept = [r for r in metric_records(copy) if r.get("epoch", 0) <= epochs_done and r.get("step", 0) <= step]
    (copy / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in kept))
    interrupted_after(copy, step)
