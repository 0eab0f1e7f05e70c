"""The one schedule every loop uses: what a step is, the learning rate at each step, the resume point."""

from __future__ import annotations

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
    assert [round(planned.lr_at(step), 6) for step in (0, 5, 10, 19, 20, 100)] == [
        0.1,
        0.125,
        0.15,
        0.195,
        0.2,
        0.2,
    ]
    assert planned.logs_lr(20) and not planned.logs_lr(21)
    assert schedule(samples=640, world_size=2, batch_size=32, warmup_epochs=0.04).warmup_steps == 1
    assert not schedule().logs_lr(0), "no warmup, no per-step records"


def test_a_resumed_run_starts_where_its_checkpoint_left_off():
    planned = schedule(batch_size=10)
    assert planned.start(None) == (0, 0)
    assert planned.start({"epoch": 3, "step": 150}) == (3, 150)
