"""LaunchSpec -> LaunchCommand: the argv and environment that start the ranks.

`build_launch` is pure: it reads no environment and starts nothing, so every launcher flag is a
row in a unit test. `run_launch` is the one place that executes a command.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

Launcher = Literal["gloo", "mpi"]
LAUNCHERS: tuple[str, ...] = ("gloo", "mpi")
MEASURED_DEFAULT: Launcher = "mpi"
"""What `--launcher auto` picks before this machine has measurements: MPI with yielding beat gloo
and DDP on synthetic-torch here (README table)."""


def choose_launcher(measured: dict[str, dict[str, float]], framework: str, mpirun_found: bool) -> Launcher:
    """`--launcher auto`: the launcher with the best measured training throughput for this framework
    (`hvdtrain bench ... --launchers gloo,mpi` records it), else the measured default."""
    candidates = {name: rate for name, rate in measured.get(framework, {}).items() if name in LAUNCHERS}
    if not mpirun_found:
        candidates.pop("mpi", None)
        return "gloo" if not candidates else max(candidates, key=candidates.get)
    return max(candidates, key=candidates.get) if candidates else MEASURED_DEFAULT


@dataclass(frozen=True)
class Host:
    name: str
    slots: int


@dataclass(frozen=True)
class LaunchSpec:
    program: list[str]
    """argv of one rank."""
    np: int
    launcher: Launcher = "gloo"
    hosts: tuple[Host, ...] = ()
    """Empty means localhost with np slots."""
    cores_per_host: int = 1
    """Used to set threads per rank so the ranks on one host do not oversubscribe its cores."""
    threads_per_rank: int | None = None
    """Overrides the threads derived from cores_per_host."""
    log_dir: str | None = None
    """Per-rank stdout/stderr go under here (rank.N/)."""
    network_interface: str | None = None
    """None: loopback when every host is localhost, else the launcher's own choice."""
    stall_timeout_s: int = 120
    """A rank that stops joining collectives ends the job after this many seconds."""
    run_as_root: bool = False
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for every rank."""
    horovod_tuning: dict[str, str] = field(default_factory=dict)
    """HOROVOD_* settings (cycle time, fusion threshold, ...) for every rank."""
    forward_env: tuple[str, ...] = ("PATH",)
    """Launcher variables mpirun passes on to the ranks (Open MPI forwards only what -x names)."""
    num_ps: int = 1
    """Parameter servers (ps)."""
    rendezvous_port: int = 29500
    """torch.distributed's rendezvous port (ddp)."""
    horovodrun: str = "horovodrun"
    """The horovodrun of the environment the ranks run in."""


@dataclass(frozen=True)
class LaunchCommand:
    argv: list[str]
    env: dict[str, str]
    """Added to the launcher's environment; the launcher passes it on to every rank."""

    def render(self) -> str:
        import shlex

        env = " ".join(f"{key}={shlex.quote(value)}" for key, value in sorted(self.env.items()))
        return f"{env} {shlex.join(self.argv)}".strip()


def parse_hosts(text: str) -> tuple[Host, ...]:
    """'a:2,b:4' -> hosts; a host without :slots gets one slot."""
    hosts = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, slots = item.partition(":")
        if not name or (slots and not slots.isdigit()) or (slots and int(slots) < 1):
            raise ValueError(f"bad host {item!r}: expected HOST or HOST:SLOTS with SLOTS >= 1")
        hosts.append(Host(name, int(slots) if slots else 1))
    if not hosts:
        raise ValueError("no hosts given")
    return tuple(hosts)


def read_hostfile(path: Path) -> tuple[Host, ...]:
    """Horovod's hostfile format: 'HOST slots=N' per line, '#' comments."""
    entries = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, *rest = line.split()
        slots = next((r.split("=", 1)[1] for r in rest if r.startswith("slots=")), "1")
        entries.append(f"{name}:{slots}")
    return parse_hosts(",".join(entries))


