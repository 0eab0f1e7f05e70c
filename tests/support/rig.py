"""A multi-host test rig on one machine: N "hosts" as Linux network namespaces behind a bridge.

The root network namespace is the launching host: a bridge (`hvd0` unless named) with the subnet's
first address (10.77.0.1/24). Host i (1..N) is the network namespace `hvdrig-<pid>-<i>` whose veth end,
named like the bridge, has the address .(i+1), so `--network-interface hvd0` finds that NIC name
everywhere. Each link can be given a rate (a token bucket on both of its ends), so the network, not the
cores, bounds what crosses it. Each host
runs its own sshd inside `unshare --uts --mount` with:

- its own hostname (`hvdhost<i>`), and an /etc/hosts that names every rig host;
- an empty /etc/resolv.conf: the hosts have no route to a name server, and a lookup that waits for one
  (a reverse lookup of the host's own address, say) would stall for its full timeout;
- its own "local disk": `BASE/host-<i>-disk` bind-mounted over `BASE/disk`, so the same path is the
  launching host's own directory in the root namespace and a private directory on each host.

Everything is named after the owning process id, so a crashed run's leftovers never collide with a new
rig, and the next rig removes them (their owner is dead) before it starts. One rig a process; rigs of
several processes (pytest's workers) live side by side on their own bridges and subnets. Needs root,
iproute2, util-linux and openssh-server. The rig never touches /etc/ssh, and of ~/.ssh only drops a
known_hosts entry of one of its own addresses that holds another key than its host's.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import ipaddress
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

BRIDGE = "hvd0"
"""The launching host's NIC on the rig network, and the name of every host's own NIC, unless named."""
BRIDGE_NAME = re.compile(r"hvd\d+")
PREFIX = "hvdrig"
"""Namespaces `hvdrig-<pid>-<i>`, temporary directories `hvdrig-<pid>-*`, the bridge's alias
`hvdrig-<pid>`."""
LINK_PREFIX = "hvr"
"""Root-namespace links `hvr<pid>h<i>` (a host's veth peer) and `hvr<pid>b` (the bridge before its rename):
link names are at most 15 characters."""
DEFAULT_SUBNET = "10.77.0.0/24"
SSH_PORT = 22
READY_TIMEOUT_S = 10.0
"""How long each sshd has to accept an ssh connection."""
SSHD_DIRS = ("/run/sshd",)
"""sshd's privilege separation directory: it refuses to start without it."""
REQUIRED = ("ip", "unshare", "nsenter", "mount", "sh", "sshd", "ssh", "ssh-keygen")

NETNS_NAME = re.compile(rf"{PREFIX}-(\d+)-(\d+)")
LINK_NAME = re.compile(rf"{LINK_PREFIX}(\d+)(?:h\d+|b)")
BASE_NAME = re.compile(rf"{PREFIX}-(\d+)-.+")
BRIDGE_ALIAS = re.compile(rf"{PREFIX}-(\d+)")

HOST_SCRIPT = """set -e
echo "$1" > /proc/sys/kernel/hostname
mount --bind "$2" "$3"
mount --bind "$4" /etc/hosts
mount --bind "$5" /etc/resolv.conf
exec "$6" -D -e -f "$7"
"""
"""Runs in the host's fresh UTS and mount namespaces, then becomes its sshd (same pid all the way down:
`ip netns exec`, `unshare` and `sh` each exec the next)."""

SSHD_CONFIG = """\
Port {port}
ListenAddress {address}
HostKey {host_key}
PidFile {pid_file}
AuthorizedKeysFile {authorized_keys}
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
UseDNS no
X11Forwarding no
PrintMotd no
PrintLastLog no
MaxStartups 100
MaxSessions 100
"""


class RigError(RuntimeError):
    """The rig could not be made, or could not be taken down completely."""


@dataclass(frozen=True)
class RigHost:
    index: int
    """1..N: what every Rig method takes as `host`."""
    hostname: str
    address: str
    netns: str
    veth: str
    """The root-namespace end of the host's cable, attached to the bridge."""
    dir: Path
    """The host's sshd config, host key, pid file and log."""
    disk: Path
    """The host's private copy of `Rig.disk`, as seen from the root namespace."""


def _host_key(keygen: str, index: int) -> Path:
    """Host i's key, made once and kept: every rig's host i is the same host to ssh, so known_hosts
    entries stay valid and launchers that refuse changed host keys (accept-new) keep working. Made
    under a lock: pytest's workers start their rigs at once, and two keys made side by side would
    leave one worker's host i with a key the others' next rigs no longer serve."""
    keys = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hvdtrain" / "rig-host-keys"
    keys.mkdir(parents=True, exist_ok=True)
    key = keys / f"ssh_host_ed25519_key_{index}"
    with (keys / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not key.exists():
            staged = key.with_name(f"{key.name}.{os.getpid()}")
            staged.unlink(missing_ok=True)
            _run(
                [keygen, "-q", "-t", "ed25519", "-N", "", "-C", f"hvdhost{index}", "-f", str(staged)],
                "ssh-keygen",
            )
            staged.rename(key)
            staged.with_name(f"{staged.name}.pub").unlink(missing_ok=True)
    return key


def _forget_other_keys(keygen: str, key: Path, address: str, port: int) -> None:
    """Drops known_hosts' entry for this address where it holds another key than the host's (one a
    rig made before its keys were kept, or made in a race): launchers ssh with accept-new, which
    refuses a changed key, and an address of the rig's is the rig's host whatever entry it had."""
    known = Path.home() / ".ssh" / "known_hosts"
    if not known.is_file():
        return
    public = _run([keygen, "-y", "-f", str(key)], "reading a host key").stdout.split()[1]
    name = address if port == 22 else f"[{address}]:{port}"
    found = _run([keygen, "-F", name, "-f", str(known)], "looking in known_hosts", check=False).stdout
    listed = [line.split()[2] for line in found.splitlines() if line and not line.startswith("#")]
    if any(other != public for other in listed):
        _run([keygen, "-R", name, "-f", str(known)], "dropping a stale known_hosts entry")


def _sbin_path() -> str:
    return os.pathsep.join([os.environ.get("PATH", ""), "/usr/local/sbin", "/usr/sbin", "/sbin"])


def _env() -> dict[str, str]:
    """Setup and teardown commands find ip, mount and sshd even where PATH lacks the sbin directories."""
    return {**os.environ, "PATH": _sbin_path()}


def _which(program: str) -> str:
    found = shutil.which(program, path=_sbin_path())
    if found is None:
        raise RigError(f"cannot make the multi-host test rig: `{program}` is not on PATH (nor in sbin)")
    return found


def _run(
    argv: Sequence[str], what: str, check: bool = True, timeout: float = 30
) -> subprocess.CompletedProcess:
    """Runs a setup or teardown command; with check, a failure is a RigError naming `what`."""
    try:
        done = subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            stdin=subprocess.DEVNULL,
            env=_env(),
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise RigError(f"cannot make the multi-host test rig: {what}: {shlex.join(argv)}: {error}") from None
    if check and done.returncode != 0:
        detail = (done.stderr or done.stdout).strip() or f"exit code {done.returncode}"
        raise RigError(f"cannot make the multi-host test rig: {what}: {shlex.join(argv)}: {detail}")
    return done


def _owner_alive(pid: int) -> bool:
    """Whether the process that made a leftover still runs; this process counts only while its rig is up."""
    if pid == os.getpid():
        return Rig.active is not None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        pass
    return True


def _cmdline(pid: int) -> str | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def _netns_list() -> list[str]:
    done = _run(["ip", "netns", "list"], "listing network namespaces", check=False)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def _netns_pids(netns: str) -> list[int]:
    """The processes in a network namespace (none when it is gone)."""
    done = _run(["ip", "netns", "pids", netns], f"listing the processes of {netns}", check=False)
    return [int(word) for word in done.stdout.split() if word.isdigit()]


def _link_exists(name: str) -> bool:
    return Path("/sys/class/net", name).exists()


def _link_alias(name: str) -> str:
    with contextlib.suppress(OSError):
        return Path("/sys/class/net", name, "ifalias").read_text().strip()
    return ""


def _wait_gone(pids: Sequence[int], timeout: float) -> list[int]:
    """Waits until none of pids runs (zombies count as gone); returns those still running."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [pid for pid in pids if _running(pid)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.02)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _kill_all(pids: Sequence[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _empty_netns(netns: str, spare: Sequence[int] = (), timeout: float = 5) -> list[int]:
    """Kills everything in a network namespace but spare, again until nothing new shows up; returns
    survivors."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = [pid for pid in _netns_pids(netns) if pid not in spare]
        if not pids:
            return []
        _kill_all(pids)
        _wait_gone(pids, max(0.0, deadline - time.monotonic()))
    return [pid for pid in _netns_pids(netns) if pid not in spare]


def _children(pid: int) -> list[int]:
    try:
        return [int(word) for word in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []


def _wait_reaped(parent: int, timeout: float) -> None:
    """Gives a live parent time to reap its children (its ssh sessions, just killed), so that none
    outlives it as a zombie for init to collect."""
    deadline = time.monotonic() + timeout
    while _children(parent) and time.monotonic() < deadline:
        time.sleep(0.01)


def _delete_link(name: str, timeout: float = 3) -> bool:
    """Deletes a root-namespace link (if there) and waits until it is gone."""
    deadline = time.monotonic() + timeout
    while _link_exists(name):
        _run(["ip", "link", "del", name], f"deleting link {name}", check=False)
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def clean_stale_rigs() -> list[str]:
    """Removes what rigs whose owning process is dead left behind: the processes in their namespaces,
    the namespaces, links, the bridge and temporary directories. Returns what it removed."""
    removed: list[str] = []
    for netns in _netns_list():
        match = NETNS_NAME.fullmatch(netns)
        if match and not _owner_alive(int(match[1])):
            _empty_netns(netns)
            _run(["ip", "netns", "del", netns], f"deleting stale namespace {netns}", check=False)
            removed.append(f"netns {netns}")
    for link in sorted(os.listdir("/sys/class/net")):
        match = LINK_NAME.fullmatch(link)
        if match and not _owner_alive(int(match[1])):
            # a veth whose namespace just went disappears by itself; a half-made one is deleted here
            _delete_link(link)
            removed.append(f"link {link}")
    for bridge in sorted(os.listdir("/sys/class/net")):
        if not BRIDGE_NAME.fullmatch(bridge):
            continue
        match = BRIDGE_ALIAS.fullmatch(_link_alias(bridge))
        if match and not _owner_alive(int(match[1])):
            _delete_link(bridge)
            removed.append(f"bridge {bridge}")
    tmp = Path(tempfile.gettempdir())
    for base in sorted(tmp.glob(f"{PREFIX}-*")):
        match = BASE_NAME.fullmatch(base.name)
        if match and base.is_dir() and not base.is_symlink() and not _owner_alive(int(match[1])):
            shutil.rmtree(base, ignore_errors=True)
            removed.append(f"dir {base}")
    return removed


class Rig:
    """N hosts with sshd on one machine. Use as a context manager, or start() and close().

    Hosts are numbered 1..N; every method that takes `host` takes that number.
    """

    active: Rig | None = None
    """The rig this process has up, if any (one a process: its links are named after the process)."""

    def __init__(
        self,
        hosts: int = 2,
        subnet: str = DEFAULT_SUBNET,
        hostname_prefix: str = "hvdhost",
        bridge: str = BRIDGE,
        rate_mbit: float | None = None,
    ) -> None:
        if not BRIDGE_NAME.fullmatch(bridge):
            raise ValueError(f"a rig's bridge is named hvd<N>, not {bridge!r}")
        network = ipaddress.ip_network(subnet)
        if not 1 <= hosts <= min(network.num_addresses - 3, 250):
            raise ValueError(f"a rig on {subnet} has 1 to {min(network.num_addresses - 3, 250)} hosts")
        self.subnet = network
        self.owner = os.getpid()
        addresses = [str(address) for address in network.hosts()]
        self.address = addresses[0]
        """The launching host's address, on the bridge."""
        self.bridge = bridge
        self.rate_mbit = rate_mbit
        """Every link's rate each way in Mbit/s (None: as fast as the machine), set by limit_links()."""
        self.ssh_port = SSH_PORT
        self.base = Path()
        """The rig's temporary directory; empty until start()."""
        self._hosts_wanted = hosts
        self._hostname_prefix = hostname_prefix
        self._addresses = addresses[1 : hosts + 1]
        self.hosts: tuple[RigHost, ...] = ()
        self._sshd: dict[int, subprocess.Popen] = {}
        self._made_bridge = False
        self._closed = False

    # -- the layout

    @property
    def disk(self) -> Path:
        """The same path everywhere: the launching host's own directory here, a private one on each host."""
        return self.base / "disk"

    @property
    def identity_file(self) -> Path:
        """The private key every host's sshd accepts (root's)."""
        return self.base / "id_ed25519"

    @property
    def addresses(self) -> list[str]:
        """Each host's address, host 1 first."""
        return [host.address for host in self.hosts]

    def host(self, host: int) -> RigHost:
        """Host number host (1..N): its hostname, address, namespace, veth and directories."""
        if not 1 <= host <= len(self.hosts):
            raise ValueError(f"no host {host}: the rig has hosts 1..{len(self.hosts)}")
        return self.hosts[host - 1]

    def private_disk(self, host: int) -> Path:
        """Where host's `disk` really is, seen from the root namespace."""
        return self.host(host).disk

    def sshd_log(self, host: int) -> str:
        """What host's sshd wrote (-e: its log goes to stderr)."""
        with contextlib.suppress(OSError):
            return (self.host(host).dir / "sshd.log").read_text(errors="replace")
        return ""

    # -- up and down

    def __enter__(self) -> Rig:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def start(self) -> Rig:
        """Makes the network, the hosts and their sshds, and waits until each accepts ssh; on failure,
        takes down what it made and raises RigError."""
        if os.geteuid() != 0:
            raise RigError("cannot make the multi-host test rig: it needs root (network namespaces, mounts)")
        programs = {program: _which(program) for program in REQUIRED}
        if self._closed or self.hosts:
            raise RigError("a Rig starts once: make a new one")
        if Rig.active is not None:
            raise RigError("cannot make the multi-host test rig: this process already has one up")
        clean_stale_rigs()
        self._check_free()
        Rig.active = self
        atexit.register(self.close)
        try:
            self._make_files(programs)
            self._make_network()
            for host in self.hosts:
                self._start_sshd(host, programs["sshd"])
            self._wait_ready()
        except BaseException as error:
            try:
                self.close()
            except RigError as teardown:
                error.add_note(str(teardown))
            raise
        return self

    def _check_free(self) -> None:
        if _link_exists(self.bridge):
            alias = _link_alias(self.bridge)
            match = BRIDGE_ALIAS.fullmatch(alias)
            owner = (
                f"the rig of running process {match[1]} ({_cmdline(int(match[1]))})" if match else "not a rig"
            )
            raise RigError(
                f"cannot make the multi-host test rig: a network interface {self.bridge} already exists "
                f"(alias {alias!r}: {owner}); remove it with `ip link del {self.bridge}` if it is a leftover"
            )
        done = _run(["ip", "-4", "-o", "addr", "show"], "listing addresses")
        for line in done.stdout.splitlines():
            words = line.split()
            if "inet" in words:
                interface = ipaddress.ip_interface(words[words.index("inet") + 1])
                if interface.network.overlaps(self.subnet):
                    raise RigError(
                        f"cannot make the multi-host test rig: {self.subnet} is in use ({words[1]} has "
                        f"{interface}); pick another subnet"
                    )
        done = _run(["ip", "-4", "route", "show", "table", "all"], "listing routes")
        for line in done.stdout.splitlines():
            destination = line.split()[0] if line.split() else "default"
            with contextlib.suppress(ValueError):
                network = ipaddress.ip_network(destination, strict=False)
                if network.prefixlen > 0 and network.overlaps(self.subnet) and not network.is_loopback:
                    raise RigError(
                        f"cannot make the multi-host test rig: {self.subnet} overlaps the route "
                        f"{line.strip()!r}; pick another subnet"
                    )

    def _make_files(self, programs: dict[str, str]) -> None:
        self.base = Path(tempfile.mkdtemp(prefix=f"{PREFIX}-{self.owner}-"))
        self.disk.mkdir()
        for directory in SSHD_DIRS:
            os.makedirs(directory, mode=0o755, exist_ok=True)
        keygen = programs["ssh-keygen"]
        _run(
            [keygen, "-q", "-t", "ed25519", "-N", "", "-C", PREFIX, "-f", str(self.identity_file)],
            "ssh-keygen",
        )
        authorized_keys = self.base / "authorized_keys"
        shutil.copyfile(self.identity_file.with_suffix(".pub"), authorized_keys)
        names = [f"{self._hostname_prefix}{i}" for i in range(1, self._hosts_wanted + 1)]
        etc_hosts = Path("/etc/hosts").read_text() if Path("/etc/hosts").exists() else ""
        rig_names = "".join(
            f"{address} {name}\n" for address, name in zip(self._addresses, names, strict=True)
        )
        hosts = []
        for i, (name, address) in enumerate(zip(names, self._addresses, strict=True), start=1):
            host = RigHost(
                index=i,
                hostname=name,
                address=address,
                netns=f"{PREFIX}-{self.owner}-{i}",
                veth=f"{LINK_PREFIX}{self.owner}h{i}",
                dir=self.base / f"host-{i}",
                disk=self.base / f"host-{i}-disk",
            )
            host.dir.mkdir()
            host.disk.mkdir()
            (host.dir / "hosts").write_text(f"{etc_hosts.rstrip()}\n# {PREFIX}\n{rig_names}")
            (host.dir / "resolv.conf").write_text(f"# {PREFIX}: no name server on the rig network\n")
            key = host.dir / "ssh_host_ed25519_key"
            kept = _host_key(keygen, i)
            _forget_other_keys(keygen, kept, address, self.ssh_port)
            shutil.copyfile(kept, key)
            key.chmod(0o600)
            config = SSHD_CONFIG.format(
                port=self.ssh_port,
                address=address,
                host_key=key,
                pid_file=host.dir / "sshd.pid",
                authorized_keys=authorized_keys,
            )
            (host.dir / "sshd_config").write_text(config)
            _run([programs["sshd"], "-t", "-f", str(host.dir / "sshd_config")], "checking the sshd config")
            hosts.append(host)
        self.hosts = tuple(hosts)

    def _make_network(self) -> None:
        staging = f"{LINK_PREFIX}{self.owner}b"  # named after us until it carries our alias
        self._made_bridge = True
        _run(["ip", "link", "add", staging, "type", "bridge"], "creating the bridge")
        _run(["ip", "link", "set", staging, "alias", f"{PREFIX}-{self.owner}"], "labelling the bridge")
        _run(["ip", "link", "set", staging, "name", self.bridge], f"naming the bridge {self.bridge}")
        prefix = self.subnet.prefixlen
        _run(["ip", "addr", "add", f"{self.address}/{prefix}", "dev", self.bridge], "addressing the bridge")
        _run(["ip", "link", "set", self.bridge, "up"], "bringing the bridge up")
        for host in self.hosts:
            netns = ["ip", "-n", host.netns]
            _run(["ip", "netns", "add", host.netns], f"creating namespace {host.netns}")
            _run(
                ["ip", "link", "add", host.veth, "type", "veth", "peer", "name", self.bridge]
                + ["netns", host.netns],
                f"creating host {host.index}'s veth pair",
            )
            _run(
                ["ip", "link", "set", host.veth, "master", self.bridge, "up"],
                f"attaching {host.veth} to the bridge",
            )
            _run([*netns, "addr", "add", f"{host.address}/{prefix}", "dev", self.bridge], "addressing a host")
            _run([*netns, "link", "set", self.bridge, "up"], f"bringing host {host.index}'s {self.bridge} up")
            _run([*netns, "link", "set", "lo", "up"], f"bringing host {host.index}'s lo up")
            _run([*netns, "route", "add", "default", "via", self.address], f"routing host {host.index}")
        if self.rate_mbit is not None:
            self.limit_links(self.rate_mbit)

    def limit_links(self, rate_mbit: float | None) -> None:
        """Every host's link at rate_mbit each way (None: unlimited), as a token bucket on the bridge's
        end (what reaches the host) and on the host's own NIC (what leaves it), so a rank's traffic
        crosses one limited link out and one in, as on a switch with one cable per host. netem (latency)
        is not in every kernel; the rate alone is what bounds a step here."""
        if rate_mbit is not None and rate_mbit <= 0:
            raise ValueError(f"a link's rate is positive, not {rate_mbit}")
        for host in self.hosts:
            for prefix, device in ((["tc"], host.veth), (["tc", "-n", host.netns], self.bridge)):
                _run([*prefix, "qdisc", "del", "dev", device, "root"], "clearing a link's rate", check=False)
                if rate_mbit is None:
                    continue
                # the bucket holds 10 ms at the rate (at least 64 KiB): a smaller one caps the rate
                # below what was asked at the kernel's timer granularity
                burst = max(int(rate_mbit * 1e6 / 8 / 100), 65536)
                argv = [*prefix, "qdisc", "add", "dev", device, "root", "tbf", "rate", f"{rate_mbit}mbit"]
                _run([*argv, "burst", str(burst), "latency", "50ms"], f"limiting host {host.index}'s link")
        self.rate_mbit = rate_mbit

    def _start_sshd(self, host: RigHost, sshd: str) -> None:
        argv = ["ip", "netns", "exec", host.netns, "unshare", "--uts", "--mount", "--propagation", "private"]
        argv += ["sh", "-c", HOST_SCRIPT, PREFIX, host.hostname, str(host.disk), str(self.disk)]
        argv += [str(host.dir / "hosts"), str(host.dir / "resolv.conf"), sshd, str(host.dir / "sshd_config")]
        with (host.dir / "sshd.log").open("w") as log:
            self._sshd[host.index] = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=_env(),
            )

    def _wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        for host in self.hosts:
            problem = self._ssh_problem(host, deadline)
            if problem is not None:
                raise RigError(
                    f"cannot make the multi-host test rig: host {host.index}'s sshd ({host.address}:"
                    f"{self.ssh_port}) did not accept ssh within {timeout:.0f} s: {problem}\n"
                    f"sshd log:\n{self.sshd_log(host.index)[-3000:]}"
                )

    def _ssh_problem(self, host: RigHost, deadline: float) -> str | None:
        """Tries `ssh host true` until it works (None) or the deadline passes (why it did not)."""
        sshd = self._sshd[host.index]
        while True:
            if sshd.poll() is not None:
                return f"sshd exited with {sshd.returncode}"
            try:
                done = self.ssh(host.index, "true", timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return "ssh timed out"
            if done.returncode == 0:
                return None
            if time.monotonic() > deadline:
                return done.stderr.strip() or f"ssh exit code {done.returncode}"
            time.sleep(0.05)

    def close(self) -> None:
        """Kills what the rig started (the sshds and everything in the hosts' namespaces), deletes the
        namespaces, links, bridge and temporary directory. Idempotent; raises RigError if something stayed."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        problems: list[str] = []
        present = _netns_list()
        daemons = [sshd.pid for sshd in self._sshd.values()]
        for host in self.hosts:  # sessions first: their sshd reaps them
            if host.netns in present:
                _empty_netns(host.netns, spare=daemons)
        for sshd in self._sshd.values():
            if sshd.poll() is None:
                _wait_reaped(sshd.pid, timeout=1)
            sshd.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                sshd.wait(timeout=5)
        for host in self.hosts:
            survivors = _empty_netns(host.netns) if host.netns in present else []
            if survivors:
                problems.append(f"processes {survivors} in {host.netns} survive SIGKILL")
        for host in self.hosts:
            if host.netns in present:
                done = _run(["ip", "netns", "del", host.netns], "deleting a namespace", check=False)
                if done.returncode != 0:
                    problems.append(f"ip netns del {host.netns}: {done.stderr.strip()}")
        for host in self.hosts:  # a namespace takes its veth pair along, a moment after it goes
            if not _delete_link(host.veth):
                problems.append(f"link {host.veth} stays")
        if self._made_bridge:
            for name in (f"{LINK_PREFIX}{self.owner}b", self.bridge):
                if _link_alias(name) == f"{PREFIX}-{self.owner}" and not _delete_link(name):
                    problems.append(f"bridge {name} stays")
        if self.base != Path() and self.base.exists():
            shutil.rmtree(self.base, ignore_errors=True)
            if self.base.exists():
                problems.append(f"{self.base} stays")
        if Rig.active is self:
            Rig.active = None
        if problems:
            raise RigError("the multi-host test rig was not taken down completely: " + "; ".join(problems))

    # -- using the hosts

    def ssh_argv(self, host: int) -> list[str]:
        """ssh to host as root with the rig's key, no known_hosts; append the remote command."""
        return [
            "ssh",
            "-p",
            str(self.ssh_port),
            "-i",
            str(self.identity_file),
            "-o",
            "BatchMode=yes",
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "-o",
            "LogLevel=ERROR",
            self.host(host).address,
        ]

    def ssh(
        self, host: int, command: str, timeout: float = 60, check: bool = False, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Runs a shell command on host over ssh; raises subprocess.TimeoutExpired after timeout seconds."""
        return subprocess.run(
            [*self.ssh_argv(host), command],
            input=input,
            stdin=None if input is not None else subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=check,
        )

    def host_argv(self, host: int, argv: Sequence[str]) -> list[str]:
        """argv run directly on host (its network, hostname and disk) without ssh, as this process's child."""
        sshd = self._sshd[self.host(host).index].pid
        return ["nsenter", "-t", str(sshd), "-n", "-u", "-m", "--", *argv]

    def link_down(self, host: int) -> None:
        """Pulls host's cable: its veth peer on the bridge goes down, so no packet reaches it or leaves it."""
        _run(["ip", "link", "set", self.host(host).veth, "down"], f"taking host {host}'s link down")

    def link_up(self, host: int) -> None:
        """Plugs host's cable back in."""
        _run(["ip", "link", "set", self.host(host).veth, "up"], f"bringing host {host}'s link up")

    def stop_sshd(self, host: int) -> None:
        """Stops host's sshd as `systemctl stop ssh` does: the daemon ends, so no new ssh connection is
        accepted, while the sessions it started (and what they run) go on."""
        sshd = self._sshd[self.host(host).index]
        sshd.terminate()
        sshd.wait(timeout=10)

    def start_sshd(self, host: int, timeout: float = READY_TIMEOUT_S) -> None:
        """Starts host's sshd again after stop_sshd (same config, key, hostname and disk) and waits
        until it accepts ssh."""
        found = self.host(host)
        if self._sshd[found.index].poll() is None:
            raise RigError(f"host {host}'s sshd already runs")
        self._start_sshd(found, _which("sshd"))
        if (problem := self._ssh_problem(found, time.monotonic() + timeout)) is not None:
            raise RigError(f"host {host}'s sshd did not accept ssh again within {timeout:.0f} s: {problem}")

    def processes(self, host: int) -> list[tuple[int, str]]:
        """(pid, command line) of each process on host but its sshd daemon: ssh sessions and what they run."""
        daemon = self._sshd[self.host(host).index].pid
        found = []
        for pid in _netns_pids(self.host(host).netns):
            cmdline = _cmdline(pid)
            if pid != daemon and cmdline is not None and _running(pid):
                found.append((pid, cmdline))
        return found

    def all_processes(self) -> dict[int, list[tuple[int, str]]]:
        """processes() of every host that has any."""
        return {host.index: found for host in self.hosts if (found := self.processes(host.index))}

    def leftover_processes(self, timeout: float = 10) -> dict[int, list[tuple[int, str]]]:
        """Waits up to timeout seconds for every host to run nothing but its sshd (an ssh session ends a
        moment after its client); returns what still runs, by host: empty when all is clean."""
        deadline = time.monotonic() + timeout
        while (found := self.all_processes()) and time.monotonic() < deadline:
            time.sleep(0.1)
        return found

    def kill_host_processes(
        self, host: int, pattern: str, signum: int = signal.SIGKILL
    ) -> list[tuple[int, str]]:
        """Sends signum to host's processes whose command line matches the regular expression pattern
        (never its sshd daemon); returns those it signalled."""
        killed = []
        for pid, cmdline in self.processes(host):
            if re.search(pattern, cmdline):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)
                    killed.append((pid, cmdline))
        return killed

    def listening(self, host: int, port: int, timeout: float = 10) -> bool:
        """Whether something accepts TCP connections on host's address and port within timeout seconds."""
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError), socket.create_connection((self.host(host).address, port), 1):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)


def rig_host_args(rig: Rig, *hosts: int) -> list[str]:
    """`hvdtrain run` options that put one rank on each rig host, over its NIC and ssh."""
    return [
        "--hosts",
        ",".join(f"{rig.host(h).address}:1" for h in hosts),
        "--ssh-port",
        str(rig.ssh_port),
        "--ssh-identity-file",
        str(rig.identity_file),
        "--network-interface",
        rig.bridge,
        "--threads-per-rank",  # the rig's hosts share this machine's cores
        "1",
    ]
