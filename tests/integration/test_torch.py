"""PyTorch recipes under Horovod, end to end, on real ranks."""

from __future__ import annotations

import json
import re

import pytest

from hvdtrain.runtime import checkpoint
from tests.support.helpers import (
    EVERY_STEP_PROGRESS,
    PROGRAMS,
    hvdtrain,
    rank_json_lines,
    summary,
    write_tiny_mnist,
)

SUMMARY_KEYS = {
    "recipe",
    "world_size",
    "test_accuracy",
    "final_loss",
    "samples_per_sec",
    "wall_seconds",
    "weights_consistent",
}


@pytest.mark.parametrize(("launcher", "np_"), [("gloo", 2), ("mpi", 2), ("gloo", 1)])
def test_digits_reaches_its_bar(launcher, np_, shared_runs):
    """The gloo x 2 run is also test_ray's reference for bit-equal weights."""
    shared = shared_runs.run(
        "digits-mlp-torch", "--np", str(np_), "--launcher", launcher, env=EVERY_STEP_PROGRESS
    )
    result, run_dir = shared.result, shared.run_dir
    done = summary(run_dir)
    assert done.keys() >= SUMMARY_KEYS
    assert done["world_size"] == np_
    assert done["test_accuracy"] >= 0.95
    assert done["weights_consistent"] is True
    assert done["samples_per_sec"] > 0
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["loss"] < metrics[0]["loss"] / 5
    assert checkpoint.latest(run_dir).path("checkpoint.pt").exists()
    assert list((run_dir / "tensorboard").iterdir())
    assert "summary:" in result.stdout and "test_accuracy=" in result.stdout
    # piped: plain lines, no launcher tags, no exponents; rank 0's progress as lines of their own
    assert "<stdout>:" not in result.output and "<stderr>:" not in result.output
    epoch_lines = [line for line in result.stdout.splitlines() if line.startswith("epoch ")]
    assert not [line for line in epoch_lines if re.search(r"\de[+-]\d", line)], epoch_lines
    # a rate reads 23,970 or, on a busy machine, 987.3
    assert any(
        re.fullmatch(r"epoch 15/15  loss [\d.]+  test_accuracy [\d.]+  lr [\d.]+  [\d,.]+ samples/s", line)
        for line in epoch_lines
    ), epoch_lines
    assert any(
        re.match(r"epoch \d+/15  step \d+/\d+  [\d,.]+ samples/s  ETA \d+:\d\d  loss ", line)
        for line in epoch_lines
    ), epoch_lines


@pytest.mark.parametrize("how", ["path", "module"])
def test_user_script_runs_unchanged_with_its_arguments(how, tmp_path):
    """As `python train.py ARGS` would run it, or `python -m package.train ARGS` (hvdtrain run -m)."""
    script = PROGRAMS / "user_script_torch.py"
    target = [str(script)] if how == "path" else ["tests.integration.programs.user_script_torch", "-m"]
    hvdtrain("run", *target, "--np", "2", "--", "--epochs", "1", "--tag", "a b", run_dir=tmp_path)
    lines = sorted(rank_json_lines(tmp_path), key=lambda line: line["rank"])
    assert [line["rank"] for line in lines] == [0, 1]
    for line in lines:
        assert line["argv"] == ["--epochs", "1", "--tag", "a b"]
        assert line["equal"] is True


def test_mnist_cnn_reads_idx_files(tmp_path):
    data_dir = tmp_path / "mnist"
    data_dir.mkdir()
    write_tiny_mnist(data_dir)
    hvdtrain(
        "run",
        "mnist-cnn-torch",
        "--variant",
        "debug",
        "--np",
        "2",
        "--set",
        f"data_dir={data_dir}",
        "--set",
        "epochs=3",
        run_dir=tmp_path / "run",
    )
    done = summary(tmp_path / "run")
    assert done["test_accuracy"] >= 0.9 and done["weights_consistent"] is True


def test_mnist_without_files_is_one_clear_error(tmp_path):
    result = hvdtrain("run", "mnist-cnn-torch", "--np", "2", "--set", f"data_dir={tmp_path}", check=False)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"hvdtrain: error: MNIST file train-images-idx3-ubyte[.gz] not found in {tmp_path}; "
        "hvdtrain downloads nothing"
    ]


def test_missing_torch_extension_is_one_clear_error(tmp_path):
    shadow = tmp_path / "torch"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    result = hvdtrain("run", "digits-mlp-torch", "--np", "2", check=False, env={"PYTHONPATH": str(tmp_path)})
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "hvdtrain: error: Horovod was built without PyTorch; fix: hvdtrain setup  "
        "(in a checkout: make horovod)"
    ]
