"""Config precedence and --set parsing: command line over variant over recipe over defaults."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import pytest

from hvdtrain import config as config_module
from hvdtrain.config import TrainConfig, apply, parse_overrides
from hvdtrain.registry import Recipe, debug_variant


@dataclass(kw_only=True)
class Config(TrainConfig):
    epochs: int = 7
    mode: Literal["a", "b"] = "a"
    """A choice."""
    ratio: float | None = None


RECIPE = Recipe(
    name="t",
    framework="torch",
    dataset="-",
    description="-",
    config=Config,
    build=lambda c: c,
    variants={"debug": debug_variant(epochs=2, lr=0.5)},
)


def test_precedence_defaults_recipe_variant_command_line():
    assert TrainConfig().epochs == 10 and TrainConfig().lr == 0.05
    assert RECIPE.make_config().epochs == 7
    debug = RECIPE.make_config("debug")
    assert (debug.epochs, debug.lr, debug.batch_size) == (2, 0.5, 32)
    final = apply(debug, parse_overrides(Config, ["epochs=3"]))
    assert (final.epochs, final.lr) == (3, 0.5)


def test_values_are_typed():
    overrides = parse_overrides(Config, ["lr=0.1", "scale_lr=false", "mode=b", "ratio=none", "batch-size=8"])
    assert overrides == {"lr": 0.1, "scale_lr": False, "mode": "b", "ratio": None, "batch_size": 8}
    assert parse_overrides(Config, ["ratio=0.5"]) == {"ratio": 0.5}
    assert parse_overrides(Config, ["lr_milestones=[1, 2.5]"]) == {"lr_milestones": (1.0, 2.5)}
    assert parse_overrides(Config, ["lr_milestones=3"]) == {"lr_milestones": (3.0,)}
    assert parse_overrides(Config, ["clip_grad_norm=none"]) == {"clip_grad_norm": None}


@pytest.mark.parametrize(
    ("pair", "message"),
    [
        ("nope=1", "unknown key; valid keys: async_checkpoint, backward_passes_per_step, batch_size"),
        ("epochs=three", "expected int"),
        ("scale_lr=maybe", "expected true or false"),
        ("mode=c", "choose one of a, b"),
        ("epochs", "expected key=value"),
        ("lr_milestones=[1,'a']", "expected a list of numbers"),
        ("lr_milestones=[1,", "expected a list"),
        ("lr_schedule=exp", "choose one of constant, step, cosine, linear"),
        ("precision=fp8", "choose one of fp32, bf16, fp16"),
    ],
)
def test_bad_overrides_say_what_is_wrong(pair, message):
    with pytest.raises(ValueError, match=message):
        parse_overrides(Config, [pair])


@pytest.mark.parametrize("pair", ["epochs=0", "batch_size=-1", "lr=0", "steps_per_epoch=-2"])
def test_validation(pair):
    with pytest.raises(ValueError):
        apply(Config(), parse_overrides(Config, [pair]))


@pytest.mark.parametrize(
    ("pairs", "message"),
    [
        (["clip_grad_norm=0"], "clip_grad_norm must be greater than 0, got 0"),
        (["clip_grad_norm=-1"], "clip_grad_norm must be greater than 0"),
        (["clip_grad_norm=1", "reduce_op=adasum"], "Adasum combines the ranks' updates"),
        (["lr_schedule=step"], "lr_schedule=step needs lr_milestones"),
        (["lr_milestones=[2]"], "lr_milestones is read by lr_schedule=step only"),
        (["lr_schedule=step", "lr_milestones=[3,2]"], "positive epochs in increasing order"),
        (["lr_schedule=step", "lr_milestones=[0]"], "positive epochs in increasing order"),
        (["lr_schedule=step", "lr_milestones=[1]", "lr_gamma=0"], "lr_gamma must be greater than 0"),
        (["lr_schedule=cosine", "min_lr=0.05"], "min_lr must be below lr for lr_schedule=cosine"),
        (["lr_schedule=linear", "warmup_epochs=7"], "leaves no epochs for lr_schedule=linear"),
        (["min_lr=-1"], "min_lr must be at least 0"),
        (["keep_checkpoints=0"], "keep_checkpoints must be at least 1, got 0"),
        (["precision=fp16", "reduce_op=adasum"], "precision=fp16 with reduce_op=adasum"),
        (["nonfinite_patience=2", "reduce_op=adasum"], "nonfinite_patience with reduce_op=adasum"),
        (["async_checkpoint=true", "checkpoint=false"], "async_checkpoint needs checkpoint=true"),
    ],
)
def test_fields_that_go_together_are_checked_together(pairs, message):
    with pytest.raises(ValueError, match=message):
        apply(Config(), parse_overrides(Config, pairs))


def test_unknown_variant_lists_the_known_ones():
    with pytest.raises(ValueError, match="variants: debug"):
        RECIPE.make_config("fast")


def test_save_and_load_round_trip(tmp_path):
    original = apply(Config(), {"mode": "b", "lr": 0.3, "lr_schedule": "step", "lr_milestones": (2.0, 4.5)})
    config_module.save(original, tmp_path / "c.json")
    assert config_module.load(Config, tmp_path / "c.json") == original
