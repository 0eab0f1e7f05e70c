"""What data parallelism must preserve, for every framework and strategy that averages gradients:
2 ranks x batch b train exactly like 1 process x batch 2b, and a resumed run ends where an
uninterrupted one ends."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import final_weights, hvdtrain, summary

EXACT = ["--set", "scale_lr=false", "--set", "momentum=0", "--set", "epochs=3", "--set", "lr=0.1"]


@pytest.mark.parametrize(
    ("recipe", "strategy"),
    [("digits-mlp-torch", "horovod"), ("digits-mlp-tf", "horovod"), ("digits-mlp-torch", "ddp")],
)
def test_two_ranks_equal_one_process_with_twice_the_batch(recipe, strategy, tmp_path):
    """Averaged allreduce + sharding are right iff 2 ranks x batch b == 1 process x batch 2b."""
    common = [recipe, "--strategy", strategy, *EXACT]
    hvdtrain("run", *common, "--np", "2", "--set", "batch_size=16", run_dir=tmp_path / "np2")
    hvdtrain("run", *common, "--np", "1", "--set", "batch_size=32", run_dir=tmp_path / "np1")
    two_ranks, one_process = final_weights(tmp_path / "np2"), final_weights(tmp_path / "np1")
    assert len(two_ranks) == len(one_process) == 4
    for a, b in zip(two_ranks, one_process, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    assert summary(tmp_path / "np2")["steps"] == summary(tmp_path / "np1")["steps"] == 3 * (1347 // 32)


@pytest.mark.parametrize("recipe", ["digits-mlp-torch", "digits-mlp-tf"])
def test_resume_ends_where_an_uninterrupted_run_ends(recipe, tmp_path):
    hvdtrain("run", recipe, "--np", "2", "--set", "epochs=4", run_dir=tmp_path / "straight")
    hvdtrain("run", recipe, "--np", "2", "--set", "epochs=2", run_dir=tmp_path / "split")
    hvdtrain("run", recipe, "--np", "2", "--resume", "--set", "epochs=4", run_dir=tmp_path / "split")
    for a, b in zip(final_weights(tmp_path / "straight"), final_weights(tmp_path / "split"), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
    assert summary(tmp_path / "split")["steps"] == summary(tmp_path / "straight")["steps"]
