"""Hears the ranks' heartbeats (hvdtrain.runtime.watchdog) while an elastic job runs, and names a rank
that falls silent. Under elastic training a stopped rank, or one whose host's link is down, makes
every rank's collective time out alike, and Gloo's timeouts name nobody; the silent rank's heartbeat
does. A rank that ends on purpose says so in its last heartbeat, and a rank is named only while
another is heard (every rank silent at once is a job suspended whole, or this host cut off)."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from hvdtrain.launching.spec import LaunchCommand, source_address
from hvdtrain.runtime.watchdog import HEARTBEAT_ENV, stopped_for

PROBE_PORT = 22
"""Where a silent rank's host is asked whether it answers: the ssh the launcher reached it by."""
PROBE_S = 1.5
LOOPBACK = "127.0.0.1"
RECEIVE_S = 0.5
"""The longest wait for a heartbeat before the silences are checked again."""


@dataclass
class Rank:
    rank: int
    heard: float
    """time.monotonic() of its last heartbeat."""
    ended: bool = False
    named: bool = False


def listen_address(remote_hosts: tuple[str, ...]) -> str | None:
    """The address the ranks reach this host at: loopback where every rank runs here, else the one the
    first other host reaches it at (None: that host does not resolve)."""
    return source_address(remote_hosts[0].rpartition("@")[2]) if remote_hosts else LOOPBACK


def why_silent(address: str, port: int = PROBE_PORT) -> str:
    """What a silent rank's host says: answering (a refused port too) leaves its process stopped,
    hung or killed without a word; no answer is the host cut off (or down)."""
    if ipaddress.ip_address(address).is_loopback:
        return "the process is stopped, hung or killed"
    try:
        with socket.create_connection((address, port), timeout=PROBE_S):
            pass
    except ConnectionRefusedError:
        pass
    except OSError as error:
        return f"its host does not answer (port {port}: {error.strerror or 'timed out'})"
    return "its host answers, so the process is stopped, hung or killed"


def parse(data: bytes) -> tuple[int, int, bool] | None:
    """(rank, pid, ended) of a heartbeat; None for anything else that reached the port."""
    try:
        beat = json.loads(data)
        rank, pid, ended = beat["rank"], beat["pid"], beat.get("ended", False)
    except (ValueError, TypeError, KeyError):
        return None
    if not (isinstance(rank, int) and isinstance(pid, int) and isinstance(ended, bool)):
        return None
    return rank, pid, ended


class Listener(threading.Thread):
    def __init__(self, address: str, silence_s: float, say: Callable[[str], None], port: int = PROBE_PORT):
        super().__init__(name="hvdtrain-heartbeats", daemon=True)
        self.silence_s, self._say, self.port = silence_s, say, port
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            self.socket.bind((address, 0))
        except OSError:
            self.socket.close()
            raise
        self.socket.settimeout(RECEIVE_S)
        self.ranks: dict[tuple[str, int], Rank] = {}
        self.stopped = threading.Event()

    @property
    def address(self) -> str:
        host, port = self.socket.getsockname()
        return f"{host}:{port}"

    def say(self, line: str) -> None:
        with contextlib.suppress(Exception):  # a closed stdout must not end the listening
            self._say(line)

    def run(self) -> None:
        last = time.monotonic()
        while not self.stopped.is_set():
            with contextlib.suppress(OSError):  # a timeout included
                data, (host, _) = self.socket.recvfrom(512)
                if (beat := parse(data)) is not None:
                    self.heard(host, *beat, time.monotonic())
            now = time.monotonic()
            if stopped_for(last, now, RECEIVE_S):  # this process was stopped: nobody was heard meanwhile
                for rank in self.ranks.values():
                    rank.heard = max(rank.heard, now)
            self.check(now)
            last = time.monotonic()  # after the probes, which take their time

    def heard(self, host: str, rank: int, pid: int, ended: bool, now: float) -> None:
        known = self.ranks.get((host, pid))
        if known is not None and known.ended:
            return  # a beat the watchdog sent after its last one: the rank has ended
        if known is not None and known.named and not ended:
            self.say(
                f"hvdtrain: rank {known.rank} on host {host} (pid {pid}) is heard again "
                f"after {now - known.heard:.0f} s"
            )
        self.ranks[(host, pid)] = Rank(rank, now, ended)

    def check(self, now: float) -> None:
        """Name each rank silent for silence_s, once, while another rank is heard."""
        alive = [rank for rank in self.ranks.values() if not rank.ended]
        if not any(now - rank.heard < self.silence_s for rank in alive):
            return
        answers: dict[str, str] = {}  # one probe a host
        for (host, pid), rank in self.ranks.items():
            if not rank.ended and not rank.named and now - rank.heard >= self.silence_s:
                rank.named = True
                if host not in answers:
                    answers[host] = why_silent(host, self.port)
                self.say(
                    f"hvdtrain: no heartbeat for {now - rank.heard:.0f} s from rank {rank.rank} on host "
                    f"{host} (pid {pid}): {answers[host]}"
                )

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=5)
        self.socket.close()


@contextlib.contextmanager
def listening(
    command: LaunchCommand, remote_hosts: tuple[str, ...], say: Callable[[str], None], port: int | None = None
) -> Iterator[LaunchCommand]:
    """The command with the address its ranks send heartbeats to, where it asks for them (its
    HEARTBEAT_ENV is the silence to name, in seconds), heard until the block ends. `port`: the other
    hosts' ssh port. Where no address serves (a host that does not resolve, no port free), the job
    runs without."""
    silence = command.env.get(HEARTBEAT_ENV)
    address = listen_address(remote_hosts) if silence and "@" not in silence else None
    try:
        listener = Listener(address, float(silence), say, port or PROBE_PORT) if address and silence else None
    except (OSError, ValueError):
        listener = None
    if listener is None:
        yield command
        return
    listener.start()
    try:
        yield replace(command, env={**command.env, HEARTBEAT_ENV: f"{silence}@{listener.address}"})
    finally:
        listener.stop()
