"""A real Slurm cluster on the hosts of the namespace rig (tests/support/rig.py).

slurmctld runs on host 1 and one slurmd on every host, each inside its host's network, UTS and mount
namespaces, so a job sees the host's hostname, address and private disk. Nothing global is used or
changed: the cluster has its own munged (key, socket, pid and seed files in its temporary directory),
its own slurm.conf and cgroup.conf there, and clients find it through `SLURM_CONF` (see `env()`).

Two things the rig's hosts need:

- `ip netns exec` remounted sysfs in the hosts, hiding the cgroup mounts, and slurmd refuses to start
  without a cgroup file system at /sys/fs/cgroup even when no plugin uses cgroups (proctrack/linuxproc,
  task/none). Each slurmd gets a mount namespace of its own, inside its host's, with an empty tmpfs
  there: enough for cgroup/v1 to start, and no cgroup of the machine is touched.
- The hosts share /tmp, where the pmix plugin makes per-step directories named after the job only, so
  two nodes of a step collide; TmpFS is per node (`%n`).

Everything is named after the owning process id like the rig's own leftovers (the temporary directory
is `hvdrig-<pid>-slurm-*`), and `clean_stale_clusters()` kills what a dead owner's cluster left running
outside the hosts' namespaces (its munged, its clients); the rig removes the rest. One cluster per
machine, as for the rig: the ports are fixed.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from tests.support.rig import PREFIX, Rig, RigError, _kill_all, _owner_alive, _running, _wait_gone, _which

SLURMCTLD_PORT = 6917
SLURMD_PORT = 6918
"""Not Slurm's defaults (6817, 6818), so a real Slurm on this machine is never confused with this one."""
CPUS_PER_NODE = 2
PARTITION = "rig"
CRED_EXPIRE_S = 15
"""The job step credential's lifetime: a requeued job waits that long plus one second before it may
start again, so it is short here (Slurm's default is 120 s), but every srun's tasks must reach their
slurmd within it, or the launch fails "Job credential expired": Slurm's lowest accepted value, 5 s,
leaves too little margin on a 2-core machine under make test's three workers."""
READY_TIMEOUT_S = 30.0
"""How long the cluster has to show every node idle."""
CLIENT_VARIABLES = re.compile(r"(SLURM|SBATCH|SALLOC|SRUN|SQUEUE|SINFO|SCONTROL|SCANCEL)_.*")
"""Variables that steer Slurm's clients: none is inherited from the caller (say, a job of another cluster)."""
REQUIRED = ("munged", "slurmctld", "slurmd", "sinfo", "squeue", "scontrol", "scancel", "srun", "sbatch")
OWNED_NAME = re.compile(rf"{PREFIX}-(\d+)-slurm-")
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "sbatch", "salloc", "sattach", "squeue", "sinfo", "scontrol", "scancel", "sstat")

SLURMD_SCRIPT = """set -e
mount -t tmpfs {prefix}-cgroup /sys/fs/cgroup
exec "$@"
"""
"""Runs in the slurmd's own mount namespace, then becomes the slurmd (same pid from nsenter on)."""


def clean_stale_clusters() -> list[str]:
    """Kills what a cluster whose owning process is dead left running outside the hosts' namespaces:
    its munged, and Slurm clients (srun, sbatch, ...) still pointed at its slurm.conf; removes its
    directory. Its daemons and jobs in the hosts' namespaces go with the rig's leftovers
    (clean_stale_rigs). Returns what it removed."""
    removed, killed = [], []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        pid = int(entry.name)
        owner = _stale_owner(pid)
        if owner is not None and not _cluster_owner_alive(owner) and _running(pid):
            removed.append(f"process {pid} ({_read(entry / 'cmdline').replace(chr(0), ' ').strip()})")
            killed.append(pid)
    _kill_all(killed)
    _wait_gone(killed, timeout=5)
    for base in sorted(Path(tempfile.gettempdir()).glob(f"{PREFIX}-*-slurm-*")):
        match = OWNED_NAME.match(base.name)
        if match and base.is_dir() and not base.is_symlink() and not _cluster_owner_alive(int(match[1])):
            shutil.rmtree(base, ignore_errors=True)
            removed.append(f"dir {base}")
    return removed


def _cluster_owner_alive(pid: int) -> bool:
    if pid == os.getpid():
        return SlurmCluster.active is not None
    return _owner_alive(pid)


