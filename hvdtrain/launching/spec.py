"""What every launch shares: the hosts, the LaunchSpec a strategy or launcher turns into a
LaunchCommand, and reading what the ranks wrote.

Everything here is pure or reads files the ranks wrote; `hvdtrain.launching.runner` is the one place that
starts a command.
"""

from __future__ import annotations

import re
import shlex
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

LOOPBACK_NAMES = ("localhost", "127.0.0.1")


@dataclass(frozen=True)
class Host:
    name: str
    slots: int


@dataclass(frozen=True)
class LaunchSpec:
    """Only what every launcher needs; a strategy's or launcher's own options live with their owner."""

    program: list[str]
    """argv of one rank."""
    np: int
    hosts: tuple[Host, ...] = ()
    """Empty means localhost with np slots."""
    discovery_script: str | None = None
    """A program printing the hosts available now, one HOST:SLOTS a line (elastic), instead of hosts."""
    log_dir: str | None = None
    """Per-rank stdout/stderr go under here."""
    network_interface: str | None = None
    """None: loopback when every host is localhost, else the launcher's own choice."""
    env: dict[str, str] = field(default_factory=dict)
    """Every rank's environment from hvdtrain: threads, the strategy's variables, the user's."""
    forward_env: tuple[str, ...] = ("PATH",)
    """Variables of the launcher's own environment the ranks need too (mpirun forwards only these)."""
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    """How the launcher reaches other hosts over ssh (None: ssh's own defaults)."""


@dataclass(frozen=True)
class RankOutput:
    """How a launcher (or a strategy that starts its own processes) shows and keeps each rank's output."""

    tag: str
    """A regex of the tag before a rank's line on the launcher's output, with a group `rank` and
    optionally `stream` (out or err; stdout where absent)."""
    logs: str
    """A glob under the log directory of a rank's output file, `{stream}` standing for stdout or
    stderr; the rank is the name of the file's folder (without a `rank.` prefix), plus N of a
    `ranks.N` folder above it (a host that numbers its own ranks from 0, N its first global rank)."""
    in_pieces: bool = False
    """The launcher tags each piece of a rank's output as it reads it, not each line (Open MPI): a
    line a rank wrote in two writes may come as two tagged pieces, another rank's between them."""


@dataclass(frozen=True)
class LaunchCommand:
    argv: list[str]
    env: dict[str, str]
    """Added to the launcher's environment; the launcher passes it on to every rank."""

    def render(self) -> str:
        env = " ".join(f"{key}={shlex.quote(value)}" for key, value in sorted(self.env.items()))
        return f"{env} {shlex.join(self.argv)}".strip()


HOST_NAME = re.compile(
    r"^(?=.{1,254}$)[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?(\.[A-Za-z0-9_]([A-Za-z0-9_-]*[A-Za-z0-9_])?)*\.?$"
)
"""A host name (underscores and a trailing dot allowed, as resolvers take them) or an IPv4 address."""


def _host(name: str, slots: str, where: str) -> Host:
    if not HOST_NAME.match(name) or not slots.isdigit() or int(slots) < 1:
        raise ValueError(f"bad host {where}: expected HOST or HOST:SLOTS with SLOTS >= 1")
    return Host(name, int(slots))


def _unique(hosts: list[Host]) -> tuple[Host, ...]:
    if not hosts:
        raise ValueError("no hosts given")
    seen: dict[str, str] = {}
    for host in hosts:
        key = "localhost" if host.name in LOOPBACK_NAMES else host.name.lower()
        if key in seen:
            raise ValueError(
                f"host {host.name} is listed twice (as {seen[key]}); give each host once with its slots"
            )
        seen[key] = host.name
    return tuple(hosts)


def parse_hosts(text: str) -> tuple[Host, ...]:
    """'a:2,b:4' -> hosts; a host without :slots gets one slot."""
    hosts = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, slots = item.partition(":")
        hosts.append(_host(name, slots if sep else "1", repr(item)))
    return _unique(hosts)


def parse_hostfile(text: str) -> tuple[Host, ...]:
    """Horovod's hostfile format: 'HOST slots=N' per line, '#' comments; anything else is refused with
    its line number rather than read as a host name."""
    hosts = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, *rest = line.split()
        fields = dict(item.partition("=")[::2] for item in rest)
        if any(not item.partition("=")[2] for item in rest) or set(fields) - {"slots", "max_slots"}:
            raise ValueError(f"hostfile line {number} {raw.strip()!r}: expected 'HOST slots=N'")
        hosts.append(_host(name, fields.get("slots", "1"), f"on hostfile line {number}"))
    return _unique(hosts)


