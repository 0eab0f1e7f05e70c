"""hvdtrain's heartbeat listener against processes that beat as an elastic rank does (the rank's own
watchdog, started from the environment a rank gets): a rank stopped with SIGSTOP is named once, and
heard again after SIGCONT; a rank that ends on purpose is not named, nor one silent while no other
rank is heard."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time

from hvdtrain.launching import heartbeats
from hvdtrain.launching.spec import LaunchCommand
from hvdtrain.runtime.watchdog import HEARTBEAT_ENV

RANK = """
import sys, time
from hvdtrain.runtime import watchdog
watchdog.start_from_env()
time.sleep(1.5)  # the watchdog's first heartbeat goes after one interval
print("beating", flush=True)
sys.stdin.readline()  # a line: return, so the last heartbeat says the rank ended
"""
SILENCE_S = 3


def start_rank(rank: int, heartbeat: str) -> subprocess.Popen:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("HVDTRAIN_", "HOROVOD_"))}
    env |= {"HOROVOD_RANK": str(rank), "HOROVOD_SIZE": "2", HEARTBEAT_ENV: heartbeat}
    process = subprocess.Popen(
        [sys.executable, "-c", RANK], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None and process.stdout.readline() == "beating\n"
    return process


def wait_for(lines: list[str], pattern: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [line for line in lines if re.search(pattern, line)]
        if found:
            return found[0]
        time.sleep(0.1)
    raise AssertionError(f"no line matches {pattern!r} in {timeout} s: {lines}")


def test_a_stopped_rank_is_named_once_and_a_rank_that_ended_is_not():
    lines: list[str] = []
    command = LaunchCommand(["true"], {HEARTBEAT_ENV: str(SILENCE_S)})
    ranks = []
    with heartbeats.listening(command, (), lines.append) as listened:
        value = listened.env[HEARTBEAT_ENV]
        assert re.fullmatch(rf"{SILENCE_S}@127\.0\.0\.1:\d+", value), "one host: loopback only"
        host, port = value.partition("@")[2].split(":")
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as stranger:  # the listener hears on
            for junk in (b"[1]", b"{}", b'{"rank": 1, "pid": 1e400}'):
                stranger.sendto(junk, (host, int(port)))
        try:
            ranks = [start_rank(0, value), start_rank(1, value)]
            stopped = ranks[1].pid
            os.kill(stopped, signal.SIGSTOP)
            named = wait_for(lines, "no heartbeat", SILENCE_S + 5)
            assert re.fullmatch(
                rf"hvdtrain: no heartbeat for [34] s from rank 1 on host 127\.0\.0\.1 \(pid {stopped}\): "
                "the process is stopped, hung or killed",
                named,
            ), named
            time.sleep(SILENCE_S)
            assert len(lines) == 1, f"named once: {lines}"
            os.kill(stopped, signal.SIGCONT)
            again = wait_for(lines, "heard again", 5)
            assert re.fullmatch(
                rf"hvdtrain: rank 1 on host 127\.0\.0\.1 \(pid {stopped}\) is heard again after \d+ s", again
            )
            ranks[1].communicate("\n", timeout=10)  # ends on purpose: its last heartbeat says so
            assert ranks[1].returncode == 0
            time.sleep(SILENCE_S + 1.5)
            assert len(lines) == 2, f"a rank that ended is not named: {lines}"
            ranks[0].kill()  # silent with no other rank heard: nothing to tell it from
            ranks[0].wait()
            time.sleep(SILENCE_S + 1.5)
            assert len(lines) == 2, f"no rank is named while none is heard: {lines}"
        finally:
            for rank in ranks:
                rank.kill()  # a stopped process too
                rank.wait()


def test_the_ranks_send_to_the_address_that_reaches_this_host():
    assert heartbeats.listen_address(()) == "127.0.0.1"
    assert heartbeats.listen_address(("127.0.0.2",)) == "127.0.0.1"
    assert heartbeats.listen_address(("no-such-host.invalid",)) is None
    command = LaunchCommand(["true"], {"OTHER": "1"})
    with heartbeats.listening(command, (), print) as listened:
        assert listened == command, "no heartbeats asked for: nothing listens"
    assert heartbeats.why_silent("127.0.0.1") == "the process is stopped, hung or killed"
    for junk in (b"[1]", b'"x"', b"{}", b'{"rank": 1, "pid": 1e400}', b"\xff", b'{"rank": "0", "pid": 2}'):
        assert heartbeats.parse(junk) is None, junk
    assert heartbeats.parse(b'{"rank": 1, "pid": 7, "ended": true}') == (1, 7, True)
