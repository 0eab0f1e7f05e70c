"""--strategy zero (ZeRO on Horovod's in-place allreduce and broadcasts) against plain Horovod, on
real ranks: the same weights with SGD momentum, with two backward passes a step and with AdamW, the
clip active; each rank holding 1/N of the optimizer's state; sharded checkpoints, a file a rank,
resumed at the same world size and at another, and consolidated for plain Horovod and ddp."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hvdtrain.runtime import checkpoint
from tests.support.helpers import final_weights, hvdtrain, killed_copy, summary

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
ZERO_1 = [*SGD, "--np", "2", "--strategy", "zero", "--set", "epochs=3", "--set", "keep_checkpoints=2"]
"""Zero stage 1's 3 epochs, keeping epoch 2's checkpoint too: cut back to it, a copy is the run the
resume tests continue, and the run itself the uninterrupted one they end as."""
EPOCH_2 = 2 * 12
"""The step of epoch 2's checkpoint."""


def close(a_dir, b_dir, atol: float = 1e-5) -> float:
    a, b = final_weights(a_dir), final_weights(b_dir)
    assert len(a) == len(b) > 0
    gap = max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))
    assert gap <= atol, f"weights differ by {gap}"
    return gap


def grad_norms(run_dir) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["grad_norm"] for row in rows if "epoch" in row]  # an epoch's mean, before clipping


def test_zero_stages_1_and_2_end_with_plain_horovods_weights_holding_half_the_optimizer_state(
    tmp_path, shared_runs
):
    """SGD with momentum, 3 epochs of 12 clipped steps at np=2: zero-1 and zero-2 against horovod."""
    runs = {
        "zero-1": shared_runs.run(*ZERO_1).run_dir,
        "horovod": shared_runs.run(*SGD, "--np", "2", "--set", "epochs=3").run_dir,
        "zero-2": tmp_path / "zero-2",
    }
    hvdtrain(
        "run",
        *SGD,
        "--np",
        "2",
        "--set",
        "epochs=3",
        "--strategy",
        "zero",
        "--set",
        "zero_stage=2",
        run_dir=runs["zero-2"],
    )
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


def test_two_backward_passes_a_step_accumulate_in_stage_1s_flat_gradient_as_under_plain_horovod(
    tmp_path, shared_runs
):
    """Stage 1's gradients are views into its flat buffer: the second pass adds to the first there.
    Two passes of 16 samples a step end as plain Horovod's one pass of the same 32 (the run the test
    above compares with; test_equivalence: two passes of b are one of 2b under plain Horovod)."""
    args = [*SGD, "--np", "2", "--set", "epochs=3"]
    whole = shared_runs.run(*args).run_dir
    passes = ["--set", "batch_size=16", "--set", "backward_passes_per_step=2"]
    hvdtrain("run", *args, "--strategy", "zero", *passes, run_dir=tmp_path / "zero")
    close(tmp_path / "zero", whole)
    assert summary(tmp_path / "zero")["steps"] == summary(whole)["steps"] == 36


def test_adamw_with_two_parameter_groups_ends_as_under_plain_horovod(tmp_path, shared_runs):
    plain, zero = shared_runs.run(*ADAMW, "--np", "2").run_dir, tmp_path / "zero"
    hvdtrain("run", *ADAMW, "--np", "2", "--strategy", "zero", "--set", "zero_stage=2", run_dir=zero)
    close(zero, plain)
    assert grad_norms(plain)[0] > 1.0, "the clip is active"
    per_rank, whole = summary(zero)["optimizer_state_bytes"], summary(plain)["optimizer_state_bytes"]
    # Adam's two moments, a value each, halved; its step count, a float32 a parameter under horovod and
    # a group under zero; and each group padded by at most one value a moment
    bound = 4 * len(final_weights(plain)) + 2 * 2 * 4
    assert abs(2 * per_rank[0] - whole[0]) <= bound and per_rank[0] == per_rank[1], (per_rank, whole)