def _stale_owner(pid: int) -> int | None:
    """The owner pid of the cluster a process belongs to: a daemon whose command line names a cluster's
    directory, or a Slurm client whose SLURM_CONF does. Nothing else, whatever it names."""
    argv = _read(Path(f"/proc/{pid}/cmdline")).split("\0")
    program = Path(argv[0]).name
    match = OWNED_NAME.search(" ".join(argv)) if program in DAEMONS else None
    if program in CLIENTS:
        environ = _read(Path(f"/proc/{pid}/environ")).split("\0")
        conf = next((item for item in environ if item.startswith("SLURM_CONF=")), "")
        match = OWNED_NAME.search(conf)
    return int(match[1]) if match else None


def _read(path: Path) -> str:
    with contextlib.suppress(OSError):
        return path.read_bytes().decode(errors="replace")
    return ""


def _tail(path: Path, limit: int = 2500) -> str:
    text = _read(path)
    return text[-limit:] if text else "(empty)"


class SlurmCluster:
    """Slurm on a started Rig: slurmctld on host 1, a slurmd on every host, one partition of them all.

    Use as a context manager, or start() and close(). Clients run in the root namespace (or in jobs)
    with `env()`, or through `run()`::

        job = cluster.run(["sbatch", "--parsable", "-N2", "--wrap", "srun hostname"], check=True)
        final = cluster.wait_job_gone(job.stdout.strip())
        assert final["JobState"] == "COMPLETED"
    """

    active: SlurmCluster | None = None
    """The cluster this process has up, if any (one per machine: the ports are fixed)."""

    def __init__(self, rig: Rig, options: Mapping[str, str] | None = None, hosts: int | None = None) -> None:
        """options: slurm.conf keys that replace or add to the defaults (say {"SlurmdTimeout": "10"});
        hosts: the first this many of the rig's hosts are the nodes (all of them by default)."""
        if not rig.hosts:
            raise RigError("cannot make the Slurm cluster: start the rig first")
        self.rig = rig
        self.owner = os.getpid()
        self.hosts = rig.hosts[:hosts] if hosts else rig.hosts
        self.nodes = tuple(host.hostname for host in self.hosts)
        """Node names, the hosts' hostnames: node i is rig host i."""
        self.partition = PARTITION
        self.base = Path()
        """The cluster's temporary directory; empty until start()."""
        self._options = dict(options or {})
        self._munged: subprocess.Popen | None = None
        self._slurmctld: subprocess.Popen | None = None
        self._slurmd: dict[str, subprocess.Popen] = {}
        self._slurmd_mounts: set[str] = set()
        self._started = False
        self._closed = False

    # -- the layout

    @property
    def conf(self) -> Path:
        """slurm.conf; cgroup.conf lies beside it."""
        return self.base / "slurm.conf"

    @property
    def workdir(self) -> Path:
        """Where run() starts clients, so a job's default output (slurm-<id>.out) lands here."""
        return self.base / "work"

    @property
    def munge_socket(self) -> Path:
        return self.base / "munge" / "munge.socket"

    def log_path(self, daemon: str) -> Path:
        """The log of "munged", "slurmctld" or a node's slurmd ("slurmd-hvdhost1")."""
        return self.base / f"{daemon}.log"

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a Slurm client here or in a job: this one without inherited Slurm variables,
        with SLURM_CONF, and with this venv's bin first on PATH, so that a job (which inherits what srun
        or sbatch had) finds `python` and `hvdtrain` of this venv on every node."""
        env = {key: value for key, value in os.environ.items() if not CLIENT_VARIABLES.fullmatch(key)}
        venv_bin = str(Path(sys.executable).parent)
        env["PATH"] = os.pathsep.join([venv_bin, env.get("PATH", "/usr/bin:/bin")])
        env["SLURM_CONF"] = str(self.conf)
        env.update(extra)
        return env

    # -- up and down

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def start(self, timeout: float = READY_TIMEOUT_S) -> SlurmCluster:
        """Writes the config, starts munged, slurmctld and the slurmds, and waits until every node is
        idle; on failure, takes down what it started and raises RigError with the daemons' logs."""
        if self._started or self._closed:
            raise RigError("a SlurmCluster starts once: make a new one")
        if SlurmCluster.active is not None:
            raise RigError("cannot make the Slurm cluster: this process already has one up")
        programs = {program: _which(program) for program in REQUIRED}
        clean_stale_clusters()
        self._started = True
        SlurmCluster.active = self
        atexit.register(self.close)
        try:
            self._make_files()
            self._start_munged(programs["munged"])
            self._start_daemons(programs["slurmctld"], programs["slurmd"])
            self.wait_idle(timeout)
            self._slurmd_mounts = self._own_mount_namespaces()
        except BaseException as error:
            try:
                self.close()
            except RigError as teardown:
                error.add_note(str(teardown))
            raise
        return self

    def _make_files(self) -> None:
        self.base = Path(tempfile.mkdtemp(prefix=f"{PREFIX}-{self.owner}-slurm-"))
        self.base.chmod(0o755)  # munged wants every directory above its socket searchable by all
        for directory in ("munge", "state", "work", *(f"spool/{n}" for n in self.nodes)):
            (self.base / directory).mkdir(parents=True)
        for node in self.nodes:
            (self.base / "tmp" / node).mkdir(parents=True)
        key = self.base / "munge" / "munge.key"
        with os.fdopen(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as out:
            out.write(os.urandom(128))
        self.conf.write_text(self._slurm_conf())
        (self.base / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")

    def _slurm_conf(self) -> str:
        base, host_1 = self.base, self.rig.host(1)
        options = {
            "ClusterName": PREFIX,
            "SlurmctldHost": f"{host_1.hostname}({host_1.address})",
            "SlurmctldPort": str(SLURMCTLD_PORT),
            "SlurmdPort": str(SLURMD_PORT),
            "SlurmUser": "root",
            "SlurmdUser": "root",
            "AuthType": "auth/munge",
            "CredType": "cred/munge",
            "AuthInfo": f"socket={self.munge_socket},cred_expire={CRED_EXPIRE_S}",
            "StateSaveLocation": f"{base}/state",
            "SlurmdSpoolDir": f"{base}/spool/%n",
            "TmpFS": f"{base}/tmp/%n",
            "SlurmctldPidFile": f"{base}/slurmctld.pid",
            "SlurmdPidFile": f"{base}/slurmd-%n.pid",
            "SlurmctldLogFile": str(self.log_path("slurmctld")),
            "SlurmdLogFile": f"{base}/slurmd-%n.log",
            "SlurmctldDebug": "info",
            "SlurmdDebug": "info",
            "MailProg": "/bin/true",
            "ProctrackType": "proctrack/linuxproc",
            "TaskPlugin": "task/none",
            "SelectType": "select/cons_tres",
            "SelectTypeParameters": "CR_CPU",
            "SlurmdParameters": "config_overrides",  # the nodes are what this file says, whatever the machine
            "SchedulerType": "sched/backfill",
            "SchedulerParameters": "sched_interval=1,bf_interval=1",
            "MpiDefault": "none",
            "AccountingStorageType": "accounting_storage/none",
            "JobCompType": "jobcomp/none",
            "JobAcctGatherType": "jobacct_gather/none",
            "JobRequeue": "1",
            "ReturnToService": "2",
            "KillWait": "5",
            "MessageTimeout": "10",
            **self._options,
        }
        lines = [f"{key}={value}" for key, value in options.items()]
        for host in self.hosts:
            lines.append(
                f"NodeName={host.hostname} NodeAddr={host.address} CPUs={CPUS_PER_NODE} Sockets=1 "
                f"CoresPerSocket={CPUS_PER_NODE} ThreadsPerCore=1 State=UNKNOWN"
            )
        nodes = ",".join(self.nodes)
        lines.append(f"PartitionName={self.partition} Nodes={nodes} Default=YES MaxTime=UNLIMITED State=UP")
        return "\n".join(lines) + "\n"

    def _start_munged(self, munged: str) -> None:
        munge = self.base / "munge"
        argv = [munged, "--foreground", f"--socket={self.munge_socket}", f"--key-file={munge}/munge.key"]
        argv += [f"--pid-file={munge}/munged.pid", f"--seed-file={munge}/munged.seed", "--num-threads=2"]
        with self.log_path("munged").open("w") as log:  # in the foreground it logs to stderr
            self._munged = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + 10
        while not self.munge_socket.exists():
            exited = self._munged.poll()
            if exited is not None or time.monotonic() > deadline:
                how = f"exited with {exited}" if exited is not None else "timed out"
                raise RigError(
                    f"cannot make the Slurm cluster: munged did not make {self.munge_socket} ({how})\n"
                    f"munged log:\n{_tail(self.log_path('munged'))}"
                )
            time.sleep(0.01)

    def _start_daemons(self, slurmctld: str, slurmd: str) -> None:
        conf = str(self.conf)
        self._slurmctld = self._popen(
            self.rig.host_argv(1, [slurmctld, "-D", "-f", conf]), self.base / "slurmctld.stderr"
        )
        for host in self.hosts:
            own_mounts = ["unshare", "--mount", "--propagation", "private", "--"]
            script = ["sh", "-c", SLURMD_SCRIPT.format(prefix=PREFIX), PREFIX]
            argv = self.rig.host_argv(
                host.index, [*own_mounts, *script, slurmd, "-D", "-f", conf, "-N", host.hostname]
            )
            self._slurmd[host.hostname] = self._popen(argv, self.base / f"slurmd-{host.hostname}.stderr")

    def _own_mount_namespaces(self) -> set[str]:
        """The mount namespaces the slurmds made for themselves (slurmstepd and jobs run there too):
        only those of a process that already is a slurmd, never its host's nor this process's."""
        found = set()
        for host in self.hosts:
            slurmd = self._slurmd.get(host.hostname)
            if slurmd is None or slurmd.poll() is not None:
                continue
            argv = _read(Path(f"/proc/{slurmd.pid}/cmdline")).split("\0")
            mount_ns = _mount_ns(slurmd.pid)
            enter = self.rig.host_argv(host.index, [])  # nsenter -t <the host's sshd> ...
            not_own = {_mount_ns(os.getpid()), _mount_ns(int(enter[enter.index("-t") + 1])), ""}
            if Path(argv[0]).name == "slurmd" and mount_ns not in not_own:
                found.add(mount_ns)
        return found

    @staticmethod
    def _popen(argv: list[str], stderr: Path) -> subprocess.Popen:
        """A daemon in the foreground; its stderr (what it says before its log file is open) to a file."""
        with stderr.open("w") as out:
            return subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait_idle(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Waits until sinfo shows every node idle; raises RigError with the daemons' logs if not."""
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while True:
            with contextlib.suppress(subprocess.TimeoutExpired):
                states = self.node_states(timeout=max(1.0, deadline - time.monotonic()))
            dead = self._dead_daemons()
            if dead:
                raise RigError(f"the Slurm cluster is down: {'; '.join(dead)}\n{self.logs()}")
            if states and all(states.get(node) == "idle" for node in self.nodes):
                return
            if time.monotonic() > deadline:
                raise RigError(
                    f"the Slurm cluster's nodes are not idle within {timeout:.0f} s "
                    f"(sinfo: {states or 'no answer'})\n{self.logs()}"
                )
            time.sleep(0.1)

    def _dead_daemons(self) -> list[str]:
        daemons = {"munged": self._munged, "slurmctld": self._slurmctld}
        daemons.update({f"slurmd on {node}": slurmd for node, slurmd in self._slurmd.items()})
        return [
            f"{name} exited with {daemon.returncode}"
            for name, daemon in daemons.items()
            if daemon is not None and daemon.poll() is not None
        ]

    def logs(self) -> str:
        """The tail of every daemon's log (and of what it wrote to stderr before its log was open)."""
        parts = [f"munged log:\n{_tail(self.log_path('munged'))}"]
        for daemon in ["slurmctld", *(f"slurmd-{node}" for node in self.nodes)]:
            parts.append(f"{daemon} stderr:\n{_tail(self.base / f'{daemon}.stderr', 1500)}")
            parts.append(f"{daemon} log:\n{_tail(self.log_path(daemon))}")
        return "\n".join(parts)

    def close(self) -> None:
        """Cancels every job, stops the daemons, kills whatever ran under a slurmd and checks that nothing
        of the cluster is left on any host. Idempotent; raises RigError if something stayed."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        problems: list[str] = []
        if self._slurmctld is not None and self._slurmctld.poll() is None and self.conf.exists():
            problems += self._cancel_all()
        mounts = self._slurmd_mounts | self._own_mount_namespaces()
        daemons = [*self._slurmd.values(), self._slurmctld, self._munged]
        for daemon in daemons:
            if daemon is not None and daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
        for daemon in daemons:
            if daemon is None:
                continue
            try:
                daemon.wait(timeout=5)
            except subprocess.TimeoutExpired:
                daemon.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    daemon.wait(timeout=5)
            if daemon.poll() is None:
                problems.append(f"{daemon.args[0]} (pid {daemon.pid}) survives SIGKILL")
        survivors = _kill_mount_namespaces(mounts)  # slurmstepd and what jobs left
        if survivors:
            problems.append(f"processes {survivors} under a slurmd survive SIGKILL")
        left = self.rig.leftover_processes(timeout=5) if self.rig.hosts and Rig.active is self.rig else {}
        if left:
            problems.append(f"processes left on the hosts: {left}")
        if self.base != Path() and self.base.exists():
            shutil.rmtree(self.base, ignore_errors=True)
            if self.base.exists():
                problems.append(f"{self.base} stays")
        if SlurmCluster.active is self:
            SlurmCluster.active = None
        if problems:
            raise RigError("the Slurm cluster was not taken down completely: " + "; ".join(problems))

    def _cancel_all(self, timeout: float = 15) -> list[str]:
        """Cancels every job and waits until none is active; returns problems."""
        try:
            self.run(["scancel", f"--partition={self.partition}"], timeout=timeout)
            deadline = time.monotonic() + timeout
            while (active := self.active_jobs()) and time.monotonic() < deadline:
                time.sleep(0.1)
        except (subprocess.TimeoutExpired, RigError) as error:
            return [f"cancelling every job: {error}"]
        return [f"jobs {active} still active {timeout:.0f} s after scancel"] if active else []

    # -- using the cluster

    def run(
        self,
        argv: Sequence[str],
        timeout: float = 60,
        check: bool = False,
        input: str | None = None,
        cwd: Path | str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Runs a Slurm client (srun, sbatch, squeue, ...) in the root namespace with env() (plus env),
        in workdir unless told; raises subprocess.TimeoutExpired after timeout seconds."""
        return subprocess.run(
            list(argv),
            input=input,
            stdin=None if input is not None else subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=check,
            cwd=cwd or self.workdir,
            env=self.env(**(env or {})),
        )

    def node_states(self, timeout: float = 15) -> dict[str, str]:
        """Each node's state as sinfo shows it ("idle", "alloc", "down*", ...)."""
        done = self.run(["sinfo", "--noheader", "--Node", "--format=%N %t"], timeout=timeout)
        return dict(line.split(None, 1) for line in done.stdout.splitlines() if len(line.split()) == 2)

    def active_jobs(self) -> list[str]:
        """The ids of jobs not yet finished (pending, running, completing)."""
        done = self.run(["squeue", "--noheader", "--format=%i"], timeout=15)
        if done.returncode != 0:
            raise RigError(f"squeue failed: {done.stderr.strip()}")
        return done.stdout.split()

    def job(self, job_id: str | int) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, NodeList, ...); empty once Slurm forgot it."""
        done = self.run(["scontrol", "--oneliner", "show", "job", str(job_id)], timeout=15)
        fields = {}
        for word in done.stdout.split():
            key, sep, value = word.partition("=")
            if sep and key not in fields:
                fields[key] = value
        return fields

    def wait_job_writes(self, job_id: str | int, path: Path, output: Path, timeout: float = 180) -> None:
        """Waits until the job has written path (say, its first metrics). Raises AssertionError at once
        if the job leaves the queue first, or after timeout, with the job's state and reason, the tail
        of its output file and the daemons' logs: a job that never ran says why."""
        deadline = time.monotonic() + timeout
        while not path.exists():
            gone = str(job_id) not in self.active_jobs()
            if gone or time.monotonic() > deadline:
                found = self.job(job_id)
                how = "left the queue" if gone else f"still {found.get('JobState')} after {timeout:.0f} s"
                raise AssertionError(
                    f"job {job_id} {how} before writing {path.name}: state {found.get('JobState')}, "
                    f"reason {found.get('Reason')}, nodes {found.get('NodeList')}, "
                    f"restarts {found.get('Restarts')}, exit code {found.get('ExitCode')}\n"
                    f"sinfo: {self.node_states()}\n{output.name}:\n{_tail(output)}\n{self.logs()}"
                )
            time.sleep(0.2)

    def wait_job_gone(self, job_id: str | int, timeout: float = 60) -> dict[str, str]:
        """Waits until the job is no longer active (finished, failed or cancelled, and completed on every
        node); returns its final `job()`. Raises TimeoutError with the job and the daemons' logs."""
        deadline = time.monotonic() + timeout
        while str(job_id) in self.active_jobs():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"job {job_id} still active after {timeout:.0f} s: {self.job(job_id)}\n{self.logs()}"
                )
            time.sleep(0.1)
        return self.job(job_id)


def _mount_ns(pid: int) -> str:
    with contextlib.suppress(OSError):
        return os.readlink(f"/proc/{pid}/ns/mnt")
    return ""


def _kill_mount_namespaces(mounts: set[str], timeout: float = 5) -> list[int]:
    """Kills every process in these mount namespaces, again until none is left; returns survivors."""
    deadline = time.monotonic() + timeout
    while True:
        pids = [
            int(entry.name)
            for entry in Path("/proc").iterdir()
            if entry.name.isdigit() and _mount_ns(int(entry.name)) in mounts and _running(int(entry.name))
        ]
        if not pids or time.monotonic() > deadline:
            return pids
        _kill_all(pids)
        _wait_gone(pids, max(0.0, deadline - time.monotonic()))