def threads_per_rank(np: int, hosts: tuple[Host, ...], cores_per_host: int) -> int:
    ranks_per_host = min(np, max(h.slots for h in hosts)) if hosts else np
    return max(1, cores_per_host // max(1, ranks_per_host))


def rank_env(
    spec: LaunchSpec, threads_hosts: tuple[Host, ...] = (), ranks_per_host: int | None = None
) -> dict[str, str]:
    """What every rank's environment gets from hvdtrain, whatever starts the ranks."""
    if spec.threads_per_rank is not None:
        threads = spec.threads_per_rank
    elif ranks_per_host is None:
        threads = threads_per_rank(spec.np, threads_hosts or spec.hosts, spec.cores_per_host)
    else:
        threads = max(1, spec.cores_per_host // ranks_per_host)
    return {
        "OMP_NUM_THREADS": str(threads),
        "HVDTRAIN_THREADS_PER_RANK": str(threads),
        # Horovod's own stall check (it works under the MPI controller), then hvdtrain's watchdog.
        "HOROVOD_STALL_CHECK_TIME_SECONDS": str(max(1, spec.stall_timeout_s // 2)),
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": str(spec.stall_timeout_s),
        "HVDTRAIN_STALL_TIMEOUT": str(spec.stall_timeout_s),
        **({"HVDTRAIN_STATUS_DIR": f"{spec.log_dir}/status"} if spec.log_dir else {}),
        **spec.horovod_tuning,
        **spec.env,
    }


def build_launch(spec: LaunchSpec) -> LaunchCommand:
    if spec.np < 1:
        raise ValueError(f"--np must be at least 1, got {spec.np}")
    hosts = spec.hosts or (Host("localhost", spec.np),)
    if sum(h.slots for h in hosts) < spec.np:
        raise ValueError(f"--np {spec.np} exceeds the {sum(h.slots for h in hosts)} slots of the hosts given")
    network_interface = spec.network_interface
    if network_interface is None and all(h.name in ("localhost", "127.0.0.1") for h in hosts):
        network_interface = "lo"  # one machine: keep gloo and MPI on loopback
    host_arg = ",".join(f"{h.name}:{h.slots}" for h in hosts)
    env = rank_env(spec, hosts)
    if spec.launcher == "gloo":
        argv = [spec.horovodrun, "-np", str(spec.np), "-H", host_arg, "--gloo"]
        if network_interface:
            argv += ["--network-interface", network_interface]
        if spec.log_dir:
            argv += ["--output-filename", spec.log_dir]
        return LaunchCommand(argv + list(spec.program), env)
    if spec.launcher == "mpi":
        argv = ["mpirun"]
        if spec.run_as_root:
            argv.append("--allow-run-as-root")
        argv += ["-np", str(spec.np), "-H", host_arg, "--bind-to", "none", "--map-by", "slot", "--tag-output"]
        # Open MPI busy-polls while a rank waits, which steals the cores the other ranks compute on;
        # yielding measured 1075-1207 vs 836-906 samples/s on synthetic-torch, np=2, 2 cores.
        argv += ["--mca", "mpi_yield_when_idle", "1"]
        if network_interface:
            argv += [
                "--mca",
                "btl_tcp_if_include",
                network_interface,
                "--mca",
                "oob_tcp_if_include",
                network_interface,
            ]
        if spec.log_dir:
            argv += ["--output-filename", spec.log_dir]
        for name in sorted(env) + [n for n in spec.forward_env if n not in env]:
            argv += ["-x", name]
        return LaunchCommand(argv + list(spec.program), env)
    raise ValueError(f"unknown launcher {spec.launcher!r}; choose one of {', '.join(LAUNCHERS)}")


@dataclass
class LaunchResult:
    returncode: int
    failed_rank: int | None
    output_tail: list[str]
    wall_seconds: float


_FAILED_RANK_PATTERNS = (
    re.compile(r"Process (\d+) exit with status code"),  # horovodrun --gloo
    re.compile(r"process rank (\d+) with PID"),  # mpirun, a rank killed by a signal
    re.compile(r"Process name: \[\[\d+,\d+\],(\d+)\]"),  # mpirun, a rank that exited non-zero
    re.compile(r"^\s*rank\s*:\s*(\d+) \(local_rank"),  # torch.distributed.run
)


ROOT_CAUSE = "Root Cause (first observed failure)"


def first_failed_rank(lines: list[str] | deque[str]) -> int | None:
    lines = list(lines)
    # torchrun lists the other failures before the "Root Cause (first observed failure)".
    root = next((i for i, line in enumerate(lines) if ROOT_CAUSE in line), 0)
    for line in lines[root:]:
        for pattern in _FAILED_RANK_PATTERNS:
            match = pattern.search(line)
            if match:
                return int(match.group(1))
    return None


def rank_output_files(log_dir: Path, stream: str = "stdout") -> dict[int, Path]:
    """rank -> its stdout or stderr file, whichever launcher wrote them: horovodrun (rank.N/, N padded
    with zeros), mpirun (1/rank.N/) or torchrun (<run id>/attempt_0/N/stdout.log)."""
    found = {}
    for path in sorted(log_dir.glob(f"**/{stream}")) + sorted(log_dir.glob(f"**/attempt_*/*/{stream}.log")):
        name = path.parent.name.removeprefix("rank.")
        if name.isdigit():
            found.setdefault(int(name), path)
    return found


def rank_json_records(log_dir: Path) -> list[dict]:
    """The JSON objects ranks printed one per line, read from their own stdout files (the console
    interleaves ranks). Tolerates the launchers' tags, including Open MPI's habit of tagging a
    line's newline as a chunk of its own ('{...}[1,0]<stdout>:')."""
    decoder = json.JSONDecoder()
    found = []
    for path in rank_output_files(log_dir).values():
        for line in path.read_text(errors="replace").splitlines():
            start = line.find("{")
            if start >= 0:
                with contextlib.suppress(json.JSONDecodeError):
                    found.append(decoder.raw_decode(line[start:])[0])
    return found


def rank_stderr_tail(log_dir: Path, rank: int, lines: int = 15) -> list[str]:
    """The last non-empty lines a rank wrote to stderr."""
    path = rank_output_files(log_dir, "stderr").get(rank)
    if path is None:
        return []
    return [line for line in path.read_text(errors="replace").splitlines() if line.strip()][-lines:]


# TensorFlow's start-up chatter (CPU features, oneDNN, absl): kept in the per-rank log files, not shown.
FRAMEWORK_NOISE = re.compile(
    r"oneDNN custom operations are on|All log messages before absl::InitializeLog|"
    r"rebuild TensorFlow with the appropriate compiler flags|This TensorFlow binary is optimized|"
    r"Unable to register cu(DNN|FFT|BLAS) factory|computation placer already registered|"
    r"Could not find cuda drivers|failed call to cuInit|TF-TRT Warning"
)


RANK_TAG = re.compile(r"^(\[\d+\]|\[\d+,\d+\])<std(out|err)>:")


def run_launch(
    command: LaunchCommand,
    timeout_s: float | None = None,
    quiet: bool = False,
    show_framework_noise: bool = False,
) -> LaunchResult:
    """Run the launcher in its own process group, stream its output, and leave no process behind."""
    start = time.monotonic()
    tail: deque[str] = deque(maxlen=400)
    failures: list[str] = []
    process = subprocess.Popen(
        command.argv,
        env={**os.environ, **command.env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        bufsize=1,
        start_new_session=True,
    )

    def pump() -> None:
        assert process.stdout is not None
        in_launcher_traceback = False
        for line in process.stdout:
            tail.append(line.rstrip("\n"))
            if ROOT_CAUSE in line or first_failed_rank([line]) is not None:
                failures.append(line)
            # horovodrun reports a failed rank with a Python traceback of its own; hvdtrain reports
            # it in one message instead. Ranks' lines carry a rank tag and are always shown.
            from_launcher = not RANK_TAG.match(line)
            in_launcher_traceback = from_launcher and (in_launcher_traceback or line.startswith("Traceback"))
            hidden = in_launcher_traceback or (FRAMEWORK_NOISE.search(line) and not show_framework_noise)
            if not quiet and not hidden:
                sys.stdout.write(line)
                sys.stdout.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        returncode = process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        returncode = 124
    except KeyboardInterrupt:
        returncode = 130
    finally:
        _kill_group(process)
    reader.join(timeout=5)
    return LaunchResult(returncode, first_failed_rank(failures), list(tail), time.monotonic() - start)


def _kill_group(process: subprocess.Popen) -> None:
    """End the launcher and every rank it started, also ranks in sessions of their own
    (horovodrun starts each rank under a setsid'd middleman): SIGTERM, a grace period, SIGKILL."""
    import psutil

    try:
        family = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        family = []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    for member in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.terminate()
    _, alive = psutil.wait_procs(family, timeout=5)
    for member in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.kill()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
