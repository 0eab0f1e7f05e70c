"""A user's own recipe from a file outside the repository: it trains under horovod and ddp like a
built-in recipe (its own config field set with --set, weights consistent, the accuracy bar) and
resumes bit-exact, by its name, from the file its run recorded (README: "Your own recipe")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.helpers import final_weights, hvdtrain, summary

MY_RECIPE = '''"""My own model, trained by hvdtrain: hvdtrain run my_recipe.py --np 2 --set width=48"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from hvdtrain.config import TrainConfig, bounded
from hvdtrain.registry import Recipe, debug_variant


@dataclass(kw_only=True)
class Config(TrainConfig):
    epochs: int = 10
    lr: float = 0.1
    width: int = bounded(64, minimum=1)
    """Units of the hidden layer."""


def build(config: Config):
    import torch

    from hvdtrain import data
    from hvdtrain.runtime.torch import TorchTask

    split = data.digits(seed=config.seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(split.x_train.shape[1], config.width),
        torch.nn.ReLU(),
        torch.nn.Linear(config.width, split.num_classes),
    )
    return TorchTask(
        model=model,
        data=split,
        optimizer=partial(torch.optim.SGD, momentum=config.momentum),
    )


RECIPE = Recipe(
    name="my-mlp",
    framework="torch",
    dataset="handwritten digits (shipped with hvdtrain)",
    description="my own two-layer MLP",
    config=Config,
    build=build,
    variants={"debug": debug_variant(epochs=3)},
)
'''


def write_recipe(tmp_path: Path) -> Path:
    path = tmp_path / "mine" / "my_recipe.py"
    path.parent.mkdir()
    path.write_text(MY_RECIPE)
    return path


def trained(run_dir: Path, width: int) -> dict:
    done = summary(run_dir)
    assert done["recipe"] == "my-mlp" and done["world_size"] == 2
    assert done["weights_consistent"] is True
    assert done["test_accuracy"] >= 0.9
    assert final_weights(run_dir)[0].shape == (width, 64), "--set width reached the ranks"
    return done


def test_a_recipe_file_trains_under_horovod_and_resumes_bit_exact_by_its_name(tmp_path):
    recipe = write_recipe(tmp_path)
    run = ["run", str(recipe), "--np", "2", "--launcher", "gloo", "--set", "width=48"]
    hvdtrain(*run, "--set", "epochs=4", run_dir=tmp_path / "straight")
    straight = trained(tmp_path / "straight", 48)
    record = json.loads((tmp_path / "straight" / "run.json").read_text())
    assert (record["recipe"], record["recipe_source"]) == ("my-mlp", str(recipe))

    hvdtrain(*run, "--set", "epochs=2", run_dir=tmp_path / "split")
    resume = ["run", "my-mlp", "--np", "2", "--launcher", "gloo", "--resume", "--set", "epochs=4"]
    hvdtrain(*resume, run_dir=tmp_path / "split")  # by name: the file recorded in run.json
    split = trained(tmp_path / "split", 48)
    assert split["parameter_digest"] == straight["parameter_digest"]
    assert split["steps"] == straight["steps"]


@pytest.mark.parametrize("strategy", ["ddp"])
def test_a_recipe_file_trains_under_another_strategy(strategy, tmp_path):
    recipe = write_recipe(tmp_path)
    hvdtrain(
        "run", str(recipe), "--np", "2", "--strategy", strategy, "--set", "epochs=4", "--set", "width=40",
        run_dir=tmp_path / "run",
    )  # fmt: skip
    assert trained(tmp_path / "run", 40)["strategy"] == strategy
