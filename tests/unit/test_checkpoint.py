"""The checkpoint layout (hvdtrain.runtime.checkpoint, written by checkpoint_write), without a
framework: step directories, the manifest written last, the latest pointer, what a resume check
finds, and the older layout."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from hvdtrain.runtime import checkpoint, checkpoint_write
from hvdtrain.runtime.common import TMP_MARK
from tests.support.helpers import saving


def write(
    run_dir: Path, step: int, files: dict[str, bytes] | None = None, **manifest
) -> checkpoint.Checkpoint:
    values = {"epoch": step // 10, "world_size": 2, "framework": "torch", **manifest}
    files = files or {"checkpoint.pt": b"state %d" % step}
    return checkpoint_write.write(
        run_dir, step, files={name: saving(data) for name, data in files.items()}, **values
    )


def test_a_step_directory_holds_its_files_a_manifest_and_the_latest_pointer(tmp_path):
    write(tmp_path, 40, {"rank-0.pt": b"zero", "rank-1.pt": b"one!"}, extra={"sharded": True})
    step = tmp_path / "checkpoints" / "40"
    assert sorted(p.name for p in step.iterdir()) == ["manifest.json", "rank-0.pt", "rank-1.pt"]
    assert (tmp_path / "checkpoints" / "latest").read_text() == "40\n"
    manifest = json.loads((step / "manifest.json").read_text())
    assert manifest == {
        "format_version": checkpoint.FORMAT_VERSION,
        "framework": "torch",
        "step": 40,
        "epoch": 4,
        "world_size": 2,
        "files": {
            "rank-0.pt": {"size": 4, "sha256": hashlib.sha256(b"zero").hexdigest()},
            "rank-1.pt": {"size": 4, "sha256": hashlib.sha256(b"one!").hexdigest()},
        },
        "extra": {"sharded": True},
    }
    found = checkpoint.latest(tmp_path)
    assert found.directory == step and found.files == ("rank-0.pt", "rank-1.pt") and found.step == 40
    assert checkpoint.check(found) == {"manifest.json": "ok", "rank-0.pt": "ok", "rank-1.pt": "ok"}
    files = checkpoint.inspect(tmp_path)
    assert files == {f"checkpoints/40/{name}": "ok" for name in ("manifest.json", "rank-0.pt", "rank-1.pt")}
    assert checkpoint.resume_problem(files, "torch") is None


def test_the_newest_checkpoint_is_latest_and_older_ones_are_pruned(tmp_path):
    for step in (10, 20, 30):
        write(tmp_path, step)
    assert checkpoint.latest(tmp_path).step == 30
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["30", "latest"]
    write(tmp_path, 40, keep=2)
    write(tmp_path, 50, keep=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["40", "50", "latest"]


def test_a_consolidated_copy_is_a_step_directory_of_its_own_that_latest_names_unless_a_newer_step_is_there(
    tmp_path,
):
    write(tmp_path, 10, {"optimizer.0.pt": b"a"}, extra={"sharded": "zero"})
    write(tmp_path, 20, {"optimizer.0.pt": b"b"}, extra={"sharded": "zero"}, keep=2)
    older = checkpoint.at(tmp_path, 10)
    copy = checkpoint_write.begin(tmp_path, 10, consolidated=True)
    entry = checkpoint_write.write_file(copy, "checkpoint.pt", saving(b"whole"))
    checkpoint_write.commit(
        tmp_path, 10, 1, 2, "torch", {"checkpoint.pt": entry}, keep=None, consolidated=True, pointer=False
    )
    assert older.manifest.extra == {"sharded": "zero"} and copy.name == "10-consolidated"
    assert checkpoint.latest(tmp_path).step == 20, "an older step's copy does not move latest back"
    assert checkpoint.step_names(tmp_path) == ["20", "10-consolidated", "10"]
    assert checkpoint.complete_steps(tmp_path) == [10, 20] and checkpoint.at(tmp_path, 30) is None
    copy = checkpoint_write.begin(tmp_path, 20, consolidated=True)
    entry = checkpoint_write.write_file(copy, "checkpoint.pt", saving(b"whole"))
    checkpoint_write.commit(
        tmp_path, 20, 2, 2, "torch", {"checkpoint.pt": entry}, keep=None, consolidated=True
    )
    found = checkpoint.latest(tmp_path)
    assert found.directory == copy and found.files == ("checkpoint.pt",) and found.manifest.extra == {}
    assert checkpoint.inspect(tmp_path) == {
        "checkpoints/20-consolidated/manifest.json": "ok",
        "checkpoints/20-consolidated/checkpoint.pt": "ok",
    }
    write(tmp_path, 30, keep=2)  # the newest two complete directories stay, a copy counting as one
    assert checkpoint.step_names(tmp_path) == ["30", "20-consolidated"]


@pytest.mark.parametrize(
    ("damage", "status"),
    [
        (lambda path: path.unlink(), "missing"),
        (lambda path: path.write_bytes(b"state 2X"), "corrupt (its sha256 differs from the manifest's)"),
        (lambda path: path.write_bytes(b"state"), "corrupt (5 bytes, the manifest says 8)"),
    ],
)
def test_a_damaged_file_is_named_with_what_is_wrong(tmp_path, damage, status):
    write(tmp_path, 20)
    damage(tmp_path / "checkpoints" / "20" / "checkpoint.pt")
    files = checkpoint.inspect(tmp_path)
    assert files["checkpoints/20/checkpoint.pt"] == status
    assert checkpoint.resume_problem(files, "torch") == ("checkpoints/20/checkpoint.pt", status)


def test_a_half_written_step_is_not_latest(tmp_path):
    """A writer killed after its files but before the manifest (or in the middle of a file, leaving
    only its temporary name): the previous checkpoint stays the one a resume loads."""
    write(tmp_path, 10)
    directory = checkpoint_write.begin(tmp_path, 20)
    checkpoint_write.write_file(directory, "checkpoint.pt", saving(b"state 20"))
    (directory / f"{TMP_MARK}123-rank-1.pt").write_bytes(b"torn")
    assert checkpoint.latest(tmp_path).step == 10
    (tmp_path / "checkpoints" / "latest").unlink()  # and without the pointer: the newest complete one
    assert checkpoint.latest(tmp_path).step == 10
    assert checkpoint.resume_problem(checkpoint.inspect(tmp_path), "torch") is None
    write(tmp_path, 20)  # written again: the stale temporary file is gone, the step complete
    assert sorted(p.name for p in directory.iterdir()) == ["checkpoint.pt", "manifest.json"]
    assert checkpoint.latest(tmp_path).step == 20


def test_a_step_written_again_is_incomplete_until_its_new_manifest(tmp_path):
    write(tmp_path, 10)
    checkpoint_write.begin(tmp_path, 10)  # e.g. an elastic reset that repeats the end of an epoch
    files = checkpoint.inspect(tmp_path)
    assert files == {"checkpoints/10/manifest.json": "missing"}
    assert checkpoint.resume_problem(files, "torch") == ("checkpoints/10/manifest.json", "missing")


def test_a_manifest_of_another_format_or_torn_is_refused(tmp_path):
    write(tmp_path, 10)
    manifest = tmp_path / "checkpoints" / "10" / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "format_version": 99}))
    assert checkpoint.latest(tmp_path).manifest is None
    reads = checkpoint.FORMAT_VERSION
    assert checkpoint.inspect(tmp_path) == {
        "checkpoints/10/manifest.json": f"corrupt (format version 99; this hvdtrain reads {reads})"
    }
    manifest.write_text('{"format_version": 1, "files": {')
    assert checkpoint.inspect(tmp_path)["checkpoints/10/manifest.json"].startswith(
        "corrupt (not a checkpoint manifest"
    )


def test_a_run_directory_of_the_older_layout_is_still_found_and_checked(tmp_path):
    with zipfile.ZipFile(tmp_path / "checkpoint.pt", "w") as archive:
        archive.writestr("data.pkl", b"weights")
    found = checkpoint.latest(tmp_path, "torch")
    assert found.directory == tmp_path and found.files == ("checkpoint.pt",) and found.manifest is None
    assert checkpoint.latest(tmp_path, "tensorflow") is None
    files = checkpoint.inspect(tmp_path)
    assert files == {"checkpoint.pt": "ok", "checkpoint.keras": "missing"}
    assert checkpoint.resume_problem(files, "torch") is None
    assert checkpoint.resume_problem(files, "tensorflow") == ("checkpoint.keras", "missing")
    (tmp_path / "checkpoint.pt").write_bytes(b"torn write")
    assert checkpoint.resume_problem(checkpoint.inspect(tmp_path), "torch") == (
        "checkpoint.pt",
        "corrupt (not a readable checkpoint)",
    )
    write(tmp_path, 30)  # once the run writes step directories, they are what resumes
    assert checkpoint.latest(tmp_path, "torch").step == 30


def test_nothing_to_resume_reads_as_the_missing_file_of_the_framework(tmp_path):
    files = checkpoint.inspect(tmp_path / "never-ran")
    assert checkpoint.resume_problem(files, "torch") == ("checkpoint.pt", "missing")
    assert checkpoint.latest(tmp_path / "never-ran") is None
