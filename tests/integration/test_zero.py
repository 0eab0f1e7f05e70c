"""--strategy zero (ZeRO on Horovod's reducescatter and allgather) against plain Horovod, on real
ranks: the same weights with SGD momentum and with AdamW, the clip active; each rank holding 1/N of
the optimizer's state; checkpoints in plain Horovod's format, resumed under either strategy and at
another world size."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from tests.support.helpers import final_weights, hvdtrain, summary

SGD = ["digits-mlp-torch", "--launcher", "gloo", "--set", "steps_per_epoch=12", "--set", "clip_grad_norm=0.5"]
"""SGD with momentum 0.9: 12 steps an epoch, every one clipped (the gradient's norm is above 0.5)."""
ADAMW = [
    "gpt-torch",
    "--variant",
    "debug",
    "--launcher",
    "gloo",
    "--set",
    "epochs=1",
    "--set",
    "steps_per_epoch=20",
]
"""AdamW with weight decay on the matrices only (two parameter groups), clipped to 1.0, 20 steps."""


def close(a_dir, b_dir, atol: float = 1e-5) -> float:
    a, b = final_weights(a_dir), final_weights(b_dir)
    assert len(a) == len(b) > 0
    gap = max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))
    assert gap <= atol, f"weights differ by {gap}"
    return gap


def grad_norms(run_dir) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["grad_norm"] for row in rows if "epoch" in row]  # an epoch's mean, before clipping


def test_zero_stages_1_and_2_end_with_plain_horovods_weights_holding_half_the_optimizer_state(tmp_path):
    """SGD with momentum, 3 epochs of 12 clipped steps at np=2: zero-1 and zero-2 against horovod."""
    runs = {}
    for name, extra in (
        ("horovod", []),
        ("zero-1", ["--strategy", "zero"]),
        ("zero-2", ["--strategy", "zero"]),
    ):
        stage = ["--set", "zero_stage=2"] if name == "zero-2" else []
        runs[name] = tmp_path / name
        hvdtrain("run", *SGD, "--np", "2", "--set", "epochs=3", *extra, *stage, run_dir=runs[name])
    plain = summary(runs["horovod"])
    assert min(grad_norms(runs["horovod"])) > 0.5, "the clip is active"
    for name in ("zero-1", "zero-2"):
        close(runs[name], runs["horovod"])
        sharded = summary(runs[name])
        assert sharded["strategy"] == "zero" and sharded["weights_consistent"] is True
        assert sharded["steps"] == plain["steps"] == 36
        # SGD's momentum: one value a parameter, split by element (38,440 bytes of a 9,610-value MLP)
        assert plain["optimizer_state_bytes"] == [38440, 38440]
        assert sharded["optimizer_state_bytes"] == [19220, 19220], sharded["optimizer_state_bytes"]
        assert sharded["param_bytes"] == plain["param_bytes"]


def test_adamw_with_two_parameter_groups_ends_as_under_plain_horovod(tmp_path):
    plain, zero = tmp_path / "horovod", tmp_path / "zero"
    hvdtrain("run", *ADAMW, "--np", "2", run_dir=plain)
    hvdtrain("run", *ADAMW, "--np", "2", "--strategy", "zero", "--set", "zero_stage=2", run_dir=zero)
    close(zero, plain)
    assert grad_norms(plain)[0] > 1.0, "the clip is active"
    per_rank, whole = summary(zero)["optimizer_state_bytes"], summary(plain)["optimizer_state_bytes"]
    # Adam's two moments, a value each, halved; its step count, a float32 a parameter under horovod and
    # a group under zero; and each group padded by at most one value a moment
    bound = 4 * len(final_weights(plain)) + 2 * 2 * 4
    assert abs(2 * per_rank[0] - whole[0]) <= bound and per_rank[0] == per_rank[1], (per_rank, whole)


@pytest.mark.parametrize("resumed_np", [2, 1])
def test_a_zero_checkpoint_resumes_under_either_strategy_at_any_world_size(resumed_np, tmp_path, shared_runs):
    """A zero run's checkpoint is plain Horovod's format: resumed under horovod and under zero, at the
    world size it was written at and at another (re-sharded), the two end alike."""
    written = shared_runs.run(*SGD, "--np", "2", "--strategy", "zero", "--set", "epochs=2").run_dir
    ends = {}
    for strategy in ("horovod", "zero"):
        ends[strategy] = tmp_path / strategy
        shutil.copytree(written, ends[strategy])
        resumed = hvdtrain(
            "run",
            "digits-mlp-torch",
            "--resume",
            "--np",
            str(resumed_np),
            "--strategy",
            strategy,
            "--set",
            "epochs=3",
            run_dir=ends[strategy],
        )
        assert "resuming from" in resumed.output
        assert summary(ends[strategy])["world_size"] == resumed_np
    close(ends["zero"], ends["horovod"])
