"""Preemption: on which step the ranks agree to stop, and how a rank takes SIGTERM (in a process of
its own)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from hvdtrain.runtime import preempt


class Summing:
    def __init__(self, others_asked: bool) -> None:
        self.others_asked, self.calls = others_asked, 0

    def sum(self, values, name):
        self.calls += 1
        return [values[0] + (1.0 if self.others_asked else 0.0)]


@pytest.mark.parametrize(
    ("step", "taken", "every", "checkpoint", "others_asked", "expected"),
    [
        (3, 3, 0, True, True, (False, False)),  # not a step the ranks agree at: no collective
        (5, 5, 0, True, False, (False, False)),
        (5, 5, 0, True, True, (True, True)),  # another rank was asked: a checkpoint here, then stop
        (5, 5, 0, False, True, (False, True)),  # checkpoint=false: stop without one
        (10, 10, 0, True, True, (False, True)),  # the epoch's last step: its own checkpoint follows
        (8, 8, 4, True, False, (True, False)),  # checkpoint_every_steps
    ],
)
def test_ranks_agree_on_the_step_to_stop_at_for_preemption(
    step, taken, every, checkpoint, others_asked, expected
):
    backend = Summing(others_asked)
    preempt.reset()
    assert preempt.after_step(step, taken, 10, every, checkpoint, backend) == expected
    assert backend.calls == (0 if step % preempt.CHECK_EVERY else 1)


RANK = """
import os, signal, sys, time
from hvdtrain.runtime import preempt

class Alone:
    def sum(self, values, name):
        return values

preempt.STOP_GRACE_S = float(sys.argv[2])
os.environ[preempt.SIGTERM_STOPS] = sys.argv[3]
preempt.install()
if sys.argv[1] == "training":
    preempt.after_step(1, 1, 10, 0, True, Alone())
print("ready", flush=True)
for line in sys.stdin:  # each line: send this rank one SIGTERM, then say where it stands
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)
    print(preempt.terminated(), preempt.after_step(5, 5, 10, 0, True, Alone())[1], flush=True)
time.sleep(30)
"""


def _rank(phase: str, grace_s: float = 60.0, sigterm_stops: str = "1"):
    process = subprocess.Popen(
        [sys.executable, "-c", RANK, phase, str(grace_s), sigterm_stops],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout.readline() == "ready\n"
    return process


def _sigterm(process) -> str:
    process.stdin.write("\n")
    process.stdin.flush()
    return process.stdout.readline().strip()


def test_sigterm_ends_a_rank_at_once_outside_a_scheduler_that_signals_ranks_itself():
    rank = _rank("training", sigterm_stops="0")
    _sigterm(rank)
    assert rank.wait(timeout=10) == -15


def test_sigterm_before_the_first_step_ends_the_rank_at_once():
    rank = _rank("starting")
    _sigterm(rank)
    assert rank.wait(timeout=10) == -15


def test_sigterm_while_training_asks_for_a_stop_and_a_second_one_soon_after_is_the_same_request():
    rank = _rank("training")
    assert _sigterm(rank) == "True True"  # the flag the ranks agree on is raised
    assert _sigterm(rank) == "True True"  # srun passing on the SIGTERM Slurm sent too
    time.sleep(preempt.SAME_REQUEST_S + 0.2)
    _sigterm(rank)  # asked again: now it ends
    assert rank.wait(timeout=10) == -15


def test_a_rank_that_cannot_stop_within_the_grace_ends_as_terminated():
    rank = _rank("training", grace_s=1.0)
    started = time.monotonic()
    assert _sigterm(rank) == "True True"
    assert rank.wait(timeout=10) == 128 + 15
    assert time.monotonic() - started < 5
