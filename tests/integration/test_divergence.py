"""A run whose loss or gradient stops being a number ends as `diverged`, on every rank at one step,
its last finite checkpoint kept; with nonfinite_patience a bad step is skipped on every rank alike."""

from __future__ import annotations

import json
import math

import pytest
import torch

from hvdtrain.runtime import checkpoint
from tests.support.helpers import PROGRAMS, hvdtrain

EXPLODES_IN_EPOCH_2 = ("epochs=3", "lr_schedule=step", "lr_milestones=1", "lr_gamma=1e14")
"""digits-mlp-torch trains its first epoch at lr 0.1, then at 1e13."""


def _sets(*pairs: str) -> list[str]:
    return [arg for pair in pairs for arg in ("--set", pair)]


def _finite_weights(run_dir) -> bool:
    found = checkpoint.latest(run_dir)
    state = torch.load(found.path(found.files[0]), map_location="cpu", weights_only=False)
    tensors = [v for v in state["model"].values() if torch.is_tensor(v)]
    return bool(tensors) and all(bool(torch.isfinite(v).all()) for v in tensors)


def test_a_diverged_run_stops_keeps_its_last_finite_checkpoint_and_resumes_from_it(tmp_path):
    args = ("run", "digits-mlp-torch", "--np", "2", "--launcher", "gloo")
    result = hvdtrain(*args, *_sets(*EXPLODES_IN_EPOCH_2), run_dir=tmp_path, check=False)
    assert result.returncode == 4, result.output[-3000:]
    marker = json.loads((tmp_path / "diverged.json").read_text())
    assert marker["epoch"] == 1 and marker["what"] == "loss" and not math.isfinite(float(marker["value"]))
    # seen within 2 * CHECK_EVERY steps, and no checkpoint of the second epoch was written
    assert marker["step"] <= marker["stopped_at"] < marker["step"] + 10
    saved = (tmp_path / "checkpoints" / "latest").read_text().strip()
    assert marker["checkpoint"] == int(saved) < marker["step"]
    assert _finite_weights(tmp_path)
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"hvdtrain: diverged: loss nan at step {marker['step']} (epoch 2)"), last
    assert f"its last checkpoint (step {saved}) is kept" in last
    assert "Traceback" not in result.output
    assert json.loads((tmp_path / "run.json").read_text())["status"] == "diverged"
    assert "diverged (exit code 4)" in hvdtrain("show", str(tmp_path)).stdout
    assert not (tmp_path / "summary.json").exists()

    resumed = hvdtrain(*args, "--resume", *_sets("lr_gamma=1"), run_dir=tmp_path)
    assert "resuming from" in resumed.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["weights_consistent"] and summary["test_accuracy"] > 0.85, summary
    assert not (tmp_path / "diverged.json").exists()


@pytest.mark.parametrize("strategy", [["--launcher", "gloo"], ["--strategy", "ddp"]], ids=["horovod", "ddp"])
def test_one_ranks_nan_stops_every_rank_at_one_step_or_is_skipped_with_patience(strategy, tmp_path):
    """Rank 1's loss is nan at step 13 (programs/one_rank_blows_up_torch.py) and rank 0's is not: the ranks
    look at it at step 20 (at step 15 they read the steps up to 10), after the checkpoint of step 10.
    With a patience the step is skipped on both ranks, and the run ends with the same weights
    everywhere."""
    args = ("run", str(PROGRAMS / "one_rank_blows_up_torch.py"), "--np", "2", *strategy)
    args += (*_sets("precision=fp32", "epochs=2", "at_step=13", "by=nan"),)
    stopped = hvdtrain(*args, run_dir=tmp_path / "stopped", check=False)
    assert stopped.returncode == 4, stopped.output[-3000:]
    marker = json.loads((tmp_path / "stopped" / "diverged.json").read_text())
    assert (marker["step"], marker["stopped_at"], marker["checkpoint"]) == (13, 20, 10), marker

    hvdtrain(*args, *_sets("nonfinite_patience=1"), run_dir=tmp_path / "skipped")
    summary = json.loads((tmp_path / "skipped" / "summary.json").read_text())
    assert summary["weights_consistent"] and math.isfinite(summary["final_loss"]), summary
    assert summary["steps"] == 20 and summary["nonfinite_skipped"] == 1, summary


def test_fp16_stops_once_its_loss_scale_cannot_save_it(tmp_path):
    args = ("run", "digits-mlp-torch", "--np", "2", "--launcher", "gloo")
    overrides = _sets("precision=fp16", "lr=1e12", "epochs=4")
    result = hvdtrain(*args, *overrides, run_dir=tmp_path, check=False)
    assert result.returncode == 4, result.output[-3000:]
    marker = json.loads((tmp_path / "diverged.json").read_text())
    assert marker["what"] == "fp16 gradient (overflowed)" and marker["in_a_row"] == 25, marker
    assert marker["stopped_at"] == marker["step"] + 24


def test_keras_stops_alike_and_skips_with_its_loss_scale(tmp_path):
    args = ("run", "digits-mlp-tf", "--np", "2", "--launcher", "gloo")
    stopped = hvdtrain(*args, *_sets(*EXPLODES_IN_EPOCH_2), run_dir=tmp_path / "stopped", check=False)
    assert stopped.returncode == 4, stopped.output[-3000:]
    marker = json.loads((tmp_path / "stopped" / "diverged.json").read_text())
    saved = (tmp_path / "stopped" / "checkpoints" / "latest").read_text().strip()
    assert marker["epoch"] == 1 and marker["checkpoint"] == int(saved) < marker["step"], marker
    assert "hvdtrain: diverged: loss nan at step" in stopped.stderr and "Traceback" not in stopped.output

    skipping = _sets(*EXPLODES_IN_EPOCH_2, "nonfinite_patience=3")
    skipped = hvdtrain(*args, *skipping, run_dir=tmp_path / "skipped", check=False)
    assert skipped.returncode == 4, skipped.output[-3000:]
    marker = json.loads((tmp_path / "skipped" / "diverged.json").read_text())
    assert marker["what"] == "gradient norm" and marker["in_a_row"] == 4, marker
    assert marker["stopped_at"] == marker["step"] + 3
