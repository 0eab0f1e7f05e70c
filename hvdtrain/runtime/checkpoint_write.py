"""Writing checkpoints in the layout of hvdtrain.runtime.checkpoint, on the rank side: a step
directory's files, then its manifest and the `latest` pointer, older steps pruned, the best one kept;
a write on a thread of its own; and what a write that fails (a full disk, a read-only folder) becomes:
one line naming the folder and the checkpoint that is still the latest, not a traceback. Kept apart
from finding and checking checkpoints, which the launching side does without any rank.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

from hvdtrain.runtime.checkpoint import (
    BEST,
    BEST_RECORD,
    LATEST,
    MANIFEST,
    Checkpoint,
    FileEntry,
    Manifest,
    checkpoints_dir,
    latest,
    read_manifest,
    step_dir,
    step_names,
)
from hvdtrain.runtime.common import atomic_write_bytes, commit_file, remove_stale_tmp_files, tmp_path_for


class WriteFailed(Exception):
    """A checkpoint that could not be written (ENOSPC, EIO, a read-only folder): the step directory
    it began is gone, and the previous checkpoint is the one `latest` names."""


class BackgroundWriter:
    """One checkpoint write at a time on a thread of its own (async_checkpoint): start() waits for
    the one in flight first; wait() joins it and raises what it raised (WriteFailed), so a failure
    in the background ends the run at the next checkpoint, stop or end, in one line as ever. The
    thread is a daemon: a rank that crashes is not kept alive by it, and its half-written step is
    no checkpoint (no manifest), so `latest` stays the previous one."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._failed: BaseException | None = None

    def start(self, write: Callable[[], None]) -> None:
        self.wait()

        def run() -> None:
            try:
                write()
            except BaseException as error:  # raised in the training thread by wait()
                self._failed = error

        self._thread = threading.Thread(target=run, name="hvdtrain-checkpoint", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._failed is not None:
            failed, self._failed = self._failed, None
            raise failed


@contextlib.contextmanager
def writing(run_dir: Path, step: int, remove: bool = True) -> Iterator[None]:
    """Around one rank's part of writing the checkpoint of `step`: an OSError becomes WriteFailed,
    which names the folder, the error and the checkpoint that is still the latest. A step directory
    without its manifest is removed (it is no checkpoint, and what it holds may be what filled the
    disk) where this write made it; one whose manifest was written is a whole checkpoint and stays.
    `remove` False: the ranks that write the step's files agree on a failure first, and the one that
    made the directory discards it once no rank writes into it any more."""
    directory = step_dir(run_dir, step)
    made_here = not directory.exists()  # an elastic world may save a step again that is on disk
    try:
        yield
    except OSError as error:
        if remove and made_here:
            discard(run_dir, step)
        where = error.filename or directory
        code = f" ({errno.errorcode[error.errno]})" if error.errno in errno.errorcode else ""
        kept = latest(run_dir)
        still = f"step {kept.manifest.step}" if kept and kept.manifest else "no checkpoint (none was written)"
        raise WriteFailed(
            f"cannot write the checkpoint of step {step} in {Path(where).parent}: "
            f"{error.strerror or error}{code}; the latest checkpoint is still {still}"
        ) from error


def discard(run_dir: Path, step: int) -> None:
    """The step directory of a checkpoint that was not completed, unless its manifest was written."""
    directory = step_dir(run_dir, step)
    if read_manifest(directory) is None:
        shutil.rmtree(directory, ignore_errors=True)


def begin(run_dir: Path, step: int, consolidated: bool = False) -> Path:
    """The step directory, made ready for its files: a manifest left there from an earlier attempt
    goes first, so the directory is incomplete until commit() writes the new one. Called by the one
    process that commits, before any rank writes."""
    directory = step_dir(run_dir, step, consolidated)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MANIFEST).unlink(missing_ok=True)
    remove_stale_tmp_files(directory)
    return directory


