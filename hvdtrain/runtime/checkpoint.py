"""The checkpoint layout of a run directory, for every framework and strategy; imports neither.

    run_dir/checkpoints/<step>/     one or more files (one per rank, once state is sharded)
    run_dir/checkpoints/<step>/manifest.json   written last: each file's size and sha256, the step,
                                               epoch, world size, framework and format version
    run_dir/checkpoints/<step>-consolidated/   a sharded step's state in one file, written after the
                                               run (`hvdtrain checkpoint consolidate`)
    run_dir/checkpoints/latest      the name of the newest complete step directory
    run_dir/checkpoints/best/       with a monitored metric: the step directory of its best epoch
                                    (hard links) and best.json; never what a resume loads

Every file is written atomically (write, fsync, rename). A step directory without its manifest was
being written when its writer stopped: it is not a checkpoint, and `latest` never names it, because
the pointer is replaced only after the manifest. Resume checks and restarts read the manifest here,
before any rank starts, without a framework. Run directories of the older layout (one file,
run_dir/checkpoint.pt or run_dir/checkpoint.keras) still resume: where there is no step directory,
the reader falls back to that file.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import threading
import zipfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hvdtrain.runtime.common import atomic_write_bytes, remove_stale_tmp_files

FORMAT_VERSION = 1
CHECKPOINTS = "checkpoints"
LATEST = "latest"
MANIFEST = "manifest.json"
SHARDED = "sharded"
"""The manifest's extra key of a checkpoint a file a rank; its value names the strategy that reads it."""
CONSOLIDATED = "-consolidated"
STEP_DIR = re.compile(rf"(\d+)({CONSOLIDATED})?")
"""A step directory's name: the step, and whether it is a sharded step's consolidated copy."""
LEGACY_FILES = {"torch": "checkpoint.pt", "tensorflow": "checkpoint.keras"}
"""The one file per framework that rank 0 wrote into the run directory itself, before step directories."""
UNREADABLE = "corrupt (not a readable checkpoint)"
WRITE_FAILED = "hvdtrain: checkpoint:"
"""How a rank's line about a checkpoint it could not write begins; the launching hvdtrain shows that
line as the job's failure."""
EXIT_WRITE_FAILED = 5


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
def writing(run_dir: Path, step: int) -> Iterator[None]:
    """Around one rank's part of writing the checkpoint of `step`: an OSError becomes WriteFailed,
    which names the folder, the error and the checkpoint that is still the latest. A step directory
    without its manifest is removed (it is no checkpoint, and what it holds may be what filled the
    disk) where this write made it; one whose manifest was written is a whole checkpoint and stays."""
    directory = step_dir(run_dir, step)
    made_here = not directory.exists()  # an elastic world may save a step again that is on disk
    try:
        yield
    except OSError as error:
        if made_here and read_manifest(directory) is None:
            shutil.rmtree(directory, ignore_errors=True)
        where = error.filename or directory
        code = f" ({errno.errorcode[error.errno]})" if error.errno in errno.errorcode else ""
        kept = latest(run_dir)
        still = f"step {kept.manifest.step}" if kept and kept.manifest else "no checkpoint (none was written)"
        raise WriteFailed(
            f"cannot write the checkpoint of step {step} in {Path(where).parent}: "
            f"{error.strerror or error}{code}; the latest checkpoint is still {still}"
        ) from error


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    step: int
    """Optimizer steps taken when the checkpoint was written."""
    epoch: int
    """Epochs finished."""
    world_size: int
    framework: str
    files: dict[str, FileEntry]
    format_version: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)
    """What a checkpointer adds (e.g. how its state is sharded), kept as written."""

    def to_json(self) -> bytes:
        value = {
            "format_version": self.format_version,
            "framework": self.framework,
            "step": self.step,
            "epoch": self.epoch,
            "world_size": self.world_size,
            "files": {name: {"size": e.size, "sha256": e.sha256} for name, e in sorted(self.files.items())},
            **({"extra": self.extra} if self.extra else {}),
        }
        return (json.dumps(value, indent=2) + "\n").encode()

    @classmethod
    def from_json(cls, text: bytes | str) -> Manifest:
        """Raises ValueError for anything but a manifest of a format this version reads."""
        try:
            value = json.loads(text)
            if (version := value["format_version"]) != FORMAT_VERSION:
                raise ValueError(f"format version {version}; this hvdtrain reads {FORMAT_VERSION}")
            files = {name: FileEntry(int(e["size"]), str(e["sha256"])) for name, e in value["files"].items()}
            return cls(
                step=int(value["step"]),
                epoch=int(value["epoch"]),
                world_size=int(value["world_size"]),
                framework=str(value["framework"]),
                files=files,
                extra=dict(value.get("extra", {})),
            )
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as error:
            raise ValueError(f"not a checkpoint manifest ({type(error).__name__}: {error})") from None


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint found in a run directory: a step directory with its manifest, or the one file of
    the older layout (manifest None)."""

    directory: Path
    files: tuple[str, ...]
    manifest: Manifest | None = None

    def path(self, name: str) -> Path:
        return self.directory / name

    @property
    def step(self) -> int | None:
        return self.manifest.step if self.manifest else None

    @property
    def sharded_by(self) -> str | None:
        """The strategy whose ranks each wrote a file of it, and which alone resumes it; None where
        it is whole."""
        return self.manifest.extra.get(SHARDED) if self.manifest else None


def checkpoints_dir(run_dir: Path) -> Path:
    return run_dir / CHECKPOINTS


def step_dir(run_dir: Path, step: int, consolidated: bool = False) -> Path:
    return checkpoints_dir(run_dir) / f"{step}{CONSOLIDATED if consolidated else ''}"


def file_entry(path: Path) -> FileEntry:
    """Size and digest of a file as it is on disk (read in blocks: shards can be large)."""
    sha = hashlib.sha256()
    with path.open("rb") as stream:
        while block := stream.read(1 << 20):
            sha.update(block)
    return FileEntry(path.stat().st_size, sha.hexdigest())


def begin(run_dir: Path, step: int, consolidated: bool = False) -> Path:
    """The step directory, made ready for its files: a manifest left there from an earlier attempt
    goes first, so the directory is incomplete until commit() writes the new one. Called by the one
    process that commits, before any rank writes."""
    directory = step_dir(run_dir, step, consolidated)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MANIFEST).unlink(missing_ok=True)
    remove_stale_tmp_files(directory)
    return directory


def write_file(directory: Path, name: str, data: bytes) -> FileEntry:
    """One file of a step, written atomically; any rank may write its own."""
    atomic_write_bytes(directory / name, data)
    return FileEntry(len(data), hashlib.sha256(data).hexdigest())


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
    files: Mapping[str, bytes],
    extra: Mapping[str, Any] | None = None,
    keep: int = 1,
) -> Checkpoint:
    """A whole checkpoint written by one process: begin, every file, commit."""
    directory = begin(run_dir, step)
    entries = {name: write_file(directory, name, data) for name, data in files.items()}
    return commit(run_dir, step, epoch, world_size, framework, entries, extra, keep)


def _order(name: str) -> tuple[int, bool]:
    found = STEP_DIR.fullmatch(name)
    assert found is not None, name
    return int(found[1]), bool(found[2])


def step_names(run_dir: Path) -> list[str]:
    """The names of the step directories there are, complete or not, newest first (a consolidated
    copy before its step)."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    names = [p.name for p in root.iterdir() if p.is_dir() and STEP_DIR.fullmatch(p.name)]
    return sorted(names, key=_order, reverse=True)


