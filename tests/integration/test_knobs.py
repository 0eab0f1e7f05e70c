"""Every Horovod knob of the config, on real ranks, with numbers (accumulation: test_equivalence)."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch

from hvdtrain.recipes import digits_mlp_torch
from hvdtrain.runtime import checkpoint
from tests.support.helpers import PROGRAMS, hvdtrain, metric_records, summary


@pytest.mark.parametrize("recipe", ["digits-mlp-torch", "digits-mlp-tf"])
def test_fp16_allreduce_reaches_the_bar(recipe, tmp_path):
    hvdtrain(
        "run", recipe, "--np", "2", "--launcher", "gloo", "--set", "fp16_allreduce=true", run_dir=tmp_path
    )
    done = summary(tmp_path)
    assert done["test_accuracy"] >= 0.95 and done["weights_consistent"] is True


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


def test_warmup_lr_per_step_follows_the_schedule_and_the_timeline_has_every_gradient(tmp_path):
    hvdtrain(
        "run", "digits-mlp-torch", "-np", "2", "--launcher", "gloo", "--cycle-time-ms", "2",
        "--timeline-filename", str(tmp_path / "timeline.json"),  # horovodrun's spelling
        "--set", "warmup_epochs=1", "--set", "lr=0.05", "--set", "steps_per_epoch=10", "--set", "epochs=3",
        run_dir=tmp_path,
    )  # fmt: skip
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "step" in r]
    assert [r["step"] for r in steps] == list(range(11))
    assert [r["lr"] for r in steps] == pytest.approx([0.05 + 0.05 * s / 10 for s in range(11)])
    assert [r["lr"] for r in records if "epoch" in r] == pytest.approx([0.095, 0.1, 0.1])
    epochs = [r for r in records if "epoch" in r]
    assert epochs[-1]["loss"] < epochs[0]["loss"]
    # Horovod's timeline: a trace row per tensor, and for every gradient one allreduce per step
    events = json.loads((tmp_path / "timeline.json").read_text())
    rows = {
        e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name" and "name" in e["args"]
    }
    allreduces = Counter(
        rows[e["pid"]] for e in events if e.get("ph") == "B" and e.get("name") == "ALLREDUCE"
    )
    config = digits_mlp_torch.RECIPE.make_config(None)
    gradients = {f"allreduce.{name}" for name, _ in digits_mlp_torch.build(config).model.named_parameters()}
    assert gradients and {name: allreduces[name] for name in gradients} == dict.fromkeys(gradients, 30)


@pytest.mark.parametrize(
    ("recipe", "precision", "strategy", "launcher"),
    [
        ("digits-mlp-torch", "fp16", "horovod", "gloo"),
        ("digits-mlp-torch", "bf16", "horovod", "mpi"),
        ("digits-mlp-torch", "fp16", "ddp", None),
        ("digits-mlp-tf", "fp16", "horovod", "gloo"),
        ("digits-mlp-tf", "bf16", "horovod", "gloo"),
    ],
)
def test_mixed_precision_with_clipping_reaches_the_bar(recipe, precision, strategy, launcher, tmp_path):
    """fp16 steps in Horovod's order (synchronize, unscale the average, clip, step without a second
    synchronize), so every rank skips the same steps and keeps the same loss scale: the weights stay
    equal, and the scale is in the checkpoint."""
    on = ["--launcher", launcher] if launcher else []
    sets = ["--set", f"precision={precision}", "--set", "clip_grad_norm=1"]
    hvdtrain("run", recipe, "--np", "2", "--strategy", strategy, *on, *sets, run_dir=tmp_path)
    done = summary(tmp_path)
    assert done["test_accuracy"] >= 0.95 and done["weights_consistent"] is True
    assert done["compute_dtype"] == {"bf16": "bfloat16", "fp16": "float16"}[precision]
    if recipe.endswith("torch"):
        epochs = [r for r in metric_records(tmp_path) if "epoch" in r]
        assert all(0 < r["grad_norm"] < 100 for r in epochs), "the norm of the unscaled gradient"
        if precision == "fp16":
            state = torch.load(checkpoint.latest(tmp_path).path("checkpoint.pt"), weights_only=True)
            assert state["scaler"]["scale"] > 0
    elif precision == "fp16":
        import zipfile

        with zipfile.ZipFile(checkpoint.latest(tmp_path).path("checkpoint.keras")) as archive:
            assert "LossScaleOptimizer" in archive.read("config.json").decode(), "its scale is saved"


def test_a_compiled_model_trains_on_two_ranks_to_the_eager_runs_numbers(tmp_path):
    """torch.compile on each rank (inductor, the machine's C++ compiler): Horovod's gradient hooks
    fire on the compiled backward, and the weights stay the same on both ranks."""
    hvdtrain(
        "run", "digits-mlp-torch", "--np", "2", "--launcher", "gloo", "--set", "epochs=3",
        "--set", "compile=true", run_dir=tmp_path,
    )  # fmt: skip
    done = summary(tmp_path)
    assert done["weights_consistent"] is True and done["test_accuracy"] >= 0.9
    assert json.loads((tmp_path / "config.json").read_text())["compile"] is True


def test_an_overflow_on_one_rank_is_skipped_by_every_rank_and_halves_the_loss_scale(tmp_path):
    """fp16: rank 1's fifth step overflows (tests/integration/programs/one_rank_blows_up_torch.py).
    The average is inf everywhere, every rank skips that step and halves the scale (65536 -> 32768), and the
    weights stay the same on both; the scale is in the checkpoint. Under zero and fsdp the inf lands
    in one rank's slice only: the ranks agree on it, and end with plain Horovod's weights."""
    weights = {}
    for strategy, written in (("horovod", "checkpoint.pt"), ("zero", "model.pt"), ("fsdp", "checkpoint.pt")):
        run_dir = tmp_path / strategy
        launcher = [] if strategy == "fsdp" else ["--launcher", "gloo"]
        hvdtrain(
            "run", str(PROGRAMS / "one_rank_blows_up_torch.py"), "--np", "2", *launcher,
            "--strategy", strategy, run_dir=run_dir,
        )  # fmt: skip
        done = summary(run_dir)
        assert done["weights_consistent"] is True and done["compute_dtype"] == "float16"
        state = torch.load(checkpoint.latest(run_dir).path(written), weights_only=True)
        assert state["scaler"]["scale"] == 32768.0 and state["step"] == 10
        weights[strategy] = [tensor.numpy() for tensor in state["model"].values()]
    for sharded in ("zero", "fsdp"):
        for a, b in zip(weights[sharded], weights["horovod"], strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