def hosts_of(spec: LaunchSpec) -> tuple[Host, ...]:
    """The hosts the ranks go to; refuses more ranks than slots."""
    if spec.np < 1:
        raise ValueError(f"--np must be at least 1, got {spec.np}")
    hosts = spec.hosts or (Host("localhost", spec.np),)
    if sum(h.slots for h in hosts) < spec.np:
        raise ValueError(f"--np {spec.np} exceeds the {sum(h.slots for h in hosts)} slots of the hosts given")
    return hosts


def is_local(hosts: Iterable[Host]) -> bool:
    return all(h.name in LOOPBACK_NAMES for h in hosts)


def host_argument(spec: LaunchSpec) -> str:
    return ",".join(f"{h.name}:{h.slots}" for h in hosts_of(spec))


def interface_for(spec: LaunchSpec) -> str | None:
    """One machine keeps gloo and MPI on loopback; several use the given NIC or the launcher's choice."""
    if spec.network_interface is None and is_local(hosts_of(spec)):
        return "lo"
    return spec.network_interface


def threads_per_rank(np: int, hosts: tuple[Host, ...], cores_per_host: int) -> int:
    """Fill the cores of the busiest host without oversubscribing them."""
    ranks_per_host = min(np, max(h.slots for h in hosts)) if hosts else np
    return max(1, cores_per_host // max(1, ranks_per_host))


def threads_from_environment(environ: Mapping[str, str]) -> int | None:
    """The OMP_NUM_THREADS the user set, which --threads-per-rank then defaults to, as a plain
    horovodrun, mpirun or torchrun job would honour it; None where it is unset. OpenMP's list form
    (`4,2`) gives the outermost level first."""
    given = environ.get("OMP_NUM_THREADS", "").strip()
    if not given:
        return None
    first = given.split(",")[0].strip()
    if not first.isdigit() or int(first) < 1:
        raise ValueError(
            f"OMP_NUM_THREADS must be a number of threads, at least 1 (it is --threads-per-rank's "
            f"default), got {given!r}"
        )
    return int(first)


def thread_env(threads: int) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(threads), "HVDTRAIN_THREADS_PER_RANK": str(threads)}


def free_ports(count: int = 1) -> list[int]:
    """Ports free on loopback now, all different (held open together while they are picked)."""
    probes = [socket.socket() for _ in range(count)]
    try:
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [probe.getsockname()[1] for probe in probes]
    finally:
        for probe in probes:
            probe.close()


def source_address(host: str) -> str | None:
    """This host's address as `host` reaches it: the one the kernel sends from towards it (connecting
    a UDP socket sends no packet). None where the name does not resolve or no route leads there."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((socket.gethostbyname(host), 9))
            return probe.getsockname()[0]
    except OSError:
        return None


ROOT_CAUSE = "Root Cause (first observed failure)"


EXIT_CODE_LINE = re.compile(r"^\s*(?:Exit code|exitcode)\s*:\s*(-?\d+)")
"""mpirun and torchrun give a failed rank's exit code on a line just after the one naming the rank."""


@dataclass(frozen=True)
class Failure:
    rank: int
    exit_code: int | None = None
    """The rank's own exit code where the launcher says it (negative: killed by that signal)."""


def first_failure(lines: Iterable[str], patterns: Iterable[re.Pattern[str]]) -> Failure | None:
    """The rank the launcher's output names as failed first, and its exit code (torchrun lists the
    other failures before its "Root Cause" section). A pattern's group 1 is the rank; a group named
    `code`, if any, the exit code; one named `signal`, the signal that killed the rank."""
    lines, patterns = list(lines), list(patterns)
    root = next((i for i, line in enumerate(lines) if ROOT_CAUSE in line), 0)
    for index in range(root, len(lines)):
        for pattern in patterns:
            if match := pattern.search(lines[index]):
                groups = match.groupdict()
                code = groups.get("code") or (f"-{groups['signal']}" if groups.get("signal") else None)
                following = (EXIT_CODE_LINE.search(line) for line in lines[index + 1 : index + 4])
                code = code or next((found.group(1) for found in following if found), None)
                return Failure(int(match.group(1)), int(code) if code is not None else None)
    return None