def step_of(name: str) -> int:
    """The step of a step directory's name."""
    return _order(name)[0]


def complete_steps(run_dir: Path) -> list[int]:
    """The steps of the complete step directories, oldest first, once each."""
    root = checkpoints_dir(run_dir)
    return sorted({step_of(name) for name in step_names(run_dir) if read_manifest(root / name)})


def at(run_dir: Path, step: int) -> Checkpoint | None:
    """The step directory of `step` itself (not a consolidated copy) where its manifest reads."""
    directory = step_dir(run_dir, step)
    manifest = read_manifest(directory)
    return None if manifest is None else Checkpoint(directory, tuple(sorted(manifest.files)), manifest)


def read_manifest(directory: Path) -> Manifest | None:
    try:
        return Manifest.from_json((directory / MANIFEST).read_bytes())
    except (OSError, ValueError):
        return None


def _pointed(run_dir: Path) -> str | None:
    """The step directory `latest` names."""
    try:
        text = (checkpoints_dir(run_dir) / LATEST).read_text().strip()
    except OSError:
        return None
    return text if STEP_DIR.fullmatch(text) else None


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


def latest(run_dir: Path, framework: str | None = None) -> Checkpoint | None:
    """What a resume loads: the step directory `latest` names, else the newest one with a manifest (a
    crash between a manifest and the pointer, or a step being written again), else the older layout's
    file of `framework` (either framework's when None), else None. Where only an incomplete directory
    is named, it is returned without files, so that check() refuses it by its manifest. Finding is not
    checking: see check()."""
    pointed = _pointed(run_dir)
    candidates = ([pointed] if pointed is not None else []) + step_names(run_dir)
    for name in candidates:
        directory = checkpoints_dir(run_dir) / name
        if (manifest := read_manifest(directory)) is not None:
            return Checkpoint(directory, tuple(sorted(manifest.files)), manifest)
    if pointed is not None:
        return Checkpoint(checkpoints_dir(run_dir) / pointed, ())
    for name in [LEGACY_FILES[framework]] if framework else LEGACY_FILES.values():
        if (run_dir / name).is_file():
            return Checkpoint(run_dir, (name,))
    return None


