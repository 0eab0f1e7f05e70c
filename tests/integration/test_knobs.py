"""Every Horovod knob of the config, on real ranks, with numbers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.support.helpers import final_weights, hvdtrain, summary


@pytest.mark.parametrize("recipe", ["digits-mlp-torch", "digits-mlp-tf"])
def test_fp16_allreduce_reaches_the_bar(recipe, tmp_path):
    hvdtrain(
        "run", recipe, "--np", "2", "--launcher", "gloo", "--set", "fp16_allreduce=true", run_dir=tmp_path
    )
    done = summary(tmp_path)
    assert done["test_accuracy"] >= 0.95 and done["weights_consistent"] is True


@pytest.mark.parametrize("recipe", ["digits-mlp-torch", "digits-mlp-tf"])
def test_backward_passes_k_times_batch_b_equal_batch_k_b(recipe, tmp_path):
    """Accumulating k batches of b before each allreduce is the same step as one batch of k*b."""
    common = ["--np", "2", "--launcher", "gloo", "--set", "momentum=0", "--set", "epochs=2"]
    common += ["--set", "steps_per_epoch=8"]
    common += ["--set", "scale_lr=false", "--set", "lr=0.1"]
    hvdtrain(
        "run",
        recipe,
        *common,
        "--set",
        "batch_size=8",
        "--set",
        "backward_passes_per_step=4",
        run_dir=tmp_path / "k",
    )
    hvdtrain("run", recipe, *common, "--set", "batch_size=32", run_dir=tmp_path / "kb")
    accumulated, whole = final_weights(tmp_path / "k"), final_weights(tmp_path / "kb")
    for a, b in zip(accumulated, whole, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    assert summary(tmp_path / "k")["steps"] == summary(tmp_path / "kb")["steps"]


def test_adasum_reaches_the_bar(tmp_path):
    hvdtrain(
        "run",
        "digits-mlp-torch",
        "--np",
        "2",
        "--launcher",
        "mpi",  # Horovod's Adasum on CPU runs over MPI; gloo is refused before any rank starts
        "--set",
        "reduce_op=adasum",
        run_dir=tmp_path,
    )
    done = summary(tmp_path)
    assert done["test_accuracy"] >= 0.95 and done["weights_consistent"] is True
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["lr"] == pytest.approx(0.05), (
        "Adasum: the learning rate is not scaled by the world size"
    )


def test_warmup_lr_per_step_follows_the_schedule(tmp_path):
    hvdtrain(
        "run",
        "digits-mlp-torch",
        "--np",
        "2",
        "--launcher",
        "gloo",
        "--set",
        "warmup_epochs=1",
        "--set",
        "lr=0.05",
        "--set",
        "steps_per_epoch=10",
        "--set",
        "epochs=3",
        run_dir=tmp_path,
    )
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "step" in r]
    assert [r["step"] for r in steps] == list(range(11))
    assert [r["lr"] for r in steps] == pytest.approx([0.05 + 0.05 * s / 10 for s in range(11)])
    assert [r["lr"] for r in records if "epoch" in r] == pytest.approx([0.095, 0.1, 0.1])
    epochs = [r for r in records if "epoch" in r]
    assert epochs[-1]["loss"] < epochs[0]["loss"]
