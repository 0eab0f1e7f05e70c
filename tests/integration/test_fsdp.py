"""--strategy fsdp (FSDP2's fully_shard, started by torchrun) against plain Horovod, on real ranks:
the same weights with SGD momentum and with AdamW (a tied embedding, a block a layer), the clip
active; each rank holding half the parameters and optimizer state; whole checkpoints that resume
under fsdp bit for bit, and under horovod and fsdp at another world size."""

from __future__ import annotations

import numpy as np

from tests.integration.test_zero import ADAMW, EPOCH_2, SGD, close, grad_norms
from tests.support.helpers import final_weights, hvdtrain, killed_copy, summary

TORCHRUN = [arg for arg in SGD if arg not in ("--launcher", "gloo")]
"""fsdp starts its ranks with torchrun: no --launcher."""
FSDP = [*TORCHRUN, "--np", "2", "--strategy", "fsdp", "--set", "epochs=3", "--set", "keep_checkpoints=2"]
"""fsdp's 3 epochs, keeping epoch 2's checkpoint too: cut back to it, a copy is the run the resume
test continues, and the run itself the uninterrupted one it ends as."""


def test_fsdp_ends_with_plain_horovods_weights_holding_half_the_parameters_and_state(shared_runs):
    plain = shared_runs.run(*SGD, "--np", "2", "--set", "epochs=3").run_dir
    sharded = shared_runs.run(*FSDP).run_dir
    close(sharded, plain)
    assert min(grad_norms(plain)) > 0.5, "the clip is active"
    found, whole = summary(sharded), summary(plain)
    assert found["strategy"] == "fsdp" and found["weights_consistent"] is True and found["steps"] == 36
    assert found["optimizer_state_bytes"] == [19220, 19220], found["optimizer_state_bytes"]
    assert found["param_bytes"] == [19220, 19220] and whole["param_bytes"] == [38440, 38440]


def test_fsdp_adamw_on_gpt_blocks_ends_as_under_plain_horovod(shared_runs):
    plain = shared_runs.run(*ADAMW, "--np", "2").run_dir
    torchrun = [arg for arg in ADAMW if arg not in ("--launcher", "gloo")]
    sharded = shared_runs.run(*torchrun, "--np", "2", "--strategy", "fsdp").run_dir
    close(sharded, plain)
    per_rank, whole = summary(sharded)["optimizer_state_bytes"], summary(plain)["optimizer_state_bytes"]
    # each moment halved, with a rank's share of a parameter of odd rows rounded up; Adam's step
    # count a parameter on each rank
    assert per_rank[0] + per_rank[1] <= whole[0] + 4 * len(final_weights(plain)), (per_rank, whole)
    assert abs(per_rank[0] - whole[0] / 2) <= 0.01 * whole[0], (per_rank, whole)


def test_an_fsdp_checkpoint_resumes_bit_exact_and_under_horovod_and_fsdp_at_another_world_size(
    tmp_path, shared_runs
):
    """Epoch 2's checkpoint of the 3-epoch run, in copies of the run cut back to there."""
    straight = shared_runs.run(*FSDP).run_dir
    ends = {}
    for name, np_, strategy in (("same", 2, "fsdp"), ("fsdp-1", 1, "fsdp"), ("horovod-1", 1, "horovod")):
        ends[name] = tmp_path / name
        killed_copy(straight, ends[name], EPOCH_2, epochs_done=2)
        resumed = hvdtrain(
            "run", "digits-mlp-torch", "--resume", "--np", str(np_), "--strategy", strategy,
            "--set", "epochs=3", run_dir=ends[name],
        )  # fmt: skip
        assert "resuming from" in resumed.output and summary(ends[name])["world_size"] == np_
    for a, b in zip(final_weights(ends["same"]), final_weights(straight), strict=True):
        np.testing.assert_array_equal(a, b)
    close(ends["fsdp-1"], ends["horovod-1"])


def test_at_four_ranks_on_two_cores_zero_2_and_fsdp_end_with_plain_horovods_weights(shared_runs):
    """20 clipped SGD steps; each rank holding a quarter of the state: under zero within one padded
    value a rank, under fsdp by whole rows (a 10-row matrix splits 3, 3, 3, 1), the four adding up."""
    quarter = ["--np", "4", "--set", "epochs=2"]
    plain = shared_runs.run(*SGD, *quarter).run_dir
    zero = shared_runs.run(*SGD, *quarter, "--strategy", "zero", "--set", "zero_stage=2").run_dir
    sharded = shared_runs.run(*TORCHRUN, *quarter, "--strategy", "fsdp").run_dir
    whole = summary(plain)["optimizer_state_bytes"][0]
    for run_dir in (zero, sharded):
        close(run_dir, plain)
        found = summary(run_dir)
        assert found["world_size"] == 4 and found["steps"] == 20  # 10 an epoch: the data ends first
        held = found["optimizer_state_bytes"]
        if run_dir == zero:
            assert all(abs(part - whole / 4) <= 4 * 4 for part in held), held
        else:
            assert sum(held) == whole and max(held) <= 1.05 * whole / 4, held
