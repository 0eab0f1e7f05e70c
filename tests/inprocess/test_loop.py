"""The training loops in one process (a single-process backend, no Horovod): the schedule, gradient
accumulation, checkpoints and resume, fast enough to run often. The multi-rank tier
(tests/integration) asserts the same across real ranks."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hvdtrain.recipes import digits_mlp_torch  # noqa: E402
from hvdtrain.runtime import checkpoint  # noqa: E402
from hvdtrain.runtime import torch as torch_runtime  # noqa: E402
from hvdtrain.runtime.torch.batches import elastic_indices  # noqa: E402
from tests.support.helpers import interrupted_after  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
"""Where the Keras tests' own interpreters run, so that they import tests.support."""


def train_torch(run_dir: Path, resume: bool = False, **changes) -> dict:
    config = digits_mlp_torch.Config(**{"epochs": 3, **changes})
    backend = torch_runtime.LocalTorch()
    return torch_runtime.run(digits_mlp_torch.build, config, backend, run_dir, "digits-mlp-torch", resume)


def saved(run_dir: Path) -> dict:
    return torch.load(checkpoint.latest(run_dir).path("checkpoint.pt"), weights_only=True)


def parameters(run_dir: Path) -> dict:
    return saved(run_dir)["model"]


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_torch_loop_learns_and_counts_steps(tmp_path):
    done = train_torch(tmp_path, epochs=4)
    epochs = [r for r in records(tmp_path) if "epoch" in r]
    assert done["test_accuracy"] >= 0.9 and done["weights_consistent"] is True
    assert done["compute_dtype"] == "float32"
    assert epochs[-1]["loss"] < epochs[0]["loss"] / 3
    assert done["steps"] == 4 * (1347 // 32) == saved(tmp_path)["step"]


def test_a_compiled_model_trains_like_the_eager_one_and_keeps_its_parameter_names(tmp_path):
    from torch._dynamo.utils import counters

    compiled_before = counters["stats"]["unique_graphs"]
    done = train_torch(tmp_path / "compiled", epochs=2, compile=True)
    assert counters["stats"]["unique_graphs"] > compiled_before, "inductor compiled the model"
    train_torch(tmp_path / "eager", epochs=2)
    compiled, eager = parameters(tmp_path / "compiled"), parameters(tmp_path / "eager")
    assert compiled.keys() == eager.keys() == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for name in eager:
        torch.testing.assert_close(compiled[name], eager[name], atol=1e-4, rtol=1e-4)
    assert done["test_accuracy"] >= 0.9


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


def epoch_losses(run_dir: Path) -> dict[int, float]:
    return {r["epoch"]: r["loss"] for r in records(run_dir) if "epoch" in r}


def test_a_step_checkpoint_resumes_at_the_next_batch_bit_for_bit(tmp_path):
    """42 steps an epoch, a checkpoint every 25: step 50 is 8 steps into epoch 2. Resumed from it,
    the run ends with the uninterrupted run's weights, and epoch 2's loss (its first 8 steps' sum came
    back with the checkpoint) is the same number."""
    train_torch(tmp_path / "straight", epochs=3, lr_schedule="cosine")
    train_torch(
        tmp_path / "split", epochs=3, lr_schedule="cosine", checkpoint_every_steps=25, keep_checkpoints=9
    )
    steps = sorted(int(p.name) for p in (tmp_path / "split" / "checkpoints").iterdir() if p.name.isdigit())
    assert steps == [25, 42, 50, 75, 84, 100, 125, 126]
    interrupted_after(tmp_path / "split", 50)
    state = saved(tmp_path / "split")
    within = state["within"]
    assert (state["epoch"], state["step"], within["taken"], within["order"], within["world_size"]) == (
        1, 50, 8, "shards", 1,
    )  # fmt: skip
    resumed = train_torch(
        tmp_path / "split", resume=True, epochs=3, lr_schedule="cosine", checkpoint_every_steps=25
    )
    straight, split = parameters(tmp_path / "straight"), parameters(tmp_path / "split")
    assert all(torch.equal(straight[name], split[name]) for name in straight)
    assert resumed["steps"] == 126
    assert epoch_losses(tmp_path / "split") == epoch_losses(tmp_path / "straight")


def test_the_newest_k_checkpoints_are_kept_and_a_resume_takes_the_newest(tmp_path):
    per_epoch = 1347 // 32
    train_torch(tmp_path, epochs=4, keep_checkpoints=2)
    steps = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.is_dir())
    assert steps == [3 * per_epoch, 4 * per_epoch]
    assert checkpoint.latest(tmp_path).manifest.step == 4 * per_epoch
    resumed = train_torch(tmp_path, resume=True, epochs=5, keep_checkpoints=3)
    steps = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.is_dir())
    assert steps == [3 * per_epoch, 4 * per_epoch, 5 * per_epoch] and resumed["steps"] == 5 * per_epoch


