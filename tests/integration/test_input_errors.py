"""Input a rank cannot use (an image that does not decode, a recipe whose build() breaks its
contract) ends the job in one `hvdtrain: error:` line naming the file or the contract, the
traceback kept in the rank's log; a user's own script's exception still shows its traceback."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hvdtrain import data
from tests.support.helpers import hvdtrain

BROKEN_BUILD = """
from dataclasses import dataclass

from hvdtrain.config import TrainConfig
from hvdtrain.registry import Recipe


@dataclass(kw_only=True)
class Config(TrainConfig):
    epochs: int = 1


RECIPE = Recipe(
    name="{name}", framework="{framework}", dataset="none", description="build returns a dict",
    config=Config, build=lambda config: {{"model": None}},
)
"""


def _one_line(result, expected: str) -> Path:
    """The line, with nothing of a traceback on the console; returns the rank log it names."""
    assert result.returncode == 2, result.output[-3000:]
    assert "Traceback" not in result.output, result.output[-3000:]
    last = result.stderr.strip().splitlines()[-2]
    assert last.startswith(f"hvdtrain: error: {expected}") and " (its traceback: " in last, last
    log = Path(re.search(r"\(its traceback: (.*)\)$", last)[1])
    assert "Traceback (most recent call last)" in log.read_text(), log
    return log


@pytest.mark.parametrize("recipe", ["image-folder-torch", "image-folder-tf"])
def test_an_image_that_does_not_decode_is_named_in_one_line(recipe, tmp_path):
    data.write_digits_images(tmp_path / "png")
    broken = sorted((tmp_path / "png" / "train" / "3").iterdir())[4]
    broken.write_bytes(b"not a png")
    run = ("run", recipe, "--np", "2", "--variant", "debug", "--set", f"data_dir={tmp_path / 'png'}")
    result = hvdtrain(*run, run_dir=tmp_path / "run", check=False)
    _one_line(result, f"{broken} cannot be")


@pytest.mark.parametrize(
    ("framework", "task"), [("torch", "torch.TorchTask"), ("tensorflow", "tensorflow.KerasTask")]
)
def test_a_recipe_whose_build_breaks_its_contract_is_named_in_one_line(framework, task, tmp_path):
    recipe = tmp_path / "contract.py"
    recipe.write_text(BROKEN_BUILD.format(name=f"contract-{framework}", framework=framework))
    result = hvdtrain("run", str(recipe), "--np", "2", run_dir=tmp_path / "run", check=False)
    contract = f"build(config) must return a hvdtrain.runtime.{task}, not builtins.dict"
    _one_line(result, f"recipe contract-{framework}: {contract} (its traceback: ")


def test_a_users_own_scripts_exception_still_shows_its_traceback(tmp_path):
    script = tmp_path / "mine.py"
    script.write_text("raise ValueError('my own bug')\n")
    result = hvdtrain("run", str(script), "--np", "2", run_dir=tmp_path / "run", check=False)
    assert result.returncode == 1 and "Traceback" in result.output and "my own bug" in result.output


PIECES = """
import os, time
from hvdtrain.errors import INPUT_ERROR, TRACEBACK_FOLLOWS

if os.environ["OMPI_COMM_WORLD_RANK"] == "1":
    os.write(2, TRACEBACK_FOLLOWS[:20].encode())
    time.sleep(0.6)
    os.write(2, (TRACEBACK_FOLLOWS[20:] + "\\nTraceback (most recent call last):\\n  File x\\n").encode())
    os.write(2, f"{INPUT_ERROR} the input".encode())
    time.sleep(0.6)
    os.write(2, b"\\n")
else:
    time.sleep(0.3)
    os.write(2, b"rank 0 between the pieces\\n")
    time.sleep(0.6)
    os.write(2, b"rank 0 again\\n")
"""


def test_a_traceback_open_mpi_passes_on_in_pieces_stays_in_the_log(tmp_path):
    """mpirun tags each piece of a rank's output it reads, not each line; the pieces are put back
    together before the console decides what to show."""
    import os
    import sys

    from hvdtrain.launching.console import Console
    from hvdtrain.launching.runner import run_launch
    from hvdtrain.launching.spec import LaunchCommand

    argv = ["mpirun", "--allow-run-as-root", "--tag-output", "-np", "2", sys.executable, "-c", PIECES]
    with open(tmp_path / "console", "w") as shown:
        result = run_launch(LaunchCommand(argv, {}), dict(os.environ), console=Console(shown, live=False))
    console = (tmp_path / "console").read_text()
    assert result.returncode == 0 and "Traceback" not in console, console
    lines = [line.split("] ", 1)[-1] for line in console.splitlines()]
    assert {"rank 0 between the pieces", "rank 0 again", "hvdtrain: error: the input"} <= set(lines), console
