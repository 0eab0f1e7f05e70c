"""The guard's decisions on one rank: when a run whose figures stop being numbers stops, and what
its marker says."""

from __future__ import annotations

import json
import math

import pytest

from hvdtrain.runtime.divergence import CHECK_EVERY, FP16_OVERFLOWS, MARKER, Diverged, Guard


def guard(tmp_path, patience=0, loss_scaled=False, enabled=True) -> Guard:
    return Guard(
        enabled, patience, loss_scaled, lambda values, name: values, lambda value: [value], tmp_path, True
    )


def train(g: Guard, losses: list[float], skipped_from: int | None = None, saves=()) -> int:
    """Steps 1.. with these losses; a step at or after `skipped_from` is skipped (its update not
    applied); a checkpoint after each step in `saves`. Returns the step it stopped at."""
    for step, loss in enumerate(losses, start=1):
        skipped = skipped_from is not None and step >= skipped_from
        try:
            g.after_step(step, 0, [loss], skipped, lambda loss=loss: loss)
            if step in saves:
                g.settle(step, 0, lambda: True)
                g.saved(step)
        except Diverged as stop:
            return stop.stopped_at
    return 0


def test_a_bad_loss_stops_at_the_look_that_reads_it(tmp_path):
    losses = [1.0] * 3 + [math.nan] + [1.0] * 20
    assert train(guard(tmp_path), losses) == 2 * CHECK_EVERY
    marker = json.loads((tmp_path / MARKER).read_text())
    assert (marker["step"], marker["what"], marker["value"], marker["checkpoint"]) == (4, "loss", "nan", None)


def test_a_checkpoint_looks_at_every_step_before_it_is_written(tmp_path):
    losses = [1.0] * 6 + [math.inf] + [1.0] * 20
    assert train(guard(tmp_path), losses, saves=(3, 7)) == 7
    assert json.loads((tmp_path / MARKER).read_text())["checkpoint"] == 3


def test_non_finite_weights_are_never_checkpointed(tmp_path):
    g = guard(tmp_path)
    with pytest.raises(Diverged) as stop:
        g.settle(8, 1, lambda: False)
    assert stop.value.bad.what == "weights" and stop.value.stopped_at == 8


@pytest.mark.parametrize(
    ("patience", "loss_scaled", "in_a_row"), [(2, False, 3), (0, True, FP16_OVERFLOWS + 1)]
)
def test_skipped_steps_stop_the_run_once_more_than_the_patience_in_a_row(
    tmp_path, patience, loss_scaled, in_a_row
):
    g = guard(tmp_path, patience, loss_scaled)
    assert train(g, [math.nan] * 40, skipped_from=5) == 4 + in_a_row
    marker = json.loads((tmp_path / MARKER).read_text())
    assert (marker["step"], marker["in_a_row"]) == (5, in_a_row)


def test_a_skipped_step_that_good_steps_follow_is_counted_and_the_run_goes_on(tmp_path):
    g = guard(tmp_path, patience=1)
    for step in range(1, 20):
        g.after_step(step, 0, [1.0], step in (4, 9), lambda: math.nan)
    assert g.skipped == 2 and not (tmp_path / MARKER).exists()


def test_a_guard_turned_off_lets_anything_through(tmp_path):
    assert train(guard(tmp_path, enabled=False), [math.nan] * 30, saves=(10,)) == 0


def test_an_elastic_reset_forgets_the_steps_taken_since_the_commit(tmp_path):
    g = guard(tmp_path, patience=2)
    for step in (1, 2):
        g.after_step(step, 0, [1.0], True, lambda: math.nan)
    g.reset()  # a new rank counts from 0: so must the others, or they stop a step before it does
    for step in (1, 2):
        g.after_step(step, 0, [1.0], True, lambda: math.nan)
    assert g.in_a_row == 2 and not (tmp_path / MARKER).exists()
