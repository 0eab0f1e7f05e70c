"""A per-rank stall watchdog that works under every Horovod controller.

Horovod's own stall check (HOROVOD_STALL_CHECK_TIME_SECONDS) names the missing ranks and shuts down
under the MPI controller, but under the Gloo controller of 0.28.1 it never fires: a rank waits on a
tensor another rank never submits for as long as the job lasts. So each rank runs
this thread: it samples the main thread's stack, and while the rank waits inside a Horovod
collective it publishes that in a small status file in the run directory. A rank that has waited
longer than the timeout reads the others' files, names the ranks that are not waiting on the same
collective, and ends its process, which makes the launcher end the job.

Under elastic training a wait in a collective is no stall (the job resets), and a rank's status file
may sit on another host's disk. There the thread sends a heartbeat datagram a second to hvdtrain
(HEARTBEAT_ENV), which names a rank that falls silent: a stopped or hung process, or a host cut off.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from types import FrameType

from hvdtrain.errors import EXIT_STALL

STALL_MARKER = "hvdtrain: stall:"
_HOROVOD_DIR = f"{os.sep}horovod{os.sep}"
_NOT_COLLECTIVES = tuple(f"{_HOROVOD_DIR}{package}{os.sep}" for package in ("runner", "ray"))
"""Horovod's launchers: a rank of --launcher ray runs inside horovod.ray's actor method all along."""
SUSPENDED_GAP_S = 3.0
"""A watchdog tick this much later than due: the process was stopped, not merely slow."""
HEARTBEAT_ENV = "HVDTRAIN_HEARTBEAT"
"""Heartbeats asked for: "SILENCE_S" as planned, "SILENCE_S@ADDRESS:PORT" once hvdtrain listens."""
HEARTBEAT_MIN_SILENCE_S = 5
"""A rank beats once a second: a shorter silence is a loaded machine's, not a fault."""
STARTUP = "hvd.init"
"""hvd.init's rendezvous, named apart: every rank waiting in it together is a slow start (a loaded
machine), not a stalled rank, and the controller's own rendezvous timeout bounds it."""


def collective_in_progress(frame: FrameType | None) -> str | None:
    """If this stack is inside a Horovod collective, its tensor name (or 'unnamed'), else None."""
    name = None
    inside = False
    while frame is not None:
        filename = frame.f_code.co_filename
        if _HOROVOD_DIR in filename and not any(part in filename for part in _NOT_COLLECTIVES):
            inside = True
            candidate = frame.f_locals.get("name")
            if isinstance(candidate, str) and candidate:
                name = candidate
            elif frame.f_code.co_name == "init" and filename.endswith(f"{os.sep}common{os.sep}basics.py"):
                name = STARTUP
        frame = frame.f_back
    return (name or "unnamed") if inside else None


def stopped_for(last_tick: float, now: float, interval_s: float) -> float:
    """How long this process was stopped between two ticks of its watchdog (0.0: it was not). A job
    suspended whole (Slurm's `scontrol suspend`, gang scheduling: SIGSTOP to every rank, SIGCONT
    later) stopped every rank together, which is no stall; a single stopped rank is one, and the
    other ranks' watchdogs, which ran on, name it."""
    late = now - last_tick - interval_s
    return late if late > SUSPENDED_GAP_S else 0.0


def rank_from_env() -> tuple[int, int] | None:
    """This rank and the world's size, as its launcher gave them before Horovod starts (srun's last:
    under horovodrun or mpirun inside an allocation, the batch step's SLURM_PROCID is inherited)."""
    for rank_key, size_key in (
        ("HOROVOD_RANK", "HOROVOD_SIZE"),
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
        ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS"),
    ):
        if rank_key in os.environ and size_key in os.environ:
            return int(os.environ[rank_key]), int(os.environ[size_key])
    return None


def heartbeat_address(value: str | None) -> tuple[str, int] | None:
    """Where to send heartbeats, from HEARTBEAT_ENV's value; None while nobody listens."""
    if not value or "@" not in value:
        return None
    host, _, port = value.partition("@")[2].rpartition(":")
    return (host, int(port)) if host and port.isdigit() else None


def heartbeat(rank: int, ended: bool = False) -> bytes:
    return json.dumps({"rank": rank, "pid": os.getpid(), "ended": ended}).encode()


