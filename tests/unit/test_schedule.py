"""The one schedule every loop uses: what a step is, the learning rate at each step, the resume point."""

from __future__ import annotations

import math

import pytest

from hvdtrain.config import TrainConfig
from hvdtrain.runtime.schedule import Schedule


def schedule(samples: int = 1000, world_size: int = 2, **config) -> Schedule:
    return Schedule.for_run(TrainConfig(**config), samples, world_size)


@pytest.mark.parametrize(
    ("config", "world_size", "steps"),
    [
        ({"batch_size": 10}, 2, 50),
        ({"batch_size": 10, "backward_passes_per_step": 5}, 2, 10),
        ({"batch_size": 10, "steps_per_epoch": 7}, 2, 7),
        ({"batch_size": 10, "steps_per_epoch": 700}, 2, 50),
        ({"batch_size": 10}, 4, 25),
    ],
)
def test_steps_per_epoch_count_optimizer_updates(config, world_size, steps):
    planned = schedule(world_size=world_size, **config)
    assert planned.steps_per_epoch == steps
    assert planned.global_samples_per_epoch == steps * config["batch_size"] * world_size * config.get(
        "backward_passes_per_step", 1
    )


def test_too_few_samples_is_a_value_error():
    with pytest.raises(ValueError, match="too few for batch_size 32 x backward_passes_per_step 2 x 4 ranks"):
        schedule(samples=100, world_size=4, backward_passes_per_step=2)


@pytest.mark.parametrize(
    ("config", "peak"),
    [
        ({"lr": 0.1}, 0.4),
        ({"lr": 0.1, "scale_lr": False}, 0.1),
        ({"lr": 0.1, "reduce_op": "adasum"}, 0.1),
    ],
)
def test_lr_scales_with_world_size_except_under_adasum(config, peak):
    assert schedule(world_size=4, **config).peak_lr == pytest.approx(peak)


def test_warmup_is_linear_per_step_from_the_one_rank_lr():
    planned = schedule(samples=640, world_size=2, batch_size=32, lr=0.1, warmup_epochs=2)
    assert planned.steps_per_epoch == 10 and planned.warmup_steps == 20
    steps = (0, 5, 10, 19, 20, 100)
    lrs = [round(planned.lr_at(planned.at(step // 10, step % 10)), 6) for step in steps]
    assert lrs == [0.1, 0.125, 0.15, 0.195, 0.2, 0.2]
    assert planned.logs_lr(planned.at(2, 0)) and not planned.logs_lr(planned.at(2, 1))
    assert schedule(samples=640, world_size=2, batch_size=32, warmup_epochs=0.04).warmup_steps == 1
    assert not schedule().logs_lr(0), "no warmup, no per-step records"
    assert schedule(log_step_lr=True).logs_lr(3.5)


def test_progress_counts_samples_so_every_world_size_agrees():
    """Half an epoch is half an epoch's samples, however many ranks share them."""
    two, four = (
        schedule(samples=640, world_size=2, batch_size=8),
        schedule(samples=640, world_size=4, batch_size=8),
    )
    assert two.steps_per_epoch == 40 and four.steps_per_epoch == 20
    assert two.at(3, 20) == four.at(3, 10) == two.progress(3, 320 / 640) == 3.5
    assert two.at(1, 10_000) == two.progress(1, 1.5) == 2.0, "an epoch's end is its last step's, not beyond"


def test_step_decay_multiplies_by_gamma_at_each_milestone_fractions_allowed():
    planned = schedule(lr=0.1, scale_lr=False, lr_schedule="step", lr_milestones=(1.5, 3), lr_gamma=0.5)
    assert [planned.lr_at(p) for p in (0, 1.49, 1.5, 2.9, 3, 9)] == [0.1, 0.1, 0.05, 0.05, 0.025, 0.025]


@pytest.mark.parametrize(
    ("kind", "middle"),
    [("cosine", 0.01 + 0.09 / 2), ("linear", 0.01 + 0.09 / 2), ("constant", 0.1)],
)
def test_cosine_and_linear_decay_after_warmup_to_min_lr_at_the_last_epoch(kind, middle):
    planned = schedule(lr=0.1, scale_lr=False, epochs=5, warmup_epochs=1, lr_schedule=kind, min_lr=0.01)
    assert planned.lr_at(0.5) == pytest.approx(0.1), "warmup to the unscaled lr is flat"
    assert planned.lr_at(1) == pytest.approx(0.1)
    assert planned.lr_at(3) == pytest.approx(middle)
    assert planned.lr_at(5) == pytest.approx(0.1 if kind == "constant" else 0.01)
    if kind == "cosine":
        assert planned.lr_at(2) == pytest.approx(0.01 + 0.09 * (1 + math.cos(math.pi / 4)) / 2)
    if kind == "linear":
        assert planned.lr_at(2) == pytest.approx(0.01 + 0.09 * 0.75)


def test_decay_starts_from_the_scaled_lr_warmup_reached():
    planned = schedule(lr=0.1, world_size=4, epochs=4, warmup_epochs=2, lr_schedule="linear")
    assert planned.lr_at(1) == pytest.approx(0.25) and planned.lr_at(2) == pytest.approx(0.4)
    assert planned.lr_at(3) == pytest.approx(0.2) and planned.lr_at(4) == 0


def test_a_resumed_run_starts_where_its_checkpoint_left_off():
    planned = schedule(batch_size=10)
    assert planned.start(None) == (0, 0)
    assert planned.start({"epoch": 3, "step": 150}) == (3, 150)
