"""Other hosts, over ssh or, inside a Slurm allocation, over Slurm's own job steps: checked before
the job, their copy of the run directory staged before and collected after it, so several hosts
need no shared file system.

The argv builders are pure (tests are tables of them); `preflight`, `stage` and `collect` run them,
each host in parallel and bounded in time, and name the host that does not answer.
"""

from __future__ import annotations

import secrets
import shlex
import subprocess
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from hvdtrain.launching.spec import Host
from hvdtrain.runtime import divergence, preempt

KEEPALIVE = ("-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3")
"""Always on: a host whose link goes down ends the connection in 15 s rather than never."""
CONNECT_TIMEOUT_S = 5
MARKER = ".hvdtrain-launch"
"""A token the launching host writes into the run directory: a host that sees it shares the disk."""
NOT_COPIED = (MARKER, "./" + MARKER)


@dataclass(frozen=True)
class Ssh:
    """How hvdtrain, horovodrun and mpirun reach the other hosts."""

    port: int | None = None
    identity_file: str | None = None

    def args(self) -> list[str]:
        """The options every ssh to another host takes: never a password prompt, keepalives on, a new
        host's key learnt but a changed one refused."""
        argv = ["-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new", "-o", "LogLevel=ERROR"]
        argv += ["-o", f"ConnectTimeout={CONNECT_TIMEOUT_S}", *KEEPALIVE]
        if self.port is not None:
            argv += ["-p", str(self.port)]
        if self.identity_file is not None:
            argv += ["-i", self.identity_file]
        return argv

    via = "ssh"

    def command(self, host: str, remote: str) -> list[str]:
        return ["ssh", *self.args(), host, remote]


@dataclass(frozen=True)
class SlurmStep:
    """How hvdtrain reaches the other nodes of the Slurm allocation it runs in: a one-task job step
    on the node (many clusters forbid ssh to compute nodes). --overlap: it shares the node's CPUs with
    the job's other steps rather than waiting for them to end."""

    srun: str
    """Slurm's program that starts a job step (its launcher's executable)."""
    via = "a Slurm job step"

    def command(self, host: str, remote: str) -> list[str]:
        step = [self.srun, "--overlap", "--quiet", "--nodes=1", "--ntasks=1", f"--nodelist={host}"]
        return [*step, "bash", "-c", remote]


Transport = Ssh | SlurmStep


def rank_hosts(hosts: Iterable[Host], np: int) -> list[str]:
    """The host of each rank: horovodrun and mpirun --map-by slot fill each host's slots in order."""
    placed = [host.name for host in hosts for _ in range(host.slots)]
    return placed[:np]


PROBE = (
    "import json, os, sys; from importlib.metadata import version; m = {marker!r}; "
    "found = {{'hvdtrain': version('hvdtrain'), 'horovod': version('horovod'), "
    "'marker': open(m).read() if os.path.exists(m) else None, 'cores': len(os.sched_getaffinity(0))}}; "
)
LIBRARY_PROBE = (
    "from hvdtrain import native; library, why = native.bind_library(); "
    "found['bind_library'] = str(library) if library else 'none: ' + why; "
)


def probe_command(python: str, run_dir: Path, bind_library: bool = False) -> str:
    """What runs on each host before the job: the same interpreter, hvdtrain and Horovod build? With
    bind_library, the host's copy of hvdtrain's listener library too (built there if missing)."""
    code = PROBE.format(marker=str(run_dir / MARKER)) + (LIBRARY_PROBE if bind_library else "")
    return shlex.join([python, "-c", code + "print(json.dumps(found))"])


def stage_command(run_dir: Path) -> str:
    """Unpacks the launching host's run directory (a resumed run's checkpoint) on a host; an earlier
    attempt's preemption marker there goes (a stale one would be collected as this attempt's)."""
    where = shlex.quote(str(run_dir))
    markers = f"{where}/{preempt.MARKER} {where}/{divergence.MARKER}"
    return f"mkdir -p {where} && rm -f {markers} && tar -C {where} -xf -"


def collect_command(run_dir: Path) -> str:
    """Packs a host's copy of the run directory: rank 0's checkpoints and metrics, ranks' logs."""
    where = shlex.quote(str(run_dir))
    excluded = " ".join(f"--exclude={shlex.quote(name)}" for name in NOT_COPIED)
    return f"test -d {where} && tar -C {where} {excluded} -cf - . || true"


@dataclass(frozen=True)
class HostCheck:
    host: str
    problem: str | None = None
    """Why the job cannot use this host, or None."""
    shared: bool = False
    """The host sees the launching host's run directory (a shared file system)."""
    cores: int | None = None
    warning: str | None = None
    """What the job does less well on this host (said, not refused)."""


def _in_parallel(function: Callable[[str], HostCheck], hosts: list[str]) -> list[HostCheck]:
    if not hosts:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(hosts))) as pool:
        return list(pool.map(function, hosts))


