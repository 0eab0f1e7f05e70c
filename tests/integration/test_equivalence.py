"""What data parallelism must preserve, for every framework and strategy that averages gradients:
2 ranks x batch b train exactly like 1 process x batch 2b, and like 2 ranks accumulating k batches
of b/k, and a resumed run ends where an uninterrupted one ends."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hvdtrain.data import write_digits_images
from tests.support.helpers import (
    PROGRAMS,
    RESUMABLE_SYNTHETIC_TF,
    final_weights,
    hvdtrain,
    interrupted_after,
    killed_copy,
    metric_records,
    summary,
)

EXACT = ["--set", "scale_lr=false", "--set", "momentum=0", "--set", "epochs=3", "--set", "lr=0.1"]
EXACT += ["--set", "steps_per_epoch=10"]  # a new permutation each epoch, 10 steps of it


ONE_PROCESS = "horovod"
"""The strategy of the one process every strategy's two ranks are compared with: alone, a process has
no peer to average with, and trains the same under ddp as under horovod (the BatchNorm test below
compares ddp with it too); one run of it serves them all."""


def exact_run(shared_runs, recipe: str, strategy: str, np_: int, *sets: str):
    """A run of EXACT on np_ ranks (--set KEY=VALUE for each of sets), shared across the tests below."""
    args = [recipe, "--strategy", strategy, *EXACT, "--np", str(np_)]
    return shared_runs.run(*args, *(item for value in sets for item in ("--set", value))).run_dir


@pytest.mark.parametrize(
    ("recipe", "strategy"),
    [("digits-mlp-torch", "horovod"), ("digits-mlp-tf", "horovod"), ("digits-mlp-torch", "ddp")],
)
def test_two_ranks_equal_one_process_with_twice_the_batch(recipe, strategy, shared_runs):
    """Averaged allreduce + sharding are right iff 2 ranks x batch b == 1 process x batch 2b."""
    np2 = exact_run(shared_runs, recipe, strategy, 2, "batch_size=16")
    np1 = exact_run(shared_runs, recipe, ONE_PROCESS, 1, "batch_size=32")
    two_ranks, one_process = final_weights(np2), final_weights(np1)
    assert len(two_ranks) == len(one_process) == 4
    for a, b in zip(two_ranks, one_process, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    assert summary(np2)["steps"] == summary(np1)["steps"] == 3 * 10


SYNC_BN = [str(PROGRAMS / "batchnorm_torch.py"), "--set", "lr=0.1"]
"""Three BatchNorm layers (2d, 2d, 1d), ten plain SGD steps."""


@pytest.mark.parametrize("strategy", ["horovod", "ddp"])
def test_synchronized_batchnorm_on_two_ranks_equals_one_process_with_twice_the_batch(strategy, shared_runs):
    """With sync_batch_norm every layer normalizes over both ranks' 16 samples, as one process does over
    32: the weights and running statistics agree. Without it, each rank's own 16 make them differ."""
    synced = ["--set", "batch_size=16", "--set", "sync_batch_norm=true"]
    np2 = shared_runs.run(*SYNC_BN, "--strategy", strategy, "--np", "2", *synced).run_dir
    np1 = shared_runs.run(*SYNC_BN, "--np", "1", "--set", "batch_size=32").run_dir
    assert len(final_weights(np1)) == 21  # 12 parameters, 9 BatchNorm buffers
    for a, b in zip(final_weights(np2), final_weights(np1), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    if strategy == "horovod":
        apart = shared_runs.run(*SYNC_BN, "--np", "2", "--set", "batch_size=16").run_dir
        gap = max(
            float(np.abs(a - b).max()) for a, b in zip(final_weights(apart), final_weights(np1), strict=True)
        )
        assert gap > 1e-2


CLIPPED = ["clip_grad_norm=0.5", "lr_schedule=cosine", "min_lr=0.01", "log_step_lr=true"]
"""Clipping that acts on most steps, under a cosine decay logged step by step."""


@pytest.mark.parametrize(
    ("recipe", "strategy", "launcher"),
    [
        ("digits-mlp-torch", "horovod", "gloo"),
        ("digits-mlp-torch", "horovod", "mpi"),
        ("digits-mlp-tf", "horovod", "gloo"),
        ("digits-mlp-torch", "ddp", None),
    ],
)
def test_the_averaged_gradient_is_clipped_and_the_lr_decays_alike_on_two_ranks(
    recipe, strategy, launcher, shared_runs
):
    """2 ranks x batch b with clipping == 1 process x batch 2b with clipping: what is clipped is the
    average over ranks, after the allreduce. The lr follows the same cosine on both."""
    sets = [item for value in CLIPPED for item in ("--set", value)]
    on = ["--launcher", launcher] if launcher else []
    args = [recipe, "--strategy", strategy, *EXACT, *sets]
    one = [recipe, "--strategy", ONE_PROCESS, *EXACT, *sets]
    np2 = shared_runs.run(*args, *on, "--np", "2", "--set", "batch_size=16").run_dir
    np1 = shared_runs.run(*one, "--np", "1", "--set", "batch_size=32").run_dir
    for a, b in zip(final_weights(np2), final_weights(np1), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    unclipped = final_weights(exact_run(shared_runs, recipe, ONE_PROCESS, 1, "batch_size=32"))
    assert max(float(np.abs(a - b).max()) for a, b in zip(final_weights(np1), unclipped, strict=True)) > 1e-3
    lrs = [r["lr"] for r in metric_records(np2) if "step" in r]
    assert lrs == pytest.approx(
        [0.01 + 0.09 * (1 + math.cos(math.pi * s / 30)) / 2 for s in range(30)], rel=1e-6
    )
    if recipe.endswith("torch"):  # the norm before clipping, which torch hands back
        assert all(r["grad_norm"] > 0.5 for r in metric_records(np2) if "epoch" in r)


@pytest.mark.parametrize("recipe", ["digits-mlp-torch", "digits-mlp-tf"])
def test_backward_passes_k_times_batch_b_equal_batch_k_b(recipe, shared_runs):
    """Accumulating k batches of b before each allreduce is the same step as one batch of k*b (the
    batch-16 run is the one the test above compares with 1 process)."""
    accumulated = exact_run(shared_runs, recipe, "horovod", 2, "batch_size=8", "backward_passes_per_step=2")
    whole = exact_run(shared_runs, recipe, "horovod", 2, "batch_size=16")
    for a, b in zip(final_weights(accumulated), final_weights(whole), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    assert summary(accumulated)["steps"] == summary(whole)["steps"] == 3 * 10


FROM_DISK = ["--set", "steps_per_epoch=8", "--set", "channels=8"]


@pytest.mark.parametrize(
    ("recipe", "args", "every", "at", "into"),
    [
        # one recipe per loop, each resumed from a step checkpoint within epoch 2; files on disk
        # through DataLoader workers and through tf.data, the custom loop on arrays (in-process,
        # tests/inprocess/test_loop.py resumes every loop on either kind of data)
        ("image-folder-torch", FROM_DISK, 4, 12, 4),
        ("image-folder-tf", FROM_DISK, 4, 12, 4),  # Keras fit
        ("synthetic-tf", RESUMABLE_SYNTHETIC_TF, 2, 4, 1),  # the custom tf.function loop
        ("image-folder-torch", [*FROM_DISK, "shards"], 4, 12, 4),  # tar shards: each rank its run of them
    ],
)
def test_every_loop_resumes_bit_exact_from_a_step_checkpoint(
    recipe, args, every, at, into, tmp_path, shared_runs
):
    """Killed `into` steps into epoch 2, right after the step checkpoint of step `at`; the resumed
    run ends with the uninterrupted run's weights and epoch losses. The uninterrupted run writes the
    step checkpoints, and a copy of it cut back to step `at` is the killed run (the custom loop's
    also asks that the checkpoints change nothing: its uninterrupted run, without them, is also
    test_tensorflow's custom-loop run over gloo)."""
    if recipe.startswith("image-folder"):
        write_digits_images(tmp_path / "pngs")
        data_dir = tmp_path / "pngs"
        if "shards" in args:
            args = [arg for arg in args if arg != "shards"]
            hvdtrain("data", "pack", str(data_dir), str(tmp_path / "shards"), "--samples-per-shard", "200")
            data_dir = tmp_path / "shards"
        args = [*args, "--set", f"data_dir={data_dir}"]
    run = ["run", recipe, "--np", "2", "--launcher", "gloo"]
    within = ["--set", f"checkpoint_every_steps={every}", "--set", "keep_checkpoints=9"]
    final = f"epochs={4 if recipe == 'synthetic-tf' else 3}"  # synthetic-tf's straight run is shared
    split = tmp_path / "split"
    if recipe == "synthetic-tf":
        straight = shared_runs.run(*run[1:], *args, "--set", final).run_dir
        hvdtrain(*run, *args, *within, "--set", "epochs=2", run_dir=split)
        interrupted_after(split, at)
    else:
        straight = tmp_path / "straight"
        hvdtrain(*run, *args, *within, "--set", final, run_dir=straight)
        killed_copy(straight, split, at, epochs_done=1)
    resumed = hvdtrain(*run, "--resume", "--set", final, run_dir=split)
    assert f"{into} steps into epoch 2" in resumed.output
    for a, b in zip(final_weights(straight), final_weights(split), strict=True):
        np.testing.assert_array_equal(a, b)
    assert summary(split)["steps"] == summary(straight)["steps"]
    losses = {r["epoch"]: r["loss"] for r in metric_records(split) if "epoch" in r}
    expected = {r["epoch"]: r["loss"] for r in metric_records(straight) if "epoch" in r}
    if recipe == "image-folder-tf":  # fit's own loss is a float32 running mean, resumed part way
        assert losses == pytest.approx(expected, rel=1e-6)
    else:
        assert losses == expected