def _check_zip(path: Path) -> str:
    """The older layout's check: torch and Keras checkpoints are zip files."""
    if not path.is_file():
        return "missing"
    try:
        if not zipfile.is_zipfile(path):
            return UNREADABLE
        with zipfile.ZipFile(path) as archive:
            if archive.testzip() is not None:
                return UNREADABLE
    except (OSError, ValueError, zipfile.BadZipFile) as error:
        return f"corrupt ({error})"
    return "ok"


def _check_entry(path: Path, entry: FileEntry) -> str:
    if not path.is_file():
        return "missing"
    try:
        found = file_entry(path)
    except OSError as error:
        return f"corrupt ({error})"
    if found.size != entry.size:
        return f"corrupt ({found.size} bytes, the manifest says {entry.size})"
    if found.sha256 != entry.sha256:
        return "corrupt (its sha256 differs from the manifest's)"
    return "ok"


def check(checkpoint: Checkpoint) -> dict[str, str]:
    """Each file of a checkpoint -> "ok", "missing" or "corrupt (why)", by name within its directory.
    A step directory is checked against its manifest (presence, size, digest), which is itself one of
    the files; an older layout's file by reading it as a zip archive."""
    if checkpoint.manifest is None and not checkpoint.files:  # the pointer names it; no manifest reads
        manifest_path = checkpoint.path(MANIFEST)
        try:
            Manifest.from_json(manifest_path.read_bytes())
        except FileNotFoundError:
            return {MANIFEST: "missing"}
        except (OSError, ValueError) as error:
            return {MANIFEST: f"corrupt ({error})"}
        return {MANIFEST: "corrupt (it changed while it was read)"}
    if checkpoint.manifest is None:
        return {name: _check_zip(checkpoint.path(name)) for name in checkpoint.files}
    statuses = {MANIFEST: "ok"}
    for name, entry in sorted(checkpoint.manifest.files.items()):
        statuses[name] = _check_entry(checkpoint.path(name), entry)
    return statuses


def inspect(run_dir: Path, step: int | None = None) -> dict[str, str]:
    """What --resume would load from a run directory (the checkpoint of `step`, else the latest),
    checked before any rank starts: each file, relative to run_dir -> "ok", "missing" or "corrupt
    (why)". Without any checkpoint, the older layout's files of both frameworks, "missing" (which
    one a recipe needs: resume_problem)."""
    if step is not None:
        found = at(run_dir, step)
        if found is None:
            return {f"{CHECKPOINTS}/{step}/{MANIFEST}": "missing"}
        return {f"{CHECKPOINTS}/{step}/{name}": status for name, status in check(found).items()}
    found = latest(run_dir)
    if found is None or (found.manifest is None and found.directory == run_dir):
        return {name: _check_zip(run_dir / name) for name in LEGACY_FILES.values()}
    prefix = found.directory.relative_to(run_dir).as_posix()
    return {f"{prefix}/{name}": status for name, status in check(found).items()}


def newest_intact(run_dir: Path, below: int | None = None) -> int | None:
    """The newest step (below `below`, where given) whose checkpoint passes its manifest."""
    for step in reversed(complete_steps(run_dir)):
        found = at(run_dir, step)
        if (below is None or step < below) and found and all(s == "ok" for s in check(found).values()):
            return step
    return None


def point_latest(run_dir: Path, step: int) -> None:
    """`latest` names this step's checkpoint: what every rank's checkpointer then loads."""
    atomic_write_bytes(checkpoints_dir(run_dir) / LATEST, f"{step_dir(run_dir, step).name}\n".encode())


def resume_problem(files: Mapping[str, str], framework: str) -> tuple[str, str] | None:
    """The first file (relative to the run directory) that stops a resume, with its status, from what
    inspect() found; None where the run can resume."""
    if any(name.startswith(f"{CHECKPOINTS}/") for name in files):
        return next(((name, status) for name, status in files.items() if status != "ok"), None)
    name = LEGACY_FILES[framework]
    status = files.get(name, "missing")
    return None if status == "ok" else (name, status)


BEST = "best"
BEST_RECORD = "best.json"


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