def resume(run_dir, np_: int, strategy: str, check: bool = True):
    return hvdtrain(
        "run", "digits-mlp-torch", "--resume", "--np", str(np_), "--strategy", strategy, "--set", "epochs=3",
        run_dir=run_dir, check=check,
    )  # fmt: skip


@pytest.mark.parametrize("resumed_np", [2, 1])
def test_a_sharded_zero_checkpoint_resumes_bit_exact_reshards_and_consolidates_for_horovod_and_ddp(
    resumed_np, tmp_path, shared_runs
):
    """Each rank writes its own file: resumed under zero at the same world size, the run ends bit for
    bit as one never stopped; at another, re-sharded. Plain Horovod and ddp refuse it in one line, and
    resume its consolidated copy, which a user's torch.load reads, to the same weights. The checkpoint
    is epoch 2's of the 3-epoch run, in copies of it cut back to there."""
    straight = shared_runs.run(*ZERO_1).run_dir
    ends = {strategy: tmp_path / strategy for strategy in ("zero", "horovod", "ddp")}
    for run_dir in ends.values():
        killed_copy(straight, run_dir, EPOCH_2, epochs_done=2)
    found = checkpoint.latest(ends["zero"])
    assert found.step == EPOCH_2 and found.files == ("model.pt", "optimizer.0.pt", "optimizer.1.pt")
    assert found.manifest.extra == {"sharded": "zero", "ranks": 2, "zero_stage": 1}
    assert "resuming from" in resume(ends["zero"], resumed_np, "zero").output
    assert summary(ends["zero"])["world_size"] == resumed_np
    if resumed_np == 2:
        for a, b in zip(final_weights(ends["zero"]), final_weights(straight), strict=True):
            np.testing.assert_array_equal(a, b)

    refused = resume(ends["horovod"], resumed_np, "horovod", check=False)
    assert refused.returncode == 2 and refused.output.strip().splitlines() == [
        f"hvdtrain: error: --resume: the checkpoint in {ends['horovod']} is sharded by --strategy zero, "
        f"which alone resumes it; `hvdtrain checkpoint consolidate {ends['horovod']}` makes a whole one "
        "for --strategy horovod"
    ]
    for strategy in ("horovod", "ddp") if resumed_np == 2 else ("horovod",):
        made = hvdtrain("checkpoint", "consolidate", str(ends[strategy]))
        copy = ends[strategy] / "checkpoints" / f"{found.step}-consolidated"
        assert made.output.strip() == f"consolidated: {copy}"
        whole = torch.load(copy / "checkpoint.pt", weights_only=True)
        assert set(whole["optimizer"]["state"]) == set(range(len(whole["model"])))  # a momentum each
        assert resume(ends[strategy], resumed_np, strategy).returncode == 0
        assert summary(ends[strategy])["strategy"] == strategy
        close(ends[strategy], ends["zero"])


def test_a_sharded_checkpoint_missing_a_ranks_file_is_refused_on_resume_and_consolidate(
    tmp_path, shared_runs
):
    run_dir = tmp_path / "run"
    killed_copy(shared_runs.run(*ZERO_1).run_dir, run_dir, EPOCH_2, epochs_done=2)  # epoch 2's alone
    lost = checkpoint.latest(run_dir).path("optimizer.1.pt")
    lost.unlink()
    for argv in (
        ["run", "digits-mlp-torch", "--resume", "--strategy", "zero", "--run-dir", str(run_dir)],
        ["checkpoint", "consolidate", str(run_dir)],
    ):
        refused = hvdtrain(*argv, check=False)
        assert refused.returncode == 2 and refused.output.strip().splitlines() in (
            [f"hvdtrain: error: --resume: {lost} is missing; nothing was changed"],
            [f"hvdtrain: error: {lost} is missing; nothing was written"],
        ), refused.output
    assert sorted(p.name for p in lost.parent.iterdir()) == ["manifest.json", "model.pt", "optimizer.0.pt"]
