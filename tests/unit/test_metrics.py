"""Metrics by name, the watch behind the best checkpoint and early stopping, and what `runs` and
`show` make of a run that reports other metrics than accuracy."""

from __future__ import annotations

import json
import math
import os

import pytest
from click.testing import CliRunner

from hvdtrain import registry
from hvdtrain.cli import main
from hvdtrain.runtime import checkpoint, checkpoint_write, metrics
from hvdtrain.runtime.metrics import Watch
from tests.support.helpers import saving


def test_perplexity_is_the_exponential_of_the_mean_cross_entropy_and_the_rest_are_means():
    assert metrics.finish("perplexity", 2.0) == pytest.approx(math.e**2)
    assert metrics.finish("perplexity", 1e4) == math.inf  # a diverged model, not an OverflowError
    assert metrics.finish("accuracy", 0.5) == metrics.finish("loss", 0.5) == 0.5


@pytest.mark.parametrize(
    ("monitor", "mode", "goal"),
    [
        ("test_accuracy", "auto", "max"),
        ("test_top5", "auto", "max"),
        ("test_perplexity", "auto", "min"),
        ("loss", "auto", "min"),
        ("loss", "max", "max"),
        ("test_f1", "max", "max"),
    ],
)
def test_the_direction_of_a_monitored_metric(monitor, mode, goal):
    assert metrics.goal(monitor, mode) == goal


def test_a_metric_hvdtrain_does_not_know_needs_a_mode():
    with pytest.raises(ValueError, match="set mode=min or mode=max"):
        metrics.check_monitor("test_f1", "auto", ("accuracy", "f1"), "r")
    metrics.check_monitor("test_f1", "max", ("accuracy", "f1"), "r")
    with pytest.raises(ValueError, match="recipe r reports loss, test_accuracy; monitor one of those"):
        metrics.check_monitor("accuracy", "auto", ("accuracy",), "r")


def test_the_watch_keeps_the_best_counts_the_epochs_since_and_resumes_with_them():
    watch = Watch("test_loss", "auto", patience=2)
    assert [watch.observe({"test_loss": v}) for v in (3.0, 2.0, 2.5, 2.0)] == [True, True, False, False]
    assert (watch.best, watch.since_best, watch.exhausted) == (2.0, 2, True)
    resumed = Watch("test_loss", "auto", patience=3, state=json.loads(json.dumps(watch.state_dict())))
    assert (resumed.best, resumed.since_best, resumed.exhausted) == (2.0, 2, False)
    assert resumed.observe({"test_loss": math.nan}) is False and resumed.exhausted
    assert resumed.observe({"test_loss": None}) is False and resumed.since_best == 4
    assert Watch("", "auto", 0).observe({"loss": 1.0}) is False and Watch("", "auto", 0).summary() == {}


def test_every_recipe_declares_metrics_hvdtrain_knows_the_direction_of():
    for recipe in registry.all_recipes().values():
        assert all(name in metrics.GOALS for name in recipe.metrics), recipe.name


def test_the_best_checkpoint_is_a_complete_copy_that_pruning_leaves(tmp_path):
    for step in (10, 20, 30):
        checkpoint_write.write(
            tmp_path, step, step // 10, 2, "torch", {"checkpoint.pt": saving(f"w{step}".encode())}, keep=1
        )
        if step != 30:
            checkpoint_write.keep_best(
                tmp_path, step, {"monitor": "test_loss", "value": 1 / step, "epoch": step // 10}
            )
    best = tmp_path / "checkpoints" / "best"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["30", "best", "latest"]
    assert (best / "checkpoint.pt").read_bytes() == b"w20"
    assert json.loads((best / "best.json").read_text()) == {"monitor": "test_loss", "value": 0.05, "epoch": 2}
    found = checkpoint.Checkpoint(best, ("checkpoint.pt",), checkpoint.read_manifest(best))
    assert set(checkpoint.check(found).values()) == {"ok"} and found.manifest.step == 20
    assert checkpoint.latest(tmp_path).manifest.step == 30  # a resume takes the newest, not the best
    assert (best / "checkpoint.pt").stat().st_nlink == 1  # its step directory is gone; the link stays
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]


LM_EPOCHS = [
    {"epoch": 1, "loss": 3.3, "test_loss": 2.5, "test_perplexity": 12.2, "lr": 0.001},
    {"epoch": 2, "loss": 2.6, "test_loss": 2.3, "test_perplexity": 10.0, "lr": 0.0001},
]


def test_runs_and_show_name_the_metrics_a_language_model_reports(tmp_path):
    run_dir = tmp_path / "gpt-torch-20260102-030405"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in LM_EPOCHS))
    (run_dir / "run.json").write_text(json.dumps({"recipe": "gpt-torch", "status": "failed", "exit_code": 1}))
    listing = CliRunner().invoke(main, ["runs", str(tmp_path)])
    assert listing.exit_code == 0, listing.output
    header, row = listing.output.strip().splitlines()
    assert "TEST" in header.split() and " loss 2.3 " in row and "accuracy" not in row
    shown = CliRunner().invoke(main, ["show", str(run_dir)])
    assert shown.exit_code == 0, shown.output
    assert "test loss        2.3" in shown.output and "test perplexity  10" in shown.output
    assert os.path.getsize(run_dir / "curves.png") > 0