def test_a_run_directory_of_the_older_layout_resumes_bit_for_bit(tmp_path):
    """run_dir/checkpoint.pt, as runs wrote it before step directories: read, then continued in them."""
    train_torch(tmp_path / "straight", epochs=4)
    train_torch(tmp_path / "old", epochs=2)
    state = saved(tmp_path / "old")
    torch.save(
        {key: state[key] for key in ("model", "optimizer", "epoch", "step")},
        tmp_path / "old" / "checkpoint.pt",
    )
    shutil.rmtree(tmp_path / "old" / "checkpoints")
    assert checkpoint.latest(tmp_path / "old", "torch").directory == tmp_path / "old"
    resumed = train_torch(tmp_path / "old", resume=True, epochs=4)
    straight, old = parameters(tmp_path / "straight"), parameters(tmp_path / "old")
    assert all(torch.equal(straight[name], old[name]) for name in straight)
    assert checkpoint.latest(tmp_path / "old").step == resumed["steps"]


def test_the_checkpointer_saves_model_optimizer_position_and_random_state(tmp_path):
    from hvdtrain.runtime.torch.task import make_optimizer

    task = digits_mlp_torch.build(digits_mlp_torch.Config())
    backend = torch_runtime.LocalTorch()
    optimizer = make_optimizer(task, task.model, 0.1)
    task.model(torch.zeros(2, 64)).sum().backward()
    optimizer.step()  # momentum buffers: state to save
    checkpointer = backend.checkpointer()
    checkpointer.save(tmp_path, task.model, optimizer, {"epoch": 3, "step": 126})
    expected = torch.rand(4)
    manifest = checkpoint.latest(tmp_path).manifest
    assert (manifest.step, manifest.epoch, manifest.world_size, manifest.framework) == (126, 3, 1, "torch")

    fresh = digits_mlp_torch.build(digits_mlp_torch.Config(seed=7))
    fresh_optimizer = make_optimizer(fresh, fresh.model, 0.1)
    assert checkpointer.load(tmp_path, fresh.model, fresh_optimizer, resume=False) is None
    assert checkpointer.load(tmp_path, fresh.model, fresh_optimizer, resume=True) == {"epoch": 3, "step": 126}
    assert torch.equal(torch.rand(4), expected), "the random stream continues where it was saved"
    for mine, theirs in zip(fresh.model.parameters(), task.model.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    momentum = [fresh_optimizer.state[p]["momentum_buffer"] for p in fresh.model.parameters()]
    assert all(
        torch.equal(a, optimizer.state[p]["momentum_buffer"])
        for a, p in zip(momentum, task.model.parameters(), strict=True)
    )


def test_the_backend_builds_the_optimizer_from_the_tasks_factory_and_groups(tmp_path):
    """Per-group options survive; every group follows the schedule's learning rate."""

    def build(config):
        task = digits_mlp_torch.build(config)
        first, second = task.model[0], task.model[2]
        task.optimizer = torch.optim.SGD
        task.param_groups = lambda model: [
            {"params": list(first.parameters()), "weight_decay": 0.01},
            {"params": list(second.parameters())},
        ]
        built.append(task)
        return task

    built: list = []
    config = digits_mlp_torch.Config(epochs=1, steps_per_epoch=4, lr=0.05)
    torch_runtime.run(build, config, torch_runtime.LocalTorch(), tmp_path, "digits-mlp-torch")
    groups = saved(tmp_path)["optimizer"]["param_groups"]
    assert [group["weight_decay"] for group in groups] == [0.01, 0]
    assert [group["lr"] for group in groups] == [0.05, 0.05]


def test_evaluation_reports_every_metric_of_the_task(tmp_path):
    def top2(outputs, targets):
        return float((outputs.topk(2, dim=1).indices == targets[:, None]).any(dim=1).sum())

    def build(config):
        task = digits_mlp_torch.build(config)
        task.metrics = {**task.metrics, "top2": top2}
        return task

    config = digits_mlp_torch.Config(epochs=2)
    done = torch_runtime.run(build, config, torch_runtime.LocalTorch(), tmp_path, "digits-mlp-torch")
    assert 0.9 <= done["test_accuracy"] < done["test_top2"] <= 1.0
    last = [r for r in records(tmp_path) if "epoch" in r][-1]
    assert (last["test_accuracy"], last["test_top2"]) == (done["test_accuracy"], done["test_top2"])


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


def test_torch_lr_decays_per_step_over_progress_and_a_resume_continues_it(tmp_path):
    """Cosine after warmup, every step's lr in metrics.jsonl, equal to the closed form; then step
    decay at a milestone inside an epoch, interrupted and resumed, bit for bit."""
    backend = torch_runtime.LocalTorch()
    backend.size = 2  # the 2-rank schedule: lr 0.05 scaled to 0.1
    config = digits_mlp_torch.Config(
        epochs=3,
        lr=0.05,
        warmup_epochs=1,
        steps_per_epoch=8,
        lr_schedule="cosine",
        min_lr=0.01,
        log_step_lr=True,
    )
    torch_runtime.run(digits_mlp_torch.build, config, backend, tmp_path / "cosine", "digits-mlp-torch")
    logged = [(r["step"], r["lr"]) for r in records(tmp_path / "cosine") if "step" in r]
    assert [step for step, _ in logged] == list(range(24))
    expected = [0.05 + 0.05 * s / 8 for s in range(8)]
    expected += [0.01 + 0.09 * (1 + math.cos(math.pi * (s - 8) / 16)) / 2 for s in range(8, 24)]
    assert [lr for _, lr in logged] == pytest.approx(expected)

    step_decay = {"lr_schedule": "step", "lr_milestones": (0.5, 1.25), "lr_gamma": 0.5, "log_step_lr": True}
    train_torch(tmp_path / "straight", epochs=3, **step_decay)
    train_torch(tmp_path / "split", epochs=1, **step_decay)
    train_torch(tmp_path / "split", resume=True, epochs=3, **step_decay)
    straight, split = parameters(tmp_path / "straight"), parameters(tmp_path / "split")
    for name in straight:
        assert torch.equal(straight[name], split[name]), name
    lrs = {r["step"]: r["lr"] for r in records(tmp_path / "split") if "step" in r}
    per_epoch = 1347 // 32
    assert lrs[per_epoch // 2 - 1] == pytest.approx(0.05) and lrs[per_epoch // 2 + 1] == pytest.approx(0.025)
    assert lrs[per_epoch + per_epoch // 4 + 1] == pytest.approx(0.0125) and lrs[3 * per_epoch - 1] == 0.0125


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_torch_mixed_precision_learns_and_fp16_resumes_with_its_loss_scale(tmp_path, precision):
    done = train_torch(tmp_path / "straight", epochs=4, precision=precision, clip_grad_norm=5.0)
    assert done["test_accuracy"] >= 0.9
    assert done["compute_dtype"] == {"bf16": "bfloat16", "fp16": "float16"}[precision], "autocast ran"
    if precision == "bf16":
        return
    scaler = saved(tmp_path / "straight")["scaler"]
    assert scaler["scale"] > 0 and scaler["_growth_tracker"] > 0, "the loss scale's state is checkpointed"
    train_torch(tmp_path / "split", epochs=2, precision=precision, clip_grad_norm=5.0)
    train_torch(tmp_path / "split", resume=True, epochs=4, precision=precision, clip_grad_norm=5.0)
    straight, split = parameters(tmp_path / "straight"), parameters(tmp_path / "split")
    for name in straight:
        assert torch.equal(straight[name], split[name]), name
    assert saved(tmp_path / "split")["scaler"] == scaler


def test_torch_clips_the_gradient_norm_and_logs_it(tmp_path):
    common = {"epochs": 1, "steps_per_epoch": 6, "momentum": 0.0}
    train_torch(tmp_path / "plain", **common)
    train_torch(tmp_path / "clipped", clip_grad_norm=0.05, **common)
    norm = [r for r in records(tmp_path / "clipped") if "epoch" in r][0]["grad_norm"]
    assert norm > 0.05, "the clip was active"
    assert "grad_norm" not in [r for r in records(tmp_path / "plain") if "epoch" in r][0]
    plain, clipped = parameters(tmp_path / "plain"), parameters(tmp_path / "clipped")
    torch.manual_seed(digits_mlp_torch.Config().seed)  # the init both runs started from
    start = digits_mlp_torch.build(digits_mlp_torch.Config(**common)).model.state_dict()
    for name in plain:  # each clipped step is shorter: the weights moved less far from the init
        assert (clipped[name] - start[name]).norm() < (plain[name] - start[name]).norm(), name


KERAS_INTERRUPTED = """
import shutil
from tests.support.helpers import interrupted_after  # run from the repository's root (ROOT)

def epoch_losses(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["epoch"]: r["loss"] for r in map(json.loads, lines) if "epoch" in r}
"""

KERAS_RUN = (
    """
import json, sys
from pathlib import Path
from hvdtrain.worker import import_framework
import_framework("tensorflow")  # as a rank imports it
import keras
import numpy as np
from hvdtrain.runtime import checkpoint, tensorflow as tf_runtime
from hvdtrain.recipes import digits_mlp_tf
"""
    + KERAS_INTERRUPTED
    + """
base = Path(sys.argv[1])

def train(loop, run_dir, resume=False, **changes):
    built = []

    def build(config):
        task = digits_mlp_tf.build(config)
        task.loop = loop
        built.append(task)
        return task

    backend = tf_runtime.LocalKeras()
    backend.size = 2  # the schedule of 2 ranks; this process trains shard 0
    config = digits_mlp_tf.Config(lr=0.05, **changes)
    done = tf_runtime.run(build, config, backend, run_dir, "digits-mlp-tf", resume)
    archive = checkpoint.latest(run_dir).path("checkpoint.keras")
    done["optimizer"] = built[0].model.optimizer
    return done, keras.models.load_model(archive, compile=False).get_weights()

def loss_scale(optimizer):
    return {"scale": float(optimizer.dynamic_scale.numpy()), "counter": int(optimizer.step_counter.numpy())}

keras.utils.set_random_seed(digits_mlp_tf.Config().seed)
start = digits_mlp_tf.build(digits_mlp_tf.Config()).model.get_weights()
for loop in ("fit", "custom"):  # one interpreter for both: TensorFlow's import is most of the time
    decay = {"lr_schedule": "step", "lr_milestones": (1.5,), "lr_gamma": 0.5, "log_step_lr": True,
             "keep_checkpoints": 2}
    scheduled, _ = train(loop, base / loop / "scheduled", epochs=2, warmup_epochs=1, steps_per_epoch=6,
                         **decay)
    short = {"epochs": 1, "steps_per_epoch": 4, "momentum": 0.0}
    _, plain = train(loop, base / loop / "plain", **short)
    _, clipped = train(loop, base / loop / "clipped", clip_grad_norm=0.05, **short)
    moved = [float(np.linalg.norm(w - s)) for w, s in zip(plain, start, strict=True)]
    moved_clipped = [float(np.linalg.norm(w - s)) for w, s in zip(clipped, start, strict=True)]
    # fp16, checkpoints every 4 steps of 6 an epoch: resumed from step 8, 2 steps into epoch 2
    fp16 = {"precision": "fp16", "epochs": 2, "steps_per_epoch": 6}
    whole_run, whole = train(loop, base / loop / "fp16", **fp16)
    train(loop, base / loop / "fp16-split", checkpoint_every_steps=4, keep_checkpoints=9, **fp16)
    kept = sorted(int(p.name) for p in (base / loop / "fp16-split" / "checkpoints").iterdir() if p.is_dir())
    interrupted_after(base / loop / "fp16-split", 8)
    split_run, split = train(loop, base / loop / "fp16-split", resume=True, **fp16)
    print(json.dumps({"loop": loop, "steps": scheduled["steps"], "moved": moved,
                      "moved_clipped": moved_clipped, "fp16_kept": kept,
                      "fp16_same": all(np.array_equal(a, b) for a, b in zip(whole, split, strict=True)),
                      "fp16_dtype": whole_run["compute_dtype"],
                      "scales": [loss_scale(whole_run["optimizer"]), loss_scale(split_run["optimizer"])],
                      "losses": [epoch_losses(base / loop / name) for name in ("fp16", "fp16-split")]}))
"""
)


def test_keras_loops_share_the_schedule_and_clip(tmp_path):
    """Its own interpreter: torch's TensorBoard writer hides TensorFlow from TensorBoard in this one.
    Warmup to the 2-rank lr, then step decay at a milestone inside the second epoch, every step
    logged; clipping shortens every step; and an fp16 run resumed from a step checkpoint within an
    epoch ends with the uninterrupted run's weights, loss scale and epoch losses."""
    pytest.importorskip("tensorflow")
    done = subprocess.run(
        [sys.executable, "-c", KERAS_RUN, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"loop"')]
    assert [line["loop"] for line in found] == ["fit", "custom"]
    for line in found:
        lrs = [r["lr"] for r in records(tmp_path / line["loop"] / "scheduled") if "step" in r]
        expected = [0.05 + 0.05 * step / 6 for step in range(6)] + [0.1] * 3 + [0.05] * 3
        assert lrs == pytest.approx(expected, rel=1e-6), line["loop"]
        assert line["steps"] == 12
        kept = tmp_path / line["loop"] / "scheduled" / "checkpoints"
        assert sorted(int(p.name) for p in kept.iterdir() if p.is_dir()) == [6, 12], "both epochs kept"
        assert all(c < p for c, p in zip(line["moved_clipped"], line["moved"], strict=True)), line
        assert line["fp16_kept"] == [4, 6, 8, 12] and line["fp16_dtype"] == "float16"
        assert line["fp16_same"] is True, line["loop"]
        whole, split = line["scales"]
        assert whole == split and whole["counter"] == 12, "the loss scale's state came back"
        whole, split = line["losses"]
        if line["loop"] == "custom":
            assert whole == split
        else:  # fit's own loss is a float32 running mean, resumed part way
            assert whole == pytest.approx(split, rel=1e-6)


@pytest.fixture(scope="module")
def png_digits(tmp_path_factory) -> Path:
    from hvdtrain.data import write_digits_images

    root = tmp_path_factory.mktemp("png-digits")
    write_digits_images(root)
    return root


def train_from_disk(run_dir: Path, root: Path, resume: bool = False, **changes) -> dict:
    from hvdtrain.recipes import image_folder_torch

    config = image_folder_torch.Config(**{"data_dir": str(root), "epochs": 3, "channels": 8, **changes})
    backend = torch_runtime.LocalTorch()
    return torch_runtime.run(image_folder_torch.build, config, backend, run_dir, "image-folder-torch", resume)


def test_a_dataset_on_disk_trains_through_dataloader_workers_and_resumes_bit_for_bit(tmp_path, png_digits):
    straight = train_from_disk(tmp_path / "straight", png_digits, epochs=4)
    assert straight["test_accuracy"] >= 0.8, "read from 1,797 PNG files by two worker processes"
    assert straight["steps"] == 4 * (1347 // 32)
    train_from_disk(tmp_path / "split", png_digits, epochs=2)
    train_from_disk(tmp_path / "split", png_digits, resume=True, epochs=4)
    whole, resumed = parameters(tmp_path / "straight"), parameters(tmp_path / "split")
    for name in whole:
        assert torch.equal(whole[name], resumed[name]), name


def test_a_step_checkpoint_of_a_dataset_on_disk_resumes_at_the_next_batch_bit_for_bit(tmp_path, png_digits):
    """The DataLoader's sampler starts at the batch after the checkpoint's; its workers read on."""
    train_from_disk(tmp_path / "straight", png_digits, epochs=2)
    train_from_disk(tmp_path / "split", png_digits, epochs=2, checkpoint_every_steps=30, keep_checkpoints=4)
    interrupted_after(tmp_path / "split", 60)  # 18 steps into epoch 2
    train_from_disk(tmp_path / "split", png_digits, resume=True, epochs=2)
    whole, resumed = parameters(tmp_path / "straight"), parameters(tmp_path / "split")
    assert all(torch.equal(whole[name], resumed[name]) for name in whole)
    assert epoch_losses(tmp_path / "split") == epoch_losses(tmp_path / "straight")


def test_a_damaged_image_names_its_file(tmp_path, png_digits):
    from hvdtrain.data import ImageFolder

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "bad.png").write_bytes(b"not a png")
    with pytest.raises(ValueError, match=r"bad\.png cannot be read as an image"):
        ImageFolder.scan(tmp_path)[0]
    with pytest.raises(ValueError, match="no image folder"):
        ImageFolder.scan(tmp_path / "missing")
    folder = ImageFolder.scan(png_digits / "train")
    image, label = folder[0]
    assert (tmp_path / "a" / "bad.png").unlink() is None
    with pytest.raises(ValueError, match=r"no image files in the class folders"):
        ImageFolder.scan(tmp_path)
    assert len(folder) == 1347 and folder.classes == tuple(str(k) for k in range(10))
    assert image.shape == (1, 8, 8) and image.dtype == np.float32 and 0 <= image.min() <= image.max() <= 1
    assert label == 0


def test_an_image_folder_reads_every_format_pillow_writes_and_the_lossless_ones_read_the_same(tmp_path):
    from hvdtrain.data import TF_IMAGE_SUFFIXES, ImageFolder, write_digits_images

    folders = {suffix: tmp_path / suffix[1:] for suffix in (".png", ".jpg", ".bmp", ".tiff", ".webp", ".gif")}
    for suffix, root in folders.items():
        assert write_digits_images(root, suffix=suffix) == {"train": 1347, "test": 450}
    read = {suffix: ImageFolder.scan(root / "train") for suffix, root in folders.items()}
    assert {len(folder) for folder in read.values()} == {1347}
    png = np.stack([read[".png"][i][0] for i in range(0, 1347, 97)])
    for suffix in (".bmp", ".tiff", ".gif"):
        assert np.array_equal(np.stack([read[suffix][i][0] for i in range(0, 1347, 97)]), png), suffix
    jpeg = np.stack([read[".jpg"][i][0] for i in range(0, 1347, 97)])
    assert jpeg.shape == png.shape and 0 < np.abs(jpeg - png).mean() < 0.05, "lossy, but the same digits"
    read[".jpg"].only(TF_IMAGE_SUFFIXES, "tf.io.decode_image")
    tiff = next((folders[".tiff"] / "train" / "4").iterdir())
    (folders[".png"] / "train" / "4" / "extra.tiff").write_bytes(tiff.read_bytes())
    with pytest.raises(ValueError, match=r"extra\.tiff: tf\.io\.decode_image decodes only"):
        ImageFolder.scan(folders[".png"] / "train").only(TF_IMAGE_SUFFIXES, "tf.io.decode_image")


def test_a_jpeg_folder_trains_through_dataloader_workers(tmp_path):
    from hvdtrain.data import write_digits_images

    write_digits_images(tmp_path / "jpegs", suffix=".jpg")
    done = train_from_disk(tmp_path / "run", tmp_path / "jpegs", epochs=4)
    assert done["test_accuracy"] >= 0.8


@pytest.mark.parametrize(("done", "size"), [(0, 2), (96, 2), (64, 3), (0, 1)])
def test_elastic_indices_follow_the_world_pass_by_pass(done, size):
    order, batch = np.random.default_rng(0).permutation(1000), 32
    for rank in range(size):
        expected, taken = [], done
        while taken + size * batch <= len(order):  # what the elastic loop takes, one pass at a time
            expected += list(order[taken + rank * batch :][:batch])
            taken += size * batch
        assert list(elastic_indices(order, done, rank, size, batch)) == expected


KERAS_FROM_DISK = (
    """
import json, sys
from pathlib import Path
from hvdtrain.worker import import_framework
import_framework("tensorflow")  # as a rank imports it
import numpy as np
from hvdtrain.recipes import image_folder_tf
from hvdtrain.runtime import checkpoint, tensorflow as tf_runtime
"""
    + KERAS_INTERRUPTED
    + """

root, base = sys.argv[1], Path(sys.argv[2])

def train(loop, run_dir, epochs, resume=False, **changes):
    def build(config):
        task = image_folder_tf.build(config)
        task.loop = loop
        return task

    backend = tf_runtime.LocalKeras()
    backend.size = 2  # the 2-rank schedule and shards; this process trains shard 0
    config = image_folder_tf.Config(data_dir=root, epochs=epochs, channels=8, **changes)
    done = tf_runtime.run(build, config, backend, run_dir, "image-folder-tf", resume)
    import keras
    archive = checkpoint.latest(run_dir).path("checkpoint.keras")
    return done, keras.models.load_model(archive, compile=False).get_weights()

for loop in ("fit", "custom"):  # one interpreter for both: TensorFlow's import is most of the time
    straight, whole = train(loop, base / loop / "straight", 2)
    train(loop, base / loop / "split", 2, checkpoint_every_steps=15, keep_checkpoints=9)
    found = {"loop": loop, "accuracy": straight["test_accuracy"], "steps": [], "same": [], "losses": []}
    for at in (21, 30):  # the end of epoch 1; 9 steps into epoch 2
        shutil.copytree(base / loop / "split", base / loop / f"from-{at}")
        interrupted_after(base / loop / f"from-{at}", at)
        resumed, split = train(loop, base / loop / f"from-{at}", 2, resume=True)
        found["steps"].append(resumed["steps"])
        found["same"].append(all(np.array_equal(a, b) for a, b in zip(whole, split, strict=True)))
        found["losses"].append([epoch_losses(base / loop / name) for name in ("straight", f"from-{at}")])
    print(json.dumps(found))
"""
)


def test_a_tf_data_pipeline_on_disk_trains_its_shard_and_resumes_bit_for_bit(tmp_path, png_digits):
    """Both Keras loops (fit, custom) read the PNG files through tf.data, and resume bit for bit at
    the next epoch's first batch and from a step checkpoint 9 steps into an epoch (the dataset
    passes over the batches taken before decoding them)."""
    pytest.importorskip("tensorflow")
    done = subprocess.run(
        [sys.executable, "-c", KERAS_FROM_DISK, str(png_digits), str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"loop"')]
    assert [result["loop"] for result in results] == ["fit", "custom"]
    for result in results:
        assert result["same"] == [True, True], f"{result['loop']}: resumed in the same order"
        assert result["steps"] == [2 * (1347 // 2 // 32)] * 2
        for whole, split in result["losses"]:
            if result["loop"] == "custom":
                assert whole == split
            else:  # fit's own loss is a float32 running mean, resumed part way
                assert whole == pytest.approx(split, rel=1e-6)
        assert result["accuracy"] >= 0.6, f"{result['loop']}: learns from its shard of the PNG files"


def test_where_forwards_are_collective_every_rank_evaluates_as_many_batches_as_the_busiest():
    """Under fsdp each forward gathers parameters from every rank: a rank with fewer test batches
    runs spare forwards until it has run as many as the rank with most (here, told it has 3 more)."""
    from hvdtrain.runtime.torch.training import evaluate

    class Sharded(torch_runtime.LocalTorch):
        forwards_are_collective = True

        def allgather_object(self, value):
            return [value, value + 3]

    task = digits_mlp_torch.build(digits_mlp_torch.Config())
    forwards = []
    task.model.register_forward_hook(lambda module, inputs, output: forwards.append(len(inputs[0])))
    scored = evaluate(task.model, task, Sharded())
    test_size = len(task.data.y_test)
    assert sum(forwards[:-3]) == test_size and len(forwards) == -(-test_size // 256) + 3, forwards
    assert scored == evaluate(task.model, task, torch_runtime.LocalTorch())  # the spares are not scored
