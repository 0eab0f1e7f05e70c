"""Checkpoints written in the background (async_checkpoint): the same bytes as written as the step
waits, a resume from them bit for bit, and a failed background write that leaves the previous
checkpoint the latest and ends the run at its next checkpoint."""

from __future__ import annotations

import errno
import hashlib
import io
import shutil
from functools import partial
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from hvdtrain.recipes import digits_mlp_torch  # noqa: E402
from hvdtrain.runtime import checkpoint, checkpoint_write  # noqa: E402
from hvdtrain.runtime import torch as torch_runtime  # noqa: E402
from hvdtrain.runtime.torch.checkpointer import host_copy  # noqa: E402
from tests.support.helpers import saving  # noqa: E402


def to_bytes(state: dict) -> bytes:
    """torch.save's archive made in memory."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def train(run_dir: Path, resume: bool = False, **changes) -> dict:
    config = digits_mlp_torch.Config(
        **{"epochs": 3, "checkpoint_every_steps": 25, "keep_checkpoints": 9, **changes}
    )
    backend = torch_runtime.LocalTorch()
    return torch_runtime.run(digits_mlp_torch.build, config, backend, run_dir, "digits-mlp-torch", resume)


def files(run_dir: Path) -> dict[str, bytes]:
    root = run_dir / "checkpoints"
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_background_checkpoints_are_the_same_bytes_and_resume_bit_for_bit(tmp_path):
    train(tmp_path / "sync", monitor="test_accuracy")
    train(tmp_path / "async", monitor="test_accuracy", async_checkpoint=True)
    assert files(tmp_path / "async") == files(tmp_path / "sync")  # best/ included
    assert len(checkpoint.complete_steps(tmp_path / "async")) == 8

    interrupted = tmp_path / "async"  # as if it had stopped after step 50
    for later in (step for step in checkpoint.complete_steps(interrupted) if step > 50):
        shutil.rmtree(checkpoint.step_dir(interrupted, later))
    checkpoint.point_latest(interrupted, 50)
    (interrupted / "summary.json").unlink()
    train(interrupted, resume=True, async_checkpoint=True)
    ours = torch.load(checkpoint.latest(interrupted).path("checkpoint.pt"), weights_only=True)["model"]
    theirs = torch.load(checkpoint.latest(tmp_path / "sync").path("checkpoint.pt"), weights_only=True)[
        "model"
    ]
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)


def test_a_copy_keeps_tied_tensors_tied_and_the_file_byte_identical():
    weight = torch.randn(4, 3)
    betas = (0.9, 0.99)  # shared by two groups, as an optimizer's param groups share them
    state = {
        "a": weight,
        "b": weight.detach(),
        "view": weight[1:],
        "groups": [{"betas": betas}, {"betas": betas}],
    }
    copied = host_copy(state)
    assert to_bytes(copied) == to_bytes(state)
    weight.add_(1.0)  # training goes on: the copy does not change
    assert not torch.equal(copied["a"], weight)
    assert copied["a"].data_ptr() == copied["b"].data_ptr()


def test_a_failed_background_write_keeps_the_previous_checkpoint_and_raises_at_the_next_wait(tmp_path):
    checkpoint_write.write(tmp_path, 10, 1, 1, "torch", {"checkpoint.pt": saving(b"ten")})
    writer = checkpoint_write.BackgroundWriter()

    def fails_half_way() -> None:
        with checkpoint_write.writing(tmp_path, 20):
            directory = checkpoint_write.begin(tmp_path, 20)
            checkpoint_write.write_file(directory, "checkpoint.pt", saving(b"half"))
            raise OSError(errno.ENOSPC, "No space left on device", str(directory / "checkpoint.pt"))

    writer.start(fails_half_way)
    with pytest.raises(
        checkpoint_write.WriteFailed, match=r"step 20 .*\(ENOSPC\); the latest checkpoint is still step 10"
    ):
        writer.wait()
    assert checkpoint.step_names(tmp_path) == ["10"] and checkpoint.latest(tmp_path).manifest.step == 10
    writer.wait()  # reported once


def test_a_failed_rewrite_of_a_step_on_disk_leaves_its_directory(tmp_path):
    """An elastic world that went back to a commit saves a step again: a failure then removes
    nothing it did not make."""
    checkpoint_write.write(tmp_path, 10, 1, 1, "torch", {"checkpoint.pt": saving(b"ten")})
    with pytest.raises(checkpoint_write.WriteFailed), checkpoint_write.writing(tmp_path, 10):
        checkpoint_write.begin(tmp_path, 10)
        raise OSError(errno.ENOSPC, "No space left on device")
    assert (checkpoint.step_dir(tmp_path, 10) / "checkpoint.pt").read_bytes() == b"ten"


def test_an_archive_streamed_to_its_file_is_the_bytes_torch_save_makes_in_memory(tmp_path):
    """Checkpoints stream torch.save's archive into the file (no copy of it in memory): the same
    bytes as before, hashed as written; a write that fails part way leaves no temporary file."""
    model = torch.nn.Linear(64, 32)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 3}
    entry = checkpoint_write.write_file(tmp_path, "checkpoint.pt", partial(torch.save, state))
    expected = to_bytes(state)
    assert (tmp_path / "checkpoint.pt").read_bytes() == expected
    assert entry == checkpoint.FileEntry(len(expected), hashlib.sha256(expected).hexdigest())

    def fails_part_way(stream) -> None:
        stream.write(b"part")
        raise OSError(errno.EIO, "Input/output error")

    with pytest.raises(OSError, match="Input/output error"):
        checkpoint_write.write_file(tmp_path, "other.pt", fails_part_way)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["checkpoint.pt"]
