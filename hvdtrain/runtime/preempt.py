"""Stopping for preemption, on every rank at the same step.

SIGUSR1 (Slurm's `--signal=B:USR1@SECONDS` warning, forwarded by the launching hvdtrain; any
scheduler can send it) only raises this rank's flag. Every CHECK_EVERY steps the ranks sum their
flags in one collective, so a signal that reached one rank, or reached the ranks at different
steps, stops all of them after the same step. There the loop writes a checkpoint (a step
checkpoint within an epoch; at an epoch's end, the epoch's own), rank 0 leaves MARKER in the run
directory, and each rank ends with exit code 0: the launching hvdtrain reads the marker, records the
run as `preempted` and, inside Slurm, requeues the job, whose run then resumes from that checkpoint.
"""

from __future__ import annotations

import json
import signal
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

_asked = threading.Event()


class Preempted(Exception):
    """Raised by a loop once every rank has stopped and the checkpoint is written."""

    def __init__(self, step: int) -> None:
        super().__init__(f"stopped for preemption after step {step}")
        self.step = step


class Summing(Protocol):
    def sum(self, values: list[float], name: str) -> list[float]: ...


def install() -> None:
    """This rank's SIGUSR1 raises its flag (the main thread's handler, set first thing in a rank, so
    that an early warning neither kills the rank nor is lost); blocking calls are not interrupted."""
    _asked.clear()
    signal.signal(SIGNAL, lambda signum, frame: _asked.set())
    signal.siginterrupt(SIGNAL, False)


def ask() -> None:
    """What the signal does; for tests and for callers that learn of a preemption otherwise."""
    _asked.set()


def agreed(step: int, backend: Summing) -> bool:
    """Every CHECK_EVERY steps, on every rank: whether any rank was asked to stop. The same answer on
    every rank, at the same step."""
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
        print(f"hvdtrain: every rank stopped after step {step} for preemption; {saved}", flush=True)
    backend.sum([0.0], name="hvdtrain.preempt.done")
    return Preempted(step)


def reset() -> None:
    _asked.clear()
