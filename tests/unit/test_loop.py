"""The training loops in one process (a single-process backend, no Horovod): the schedule, gradient
accumulation, checkpoints and resume, fast enough to run often. The multi-rank tier
(tests/integration) asserts the same across real ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from hvdtrain.runtime import torch as torch_runtime  # noqa: E402
from recipes import digits_mlp_torch  # noqa: E402


def train_torch(run_dir: Path, resume: bool = False, **changes) -> dict:
    config = digits_mlp_torch.Config(**{"epochs": 3, **changes})
    backend = torch_runtime.LocalTorch()
    return torch_runtime.run(digits_mlp_torch.build, config, backend, run_dir, "digits-mlp-torch", resume)


def parameters(run_dir: Path) -> dict:
    return torch.load(run_dir / torch_runtime.CHECKPOINT, weights_only=True)["model"]


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_torch_loop_learns_and_counts_steps(tmp_path):
    done = train_torch(tmp_path, epochs=4)
    epochs = [r for r in records(tmp_path) if "epoch" in r]
    assert done["test_accuracy"] >= 0.9 and done["weights_consistent"] is True
    assert epochs[-1]["loss"] < epochs[0]["loss"] / 3
    assert done["steps"] == 4 * (1347 // 32) == torch.load(tmp_path / "checkpoint.pt")["step"]


def test_accumulating_k_batches_equals_one_batch_k_times_larger(tmp_path):
    common = {"momentum": 0.0, "lr": 0.1, "epochs": 2}
    train_torch(tmp_path / "k", batch_size=8, backward_passes_per_step=4, **common)
    train_torch(tmp_path / "one", batch_size=32, **common)
    accumulated, whole = parameters(tmp_path / "k"), parameters(tmp_path / "one")
    for name in whole:
        torch.testing.assert_close(accumulated[name], whole[name], atol=1e-5, rtol=0)


def test_resume_equals_the_uninterrupted_run_bit_for_bit(tmp_path):
    train_torch(tmp_path / "straight", epochs=4)
    train_torch(tmp_path / "split", epochs=2)
    resumed = train_torch(tmp_path / "split", resume=True, epochs=4)
    straight, split = parameters(tmp_path / "straight"), parameters(tmp_path / "split")
    for name in straight:
        assert torch.equal(straight[name], split[name]), name
    assert resumed["steps"] == train_torch(tmp_path / "again", epochs=4)["steps"]


def test_torch_warmup_ramps_per_step_to_the_scaled_lr(tmp_path):
    """A world size of 4 seen by the schedule (the backend still one process): the ramp is per step."""
    backend = torch_runtime.LocalTorch()
    backend.size = 4  # 4 shards; this process trains shard 0, so the LR is the 4-rank schedule's
    config = digits_mlp_torch.Config(epochs=2, lr=0.05, warmup_epochs=1, steps_per_epoch=8)
    torch_runtime.run(digits_mlp_torch.build, config, backend, tmp_path, "digits-mlp-torch")
    lrs = [r["lr"] for r in records(tmp_path) if "step" in r]
    assert lrs == pytest.approx([0.05 + (0.2 - 0.05) * step / 8 for step in range(9)])
    # an epoch record carries the LR of its last step
    assert [r["lr"] for r in records(tmp_path) if "epoch" in r] == pytest.approx([0.05 + 0.15 * 7 / 8, 0.2])


KERAS_RUN = """
import json, sys
from pathlib import Path
from hvdtrain.runtime import tensorflow as tf_runtime
from recipes import digits_mlp_tf

loop, run_dir = sys.argv[1], Path(sys.argv[2])

def build(config):
    task = digits_mlp_tf.build(config)
    task.loop = loop
    return task

backend = tf_runtime.LocalKeras()
backend.size = 2  # the schedule of 2 ranks; this process trains shard 0
config = digits_mlp_tf.Config(epochs=2, lr=0.05, warmup_epochs=1, steps_per_epoch=6, checkpoint=False)
print(json.dumps(tf_runtime.run(build, config, backend, run_dir, "digits-mlp-tf")))
"""


@pytest.mark.parametrize("loop", ["fit", "custom"])
def test_keras_loops_share_the_schedule(tmp_path, loop):
    """Its own interpreter: torch's TensorBoard writer hides TensorFlow from TensorBoard in this one."""
    pytest.importorskip("tensorflow")
    done = subprocess.run(
        [sys.executable, "-c", KERAS_RUN, loop, str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    lrs = [r["lr"] for r in records(tmp_path) if "step" in r]
    assert lrs == pytest.approx([0.05 + 0.05 * step / 6 for step in range(7)], rel=1e-6)
    assert summary["steps"] == 12
