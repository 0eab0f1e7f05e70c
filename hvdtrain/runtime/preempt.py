"""Stopping at one step on every rank, checkpointed there: for preemption, or as a job ends.

SIGUSR1 (Slurm's `--signal=B:USR1@SECONDS` warning, passed on by the launching hvdtrain; any
scheduler can send it) only raises this rank's flag. Inside a Slurm job, so does a SIGTERM that
reaches a rank once it trains (scancel and Slurm's preemption signal every task of a job
themselves): the rank then has STOP_GRACE_S to stop with the others before it ends as SIGTERM would
have ended it. The launching hvdtrain passes its own SIGTERM on as SIGUSR1. Every CHECK_EVERY steps
the ranks sum their flags in one collective, so a signal that reached one rank, or reached the ranks
at different steps, stops all of them after the same step. There the loop writes a checkpoint (a
step checkpoint within an epoch; at an epoch's end, the epoch's own), rank 0 leaves MARKER in the
run directory, and each rank ends with exit code 0. The launching hvdtrain reads the marker: after
SIGUSR1 it records the run as `preempted` and, inside Slurm, requeues the job, whose run then
resumes from that checkpoint; after SIGTERM it records the run as `interrupted`, resumable with
--resume.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Protocol

from hvdtrain.runtime.common import atomic_write_bytes

SIGNAL = signal.SIGUSR1
CHECK_EVERY = 5
"""Steps between the ranks' agreements: one collective of one number each time."""
MARKER = "preempted.json"
"""In the run directory: the step the ranks stopped at for preemption, written by rank 0."""

SIGTERM_STOPS = "HVDTRAIN_SIGTERM_STOPS"
"""Set to 1 in ranks' environment where the scheduler signals the ranks themselves (inside a Slurm
job): their SIGTERM is then a stop request. Elsewhere a rank's SIGTERM comes from a launcher ending a
failing job, which must not wait, and hvdtrain asks the ranks to stop with SIGUSR1."""
STOP_GRACE_S = 20.0
"""How long a rank given SIGTERM while it trains has to stop at an agreed step and checkpoint there
(Slurm sends SIGKILL KillWait seconds after SIGTERM: 30 by default)."""

_asked = threading.Event()
_terminated = threading.Event()  # SIGTERM came: a second one, or the grace running out, ends the rank
_training = threading.Event()  # a loop has taken a step: before that there is nothing to save
_previous: dict[int, object] = {}
_first_sigterm = [0.0]
_deadline: list[threading.Timer] = []  # the grace's timer, cancelled once the rank has trained
SAME_REQUEST_S = 2.0
"""SIGTERMs this close together are one request: Slurm signals a task's processes itself and srun
passes its own SIGTERM on too; one that comes later ends the rank at once."""


class Preempted(Exception):
    """Raised by a loop once every rank has stopped and the checkpoint is written."""

    def __init__(self, step: int) -> None:
        super().__init__(f"stopped as asked after step {step}")
        self.step = step


class Summing(Protocol):
    def sum(self, values: list[float], name: str) -> list[float]: ...


def install() -> None:
    """This rank's SIGUSR1 raises its flag (the main thread's handler, set first thing in a rank, so
    that an early warning neither kills the rank nor is lost); so does SIGTERM once the rank trains,
    where SIGTERM_STOPS says so. Blocking calls are not interrupted."""
    reset()
    _previous[SIGNAL] = signal.signal(SIGNAL, lambda signum, frame: _asked.set())
    if os.environ.get(SIGTERM_STOPS) == "1":
        _previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, _on_sigterm)
    for signum in _previous:
        signal.siginterrupt(signum, False)


def uninstall() -> None:
    """The handlers from before install(), once the rank has trained (a Ray actor's process lives on,
    and Ray ends it with SIGTERM)."""
    while _deadline:
        _deadline.pop().cancel()
    while _previous:
        signum, handler = _previous.popitem()
        signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


def _on_sigterm(signum: int, frame: object) -> None:
    now = time.monotonic()
    if not _training.is_set() or (_terminated.is_set() and now - _first_sigterm[0] > SAME_REQUEST_S):
        end_as_terminated()  # nothing to save yet, or asked again
        return
    if _terminated.is_set():
        return
    _first_sigterm[:] = [now]
    _terminated.set()
    _asked.set()
    deadline = threading.Timer(STOP_GRACE_S, end_as_terminated)
    deadline.daemon = True
    deadline.start()
    _deadline[:] = [deadline]


def end_as_terminated() -> None:
    """End this rank as SIGTERM ends a process that does not handle it (from the grace's timer
    thread, which may not touch handlers: with the shell's code for it)."""
    if threading.current_thread() is not threading.main_thread():
        print(f"hvdtrain: no agreed stop within {STOP_GRACE_S:.0f} s of SIGTERM", file=sys.stderr, flush=True)
        os._exit(128 + signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def terminated() -> bool:
    """Whether this rank was given SIGTERM: the launcher or the scheduler is ending the job."""
    return _terminated.is_set()


def ask() -> None:
    """What the signal does; for tests and for callers that learn of a preemption otherwise."""
    _asked.set()


def agreed(step: int, backend: Summing) -> bool:
    """Every CHECK_EVERY steps, on every rank: whether any rank was asked to stop. The same answer on
    every rank, at the same step."""
    _training.set()
    if step % CHECK_EVERY:
        return False
    return backend.sum([1.0 if _asked.is_set() else 0.0], name="hvdtrain.preempt")[0] > 0


def after_step(
    step: int, taken: int, steps: int, every: int, checkpoint: bool, backend: Summing
) -> tuple[bool, bool]:
    """Every rank after each step of an epoch (`taken` of `steps`): whether to write a step
    checkpoint now (every `every` steps, and where the ranks stop here for preemption), and whether
    they stop for preemption after it. At an epoch's last step the epoch's own checkpoint is the one,
    and the loop stops after the epoch (unless it was the run's last)."""
    preempted = agreed(step, backend)
    inside = taken < steps
    return inside and (bool(every and step % every == 0) or (preempted and checkpoint)), preempted


def stopped(run_dir: Path, step: int, is_chief: bool, backend: Summing, checkpointed: bool) -> Preempted:
    """After the checkpoint of `step` (none with checkpoint=false): rank 0 leaves the marker, every
    rank waits for it (so no rank ends while rank 0 still writes), and the loop raises what this
    returns."""
    if is_chief:
        record = {"step": step, "time": time.time(), "checkpoint": checkpointed}
        atomic_write_bytes(run_dir / MARKER, (json.dumps(record) + "\n").encode())
        saved = "checkpoint saved" if checkpointed else "no checkpoint (checkpoint=false)"
        print(f"hvdtrain: every rank stopped after step {step} as asked; {saved}", flush=True)
    backend.sum([0.0], name="hvdtrain.preempt.done")
    return Preempted(step)


def reset() -> None:
    for event in (_asked, _terminated, _training):
        event.clear()
