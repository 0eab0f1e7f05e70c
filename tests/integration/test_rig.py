"""The multi-host rig itself: separate hosts (names, disks, processes) one ssh away, a network between
them that a test can cut, and leftovers of a crashed rig removed by the next one."""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.support.rig import LINK_PREFIX, PREFIX, clean_stale_rigs

FETCH = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())"


def test_each_host_has_its_own_hostname(rig):
    names = [rig.ssh(host.index, "hostname", timeout=20, check=True).stdout.strip() for host in rig.hosts]
    assert names == [host.hostname for host in rig.hosts]
    assert socket.gethostname() not in names


def test_the_disk_is_private_to_each_host(rig):
    remote = rig.disk / "landed-on-host-1"
    rig.ssh(1, f"echo hello > {shlex.quote(str(remote))}", timeout=20, check=True)
    assert (rig.private_disk(1) / remote.name).read_text() == "hello\n"
    assert not remote.exists()  # the launching host's own rig.disk
    assert not (rig.private_disk(2) / remote.name).exists()
    (rig.disk / "launching-host-only").write_text("here")
    seen = rig.ssh(1, f"ls -A {shlex.quote(str(rig.disk))}", timeout=20, check=True).stdout.split()
    assert "landed-on-host-1" in seen and "launching-host-only" not in seen
    rig.ssh(1, f"rm {shlex.quote(str(remote))}", timeout=20, check=True)


def test_hosts_run_the_shared_venv(rig):
    for host in rig.hosts:
        done = rig.ssh(
            host.index, f'{shlex.quote(sys.executable)} -c "import horovod, hvdtrain"', timeout=120
        )
        assert done.returncode == 0, done.stderr
    assert Path(sys.executable).parent.parent == Path(__file__).parents[2] / ".venv"


def test_hosts_reach_each_other_and_the_launching_host_reaches_both(rig):
    (rig.private_disk(2) / "index.txt").write_text("served by host 2")
    serve = [sys.executable, "-m", "http.server", "--bind", rig.host(2).address, "--directory", str(rig.disk)]
    server = subprocess.Popen(
        rig.host_argv(2, [*serve, "8000"]), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        assert rig.listening(2, 8000), "http.server on host 2 never listened"
        url = f"http://{rig.host(2).address}:8000/index.txt"
        from_host_1 = rig.ssh(1, shlex.join([sys.executable, "-c", FETCH, url]), timeout=60)
        assert from_host_1.stdout.strip() == "served by host 2", from_host_1.stderr
        from_root = subprocess.run(
            [sys.executable, "-c", FETCH, url], capture_output=True, text=True, timeout=60
        )
        assert from_root.stdout.strip() == "served by host 2", from_root.stderr
        assert rig.listening(1, rig.ssh_port, timeout=2)  # the launching host reaches host 1 too
    finally:
        server.kill()
        server.wait()
        (rig.private_disk(2) / "index.txt").unlink()


def test_a_pulled_cable_cuts_the_host_off_until_plugged_back(rig):
    rig.link_down(1)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            rig.ssh(1, "true", timeout=3)
        assert not rig.listening(1, rig.ssh_port, timeout=1)
        assert rig.ssh(2, "true", timeout=20).returncode == 0  # the other host is unaffected
    finally:
        rig.link_up(1)
    assert rig.ssh(1, "true", timeout=20).returncode == 0
    assert rig.leftover_processes() == {}


def test_processes_on_a_host_are_listed_and_killed(rig):
    rig.ssh(1, "nohup sleep 321 >/dev/null 2>&1 &", timeout=20, check=True)
    deadline = time.monotonic() + 10  # the ssh session's own processes end a moment after the client
    while (running := [cmdline for _, cmdline in rig.processes(1)]) != [
        "sleep 321"
    ] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running == ["sleep 321"]
    assert rig.processes(2) == []
    killed = rig.kill_host_processes(1, r"^sleep 321$")
    assert [cmdline for _, cmdline in killed] == ["sleep 321"]
    assert rig.leftover_processes() == {}


def test_leftovers_of_a_dead_rig_are_removed():
    """What a crashed rig leaves: a namespace with a process in it, a root-namespace link, a directory."""
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid names the leftovers: a process that is no more
    netns, link = f"{PREFIX}-{dead.pid}-1", f"{LINK_PREFIX}{dead.pid}h1"
    leftover_dir = Path(tempfile.gettempdir()) / f"{PREFIX}-{dead.pid}-crashed"
    subprocess.run(["ip", "netns", "add", netns], check=True)
    stray = subprocess.Popen(["ip", "netns", "exec", netns, "sleep", "300"], start_new_session=True)
    try:
        subprocess.run(["ip", "link", "add", link, "type", "veth", "peer", "name", f"{link}p"], check=True)
        leftover_dir.mkdir()
        (leftover_dir / "disk").mkdir()
        deadline = time.monotonic() + 10
        while str(stray.pid) not in ip("netns", "pids", netns).split() and time.monotonic() < deadline:
            time.sleep(0.05)

        removed = clean_stale_rigs()

        assert f"netns {netns}" in removed and f"link {link}" in removed and f"dir {leftover_dir}" in removed
        assert stray.wait(timeout=5) == -9
        assert netns not in ip("netns", "list").split()
        assert not os.path.exists(f"/sys/class/net/{link}") and not leftover_dir.exists()
    finally:
        stray.kill()
        stray.wait()
        subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        subprocess.run(["ip", "link", "del", link], capture_output=True)


def ip(*args: str) -> str:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=True).stdout