class StallWatchdog(threading.Thread):
    def __init__(
        self,
        status_dir: Path | None,
        rank: int,
        size: int,
        timeout_s: float | None,
        interval_s: float = 1.0,
        beat_to: tuple[str, int] | None = None,
    ):
        """`timeout_s` None: publish and beat only, never end the process (elastic training)."""
        super().__init__(name="hvdtrain-stall-watchdog", daemon=True)
        self.status_dir, self.rank, self.size = status_dir, rank, size
        self.timeout_s, self.interval_s = timeout_s, interval_s
        self.main_ident = threading.main_thread().ident
        self.beat_to = beat_to
        self._socket: socket.socket | None = None
        self._ended = False
        if status_dir is not None:
            status_dir.mkdir(parents=True, exist_ok=True)

    def beat(self, ended: bool = False) -> None:
        """One heartbeat to hvdtrain; `ended`: this rank ends on purpose, its silence is no fault."""
        if self.beat_to is None or self._ended:
            return
        self._ended = ended  # the last: no tick's beat after it says the rank is back
        with contextlib.suppress(OSError):  # a host cut off: its silence is what hvdtrain names
            if self._socket is None:
                # connected: bound to the address that reaches hvdtrain, not listening on every one
                sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                try:
                    sender.connect(self.beat_to)
                except OSError:
                    sender.close()
                    raise
                self._socket = sender
            self._socket.send(heartbeat(self.rank, ended))

    def _publish(self, waiting: str | None, since: float) -> None:
        """The heartbeat tells the others this rank's process still runs (a stopped or hung one stops
        beating even while its file says it waits in the same collective)."""
        self.beat()
        if self.status_dir is None:
            return
        path = self.status_dir / f"rank.{self.rank}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"waiting": waiting, "since": since, "heartbeat": time.time()}))
        os.replace(tmp, path)

    def _others(self) -> dict[int, dict]:
        found: dict[int, dict] = {}
        if self.status_dir is None:
            return found
        for rank in range(self.size):
            try:
                found[rank] = json.loads((self.status_dir / f"rank.{rank}.json").read_text())
            except (OSError, ValueError):
                continue
        return found

    def run(self) -> None:
        for _ in self.ticks():
            pass

    def waiting(self) -> str | None:
        """The collective the main thread waits in now, if any."""
        return collective_in_progress(sys._current_frames().get(self.main_ident))

    def ticks(self, sleep=time.sleep):
        """The watchdog's loop, one tick a step: publish where this rank waits; past the timeout in one
        collective, name the ranks holding it up and end the process."""
        current, since = None, time.time()
        last, settled = since, 0.0
        silent_s = max(5.0, 5 * self.interval_s)
        while True:
            sleep(self.interval_s)
            now = time.time()
            if stopped := stopped_for(last, now, self.interval_s):
                since += stopped  # the time the job was suspended is no wait
                settled = now + silent_s  # until every rank's heartbeat has come back
            last = now
            waiting = self.waiting()
            if waiting != current:
                current, since = waiting, now
            self._publish(current, since)
            verdict = None
            timed_out = self.timeout_s is not None and now - since >= self.timeout_s
            if current is not None and timed_out and now >= settled:
                verdict = stall_verdict(self._others(), self.size, current, now - silent_s)
            if verdict is not None:
                print(
                    f"{STALL_MARKER} rank {self.rank} waited {now - since:.0f}s in collective "
                    f"'{current}'; missing ranks: {verdict}. Ending the job.",
                    file=sys.stderr,
                    flush=True,
                )
                os._exit(EXIT_STALL)
            yield


def held_up_by(
    statuses: dict[int, dict], size: int, collective: str, silent_before: float
) -> tuple[list[int], list[int]]:
    """The ranks holding up `collective`: those waiting elsewhere (or not in a collective) and those
    whose heartbeat stopped before `silent_before` (a stopped or hung process); then, apart, the
    ranks with no status file at all (on another host without a shared run directory)."""
    missing = [
        rank
        for rank in range(size)
        if rank in statuses
        and (
            statuses[rank].get("waiting") != collective or statuses[rank].get("heartbeat", 0) < silent_before
        )
    ]
    return missing, [rank for rank in range(size) if rank not in statuses]


def stall_verdict(statuses: dict[int, dict], size: int, collective: str, silent_before: float) -> str | None:
    """The ranks to name for a wait past the timeout, or None when every rank is seen starting up
    together."""
    missing, unheard = held_up_by(statuses, size, collective, silent_before)
    if collective == STARTUP and not missing and not unheard:
        return None
    text = ", ".join(map(str, missing)) if missing else "none seen here"
    if unheard:
        text += f" (no status from rank(s) {', '.join(map(str, unheard))}: another host?)"
    return text


def start_from_env() -> StallWatchdog | None:
    """Started by every rank hvdtrain launches; configured by the launcher's environment: a stall
    timeout with a status folder, heartbeats, or both."""
    status_dir, timeout = os.environ.get("HVDTRAIN_STATUS_DIR"), os.environ.get("HVDTRAIN_STALL_TIMEOUT")
    beat_to = heartbeat_address(os.environ.get(HEARTBEAT_ENV))
    identity = rank_from_env()
    stalls = bool(status_dir and timeout)
    if identity is None or not (stalls or beat_to):
        return None
    watchdog = StallWatchdog(
        Path(status_dir) if stalls and status_dir else None,  # elastic: no file, none to read it
        identity[0],
        identity[1],
        float(timeout) if stalls and timeout else None,
        beat_to=beat_to,
    )
    watchdog.start()
    atexit.register(watchdog.beat, True)  # a rank that returns; one ending by os._exit beats first
    return watchdog
