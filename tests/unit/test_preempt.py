"""Preemption, pure: on which step the ranks agree to stop, and what they write there."""

from __future__ import annotations

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