def _ssh_problem(
    host: str, completed: subprocess.CompletedProcess | None, timeout: float, via: str = Ssh.via
) -> str:
    if completed is None:
        return f"host {host} did not answer over {via} within {timeout:.0f} s"
    text = (completed.stderr or b"").decode(errors="replace").strip().splitlines()
    detail = text[-1] if text else f"exit code {completed.returncode}"
    return f"host {host}: {via} failed: {detail}"


def _run(argv: list[str], timeout: float, stdin: bytes | None = None) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(argv, input=stdin, capture_output=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return None


def write_marker(run_dir: Path) -> str:
    token = secrets.token_hex(8)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / MARKER).write_text(token)
    return token


def preflight(
    hosts: list[str],
    ssh: Transport,
    python: str,
    run_dir: Path,
    expected: dict[str, str],
    token: str,
    timeout: float = 20,
) -> list[HostCheck]:
    """Each host reachable, with this hvdtrain and this Horovod build (and hvdtrain's listener library
    where expected names one); whether it shares run_dir (it reads the token write_marker just wrote
    there)."""
    import json

    def check(host: str) -> HostCheck:
        probe = probe_command(python, run_dir, bind_library="bind_library" in expected)
        completed = _run(ssh.command(host, probe), timeout)
        if (
            completed is None
            or completed.returncode == 255
            or (
                isinstance(ssh, SlurmStep)
                and completed.returncode != 0
                and b"srun: error" in completed.stderr
            )
        ):
            return HostCheck(host, _ssh_problem(host, completed, timeout, ssh.via))
        if completed.returncode != 0:
            reason = (completed.stderr or b"").decode(errors="replace").strip().splitlines()
            last = reason[-1] if reason else f"exit code {completed.returncode}"
            return HostCheck(host, f"host {host}: {python} cannot run hvdtrain there: {last}")
        try:
            found = json.loads(completed.stdout.decode().strip().splitlines()[-1])
        except (ValueError, IndexError):
            return HostCheck(host, f"host {host}: unexpected answer to the version check")
        warning = None
        for name, version in expected.items():
            if found.get(name) == version:
                continue
            if name == "bind_library":  # a job without it runs; that host's daemon listens everywhere
                warning = (
                    f"host {host}: Open MPI's listeners there will answer on every interface: hvdtrain's "
                    f"bind library is not at {version} there ({found.get(name)})"
                )
                continue
            return HostCheck(host, f"host {host} has {name} {found.get(name)}, this host {version}")
        return HostCheck(host, None, found.get("marker") == token, found.get("cores"), warning)

    return _in_parallel(check, hosts)


def stage(hosts: list[str], ssh: Transport, run_dir: Path, timeout: float = 120) -> list[HostCheck]:
    """Copies the run directory (not its logs) to hosts that do not share it, so rank 0 finds the
    checkpoint to resume from wherever it runs."""
    names = sorted(p.name for p in run_dir.iterdir() if p.name not in ("logs", MARKER))
    if not hosts or not names:
        return []
    packed = subprocess.run(["tar", "-C", str(run_dir), "-cf", "-", *names], capture_output=True)
    if packed.returncode != 0:
        return [
            HostCheck(hosts[0], f"cannot pack {run_dir}: {packed.stderr.decode(errors='replace').strip()}")
        ]

    def push(host: str) -> HostCheck:
        completed = _run(ssh.command(host, stage_command(run_dir)), timeout, packed.stdout)
        ok = completed is not None and completed.returncode == 0
        return HostCheck(host, None if ok else _ssh_problem(host, completed, timeout, ssh.via))

    return _in_parallel(push, hosts)


def alive(hosts: list[str], ssh: Transport, timeout: float = 20) -> list[HostCheck]:
    """Which hosts still answer over ssh (after a failed job: a lost host is named)."""

    def answer(host: str) -> HostCheck:
        completed = _run(ssh.command(host, "true"), timeout)
        ok = completed is not None and completed.returncode == 0
        return HostCheck(host, None if ok else _ssh_problem(host, completed, timeout, ssh.via))

    return _in_parallel(answer, hosts)


def collect(hosts: list[str], ssh: Transport, run_dir: Path, timeout: float = 120) -> list[HostCheck]:
    """Brings each host's copy of the run directory back to the launching host: what rank 0 wrote,
    and the rank logs mpirun leaves where each rank ran. A host that does not answer is named."""
    unpacking = threading.Lock()  # one host's files at a time into the one directory

    def pull(host: str) -> HostCheck:
        completed = _run(ssh.command(host, collect_command(run_dir)), timeout)
        if completed is None or completed.returncode != 0:
            return HostCheck(host, _ssh_problem(host, completed, timeout, ssh.via))
        if not completed.stdout:
            return HostCheck(host)
        with unpacking:  # newest wins: under elastic training rank 0 may have moved host mid-run
            unpack = ["tar", "-C", str(run_dir), "--keep-newer-files", "-xf", "-"]
            unpacked = _run(unpack, timeout, completed.stdout)
        if unpacked is None or unpacked.returncode != 0:
            return HostCheck(host, f"host {host}: its run directory could not be unpacked here")
        return HostCheck(host)

    return _in_parallel(pull, hosts)