def write_file(directory: Path, name: str, save: Callable[[BinaryIO], None]) -> FileEntry:
    """One file of a step, written atomically; any rank may write its own. `save` writes it into the
    stream it is given (torch.save's archive, say, straight to the file: no copy of it in memory, and
    a background writer holds the GIL only between its writes, which, as the hashing, release it)."""
    path = directory / name
    tmp = tmp_path_for(path)
    hashing = None
    try:
        with tmp.open("wb") as stream:
            hashing = _Hashing(stream)
            save(hashing)
        commit_file(tmp, path)
    except BaseException as error:
        tmp.unlink(missing_ok=True)
        if hashing is not None and hashing.failed is not None and hashing.failed is not error:
            raise hashing.failed from error  # torch.save reports a failed write as its own error
        raise
    return FileEntry(hashing.size, hashing.sha.hexdigest())


class _Hashing:
    """A stream that hashes and counts what goes through it into the file."""

    def __init__(self, stream: BinaryIO) -> None:
        self.stream, self.sha, self.size = stream, hashlib.sha256(), 0
        self.failed: OSError | None = None
        """The first write that failed (ENOSPC, EIO)."""

    def write(self, data: Any) -> int:
        self.sha.update(data)
        self.size += memoryview(data).nbytes
        try:
            return self.stream.write(data)
        except OSError as error:
            self.failed = self.failed or error
            raise

    def flush(self) -> None:
        self.stream.flush()


def commit(
    run_dir: Path,
    step: int,
    epoch: int,
    world_size: int,
    framework: str,
    files: Mapping[str, FileEntry],
    extra: Mapping[str, Any] | None = None,
    keep: int | None = 1,
    consolidated: bool = False,
    pointer: bool = True,
) -> Checkpoint:
    """After every file of the step is on disk: the manifest, then the latest pointer (unless not
    `pointer`), then older step directories beyond the newest `keep` removed (None: none removed). A
    crash at any point leaves the previous checkpoint or this one complete, never neither."""
    manifest = Manifest(step, epoch, world_size, framework, dict(files), extra=dict(extra or {}))
    directory = step_dir(run_dir, step, consolidated)
    atomic_write_bytes(directory / MANIFEST, manifest.to_json())
    if pointer:
        atomic_write_bytes(checkpoints_dir(run_dir) / LATEST, f"{directory.name}\n".encode())
    if keep is not None:
        prune(run_dir, keep)
    return Checkpoint(directory, tuple(sorted(files)), manifest)


def write(
    run_dir: Path,
    step: int,
    epoch: int,
    world_size: int,
    framework: str,
    files: Mapping[str, Callable[[BinaryIO], None]],
    extra: Mapping[str, Any] | None = None,
    keep: int = 1,
) -> Checkpoint:
    """A whole checkpoint written by one process: begin, every file (write_file's save), commit."""
    directory = begin(run_dir, step)
    entries = {name: write_file(directory, name, save) for name, save in files.items()}
    return commit(run_dir, step, epoch, world_size, framework, entries, extra, keep)


def prune(run_dir: Path, keep: int) -> None:
    """Keep the newest `keep` complete step directories (and any newer incomplete one, which a writer
    may be filling); remove the rest."""
    complete = 0
    for name in step_names(run_dir):
        directory = checkpoints_dir(run_dir) / name
        if complete >= keep:
            shutil.rmtree(directory, ignore_errors=True)
        elif read_manifest(directory) is not None:
            complete += 1


def keep_best(run_dir: Path, step: int, record: Mapping[str, Any]) -> Path:
    """checkpoints/best: the complete step directory `step`, hard-linked (its files are only ever
    replaced whole, never changed in place), with best.json saying which metric made it best. The
    new one is made beside the old and renamed into place; pruning step directories leaves it."""
    root = checkpoints_dir(run_dir)
    best, new, old = root / BEST, root / f".{BEST}-new", root / f".{BEST}-old"
    for leftover in (new, old):
        shutil.rmtree(leftover, ignore_errors=True)
    shutil.copytree(step_dir(run_dir, step), new, copy_function=os.link)
    atomic_write_bytes(new / BEST_RECORD, (json.dumps(dict(record), indent=2) + "\n").encode())
    if best.exists():
        os.replace(best, old)
    os.replace(new, best)
    shutil.rmtree(old, ignore_errors=True)
    return best
