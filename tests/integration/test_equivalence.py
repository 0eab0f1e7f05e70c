"""What data parallelism must preserve, for every framework and strategy that averages gradients:
2 ranks x batch b train exactly like 1 process x batch 2b, and a resumed run ends where an
uninterrupted one ends."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.helpers import RESUMABLE_SYNTHETIC_TF, final_weights, hvdtrain, summary, write_tiny_mnist

EXACT = ["--set", "scale_lr=false", "--set", "momentum=0", "--set", "epochs=3", "--set", "lr=0.1"]
EXACT += ["--set", "steps_per_epoch=10"]  # a new permutation each epoch, 10 steps of it


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
    assert summary(tmp_path / "np2")["steps"] == summary(tmp_path / "np1")["steps"] == 3 * 10


@pytest.mark.parametrize(
    ("recipe", "args"),
    [
        # one recipe per loop: the other recipes of a loop differ only in model and data, which the
        # in-process tests resume bit for bit too (tests/unit/test_loop.py)
        ("digits-mlp-torch", ["--set", "steps_per_epoch=8"]),  # the torch loop
        ("digits-mlp-tf", ["--set", "steps_per_epoch=8"]),  # Keras fit
        ("synthetic-tf", RESUMABLE_SYNTHETIC_TF),  # the custom tf.function loop, SGD with momentum
    ],
)
def test_every_loop_resumes_bit_exact(recipe, args, tmp_path, shared_runs):
    """The uninterrupted synthetic-tf run is also test_tensorflow's custom-loop run over gloo."""
    if recipe.startswith("mnist"):
        write_tiny_mnist(tmp_path)
        args = [*args, "--set", f"data_dir={tmp_path}"]
    run = ["run", recipe, "--np", "2", "--launcher", "gloo"]
    straight = shared_runs.run(*run[1:], *args, "--set", "epochs=4").run_dir
    hvdtrain(*run, *args, "--set", "epochs=2", run_dir=tmp_path / "split")
    hvdtrain(*run, "--resume", "--set", "epochs=4", run_dir=tmp_path / "split")
    for a, b in zip(final_weights(straight), final_weights(tmp_path / "split"), strict=True):
        np.testing.assert_array_equal(a, b)
    assert summary(tmp_path / "split")["steps"] == summary(straight)["steps"]
